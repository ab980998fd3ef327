// expect: or train on volt::CPU: this accelerator's graphs are not compiled in .*runs neither CUDA graphs nor the GPU
// Graphed<GPU> where CUDA is not compiled in: a graph type that says so, so that the rule is reached on every line.
#include <volt/volt.hpp>
struct MissingGraph {
  static constexpr bool available = false;
};
struct GpuWithoutCuda : volt::GPU { using graph_type = MissingGraph; };
int main() { volt::Trainer<volt::SingleDevice, volt::Bf16, volt::Graphed<GpuWithoutCuda>> trainer; }
