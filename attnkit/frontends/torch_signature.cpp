// The torch frontend's call signature in C++ (attnkit/frontends/torch_compiled.py builds and loads it).
//
// attend() keys its cache of validated calls on a signature of the tensors' metadata. In Python that is nine
// tensor attribute reads (each builds a torch.Size or torch.device) and the hash of what they return: about 1 us of
// a decode step's dispatch. Here the same facts come from the C++ tensor for q, k and v: a tuple of small ints.
//
// Only the common call is handled (q, k, v exactly torch.Tensor, no mask, bias or lengths); every other call goes
// to the Python signature, set once with set_fallback(), so both always agree on which calls they can key. The same
// holds for length_class_signature(), the key of attend's length-class table (TorchOps.length_class_signature): the
// sequence lengths enter it only by their class (attnkit.backend.length_class) and the sign of Lk - Lq.

#include <ATen/core/grad_mode.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

PyObject* python_signature = nullptr;  // TorchOps' Python signature, the fallback
PyObject* python_class_signature = nullptr;  // TorchOps.length_class_signature, its fallback
PyObject* bshd_layout = nullptr;  // attnkit.spec.Layout.BSHD: the sequence axis is 1 there, else 2
PyObject* layout_name = nullptr;  // "layout", interned

constexpr Py_ssize_t kArguments = 7;  // q, k, v, mask, bias, q_lengths, kv_lengths
constexpr size_t kMaxDims = 8;

// Everything validation and dispatch read from one tensor but its sizes, in one int: dtype, device type and index,
// requires_grad. Each field has room to spare: ScalarType < 64, DeviceType < 64, index in [-1, 65534].
int64_t packed_flags(const at::Tensor& tensor) {
  const auto device = tensor.device();
  int64_t flags = static_cast<int64_t>(tensor.scalar_type());
  flags = flags * 64 + static_cast<int64_t>(device.type());
  flags = flags * 65536 + (static_cast<int64_t>(device.index()) + 1);
  return flags * 2 + (tensor.requires_grad() ? 1 : 0);
}

// The key: a tuple of the ints.
PyObject* as_tuple(const int64_t* values, Py_ssize_t count) {
  PyObject* key = PyTuple_New(count);
  if (key == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* value = PyLong_FromLongLong(values[i]);
    if (value == nullptr) {
      Py_DECREF(key);
      return nullptr;
    }
    PyTuple_SET_ITEM(key, i, value);
  }
  return key;
}

PyObject* fallback(PyObject* const* args) {
  if (python_signature == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "attnkit: set_fallback() was not called before signature()");
    return nullptr;
  }
  return PyObject_Vectorcall(python_signature, args, kArguments, nullptr);
}

// (ndim, sizes..., flags) for q, k and v in turn, then grad mode.
PyObject* signature(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != kArguments) {
    PyErr_Format(PyExc_TypeError, "signature() takes %zd arguments, got %zd", kArguments, nargs);
    return nullptr;
  }
  for (Py_ssize_t i = 3; i < kArguments; ++i) {
    if (args[i] != Py_None) return fallback(args);
  }
  int64_t values[3 * (kMaxDims + 2) + 1];
  Py_ssize_t count = 0;
  for (Py_ssize_t i = 0; i < 3; ++i) {
    // Exactly torch.Tensor: THPVariable_CheckExact would also take nn.Parameter, which the Python signature leaves
    // to the full validation path.
    if (Py_TYPE(args[i]) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return fallback(args);
    const at::Tensor& tensor = THPVariable_Unpack(args[i]);
    const auto sizes = tensor.sizes();
    if (sizes.size() > kMaxDims) return fallback(args);
    values[count++] = static_cast<int64_t>(sizes.size());
    for (const auto size : sizes) values[count++] = size;
    values[count++] = packed_flags(tensor);
  }
  values[count++] = at::GradMode::is_enabled() ? 1 : 0;
  return as_tuple(values, count);
}

constexpr Py_ssize_t kClassArguments = 8;  // spec, q, k, v, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids

// attnkit.backend.length_class: each power of two (and 0) a class of its own, each open interval between two another.
int64_t length_class(int64_t length) {
  const int64_t bits = length > 0 ? 64 - __builtin_clzll(static_cast<uint64_t>(length)) : 0;
  return 2 * bits - ((length & (length - 1)) == 0 ? 1 : 0);
}

// For q, k and v in turn its sizes but the sequence axis, and flags; then grad mode, each length's class, the sign of
// Lk - Lq. None where v's length is not k's (validation names it); the fallback for every call it does not key.
PyObject* length_class_signature(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != kClassArguments) {
    PyErr_Format(PyExc_TypeError, "length_class_signature() takes %zd arguments, got %zd", kClassArguments, nargs);
    return nullptr;
  }
  if (python_class_signature == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "attnkit: set_class_fallback() was not called before length_class_signature()");
    return nullptr;
  }
  bool common = true;
  for (Py_ssize_t i = 4; i < kClassArguments; ++i) common = common && args[i] == Py_None;
  for (Py_ssize_t i = 1; i < 4; ++i) {
    common = common && Py_TYPE(args[i]) == reinterpret_cast<PyTypeObject*>(THPVariableClass) &&
             THPVariable_Unpack(args[i]).dim() == 4;
  }
  if (!common) return PyObject_Vectorcall(python_class_signature, args, kClassArguments, nullptr);
  PyObject* layout = PyObject_GetAttr(args[0], layout_name);
  if (layout == nullptr) return nullptr;
  const size_t sequence = layout == bshd_layout ? 1 : 2;
  Py_DECREF(layout);
  int64_t values[3 * 4 + 4];
  Py_ssize_t count = 0;
  int64_t lengths[3];
  for (Py_ssize_t i = 0; i < 3; ++i) {
    const at::Tensor& tensor = THPVariable_Unpack(args[i + 1]);
    const auto sizes = tensor.sizes();
    for (size_t axis = 0; axis < 4; ++axis) {
      if (axis != sequence) values[count++] = sizes[axis];
    }
    lengths[i] = sizes[sequence];
    values[count++] = packed_flags(tensor);
  }
  if (lengths[2] != lengths[1]) Py_RETURN_NONE;
  values[count++] = at::GradMode::is_enabled() ? 1 : 0;
  values[count++] = length_class(lengths[0]);
  values[count++] = length_class(lengths[1]);
  values[count++] = (lengths[1] > lengths[0]) - (lengths[1] < lengths[0]);
  return as_tuple(values, count);
}

// set_class_fallback(function, bshd): the Python length-class signature, and Layout.BSHD.
PyObject* set_class_fallback(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyCallable_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "set_class_fallback(function, bshd) needs a callable and the BSHD layout");
    return nullptr;
  }
  if (layout_name == nullptr && (layout_name = PyUnicode_InternFromString("layout")) == nullptr) return nullptr;
  Py_INCREF(args[0]);
  Py_XSETREF(python_class_signature, args[0]);
  Py_INCREF(args[1]);
  Py_XSETREF(bshd_layout, args[1]);
  Py_RETURN_NONE;
}

PyObject* set_fallback(PyObject*, PyObject* function) {
  if (!PyCallable_Check(function)) {
    PyErr_SetString(PyExc_TypeError, "set_fallback() needs a callable");
    return nullptr;
  }
  Py_INCREF(function);
  Py_XSETREF(python_signature, function);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(signature)), METH_FASTCALL,
     "signature(q, k, v, mask, bias, q_lengths, kv_lengths): the cache key of a call's tensor metadata"},
    {"set_fallback", set_fallback, METH_O, "set_fallback(function): the Python signature, for every other call"},
    {"length_class_signature",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(length_class_signature)), METH_FASTCALL,
     "length_class_signature(spec, q, k, v, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids): the key of "
     "attend's length-class table"},
    {"set_class_fallback", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(set_class_fallback)),
     METH_FASTCALL, "set_class_fallback(function, bshd): the Python length-class signature, and Layout.BSHD"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

// Plain CPython functions on the module pybind11 makes: a pybind11 function would spend more on argument
// conversion than the signature itself costs.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  if (PyModule_AddFunctions(module.ptr(), methods) != 0) throw pybind11::error_already_set();
}
