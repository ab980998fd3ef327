// expect: float16 autocast.*for Fp16Mixed use the GPU accelerator
#include <volt/volt.hpp>
int main() { volt::Trainer<volt::SingleDevice, volt::Fp16Mixed, volt::CPU> trainer; }
