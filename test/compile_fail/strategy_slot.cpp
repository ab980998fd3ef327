// expect: give a strategy as the first Trainer argument
#include <volt/volt.hpp>
int main() { volt::Trainer<int, volt::Fp32, volt::CPU> trainer; }
