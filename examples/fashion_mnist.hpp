#pragma once
// Reads the Fashion-MNIST IDX files (gzip) that Debian's dataset-fashion-mnist package installs.

#include <torch/types.h>
#include <zlib.h>

#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

namespace fashion_mnist {

inline const char* default_dir = "/usr/share/datasets/fashion-mnist";

inline std::vector<uint8_t> read_gz(const std::filesystem::path& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) {
    throw std::runtime_error("cannot open " + path.string() +
                             ". Install the dataset with `apt-get install dataset-fashion-mnist` "
                             "or pass --data-dir to a folder holding the four *-idx*-ubyte.gz files.");
  }
  std::vector<uint8_t> out;
  uint8_t buf[1 << 16];
  int n = 0;
  while ((n = gzread(f, buf, sizeof buf)) > 0) out.insert(out.end(), buf, buf + n);
  gzclose(f);
  if (n < 0) throw std::runtime_error("corrupt gzip file " + path.string());
  return out;
}

inline uint32_t be32(const std::vector<uint8_t>& b, std::size_t at) {
  return (uint32_t(b[at]) << 24) | (uint32_t(b[at + 1]) << 16) | (uint32_t(b[at + 2]) << 8) | uint32_t(b[at + 3]);
}

/// The files `load` reads, or the first one missing from `dir` (empty when all are there).
inline std::string missing_file(const std::filesystem::path& dir) {
  for (const char* name : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                           "t10k-labels-idx1-ubyte.gz"}) {
    if (!std::filesystem::is_regular_file(dir / name)) return (dir / name).string();
  }
  return {};
}

/// Images as float [N, 1, 28, 28] normalised to mean 0 / std 1 (the training set's statistics), labels as int64 [N].
inline std::pair<torch::Tensor, torch::Tensor> load(const std::filesystem::path& dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  const auto images = read_gz(dir / (prefix + "-images-idx3-ubyte.gz"));
  const auto labels = read_gz(dir / (prefix + "-labels-idx1-ubyte.gz"));
  if (images.size() < 16 || be32(images, 0) != 2051 || labels.size() < 8 || be32(labels, 0) != 2049) {
    throw std::runtime_error("not Fashion-MNIST IDX files in " + dir.string());
  }
  const int64_t n = be32(images, 4), rows = be32(images, 8), cols = be32(images, 12);
  if (static_cast<int64_t>(be32(labels, 4)) != n || images.size() != 16 + std::size_t(n * rows * cols)) {
    throw std::runtime_error("truncated Fashion-MNIST files in " + dir.string());
  }
  auto x = torch::from_blob(const_cast<uint8_t*>(images.data() + 16), {n, 1, rows, cols}, torch::kUInt8)
               .to(torch::kFloat32)
               .div_(255.0)
               .sub_(0.2860)
               .div_(0.3530);
  auto y = torch::from_blob(const_cast<uint8_t*>(labels.data() + 8), {n}, torch::kUInt8).to(torch::kInt64);
  return {x, y};
}

}  // namespace fashion_mnist
