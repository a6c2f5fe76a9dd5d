"""TileLang kernels of the split-partial reduction and RMS step of the prenorm projection (mhc.md §2.2.2 steps
4-6, §2.2.3 first three bullets, §5.2): ``mhc_reduce_partials_and_rmsnorm_fwd`` and ``..._bwd``.

Layout (fp32, contiguous): partials ``PS [S, T, G, M]``, ``QS [S, T, G]``; reduced ``PM [T, G, M]``,
``QM [T, G]``; ``out [T, M]``; gradients ``DO [T, M]`` -> ``DPM [T, G, M]``, ``DQM [T, G]``. The token count
``T`` is a runtime (64-bit) value; ``S``, ``G``, ``M`` are compile-time. The group size ``K_g`` (as fp32), ``eps``
and ``E = fp32(eps * K_g)`` (the product formed in double by the launcher, §0) are launch arguments. Every fp32
operation is an explicit ``__f*_rn`` intrinsic (no contraction); ``rsqrtf`` is the CUDA library function.

Forward: one thread per ``(t, j)``. For each group g in order: ``Pm = 0 + P_0 + P_1 + ...`` and
``Qm = 0 + Q_0 + Q_1 + ...`` (splits in increasing order, §2.2.2 step 4, exact as the reference's ``seq_sum``),
``r = rsqrtf(Qm / K_g + eps)`` and ``out = out + RN(Pm * r)`` from ``out = 0``. The thread writes ``PM[t, g, j]``;
the ``j = 0`` thread also writes ``QM[t, g]`` (the ``M`` threads of a token compute the same ``Qm``; their loads
of ``QS`` are one broadcast address). A warp's loads of one split are consecutive addresses (coalesced).

Backward: one thread per ``(t, g, j)``: ``r`` as in the forward from the saved ``Qm``, ``dP[j] = RN(d_out[j] * r)``
(consecutive threads write consecutive addresses); the ``j = 0`` thread of each ``(t, g)`` also sums
``dr = dr + RN(d_out[i] * Pm[i])`` for ``i = 0..M-1`` from 0 (the spec leaves this order open) and writes
``dQ = ((dr * r) / (Qm + E)) / -2`` (§2.2.3, each operation rounded once). No TF32 rounding (§5.2).

Nothing is summed over tokens: deterministic and batch-invariant, no atomics, no shared memory.

Kernel constraints: CUDA fp32 tensors with ``S <= MAX_S``, ``G <= MAX_G``, ``M <= MAX_M`` (the loops over them are
unrolled) and ``K_g < 2^24`` (exact as fp32); the public ops keep the reference path for other inputs (``takes``).

Speed: docs/BENCHMARKS.md (its mHC and Engram section). ptxas (sm_90, S = 16, G = 1, M = 24): the forward 56
registers, the backward 59.
"""

import torch

from tilefuse import _jit, _ops
from tilefuse._rn import add as _add, call as _f, div as _div, mul as _mul

KERNEL_HELPERS = ("tilefuse._rn",)  # part of this module's kernel cache key (_jit._module_digest)

# ---- tuning knobs (TILEFUSE_KNOBS; results unchanged) ----
FWD_THREADS = 128  # forward: threads per CTA (one (token, logit) each)
BWD_THREADS = 128  # backward: threads per CTA (one (token, group, logit) each)

MAX_S, MAX_G, MAX_M = 64, 8, 80  # M = n(n + 2) <= 80 for n <= 8
F32 = "float32"
I64 = "int64"


def _rms(q, kg, eps):
    """``r = rsqrtf(Q / K_g + eps)`` (§2.2.2 step 5)."""
    return _f("rsqrtf", _add(_div(q, kg), eps))


def supports(S: int, G: int, M: int) -> bool:
    """Whether the kernels are built for ``S`` splits (forward only), ``G`` groups and ``M`` logits."""
    return 1 <= S <= MAX_S and 1 <= G <= MAX_G and 1 <= M <= MAX_M


def reduce_fwd_kernel(S: int, G: int, M: int):
    """Factory: forward for ``S`` splits, ``G`` groups, ``M`` logits. Launch: ``PS [S, T, G, M]``, ``QS [S, T, G]``,
    outputs ``PM [T, G, M]``, ``QM [T, G]``, ``OUT [T, M]``, then the floats ``kg`` (K_g) and ``eps``."""
    import tilelang.language as T

    assert supports(S, G, M), (S, G, M)
    threads = FWD_THREADS
    Tn = T.dynamic("num_tokens", I64)

    @T.prim_func
    def mhc_reduce_rmsnorm_fwd(PS: T.Tensor((S, Tn, G, M), F32), QS: T.Tensor((S, Tn, G), F32),
                               PM: T.Tensor((Tn, G, M), F32), QM: T.Tensor((Tn, G), F32),
                               OUT: T.Tensor((Tn, M), F32), kg: T.float32, eps: T.float32):
        with T.Kernel(T.ceildiv(Tn * M, threads), threads=threads) as bx:
            p = T.alloc_local((1,), F32)
            q = T.alloc_local((1,), F32)
            o = T.alloc_local((1,), F32)
            e = T.cast(bx, I64) * threads + T.get_thread_binding()
            if e < Tn * M:
                t = e // M
                j = e % M
                o[0] = T.float32(0.0)
                for g in T.unroll(G):
                    p[0] = T.float32(0.0)
                    q[0] = T.float32(0.0)
                    for s in T.unroll(S):
                        p[0] = _add(p[0], PS[s, t, g, j])
                        q[0] = _add(q[0], QS[s, t, g])
                    PM[t, g, j] = p[0]
                    if j == 0:
                        QM[t, g] = q[0]
                    o[0] = _add(o[0], _mul(p[0], _rms(q[0], kg, eps)))
                OUT[t, j] = o[0]

    return mhc_reduce_rmsnorm_fwd


def reduce_bwd_kernel(G: int, M: int):
    """Factory: backward for ``G`` groups, ``M`` logits. Launch: ``DO [T, M]``, ``PM [T, G, M]``, ``QM [T, G]``,
    outputs ``DPM [T, G, M]``, ``DQM [T, G]``, then the floats ``kg`` (K_g), ``eps`` and ``E`` (fp32(eps K_g))."""
    import tilelang.language as T

    assert supports(1, G, M), (G, M)
    threads = BWD_THREADS
    Tn = T.dynamic("num_tokens", I64)

    @T.prim_func
    def mhc_reduce_rmsnorm_bwd(DO: T.Tensor((Tn, M), F32), PM: T.Tensor((Tn, G, M), F32),
                               QM: T.Tensor((Tn, G), F32), DPM: T.Tensor((Tn, G, M), F32),
                               DQM: T.Tensor((Tn, G), F32), kg: T.float32, eps: T.float32, E: T.float32):
        with T.Kernel(T.ceildiv(Tn * G * M, threads), threads=threads) as bx:
            q = T.alloc_local((1,), F32)
            r = T.alloc_local((1,), F32)
            dr = T.alloc_local((1,), F32)
            e = T.cast(bx, I64) * threads + T.get_thread_binding()
            if e < Tn * G * M:
                t = e // (G * M)
                g = (e // M) % G
                j = e % M
                q[0] = QM[t, g]
                r[0] = _rms(q[0], kg, eps)
                DPM[t, g, j] = _mul(DO[t, j], r[0])
                if j == 0:
                    dr[0] = T.float32(0.0)
                    for i in T.unroll(M):
                        dr[0] = _add(dr[0], _mul(DO[t, i], PM[t, g, i]))
                    DQM[t, g] = _div(_div(_mul(dr[0], r[0]), _add(q[0], E)), T.float32(-2.0))

    return mhc_reduce_rmsnorm_bwd


# The bench's launches: S = 16 splits, G = 1, M = 24 (n = 4; issue #35's shapes).
BENCH_SPLITS, BENCH_M = 16, 24

_jit.register("mhc_reduce_rmsnorm_fwd", reduce_fwd_kernel, lambda: [(BENCH_SPLITS, 1, BENCH_M)])
_jit.register("mhc_reduce_rmsnorm_bwd", reduce_bwd_kernel, lambda: [(1, BENCH_M)])


# ---- launchers (no validation: the public ops validate) ----

def takes(t: torch.Tensor, S: int, G: int, M: int, group_size: int) -> bool:
    """Whether the kernels take these (validated) arguments: a CUDA fp32 tensor ``t``, ``supports(S, G, M)`` and
    a group size exact in fp32."""
    return t.is_cuda and t.dtype == torch.float32 and supports(S, G, M) and 0 < group_size < 2 ** 24


def reduce_fwd_launch(out_mul_splitted, sqrsum_splitted, out_mul, sqrsum, out, rms_group_size: int,
                      rms_eps: float) -> None:
    """Write ``out_mul [T, G, M]``, ``sqrsum [T, G]``, ``out [T, M]`` from the contiguous partials (one launch)."""
    S, T_, G, M = out_mul_splitted.shape
    if T_:
        _jit.get("mhc_reduce_rmsnorm_fwd", (S, G, M))(out_mul_splitted, sqrsum_splitted, out_mul, sqrsum, out,
                                                       float(rms_group_size), float(rms_eps))


def reduce_bwd_launch(out_grad, out_mul, sqrsum, out_mul_grad, sqrsum_grad, rms_group_size: int,
                      rms_eps: float) -> None:
    """Write ``out_mul_grad [T, G, M]`` and ``sqrsum_grad [T, G]`` (contiguous tensors, one launch). ``E`` is
    ``eps * K_g`` formed in double (Python floats) and rounded to fp32 as the kernel's argument."""
    T_, G, M = out_mul.shape
    if T_:
        _jit.get("mhc_reduce_rmsnorm_bwd", (G, M))(out_grad, out_mul, sqrsum, out_mul_grad, sqrsum_grad,
                                                   float(rms_group_size), float(rms_eps),
                                                   float(rms_eps) * rms_group_size)


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::mhc_reduce_rmsnorm_fwd", mutates_args=("out_mul", "sqrsum", "out"), device_types="cuda")
def _fwd_op(out_mul_splitted: torch.Tensor, sqrsum_splitted: torch.Tensor, out_mul: torch.Tensor,
            sqrsum: torch.Tensor, out: torch.Tensor, rms_group_size: int, rms_eps: float) -> None:
    reduce_fwd_launch(out_mul_splitted, sqrsum_splitted, out_mul, sqrsum, out, rms_group_size, rms_eps)



@_ops.kernel_op("tilefuse::mhc_reduce_rmsnorm_bwd", mutates_args=("out_mul_grad", "sqrsum_grad"),
                device_types="cuda")
def _bwd_op(out_grad: torch.Tensor, out_mul: torch.Tensor, sqrsum: torch.Tensor, out_mul_grad: torch.Tensor,
            sqrsum_grad: torch.Tensor, rms_group_size: int, rms_eps: float) -> None:
    reduce_bwd_launch(out_grad, out_mul, sqrsum, out_mul_grad, sqrsum_grad, rms_group_size, rms_eps)



# ---- CUDA entries: a direct launch in eager mode, the custom op under torch.compile ----

def _tracing() -> bool:
    return torch.compiler.is_compiling()


def reduce_fwd_cuda(*args) -> None:
    (torch.ops.tilefuse.mhc_reduce_rmsnorm_fwd if _tracing() else reduce_fwd_launch)(*args)


def reduce_bwd_cuda(*args) -> None:
    (torch.ops.tilefuse.mhc_reduce_rmsnorm_bwd if _tracing() else reduce_bwd_launch)(*args)
