// expect: give DDP<...>/ManualParallel<...> a launcher as its first argument
#include <volt/volt.hpp>
int main() { volt::Trainer<volt::DDP<volt::Mpi>, volt::Fp32, volt::CPU> trainer({.devices = 2}); }
