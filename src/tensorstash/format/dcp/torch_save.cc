#include "tensorstash/format/dcp/torch_save.h"

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorstash/format/dcp/dcp_metadata.h"
#include "tensorstash/format/dcp/pickle.h"
#include "tensorstash/format/dcp/torch_zip.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

// The dtype of a legacy typed storage class (torch.FloatStorage, ...), which
// _rebuild_tensor_v2 takes the dtype from.
Result<DType> DTypeOfStorage(std::string_view storage, std::string_view what) {
  static constexpr std::pair<std::string_view, DType> kStorages[] = {
      {"torch.FloatStorage", DType::kFloat32},      {"torch.DoubleStorage", DType::kFloat64},
      {"torch.HalfStorage", DType::kFloat16},       {"torch.BFloat16Storage", DType::kBfloat16},
      {"torch.LongStorage", DType::kInt64},         {"torch.IntStorage", DType::kInt32},
      {"torch.ShortStorage", DType::kInt16},        {"torch.CharStorage", DType::kInt8},
      {"torch.ByteStorage", DType::kUint8},         {"torch.BoolStorage", DType::kBool},
      {"torch.ComplexFloatStorage", DType::kComplex64},
      {"torch.ComplexDoubleStorage", DType::kComplex128},
  };
  for (const auto& [name, dtype] : kStorages) {
    if (name == storage) return dtype;
  }
  return UnimplementedError(StrCat(what, ": storage type ", storage, " has no dtype here"));
}

}  // namespace

Result<TorchSavedTensor> ReadTorchSavedTensor(std::string_view archive, std::string_view what,
                                              bool check_crc, ZipHole hole) {
  auto loss = [&](const auto&... parts) {
    return DataLossError(StrCat("torch.save archive ", what, ": ", parts...));
  };
  TS_ASSIGN_OR_RETURN(std::vector<ZipEntry> entries,
                      ReadStoredZip(archive, what, check_crc, hole));
  const ZipEntry* in_hole = nullptr;  // the entry whose bytes were not read, if any
  for (const ZipEntry& e : entries) {
    if (e.covers_hole) in_hole = &e;
  }
  auto unread = [&](const ZipEntry* e) {
    return OutOfRangeError(StrCat("torch.save archive ", what, ": entry '", e->name,
                                  "' lies in bytes not read"));
  };
  if (const ZipEntry* order = FindTorchZipEntry(entries, "byteorder"); order != nullptr) {
    if (order == in_hole) return unread(order);
    std::string_view value = archive.substr(order->data_offset, order->size);
    if (value != "little") {
      return UnimplementedError(
          StrCat("torch.save archive ", what, ": byte order '", value, "' (only little)"));
    }
  }
  const ZipEntry* pkl = FindTorchZipEntry(entries, "data.pkl");
  if (pkl == nullptr) return loss("no data.pkl entry");
  if (pkl == in_hole) return unread(pkl);
  TS_ASSIGN_OR_RETURN(PickleTree tree,
                      DecodePickle(archive.substr(pkl->data_offset, pkl->size),
                                   DcpPickleGlobals(), StrCat(what, "/data.pkl")));
  const PickleValue& root = tree.root();
  const bool v3 = root.IsObjectOf("torch._utils._rebuild_tensor_v3");
  if (!v3 && !root.IsObjectOf("torch._utils._rebuild_tensor_v2")) {
    return loss("data.pkl does not hold one tensor (a ",
                root.Is(PickleKind::kObject) ? root.callee->text
                                             : std::string(PickleKindName(root.kind)),
                ")");
  }
  const std::vector<const PickleValue*>& args = root.args->items;
  if (args.size() < (v3 ? 7u : 4u)) return loss("a tensor rebuilt from ", args.size(), " arguments");
  // The storage: a persistent id ("storage", type, key, location, numel).
  const PickleValue* pid = args[0]->Is(PickleKind::kPersistentId) ? args[0]->args : nullptr;
  if (pid == nullptr || !pid->Is(PickleKind::kTuple) || pid->items.size() != 5 ||
      pid->items[0]->text != "storage" || !pid->items[1]->Is(PickleKind::kGlobal) ||
      !pid->items[2]->Is(PickleKind::kStr) || !pid->items[4]->Is(PickleKind::kInt) ||
      pid->items[4]->integer < 0) {
    return loss("the tensor's storage is not a persistent id (\"storage\", type, key, ",
                "location, numel)");
  }
  const std::string& storage_type = pid->items[1]->text;
  const bool untyped = storage_type == "torch.storage.UntypedStorage";
  TorchSavedTensor out;
  if (v3) {
    const PickleValue* dt = args[6];
    if (!dt->Is(PickleKind::kGlobal) || dt->text.rfind("torch.", 0) != 0) {
      return loss("_rebuild_tensor_v3 without a torch dtype");
    }
    TS_ASSIGN_OR_RETURN(out.dtype, DTypeFromTorchName(std::string_view(dt->text).substr(6), what));
  } else {
    if (untyped) return loss("_rebuild_tensor_v2 of an untyped storage");
    TS_ASSIGN_OR_RETURN(out.dtype, DTypeOfStorage(storage_type, what));
  }
  const uint64_t item = ItemSize(out.dtype);
  const std::string key = pid->items[2]->text;
  const ZipEntry* data = FindTorchZipEntry(entries, StrCat("data/", key));
  if (data == nullptr) return loss("no entry data/", key, " for the tensor's storage");
  if (in_hole != nullptr && in_hole != data) return unread(in_hole);
  uint64_t storage_bytes = static_cast<uint64_t>(pid->items[4]->integer);
  if (!untyped && __builtin_mul_overflow(storage_bytes, item, &storage_bytes)) {
    return loss("storage size overflows");
  }
  if (storage_bytes != data->size) {
    return loss("storage data/", key, " has ", data->size, " bytes, data.pkl says ", storage_bytes);
  }
  if (!args[1]->Is(PickleKind::kInt) || args[1]->integer < 0) {
    return loss("a storage offset that is not a non-negative int");
  }
  const uint64_t storage_offset = static_cast<uint64_t>(args[1]->integer);
  if (!args[2]->Is(PickleKind::kTuple) || !args[3]->Is(PickleKind::kTuple) ||
      args[2]->items.size() != args[3]->items.size()) {
    return loss("size and stride are not tuples of one length");
  }
  uint64_t elements = 1;
  for (const PickleValue* d : args[2]->items) {
    if (!d->Is(PickleKind::kInt) || d->integer < 0) return loss("a size that is not a non-negative int");
    out.shape.push_back(d->integer);
    if (__builtin_mul_overflow(elements, static_cast<uint64_t>(d->integer), &elements)) {
      return loss("element count overflows");
    }
  }
  // C order: each stride is the product of the later extents (any stride where the extent is 1).
  uint64_t expected = 1;
  for (size_t i = out.shape.size(); i > 0; --i) {
    const PickleValue* s = args[3]->items[i - 1];
    if (!s->Is(PickleKind::kInt)) return loss("a stride that is not an int");
    if (elements != 0 && out.shape[i - 1] != 1 && static_cast<uint64_t>(s->integer) != expected) {
      return UnimplementedError(StrCat("torch.save archive ", what,
                                       ": the tensor is not stored contiguously in C order"));
    }
    expected *= static_cast<uint64_t>(out.shape[i - 1]);  // <= elements, or 0
  }
  uint64_t begin = 0, length = 0, end = 0;
  if (__builtin_mul_overflow(storage_offset, item, &begin) ||
      __builtin_mul_overflow(elements, item, &length) ||
      __builtin_add_overflow(begin, length, &end) || (elements != 0 && end > storage_bytes)) {
    return loss("the tensor (", elements, " elements from element ", storage_offset,
                ") runs past its storage (", storage_bytes, " bytes)");
  }
  out.data_offset = data->data_offset + (elements == 0 ? 0 : begin);
  out.data_length = length;
  out.whole_entry = out.data_offset == data->data_offset && out.data_length == data->size;
  out.data_crc32 = data->crc32;
  return out;
}

}  // namespace tensorstash
