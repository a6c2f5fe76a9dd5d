"""Test helpers of the gate forward kernels (not a test module): the kernel's arithmetic as a PyTorch model, and the
CUDA source TileLang generates, run on the CPU.

``model``: the order of engram.md §2.4.2 written with PyTorch ops on any device: 32 interleaved fp32 partials per
row (lane ``l`` covers columns ``256 c + 8 l + i``, visited in increasing ``c`` then ``i``, each step a correctly
rounded fma), the XOR butterfly 16, 8, 4, 2, 1, then the scalar chain, each operation correctly rounded (``_rn``).
So ``dot``, ``rstd_x``, ``rstd_k`` and ``u`` are the kernel's bits on any device; ``g`` goes through the device's
``exp``, which may differ from the kernel's ``expf`` in the last bits.

``build``: the kernel function compiled by g++ with a shim (``bfloat16_t`` rounding to nearest even, 16-byte vector
types without alignment, the ``__f*_rn`` intrinsics as single rounded host operations with contraction off,
``__syncthreads`` a barrier of the CTA's host threads, ``__shfl_xor_sync`` exchanged through a 32-slot array at a
barrier of the warp's host threads, the dynamic shared memory, of any element type, one host buffer). Each CTA runs
as one host thread per CUDA thread. The host ``expf`` stands in for CUDA's, so ``g`` may differ from the GPU's in
the last bits; everything else is the GPU's arithmetic bit for bit, which checks the indexing, the guards, the
shared-memory layout and the reduction without a GPU.
"""
import ctypes
import re
from pathlib import Path

import torch

from tests.cuda_emulation import HAS_GXX, PREAMBLE, compile_run, signature, values  # noqa: F401 (HAS_GXX: re-exported)

from tilefuse.reference.engram import _fma_f32

LANES, V, CHUNK = 32, 8, 256


# ---- the arithmetic as a PyTorch model ----

def _partials(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-lane fma chains over ``[..., H]`` fp32 factors: ``acc[..., l] = fma(a, b, acc)`` over the columns
    ``256 c + 8 l + i``, ``c`` then ``i`` increasing, from +0. Returns ``[..., 32]`` fp32."""
    chunks = a.shape[-1] // CHUNK
    a = a.reshape(*a.shape[:-1], chunks, LANES, V)
    b = b.reshape(*b.shape[:-1], chunks, LANES, V)
    acc = torch.zeros(a.shape[:-3] + (LANES,), dtype=torch.float32, device=a.device)
    for c in range(chunks):
        for i in range(V):
            acc = _fma_f32(a[..., c, :, i], b[..., c, :, i], acc)
    return acc


def _butterfly(acc: torch.Tensor) -> torch.Tensor:
    """The XOR butterfly over the last dimension (32 lanes): ``acc[l] + acc[l ^ d]`` for d = 16, 8, 4, 2, 1; every
    lane ends with the same value, returned as ``[...]``."""
    lanes = torch.arange(LANES, device=acc.device)
    for d in (16, 8, 4, 2, 1):
        acc = acc + acc[..., lanes ^ d]
    return acc[..., 0]


def _rn(fn, *args: torch.Tensor) -> torch.Tensor:
    """One correctly rounded fp32 operation: ``fn`` of the fp32 ``args`` in float64, rounded once to fp32. For one
    +, -, *, / or square root of fp32 operands that equals the IEEE fp32 result (float64 has more than 2 * 24 + 2
    bits), on every device and whatever the library's own fp32 kernels do (the CPU's vectorised ``sqrt`` is not
    always correctly rounded)."""
    return fn(*(a.double() for a in args)).float()


def model(x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, eps: float, clamp: float):
    """``(dot, rstd_x, rstd_k, u, g)`` ``[T, M]`` fp32 of the kernel's order for bf16 ``x, k [T, M, H]`` and fp32
    ``w [M, H]`` (``v`` unused: the output is ``out_model``'s)."""
    h = x.shape[-1]
    xf, kf = x.float(), k.float()
    sxx = _butterfly(_partials(xf, xf))
    skk = _butterfly(_partials(kf, kf))
    dot = _butterfly(_partials(xf * w.float(), kf))  # RN(x * w) in fp32, then the fma with k
    c_h = float(torch.tensor(h ** -0.5, dtype=torch.float32))  # H^-0.5 in double, rounded once
    eps, clamp = (float(torch.tensor(e, dtype=torch.float32)) for e in (eps, clamp))  # the kernel's fp32 scalars
    rx = _rn(lambda a: 1.0 / a, _rn(torch.sqrt, _rn(lambda b: b + eps, _rn(lambda b: b / h, sxx))))
    rk = _rn(lambda a: 1.0 / a, _rn(torch.sqrt, _rn(lambda b: b + eps, _rn(lambda b: b / h, skk))))
    s = _rn(lambda a: a * c_h, _rn(lambda a, b: a * b, _rn(lambda a, b: a * b, dot, rx), rk))
    a = s.abs()
    u = torch.copysign(_rn(torch.sqrt, torch.where(a < clamp, torch.full_like(a, clamp), a)), s)
    g = _rn(lambda e: 1.0 / e, _rn(lambda e: 1.0 + e, torch.exp(-u)))
    return dot, rx, rk, u, g


def out_model(x: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``bf16(fma(g, v, x))`` for ``x [T, M, H]``, ``v [T, H]`` bf16 and ``g [T, M]`` fp32."""
    xf = x.float()
    vf = v.float().unsqueeze(-2).expand_as(xf)
    return _fma_f32(g.unsqueeze(-1).expand_as(xf), vf, xf).to(torch.bfloat16)


def f32_ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of fp32 values at ``|t|`` (float64)."""
    a = t.float().abs()
    return (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).double()


# ---- the generated CUDA source on the CPU ----

SHIM = PREAMBLE + r"""
struct uint4 { uint x, y, z, w; };
struct float4 { float x, y, z, w; };
static inline uint __pack_nv_bfloat162(bfloat16_t a, bfloat16_t b) { return (uint)a.s | ((uint)b.s << 16); }
static inline uint4 make_uint4(uint a, uint b, uint c, uint d) { return uint4{a, b, c, d}; }
static float* g_smem;
static std::barrier<>* g_cta;
static std::vector<std::barrier<>*> g_warp;
static float g_slots[1024];
static inline void __syncthreads() { g_cta->arrive_and_wait(); }
static inline float __shfl_xor_sync(uint, float v, int delta, int) {
  int t = threadIdx.x, base = t & ~31;
  g_slots[t] = v;
  g_warp[t / 32]->arrive_and_wait();
  float r = g_slots[base + ((t & 31) ^ delta)];
  g_warp[t / 32]->arrive_and_wait();
  return r;
}
"""


def build(src: str, name: str, threads: int, workdir: Path):
    """Compile the ``__global__`` function ``name`` of ``src`` for the CPU; returns ``run(args: dict, blocks,
    smem_floats=0)``, which binds tensors (CPU, contiguous) and Python numbers by the kernel's parameter names."""
    body = src[src.index('extern "C" __global__ void __launch_bounds__'):]
    body = re.sub(r"extern __shared__ __align__\(\d+\) (\w+) (\w+)\[\];", r"\1* \2 = (\1*)g_smem;", body)
    decl, cargs, call = signature(body, name)
    cpp = SHIM + body.replace('extern "C" __global__', "static") + f"""
extern "C" void run({cargs}, int64_t blocks, int64_t smem_floats) {{
  std::vector<float> smem(smem_floats > 0 ? smem_floats : 1);
  g_smem = smem.data();
  for (int64_t b = 0; b < blocks; ++b) {{
    std::barrier<> cta({threads});
    g_cta = &cta;
    std::vector<std::barrier<>*> warps;
    for (int w = 0; w < {threads // 32}; ++w) warps.push_back(new std::barrier<>(32));
    g_warp = warps;
    std::vector<std::thread> th;
    for (unsigned t = 0; t < {threads}; ++t)
      th.emplace_back([=]() {{ blockIdx.x = b; threadIdx.x = t; {name}({call}); }});
    for (auto& t : th) t.join();
    for (auto* w : warps) delete w;
  }}
}}
"""
    fn = compile_run(cpp, name, workdir)

    def run(args: dict, blocks: int, smem_floats: int = 0) -> None:
        fn(*values(decl, args), ctypes.c_int64(blocks), ctypes.c_int64(smem_floats))

    return run
