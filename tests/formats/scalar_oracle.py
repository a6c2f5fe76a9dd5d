"""Independent scalar formulations of quant.md sections 1.1-1.4 and 1.6 for the format and cast tests.

Python floats (binary64) with explicit rounding to binary32: a binary32 product or quotient of binary32
operands computed in binary64 and rounded once is the correctly rounded binary32 result. Nothing here
imports tilefuse.
"""
from __future__ import annotations

import bisect
import math
import struct


def f32(x: float) -> float:
    """Python float rounded to binary32 (inf if it overflows)."""
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


# ---------------------------------------------------------------------------------------------- E4M3

def e4m3_value(byte: int) -> float:
    """Value of an E4M3 byte from the section 1.1 field layout (NaN for S.1111.111)."""
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    mag = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


_E4M3_POS = [e4m3_value(c) for c in range(0x7F)]  # increasing with the code


def e4m3_nearest(v: float) -> int:
    """Saturate to +-448, then the nearest finite code with ties to the even code; sign from v's sign."""
    if math.isnan(v):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    m = min(abs(v), 448.0)
    k = bisect.bisect_left(_E4M3_POS, m)
    cands = [c for c in (k - 1, k) if 0 <= c < 0x7F]
    return sign | min(cands, key=lambda c: (abs(_E4M3_POS[c] - m), c & 1))


# ---------------------------------------------------------------------------------------------- E2M1

E2M1_MAG = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_nearest(v: float) -> int:
    """Nearest magnitude code (ties to the even code, saturating at 6), sign bit copied."""
    if math.isnan(v):
        return 0x7
    best = min(range(8), key=lambda k: (abs(E2M1_MAG[k] - min(abs(v), 6.0)), k & 1))
    return best | (8 if math.copysign(1.0, v) < 0 else 0)


def e2m1_value(code: int) -> float:
    mag = E2M1_MAG[code & 7]
    return -mag if code & 8 else mag


# ---------------------------------------------------------------------------------------------- E5M6

_HALF_POS = sorted(struct.unpack("<e", struct.pack("<H", h))[0] for h in range(0x7C00))


def e5m6_code(v: float) -> int:
    """Section 1.3 step by step, the round-toward-zero binary16 found by search in the value table."""
    v = f32(v)
    a = abs(v)
    if a >= 65536.0:
        h = 0x7C00
    else:
        h = struct.unpack("<H", struct.pack("<e", _HALF_POS[bisect.bisect_right(_HALF_POS, a) - 1]))[0]
    h |= 0x8000 if math.copysign(1, v) < 0 else 0
    t = h >> 4
    r = f32_bits(v) & 0x1FFFF
    if (t & 1) + r > 0x10000:
        t += 1
    return t & 0xFFF


def e5m6_value(code: int) -> float:
    return struct.unpack("<e", struct.pack("<H", (code & 0xFFF) << 4))[0]


# ---------------------------------------------------------------------------------------------- scales

FMT_MAX = {"e4m3": 448.0, "e2m1": 6.0, "e5m6": 65024.0}
CLAMP = {"e4m3": f32(1e-4), "e2m1": 6 * 2.0 ** -126, "e5m6": f32(1e-4)}
NEAREST = {"e4m3": e4m3_nearest, "e2m1": e2m1_nearest, "e5m6": e5m6_code}
VALUE = {"e4m3": e4m3_value, "e2m1": e2m1_value, "e5m6": e5m6_value}


def scale(amax: float, fmt: str, round_sf: bool) -> tuple[float, float]:
    """Section 1.4: (sf, sf_inv) of one block from its amax."""
    a = max(amax, CLAMP[fmt])
    M = FMT_MAX[fmt]
    if not round_sf:
        return f32(a / M), f32(M / a)
    s = f32(a / M)
    mant, e = math.frexp(s)  # s = mant * 2^e, 0.5 <= mant < 1
    E = e - 1 if mant == 0.5 else e
    return 2.0 ** E, 2.0 ** -E


def block_cast(rows: list[list[float]], fmt: str, bm: int, bk: int, round_sf: bool,
               sf_in: list[list[float]] | None = None, order: str = "A", given_sf=None):
    """Block quantization by loops: returns (codes[T][W], sf[nbm][nbk]).

    ``rows`` are binary32 values (or the e4m3/e2m1 data values of a pair whose per-element input sf is
    ``sf_in``); ``order`` picks A ``d * (sf_in * sf_inv)`` or B ``(d * sf_in) * sf_inv`` for pairs;
    ``given_sf`` is precomputed mode (``sf_inv = 1 / sf``).
    """
    T, W = len(rows), len(rows[0]) if rows else 0
    nbm, nbk = -(-T // bm), -(-W // bk)
    deq = rows if sf_in is None else [[f32(d * s) for d, s in zip(r, q)] for r, q in zip(rows, sf_in)]
    sf = [[0.0] * nbk for _ in range(nbm)]
    inv = [[0.0] * nbk for _ in range(nbm)]
    for i in range(nbm):
        for g in range(nbk):
            if given_sf is not None:
                sf[i][g] = given_sf[i][g]
                inv[i][g] = f32(1.0 / given_sf[i][g])
                continue
            amax = max(abs(deq[r][c]) for r in range(i * bm, min(T, (i + 1) * bm))
                       for c in range(g * bk, min(W, (g + 1) * bk)))
            sf[i][g], inv[i][g] = scale(amax, fmt, round_sf)
    codes = []
    for r in range(T):
        row = []
        for c in range(W):
            si = inv[r // bm][c // bk]
            if sf_in is None:
                v = f32(rows[r][c] * si)
            elif order == "A":
                v = f32(rows[r][c] * f32(sf_in[r][c] * si))
            else:
                v = f32(deq[r][c] * si)
            row.append(NEAREST[fmt](v))
        codes.append(row)
    return codes, sf
