#include "tensorstash/format/safetensors/safetensors_header.h"

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "nlohmann/json.hpp"
#include "tensorstash/array/box.h"
#include "tensorstash/util/endian.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

using Json = nlohmann::json;

struct DTypeNameEntry {
  std::string_view name;
  DType dtype;
};

// safetensors' names of the dtypes both have. F8_E4M3 is torch's float8_e4m3fn (finite, with
// NaN), F8_E8M0 torch's float8_e8m0fnu.
constexpr DTypeNameEntry kDTypeNames[] = {
    {"BOOL", DType::kBool},         {"U8", DType::kUint8},
    {"I8", DType::kInt8},           {"F8_E5M2", DType::kFloat8E5m2},
    {"F8_E4M3", DType::kFloat8E4m3fn}, {"F8_E8M0", DType::kFloat8E8m0fnu},
    {"I16", DType::kInt16},         {"U16", DType::kUint16},
    {"F16", DType::kFloat16},       {"BF16", DType::kBfloat16},
    {"I32", DType::kInt32},         {"U32", DType::kUint32},
    {"F32", DType::kFloat32},       {"F64", DType::kFloat64},
    {"I64", DType::kInt64},         {"U64", DType::kUint64},
    {"C64", DType::kComplex64},
};

// The header as a SAX stream: tensors and metadata are built as the parser goes, so a repeated
// key (which a DOM would silently keep the last of) is seen and refused, and no DOM of a 100 MB
// header is built.
class HeaderScan final : public nlohmann::json_sax<Json> {
 public:
  explicit HeaderScan(std::string file) : file_(std::move(file)) {}

  bool null() override { return Fail("null where a value was expected"); }
  bool boolean(bool) override { return Fail("a boolean where a value was expected"); }
  bool number_integer(number_integer_t v) override {
    if (v < 0) return Fail(StrCat("a negative number (", v, ")"));
    return Number(static_cast<uint64_t>(v));
  }
  bool number_unsigned(number_unsigned_t v) override { return Number(v); }
  bool number_float(number_float_t, const string_t& s) override {
    return Fail(StrCat("a non-integer number (", s, ")"));
  }
  bool binary(binary_t&) override { return Fail("binary data"); }
  bool string(string_t& s) override {
    if (depth_ == 2 && in_metadata_) {
      header_.metadata.emplace_back(key1_, s);
      return true;
    }
    if (depth_ == 2 && key2_ == "dtype") {
      Result<DType> dtype = SafetensorsDTypeFromName(s, TensorWhat());
      if (!dtype.ok()) return Fail(dtype.status());
      current_.dtype = *dtype;
      have_dtype_ = true;
      return true;
    }
    return Fail("an unexpected string");
  }
  bool start_object(std::size_t) override {
    ++depth_;
    if (depth_ == 1) return true;
    if (depth_ == 2) {
      keys2_.clear();
      if (in_metadata_) return true;
      current_ = SafetensorsTensor{};
      current_.name = key1_;
      have_dtype_ = have_shape_ = have_offsets_ = false;
      return true;
    }
    return Fail("a nested object");
  }
  bool end_object() override {
    --depth_;
    if (depth_ == 1 && !in_metadata_) {
      if (!have_dtype_ || !have_shape_ || !have_offsets_) {
        return Fail(StrCat(TensorWhat(), " lacks ",
                           !have_dtype_ ? "\"dtype\"" : !have_shape_ ? "\"shape\"" : "\"data_offsets\""));
      }
      header_.tensors.push_back(std::move(current_));
    }
    return true;
  }
  bool start_array(std::size_t) override {
    ++depth_;
    if (depth_ == 3 && !in_metadata_ && (key2_ == "shape" || key2_ == "data_offsets")) {
      numbers_.clear();
      return true;
    }
    return Fail("an unexpected array");
  }
  bool end_array() override {
    --depth_;
    if (key2_ == "shape") {
      if (numbers_.size() > static_cast<size_t>(kMaxRank)) {
        return Fail(StrCat(TensorWhat(), " has rank ", numbers_.size(), ", more than ", kMaxRank));
      }
      current_.shape.clear();
      for (uint64_t n : numbers_) {
        if (n > static_cast<uint64_t>(INT64_MAX)) return Fail(StrCat(TensorWhat(), ": extent too large"));
        current_.shape.push_back(static_cast<int64_t>(n));
      }
      have_shape_ = true;
    } else {
      if (numbers_.size() != 2) {
        return Fail(StrCat(TensorWhat(), ": \"data_offsets\" has ", numbers_.size(),
                           " numbers instead of 2"));
      }
      current_.begin = numbers_[0];
      current_.end = numbers_[1];
      have_offsets_ = true;
    }
    return true;
  }
  bool key(string_t& key) override {
    if (depth_ == 1) {
      if (!keys1_.insert(key).second) {
        return Fail(key == "__metadata__" ? std::string("\"__metadata__\" appears twice")
                                          : StrCat("tensor '", key, "' appears twice"));
      }
      key1_ = key;
      in_metadata_ = key == "__metadata__";
      return true;
    }
    if (!keys2_.insert(key).second) {
      return Fail(StrCat(in_metadata_ ? std::string("\"__metadata__\"") : TensorWhat(),
                         ": key \"", key, "\" appears twice"));
    }
    key2_ = key;
    if (!in_metadata_ && key != "dtype" && key != "shape" && key != "data_offsets") {
      return Fail(StrCat(TensorWhat(), ": unknown member \"", key, "\""));
    }
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    std::string message = e.what();
    if (const size_t end = message.find("] "); end != std::string::npos) message.erase(0, end + 2);
    return Fail(StrCat("not valid JSON (", message, ")"));
  }

  Status status() const { return status_; }
  SafetensorsHeader& header() { return header_; }

 private:
  std::string TensorWhat() const { return StrCat("tensor '", key1_, "'"); }
  bool Number(uint64_t v) {
    if (depth_ == 3) {
      numbers_.push_back(v);
      return true;
    }
    return Fail("an unexpected number");
  }
  bool Fail(std::string what) {
    if (status_.ok()) {
      std::string where = depth_ >= 2 && !in_metadata_ && what.find("tensor '") == std::string::npos
                              ? StrCat(" (in ", TensorWhat(), ")")
                              : "";
      status_ = DataLossError(StrCat("safetensors file '", file_, "': header: ", what, where));
    }
    return false;
  }
  bool Fail(const Status& status) {
    if (status_.ok()) {
      status_ = Status(status.code(), StrCat("safetensors file '", file_, "': ", status.message()));
    }
    return false;
  }

  const std::string file_;
  Status status_;
  SafetensorsHeader header_;
  int depth_ = 0;
  std::string key1_, key2_;
  bool in_metadata_ = false;
  std::unordered_set<std::string> keys1_, keys2_;
  SafetensorsTensor current_;
  bool have_dtype_ = false, have_shape_ = false, have_offsets_ = false;
  std::vector<uint64_t> numbers_;
};

}  // namespace

Result<DType> SafetensorsDTypeFromName(std::string_view name, std::string_view where) {
  for (const DTypeNameEntry& e : kDTypeNames) {
    if (e.name == name) return e.dtype;
  }
  if (name == "F4" || name == "F6_E2M3" || name == "F6_E3M2") {
    return UnimplementedError(StrCat(where, ": dtype ", name,
                                     " (packed below a byte per element) is not supported"));
  }
  return DataLossError(StrCat(where, ": unknown dtype \"", EscapeBytes(name), "\""));
}

Result<std::string_view> SafetensorsDTypeName(DType dtype, std::string_view what) {
  for (const DTypeNameEntry& e : kDTypeNames) {
    if (e.dtype == dtype) return e.name;
  }
  return InvalidArgumentError(
      StrCat(what, ": safetensors has no dtype for ", DTypeName(dtype)));
}

Result<uint64_t> ParseSafetensorsHeaderLength(std::string_view prefix, uint64_t file_size,
                                              std::string_view file) {
  if (file_size < 8 || prefix.size() < 8) {
    return DataLossError(StrCat("safetensors file '", file, "' is ", file_size,
                                " bytes, too short for the 8-byte header length"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(prefix[i]);
  if (n > kSafetensorsMaxHeaderBytes) {
    return DataLossError(StrCat("safetensors file '", file, "': header length ", n,
                                " is over the limit of ", kSafetensorsMaxHeaderBytes, " bytes"));
  }
  if (n > file_size - 8) {
    return DataLossError(StrCat("safetensors file '", file, "': header length ", n,
                                " reaches past the end of the file (", file_size, " bytes)"));
  }
  return n;
}

Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json, uint64_t file_size,
                                                 std::string_view file) {
  const std::string where = StrCat("safetensors file '", file, "'");
  if (json.empty() || json.front() != '{') {
    return DataLossError(StrCat(where, ": header does not start with '{'"));
  }
  if (!IsValidUtf8(json)) return DataLossError(StrCat(where, ": header is not UTF-8"));
  HeaderScan scan{std::string(file)};
  const bool parsed = Json::sax_parse(json, &scan);
  if (!scan.status().ok()) return scan.status();
  if (!parsed) return DataLossError(StrCat(where, ": header is not valid JSON"));
  SafetensorsHeader header = std::move(scan.header());
  header.data_start = 8 + json.size();
  if (header.data_start > file_size) {
    return DataLossError(StrCat(where, ": header reaches past the end of the file"));
  }
  const uint64_t data_size = file_size - header.data_start;
  for (SafetensorsTensor& t : header.tensors) {
    const std::string what = StrCat(where, ": tensor '", t.name, "'");
    Result<int64_t> count = CheckedNumElements(t.shape, what);
    if (!count.ok()) return DataLossError(StrCat(what, ": shape overflows"));
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(*count), ItemSize(t.dtype), &bytes)) {
      return DataLossError(StrCat(what, ": size overflows"));
    }
    if (t.end < t.begin) {
      return DataLossError(StrCat(what, ": data_offsets [", t.begin, ", ", t.end,
                                  "] end before they begin"));
    }
    if (t.end - t.begin != bytes) {
      return DataLossError(StrCat(what, ": data_offsets [", t.begin, ", ", t.end, "] hold ",
                                  t.end - t.begin, " bytes, but ", DTypeName(t.dtype), " shape [",
                                  StrJoin(t.shape, ", "), "] needs ", bytes));
    }
    if (t.end > data_size) {
      return DataLossError(StrCat(what, ": data_offsets [", t.begin, ", ", t.end,
                                  "] reach past the end of the file (", data_size,
                                  " bytes of data)"));
    }
  }
  std::stable_sort(header.tensors.begin(), header.tensors.end(),
                   [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
                     return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
                   });
  uint64_t expected = 0;
  const SafetensorsTensor* previous = nullptr;
  for (const SafetensorsTensor& t : header.tensors) {
    if (t.begin < expected) {
      return DataLossError(StrCat(where, ": tensor '", t.name, "' [", t.begin, ", ", t.end,
                                  ") overlaps tensor '", previous->name, "'"));
    }
    if (t.begin > expected) {
      return DataLossError(StrCat(where, ": a hole of ", t.begin - expected,
                                  " bytes before tensor '", t.name, "' (at data offset ",
                                  expected, ")"));
    }
    expected = t.end;
    previous = &t;
  }
  if (expected != data_size) {
    return DataLossError(StrCat(where, ": ", data_size - expected,
                                " bytes after the last tensor (the data section is ", data_size,
                                " bytes, the tensors end at ", expected, ")"));
  }
  for (SafetensorsTensor& t : header.tensors) {
    t.begin += header.data_start;
    t.end += header.data_start;
  }
  return header;
}

Result<std::string> EncodeSafetensorsHeader(
    std::vector<SafetensorsTensor>& tensors,
    const std::vector<std::pair<std::string, std::string>>& metadata) {
  std::string json = "{";
  bool first = true;
  auto quoted = [](const std::string& s) -> Result<std::string> {
    if (!IsValidUtf8(s)) {
      return InvalidArgumentError(StrCat("safetensors names and metadata must be UTF-8: '",
                                         EscapeBytes(s), "'"));
    }
    return Json(s).dump();
  };
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    for (size_t i = 0; i < metadata.size(); ++i) {
      TS_ASSIGN_OR_RETURN(std::string k, quoted(metadata[i].first));
      TS_ASSIGN_OR_RETURN(std::string v, quoted(metadata[i].second));
      json += StrCat(i ? "," : "", k, ":", v);
    }
    json += "}";
    first = false;
  }
  uint64_t offset = 0;
  for (SafetensorsTensor& t : tensors) {
    TS_ASSIGN_OR_RETURN(std::string_view dtype, SafetensorsDTypeName(t.dtype, t.name));
    TS_ASSIGN_OR_RETURN(int64_t count, CheckedNumElements(t.shape, t.name));
    uint64_t bytes = 0, end = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(count), ItemSize(t.dtype), &bytes) ||
        __builtin_add_overflow(offset, bytes, &end)) {
      return InvalidArgumentError(StrCat("tensor '", t.name, "': size overflows"));
    }
    TS_ASSIGN_OR_RETURN(std::string name, quoted(t.name));
    json += StrCat(first ? "" : ",", name, ":{\"dtype\":\"", dtype, "\",\"shape\":[",
                   StrJoin(t.shape, ","), "],\"data_offsets\":[", offset, ",", end, "]}");
    first = false;
    t.begin = offset;
    t.end = end;
    offset = end;
  }
  json += "}";
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += json;
  for (SafetensorsTensor& t : tensors) {
    t.begin += out.size();
    t.end += out.size();
  }
  return out;
}

}  // namespace tensorstash
