// expect: first Trainer argument must be a strategy
#include <volt/volt.hpp>
int main() { volt::Trainer<volt::Fp32, volt::SingleDevice, volt::CPU> trainer; }
