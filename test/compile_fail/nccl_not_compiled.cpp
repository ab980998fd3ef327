// expect: link the volt::nccl CMake target .*not compiled in
// Built without volt::nccl: the GPU picks Nccl, which is missing.
#include <volt/volt.hpp>
int main() { volt::Trainer<volt::DDP<volt::Spawn>, volt::Bf16Mixed, volt::GPU> trainer({.devices = 1}); }
