"""TileLang expression helpers shared by the quant kernels (number formats of quant.md 1.x).

Each helper builds an expression while a kernel's ``prim_func`` is traced; none allocates or loops. They are
written for the H200's issue rates: integer, logic, compare and min/max instructions issue at half the rate
of binary32 add/multiply/FMA, so the hot per-element paths lean on FP arithmetic. ``_jit`` folds this file's
source into every kernel's cache key.
"""
from __future__ import annotations

import struct

_MAGIC = 12582912.0  # 1.5 * 2^23: adding it rounds a value in [0, 2^22) to an integer (ulp 1), ties to even
_MAGIC_BITS = 0x4B400000


def _tl():
    import tilelang.language as T

    return T


def statically(n: int) -> tuple:
    """``range(n)`` that TileLang's macro tracer leaves alone (a plain ``range`` in a macro becomes a device
    loop whose variable is symbolic): the loop body is traced n times with Python ints."""
    return tuple(range(n))


def saturate(x):
    """``min(max(x, 0), 1)`` with NaN -> 0, folded by nvcc into the producing FMUL/FFMA/FADD (``.SAT``)."""
    return _tl().call_extern("float32", "__saturatef", x)


def e2m1_steps_of_half(h):
    """int32 whose low 3 bits are the E2M1 magnitude code (0..7) of ``v = 2 h`` (quant.md 1.2: nearest code,
    ties to the even code, saturating at 6; NaN and +-inf give 7); bits 3..21 are zero, bits 22 and up not.
    Callers pass ``h = x * (sf_inv / 2)``: halving the scale is exact, and saves a multiply per element.

    With ``m = min(|h|, 3)`` (NaN -> 3) the code is ``rne(4 min(m, 1)) + rne(2 clamp(m - 1, 0, 1)) +
    rne(clamp(m - 2, 0, 1))``, one term per binade of the grid; each clamp is a saturated add (exact), and
    the terms accumulate by FMA onto 1.5 * 2^23 whose ulp is 1, so each FMA rounds its term to an integer,
    ties to even. A later term is nonzero only when the sum so far is even (4, then 6), so rounding the
    sum rounds the term. The code is the low bits of the result's pattern. Six FP-pipe instructions and one
    min per element; checked against the decision table for every binary32 pattern."""
    T = _tl()
    m = T.min(T.abs(h), T.float32(3.0))
    r = saturate(m) * T.float32(4.0) + T.float32(_MAGIC)
    r = saturate(m - T.float32(1.0)) * T.float32(2.0) + r
    r = saturate(m - T.float32(2.0)) + r
    return T.reinterpret(r, "int32")


def e2m1_pair_byte_of_halves(lo, hi):
    """int32 whose low byte packs the E2M1 nibbles of ``2 lo`` (low nibble) and ``2 hi`` (see
    :func:`e2m1_steps_of_half`): code plus the sign bit of each value (so -0 gives 0x8; a NaN made by the FP
    pipe is positive: code 7). Bits above 7 are not zero."""
    T = _tl()
    codes = e2m1_steps_of_half(lo) + e2m1_steps_of_half(hi) * 16
    signs = (T.shift_right(T.reinterpret(lo, "uint32"), 28) & 8) | (T.shift_right(T.reinterpret(hi, "uint32"), 24) & 128)
    return codes | T.cast(signs, "int32")


def e2m1_nibble_of_half(h):
    """int32 E2M1 nibble (0..15) of ``2 h``: the code and the sign bit (bit 3)."""
    T = _tl()
    return (e2m1_steps_of_half(h) & 7) | T.cast(T.shift_right(T.reinterpret(h, "uint32"), 28) & 8, "int32")


# CUDA device helpers some expressions below call; a kernel that uses them runs ``import_cuda_helpers()`` once
# inside its ``T.Kernel`` block. ``prmt`` is PTX's byte permute in its default mode: selector nibble bit 3
# replicates the sign bit of the chosen byte (0x00 or 0xFF), which CUDA's ``__byte_perm`` does not promise.
CUDA_HELPERS = """
__device__ __forceinline__ unsigned tf_prmt(unsigned a, unsigned b, unsigned s) {
  unsigned d; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s)); return d; }
__device__ __forceinline__ unsigned tf_e2m1_codes_f16x2(unsigned h) {
  // lanes: 1536 + E2M1 code of twice each binary16 lane of h (see e2m1_pack_of_f16_halves)
  unsigned m, s1, s2, s3, r;
  asm("abs.f16x2 %0, %1;" : "=r"(m) : "r"(h));
  asm("min.f16x2 %0, %1, %2;" : "=r"(m) : "r"(m), "r"(0x42004200u));         // 3.0; NaN -> 3.0
  asm("add.sat.f16x2 %0, %1, %2;" : "=r"(s1) : "r"(m), "r"(0x80008000u));    // + (-0.0)
  asm("add.sat.f16x2 %0, %1, %2;" : "=r"(s2) : "r"(m), "r"(0xBC00BC00u));    // - 1.0
  asm("add.sat.f16x2 %0, %1, %2;" : "=r"(s3) : "r"(m), "r"(0xC000C000u));    // - 2.0
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(s1), "r"(0x44004400u), "r"(0x66006600u));  // 4 s1 + 1536
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(s2), "r"(0x40004000u), "r"(r));            // + 2 s2
  asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(s3), "r"(r));                                  // + s3
  return r; }
__device__ __forceinline__ unsigned tf_f16x2(float lo, float hi) {
  unsigned h; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(hi), "f"(lo)); return h; }
__device__ __forceinline__ void tf_store_u32(signed char* p, unsigned w) { *reinterpret_cast<unsigned*>(p) = w; }
__device__ __forceinline__ void tf_store_u16(signed char* p, unsigned w) {
  *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(w); }
"""


def import_cuda_helpers() -> None:
    _tl().import_source(CUDA_HELPERS)


def prmt(a, b, selector: int):
    """PTX ``prmt.b32`` (default mode) of the uint32 words ``a`` (bytes 0-3) and ``b`` (bytes 4-7)."""
    T = _tl()
    return T.call_extern("uint32", "tf_prmt", a, b, T.uint32(selector))


def e2m1_pack_of_halves(h):
    """uint32 holding the E2M1 nibbles of ``2 h[0], 2 h[1], ...`` (4 or 8 binary32 values; element 2k in the
    low nibble of byte k, so 8 values fill the word and 4 fill its low half): codes from
    :func:`e2m1_steps_of_half`, sign bits copied from the values (so -0 gives 0x8, an FP-made NaN 0x7).
    Byte permutes gather the low bytes of the even and odd codes and, replicating each value's sign bit, a
    byte of 0x00/0xFF per value: 15 integer instructions per 8 values instead of ~28 for shift-and-mask."""
    T = _tl()
    n = len(h)
    assert n in (4, 8)
    steps = [T.reinterpret(e2m1_steps_of_half(v), "uint32") for v in h]
    bits = [T.reinterpret(v, "uint32") for v in h]

    def gather(words, low_byte_sel, merge=0x5410):
        # byte 0 (or, with 0xB/0xF selectors, the replicated sign of byte 3) of each word, in order
        pairs = [prmt(words[i], words[i + 1], low_byte_sel) for i in range(0, len(words), 2)]
        return pairs[0] if len(pairs) == 1 else prmt(pairs[0], pairs[1], merge)

    codes = gather(steps[0::2], 0x0040) + gather(steps[1::2], 0x0040) * T.uint32(16)
    signs_even = gather(bits[0::2], 0x00FB)
    signs_odd = gather(bits[1::2], 0x00FB)
    return codes | (signs_even & T.uint32(0x08080808)) | (signs_odd & T.uint32(0x80808080))


def _field_and_exponent(m: float) -> tuple[int, int]:
    bits = struct.unpack("<I", struct.pack("<f", m))[0]
    return bits & 0x7FFFFF, (bits >> 23) - 127


def pow2_sf_exponent(a, fmt_max: float):
    """Biased exponent ``eb`` of ``2^ceil(log2(a / fmt_max))`` (quant.md 1.4's power-of-two sf) without the
    division, for binary32 ``a >= fmt_max * 2^-126`` (normal quotients) or ``a = +inf`` (eb = 255). With
    ``fmt_max = (1 + f) 2^k``, ``a / fmt_max <= 2^n`` exactly when ``bits(a) - f <= (n + k + 127) << 23``.
    Checked against ``bits(a / fmt_max)`` for every binary32 ``a`` in range, for 448 and 6."""
    T = _tl()
    field, exp = _field_and_exponent(fmt_max)
    ab = T.reinterpret(a, "int32")
    return T.if_then_else(ab >= 0x7F800000, 255, T.shift_right(ab - (field + 1), 23) + (1 - exp))


def pow2_from_exponent(eb):
    """``2^(eb - 127)`` as binary32 (eb in 1..255; 255 gives +inf)."""
    T = _tl()
    return T.reinterpret(T.shift_left(eb, 23), "float32")


def pow2_inverse_from_exponent(eb):
    """``2^(127 - eb)``, the reciprocal of :func:`pow2_from_exponent`, exactly; eb = 255 (sf = inf) gives 0."""
    T = _tl()
    return T.reinterpret(T.shift_left(T.max(254 - eb, 0), 23), "float32")


def e2m1_pack_of_f16_halves(h):
    """:func:`e2m1_pack_of_halves` for 8 values computed two at a time in binary16 (packed ``f16x2``
    arithmetic: half the FP instructions). Exact only when every ``h`` is exactly representable in binary16
    or smaller than 2^-14 in magnitude (such values encode to code 0 either way, and the conversion keeps
    their sign), or NaN/inf: true for bf16 inputs scaled by a power of two (8 significant bits), not for
    general binary32 values. Per pair: the binary16 value ``m = min(|h|, 3)`` (NaN -> 3), the three
    saturated binade terms and two FMAs plus an add onto 1536 (ulp 1 in binary16), as in
    :func:`e2m1_steps_of_half`; then the same byte permutes gather codes and signs."""
    T = _tl()
    assert len(h) == 8
    packed = [T.call_extern("uint32", "tf_f16x2", h[2 * k], h[2 * k + 1]) for k in range(4)]
    codes = [T.call_extern("uint32", "tf_e2m1_codes_f16x2", w) for w in packed]

    def gather(words, sel):
        return prmt(prmt(words[0], words[1], sel), prmt(words[2], words[3], sel), 0x5410)

    # lane 0 of each word (byte 0) holds the even element's code, lane 1 (byte 2) the odd one's; the sign
    # bits sit in bytes 1 and 3 (replicated by selector nibbles 0x9 / 0xB and 0xD / 0xF)
    low = gather(codes, 0x0040)
    high = gather(codes, 0x0062)
    signs_even = gather(packed, 0x00D9)
    signs_odd = gather(packed, 0x00FB)
    return (low + high * T.uint32(16)) | (signs_even & T.uint32(0x08080808)) | (signs_odd & T.uint32(0x80808080))


# IEEE quotients of the scale pair (quant.md 1.4: ``a ⊘ M`` and ``M ⊘ a``) in FMA-pipe arithmetic, without
# ``div.rn.f32``: its slow path is a called subroutine, and under a tight launch-bounds register cap ptxas spills
# the values live across that call. Valid for a constant ``M >= 4`` and binary32 ``a`` in ``[M 2^-126, +inf]``
# (both quotients normal, or a = +inf: ``(inf, 0)``); NaN is outside the domain. With ``a = m 2^e``, m in [1, 2),
# ``RN(a / M) = RN(m / M) 2^e`` and ``RN(M / a) = RN(M / m) 2^-e`` (rounding commutes with scaling by a power of
# two while the result is normal), the power of two applied exactly as ``e << 23`` on the bits. ``RN(m / M)``:
# ``q = m R`` (R = RN(1 / M)) and one remainder correction ``q + (m - q M) R``; ``RN(M / m)``: ``y ~ 1 / m`` from
# a linear start and three Newton steps, ``q = M y`` and one remainder correction. Every step is an ``fma.rn`` /
# ``mul.rn`` (no contraction); the result equals IEEE division for every m of the binade, for M = 448 and 6
# (tests/quant/test_per_channel_cast_kernel.py checks all 2^23 of them with an exact binary32 FMA model).
RCP_START = (float.fromhex("0x1.69696ap+0"), float.fromhex("-0x1.e1e1e2p-2"))  # binary32 24/17, -8/17
EXACT_DIV_SRC = """
__device__ __forceinline__ float tf_quot_rn(float a, float M, float R) {
  int ab = __float_as_int(a);
  float m = __int_as_float((ab & 0x007FFFFF) | 0x3F800000);
  int e23 = (ab & 0x7F800000) - 0x3F800000;
  float q = __fmul_rn(m, R);
  q = __fmaf_rn(__fmaf_rn(-q, M, m), R, q);
  return ab >= 0x7F800000 ? a : __int_as_float(__float_as_int(q) + e23); }
__device__ __forceinline__ float tf_inv_quot_rn(float M, float a) {
  int ab = __float_as_int(a);
  float m = __int_as_float((ab & 0x007FFFFF) | 0x3F800000);
  int e23 = (ab & 0x7F800000) - 0x3F800000;
  float y = __fmaf_rn(m, %(c1)s, %(c0)s);
  for (int i = 0; i < 3; ++i) y = __fmaf_rn(y, __fmaf_rn(-m, y, 1.0f), y);
  float q = __fmul_rn(M, y);
  q = __fmaf_rn(__fmaf_rn(-q, m, M), y, q);
  return ab >= 0x7F800000 ? 0.0f : __int_as_float(__float_as_int(q) - e23); }
""" % {"c0": RCP_START[0].hex() + "f", "c1": RCP_START[1].hex() + "f"}


def _rcp_f32(m: float) -> float:
    """RN(1 / m) in binary32, for a binary32 m."""
    import numpy as np

    return float(np.float32(1.0) / np.float32(m))


def exact_quotient(a, fmt_max: float):
    """``a ⊘ fmt_max`` bit for bit (IEEE binary32 division) for ``a`` in the domain above; needs
    ``EXACT_DIV_SRC`` imported by the kernel."""
    T = _tl()
    assert fmt_max >= 4.0
    return T.call_extern("float32", "tf_quot_rn", a, T.float32(fmt_max), T.float32(_rcp_f32(fmt_max)))


def exact_inverse_quotient(fmt_max: float, a):
    """``fmt_max ⊘ a`` bit for bit (IEEE binary32 division) for ``a`` in the domain above (+inf gives 0); needs
    ``EXACT_DIV_SRC`` imported by the kernel."""
    T = _tl()
    assert fmt_max >= 4.0
    return T.call_extern("float32", "tf_inv_quot_rn", T.float32(fmt_max), a)
