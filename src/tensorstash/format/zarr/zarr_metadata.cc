#include "tensorstash/format/zarr/zarr_metadata.h"

#include <cmath>
#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

#include "tensorstash/array/box.h"
#include "tensorstash/array/convert.h"

namespace tensorstash {
namespace {

using json = nlohmann::json;

// A compact rendering of a JSON value for messages (cut short: metadata may be hostile).
std::string Quote(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

Status Invalid(std::string_view what, std::string_view message) {
  return InvalidArgumentError(StrCat(what, ": ", message));
}

Result<int64_t> GetInt64(const json& value, std::string_view what, std::string_view field) {
  if (value.is_number_unsigned()) {
    const uint64_t v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Invalid(what, StrCat(field, " ", v, " is too large"));
    }
    return static_cast<int64_t>(v);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  return Invalid(what, StrCat(field, " must be an integer, not ", Quote(value)));
}

// A shape (min_extent 0) or chunk shape (min_extent 1) of at most kMaxRank dimensions.
Result<std::vector<int64_t>> GetShape(const json& value, std::string_view what,
                                      std::string_view field, int64_t min_extent) {
  if (!value.is_array()) return Invalid(what, StrCat(field, " must be an array of integers"));
  if (value.size() > static_cast<size_t>(kMaxRank)) {
    return Invalid(what,
                   StrCat(field, " has rank ", value.size(), ", above the limit of ", kMaxRank));
  }
  std::vector<int64_t> out;
  for (const json& v : value) {
    TS_ASSIGN_OR_RETURN(int64_t extent, GetInt64(v, what, field));
    if (extent < min_extent) {
      return Invalid(what, StrCat(field, " ", Quote(value), " has an extent below ", min_extent));
    }
    out.push_back(extent);
  }
  return out;
}

// Member `key` of object `obj`, or nullptr.
const json* Member(const json& obj, std::string_view key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(std::string(key));
  return it == obj.end() ? nullptr : &*it;
}

Result<std::string> GetString(const json& obj, std::string_view key, std::string_view what,
                              std::string_view default_value, bool required = false) {
  const json* v = Member(obj, key);
  if (v == nullptr || (v->is_null() && !required)) {
    if (required) return Invalid(what, StrCat("missing \"", key, "\""));
    return std::string(default_value);
  }
  if (!v->is_string()) {
    return Invalid(what, StrCat("\"", key, "\" must be a string, not ", Quote(*v)));
  }
  return v->get<std::string>();
}

Result<int64_t> GetIntMember(const json& obj, std::string_view key, std::string_view what,
                             int64_t default_value) {
  const json* v = Member(obj, key);
  if (v == nullptr || v->is_null()) return default_value;
  return GetInt64(*v, what, StrCat("\"", key, "\""));
}

// ---- fill values ----

// One float (or complex part) of dtype `dtype` from a number, "NaN", "Infinity", "-Infinity" or
// a "0x..." bit pattern, into ItemSize(dtype) host-order bytes at `out`.
Status ParseFloatFill(const json& value, DType dtype, char* out, std::string_view what) {
  double d;
  if (value.is_number()) {
    d = value.get<double>();
  } else if (value.is_string()) {
    const std::string s = value.get<std::string>();
    if (s == "NaN") {
      d = std::numeric_limits<double>::quiet_NaN();
    } else if (s == "Infinity") {
      d = std::numeric_limits<double>::infinity();
    } else if (s == "-Infinity") {
      d = -std::numeric_limits<double>::infinity();
    } else if (s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X') &&
               s.size() - 2 <= 2 * ItemSize(dtype)) {
      uint64_t bits = 0;
      for (size_t i = 2; i < s.size(); ++i) {
        const char c = s[i];
        int digit;
        if (c >= '0' && c <= '9')
          digit = c - '0';
        else if (c >= 'a' && c <= 'f')
          digit = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F')
          digit = c - 'A' + 10;
        else
          return Invalid(what, StrCat("fill_value \"", s, "\" is not valid hex"));
        bits = (bits << 4) | static_cast<uint64_t>(digit);
      }
      std::memcpy(out, &bits, ItemSize(dtype));  // little-endian host: the low bytes
      return OkStatus();
    } else {
      return Invalid(what, StrCat("fill_value ", Quote(value), " is not a ", DTypeName(dtype)));
    }
  } else {
    return Invalid(what, StrCat("fill_value ", Quote(value), " is not a ", DTypeName(dtype)));
  }
  return ConvertElements(DType::kFloat64, &d, dtype, out, 1, what);
}

Result<std::string> ParseFillValue(const json& value, DType dtype, std::string_view what) {
  std::string out(ItemSize(dtype), '\0');
  if (value.is_null()) return out;  // v2: "uninitialized"; zeros, as TensorStore reads it
  switch (Kind(dtype)) {
    case DTypeKind::kBool:
      if (value.is_boolean()) {
        out[0] = value.get<bool>() ? 1 : 0;
        return out;
      }
      if (value.is_number_integer() && (value.get<int64_t>() == 0 || value.get<int64_t>() == 1)) {
        out[0] = static_cast<char>(value.get<int64_t>());
        return out;
      }
      break;
    case DTypeKind::kSignedInt:
    case DTypeKind::kUnsignedInt: {
      // An integer, or a float holding an integral value (some writers emit 0.0).
      bool negative = false;
      uint64_t magnitude = 0;
      if (value.is_number_unsigned()) {
        magnitude = value.get<uint64_t>();
      } else if (value.is_number_integer()) {
        const int64_t v = value.get<int64_t>();
        negative = v < 0;
        magnitude = negative ? 0 - static_cast<uint64_t>(v) : static_cast<uint64_t>(v);
      } else if (value.is_number_float()) {
        const double v = value.get<double>();
        if (!(std::fabs(v) < 1.8e19) || v != std::trunc(v)) break;
        negative = v < 0;
        magnitude = static_cast<uint64_t>(std::fabs(v));
      } else {
        break;
      }
      const int bits = BitWidth(dtype);  // 2 or 4 for int2/int4/uint2/uint4
      const bool is_signed = Kind(dtype) == DTypeKind::kSignedInt;
      const uint64_t max_positive = is_signed
                                        ? (uint64_t{1} << (bits - 1)) - 1
                                        : (bits == 64 ? ~uint64_t{0} : (uint64_t{1} << bits) - 1);
      const uint64_t max_negative = is_signed ? uint64_t{1} << (bits - 1) : 0;
      if (negative ? magnitude > max_negative : magnitude > max_positive) {
        return Invalid(what,
                       StrCat("fill_value ", Quote(value), " does not fit ", DTypeName(dtype)));
      }
      uint64_t raw = negative ? 0 - magnitude : magnitude;
      if (bits < 8) raw &= (uint64_t{1} << bits) - 1;  // sub-byte: the low bits, as ml_dtypes
      std::memcpy(out.data(), &raw, out.size());
      return out;
    }
    case DTypeKind::kFloat:
      TS_RETURN_IF_ERROR(ParseFloatFill(value, dtype, out.data(), what));
      return out;
    case DTypeKind::kComplex: {
      const DType part = dtype == DType::kComplex64 ? DType::kFloat32 : DType::kFloat64;
      if (value.is_array() && value.size() == 2) {
        TS_RETURN_IF_ERROR(ParseFloatFill(value[0], part, out.data(), what));
        TS_RETURN_IF_ERROR(ParseFloatFill(value[1], part, out.data() + ItemSize(part), what));
        return out;
      }
      if (value.is_number() || value.is_string()) {  // a real value
        TS_RETURN_IF_ERROR(ParseFloatFill(value, part, out.data(), what));
        return out;
      }
      break;
    }
  }
  return Invalid(what, StrCat("fill_value ", Quote(value), " is not a ", DTypeName(dtype)));
}

// A float (or complex part) as JSON: a number, or "NaN" / "Infinity" / "-Infinity".
json FloatFillJson(DType dtype, const char* bytes) {
  double d = 0;
  (void)ConvertElements(dtype, bytes, DType::kFloat64, &d, 1, "fill_value");
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  return d;
}

json FillValueJson(DType dtype, const std::string& fill) {
  switch (Kind(dtype)) {
    case DTypeKind::kBool:
      return fill[0] != 0;
    case DTypeKind::kSignedInt: {
      // Through the converter: it reads int2/int4 from their low bits, sign-extended.
      int64_t v = 0;
      (void)ConvertElements(dtype, fill.data(), DType::kInt64, &v, 1, "fill_value");
      return v;
    }
    case DTypeKind::kUnsignedInt: {
      uint64_t v = 0;
      (void)ConvertElements(dtype, fill.data(), DType::kUint64, &v, 1, "fill_value");
      return v;
    }
    case DTypeKind::kFloat:
      return FloatFillJson(dtype, fill.data());
    case DTypeKind::kComplex: {
      const DType part = dtype == DType::kComplex64 ? DType::kFloat32 : DType::kFloat64;
      return json::array(
          {FloatFillJson(part, fill.data()), FloatFillJson(part, fill.data() + ItemSize(part))});
    }
  }
  return nullptr;
}

// ---- v3 codecs ----

Result<std::vector<ZarrCodec>> ParseV3Codecs(const json& list, int rank, std::string_view what);

Result<ZarrCodec> ParseV3Codec(const json& entry, int rank, std::string_view what) {
  std::string name;
  json config = json::object();
  if (entry.is_string()) {
    name = entry.get<std::string>();
  } else if (entry.is_object()) {
    TS_ASSIGN_OR_RETURN(name, GetString(entry, "name", what, "", /*required=*/true));
    if (const json* c = Member(entry, "configuration"); c != nullptr && !c->is_null()) {
      if (!c->is_object()) {
        return Invalid(what, StrCat("codec \"", name, "\" configuration is not an object"));
      }
      config = *c;
    }
  } else {
    return Invalid(what, StrCat("codec entry ", Quote(entry), " is not an object"));
  }
  const std::string cwhat = StrCat(what, ": codec \"", name, "\"");
  ZarrCodec codec;
  if (name == "bytes" || name == "endian") {
    codec.kind = ZarrCodecKind::kBytes;
    TS_ASSIGN_OR_RETURN(std::string endian, GetString(config, "endian", cwhat, "little"));
    if (endian != "little" && endian != "big") {
      return Invalid(cwhat, StrCat("unknown endian \"", endian, "\""));
    }
    codec.big_endian = endian == "big";
  } else if (name == "transpose") {
    codec.kind = ZarrCodecKind::kTranspose;
    const json* order = Member(config, "order");
    if (order == nullptr) return Invalid(cwhat, "missing \"order\"");
    if (order->is_string()) {  // early drafts' "C" / "F"
      const std::string s = order->get<std::string>();
      if (s != "C" && s != "F") return Invalid(cwhat, StrCat("unknown order \"", s, "\""));
      for (int d = 0; d < rank; ++d) codec.order.push_back(s == "C" ? d : rank - 1 - d);
    } else {
      TS_ASSIGN_OR_RETURN(std::vector<int64_t> o, GetShape(*order, cwhat, "order", 0));
      for (int64_t v : o) codec.order.push_back(static_cast<int>(std::min<int64_t>(v, 1 << 20)));
    }
  } else if (name == "zstd") {
    codec.kind = ZarrCodecKind::kZstd;
    TS_ASSIGN_OR_RETURN(int64_t level, GetIntMember(config, "level", cwhat, 0));
    codec.level = static_cast<int>(std::clamp<int64_t>(level, -131072, 22));
    if (const json* c = Member(config, "checksum"); c != nullptr && c->is_boolean()) {
      codec.zstd_checksum = c->get<bool>();
    }
  } else if (name == "gzip") {
    codec.kind = ZarrCodecKind::kGzip;
    TS_ASSIGN_OR_RETURN(int64_t level, GetIntMember(config, "level", cwhat, 6));
    codec.level = static_cast<int>(std::clamp<int64_t>(level, 0, 9));
  } else if (name == "blosc") {
    codec.kind = ZarrCodecKind::kBlosc;
    TS_ASSIGN_OR_RETURN(codec.blosc_cname, GetString(config, "cname", cwhat, "lz4"));
    TS_ASSIGN_OR_RETURN(int64_t level, GetIntMember(config, "clevel", cwhat, 5));
    codec.level = static_cast<int>(std::clamp<int64_t>(level, 0, 9));
    TS_ASSIGN_OR_RETURN(std::string shuffle, GetString(config, "shuffle", cwhat, "noshuffle"));
    codec.blosc_shuffle = shuffle == "shuffle" ? 1 : shuffle == "bitshuffle" ? 2 : 0;
    TS_ASSIGN_OR_RETURN(int64_t typesize, GetIntMember(config, "typesize", cwhat, 1));
    codec.blosc_typesize = static_cast<int>(std::clamp<int64_t>(typesize, 1, 255));
    TS_ASSIGN_OR_RETURN(int64_t blocksize, GetIntMember(config, "blocksize", cwhat, 0));
    codec.blosc_blocksize = static_cast<int>(std::clamp<int64_t>(blocksize, 0, 1 << 30));
  } else if (name == "crc32c") {
    codec.kind = ZarrCodecKind::kCrc32c;
  } else if (name == "sharding_indexed") {
    codec.kind = ZarrCodecKind::kSharding;
    const json* cs = Member(config, "chunk_shape");
    if (cs == nullptr) return Invalid(cwhat, "missing \"chunk_shape\"");
    TS_ASSIGN_OR_RETURN(codec.inner_chunk_shape, GetShape(*cs, cwhat, "chunk_shape", 1));
    const json* inner = Member(config, "codecs");
    if (inner == nullptr) return Invalid(cwhat, "missing \"codecs\"");
    TS_ASSIGN_OR_RETURN(std::vector<ZarrCodec> inner_codecs, ParseV3Codecs(*inner, rank, cwhat));
    codec.inner_codecs = std::make_shared<const std::vector<ZarrCodec>>(std::move(inner_codecs));
    const json* index = Member(config, "index_codecs");
    std::vector<ZarrCodec> index_codecs;
    if (index == nullptr) {
      index_codecs.resize(2);
      index_codecs[1].kind = ZarrCodecKind::kCrc32c;
    } else {
      TS_ASSIGN_OR_RETURN(index_codecs, ParseV3Codecs(*index, rank + 1, cwhat));
    }
    codec.index_codecs = std::make_shared<const std::vector<ZarrCodec>>(std::move(index_codecs));
    TS_ASSIGN_OR_RETURN(std::string location, GetString(config, "index_location", cwhat, "end"));
    if (location != "end" && location != "start") {
      return Invalid(cwhat, StrCat("unknown index_location \"", location, "\""));
    }
    codec.index_at_end = location == "end";
  } else {
    return UnimplementedError(StrCat(what, ": unsupported codec \"", name, "\""));
  }
  return codec;
}

Result<std::vector<ZarrCodec>> ParseV3Codecs(const json& list, int rank, std::string_view what) {
  if (!list.is_array()) return Invalid(what, "\"codecs\" must be an array");
  if (list.size() > 64) return Invalid(what, "more than 64 codecs");
  std::vector<ZarrCodec> out;
  for (const json& entry : list) {
    TS_ASSIGN_OR_RETURN(ZarrCodec codec, ParseV3Codec(entry, rank, what));
    out.push_back(std::move(codec));
  }
  return out;
}

bool IsArrayToBytes(ZarrCodecKind k) {
  return k == ZarrCodecKind::kBytes || k == ZarrCodecKind::kSharding;
}

Status ValidateChain(const std::vector<ZarrCodec>& codecs, std::vector<int64_t> shape, DType dtype,
                     bool check_chunk_bytes, int depth, std::string_view what) {
  if (depth > 4) return Invalid(what, "sharding nested more than 4 levels deep");
  const int rank = static_cast<int>(shape.size());
  size_t i = 0;
  for (; i < codecs.size() && codecs[i].kind == ZarrCodecKind::kTranspose; ++i) {
    const std::vector<int>& order = codecs[i].order;
    std::vector<bool> seen(rank, false);
    bool ok = static_cast<int>(order.size()) == rank;
    for (size_t k = 0; ok && k < order.size(); ++k) {
      ok = order[k] >= 0 && order[k] < rank && !seen[order[k]];
      if (ok) seen[order[k]] = true;
    }
    if (!ok) {
      return Invalid(what, StrCat("transpose order [", StrJoin(order, ", "),
                                  "] is not a permutation of ", rank, " dimensions"));
    }
    std::vector<int64_t> permuted(rank);
    for (int k = 0; k < rank; ++k) permuted[k] = shape[order[k]];
    shape = std::move(permuted);
  }
  if (i == codecs.size() || !IsArrayToBytes(codecs[i].kind)) {
    return Invalid(what,
                   "the codec chain needs exactly one array-to-bytes codec (\"bytes\" or "
                   "\"sharding_indexed\") after the array-to-array ones");
  }
  const ZarrCodec& ab = codecs[i];
  for (size_t j = i + 1; j < codecs.size(); ++j) {
    if (codecs[j].kind == ZarrCodecKind::kTranspose || IsArrayToBytes(codecs[j].kind)) {
      return Invalid(what, "an array codec follows the array-to-bytes codec");
    }
  }
  if (ab.kind == ZarrCodecKind::kBytes) {
    if (check_chunk_bytes) {
      TS_ASSIGN_OR_RETURN(int64_t n, CheckedNumElements(shape, what));
      if (static_cast<uint64_t>(n) > kMaxZarrChunkBytes / ItemSize(dtype)) {
        return Invalid(what, StrCat("a chunk of shape [", StrJoin(shape, ", "), "] exceeds the ",
                                    kMaxZarrChunkBytes, "-byte chunk limit"));
      }
    }
    return OkStatus();
  }
  // sharding_indexed: inner chunks tile the shard.
  const std::string swhat = StrCat(what, ": sharding_indexed");
  if (static_cast<int>(ab.inner_chunk_shape.size()) != rank) {
    return Invalid(swhat, StrCat("inner chunk_shape [", StrJoin(ab.inner_chunk_shape, ", "),
                                 "] does not have rank ", rank));
  }
  std::vector<int64_t> per_shard(rank);
  for (int d = 0; d < rank; ++d) {
    if (shape[d] % ab.inner_chunk_shape[d] != 0) {
      return Invalid(swhat,
                     StrCat("inner chunk_shape [", StrJoin(ab.inner_chunk_shape, ", "),
                            "] does not divide the shard shape [", StrJoin(shape, ", "), "]"));
    }
    per_shard[d] = shape[d] / ab.inner_chunk_shape[d];
  }
  TS_ASSIGN_OR_RETURN(int64_t inner_count, CheckedNumElements(per_shard, swhat));
  if (inner_count > (int64_t{1} << 40)) {
    return Invalid(swhat, StrCat(inner_count, " inner chunks per shard is above the limit"));
  }
  TS_RETURN_IF_ERROR(ValidateChain(*ab.inner_codecs, ab.inner_chunk_shape, dtype,
                                   /*check_chunk_bytes=*/true, depth + 1, swhat));
  const std::vector<ZarrCodec>& index = *ab.index_codecs;
  bool index_ok = !index.empty() && index[0].kind == ZarrCodecKind::kBytes;
  for (size_t j = 1; index_ok && j < index.size(); ++j) {
    index_ok = index[j].kind == ZarrCodecKind::kCrc32c;
  }
  if (!index_ok) {
    return UnimplementedError(StrCat(swhat,
                                     ": index_codecs other than \"bytes\" followed by "
                                     "\"crc32c\" are not supported"));
  }
  return OkStatus();
}

// ---- v2 dtypes ----

// The ml_dtypes types (bfloat16, float8/6/4, int2/int4/uint2/uint4), which have no NumPy
// typestr: TensorStore writes their names as the v2 dtype.
bool IsMlDtype(DType dtype) {
  return dtype == DType::kBfloat16 || (ItemSize(dtype) == 1 && Kind(dtype) == DTypeKind::kFloat) ||
         BitWidth(dtype) < 8;
}

struct V2Type {
  DType dtype;
  bool big_endian;
};

Result<V2Type> ParseV2DType(const json& value, std::string_view what) {
  if (!value.is_string()) {
    return UnimplementedError(
        StrCat(what, ": dtype ", Quote(value), " (structured dtypes are not supported)"));
  }
  const std::string s = value.get<std::string>();
  // TensorStore spells the ml_dtypes types by name (their names have no '<', '>' or '|').
  if (Result<DType> named = ParseDType(s); named.ok() && IsMlDtype(*named)) {
    return V2Type{*named, false};
  }
  if (s.size() >= 3 && (s[0] == '<' || s[0] == '>' || s[0] == '|')) {
    const char kind = s[1];
    int size = 0;
    if (ParseInt(std::string_view(s).substr(2), &size)) {
      const bool big = s[0] == '>';
      static constexpr struct {
        char kind;
        int size;
        DType dtype;
      } kTable[] = {
          {'b', 1, DType::kBool},      {'i', 1, DType::kInt8},        {'i', 2, DType::kInt16},
          {'i', 4, DType::kInt32},     {'i', 8, DType::kInt64},       {'u', 1, DType::kUint8},
          {'u', 2, DType::kUint16},    {'u', 4, DType::kUint32},      {'u', 8, DType::kUint64},
          {'f', 2, DType::kFloat16},   {'f', 4, DType::kFloat32},     {'f', 8, DType::kFloat64},
          {'c', 8, DType::kComplex64}, {'c', 16, DType::kComplex128},
      };
      for (const auto& row : kTable) {
        if (row.kind == kind && row.size == size) return V2Type{row.dtype, big && size > 1};
      }
    }
  }
  return UnimplementedError(StrCat(what, ": unsupported dtype \"", s, "\""));
}

std::string V2TypeString(DType dtype, bool big_endian) {
  const char order = ItemSize(dtype) == 1 ? '|' : (big_endian ? '>' : '<');
  switch (dtype) {
    case DType::kBool:
      return "|b1";
    default:
      break;
  }
  if (IsMlDtype(dtype)) return std::string(DTypeName(dtype));
  const char kind = Kind(dtype) == DTypeKind::kSignedInt     ? 'i'
                    : Kind(dtype) == DTypeKind::kUnsignedInt ? 'u'
                    : Kind(dtype) == DTypeKind::kComplex     ? 'c'
                                                             : 'f';
  return StrCat(order, kind, ItemSize(dtype));
}

Result<json> ParseDocument(std::string_view text, std::string_view what) {
  if (text.size() > kMaxZarrMetadataBytes) {
    return Invalid(what, StrCat("metadata of ", text.size(), " bytes is above the ",
                                kMaxZarrMetadataBytes, "-byte limit"));
  }
  json doc = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return Invalid(what, "metadata is not valid JSON");
  if (!doc.is_object()) return Invalid(what, "metadata is not a JSON object");
  return doc;
}

// Fixes chunk extents of 0 on dimensions of extent 0 (some writers emit them) to 1.
Result<std::vector<int64_t>> GetChunkShape(const json& value, const std::vector<int64_t>& shape,
                                           std::string_view what, std::string_view field) {
  TS_ASSIGN_OR_RETURN(std::vector<int64_t> chunks, GetShape(value, what, field, 0));
  if (chunks.size() != shape.size()) {
    return Invalid(what, StrCat(field, " [", StrJoin(chunks, ", "),
                                "] does not have the rank of "
                                "shape [",
                                StrJoin(shape, ", "), "]"));
  }
  for (size_t d = 0; d < chunks.size(); ++d) {
    if (chunks[d] == 0) {
      if (shape[d] != 0) return Invalid(what, StrCat(field, " has an extent of 0"));
      chunks[d] = 1;
    }
  }
  return chunks;
}

Result<ZarrMetadata> ParseV3(const json& doc, std::string_view what) {
  ZarrMetadata m;
  m.zarr_format = 3;
  const json* format = Member(doc, "zarr_format");
  if (format == nullptr || !format->is_number_integer() || format->get<int64_t>() != 3) {
    return Invalid(what, "zarr.json does not have \"zarr_format\": 3");
  }
  TS_ASSIGN_OR_RETURN(std::string node_type, GetString(doc, "node_type", what, "", true));
  if (node_type != "array") {
    return Invalid(what, StrCat("zarr.json describes a ", node_type, ", not an array"));
  }
  const json* shape = Member(doc, "shape");
  if (shape == nullptr) return Invalid(what, "missing \"shape\"");
  TS_ASSIGN_OR_RETURN(m.shape, GetShape(*shape, what, "shape", 0));

  const json* type = Member(doc, "data_type");
  if (type == nullptr) return Invalid(what, "missing \"data_type\"");
  Result<DType> dtype = type->is_string() ? ParseDType(type->get<std::string>())
                                          : Result<DType>(InvalidArgumentError("not a string"));
  if (!dtype.ok()) {
    return UnimplementedError(StrCat(what, ": unsupported data_type ", Quote(*type)));
  }
  m.dtype = *dtype;

  const json* grid = Member(doc, "chunk_grid");
  if (grid == nullptr) return Invalid(what, "missing \"chunk_grid\"");
  TS_ASSIGN_OR_RETURN(std::string grid_name, GetString(*grid, "name", what, "", true));
  if (grid_name != "regular") {
    return UnimplementedError(StrCat(what, ": unsupported chunk_grid \"", grid_name, "\""));
  }
  const json* grid_config = Member(*grid, "configuration");
  const json* chunk_shape = grid_config ? Member(*grid_config, "chunk_shape") : nullptr;
  if (chunk_shape == nullptr) return Invalid(what, "chunk_grid has no chunk_shape");
  TS_ASSIGN_OR_RETURN(m.chunk_shape, GetChunkShape(*chunk_shape, m.shape, what, "chunk_shape"));

  if (const json* enc = Member(doc, "chunk_key_encoding"); enc != nullptr) {
    TS_ASSIGN_OR_RETURN(std::string enc_name, GetString(*enc, "name", what, "", true));
    if (enc_name == "default") {
      m.key_encoding = ZarrKeyEncoding::kDefault;
    } else if (enc_name == "v2") {
      m.key_encoding = ZarrKeyEncoding::kV2;
    } else {
      return UnimplementedError(
          StrCat(what, ": unsupported chunk_key_encoding \"", enc_name, "\""));
    }
    const json* cfg = Member(*enc, "configuration");
    const std::string default_sep = enc_name == "v2" ? "." : "/";
    TS_ASSIGN_OR_RETURN(std::string sep, cfg ? GetString(*cfg, "separator", what, default_sep)
                                             : Result<std::string>(default_sep));
    if (sep != "/" && sep != ".") return Invalid(what, StrCat("unknown separator \"", sep, "\""));
    m.separator = sep[0];
  }
  if (const json* st = Member(doc, "storage_transformers");
      st != nullptr && !st->is_null() && !(st->is_array() && st->empty())) {
    return UnimplementedError(StrCat(what, ": storage_transformers are not supported"));
  }
  const json* fill = Member(doc, "fill_value");
  TS_ASSIGN_OR_RETURN(m.fill_value, ParseFillValue(fill ? *fill : json(nullptr), m.dtype, what));
  const json* codecs = Member(doc, "codecs");
  if (codecs == nullptr) return Invalid(what, "missing \"codecs\"");
  TS_ASSIGN_OR_RETURN(m.codecs, ParseV3Codecs(*codecs, m.rank(), what));
  TS_RETURN_IF_ERROR(ValidateZarrMetadata(m, what));
  return m;
}

Result<ZarrMetadata> ParseV2(const json& doc, std::string_view what) {
  ZarrMetadata m;
  m.zarr_format = 2;
  m.key_encoding = ZarrKeyEncoding::kV2;
  const json* format = Member(doc, "zarr_format");
  if (format == nullptr || !format->is_number_integer() || format->get<int64_t>() != 2) {
    return Invalid(what, ".zarray does not have \"zarr_format\": 2");
  }
  const json* shape = Member(doc, "shape");
  if (shape == nullptr) return Invalid(what, "missing \"shape\"");
  TS_ASSIGN_OR_RETURN(m.shape, GetShape(*shape, what, "shape", 0));
  const json* chunks = Member(doc, "chunks");
  if (chunks == nullptr) return Invalid(what, "missing \"chunks\"");
  TS_ASSIGN_OR_RETURN(m.chunk_shape, GetChunkShape(*chunks, m.shape, what, "chunks"));
  const json* dtype = Member(doc, "dtype");
  if (dtype == nullptr) return Invalid(what, "missing \"dtype\"");
  TS_ASSIGN_OR_RETURN(V2Type type, ParseV2DType(*dtype, what));
  m.dtype = type.dtype;
  const json* fill = Member(doc, "fill_value");
  TS_ASSIGN_OR_RETURN(m.fill_value, ParseFillValue(fill ? *fill : json(nullptr), m.dtype, what));
  TS_ASSIGN_OR_RETURN(std::string order, GetString(doc, "order", what, "C"));
  if (order != "C" && order != "F") return Invalid(what, StrCat("unknown order \"", order, "\""));
  TS_ASSIGN_OR_RETURN(std::string sep, GetString(doc, "dimension_separator", what, "."));
  if (sep != "." && sep != "/") {
    return Invalid(what, StrCat("unknown dimension_separator \"", sep, "\""));
  }
  m.separator = sep[0];
  if (const json* filters = Member(doc, "filters");
      filters != nullptr && !filters->is_null() && !(filters->is_array() && filters->empty())) {
    return UnimplementedError(StrCat(what, ": filters ", Quote(*filters), " are not supported"));
  }
  if (order == "F" && m.rank() > 1) {
    ZarrCodec t;
    t.kind = ZarrCodecKind::kTranspose;
    for (int d = m.rank() - 1; d >= 0; --d) t.order.push_back(d);
    m.codecs.push_back(std::move(t));
  }
  ZarrCodec bytes;
  bytes.kind = ZarrCodecKind::kBytes;
  bytes.big_endian = type.big_endian;
  m.codecs.push_back(bytes);
  if (const json* comp = Member(doc, "compressor"); comp != nullptr && !comp->is_null()) {
    TS_ASSIGN_OR_RETURN(std::string id, GetString(*comp, "id", what, "", true));
    ZarrCodec c;
    if (id == "zstd") {
      c.kind = ZarrCodecKind::kZstd;
      TS_ASSIGN_OR_RETURN(int64_t level, GetIntMember(*comp, "level", what, 1));
      c.level = static_cast<int>(std::clamp<int64_t>(level, -131072, 22));
    } else if (id == "gzip" || id == "zlib") {
      c.kind = ZarrCodecKind::kGzip;
      c.zlib_framing = id == "zlib";
      TS_ASSIGN_OR_RETURN(int64_t level, GetIntMember(*comp, "level", what, 6));
      c.level = static_cast<int>(std::clamp<int64_t>(level, 0, 9));
    } else if (id == "blosc") {
      c.kind = ZarrCodecKind::kBlosc;
      TS_ASSIGN_OR_RETURN(c.blosc_cname, GetString(*comp, "cname", what, "lz4"));
      TS_ASSIGN_OR_RETURN(int64_t level, GetIntMember(*comp, "clevel", what, 5));
      c.level = static_cast<int>(std::clamp<int64_t>(level, 0, 9));
      TS_ASSIGN_OR_RETURN(int64_t shuffle, GetIntMember(*comp, "shuffle", what, 1));
      c.blosc_shuffle = shuffle < 0 ? (ItemSize(m.dtype) == 1 ? 2 : 1)
                                    : static_cast<int>(std::clamp<int64_t>(shuffle, 0, 2));
      c.blosc_typesize = static_cast<int>(ItemSize(m.dtype));
      TS_ASSIGN_OR_RETURN(int64_t blocksize, GetIntMember(*comp, "blocksize", what, 0));
      c.blosc_blocksize = static_cast<int>(std::clamp<int64_t>(blocksize, 0, 1 << 30));
    } else {
      return UnimplementedError(StrCat(what, ": unsupported compressor \"", id, "\""));
    }
    m.codecs.push_back(std::move(c));
  }
  TS_RETURN_IF_ERROR(ValidateZarrMetadata(m, what));
  return m;
}

json CodecJson(const ZarrCodec& c);

json CodecsJson(const std::vector<ZarrCodec>& codecs) {
  json out = json::array();
  for (const ZarrCodec& c : codecs) out.push_back(CodecJson(c));
  return out;
}

json CodecJson(const ZarrCodec& c) {
  switch (c.kind) {
    case ZarrCodecKind::kTranspose:
      return {{"name", "transpose"}, {"configuration", {{"order", c.order}}}};
    case ZarrCodecKind::kBytes:
      return {{"name", "bytes"}, {"configuration", {{"endian", c.big_endian ? "big" : "little"}}}};
    case ZarrCodecKind::kZstd:
      return {{"name", "zstd"},
              {"configuration", {{"level", c.level}, {"checksum", c.zstd_checksum}}}};
    case ZarrCodecKind::kGzip:
      return {{"name", "gzip"}, {"configuration", {{"level", c.level}}}};
    case ZarrCodecKind::kBlosc: {
      static constexpr const char* kShuffle[] = {"noshuffle", "shuffle", "bitshuffle"};
      return {{"name", "blosc"},
              {"configuration",
               {{"cname", c.blosc_cname},
                {"clevel", c.level},
                {"shuffle", kShuffle[std::clamp(c.blosc_shuffle, 0, 2)]},
                {"typesize", c.blosc_typesize},
                {"blocksize", c.blosc_blocksize}}}};
    }
    case ZarrCodecKind::kCrc32c:
      return {{"name", "crc32c"}};
    case ZarrCodecKind::kSharding:
      return {{"name", "sharding_indexed"},
              {"configuration",
               {{"chunk_shape", c.inner_chunk_shape},
                {"codecs", CodecsJson(*c.inner_codecs)},
                {"index_codecs", CodecsJson(*c.index_codecs)},
                {"index_location", c.index_at_end ? "end" : "start"}}}};
  }
  return nullptr;
}

}  // namespace

const ZarrCodec* ZarrMetadata::sole_sharding() const {
  return codecs.size() == 1 && codecs[0].kind == ZarrCodecKind::kSharding ? &codecs[0] : nullptr;
}

Status ValidateZarrMetadata(const ZarrMetadata& m, std::string_view what) {
  if (m.rank() > kMaxRank) {
    return Invalid(what, StrCat("rank ", m.rank(), " is above the limit of ", kMaxRank));
  }
  if (m.chunk_shape.size() != m.shape.size()) {
    return Invalid(what,
                   StrCat("chunk shape [", StrJoin(m.chunk_shape, ", "),
                          "] does not have the rank of shape [", StrJoin(m.shape, ", "), "]"));
  }
  TS_RETURN_IF_ERROR(ValidateBox(Box::FromShape(m.shape), ItemSize(m.dtype), what));
  for (int64_t c : m.chunk_shape) {
    if (c < 1) {
      return Invalid(
          what, StrCat("chunk shape [", StrJoin(m.chunk_shape, ", "), "] has an extent below 1"));
    }
  }
  if (m.fill_value.size() != ItemSize(m.dtype)) {
    return Invalid(what, "fill value has the wrong size");
  }
  if (m.separator != '/' && m.separator != '.') {
    return Invalid(what, "separator must be '/' or '.'");
  }
  // A shard read piecewise is never held whole; any other chunk is decoded whole.
  return ValidateChain(m.codecs, m.chunk_shape, m.dtype,
                       /*check_chunk_bytes=*/m.sole_sharding() == nullptr, 0, what);
}

Result<ZarrMetadata> ParseZarrV3Metadata(std::string_view text, std::string_view what) {
  try {
    TS_ASSIGN_OR_RETURN(json doc, ParseDocument(text, what));
    return ParseV3(doc, what);
  } catch (const json::exception& e) {
    return Invalid(what, StrCat("malformed zarr.json: ", e.what()));
  }
}

Result<ZarrMetadata> ParseZarrV2Metadata(std::string_view text, std::string_view what) {
  try {
    TS_ASSIGN_OR_RETURN(json doc, ParseDocument(text, what));
    return ParseV2(doc, what);
  } catch (const json::exception& e) {
    return Invalid(what, StrCat("malformed .zarray: ", e.what()));
  }
}

// The ml_dtypes types TensorStore (0.1.86) has no data type for: no TensorStore, and so no
// Orbax, could open a zarr array of them.
bool TensorStoreLacks(DType dtype) {
  return dtype == DType::kUint2 || dtype == DType::kUint4 || dtype == DType::kFloat6E2m3fn ||
         dtype == DType::kFloat6E3m2fn || dtype == DType::kFloat8E4m3;
}

Result<std::string> EncodeZarrMetadata(const ZarrMetadata& m) {
  TS_RETURN_IF_ERROR(ValidateZarrMetadata(m, "zarr metadata"));
  if (TensorStoreLacks(m.dtype)) {
    return UnimplementedError(StrCat("dtype ", DTypeName(m.dtype),
                                     " cannot be written as zarr: TensorStore (and so Orbax) has "
                                     "no data type for it"));
  }
  try {
    json doc;
    if (m.zarr_format == 3) {
      doc["zarr_format"] = 3;
      doc["node_type"] = "array";
      doc["shape"] = m.shape;
      doc["data_type"] = std::string(DTypeName(m.dtype));
      doc["chunk_grid"] = {{"name", "regular"},
                           {"configuration", {{"chunk_shape", m.chunk_shape}}}};
      doc["chunk_key_encoding"] = {
          {"name", m.key_encoding == ZarrKeyEncoding::kV2 ? "v2" : "default"},
          {"configuration", {{"separator", std::string(1, m.separator)}}}};
      doc["fill_value"] = FillValueJson(m.dtype, m.fill_value);
      doc["codecs"] = CodecsJson(m.codecs);
      return doc.dump();
    }
    if (m.zarr_format != 2) return InvalidArgumentError(StrCat("zarr_format ", m.zarr_format));
    // v2: [transpose reversed]? bytes [compressor]?
    size_t i = 0;
    bool fortran = false;
    if (i < m.codecs.size() && m.codecs[i].kind == ZarrCodecKind::kTranspose) {
      for (int k = 0; k < m.rank(); ++k) {
        if (m.codecs[i].order[k] != m.rank() - 1 - k) {
          return InvalidArgumentError("zarr v2 can only store C or F order");
        }
      }
      fortran = true;
      ++i;
    }
    if (i >= m.codecs.size() || m.codecs[i].kind != ZarrCodecKind::kBytes) {
      return InvalidArgumentError("zarr v2 arrays cannot be sharded");
    }
    const bool big_endian = m.codecs[i].big_endian;
    ++i;
    json compressor = nullptr;
    if (i < m.codecs.size()) {
      const ZarrCodec& c = m.codecs[i];
      switch (c.kind) {
        case ZarrCodecKind::kZstd:
          compressor = {{"id", "zstd"}, {"level", c.level}};
          break;
        case ZarrCodecKind::kGzip:
          compressor = {{"id", c.zlib_framing ? "zlib" : "gzip"}, {"level", c.level}};
          break;
        case ZarrCodecKind::kBlosc:
          compressor = {{"id", "blosc"},
                        {"cname", c.blosc_cname},
                        {"clevel", c.level},
                        {"shuffle", c.blosc_shuffle},
                        {"blocksize", c.blosc_blocksize}};
          break;
        default:
          return InvalidArgumentError("zarr v2 supports one compressor: zstd, gzip, zlib or blosc");
      }
      ++i;
    }
    if (i != m.codecs.size()) return InvalidArgumentError("zarr v2 supports one compressor");
    doc["zarr_format"] = 2;
    doc["shape"] = m.shape;
    doc["chunks"] = m.chunk_shape;
    doc["dtype"] = V2TypeString(m.dtype, big_endian);
    doc["compressor"] = compressor;
    doc["fill_value"] = FillValueJson(m.dtype, m.fill_value);
    doc["order"] = fortran ? "F" : "C";
    doc["filters"] = nullptr;
    doc["dimension_separator"] = std::string(1, m.separator);
    return doc.dump();
  } catch (const json::exception& e) {
    return InternalError(StrCat("encoding zarr metadata: ", e.what()));
  }
}

std::string ZarrChunkKey(const ZarrMetadata& m, const std::vector<int64_t>& grid) {
  if (m.key_encoding == ZarrKeyEncoding::kDefault) {
    // Built by appending only: GCC 12 warns (-Wrestrict, a false positive) on key = "c".
    std::string key(1, 'c');
    for (int64_t g : grid) {
      key.push_back(m.separator);
      key += std::to_string(g);
    }
    return key;
  }
  if (grid.empty()) return "0";
  std::string key;
  for (size_t d = 0; d < grid.size(); ++d) {
    if (d > 0) key.push_back(m.separator);
    key += std::to_string(grid[d]);
  }
  return key;
}

}  // namespace tensorstash
