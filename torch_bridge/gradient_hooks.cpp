// TieredAdamW's gradient hooks in C++: the moment backward has accumulated a param's gradient, it
// is handed to the engine's step protocol (StepProtocol::grad_ready, through the C entry of
// memtide/tiering/engine/grad_entry.h) from autograd's own thread, without the GIL.
//
// Why: a Python post-accumulate-grad hook runs in the middle of backward, whose kernels have just
// streamed the layer's weights and gradients through the caches, so every Python object it
// touches misses: 18-22 us a hook on a 50M-param MLP where the same code runs in 1-2 us warm, plus
// taking the GIL (bench/results/step-overhead/). Here a hook is a few loads and one call.
//
// The hook is the param's post-accumulate-grad hook, as Python's register_post_accumulate_grad_hook
// installs one: torch calls it after writing `.grad`, from whichever gradient accumulator the
// param has now (one is made anew for each graph, and when `p.data` changes its shape, dtype or
// device). torch keeps one such hook object per param; where Python hooks are already there, this
// one holds them and calls them first, as they would run before a Python hook registered after
// them. A Python hook registered later, on a param that had none, replaces it: the step then
// finds that param's gradient unsent and sends it itself (stats.regathered), as before.
// Where the hook cannot hand the gradient over itself (the route is "python": updates during
// backward; a gradient on a GPU, sparse, conjugated, not contiguous, of another dtype) it calls the
// Python hook instead, which does what it always did. DDP's params are skipped: their gradients
// come reduced from DDP's bucket hook.

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "memtide/tiering/engine/grad_entry.h"

namespace {

using torch::autograd::PostAccumulateGradHook;
using torch::autograd::Variable;

// The route every gradient takes while it is set (memtide_grad_route), or this: through Python.
constexpr int kRoutePython = -1;

class Hooks;

struct Hook final : PostAccumulateGradHook {
  Hook(std::weak_ptr<Hooks> owner, std::uint64_t owned_by, std::size_t index,
       std::unique_ptr<PostAccumulateGradHook> inner)
      : owner(std::move(owner)), owned_by(owned_by), index(index), inner(std::move(inner)) {}
  void operator()(const Variable& param) override;
  // Compiled autograd sees the Python hooks this one holds, not this one: the step then sends
  // the gradients itself.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    if (inner) inner->compiled_args(args);
  }
  void apply_with_saved(Variable& param, torch::dynamo::autograd::SwapSavedVariables& saved) override {
    if (inner) inner->apply_with_saved(param, saved);
  }
  std::weak_ptr<Hooks> owner;  // weak: the param (its autograd metadata) owns this hook
  std::uint64_t owned_by;      // which Hooks installed it (Hooks::id)
  std::size_t index;
  std::unique_ptr<PostAccumulateGradHook> inner;  // the Python hooks it replaced in torch's slot, or null
};

// Takes the GIL for a scope (the thread may be one of autograd's, which Python has not seen).
struct Gil {
  PyGILState_STATE state = PyGILState_Ensure();
  Gil() = default;
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;
  ~Gil() { PyGILState_Release(state); }
};

// A held Python reference; released with the GIL taken, from whichever thread drops it last.
struct PyRef {
  PyObject* obj = nullptr;
  explicit PyRef(PyObject* o = nullptr) : obj(o) { Py_XINCREF(obj); }
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() {
    if (obj == nullptr || !Py_IsInitialized()) return;
    Gil gil;
    Py_DECREF(obj);
  }
};

class Hooks : public std::enable_shared_from_this<Hooks> {
 public:
  Hooks(PyObject* fallback, PyObject* protocol, memtide_grad_ready_fn ready, void* native_protocol,
        std::int64_t* addresses, std::int64_t* versions, const std::int64_t* sizes, PyObject* arrays, std::size_t n)
      : fallback_(fallback),
        protocol_(protocol),
        arrays_(arrays),
        ready_(ready),
        native_protocol_(native_protocol),
        addresses_(addresses),
        versions_(versions),
        sizes_(sizes),
        sources_(n),
        params_(n),
        skip_(n, 0) {}

  ~Hooks() { remove(); }

  // Hooks param `i` (a leaf that requires grad), taking torch's slot for it.
  void add(std::size_t i, const Variable& param) {
    auto& slot = torch::autograd::impl::post_acc_grad_hooks(param);
    slot = std::make_unique<Hook>(weak_from_this(), id_, i, std::move(slot));
    params_[i] = param;
  }

  // Takes this object's hook out of each param's slot, giving back what it held (a second
  // optimizer over the same params holds the first's hook inside its own: it is cut out of the
  // chain), and lets the params go (the GIL is held: a param's Python object may go with it).
  void remove() {
    for (auto& param : params_) {
      if (!param.defined()) continue;
      std::unique_ptr<PostAccumulateGradHook>* link = &torch::autograd::impl::post_acc_grad_hooks(param);
      while (auto* hook = dynamic_cast<Hook*>(link->get())) {  // a Python hooks object ends the chain
        if (hook->owned_by == id_) {
          *link = std::move(hook->inner);
          break;
        }
        link = &hook->inner;
      }
      param.reset();
    }
  }

  void set_route(int route) { route_.store(route, std::memory_order_relaxed); }
  // Params whose hook does nothing (DDP's: their gradients come reduced from its bucket hook).
  void set_skip(const unsigned char* skip) {
    for (std::size_t i = 0; i < skip_.size(); ++i) skip_[i] = skip[i] != 0;
  }
  // The next backward sends its own: the gradients read where they lay are let go.
  void reset() {
    for (auto& s : sources_) s.reset();
  }
  [[nodiscard]] std::int64_t native_sends() const { return native_sends_.load(std::memory_order_relaxed); }

  // Autograd has accumulated param i's gradient into `.grad`.
  void ready(std::size_t i, const Variable& param) {
    if (skip_[i]) return;
    const int route = route_.load(std::memory_order_relaxed);
    const at::Tensor& g = param.grad();
    if (route == kRoutePython || (g.defined() && !native(g))) {
      python(i, param);
      return;
    }
    // Nothing to send: step() finds no gradient; or a param resized since the layout, which step() refuses.
    if (!g.defined() || g.numel() != sizes_[i]) return;
    const int dtype = g.scalar_type() == at::kFloat ? MEMTIDE_GRAD_FP32
                      : g.scalar_type() == at::kHalf ? MEMTIDE_GRAD_FP16
                                                     : MEMTIDE_GRAD_BF16;
    void* data = g.data_ptr();
    char error[512] = {};
    if (ready_(native_protocol_, i, data, dtype, static_cast<std::size_t>(g.numel()), route, nullptr, error,
               sizeof error) != 0) {
      throw std::invalid_argument(std::string("TieredAdamW's gradient hook: ") + error);
    }
    addresses_[i] = reinterpret_cast<std::intptr_t>(data);
    versions_[i] = g._version();
    if (route == MEMTIDE_GRAD_IN_PLACE) sources_[i] = g;  // read where it lies by the step: kept alive until then
    native_sends_.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  // What this hook hands over itself: a dense CPU gradient of a dtype the engine reads, laid out
  // as the flat range it fills. The rest goes through Python, which copies or routes it.
  static bool native(const at::Tensor& g) {
    const auto t = g.scalar_type();
    return g.layout() == at::kStrided && g.device().is_cpu() && g.is_contiguous() && !g.is_conj() &&
           !g.is_neg() && (t == at::kFloat || t == at::kHalf || t == at::kBFloat16);
  }

  void python(std::size_t i, const Variable& param) {
    Gil gil;
    PyObject* obj = THPVariable_Wrap(param);
    if (obj == nullptr) throw_python();
    PyObject* out = PyObject_CallFunction(fallback_.obj, "nN", static_cast<Py_ssize_t>(i), obj);
    if (out == nullptr) throw_python();
    Py_DECREF(out);
  }

  [[noreturn]] static void throw_python() {
    // Taken off the thread now, the GIL held: autograd rethrows it where backward was called.
    python_error err;
    err.persist();
    throw err;
  }

  PyRef fallback_;  // the Python hook: fallback(i, param)
  PyRef protocol_;  // keeps the protocol that native_protocol_ points into alive
  PyRef arrays_;    // keeps the arrays addresses_ and versions_ point into alive
  memtide_grad_ready_fn ready_;
  void* native_protocol_;
  std::int64_t* addresses_;
  std::int64_t* versions_;
  const std::int64_t* sizes_;  // each param's element count in the layout
  std::vector<at::Tensor> sources_;
  std::vector<Variable> params_;  // the hooked params (undefined: not hooked)
  std::vector<unsigned char> skip_;  // set between backwards only
  std::atomic<int> route_{kRoutePython};
  std::atomic<std::int64_t> native_sends_{0};
  const std::uint64_t id_ = next_id_.fetch_add(1);  // never reused, unlike an address
  static inline std::atomic<std::uint64_t> next_id_{1};
};

void Hook::operator()(const Variable& param) {
  if (inner) (*inner)(param);  // registered before: they ran first as Python hooks, and an edit of theirs is sent
  if (auto hooks = owner.lock()) hooks->ready(index, param);
}

// What Python holds: the hooks are shared with the callbacks queued on autograd.
using Handle = std::shared_ptr<Hooks>;

}  // namespace

extern "C" {

/// Hooks every param i of the list `params` for which `wanted[i]` is nonzero (a leaf that requires
/// grad; Python's hook serves the others) with a post-accumulate-grad hook, which hands
/// its gradient to the step protocol at `native_protocol` through `ready` (grad_entry.h) or calls
/// `fallback(i, param)` where it cannot or is not to (the route, set with
/// memtide_gradient_hooks_route, starts at -1: every gradient through Python). A gradient of
/// another size than `sizes[i]` is not sent. What each sent is written to `addresses[i]`,
/// `versions[i]`. The three are int64 arrays inside the Python object `arrays` (held, as are
/// `fallback` and `protocol`, the Python object owning the native one). Called with the GIL held.
/// Returns a handle for the calls below, or null with a Python exception set.
__attribute__((visibility("default"))) void* memtide_gradient_hooks_make(
    PyObject* params, const unsigned char* wanted, PyObject* fallback, PyObject* protocol, void* ready,
    void* native_protocol, std::int64_t* addresses, std::int64_t* versions, const std::int64_t* sizes,
    PyObject* arrays, long n) {
  if (!PyList_CheckExact(params) || PyList_GET_SIZE(params) != n || n < 0) {
    PyErr_SetString(PyExc_ValueError, "memtide_gradient_hooks_make: params must be a list of n tensors");
    return nullptr;
  }
  if (ready == nullptr || native_protocol == nullptr || addresses == nullptr || versions == nullptr ||
      sizes == nullptr || !PyCallable_Check(fallback)) {
    PyErr_SetString(PyExc_ValueError,
                    "memtide_gradient_hooks_make: a null entry, protocol or array, or a fallback that is not callable");
    return nullptr;
  }
  try {
    auto hooks = std::make_shared<Hooks>(fallback, protocol, reinterpret_cast<memtide_grad_ready_fn>(ready),
                                         native_protocol, addresses, versions, sizes, arrays,
                                         static_cast<std::size_t>(n));
    for (long i = 0; i < n; ++i) {
      if (wanted[i] == 0) continue;
      PyObject* item = PyList_GET_ITEM(params, i);
      if (!THPVariable_Check(item)) {
        PyErr_Format(PyExc_TypeError, "memtide_gradient_hooks_make: param %ld is not a tensor", i);
        return nullptr;
      }
      hooks->add(static_cast<std::size_t>(i), THPVariable_Unpack(item));
    }
    return new Handle(std::move(hooks));
  } catch (const std::exception& e) {
    PyErr_Format(PyExc_RuntimeError, "memtide_gradient_hooks_make: %s", e.what());
    return nullptr;
  }
}

/// Every gradient from now on takes `route` (memtide_grad_route), or goes through Python (-1).
__attribute__((visibility("default"))) void memtide_gradient_hooks_route(void* handle, int route) {
  (*static_cast<Handle*>(handle))->set_route(route);
}

/// From the next backward on, the hook of each param i with `skip[i]` nonzero does nothing (n bytes).
__attribute__((visibility("default"))) void memtide_gradient_hooks_skip(void* handle, const unsigned char* skip) {
  (*static_cast<Handle*>(handle))->set_skip(skip);
}

/// The next backward sends its own: the gradients kept for the step to read are let go.
__attribute__((visibility("default"))) void memtide_gradient_hooks_reset(void* handle) {
  (*static_cast<Handle*>(handle))->reset();
}

/// How many gradients the hooks have handed over themselves (not through Python).
__attribute__((visibility("default"))) std::int64_t memtide_gradient_hooks_sent(void* handle) {
  return (*static_cast<Handle*>(handle))->native_sends();
}

/// How many memtide hooks torch's post-accumulate-grad slot of the tensor `param` holds, one
/// inside the other (each optimizer alive over it adds one), or -1 when `param` is not a tensor.
__attribute__((visibility("default"))) long memtide_gradient_hooks_depth(PyObject* param) {
  if (!THPVariable_Check(param)) return -1;
  long depth = 0;
  const auto* link = &torch::autograd::impl::post_acc_grad_hooks(THPVariable_Unpack(param));
  while (const auto* hook = dynamic_cast<const Hook*>(link->get())) {
    ++depth;
    link = &hook->inner;
  }
  return depth;
}

/// Takes the hooks off and frees the handle (the GIL is held).
__attribute__((visibility("default"))) void memtide_gradient_hooks_free(void* handle) {
  auto* h = static_cast<Handle*>(handle);
  (*h)->remove();
  delete h;
}

}  // extern "C"
