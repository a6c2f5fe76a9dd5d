"""Run the CUDA source that TileLang generates for the Engram hash and Sinkhorn kernels on the CPU (not a test module).

The ``__global__`` function is compiled by g++ with a shim that gives the device intrinsics their IEEE meaning, one
rounding each and no contraction (``-ffp-contract=off``): ``__fadd_rn`` / ``__fmul_rn`` / ``__fdiv_rn`` /
``__fsqrt_rn`` are the rounded C operations, ``__fmaf_rn`` is ``std::fmaf``; ``bfloat16_t`` rounds to nearest even;
the 16-byte vector types are plain structs. A CTA runs either its threads one after another (kernels without
exchange between threads) or as ``threads`` host threads (``threaded=True``) with ``__syncthreads`` a barrier of the
CTA, ``__shfl_xor_sync`` an exchange through per-warp slots at a barrier of the warp, and the dynamic shared memory
one host array. So the CPU computes what the GPU computes, bit for bit, and checks the kernels' indexing, guards,
chunking and reductions without a GPU.
"""
import ctypes
import re
import shutil
import subprocess
from pathlib import Path

HAS_GXX = shutil.which("g++") is not None

SHIM = r"""
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
struct alignas(16) uint4 { uint x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
struct Idx { unsigned x, y, z; };
thread_local Idx threadIdx, blockIdx;
#define __launch_bounds__(a, b)
#define __restrict__
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static inline float __fsqrt_rn(float a) { volatile float r = std::sqrt(a); return r; }
static inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
static std::barrier<>* g_cta;
static std::barrier<>* g_warp[32];
static float g_slots[32][32];
alignas(1024) static float g_shared[65536];
#define __syncthreads() g_cta->arrive_and_wait()
static inline float __shfl_xor_sync(uint, float v, int delta, int) {
  unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
  g_slots[w][l] = v;
  g_warp[w]->arrive_and_wait();
  float r = g_slots[w][l ^ delta];
  g_warp[w]->arrive_and_wait();
  return r;
}
"""

_SCALARS = {"int64_t": ctypes.c_int64, "float": ctypes.c_float, "int": ctypes.c_int32}


def build(src: str, name: str, threads: int, workdir: Path, threaded: bool = False):
    """Compile the ``__global__`` function ``name`` of the generated ``src`` for the CPU; returns
    ``run(args: dict, grid: tuple)``, which binds CPU contiguous tensors and Python numbers by the kernel's parameter
    names and runs the ``(gx, gy)`` grid of CTAs."""
    body = src[src.index('extern "C" __global__ void __launch_bounds__'):]
    body = re.sub(r"extern __shared__ __align__\(\d+\) (\w+) (\w+)\[\];", r"\1* \2 = (\1*)g_shared;", body)
    params = [p.replace("__restrict__", "").replace("const ", "").strip()
              for p in re.search(re.escape(name) + r"\(([^)]*)\)", body).group(1).split(",")]
    decl = [(p.rsplit(" ", 1)[0].strip(), p.rsplit(" ", 1)[1]) for p in params]
    cargs = ", ".join(f"void* {a}" if t.endswith("*") else f"{t} {a}" for t, a in decl)
    call = ", ".join(f"({t}){a}" if t.endswith("*") else a for t, a in decl)
    if threaded:
        cta = f"""std::barrier<> cta({threads}); g_cta = &cta;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    for (unsigned w = 0; w < {threads} / 32; ++w) {{
      warps.emplace_back(new std::barrier<>(32));
      g_warp[w] = warps.back().get();
    }}
    std::vector<std::thread> th;
    for (unsigned t = 0; t < {threads}; ++t)
      th.emplace_back([=]() {{ blockIdx.x = bx; blockIdx.y = by; threadIdx.x = t; {name}({call}); }});
    for (auto& t : th) t.join();"""
    else:
        cta = f"""for (unsigned t = 0; t < {threads}; ++t) {{
      blockIdx.x = bx; blockIdx.y = by; threadIdx.x = t; {name}({call});
    }}"""
    cpp = SHIM + body.replace('extern "C" __global__', "static") + f"""
extern "C" void run({cargs}, int64_t gx, int64_t gy) {{
  for (int64_t by = 0; by < gy; ++by) for (int64_t bx = 0; bx < gx; ++bx) {{
    {cta}
  }}
}}
"""
    workdir.mkdir(parents=True, exist_ok=True)
    source, lib = workdir / f"{name}.cpp", workdir / f"{name}.so"
    source.write_text(cpp)
    subprocess.run(["g++", "-std=c++20", "-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-shared", "-fPIC",
                    "-pthread", "-o", str(lib), str(source)], check=True, capture_output=True)
    fn = ctypes.CDLL(str(lib)).run

    def run(args: dict, grid: tuple) -> None:
        values = []
        for t, a in decl:
            v = args[a]
            if t.endswith("*"):
                assert v.device.type == "cpu" and v.is_contiguous(), a
                values.append(ctypes.c_void_p(v.data_ptr()))
            else:
                values.append(_SCALARS[t](v))
        gx, gy = (tuple(grid) + (1,))[:2]
        fn(*values, ctypes.c_int64(gx), ctypes.c_int64(gy))

    return run
