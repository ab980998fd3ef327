#pragma once
/// \file
/// TensorBoard's event-file format, written by hand: TFRecord framing around `tensorboard.Event` protocol-buffer
/// messages, as TensorFlow's and PyTorch's `SummaryWriter` write them.
///
/// A record is `uint64 length`, `uint32 masked_crc32c(length bytes)`, `length` bytes of data and
/// `uint32 masked_crc32c(data)`, all little-endian; CRC-32C is the Castagnoli polynomial, masked as
/// `((crc >> 15) | (crc << 17)) + 0xa282ead8`. The messages used (field numbers from tensorboard/compat/proto and
/// tensorboard/plugins/hparams, checked against tensorboard 2.21's descriptors):
///
/// | message | fields volt writes |
/// |---|---|
/// | `Event` | `wall_time` 1 (double), `step` 2 (int64), `file_version` 3 (string), `summary` 5 |
/// | `Summary` | `value` 1 (repeated `Summary.Value`) |
/// | `Summary.Value` | `tag` 1, `simple_value` 2 (float), `metadata` 9, `tensor` 8 |
/// | `SummaryMetadata` | `plugin_data` 1 (`plugin_name` 1, `content` 2 bytes) |
/// | `TensorProto` | `dtype` 1 (DT_STRING = 7), `tensor_shape` 2 (`dim` 2: `size` 1), `string_val` 8 |
/// | `HParamsPluginData` | `version` 1, `experiment` 2, `session_start_info` 3, `session_end_info` 4 |
/// | `Experiment` | `hparam_infos` 4 (`name` 1, `type` 4), `metric_infos` 5 (`name` 1: `tag` 2) |
/// | `SessionStartInfo` | `hparams` 1 (map of string to `google.protobuf.Value`), `start_time_secs` 5 |
/// | `SessionEndInfo` | `status` 1 (1 success, 2 failure), `end_time_secs` 2 |
/// | `google.protobuf.Value` | `number_value` 2, `string_value` 3, `bool_value` 4 |
///
/// Encoding by hand (about a hundred lines) instead of with libprotobuf: a header-only library would otherwise need
/// TensorBoard's .proto files compiled by protoc at the user's build, and a libprotobuf whose version matches both
/// the generated code and the one pip's LibTorch links; the handful of fields above never change meaning (protocol
/// buffers keep field numbers forever). zlib has CRC-32 but not CRC-32C, so that is here too.

#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace volt::tensorboard {

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `data`.
inline uint32_t crc32c(std::string_view data) {
  static constexpr auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (const char ch : data) crc = table[(crc ^ static_cast<uint8_t>(ch)) & 0xFFu] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

/// The masked CRC TFRecord stores (so that a CRC of data that holds CRCs is not degenerate).
inline uint32_t masked_crc32c(std::string_view data) {
  const uint32_t crc = crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

namespace detail {
inline void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFFu));
}
}  // namespace detail

/// One TFRecord: framing and checksums around `data`.
inline std::string record(std::string_view data) {
  std::string out, length;
  detail::put_le(length, data.size(), 8);
  out.reserve(data.size() + 16);
  out += length;
  detail::put_le(out, masked_crc32c(length), 4);
  out.append(data);
  detail::put_le(out, masked_crc32c(data), 4);
  return out;
}

/// Protocol-buffer wire encoding of one message, field by field (wire types 0, 1, 2 and 5).
class Proto {
 public:
  Proto& varint(int field, uint64_t v) {
    key(field, 0);
    raw_varint(v);
    return *this;
  }
  Proto& int64(int field, int64_t v) { return varint(field, static_cast<uint64_t>(v)); }
  Proto& f64(int field, double v) {
    key(field, 1);
    uint64_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    detail::put_le(bytes_, bits, 8);
    return *this;
  }
  Proto& f32(int field, float v) {
    key(field, 5);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    detail::put_le(bytes_, bits, 4);
    return *this;
  }
  Proto& bytes(int field, std::string_view v) {
    key(field, 2);
    raw_varint(v.size());
    bytes_.append(v);
    return *this;
  }
  Proto& message(int field, const Proto& m) { return bytes(field, m.bytes_); }
  const std::string& str() const { return bytes_; }

 private:
  void key(int field, int wire_type) { raw_varint((static_cast<uint64_t>(field) << 3) | static_cast<uint64_t>(wire_type)); }
  void raw_varint(uint64_t v) {
    while (v >= 0x80u) {
      bytes_.push_back(static_cast<char>((v & 0x7Fu) | 0x80u));
      v >>= 7;
    }
    bytes_.push_back(static_cast<char>(v));
  }
  std::string bytes_;
};

/// A hyper-parameter's value, as TensorBoard's HPARAMS plugin types them: a number (any arithmetic type, kept as a
/// double), a bool or a string.
struct HParam {
  std::variant<double, bool, std::string> value;
  HParam(bool b) : value(b) {}
  template <class N>
    requires(std::is_arithmetic_v<N> && !std::is_same_v<N, bool>)
  HParam(N n) : value(static_cast<double>(n)) {}
  HParam(std::string s) : value(std::move(s)) {}
  HParam(const char* s) : value(std::string(s)) {}
};

/// `Event{wall_time, step, summary}` around the given `Summary.Value`s.
inline std::string event(double wall_time, int64_t step, const std::vector<Proto>& values) {
  Proto summary;
  for (const auto& v : values) summary.message(1, v);
  return Proto().f64(1, wall_time).int64(2, step).message(5, summary).str();
}

/// The first event of every file: `file_version = "brain.Event:2"`.
inline std::string file_version_event(double wall_time) {
  return Proto().f64(1, wall_time).bytes(3, "brain.Event:2").str();
}

/// A scalar, as `SummaryWriter.add_scalar` writes it (`simple_value`, a float).
inline Proto scalar_value(std::string_view tag, double value) {
  return Proto().bytes(1, tag).f32(2, static_cast<float>(value));
}

/// A text (markdown) for TensorBoard's TEXT tab, as `SummaryWriter.add_text` writes it (tag `<tag>/text_summary`).
inline Proto text_value(std::string_view tag, std::string_view text) {
  const Proto plugin = Proto().bytes(1, "text").bytes(2, Proto().varint(1, 0).str());  // TextPluginData{version 0}
  const Proto shape = Proto().message(2, Proto().int64(1, 1));
  const Proto tensor = Proto().varint(1, 7).message(2, shape).bytes(8, text);  // DT_STRING, shape [1]
  return Proto().bytes(1, std::string(tag) + "/text_summary").message(9, Proto().message(1, plugin)).message(8, tensor);
}

namespace detail {
/// `Summary.Value{tag, metadata{plugin_data{"hparams", HParamsPluginData{version 0, <which> = data}}}}`.
inline Proto hparams_value(std::string_view tag, int which, const Proto& data) {
  const Proto content = Proto().varint(1, 0).message(which, data);
  const Proto plugin = Proto().bytes(1, "hparams").bytes(2, content.str());
  return Proto().bytes(1, tag).message(9, Proto().message(1, plugin));
}
inline Proto protobuf_value(const HParam& hp) {
  const auto& v = hp.value;
  if (const auto* d = std::get_if<double>(&v)) return Proto().f64(2, *d);
  if (const auto* s = std::get_if<std::string>(&v)) return Proto().bytes(3, *s);
  return Proto().varint(4, std::get<bool>(v) ? 1 : 0);
}
}  // namespace detail

/// The HPARAMS plugin's experiment: each hyper-parameter's name and type, and the metric tags to show beside them
/// (the same three summaries as `torch.utils.tensorboard.summary.hparams`: this, then session start and end).
inline Proto hparams_experiment(const std::map<std::string, HParam>& hparams, const std::vector<std::string>& metrics) {
  Proto experiment;
  for (const auto& [name, value] : hparams) {
    const auto& v = value.value;
    const int type = std::holds_alternative<std::string>(v) ? 1 : std::holds_alternative<bool>(v) ? 2 : 3;
    experiment.message(4, Proto().bytes(1, name).varint(4, static_cast<uint64_t>(type)));
  }
  for (const auto& tag : metrics) experiment.message(5, Proto().message(1, Proto().bytes(2, tag)));
  return detail::hparams_value("_hparams_/experiment", 2, experiment);
}

/// The session's hyper-parameter values.
inline Proto hparams_session_start(const std::map<std::string, HParam>& hparams, double start_time) {
  Proto start;
  for (const auto& [name, value] : hparams) {
    start.message(1, Proto().bytes(1, name).message(2, detail::protobuf_value(value)));  // a map entry
  }
  start.f64(5, start_time);
  return detail::hparams_value("_hparams_/session_start_info", 3, start);
}

/// The session's end: `success` (status 1) or a failure (status 2).
inline Proto hparams_session_end(bool success, double end_time) {
  return detail::hparams_value("_hparams_/session_end_info", 4, Proto().varint(1, success ? 1 : 2).f64(2, end_time));
}

}  // namespace volt::tensorboard
