// Catch2 entry point. GPU-tagged runs (a tag that starts with "[gpu": "[gpu]", "[gpu_activation]") exit with 77
// (CTest: skipped) where no CUDA device is visible, so the same test binary serves the developer machines and the
// GPU host. The folders the tests made with vt::scratch (test/support/models.hpp: volt_ckpt_test_<pid> under the
// system's temporary folder) go when the run ends.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <torch/cuda.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "[gpu", 4) == 0 && !torch::cuda::is_available()) {
      std::cout << "no CUDA device visible: GPU tests skipped\n";
      return 77;
    }
  }
  const int failed = Catch::Session().run(argc, argv);
  std::error_code ec;
  const auto root = std::filesystem::temp_directory_path(ec) / ("volt_ckpt_test_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root, ec);
  return failed;
}
