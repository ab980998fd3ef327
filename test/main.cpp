// Catch2 entry point. GPU-tagged runs (a tag that starts with "[gpu": "[gpu]", "[gpu_activation]") exit with 77
// (CTest: skipped) where no CUDA device is visible, so the same test binary serves the developer machines and the
// GPU host.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <torch/cuda.h>

#include <cstring>
#include <iostream>

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "[gpu", 4) == 0 && !torch::cuda::is_available()) {
      std::cout << "no CUDA device visible: GPU tests skipped\n";
      return 77;
    }
  }
  return Catch::Session().run(argc, argv);
}
