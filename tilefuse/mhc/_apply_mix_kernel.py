"""TileLang kernels of ``mhc_pre_apply_mix`` (mhc.md §2.5, §5.2): the forward mixes the ``n`` streams of
``x [T, n, C]`` with the per-token weights ``mix [T, n]`` into ``o [T, C]``; the backward writes (or accumulates)
the stream gradients and the per-token mix gradient.

Chunks: a row of ``C`` bf16 is ``C / 8`` chunks of 16 bytes; a thread takes whole chunks of one token.

* forward (``apply_mix_fwd_kernel``), per element: ``acc = mix_0 * f(x_0)``, then ``acc = fma(mix_i, f(x_i), acc)``
  for i = 1..n-1, ``o = bf(acc)`` (the spec's chain, pinned with ``__fmul_rn`` / ``__fmaf_rn``). CTA ``(b, j)``
  takes ``TOKENS_PER_CTA`` consecutive tokens and ``threads`` consecutive chunks of each (``_rows.row_threads``);
  a thread loads its chunks of all its tokens before it stores.
* backward (``apply_mix_bwd_kernel``): the mix gradient is a reduction over C *within a token*
  (``d_mix[t, i] = sum_c f(g[c]) * f(x_i[c])``), never over tokens, so one CTA owns one token: thread ``k`` walks
  chunks ``k, k + threads, ...`` in order, writing ``x_grad_i = bf(fma(mix_i, f(g), f(x_grad_i)))`` (accumulate;
  ``bf(mix_i * f(g))`` without) and adding the exact products ``f(g) * f(x_i)`` to its n fp32 running sums
  (``__fmaf_rn``, element order within a chunk); then a butterfly over each warp's lanes (``shfl_xor`` 16, 8, 4,
  2, 1; lane 0's sum is kept) and the warps' sums in warp order. The tree depends only on ``C`` (a static config),
  so results are deterministic and batch-invariant; no atomics.

Addresses are 64-bit (the token count is an int64 symbol). Kernel constraints: ``C % 8 == 0``, ``n <= MAX_N`` (8) and
16-byte aligned tensors; the public ops send other shapes to the reference, and the launchers copy a misaligned (or
non-contiguous) tensor into an aligned one.
"""
import torch

from tilefuse import _jit, _launch, _ops
from tilefuse._rn import fma as _fma, mul as _fmul
from tilefuse.mhc._rows import MAX_N, V, row_threads, takes, write_through  # noqa: F401  (takes, MAX_N: _functions)

KERNEL_HELPERS = ("tilefuse.mhc._rows", "tilefuse._rn")  # part of this module's cache key (_jit._module_digest)

# Threads per CTA of the backward: up to BWD_MAX_THREADS (_rows.row_threads). Not a tuning knob: the thread count
# sets the mix gradient's summation tree, so changing it changes results (within the derived bound).
BWD_MAX_THREADS = 256

# ---- tuning knobs of the forward (TILEFUSE_KNOBS; results unchanged) ----
MAX_THREADS = 512  # the most threads per CTA (_rows.row_threads)
# tokens per CTA: a thread loads its chunk of TOKENS_PER_CTA consecutive tokens before it stores any
TOKENS_PER_CTA = 1
# PDL: the first statement waits for the stream's previous grid (griddepcontrol.wait). Results unchanged.
PDL = True


def apply_mix_fwd_kernel(n: int, C: int):
    """Factory: ``o[t, :] = bf(chain_i mix[t, i] * x[t, i, :])`` (module doc) for ``n`` streams of ``C``.

    Arguments at launch: ``X`` bf16 ``[T, n, C]``, ``MIX`` fp32 ``[T, n]``, ``O`` bf16 ``[T, C]`` (contiguous,
    16-byte aligned).
    """
    import tilelang.language as T

    assert n >= 1 and C % V == 0 and C > 0, (n, C)
    cv = C // V
    threads = row_threads(C, MAX_THREADS)
    R = TOKENS_PER_CTA
    vec_mix = n in (2, 4)
    Tn = T.dynamic("num_tokens", "int64")

    @T.prim_func
    def apply_mix_fwd(X: T.Tensor((Tn, n, C), "bfloat16"), MIX: T.Tensor((Tn, n), "float32"),
                      O: T.Tensor((Tn, C), "bfloat16")):
        with T.Kernel(T.ceildiv(Tn, R), T.ceildiv(cv, threads), threads=threads) as (bt, bc):
            if PDL:
                T.pdl_sync()
            j = bc * threads + T.get_thread_binding()
            mix = T.alloc_local((R * n,), "float32")
            x = T.alloc_local((R * n * V,), "bfloat16")
            acc = T.alloc_local((V,), "float32")
            out = T.alloc_local((V,), "bfloat16")
            if j < cv:
                for r in T.unroll(R):
                    t = T.cast(bt, "int64") * R + r
                    if R == 1 or t < Tn:
                        if vec_mix:  # one vector load of the token's mix row (8 or 16 bytes), else n scalar loads
                            for i in T.vectorized(n):
                                mix[r * n + i] = MIX[t, i]
                        else:
                            for i in T.unroll(n):
                                mix[r * n + i] = MIX[t, i]
                        for i in T.unroll(n):
                            for e in T.vectorized(V):
                                x[(r * n + i) * V + e] = X[t, i, j * V + e]
                for r in T.unroll(R):
                    t = T.cast(bt, "int64") * R + r
                    if R == 1 or t < Tn:
                        for e in T.unroll(V):
                            acc[e] = _fmul(mix[r * n], T.cast(x[r * n * V + e], "float32"))
                        for i in T.unroll(1, n):
                            for e in T.unroll(V):
                                acc[e] = _fma(mix[r * n + i], T.cast(x[(r * n + i) * V + e], "float32"), acc[e])
                        for e in T.unroll(V):
                            out[e] = T.cast(acc[e], "bfloat16")
                        for e in T.vectorized(V):
                            O[t, j * V + e] = out[e]

    return apply_mix_fwd


def apply_mix_bwd_kernel(n: int, C: int, accumulate: bool):
    """Factory: the §2.5 backward for ``n`` streams of ``C`` (module doc); ``accumulate``: ``x_grad`` holds the
    destination D and becomes ``bf(fma(mix, g, D))`` (v2.1), else it is written ``bf(mix * g)`` (v1, no side
    channel) and not read.

    Arguments at launch: ``G`` bf16 ``[T, C]`` (the output gradient), ``X`` bf16 ``[T, n, C]``, ``MIX`` fp32
    ``[T, n]``, ``XG`` bf16 ``[T, n, C]`` (read and written), ``MG`` fp32 ``[T, n]`` (written); contiguous and
    16-byte aligned.
    """
    import tilelang.language as T

    assert n >= 1 and C % V == 0 and C > 0, (n, C)
    cv = C // V
    threads = row_threads(C, BWD_MAX_THREADS)
    steps = -(-cv // threads)  # chunks per thread (the last may be past the row)
    warps = threads // 32
    vec_mix = n in (2, 4)
    Tn = T.dynamic("num_tokens", "int64")

    @T.prim_func
    def apply_mix_bwd(G: T.Tensor((Tn, C), "bfloat16"), X: T.Tensor((Tn, n, C), "bfloat16"),
                      MIX: T.Tensor((Tn, n), "float32"), XG: T.Tensor((Tn, n, C), "bfloat16"),
                      MG: T.Tensor((Tn, n), "float32")):
        with T.Kernel(Tn, threads=threads) as bt:
            if PDL:
                T.pdl_sync()
            t = T.cast(bt, "int64")
            tid = T.get_thread_binding()
            mix = T.alloc_local((n,), "float32")
            part = T.alloc_local((n,), "float32")
            g = T.alloc_local((V,), "bfloat16")
            x = T.alloc_local((n * V,), "bfloat16")
            xg = T.alloc_local((n * V,), "bfloat16")
            red = T.alloc_shared((warps * n,), "float32")
            if vec_mix:  # one vector load of the token's mix row (8 or 16 bytes), else n scalar loads
                for i in T.vectorized(n):
                    mix[i] = MIX[t, i]
            else:
                for i in T.unroll(n):
                    mix[i] = MIX[t, i]
            for i in T.unroll(n):
                part[i] = T.float32(0.0)
            # a loop, not unrolled: unrolling the steps kept their addresses live (118 registers a thread at n = 4,
            # C = 7168, 2 CTAs an SM) without overlapping their loads (x_grad's stores may alias them); the loop
            # takes 64 (4 CTAs an SM; ptxas -v, sm_90, not timed: no GPU). Same order, same results.
            for s in T.serial(steps):
                j = s * threads + tid
                if j < cv:
                    for e in T.vectorized(V):
                        g[e] = G[t, j * V + e]
                    for i in T.unroll(n):
                        for e in T.vectorized(V):
                            x[i * V + e] = X[t, i, j * V + e]
                    if accumulate:
                        for i in T.unroll(n):
                            for e in T.vectorized(V):
                                xg[i * V + e] = XG[t, i, j * V + e]
                    for i in T.unroll(n):
                        for e in T.unroll(V):
                            gf = T.cast(g[e], "float32")
                            part[i] = _fma(gf, T.cast(x[i * V + e], "float32"), part[i])
                            if accumulate:
                                xg[i * V + e] = T.cast(_fma(mix[i], gf, T.cast(xg[i * V + e], "float32")),
                                                       "bfloat16")
                            else:
                                xg[i * V + e] = T.cast(_fmul(mix[i], gf), "bfloat16")
                    for i in T.unroll(n):
                        for e in T.vectorized(V):
                            XG[t, i, j * V + e] = xg[i * V + e]
            for i in T.unroll(n):
                for k in T.unroll(5):
                    part[i] = part[i] + T.shfl_xor(part[i], 16 >> k)
            if tid % 32 == 0:
                for i in T.unroll(n):
                    red[(tid // 32) * n + i] = part[i]
            T.sync_threads()
            if tid < n:
                total = T.alloc_var("float32", init=red[tid])
                for w in T.unroll(1, warps):
                    total = total + red[w * n + tid]
                MG[t, tid] = total

    return apply_mix_bwd


# Exactly the configs the bench launches (tilefuse/bench/mhc.py: the n = 4, C in {2560, 4096, 7168}; the
# backward accumulating, as the v2.1 op does); any other config compiles on first use.
BENCH_N = (4,)
BENCH_C = (2560, 4096, 7168)


def _fwd_configs() -> list[tuple]:
    return [(n, c) for n in BENCH_N for c in BENCH_C]


def _bwd_configs() -> list[tuple]:
    return [(n, c, True) for n in BENCH_N for c in BENCH_C]


_jit.register("mhc_apply_mix_fwd", apply_mix_fwd_kernel, _fwd_configs)
_jit.register("mhc_apply_mix_bwd", apply_mix_bwd_kernel, _bwd_configs)


# ---- launchers (validate nothing: the public ops do) ----

def apply_mix_fwd_launch(x: torch.Tensor, mix: torch.Tensor, o: torch.Tensor) -> None:
    """Write ``o [T, C]`` from ``x [T, n, C]`` and ``mix [T, n]`` (``takes(n, C)``); a misaligned or non-contiguous
    ``o`` is written through an aligned buffer."""
    Tn, n, C = x.shape
    if Tn == 0:
        return
    fn = _jit.get("mhc_apply_mix_fwd", (n, C))
    write_through(o, lambda dst: fn(_launch.aligned(x.contiguous()), _launch.aligned(mix.contiguous()), dst))


def apply_mix_bwd_launch(o_grad: torch.Tensor, x: torch.Tensor, mix: torch.Tensor, x_grad: torch.Tensor,
                         accumulate: bool) -> torch.Tensor:
    """Write (``accumulate``: accumulate into) ``x_grad [T, n, C]``; return a new ``mix_grad [T, n]`` fp32."""
    Tn, n, C = x.shape
    mix_grad = torch.empty((Tn, n), dtype=torch.float32, device=x.device)
    if Tn == 0:
        return mix_grad
    fn = _jit.get("mhc_apply_mix_bwd", (n, C, bool(accumulate)))
    write_through(x_grad, lambda dst: fn(_launch.aligned(o_grad.contiguous()), _launch.aligned(x.contiguous()),
                                         _launch.aligned(mix.contiguous()), dst, mix_grad), read=accumulate)
    return mix_grad


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::mhc_apply_mix_fwd", mutates_args=("o",), device_types="cuda")
def _apply_mix_fwd_op(x: torch.Tensor, mix: torch.Tensor, o: torch.Tensor) -> None:
    apply_mix_fwd_launch(x, mix, o)



@_ops.kernel_op("tilefuse::mhc_apply_mix_bwd", mutates_args=("x_grad",), device_types="cuda")
def _apply_mix_bwd_op(o_grad: torch.Tensor, x: torch.Tensor, mix: torch.Tensor, x_grad: torch.Tensor,
                      accumulate: bool) -> torch.Tensor:
    return apply_mix_bwd_launch(o_grad, x, mix, x_grad, accumulate)


@_apply_mix_bwd_op.register_fake
def _(o_grad, x, mix, x_grad, accumulate):
    return x.new_empty((x.shape[0], x.shape[1]), dtype=torch.float32)


def apply_mix_fwd_cuda(x: torch.Tensor, mix: torch.Tensor, o: torch.Tensor) -> None:
    """CUDA entry (``x [T, n, C]``, ``mix [T, n]``, ``o [T, C]``): a direct launch in eager mode, the custom op
    under ``torch.compile``."""
    if torch.compiler.is_compiling():
        torch.ops.tilefuse.mhc_apply_mix_fwd(x, mix, o)
    else:
        apply_mix_fwd_launch(x, mix, o)


def apply_mix_bwd_cuda(o_grad: torch.Tensor, x: torch.Tensor, mix: torch.Tensor, x_grad: torch.Tensor,
                       accumulate: bool) -> torch.Tensor:
    """CUDA entry of the backward, as ``apply_mix_fwd_cuda``; returns ``mix_grad [T, n]``."""
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.mhc_apply_mix_bwd(o_grad, x, mix, x_grad, accumulate)
    return apply_mix_bwd_launch(o_grad, x, mix, x_grad, accumulate)
