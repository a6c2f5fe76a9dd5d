// tilefuse's native launch plans: allocate a kernel's outputs and launch it in one C++ call.
//
// A Plan holds what one static config of a kernel needs per call: the TileLang kernel's TVM-FFI entry
// function, the input's row alignment rule, and each output's (columns, dtype, layout). Calling it with
// (x, t) allocates the outputs through ATen (torch's caching allocator: the tensors are ordinary torch
// tensors, record_stream and CUDA-graph pools included), points the TVM-FFI environment stream at
// torch's current stream of x's device, and calls the kernel with (x, outputs...) as DLTensor pointers.
// The Python path does the same with two torch.empty_strided calls and a TVM-FFI call; here the argument
// parsing of those calls is gone. Built by tilefuse/_native.py with the host compiler, against the
// installed torch and tvm_ffi headers; nothing here depends on CUDA headers (the stream comes through
// c10's device-guard interface).
#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// The DLPack type of a torch dtype, as torch's own DLPack export writes it (the kernels check it).
DLDataType dl_dtype(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return {kDLFloat, 32, 1};
    case at::kBFloat16: return {kDLBfloat, 16, 1};
    case at::kHalf: return {kDLFloat, 16, 1};
    case at::kFloat8_e4m3fn: return {kDLFloat8_e4m3fn, 8, 1};
    case at::kFloat8_e5m2: return {kDLFloat8_e5m2, 8, 1};
    case at::kChar: return {kDLInt, 8, 1};
    case at::kByte: return {kDLUInt, 8, 1};
    case at::kShort: return {kDLInt, 16, 1};
    case at::kInt: return {kDLInt, 32, 1};
    case at::kLong: return {kDLInt, 64, 1};
    case at::kBool: return {kDLBool, 8, 1};
    default: throw std::invalid_argument(std::string("tilefuse native launch: unsupported dtype ") +
                                         c10::toString(s));
  }
}

DLTensor dl_view(const at::Tensor& t) {
  DLTensor d;
  d.data = t.data_ptr();
  d.device = {t.is_cuda() ? kDLCUDA : kDLCPU, t.is_cuda() ? static_cast<int32_t>(t.get_device()) : 0};
  d.ndim = static_cast<int32_t>(t.dim());
  d.dtype = dl_dtype(t.scalar_type());
  d.shape = const_cast<int64_t*>(t.sizes().data());
  d.strides = const_cast<int64_t*>(t.strides().data());
  d.byte_offset = 0;
  return d;
}

// One output: (t, cols) of `dtype`, row-major, or column-major with the column stride rounded up to a
// multiple of 4 rows (the TMA-aligned sf layout of quant.md 1.5).
struct Out {
  int64_t cols;
  at::ScalarType dtype;
  bool col_major;
};

class Plan {
 public:
  Plan(py::object fn, int64_t align_bytes, int64_t row_multiple, std::vector<int64_t> cols,
       std::vector<at::ScalarType> dtypes, std::vector<bool> col_major)
      : fn_(std::move(fn)), align_(align_bytes), vp_(row_multiple) {
    if (cols.size() != dtypes.size() || cols.size() != col_major.size() || cols.empty() || cols.size() > 3)
      throw std::invalid_argument("tilefuse native launch: 1 to 3 outputs, each with cols, dtype, layout");
    for (size_t i = 0; i < cols.size(); ++i) outs_.push_back({cols[i], dtypes[i], col_major[i]});
    handle_ = reinterpret_cast<void*>(fn_.attr("__chandle__")().cast<uintptr_t>());
  }

  // Allocate the outputs for t = x.size(0) rows and, when t > 0, launch fn(x, outputs...) on torch's
  // current stream. Returns the output tensor, or a tuple of them.
  py::object operator()(at::Tensor x, int64_t t) const {
    at::TensorOptions opts = x.options();
    at::Tensor y[3];
    const size_t n = outs_.size();
    for (size_t i = 0; i < n; ++i) {
      const Out& o = outs_[i];
      if (o.col_major) {
        y[i] = at::empty_strided({t, o.cols}, {1, (t + 3) & ~int64_t(3)}, opts.dtype(o.dtype));
      } else {
        y[i] = at::empty({t, o.cols}, opts.dtype(o.dtype));
      }
    }
    if (t > 0) {
      if (reinterpret_cast<uintptr_t>(x.data_ptr()) % align_ || (t > 1 && x.stride(0) % vp_)) {
        // rows the kernel's vector loads cannot take in place: an aligned copy (contiguous() would
        // return a misaligned contiguous x itself)
        x = x.clone(at::MemoryFormat::Contiguous);
      }
      launch(x, y, n);
    }
    if (n == 1) return py::cast(y[0]);
    if (n == 2) return py::make_tuple(y[0], y[1]);
    return py::make_tuple(y[0], y[1], y[2]);
  }

 private:
  void launch(const at::Tensor& x, const at::Tensor* y, size_t n) const {
    DLTensor dl[4];
    TVMFFIAny args[4];
    dl[0] = dl_view(x);
    for (size_t i = 0; i < n; ++i) dl[i + 1] = dl_view(y[i]);
    for (size_t i = 0; i <= n; ++i) {
      args[i].type_index = kTVMFFIDLTensorPtr;
      args[i].zero_padding = 0;
      args[i].v_ptr = &dl[i];
    }
    TVMFFIAny result;
    result.type_index = kTVMFFINone;
    result.zero_padding = 0;
    result.v_int64 = 0;
    TVMFFIStreamHandle prev = nullptr;
    const bool cuda = x.is_cuda();
    const int32_t dev = cuda ? static_cast<int32_t>(x.get_device()) : 0;
    if (cuda) {
      c10::Stream s = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(x.device());
      if (TVMFFIEnvSetStream(kDLCUDA, dev, s.native_handle(), &prev) != 0)
        throw ::tvm::ffi::details::MoveFromSafeCallRaised();
    }
    int rc = TVMFFIFunctionCall(handle_, args, static_cast<int32_t>(n + 1), &result);
    if (cuda) TVMFFIEnvSetStream(kDLCUDA, dev, prev, nullptr);
    if (rc != 0) throw ::tvm::ffi::details::MoveFromSafeCallRaised();
    if (result.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(result.v_obj);
  }

  py::object fn_;  // keeps the TVM-FFI function (and its module) alive
  void* handle_ = nullptr;
  int64_t align_, vp_;
  std::vector<Out> outs_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tilefuse native launch plans (allocation + TileLang kernel launch in one call)";
  py::class_<Plan>(m, "Plan")
      .def(py::init<py::object, int64_t, int64_t, std::vector<int64_t>, std::vector<at::ScalarType>,
                    std::vector<bool>>(),
           py::arg("fn"), py::arg("align_bytes"), py::arg("row_multiple"), py::arg("cols"), py::arg("dtypes"),
           py::arg("col_major"))
      .def("__call__", &Plan::operator(), py::arg("x"), py::arg("t"));
  m.def("dl_dtype_code", [](at::ScalarType s) {
    DLDataType d = dl_dtype(s);
    return py::make_tuple(static_cast<int>(d.code), static_cast<int>(d.bits), static_cast<int>(d.lanes));
  });
}
