"""TileLang kernels of ``expand_to_mhc`` (mhc.md §2.1, §5.2): the forward copies a token row ``x [T, C]`` to
each of the ``n`` streams of ``o [T, n, C]``; the backward sums ``o_grad [T, n, C]`` over the streams.

Work split (both kernels): a row of ``C`` bf16 is ``C / 8`` chunks of 16 bytes (``_rows``); CTA ``(b, j)`` takes
tokens ``b R .. b R + R - 1`` (``R = TOKENS_PER_CTA``; ``blockIdx.x``, so any token count fits the grid) and
``threads`` consecutive chunks starting at chunk ``j * threads``; a thread owns one chunk column of its tokens and
loads all of them before it stores. ``threads`` divides the chunk count where a whole number of warps does
(``row_threads``), so no lane idles at the rows of the bench. Addresses are 64-bit (the token
count is an int64 symbol): ``T * n * C`` may exceed 2^31.

* forward: one 16-byte load of ``x``, then ``n`` 16-byte stores, one per stream (a bitwise copy);
* backward: ``n`` 16-byte loads, then per element ``acc = 0``, ``acc = acc + f(g_i)`` for i = 0..n-1 in fp32
  (``__fadd_rn``, so nothing folds the leading ``0 +``: it turns a -0 sum into +0, as the spec's chain does),
  one RNE rounding to bf16 and one 16-byte store.

No shared memory, no reductions across threads: deterministic and batch-invariant.

Kernel constraints: ``C % 8 == 0`` (whole chunks), ``n <= MAX_N`` and 16-byte aligned tensors; the public ops send
other shapes to the reference, and the launchers copy a misaligned (or non-contiguous) tensor into an aligned one.
"""

import torch

from tilefuse import _jit, _launch, _ops
from tilefuse._rn import add as _fadd
from tilefuse.mhc._rows import MAX_N, V, row_threads, takes, write_through  # noqa: F401  (takes, MAX_N: _functions)

KERNEL_HELPERS = ("tilefuse.mhc._rows", "tilefuse._rn")  # part of this module's cache key (_jit._module_digest)

# ---- tuning knobs (TILEFUSE_KNOBS) ----
MAX_THREADS = 256  # the most threads per CTA (_rows.row_threads)
# tokens per CTA: a thread loads its chunk of TOKENS_PER_CTA consecutive tokens before it stores any (more bytes in
# flight per thread, fewer CTAs). Results unchanged.
TOKENS_PER_CTA = 1
# PDL: the first statement waits for the stream's previous grid (griddepcontrol.wait), so the launch and CTA setup
# overlap the previous kernel's tail. Results unchanged.
PDL = True


def expand_fwd_kernel(n: int, C: int):
    """Factory: ``o[t, i, :] = x[t, :]`` for ``n`` streams of hidden size ``C`` (``C % 8 == 0``).

    Arguments at launch: ``X`` bf16 ``[T, C]``, ``O`` bf16 ``[T, n, C]`` (contiguous, 16-byte aligned).
    """
    import tilelang.language as T

    assert n >= 1 and C % V == 0 and C > 0, (n, C)
    cv = C // V
    threads = row_threads(C, MAX_THREADS)
    R = TOKENS_PER_CTA
    Tn = T.dynamic("num_tokens", "int64")

    @T.prim_func
    def expand_fwd(X: T.Tensor((Tn, C), "bfloat16"), O: T.Tensor((Tn, n, C), "bfloat16")):
        with T.Kernel(T.ceildiv(Tn, R), T.ceildiv(cv, threads), threads=threads) as (bt, bc):
            if PDL:
                T.pdl_sync()
            j = bc * threads + T.get_thread_binding()
            buf = T.alloc_local((R * V,), "bfloat16")
            if j < cv:
                for r in T.unroll(R):
                    t = T.cast(bt, "int64") * R + r
                    if R == 1 or t < Tn:
                        for e in T.vectorized(V):
                            buf[r * V + e] = X[t, j * V + e]
                for r in T.unroll(R):
                    t = T.cast(bt, "int64") * R + r
                    if R == 1 or t < Tn:
                        for i in T.unroll(n):
                            for e in T.vectorized(V):
                                O[t, i, j * V + e] = buf[r * V + e]

    return expand_fwd


def expand_bwd_kernel(n: int, C: int):
    """Factory: ``x_grad[t, :] = bf(((0 + g_0) + g_1) + ... + g_{n-1})`` in fp32, ``g_i = o_grad[t, i, :]``.

    Arguments at launch: ``G`` bf16 ``[T, n, C]``, ``XG`` bf16 ``[T, C]`` (contiguous, 16-byte aligned).
    """
    import tilelang.language as T

    assert n >= 1 and C % V == 0 and C > 0, (n, C)
    cv = C // V
    threads = row_threads(C, MAX_THREADS)
    R = TOKENS_PER_CTA
    Tn = T.dynamic("num_tokens", "int64")

    @T.prim_func
    def expand_bwd(G: T.Tensor((Tn, n, C), "bfloat16"), XG: T.Tensor((Tn, C), "bfloat16")):
        with T.Kernel(T.ceildiv(Tn, R), T.ceildiv(cv, threads), threads=threads) as (bt, bc):
            if PDL:
                T.pdl_sync()
            j = bc * threads + T.get_thread_binding()
            g = T.alloc_local((R * n * V,), "bfloat16")
            acc = T.alloc_local((V,), "float32")
            out = T.alloc_local((V,), "bfloat16")
            if j < cv:
                for r in T.unroll(R):
                    t = T.cast(bt, "int64") * R + r
                    if R == 1 or t < Tn:
                        for i in T.unroll(n):
                            for e in T.vectorized(V):
                                g[(r * n + i) * V + e] = G[t, i, j * V + e]
                for r in T.unroll(R):
                    t = T.cast(bt, "int64") * R + r
                    if R == 1 or t < Tn:
                        for e in T.unroll(V):
                            acc[e] = T.float32(0.0)
                        for i in T.unroll(n):
                            for e in T.unroll(V):
                                acc[e] = _fadd(acc[e], T.cast(g[(r * n + i) * V + e], "float32"))
                        for e in T.unroll(V):
                            out[e] = T.cast(acc[e], "bfloat16")
                        for e in T.vectorized(V):
                            XG[t, j * V + e] = out[e]

    return expand_bwd


# Exactly the configs the bench launches (tilefuse/bench/mhc.py: the n = 4, C in {2560, 4096, 7168}); any other
# config compiles on first use.
BENCH_N = (4,)
BENCH_C = (2560, 4096, 7168)


def _configs() -> list[tuple]:
    return [(n, c) for n in BENCH_N for c in BENCH_C]


_jit.register("mhc_expand_fwd", expand_fwd_kernel, _configs)
_jit.register("mhc_expand_bwd", expand_bwd_kernel, _configs)


# ---- launchers (validate nothing: the public ops do) ----

def expand_fwd_launch(x: torch.Tensor, o: torch.Tensor) -> None:
    """Write ``o [T, n, C]`` from ``x [T, C]`` (bf16, ``takes(n, C)``); a misaligned or non-contiguous ``o`` is
    written through an aligned buffer."""
    Tn, n, C = o.shape
    if Tn == 0:
        return
    fn = _jit.get("mhc_expand_fwd", (n, C))
    write_through(o, lambda dst: fn(_launch.aligned(x.contiguous()), dst))


def expand_bwd_launch(o_grad: torch.Tensor, x_grad: torch.Tensor) -> None:
    """Overwrite ``x_grad [T, C]`` with the stream sum of ``o_grad [T, n, C]`` (bf16, ``takes(n, C)``)."""
    Tn, n, C = o_grad.shape
    if Tn == 0:
        return
    fn = _jit.get("mhc_expand_bwd", (n, C))
    write_through(x_grad, lambda dst: fn(_launch.aligned(o_grad.contiguous()), dst))


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::mhc_expand_fwd", mutates_args=("o",), device_types="cuda")
def _expand_fwd_op(x: torch.Tensor, o: torch.Tensor) -> None:
    expand_fwd_launch(x, o)



@_ops.kernel_op("tilefuse::mhc_expand_bwd", mutates_args=("x_grad",), device_types="cuda")
def _expand_bwd_op(o_grad: torch.Tensor, x_grad: torch.Tensor) -> None:
    expand_bwd_launch(o_grad, x_grad)



def expand_fwd_cuda(x: torch.Tensor, o: torch.Tensor) -> None:
    """CUDA entry (``x [T, C]``, ``o [T, n, C]``): a direct launch in eager mode, the custom op under
    ``torch.compile``."""
    if torch.compiler.is_compiling():
        torch.ops.tilefuse.mhc_expand_fwd(x, o)
    else:
        expand_fwd_launch(x, o)


def expand_bwd_cuda(o_grad: torch.Tensor, x_grad: torch.Tensor) -> None:
    """CUDA entry (``o_grad [T, n, C]``, ``x_grad [T, C]``), as ``expand_fwd_cuda``."""
    if torch.compiler.is_compiling():
        torch.ops.tilefuse.mhc_expand_bwd(o_grad, x_grad)
    else:
        expand_bwd_launch(o_grad, x_grad)
