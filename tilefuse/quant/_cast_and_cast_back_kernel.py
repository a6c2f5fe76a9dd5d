"""TileLang kernel for ``per_token_cast_and_cast_back`` (quant.md 5.8; formats 1.1, 1.2, 1.4), in place.

Per ``(1, npc)`` group: amax of ``|x|`` (binary32), ``a = max(amax, clamp)``, then sf and sf_inv by the rule of
1.4 (plain IEEE divisions, the power-of-two bit rule, or an E4M3 sf with ``sf_inv = 1 / float(sf_q)``), and
``x <- round_{x.dtype}(decode(narrow(x * sf_inv)) * sf)``. Fast-math is off, so every division is IEEE.

Mapping: the (row, 16-byte vector) pairs of the tensor are numbered row-major; thread ``tx`` of CTA ``bx``
owns pairs ``(bx * R + j) * threads + tx``. A group is ``L = npc / E`` consecutive vectors (E elements of
16 bytes), always L aligned lanes of one warp because ``H % npc == 0``; its maximum is a register max and a
shuffle butterfly over those lanes. Every thread runs the shuffles (out-of-range rows hold zeros), so the
butterfly never diverges. No shared memory, no atomics, no dependence on T: deterministic, batch-invariant.
"""
import torch

from tilefuse import _jit
from tilefuse import formats as F
from tilefuse.quant._cast_back_kernel import _decode_e2m1  # fp32 of an E2M1 nibble (bit assembly)

_TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_THREADS = 256
_R = 2  # vectors per thread, all loaded before the first is used


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
        bits = T.reinterpret(a / M, "int32")
        eb = T.shift_right(bits - 1, 23) + 1  # biased exponent of 2^ceil(log2(a / M))
        return (T.reinterpret(T.shift_left(eb, 23), "float32"),
                T.reinterpret(T.shift_left(254 - eb, 23), "float32"))
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
    VPR = hidden // E                # vectors per row
    clamp = F.default_clamp_min(fmt, sf_mode == "e4m3")
    Tn, S = T.dynamic("num_tokens, row_stride")

    x_param = T.StridedTensor((Tn, hidden), (S, 1), x_dtype)

    @T.prim_func
    def cast_and_cast_back(X: x_param):
        T.assume(S % E == 0)
        with T.Kernel(T.ceildiv(Tn * VPR, _THREADS * _R), threads=_THREADS) as bx:
            tx = T.get_thread_binding()
            raw = T.alloc_local((_R, E), x_dtype)
            am = T.alloc_local((_R,), "float32")
            for j in T.unroll(_R):
                p = (bx * _R + j) * _THREADS + tx
                row = p // VPR
                col = (p % VPR) * E
                if row < Tn:
                    for e in T.vectorized(E):
                        raw[j, e] = X[row, col + e]
                else:
                    for e in T.vectorized(E):
                        raw[j, e] = T.cast(0, x_dtype)
            for j in T.unroll(_R):
                am[j] = T.float32(0.0)
                for e in T.unroll(E):
                    am[j] = T.max(am[j], T.abs(T.cast(raw[j, e], "float32")))
                for st in T.unroll(L.bit_length() - 1):
                    am[j] = T.max(am[j], T.shfl_xor(am[j], T.shift_right(L // 2, st)))
            for j in T.unroll(_R):
                p = (bx * _R + j) * _THREADS + tx
                row = p // VPR
                col = (p % VPR) * E
                sf, inv = sf_and_inv(T.max(am[j], T.float32(clamp)), fmt, sf_mode)
                for e in T.unroll(E):
                    q = T.cast(raw[j, e], "float32") * inv
                    if fmt == "e4m3":
                        d = T.cast(T.cast(T.max(T.min(q, T.float32(448.0)), T.float32(-448.0)), "float8_e4m3fn"),
                                   "float32")
                    else:
                        d = _decode_e2m1(e2m1_nibble(q))
                    raw[j, e] = T.cast(d * sf, x_dtype)
                if row < Tn:
                    for e in T.vectorized(E):
                        X[row, col + e] = raw[j, e]

    return cast_and_cast_back


def _sf_mode(round_sf: bool, use_e4m3_sf: bool) -> str:
    return "round" if round_sf else ("e4m3" if use_e4m3_sf else "plain")


HIDDEN_SIZES = (576, 2048, 2560, 3072, 4096, 6144, 7168)  # quant.md 7.1 (bench shapes)


def test_configs() -> list[tuple]:
    """The configs the GPU tier uses (and the compile tier builds)."""
    cfgs = [(xd, fmt, 2048, 128, mode) for xd in ("bfloat16", "float32") for fmt in ("e4m3", "e2m1")
            for mode in ("plain", "round", "e4m3")]
    cfgs += [("bfloat16", "e4m3", 2048, npc, "plain") for npc in (16, 32, 64)]
    cfgs += [("float32", "e2m1", 2048, 16, "round")]
    return cfgs


def _configs() -> list[tuple]:
    cfgs = test_configs()
    cfgs += [c for c in (("bfloat16", "e4m3", h, 128, "round") for h in HIDDEN_SIZES if h % 128 == 0) if c not in cfgs]
    return cfgs


_jit.register("per_token_cast_and_cast_back", cast_and_cast_back_kernel, _configs)


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
        y = x.contiguous()
        fn(y)
        x.copy_(y)
    else:
        fn(x)


@torch.library.custom_op("tilefuse::per_token_cast_and_cast_back", mutates_args=("x",), device_types="cuda")
def _cast_and_cast_back_op(x: torch.Tensor, fmt: str, num_per_channels: int, round_sf: bool,
                           use_e4m3_sf: bool) -> None:
    cast_and_cast_back_launch(x, fmt, num_per_channels, round_sf, use_e4m3_sf)


@_cast_and_cast_back_op.register_fake
def _(x, fmt, num_per_channels, round_sf, use_e4m3_sf):
    return None


def per_token_cast_and_cast_back_cuda(x: torch.Tensor, fmt: str, num_per_channels: int, round_sf: bool = False,
                                      use_e4m3_sf: bool = False) -> None:
    """CUDA entry for the public ``per_token_cast_and_cast_back`` (in place, returns None)."""
    if torch.compiler.is_compiling():
        torch.ops.tilefuse.per_token_cast_and_cast_back(x, fmt, num_per_channels, round_sf, use_e4m3_sf)
    else:
        cast_and_cast_back_launch(x, fmt, num_per_channels, round_sf, use_e4m3_sf)
