#include "tensorstash/format/dcp/pickle.h"

#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tensorstash/util/str_util.h"

namespace tensorstash {

std::string_view PickleKindName(PickleKind kind) {
  switch (kind) {
    case PickleKind::kNone: return "None";
    case PickleKind::kBool: return "bool";
    case PickleKind::kInt: return "int";
    case PickleKind::kFloat: return "float";
    case PickleKind::kStr: return "str";
    case PickleKind::kBytes: return "bytes";
    case PickleKind::kList: return "list";
    case PickleKind::kTuple: return "tuple";
    case PickleKind::kDict: return "dict";
    case PickleKind::kGlobal: return "global";
    case PickleKind::kObject: return "object";
    case PickleKind::kPersistentId: return "persistent id";
  }
  return "?";
}

const PickleValue* PickleValue::Find(std::string_view key) const {
  if (kind != PickleKind::kDict) return nullptr;
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    if (it->first->kind == PickleKind::kStr && it->first->text == key) return it->second;
  }
  return nullptr;
}

bool PickleValue::IsObjectOf(std::string_view qualified_name) const {
  return kind == PickleKind::kObject && callee != nullptr && callee->text == qualified_name;
}

class PickleDecoder {
 public:
  PickleDecoder(std::string_view bytes, absl::Span<const std::string_view> allowed,
                std::string_view what)
      : bytes_(bytes), allowed_(allowed), what_(what) {}

  Result<PickleTree> Run();

 private:
  Status Error(std::string_view problem) const {
    return InvalidArgumentError(
        StrCat("pickle ", what_, ": ", problem, " at byte ", op_start_));
  }
  // Takes `n` bytes of opcode argument; a length is checked against what is left first, so a
  // hostile length allocates nothing.
  Result<std::string_view> Take(uint64_t n) {
    if (n > bytes_.size() - pos_) {
      return Error(StrCat("truncated: needs ", n, " bytes, ", bytes_.size() - pos_, " left"));
    }
    std::string_view out = bytes_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  Result<uint64_t> TakeUint(int n) {
    TS_ASSIGN_OR_RETURN(std::string_view b, Take(n));
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(b[i]);
    return v;
  }
  Result<std::string_view> TakeLine() {
    size_t end = bytes_.find('\n', pos_);
    if (end == std::string_view::npos) return Error("truncated: a GLOBAL without its newline");
    std::string_view out = bytes_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return out;
  }
  PickleValue* New(PickleKind kind) {
    tree_.nodes_.push_back(std::make_unique<PickleValue>());
    PickleValue* v = tree_.nodes_.back().get();
    v->kind = kind;
    v->offset = op_start_;
    return v;
  }
  void Push(PickleValue* v) { stack_.push_back(v); }
  Result<PickleValue*> Pop() {
    size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() <= floor) return Error("stack underflow");
    PickleValue* v = stack_.back();
    stack_.pop_back();
    return v;
  }
  Result<PickleValue*> Top() {
    size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() <= floor) return Error("stack underflow");
    return stack_.back();
  }
  // The items since the last MARK, removed from the stack with the mark.
  Result<std::vector<PickleValue*>> PopMark() {
    if (marks_.empty()) return Error("no MARK before an opcode that needs one");
    size_t start = marks_.back();
    marks_.pop_back();
    std::vector<PickleValue*> out(stack_.begin() + static_cast<ptrdiff_t>(start), stack_.end());
    stack_.resize(start);
    return out;
  }
  Status Memo(uint64_t index) {
    TS_ASSIGN_OR_RETURN(PickleValue * top, Top());
    memo_[index] = top;
    return OkStatus();
  }
  Status Get(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) return Error(StrCat("memo index ", index, " was never stored"));
    Push(it->second);
    return OkStatus();
  }
  Status Global(std::string_view module, std::string_view name) {
    std::string qualified = StrCat(module, ".", name);
    bool ok = false;
    for (std::string_view a : allowed_) ok = ok || a == qualified;
    if (!ok) {
      return Error(StrCat("global ", qualified, " is not allowed (only the classes a ",
                                "checkpoint's metadata holds are; nothing is run)"));
    }
    PickleValue* v = New(PickleKind::kGlobal);
    v->text = std::move(qualified);
    Push(v);
    return OkStatus();
  }
  Status Object(PickleValue* callee, PickleValue* args) {
    if (callee->kind != PickleKind::kGlobal) {
      return Error(StrCat("a call of a ", PickleKindName(callee->kind), ", not of a global"));
    }
    if (args->kind != PickleKind::kTuple) {
      return Error(StrCat("call arguments are a ", PickleKindName(args->kind), ", not a tuple"));
    }
    PickleValue* v = New(PickleKind::kObject);
    v->callee = callee;
    v->args = args;
    Push(v);
    return OkStatus();
  }
  Result<PickleValue*> TopList(std::string_view op) {
    TS_ASSIGN_OR_RETURN(PickleValue * v, Top());
    if (v->kind != PickleKind::kList) {
      return Error(StrCat(op, " onto a ", PickleKindName(v->kind), ", not a list"));
    }
    return v;
  }
  Result<PickleValue*> TopDict(std::string_view op) {
    TS_ASSIGN_OR_RETURN(PickleValue * v, Top());
    if (v->kind != PickleKind::kDict) {
      return Error(StrCat(op, " onto a ", PickleKindName(v->kind), ", not a dict"));
    }
    return v;
  }
  Status Int(int64_t value) {
    PickleValue* v = New(PickleKind::kInt);
    v->integer = value;
    Push(v);
    return OkStatus();
  }
  Status Text(PickleKind kind, uint64_t n) {
    TS_ASSIGN_OR_RETURN(std::string_view b, Take(n));
    PickleValue* v = New(kind);
    v->text = std::string(b);
    Push(v);
    return OkStatus();
  }
  Status Tuple(std::vector<PickleValue*> items) {
    PickleValue* v = New(PickleKind::kTuple);
    v->items.assign(items.begin(), items.end());
    Push(v);
    return OkStatus();
  }
  Status Step(uint8_t op);

  std::string_view bytes_;
  absl::Span<const std::string_view> allowed_;
  std::string_view what_;
  size_t pos_ = 0;
  size_t op_start_ = 0;
  std::vector<PickleValue*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PickleValue*> memo_;
  PickleTree tree_;
  bool stopped_ = false;
};

Status PickleDecoder::Step(uint8_t op) {
  switch (op) {
    case 0x80: {  // PROTO
      TS_ASSIGN_OR_RETURN(uint64_t proto, TakeUint(1));
      if (proto < 2 || proto > 5) return Error(StrCat("protocol ", proto, " is not 2 to 5"));
      return OkStatus();
    }
    case 0x95:  // FRAME: a length hint only
      return Take(8).status();
    case '.': {  // STOP
      if (!marks_.empty() || stack_.size() != 1) {
        return Error(StrCat("STOP with ", stack_.size(), " values and ", marks_.size(),
                                  " marks on the stack (wants one value)"));
      }
      tree_.root_ = stack_.back();
      stopped_ = true;
      return OkStatus();
    }
    case 'N': Push(New(PickleKind::kNone)); return OkStatus();
    case 0x88:
    case 0x89: {
      PickleValue* v = New(PickleKind::kBool);
      v->boolean = op == 0x88;
      Push(v);
      return OkStatus();
    }
    case 'J': {
      TS_ASSIGN_OR_RETURN(uint64_t u, TakeUint(4));
      return Int(static_cast<int32_t>(static_cast<uint32_t>(u)));
    }
    case 'K': {
      TS_ASSIGN_OR_RETURN(uint64_t u, TakeUint(1));
      return Int(static_cast<int64_t>(u));
    }
    case 'M': {
      TS_ASSIGN_OR_RETURN(uint64_t u, TakeUint(2));
      return Int(static_cast<int64_t>(u));
    }
    case 0x8a:
    case 0x8b: {  // LONG1, LONG4: little-endian two's complement of n bytes
      TS_ASSIGN_OR_RETURN(uint64_t n, TakeUint(op == 0x8a ? 1 : 4));
      if (op == 0x8b && n > 0x7fffffffu) return Error("negative LONG4 length");
      if (n > 8) return Error(StrCat("an int of ", n, " bytes (past 64 bits)"));
      TS_ASSIGN_OR_RETURN(std::string_view b, Take(n));
      uint64_t u = 0;
      for (size_t i = n; i > 0; --i) u = (u << 8) | static_cast<uint8_t>(b[i - 1]);
      if (n > 0 && n < 8 && (static_cast<uint8_t>(b[n - 1]) & 0x80)) u |= ~uint64_t{0} << (8 * n);
      return Int(static_cast<int64_t>(u));
    }
    case 'G': {  // BINFLOAT: big-endian IEEE double
      TS_ASSIGN_OR_RETURN(std::string_view b, Take(8));
      uint64_t u = 0;
      for (char c : b) u = (u << 8) | static_cast<uint8_t>(c);
      PickleValue* v = New(PickleKind::kFloat);
      std::memcpy(&v->real, &u, 8);
      Push(v);
      return OkStatus();
    }
    case 'X': {
      TS_ASSIGN_OR_RETURN(uint64_t n, TakeUint(4));
      return Text(PickleKind::kStr, n);
    }
    case 0x8c: {
      TS_ASSIGN_OR_RETURN(uint64_t n, TakeUint(1));
      return Text(PickleKind::kStr, n);
    }
    case 0x8d: {
      TS_ASSIGN_OR_RETURN(uint64_t n, TakeUint(8));
      return Text(PickleKind::kStr, n);
    }
    case 'B': {
      TS_ASSIGN_OR_RETURN(uint64_t n, TakeUint(4));
      return Text(PickleKind::kBytes, n);
    }
    case 'C': {
      TS_ASSIGN_OR_RETURN(uint64_t n, TakeUint(1));
      return Text(PickleKind::kBytes, n);
    }
    case 0x8e:
    case 0x96: {  // BINBYTES8, BYTEARRAY8
      TS_ASSIGN_OR_RETURN(uint64_t n, TakeUint(8));
      return Text(PickleKind::kBytes, n);
    }
    case ']': Push(New(PickleKind::kList)); return OkStatus();
    case ')': Push(New(PickleKind::kTuple)); return OkStatus();
    case '}': Push(New(PickleKind::kDict)); return OkStatus();
    case 'l': {
      TS_ASSIGN_OR_RETURN(std::vector<PickleValue*> items, PopMark());
      PickleValue* v = New(PickleKind::kList);
      v->items.assign(items.begin(), items.end());
      Push(v);
      return OkStatus();
    }
    case 't': {
      TS_ASSIGN_OR_RETURN(std::vector<PickleValue*> items, PopMark());
      return Tuple(std::move(items));
    }
    case 0x85:
    case 0x86:
    case 0x87: {  // TUPLE1..3
      size_t n = op - 0x84;
      std::vector<PickleValue*> items(n);
      for (size_t i = n; i > 0; --i) {
        TS_ASSIGN_OR_RETURN(items[i - 1], Pop());
      }
      return Tuple(std::move(items));
    }
    case 'd': {
      TS_ASSIGN_OR_RETURN(std::vector<PickleValue*> items, PopMark());
      if (items.size() % 2 != 0) return Error("DICT with an odd number of items");
      PickleValue* v = New(PickleKind::kDict);
      for (size_t i = 0; i < items.size(); i += 2) v->entries.emplace_back(items[i], items[i + 1]);
      Push(v);
      return OkStatus();
    }
    case 'a': {
      TS_ASSIGN_OR_RETURN(PickleValue * item, Pop());
      TS_ASSIGN_OR_RETURN(PickleValue * list, TopList("APPEND"));
      list->items.push_back(item);
      return OkStatus();
    }
    case 'e': {
      TS_ASSIGN_OR_RETURN(std::vector<PickleValue*> items, PopMark());
      TS_ASSIGN_OR_RETURN(PickleValue * list, TopList("APPENDS"));
      list->items.insert(list->items.end(), items.begin(), items.end());
      return OkStatus();
    }
    case 's': {
      TS_ASSIGN_OR_RETURN(PickleValue * value, Pop());
      TS_ASSIGN_OR_RETURN(PickleValue * key, Pop());
      TS_ASSIGN_OR_RETURN(PickleValue * dict, TopDict("SETITEM"));
      dict->entries.emplace_back(key, value);
      return OkStatus();
    }
    case 'u': {
      TS_ASSIGN_OR_RETURN(std::vector<PickleValue*> items, PopMark());
      if (items.size() % 2 != 0) return Error("SETITEMS with an odd number of items");
      TS_ASSIGN_OR_RETURN(PickleValue * dict, TopDict("SETITEMS"));
      for (size_t i = 0; i < items.size(); i += 2) {
        dict->entries.emplace_back(items[i], items[i + 1]);
      }
      return OkStatus();
    }
    case '(': marks_.push_back(stack_.size()); return OkStatus();
    case '0': return Pop().status();
    case '1': return PopMark().status();
    case '2': {
      TS_ASSIGN_OR_RETURN(PickleValue * v, Top());
      Push(v);
      return OkStatus();
    }
    case 'h': {
      TS_ASSIGN_OR_RETURN(uint64_t i, TakeUint(1));
      return Get(i);
    }
    case 'j': {
      TS_ASSIGN_OR_RETURN(uint64_t i, TakeUint(4));
      return Get(i);
    }
    case 'q': {
      TS_ASSIGN_OR_RETURN(uint64_t i, TakeUint(1));
      return Memo(i);
    }
    case 'r': {
      TS_ASSIGN_OR_RETURN(uint64_t i, TakeUint(4));
      return Memo(i);
    }
    case 0x94: return Memo(memo_.size());
    case 'c': {  // GLOBAL "module\nname\n"
      TS_ASSIGN_OR_RETURN(std::string_view module, TakeLine());
      TS_ASSIGN_OR_RETURN(std::string_view name, TakeLine());
      return Global(module, name);
    }
    case 0x93: {  // STACK_GLOBAL
      TS_ASSIGN_OR_RETURN(PickleValue * name, Pop());
      TS_ASSIGN_OR_RETURN(PickleValue * module, Pop());
      if (name->kind != PickleKind::kStr || module->kind != PickleKind::kStr) {
        return Error("STACK_GLOBAL of values that are not strings");
      }
      return Global(module->text, name->text);
    }
    case 'R':
    case 0x81: {  // REDUCE, NEWOBJ: callable/class, then the argument tuple
      TS_ASSIGN_OR_RETURN(PickleValue * args, Pop());
      TS_ASSIGN_OR_RETURN(PickleValue * callee, Pop());
      return Object(callee, args);
    }
    case 0x92: {  // NEWOBJ_EX: class, args, kwargs (only empty kwargs)
      TS_ASSIGN_OR_RETURN(PickleValue * kwargs, Pop());
      TS_ASSIGN_OR_RETURN(PickleValue * args, Pop());
      TS_ASSIGN_OR_RETURN(PickleValue * callee, Pop());
      if (kwargs->kind != PickleKind::kDict || !kwargs->entries.empty()) {
        return Error("NEWOBJ_EX with keyword arguments");
      }
      return Object(callee, args);
    }
    case 'b': {  // BUILD
      TS_ASSIGN_OR_RETURN(PickleValue * state, Pop());
      TS_ASSIGN_OR_RETURN(PickleValue * object, Top());
      if (object->kind != PickleKind::kObject) {
        return Error(StrCat("BUILD of a ", PickleKindName(object->kind), ", not an object"));
      }
      if (object->state != nullptr) return Error("BUILD of an object already built");
      object->state = state;
      return OkStatus();
    }
    case 'Q': {  // BINPERSID
      TS_ASSIGN_OR_RETURN(PickleValue * id, Pop());
      PickleValue* v = New(PickleKind::kPersistentId);
      v->args = id;
      Push(v);
      return OkStatus();
    }
    default:
      return Error(StrCat("opcode 0x", "0123456789abcdef"[op >> 4], "0123456789abcdef"[op & 15],
                          " is not supported"));
  }
}

Result<PickleTree> PickleDecoder::Run() {
  while (!stopped_) {
    op_start_ = pos_;
    if (pos_ >= bytes_.size()) return Error("truncated: no STOP opcode");
    uint8_t op = static_cast<uint8_t>(bytes_[pos_++]);
    TS_RETURN_IF_ERROR(Step(op));
  }
  return std::move(tree_);
}

Result<PickleTree> DecodePickle(std::string_view bytes,
                                absl::Span<const std::string_view> allowed_globals,
                                std::string_view what) {
  PickleDecoder decoder(bytes, allowed_globals, what);
  return decoder.Run();
}

absl::Span<const std::string_view> DcpPickleGlobals() {
  static constexpr std::string_view kGlobals[] = {
      // DCP's metadata (torch/distributed/checkpoint/metadata.py, filesystem.py).
      "torch.distributed.checkpoint.metadata.Metadata",
      "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
      "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
      "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
      "torch.distributed.checkpoint.metadata.TensorProperties",
      "torch.distributed.checkpoint.metadata.MetadataIndex",
      "torch.distributed.checkpoint.metadata.StorageMeta",
      "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
      "torch.distributed.checkpoint.filesystem._StorageInfo",
      "torch.serialization._get_layout",
      "torch.Size",
      // torch dtypes, pickled by name.
      "torch.bool", "torch.int8", "torch.int16", "torch.int32", "torch.int64", "torch.uint8",
      "torch.uint16", "torch.uint32", "torch.uint64", "torch.float16", "torch.bfloat16",
      "torch.float32", "torch.float64", "torch.complex32", "torch.complex64", "torch.complex128",
      "torch.float8_e4m3fn", "torch.float8_e5m2", "torch.float8_e4m3fnuz", "torch.float8_e5m2fnuz",
      "torch.float8_e8m0fnu",
      // torch.save's tensor description (data.pkl).
      "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
      "torch.storage.UntypedStorage", "torch.FloatStorage", "torch.DoubleStorage",
      "torch.HalfStorage", "torch.BFloat16Storage", "torch.LongStorage", "torch.IntStorage",
      "torch.ShortStorage", "torch.CharStorage", "torch.ByteStorage", "torch.BoolStorage",
      "torch.ComplexFloatStorage", "torch.ComplexDoubleStorage",
      "collections.OrderedDict",
      // StorageMeta.checkpoint_id (pathlib._local from Python 3.13).
      "pathlib.Path", "pathlib.PosixPath", "pathlib.WindowsPath", "pathlib.PurePosixPath",
      "pathlib.PureWindowsPath", "pathlib._local.PosixPath", "pathlib._local.WindowsPath",
      "pathlib._local.PurePosixPath", "pathlib._local.PureWindowsPath",
  };
  return kGlobals;
}

}  // namespace tensorstash
