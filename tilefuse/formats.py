"""Number formats and scale-factor layouts (quant.md section 1), shared by references, tests and kernels.

This is the single home of every element format (E4M3, E2M1 and its nibble packing, E5M6 and its 12-bit
packing), of the scale-factor rule (amax -> sf, sf_inv) and of the scale-factor storage encodings and layouts
(binary32, UE8M0, packed UE8M0, TMA-aligned column-major). Everything here is plain PyTorch on any device;
integer bit manipulation is done in int64 so no intermediate overflows.
"""
from __future__ import annotations

import torch

__all__ = [
    "FMT_MAX", "CLAMP_MIN", "E4M3_SF_CLAMP_MIN", "default_clamp_min", "cdiv", "align",
    "e4m3_encode", "e4m3_decode",
    "e2m1_encode", "e2m1_decode", "e2m1_pack", "e2m1_unpack",
    "e5m6_encode", "e5m6_decode", "e5m6_pack", "e5m6_unpack",
    "round_sf_pow2", "scale_from_amax",
    "ue8m0_encode", "ue8m0_decode", "pack_ue8m0", "unpack_ue8m0",
    "store_sf", "load_sf", "sf_is_col_major",
    "quantize", "dequantize", "fmt_of", "logical_width",
]

# Largest finite magnitude M of each element format (sections 1.1-1.3).
FMT_MAX: dict[str, float] = {"e4m3": 448.0, "e2m1": 6.0, "e5m6": 65024.0}


def _fp32(value: float) -> float:
    """``value`` rounded to binary32, returned as a Python float (exact in both precisions)."""
    return torch.tensor(value, dtype=torch.float32).item()


# Default amax clamp per output format with binary32 / UE8M0 scale factors (section 1.4 table).
CLAMP_MIN: dict[str, float] = {"e4m3": _fp32(1e-4), "e2m1": 6.0 * 2.0 ** -126, "e5m6": _fp32(1e-4)}
# v2 defaults when the scale factor itself is stored as E4M3 (section 1.4 table): M * 2^-9.
E4M3_SF_CLAMP_MIN: dict[str, float] = {"e4m3": 448.0 * 2.0 ** -9, "e2m1": 6.0 * 2.0 ** -9}


def default_clamp_min(fmt: str, use_e4m3_sf: bool = False) -> float:
    """The default amax clamp of section 1.4 for ``fmt`` (and the v2 E4M3-sf variant)."""
    return E4M3_SF_CLAMP_MIN[fmt] if use_e4m3_sf else CLAMP_MIN[fmt]


def cdiv(a: int, b: int) -> int:
    """Ceil division."""
    return -(-a // b)


def align(a: int, b: int) -> int:
    """``a`` rounded up to a multiple of ``b``."""
    return cdiv(a, b) * b


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The binary32 bit pattern of fp32 ``x`` as non-negative int64 (0 .. 2^32-1)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(b: torch.Tensor) -> torch.Tensor:
    """fp32 tensor whose bit patterns are the low 32 bits of int64 ``b``."""
    b = b & 0xFFFFFFFF
    return torch.where(b >= 2 ** 31, b - 2 ** 32, b).to(torch.int32).view(torch.float32)


# ---------------------------------------------------------------------------------------------------------
# FP8 E4M3 (section 1.1)
# ---------------------------------------------------------------------------------------------------------

def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn: RNE, saturating at +-448 (values in [464, inf) included), -0 kept, NaN -> NaN."""
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def e4m3_decode(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> exact fp32 value."""
    return q.float()


# ---------------------------------------------------------------------------------------------------------
# FP4 E2M1 (section 1.2)
# ---------------------------------------------------------------------------------------------------------

_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> uint8 E2M1 codes 0..15 per the decision table of section 1.2.

    The magnitude rounds to the nearest code with ties to the even code and saturates at 6 (+inf and NaN
    give magnitude code 7); bit 3 is copied from the input's sign bit, so -0 and tiny negatives give 0x8.
    """
    x = x.float()
    m = x.abs()
    # Each threshold crossed adds one code; "<=" thresholds are ties that go down to the even code.
    code = ((m > 0.25).to(torch.uint8) + (m >= 0.75) + (m > 1.25) + (m >= 1.75)
            + (m > 2.5) + (m >= 3.5) + (m > 5.0))
    code = torch.where(torch.isnan(m), torch.full_like(code, 7), code)
    sign = (_bits(x) >> 31).to(torch.uint8)
    return code | (sign << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (any integer dtype, values 0..15) -> fp32; code 0x8 is -0.0."""
    c = codes.to(torch.int64) & 0xF
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[c & 0x7]
    return torch.where((c & 0x8) != 0, -mag, mag)


def e2m1_pack(codes: torch.Tensor) -> torch.Tensor:
    """codes ``[..., H]`` (H even) -> int8 ``[..., H/2]``; element 2k in the low nibble of byte k."""
    if codes.size(-1) % 2:
        raise ValueError(f"e2m1_pack: codes must have an even last dimension, got shape {tuple(codes.shape)}")
    c = codes.to(torch.int64) & 0xF
    byte = c[..., 0::2] | (c[..., 1::2] << 4)
    return byte.to(torch.uint8).view(torch.int8)


def e2m1_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 ``[..., K]`` -> uint8 codes ``[..., 2K]`` (low nibble first)."""
    b = packed.contiguous().view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------------------
# E5M6: the upper 12 bits of a binary16 (section 1.3)
# ---------------------------------------------------------------------------------------------------------

def _fp16_bits_toward_zero(b: torch.Tensor) -> torch.Tensor:
    """binary16 pattern (int64) of the binary32 pattern ``b`` rounded toward zero (section 1.3 step 1).

    binary16 subnormals are truncated, values below 2^-24 give +-0, |v| >= 2^16 gives +-inf (the
    reference's behaviour), NaN keeps the top 10 payload bits (quiet bit forced if they are all zero).
    """
    sign = (b >> 31) << 15
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    eh = e - 127 + 15
    normal = (eh << 10) | (m >> 13)
    mant = m | 0x800000  # implicit bit; only used when e >= 1
    sub = mant >> torch.clamp(126 - e, min=0, max=40)
    sub = torch.where(e == 0, torch.zeros_like(sub), sub)
    nan_payload = m >> 13
    nan_payload = torch.where(nan_payload == 0, torch.full_like(m, 0x200), nan_payload)
    special = torch.where(m == 0, torch.full_like(m, 0x7C00), 0x7C00 | nan_payload)
    mag = torch.where(eh >= 1, normal, sub)
    mag = torch.where(eh >= 31, torch.full_like(m, 0x7C00), mag)
    mag = torch.where(e == 255, special, mag)
    return sign | mag


def e5m6_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> int32 12-bit E5M6 codes, bit-exactly the section 1.3 algorithm.

    ``t = fp16_rtz(v) >> 4``; ``r`` = low 17 bits of v's binary32 pattern; ``t += 1`` if
    ``(t & 1) + r > 0x10000`` (RNE in the binary16 normal range, an approximation for its subnormals).
    """
    b = _bits(x.float())
    t = _fp16_bits_toward_zero(b) >> 4
    r = b & 0x1FFFF
    t = torch.where((t & 1) + r > 0x10000, t + 1, t) & 0xFFF
    return t.to(torch.int32)


def e5m6_decode(codes: torch.Tensor) -> torch.Tensor:
    """12-bit E5M6 codes -> fp32: the binary16 pattern ``c << 4`` widened to binary32."""
    h = (codes.to(torch.int64) & 0xFFF) << 4
    widened = torch.where(h >= 0x8000, h - 0x10000, h).to(torch.int16).view(torch.float16).float()
    # NaN patterns are widened by hand: the payload moves up 13 bits unchanged (no quieting).
    nan = ((h & 0x7C00) == 0x7C00) & ((h & 0x3FF) != 0)
    nan_bits = ((h >> 15) << 31) | 0x7F800000 | ((h & 0x3FF) << 13)
    return torch.where(nan, _from_bits(nan_bits), widened)


def e5m6_pack(codes: torch.Tensor) -> torch.Tensor:
    """codes ``[..., H]`` (H % 8 == 0) -> uint8 ``[..., 3H/2]`` (section 1.3 packing).

    Each group of 8 codes forms three big-endian-ordered 32-bit words W0..W2, stored as little-endian
    uint32 values one after the other.
    """
    if codes.size(-1) % 8:
        raise ValueError(f"e5m6_pack: codes must have a last dimension % 8 == 0, got shape {tuple(codes.shape)}")
    c = (codes.to(torch.int64) & 0xFFF).unflatten(-1, (-1, 8))
    c0, c1, c2, c3, c4, c5, c6, c7 = c.unbind(-1)
    w0 = (c0 << 20) | (c1 << 8) | (c2 >> 4)
    w1 = ((c2 & 0xF) << 28) | (c3 << 16) | (c4 << 4) | (c5 >> 8)
    w2 = ((c5 & 0xFF) << 24) | (c6 << 12) | c7
    words = torch.stack((w0, w1, w2), dim=-1)  # [..., G, 3]
    shifts = torch.arange(0, 32, 8, device=codes.device)
    byte = (words.unsqueeze(-1) >> shifts) & 0xFF  # [..., G, 3, 4], least significant byte first
    return byte.flatten(-3).to(torch.uint8)


def e5m6_unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 3H/2]`` -> int32 codes ``[..., H]``; the exact inverse of ``e5m6_pack``."""
    if packed.size(-1) % 12:
        raise ValueError(f"e5m6_unpack: packed must have a last dimension % 12 == 0, got shape {tuple(packed.shape)}")
    byte = packed.to(torch.int64).unflatten(-1, (-1, 3, 4))
    shifts = torch.arange(0, 32, 8, device=packed.device)
    words = (byte << shifts).sum(-1)  # [..., G, 3]
    w0, w1, w2 = words.unbind(-1)
    c = torch.stack((
        w0 >> 20, (w0 >> 8) & 0xFFF, ((w0 & 0xFF) << 4) | (w1 >> 28),
        (w1 >> 16) & 0xFFF, (w1 >> 4) & 0xFFF, ((w1 & 0xF) << 8) | (w2 >> 24),
        (w2 >> 12) & 0xFFF, w2 & 0xFFF,
    ), dim=-1)
    return c.flatten(-2).to(torch.int32)


# ---------------------------------------------------------------------------------------------------------
# Scale factors (section 1.4)
# ---------------------------------------------------------------------------------------------------------

def round_sf_pow2(s: torch.Tensor) -> torch.Tensor:
    """Positive normal fp32 ``s`` -> ``2^ceil(log2 s)`` via ``(bits + 0x7FFFFF) & 0x7F800000``.

    Powers of two stay unchanged; every other value rounds up to the next power of two.
    """
    return _from_bits((_bits(s.float()) + 0x7FFFFF) & 0x7F800000)


def scale_from_amax(
    amax: torch.Tensor,
    fmt: str,
    round_sf: bool,
    clamp_min: float | None = None,
    use_e4m3_sf: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Section 1.4 ``get_sf_and_inv``: fp32 block maxima -> (sf, sf_inv), both fp32.

    ``a = max(amax, clamp_min)``; plain: ``sf = a / M`` and ``sf_inv = M / a`` (two IEEE divisions);
    ``round_sf``: ``sf = 2^E`` with ``E = ceil(log2(a / M))`` and ``sf_inv = 2^-E`` (exact);
    ``use_e4m3_sf`` (v2): ``sf = float(e4m3(a / M))`` and ``sf_inv = 1 / sf``. A zero sf gets sf_inv 0.
    """
    if round_sf and use_e4m3_sf:
        raise ValueError("scale_from_amax: round_sf and use_e4m3_sf cannot be combined")
    if clamp_min is None:
        clamp_min = default_clamp_min(fmt, use_e4m3_sf)
    a = torch.clamp_min(amax.float(), clamp_min)
    m = torch.full_like(a, FMT_MAX[fmt])  # a tensor, so both divisions are true IEEE divisions
    if round_sf:
        sf = round_sf_pow2(a / m)
        sf_inv = torch.reciprocal(sf)  # exact: the reciprocal of a power of two is 2^-E
    elif use_e4m3_sf:
        sf = e4m3_decode(e4m3_encode(a / m))
        sf_inv = torch.reciprocal(sf)
    else:
        sf = a / m
        sf_inv = m / a
    sf_inv = torch.where(sf == 0, torch.zeros_like(sf_inv), sf_inv)
    return sf, sf_inv


def ue8m0_encode(sf: torch.Tensor) -> torch.Tensor:
    """fp32 sf -> uint8 biased exponent byte (``bits >> 23``; exact for positive powers of two)."""
    return ((_bits(sf.float()) >> 23) & 0xFF).to(torch.uint8)


def ue8m0_decode(byte: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> fp32 ``float_from_bits(byte << 23)``; byte 0 decodes to +0.0."""
    return _from_bits(byte.to(torch.int64) << 23)


def pack_ue8m0(byte: torch.Tensor) -> torch.Tensor:
    """uint8 ``[R, n]`` -> int32 ``[R, cdiv(n, 4)]``: block 4j+u in byte u (bits 8u..8u+7), zero padding."""
    n = byte.size(-1)
    b = torch.nn.functional.pad(byte.to(torch.int64), (0, align(n, 4) - n))
    shifts = torch.arange(0, 32, 8, device=byte.device)
    word = (b.unflatten(-1, (-1, 4)) << shifts).sum(-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def unpack_ue8m0(packed: torch.Tensor, n: int) -> torch.Tensor:
    """int32 ``[R, W]`` -> uint8 ``[R, n]`` (the first n of the 4W little-endian bytes of each row)."""
    shifts = torch.arange(0, 32, 8, device=packed.device)
    b = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xFF
    return b.flatten(-2)[..., :n].to(torch.uint8)


# ---------------------------------------------------------------------------------------------------------
# Scale-factor layouts (section 1.5)
# ---------------------------------------------------------------------------------------------------------

def store_sf(sf: torch.Tensor, use_tma_aligned_col_major_sf: bool = False,
             use_packed_ue8m0: bool = False) -> torch.Tensor:
    """fp32 sf grid ``[nbm, nbk]`` -> the output tensor of the requested section 1.5 layout.

    * default: contiguous fp32 ``(nbm, nbk)``;
    * col: fp32 ``(nbm, nbk)`` with strides ``(1, align(nbm, 4))``, storage rows nbm.. zero;
    * col + packed: int32 ``(nbm, cdiv(nbk, 4))`` with strides ``(1, align(nbm, 4))``;
    * packed without col (the v2 row-major packed layout): contiguous int32 ``(nbm, cdiv(nbk, 4))``.
      v1 ops reject this combination before calling here.
    Packed words hold UE8M0 bytes (``ue8m0_encode``) with zero padding bytes.
    """
    out = pack_ue8m0(ue8m0_encode(sf)) if use_packed_ue8m0 else sf.float().contiguous()
    if not use_tma_aligned_col_major_sf:
        return out
    nbm, width = out.shape
    storage = torch.zeros(width, align(nbm, 4), dtype=out.dtype, device=out.device)
    storage[:, :nbm] = out.T
    return storage[:, :nbm].T


def sf_is_col_major(sf: torch.Tensor) -> bool:
    """Section 1.5 input detection: a 2-D sf whose first stride is 1 (and, as v2 requires, whose second
    stride is not 1, so a contiguous ``(T, 1)`` tensor counts as row-major) is column-major."""
    return sf.dim() == 2 and sf.stride(0) == 1 and sf.stride(1) != 1


def load_sf(sf: torch.Tensor, nbk: int) -> torch.Tensor:
    """An input sf in any section 1.5 layout -> contiguous fp32 ``[nbm, nbk]``.

    int32 is packed UE8M0 (row-major or column-major words; the logical view addresses the same words),
    float8_e4m3fn is a v2 E4M3 sf, fp32 is used as is.
    """
    if sf.dtype == torch.int32:
        return ue8m0_decode(unpack_ue8m0(sf, nbk))
    if sf.dtype == torch.float8_e4m3fn:
        return e4m3_decode(sf).contiguous()
    if sf.dtype == torch.float32:
        return sf[:, :nbk].contiguous()
    raise TypeError(f"load_sf: sf must have dtype float32, int32 or float8_e4m3fn, got {sf.dtype}")


# ---------------------------------------------------------------------------------------------------------
# Element containers (section 1.6)
# ---------------------------------------------------------------------------------------------------------

def quantize(v: torch.Tensor, sf_inv: torch.Tensor, fmt: str) -> torch.Tensor:
    """``narrow_fmt(v * sf_inv)`` (one binary32 product) in the format's container:
    float8_e4m3fn ``(.., H)``, packed int8 E2M1 ``(.., H/2)`` or packed uint8 E5M6 ``(.., 3H/2)``.

    A NaN product (NaN input, or inf * 0 when a block's sf is inf) is encoded as the positive canonical
    NaN, as the kernels do (section 9.2): e4m3 0x7F, e2m1 code 0x7.
    """
    scaled = v.float() * sf_inv
    scaled = torch.where(torch.isnan(scaled), torch.full_like(scaled, float("nan")).abs(), scaled)
    if fmt == "e4m3":
        return e4m3_encode(scaled)
    if fmt == "e2m1":
        return e2m1_pack(e2m1_encode(scaled))
    if fmt == "e5m6":
        return e5m6_pack(e5m6_encode(scaled))
    raise ValueError(f"quantize: fmt must be one of 'e4m3', 'e2m1', 'e5m6', got {fmt!r}")


def dequantize(data: torch.Tensor, fmt: str) -> torch.Tensor:
    """Exact fp32 element values of a container (no scale factor applied), logical shape ``(.., H)``."""
    if fmt == "e4m3":
        return e4m3_decode(data)
    if fmt == "e2m1":
        return e2m1_decode(e2m1_unpack(data))
    if fmt == "e5m6":
        return e5m6_decode(e5m6_unpack(data))
    raise ValueError(f"dequantize: fmt must be one of 'e4m3', 'e2m1', 'e5m6', got {fmt!r}")


def fmt_of(data: torch.Tensor) -> str | None:
    """The element format a container dtype carries: e4m3 (float8_e4m3fn), e2m1 (int8), e5m6 (uint8)."""
    return {torch.float8_e4m3fn: "e4m3", torch.int8: "e2m1", torch.uint8: "e5m6"}.get(data.dtype)


def logical_width(data: torch.Tensor, fmt: str) -> int:
    """Logical number of elements per row of a container's last dimension."""
    w = data.size(-1)
    return {"e4m3": w, "e2m1": 2 * w, "e5m6": (2 * w) // 3}[fmt]
