#pragma once
/// \file
/// The optimizer state of a checkpoint file as PyTorch writes it, part of volt/checkpoint.hpp (which includes it at
/// its end): for LibTorch's `Adam`, `AdamW` and `SGD` (and volt::optim's, whose state is theirs) each entry of
/// `optimizer_states` in the file is PyTorch's `optimizer.state_dict()`, so that Python's `torch.optim.Adam`, `AdamW`
/// or `SGD` takes it with `load_state_dict` and steps on from it:
///
/// | key | contents |
/// |---|---|
/// | `state` | by parameter index (the optimizer's groups in order, as PyTorch numbers them): Adam's and AdamW's `step` (a float32 scalar tensor, as PyTorch's), `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq` with amsgrad); SGD's `momentum_buffer` (with momentum); nothing for a parameter not stepped yet |
/// | `param_groups` | per group its options under PyTorch's names (Adam, AdamW: `lr`, `betas`, `eps`, `weight_decay`, `amsgrad`, `decoupled_weight_decay`; SGD: `lr`, `momentum`, `dampening`, `weight_decay`, `nesterov`) and `params`, its parameters' indices |
/// | `volt_optimizer` | the LibTorch family (`torch::optim::Adam`, ...); PyTorch's load_state_dict passes over it |
///
/// Inside volt an optimizer's state travels as its LibTorch archive (the strategies gather and cut it, `load` takes
/// it): `save` turns each archive into this form as it writes, and `read` turns the form back into the archive as it
/// reads, so nothing else sees the difference. Other optimizers (RMSprop, Adagrad, LBFGS, one's own) keep their
/// LibTorch archive in the file, a uint8 tensor that only LibTorch reads; so do files written before this form.

#include "volt/checkpoint.hpp"
#include "volt/checkpoint/optimizer_state.hpp"
#include "volt/detail/optimizer_family.hpp"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace volt {
namespace checkpoint {

/// An optimizer of `family` (detail::optimizer_family_name) over `groups`, to read and write archives through.
inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& family,
                                                               std::vector<torch::optim::OptimizerParamGroup> groups,
                                                               const std::string& path) {
  if (family == "torch::optim::AdamW") return std::make_unique<torch::optim::AdamW>(std::move(groups));
  if (family == "torch::optim::Adam") return std::make_unique<torch::optim::Adam>(std::move(groups));
  if (family == "torch::optim::SGD") {
    return std::make_unique<torch::optim::SGD>(std::move(groups), torch::optim::SGDOptions(0.0));
  }
  throw CheckpointError("volt: " + path + " holds the state of a " + family + " in a form volt writes for Adam, "
                        "AdamW and SGD only (other optimizers' as their LibTorch archive).");
}

namespace detail {

inline bool pytorch_family(const std::string& family) {
  return family == "torch::optim::AdamW" || family == "torch::optim::Adam" || family == "torch::optim::SGD";
}

/// Each group's parameter count in the LibTorch optimizer archive `a` (its `param_groups` entry).
inline std::vector<int64_t> archived_group_sizes(torch::serialize::InputArchive& a) {
  torch::serialize::InputArchive groups;
  a.read("param_groups", groups);
  at::Tensor n;
  groups.read("param_groups/size", n);
  std::vector<int64_t> sizes;
  for (int64_t g = 0; g < n.item<int64_t>(); ++g) {
    torch::serialize::InputArchive group;
    groups.read("param_groups/" + std::to_string(g), group);
    at::Tensor k;
    group.read("params/size", k);
    sizes.push_back(k.item<int64_t>());
  }
  return sizes;
}

/// A group's options under PyTorch's names.
inline Dict group_to_pytorch(const torch::optim::OptimizerOptions& options, const std::string& family) {
  Dict g = make_dict();
  if (family == "torch::optim::SGD") {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
    g.insert("lr", o.lr());
    g.insert("momentum", o.momentum());
    g.insert("dampening", o.dampening());
    g.insert("weight_decay", o.weight_decay());
    g.insert("nesterov", o.nesterov());
    return g;
  }
  const auto put = [&](double lr, std::tuple<double, double> betas, double eps, double wd, bool amsgrad) {
    c10::impl::GenericList b(c10::AnyType::get());
    b.push_back(std::get<0>(betas));
    b.push_back(std::get<1>(betas));
    g.insert("lr", lr);
    g.insert("betas", b);
    g.insert("eps", eps);
    g.insert("weight_decay", wd);
    g.insert("amsgrad", amsgrad);
    g.insert("decoupled_weight_decay", family == "torch::optim::AdamW");  // PyTorch's AdamW is Adam with it (2.x)
  };
  if (family == "torch::optim::AdamW") {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(options);
    put(o.lr(), o.betas(), o.eps(), o.weight_decay(), o.amsgrad());
  } else {
    const auto& o = static_cast<const torch::optim::AdamOptions&>(options);
    put(o.lr(), o.betas(), o.eps(), o.weight_decay(), o.amsgrad());
  }
  return g;
}

/// A number of a PyTorch dict (an int, a float, a bool, or a one-element tensor such as Adam's `step`).
inline double number(const c10::IValue& v, const std::string& what, const std::string& path) {
  if (v.isDouble()) return v.toDouble();
  if (v.isInt()) return static_cast<double>(v.toInt());
  if (v.isBool()) return v.toBool() ? 1.0 : 0.0;
  if (v.isTensor() && v.toTensor().numel() == 1) return v.toTensor().item<double>();
  throw CheckpointError("volt: the optimizer state in " + path + " holds a " + v.tagKind() + " as " + what +
                        ", where a number belongs; nothing was loaded.");
}

/// A group's options from PyTorch's names (what a group does not name keeps LibTorch's default).
inline std::unique_ptr<torch::optim::OptimizerOptions> group_from_pytorch(const Dict& g, const std::string& family,
                                                                          const std::string& path) {
  const auto get = [&](const char* key, double fallback) {
    return g.contains(key) ? number(g.at(key), std::string("\"") + key + "\"", path) : fallback;
  };
  if (family == "torch::optim::SGD") {
    auto o = std::make_unique<torch::optim::SGDOptions>(get("lr", 0.0));
    o->momentum(get("momentum", 0.0)).dampening(get("dampening", 0.0)).weight_decay(get("weight_decay", 0.0));
    o->nesterov(get("nesterov", 0.0) != 0.0);
    return o;
  }
  std::tuple<double, double> betas{0.9, 0.999};
  if (g.contains("betas")) {
    const c10::IValue b = g.at("betas");
    std::vector<c10::IValue> items;
    if (b.isList()) {
      for (const auto& x : b.toListRef()) items.push_back(x);
    } else if (b.isTuple()) {
      for (const auto& x : b.toTupleRef().elements()) items.push_back(x);
    }
    if (items.size() != 2) {
      throw CheckpointError("volt: the optimizer state in " + path + " has betas of " + std::to_string(items.size()) +
                            " numbers; Adam takes 2. Nothing was loaded.");
    }
    betas = {number(items[0], "a beta", path), number(items[1], "a beta", path)};
  }
  const auto fill = [&](auto o) {
    o->betas(betas).eps(get("eps", 1e-8)).weight_decay(get("weight_decay", o->weight_decay()));
    o->amsgrad(get("amsgrad", 0.0) != 0.0);
    return o;
  };
  if (family == "torch::optim::AdamW") return fill(std::make_unique<torch::optim::AdamWOptions>(get("lr", 1e-3)));
  return fill(std::make_unique<torch::optim::AdamOptions>(get("lr", 1e-3)));
}

}  // namespace detail

/// PyTorch's `state_dict()` of the optimizer whose LibTorch archive is `archive` (the file comment's table); none
/// where it is not Adam's, AdamW's or SGD's (or a file's from before the archive named its optimizer).
inline std::optional<Dict> to_pytorch_optimizer(const at::Tensor& archive) {
  if (archive.scalar_type() != at::kByte || archive.dim() != 1) return std::nullopt;
  const at::Tensor bytes = archive.contiguous();
  torch::serialize::InputArchive a;
  c10::IValue kind;
  try {
    a.load_from(static_cast<const char*>(bytes.data_ptr()), static_cast<std::size_t>(bytes.numel()));
    if (!a.try_read("volt_optimizer", kind)) return std::nullopt;
  } catch (const c10::Error&) {  // not an archive: kept as it is
    return std::nullopt;
  }
  if (!kind.isString() || !detail::pytorch_family(kind.toStringRef())) return std::nullopt;
  const std::string family = kind.toStringRef();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const int64_t n : detail::archived_group_sizes(a)) {
    std::vector<at::Tensor> stand_ins;
    for (int64_t k = 0; k < n; ++k) stand_ins.push_back(torch::empty({0}));
    groups.emplace_back(std::move(stand_ins));
  }
  auto optimizer = make_optimizer(family, std::move(groups), "a save");
  load_optimizer_state(*optimizer, archive, "a save");
  Dict state(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericList param_groups(c10::AnyType::get());
  int64_t index = 0;
  ::volt::detail::with_state_codec(*optimizer, [&](auto codec) {
    using Codec = decltype(codec);
    for (const auto& group : optimizer->param_groups()) {
      Dict g = detail::group_to_pytorch(group.options(), family);
      c10::impl::GenericList params(c10::AnyType::get());
      for (const at::Tensor& p : group.params()) {
        const auto* s = ::volt::detail::find_state(*optimizer, p);
        if (s != nullptr) {
          const auto& typed = static_cast<const typename Codec::State&>(*s);
          Dict entry = make_dict();
          if (family != "torch::optim::SGD") entry.insert("step", torch::tensor(static_cast<float>(Codec::step(typed))));
          const auto tensors = Codec::tensors(typed);
          for (std::size_t f = 0; f < tensors.size(); ++f) {
            if (tensors[f].defined()) entry.insert(Codec::names[f], tensors[f]);
          }
          state.insert(index, entry);
        }
        params.push_back(index++);
      }
      g.insert("params", params);
      param_groups.push_back(g);
    }
  });
  Dict out = make_dict();
  out.insert("state", state);
  out.insert("param_groups", param_groups);
  out.insert("volt_optimizer", family);
  return out;
}

/// The LibTorch archive of the optimizer whose PyTorch `state_dict()` is `d` (as `to_pytorch_optimizer` writes it, or
/// as Python's optimizer gives it with `volt_optimizer` added). `path` names the file in messages.
inline at::Tensor from_pytorch_optimizer(const Dict& d, const std::string& path) {
  const auto fail = [&](const std::string& what) {
    throw CheckpointError("volt: the optimizer state in " + path + " " + what + "; nothing was loaded.");
  };
  if (!d.contains("volt_optimizer") || !d.at("volt_optimizer").isString()) {
    fail("is a dictionary without \"volt_optimizer\" (which of torch::optim::Adam, AdamW or SGD it is)");
  }
  const std::string family = d.at("volt_optimizer").toStringRef();
  if (!detail::pytorch_family(family)) fail("names a " + family + ", not Adam, AdamW or SGD");
  if (!d.contains("param_groups") || !d.at("param_groups").isList() || !d.contains("state") ||
      !d.at("state").isGenericDict()) {
    fail("has no \"state\" dictionary or \"param_groups\" list");
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  std::vector<std::pair<int64_t, at::Tensor>> stand_ins;  // PyTorch's index of each parameter, and its stand-in
  for (const auto& gv : d.at("param_groups").toListRef()) {
    if (!gv.isGenericDict() || !gv.toGenericDict().contains("params")) fail("has a parameter group without params");
    const Dict g = gv.toGenericDict();
    std::vector<at::Tensor> params;
    for (const auto& i : g.at("params").toListRef()) {
      if (!i.isInt()) fail("names a parameter by a " + std::string(i.tagKind()) + ", not an index");
      params.push_back(torch::empty({0}));
      stand_ins.emplace_back(i.toInt(), params.back());
    }
    groups.emplace_back(std::move(params), detail::group_from_pytorch(g, family, path));
  }
  auto optimizer = make_optimizer(family, std::move(groups), path);
  const Dict state = d.at("state").toGenericDict();
  ::volt::detail::with_state_codec(*optimizer, [&](auto codec) {
    using Codec = decltype(codec);
    for (const auto& [index, stand_in] : stand_ins) {
      if (!state.contains(index)) continue;  // not stepped yet
      const c10::IValue& ev = state.at(index);
      if (!ev.isGenericDict()) fail("holds a " + std::string(ev.tagKind()) + " as the state of a parameter");
      const Dict e = ev.toGenericDict();
      std::vector<at::Tensor> fields(Codec::fields);
      for (std::size_t f = 0; f < Codec::fields; ++f) {
        if (e.contains(Codec::names[f]) && e.at(Codec::names[f]).isTensor()) fields[f] = e.at(Codec::names[f]).toTensor();
      }
      const double step = e.contains("step") ? detail::number(e.at("step"), "a step", path) : 0.0;
      ::volt::detail::put_state(*optimizer, stand_in, Codec::make(fields, static_cast<int64_t>(step)));
    }
  });
  return optimizer_state(*optimizer);
}

/// A checkpoint's contents as the file holds them: each optimizer archive that has PyTorch's form in it (`save`).
inline void optimizers_to_pytorch(Dict& contents) {
  if (!contents.contains(keys::optimizer_states) || !contents.at(keys::optimizer_states).isList()) return;
  c10::impl::GenericList out(c10::AnyType::get());
  for (const auto& o : contents.at(keys::optimizer_states).toListRef()) {
    std::optional<Dict> pytorch = o.isTensor() ? to_pytorch_optimizer(o.toTensor()) : std::nullopt;
    out.push_back(pytorch ? c10::IValue(*pytorch) : o);
  }
  contents.insert_or_assign(keys::optimizer_states, out);
}

/// A file's contents as volt works with them: each optimizer in PyTorch's form back as its archive (`read`).
inline void optimizers_from_pytorch(Dict& contents, const std::string& path) {
  if (!contents.contains(keys::optimizer_states) || !contents.at(keys::optimizer_states).isList()) return;
  c10::impl::GenericList out(c10::AnyType::get());
  try {
    for (const auto& o : contents.at(keys::optimizer_states).toListRef()) {
      out.push_back(o.isGenericDict() ? c10::IValue(from_pytorch_optimizer(o.toGenericDict(), path)) : o);
    }
  } catch (const c10::Error& e) {  // a value of another kind where the form has a list, a dict or a tensor
    throw CheckpointError("volt: the optimizer state in " + path + " is not what volt writes (" +
                          detail::first_line(e.what()) + "); nothing was loaded.");
  }
  contents.insert_or_assign(keys::optimizer_states, out);
}

}  // namespace checkpoint
}  // namespace volt
