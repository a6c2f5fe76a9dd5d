"""Run the CUDA source that TileLang generates for the post kernels on the CPU (not a test module).

The kernel function is compiled by g++ with a small shim: ``bfloat16_t`` with round-to-nearest-even, the 16-byte
vector types, ``__fmaf_rn`` = ``std::fmaf``, ``__fmul_rn`` = one rounded multiply (no contraction:
``-ffp-contract=off``), and ``__shfl_xor_sync`` exchanged through a 32-slot array between the 32 host threads of a
warp at a barrier. The forward runs its CTAs' threads one after another (it has no exchange between threads); the
backward runs each warp as 32 host threads. So the CPU computes exactly what the GPU computes, bit for bit, and
checks the kernels' indexing, guards and reductions without a GPU.
"""
import ctypes
from pathlib import Path

import torch

from tests.cuda_emulation import HAS_GXX, PREAMBLE, compile_run, launch_loop, signature, values  # noqa: F401 (re-exported)

SHIM = PREAMBLE + r"""
struct alignas(16) uint4 { uint x, y, z, w; };
struct alignas(8) uint2 { uint x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
static float g_slots[32];
static std::barrier<>* g_bar;
static inline float __shfl_xor_sync(uint, float v, int delta, int) {
  int lane = threadIdx.x % 32;
  g_slots[lane] = v;
  g_bar->arrive_and_wait();
  float r = g_slots[lane ^ delta];
  g_bar->arrive_and_wait();
  return r;
}
"""


def build(src: str, name: str, threads: int, warp_threads: bool, workdir: Path):
    """Compile the ``__global__`` function ``name`` of ``src`` for the CPU; returns ``run(tensors: dict, num_tokens,
    blocks)``, which binds tensors by the kernel's parameter names."""
    body = src[src.index('extern "C" __global__ void __launch_bounds__'):]
    decl, cargs, call = signature(body, name)
    loop = launch_loop("warps" if warp_threads else "serial", name, call, threads)
    cpp = SHIM + body.replace('extern "C" __global__', "static") + f"""
extern "C" void run({cargs}, int64_t blocks) {{
  {loop}
}}
"""
    fn = compile_run(cpp, name, workdir)

    def run(tensors: dict, num_tokens: int, blocks: int) -> None:
        fn(*values(decl, {**tensors, "num_tokens": num_tokens}), ctypes.c_int64(blocks))

    return run


def fma_chain(first: torch.Tensor, terms) -> torch.Tensor:
    """``fma(a_k, b_k, ... fma(a_1, b_1, first))`` in fp32: the product of two fp32 values is exact in float64 and
    the float64 sum is rounded to fp32. That equals the fma's single rounding except where the float64 rounding
    lands exactly on an fp32 halfway point (a chance of about 2^-29 per operation on random data); a test that
    compares this model bitwise uses fixed seeded data."""
    acc = first
    for a, b in terms:
        acc = (a.double() * b.double() + acc.double()).float()
    return acc
