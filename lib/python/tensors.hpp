// refit Python binding — tensors in and out: anything with __dlpack__ (numpy, cupy, jax) or a
// torch.Tensor becomes refit memory without a copy; receiver memory becomes torch tensors (numpy
// arrays without torch) that alias it.
//
// Only the public headers of refit and pybind11: the binding builds on a GPU node against a
// bundled librefit.so, for that node's Python.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "refit/model.hpp"

namespace refit::python {

namespace py = pybind11;

/// A Python tensor seen as refit memory. `keep` holds what keeps the memory alive (the tensor, or
/// the DLPack capsule that owns it).
struct borrowed_tensor {
  tensor_meta meta;
  void* data = nullptr;
  device dev{};
  py::object keep;
  /// Only from borrow(..., views = true): the strides (elements; empty when dense) and the
  /// allocation the tensor lies in (alloc_bytes 0 when unknown).
  std::vector<std::int64_t> strides;
  const void* alloc = nullptr;
  std::uint64_t alloc_bytes = 0;
};

/// Python's hasattr(obj, name) for an interned `name`: a missing attribute makes no AttributeError
/// (py::hasattr makes, formats and discards one: most of a microsecond); an error other than
/// AttributeError raised by the lookup is raised. Needs the GIL.
bool has_attr(py::handle obj, const py::str& name);

/// What the binding knows of the Python side: torch (when importable) and its dtypes.
class tensor_world {
 public:
  /// Looks torch up once (import errors mean "no torch"); numpy is looked up when first needed.
  tensor_world();

  [[nodiscard]] bool has_torch() const noexcept { return !torch_.is_none(); }

  /// Reads `obj` as a dense tensor named `name`. Raises TypeError for an object that is not a
  /// tensor or has a dtype refit does not carry, ValueError for a non-contiguous tensor or one on
  /// a device refit cannot reach; both name the tensor. Needs the GIL.
  /// With `views`, a strided tensor (a view into an engine tensor: `qkv.narrow(0, q, kv)`,
  /// `w[:, a:b]`) is accepted and its strides and allocation are read too.
  /// A torch.Tensor or nn.Parameter (exactly those types) is read without an isinstance check;
  /// any other tensor subclass through its attributes (so its __torch_function__ is honoured).
  borrowed_tensor borrow(py::handle obj, std::string name, bool views = false);

  /// Whether `obj` is exactly a torch.Tensor or a torch.nn.Parameter (no subclass): what a
  /// state_dict() or named_parameters() holds. One pointer comparison each.
  [[nodiscard]] bool is_plain_tensor(py::handle obj) const noexcept {
    // Without torch both are null, and no object's type is.
    const auto* type = reinterpret_cast<const PyObject*>(Py_TYPE(obj.ptr()));
    return type == tensor_type_.ptr() || type == parameter_type_.ptr();
  }

  /// A tensor aliasing `bytes` bytes at `data` (on `dev`): typed and shaped like `meta` when
  /// `whole`, else a flat uint8 tensor of the byte range. torch when importable, numpy otherwise
  /// (CPU memory only). Needs the GIL.
  py::object alias(const tensor_meta& meta, const void* data, std::uint64_t bytes, device dev, bool whole);

  /// The Python dtype object for a refit dtype (torch.bfloat16; a numpy dtype or name without torch).
  py::object python_dtype(dtype t);

  /// The current torch stream of CUDA device `index` as a cudaStream_t value, legacy default
  /// stream included (as cudaStreamLegacy). Needs the GIL.
  void* current_stream(int index);

 private:
  borrowed_tensor borrow_torch(py::handle obj, std::string&& name, bool views);
  borrowed_tensor borrow_dlpack(py::handle obj, std::string&& name, bool views);
  std::optional<dtype> of_torch_dtype(PyObject* type) const noexcept;
  py::object torch_dtype(dtype t);

  py::object torch_;           // the torch module, or None
  py::object tensor_type_;     // torch.Tensor
  py::object parameter_type_;  // torch.nn.Parameter
  py::object from_dlpack_;     // torch.utils.dlpack.from_dlpack
  py::object uint8_;           // torch.uint8
  py::object cuda_;            // torch.cuda
  py::object raw_stream_;      // torch._C._cuda_getCurrentRawStream, where this torch has it
  py::object numpy_;           // numpy, looked up lazily
  /// torch dtype object -> refit dtype: a dozen entries, scanned (faster than hashing here).
  std::vector<std::pair<PyObject*, dtype>> by_torch_dtype_;
  std::unordered_map<int, py::object> torch_by_refit_;
};

}  // namespace refit::python
