// expect: build the Trainer with volt::make_trainer<Strategy, Precision, Accelerator>.options, callbacks...., which puts
#include <volt/volt.hpp>
int main() { volt::Trainer<volt::SingleDevice, volt::Fp32, volt::CPU> trainer({.max_epochs = 5}, volt::ProgressBar{}); }
