// expect: give an accelerator as the third Trainer argument
#include <volt/volt.hpp>
int main() { volt::Trainer<volt::SingleDevice, volt::Fp32, volt::Bf16Mixed> trainer; }
