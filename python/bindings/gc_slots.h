// Garbage-collector support for a bound class whose instances hold Python objects through C++
// members the collector cannot otherwise see (a coordinator or a callback that refers back to
// the instance closes a cycle through them).
//
// T must have `python_objects() const`, the Python objects it holds as a range of
// nanobind::handle (null handles are skipped), and `Clear()`, which drops them all and leaves
// the instance unusable. Use: nanobind::class_<T>(m, "T", ..., nanobind::type_slots(GcSlots<T>())).
//
// Thread-safety: the slots are called by the collector, with the GIL held.
#ifndef TENSORSTASH_PYTHON_BINDINGS_GC_SLOTS_H_
#define TENSORSTASH_PYTHON_BINDINGS_GC_SLOTS_H_

#include <nanobind/nanobind.h>

namespace tensorstash::python {

template <typename T>
struct GcSupport {
  static int Traverse(PyObject* self, visitproc visit, void* arg) {
    Py_VISIT(Py_TYPE(self));  // heap types own a reference to their type
    if (!nanobind::inst_ready(self)) return 0;
    for (nanobind::handle object : nanobind::inst_ptr<T>(self)->python_objects()) {
      Py_VISIT(object.ptr());
    }
    return 0;
  }

  static int Clear(PyObject* self) {
    if (nanobind::inst_ready(self)) nanobind::inst_ptr<T>(self)->Clear();
    return 0;
  }
};

// Py_tp_traverse and Py_tp_clear for T, as nanobind::type_slots wants them.
template <typename T>
const PyType_Slot* GcSlots() {
  static PyType_Slot slots[] = {{Py_tp_traverse, reinterpret_cast<void*>(&GcSupport<T>::Traverse)},
                                {Py_tp_clear, reinterpret_cast<void*>(&GcSupport<T>::Clear)},
                                {0, nullptr}};
  return slots;
}

}  // namespace tensorstash::python

#endif  // TENSORSTASH_PYTHON_BINDINGS_GC_SLOTS_H_
