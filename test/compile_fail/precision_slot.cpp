// expect: give a precision as the second Trainer argument
#include <volt/volt.hpp>
int main() { volt::Trainer<volt::SingleDevice, int, volt::CPU> trainer; }
