#pragma once
/// \file
/// `volt::detail::CudaGraph`: the graph type of the GPU accelerator (see volt/accelerators/graphed.hpp for what a
/// graph type does). It wraps LibTorch's `at::cuda::CUDAGraph` and the side stream that warm-up and capture run on,
/// as PyTorch's `torch.cuda.graph` does. Compiled where LibTorch has CUDA (`VOLT_WITH_CUDA=1`, which volt's CMake
/// target defines for a CUDA build of LibTorch); elsewhere only `available = false` is left, and the compile-time
/// rules refuse `Graphed<GPU>` with the fix.

#ifndef VOLT_WITH_CUDA
#define VOLT_WITH_CUDA 0
#endif

#include <c10/core/Device.h>

#if VOLT_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <exception>
#include <memory>
#include <optional>
#include <utility>
#endif

namespace volt::detail {

class CudaGraph {
 public:
  /// Whether CUDA graphs are compiled in.
  static constexpr bool available = VOLT_WITH_CUDA != 0;

#if VOLT_WITH_CUDA
  /// Runs `f` (a real, eager step) on the stream captures will use: before the first capture PyTorch warms up on
  /// that stream, so that lazy set-up (cuBLAS workspaces, autograd's device threads) happens outside any graph.
  /// The stream waits for the device's current work first, and the current stream waits for it after.
  template <class F>
  void run_eager(const c10::Device& device, F&& f) {
    c10::cuda::CUDAGuard device_guard(device);
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device.index());
    const c10::cuda::CUDAStream& side = side_stream(device);
    wait(side, current);
    {
      c10::cuda::CUDAStreamGuard on_side(side);
      std::forward<F>(f)();
    }
    wait(current, side);
  }

  /// Records `f`'s device work into this graph without running it (its host code runs once, now). `shared` is a
  /// graph of the same trainer already captured: this one allocates from its memory pool (they replay one at a time
  /// on one stream, and what each must keep, its outputs, stays referenced). A failure ends the capture and throws.
  template <class F>
  void capture(const c10::Device& device, F&& f, const CudaGraph* shared) {
    c10::cuda::CUDAGuard device_guard(device);
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device.index());
    const c10::cuda::CUDAStream& side = shared != nullptr && shared->stream_ ? *shared->stream_ : side_stream(device);
    stream_ = side;
    c10::cuda::device_synchronize();  // nothing of the eager steps still in flight (as torch.cuda.graph)
    graph_ = std::make_unique<at::cuda::CUDAGraph>();
    {
      c10::cuda::CUDAStreamGuard on_side(side);
      const c10::cuda::MempoolId_t pool =
          shared != nullptr && shared->graph_ ? shared->graph_->pool() : c10::cuda::MempoolId_t{0, 0};
      // Global, as torch.cuda.graph: a host wait in `f` (or any thread's unsafe CUDA call) fails the capture.
      graph_->capture_begin(pool, cudaStreamCaptureModeGlobal);
      try {
        std::forward<F>(f)();
      } catch (...) {
        try {
          graph_->capture_end();
        } catch (...) {  // the capture was invalidated: the first error says why
        }
        graph_.reset();
        throw;
      }
      graph_->capture_end();
    }
    wait(current, side);
  }

  /// Runs the recorded work on the current stream.
  void replay() { graph_->replay(); }

 private:
  const c10::cuda::CUDAStream& side_stream(const c10::Device& device) {
    if (!stream_) stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
    return *stream_;
  }
  static void wait(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& on) {
    at::cuda::CUDAEvent event;
    event.record(on);
    event.block(waiter);
  }

  std::optional<c10::cuda::CUDAStream> stream_;
  std::unique_ptr<at::cuda::CUDAGraph> graph_;
#endif
};

}  // namespace volt::detail
