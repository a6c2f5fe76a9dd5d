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
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <cstdint>
#include <optional>
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
    case at::kUInt32: return {kDLUInt, 32, 1};
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

// One output of t rows: `rows` = ceil(t / row_div) by `cols` of `dtype`, in one of three layouts --
//   kRow        contiguous;
//   kColTight   column-major, column stride rounded up to 4 rows, minimal storage (torch.empty_strided);
//   kColStorage a contiguous (cols, align(rows, 4)) storage returned as its transposed view of `rows` rows
//               (the TMA-aligned sf layout of quant.md 1.5; the padding rows exist in memory) --
// and handed to the kernel as one of: kSame (the returned tensor), kStorage (the kColStorage storage),
// kStorageBytes (that int32 storage as (cols, pad, 4) bytes), kWords (a kRow tensor reinterpreted as
// `kdtype`, its last dimension rescaled).
enum Layout : int { kRow = 0, kColTight = 1, kColStorage = 2 };
enum KView : int { kSame = 0, kStorage = 1, kStorageBytes = 2, kWords = 3 };

struct Out {
  int64_t cols;
  at::ScalarType dtype;
  int layout;
  int64_t row_div;
  int kview;
  at::ScalarType kdtype;
};

// The kernel's view of a tensor: a DLTensor with its own shape and strides (up to 3 dims).
struct KernelArg {
  DLTensor dl;
  int64_t shape[3];
  int64_t strides[3];
  void point(const at::Tensor& t) {
    dl = dl_view(t);
    for (int i = 0; i < dl.ndim; ++i) {
      shape[i] = dl.shape[i];
      strides[i] = dl.strides[i];
    }
    dl.shape = shape;
    dl.strides = strides;
  }
  void placeholder(const at::Tensor& t, at::ScalarType d) {  // one element of d at t's start: a parameter the
    point(t);                                                 // kernel's config never reads
    dl.dtype = dl_dtype(d);
    dl.ndim = 1;
    shape[0] = 1;
    strides[0] = 1;
  }
  void words(const at::Tensor& t, at::ScalarType kdtype) {  // row-major t as kdtype elements
    point(t);
    const int64_t num = t.element_size(), den = c10::elementSize(kdtype);
    dl.dtype = dl_dtype(kdtype);
    shape[dl.ndim - 1] = shape[dl.ndim - 1] * num / den;
    for (int i = 0; i < dl.ndim - 1; ++i) strides[i] = strides[i] * num / den;
  }
};

// TVM-FFI arguments of n kernel tensors.
void tensor_args(TVMFFIAny* args, KernelArg* a, int n) {
  for (int i = 0; i < n; ++i) {
    args[i].type_index = kTVMFFIDLTensorPtr;
    args[i].zero_padding = 0;
    args[i].v_ptr = &a[i].dl;
  }
}

// Call the TVM-FFI function `handle` with `args` on torch's current stream of x's device (a CUDA x).
void call(void* handle, TVMFFIAny* args, int32_t nargs, const at::Tensor& x) {
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
  int rc = TVMFFIFunctionCall(handle, args, nargs, &result);
  if (cuda) TVMFFIEnvSetStream(kDLCUDA, dev, prev, nullptr);
  if (rc != 0) throw ::tvm::ffi::details::MoveFromSafeCallRaised();
  if (result.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(result.v_obj);
}

class Plan {
 public:
  // outs: (cols, dtype, layout, row_div, kview, kdtype) per output; x_kdtype: the dtype the kernel reads x
  // as (x's own dtype, or a wider word type whose size divides the row bytes)
  Plan(py::object fn, int64_t align_bytes, int64_t row_multiple, std::vector<py::tuple> outs,
       at::ScalarType x_kdtype)
      : fn_(std::move(fn)), align_(align_bytes), vp_(row_multiple), x_kdtype_(x_kdtype) {
    if (outs.empty() || outs.size() > 3)
      throw std::invalid_argument("tilefuse native launch: 1 to 3 outputs");
    for (const py::tuple& o : outs) {
      if (o.size() != 6) throw std::invalid_argument("tilefuse native launch: an output is "
                                                     "(cols, dtype, layout, row_div, kview, kdtype)");
      Out d{o[0].cast<int64_t>(), o[1].cast<at::ScalarType>(), o[2].cast<int>(), o[3].cast<int64_t>(),
            o[4].cast<int>(), o[5].cast<at::ScalarType>()};
      const bool col = d.layout == kColTight || d.layout == kColStorage;
      if (d.layout < kRow || d.layout > kColStorage || d.row_div < 1 || d.kview < kSame || d.kview > kWords ||
          ((d.kview == kStorage || d.kview == kStorageBytes) && d.layout != kColStorage) ||
          (d.kview == kStorageBytes && d.dtype != at::kInt) || (d.kview == kWords && col))
        throw std::invalid_argument("tilefuse native launch: inconsistent output layout / kernel view");
      outs_.push_back(d);
    }
    handle_ = reinterpret_cast<void*>(fn_.attr("__chandle__")().cast<uintptr_t>());
  }

  // Allocate the outputs for t = x.size(0) rows and, when t > 0, launch fn(x, [extra,] outputs...) on
  // torch's current stream (`extra`: a second input handed over as it is). Returns the output tensor, or a
  // tuple of them.
  py::object operator()(at::Tensor x, int64_t t, std::optional<at::Tensor> extra) const {
    at::TensorOptions opts = x.options();
    at::Tensor y[3], store[3];
    const size_t n = outs_.size();
    for (size_t i = 0; i < n; ++i) {
      const Out& o = outs_[i];
      const int64_t rows = (t + o.row_div - 1) / o.row_div, pad = (rows + 3) & ~int64_t(3);
      if (o.layout == kColTight) {
        y[i] = at::empty_strided({rows, o.cols}, {1, pad}, opts.dtype(o.dtype));
      } else if (o.layout == kColStorage) {
        store[i] = at::empty({o.cols, pad}, opts.dtype(o.dtype));
        y[i] = store[i].as_strided({rows, o.cols}, {1, pad});
      } else {
        y[i] = at::empty({rows, o.cols}, opts.dtype(o.dtype));
      }
    }
    if (t > 0) {
      if (reinterpret_cast<uintptr_t>(x.data_ptr()) % align_ || (t > 1 && x.stride(0) % vp_)) {
        // rows the kernel's vector loads cannot take in place: an aligned copy (contiguous() would
        // return a misaligned contiguous x itself)
        x = x.clone(at::MemoryFormat::Contiguous);
      }
      KernelArg args[5];
      if (x_kdtype_ == x.scalar_type()) {
        args[0].point(x);
      } else {
        args[0].words(x, x_kdtype_);
      }
      const size_t first = extra.has_value() ? 2 : 1;
      if (extra.has_value()) args[1].point(*extra);
      for (size_t i = 0; i < n; ++i) {
        const Out& o = outs_[i];
        KernelArg& a = args[i + first];
        if (o.kview == kStorage) {
          a.point(store[i]);
        } else if (o.kview == kStorageBytes) {  // int32 (cols, pad) storage as (cols, pad, 4) bytes
          a.point(store[i]);
          a.dl.dtype = dl_dtype(at::kByte);
          a.dl.ndim = 3;
          a.shape[2] = 4;
          a.strides[2] = 1;
          a.strides[1] = 4;
          a.strides[0] = a.shape[1] * 4;
        } else if (o.kview == kWords) {
          a.words(y[i], o.kdtype);
        } else {
          a.point(y[i]);
        }
      }
      launch(args, n + first, x);
    }
    if (n == 1) return py::cast(y[0]);
    if (n == 2) return py::make_tuple(y[0], y[1]);
    return py::make_tuple(y[0], y[1], y[2]);
  }

 private:
  void launch(KernelArg* a, size_t nargs, const at::Tensor& x) const {
    TVMFFIAny args[5];
    tensor_args(args, a, static_cast<int>(nargs));
    call(handle_, args, static_cast<int32_t>(nargs), x);
  }

  py::object fn_;  // keeps the TVM-FFI function (and its module) alive
  void* handle_ = nullptr;
  int64_t align_, vp_;
  at::ScalarType x_kdtype_;
  std::vector<Out> outs_;
};

// The RMSNorm forward kernel (quant.md 5.11) of one static config without residual, bf16 copy or mega-MoE sf:
// its parameters are (X, W, Res, ResOut, Out, SF, Bf, Rstd, Mega, eps, out_scale), x and out as (1, T, H) row
// views (the strides of size-1 dimensions 0, as the Python launcher passes them). Calling it with (x, weight,
// eps, out_scale) allocates out (T, H), the sf of the quantizing configs (row-major, or column-major with
// leading dimension align(T, 4) and minimal storage) and rstd (T,) when asked, and launches on torch's current
// stream. x and the weight are copied where their start is not 16-byte aligned (the kernel's vector loads);
// a row stride is taken as it is (the public op checked it). The parameters the config does not read get a
// one-element view of out's storage of their dtype (what the kernel's argument checks ask of them).
class NormPlan {
 public:
  // sf_kind: -1 none, 0 row fp32, 1 row packed int32, 2 col fp32, 3 col packed int32
  NormPlan(py::object fn, int64_t hidden, at::ScalarType x_dtype, at::ScalarType out_dtype, int sf_kind,
           bool has_weight, bool with_rstd)
      : fn_(std::move(fn)), h_(hidden), x_dtype_(x_dtype), out_dtype_(out_dtype), sf_kind_(sf_kind),
        has_w_(has_weight), rstd_(with_rstd) {
    if (sf_kind < -1 || sf_kind > 3 || hidden < 16 || hidden % 16 || (sf_kind >= 0 && hidden % 32))
      throw std::invalid_argument("tilefuse native launch: bad RMSNorm plan");
    handle_ = reinterpret_cast<void*>(fn_.attr("__chandle__")().cast<uintptr_t>());
    const int64_t groups = hidden / 32;
    sf_cols_ = (sf_kind == 1 || sf_kind == 3) ? (groups + 3) / 4 : groups;
  }

  // (out, sf or None, rstd or None)
  py::tuple operator()(at::Tensor x, std::optional<at::Tensor> w, double eps, double out_scale) const {
    const int64_t t = x.size(0);
    at::TensorOptions opts = x.options();
    at::Tensor out = at::empty({t, h_}, opts.dtype(out_dtype_)), sf, rstd;
    const int64_t pad = (t + 3) & ~int64_t(3);
    const bool packed = sf_kind_ == 1 || sf_kind_ == 3, col = sf_kind_ >= 2;
    if (sf_kind_ >= 0) {
      const at::ScalarType d = packed ? at::kInt : at::kFloat;
      sf = col ? at::empty_strided({t, sf_cols_}, {1, pad}, opts.dtype(d)) : at::empty({t, sf_cols_}, opts.dtype(d));
    }
    if (rstd_) rstd = at::empty({t}, opts.dtype(at::kFloat));
    if (t > 0) {
      if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16) x = x.clone(at::MemoryFormat::Contiguous);
      at::Tensor wt;
      if (has_w_) {
        wt = w.value();   // (throws, not UB, on a missing weight)
        if (reinterpret_cast<uintptr_t>(wt.data_ptr()) % 16) wt = wt.clone(at::MemoryFormat::Contiguous);
      }
      KernelArg a[9];
      auto rows = [&](KernelArg& k, const at::Tensor& v, int64_t row_stride) {  // (1, t, H) row view
        k.point(v);
        k.dl.ndim = 3;
        k.shape[0] = 1, k.shape[1] = t, k.shape[2] = h_;
        k.strides[0] = 0, k.strides[1] = t > 1 ? row_stride : 0, k.strides[2] = 1;
      };
      auto dummy = [&](KernelArg& k, at::ScalarType d) { k.placeholder(out, d); };
      rows(a[0], x, x.stride(0));
      if (has_w_) a[1].point(wt); else dummy(a[1], x_dtype_);
      dummy(a[2], x_dtype_);
      dummy(a[3], x_dtype_);
      rows(a[4], out, h_);
      if (sf_kind_ >= 0) {  // (1, t, cols): row-major, or per batch column-major with leading dimension pad
        a[5].point(sf);
        a[5].dl.ndim = 3;
        a[5].shape[0] = 1, a[5].shape[1] = t, a[5].shape[2] = sf_cols_;
        if (col) a[5].strides[0] = sf_cols_ * pad, a[5].strides[1] = 1, a[5].strides[2] = pad;
        else a[5].strides[0] = t * sf_cols_, a[5].strides[1] = sf_cols_, a[5].strides[2] = 1;
      } else {
        dummy(a[5], at::kFloat);
      }
      dummy(a[6], at::kBFloat16);
      if (rstd_) {
        a[7].point(rstd);
        a[7].dl.ndim = 2;
        a[7].shape[0] = 1, a[7].shape[1] = t;
        a[7].strides[0] = t, a[7].strides[1] = 1;
      } else {
        dummy(a[7], at::kFloat);
      }
      dummy(a[8], at::kInt);
      TVMFFIAny args[11];
      tensor_args(args, a, 9);
      for (int i = 9; i < 11; ++i) {
        args[i].type_index = kTVMFFIFloat;
        args[i].zero_padding = 0;
        args[i].v_float64 = i == 9 ? eps : out_scale;
      }
      call(handle_, args, 11, x);
    }
    return py::make_tuple(out, sf_kind_ >= 0 ? py::cast(sf) : py::none(), rstd_ ? py::cast(rstd) : py::none());
  }

 private:
  py::object fn_;
  void* handle_ = nullptr;
  int64_t h_, sf_cols_ = 0;
  at::ScalarType x_dtype_, out_dtype_;
  int sf_kind_;
  bool has_w_, rstd_;
};

// The RMSNorm backward (quant.md 5.11) of one static config without residual_out_grad or a given weight_grad:
// the dx kernel (DY, X, W, Rstd, RG, DX, Part, out_scale) with out_grad and x as (T, H) row views (the row stride 0
// at one row, as the Python launcher passes them), then, with a weight, the weight-gradient reduce (Part, WG) in
// its assigning config (WG_ASSIGN: weight_grad allocated uninitialized). Calling it with (out_grad, x, weight,
// rstd, out_scale) allocates x_grad, the (NP, H) fp32 partials and weight_grad and launches both kernels on
// torch's current stream; inputs whose start is not 16-byte aligned are copied. At T = 0 nothing launches and
// weight_grad is zeros.
class NormBackwardPlan {
 public:
  NormBackwardPlan(py::object fn, py::object reduce, int64_t hidden, int64_t partials)
      : fn_(std::move(fn)), reduce_(std::move(reduce)), h_(hidden), np_(partials) {
    if (hidden < 16 || hidden % 16 || partials < 1)
      throw std::invalid_argument("tilefuse native launch: bad RMSNorm backward plan");
    handle_ = reinterpret_cast<void*>(fn_.attr("__chandle__")().cast<uintptr_t>());
    if (!reduce_.is_none()) red_ = reinterpret_cast<void*>(reduce_.attr("__chandle__")().cast<uintptr_t>());
  }

  // (x_grad, weight_grad or None)
  py::tuple operator()(at::Tensor dy, at::Tensor x, std::optional<at::Tensor> w, at::Tensor rstd,
                       double out_scale) const {
    const int64_t t = x.size(0);
    const bool has_w = red_ != nullptr;
    at::Tensor dx = at::empty({t, h_}, x.options()), wg, part;
    if (has_w) wg = t > 0 ? at::empty({h_}, w.value().options()) : at::zeros({h_}, w.value().options());
    if (t > 0) {
      auto aligned = [](at::Tensor v) {
        return reinterpret_cast<uintptr_t>(v.data_ptr()) % 16 ? v.clone(at::MemoryFormat::Contiguous) : v;
      };
      dy = aligned(dy);
      x = aligned(x);
      at::Tensor wt = has_w ? aligned(w.value()) : at::Tensor();
      if (has_w) part = at::empty({np_, h_}, x.options().dtype(at::kFloat));
      KernelArg a[7];
      auto rows = [&](KernelArg& k, const at::Tensor& v) {  // (t, H), row stride 0 at one row
        k.point(v);
        k.strides[0] = t > 1 ? v.stride(0) : 0;
        k.strides[1] = 1;
      };
      auto dummy = [&](KernelArg& k, at::ScalarType d) { k.placeholder(dx, d); };
      rows(a[0], dy);
      rows(a[1], x);
      if (has_w) a[2].point(wt); else dummy(a[2], x.scalar_type());
      a[3].point(rstd);
      dummy(a[4], x.scalar_type());
      a[5].point(dx);
      if (has_w) a[6].point(part); else dummy(a[6], at::kFloat);
      TVMFFIAny args[8];
      tensor_args(args, a, 7);
      args[7].type_index = kTVMFFIFloat;
      args[7].zero_padding = 0;
      args[7].v_float64 = out_scale;
      call(handle_, args, 8, x);
      if (has_w) {
        KernelArg r[2];
        r[0].point(part);
        r[1].point(wg);
        TVMFFIAny rargs[2];
        tensor_args(rargs, r, 2);
        call(red_, rargs, 2, x);
      }
    }
    return py::make_tuple(dx, has_w ? py::cast(wg) : py::none());
  }

 private:
  py::object fn_, reduce_;
  void* handle_ = nullptr;
  void* red_ = nullptr;
  int64_t h_, np_;
};

// A kernel of many parameters for one call pattern (the one-token MoE gates): each parameter is an input of
// the call (x, or the optional second input x2), a tensor the plan holds (the stand-in of an absent optional
// input), an output the call allocates ((t, cols) row-major), or a scalar the plan holds. Calling it with
// (x, x2, t) allocates the outputs and, when t > 0, launches on torch's current stream; x is copied where its
// start is not `align_bytes` aligned (the kernel's vector loads), x2 is handed over as it is.
class ArgPlan {
 public:
  enum Kind : int { kInput = 0, kHeld = 1, kOutput = 2, kFloat = 3, kInt = 4 };
  static constexpr size_t kMaxArgs = 32;

  // slots: (kind, index) per kernel parameter -- the input (0: x, 1: x2), the held tensor, the output, the
  // float, or (kInt) the integer value itself
  ArgPlan(py::object fn, std::vector<std::pair<int, int64_t>> slots, std::vector<at::Tensor> held,
          std::vector<std::pair<int64_t, at::ScalarType>> outs, std::vector<double> floats, int64_t align_bytes)
      : fn_(std::move(fn)), slots_(std::move(slots)), held_(std::move(held)), outs_(std::move(outs)),
        floats_(std::move(floats)), align_(align_bytes) {
    if (slots_.size() > kMaxArgs || outs_.empty() || outs_.size() > 3)
      throw std::invalid_argument("tilefuse native launch: at most 32 parameters and 1 to 3 outputs");
    for (const auto& s : slots_) {
      const int64_t n = s.first == kInput ? 2 : s.first == kHeld ? static_cast<int64_t>(held_.size())
                        : s.first == kOutput ? static_cast<int64_t>(outs_.size())
                        : s.first == kFloat ? static_cast<int64_t>(floats_.size()) : -1;
      if (s.first < kInput || s.first > kInt || (s.first != kInt && (s.second < 0 || s.second >= n)))
        throw std::invalid_argument("tilefuse native launch: a parameter slot names nothing");
    }
    handle_ = reinterpret_cast<void*>(fn_.attr("__chandle__")().cast<uintptr_t>());
  }

  py::object operator()(at::Tensor x, std::optional<at::Tensor> x2, int64_t t) const {
    at::TensorOptions opts = x.options();
    at::Tensor y[3];
    const size_t n = outs_.size();
    for (size_t i = 0; i < n; ++i) y[i] = at::empty({t, outs_[i].first}, opts.dtype(outs_[i].second));
    if (t > 0) {
      if (reinterpret_cast<uintptr_t>(x.data_ptr()) % align_) x = x.clone(at::MemoryFormat::Contiguous);
      KernelArg a[kMaxArgs];
      TVMFFIAny args[kMaxArgs];
      for (size_t i = 0; i < slots_.size(); ++i) {
        const int kind = slots_[i].first;
        const int64_t j = slots_[i].second;
        args[i].zero_padding = 0;
        if (kind == kFloat) {
          args[i].type_index = kTVMFFIFloat;
          args[i].v_float64 = floats_[j];
        } else if (kind == kInt) {
          args[i].type_index = kTVMFFIInt;
          args[i].v_int64 = j;
        } else {
          if (kind == kInput && j == 1 && !x2.has_value())
            throw std::invalid_argument("tilefuse native launch: the plan's second input is missing");
          a[i].point(kind == kInput ? (j == 0 ? x : *x2) : kind == kHeld ? held_[j] : y[j]);
          args[i].type_index = kTVMFFIDLTensorPtr;
          args[i].v_ptr = &a[i].dl;
        }
      }
      call(handle_, args, static_cast<int32_t>(slots_.size()), x);
    }
    if (n == 1) return py::cast(y[0]);
    if (n == 2) return py::make_tuple(y[0], y[1]);
    return py::make_tuple(y[0], y[1], y[2]);
  }

 private:
  py::object fn_;  // keeps the TVM-FFI function (and its module) alive
  void* handle_ = nullptr;
  std::vector<std::pair<int, int64_t>> slots_;
  std::vector<at::Tensor> held_;
  std::vector<std::pair<int64_t, at::ScalarType>> outs_;
  std::vector<double> floats_;
  int64_t align_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tilefuse native launch plans (allocation + TileLang kernel launch in one call)";
  py::class_<Plan>(m, "Plan")
      .def(py::init<py::object, int64_t, int64_t, std::vector<py::tuple>, at::ScalarType>(), py::arg("fn"),
           py::arg("align_bytes"), py::arg("row_multiple"), py::arg("outs"), py::arg("x_kdtype"))
      .def("__call__", &Plan::operator(), py::arg("x"), py::arg("t"), py::arg("extra") = py::none());
  py::class_<NormPlan>(m, "NormPlan")
      .def(py::init<py::object, int64_t, at::ScalarType, at::ScalarType, int, bool, bool>(), py::arg("fn"),
           py::arg("hidden"), py::arg("x_dtype"), py::arg("out_dtype"), py::arg("sf_kind"), py::arg("has_weight"),
           py::arg("with_rstd"))
      .def("__call__", &NormPlan::operator(), py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("out_scale"));
  py::class_<NormBackwardPlan>(m, "NormBackwardPlan")
      .def(py::init<py::object, py::object, int64_t, int64_t>(), py::arg("fn"), py::arg("reduce"), py::arg("hidden"),
           py::arg("partials"))
      .def("__call__", &NormBackwardPlan::operator(), py::arg("out_grad"), py::arg("x"), py::arg("weight"),
           py::arg("rstd"), py::arg("out_scale"));
  py::class_<ArgPlan>(m, "ArgPlan")
      .def(py::init<py::object, std::vector<std::pair<int, int64_t>>, std::vector<at::Tensor>,
                    std::vector<std::pair<int64_t, at::ScalarType>>, std::vector<double>, int64_t>(),
           py::arg("fn"), py::arg("slots"), py::arg("held"), py::arg("outs"), py::arg("floats"),
           py::arg("align_bytes"))
      .def("__call__", &ArgPlan::operator(), py::arg("x"), py::arg("x2"), py::arg("t"));
  m.def("dl_dtype_code", [](at::ScalarType s) {
    DLDataType d = dl_dtype(s);
    return py::make_tuple(static_cast<int>(d.code), static_cast<int>(d.bits), static_cast<int>(d.lanes));
  });
}
