// expect: use Bf16Mixed or Fp32 on the CPU, or the GPU accelerator for Fp16Mixed: .*float16
#include <volt/volt.hpp>
int main() { volt::Trainer<volt::SingleDevice, volt::Fp16Mixed, volt::CPU> trainer; }
