// tree.json: the pytree of one checkpoint item and the metadata of its arrays.
//
// The tree holds nested dicts (string keys, in order), lists, tuples, None, and leaves of kind
// array, int, float, bool, string and bytes. Array leaves refer to entries of the `arrays` table,
// which carries each array's dtype, shape, chunk grid and codec. docs/format.md, "tree.json",
// is the spec; EncodeTreeJson and DecodeTreeJson are exact inverses.
//
// Array paths name arrays in APIs and messages: the keys from the root to the leaf joined by
// '/', each key escaped as in JSON Pointer (RFC 6901: '~' -> "~0", '/' -> "~1"), list and tuple
// positions as decimal numbers. "opt/mu/layer~10" is key "layer/0" under "mu" under "opt". An
// array's path MUST be the path of its leaf; DecodeTreeJson checks it.
//
// Thread-safety: value types and pure functions.
#ifndef TENSORSTASH_FORMAT_TREE_H_
#define TENSORSTASH_FORMAT_TREE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorstash/array/chunk_grid.h"
#include "tensorstash/array/dtype.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

inline constexpr int kTreeMajorVersion = 1;
inline constexpr int kTreeMinorVersion = 0;
inline constexpr int kMaxTreeDepth = 512;

enum class Codec : uint8_t { kNone, kZstd };
std::string_view CodecName(Codec codec);  // "none", "zstd"

struct ArrayMetadata {
  std::string path;
  DType dtype = DType::kFloat32;
  ChunkGrid grid;  // grid.shape is the array's shape
  Codec codec = Codec::kNone;
  int zstd_level = 0;  // meaningful for kZstd

  const std::vector<int64_t>& shape() const { return grid.shape; }
};

struct TreeNode {
  enum class Kind : uint8_t {
    kNone,
    kDict,
    kList,
    kTuple,
    kArray,
    kInt,
    kFloat,
    kBool,
    kString,
    kBytes
  };
  Kind kind = Kind::kNone;
  std::vector<std::pair<std::string, TreeNode>> entries;  // kDict, in order
  // kDict whose keys are not all strings (tree.json kind "typed_dict"): entry i's key as a node
  // (int, bool, float, string, bytes, none, or a tuple of those); entries[i].first is then
  // the key's text, which paths use. Empty for a plain dict.
  std::vector<TreeNode> keys;
  std::vector<TreeNode> items;                            // kList, kTuple
  int64_t array_id = -1;                                  // kArray: position in `arrays`
  // kArray: the leaf's optional "sharding" member (docs/format.md 4.2), a JSON object kept as
  // its compact text, or empty. The core stores and copies it, and never interprets it: the
  // framework fronts record what their arrays were sharded as (Python: the JAX mesh).
  std::string sharding;
  std::string int_value;                                  // kInt: decimal, any magnitude ("-12")
  double float_value = 0;                                 // kFloat
  bool bool_value = false;                                // kBool
  std::string string_value;                               // kString (UTF-8) and kBytes (raw)

  // Declared here and defined in tree.cc: with an implicit one, clang + libstdc++ ask whether
  // TreeNode is default constructible while still deciding it (std::pair<std::string, TreeNode>
  // in `entries`), and refuse to compile.
  TreeNode();

  static TreeNode Dict();
  static TreeNode Array(int64_t id);
};

inline TreeNode TreeNode::Dict() {
  TreeNode node;
  node.kind = Kind::kDict;
  return node;
}
inline TreeNode TreeNode::Array(int64_t id) {
  TreeNode node;
  node.kind = Kind::kArray;
  node.array_id = id;
  return node;
}

struct TreeFile {
  TreeNode root;
  std::vector<ArrayMetadata> arrays;
};

// The "kind" of a node as tree.json names it ("dict", "float", ...), and the text tree.json
// stores a float leaf's value as: the shortest that parses back to the same double, whatever
// the process locale; "nan", "-nan", "inf" and "-inf" for the special values.
std::string_view TreeNodeKindName(TreeNode::Kind kind);
std::string TreeFloatText(double value);

// Escapes one key for use in an array path, and splits a path back into keys.
std::string EscapePathKey(std::string_view key);
Result<std::vector<std::string>> SplitArrayPath(std::string_view path);

// Builds nested dicts from array paths: array i becomes an array leaf at arrays[i].path. Two
// paths where one is a prefix of the other, or duplicates, are InvalidArgument.
Result<TreeNode> TreeFromArrayPaths(const std::vector<ArrayMetadata>& arrays);

// One tree node (the "tree" member of tree.json) to and from JSON text, for the Python front,
// which builds and rebuilds pytrees in that schema. TreeNodeFromJson checks the node schema and
// depth but not array references (arrays are checked when the whole tree.json is); malformed
// input is InvalidArgument.
Result<std::string> TreeNodeToJson(const TreeNode& node);
Result<TreeNode> TreeNodeFromJson(std::string_view text);

// Serializes to JSON text. InvalidArgument if a key or string is not valid UTF-8.
Result<std::string> EncodeTreeJson(const TreeFile& tree);

// Parses and checks tree.json read from `where`: JSON syntax, nesting depth (kMaxTreeDepth),
// version (newer major -> Unimplemented), dtype names, chunk grids (ValidateChunkGrid), unique
// array paths, every array referenced by exactly one leaf. DataLoss naming `where` otherwise.
Result<TreeFile> DecodeTreeJson(std::string_view text, std::string_view where);

}  // namespace tensorstash

#endif  // TENSORSTASH_FORMAT_TREE_H_
