// The parts of the tensorstash._ext module, each defined in its own file and added to the module
// by module.cc.
#ifndef TENSORSTASH_PYTHON_BINDINGS_BINDINGS_H_
#define TENSORSTASH_PYTHON_BINDINGS_BINDINGS_H_

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "tensorstash/checkpoint/open_step.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/tiers/multi_tier_manager.h"

namespace tensorstash::python {

void DefineWriter(nanobind::module_& m);       // writer.cc
void DefineReader(nanobind::module_& m);       // reader.cc
void DefineManager(nanobind::module_& m);      // manager.cc
void DefineOrbaxWriter(nanobind::module_& m);  // orbax_writer.cc
void DefineJson(nanobind::module_& m);         // json.cc
void DefinePeerServer(nanobind::module_& m);   // peer_server.cc
void DefineHoldings(nanobind::module_& m);     // holdings.cc

// The boxes a Reader's restore_to_host handed over, buffers included (any thread adds, under
// `mutex`).
struct KeptBoxes {
  std::mutex mutex;
  std::vector<RestoredBox> boxes;
};

// A tensorstash._ext.Reader over `source`, which reads from `kv` (may be null; kept alive with
// the source); with `keep`, its restore_to_host also adds every box it hands over there. Needs
// the GIL. (reader.cc)
nanobind::object ReaderFromSource(std::unique_ptr<KvStore> kv, std::shared_ptr<StepSource> source,
                                  std::shared_ptr<KeptBoxes> keep = nullptr);

// A tensorstash._ext.Reader over a SharedStepSource of native step `dir` of `kv` (owned by
// `owned` when the reader keeps it), sharing through the Python `coordinator` under
// `key_prefix`. Needs the GIL. (reader.cc)
nanobind::object SharedReader(std::unique_ptr<KvStore> owned, KvStore* kv, const std::string& dir,
                              const ReaderOptions& options, nanobind::object coordinator,
                              const std::string& key_prefix, double timeout_s);

// ReaderOptions from the arguments every reading call of the module takes; ValueError (raised)
// for max_inflight_bytes <= 0. (reader.cc)
ReaderOptions ReadOptionsFromPython(bool verify_checksums, int64_t max_inflight_bytes,
                                    int io_threads, bool map_spans);

}  // namespace tensorstash::python

#endif  // TENSORSTASH_PYTHON_BINDINGS_BINDINGS_H_
