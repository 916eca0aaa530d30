// Shared helpers of the checkpoint tests (and of tests/tools/crash_writer.cc).
//
//  - Deterministic array contents: element i of an array seeded s has fixed bits, so expected
//    data for any box is regenerated instead of kept around.
//  - Sharding over a device mesh the way JAX does: each array dimension is either split over one
//    mesh axis in ceil-sized pieces (the last pieces may be short or empty) or not split; devices
//    that differ only along unused axes hold the same box and are replicas of each other.
//  - TempDirTest: a fixture with a fresh scratch directory (gtest only; define
//    TS_CHECKPOINT_TEST_UTIL_NO_GTEST to use the rest from a program without gtest).
#ifndef TENSORSTASH_TESTING_CHECKPOINT_TEST_UTIL_H_
#define TENSORSTASH_TESTING_CHECKPOINT_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tensorstash/array/box.h"
#include "tensorstash/array/dtype.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/kvstore/file/file_kvstore.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/util/status.h"

#ifndef TS_CHECKPOINT_TEST_UTIL_NO_GTEST
#include <stdlib.h>

#include <cerrno>
#include <filesystem>
#include <system_error>

#include "gtest/gtest.h"
#include "tensorstash/testing/status_test_macros.h"
#endif

namespace tensorstash {
namespace test {

// splitmix64's finalizer: a cheap, well-mixed function of x.
inline uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Writes the bits of element `index` of the array seeded `seed` to `out` (ItemSize bytes).
// Every bit pattern may appear (NaNs included), except bool, which holds 0 or 1.
inline void FillElement(DType dtype, uint64_t seed, uint64_t index, char* out) {
  const size_t item = ItemSize(dtype);
  uint64_t bits = Mix64(seed * 0x100000001b3ull + index);
  if (dtype == DType::kBool) bits &= 1;
  std::memcpy(out, &bits, std::min<size_t>(item, 8));
  if (item == 16) {
    const uint64_t high = Mix64(bits ^ 0xa5a5a5a5a5a5a5a5ull);
    std::memcpy(out + 8, &high, 8);
  }
}

// The elements of `box` (C order) of an array of `shape` seeded `seed`; zeros where the box lies
// outside the shape.
inline std::vector<char> MakeBoxData(DType dtype, const std::vector<int64_t>& shape, uint64_t seed,
                                     const Box& box) {
  const size_t item = ItemSize(dtype);
  const int64_t n = box.num_elements();
  std::vector<char> out(static_cast<size_t>(n) * item, 0);
  if (n == 0) return out;
  const int rank = box.rank();
  std::vector<int64_t> idx(rank, 0);
  for (int64_t i = 0; i < n; ++i) {
    bool inside = true;
    uint64_t global = 0;
    for (int d = 0; d < rank; ++d) {
      const int64_t g = box.origin[d] + idx[d];
      if (g >= shape[d]) inside = false;
      global = global * static_cast<uint64_t>(shape[d]) + static_cast<uint64_t>(g);
    }
    if (inside) FillElement(dtype, seed, global, out.data() + i * item);
    for (int d = rank - 1; d >= 0; --d) {
      if (++idx[d] < box.shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

inline std::vector<char> MakeArrayData(DType dtype, const std::vector<int64_t>& shape,
                                       uint64_t seed) {
  return MakeBoxData(dtype, shape, seed, Box::FromShape(shape));
}

// A device mesh and how an array is laid out on it.
struct Sharding {
  std::vector<int> mesh;      // extent of each mesh axis; devices = product
  std::vector<int> dim_axis;  // per array dimension: the mesh axis splitting it, or -1

  int num_devices() const {
    int n = 1;
    for (int a : mesh) n *= a;
    return n;
  }
  std::string ToString() const {
    return StrCat("mesh [", StrJoin(mesh, ","), "] dims->axes [", StrJoin(dim_axis, ","), "]");
  }
};

// A fully replicated layout on `devices` devices (for 0-d arrays and simple cases).
inline Sharding Replicated(int rank, int devices) {
  return Sharding{{devices}, std::vector<int>(rank, -1)};
}

struct DeviceShard {
  int device = 0;
  Box box;
  int replica_id = 0;
  int num_replicas = 1;
};

// JAX's piece i of `parts` of an extent n: ceil-sized, clipped at n (possibly empty).
inline void CeilPiece(int64_t n, int parts, int i, int64_t* origin, int64_t* extent) {
  const int64_t size = (n + parts - 1) / parts;
  *origin = std::min<int64_t>(n, size * i);
  *extent = std::min<int64_t>(n, *origin + size) - *origin;
}

// One entry per device, in device order.
inline std::vector<DeviceShard> ShardArray(const std::vector<int64_t>& shape,
                                           const Sharding& sharding) {
  const int axes = static_cast<int>(sharding.mesh.size());
  std::vector<bool> used(axes, false);
  for (int a : sharding.dim_axis) {
    if (a >= 0) used[a] = true;
  }
  std::vector<DeviceShard> out;
  for (int device = 0; device < sharding.num_devices(); ++device) {
    std::vector<int> coord(axes);
    for (int a = axes - 1, rest = device; a >= 0; --a) {
      coord[a] = rest % sharding.mesh[a];
      rest /= sharding.mesh[a];
    }
    DeviceShard shard;
    shard.device = device;
    shard.box = Box::FromShape(shape);
    for (size_t d = 0; d < shape.size(); ++d) {
      const int a = sharding.dim_axis[d];
      if (a >= 0) {
        CeilPiece(shape[d], sharding.mesh[a], coord[a], &shard.box.origin[d], &shard.box.shape[d]);
      }
    }
    for (int a = 0; a < axes; ++a) {
      if (used[a]) continue;
      shard.replica_id = shard.replica_id * sharding.mesh[a] + coord[a];
      shard.num_replicas *= sharding.mesh[a];
    }
    out.push_back(std::move(shard));
  }
  return out;
}

// A random layout for an array of rank `rank` on a mesh of at most `max_devices` devices.
inline Sharding RandomSharding(int rank, int max_devices, std::mt19937_64& rng) {
  Sharding s;
  const int axes = 1 + static_cast<int>(rng() % 3);
  int devices = 1;
  for (int a = 0; a < axes; ++a) {
    const int limit = std::max(1, max_devices / devices);
    const int extent = 1 + static_cast<int>(rng() % std::min(4, limit));
    s.mesh.push_back(extent);
    devices *= extent;
  }
  std::vector<int> free_axes;
  for (int a = 0; a < axes; ++a) free_axes.push_back(a);
  s.dim_axis.assign(rank, -1);
  for (int d = 0; d < rank; ++d) {
    if (free_axes.empty() || rng() % 3 == 0) continue;
    const size_t pick = rng() % free_axes.size();
    s.dim_axis[d] = free_axes[pick];
    free_axes.erase(free_axes.begin() + static_cast<std::ptrdiff_t>(pick));
  }
  return s;
}

// An array of a test checkpoint: its spec, the seed of its contents, and how it is sharded.
struct TestArray {
  ArraySpec spec;
  uint64_t seed = 0;
  Sharding sharding;
};

// Shard buffers of one array held by some devices, ready for CheckpointWriter::AddArray.
struct HeldShards {
  std::vector<std::vector<char>> buffers;
  std::vector<ShardData> shards;
};

// The shards of the devices for which `keep(device)` is true.
template <typename Keep>
HeldShards HoldShards(const ArraySpec& spec, uint64_t seed, const Sharding& sharding, Keep keep) {
  HeldShards held;
  std::vector<DeviceShard> devices = ShardArray(spec.shape, sharding);
  held.buffers.reserve(devices.size());
  for (const DeviceShard& d : devices) {
    if (!keep(d.device)) continue;
    held.buffers.push_back(MakeBoxData(spec.dtype, spec.shape, seed, d.box));
    held.shards.push_back({d.box, held.buffers.back().data(), d.replica_id, d.num_replicas});
  }
  return held;
}
inline HeldShards HoldAllShards(const ArraySpec& spec, uint64_t seed, const Sharding& sharding) {
  return HoldShards(spec, seed, sharding, [](int) { return true; });
}

// A random box of rank `shape.size()` that may reach up to `past` elements beyond the shape.
inline Box RandomBox(const std::vector<int64_t>& shape, int64_t past, std::mt19937_64& rng) {
  Box box = Box::FromShape(shape);
  for (size_t d = 0; d < shape.size(); ++d) {
    const int64_t limit = shape[d] + past;
    box.origin[d] = static_cast<int64_t>(rng() % static_cast<uint64_t>(limit + 1));
    box.shape[d] = static_cast<int64_t>(rng() % static_cast<uint64_t>(limit - box.origin[d] + 1));
  }
  return box;
}

// Structural equality of trees; floats compare by value, NaN equal to NaN. On a difference,
// `why` says where.
inline bool TreesEqual(const TreeNode& a, const TreeNode& b, const std::string& at,
                       std::string* why) {
  auto differ = [&](std::string_view what) {
    *why = StrCat("at ", at.empty() ? std::string("<root>") : at, ": ", what);
    return false;
  };
  if (a.kind != b.kind) {
    return differ(StrCat("kind ", static_cast<int>(a.kind), " vs ", static_cast<int>(b.kind)));
  }
  switch (a.kind) {
    case TreeNode::Kind::kNone:
      return true;
    case TreeNode::Kind::kDict:
      if (a.entries.size() != b.entries.size()) return differ("dict sizes differ");
      for (size_t i = 0; i < a.entries.size(); ++i) {
        if (a.entries[i].first != b.entries[i].first) {
          return differ(StrCat("key ", i, " is \"", a.entries[i].first, "\" vs \"",
                               b.entries[i].first, "\""));
        }
        if (!TreesEqual(a.entries[i].second, b.entries[i].second,
                        StrCat(at, "/", EscapePathKey(a.entries[i].first)), why)) {
          return false;
        }
      }
      return true;
    case TreeNode::Kind::kList:
    case TreeNode::Kind::kTuple:
      if (a.items.size() != b.items.size()) return differ("sequence lengths differ");
      for (size_t i = 0; i < a.items.size(); ++i) {
        if (!TreesEqual(a.items[i], b.items[i], StrCat(at, "/", i), why)) return false;
      }
      return true;
    case TreeNode::Kind::kArray:
      return a.array_id == b.array_id ? true
                                      : differ(StrCat("array ", a.array_id, " vs ", b.array_id));
    case TreeNode::Kind::kInt:
      return a.int_value == b.int_value ? true : differ(StrCat(a.int_value, " vs ", b.int_value));
    case TreeNode::Kind::kFloat: {
      const bool same = (std::isnan(a.float_value) && std::isnan(b.float_value)) ||
                        (a.float_value == b.float_value &&
                         std::signbit(a.float_value) == std::signbit(b.float_value));
      return same ? true : differ(StrCat(a.float_value, " vs ", b.float_value));
    }
    case TreeNode::Kind::kBool:
      return a.bool_value == b.bool_value ? true : differ("bools differ");
    case TreeNode::Kind::kString:
    case TreeNode::Kind::kBytes:
      return a.string_value == b.string_value ? true : differ("strings differ");
  }
  return differ("unknown kind");
}

// The arrays that tests/tools/crash_writer.cc saves as step `step` (a few MiB in all). Content
// is a function of the step number, so a reader can check any step.
inline std::vector<TestArray> CrashStepArrays(int64_t step) {
  const uint64_t base = static_cast<uint64_t>(step) * 1000;
  std::vector<TestArray> arrays;
  arrays.push_back({{"params/w", DType::kFloat32, {512, 640}}, base + 1, {{2, 2}, {0, 1}}});
  arrays.push_back({{"params/b", DType::kBfloat16, {640}}, base + 2, {{2, 2}, {1}}});
  arrays.push_back({{"opt/mu", DType::kFloat32, {300, 777}}, base + 3, {{4}, {0, -1}}});
  arrays.push_back({{"opt/count", DType::kInt64, {}}, base + 4, {{4}, {}}});
  arrays.back().spec.codec = Codec::kZstd;
  return arrays;
}
// Step folder name of step `step` ("0000000042").
inline std::string StepName(int64_t step) {
  std::string digits = std::to_string(step);
  return std::string(digits.size() < 10 ? 10 - digits.size() : 0, '0') + digits;
}

// The backends the checkpoint tests run on.
enum class StoreKind { kFile, kMemory, kMemoryNoRename };
inline std::string StoreName(StoreKind kind) {
  switch (kind) {
    case StoreKind::kFile:
      return "File";
    case StoreKind::kMemory:
      return "Memory";
    case StoreKind::kMemoryNoRename:
      return "MemoryNoRename";
  }
  return "?";
}
// A fresh store; `root_dir` (a missing or empty directory) is used by the file backend only.
inline Result<std::unique_ptr<KvStore>> MakeStore(StoreKind kind, const std::string& root_dir) {
  if (kind == StoreKind::kFile) {
    TS_ASSIGN_OR_RETURN(std::unique_ptr<FileKvStore> store, FileKvStore::Open(root_dir));
    return std::unique_ptr<KvStore>(std::move(store));
  }
  return std::unique_ptr<KvStore>(
      std::make_unique<MemoryKvStore>(/*supports_rename=*/kind == StoreKind::kMemory));
}

#ifndef TS_CHECKPOINT_TEST_UTIL_NO_GTEST

inline void PrintTo(StoreKind kind, std::ostream* out) { *out << StoreName(kind); }

// `got` equals `want` byte for byte; otherwise says where the first difference is.
inline ::testing::AssertionResult BytesEqual(const std::vector<char>& want, const void* got,
                                             size_t got_size) {
  if (want.size() != got_size) {
    return ::testing::AssertionFailure() << "size " << got_size << ", expected " << want.size();
  }
  if (want.empty() || std::memcmp(want.data(), got, want.size()) == 0) {
    return ::testing::AssertionSuccess();
  }
  const char* g = static_cast<const char*>(got);
  size_t first = 0;
  while (want[first] == g[first]) ++first;
  size_t count = 0;
  for (size_t i = 0; i < want.size(); ++i) count += want[i] != g[i];
  return ::testing::AssertionFailure()
         << count << " of " << want.size() << " bytes differ; the first at byte " << first;
}
inline ::testing::AssertionResult BytesEqual(const std::vector<char>& want,
                                             const std::vector<char>& got) {
  return BytesEqual(want, got.data(), got.size());
}

// A fresh directory under the test temp dir, removed after the test.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string dir = ::testing::TempDir() + "tensorstash_ckpt_XXXXXX";
    ASSERT_NE(::mkdtemp(dir.data()), nullptr) << std::strerror(errno);
    temp_dir_ = dir;
  }
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(temp_dir_, ignored);
  }
  const std::string& temp_dir() const { return temp_dir_; }

 private:
  std::string temp_dir_;
};

#endif  // TS_CHECKPOINT_TEST_UTIL_NO_GTEST

}  // namespace test
}  // namespace tensorstash

#endif  // TENSORSTASH_TESTING_CHECKPOINT_TEST_UTIL_H_
