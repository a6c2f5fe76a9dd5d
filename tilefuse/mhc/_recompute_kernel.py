"""TileLang kernel of ``mhc_multilayer_recompute`` (mhc.md §2.9): the apply-mix / post chain of L layers in one
pass over the tokens.

Layout: the public tensors are viewed flat, ``initial_residual`` and ``residual_list[l]`` ``[T, n, C]``,
``layer_output_list[l]`` and ``layer_input_list[l]`` ``[T, C]``, ``pre_mix_list[l]`` and ``post_mix_list[l]``
``[T, n]``, ``comb_mix_list[l]`` ``[T, n, n]`` (``comb[t, i, o]``: input stream i to output stream o). A *lane* is
``V = 8`` adjacent columns of one token (one 16-byte bf16 vector per stream); one thread per lane over the flattened
``T * C / V`` lanes, as the post forward.

A thread loads its lane of the initial residual once and keeps the current residual (bf16, n vectors) in registers;
for each layer l it loads the token's mixes (the same addresses for all lanes of a token: L1 broadcasts) and its
lane of ``layer_output_list[l]``, writes ``layer_input_list[l] = bf(apply_mix(pre_l, R^l))`` and, for l < P,
``residual_list[l] = R^{l+1} = bf(post(post_l, y_l, comb_l, R^l))``, which the next layer reads as the rounded bf16
value it stored. The per-element chains are ``tilefuse.mhc._chains``: the post kernel's own expression and the
apply-mix kernel's sequence of rounded operations, so the results are bit-identical to the layer-by-layer chain
(§2.9).

Bytes per token (bf16 2, fp32 4): the chain reads the residual twice per layer (apply, then post), ``L (2nC + 4n +
2C) + P (2C + 2nC + 4n + 4n^2 + 2nC)``; the fused kernel reads the initial residual once and every other tensor once,
``2nC + L (4n + 2C) + P (2C + 4n + 4n^2 + 2nC)``: 2.19x fewer at n = 4, L = P = 10 and C in {2560, 4096, 7168}
(4.30 GB against 9.40 GB at T = 8192, C = 4096). That is every tensor once, the bench's ``io_fused`` count.

Arguments: the L (or P) tensors of a list are L (or P) separate kernel parameters, in the public op's argument order
(the kernel is specialised on ``(n, C, L, P)``; the token count is a runtime 64-bit value). TileLang's ``prim_func``
has a fixed signature, so the factory declares the lists' parameters with the IR builder's ``arg`` as the body's
first statements, after the signature's one (the initial residual).

Speed: docs/BENCHMARKS.md (its mHC and Engram section). ptxas (sm_90, no spills): n = 4, L = P = 10 takes 128
registers (``MIN_BLOCKS``), n = 8 236 (2 CTAs an SM; no bench case has n = 8).

Kernel constraints: ``n`` in ``KERNEL_N``, ``C % 8 == 0``, contiguous tensors (``takes``; the public op runs the
layer-by-layer chain for anything else); the launcher gives the kernel 16-byte aligned copies of misaligned ones.
"""
import torch

from tilefuse import _jit, _launch, _ops
from tilefuse.mhc import _chains

KERNEL_HELPERS = ("tilefuse.mhc._chains", "tilefuse._rn")  # part of this module's cache key (_jit._module_digest)

# ---- tuning knobs (TILEFUSE_KNOBS; results unchanged) ----
THREADS = 128  # threads per CTA (one lane each)
# __launch_bounds__' minimum CTAs per SM (0: TileLang's default, no register cap). ptxas (sm_90, n = 4, L = P = 10):
# uncapped 128 registers, no spills (4 CTAs, 16 warps an SM); 6 -> 80 registers, 4 bytes spilled; 8 -> 64 registers,
# about 1 KB spilled a thread. Not measured on a GPU: the first knob to sweep.
MIN_BLOCKS = 0

V = 8                # bf16 columns per lane: one 16-byte vector
KERNEL_N = (2, 4, 8)  # multiplicities the kernel is built for (those of the post kernels)


def recompute_kernel(n: int, C: int, L: int, P: int):
    """Factory: L layers with P post steps (``P in (L, L - 1)``) of ``n`` streams of ``C`` columns.

    Arguments at launch, in order: ``R0`` bf16 ``[T, n, C]``; ``PRE_l`` fp32 ``[T, n]`` (L); ``Y_l`` bf16
    ``[T, C]`` (P); ``PM_l`` fp32 ``[T, n]`` (P); ``CM_l`` fp32 ``[T, n, n]`` (P); outputs ``LI_l`` bf16 ``[T, C]`` (L)
    and ``RS_l`` bf16 ``[T, n, C]`` (P); contiguous, 16-byte aligned.
    """
    import tilelang.language as T
    from tvm.script.ir_builder import tirx as ir

    assert n in KERNEL_N and C % V == 0 and C > 0 and L >= 1 and P in (L, L - 1), (n, C, L, P)
    lanes = C // V
    threads = THREADS
    Tn = T.dynamic("num_tokens", "int64")
    bf, f32 = "bfloat16", "float32"
    layers = [(l, l < P) for l in range(L)]  # a Python list: the loop over it is unrolled while tracing

    def params(prefix: str, count: int, shape: tuple, dtype: str) -> list:
        """``count`` more kernel parameters (a list's tensors), declared in order after the signature's."""
        return [ir.arg(f"{prefix}{l}", T.Tensor(shape, dtype)) for l in range(count)]

    @T.prim_func
    def mhc_recompute(R0: T.Tensor((Tn, n, C), bf)):
        PRE = params("PRE", L, (Tn, n), f32)
        Y = params("Y", P, (Tn, C), bf)
        PM = params("PM", P, (Tn, n), f32)
        CM = params("CM", P, (Tn, n, n), f32)
        LI = params("LI", L, (Tn, C), bf)
        RS = params("RS", P, (Tn, n, C), bf)
        with T.Kernel(T.ceildiv(Tn * lanes, threads), threads=threads) as bx:
            if MIN_BLOCKS:
                T.annotate_min_blocks_per_sm(MIN_BLOCKS)
            tid = T.get_thread_binding()
            rv = T.alloc_local((n * V,), bf)   # the current residual R^l: stream i at [i * V, (i + 1) * V)
            nv = T.alloc_local((n * V,), bf)   # R^{l+1}
            yv = T.alloc_local((V,), bf)
            mv = T.alloc_local((n,), f32)      # pre mix
            pv = T.alloc_local((n,), f32)      # post mix
            cv = T.alloc_local((n * n,), f32)  # comb mix, [i * n + o]
            ov = T.alloc_local((V,), bf)
            g = T.cast(bx, "int64") * threads + tid
            if g < Tn * lanes:
                t = g // lanes
                c = (g % lanes) * V
                for i in T.unroll(n):
                    for e in T.vectorized(V):
                        rv[i * V + e] = R0[t, i, c + e]
                for l, has_post in layers:
                    for e in T.vectorized(n):
                        mv[e] = PRE[l][t, e]
                    if has_post:
                        for e in T.vectorized(n):
                            pv[e] = PM[l][t, e]
                        for i in T.unroll(n):
                            for e in T.vectorized(n):
                                cv[i * n + e] = CM[l][t, i, e]
                        for e in T.vectorized(V):
                            yv[e] = Y[l][t, c + e]
                    # layer_input_list[l] = bf(apply_mix(pre_l, R^l))
                    for e in T.unroll(V):
                        ov[e] = T.cast(_chains.apply_mix([mv[i] for i in range(n)],
                                                         [T.cast(rv[i * V + e], f32) for i in range(n)]), bf)
                    for e in T.vectorized(V):
                        LI[l][t, c + e] = ov[e]
                    if has_post:
                        # residual_list[l] = R^{l+1} = bf(post(post_l, y_l, comb_l, R^l)), kept for layer l + 1
                        for o in T.unroll(n):
                            for e in T.unroll(V):
                                nv[o * V + e] = T.cast(_chains.post(pv[o], T.cast(yv[e], f32),
                                                                    [cv[i * n + o] for i in range(n)],
                                                                    [T.cast(rv[i * V + e], f32) for i in range(n)]),
                                                       bf)
                            for e in T.vectorized(V):
                                RS[l][t, o, c + e] = nv[o * V + e]
                        for k in T.unroll(n * V):
                            rv[k] = nv[k]

    return mhc_recompute


# The bench's launches (tilefuse/bench/mhc.py: mhc.md §4's L = P = 10 layers, n = 4, at the issue's C in {2560,
# 4096, 7168}); any other config compiles on first use.
BENCH_C = (2560, 4096, 7168)
BENCH_LAYERS = 10


def _configs() -> list[tuple]:
    return [(4, c, BENCH_LAYERS, BENCH_LAYERS) for c in BENCH_C]


_jit.register("mhc_multilayer_recompute", recompute_kernel, _configs)


# ---- launcher (validates nothing: the public op does) ----

def takes(initial_residual: torch.Tensor, *lists) -> bool:
    """Whether the kernel takes these (validated: contiguous, one device, §2.9's dtypes and shapes) arguments: CUDA
    tensors, ``n`` in ``KERNEL_N`` and ``C % 8 == 0``. Anything else runs the layer-by-layer chain. (Alignment is
    the launcher's: it holds no data pointer here, so ``torch.compile`` traces this.)"""
    n, C = initial_residual.shape[-2:]
    return initial_residual.is_cuda and n in KERNEL_N and C % V == 0 and C > 0


def recompute_launch(initial_residual: torch.Tensor, pre_mix_list, layer_output_list, post_mix_list, comb_mix_list,
                     layer_input_list, residual_list) -> None:
    """Launch the kernel on the contiguous public tensors of §2.9 (``takes`` holds): views them flat and binds them
    in the kernel's parameter order. An input whose data is not on a 16-byte boundary is copied into an aligned one,
    and such an output is written through an aligned buffer copied back."""
    n, C = initial_residual.shape[-2:]
    tokens = initial_residual.numel() // (n * C)
    if tokens == 0:
        return
    L, P = len(pre_mix_list), len(post_mix_list)
    ins = [initial_residual.view(tokens, n, C)]
    ins += [m.view(tokens, n) for m in pre_mix_list]
    ins += [y.view(tokens, C) for y in layer_output_list]
    ins += [m.view(tokens, n) for m in post_mix_list]
    ins += [m.view(tokens, n, n) for m in comb_mix_list]
    outs = [o.view(tokens, C) for o in layer_input_list] + [r.view(tokens, n, C) for r in residual_list]
    bufs = [o if o.data_ptr() % 16 == 0 else torch.empty_like(o) for o in outs]
    _jit.get("mhc_multilayer_recompute", (n, C, L, P))(*[_launch.aligned(t) for t in ins], *bufs)
    for o, b in zip(outs, bufs):
        if b is not o:
            o.copy_(b)


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::mhc_multilayer_recompute", mutates_args=("layer_input_list", "residual_list"),
                device_types="cuda")
def _recompute_op(initial_residual: torch.Tensor, pre_mix_list: list[torch.Tensor],
                  layer_output_list: list[torch.Tensor], post_mix_list: list[torch.Tensor],
                  comb_mix_list: list[torch.Tensor], layer_input_list: list[torch.Tensor],
                  residual_list: list[torch.Tensor]) -> None:
    recompute_launch(initial_residual, pre_mix_list, layer_output_list, post_mix_list, comb_mix_list,
                     layer_input_list, residual_list)


def recompute_cuda(initial_residual, pre_mix_list, layer_output_list, post_mix_list, comb_mix_list,
                   layer_input_list, residual_list) -> None:
    """CUDA entry: a direct launch in eager mode, the custom op under ``torch.compile``."""
    args = (initial_residual, list(pre_mix_list), list(layer_output_list), list(post_mix_list), list(comb_mix_list),
            list(layer_input_list), list(residual_list))
    if torch.compiler.is_compiling():
        torch.ops.tilefuse.mhc_multilayer_recompute(*args)
    else:
        recompute_launch(*args)
