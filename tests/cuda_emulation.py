"""Shared pieces of the CPU runs of TileLang's generated CUDA (not a test module): the C++ preamble every
family's shim starts with, the g++ build, and the binding of a kernel's parameters.

The preamble gives ``bfloat16_t`` rounding to nearest even, the thread and block indices as thread-locals, the
launch and alias qualifiers as nothing, and the rounded fp32 intrinsics their IEEE meaning, one rounding each
(``std::fmaf``; ``volatile`` keeps g++ from fusing, with ``-ffp-contract=off`` besides). Each family's module adds
its vector types, shared memory and thread exchange (``__syncthreads``, ``__shfl_xor_sync``) to it.
"""
import ctypes
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

HAS_GXX = shutil.which("g++") is not None

PREAMBLE = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
using std::max;
using std::min;
typedef unsigned int uint;
typedef unsigned char uchar;
struct bfloat16_t {
  uint16_t s;
  bfloat16_t() = default;
  explicit bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (std::isnan(f)) { s = 0x7fc0; return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    s = (uint16_t)(u >> 16);
  }
  explicit operator float() const { uint32_t u = (uint32_t)s << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
struct Idx { unsigned x, y, z; };
thread_local Idx threadIdx, blockIdx;
#define __launch_bounds__(a, b)
#define __restrict__
#define __align__(n)
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static inline float __fsqrt_rn(float a) { volatile float r = std::sqrt(a); return r; }
static inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
"""

SCALARS = {"int64_t": ctypes.c_int64, "float": ctypes.c_float, "int": ctypes.c_int32}


def compile_run(cpp: str, name: str, workdir: Path):
    """Compile ``cpp`` (device code made host C++, with an ``extern "C" run``) with g++, no contraction of
    multiply-adds, into ``workdir``; return its ``run`` (ctypes)."""
    workdir.mkdir(parents=True, exist_ok=True)
    source, lib = workdir / f"{name}.cpp", workdir / f"{name}.so"
    source.write_text(cpp)
    subprocess.run(["g++", "-std=c++20", "-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-w", "-shared", "-fPIC",
                    "-pthread", "-o", str(lib), str(source)], check=True, capture_output=True)
    return ctypes.CDLL(str(lib)).run


def signature(body: str, name: str):
    """The parameters of the kernel ``name`` in ``body``: ``(decl, cargs, call)``: ``[(C type, name)]``, the host
    entry's parameter list (pointers as ``void*``) and the call's arguments (pointers cast back)."""
    params = [p.replace("__restrict__", "").replace("const ", "").strip()
              for p in re.search(re.escape(name) + r"\(([^)]*)\)", body).group(1).split(",")]
    decl = [(p.rsplit(" ", 1)[0].strip(), p.rsplit(" ", 1)[1]) for p in params]
    cargs = ", ".join(f"void* {a}" if t.endswith("*") else f"{t} {a}" for t, a in decl)
    call = ", ".join(f"({t}){a}" if t.endswith("*") else a for t, a in decl)
    return decl, cargs, call


def values(decl, args: dict, contiguous: bool = True) -> list:
    """ctypes values of ``args`` (CPU tensors and Python numbers) in the order of ``decl``."""
    out = []
    for t, a in decl:
        v = args[a]
        if t.endswith("*"):
            assert v.device.type == "cpu" and (v.is_contiguous() or not contiguous), a
            out.append(ctypes.c_void_p(v.data_ptr()))
        else:
            out.append(SCALARS[t](v))
    return out


# A CTA's threads as host threads (``launch_loop``'s mode ``cta_warps``): ``__syncthreads`` a barrier of the CTA,
# ``__shfl_xor_sync`` exchanged through the warp's 32 slots between two barriers of the warp.
CTA_EXCHANGE = r"""
static std::barrier<>* g_bar;
static std::barrier<>* g_wbar[32];
static float g_slots[32][32];
static inline void __syncthreads() { g_bar->arrive_and_wait(); }
static inline float __shfl_xor_sync(uint, float v, int delta, int) {
  unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
  g_slots[w][lane] = v;
  g_wbar[w]->arrive_and_wait();
  float r = g_slots[w][lane ^ delta];
  g_wbar[w]->arrive_and_wait();
  return r;
}
"""


# TileLang's cp.async (``tl::cp_async_gs``, ``tl::cp_async_gs_conditional``, commit, wait) as the PTX states it, per
# emulated thread (a host thread): a copy's destination holds nothing defined until a wait covers its commit group
# (NaN bytes from the issue on; the data, or zeros for a conditional copy whose condition is false, when the wait
# lands it); ``wait<N>`` completes all but the N newest groups. A read that comes before its wait sees NaN.
CP_ASYNC = r"""
namespace tl {
struct AsyncCopy { void* dst; const void* src; int n; bool zero; };
static thread_local std::vector<std::vector<AsyncCopy>> g_async_groups;  // committed, oldest first
static thread_local std::vector<AsyncCopy> g_async_open;                 // issued since the last commit
static inline void cp_async_issue(void* dst, const void* src, int n, bool zero) {
  std::memset(dst, 0xFF, n);
  g_async_open.push_back(AsyncCopy{dst, src, n, zero});
}
template <int N> static inline void cp_async_gs(const void* dst, const void* src) {
  cp_async_issue(const_cast<void*>(dst), src, N, false);
}
template <int N> static inline void cp_async_gs_conditional(const void* dst, const void* src, bool cond) {
  cp_async_issue(const_cast<void*>(dst), src, N, !cond);
}
static inline void cp_async_commit() { g_async_groups.push_back(std::move(g_async_open)); g_async_open.clear(); }
template <int N> static inline void cp_async_wait() {
  while (g_async_groups.size() > (size_t)N) {
    for (const AsyncCopy& c : g_async_groups.front()) {
      if (c.zero) std::memset(c.dst, 0, c.n); else std::memcpy(c.dst, c.src, c.n);
    }
    g_async_groups.erase(g_async_groups.begin());
  }
}
}  // namespace tl
"""


def launch_loop(mode: str, name: str, call: str, threads: int) -> str:
    """The C++ loop that runs a grid of ``blocks`` CTAs of ``threads`` threads on the host. ``mode``: ``"warps"``,
    each warp's 32 threads as host threads (shuffles through ``g_bar``); ``"cta"``, a CTA's threads as host threads
    (``__syncthreads`` through ``g_bar``); ``"cta_warps"``, the same with a barrier a warp too (``g_wbar[w]``: the
    caller's shuffles) and the caller's shared memory ``g_smem`` filled with 0xFF before each CTA; ``"serial"``, a
    CTA's threads one after another."""
    if mode == "cta_warps":
        return f"""std::barrier<> bar({threads}); g_bar = &bar;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  for (unsigned w = 0; w < {threads // 32}; ++w) warps.emplace_back(g_wbar[w] = new std::barrier<>(32));
  for (int64_t b = 0; b < blocks; ++b) {{
    std::memset(g_smem, 0xFF, sizeof(g_smem));
    std::vector<std::thread> th;
    for (unsigned t = 0; t < {threads}; ++t)
      th.emplace_back([=]() {{ blockIdx.x = (unsigned)b; threadIdx.x = t; {name}({call}); }});
    for (auto& t : th) t.join();
  }}"""
    if mode == "cta":
        return f"""for (int64_t b = 0; b < blocks; ++b) {{
    std::barrier<> bar({threads}); g_bar = &bar;
    std::vector<std::thread> th;
    for (unsigned l = 0; l < {threads}; ++l)
      th.emplace_back([=]() {{ blockIdx.x = b; threadIdx.x = l; {name}({call}); }});
    for (auto& t : th) t.join();
  }}"""
    if mode == "warps":
        return f"""std::barrier<> bar(32); g_bar = &bar;
  for (int64_t b = 0; b < blocks; ++b) for (unsigned w = 0; w < {threads // 32}; ++w) {{
    std::vector<std::thread> th;
    for (unsigned l = 0; l < 32; ++l)
      th.emplace_back([=]() {{ blockIdx.x = b; threadIdx.x = w * 32 + l; {name}({call}); }});
    for (auto& t : th) t.join();
  }}"""
    assert mode == "serial", mode
    return f"""for (int64_t b = 0; b < blocks; ++b) for (unsigned t = 0; t < {threads}; ++t) {{
    blockIdx.x = b; threadIdx.x = t; {name}({call});
  }}"""


def build_kernel(prefix: str, body: str, name: str, threads: int, mode: str, workdir: Path):
    """``run(blocks, **args)``: the ``__global__`` function ``name`` of ``body`` (from its declaration on) after the
    C++ ``prefix`` (a family's shim), compiled for the CPU and launched by ``launch_loop(mode)``; arguments by the
    kernel's parameter names (pointers: contiguous CPU tensors)."""
    decl, cargs, call = signature(body, name)
    cpp = prefix + body.replace('extern "C" __global__', "static") + f"""
extern "C" void run({cargs}, int64_t blocks) {{
  {launch_loop(mode, name, call, threads)}
}}
"""
    fn = compile_run(cpp, f"{name}_{hashlib.sha256(cpp.encode()).hexdigest()[:12]}", workdir)
    names = {a for _, a in decl}

    def run(blocks, **args):
        assert set(args) == names, (sorted(args), sorted(names))
        fn(*values(decl, args), ctypes.c_int64(blocks))

    return run
