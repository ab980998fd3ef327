#pragma once
/// \file
/// Saving checkpoints, part of volt/checkpoint.hpp (which includes it at its end): a checkpoint's contents stamped
/// with the format, the versions and the checksum, serialised once and written atomically to each path; the
/// weights-only safetensors file beside a checkpoint (ModelCheckpoint's `save_safetensors`); and the writer that does
/// both on a thread of its own (asynchronous saves).

#include "volt/checkpoint.hpp"
#include "volt/checkpoint/safetensors.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/api/include/torch/version.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/serialize.h>

#include <exception>
#include <filesystem>
#include <system_error>
#include <functional>
#include <future>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

namespace volt {
namespace checkpoint {

// volt/checkpoint/pytorch_optimizer.hpp: declared here too, for a unit in which that header comes first and so is
// only defined after this one.
inline void optimizers_to_pytorch(Dict& contents);

/// A copy of `v` whose dicts and lists are its own (lists as plain lists of any element): the pickler memoizes a
/// container shared elsewhere (its use count above one), so without this the bytes of a save would depend on who else
/// holds its pieces; and a list of tensors or numbers pickles as a LibTorch builder call (`build_tensorlist`) that
/// Python's `torch.load(weights_only=True)` refuses. `copy_tensors`: tensors copied too, into memory training cannot change (CPU tensors cloned, CUDA
/// tensors copied into pinned host memory); else shared. Numbers and strings are immutable and shared.
inline c10::IValue unshared(const c10::IValue& v, bool copy_tensors) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!copy_tensors || !t.defined()) return t;
    if (t.is_cpu()) return t.clone();
    at::Tensor host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
    return host.copy_(t);
  }
  if (v.isGenericDict()) {
    const auto d = v.toGenericDict();
    c10::impl::GenericDict out(d.keyType(), d.valueType());
    out.reserve(d.size());
    for (const auto& e : d) out.insert(e.key(), unshared(e.value(), copy_tensors));
    return out;
  }
  if (v.isList()) {
    const auto l = v.toList();
    c10::impl::GenericList out(c10::AnyType::get());  // a plain list: a typed one pickles as a builder call
    out.reserve(l.size());
    for (const auto& e : l) out.push_back(unshared(e, copy_tensors));
    return out;
  }
  if (v.isTuple() && copy_tensors) return v.deepcopy();
  return v;
}

namespace detail {

/// `torch::pickle_save(v)` (the zip of `torch.save`: `data.pkl` and one record per tensor) without the type tags
/// LibTorch's pickler puts on dicts and lists (`torch.jit._pickle.restore_type_tag`): Python's
/// `torch.load(weights_only=True)`, PyTorch's default since 2.6, refuses any global but tensors and plain containers.
/// Read back, every dict and list is of any element, which volt's readers take.
inline std::vector<char> pickle_plain(const c10::IValue& v) {
  std::vector<char> data;
  torch::jit::Pickler pickler([&](const char* buf, size_t size) { data.insert(data.end(), buf, buf + size); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(v);
  pickler.stop();
  std::vector<char> zip;
  zip.reserve(data.size());
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t len) {
      const char* b = static_cast<const char*>(bytes);
      zip.insert(zip.end(), b, b + len);
      return len;
    });
    torch::jit::writeArchiveAndTensors("data", data.data(), data.size(), pickler.tensorData(), writer);
  }  // the writer ends the zip as it goes
  return zip;
}

}  // namespace detail

/// Where the weights-only safetensors file of the checkpoint at `path` goes: beside it, its `.ckpt` replaced
/// (`epoch=1-step=20.ckpt` -> `epoch=1-step=20.safetensors`; a path with another ending gets `.safetensors` added).
inline std::string weights_beside(const std::string& path) {
  std::filesystem::path p(path);
  if (p.extension() == ".ckpt") return p.replace_extension(".safetensors").string();
  return path + ".safetensors";
}

/// A checkpoint's `state_dict` as a safetensors file's tensors (metadata `"format": "pt"`, what Hugging Face's
/// loaders look for): the weights as the checkpoint holds them, after every on_save_checkpoint hook (EMA's average
/// where that callback runs). `path` names the checkpoint in the message for an entry that is not a tensor.
inline TensorFile weights_of(const Dict& contents, const std::string& path) {
  TensorFile file{.tensors = {}, .metadata = {{"format", "pt"}}};
  if (!contents.contains(keys::state_dict) || !contents.at(keys::state_dict).isGenericDict()) {
    throw CheckpointError("volt: the checkpoint for " + path + " has no state_dict dictionary, so there are no "
                          "weights to write beside it as safetensors.");
  }
  for (const auto& e : contents.at(keys::state_dict).toGenericDict()) {
    const std::string name = e.key().isString() ? e.key().toStringRef() : e.key().tagKind();
    if (!e.key().isString() || !e.value().isTensor()) {
      throw CheckpointError("volt: the state_dict of the checkpoint for " + path + " holds a " + e.value().tagKind() +
                            " under \"" + name + "\"; a safetensors file holds named tensors only (an "
                            "on_save_checkpoint hook put it there?).");
    }
    file.tensors.emplace_back(name, e.value().toTensor());
  }
  return file;
}

/// Stamps `contents` with the format, the versions and its checksum, and writes it atomically to each of `paths` in
/// order (the same bytes; serialized once). `weights_beside_each`: after each checkpoint, its state_dict as
/// safetensors at `weights_beside(path)`, written atomically too (a process killed between the two leaves a
/// checkpoint without its weights file, never a partial file). Without it, a weights file an earlier run left at
/// `weights_beside(path)` is deleted before the checkpoint is written.
inline void save(const std::vector<std::string>& paths, const Dict& given, bool weights_beside_each = false) {
  const std::string path = paths.empty() ? std::string() : paths.front();
  Dict contents = unshared(given, /*copy_tensors=*/false).toGenericDict();  // the same bytes whoever shares a piece
  optimizers_to_pytorch(contents);  // Adam's, AdamW's and SGD's state as PyTorch's state_dict (pytorch_optimizer.hpp)
  contents.insert_or_assign("format", std::string(kFormat));
  contents.insert_or_assign("format_version", kFormatVersion);
  contents.insert_or_assign("volt_version", std::string(version_string));
  contents.insert_or_assign("torch_version", std::string(TORCH_VERSION));
  (void)contents.erase("checksum");
  const uint32_t sum = detail::checksum(contents, 0);
  contents.insert("checksum", static_cast<int64_t>(sum));
  const TensorFile weights = weights_beside_each ? weights_of(contents, path) : TensorFile{};
  std::vector<char> bytes;
  try {
    bytes = detail::pickle_plain(contents);
  } catch (const c10::Error& e) {
    throw CheckpointError("volt: serializing the checkpoint for " + path + " failed: " + detail::first_line(e.what()));
  }
  for (const auto& p : paths) {
    // A weights file never stands beside a checkpoint of another step: an earlier run's goes before this one lands.
    std::error_code ec;
    if (!weights_beside_each) std::filesystem::remove(weights_beside(p), ec);
    write_atomic(p, bytes.data(), bytes.size());
    if (weights_beside_each) safetensors::write(weights_beside(p), weights);
  }
}

/// Stamps `contents` and writes it atomically to `path`.
inline void save(const std::string& path, const Dict& contents) { save(std::vector<std::string>{path}, contents); }

/// Writes checkpoints on a thread of its own, one save at a time: `submit` returns once the contents are copied to
/// host memory, and waits first for the save in flight (as torchtitan's asynchronous checkpoints). The files are
/// the bytes `save` writes, written and renamed the same way (a process killed mid-write leaves each previous file
/// whole). A failed write is thrown, as a CheckpointError naming the file, by the next `submit` or `wait`.
class AsyncWriter {
 public:
  AsyncWriter() = default;
  AsyncWriter(AsyncWriter&&) noexcept = default;
  AsyncWriter& operator=(AsyncWriter&&) noexcept = default;
  /// Waits for the save in flight; an error it had is printed (a destructor cannot throw).
  ~AsyncWriter() {
    try {
      wait();
    } catch (const std::exception& e) {
      std::cerr << e.what() << '\n';
    }
  }

  /// Copies `contents` to host memory, then writes it to each of `paths` in order on the writer's thread (with the
  /// safetensors file beside each where `weights_beside_each`, as `save`) and calls `done` there once all are in
  /// place (ModelCheckpoint deletes the files that left its top k then).
  void submit(std::vector<std::string> paths, const Dict& contents, bool weights_beside_each = false,
              std::function<void()> done = {}) {
    wait();
    Dict copy = unshared(contents, /*copy_tensors=*/true).toGenericDict();
    pending_ = std::async(std::launch::async, [paths = std::move(paths), copy = std::move(copy), weights_beside_each,
                                               done = std::move(done)]() mutable {
      save(paths, std::move(copy), weights_beside_each);
      if (done) done();
    });
  }
  /// Waits for the save in flight, if any; throws its error.
  void wait() {
    if (!pending_.valid()) return;
    std::future<void> f = std::move(pending_);
    f.get();
  }

 private:
  std::future<void> pending_;
};

}  // namespace checkpoint

/// How `Trainer::save_checkpoint` writes a checkpoint.
struct SaveOptions {
  bool weights_only = false;     ///< the module's parameters and buffers only
  bool async_save = false;       ///< copied to host memory, then written on a thread (checkpoint::AsyncWriter)
  bool safetensors = false;      ///< also the weights as safetensors beside each file (checkpoint::weights_beside)
  std::function<void()> done{};  ///< on rank zero, once every file is in place (on the writer's thread when async)
};

}  // namespace volt

#include "volt/checkpoint/sharded.hpp"  // the sharded form: checkpoint::save_sharded, read_sharded
