// expect: second Trainer argument must be a precision
#include <volt/volt.hpp>
int main() { volt::Trainer<volt::SingleDevice, int, volt::CPU> trainer; }
