"""TileLang kernels for the Sinkhorn of mHC (mhc.md §2.4, §5.2): ``mhc_sinkhorn_fwd`` / ``mhc_sinkhorn_bwd`` on
``[T, n, n]`` fp32 logits, behind ``sinkhorn_normalize`` (v1) and the v2.1 destination-passing ops.

Work split: one lane per matrix element. The ``n * n`` lanes of a matrix are an aligned group inside one warp
(lane ``l`` of the group holds row ``j = l // n``, column ``k = l % n``), so a CTA of ``THREADS`` lanes holds
``THREADS / n^2`` matrices, every value lives in a register, and consecutive lanes read and write consecutive
4-byte words (whole 128-byte lines per warp). Registers a lane (ptxas, sm_90, no spills): forward 15;
backward 52 / 92 / 141 at repeat 10 / 20 / 32. Kernels take ``n`` in ``KERNEL_N`` (a matrix fits a warp).

Sums and maxima over a row or column are XOR butterflies inside the group, halving the distance: a row sum
(over k) takes distances ``n/2, ..., 1``, a column sum (over j) ``n^2/2, ..., n``. Every lane of the row /
column ends with the same bits; for n = 4 the sum of ``e0..e3`` is ``(e0 + e2) + (e1 + e3)``, the order of
upstream's forward (mhc.md §2.4). Every add of a sum is ``__fadd_rn`` and every product feeding one is
``__fmul_rn``, so nvcc contracts nothing into an fma (``expf`` ends in a multiply).

Forward (§2.4 steps 1-5): softmax of the row (max, ``expf(x - max)``, divide by the sum), ``+ eps``, a column
step, then ``repeat - 1`` (row step, column step) pairs, each dividing by ``sum + eps`` (IEEE division:
fast-math is off). ``repeat`` and ``eps`` are launch arguments: one binary per ``n``.

Backward (§2.4 backward, the order of ``sinkhorn_normalize_bwd_ref``): the forward is replayed keeping the
softmax ``A0`` and, for each of the ``2 repeat - 1`` steps, its input value and its ``sum + eps`` (two
registers per step, statically indexed: ``repeat`` is a compile-time constant of the backward, at most
``MAX_BWD_REPEAT``). Walking the steps back, ``tau = sum(g * U) / s`` and ``g = (g - tau) / s``; finally
``d_x = (g - sum_k g * A0) * A0``.

Lanes past the last token compute on zeros (the butterflies need every lane of the warp) and store nothing.
No shared memory, no atomics: deterministic and batch-invariant.
"""
from __future__ import annotations

import torch

from tilefuse import _jit, _ops
from tilefuse._rn import add as _fadd, mul as _fmul

KERNEL_HELPERS = ("tilefuse._rn",)  # part of this module's kernel cache key (_jit._module_digest)

# ---- tuning knobs (TILEFUSE_KNOBS) ----
# lanes per CTA: THREADS / n^2 matrices (8 for n = 4). 128 rather than 256: the backward at repeat = 20 uses 92
# registers a lane (ptxas, sm_90; no spills), so an SM holds 5 CTAs of 4 warps (20 warps) against 2 of 8 (16)
THREADS = 128
# PDL: the first statement waits for the stream's previous grid (griddepcontrol.wait), so the launch and CTA
# setup overlap the previous kernel's tail. Results unchanged.
PDL = True

KERNEL_N = (2, 4)       # multiplicities the kernels take (n^2 lanes of one warp); others keep the reference
MAX_BWD_REPEAT = 32     # the backward keeps 2 (2 repeat - 1) registers per lane; longer chains keep the reference
MAX_FWD_REPEAT = 2 ** 31 - 1  # the forward's repeat is an int32 launch argument


def _expf(v):
    import tilelang.language as T

    return T.call_extern("float32", "expf", v)


def _distances(n: int, over: str) -> tuple:
    """XOR distances of a butterfly over a row (``"row"``: across k) or a column (``"col"``: across j)."""
    out, d = [], (n // 2 if over == "row" else n * n // 2)
    stop = 1 if over == "row" else n
    while d >= stop:
        out.append(d)
        d //= 2
    return tuple(out)


def _common(n: int):
    """Symbols and helpers shared by both factories."""
    import tilelang.language as T

    assert n in KERNEL_N and THREADS % (n * n) == 0 and THREADS % 32 == 0, (n, THREADS)

    @T.macro
    def butterfly_sum(acc, over):
        """``acc[0]`` (a one-element register buffer) becomes the sum over the lane's row or column."""
        for d in _distances(n, over):
            acc[0] = _fadd(acc[0], T.shfl_xor(acc[0], d))

    @T.macro
    def softmax(a, acc):
        """``a[0]`` (the lane's logit) becomes its row's softmax value; ``acc`` is scratch."""
        acc[0] = a[0]
        for d in _distances(n, "row"):
            acc[0] = T.max(acc[0], T.shfl_xor(acc[0], d))
        a[0] = _expf(a[0] - acc[0])
        acc[0] = a[0]
        butterfly_sum(acc, "row")
        a[0] = a[0] / acc[0]

    return butterfly_sum, softmax


def sinkhorn_fwd_kernel(n: int):
    """Factory: the forward for multiplicity ``n`` (``KERNEL_N``). Launch: ``X``, ``Y`` fp32 ``[T, n, n]``
    contiguous (T symbolic), ``repeat`` (int32, >= 1), ``eps`` (fp32)."""
    import tilelang.language as T

    butterfly_sum, softmax = _common(n)
    NN = n * n
    MPC = THREADS // NN  # matrices per CTA
    Tn = T.dynamic("num_tokens", "int64")

    @T.prim_func
    def sinkhorn_fwd(X: T.Tensor((Tn, n, n), "float32"), Y: T.Tensor((Tn, n, n), "float32"),
                     repeat: T.int32, eps: T.float32):
        with T.Kernel(T.ceildiv(Tn, MPC), threads=THREADS) as bx:
            if PDL:
                T.pdl_sync()
            tid = T.get_thread_binding()
            t = T.cast(bx, "int64") * MPC + T.cast(tid // NN, "int64")
            j = (tid % NN) // n
            k = tid % n
            a = T.alloc_local((1,), "float32")    # the lane's entry
            acc = T.alloc_local((1,), "float32")  # sums and maxima
            a[0] = T.float32(0.0)
            if t < Tn:
                a[0] = X[t, j, k]
            softmax(a, acc)
            a[0] = a[0] + eps
            acc[0] = a[0]
            butterfly_sum(acc, "col")
            a[0] = a[0] / (acc[0] + eps)
            for _ in T.serial(repeat - 1):
                acc[0] = a[0]
                butterfly_sum(acc, "row")
                a[0] = a[0] / (acc[0] + eps)
                acc[0] = a[0]
                butterfly_sum(acc, "col")
                a[0] = a[0] / (acc[0] + eps)
            if t < Tn:
                Y[t, j, k] = a[0]

    return sinkhorn_fwd


def sinkhorn_bwd_kernel(n: int, repeat: int):
    """Factory: the backward for multiplicity ``n`` (``KERNEL_N``) and ``1 <= repeat <= MAX_BWD_REPEAT``.
    Launch: ``G`` (d_out), ``X``, ``DX`` fp32 ``[T, n, n]`` contiguous (T symbolic), ``eps`` (fp32)."""
    import tilelang.language as T

    assert 1 <= repeat <= MAX_BWD_REPEAT, repeat
    butterfly_sum, softmax = _common(n)
    NN = n * n
    MPC = THREADS // NN
    S = 2 * repeat - 1                                            # normalisation steps
    steps = tuple((s, "col" if s % 2 == 0 else "row") for s in range(S))  # unrolled while building
    Tn = T.dynamic("num_tokens", "int64")

    @T.prim_func
    def sinkhorn_bwd(G: T.Tensor((Tn, n, n), "float32"), X: T.Tensor((Tn, n, n), "float32"),
                     DX: T.Tensor((Tn, n, n), "float32"), eps: T.float32):
        with T.Kernel(T.ceildiv(Tn, MPC), threads=THREADS) as bx:
            if PDL:
                T.pdl_sync()
            tid = T.get_thread_binding()
            t = T.cast(bx, "int64") * MPC + T.cast(tid // NN, "int64")
            j = (tid % NN) // n
            k = tid % n
            u = T.alloc_local((S,), "float32")     # input of step s (this lane's entry)
            den = T.alloc_local((S,), "float32")   # sum + eps of step s (this lane's row / column)
            a0 = T.alloc_local((1,), "float32")   # softmax output (before + eps)
            a = T.alloc_local((1,), "float32")    # the replayed iterate
            g = T.alloc_local((1,), "float32")    # the gradient walked back
            acc = T.alloc_local((1,), "float32")  # sums and maxima
            a0[0] = T.float32(0.0)
            g[0] = T.float32(0.0)
            if t < Tn:
                a0[0] = X[t, j, k]
                g[0] = G[t, j, k]
            softmax(a0, acc)
            a[0] = a0[0] + eps
            for s, over in steps:
                u[s] = a[0]
                acc[0] = a[0]
                butterfly_sum(acc, over)
                den[s] = acc[0] + eps
                a[0] = a[0] / den[s]
            for s, over in reversed(steps):
                acc[0] = _fmul(g[0], u[s])
                butterfly_sum(acc, over)
                g[0] = (g[0] - acc[0] / den[s]) / den[s]
            acc[0] = _fmul(g[0], a0[0])
            butterfly_sum(acc, "row")
            if t < Tn:
                DX[t, j, k] = (g[0] - acc[0]) * a0[0]

    return sinkhorn_bwd


BENCH_REPEATS = (10, 20)  # the spec's test grid (R = 10, mhc.md §4) and the bench row (20 iterations)


_jit.register("mhc_sinkhorn_fwd", sinkhorn_fwd_kernel, lambda: [(4,)])
_jit.register("mhc_sinkhorn_bwd", sinkhorn_bwd_kernel, lambda: [(4, r) for r in BENCH_REPEATS])


# ---- which inputs the kernels take ----

def fwd_supported(x: torch.Tensor, repeat: int) -> bool:
    """The forward kernel takes ``x`` (fp32 ``[..., n, n]`` on CUDA, ``n`` in ``KERNEL_N``) at this ``repeat``."""
    return (x.is_cuda and x.dtype == torch.float32 and x.dim() >= 2 and x.shape[-1] in KERNEL_N
            and 1 <= repeat <= MAX_FWD_REPEAT)


def bwd_supported(x: torch.Tensor, repeat: int) -> bool:
    """The backward kernel takes ``x`` at this ``repeat`` (``repeat <= MAX_BWD_REPEAT``)."""
    return fwd_supported(x, repeat) and repeat <= MAX_BWD_REPEAT


# ---- launchers (no validation: the public ops validate; tensors contiguous [T, n, n] fp32) ----

def sinkhorn_fwd_launch(x: torch.Tensor, out: torch.Tensor, repeat: int, eps: float) -> None:
    """Write the Sinkhorn of ``x`` into ``out`` (one launch; none for T = 0)."""
    if x.size(0) == 0:
        return
    _jit.get("mhc_sinkhorn_fwd", (x.size(-1),))(x, out, int(repeat), float(eps))


def sinkhorn_bwd_launch(d_out: torch.Tensor, x: torch.Tensor, d_x: torch.Tensor, repeat: int, eps: float) -> None:
    """Write the Sinkhorn input gradient into ``d_x`` (one launch; none for T = 0)."""
    if x.size(0) == 0:
        return
    _jit.get("mhc_sinkhorn_bwd", (x.size(-1), int(repeat)))(d_out, x, d_x, float(eps))


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::mhc_sinkhorn_fwd", mutates_args=("y",), device_types="cuda")
def _sinkhorn_fwd_op(x: torch.Tensor, y: torch.Tensor, repeat: int, eps: float) -> None:
    sinkhorn_fwd_launch(x, y, repeat, eps)



@_ops.kernel_op("tilefuse::mhc_sinkhorn_bwd", mutates_args=("d_x",), device_types="cuda")
def _sinkhorn_bwd_op(d_out: torch.Tensor, x: torch.Tensor, d_x: torch.Tensor, repeat: int, eps: float) -> None:
    sinkhorn_bwd_launch(d_out, x, d_x, repeat, eps)



def sinkhorn_fwd_cuda(x: torch.Tensor, out: torch.Tensor, repeat: int, eps: float) -> None:
    """CUDA entry (``[T, n, n]`` views): a direct launch in eager mode, the custom op under ``torch.compile``."""
    if torch.compiler.is_compiling():
        torch.ops.tilefuse.mhc_sinkhorn_fwd(x, out, repeat, eps)
    else:
        sinkhorn_fwd_launch(x, out, repeat, eps)


def sinkhorn_bwd_cuda(d_out: torch.Tensor, x: torch.Tensor, d_x: torch.Tensor, repeat: int, eps: float) -> None:
    """CUDA entry of the backward, as ``sinkhorn_fwd_cuda``."""
    if torch.compiler.is_compiling():
        torch.ops.tilefuse.mhc_sinkhorn_bwd(d_out, x, d_x, repeat, eps)
    else:
        sinkhorn_bwd_launch(d_out, x, d_x, repeat, eps)
