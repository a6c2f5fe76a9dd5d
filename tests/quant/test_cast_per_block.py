"""per_block_cast (+ sf-only, precomputed) and per_block_cast_lossless (quant.md 3.6, 3.7)."""
import pytest
import torch

from tilefuse import formats as F
from tilefuse import quant as Q
from tilefuse.reference import quant as R
from tilefuse.testing import assert_equal, calc_diff, check_bias
from tests.formats.scalar_oracle import block_cast, f32

DIFF_E4M3 = 1e-3  # quant.md 6.3 round-trip bounds
DIFF_E2M1 = 2e-2


def codes_of(data, fmt):
    return data.view(torch.uint8).tolist() if fmt == "e4m3" else F.e2m1_unpack(data).tolist()


def test_hand_partial_row_block():
    x = torch.ones(33, 64)
    x[32, 5] = -2.0          # the only real row of row-block 1
    x[0, 40] = 7.0
    out, sf = Q.per_block_cast(x, "e4m3", (32, 32))
    assert sf.tolist() == [[f32(1 / 448), f32(7 / 448)], [f32(2 / 448), f32(1 / 448)]]
    assert out.view(torch.uint8)[32, 5].item() == 0xFE and out.view(torch.uint8)[0, 40].item() == 0x7E


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("block", [(128, 128), (32, 32), (32, 128)])
@pytest.mark.parametrize("round_sf", [False, True])
def test_against_scalar_loop(fmt, block, round_sf):
    x = (torch.randn(100, 128) * torch.exp2(torch.randint(-6, 6, (100, 1)).float())).bfloat16()
    out, sf = Q.per_block_cast(x, fmt, block, round_sf=round_sf)
    codes, osf = block_cast(x.float().tolist(), fmt, *block, round_sf)
    assert codes_of(out, fmt) == codes and sf.tolist() == osf


@pytest.mark.parametrize("T,strides", [(100, (1, 4)), (130, (1, 8))])
def test_layouts(T, strides):
    x = torch.randn(T, 192)
    _, row = Q.per_block_cast(x, "e2m1", (32, 128), round_sf=True)
    _, col = Q.per_block_cast(x, "e2m1", (32, 128), True, True)
    _, pk = Q.per_block_cast(x, "e2m1", (32, 128), True, True, True)
    assert col.stride() == strides and torch.equal(col, row)
    assert pk.dtype == torch.int32 and pk.shape == (F.cdiv(T, 32), 1) and pk.stride() == strides
    assert torch.equal(F.load_sf(pk, 2), row)


@pytest.mark.parametrize("fmt,bound", [("e4m3", DIFF_E4M3), ("e2m1", DIFF_E2M1)])
def test_round_trip_quality_and_bias(fmt, bound):
    x = torch.randn(128, 256)
    out, sf = Q.per_block_cast(x, fmt, (32, 32))
    back = Q.cast_back((out, sf), "fp32", (32, 32))
    assert calc_diff(back, x) < bound
    check_bias(back, x)


@pytest.mark.parametrize("flags", [(False, False, False), (False, True, False), (True, True, True)])
def test_sf_only_and_precomputed(flags):
    x = torch.randn(70, 256, dtype=torch.bfloat16)
    out, sf = Q.per_block_cast(x, "e4m3", (128, 32), *flags)
    assert_equal(Q.per_block_cast_with_sf_only(x, "e4m3", (128, 32), *flags), sf)
    row_sf = F.load_sf(sf, 8)
    if flags[1]:  # power-of-two sf: 1/sf is the op's sf_inv, so the data match
        assert_equal(Q.per_block_cast_with_precomputed_sf(x, "e4m3", (128, 32), row_sf), out)
    given = torch.rand(1, 8) + 0.01
    got = Q.per_block_cast_with_precomputed_sf(x, "e2m1", (128, 32), given)
    codes, _ = block_cast(x.float().tolist(), "e2m1", 128, 32, False, given_sf=given.tolist())
    assert codes_of(got, "e2m1") == codes


def test_cpu_dispatch_and_zero_tokens():
    x = torch.randn(40, 128)
    a = Q.per_block_cast(x, "e2m1", (32, 32), True, True, True)
    b = R.cast(x, "e2m1", (32, 32), round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    assert_equal(a[0], b[0])
    assert_equal(a[1], b[1])
    out, sf = Q.per_block_cast(torch.empty(0, 128), "e4m3", (32, 32))
    assert out.shape == (0, 128) and sf.shape == (0, 4)
    assert Q.per_block_cast_with_sf_only(torch.empty(0, 128), "e4m3", (32, 32), True, True, True).shape == (0, 1)


def test_errors():
    x = torch.randn(64, 128)
    with pytest.raises(ValueError, match="block_size"):
        Q.per_block_cast(x, "e4m3", (64, 64))
    with pytest.raises(TypeError, match="block_size"):
        Q.per_block_cast(x, "e4m3", 128)
    with pytest.raises(ValueError, match="hidden"):
        Q.per_block_cast(torch.randn(64, 96), "e4m3", (32, 32))
    with pytest.raises(ValueError, match="contiguous"):
        Q.per_block_cast(torch.randn(64, 256)[:, :128], "e4m3", (32, 32))
    with pytest.raises(ValueError, match="fmt"):
        Q.per_block_cast(x, "e5m6", (32, 32))
    with pytest.raises(ValueError, match="use_packed_ue8m0"):
        Q.per_block_cast_with_precomputed_sf(x, "e4m3", (32, 32), torch.ones(2, 4), use_packed_ue8m0=True)
    with pytest.raises(ValueError, match="sf"):
        Q.per_block_cast_with_precomputed_sf(x, "e4m3", (32, 32), torch.ones(2, 3))


# --------------------------------------------------------------------------------------------- lossless

def lossless_input(T, H, obm, obk, low=-20, seed_spread=12):
    """FP4 data with (1, 32) power-of-two sf whose exponents stay within 11 of their output block's max."""
    codes = torch.randint(0, 16, (T, H), dtype=torch.uint8)
    nb = H // 32
    base = torch.randint(low, low + 30, (F.cdiv(T, obm), F.cdiv(nb, obk // 32)))
    e = R.expand_blocks(base, obm, obk // 32, T, nb) + torch.randint(0, seed_spread, (T, nb))
    return F.e2m1_pack(codes), torch.exp2(e.float())


def test_lossless_hand_case():
    codes = torch.tensor([[7, 1] + [0] * 30 + [2, 0] + [0] * 30], dtype=torch.uint8)  # 6, 0.5 | 1.0
    data = F.e2m1_pack(codes)
    sf_in = torch.tensor([[2.0 ** 3, 2.0 ** -5]])       # biased exponents 130 and 122
    out, sf = Q.per_block_cast_lossless((data, sf_in), "e4m3", (1, 32), (1, 64))
    # E_B = max(130, 122) - 6 = 124 -> sf 2^-3; factors 2^(130-124) = 64 and 2^(122-124) = 1/4
    assert sf.tolist() == [[2.0 ** -3]]
    assert out.float()[0, :2].tolist() == [384.0, 32.0] and out.float()[0, 32].item() == 0.25
    # all exponents <= 6: E_B = 0 and the stored sf is +0.0 (bit pattern 0)
    _, sf0 = Q.per_block_cast_lossless((data, torch.tensor([[2.0 ** -125, 2.0 ** -126]])), "e4m3", (1, 32), (1, 64))
    assert sf0.view(torch.int32).tolist() == [[0]]


@pytest.mark.parametrize("out_block", [(1, 128), (32, 32), (128, 128)])
@pytest.mark.parametrize("flags", [(False, False), (True, True)])
@pytest.mark.parametrize("in_packed", [False, True])
def test_lossless_round_trip_is_bit_exact(out_block, flags, in_packed):
    data, sf_in = lossless_input(40, 256, *out_block)
    x_sf = F.store_sf(sf_in, True, True) if in_packed else sf_in
    out, sf = Q.per_block_cast_lossless((data, x_sf), "e4m3", (1, 32), out_block, flags[0], True, flags[1])
    assert out.dtype == torch.float8_e4m3fn and out.shape == (40, 256)
    if flags[0]:
        assert sf.stride() == (1, F.align(F.cdiv(40, out_block[0]), 4))
    assert_equal(Q.cast_back((out, sf), "fp32", out_block), Q.cast_back((data, sf_in), "fp32", (1, 32)))


def test_lossless_errors():
    data, sf_in = lossless_input(32, 128, 32, 32)
    with pytest.raises(ValueError, match="fmt"):
        Q.per_block_cast_lossless((data, sf_in), "e2m1", (1, 32), (32, 32))
    with pytest.raises(ValueError, match="out_block_size"):
        Q.per_block_cast_lossless((data, sf_in), "e4m3", (1, 32), (32, 48))
    with pytest.raises(ValueError, match="out_block_size"):
        Q.per_block_cast_lossless((data, sf_in), "e4m3", (1, 32), (32, 16))
    with pytest.raises(TypeError, match="x"):
        Q.per_block_cast_lossless(torch.randn(32, 128), "e4m3", (1, 32), (32, 32))
    with pytest.raises(ValueError, match="use_packed_ue8m0"):
        Q.per_block_cast_lossless((data, sf_in), "e4m3", (1, 32), (32, 32), False, True, True)
    spread = sf_in.clone()
    spread[0, 0], spread[0, 1] = 2.0 ** 20, 2.0 ** 5  # 15 apart inside one output block
    with pytest.raises(ValueError, match="exponent"):
        Q.per_block_cast_lossless((data, spread), "e4m3", (1, 32), (32, 32))
    out, sf = Q.per_block_cast_lossless((data[:0], sf_in[:0]), "e4m3", (1, 32), (32, 32))
    assert out.shape == (0, 128) and sf.shape == (0, 4)
