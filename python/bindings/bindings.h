// The parts of the tensorstash._ext module, each defined in its own file and added to the module
// by module.cc.
#ifndef TENSORSTASH_PYTHON_BINDINGS_BINDINGS_H_
#define TENSORSTASH_PYTHON_BINDINGS_BINDINGS_H_

#include <nanobind/nanobind.h>

#include <memory>

#include "tensorstash/checkpoint/open_step.h"
#include "tensorstash/kvstore/kvstore.h"

namespace tensorstash::python {

void DefineWriter(nanobind::module_& m);       // writer.cc
void DefineReader(nanobind::module_& m);       // reader.cc
void DefineManager(nanobind::module_& m);      // manager.cc
void DefineOrbaxWriter(nanobind::module_& m);  // orbax_writer.cc
void DefineJson(nanobind::module_& m);         // json.cc
void DefinePeerServer(nanobind::module_& m);   // peer_server.cc
void DefineLocalTier(nanobind::module_& m);    // local_tier.cc

// A tensorstash._ext.Reader over `source`, which reads from `kv` (may be null; kept alive with
// the source). Needs the GIL. (reader.cc)
nanobind::object ReaderFromSource(std::unique_ptr<KvStore> kv, std::unique_ptr<StepSource> source);

}  // namespace tensorstash::python

#endif  // TENSORSTASH_PYTHON_BINDINGS_BINDINGS_H_
