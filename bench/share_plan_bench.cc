// Planning shared reads at the scale of real jobs, by simulation (issue 42 part 7): one process
// plays process 0 of a job of N processes restoring a 70B-parameter training state, and does what
// that process would do: decode the distinct box lists it receives, plan (PlanSharedReads) and
// take its own part (ForProcess). Prints time, memory and the coordinator bytes per process.
//
//   tensorstash_share_plan_bench [processes] [processes per replica] [per replica at save]
//   (defaults 4096 64 64; a save count other than the restore's is a reshard: a process's rows
//   then cut through stored chunks, which processes of a replica share as well)
//
// The state: a Llama-style 70B model (80 layers of hidden 8192, FFN 28672, 8 KV heads of 128,
// vocabulary 128256), parameters in bfloat16 and Adam's two moments in float32 (705 GB, 2,169
// arrays). The job: replicas of F processes (4 devices each), the state FSDP-sharded over the
// 4F devices of a replica along each array's first dimension, as it was at save (so the stored
// chunk grid has one cell per device shard, chunks of at most 8 MiB), and N / F data-parallel
// replicas that each need the whole state.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tensorstash/share/needs_exchange.h"
#include "tensorstash/share/shared_read_plan.h"
#include "tensorstash/util/base64.h"

namespace ts = tensorstash;

namespace {

constexpr int kDevicesPerProcess = 4;
constexpr int64_t kTargetChunkBytes = int64_t{8} << 20;

struct Leaf {
  std::string name;
  std::vector<int64_t> shape;
};

std::vector<Leaf> Llama70B() {
  const int64_t d = 8192, ffn = 28672, kv = 8 * 128, vocab = 128256;
  std::vector<Leaf> leaves = {{"embed", {vocab, d}}, {"lm_head", {d, vocab}}, {"final_norm", {d}}};
  for (int l = 0; l < 80; ++l) {
    const std::string p = "layers/" + std::to_string(l) + "/";
    for (const Leaf& leaf : std::vector<Leaf>{{p + "wq", {d, d}},     {p + "wk", {d, kv}},
                                              {p + "wv", {d, kv}},     {p + "wo", {d, d}},
                                              {p + "w1", {d, ffn}},    {p + "w3", {d, ffn}},
                                              {p + "w2", {ffn, d}},    {p + "attn_norm", {d}},
                                              {p + "ffn_norm", {d}}}) {
      leaves.push_back(leaf);
    }
  }
  return leaves;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

double PeakRssMiB() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 4096;
  const int per_replica = argc > 2 ? std::atoi(argv[2]) : 64;
  const int per_replica_at_save = argc > 3 ? std::atoi(argv[3]) : per_replica;
  if (n < 1 || per_replica < 1 || per_replica_at_save < 1 || n % per_replica != 0) {
    std::fprintf(stderr, "processes (%d) must be a multiple of processes per replica (%d)\n", n,
                 per_replica);
    return 2;
  }
  const int64_t shards = int64_t{per_replica_at_save} * kDevicesPerProcess;

  // The step as stored: params (bf16), mu and nu (f32).
  std::vector<ts::SharedArray> arrays;
  uint64_t state_bytes = 0;
  for (const auto& [prefix, item_size] :
       std::vector<std::pair<std::string, size_t>>{{"params/", 2}, {"mu/", 4}, {"nu/", 4}}) {
    for (const Leaf& leaf : Llama70B()) {
      std::vector<int64_t> cell = leaf.shape;
      cell[0] = CeilDiv(leaf.shape[0], shards);
      ts::SharedArray array;
      array.path = prefix + leaf.name;
      array.grid = ts::ChooseChunkGrid(leaf.shape, cell, item_size, kTargetChunkBytes);
      array.chunk_bytes.resize(array.grid.NumChunks());
      for (int64_t c = 0; c < array.grid.NumChunks(); ++c) {
        array.chunk_bytes[c] = static_cast<uint64_t>(array.grid.ChunkNumElements(c)) * item_size;
        state_bytes += array.chunk_bytes[c];
      }
      arrays.push_back(std::move(array));
    }
  }
  // What process q of a replica needs: its 4 devices' rows of every array.
  auto needs_of = [&](int q) {
    ts::ProcessNeeds needs;
    for (const ts::SharedArray& array : arrays) {
      const int64_t rows = CeilDiv(array.grid.shape[0], per_replica);
      ts::Box box = ts::Box::FromShape(array.grid.shape);
      box.origin[0] = std::min<int64_t>(rows * q, array.grid.shape[0]);
      box.shape[0] = std::max<int64_t>(0, std::min<int64_t>(rows, array.grid.shape[0] - box.origin[0]));
      needs.boxes.push_back({box});
    }
    return needs;
  };
  // The coordinator's values as they arrive at process 0: the F distinct lists (base64).
  std::vector<std::string> texts;
  for (int q = 0; q < per_replica; ++q) texts.push_back(ts::Base64Encode(ts::EncodeNeeds(needs_of(q))));
  const double rss_before = PeakRssMiB();

  const auto start = std::chrono::steady_clock::now();
  ts::JobNeeds job;
  for (int q = 0; q < per_replica; ++q) {
    auto bytes = ts::Base64Decode(texts[q]);
    auto needs = ts::DecodeNeeds(*bytes, arrays, q);
    if (!needs.ok()) {
      std::fprintf(stderr, "%s\n", needs.status().ToString().c_str());
      return 1;
    }
    job.distinct.push_back(*std::move(needs));
  }
  job.list_of_process.resize(n);
  for (int p = 0; p < n; ++p) job.list_of_process[p] = p % per_replica;
  auto plan = ts::PlanSharedReads(arrays, job);
  if (!plan.ok()) {
    std::fprintf(stderr, "%s\n", plan.status().ToString().c_str());
    return 1;
  }
  const ts::ProcessShare mine = plan->ForProcess(job, arrays, 0);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double rss_after = PeakRssMiB();

  uint64_t max_reads = 0, min_reads = UINT64_MAX;
  for (int p = 0; p < n; ++p) {
    max_reads = std::max(max_reads, plan->storage_bytes(p));
    min_reads = std::min(min_reads, plan->storage_bytes(p));
  }
  // Coordinator bytes of process 0 (needs_exchange.h): it sends its list and its digest; it
  // reads the N - 1 other digests and the lists of the F - 1 other distinct lists.
  const uint64_t digest = 32;
  const uint64_t sent = texts[0].size() + digest;
  uint64_t received = (n - 1) * digest;
  for (int q = 1; q < per_replica; ++q) received += texts[q].size();
  std::printf(
      "processes %d (%d replicas of %d, saved by replicas of %d), state %.1f GB in %zu arrays, %zu shared chunks\n"
      "  plan %.3f s, peak RSS +%.1f MiB (%.1f MiB in all)\n"
      "  coordinator per process: sends %.1f KiB, receives %.2f MiB (%llu KiB of digests); the "
      "store holds %.1f MiB\n"
      "  storage reads: %.1f GB in all (unshared %.1f GB, %.0fx); per process %.1f-%.1f MiB; "
      "process 0 serves %zu chunks, receives %zu\n",
      n, n / per_replica, per_replica, per_replica_at_save, state_bytes / 1e9, arrays.size(), plan->shared().size(),
      seconds, rss_after - rss_before, rss_after, sent / 1024.0, received / 1048576.0,
      static_cast<unsigned long long>((n - 1) * digest / 1024), n * double(sent) / 1048576.0,
      plan->total_storage_bytes() / 1e9, plan->unshared_storage_bytes() / 1e9,
      double(plan->unshared_storage_bytes()) / double(plan->total_storage_bytes()),
      min_reads / 1048576.0, max_reads / 1048576.0, mine.serves.size(), mine.receives.size());
  return 0;
}
