// expect: a layout declares volt::role::gathers_units in its volt_roles and lacks one of the role's members
// A layout whose holder declares that it gathers units (strategies/layout.hpp) and misspells one of the role's
// members: found by a probe, the misspelt member would compile and the host would fall back to its default.
#include <volt/volt.hpp>
template <class B>
struct GatheringHolder : volt::Replicated::Holder<B> {
  void begin_forward(volt::Stage) {}
  template <class G>
  void end_forward(G&, bool) {}
  volt::detail::UnitRuntime* units() const { return nullptr; }
  template <class G>
  void finsh_fit(G&) {}  // misspelt: finish_fit
  template <class G>
  c10::Dict<std::string, at::Tensor> module_state(G&, const torch::nn::Module& m, bool on_device) {
    return volt::checkpoint::module_state(m, on_device);
  }
  template <class G>
  void load_module_state(G&, torch::nn::Module& m, const volt::checkpoint::Dict& state) {
    volt::checkpoint::load_module_state(m, state);
  }
  template <class G>
  at::Tensor window_gradient(G&, std::size_t) const { return at::Tensor(); }
  std::size_t parameter_bytes() const { return 0; }
};
struct Gathering : volt::Replicated {
  using volt_roles = volt::Roles<volt::role::gathers_units>;
  template <class B>
  using Holder = GatheringHolder<B>;
};
int main() {
  volt::Trainer<volt::DataParallel<Gathering, volt::Script, volt::Mpi>, volt::Fp32, volt::CPU> trainer;
  (void)trainer;
}
