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
