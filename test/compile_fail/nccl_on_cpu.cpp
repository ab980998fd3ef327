// expect: use volt::Mpi .*Nccl\) reduces CUDA tensors only, and the accelerator is CPU
#include <volt/volt.hpp>
int main() { volt::Trainer<volt::DDP<volt::Script, volt::Nccl>, volt::Fp32, volt::CPU> trainer({.devices = 2}); }
