// expect: give EarlyStopping the metric to watch, as EarlyStopping
#include <volt/volt.hpp>
int main() { auto trainer = volt::make_trainer({.max_epochs = 5}, volt::EarlyStopping{}); }
