// expect: third Trainer argument must be an accelerator
#include <volt/volt.hpp>
int main() { volt::Trainer<volt::SingleDevice, volt::Fp32, volt::Bf16Mixed> trainer; }
