// memtide._memtide: the Python face of libmemtide.so. Everything goes through the shared
// library's C++ API (or its C ABI where that is the contract, as for snapshots), so Python, torch's
// CUDAPluggableAllocator and C callers share one Runtime. The bindings live by area in module/.

#include <exception>

#include "memtide/core/error.hpp"
#include "module/common.hpp"

namespace {

// memtide._memtide.ConfigError, a ValueError: the CLI tells a bad MEMTIDE_* setting (exit 2, no
// traceback) apart from other errors by this type.
PyObject* g_config_error = nullptr;

}  // namespace

NB_MODULE(_memtide, m) {
  m.doc() = "memtide's native module: allocator runtime, options, phases, snapshots, trace replay, host arrays,\n"
            "optimizer kernels and the tiering engine.";

  g_config_error = PyErr_NewExceptionWithDoc("memtide._memtide.ConfigError",
                                             "A MEMTIDE_* setting (or backend name) has a value memtide does not accept.",
                                             PyExc_ValueError, nullptr);
  if (g_config_error == nullptr) throw nb::python_error();
  m.attr("ConfigError") = nb::handle(g_config_error);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const memtide::OutOfMemory& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const memtide::ConfigError& e) {
      PyErr_SetString(g_config_error, e.what());
    } catch (const memtide::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const memtide::IoError& e) {
      PyErr_SetString(PyExc_OSError, e.what());  // a file or sysfs path: as Python's own I/O raises
    } catch (const memtide::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });


  // torch tensors made with from_dlpack hold memtide objects (the engine's arrays, host tensors)
  // through their deleters, and torch does not release every tensor before nanobind checks at
  // interpreter exit: the check would report those as leaks. Real leaks are tested instead (the
  // optimizer's host and device bytes return to zero once it is gone).
  nb::set_leak_warnings(false);

  memtide::bindings::bind_runtime(m);
  memtide::bindings::bind_host(m);
  memtide::bindings::bind_kernels(m);
  memtide::bindings::bind_tiering(m);
  memtide::bindings::bind_engine(m);
  memtide::bindings::bind_tracing(m);
}
