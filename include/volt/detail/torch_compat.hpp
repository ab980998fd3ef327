#pragma once
/// \file
/// Every difference between the LibTorch lines volt supports lives here, and nowhere else:
/// Debian's 1.13.1 (CPU) and 2.x with CUDA (2.11 is tested). Code elsewhere calls these wrappers.

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <torch/cuda.h>
#include <torch/optim/optimizer.h>
#include <torch/version.h>

#include <dlfcn.h>

#include <cstdint>
#include <utility>

namespace volt::detail {

/// LibTorch's version as one comparable number: 1.13.1 -> 11301, 2.11.0 -> 21100.
inline constexpr int torch_version = TORCH_VERSION_MAJOR * 10000 + TORCH_VERSION_MINOR * 100 + TORCH_VERSION_PATCH;

// LibTorch 2.4 replaced the per-device autocast functions (set_cpu_enabled, set_autocast_gpu_dtype, ...)
// with ones taking a DeviceType; the wrappers below choose by version.

inline bool autocast_enabled(c10::DeviceType device) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  return at::autocast::is_autocast_enabled(device);
#else
  return device == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}

inline void set_autocast_enabled(c10::DeviceType device, bool enabled) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  at::autocast::set_autocast_enabled(device, enabled);
#else
  if (device == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(enabled);
  } else {
    at::autocast::set_enabled(enabled);
  }
#endif
}

inline at::ScalarType autocast_dtype(c10::DeviceType device) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  return at::autocast::get_autocast_dtype(device);
#else
  return device == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                        : at::autocast::get_autocast_gpu_dtype();
#endif
}

inline void set_autocast_dtype(c10::DeviceType device, at::ScalarType dtype) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  at::autocast::set_autocast_dtype(device, dtype);
#else
  if (device == c10::DeviceType::CPU) {
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
#endif
}

/// RAII autocast region for one device type, as Python's `torch.autocast(device, dtype)`: it enables
/// autocast, sets the dtype, and on leaving the outermost region clears the cast-weight cache and
/// restores what was there before.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, at::ScalarType dtype)
      : device_(device), prev_enabled_(autocast_enabled(device)), prev_dtype_(autocast_dtype(device)) {
    set_autocast_enabled(device_, true);
    set_autocast_dtype(device_, dtype);
    at::autocast::increment_nesting();
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  ~AutocastGuard() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    set_autocast_enabled(device_, prev_enabled_);
    set_autocast_dtype(device_, prev_dtype_);
  }

 private:
  c10::DeviceType device_;
  bool prev_enabled_;
  at::ScalarType prev_dtype_;
};

/// LibTorch 2.4 added fused Adam, AdamW and SGD kernels on the CPU (CUDA had them before); volt::optim uses them
/// from there on, on both devices.
inline constexpr bool has_fused_optimizer_kernels = torch_version >= 20400;

/// `at::_fused_adamw_` (weight decay decoupled) or `at::_fused_adam_`, with their arguments; a no-op before 2.4,
/// where volt::optim never calls it.
template <class... A>
void fused_adam(bool decoupled, A&&... args) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  decoupled ? at::_fused_adamw_(std::forward<A>(args)...) : at::_fused_adam_(std::forward<A>(args)...);
#else
  ((void)decoupled, ..., (void)args);
#endif
}

/// `at::_fused_sgd_` with its arguments; a no-op before 2.4, where volt::optim never calls it.
template <class... A>
void fused_sgd(A&&... args) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  at::_fused_sgd_(std::forward<A>(args)...);
#else
  ((void)args, ...);
#endif
}

/// Waits for all work queued on a CUDA device (no-op builds without CUDA are never asked).
inline void cuda_synchronize(int64_t device_index) { torch::cuda::synchronize(device_index); }

/// Makes LibTorch's operations on the calling thread run single-threaded (a loader worker's): its OpenMP team is
/// set to one thread after LibTorch's own per-thread set-up, which would otherwise reset it at the thread's first
/// kernel. That set-up runs inside LibTorch's library through `at::get_num_threads()` (the inline
/// `at::internal::lazy_init_num_threads` compiled here is another copy on LibTorch 2.x). The OpenMP runtime is the
/// one LibTorch loaded, found at run time, so volt links none. Nothing happens where LibTorch runs without OpenMP.
inline void serial_intra_op_in_this_thread() {
  (void)at::get_num_threads();
  using SetThreads = void (*)(int);
  static const auto set = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  if (set != nullptr) set(1);
}

}  // namespace volt::detail
