// expect: give the precision an agree_found_inf\(optimizer, max_over_ranks\)
#include <volt/volt.hpp>
// A precision of one's own that scales the loss (its step may be skipped for an inf) but keeps PrecisionDefaults'
// agree_found_inf: under ZeRO each rank would check only its own shard of the gradients.
struct MyScaled : volt::PrecisionDefaults {
  static constexpr const char* name = "MyScaled";
  static constexpr bool scales_loss = true;
};
int main() { volt::Trainer<volt::ZeRO<2, volt::Script, volt::Mpi>, MyScaled, volt::CPU> trainer; }
