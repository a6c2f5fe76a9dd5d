"""Run the CUDA source that TileLang generates for the post kernels on the CPU (not a test module).

The kernel function is compiled by g++ with a small shim: ``bfloat16_t`` with round-to-nearest-even, the 16-byte
vector types, ``__fmaf_rn`` = ``std::fmaf``, ``__fmul_rn`` = one rounded multiply (no contraction:
``-ffp-contract=off``), ``__shfl_xor_sync`` exchanged through the warp's 32 slots between two barriers of the warp,
dynamic shared memory as one host buffer (NaN bytes before each CTA) and ``__syncthreads`` a barrier of the CTA.
The forward runs its CTAs' threads one after another (it has no exchange between threads); the backward runs every
thread of a CTA as a host thread, CTAs one after another. So the CPU computes exactly what the GPU computes, bit for
bit, and checks the kernels' indexing, guards, barriers and reductions without a GPU.
"""
import ctypes
import re
from pathlib import Path

import torch

from tests.cuda_emulation import HAS_GXX  # noqa: F401 (re-exported)
from tests.cuda_emulation import CTA_EXCHANGE, PREAMBLE, compile_run, launch_loop, signature, values

_TYPES = r"""
struct alignas(16) uint4 { uint x, y, z, w; };
struct alignas(8) uint2 { uint x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
"""
# a warp's threads as host threads (``launch_loop``'s modes warps and serial; the other kernels' CPU runs use it too)
SHIM = PREAMBLE + _TYPES + r"""
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
# a CTA's threads as host threads, with its dynamic shared memory (the backward)
CTA_SHIM = PREAMBLE + _TYPES + r"""
static uchar g_smem[4096] __attribute__((aligned(1024)));
""" + CTA_EXCHANGE


def build(src: str, name: str, threads: int, cta_threads: bool, workdir: Path):
    """Compile the ``__global__`` function ``name`` of ``src`` for the CPU, a CTA's threads as host threads
    (``cta_threads``) or one after another; returns ``run(tensors: dict, num_tokens, blocks)``, which binds tensors
    by the kernel's parameter names."""
    assert threads % 32 == 0 and threads <= 1024, threads
    body = src[src.index('extern "C" __global__ void __launch_bounds__'):]
    body = re.sub(r"extern __shared__ [^;]*float (\w+)\[\];", r"float* \1 = (float*)g_smem;", body)
    decl, cargs, call = signature(body, name)
    loop = launch_loop("cta_warps" if cta_threads else "serial", name, call, threads)
    cpp = (CTA_SHIM if cta_threads else SHIM) + body.replace('extern "C" __global__', "static") + f"""
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


def mix_model(a: torch.Tensor, g: torch.Tensor, token_warps: int) -> torch.Tensor:
    """``sum_c a[..., c] g[..., c]`` (fp32 ``[..., C]``, ``C % 8 == 0``) in the backward's order: thread ``k`` of the
    token's ``32 * token_warps`` takes the lanes ``k, k + 32 * token_warps, ...`` and chains their columns in
    increasing order with fma (``fma_chain``'s model), each warp adds its 32 partials by the XOR butterfly (offsets
    16, 8, 4, 2, 1), then the warps' sums are added in warp order."""
    *lead, c = a.shape
    tw = 32 * token_warps
    steps = -(-c // (8 * tw))
    pad = steps * tw * 8 - c  # zero columns: fma(0, 0, acc) leaves acc unchanged
    a, g = (torch.nn.functional.pad(t, (0, pad)).view(*lead, steps, tw, 8) for t in (a, g))
    acc = torch.zeros(*lead, tw)
    for s in range(steps):
        acc = fma_chain(acc, [(a[..., s, :, e], g[..., s, :, e]) for e in range(8)])
    acc = acc.view(*lead, token_warps, 32)
    for off in (16, 8, 4, 2, 1):
        acc = acc + acc[..., torch.arange(32) ^ off]
    total = acc[..., 0, 0]
    for h in range(1, token_warps):
        total = total + acc[..., h, 0]
    return total
