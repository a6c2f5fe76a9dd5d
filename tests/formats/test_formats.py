"""tilefuse.formats against quant.md section 1: exhaustive code tables, rounding ties, packing byte order,
UE8M0, the scale rule and the sf layouts. Oracles are independent scalar formulations (float64 / Fraction /
struct), never the code under test."""
import math
import struct

import pytest
import torch

from tilefuse import formats as F
from tests.formats.scalar_oracle import E2M1_MAG, e4m3_nearest, e4m3_value, e5m6_code, f32, f32_bits


def bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def as_u8(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).flatten().tolist()


# ------------------------------------------------------------------------------------------------ E4M3

def test_e4m3_all_bytes_decode_and_reencode():
    codes = torch.arange(256, dtype=torch.uint8)
    dec = F.e4m3_decode(codes.view(torch.float8_e4m3fn))
    assert dec.dtype == torch.float32
    for b in range(256):
        want = e4m3_value(b)
        got = dec[b].item()
        if math.isnan(want):
            assert math.isnan(got)
        else:
            assert got == want and math.copysign(1, got) == math.copysign(1, want), b
    assert as_u8(F.e4m3_encode(dec)) == list(range(256))
    assert dec[0x7E].item() == 448.0 and dec[0x01].item() == 2.0 ** -9 and dec[0x08].item() == 2.0 ** -6


def test_e4m3_ties_round_to_even_and_saturate():
    finite = sorted({e4m3_value(b) for b in range(0x7F)})
    mids = [(a + b) / 2 for a, b in zip(finite, finite[1:])]  # exact in fp32
    eps = [m * (1 + 2.0 ** -20) for m in mids] + [m * (1 - 2.0 ** -20) for m in mids]
    vals = mids + eps + [-v for v in mids] + [448.0, 460.0, 463.99, 464.0, 464.01, 479.0, 480.0, 1e9, 3e38, -464.0,
                                               -1e30, 2.0 ** -10, 2.0 ** -10 * 3, 1e-30, -1e-30, -0.0, 0.0]
    x = torch.tensor(vals, dtype=torch.float32)
    got = as_u8(F.e4m3_encode(x))
    want = [e4m3_nearest(f32(v)) for v in vals]
    assert got == want
    # hand-picked: 464 is the 448/480 midpoint and saturates; tiny negatives give -0; 2^-10 ties to 0
    assert got[len(mids) * 4 + 3] == 0x7E and got[len(mids) * 4 + 9] == 0xFE
    assert F.e4m3_encode(torch.tensor([-1e-30, 2.0 ** -10, 3 * 2.0 ** -10])).view(torch.uint8).tolist() == [0x80, 0, 2]


def test_e4m3_random_against_scalar_oracle():
    x = torch.randn(300) * torch.exp2(torch.randint(-12, 10, (300,)).float())
    got = as_u8(F.e4m3_encode(x))
    assert got == [e4m3_nearest(v) for v in x.tolist()]


def test_e4m3_nan_stays_nan():
    q = F.e4m3_encode(torch.tensor([math.nan, -math.nan]))
    assert torch.isnan(F.e4m3_decode(q)).all()


# ------------------------------------------------------------------------------------------------ E2M1

def test_e2m1_all_codes_decode_and_reencode():
    codes = torch.arange(16, dtype=torch.uint8)
    dec = F.e2m1_decode(codes)
    for c in range(16):
        want = -E2M1_MAG[c & 7] if c & 8 else E2M1_MAG[c & 7]
        assert dec[c].item() == want
        assert math.copysign(1, dec[c].item()) == (-1 if c & 8 else 1)
    assert F.e2m1_encode(dec).tolist() == list(range(16))


@pytest.mark.parametrize("m,code", [
    (0.25, 0), (0.2500001, 1), (0.7499999, 1), (0.75, 2), (1.25, 2), (1.2500001, 3), (1.7499999, 3),
    (1.75, 4), (2.5, 4), (2.5000002, 5), (3.4999998, 5), (3.5, 6), (5.0, 6), (5.0000005, 7), (1e30, 7),
    (math.inf, 7), (0.0, 0), (1e-40, 0), (0.5, 1), (3.0, 5), (6.0, 7), (100.0, 7),
])
def test_e2m1_decision_table(m, code):
    x = torch.tensor([m, -m], dtype=torch.float32)
    assert F.e2m1_encode(x).tolist() == [code, code | 8]


def test_e2m1_sign_bit_and_nan():
    x = torch.tensor([-0.0, -1e-9, math.nan, -math.nan])
    assert F.e2m1_encode(x).tolist() == [8, 8, 7, 15]


def test_e2m1_random_against_nearest():
    x = torch.randn(400) * 3
    got = F.e2m1_encode(x).tolist()
    for v, c in zip(x.tolist(), got):
        best = min(range(8), key=lambda k: (abs(E2M1_MAG[k] - abs(v)), k & 1))
        assert c == best | (8 if v < 0 else 0)


def test_e2m1_pack_byte_order():
    codes = torch.tensor([[1, 2, 0xF, 0x8], [0, 7, 9, 0]], dtype=torch.uint8)
    packed = F.e2m1_pack(codes)
    assert packed.dtype == torch.int8 and packed.shape == (2, 2)
    assert as_u8(packed) == [0x21, 0x8F, 0x70, 0x09]
    assert torch.equal(F.e2m1_unpack(packed), codes)
    assert torch.equal(F.e2m1_unpack(packed.view(torch.uint8)), codes)
    with pytest.raises(ValueError, match="codes"):
        F.e2m1_pack(torch.zeros(3, dtype=torch.uint8))


# ------------------------------------------------------------------------------------------------ E5M6

def test_e5m6_all_codes_identity_and_values():
    codes = torch.arange(4096, dtype=torch.int32)
    dec = F.e5m6_decode(codes)
    assert torch.equal(F.e5m6_encode(dec), codes)
    for c in range(0, 4096, 7):  # decode = the binary16 pattern c << 4
        want = struct.unpack("<e", struct.pack("<H", c << 4))[0]
        got = dec[c].item()
        assert (math.isnan(want) and math.isnan(got)) or (got == want and math.copysign(1, got) == math.copysign(1, want))
    assert dec[0x7BF].item() == 65024.0 and dec[1].item() == 2.0 ** -20 and dec[0x3F].item() == 2.0 ** -14 * 63 / 64


def test_e5m6_rounding_ties_carry_and_subnormal_quirk():
    cases = [
        (1 + 2.0 ** -7, 0x3C0),            # tie between 0x3C0 and 0x3C1 -> even 0x3C0
        (1 + 3 * 2.0 ** -7, 0x3C2),        # tie between 0x3C1 and 0x3C2 -> even 0x3C2
        (1 + 2.0 ** -7 + 2.0 ** -20, 0x3C1),  # just above the tie
        (2 - 2.0 ** -7, 0x400),            # tie at 0x3FF/0x400 -> carry ripples into the exponent
        (2 - 2.0 ** -8, 0x400),            # above the midpoint: carry into the exponent
        (65024.0, 0x7BF), (-65024.0, 0xFBF),
        (2.0 ** -20, 0x001), (2.0 ** -14 * 63 / 64, 0x03F), (2.0 ** -14, 0x040),
        (1.5 * 2.0 ** -20, 0x001),         # subnormal quirk: true RNE would give 0x002 (tie, odd)
        (1.75 * 2.0 ** -20, 0x001),        # quirk: RNE gives 0x002; the low 17 bits of the pattern are 0
        (2.0 ** -25, 0x000), (-2.0 ** -25, 0x800), (-0.0, 0x800),
    ]
    x = torch.tensor([v for v, _ in cases], dtype=torch.float32)
    assert F.e5m6_encode(x).tolist() == [c for _, c in cases]
    assert [e5m6_code(v) for v, _ in cases] == [c for _, c in cases]


def test_e5m6_random_against_scalar_oracle():
    x = torch.randn(600) * torch.exp2(torch.randint(-26, 16, (600,)).float())
    x = x.clamp(-65024, 65024)
    assert F.e5m6_encode(x).tolist() == [e5m6_code(v) for v in x.tolist()]


def test_e5m6_pack_byte_order():
    codes = torch.tensor([[0x123, 0x456, 0x789, 0xABC, 0xDEF, 0x012, 0x345, 0x678]], dtype=torch.int32)
    # 96-bit string 123456789ABCDEF012345678 -> W0 0x12345678, W1 0x9ABCDEF0, W2 0x12345678, little-endian
    packed = F.e5m6_pack(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 12)
    assert packed.flatten().tolist() == [0x78, 0x56, 0x34, 0x12, 0xF0, 0xDE, 0xBC, 0x9A, 0x78, 0x56, 0x34, 0x12]
    assert torch.equal(F.e5m6_unpack(packed), codes)
    rnd = torch.randint(0, 4096, (3, 32), dtype=torch.int32)
    p = F.e5m6_pack(rnd)
    assert p.shape == (3, 48) and torch.equal(F.e5m6_unpack(p), rnd)
    with pytest.raises(ValueError, match="codes"):
        F.e5m6_pack(torch.zeros(1, 12, dtype=torch.int32))


# ------------------------------------------------------------------------------------------------ scales

def test_ue8m0_encode_decode():
    b = torch.tensor([0, 1, 124, 127, 128, 254], dtype=torch.uint8)
    dec = F.ue8m0_decode(b)
    assert [f32_bits(v) for v in dec.tolist()] == [0, 1 << 23, 124 << 23, 127 << 23, 128 << 23, 254 << 23]
    assert dec[0].item() == 0.0 and math.copysign(1, dec[0].item()) == 1  # byte 0 -> +0.0
    assert dec[3].item() == 1.0 and dec[2].item() == 0.125
    assert F.ue8m0_encode(dec[1:]).tolist() == [1, 124, 127, 128, 254]


def test_pack_ue8m0_little_endian_with_zero_padding():
    b = torch.tensor([[1, 2, 3, 4, 5], [0xFF, 0x80, 0, 0x7F, 9]], dtype=torch.uint8)
    p = F.pack_ue8m0(b)
    assert p.dtype == torch.int32 and p.shape == (2, 2)
    assert [v & 0xFFFFFFFF for v in p.flatten().tolist()] == [0x04030201, 0x00000005, 0x7F0080FF, 0x00000009]
    assert torch.equal(F.unpack_ue8m0(p, 5), b)


def test_round_sf_pow2():
    pows = torch.exp2(torch.arange(-126, 128, dtype=torch.float32))
    assert torch.equal(F.round_sf_pow2(pows), pows)
    s = torch.rand(500) * torch.exp2(torch.randint(-100, 100, (500,)).float()) + 1e-30
    r = F.round_sf_pow2(s)
    for v, got in zip(s.tolist(), r.tolist()):
        assert got == 2.0 ** math.ceil(math.log2(v)), v
    assert F.round_sf_pow2(torch.tensor([1.5, 3.0, 2.0 ** -9 * 1.0000001])).tolist() == [2.0, 4.0, 2.0 ** -8]


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "e5m6"])
def test_scale_from_amax_plain_is_two_ieee_divisions(fmt):
    M = F.FMT_MAX[fmt]
    amax = torch.cat([torch.tensor([0.0, 1.0, M, 3.0]), torch.rand(200) * 10 ** torch.randint(-6, 6, (200,)).float()])
    sf, sf_inv = F.scale_from_amax(amax, fmt, round_sf=False)
    cmin = F.CLAMP_MIN[fmt]
    for a, s, si in zip(amax.tolist(), sf.tolist(), sf_inv.tolist()):
        a = max(a, cmin)
        assert s == f32(a / M) and si == f32(M / a)  # binary32 division == double division rounded once
    assert sf[2].item() == 1.0 and sf_inv[2].item() == 1.0
    assert sf[0].item() == f32(cmin / M)  # all-zero block: clamp_min / M


def test_scale_from_amax_clamp_defaults():
    assert F.CLAMP_MIN["e4m3"] == f32(1e-4) and F.CLAMP_MIN["e2m1"] == 6 * 2.0 ** -126
    assert F.default_clamp_min("e4m3", use_e4m3_sf=True) == 0.875
    assert F.default_clamp_min("e2m1", use_e4m3_sf=True) == 0.01171875
    sf, sf_inv = F.scale_from_amax(torch.zeros(1), "e2m1", round_sf=True)
    assert sf.item() == 2.0 ** -126 and sf_inv.item() == 2.0 ** 126
    sf, _ = F.scale_from_amax(torch.zeros(1), "e4m3", round_sf=False, clamp_min=0.5)
    assert sf.item() == f32(0.5 / 448)


def test_scale_from_amax_rounded():
    amax = torch.tensor([1.0, 448.0, 448.0 * 8, 449.0, 0.0, 447.0])
    sf, sf_inv = F.scale_from_amax(amax, "e4m3", round_sf=True)
    # 1/448 lies in (2^-9, 2^-8]; 449/448 in (1, 2]; 1e-4/448 in (2^-23, 2^-22]
    assert sf.tolist() == [2.0 ** -8, 1.0, 8.0, 2.0, 2.0 ** -22, 1.0]
    assert sf_inv.tolist() == [2.0 ** 8, 1.0, 0.125, 0.5, 2.0 ** 22, 1.0]


def test_scale_from_amax_e4m3_sf():
    sf, sf_inv = F.scale_from_amax(torch.tensor([0.0, 448.0, 500.0]), "e4m3", round_sf=False, use_e4m3_sf=True)
    # 0 -> clamp 0.875 -> 0.875/448 = 2^-9 exactly; 500/448 = 1.116 -> e4m3 1.125
    assert sf.tolist() == [2.0 ** -9, 1.0, 1.125] and sf_inv.tolist() == [512.0, 1.0, f32(1 / 1.125)]
    with pytest.raises(ValueError, match="round_sf"):
        F.scale_from_amax(torch.ones(1), "e4m3", round_sf=True, use_e4m3_sf=True)


# ------------------------------------------------------------------------------------------------ layouts

@pytest.mark.parametrize("nbm,nbk", [(5, 2), (4, 3), (1, 7), (9, 4)])
def test_store_and_load_sf_layouts(nbm, nbk):
    sf = torch.exp2(torch.randint(-20, 20, (nbm, nbk)).float())
    row = F.store_sf(sf, False, False)
    assert row.dtype == torch.float32 and row.shape == (nbm, nbk) and row.stride() == (nbk, 1)
    P = F.align(nbm, 4)
    col = F.store_sf(sf, True, False)
    assert col.dtype == torch.float32 and col.shape == (nbm, nbk) and col.stride() == (1, P)
    assert torch.equal(col, sf)
    storage = col.as_strided((nbk, P), (P, 1))
    assert (storage[:, nbm:] == 0).all()
    packed = F.store_sf(sf, True, True)
    W = F.cdiv(nbk, 4)
    assert packed.dtype == torch.int32 and packed.shape == (nbm, W) and packed.stride() == (1, P)
    for i in range(nbm):
        for g in range(nbk):
            byte = (packed[i, g // 4].item() >> (8 * (g % 4))) & 0xFF
            assert byte == (f32_bits(sf[i, g].item()) >> 23)
        for g in range(nbk, 4 * W):  # padding bytes are zero in the reference
            assert (packed[i, g // 4].item() >> (8 * (g % 4))) & 0xFF == 0
    assert (packed.as_strided((W, P), (P, 1))[:, nbm:] == 0).all()
    rowpacked = F.store_sf(sf, False, True)
    assert rowpacked.shape == (nbm, W) and rowpacked.is_contiguous()
    for t in (row, col, packed, rowpacked):
        assert torch.equal(F.load_sf(t, nbk), sf)
    assert F.sf_is_col_major(col) and not F.sf_is_col_major(row)


def test_col_sf_strides_match_probe_and_empty():
    assert F.store_sf(torch.rand(5, 2), True, False).stride() == (1, 8)
    e = F.store_sf(torch.rand(0, 3), True, True)
    assert e.shape == (0, 1) and e.dtype == torch.int32
    assert not F.sf_is_col_major(torch.rand(7, 1))  # (T, 1) contiguous counts as row-major


def test_load_sf_e4m3_and_bad_dtype():
    q = F.e4m3_encode(torch.tensor([[0.5, 3.0]]))
    assert F.load_sf(q, 2).tolist() == [[0.5, 3.0]]
    with pytest.raises(TypeError, match="sf"):
        F.load_sf(torch.zeros(1, 1, dtype=torch.float16), 1)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "e5m6"])
def test_quantize_dequantize(fmt):
    v = torch.randn(3, 16) * 4
    sf_inv = torch.tensor([[0.5], [1.0], [2.0]])
    q = F.quantize(v, sf_inv, fmt)
    assert F.fmt_of(q) == fmt and F.logical_width(q, fmt) == 16
    scaled = v * sf_inv
    enc = {"e4m3": lambda s: F.e4m3_decode(F.e4m3_encode(s)),
           "e2m1": lambda s: F.e2m1_decode(F.e2m1_encode(s)),
           "e5m6": lambda s: F.e5m6_decode(F.e5m6_encode(s))}[fmt]
    assert torch.equal(F.dequantize(q, fmt), enc(scaled))
    with pytest.raises(ValueError, match="fmt"):
        F.quantize(v, sf_inv, "e3m2")
