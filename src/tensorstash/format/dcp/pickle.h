// A Python pickle decoder (protocols 2 to 5) that never runs code: it turns the opcodes into a
// small tree of values, and a reference to a class or function ("global") is kept as its
// qualified name, only if an allow-list names it. PyTorch's DCP writes its `.metadata` as a
// pickle and torch.save writes a tensor's description (data.pkl) as one; this reads both without
// trusting them (unpickling with Python would run whatever a hostile file names).
//
// What a pickle builds maps onto the tree as follows: None, bool, int (up to 64 bits), float,
// str, bytes (bytearray too), list, tuple, dict (keys in insertion order), a global
// ("module.name"), an object (a call of a global with an argument tuple, from REDUCE or NEWOBJ;
// BUILD sets its state), and a persistent id (BINPERSID: torch.save's reference to a storage).
// Sets, extension codes, out-of-band buffers and the text opcodes of protocols 0 and 1 (other
// than GLOBAL, which protocol 2 still uses) are refused.
//
// Memory: the tree is at most one node per input byte; a length in the input (a string, a memo
// index) is checked against the bytes left before anything is allocated for it.
// A pickle can build a cycle through its memo (a list appended to itself): the tree holds it
// (nodes are owned by the tree, not by each other), so code walking a tree must bound its depth.
//
// Thread-safety: a PickleTree is immutable once decoded; DecodePickle is a pure function.
#ifndef TENSORSTASH_FORMAT_DCP_PICKLE_H_
#define TENSORSTASH_FORMAT_DCP_PICKLE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

enum class PickleKind : uint8_t {
  kNone,
  kBool,
  kInt,
  kFloat,
  kStr,
  kBytes,
  kList,
  kTuple,
  kDict,
  kGlobal,         // text: "module.name"
  kObject,         // callee (a kGlobal), args (a kTuple), state (BUILD's argument, or null)
  kPersistentId,   // args: the persistent id value
};

std::string_view PickleKindName(PickleKind kind);

struct PickleValue {
  PickleKind kind = PickleKind::kNone;
  uint64_t offset = 0;  // where in the pickle the opcode that made it starts
  bool boolean = false;
  int64_t integer = 0;
  double real = 0;
  std::string text;  // kStr (UTF-8 as stored), kBytes, kGlobal
  std::vector<const PickleValue*> items;  // kList / kTuple
  std::vector<std::pair<const PickleValue*, const PickleValue*>> entries;  // kDict
  const PickleValue* callee = nullptr;  // kObject: the global called
  // kObject: the argument tuple (shared, not copied: a memoized tuple can be used many times);
  // kPersistentId: the id.
  const PickleValue* args = nullptr;
  const PickleValue* state = nullptr;  // kObject: set by BUILD, else null

  bool Is(PickleKind k) const { return kind == k; }
  // kDict: the value of the last entry whose key is the str `key`; null if there is none.
  const PickleValue* Find(std::string_view key) const;
  // kObject whose callee is the global `qualified_name`.
  bool IsObjectOf(std::string_view qualified_name) const;
};

class PickleTree {
 public:
  PickleTree() = default;
  PickleTree(PickleTree&&) = default;
  PickleTree& operator=(PickleTree&&) = default;

  const PickleValue& root() const { return *root_; }
  size_t node_count() const { return nodes_.size(); }

 private:
  friend class PickleDecoder;
  std::vector<std::unique_ptr<PickleValue>> nodes_;
  const PickleValue* root_ = nullptr;
};

// Decodes the pickle `bytes` (one pickle, ending at its STOP opcode; bytes after STOP are
// ignored). Every global (GLOBAL or STACK_GLOBAL) must be in `allowed_globals` ("module.name").
// On failure: InvalidArgument naming `what`, the byte offset and the problem, for a global not
// allowed (naming module.name), an opcode not supported, a truncated or malformed pickle, an int
// past 64 bits, a memo index never stored, or an object built from a non-global.
Result<PickleTree> DecodePickle(std::string_view bytes, absl::Span<const std::string_view> allowed_globals,
                                std::string_view what);

// The globals a real DCP checkpoint's `.metadata` (torch 2.x FileSystemWriter) and the data.pkl
// of its torch.save'd tensors name: DCP's metadata classes, torch.Size, the torch dtypes, the
// typed storages and _rebuild_tensor_v2/v3, collections.OrderedDict and pathlib's paths.
absl::Span<const std::string_view> DcpPickleGlobals();

}  // namespace tensorstash

#endif  // TENSORSTASH_FORMAT_DCP_PICKLE_H_
