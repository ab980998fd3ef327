// expect: a strategy declares volt::role::writes_shards in its volt_roles and lacks one of the role's members
// A strategy of one's own that declares it writes the sharded checkpoint form (strategies/concept.hpp's roles) and
// misspells one of the role's members: found by a probe, the Trainer would silently write the full form.
#include <volt/volt.hpp>
struct MyStrategy : volt::SingleDevice {
  using volt_roles = volt::Roles<volt::role::writes_shards>;
  volt::StateDictType state_dict_type() const { return volt::StateDictType::sharded; }
  std::vector<volt::checkpoint::Slice> state_slice() const { return {}; }  // misspelt: state_slices
  std::vector<std::vector<at::Tensor>> full_param_groups(torch::optim::Optimizer& o) {
    return volt::detail::param_lists(o);
  }
};
int main() {
  volt::Trainer<MyStrategy, volt::Fp32, volt::CPU> trainer;
  (void)trainer;
}
