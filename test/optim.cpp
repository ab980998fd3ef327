// volt::optim against torch::optim: the same steps for every option combination, state archives that load into
// each other mid-run, LibTorch's LR schedulers, and a Trainer checkpoint written with one and resumed with the other.

#include "common.hpp"

#include <volt/optim.hpp>

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

/// Two layers in two parameter groups (other learning rates), and a layer that never gets a gradient.
struct NetImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, unused{nullptr};
  NetImpl() {
    torch::manual_seed(3);
    a = register_module("a", torch::nn::Linear(6, 8));
    b = register_module("b", torch::nn::Linear(8, 3));
    unused = register_module("unused", torch::nn::Linear(2, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::tanh(a(x))); }
  std::vector<torch::optim::OptimizerParamGroup> groups() {
    std::vector<torch::Tensor> rest = b->parameters();
    for (auto& p : unused->parameters()) rest.push_back(p);
    return {torch::optim::OptimizerParamGroup(a->parameters()), torch::optim::OptimizerParamGroup(rest)};
  }
};
TORCH_MODULE(Net);

using MakeOptimizer = std::function<std::unique_ptr<torch::optim::Optimizer>(Net&)>;

/// Steps `net` `n` times on fixed batches (batch i of a fixed sequence from `first`), the second group at a third
/// of the first's rate, a StepLR halving both every 10 steps.
void train(Net& net, torch::optim::Optimizer& opt, int first, int n) {
  for (int i = first; i < first + n; ++i) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + i);
    const auto x = torch::randn({16, 6}, gen);
    const auto y = torch::randn({16, 3}, gen);
    opt.zero_grad();
    vt::mse(net(x), y).backward();
    opt.step();
    if ((i + 1) % 10 == 0) {
      for (auto& g : opt.param_groups()) g.options().set_lr(g.options().get_lr() * 0.5);
    }
  }
}

std::unique_ptr<torch::optim::Optimizer> with_group_rates(std::unique_ptr<torch::optim::Optimizer> opt) {
  auto& second = opt->param_groups()[1].options();
  second.set_lr(second.get_lr() / 3);
  return opt;
}

/// The largest |a - b| / max|b| over the parameters of two nets.
double largest_relative_difference(Net& a, Net& b) {
  double worst = 0;
  const auto pa = a->parameters(), pb = b->parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) {
    const double scale = std::max(pb[i].abs().max().item<double>(), 1e-12);
    worst = std::max(worst, (pa[i] - pb[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

struct Case {
  std::string name;
  MakeOptimizer reference, fused;
};

std::vector<Case> all_cases() {
  using namespace torch::optim;
  std::vector<Case> cases;
  for (double wd : {0.0, 0.1}) {
    for (bool amsgrad : {false, true}) {
      for (auto betas : {std::make_tuple(0.9, 0.999), std::make_tuple(0.8, 0.99)}) {
        const auto o = AdamOptions(1e-2).weight_decay(wd).amsgrad(amsgrad).betas(betas).eps(1e-7);
        const std::string name = "Adam wd " + std::to_string(wd) + " amsgrad " + std::to_string(amsgrad) + " beta1 " +
                                 std::to_string(std::get<0>(betas));
        cases.push_back(
            {name, [o](Net& n) { return with_group_rates(std::make_unique<Adam>(n->groups(), o)); },
             [o](Net& n) { return with_group_rates(std::make_unique<volt::optim::Adam>(n->groups(), o)); }});
      }
    }
  }
  for (double wd : {0.0, 1e-2, 0.1}) {
    for (bool amsgrad : {false, true}) {
      const auto o = AdamWOptions(1e-2).weight_decay(wd).amsgrad(amsgrad);
      const std::string name = "AdamW wd " + std::to_string(wd) + " amsgrad " + std::to_string(amsgrad);
      cases.push_back({name, [o](Net& n) { return with_group_rates(std::make_unique<AdamW>(n->groups(), o)); },
                       [o](Net& n) { return with_group_rates(std::make_unique<volt::optim::AdamW>(n->groups(), o)); }});
    }
  }
  for (double momentum : {0.0, 0.9}) {
    for (double dampening : {0.0, 0.1}) {
      for (bool nesterov : {false, true}) {
        if (nesterov && (momentum == 0 || dampening != 0)) continue;  // LibTorch refuses these
        for (double wd : {0.0, 0.1}) {
          const auto o = SGDOptions(0.05).momentum(momentum).dampening(dampening).nesterov(nesterov).weight_decay(wd);
          const std::string name = "SGD momentum " + std::to_string(momentum) + " dampening " +
                                   std::to_string(dampening) + " nesterov " + std::to_string(nesterov) + " wd " +
                                   std::to_string(wd);
          cases.push_back(
              {name, [o](Net& n) { return with_group_rates(std::make_unique<SGD>(n->groups(), o)); },
               [o](Net& n) { return with_group_rates(std::make_unique<volt::optim::SGD>(n->groups(), o)); }});
        }
      }
    }
  }
  return cases;
}

/// An optimizer's archive as bytes and back, as checkpoints hold it.
void carry_state(const torch::optim::Optimizer& from, torch::optim::Optimizer& to) {
  volt::checkpoint::load_optimizer_state(to, volt::checkpoint::optimizer_state(from), "memory");
}

}  // namespace

TEST_CASE("volt::optim steps as torch::optim does: every option, two groups, a changing rate, 100 steps", "[optim]") {
  const auto cases = all_cases();
  REQUIRE(cases.size() == 8 + 6 + 10);
  for (const auto& c : cases) {
    Net ref, fused;
    auto ref_opt = c.reference(ref);
    auto fused_opt = c.fused(fused);
    train(ref, *ref_opt, 0, 100);
    train(fused, *fused_opt, 0, 100);
    const double diff = largest_relative_difference(fused, ref);
    INFO(c.name << ": largest relative difference " << diff);
    CHECK(diff <= 1e-6);
    CHECK(!torch::equal(fused->a->weight, Net()->a->weight));  // it trained
    CHECK(!fused->unused->weight.grad().defined());            // and left the parameter without a gradient alone
    CHECK(torch::equal(fused->unused->weight, Net()->unused->weight));
  }
}

TEST_CASE("volt::optim and torch::optim states load into each other mid-run", "[optim]") {
  for (const auto& c : all_cases()) {
    INFO(c.name);
    Net ref;
    auto ref_opt = c.reference(ref);
    train(ref, *ref_opt, 0, 100);
    for (bool fused_first : {true, false}) {
      INFO((fused_first ? "volt::optim, then torch::optim" : "torch::optim, then volt::optim"));
      Net first, second;
      auto a = fused_first ? c.fused(first) : c.reference(first);
      train(first, *a, 0, 50);
      {
        torch::NoGradGuard no_grad;
        for (std::size_t i = 0; i < first->parameters().size(); ++i) {
          second->parameters()[i].copy_(first->parameters()[i]);
        }
      }
      auto b = fused_first ? c.reference(second) : c.fused(second);
      carry_state(*a, *b);
      CHECK(b->param_groups()[1].options().get_lr() == a->param_groups()[1].options().get_lr());
      train(second, *b, 50, 50);
      CHECK(largest_relative_difference(second, ref) <= 1e-6);
    }
  }
}

TEST_CASE("volt::optim's archives count Adam's steps as torch::optim's do", "[optim]") {
  Net fused;
  volt::optim::AdamW opt(fused->groups(), torch::optim::AdamWOptions(1e-3));
  train(fused, opt, 0, 37);
  Net other;
  torch::optim::AdamW read(other->groups(), torch::optim::AdamWOptions(1e-3));
  carry_state(opt, read);
  int states = 0;
  for (const auto& [key, state] : read.state()) {
    CHECK(static_cast<const torch::optim::AdamWParamState&>(*state).step() == 37);
    ++states;
  }
  CHECK(states == 4);  // a and b, weights and biases; never the unused layer
}

TEST_CASE("volt::optim takes LibTorch's own step where no fused kernel applies: sparse gradients", "[optim]") {
  auto run = [](auto make) {
    torch::manual_seed(5);
    torch::nn::Embedding e(torch::nn::EmbeddingOptions(10, 3).sparse(true));
    const auto initial = e->weight.clone();
    auto opt = make(e->parameters());
    for (int i = 0; i < 5; ++i) {
      opt.zero_grad();
      e(torch::tensor({1, 4, 4, 7})).pow(2).sum().backward();
      opt.step();
    }
    return std::make_pair(initial, e->weight.clone());
  };
  const auto o = torch::optim::SGDOptions(0.1);
  const auto [initial, ref] = run([&](std::vector<torch::Tensor> p) { return torch::optim::SGD(p, o); });
  const auto got = run([&](std::vector<torch::Tensor> p) { return volt::optim::SGD(p, o); }).second;
  CHECK(torch::equal(got, ref));
  CHECK(!torch::equal(got.index({4}), initial.index({4})));  // rows looked up moved
  CHECK(torch::equal(got.index({0}), initial.index({0})));   // the others did not
}

TEST_CASE("step_on_device refuses a gradient no fused kernel can step, naming the optimizer it was called on",
          "[optim]") {
  auto message = [](auto make) {
    torch::nn::Embedding e(torch::nn::EmbeddingOptions(10, 3).sparse(true));
    auto opt = make(e->parameters());
    e(torch::tensor({1, 4})).sum().backward();  // a sparse gradient, on every LibTorch line
    try {
      opt.step_on_device();
    } catch (const std::logic_error& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  const auto adam = message([](std::vector<torch::Tensor> p) { return volt::optim::Adam(p); });
  const auto adamw = message([](std::vector<torch::Tensor> p) { return volt::optim::AdamW(p); });
  const auto sgd = message([](std::vector<torch::Tensor> p) { return volt::optim::SGD(p, 0.1); });
  CHECK_THAT(adam, StartsWith("volt: volt::optim::Adam::step_on_device needs LibTorch's fused kernels"));
  CHECK_THAT(adamw, StartsWith("volt: volt::optim::AdamW::step_on_device needs LibTorch's fused kernels"));
  CHECK_THAT(sgd, StartsWith("volt: volt::optim::SGD::step_on_device needs LibTorch's fused kernels"));
}

TEST_CASE("on LibTorch 2.4 and later the CPU step is the fused kernel", "[optim]") {
  Net n;
  volt::optim::Adam opt(n->parameters());
  vt::mse(n(torch::ones({2, 6})), torch::zeros({2, 3})).backward();
  CHECK(volt::optim::detail::fused_applies(opt) == (volt::detail::torch_version >= 20400));
}

namespace {
/// A regressor whose optimizer is chosen by type.
template <class Optimizer>
struct AdamRegressorImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  AdamRegressorImpl() {
    torch::manual_seed(11);
    a = register_module("a", torch::nn::Linear(4, 8));
    b = register_module("b", torch::nn::Linear(8, 1));
  }
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context&) {
    return vt::mse(b(torch::relu(a(batch.data))), batch.target);
  }
  volt::OptimizerConfig configure_optimizers() {
    auto opt = std::make_shared<Optimizer>(parameters(), torch::optim::AdamWOptions(1e-2).amsgrad(true));
    return {opt, std::make_shared<torch::optim::StepLR>(*opt, 2, 0.5), volt::Interval::epoch};
  }
};
template <class O>
using AdamRegressor = torch::nn::ModuleHolder<AdamRegressorImpl<O>>;

/// Fits `epochs` epochs (resuming from `resume_from` if given), saves a checkpoint to `save_to` if given, and
/// returns the weights.
template <class O>
std::vector<torch::Tensor> fit(int epochs, const std::string& resume_from = "", const std::string& save_to = "") {
  AdamRegressor<O> m;
  auto [x, y] = vt::regression_data(48);
  volt::Trainer<> t({.max_epochs = epochs});
  if (resume_from.empty()) {
    t.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 8}));
  } else {
    t.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::NoLoader{}, resume_from);
  }
  if (!save_to.empty()) t.save_checkpoint(save_to);
  return m->parameters();
}
}  // namespace

TEST_CASE("a Trainer checkpoint written with volt::optim resumes with torch::optim, and the other way round",
          "[optim]") {
  const fs::path dir = scratch("optim-interchange");
  const auto reference = fit<torch::optim::AdamW>(5);
  const auto initial = AdamRegressor<torch::optim::AdamW>()->parameters();
  for (bool fused_first : {true, false}) {
    INFO((fused_first ? "volt::optim::AdamW, then torch::optim::AdamW" : "torch::optim::AdamW, then volt's"));
    const std::string ckpt = (dir / (fused_first ? "fused.ckpt" : "torch.ckpt")).string();
    fused_first ? fit<volt::optim::AdamW>(2, "", ckpt) : fit<torch::optim::AdamW>(2, "", ckpt);
    const auto got = fused_first ? fit<torch::optim::AdamW>(5, ckpt) : fit<volt::optim::AdamW>(5, ckpt);
    for (std::size_t i = 0; i < got.size(); ++i) {
      CHECK(torch::allclose(got[i], reference[i], /*rtol=*/1e-6, /*atol=*/1e-7));
      CHECK(!torch::allclose(got[i], initial[i]));
    }
  }
}

TEST_CASE("GPU: volt::optim on CUDA steps as torch::optim does on CUDA, one fused kernel per group", "[.gpu]") {
  const torch::Device cuda(torch::kCUDA);
  const auto cases = all_cases();
  for (const auto& c : cases) {
    Net ref, fused;
    ref->to(cuda);
    fused->to(cuda);
    auto ref_opt = c.reference(ref);
    auto fused_opt = c.fused(fused);
    REQUIRE(volt::optim::has_fused_kernels(cuda) == (volt::detail::torch_version >= 20400));
    for (int i = 0; i < 100; ++i) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + i);
      const auto x = torch::randn({16, 6}, gen).to(cuda);
      const auto y = torch::randn({16, 3}, gen).to(cuda);
      for (auto [net, opt] : {std::pair{&ref, ref_opt.get()}, std::pair{&fused, fused_opt.get()}}) {
        opt->zero_grad();
        vt::mse((*net)(x), y).backward();
        opt->step();
      }
    }
    const double diff = largest_relative_difference(fused, ref);
    INFO(c.name << " on CUDA: largest relative difference " << diff);
    CHECK(diff <= 1e-5);  // CUDA's fused kernels contract multiply-adds that LibTorch's per-tensor ops round apart
    CHECK(fused->a->weight.is_cuda());
  }
}
