#include "tensorstash/format/dcp/dcp_metadata.h"

#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "tensorstash/format/dcp/pickle.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

constexpr std::string_view kMeta = "torch.distributed.checkpoint.metadata.";
// Pairwise disjointness is checked in O(chunks^2); a tensor split into more pieces is refused
// rather than made slow (DCP writes one chunk per shard, i.e. at most one per rank).
constexpr size_t kMaxChunksPerTensor = 8192;

std::string MetaClass(std::string_view name) { return StrCat(kMeta, name); }

class Parser {
 public:
  explicit Parser(std::string_view what) : what_(what) {}

  template <typename... Parts>
  Status Loss(const Parts&... parts) const {
    return DataLossError(StrCat("DCP checkpoint ", what_, ": ", parts...));
  }

  // A dataclass field: the object's BUILD state is a dict of its fields.
  Result<const PickleValue*> Field(const PickleValue* object, std::string_view name,
                                   std::string_view where) const {
    if (object->state == nullptr || !object->state->Is(PickleKind::kDict)) {
      return Loss(where, ": a ", object->callee->text, " without its fields");
    }
    const PickleValue* v = object->state->Find(name);
    if (v == nullptr) return Loss(where, ": ", object->callee->text, " lacks '", name, "'");
    return v;
  }

  Result<int64_t> Int(const PickleValue* v, std::string_view where) const {
    if (!v->Is(PickleKind::kInt)) {
      return Loss(where, ": a ", PickleKindName(v->kind), " where an int belongs");
    }
    return v->integer;
  }

  Result<std::string> Str(const PickleValue* v, std::string_view where) const {
    if (!v->Is(PickleKind::kStr)) {
      return Loss(where, ": a ", PickleKindName(v->kind), " where a str belongs");
    }
    return v->text;
  }

  // torch.Size((a, b, ...)) (or a bare tuple) of non-negative ints.
  Result<std::vector<int64_t>> Size(const PickleValue* v, std::string_view where) const {
    if (v->IsObjectOf("torch.Size")) {
      if (v->args->items.size() != 1) return Loss(where, ": torch.Size with ", v->args->items.size(), " arguments");
      v = v->args->items[0];
    }
    if (!v->Is(PickleKind::kTuple) && !v->Is(PickleKind::kList)) {
      return Loss(where, ": a ", PickleKindName(v->kind), " where a torch.Size belongs");
    }
    std::vector<int64_t> out;
    out.reserve(v->items.size());
    for (const PickleValue* item : v->items) {
      TS_ASSIGN_OR_RETURN(int64_t n, Int(item, where));
      if (n < 0) return Loss(where, ": a negative extent (", n, ")");
      out.push_back(n);
    }
    return out;
  }

  Result<DcpItemLocation> Location(const PickleValue* info, std::string_view where) const {
    if (!info->IsObjectOf("torch.distributed.checkpoint.filesystem._StorageInfo")) {
      return Loss(where, ": storage info is a ", Describe(info), ", not a _StorageInfo");
    }
    DcpItemLocation loc;
    TS_ASSIGN_OR_RETURN(const PickleValue* path, Field(info, "relative_path", where));
    TS_ASSIGN_OR_RETURN(loc.relative_path, Str(path, where));
    TS_ASSIGN_OR_RETURN(const PickleValue* offset, Field(info, "offset", where));
    TS_ASSIGN_OR_RETURN(int64_t o, Int(offset, where));
    TS_ASSIGN_OR_RETURN(const PickleValue* length, Field(info, "length", where));
    TS_ASSIGN_OR_RETURN(int64_t n, Int(length, where));
    if (o < 0 || n < 0) return Loss(where, ": a negative offset or length (", o, ", ", n, ")");
    loc.offset = static_cast<uint64_t>(o);
    loc.length = static_cast<uint64_t>(n);
    const std::string& p = loc.relative_path;
    if (p.empty() || p == "." || p == ".." || p.find('/') != std::string::npos ||
        p.find('\\') != std::string::npos || p.find('\0') != std::string::npos) {
      return Loss(where, ": relative path '", p, "' is not a file name in the checkpoint folder");
    }
    if (const PickleValue* t = info->state->Find("transform_descriptors");
        t != nullptr && !t->Is(PickleKind::kNone) && !t->items.empty()) {
      return UnimplementedError(StrCat("DCP checkpoint ", what_, ": ", where,
                                       " is stored through transforms (a DCP extension such as ",
                                       "compression), which this reader does not undo"));
    }
    return loc;
  }

  static std::string Describe(const PickleValue* v) {
    if (v->Is(PickleKind::kObject)) return v->callee->text;
    return std::string(PickleKindName(v->kind));
  }

  std::vector<std::string> Path(const PickleValue* planner_data, std::string_view fqn) const {
    std::vector<std::string> out;
    if (planner_data == nullptr) return out;
    const PickleValue* p = planner_data->Find(fqn);
    if (p == nullptr || !(p->Is(PickleKind::kTuple) || p->Is(PickleKind::kList))) return out;
    for (const PickleValue* k : p->items) {
      if (k->Is(PickleKind::kStr)) {
        out.push_back(k->text);
      } else if (k->Is(PickleKind::kInt)) {
        out.push_back(std::to_string(k->integer));
      } else {
        return {};
      }
    }
    return out;
  }

  Status CheckTiling(const DcpTensor& t) const {
    const std::string where = StrCat("tensor '", t.fqn, "'");
    if (t.chunks.size() > kMaxChunksPerTensor) {
      return UnimplementedError(StrCat("DCP checkpoint ", what_, ": ", where, " has ",
                                       t.chunks.size(), " chunks, more than ", kMaxChunksPerTensor));
    }
    uint64_t total = 1;
    for (int64_t d : t.shape) {
      if (__builtin_mul_overflow(total, static_cast<uint64_t>(d), &total)) {
        return Loss(where, ": its element count overflows");
      }
    }
    uint64_t covered = 0;
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      const DcpChunk& c = t.chunks[i];
      if (c.offsets.size() != t.shape.size() || c.sizes.size() != t.shape.size()) {
        return Loss(where, ": chunk ", i, " has rank ", c.offsets.size(), "/", c.sizes.size(),
                    ", the tensor ", t.shape.size());
      }
      uint64_t volume = 1;
      for (size_t d = 0; d < t.shape.size(); ++d) {
        if (c.offsets[d] > t.shape[d] - c.sizes[d]) {
          return Loss(where, ": chunk ", i, " (offset ", c.offsets[d], ", size ", c.sizes[d],
                      " in dimension ", d, ") is outside the shape (", t.shape[d], ")");
        }
        volume *= static_cast<uint64_t>(c.sizes[d]);  // <= total: no overflow
      }
      if (volume == 0) continue;
      for (size_t j = 0; j < i; ++j) {
        const DcpChunk& o = t.chunks[j];
        bool overlap = true;
        for (size_t d = 0; d < t.shape.size() && overlap; ++d) {
          overlap = c.offsets[d] < o.offsets[d] + o.sizes[d] && o.offsets[d] < c.offsets[d] + c.sizes[d];
        }
        if (overlap) return Loss(where, ": chunks ", j, " and ", i, " overlap");
      }
      covered += volume;
    }
    if (covered != total) {
      return Loss(where, ": its chunks cover ", covered, " of its ", total, " elements");
    }
    return OkStatus();
  }

  Result<DcpMetadata> Run(std::string_view bytes) {
    TS_ASSIGN_OR_RETURN(PickleTree tree,
                        DecodePickle(bytes, DcpPickleGlobals(), StrCat(what_, "/.metadata")));
    const PickleValue* root = &tree.root();
    if (!root->IsObjectOf(MetaClass("Metadata"))) {
      return Loss(".metadata holds a ", Describe(root), ", not a DCP Metadata");
    }
    DcpMetadata out;
    if (root->state != nullptr && root->state->Is(PickleKind::kDict)) {
      if (const PickleValue* v = root->state->Find("version"); v != nullptr && v->Is(PickleKind::kStr)) {
        out.version = v->text;
      }
    }
    TS_ASSIGN_OR_RETURN(const PickleValue* sd, Field(root, "state_dict_metadata", "Metadata"));
    TS_ASSIGN_OR_RETURN(const PickleValue* storage, Field(root, "storage_data", "Metadata"));
    if (!sd->Is(PickleKind::kDict) || !storage->Is(PickleKind::kDict)) {
      return Loss("Metadata's state_dict_metadata and storage_data are not dicts");
    }
    const PickleValue* planner_data = root->state->Find("planner_data");
    if (planner_data != nullptr && !planner_data->Is(PickleKind::kDict)) planner_data = nullptr;

    // storage_data: MetadataIndex(fqn, offset (torch.Size, None for bytes), index) -> location.
    std::map<std::tuple<std::string, bool, std::vector<int64_t>>, DcpItemLocation> locations;
    for (const auto& [key, info] : storage->entries) {
      if (!key->IsObjectOf(MetaClass("MetadataIndex"))) {
        return Loss("a storage_data key is a ", Describe(key), ", not a MetadataIndex");
      }
      TS_ASSIGN_OR_RETURN(const PickleValue* fqn_v, Field(key, "fqn", "a storage_data key"));
      TS_ASSIGN_OR_RETURN(std::string fqn, Str(fqn_v, "a storage_data key"));
      const std::string where = StrCat("storage of '", fqn, "'");
      // A bytes item's index pickles without its offset (None, the default).
      const PickleValue* offset_v = key->state->Find("offset");
      std::vector<int64_t> offset;
      const bool has_offset = offset_v != nullptr && !offset_v->Is(PickleKind::kNone);
      if (has_offset) {
        TS_ASSIGN_OR_RETURN(offset, Size(offset_v, where));
      }
      TS_ASSIGN_OR_RETURN(DcpItemLocation loc, Location(info, where));
      if (!locations.emplace(std::make_tuple(fqn, has_offset, offset), std::move(loc)).second) {
        return Loss(where, ": two storage entries for one item");
      }
    }
    auto find = [&](const std::string& fqn, bool has_offset, const std::vector<int64_t>& offset,
                    std::string_view where) -> Result<DcpItemLocation> {
      auto it = locations.find(std::make_tuple(fqn, has_offset, offset));
      if (it == locations.end()) return Loss(where, ": no storage entry (not in storage_data)");
      return it->second;
    };

    for (const auto& [key, entry] : sd->entries) {
      TS_ASSIGN_OR_RETURN(std::string fqn, Str(key, "a state_dict_metadata key"));
      if (entry->IsObjectOf(MetaClass("BytesStorageMetadata"))) {
        const std::string where = StrCat("bytes item '", fqn, "'");
        DcpBytesItem item;
        item.fqn = fqn;
        TS_ASSIGN_OR_RETURN(item.location, find(fqn, false, {}, where));
        item.path = Path(planner_data, fqn);
        out.bytes_items.push_back(std::move(item));
        continue;
      }
      if (!entry->IsObjectOf(MetaClass("TensorStorageMetadata"))) {
        return UnimplementedError(StrCat("DCP checkpoint ", what_, ": entry '", fqn, "' is a ",
                                         Describe(entry), ", not a tensor or bytes item"));
      }
      const std::string where = StrCat("tensor '", fqn, "'");
      DcpTensor t;
      t.fqn = fqn;
      t.path = Path(planner_data, fqn);
      TS_ASSIGN_OR_RETURN(const PickleValue* props, Field(entry, "properties", where));
      if (!props->IsObjectOf(MetaClass("TensorProperties")) || props->state == nullptr) {
        return Loss(where, ": properties are a ", Describe(props), ", not TensorProperties");
      }
      // TensorProperties pickles its fields as a tuple (dtype, layout, requires_grad,
      // memory_format, pin_memory); older torch as a dict.
      const PickleValue* dtype_v = props->state->Is(PickleKind::kTuple) && !props->state->items.empty()
                                       ? props->state->items[0]
                                       : props->state->Find("dtype");
      if (dtype_v == nullptr || !dtype_v->Is(PickleKind::kGlobal) ||
          dtype_v->text.rfind("torch.", 0) != 0) {
        return Loss(where, ": no torch dtype in its properties");
      }
      TS_ASSIGN_OR_RETURN(t.dtype, DTypeFromTorchName(std::string_view(dtype_v->text).substr(6),
                                                      StrCat(what_, ": ", where)));
      TS_ASSIGN_OR_RETURN(const PickleValue* size, Field(entry, "size", where));
      TS_ASSIGN_OR_RETURN(t.shape, Size(size, where));
      TS_ASSIGN_OR_RETURN(const PickleValue* chunks, Field(entry, "chunks", where));
      if (!chunks->Is(PickleKind::kList)) return Loss(where, ": chunks are not a list");
      for (const PickleValue* c : chunks->items) {
        if (!c->IsObjectOf(MetaClass("ChunkStorageMetadata"))) {
          return Loss(where, ": a chunk is a ", Describe(c), ", not a ChunkStorageMetadata");
        }
        DcpChunk chunk;
        TS_ASSIGN_OR_RETURN(const PickleValue* o, Field(c, "offsets", where));
        TS_ASSIGN_OR_RETURN(chunk.offsets, Size(o, where));
        TS_ASSIGN_OR_RETURN(const PickleValue* s, Field(c, "sizes", where));
        TS_ASSIGN_OR_RETURN(chunk.sizes, Size(s, where));
        TS_ASSIGN_OR_RETURN(chunk.location,
                            find(fqn, true, chunk.offsets,
                                 StrCat(where, " chunk at ", OffsetsText(chunk.offsets))));
        t.chunks.push_back(std::move(chunk));
      }
      TS_RETURN_IF_ERROR(CheckTiling(t));
      out.tensors.push_back(std::move(t));
    }
    return out;
  }

  static std::string OffsetsText(const std::vector<int64_t>& v) {
    std::string s = "(";
    for (size_t i = 0; i < v.size(); ++i) s += StrCat(i ? ", " : "", v[i]);
    return s + ")";
  }

 private:
  std::string what_;
};

}  // namespace

Result<DType> DTypeFromTorchName(std::string_view name, std::string_view where) {
  static constexpr std::pair<std::string_view, DType> kNames[] = {
      {"bool", DType::kBool},           {"int8", DType::kInt8},
      {"int16", DType::kInt16},         {"int32", DType::kInt32},
      {"int64", DType::kInt64},         {"uint8", DType::kUint8},
      {"uint16", DType::kUint16},       {"uint32", DType::kUint32},
      {"uint64", DType::kUint64},       {"float16", DType::kFloat16},
      {"bfloat16", DType::kBfloat16},   {"float32", DType::kFloat32},
      {"float64", DType::kFloat64},     {"complex64", DType::kComplex64},
      {"complex128", DType::kComplex128}, {"float8_e4m3fn", DType::kFloat8E4m3fn},
      {"float8_e5m2", DType::kFloat8E5m2}, {"float8_e4m3fnuz", DType::kFloat8E4m3fnuz},
      {"float8_e5m2fnuz", DType::kFloat8E5m2fnuz}, {"float8_e8m0fnu", DType::kFloat8E8m0fnu},
  };
  for (const auto& [n, dtype] : kNames) {
    if (n == name) return dtype;
  }
  return UnimplementedError(StrCat(where, ": torch dtype ", name, " is not supported"));
}

Result<DcpMetadata> ParseDcpMetadata(std::string_view bytes, std::string_view what) {
  Parser parser(what);
  return parser.Run(bytes);
}

}  // namespace tensorstash
