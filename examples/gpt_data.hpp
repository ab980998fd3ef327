#pragma once
// The GPT example's text (examples/gpt.cpp, bench/gpt.cpp): files read whole, a character vocabulary, and windows
// of tokens that never cross from one file into the next.

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace gpt {

/// The files of `path` (a file, or a folder's .txt files in name order), each one string.
inline std::vector<std::string> read_texts(const std::filesystem::path& path) {
  std::vector<std::filesystem::path> files;
  if (std::filesystem::is_directory(path)) {
    for (const auto& e : std::filesystem::directory_iterator(path)) {
      if (e.path().extension() == ".txt") files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
  } else if (std::filesystem::exists(path)) {
    files.push_back(path);
  }
  std::vector<std::string> texts;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    texts.push_back(s.str());
  }
  return texts;
}

/// Characters to token ids and back.
struct Vocabulary {
  std::vector<char> chars;  // in the order of their byte values (0 to 255)
  std::map<char, int64_t> ids;
  explicit Vocabulary(const std::vector<std::string>& texts) {
    std::set<unsigned char> seen;
    for (const auto& t : texts) seen.insert(t.begin(), t.end());
    chars.assign(seen.begin(), seen.end());
    for (std::size_t i = 0; i < chars.size(); ++i) ids[chars[i]] = static_cast<int64_t>(i);
  }
  int64_t size() const { return static_cast<int64_t>(chars.size()); }
};

/// Windows of `context + 1` tokens that never cross from one file into the next: each file cut every `context`
/// tokens, its last window shorter (padded with token 0) where the file does not fill it. Rows of tokens, and each
/// row's count of tokens that have a next token to predict (the loss counts only those).
inline std::pair<torch::Tensor, torch::Tensor> windows(const std::vector<std::string>& texts, const Vocabulary& v,
                                                int64_t context) {
  std::vector<int64_t> tokens, lengths;
  for (const auto& t : texts) {
    const auto n = static_cast<int64_t>(t.size());
    for (int64_t start = 0; start + 1 < n; start += context) {
      const int64_t len = std::min(context, n - 1 - start);
      for (int64_t i = 0; i <= context; ++i) tokens.push_back(i <= len ? v.ids.at(t[start + i]) : 0);
      lengths.push_back(len);
    }
  }
  const auto rows = static_cast<int64_t>(lengths.size());
  return {torch::tensor(tokens).view({rows, context + 1}), torch::tensor(lengths)};
}

}  // namespace gpt
