// expect: write the policies in the order Trainer<Strategy, Precision, Accelerator, Callbacks...>, as Trainer<volt::SingleDevice
#include <volt/volt.hpp>
int main() { volt::Trainer<volt::Fp32, volt::SingleDevice, volt::CPU> trainer; }
