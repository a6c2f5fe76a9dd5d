"""TileLang kernels of the norm-weight merge (mhc.md §2.2.1, §5.2): ``mhc_fn_normw_merge_fwd`` and
``mhc_fn_normw_merge_bwd``.

Layout: ``fn``, the merged weight and its gradients are ``[M, K]`` fp32 (contiguous), the norm weight and its
gradient ``[K]``. The row count ``M`` is a runtime (64-bit) value; ``K`` is compile-time. Every fp32 operation is
an explicit ``__fmul_rn`` / ``__fadd_rn`` so nvcc cannot contract a product and a sum into one fma.

Forward: ``out[j, k] = fn[j, k] * w[k]`` (one rounding). One thread per 16-byte vector of ``V = 4`` columns of
one row, over the flattened ``M * K / V`` vectors (``K % 4 == 0``).

Backward (both outputs accumulate into the caller's buffers): one thread per ``BWD_VEC`` consecutive columns (each
column ``k`` as below, its operations in the same order: no bit changes with the knob). It walks the rows
``j = 0, 1, ..., M - 1`` in order (loading ``BWD_ROWS`` rows ahead of their arithmetic, which changes no bit): ``fn_grad[j, k] = fn_grad[j, k] + RN(dW[j, k] * w[k])`` and
``acc = acc + RN(dW[j, k] * fn[j, k])`` from ``acc = 0``; then ``normw_grad[k] = normw_grad[k] + acc`` once.
That is the order of §2.2.1 and of the reference (``seq_sum`` over rows, then one add): bit for bit, with no
atomics and nothing that depends on the launch. Consecutive threads take consecutive columns, so every row
access of a warp is one coalesced 128-byte line (``BWD_VEC`` lines of 8- or 16-byte vectors at 2 or 4).

Kernel constraints: CUDA fp32 tensors; the forward needs ``K % 4 == 0`` (``takes_fwd``), the backward takes
any ``K``. The public ops keep the reference path for other inputs. The backward's launcher builds the
``BWD_VEC``-column kernel when ``K % BWD_VEC == 0`` and every tensor starts on a ``4 * BWD_VEC``-byte boundary
(``bwd_vec``), else the one-column kernel.

Speed: docs/BENCHMARKS.md (its mHC and Engram section; the knobs' values are the fastest measured there: 64 threads,
every row's loads at once, two columns a thread). ptxas (sm_90, K = 16384, no spills): the forward 19 registers, the
backward at ``BWD_VEC = 1`` 128 at 24 rows (56 at 8). The backward at ``BWD_VEC = 2``: 195 registers at 24 rows, 125
at 14 (the most rows under 128), 238 at 32; at ``BWD_VEC = 4``: 111 at 7 rows (the most under 128), 233 at 16, 255 at
18 (the most without spills; 20 rows spill). No shared memory.
"""

import torch

from tilefuse import _jit, _launch, _ops
from tilefuse._rn import add as _add, mul as _mul
from tilefuse.mhc._rows import write_through

KERNEL_HELPERS = ("tilefuse._rn",)  # part of this module's kernel cache key (_jit._module_digest)

# ---- tuning knobs (TILEFUSE_KNOBS; results unchanged) ----
FWD_THREADS = 128  # forward: threads per CTA (one 16-byte vector each)
BWD_THREADS = 64   # backward: threads per CTA (BWD_VEC columns each)
BWD_ROWS = 24      # backward: rows whose loads a thread issues before their arithmetic (the order is the same)
BWD_VEC = 2        # backward: consecutive columns a thread (1, 2 or 4: 4-, 8- or 16-byte accesses; see bwd_vec)

V = 4  # fp32 columns per forward vector (16 bytes)
F32 = "float32"
I64 = "int64"


def normw_merge_fwd_kernel(K: int):
    """Factory: forward at ``K`` columns (``K % 4 == 0``). Launch: ``FN [M, K]``, ``W [K]``, ``OUT [M, K]``."""
    import tilelang.language as T

    assert K > 0 and K % V == 0, K
    L = K // V
    threads = FWD_THREADS
    Mn = T.dynamic("rows", I64)

    @T.prim_func
    def mhc_normw_merge_fwd(FN: T.Tensor((Mn, K), F32), W: T.Tensor((K,), F32), OUT: T.Tensor((Mn, K), F32)):
        with T.Kernel(T.ceildiv(Mn * L, threads), threads=threads) as bx:
            a = T.alloc_local((V,), F32)
            w = T.alloc_local((V,), F32)
            o = T.alloc_local((V,), F32)
            g = T.cast(bx, I64) * threads + T.get_thread_binding()
            if g < Mn * L:
                j = g // L
                k = (g % L) * V
                for e in T.vectorized(V):
                    a[e] = FN[j, k + e]
                for e in T.vectorized(V):
                    w[e] = W[k + e]
                for e in T.unroll(V):
                    o[e] = _mul(a[e], w[e])
                for e in T.vectorized(V):
                    OUT[j, k + e] = o[e]

    return mhc_normw_merge_fwd


def normw_merge_bwd_kernel(K: int, vec: int):
    """Factory: backward at ``K`` columns, ``vec`` consecutive columns a thread (1, 2 or 4; ``K % vec == 0``).
    Launch: ``FN [M, K]``, ``W [K]``, ``DW [M, K]`` (the merged weight's gradient), then the accumulated
    ``DFN [M, K]`` and ``DNW [K]``; at ``vec > 1`` every tensor starts on a ``4 * vec``-byte boundary."""
    import tilelang.language as T

    assert K > 0 and vec in (1, 2, 4) and K % vec == 0, (K, vec)
    threads, U = BWD_THREADS, max(1, BWD_ROWS)
    Mn = T.dynamic("rows", I64)

    @T.prim_func
    def mhc_normw_merge_bwd(FN: T.Tensor((Mn, K), F32), W: T.Tensor((K,), F32), DW: T.Tensor((Mn, K), F32),
                            DFN: T.Tensor((Mn, K), F32), DNW: T.Tensor((K,), F32)):
        with T.Kernel(T.ceildiv(K, vec * threads), threads=threads) as bx:
            acc = T.alloc_local((vec,), F32)
            w = T.alloc_local((vec,), F32)
            d = T.alloc_local((U * vec,), F32)
            f = T.alloc_local((U * vec,), F32)
            g = T.alloc_local((U * vec,), F32)
            k = (bx * threads + T.get_thread_binding()) * vec  # the thread's first column
            if k < K:
                for e in T.vectorized(vec):
                    w[e] = W[k + e]
                for e in T.unroll(vec):
                    acc[e] = T.float32(0.0)
                for s in T.serial(T.ceildiv(Mn, U)):
                    for u in T.unroll(U):  # the loads of U rows, then their arithmetic in row order
                        if s * U + u < Mn:
                            for e in T.vectorized(vec):
                                d[u * vec + e] = DW[s * U + u, k + e]
                            for e in T.vectorized(vec):
                                f[u * vec + e] = FN[s * U + u, k + e]
                            for e in T.vectorized(vec):
                                g[u * vec + e] = DFN[s * U + u, k + e]
                    for u in T.unroll(U):
                        if s * U + u < Mn:
                            if vec == 1:
                                DFN[s * U + u, k] = _add(g[u], _mul(d[u], w[0]))
                            else:  # the vec sums, then one vector store
                                for e in T.unroll(vec):
                                    g[u * vec + e] = _add(g[u * vec + e], _mul(d[u * vec + e], w[e]))
                                for e in T.vectorized(vec):
                                    DFN[s * U + u, k + e] = g[u * vec + e]
                            for e in T.unroll(vec):
                                acc[e] = _add(acc[e], _mul(d[u * vec + e], f[u * vec + e]))
                if vec == 1:
                    DNW[k] = _add(DNW[k], acc[0])
                else:  # one vector load of the destinations (into w, read no more), the vec adds, one vector store
                    for e in T.vectorized(vec):
                        w[e] = DNW[k + e]
                    for e in T.unroll(vec):
                        acc[e] = _add(w[e], acc[e])
                    for e in T.vectorized(vec):
                        DNW[k + e] = acc[e]

    return mhc_normw_merge_bwd


# The bench's launches: K = n * C for n = 4, C in {2560, 4096, 7168} (issue #35's shapes).
BENCH_K = (4 * 2560, 4 * 4096, 4 * 7168)


def _fwd_configs() -> list[tuple]:
    return [(k,) for k in BENCH_K]


def _bwd_configs() -> list[tuple]:
    return [(k, BWD_VEC) for k in BENCH_K]


_jit.register("mhc_normw_merge_fwd", normw_merge_fwd_kernel, _fwd_configs)
_jit.register("mhc_normw_merge_bwd", normw_merge_bwd_kernel, _bwd_configs)


# ---- launchers (no validation: the public ops validate) ----

def takes_fwd(fn: torch.Tensor) -> bool:
    """Whether the forward kernel takes this (validated) ``fn [M, K]``: CUDA fp32 and ``K % 4 == 0``."""
    return fn.is_cuda and fn.dtype == torch.float32 and fn.shape[1] % V == 0


def takes_bwd(fn: torch.Tensor) -> bool:
    """Whether the backward kernel takes this (validated) ``fn [M, K]``: CUDA fp32."""
    return fn.is_cuda and fn.dtype == torch.float32


def bwd_vec(K: int, *ts: torch.Tensor) -> int:
    """Columns a backward thread takes: ``BWD_VEC`` when ``K`` is a multiple of it and every tensor starts on a
    ``4 * BWD_VEC``-byte boundary (then so does every row), else 1."""
    if K % BWD_VEC == 0 and all(t.data_ptr() % (4 * BWD_VEC) == 0 for t in ts):
        return BWD_VEC
    return 1


def normw_merge_fwd_launch(fn: torch.Tensor, normw: torch.Tensor, out_fn: torch.Tensor) -> None:
    """Write ``out_fn = fn * normw`` (contiguous fp32 tensors, ``K % 4 == 0``). The kernel's 16-byte accesses: a
    misaligned input is bound through an aligned copy, a misaligned ``out_fn`` written through one."""
    M, K = fn.shape
    if M and K:
        kernel = _jit.get("mhc_normw_merge_fwd", (K,))
        write_through(out_fn, lambda dst: kernel(_launch.aligned(fn), _launch.aligned(normw), dst))


def normw_merge_bwd_launch(fn: torch.Tensor, normw: torch.Tensor, out_fn_grad: torch.Tensor, fn_grad: torch.Tensor,
                           normw_grad: torch.Tensor) -> None:
    """Accumulate ``fn_grad += out_fn_grad * normw`` and ``normw_grad += sum_j out_fn_grad[j] * fn[j]``
    (contiguous fp32 tensors). With ``M = 0`` the row sum is 0 and ``normw_grad`` gets ``+ 0``."""
    M, K = fn.shape
    if not K:
        return
    if not M:
        normw_grad.add_(0.0)  # the kernel's one add of an empty sum (turns -0 into +0, as the reference does)
        return
    args = (fn, normw, out_fn_grad, fn_grad, normw_grad)
    _jit.get("mhc_normw_merge_bwd", (K, bwd_vec(K, *args)))(*args)


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::mhc_normw_merge_fwd", mutates_args=("out_fn",), device_types="cuda")
def _fwd_op(fn: torch.Tensor, normw: torch.Tensor, out_fn: torch.Tensor) -> None:
    normw_merge_fwd_launch(fn, normw, out_fn)



@_ops.kernel_op("tilefuse::mhc_normw_merge_bwd", mutates_args=("fn_grad", "normw_grad"), device_types="cuda")
def _bwd_op(fn: torch.Tensor, normw: torch.Tensor, out_fn_grad: torch.Tensor, fn_grad: torch.Tensor,
            normw_grad: torch.Tensor) -> None:
    normw_merge_bwd_launch(fn, normw, out_fn_grad, fn_grad, normw_grad)



# ---- CUDA entries: a direct launch in eager mode, the custom op under torch.compile ----

def _tracing() -> bool:
    return torch.compiler.is_compiling()


def normw_merge_fwd_cuda(*args) -> None:
    (torch.ops.tilefuse.mhc_normw_merge_fwd if _tracing() else normw_merge_fwd_launch)(*args)


def normw_merge_bwd_cuda(*args) -> None:
    (torch.ops.tilefuse.mhc_normw_merge_bwd if _tracing() else normw_merge_bwd_launch)(*args)
