// expect: first argument of DDP<...>/ManualParallel<...> must be a launcher
#include <volt/volt.hpp>
int main() { volt::Trainer<volt::DDP<volt::Mpi>, volt::Fp32, volt::CPU> trainer({.devices = 2}); }
