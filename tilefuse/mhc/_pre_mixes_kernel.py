"""TileLang kernel of the small steps of the fused pre (mhc.md §2.8): reduce + RMS of the split partials
(§2.2.2 steps 4-6), split mixes (§2.3) and the Sinkhorn forward of the comb logits (§2.4), one thread per token,
in one launch. ``_functions.pre_chain`` runs it and then the apply-mix kernel: two launches instead of four.

Layout (fp32, contiguous): partials ``PS [S, T, M]`` and ``QS [S, T]`` (``M = n (n + 2)``), ``scale [3]``,
``base [M]``; outputs ``PRE [T, n]`` (the apply's mix), ``POST [T, n]``, ``COMB [T, n * n]``. ``T`` is a runtime
(64-bit) value; ``n`` and ``S`` are compile-time. Launch arguments: ``kg`` (the group size ``n C`` as fp32),
``rms_eps``, ``v`` (post_mult_value), ``pre_eps``, ``repeat`` (int32) and ``sk_eps`` (named ``eps`` in the
generated CUDA: the Sinkhorn macros' parameter name).

Order of operations, per token ``t`` (thread ``t``), each the one of the kernel it replaces:

1. reduce (``_reduce_norm_kernel``'s forward with one group): ``P[j] = 0 + PS[0, t, j] + PS[1, t, j] + ...`` and
   ``Q = 0 + QS[0, t] + ...`` (splits in increasing order from zero), ``r = rsqrtf(Q / kg + eps)`` (its ``_rms``)
   and ``m[j] = 0 + RN(P[j] * r)``;
2. split (``_mix_kernel``'s split forward): ``z[j] = RN(m[j] * scale[g]) + base[j]`` (``g`` the group of column
   ``j``), ``PRE = sigmoid(z[i]) + pre_eps``, ``POST = sigmoid(z[n + i]) * v`` (its ``_sigmoid``), comb logits
   ``z[2n:]``;
3. Sinkhorn (``_sinkhorn_kernel``'s macros ``softmax`` and ``normalize``): row softmax, ``+ eps``, a column step,
   then ``repeat - 1`` (row, column) pairs; the sums are that kernel's trees.

Why bit-identical to the four-kernel chain (§3 contract 2): every fp32 operation above is the same operation on the
same operands in the same order as in the chain's kernels -- additions, products and quotients are explicit
``__f*_rn`` intrinsics (``tilefuse._rn``) or IEEE ``/`` with fast-math off, so nvcc contracts nothing into an fma;
``expf`` and ``rsqrtf`` are the same library functions -- and the values the chain stores between its kernels (the
RMS output, the comb logits) are fp32, which the registers here hold exactly. The Sinkhorn macros are the Sinkhorn
kernel's own (with ``FAST_DIV`` the shared-reciprocal quotient is the IEEE quotient in its checked range, plain
division outside: the sinkhorn module's doc and tests). The helpers are imported, not copied: ``_rms``, ``_sigmoid``,
``_groups`` and the Sinkhorn ``_common``, so a change there changes both paths (their modules are in
``KERNEL_HELPERS``, so in this kernel's cache key). The compile tier runs this kernel's generated CUDA and the
chain's three kernels under g++ and compares the outputs bit for bit.

Loads: a thread reads its token's ``M`` floats of each split as ``M / 4`` 16-byte vectors (the row is 16-byte
aligned when ``M % 4 == 0``: ``n`` even), the ``S`` splits unrolled so the loads of later splits are in flight
while earlier ones are added; a warp's vector loads span ``32 M`` consecutive floats, whole lines that L1 serves
to the warp's following vector loads. ``QS`` loads are consecutive words across a warp.

Nothing is summed over tokens: deterministic and batch-invariant, no atomics.

Measured on an NVIDIA H200, 2026-12-05 (isolated timer, ``mhc_pre_big_fuse_fwd`` at T = 8192, n = 4, C = 4096,
S = 16; ``tools/gpu_verify.sh`` with this kernel as a knob variant beside the chain in the same session): 95.6 µs,
against 101.0 for the four-kernel chain and 92.6 for TileKernels 2.1.0. The model said 91-92 µs: this kernel's share
(the partials' 13.1 MB and the Sinkhorn's steps on 2 warps an SM) about 5 µs against the three kernels' ~13.6 µs.

Registers a thread (ptxas, sm_90, ``nvcc -O3``, no spills, no stack): n = 4, S = 16: 254 (ptxas hoists the splits'
loads ahead of their adds; that still fits 8 CTAs of 32 threads an SM, more than the 2 that T = 8192 puts there);
n = 4, S = 1: 63; n = 2, S = 16: 158; n = 2, S = 1: 31.

Kernel constraints: ``n`` in ``_sinkhorn_kernel.KERNEL_N`` (2, 4), ``S <= _reduce_norm_kernel.MAX_S``, a group size
exact in fp32; the caller keeps the four-kernel chain for anything else (``takes``).
"""
from __future__ import annotations

import torch

from tilefuse import _jit, _launch, _ops
from tilefuse._rn import add as _add, mul as _mul
from tilefuse.mhc import _reduce_norm_kernel as RK, _sinkhorn_kernel as SK
from tilefuse.mhc._mix_kernel import _groups, _sigmoid
from tilefuse.mhc._rows import write_through

# part of this module's kernel cache key (_jit._module_digest): the helpers the kernel's code comes from
KERNEL_HELPERS = ("tilefuse._rn", "tilefuse.mhc._reduce_norm_kernel", "tilefuse.mhc._mix_kernel",
                  "tilefuse.mhc._sinkhorn_kernel")

# ---- knobs (TILEFUSE_KNOBS; results unchanged) ----
# True: pre_chain runs this kernel and the apply kernel (2 launches); False: the four-kernel chain (reduce, split,
# Sinkhorn, apply), which also serves every input this kernel does not take (``takes``) and is the tests' baseline
ENABLED = True
THREADS = 32  # threads (tokens) per CTA: T = 8192 gives 256 CTAs, two on each of 132 SMs
# PDL: the first statement waits for the stream's previous grid (griddepcontrol.wait), so the launch and CTA setup
# overlap the previous kernel's tail
PDL = True

F32 = "float32"
I64 = "int64"


def supports(n: int, S: int) -> bool:
    """Whether the kernel is built for multiplicity ``n`` and ``S`` splits."""
    return n in SK.KERNEL_N and RK.supports(S, 1, n * (n + 2))


def pre_mixes_kernel(n: int, S: int):
    """Factory: multiplicity ``n``, ``S`` splits. Launch: ``PS [S, T, M]``, ``QS [S, T]``, ``SC [3]``, ``BS [M]``,
    outputs ``PRE [T, n]``, ``POST [T, n]``, ``COMB [T, n * n]``, then ``kg``, ``rms_eps``, ``v``, ``pre_eps``
    (fp32), ``repeat`` (int32, >= 1), ``sk_eps`` (fp32)."""
    import tilelang.language as T

    assert supports(n, S), (n, S)
    forward = SK._common(n)[3]
    M, NN, TPB = n * (n + 2), n * n, THREADS
    VEC = 4 if M % 4 == 0 else 1  # floats a load: 16-byte vectors when every row starts on a 16-byte boundary
    groups = _groups(n)
    Tn = T.dynamic("num_tokens", I64)

    @T.prim_func
    def mhc_pre_mixes(PS: T.Tensor((S, Tn, M), F32), QS: T.Tensor((S, Tn), F32), SC: T.Tensor((3,), F32),
                      BS: T.Tensor((M,), F32), PRE: T.Tensor((Tn, n), F32), POST: T.Tensor((Tn, n), F32),
                      COMB: T.Tensor((Tn, NN), F32), kg: T.float32, rms_eps: T.float32, v: T.float32,
                      pre_eps: T.float32, repeat: T.int32, sk_eps: T.float32):
        with T.Kernel(T.ceildiv(Tn, TPB), threads=TPB) as bx:
            if PDL:
                T.pdl_sync()
            t = T.cast(bx, I64) * TPB + T.cast(T.get_thread_binding(), I64)
            ld = T.alloc_local((M,), F32)      # one split's partials of the token
            p = T.alloc_local((M,), F32)       # reduced partials, then the mix logits z
            q = T.alloc_local((1,), F32)
            r = T.alloc_local((1,), F32)
            a = T.alloc_local((NN,), F32)      # the comb matrix
            den = T.alloc_local((n,), F32)
            rcp = T.alloc_local((n,), F32)
            # 1. reduce + RMS: splits in increasing order from zero
            q[0] = T.float32(0.0)
            for j in T.unroll(M):
                p[j] = T.float32(0.0)
            if t < Tn:
                for s in T.unroll(S):
                    for c in T.unroll(M // VEC):
                        for e in T.vectorized(VEC):
                            ld[c * VEC + e] = PS[s, t, c * VEC + e]
                    q[0] = _add(q[0], QS[s, t])
                    for j in T.unroll(M):
                        p[j] = _add(p[j], ld[j])
            if t < Tn:
                r[0] = RK._rms(q[0], kg, rms_eps)
                # 2. split: z = RN(RN(0 + RN(P r)) * scale[g]) + base
                for g, (lo, hi) in enumerate(groups):
                    for j in T.unroll(lo, hi):
                        p[j] = _add(_mul(_add(T.float32(0.0), _mul(p[j], r[0])), SC[g]), BS[j])
                for i in T.unroll(n):
                    PRE[t, i] = _add(_sigmoid(p[i]), pre_eps)
                for i in T.unroll(n):
                    POST[t, i] = _mul(_sigmoid(p[n + i]), v)
                # 3. Sinkhorn of the comb logits (the Sinkhorn kernel's macros: its trees and quotients)
                for k in T.unroll(NN):
                    a[k] = p[2 * n + k]
                forward(a, den, rcp, sk_eps, repeat)
                for k in T.unroll(NN // VEC):
                    for e in T.vectorized(VEC):
                        COMB[t, k * VEC + e] = a[k * VEC + e]

    return mhc_pre_mixes


# The bench's launch: n = 4, S = 16 (mhc_pre_big_fuse_fwd at T = 8192; tilefuse/bench/mhc.py)
BENCH_N, BENCH_SPLITS = 4, 16


def _configs() -> list[tuple]:
    return [(BENCH_N, BENCH_SPLITS)] if ENABLED else []  # off: the bench launches the chain's kernels instead


_jit.register("mhc_pre_mixes_fwd", pre_mixes_kernel, _configs)


# ---- launcher (validates nothing: the public ops do) ----

def takes(out_mul_splitted: torch.Tensor, sqrsum_splitted: torch.Tensor, n: int, C: int, repeat: int) -> bool:
    """Whether the kernel takes these partials ``[S, T, 1, M]``, ``[S, T, 1]`` of ``n`` streams of ``C`` columns
    at this ``repeat``: exactly where the chain's reduce, split and Sinkhorn steps all take their kernels (CUDA fp32
    partials with one group, ``S`` and ``M`` the reduce kernel's, a group size exact in fp32, ``n`` the Sinkhorn
    kernel's and ``repeat`` its forward's), and ``ENABLED``."""
    S = out_mul_splitted.shape[0]
    return (ENABLED and out_mul_splitted.dim() == 4 and tuple(out_mul_splitted.shape[-2:]) == (1, n * (n + 2))
            and sqrsum_splitted.dtype == torch.float32 and supports(n, S)
            and RK.takes(out_mul_splitted, S, 1, n * (n + 2), n * C) and 1 <= repeat <= SK.MAX_FWD_REPEAT)


def pre_mixes_launch(out_mul: torch.Tensor, sqrsum: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                     pre: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, group_size: int, rms_eps: float,
                     post_mult_value: float, pre_eps: float, repeat: int, sinkhorn_eps: float) -> None:
    """Write ``pre [T, n]``, ``post [T, n]``, ``comb [T, n * n]`` from the contiguous partials ``out_mul [S, T, M]``,
    ``sqrsum [S, T]`` (one launch; none for T = 0). The kernel's 16-byte accesses: misaligned partials are bound
    through an aligned copy, a misaligned output written through one."""
    S, T_, _ = out_mul.shape
    if T_ == 0:
        return
    fn = _jit.get("mhc_pre_mixes_fwd", (pre.shape[1], S))
    args = (float(group_size), float(rms_eps), float(post_mult_value), float(pre_eps), int(repeat), float(sinkhorn_eps))
    write_through(pre, lambda p: write_through(post, lambda q: write_through(comb, lambda c: fn(
        _launch.aligned(out_mul), sqrsum, scale, base, p, q, c, *args))))


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::mhc_pre_mixes_fwd", mutates_args=("pre", "post", "comb"), device_types="cuda")
def _pre_mixes_op(out_mul: torch.Tensor, sqrsum: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                  pre: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, group_size: int, rms_eps: float,
                  post_mult_value: float, pre_eps: float, repeat: int, sinkhorn_eps: float) -> None:
    pre_mixes_launch(out_mul, sqrsum, scale, base, pre, post, comb, group_size, rms_eps, post_mult_value, pre_eps,
                     repeat, sinkhorn_eps)


def pre_mixes_cuda(*args) -> None:
    """CUDA entry (``pre_mixes_launch``'s arguments): a direct launch in eager mode, the custom op under
    ``torch.compile``."""
    (torch.ops.tilefuse.mhc_pre_mixes_fwd if torch.compiler.is_compiling() else pre_mixes_launch)(*args)
