#pragma once
// Writes an 8-bit greyscale PNG with zlib (the PNG format: a signature, then IHDR, IDAT and IEND chunks, each with its
// length and CRC-32; the pixel rows, each led by filter byte 0, deflated as one zlib stream). Written to a temporary
// file and renamed, so a reader never sees half an image.

#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace png {

inline void put32(std::string& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out += static_cast<char>((v >> shift) & 0xff);
}

inline void chunk(std::string& out, const char* type, const std::string& data) {
  put32(out, static_cast<uint32_t>(data.size()));
  const std::string body = std::string(type, 4) + data;
  out += body;
  put32(out, static_cast<uint32_t>(crc32(0L, reinterpret_cast<const Bytef*>(body.data()), static_cast<uInt>(body.size()))));
}

/// Writes `pixels` (row-major, `width` * `height` bytes, 0 black to 255 white) to `path`.
inline void write_gray(const std::filesystem::path& path, const std::vector<uint8_t>& pixels, uint32_t width,
                       uint32_t height) {
  if (pixels.size() != static_cast<std::size_t>(width) * height) {
    throw std::invalid_argument("png: " + std::to_string(pixels.size()) + " pixels for a " + std::to_string(width) +
                                " x " + std::to_string(height) + " image");
  }
  std::string rows;
  for (uint32_t y = 0; y < height; ++y) {
    rows += '\0';  // filter: none
    rows.append(reinterpret_cast<const char*>(pixels.data()) + static_cast<std::size_t>(y) * width, width);
  }
  uLongf size = compressBound(static_cast<uLong>(rows.size()));
  std::string deflated(size, '\0');
  if (compress2(reinterpret_cast<Bytef*>(deflated.data()), &size, reinterpret_cast<const Bytef*>(rows.data()),
                static_cast<uLong>(rows.size()), Z_BEST_COMPRESSION) != Z_OK) {
    throw std::runtime_error("png: zlib could not compress " + path.string());
  }
  deflated.resize(size);
  std::string file = "\x89PNG\r\n\x1a\n";
  std::string header;
  put32(header, width);
  put32(header, height);
  header += std::string("\x08\x00\x00\x00\x00", 5);  // 8 bits, greyscale, deflate, no filter set, no interlace
  chunk(file, "IHDR", header);
  chunk(file, "IDAT", deflated);
  chunk(file, "IEND", "");
  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    out.write(file.data(), static_cast<std::streamsize>(file.size()));
    if (!out.flush()) throw std::runtime_error("png: could not write " + tmp.string());
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace png
