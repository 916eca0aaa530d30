// PyCoordinator: a Coordinator backed by a Python object, so that a multi-process save can use
// the job's own runtime (e.g. JAX's distributed client) from Python.
//
// The object must have process_index() -> int, process_count() -> int,
// barrier(name: str, timeout_ms: int) -> None, key_value_set(key: str, value: str) -> None and
// key_value_get(key: str, timeout_ms: int) -> str. Each call takes the GIL, so the writer may
// call it from a thread that released it. A Python exception becomes a Status
// (StatusFromPythonError): TimeoutError -> DeadlineExceeded, anything else -> Internal.
//
// Thread-safety: as Coordinator. Create it and destroy it with the GIL held.
#ifndef TENSORSTASH_PYTHON_BINDINGS_COORDINATOR_H_
#define TENSORSTASH_PYTHON_BINDINGS_COORDINATOR_H_

#include <nanobind/nanobind.h>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "tensorstash/coordination/coordinator.h"
#include "tensorstash/util/status.h"

namespace tensorstash::python {

class PyCoordinator final : public Coordinator {
 public:
  // Asks `object` for its process index and count once (they never change during a job), which
  // lets the const accessors below work without the GIL. A Python exception raised by those
  // calls propagates; an index or count out of range is InvalidArgument.
  static Result<std::unique_ptr<PyCoordinator>> Create(nanobind::object object);

  // The Python object, for the Writer's garbage-collector support.
  nanobind::handle object() const { return object_; }

  int process_index() const override { return process_index_; }
  int process_count() const override { return process_count_; }
  Status Barrier(std::string_view name, std::chrono::milliseconds timeout) override;
  Status KeyValueSet(std::string_view key, std::string_view value) override;
  Result<std::string> KeyValueGet(std::string_view key, std::chrono::milliseconds timeout) override;
  // key_value_try_get(key) -> str | None where the object has it; otherwise key_value_get(key, 0),
  // its TimeoutError read as "not set".
  Result<std::optional<std::string>> KeyValueTryGet(std::string_view key) override;

 private:
  PyCoordinator(nanobind::object object, int process_index, int process_count);

  nanobind::object object_;
  const int process_index_;
  const int process_count_;
};

}  // namespace tensorstash::python

#endif  // TENSORSTASH_PYTHON_BINDINGS_COORDINATOR_H_
