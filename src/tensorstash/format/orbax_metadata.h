// Orbax's `_METADATA`: what a PyTree item records about its tree (orbax-checkpoint 0.12's
// metadata/tree.py), as a plain value, and its encode/decode pair (docs/foreign_formats.md,
// "Orbax checkpoints"). The file names are in orbax_names.h.
//
//   {"tree_metadata": {"('params', 'w')": {"key_metadata": [{"key": "params", "key_type": 2},
//                                                          {"key": "w", "key_type": 2}],
//                                         "value_metadata": {"value_type": "jax.Array",
//                                                            "skip_deserialize": false,
//                                                            "write_shape": [2, 3]}}, ...},
//    "use_ocdbt": true, "use_zarr3": true, "store_array_data_equal_to_fill_value": true,
//    "custom_metadata": null}
//
// One entry per leaf, in the pytree's order. Orbax reads a leaf's keys from key_metadata; the
// entry's name is a label. An array leaf's zarr array is named by its keys joined with '.'.
//
// Thread-safety: value types and pure functions.
#ifndef TENSORSTASH_FORMAT_ORBAX_METADATA_H_
#define TENSORSTASH_FORMAT_ORBAX_METADATA_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/util/status.h"

namespace tensorstash {

// Larger `_METADATA` documents are refused unread.
inline constexpr uint64_t kMaxOrbaxMetadataBytes = uint64_t{256} << 20;
// JSON nested deeper than this is refused: Python's json module, which Orbax reads with, stops
// near 1000 levels, and a real `_METADATA` needs a handful.
inline constexpr int kMaxOrbaxMetadataNesting = 1000;

// value_metadata.value_type of the leaves tensorstash reads and writes. Any other string is a
// custom TypeHandler's, decoded as it is.
inline constexpr char kOrbaxJaxArrayType[] = "jax.Array";
inline constexpr char kOrbaxNumpyArrayType[] = "np.ndarray";
inline constexpr char kOrbaxScalarType[] = "scalar";       // a 0-d zarr array
inline constexpr char kOrbaxStringType[] = "string";       // the value is in _strings.json
// Leaves without data (Orbax's empty_values.py), skip_deserialize true.
inline constexpr char kOrbaxNoneType[] = "None";
inline constexpr char kOrbaxNamedTupleType[] = "NamedTuple";
inline constexpr char kOrbaxEmptyDictType[] = "Dict";
inline constexpr char kOrbaxEmptyListType[] = "List";
inline constexpr char kOrbaxEmptyTupleType[] = "Tuple";

// Orbax's KeyType: key_metadata's key_type.
enum class OrbaxKeyType : int { kSequence = 1, kDict = 2 };

struct OrbaxKey {
  std::string name;  // a dict key, or a sequence position in decimal ("0")
  OrbaxKeyType type = OrbaxKeyType::kDict;
  bool operator==(const OrbaxKey&) const = default;
};

// One entry of tree_metadata: one leaf.
struct OrbaxTreeEntry {
  std::string name;            // its key in tree_metadata; Orbax writes OrbaxEntryName(keys)
  std::vector<OrbaxKey> keys;  // key_metadata, from the root
  std::string value_type;      // value_metadata.value_type (kOrbax*Type, or a custom one)
  // value_metadata's optional fields; absent ones are not written.
  std::optional<bool> skip_deserialize;
  std::optional<std::vector<int64_t>> write_shape;  // jax.Array leaves: the shard shape
  bool operator==(const OrbaxTreeEntry&) const = default;
};

struct OrbaxMetadata {
  std::vector<OrbaxTreeEntry> tree;  // tree_metadata, in the order written
  std::optional<bool> use_ocdbt;
  std::optional<bool> use_zarr3;
  // false: chunks equal to the fill value were left out, so a missing chunk is not damage.
  std::optional<bool> store_array_data_equal_to_fill_value;
  // custom_metadata is written null and not decoded.
  bool operator==(const OrbaxMetadata&) const = default;
};

// How Orbax names an entry, Python's str(tuple(names)): "('params', 'w')", "('lr',)".
std::string OrbaxEntryName(const std::vector<OrbaxKey>& keys);

// The `_METADATA` text of `metadata`: compact JSON, entries in order, absent fields left out,
// custom_metadata null. Entry names must be distinct (DecodeOrbaxMetadata refuses repeats).
std::string EncodeOrbaxMetadata(const OrbaxMetadata& metadata);

// Parses `_METADATA` text. `where` names the document in errors ("Orbax metadata
// 'step/_METADATA'"). On success returns every entry of tree_metadata in the order written,
// with its keys and value type; value types are not interpreted. On failure returns DataLoss
// naming `where` (and the entry) and what is wrong: text over kMaxOrbaxMetadataBytes, not JSON,
// nested deeper than kMaxOrbaxMetadataNesting, no "tree_metadata" object (Orbax before 0.5, or
// not a PyTree item), an entry that repeats or lacks key_metadata or value_metadata, a key
// without a string "key" or an integer "key_type", a key_type other than 1 or 2, no string
// value_type. The optional fields (skip_deserialize, write_shape, the use_* and
// store_array_data_equal_to_fill_value flags) are taken when they have Orbax's type and read
// as absent otherwise, as tensorstash needs none of them to read; the reader's defaults apply.
Result<OrbaxMetadata> DecodeOrbaxMetadata(std::string_view json, std::string_view where);

}  // namespace tensorstash

#endif  // TENSORSTASH_FORMAT_ORBAX_METADATA_H_
