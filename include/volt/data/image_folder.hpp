#pragma once
/// \file
/// `volt::data::ImageFolder`: a data set of PNG files, one image per file, laid out as torchvision's
/// ImageFolder: `root/<class>/<name>.png`, classes in sorted order (their index is the target), files sorted
/// within each. A sample is read and decoded when it is asked for, on a loader worker when there are workers:
/// use it with `SampleLoader`, which hands each sample its own generator for random augmentation.
/// \code
///   volt::data::ImageFolder images("data/train", {.channels = 1},
///                                  [](torch::Tensor img, at::Generator& gen) {  // a random horizontal flip
///                                    return torch::rand({1}, gen).item<float>() < 0.5f ? img.flip({2}) : img;
///                                  });
///   volt::data::SampleLoader train(std::move(images), {.batch_size = 64, .shuffle = true, .num_workers = 2});
/// \endcode
/// Decoding is libpng's (its simplified API: any bit depth, palette, interlacing or alpha, converted to 8-bit grey
/// or RGB), so a program that includes this header links `volt::png` (CMake), which brings libpng.

#include <ATen/core/Generator.h>
#include <png.h>
#include <torch/data/example.h>
#include <torch/types.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace volt::data {

/// The PNG at `path` as a uint8 tensor [channels, height, width]; `channels` is 1 (grey) or 3 (RGB), converted
/// from whatever the file holds.
inline torch::Tensor read_png(const std::string& path, int channels) {
  if (channels != 1 && channels != 3) {
    throw std::invalid_argument("volt: read_png channels=" + std::to_string(channels) + " is not allowed: give 1 or 3.");
  }
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  if (png_image_begin_read_from_file(&image, path.c_str()) == 0) {
    throw std::runtime_error("volt: cannot read the PNG " + path + ": " + image.message);
  }
  image.format = channels == 1 ? PNG_FORMAT_GRAY : PNG_FORMAT_RGB;
  torch::Tensor hwc;
  try {
    hwc = torch::empty({image.height, image.width, channels}, torch::kUInt8);
  } catch (...) {
    png_image_free(&image);  // closes the file
    throw;
  }
  if (png_image_finish_read(&image, nullptr, hwc.data_ptr<uint8_t>(), 0, nullptr) == 0) {
    const std::string why = image.message;
    png_image_free(&image);
    throw std::runtime_error("volt: cannot decode the PNG " + path + ": " + why);
  }
  return hwc.permute({2, 0, 1}).contiguous();
}

struct ImageFolderOptions {
  /// 1: grey, 3: RGB (each file is converted).
  int channels = 3;
};

class ImageFolder {
 public:
  using Options = ImageFolderOptions;
  /// Applied to each decoded image (float [C, H, W] in [0, 1]); draws its randomness from `gen` only.
  using Transform = std::function<torch::Tensor(torch::Tensor image, at::Generator& gen)>;

  explicit ImageFolder(const std::string& root, Options options = {}, Transform transform = {})
      : options_(options), transform_(std::move(transform)) {
    namespace fs = std::filesystem;
    if (!fs::is_directory(root)) {
      throw std::invalid_argument("volt: ImageFolder root " + root + " is not a folder; expected root/<class>/<image>.png.");
    }
    for (const auto& entry : fs::directory_iterator(root)) {
      if (entry.is_directory()) classes_.push_back(entry.path().filename().string());
    }
    std::sort(classes_.begin(), classes_.end());
    std::string empty;  // class folders without an image: each would be a class no sample has, as torchvision refuses
    for (std::size_t c = 0; c < classes_.size(); ++c) {
      std::vector<std::string> files;
      for (const auto& entry : fs::directory_iterator(fs::path(root) / classes_[c])) {
        if (entry.is_regular_file() && is_png(entry.path())) files.push_back(entry.path().string());
      }
      if (files.empty()) empty += (empty.empty() ? "" : ", ") + classes_[c];
      std::sort(files.begin(), files.end());
      for (auto& f : files) samples_.emplace_back(std::move(f), static_cast<int64_t>(c));
    }
    if (classes_.empty()) {
      throw std::invalid_argument("volt: ImageFolder found no class folders in " + root +
                                  "; expected root/<class>/<image>.png.");
    }
    if (!empty.empty()) {
      throw std::invalid_argument("volt: ImageFolder found no valid file for the classes " + empty + " in " + root +
                                  " (every class folder becomes a class index, so an empty one would shift the "
                                  "labels). Supported extensions are: .png (in any case). Remove the empty folders or "
                                  "put their images in.");
    }
  }

  /// Whether `file` is a PNG by its extension, compared without case (`.png`, `.PNG`), as torchvision compares.
  static bool is_png(const std::filesystem::path& file) {
    std::string ext = file.extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char ch) { return std::tolower(ch); });
    return ext == ".png";
  }

  int64_t size() const { return static_cast<int64_t>(samples_.size()); }
  /// Class names, in the order of their target index.
  const std::vector<std::string>& classes() const { return classes_; }
  /// Only a transform draws random numbers: without one, SampleLoader does not seed a generator per sample.
  bool draws_random() const { return static_cast<bool>(transform_); }
  /// The file of sample `index`.
  const std::string& path(int64_t index) const { return samples_.at(static_cast<std::size_t>(index)).first; }

  /// Image `index` as float [C, H, W] in [0, 1] (transformed, drawing from `gen`) and its class index.
  torch::data::Example<> get(int64_t index, at::Generator& gen) const {
    const auto& [file, label] = samples_.at(static_cast<std::size_t>(index));
    torch::Tensor image = read_png(file, options_.channels).to(torch::kFloat32).div_(255.0);
    if (transform_) image = transform_(std::move(image), gen);
    return {image, torch::scalar_tensor(label, torch::kLong)};
  }

 private:
  Options options_;
  Transform transform_;
  std::vector<std::string> classes_;
  std::vector<std::pair<std::string, int64_t>> samples_;
};

}  // namespace volt::data
