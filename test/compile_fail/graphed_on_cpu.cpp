// expect: use Graphed<volt::GPU>, or the CPU without Graphed: graph mode captures steps in CUDA graphs
#include <volt/volt.hpp>
int main() { volt::Trainer<volt::SingleDevice, volt::Bf16, volt::Graphed<volt::CPU>> trainer; }
