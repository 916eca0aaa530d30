#include "tensorstash/checkpoint/orbax_reader.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <map>
#include <optional>

#include "nlohmann/json.hpp"
#include "tensorstash/array/convert.h"
#include "tensorstash/engine/executor.h"
#include "tensorstash/engine/read_plan.h"
#include "tensorstash/format/orbax_metadata.h"
#include "tensorstash/format/orbax_names.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

using OrderedJson = nlohmann::ordered_json;

// The values of Orbax's string leaves (orbax/checkpoint/_src/serialization/type_handlers.py).
constexpr char kOrbaxStringsFile[] = "_strings.json";

struct KeyPart {
  std::string name;
  bool sequence = false;
};

std::string KeysText(const std::vector<KeyPart>& keys) {
  std::string out = "(";
  for (size_t i = 0; i < keys.size(); ++i) {
    out += StrCat(i ? ", " : "", "'", keys[i].name, "'");
  }
  return out + ")";
}

// Reads a metadata document of at most kMaxOrbaxMetadataBytes. NotFound passes through.
Result<std::string> ReadSmallFile(KvStore* kv, const std::string& key) {
  TS_ASSIGN_OR_RETURN(uint64_t size, kv->Size(key));
  if (size > kMaxOrbaxMetadataBytes) {
    return DataLossError(
        StrCat("'", key, "' is ", size, " bytes, more than the limit of ", kMaxOrbaxMetadataBytes));
  }
  return kv->Read(key);
}

Result<OrderedJson> ParseJsonFile(KvStore* kv, const std::string& key) {
  TS_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(kv, key));
  OrderedJson doc = OrderedJson::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return DataLossError(StrCat("'", key, "' is not valid JSON"));
  return doc;
}

// Parses a jax.tree_util.keystr path ("['params']['w'][0].bias") into keys. Returns false when
// `text` is not such a path.
bool ParseKeystr(std::string_view text, std::vector<KeyPart>* keys) {
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] == '.') {
      size_t j = i + 1;
      while (j < text.size() &&
             (std::isalnum(static_cast<unsigned char>(text[j])) || text[j] == '_'))
        ++j;
      if (j == i + 1) return false;
      keys->push_back({std::string(text.substr(i + 1, j - i - 1)), false});
      i = j;
    } else if (text[i] == '[') {
      if (i + 1 >= text.size()) return false;
      const char quote = text[i + 1];
      if (quote == '\'' || quote == '"') {
        std::string key;
        size_t j = i + 2;
        for (; j < text.size() && text[j] != quote; ++j) {
          if (text[j] == '\\' && j + 1 < text.size()) ++j;  // \\ \' \"
          key += text[j];
        }
        if (j + 1 >= text.size() || text[j + 1] != ']') return false;
        keys->push_back({std::move(key), false});
        i = j + 2;
      } else {
        size_t j = i + 1;
        while (j < text.size() && std::isdigit(static_cast<unsigned char>(text[j]))) ++j;
        if (j == i + 1 || j >= text.size() || text[j] != ']' || j - i - 1 > 9) return false;
        keys->push_back({std::string(text.substr(i + 1, j - i - 1)), true});
        i = j + 1;
      }
    } else {
      return false;
    }
  }
  return !keys->empty();
}

// A chunk's position in a zarr grid (ArrayMetadata::grid: its cells are the zarr chunks).
std::vector<int64_t> GridPosition(const ChunkGrid& grid, const Box& chunk_box) {
  std::vector<int64_t> position(chunk_box.rank());
  for (int d = 0; d < chunk_box.rank(); ++d) {
    position[d] = chunk_box.origin[d] / grid.chunk_shape[d];
  }
  return position;
}

std::string GridName(const std::vector<int64_t>& grid) {
  return StrCat("[", StrJoin(grid, ", "), "]");
}

std::string CodecChainName(const std::vector<ZarrCodec>& codecs) {
  std::vector<std::string> names;
  for (const ZarrCodec& c : codecs) {
    switch (c.kind) {
      case ZarrCodecKind::kTranspose:
        names.push_back("transpose");
        break;
      case ZarrCodecKind::kBytes:
        break;  // always there; says nothing
      case ZarrCodecKind::kSharding:
        names.push_back(
            StrCat("sharded(", c.inner_codecs ? CodecChainName(*c.inner_codecs) : "", ")"));
        break;
      case ZarrCodecKind::kZstd:
        names.push_back("zstd");
        break;
      case ZarrCodecKind::kGzip:
        names.push_back("gzip");
        break;
      case ZarrCodecKind::kBlosc:
        names.push_back("blosc");
        break;
      case ZarrCodecKind::kCrc32c:
        names.push_back("crc32c");
        break;
    }
  }
  return names.empty() ? "raw" : StrJoin(names, "+");
}

}  // namespace

Result<std::string> CountingKvStore::Read(std::string_view key) {
  Result<std::string> r = base()->Read(key);
  requests_.fetch_add(1);
  if (r.ok()) bytes_.fetch_add(r->size());
  return r;
}

Status CountingKvStore::ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) {
  requests_.fetch_add(1);
  bytes_.fetch_add(size);
  return base()->ReadRange(key, offset, size, dest);
}

// The pytree while it is collected from _METADATA or array names: dicts keep their first-seen
// order, sequences are ordered by index and must end up dense.
struct OrbaxReader::Builder {
  enum class Kind { kUnset, kDict, kSeq, kLeaf };
  enum class LeafKind { kValue, kArray, kScalar };
  Kind kind = Kind::kUnset;
  std::vector<std::pair<std::string, std::unique_ptr<Builder>>> dict;
  std::map<std::string, size_t> dict_index;
  std::map<int64_t, std::unique_ptr<Builder>> seq;
  LeafKind leaf_kind = LeafKind::kValue;
  TreeNode value;      // kValue
  std::string prefix;  // kArray, kScalar: the zarr array's prefix under array_root_
  std::string where;   // the leaf's key path, for messages

  // The child for `key`, made a container of the right kind; nullptr on a conflict.
  Builder* Child(const KeyPart& key) {
    if (key.sequence) {
      if (kind != Kind::kUnset && kind != Kind::kSeq) return nullptr;
      kind = Kind::kSeq;
      int64_t index = 0;
      for (char c : key.name) {  // checked by Leaf: 1 to 9 digits
        index = index * 10 + (c - '0');
      }
      auto& slot = seq[index];
      if (!slot) slot = std::make_unique<Builder>();
      return slot.get();
    }
    if (kind != Kind::kUnset && kind != Kind::kDict) return nullptr;
    kind = Kind::kDict;
    auto [it, inserted] = dict_index.emplace(key.name, dict.size());
    if (inserted) dict.emplace_back(key.name, std::make_unique<Builder>());
    return dict[it->second].second.get();
  }

  // The leaf node at `keys`, or DataLoss when the path clashes with another leaf.
  static Result<Builder*> Leaf(Builder* root, const std::vector<KeyPart>& keys,
                               const std::string& where) {
    if (keys.size() > static_cast<size_t>(kMaxTreeDepth)) {
      return DataLossError(
          StrCat(where, ": key path ", KeysText(keys), " is deeper than ", kMaxTreeDepth));
    }
    for (const KeyPart& key : keys) {
      if (key.sequence && (key.name.empty() || key.name.size() > 9 ||
                           !std::all_of(key.name.begin(), key.name.end(), [](char c) {
                             return std::isdigit(static_cast<unsigned char>(c));
                           }))) {
        return DataLossError(
            StrCat(where, ": sequence key '", key.name, "' is not an index (up to 9 digits)"));
      }
    }
    Builder* node = root;
    for (const KeyPart& key : keys) {
      node = node->Child(key);
      if (node == nullptr) {
        return DataLossError(
            StrCat(where, ": key path ", KeysText(keys), " clashes with another leaf's path"));
      }
    }
    if (node->kind != Kind::kUnset) {
      return DataLossError(StrCat(where, ": key path ", KeysText(keys), " appears twice"));
    }
    node->kind = Kind::kLeaf;
    return node;
  }
};

OrbaxReader::OrbaxReader(KvStore* kv, std::string dir, StepFormat format, ReaderOptions options)
    : base_(kv), dir_(std::move(dir)), format_(format), options_(options) {}

OrbaxReader::~OrbaxReader() {
  // The pools run tasks that use the arrays and stores: stop them first.
  pool_.reset();
  staging_.reset();
}

Result<std::unique_ptr<OrbaxReader>> OrbaxReader::Open(KvStore* kv, std::string dir,
                                                       StepFormat format, ReaderOptions options) {
  TS_RETURN_IF_ERROR(ValidateKey(dir));
  if (options.io_threads <= 0) options.io_threads = DefaultIoThreads();
  std::unique_ptr<OrbaxReader> reader(new OrbaxReader(kv, std::move(dir), format, options));
  switch (format) {
    case StepFormat::kOrbaxOcdbt:
    case StepFormat::kOrbaxFolders:
      TS_RETURN_IF_ERROR(reader->LoadOrbax());
      break;
    case StepFormat::kZarrGroup:
      TS_RETURN_IF_ERROR(reader->LoadZarrGroup());
      break;
    case StepFormat::kNative:
    case StepFormat::kSafetensors:
    case StepFormat::kDcp:
      return InvalidArgumentError(StrCat("OrbaxReader cannot open a ", StepFormatName(format),
                                         " step"));
  }
  reader->pool_ = std::make_unique<ThreadPool>(reader->options_.io_threads);
  reader->staging_ = std::make_unique<StagingPool>(reader->options_.max_inflight_bytes);
  return reader;
}

Status OrbaxReader::CheckGridIsPlausible(const ZarrArray& array, const std::string& where) {
  constexpr uint64_t kChunksAlwaysAllowed = uint64_t{1} << 20;
  uint64_t chunks = 1;
  for (size_t d = 0; d < array.shape().size(); ++d) {
    const uint64_t extent =
        array.shape()[d] == 0
            ? 0
            : static_cast<uint64_t>((array.shape()[d] + array.chunk_shape()[d] - 1) /
                                    array.chunk_shape()[d]);
    chunks = extent != 0 && chunks > UINT64_MAX / extent ? UINT64_MAX : chunks * extent;
  }
  if (chunks <= kChunksAlwaysAllowed) return OkStatus();
  if (!stored_total_) {
    uint64_t total = 0;
    Result<std::vector<std::string>> keys = base_->List(StrCat(dir_, "/"));
    if (keys.ok()) {
      for (const std::string& key : *keys) {
        if (Result<uint64_t> size = base_->Size(key); size.ok()) total += *size;
      }
    }
    stored_total_ = total;
  }
  if (chunks <= *stored_total_) return OkStatus();
  return InvalidArgumentError(StrCat(where, ": array '", array.prefix(), "' claims a grid of ",
                                     chunks, " chunks (shape [", StrJoin(array.shape(), ", "),
                                     "], chunks [", StrJoin(array.chunk_shape(), ", "),
                                     "]), more than the ", *stored_total_,
                                     " bytes the checkpoint stores could hold: the "
                                     "metadata is damaged or hostile"));
}

Status OrbaxReader::LoadOrbax() {
  const std::string metadata_key = StrCat(dir_, "/", kOrbaxMetadataFileName);
  const std::string where = StrCat("Orbax metadata '", metadata_key, "'");
  TS_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(base_, metadata_key));
  TS_ASSIGN_OR_RETURN(OrbaxMetadata metadata, DecodeOrbaxMetadata(text, where));
  if (metadata.store_array_data_equal_to_fill_value.has_value()) {
    all_chunks_stored_ = *metadata.store_array_data_equal_to_fill_value;
  }
  if (format_ == StepFormat::kOrbaxOcdbt) {
    TS_ASSIGN_OR_RETURN(ocdbt_, OcdbtKvStore::Open(base_, dir_));
    counting_ = std::make_unique<CountingKvStore>(ocdbt_.get());
  } else {
    counting_ = std::make_unique<CountingKvStore>(base_);
    array_root_ = StrCat(dir_, "/");
  }

  Builder root;
  std::optional<OrderedJson> strings;
  for (const OrbaxTreeEntry& entry : metadata.tree) {
    const std::string leaf_where = StrCat(where, ", entry ", entry.name);
    std::vector<KeyPart> keys;
    keys.reserve(entry.keys.size());
    for (const OrbaxKey& k : entry.keys) {
      keys.push_back({k.name, k.type == OrbaxKeyType::kSequence});
    }
    const std::string& type = entry.value_type;
    TS_ASSIGN_OR_RETURN(Builder * leaf, Builder::Leaf(&root, keys, leaf_where));
    leaf->where = StrCat("leaf ", KeysText(keys), " of ", dir_);
    // Orbax names a parameter by its keys joined with '.'.
    std::vector<std::string> names;
    for (const KeyPart& k : keys) names.push_back(k.name);
    const std::string param = StrJoin(names, ".");
    if (type == kOrbaxJaxArrayType || type == kOrbaxNumpyArrayType) {
      leaf->leaf_kind = Builder::LeafKind::kArray;
      leaf->prefix = param;
    } else if (type == kOrbaxScalarType) {
      leaf->leaf_kind = Builder::LeafKind::kScalar;
      leaf->prefix = param;
    } else if (type == kOrbaxNoneType || type == kOrbaxNamedTupleType) {
      leaf->value.kind = TreeNode::Kind::kNone;
    } else if (type == kOrbaxEmptyDictType) {
      leaf->value.kind = TreeNode::Kind::kDict;
    } else if (type == kOrbaxEmptyListType) {
      leaf->value.kind = TreeNode::Kind::kList;
    } else if (type == kOrbaxEmptyTupleType) {
      leaf->value.kind = TreeNode::Kind::kTuple;
    } else if (type == kOrbaxStringType) {
      if (!strings.has_value()) {
        TS_ASSIGN_OR_RETURN(strings, ParseJsonFile(base_, StrCat(dir_, "/", kOrbaxStringsFile)));
      }
      if (!strings->is_object() || !strings->contains(param) || !(*strings)[param].is_string()) {
        return DataLossError(
            StrCat("'", dir_, "/", kOrbaxStringsFile, "' has no string for '", param, "'"));
      }
      leaf->value.kind = TreeNode::Kind::kString;
      leaf->value.string_value = (*strings)[param].get<std::string>();
    } else {
      return UnimplementedError(StrCat(leaf_where, ": value type '", type,
                                       "' (a custom Orbax TypeHandler) cannot be read"));
    }
  }

  // Creation time: _CHECKPOINT_METADATA of the item or of its manager step. Optional.
  for (const std::string& key :
       {StrCat(dir_, "/", kOrbaxCheckpointMetadataFileName),
        dir_.find('/') == std::string::npos
            ? std::string()
            : StrCat(dir_.substr(0, dir_.rfind('/')), "/", kOrbaxCheckpointMetadataFileName)}) {
    if (key.empty()) continue;
    Result<OrderedJson> meta = ParseJsonFile(base_, key);
    if (!meta.ok() || !meta->is_object()) continue;
    for (const char* field : {"commit_timestamp_nsecs", "init_timestamp_nsecs"}) {
      if (meta->contains(field) && (*meta)[field].is_number_integer()) {
        created_unix_ms_ = (*meta)[field].get<int64_t>() / 1000000;
        break;
      }
    }
    break;
  }
  // Orbax's per-process OCDBT databases: ocdbt.process_<N>/.
  if (format_ == StepFormat::kOrbaxOcdbt) {
    Result<std::vector<std::string>> keys = base_->List(StrCat(dir_, "/"));
    if (keys.ok()) {
      for (const std::string& key : *keys) {
        const std::string rest = key.substr(dir_.size() + 1);
        if (rest.rfind("ocdbt.process_", 0) == 0 && rest.ends_with("/manifest.ocdbt"))
          ++process_count_;
      }
    }
    if (process_count_ == 0) process_count_ = 1;
  }
  return Finish(root);
}

Status OrbaxReader::LoadZarrGroup() {
  counting_ = std::make_unique<CountingKvStore>(base_);
  array_root_ = StrCat(dir_, "/");
  // The commit mark: attribute write_completed of the group (.zattrs, or zarr.json attributes).
  bool completed = false;
  const std::string v2_attrs = StrCat(dir_, "/.zattrs");
  const std::string v3_doc = StrCat(dir_, "/zarr.json");
  Result<OrderedJson> attrs = ParseJsonFile(base_, v2_attrs);
  if (attrs.ok()) {
    completed = attrs->is_object() && attrs->contains("write_completed") &&
                (*attrs)["write_completed"] == true;
  } else if (!absl::IsNotFound(attrs.status())) {
    return attrs.status();
  } else {
    Result<OrderedJson> group = ParseJsonFile(base_, v3_doc);
    if (group.ok()) {
      completed = group->is_object() && group->contains("attributes") &&
                  (*group)["attributes"].is_object() &&
                  (*group)["attributes"].contains("write_completed") &&
                  (*group)["attributes"]["write_completed"] == true;
    } else if (!absl::IsNotFound(group.status())) {
      return group.status();
    }
  }
  if (!completed) {
    return FailedPreconditionError(
        StrCat("zarr checkpoint '", dir_,
               "' has no 'write_completed' attribute: the save did not "
               "finish (an incomplete or crashed save); it cannot be read"));
  }
  TS_ASSIGN_OR_RETURN(std::vector<std::string> keys, base_->List(array_root_));
  Builder root;
  for (const std::string& key : keys) {
    std::string_view rest = std::string_view(key).substr(array_root_.size());
    std::string_view name;
    if (rest.ends_with("/.zarray")) {
      name = rest.substr(0, rest.size() - 8);
    } else if (rest.ends_with("/zarr.json")) {
      name = rest.substr(0, rest.size() - 10);
      Result<OrderedJson> doc = ParseJsonFile(base_, key);
      if (!doc.ok()) return doc.status();
      if (!doc->is_object() || !doc->contains("node_type") || (*doc)["node_type"] != "array")
        continue;
    } else {
      continue;
    }
    // Names become the tree's keys, which are text (UTF-8): a name of other bytes is refused
    // here rather than failing later in whichever front decodes it.
    if (!IsValidUtf8(name)) {
      return DataLossError(StrCat("zarr checkpoint '", dir_, "': array name '", EscapeBytes(name),
                                  "' is not valid UTF-8"));
    }
    // Names are keystr paths; anything else is a nested dict by '/'.
    std::vector<KeyPart> parts;
    size_t start = 0;
    while (true) {
      const size_t slash = name.find('/', start);
      const std::string_view segment =
          name.substr(start, slash == std::string_view::npos ? slash : slash - start);
      std::vector<KeyPart> sub;
      if (ParseKeystr(segment, &sub)) {
        parts.insert(parts.end(), sub.begin(), sub.end());
      } else {
        parts.push_back({std::string(segment), false});
      }
      if (slash == std::string_view::npos) break;
      start = slash + 1;
    }
    const std::string where = StrCat("zarr checkpoint '", dir_, "', array '", name, "'");
    TS_ASSIGN_OR_RETURN(Builder * leaf, Builder::Leaf(&root, parts, where));
    leaf->where = StrCat("array '", name, "' of ", dir_);
    leaf->leaf_kind = Builder::LeafKind::kArray;
    leaf->prefix = std::string(name);
  }
  return Finish(root);
}

Status OrbaxReader::Finish(Builder& root) {
  // Depth-first, in order: array ids follow the tree order, as in native steps.
  std::function<Result<TreeNode>(Builder&, const std::string&, bool)> build =
      [&](Builder& b, const std::string& path, bool at_root) -> Result<TreeNode> {
    auto join = [&](const std::string& segment) {
      return at_root ? segment : StrCat(path, "/", segment);
    };
    switch (b.kind) {
      case Builder::Kind::kUnset:
        return TreeNode::Dict();  // an empty tree
      case Builder::Kind::kDict: {
        TreeNode node = TreeNode::Dict();
        for (auto& [key, child] : b.dict) {
          TS_ASSIGN_OR_RETURN(TreeNode sub, build(*child, join(EscapePathKey(key)), false));
          node.entries.emplace_back(key, std::move(sub));
        }
        return node;
      }
      case Builder::Kind::kSeq: {
        TreeNode node;
        node.kind = TreeNode::Kind::kList;
        int64_t expect = 0;
        for (auto& [index, child] : b.seq) {
          if (index != expect) {
            return DataLossError(
                StrCat("item ", expect, " of the list at '", path, "' in ", dir_, " is missing"));
          }
          ++expect;
          TS_ASSIGN_OR_RETURN(TreeNode sub, build(*child, join(StrCat(index)), false));
          node.items.push_back(std::move(sub));
        }
        return node;
      }
      case Builder::Kind::kLeaf:
        break;
    }
    if (b.leaf_kind == Builder::LeafKind::kValue) return std::move(b.value);
    Result<std::unique_ptr<ZarrArray>> opened =
        ZarrArray::Open(counting_.get(), StrCat(array_root_, b.prefix));
    if (!opened.ok()) {
      Status status = opened.status();
      // A missing array of a readable checkpoint is damage, not a wrong path.
      if (absl::IsNotFound(status)) status = DataLossError(status.message());
      return Annotate(status, b.where);
    }
    std::unique_ptr<ZarrArray> array = std::move(opened).value();
    array->set_all_chunks_stored(all_chunks_stored_);
    TS_RETURN_IF_ERROR(CheckGridIsPlausible(*array, b.where));
    if (b.leaf_kind == Builder::LeafKind::kScalar && array->shape().empty() &&
        Kind(array->dtype()) != DTypeKind::kComplex) {
      TreeNode node;
      union {
        int64_t i;
        uint64_t u;
        double f;
        bool b;
      } v{};
      const DTypeKind kind = Kind(array->dtype());
      const DType as = kind == DTypeKind::kBool          ? DType::kBool
                       : kind == DTypeKind::kSignedInt   ? DType::kInt64
                       : kind == DTypeKind::kUnsignedInt ? DType::kUint64
                                                         : DType::kFloat64;
      TS_RETURN_IF_ERROR(Annotate(array->Read(Box({}, {}), as, &v), b.where));
      if (kind == DTypeKind::kBool) {
        node.kind = TreeNode::Kind::kBool;
        node.bool_value = v.b;
      } else if (kind == DTypeKind::kSignedInt) {
        node.kind = TreeNode::Kind::kInt;
        node.int_value = StrCat(v.i);
      } else if (kind == DTypeKind::kUnsignedInt) {
        node.kind = TreeNode::Kind::kInt;
        node.int_value = StrCat(v.u);
      } else {
        node.kind = TreeNode::Kind::kFloat;
        node.float_value = v.f;
      }
      return node;
    }
    ArrayMetadata meta;
    meta.path = at_root ? std::string() : path;
    meta.dtype = array->dtype();
    meta.grid.shape = array->shape();
    meta.grid.chunk_shape = array->chunk_shape();
    meta.grid.cell_shape = array->chunk_shape();
    meta.codec = Codec::kNone;
    metadata_.push_back(std::move(meta));
    zarr_.push_back(std::move(array));
    return TreeNode::Array(static_cast<int64_t>(metadata_.size() - 1));
  };
  TS_ASSIGN_OR_RETURN(tree_, build(root, "", true));
  for (size_t i = 0; i < metadata_.size(); ++i) by_path_.emplace(metadata_[i].path, i);
  return OkStatus();
}

std::string OrbaxReader::ArrayWhat(size_t id) const {
  return StrCat("array '", metadata_[id].path, "' (zarr '", zarr_[id]->prefix(), "') of ", dir_);
}

void OrbaxReader::ListStored() const {
  std::call_once(stored_once_, [&] {
    stored_bytes_.assign(zarr_.size(), 0);
    stored_chunks_.assign(zarr_.size(), 0);
    KvStore* store = ocdbt_ ? static_cast<KvStore*>(ocdbt_.get()) : base_;
    // One listing of everything, each key given to the array whose prefix it has (the longest,
    // should prefixes nest): a listing per array cost O(arrays x keys) (15 s for 20k arrays).
    std::map<std::string, size_t, std::less<>> by_prefix;
    for (size_t i = 0; i < zarr_.size(); ++i) by_prefix.emplace(zarr_[i]->prefix(), i);
    Result<std::vector<std::string>> keys = store->List(array_root_);
    if (!keys.ok()) return;
    for (const std::string& key : *keys) {
      std::optional<size_t> owner;
      size_t rest_at = 0;
      for (size_t slash = key.find('/'); slash != std::string::npos;
           slash = key.find('/', slash + 1)) {
        auto it = by_prefix.find(std::string_view(key).substr(0, slash));
        if (it != by_prefix.end()) {
          owner = it->second;
          rest_at = slash + 1;
        }
      }
      if (!owner) continue;
      const std::string_view rest = std::string_view(key).substr(rest_at);
      if (rest.ends_with("zarr.json") || rest.ends_with(".zarray") || rest.ends_with(".zattrs") ||
          rest.ends_with(".zgroup")) {
        continue;  // metadata documents, not chunks
      }
      Result<uint64_t> size = store->Size(key);
      if (!size.ok()) continue;
      stored_bytes_[*owner] += *size;
      ++stored_chunks_[*owner];
    }
  });
}

uint64_t OrbaxReader::StoredBytes(size_t id) const {
  ListStored();
  return id < stored_bytes_.size() ? stored_bytes_[id] : 0;
}

int64_t OrbaxReader::NumChunks(size_t id) const {
  ListStored();
  return id < stored_chunks_.size() ? stored_chunks_[id] : 0;
}

std::string OrbaxReader::CodecDescription(size_t id) const {
  const ZarrArray& a = *zarr_[id];
  return StrCat("zarr", a.zarr_format(), " ", CodecChainName(a.metadata().codecs));
}

Status OrbaxReader::ReadMany(const std::vector<ReadRequest>& requests, ReadStats* stats,
                             const std::function<void(uint64_t, uint64_t)>& progress) {
  // 1. Which zarr chunks the requests need, each once (engine/read_plan.h).
  std::vector<BoxRead> box_reads(requests.size());
  for (size_t r = 0; r < requests.size(); ++r) {
    const ReadRequest& req = requests[r];
    auto it = by_path_.find(req.path);
    if (it == by_path_.end()) {
      return NotFoundError(StrCat("no array '", req.path, "' in ", dir_));
    }
    const ArrayMetadata& a = metadata_[it->second];
    TS_RETURN_IF_ERROR(ValidateReadRequest(req, a, req.dtype));
    if (!CanConvert(a.dtype, req.dtype)) {
      return InvalidArgumentError(StrCat("reading ", ArrayWhat(it->second), ": cannot convert ",
                                         DTypeName(a.dtype), " to ", DTypeName(req.dtype)));
    }
    box_reads[r] = {static_cast<uint32_t>(it->second), &a.grid, req.box};
    if (!req.box.empty() && !Box::FromShape(a.shape()).Contains(req.box)) {
      // Zeros where the box reaches past the stored shape, as CheckpointReader does.
      std::memset(req.dest, 0, req.box.num_elements() * ItemSize(req.dtype));
    }
  }
  const std::vector<NeededChunk> needed = PlanChunkPieces(box_reads);
  uint64_t total = 0;
  for (const NeededChunk& n : needed) {
    for (const ChunkPiece& p : n.pieces) {
      total += static_cast<uint64_t>(p.region.num_elements()) * ItemSize(requests[p.read].dtype);
    }
  }

  // 2. One task per chunk, under the byte cap (engine/executor.h). A chunk several requests
  // need is decoded once into staging and copied into each; a chunk with one piece (or one
  // larger than the cap) is read into its destination, in place when it lands whole.
  const uint64_t bytes_before = counting_->bytes(), requests_before = counting_->requests();
  std::mutex mutex;
  uint64_t done = 0;
  auto report = [&](const ChunkPiece& p) {
    if (!progress) return;
    std::lock_guard<std::mutex> lock(mutex);
    done += static_cast<uint64_t>(p.region.num_elements()) * ItemSize(requests[p.read].dtype);
    progress(done, total);
  };
  // Part `region` of chunk `n`, into `dest` laid out over `box`.
  auto read_chunk = [&](const NeededChunk& n, const Box& region, const Box& box, DType dtype,
                        void* dest) {
    return Annotate(
        zarr_[n.array_id]->ReadChunkRegion(GridPosition(metadata_[n.array_id].grid, n.chunk_box),
                                           region, box, dtype, dest, staging_.get()),
        StrCat("reading ", ArrayWhat(n.array_id)));
  };
  Status status;
  {
    Executor run(pool_.get(), options_.max_inflight_bytes);
    for (const NeededChunk& each : needed) {
      if (run.failed()) break;
      const NeededChunk* n = &each;
      const ArrayMetadata& a = metadata_[n->array_id];
      const uint64_t chunk_bytes =
          static_cast<uint64_t>(n->chunk_box.num_elements()) * ItemSize(a.dtype);
      if (n->pieces.size() == 1 || chunk_bytes > options_.max_inflight_bytes) {
        const std::vector<int64_t> grid = GridPosition(a.grid, n->chunk_box);
        for (const ChunkPiece& piece : n->pieces) {
          // A chunk read straight into its destination needs nothing beyond one staging piece,
          // which the staging pool bounds: it holds none of the cap, so that large chunks are
          // decoded side by side rather than one or two at a time.
          const ReadRequest& req = requests[piece.read];
          const uint64_t hold =
              zarr_[n->array_id]->ReadsInPlace(grid, piece.region, req.box, req.dtype)
                  ? 0
                  : chunk_bytes;
          run.RunHolding(hold, [&, n, p = &piece]() -> Status {
            const ReadRequest& to = requests[p->read];
            TS_RETURN_IF_ERROR(read_chunk(*n, p->region, to.box, to.dtype, to.dest));
            report(*p);
            return OkStatus();
          });
        }
        continue;
      }
      run.Run(chunk_bytes, [&, n](char* decoded) -> Status {
        const ArrayMetadata& stored = metadata_[n->array_id];
        TS_RETURN_IF_ERROR(read_chunk(*n, n->chunk_box, n->chunk_box, stored.dtype, decoded));
        for (const ChunkPiece& p : n->pieces) {
          const ReadRequest& req = requests[p.read];
          TS_RETURN_IF_ERROR(CopyBox(p.region, stored.dtype, decoded, n->chunk_box, req.dtype,
                                     req.dest, req.box, ArrayWhat(n->array_id)));
          report(p);
        }
        return OkStatus();
      });
    }
    status = run.Wait();
  }
  if (stats != nullptr) {
    *stats = ReadStats();
    stats->bytes_read = counting_->bytes() - bytes_before;
    stats->requests = counting_->requests() - requests_before;
  }
  return status;
}

Result<std::string> OrbaxReader::ReadFile(std::string_view name) const {
  // Only names inside the checkpoint's folder: no absolute path, no empty, "." or ".." part.
  bool inside = !name.empty() && name.front() != '/';
  for (std::string_view part : StrSplit(name, '/')) {
    inside = inside && !part.empty() && part != "." && part != "..";
  }
  if (!inside) {
    return InvalidArgumentError(
        StrCat("'", name, "' does not name a file inside the checkpoint '", dir_, "'"));
  }
  // Orbax's own files (`_sharding`, `array_metadatas/process_0`) are plain files of the folder,
  // beside the OCDBT database, on whatever store the checkpoint is: read through the base store.
  const std::string key = dir_.empty() ? std::string(name) : StrCat(dir_, "/", name);
  Result<std::string> data = base_->Read(key);
  if (!data.ok() && absl::IsNotFound(data.status())) {
    return NotFoundError(StrCat("the ", StepFormatName(format_), " checkpoint '", dir_,
                                "' has no file '", name, "'"));
  }
  return data;
}

uint64_t OrbaxReader::VerifyTotalBytes() const {
  uint64_t total = 0;
  for (const ArrayMetadata& a : metadata_) {
    int64_t n = 1;
    for (int64_t e : a.shape()) n *= e;
    total += static_cast<uint64_t>(n) * ItemSize(a.dtype);
  }
  return total;
}

size_t OrbaxReader::VerifyTotalItems() const {
  size_t n = 0;
  for (const ArrayMetadata& a : metadata_) n += static_cast<size_t>(a.grid.NumStoredChunks());
  return n;
}

Result<std::vector<BadChunk>> OrbaxReader::Verify(
    const std::function<void(uint64_t, uint64_t)>& progress) {
  std::mutex mutex;
  std::vector<BadChunk> bad;
  // Every node of the OCDBT B+tree (List walks them all; each is checked when decoded), and of
  // each process's own database: Orbax merges those into the top-level one, whose tree then
  // reaches their values but not their nodes; damage there is damage too.
  if (ocdbt_) {
    if (Result<std::vector<std::string>> all = ocdbt_->List(""); !all.ok()) {
      bad.push_back({"", "", StrCat(dir_, "/manifest.ocdbt"), std::string(all.status().message())});
    }
    Result<std::vector<std::string>> keys = base_->List(StrCat(dir_, "/"));
    if (keys.ok()) {
      for (const std::string& key : *keys) {
        const std::string rest = key.substr(dir_.size() + 1);
        if (rest.rfind("ocdbt.process_", 0) != 0 || !rest.ends_with("/manifest.ocdbt") ||
            rest.find('/') != rest.size() - 15) {
          continue;
        }
        const std::string root = key.substr(0, key.size() - 15);
        Result<std::unique_ptr<OcdbtKvStore>> db = OcdbtKvStore::Open(base_, root);
        Status status = db.status();
        if (db.ok()) status = (*db)->List("").status();
        if (!status.ok()) bad.push_back({"", "", key, std::string(status.message())});
      }
    }
  }
  const uint64_t total = VerifyTotalBytes();
  uint64_t done = 0;
  {
    // One task per chunk; decoded chunks held at once stay under max_inflight_bytes (one
    // larger chunk alone), and never millions of tasks are queued at once.
    Executor run(pool_.get(), options_.max_inflight_bytes, /*max_pending=*/256);
    for (size_t id = 0; id < zarr_.size(); ++id) {
      const ChunkGrid& grid = metadata_[id].grid;
      grid.ForEachChunkIntersecting(Box::FromShape(grid.shape), [&, id](int64_t, const Box& box) {
        const ZarrArray& a = *zarr_[id];
        const std::vector<int64_t> position = GridPosition(grid, box);
        const uint64_t bytes = static_cast<uint64_t>(box.num_elements()) * ItemSize(a.dtype());
        auto checked = [&, id, position, bytes](const Status& status) {
          std::lock_guard<std::mutex> lock(mutex);
          if (!status.ok()) {
            bad.push_back({metadata_[id].path, GridName(position), zarr_[id]->ChunkKey(position),
                           std::string(status.message())});
          }
          done += bytes;
          if (progress) progress(done, total);
          return OkStatus();
        };
        run.Run(bytes, [this, &a, box, position, checked](char* scratch) {
          if (!all_chunks_stored_) {
            // A chunk left out holds the fill value: nothing stored to check (and a sparse
            // grid of huge chunks must not cost a fill of each).
            Result<bool> stored = a.ChunkStored(position);
            if (stored.ok() && !*stored) return checked(OkStatus());
          }
          return checked(a.ReadChunkRegion(position, box, box, a.dtype(), scratch));
        });
      });
    }
    TS_RETURN_IF_ERROR(run.Wait());
  }
  std::sort(bad.begin(), bad.end(), [](const BadChunk& a, const BadChunk& b) {
    return std::tie(a.array_path, a.chunk) < std::tie(b.array_path, b.chunk);
  });
  return bad;
}

}  // namespace tensorstash
