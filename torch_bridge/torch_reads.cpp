// What TieredAdamW's step must read of every param each step, read in one C++ pass: each param's
// data pointer and in-place version (a storage swapped in by a framework, an in-place write of the
// master), and its gradient's (an edit after the gradient's hook ran: clip_grad_norm_, an unscale).
//
// Why: torch charges Python about 100 ns for each such read even warm (each getter checks for
// __torch_function__ and makes a Python int), five reads a param; right after backward, with the
// caches cold, several times that (bench/results/step-overhead/). Here a read is a load from the
// TensorImpl. Python calls this through ctypes.PyDLL, so the GIL is held: it touches Python objects.
//
// Plain tensors and Parameters are read from the object itself (THPVariable_CheckExact); a DTensor
// (FSDP2's params and gradients) through its local shard (`_local_tensor`), which is what the step
// reads in Python too. Any other subclass may answer these reads differently in Python
// (__torch_function__), and the caller reads it itself. Built as a library of its own (libmemtide_torch_reads.so): it needs Python's and
// torch's Python headers, which the allocator bridge does not, and a torch whose Python headers do
// not compile costs this library only.

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <limits>

namespace {

// What a Python attribute read returns, released at the end of the scope.
struct Owned {
  PyObject* obj = nullptr;
  Owned() = default;
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() { Py_XDECREF(obj); }
};

// Attribute names made once (PyObject_GetAttrString would make a string per read). The GIL is held.
PyObject* name(const char* text, PyObject*& cached) {
  if (cached == nullptr) cached = PyUnicode_InternFromString(text);
  return cached;
}
PyObject* g_local_name = nullptr;

// The tensor `obj` stands for: itself, or a DTensor's local shard (`sharded`: DTensor's type, or
// None). Null when it is neither (the caller reads it in Python); `hold` keeps the shard alive.
const at::Tensor* tensor_of(PyObject* obj, PyObject* sharded, Owned& hold) {
  if (THPVariable_CheckExact(obj)) return &THPVariable_Unpack(obj);
  if (sharded == Py_None || PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(sharded)) == 0) return nullptr;
  PyObject* attr = name("_local_tensor", g_local_name);
  hold.obj = attr == nullptr ? nullptr : PyObject_GetAttr(obj, attr);
  if (hold.obj == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  return THPVariable_CheckExact(hold.obj) ? &THPVariable_Unpack(hold.obj) : nullptr;
}

// A gradient that is not there: a value no address or version can take, and not the caller's
// "nothing sent" mark either (std::numeric_limits<std::int64_t>::min()).
constexpr std::int64_t kNoGrad = std::numeric_limits<std::int64_t>::min() + 1;

}  // namespace

extern "C" {

/// Reads, for each of the `n` tensors of the list `tensors`, its data pointer and version into
/// `data[i]`, `version[i]`, and its gradient's into `grad_data[i]`, `grad_version[i]` (kNoGrad for
/// both when it has none); of a DTensor (an instance of `sharded`, or None), its local shard's and
/// its gradient's local shard's. Returns 0; -1 when `tensors` is not a list of `n`; i + 1 when
/// tensor i cannot be read here (another subclass, no storage, no version counter, a sparse
/// gradient): the caller reads them in Python, which raises what torch raises.
__attribute__((visibility("default"))) long memtide_torch_read(PyObject* tensors, PyObject* sharded,
                                                               std::int64_t* data, std::int64_t* version,
                                                               std::int64_t* grad_data, std::int64_t* grad_version,
                                                               long n) {
  if (!PyList_CheckExact(tensors) || PyList_GET_SIZE(tensors) != n) return -1;
  if (sharded != Py_None && !PyType_Check(sharded)) return -1;
  for (long i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(tensors, i);
    Owned local, grad, grad_local;
    const at::Tensor* t = tensor_of(item, sharded, local);
    if (t == nullptr) return i + 1;
    try {
      if (t->is_sparse()) return i + 1;
      data[i] = reinterpret_cast<std::intptr_t>(t->data_ptr());
      version[i] = t->_version();
      const at::Tensor* g = nullptr;
      if (local.obj == nullptr) {
        g = &t->grad();
      } else {
        // A DTensor's gradient is a DTensor whose local shard is read. Its Python object comes
        // from the gradient itself (torch keeps it there): Python's `.grad` on a tensor subclass
        // costs about 0.5 us, checking for __torch_function__.
        const at::Tensor& wrapper_grad = THPVariable_Unpack(item).grad();
        if (wrapper_grad.defined()) {
          grad.obj = THPVariable_Wrap(wrapper_grad);
          if (grad.obj == nullptr) {
            PyErr_Clear();
            return i + 1;
          }
          if ((g = tensor_of(grad.obj, sharded, grad_local)) == nullptr) return i + 1;
        }
      }
      if (g == nullptr || !g->defined()) {
        grad_data[i] = grad_version[i] = kNoGrad;
      } else {
        if (g->is_sparse()) return i + 1;
        grad_data[i] = reinterpret_cast<std::intptr_t>(g->data_ptr());
        grad_version[i] = g->_version();
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
