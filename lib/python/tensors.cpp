// refit Python binding — tensors in and out (see tensors.hpp).
#include "tensors.hpp"

#include <cstddef>
#include <string>
#include <utility>

namespace refit::python {
namespace {

// The DLPack ABI (dmlc/dlpack, v0.x "dltensor" capsules), declared here so the binding needs no
// header of any array library: every producer (numpy, torch, cupy, jax) speaks it.
namespace dl {
enum : std::int32_t { kind_cpu = 1, kind_cuda = 2, kind_cuda_host = 3, kind_cuda_managed = 13 };
enum : std::uint8_t {
  code_int = 0,
  code_uint = 1,
  code_float = 2,
  code_bfloat = 4,
  code_bool = 6,
  code_f8_e4m3fn = 10,
  code_f8_e5m2 = 12,
  code_f8_e8m0fnu = 14,  // DLPack 1.1 kDLFloat8_e8m0fnu
  code_f4_e2m1fn = 17,   // kDLFloat4_e2m1fn: torch exports float4_e2m1fn_x2 as bits 4, lanes 2
};
struct device {
  std::int32_t kind;
  std::int32_t id;
};
struct data_type {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct tensor {
  void* data;
  device dev;
  std::int32_t ndim;
  data_type type;
  std::int64_t* shape;
  std::int64_t* strides;
  std::uint64_t byte_offset;
};
struct managed_tensor {
  tensor t;
  void* context;
  void (*deleter)(managed_tensor*);
};
}  // namespace dl

std::optional<dtype> from_dl(dl::data_type t) noexcept {
  // Two e2m1 values a byte: torch's DLPack export of float4_e2m1fn_x2 (torch/csrc/utils/dlpack or
  // aten DLConvertor: kDLFloat4_e2m1fn, bits 4, lanes 2); one byte of the x2 dtype per element.
  if (t.code == dl::code_f4_e2m1fn && t.bits == 4 && t.lanes == 2) return dtype::f4_e2m1x2;
  if (t.lanes != 1) return std::nullopt;
  switch (t.code) {
    case dl::code_bool: return t.bits == 8 ? std::optional(dtype::bool_) : std::nullopt;
    case dl::code_int:
      switch (t.bits) {
        case 8: return dtype::i8;
        case 16: return dtype::i16;
        case 32: return dtype::i32;
        case 64: return dtype::i64;
        default: return std::nullopt;
      }
    case dl::code_uint:
      switch (t.bits) {
        case 8: return dtype::u8;
        case 16: return dtype::u16;
        case 32: return dtype::u32;
        case 64: return dtype::u64;
        default: return std::nullopt;
      }
    case dl::code_float:
      switch (t.bits) {
        case 16: return dtype::f16;
        case 32: return dtype::f32;
        case 64: return dtype::f64;
        default: return std::nullopt;
      }
    case dl::code_bfloat: return t.bits == 16 ? std::optional(dtype::bf16) : std::nullopt;
    case dl::code_f8_e4m3fn: return t.bits == 8 ? std::optional(dtype::f8_e4m3) : std::nullopt;
    case dl::code_f8_e5m2: return t.bits == 8 ? std::optional(dtype::f8_e5m2) : std::nullopt;
    case dl::code_f8_e8m0fnu: return t.bits == 8 ? std::optional(dtype::f8_e8m0) : std::nullopt;
    default: return std::nullopt;
  }
}

/// A flat uint8 DLPack tensor over memory refit owns: the capsule's deleter frees only this.
struct byte_view {
  dl::managed_tensor managed{};
  std::int64_t shape[1] = {0};
};

void delete_byte_view(dl::managed_tensor* m) { delete static_cast<byte_view*>(m->context); }

void byte_capsule_destructor(PyObject* capsule) {
  // A consumer renames the capsule "used_dltensor" once it owns the tensor; one that never did
  // leaves the freeing to us.
  if (PyCapsule_IsValid(capsule, "dltensor") == 0) return;
  auto* m = static_cast<dl::managed_tensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (m != nullptr && m->deleter != nullptr) m->deleter(m);
}

py::object byte_capsule(const void* data, std::uint64_t bytes, device dev) {
  auto* v = new byte_view;
  v->shape[0] = static_cast<std::int64_t>(bytes);
  v->managed.t.data = const_cast<void*>(data);
  v->managed.t.dev = dev.kind == device_kind::cuda ? dl::device{dl::kind_cuda, dev.index} : dl::device{dl::kind_cpu, 0};
  v->managed.t.ndim = 1;
  v->managed.t.type = dl::data_type{dl::code_uint, 8, 1};
  v->managed.t.shape = v->shape;
  v->managed.t.strides = nullptr;
  v->managed.t.byte_offset = 0;
  v->managed.context = v;
  v->managed.deleter = delete_byte_view;
  PyObject* capsule = PyCapsule_New(&v->managed, "dltensor", byte_capsule_destructor);
  if (capsule == nullptr) {
    delete v;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}

std::string where(const std::string& name) { return "tensor '" + name + "'"; }

std::int64_t dim_of(PyObject* item, const std::string& name) {
  const long long d = PyLong_AsLongLong(item);
  if (d == -1 && PyErr_Occurred() != nullptr) throw py::error_already_set();
  if (d < 0) throw py::value_error(where(name) + " has a negative dimension");
  return static_cast<std::int64_t>(d);
}

}  // namespace

bool has_attr(py::handle obj, const py::str& name) {
  PyObject* found = nullptr;
#if PY_VERSION_HEX >= 0x030D0000
  const int r = PyObject_GetOptionalAttr(obj.ptr(), name.ptr(), &found);
#else
  const int r = _PyObject_LookupAttr(obj.ptr(), name.ptr(), &found);
#endif
  if (r < 0) throw py::error_already_set();
  Py_XDECREF(found);
  return r == 1;
}

tensor_world::tensor_world() : torch_(py::none()) {
  try {
    torch_ = py::module_::import("torch");
  } catch (const py::error_already_set&) {
    return;  // numpy and other DLPack producers still work
  }
  tensor_type_ = torch_.attr("Tensor");
  try {
    parameter_type_ = torch_.attr("nn").attr("Parameter");
  } catch (const py::error_already_set&) {
    // A torch without nn: Parameters (if any) take the isinstance path.
  }
  from_dlpack_ = py::module_::import("torch.utils.dlpack").attr("from_dlpack");
  uint8_ = torch_.attr("uint8");
  cuda_ = torch_.attr("cuda");
  // torch.cuda.current_stream(i).cuda_stream builds a torch.cuda.Stream, entering and leaving the
  // device's context, to read one integer: microseconds of every refit of CUDA tensors. A torch
  // built with CUDA also has the raw query (the same integer); current_stream() uses it once torch
  // has initialised CUDA in this process (torch.cuda._initialized, cleared in a forked child).
  const py::object c = torch_.attr("_C");
  if (py::hasattr(c, "_cuda_getCurrentRawStream") && py::hasattr(cuda_, "_initialized"))
    raw_stream_ = c.attr("_cuda_getCurrentRawStream");
  // Every torch dtype refit carries; newer ones (fp8, unsigned) only where this torch has them.
  static constexpr std::pair<const char*, dtype> names[] = {
      {"bool", dtype::bool_},
      {"uint8", dtype::u8},
      {"int8", dtype::i8},
      {"int16", dtype::i16},
      {"int32", dtype::i32},
      {"int64", dtype::i64},
      {"float16", dtype::f16},
      {"bfloat16", dtype::bf16},
      {"float32", dtype::f32},
      {"float64", dtype::f64},
      {"float8_e4m3fn", dtype::f8_e4m3},
      {"float8_e5m2", dtype::f8_e5m2},
      {"float8_e8m0fnu", dtype::f8_e8m0},      // torch 2.7+: MX scales
      {"float4_e2m1fn_x2", dtype::f4_e2m1x2},  // torch 2.8+: two e2m1 a byte
      {"uint16", dtype::u16},
      {"uint32", dtype::u32},
      {"uint64", dtype::u64},
  };
  for (const auto& [name, type] : names) {
    if (!py::hasattr(torch_, name)) continue;
    py::object d = torch_.attr(name);
    by_torch_dtype_.emplace_back(d.ptr(), type);
    torch_by_refit_.emplace(static_cast<int>(type), d);
  }
}

std::optional<dtype> tensor_world::of_torch_dtype(PyObject* type) const noexcept {
  for (const auto& [object, refit_type] : by_torch_dtype_)
    if (object == type) return refit_type;
  return std::nullopt;
}

namespace {

/// Attribute names, interned once: a refit of thousands of tensors reads six of them per tensor, and
/// building each name afresh costs as much as the lookup.
struct torch_names {
  py::str dtype{"dtype"}, shape{"shape"}, is_contiguous{"is_contiguous"}, is_cuda{"is_cuda"}, is_cpu{"is_cpu"},
      get_device{"get_device"}, data_ptr{"data_ptr"}, stride{"stride"}, device{"device"}, dlpack{"__dlpack__"};
};

const torch_names& names() {
  static const torch_names* n = new torch_names();  // never destroyed: outlives the interpreter's teardown
  return *n;
}

py::object get(py::handle obj, const py::str& attr) {
  PyObject* r = PyObject_GetAttr(obj.ptr(), attr.ptr());
  if (r == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

/// obj.method(), without a bound method object.
py::object call(py::handle obj, const py::str& method) {
#if PY_VERSION_HEX >= 0x03090000
  PyObject* self = obj.ptr();
  PyObject* r = PyObject_VectorcallMethod(method.ptr(), &self, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
#else
  PyObject* r = PyObject_CallMethodObjArgs(obj.ptr(), method.ptr(), nullptr);
#endif
  if (r == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

bool truth(const py::object& o) {
  if (o.ptr() == Py_True) return true;  // torch's flags are the bool singletons
  if (o.ptr() == Py_False) return false;
  const int t = PyObject_IsTrue(o.ptr());
  if (t < 0) throw py::error_already_set();
  return t == 1;
}

}  // namespace

borrowed_tensor tensor_world::borrow(py::handle obj, std::string name, bool views) {
  // Exact torch.Tensor and nn.Parameter first: a state_dict() is thousands of them, and
  // isinstance() of a subclass walks the metaclass's __instancecheck__.
  if (is_plain_tensor(obj)) return borrow_torch(obj, std::move(name), views);
  if (has_torch()) {
    const int is_tensor = PyObject_IsInstance(obj.ptr(), tensor_type_.ptr());
    if (is_tensor < 0) throw py::error_already_set();
    if (is_tensor == 1) return borrow_torch(obj, std::move(name), views);
  }
  if (has_attr(obj, names().dlpack)) return borrow_dlpack(obj, std::move(name), views);
  throw py::type_error(where(name) + " is a " + std::string(py::str(py::type::handle_of(obj).attr("__name__"))) +
                       ", not a tensor (a torch.Tensor or any object with __dlpack__: numpy, cupy, jax)");
}

borrowed_tensor tensor_world::borrow_torch(py::handle obj, std::string&& tensor_name, bool views) {
  const torch_names& n = names();
  borrowed_tensor b;
  b.meta.name = std::move(tensor_name);
  const std::string& name = b.meta.name;
  const py::object type = get(obj, n.dtype);
  const auto t = of_torch_dtype(type.ptr());
  if (!t)
    throw py::type_error(where(name) + " has dtype " + std::string(py::str(type)) + ", which refit does not carry");
  b.meta.type = *t;
  const py::object shape = get(obj, n.shape);  // torch.Size: a tuple
  if (!PyTuple_Check(shape.ptr())) throw py::type_error(where(name) + " has a shape that is not a tuple");
  const Py_ssize_t rank = PyTuple_GET_SIZE(shape.ptr());
  b.meta.shape.reserve(static_cast<std::size_t>(rank));
  for (Py_ssize_t i = 0; i < rank; ++i) b.meta.shape.push_back(dim_of(PyTuple_GET_ITEM(shape.ptr(), i), name));
  const bool contiguous = truth(call(obj, n.is_contiguous));
  if (views) {
    if (!contiguous) {
      const py::tuple strides = call(obj, n.stride);
      for (const py::handle s : strides) b.strides.push_back(s.cast<std::int64_t>());
      for (std::size_t k = b.strides.size(); k-- > 0;) {
        if (b.meta.shape[k] == 1) continue;
        if (b.strides[k] != 1)
          throw py::value_error(where(name) + " is not contiguous in its last dimension (stride " +
                                std::to_string(b.strides[k]) +
                                "): refit writes rows of elements; register a view whose last dimension has "
                                "stride 1, such as qkv.narrow(0, q, kv) or w[:, a:b] with b - a > 1");
        break;
      }
    }
    // The allocation the view lies in, so that a view outside it is refused (torch >= 2 has
    // untyped_storage(); 1.13 a typed storage with the same two calls).
    py::object storage = py::hasattr(obj, "untyped_storage") ? obj.attr("untyped_storage")() : obj.attr("storage")();
    b.alloc = reinterpret_cast<const void*>(storage.attr("data_ptr")().cast<std::uintptr_t>());
    b.alloc_bytes = storage.attr("nbytes")().cast<std::uint64_t>();
  } else if (!contiguous) {
    throw py::value_error(where(name) +
                          " is not contiguous: refit reads dense row-major tensors (pass "
                          "tensor.contiguous())");
  }
  if (truth(get(obj, n.is_cuda))) {
    b.dev = device::cuda(call(obj, n.get_device).cast<int>());
  } else if (!truth(get(obj, n.is_cpu))) {
    throw py::value_error(where(name) + " is on device " + std::string(py::str(get(obj, n.device))) +
                          ": refit reads CPU and CUDA memory");
  }
  const py::object ptr = call(obj, n.data_ptr);
  const unsigned long long address = PyLong_AsUnsignedLongLong(ptr.ptr());
  if (address == static_cast<unsigned long long>(-1) && PyErr_Occurred() != nullptr) throw py::error_already_set();
  b.data = reinterpret_cast<void*>(static_cast<std::uintptr_t>(address));
  b.keep = py::reinterpret_borrow<py::object>(obj);
  return b;
}

borrowed_tensor tensor_world::borrow_dlpack(py::handle obj, std::string&& tensor_name, bool views) {
  py::object capsule = call(obj, names().dlpack);
  auto* m = static_cast<dl::managed_tensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (m == nullptr) throw py::error_already_set();
  const dl::tensor& t = m->t;
  borrowed_tensor b;
  b.meta.name = std::move(tensor_name);
  const std::string& name = b.meta.name;
  const auto type = from_dl(t.type);
  if (!type)
    throw py::type_error(where(name) + " has a DLPack dtype (code " + std::to_string(t.type.code) + ", " +
                         std::to_string(t.type.bits) + " bits, " + std::to_string(t.type.lanes) +
                         " lanes) that refit does not carry");
  b.meta.type = *type;
  b.meta.shape.assign(t.shape, t.shape + t.ndim);
  for (const std::int64_t d : b.meta.shape)
    if (d < 0) throw py::value_error(where(name) + " has a negative dimension");
  if (t.strides != nullptr) {
    std::int64_t expected = 1;
    bool dense = true;
    for (std::int32_t i = t.ndim - 1; i >= 0; --i) {
      if (t.shape[i] != 1 && t.strides[i] != expected) dense = false;
      expected *= t.shape[i];
    }
    if (!dense && !views)
      throw py::value_error(where(name) + " is not contiguous: refit reads dense row-major tensors");
    if (!dense) b.strides.assign(t.strides, t.strides + t.ndim);
  }
  switch (t.dev.kind) {
    case dl::kind_cpu:
    case dl::kind_cuda_host: b.dev = device::cpu(); break;
    case dl::kind_cuda:
    case dl::kind_cuda_managed: b.dev = device::cuda(t.dev.id); break;
    default:
      throw py::value_error(where(name) + " is on DLPack device type " + std::to_string(t.dev.kind) +
                            ": refit reads CPU and CUDA memory");
  }
  b.data = static_cast<std::byte*>(t.data) + t.byte_offset;
  b.keep = std::move(capsule);  // its destructor hands the tensor back to its producer
  return b;
}

py::object tensor_world::torch_dtype(dtype t) {
  const auto it = torch_by_refit_.find(static_cast<int>(t));
  if (it == torch_by_refit_.end())
    throw py::type_error("this torch has no dtype for refit's " + std::string(to_string(t)) + " (torch " +
                         std::string(py::str(torch_.attr("__version__"))) + ")");
  return it->second;
}

py::object tensor_world::python_dtype(dtype t) {
  if (has_torch()) return torch_dtype(t);
  return py::str(std::string(to_string(t)));
}

py::object tensor_world::alias(const tensor_meta& meta, const void* data, std::uint64_t bytes, device dev, bool whole) {
  py::tuple shape(meta.shape.size());
  for (std::size_t i = 0; i < meta.shape.size(); ++i) shape[i] = py::int_(meta.shape[i]);
  if (has_torch()) {
    py::object t = from_dlpack_(byte_capsule(data, bytes, dev));
    if (whole) t = t.attr("view")(torch_dtype(meta.type)).attr("reshape")(shape);
    return t;
  }
  if (dev.kind != device_kind::cpu)
    throw py::type_error("tensor '" + meta.name + "' is in CUDA memory: views of it need torch (not importable here)");
  if (numpy_.is_none() || !numpy_) numpy_ = py::module_::import("numpy");
  py::object memory = py::reinterpret_steal<py::object>(PyMemoryView_FromMemory(
      static_cast<char*>(const_cast<void*>(data)), static_cast<Py_ssize_t>(bytes), PyBUF_WRITE));
  if (!memory) throw py::error_already_set();
  py::object a = numpy_.attr("frombuffer")(memory, "uint8");
  // numpy has no bf16 or fp8: those stay flat bytes.
  const std::string_view name = to_string(meta.type);
  static constexpr std::pair<std::string_view, const char*> numpy_names[] = {
      {"bool", "bool"},   {"u8", "uint8"},   {"i8", "int8"},     {"i16", "int16"},
      {"i32", "int32"},   {"i64", "int64"},  {"f16", "float16"}, {"f32", "float32"},
      {"f64", "float64"}, {"u16", "uint16"}, {"u32", "uint32"},  {"u64", "uint64"},
  };
  if (whole)
    for (const auto& [refit_name, numpy_name] : numpy_names)
      if (refit_name == name) return a.attr("view")(numpy_name).attr("reshape")(shape);
  return a;
}

void* tensor_world::current_stream(int index) {
  if (!has_torch()) return nullptr;
  // Until torch initialised CUDA, current_stream() does it (or raises what torch raises).
  static const auto* initialized = new py::str("_initialized");  // never destroyed: see names()
  const bool raw = raw_stream_ && truth(get(cuda_, *initialized));
  const auto handle =
      (raw ? raw_stream_(index) : cuda_.attr("current_stream")(index).attr("cuda_stream")).cast<std::uintptr_t>();
  // torch's default stream is the legacy default stream (handle 0); refit reads a null stream as
  // "nothing to wait for", so name it explicitly (cudaStreamLegacy).
  return handle == 0 ? reinterpret_cast<void*>(std::uintptr_t{1}) : reinterpret_cast<void*>(handle);
}

}  // namespace refit::python
