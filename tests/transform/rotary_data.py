"""Test data for apply_rotary (transform.md 8.1) and an independent per-element model of section 3.3 in exact
rational arithmetic (Python ``fractions``), shared by the reference tier and the GPU tier."""
import math
from fractions import Fraction

import torch

R_DEFAULT = 8192


def make_cos_sin_cache(rows: int = R_DEFAULT, d: int = 128, base: float = 10000.0, device="cpu") -> torch.Tensor:
    """``[cos theta, sin theta]`` with ``theta[p, j] = p * base^(-2j/D)`` computed in float64, rounded to fp32."""
    p = torch.arange(rows, dtype=torch.float64)[:, None]
    j = torch.arange(d // 2, dtype=torch.float64)[None, :]
    theta = p * base ** (-2.0 * j / d)
    return torch.cat((theta.cos(), theta.sin()), dim=1).to(torch.float32).to(device)


def rand(shape, dtype, device="cpu") -> torch.Tensor:
    return torch.randn(shape, device=device).to(dtype)


def draw_positions(shape, rows: int, offset: int, dtype=torch.int64, device="cpu") -> torch.Tensor:
    """Uniform in ``[max(0, -offset), rows - offset)``: duplicates and unsorted order, every row valid."""
    lo = max(0, -offset)
    return torch.randint(lo, rows - offset, shape, dtype=torch.int64).to(dtype).to(device)


def special_values(n: int, dtype) -> torch.Tensor:
    """``n`` values cycling through +-0, subnormals, +-1e30, +-inf, NaN and ordinary numbers."""
    tiny = 1e-40 if dtype == torch.float32 else 5e-39
    pool = torch.tensor([0.0, -0.0, tiny, -tiny, 1e30, -1e30, float("inf"), -float("inf"), float("nan"), 1.5, -2.25,
                         3.0e-3], dtype=torch.float32)
    idx = torch.randint(0, len(pool), (n,))
    return pool[idx].to(dtype)


# ---- exact model (no torch arithmetic) ----

def round_binary(x: Fraction, neg_zero: bool, p: int, emin: int = -126, emax: int = 127) -> float:
    """Round-to-nearest-even of the exact ``x`` to a binary format of ``p`` significand bits (binary32: 24,
    bfloat16: 8; both have binary32's exponent range), overflow to +-inf; a zero result is -0 if ``neg_zero``."""
    if x == 0:
        return -0.0 if neg_zero else 0.0
    neg = x < 0
    a = -x if neg else x
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    e = max(e, emin)
    ulp = Fraction(2) ** (e - p + 1)
    q, r = divmod(a, ulp)
    if 2 * r > ulp or (2 * r == ulp and q % 2 == 1):
        q += 1
    v = q * ulp
    if v >= Fraction(2) ** (emax + 1):
        return -math.inf if neg else math.inf
    if v == 0:  # underflow keeps the sign
        return -0.0 if neg else 0.0
    f = float(v)
    return -f if neg else f


def _neg(v: float) -> bool:
    return math.copysign(1.0, v) < 0


def mul32(a: float, b: float) -> float:
    """``RN(a * b)`` in binary32."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return a * b
    return round_binary(Fraction(a) * Fraction(b), _neg(a) != _neg(b), 24)


def fma32(a: float, b: float, c: float) -> float:
    """``RN(a * b + c)`` in binary32, one rounding; a zero sum is -0 only when both addends are -0 (IEEE RNE)."""
    if not (math.isfinite(a) and math.isfinite(b) and math.isfinite(c)):
        return a * b + c  # inf / NaN arithmetic of the exact product and c
    prod = Fraction(a) * Fraction(b)
    prod_neg_zero = prod == 0 and (_neg(a) != _neg(b))
    exact = prod + Fraction(c)
    return round_binary(exact, prod_neg_zero and c == 0 and _neg(c), 24)


def to_dtype(v: float, dtype) -> float:
    if dtype == torch.float32 or not math.isfinite(v):
        return v
    return round_binary(Fraction(v), _neg(v), 8)


def model_pair(f: float, s: float, c: float, n: float, conjugate: bool, dtype) -> tuple:
    """Section 3.3 for one pair, from the table, in exact arithmetic."""
    if conjugate:
        first = fma32(f, c, mul32(s, n))
        second = fma32(f, -n, mul32(s, c))
    else:
        first = fma32(f, c, -mul32(s, n))
        second = fma32(f, n, mul32(s, c))
    return to_dtype(first, dtype), to_dtype(second, dtype)


def model(x: torch.Tensor, cache: torch.Tensor, positions, offset: int, interleaved: bool, conjugate: bool):
    """Slow per-element model of ``apply_rotary`` on a copy of 3-D or 4-D ``x`` (whole last dimension rotated)."""
    out = x.detach().cpu().clone()
    x4 = out if out.dim() == 4 else out.unsqueeze(0)
    src = x4.clone().float()
    cache = cache.detach().cpu()
    rows, d = cache.shape
    half = d // 2
    nb, ns, nh, _ = x4.shape
    pos = None if positions is None else positions.detach().cpu().reshape(nb, ns).tolist()
    for b in range(nb):
        for t in range(ns):
            p = (t if pos is None else pos[b][t]) + offset
            if not 0 <= p < rows:
                continue
            for h in range(nh):
                row = src[b, t, h].tolist()
                for j in range(half):
                    fi, si = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
                    c, n = cache[p, j].item(), cache[p, half + j].item()
                    nf, nsv = model_pair(row[fi], row[si], c, n, conjugate, x.dtype)
                    x4[b, t, h, fi] = nf
                    x4[b, t, h, si] = nsv
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits as integers (so -0 differs from +0); NaNs mapped to one pattern (payloads are not specified)."""
    t = t.detach()
    ints = t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)
    return torch.where(torch.isnan(t), torch.full_like(ints, -1), ints)
