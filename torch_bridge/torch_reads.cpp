// What TieredAdamW's step must read of every param each step, read in one C++ pass: each param's
// data pointer and in-place version (a storage swapped in by a framework, an in-place write of the
// master), and its gradient's (an edit after the gradient's hook ran: clip_grad_norm_, an unscale).
//
// Why: torch charges Python about 100 ns for each such read even warm (each getter checks for
// __torch_function__ and makes a Python int), five reads a param; right after backward, with the
// caches cold, several times that (bench/results/step-overhead/). Here a read is a load from the
// TensorImpl. Python calls this through ctypes.PyDLL, so the GIL is held: it touches Python objects.
//
// Only plain tensors and Parameters are read (THPVariable_CheckExact): a subclass may answer these
// reads differently in Python (__torch_function__, DTensor's local shard), and the caller reads
// those itself. Built as a library of its own (libmemtide_torch_reads.so): it needs Python's and
// torch's Python headers, which the allocator bridge does not, and a torch whose Python headers do
// not compile costs this library only.

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <limits>

namespace {

// A gradient that is not there: a value no address or version can take, and not the caller's
// "nothing sent" mark either (std::numeric_limits<std::int64_t>::min()).
constexpr std::int64_t kNoGrad = std::numeric_limits<std::int64_t>::min() + 1;

}  // namespace

extern "C" {

/// Reads, for each of the `n` tensors of the list `tensors`, its data pointer and version into
/// `data[i]`, `version[i]`, and its gradient's into `grad_data[i]`, `grad_version[i]` (kNoGrad for
/// both when it has none). Returns 0; -1 when `tensors` is not a list of `n`; i + 1 when tensor i
/// cannot be read here (not a plain tensor or Parameter, no storage, no version counter, a sparse
/// gradient): the caller reads them in Python, which raises what torch raises.
__attribute__((visibility("default"))) long memtide_torch_read(PyObject* tensors, std::int64_t* data,
                                                               std::int64_t* version, std::int64_t* grad_data,
                                                               std::int64_t* grad_version, long n) {
  if (!PyList_CheckExact(tensors) || PyList_GET_SIZE(tensors) != n) return -1;
  for (long i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(tensors, i);
    if (!THPVariable_CheckExact(item)) return i + 1;
    try {
      const at::Tensor& t = THPVariable_Unpack(item);
      if (t.is_sparse()) return i + 1;
      data[i] = reinterpret_cast<std::intptr_t>(t.data_ptr());
      version[i] = t._version();
      const at::Tensor& g = t.grad();
      if (!g.defined()) {
        grad_data[i] = grad_version[i] = kNoGrad;
      } else {
        if (g.is_sparse()) return i + 1;
        grad_data[i] = reinterpret_cast<std::intptr_t>(g.data_ptr());
        grad_version[i] = g._version();
      }
    } catch (...) {  // c10::Error: no storage (a meta or fake tensor), an inference tensor's version
      return i + 1;
    }
  }
  return 0;
}

/// The value memtide_torch_read writes for a missing gradient (the Python side checks it agrees).
__attribute__((visibility("default"))) std::int64_t memtide_torch_read_no_grad() { return kNoGrad; }

}  // extern "C"
