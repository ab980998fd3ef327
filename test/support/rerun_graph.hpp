#pragma once
// A graph type of one's own for the compile-fail tests of graph mode's rules, so that the rule is reached on every
// LibTorch line (a build without CUDA has no CUDA graph): `volt::Graphed<GraphCPU>` passes the accelerator rules.
#include <volt/volt.hpp>
struct RerunGraph {
  static constexpr bool available = true;
  template <class F> void run_eager(const c10::Device&, F&& f) { f(); }
  template <class F> void capture(const c10::Device&, F&&, const RerunGraph*) {}
  void replay() {}
};
struct GraphCPU : volt::CPU { using graph_type = RerunGraph; };
