// The compile-time truth table (as mp-units' test/static): every policy against its kind, every rule between
// kinds, the capabilities the loops read, and the policies written from their concept files alone. Nothing
// runs: this file compiling is the test. Each row says what it checks; the reference is the table in the
// concept file or volt/rules.hpp that the row's comment names.

#include "../support/concept_policies.hpp"

#include <volt/volt.hpp>

#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using volt::CPU;
using volt::GPU;
using Batch = torch::data::Example<>;

// ---- each kind (strategies/, precision/, accelerators/, launchers/ concept.hpp) ----------------------------
static_assert(volt::Strategy<volt::SingleDevice>);
static_assert(volt::Strategy<volt::DDP<volt::Script>>);
static_assert(volt::Strategy<volt::DDP<volt::Spawn>>);
static_assert(volt::Strategy<volt::DDP<volt::Script, volt::Mpi>>);
static_assert(volt::Strategy<volt::DDP<volt::Spawn, volt::Nccl>>);
static_assert(volt::Strategy<volt::ManualParallel<volt::Script>>);
static_assert(volt::Strategy<volt::ManualParallel<volt::Spawn, volt::Mpi>>);
static_assert(volt::Strategy<volt::ZeRO<1>>);
static_assert(volt::Strategy<volt::ZeRO<2, volt::Spawn, volt::Mpi>>);
static_assert(volt::Strategy<vt::CountingStrategy>);  // written from strategies/concept.hpp alone
static_assert(!volt::Strategy<volt::Fp32>);
static_assert(!volt::Strategy<volt::CPU>);
static_assert(!volt::Strategy<volt::Script>);

static_assert(volt::Precision<volt::Fp32>);
static_assert(volt::Precision<volt::Fp64True>);
static_assert(volt::Precision<volt::Bf16Mixed>);
static_assert(volt::Precision<volt::Fp16Mixed>);
static_assert(volt::Precision<volt::Bf16True>);
static_assert(!volt::Precision<volt::SingleDevice>);
static_assert(!volt::Precision<volt::GPU>);
static_assert(!volt::Precision<volt::CPU>);
static_assert(std::is_same_v<volt::Bf16, volt::Bf16Mixed> && std::is_same_v<volt::Fp16, volt::Fp16Mixed>);
// a precision without ZeRO's inf agreement (precision/concept.hpp's agree_found_inf) is no precision
struct NoInfAgreement {
  struct NoGuard {};
  static constexpr const char* name = "NoInfAgreement";
  static constexpr bool needs_fp16_autocast = false, needs_bf16_autocast = false, converts_inputs = false;
  static constexpr torch::Dtype input_dtype = torch::kFloat32;
  static constexpr bool scales_loss = true;
  NoGuard forward_context(c10::DeviceType) { return {}; }
  void convert_module(torch::nn::Module&) {}
  void backward(const torch::Tensor& loss) { loss.backward(); }
  void unscale_gradients(torch::optim::Optimizer&) {}
  bool optimizer_step(torch::optim::Optimizer&) { return true; }
  void update() {}
  std::map<std::string, double> state_dict() const { return {}; }
  void load_state_dict(const std::map<std::string, double>&) {}
};
static_assert(!volt::Precision<NoInfAgreement>);
struct WithInfAgreement : NoInfAgreement {
  void agree_found_inf(torch::optim::Optimizer&, const std::function<void(torch::Tensor&)>&) {}
};
static_assert(volt::Precision<WithInfAgreement>);
// a precision that scales the loss must agree on its inf check under ZeRO (rules.hpp); one that does not scale may
// keep the default
struct ScaledDefaults : volt::PrecisionDefaults {
  static constexpr const char* name = "ScaledDefaults";
  static constexpr bool scales_loss = true;
};
struct ScaledAgreeing : ScaledDefaults {
  void agree_found_inf(torch::optim::Optimizer&, const std::function<void(torch::Tensor&)>&) {}
};
static_assert(volt::detail::default_inf_agreement<ScaledDefaults> && !volt::detail::default_inf_agreement<ScaledAgreeing>);
static_assert(!volt::detail::default_inf_agreement<volt::Fp16Mixed> && volt::detail::default_inf_agreement<volt::Fp32>);

static_assert(volt::Accelerator<CPU>);
static_assert(volt::Accelerator<GPU>);
static_assert(!volt::Accelerator<volt::Fp32>);
static_assert(!volt::Accelerator<volt::SingleDevice>);
static_assert(!volt::Accelerator<int>);

static_assert(volt::Launcher<volt::Script>);
static_assert(volt::Launcher<volt::Spawn>);
static_assert(!volt::Launcher<volt::SingleDevice>);
static_assert(!volt::Launcher<volt::Mpi>);

static_assert(volt::Callback<volt::ProgressBar>);
static_assert(volt::Callback<volt::ModelCheckpoint>);
static_assert(volt::Callback<vt::EpochLossLog>);  // written from callbacks/concept.hpp alone
static_assert(!volt::Callback<int&>);

// ---- the rules between kinds (volt/rules.hpp) ---------------------------------------------------------------
// a precision's autocast dtype exists on the accelerator
static_assert(!volt::Fp16AutocastAvailable<volt::Fp16Mixed, CPU>);
static_assert(volt::Fp16AutocastAvailable<volt::Fp16Mixed, GPU>);
static_assert(volt::Bf16AutocastAvailable<volt::Bf16Mixed, CPU>);
static_assert(volt::Bf16AutocastAvailable<volt::Bf16Mixed, GPU>);
static_assert(volt::Fp16AutocastAvailable<volt::Fp32, CPU> && volt::Bf16AutocastAvailable<volt::Fp32, CPU>);
static_assert(volt::Fp16AutocastAvailable<volt::Bf16True, CPU> && volt::Fp16AutocastAvailable<volt::Fp64True, CPU>);
struct Fp16Cpu : CPU {  // a user's accelerator claiming float16 autocast takes part on equal terms
  static constexpr bool has_fp16_autocast = true;
};
static_assert(volt::Fp16AutocastAvailable<volt::Fp16Mixed, Fp16Cpu>);
// a strategy's collective backend takes the accelerator's tensors (Nccl: CUDA only; Mpi: both, through host memory)
static_assert(!volt::BackendRunsOn<volt::DDP<volt::Script, volt::Nccl>, CPU>);
static_assert(volt::BackendRunsOn<volt::DDP<volt::Script, volt::Nccl>, GPU>);
static_assert(volt::BackendRunsOn<volt::DDP<volt::Script, volt::Mpi>, CPU>);
static_assert(volt::BackendRunsOn<volt::DDP<volt::Spawn, volt::Mpi>, GPU>);
static_assert(!volt::BackendRunsOn<volt::ManualParallel<volt::Script, volt::Nccl>, CPU>);
static_assert(volt::BackendRunsOn<volt::SingleDevice, CPU> && volt::BackendRunsOn<volt::SingleDevice, GPU>);
static_assert(volt::BackendRunsOn<vt::CountingStrategy, CPU>);
// the backend was compiled in (Nccl: only with the volt::nccl target)
static_assert(volt::BackendCompiledIn<volt::DDP<volt::Script, volt::Nccl>> == (VOLT_WITH_NCCL != 0));
static_assert(volt::BackendCompiledIn<volt::DDP<volt::Script, volt::Mpi>>);
static_assert(volt::BackendCompiledIn<volt::SingleDevice>);
// graph mode (accelerators/graphed.hpp, rules.hpp): the accelerator has a graph type, compiled in; one process
struct ReplayGraph {  // a graph type of one's own (the shape the table in graphed.hpp gives)
  static constexpr bool available = true;
  template <class F> void run_eager(const c10::Device&, F&& f) { f(); }
  template <class F> void capture(const c10::Device&, F&&, const ReplayGraph*) {}
  void replay() {}
};
struct GraphCPU : CPU {
  using graph_type = ReplayGraph;
};
using volt::detail::first_broken_rule;
using volt::detail::Rule;
static_assert(volt::detail::captures_step<volt::Graphed<GPU>> && !volt::detail::captures_step<GPU>);
static_assert(volt::Accelerator<volt::Graphed<GPU>> && volt::Graphed<GPU>::warmup_batches == 3);
static_assert(first_broken_rule<volt::SingleDevice, volt::Bf16, volt::Graphed<CPU>>() == Rule::graph_device);
static_assert(first_broken_rule<volt::SingleDevice, volt::Bf16, volt::Graphed<GraphCPU>>() == Rule::none);
static_assert(first_broken_rule<volt::SingleDevice, volt::Fp16Mixed, volt::Graphed<GPU>>() ==
              (VOLT_WITH_CUDA ? Rule::none : Rule::graph_compiled));
static_assert(first_broken_rule<volt::DDP<volt::Script>, volt::Fp32, volt::Graphed<GraphCPU>>() ==
              Rule::graph_distributed);
static_assert(first_broken_rule<volt::DDP<volt::Script>, volt::Fp32, GraphCPU>() == Rule::none);  // not graphed
static_assert(first_broken_rule<volt::ZeRO<2>, volt::Fp32, volt::Graphed<GraphCPU>>() == Rule::graph_distributed);
static_assert(!volt::BackendRunsOn<volt::ZeRO<1, volt::Script, volt::Nccl>, CPU>);
static_assert(first_broken_rule<volt::ZeRO<2>, ScaledDefaults, CPU>() == Rule::sharded_inf_unagreed);
static_assert(first_broken_rule<volt::ZeRO<2>, ScaledAgreeing, CPU>() == Rule::none);
static_assert(first_broken_rule<volt::DDP<volt::Script>, ScaledDefaults, CPU>() == Rule::none);  // whole gradients
static_assert(first_broken_rule<volt::ZeRO<1>, volt::Fp32, CPU>() == Rule::none);  // nothing to agree on
// ZeRO steps the optimizer itself: it shards its state, and refuses manual optimization (rules.hpp's CheckedFit)
struct ManualFlag {
  static constexpr bool automatic_optimization = false;
};
struct AutomaticFlag {};
static_assert(volt::detail::shards_optimizer_state<volt::ZeRO<1>> && volt::detail::shards_optimizer_state<volt::ZeRO<2>>);
static_assert(!volt::detail::shards_optimizer_state<volt::DDP<volt::Script>>);
static_assert(volt::detail::sharded_manual<volt::ZeRO<1>, ManualFlag>);
static_assert(!volt::detail::sharded_manual<volt::DDP<volt::Script>, ManualFlag>);
static_assert(!volt::detail::sharded_manual<volt::ZeRO<2>, AutomaticFlag>);
// which optimizers a captured step can hold (optim/fused.hpp)
static_assert(volt::optim::CapturableOptimizer<volt::optim::Adam> && volt::optim::CapturableOptimizer<volt::optim::SGD>);
static_assert(volt::optim::CapturableOptimizer<volt::optim::AdamW>);
static_assert(!volt::optim::CapturableOptimizer<torch::optim::Adam> &&
              !volt::optim::CapturableOptimizer<torch::optim::Optimizer>);
// and what configure_optimizers says of its optimizer's type (module.hpp)
static_assert(std::is_same_v<volt::detail::optimizer_type<volt::OptimizerConfigOf<volt::optim::SGD>>::type,
                             volt::optim::SGD>);
static_assert(std::is_same_v<volt::detail::optimizer_type<std::unique_ptr<volt::optim::Adam>>::type,
                             volt::optim::Adam>);
static_assert(std::is_same_v<volt::detail::optimizer_type<volt::OptimizerConfig>::type, torch::optim::Optimizer>);
// AutoBackend resolves by accelerator: Mpi on CPU, Nccl on GPU (strategies/ddp.hpp's with_accelerator)
static_assert(std::is_same_v<volt::detail::bind_strategy_t<volt::DDP<volt::Spawn>, CPU>, volt::DDP<volt::Spawn, volt::Mpi>>);
static_assert(std::is_same_v<volt::detail::bind_strategy_t<volt::DDP<volt::Script>, GPU>, volt::DDP<volt::Script, volt::Nccl>>);
static_assert(std::is_same_v<volt::detail::bind_strategy_t<volt::ManualParallel<volt::Script>, CPU>,
                             volt::ManualParallel<volt::Script, volt::Mpi>>);
static_assert(std::is_same_v<volt::detail::bind_strategy_t<volt::ZeRO<2, volt::Spawn>, CPU>,
                             volt::ZeRO<2, volt::Spawn, volt::Mpi>>);
static_assert(std::is_same_v<volt::detail::bind_strategy_t<volt::ZeRO<1>, GPU>, volt::ZeRO<1, volt::Script, volt::Nccl>>);
static_assert(std::is_same_v<volt::detail::bind_strategy_t<volt::SingleDevice, GPU>, volt::SingleDevice>);
static_assert(std::is_same_v<volt::detail::bind_strategy_t<vt::CountingStrategy, CPU>, vt::CountingStrategy>);
// a Trainer type's strategy_type is the bound one
static_assert(std::is_same_v<volt::Trainer<volt::DDP<volt::Spawn>, volt::Fp32, CPU>::strategy_type,
                             volt::DDP<volt::Spawn, volt::Mpi>>);
// the slots are asked first; the pairwise rules only when they hold (no cascades of errors)
static_assert(volt::detail::slots_ok<volt::SingleDevice, volt::Fp32, CPU>);
static_assert(!volt::detail::slots_ok<volt::Fp32, volt::SingleDevice, CPU>);

// ---- capabilities the loops read ----------------------------------------------------------------------------
// a token-weighted loss is weighed across ranks only where volt averages the gradients (strategies/concept.hpp)
static_assert(volt::SingleDevice::averages_gradients && volt::DDP<volt::Script>::averages_gradients);
static_assert(volt::ZeRO<2>::averages_gradients);
static_assert(!volt::ManualParallel<volt::Script>::averages_gradients);
// DDP and ZeRO are one data-parallel strategy with their layouts (strategies/data_parallel.hpp)
static_assert(std::is_same_v<volt::DDP<volt::Script, volt::Mpi>, volt::DataParallel<volt::Replicated, volt::Script, volt::Mpi>>);
static_assert(std::is_same_v<volt::ZeRO<1, volt::Spawn>, volt::DataParallel<volt::Sharded<1>, volt::Spawn>>);
static_assert(std::is_void_v<volt::SingleDevice::backend_type>);
static_assert(std::is_same_v<volt::DDP<volt::Script, volt::Mpi>::backend_type, volt::Mpi>);
// Script joins an outside mpirun/srun job, Spawn refuses one (launchers/concept.hpp)
static_assert(volt::Script::joins_external_jobs && !volt::Spawn::joins_external_jobs);
// metric-watching callbacks run after the module's on_train_epoch_end (callbacks/concept.hpp)
static_assert(volt::monitors_metrics<volt::ModelCheckpoint> && volt::monitors_metrics<volt::EarlyStopping>);
static_assert(!volt::monitors_metrics<volt::ProgressBar> && !volt::monitors_metrics<volt::CSVLogger>);
static_assert(volt::monitors_metrics<vt::EpochLossLog>);
// the precisions' flags (precision/concept.hpp)
static_assert(volt::Bf16Mixed::needs_bf16_autocast && !volt::Bf16Mixed::converts_inputs);
static_assert(volt::Fp16Mixed::needs_fp16_autocast);
static_assert(volt::Bf16True::converts_inputs && volt::Bf16True::input_dtype == torch::kBFloat16);
static_assert(volt::Fp64True::converts_inputs && volt::Fp64True::input_dtype == torch::kFloat64);
static_assert(!volt::Fp32::converts_inputs && !volt::Fp32::needs_bf16_autocast && !volt::Fp32::needs_fp16_autocast);
// the loaders' capabilities (data/concept.hpp)
static_assert(volt::data::SizedLoader<volt::data::TensorLoader> && volt::data::ShardableLoader<volt::data::TensorLoader>);
static_assert(volt::data::PositionedLoader<volt::data::TensorLoader>);
static_assert(volt::data::SizedLoader<std::vector<Batch>> && !volt::data::PositionedLoader<std::vector<Batch>>);
static_assert(!volt::data::ShardableLoader<std::vector<Batch>>);
static_assert(std::is_same_v<volt::detail::batch_t<std::vector<Batch>>, Batch>);
static_assert(std::is_same_v<volt::detail::batch_t<std::unique_ptr<std::vector<Batch>>>, Batch>);
// the batch types volt can look inside (batch.hpp)
static_assert(volt::MappableBatch<Batch> && volt::MappableBatch<torch::Tensor>);
static_assert(volt::MappableBatch<std::vector<torch::Tensor>>);
static_assert(volt::MappableBatch<int> && volt::MappableBatch<std::string>);  // leaves, left alone
struct NoTraits {
  torch::Tensor x;
};
static_assert(!volt::MappableBatch<NoTraits> && !volt::MappableBatch<std::vector<NoTraits>>);

// ---- declared hooks (volt/declared_hooks.hpp): a member of any kind under each name, a template one too ------
struct DeclaringCallback {
  using volt_hooks = volt::Hooks<volt::hook::on_train_epoch_end, volt::hook::state_dict, volt::hook::setup>;
  void on_train_epoch_end(auto&, auto&) {}                   // a member template
  std::map<std::string, double> state_dict() const { return {}; }
  template <class T, class M>
  void setup(T&, M&, volt::Stage) {}
};
static_assert(volt::detail::check_declared_hooks<DeclaringCallback>());
struct DeclaringLogger final {  // final: the name is looked up directly
  static constexpr bool is_logger = true;
  using volt_hooks = volt::Hooks<volt::hook::log_metrics, volt::hook::finalize>;
  void log_metrics(const std::map<std::string, double>&, int64_t) {}
  void finalize(volt::RunStatus) {}
};
static_assert(volt::detail::check_declared_hooks<DeclaringLogger>() && volt::detail::check_logger<DeclaringLogger>());
struct DeclaringModule : torch::nn::Module {
  using volt_hooks = volt::Hooks<volt::hook::training_step, volt::hook::configure_optimizers>;
  torch::Tensor training_step(const Batch&, volt::Context&) { return {}; }
  volt::optim::SGD configure_optimizers() { return volt::optim::SGD(parameters(), 0.1); }
};
static_assert(volt::detail::CheckedFit<DeclaringModule, Batch, void>::ok);
static_assert(!volt::detail::has_member_on_train_epoch_end<DeclaringLogger>() &&
              !volt::detail::has_member_configure_model<DeclaringModule>());  // absent names stay absent

// ---- a Trainer over the concept-only policies is a complete type with the API callbacks use ----------------
using ConceptTrainer = volt::Trainer<vt::CountingStrategy, volt::Fp32, CPU, vt::EpochLossLog>;
static_assert(std::is_same_v<ConceptTrainer::strategy_type, vt::CountingStrategy>);
static_assert(requires(ConceptTrainer& t) {
  t.current_epoch();
  t.global_step();
  t.callback_metric_values();
  t.request_stop();
  t.template callback<vt::EpochLossLog>();
  t.save_checkpoint(std::string());
});

}  // namespace
