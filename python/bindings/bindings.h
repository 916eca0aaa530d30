// The parts of the tensorstash._ext module, each defined in its own file and added to the module
// by module.cc.
#ifndef TENSORSTASH_PYTHON_BINDINGS_BINDINGS_H_
#define TENSORSTASH_PYTHON_BINDINGS_BINDINGS_H_

#include <nanobind/nanobind.h>

namespace tensorstash::python {

void DefineWriter(nanobind::module_& m);       // writer.cc
void DefineReader(nanobind::module_& m);       // reader.cc
void DefineManager(nanobind::module_& m);      // manager.cc
void DefineOrbaxWriter(nanobind::module_& m);  // orbax_writer.cc
void DefineJson(nanobind::module_& m);         // json.cc
void DefinePeerServer(nanobind::module_& m);   // peer_server.cc

}  // namespace tensorstash::python

#endif  // TENSORSTASH_PYTHON_BINDINGS_BINDINGS_H_
