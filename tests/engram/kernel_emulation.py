"""Run the CUDA source that TileLang generates for the Engram hash and Sinkhorn kernels on the CPU (not a test module).

The ``__global__`` function is compiled by g++ with a shim that gives the device intrinsics their IEEE meaning, one
rounding each and no contraction (``-ffp-contract=off``): ``__fadd_rn`` / ``__fmul_rn`` / ``__fdiv_rn`` /
``__fsqrt_rn`` are the rounded C operations, ``__fmaf_rn`` is ``std::fmaf``; ``bfloat16_t`` rounds to nearest even;
the 16- and 8-byte vector types are plain structs. A CTA runs either its threads one after another (kernels without
exchange between threads) or as ``threads`` host threads (``threaded=True``) with ``__syncthreads`` a barrier of the
CTA, ``__shfl_xor_sync`` an exchange through per-warp slots at a barrier of the warp, and the dynamic shared memory
one host array. So the CPU computes what the GPU computes, bit for bit, and checks the kernels' indexing, guards,
chunking and reductions without a GPU.
"""
import ctypes
import re
from pathlib import Path

from tests.cuda_emulation import HAS_GXX  # noqa: F401 (re-exported)
from tests.cuda_emulation import CTA_EXCHANGE, PREAMBLE, compile_run, signature, values

SHIM = PREAMBLE + r"""
struct alignas(16) uint4 { uint x, y, z, w; };
struct alignas(8) uint2 { uint x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
alignas(1024) static float g_shared[65536];
""" + CTA_EXCHANGE


def build(src: str, name: str, threads: int, workdir: Path, threaded: bool = False):
    """Compile the ``__global__`` function ``name`` of the generated ``src`` for the CPU; returns
    ``run(args: dict, grid: tuple)``, which binds CPU contiguous tensors and Python numbers by the kernel's parameter
    names and runs the ``(gx, gy)`` grid of CTAs."""
    body = src[src.index('extern "C" __global__ void __launch_bounds__'):]
    body = re.sub(r"extern __shared__ __align__\(\d+\) (\w+) (\w+)\[\];", r"\1* \2 = (\1*)g_shared;", body)
    decl, cargs, call = signature(body, name)
    if threaded:
        cta = f"""std::barrier<> cta({threads}); g_bar = &cta;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    for (unsigned w = 0; w < {threads} / 32; ++w) warps.emplace_back(g_wbar[w] = new std::barrier<>(32));
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
    fn = compile_run(cpp, name, workdir)

    def run(args: dict, grid: tuple) -> None:
        gx, gy = (tuple(grid) + (1,))[:2]
        fn(*values(decl, args), ctypes.c_int64(gx), ctypes.c_int64(gy))

    return run
