"""TileLang kernel for ``per_token_cast_and_cast_back`` (quant.md 5.8; formats 1.1, 1.2, 1.4), in place.

Per ``(1, npc)`` group: amax of ``|x|`` (binary32), ``a = max(amax, clamp)``, then sf and sf_inv by the rule of
1.4 (plain IEEE divisions, the power-of-two bit rule, or an E4M3 sf with ``sf_inv = 1 / float(sf_q)``), and
``x <- round_{x.dtype}(decode(narrow(x * sf_inv)) * sf)``. Fast-math is off, so every division is IEEE.

Mapping: CTA ``(row, bx)`` owns vectors ``(bx * R + j) * THREADS + tx`` (j < R) of one row (see ``tile``: R up
to R_MAX, a 7168-wide bf16 row in one CTA of 7; no per-element index division). A group is ``L = npc / E``
consecutive vectors (E elements of 16 bytes), always L aligned lanes of one warp because ``H % npc == 0``;
its maximum is a register max and a shuffle butterfly over those lanes. Every thread runs the shuffles
(out-of-range columns hold zeros), so the butterfly never diverges. Only the loaded vectors stay live from the
loads to the stores (each pass widens them to binary32 again), and each group's sf pair is computed just
before its quantize, where the fewest vectors are live across the divisions' slow-path calls. No shared
memory, no atomics, no dependence on T: deterministic, batch-invariant.
"""
import torch

from tilefuse import _jit, _ops
from tilefuse import formats as F
from tilefuse.quant import _tl
from tilefuse.quant._cast_back_kernel import _decode_e2m1  # fp32 of an E2M1 nibble (bit assembly)

_TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
# Tuning knobs (TILEFUSE_KNOBS, see _jit.knobs); none changes a result bit.
THREADS = 128
R_MAX = 8         # at most R_MAX vectors (16 R_MAX bytes) per thread
MIN_BLOCKS = 8    # __launch_bounds__(THREADS, MIN_BLOCKS): a cap of 65536 / (THREADS MIN_BLOCKS) registers (0: none)
# R per config: BALANCE_R spreads a row over the fewest CTAs that hold it at <= R_MAX vectors per thread, with the
# fewest vectors per thread that still cover it (18432 bf16: 3 CTAs of 6, not 3 of 8 with a quarter idle);
# otherwise R = min(R_MAX, ceil(vectors per row / THREADS)).
BALANCE_R = True
# WIDE_TILE keeps a binary32 copy of the whole tile from the amax pass to the quantize pass (8 registers per
# bf16 vector, which spills under the register cap from R = 7 on); otherwise only the loaded 16-byte vectors
# stay live (4 registers each) and every pass widens them again (the widening of bf16 is exact and cheap).
WIDE_TILE = False
# The cap of e2m1 configs whose sf takes IEEE divisions (sf modes plain and e4m3): each division's slow-path
# call pins registers, and with the e2m1 arithmetic R = 7 spills under 64 registers (None: MIN_BLOCKS).
E2M1_DIV_MIN_BLOCKS = 6


def tile(x_dtype: str, hidden: int) -> tuple[int, int]:
    """(R, NX) of a config: vectors per thread and CTAs per row."""
    vpr = hidden // (16 // (2 if x_dtype == "bfloat16" else 4))
    if BALANCE_R:
        nx = -(-vpr // (THREADS * R_MAX))
        return -(-vpr // (THREADS * nx)), nx
    r = min(R_MAX, -(-vpr // THREADS))
    return r, -(-vpr // (THREADS * r))


def e2m1_nibble(v):
    """int32 E2M1 code of binary32 ``v`` (quant.md 1.2): the magnitude rounded to the nearest code, ties to
    even (the tie points 0.25, 1.25, 2.5 and 5 go down; 0.75, 1.75 and 3.5 go up), saturated at 6.0; sign bit
    copied. NaN inputs are outside the contract (1.7)."""
    import tilelang.language as T

    m = T.abs(v)
    code = (T.cast(m > T.float32(0.25), "int32") + T.cast(m >= T.float32(0.75), "int32")
            + T.cast(m > T.float32(1.25), "int32") + T.cast(m >= T.float32(1.75), "int32")
            + T.cast(m > T.float32(2.5), "int32") + T.cast(m >= T.float32(3.5), "int32")
            + T.cast(m > T.float32(5.0), "int32"))
    sign = T.shift_right(T.reinterpret(v, "int32"), 28) & 8
    return code | sign


def sf_and_inv(a, fmt: str, sf_mode: str):
    """(sf, sf_inv) of quant.md 1.4 from the clamped amax ``a`` (binary32 expressions).

    sf_mode "plain": ``a / M`` and ``M / a``; "round": ``2^E`` and ``2^-E`` from the exponent bits of
    ``a / M``; "e4m3": ``sf = float(e4m3_satfinite(a / M))`` (RNE) and ``sf_inv = 1 / sf``."""
    import tilelang.language as T

    M = T.float32(F.FMT_MAX[fmt])
    if sf_mode == "round":
        # division-free 2^ceil(log2(a / M)); the clamp keeps a >= M 2^-126, and an infinite amax gives
        # eb = 255: sf = inf and sf_inv = 0 (quant.md 1.7), where (254 - eb) << 23 would give -inf
        eb = _tl.pow2_sf_exponent(a, F.FMT_MAX[fmt])
        return _tl.pow2_from_exponent(eb), _tl.pow2_inverse_from_exponent(eb)
    if sf_mode == "e4m3":
        s = T.min(a / M, T.float32(448.0))  # satfinite: a / M >= 0, so only the top needs a clamp
        sf = T.cast(T.cast(s, "float8_e4m3fn"), "float32")
        return sf, T.float32(1.0) / sf
    return a / M, M / a


def cast_and_cast_back_kernel(x_dtype: str, fmt: str, hidden: int, npc: int, sf_mode: str):
    """Factory: in-place quantize-dequantize of a ``(T, hidden)`` tensor with symbolic T and row stride S.

    x_dtype: "bfloat16" | "float32"; fmt: "e4m3" | "e2m1"; sf_mode: "plain" | "round" | "e4m3" (1.4)."""
    import tilelang.language as T

    eb_ = 2 if x_dtype == "bfloat16" else 4
    E = 16 // eb_                    # elements per 16-byte vector
    L = npc // E                     # lanes per group (2..32, a power of two)
    assert hidden % npc == 0 and npc % E == 0 and 1 <= L <= 32 and L & (L - 1) == 0
    clamp = F.default_clamp_min(fmt, sf_mode == "e4m3")
    Tn, S = T.dynamic("num_tokens, row_stride")

    x_param = T.StridedTensor((Tn, hidden), (S, 1), x_dtype)
    R, NX = tile(x_dtype, hidden)  # R vectors per thread, all loaded before the first is used; NX CTAs per row
    min_blocks = MIN_BLOCKS
    if fmt == "e2m1" and sf_mode != "round" and E2M1_DIV_MIN_BLOCKS is not None:
        min_blocks = E2M1_DIV_MIN_BLOCKS

    @T.prim_func
    def cast_and_cast_back(X: x_param):
        T.assume(S % E == 0)
        with T.Kernel(Tn, NX, threads=THREADS) as (row, bx):  # rows on grid x (y is limited to 65535)
            if min_blocks:
                T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            raw = T.alloc_local((R, E), x_dtype)
            am = T.alloc_local((R,), "float32")
            if WIDE_TILE:
                v = T.alloc_local((R, E), "float32")
            for j in T.unroll(R):
                col = ((bx * R + j) * THREADS + tx) * E
                if col < hidden:
                    for e in T.vectorized(E):
                        raw[j, e] = X[row, col + e]
                else:
                    for e in T.vectorized(E):
                        raw[j, e] = T.cast(0, x_dtype)
            for j in T.unroll(R):
                am[j] = T.float32(0.0)
                for e in T.unroll(E):
                    if WIDE_TILE:
                        v[j, e] = T.cast(raw[j, e], "float32")
                        am[j] = T.max(am[j], T.abs(v[j, e]))
                    else:
                        am[j] = T.max(am[j], T.abs(T.cast(raw[j, e], "float32")))
                for st in T.unroll(L.bit_length() - 1):
                    am[j] = T.max(am[j], T.shfl_xor(am[j], T.shift_right(L // 2, st)))
            for j in T.unroll(R):
                col = ((bx * R + j) * THREADS + tx) * E
                sf, inv = sf_and_inv(T.max(am[j], T.float32(clamp)), fmt, sf_mode)
                if fmt == "e4m3":
                    # the E4M3 conversion saturates finite values to +-448 and keeps NaN (as the reference)
                    qb = T.alloc_local((E,), "float8_e4m3fn")
                    for e in T.vectorized(E):
                        if WIDE_TILE:
                            qb[e] = T.cast(v[j, e] * inv, "float8_e4m3fn")
                        else:
                            qb[e] = T.cast(T.cast(raw[j, e], "float32") * inv, "float8_e4m3fn")
                    for e in T.unroll(E):
                        raw[j, e] = T.cast(T.cast(qb[e], "float32") * sf, x_dtype)
                else:
                    for e in T.unroll(E):
                        # halving the scaled value is exact where the code is decided (normal range);
                        # NaN gives code 7 (quant.md 1.7)
                        xv = v[j, e] if WIDE_TILE else T.cast(raw[j, e], "float32")
                        d = _decode_e2m1(_tl.e2m1_nibble_of_half((xv * inv) * T.float32(0.5)))
                        raw[j, e] = T.cast(d * sf, x_dtype)
                if col < hidden:
                    for e in T.vectorized(E):
                        X[row, col + e] = raw[j, e]

    return cast_and_cast_back


def _sf_mode(round_sf: bool, use_e4m3_sf: bool) -> str:
    return "round" if round_sf else ("e4m3" if use_e4m3_sf else "plain")


BENCH_HIDDEN = (1536, 2048, 4096, 7168, 18432)  # tilefuse.bench.quant.HIDDEN


def _bench_configs() -> list[tuple]:
    """The configs the bench launches (tilefuse.bench.quant): bf16 input, e4m3 and e2m1, npc 128, plain and
    rounded sf, at every grid hidden size, as (x dtype, format, hidden, npc, sf mode). Other configs compile on
    first use."""
    return [("bfloat16", fmt, h, 128, mode) for fmt in ("e4m3", "e2m1") for h in BENCH_HIDDEN
            for mode in ("plain", "round")]


_jit.register("per_token_cast_and_cast_back", cast_and_cast_back_kernel, _bench_configs)


def cast_and_cast_back_launch(x: torch.Tensor, fmt: str, num_per_channels: int, round_sf: bool = False,
                              use_e4m3_sf: bool = False) -> None:
    """Quantize-dequantize ``x`` in place (quant.md 5.8). Validates nothing: the public op does.

    A row stride that is not a multiple of 16 bytes, or an unaligned base, goes through a contiguous copy
    that is written back."""
    t, h = x.shape
    if t == 0:
        return
    cfg = (_TL_DTYPE[x.dtype], fmt, h, num_per_channels, _sf_mode(round_sf, use_e4m3_sf))
    fn = _jit.get("per_token_cast_and_cast_back", cfg)
    vec = 16 // x.element_size()
    if x.data_ptr() % 16 or (t > 1 and x.stride(0) % vec):
        y = x.clone(memory_format=torch.contiguous_format)  # aligned even where x is contiguous
        fn(y)
        x.copy_(y)
    else:
        fn(x)


@_ops.kernel_op("tilefuse::per_token_cast_and_cast_back", mutates_args=("x",), device_types="cuda")
def _cast_and_cast_back_op(x: torch.Tensor, fmt: str, num_per_channels: int, round_sf: bool,
                           use_e4m3_sf: bool) -> None:
    cast_and_cast_back_launch(x, fmt, num_per_channels, round_sf, use_e4m3_sf)



def per_token_cast_and_cast_back_cuda(x: torch.Tensor, fmt: str, num_per_channels: int, round_sf: bool = False,
                                      use_e4m3_sf: bool = False) -> None:
    """CUDA entry for the public ``per_token_cast_and_cast_back`` (in place, returns None)."""
    if torch.compiler.is_compiling():
        torch.ops.tilefuse.per_token_cast_and_cast_back(x, fmt, num_per_channels, round_sf, use_e4m3_sf)
    else:
        cast_and_cast_back_launch(x, fmt, num_per_channels, round_sf, use_e4m3_sf)
