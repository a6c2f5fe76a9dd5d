"""per_token_cast and its sf-only / precomputed variants (quant.md 3.1-3.3, 1.4-1.7, 9.2) against hand values
and a scalar-loop oracle; invariants, layouts, pre-quantized pairs, strided rows, T = 0, errors."""
import math

import pytest
import torch

from tilefuse import formats as F
from tilefuse import quant as Q
from tilefuse.reference import quant as R
from tilefuse.testing import assert_equal, calc_diff, check_bias
from tests.formats.scalar_oracle import block_cast, f32

# Round-trip quality bounds of quant.md 6.3 (calc_diff of cast_back(per_token_cast(x)) vs x).
DIFF_E4M3 = 1e-3
DIFF_E2M1 = 2e-2


def codes_of(data: torch.Tensor, fmt: str) -> list[list[int]]:
    if fmt == "e4m3":
        return data.view(torch.uint8).tolist()
    return F.e2m1_unpack(data).tolist()


def check_against_oracle(x, fmt, npc, round_sf, data, sf, **kw):
    codes, osf = block_cast(x.float().tolist(), fmt, 1, npc, round_sf, **kw)
    assert codes_of(data, fmt) == codes
    assert F.load_sf(sf, F.cdiv(x.size(1), npc)).tolist() == osf


# --------------------------------------------------------------------------------------------- hand cases

def test_hand_e4m3_rows():
    x = torch.ones(2, 32)
    x[0, 0] = 448.0
    x[0, 16:] = 3.0                      # group 1: amax 3
    x[1, :16] = 0.0                      # all-zero group: sf = 1e-4/448, codes 0
    x[1, 16] = -0.0
    x[1, 17] = -1.0
    out, sf = Q.per_token_cast(x, "e4m3", 16)
    b = out.view(torch.uint8)
    assert sf.tolist()[0] == [1.0, f32(3.0 / 448)] and sf[1, 0].item() == f32(f32(1e-4) / 448)
    assert b[0, 0].item() == 0x7E and b[0, 1].item() == 0x38       # 448 and 1.0 with sf 1
    assert b[0, 16].item() == 0x7E                                  # the amax always maps to 448
    assert b[1, :16].tolist() == [0] * 16
    out, sf = Q.per_token_cast(x, "e4m3", 16, round_sf=True)
    b = out.view(torch.uint8)
    # amax 3 -> 3/448 in (2^-8, 2^-7] -> sf 2^-7, sf_inv 128: 3*128 = 384 = 1.5*2^8 -> code 0x7C;
    # row 1: amax 1 -> sf 2^-8, sf_inv 256: -1*256 = -(1.0*2^8) -> exponent field 15 -> 0xF8; -0 -> 0x80
    assert sf[0, 1].item() == 2.0 ** -7 and b[0, 16].item() == 0x7C and b[0, 17].item() == 0x7C
    assert sf[1, 1].item() == 2.0 ** -8 and b[1, 17].item() == 0xF8 and b[1, 16].item() == 0x80


def test_hand_e2m1_row():
    x = torch.tensor([[6.0, -3.0, 0.25, 0.75, 1.25, -1.75, 2.5, 5.0] * 2])
    out, sf = Q.per_token_cast(x, "e2m1", 16)
    assert out.dtype == torch.int8 and out.shape == (1, 8) and sf.tolist() == [[1.0]]
    # pairs (6, -3) -> codes 7, 0xD -> byte 0xD7; (0.25, 0.75) -> 0, 2 -> 0x20; (1.25, -1.75) -> 2, 0xC -> 0xC2;
    # (2.5, 5) -> 4, 6 -> 0x64
    assert out.view(torch.uint8).tolist()[0] == [0xD7, 0x20, 0xC2, 0x64] * 2


def test_special_values_match_observed_kernel():
    x = torch.ones(2, 32)
    x[0, 3] = math.nan
    x[0, 5] = 2.0                       # the NaN is ignored: amax 2
    x[1, 0] = math.inf
    x[1, 1] = -1.0
    out, sf = Q.per_token_cast(x, "e4m3", 32)
    b = out.view(torch.uint8)
    assert sf[0, 0].item() == f32(2.0 / 448) and b[0, 3].item() == 0x7F
    assert sf[1, 0].item() == math.inf and b[1, 0].item() == 0x7F and b[1, 1].item() == 0x80 and b[1, 2].item() == 0
    codes = F.e2m1_unpack(Q.per_token_cast(x, "e2m1", 32)[0])
    assert codes[0, 3].item() == 7 and codes[1, 0].item() == 7 and codes[1, 1].item() == 8


# --------------------------------------------------------------------------------------------- oracle

@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_last_group_against_scalar_loop(fmt, round_sf, dtype):
    x = (torch.randn(3, 576) * torch.exp2(torch.randint(-8, 8, (3, 1)).float())).to(dtype)
    out, sf = Q.per_token_cast(x, fmt, 128, round_sf=round_sf)
    assert sf.shape == (3, 5) and out.shape == ((3, 576) if fmt == "e4m3" else (3, 288))
    check_against_oracle(x, fmt, 128, round_sf, out, sf)


@pytest.mark.parametrize("npc", [16, 32, 64, 128])
def test_group_sizes_against_scalar_loop(npc):
    x = torch.randn(2, 256) * 5
    out, sf = Q.per_token_cast(x, "e4m3", npc)
    check_against_oracle(x, "e4m3", npc, False, out, sf)


def test_npc_equal_hidden():
    x = torch.randn(3, 192)
    out, sf = Q.per_token_cast(x, "e4m3", 192, round_sf=True)
    assert sf.shape == (3, 1)
    check_against_oracle(x, "e4m3", 192, True, out, sf)


# --------------------------------------------------------------------------------------------- pairs

@pytest.mark.parametrize("in_fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("xbs", [(1, 128), (32, 32)])
def test_pre_quantized_pair_uses_order_a(in_fmt, xbs):
    src = torch.randn(40, 256, dtype=torch.bfloat16)
    pair = R.cast(src, in_fmt, xbs)                  # non-power-of-two input sf
    out, sf = Q.per_token_cast(pair, "e4m3", 32, x_block_size=xbs)
    data_vals = F.dequantize(pair[0], in_fmt)
    sf_in = R.expand_blocks(pair[1], *xbs, 40, 256)
    codes, osf = block_cast(data_vals.tolist(), "e4m3", 1, 32, False, sf_in=sf_in.tolist(), order="A")
    assert out.view(torch.uint8).tolist() == codes and sf.tolist() == osf


def test_pre_quantized_pair_with_col_packed_sf():
    src = torch.randn(8, 256)
    pair = R.cast(src, "e2m1", (1, 32), round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    row_pair = (pair[0], F.load_sf(pair[1], 8))
    a = Q.per_token_cast(pair, "e4m3", 128, x_block_size=(1, 32), round_sf=True)
    b = Q.per_token_cast(row_pair, "e4m3", 128, x_block_size=(1, 32), round_sf=True)
    assert_equal(a[0], b[0])
    assert_equal(a[1], b[1])
    assert a[1].tolist() != [[0.0, 0.0]] * 8


# --------------------------------------------------------------------------------------------- layouts, invariants

@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_col_and_packed_layouts_hold_the_row_major_values(fmt):
    x = torch.randn(5, 576)
    _, row = Q.per_token_cast(x, fmt, 64, round_sf=True)
    d1, col = Q.per_token_cast(x, fmt, 64, use_tma_aligned_col_major_sf=True, round_sf=True)
    d2, pk = Q.per_token_cast(x, fmt, 64, use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)
    assert col.stride() == (1, 8) and torch.equal(col, row)
    assert pk.dtype == torch.int32 and pk.shape == (5, 3) and pk.stride() == (1, 8)
    assert torch.equal(F.load_sf(pk, 9), row)
    assert_equal(d1, d2)


@pytest.mark.parametrize("fmt,bound", [("e4m3", DIFF_E4M3), ("e2m1", DIFF_E2M1)])
@pytest.mark.parametrize("round_sf", [False, True])
def test_round_trip_quality_and_bias(fmt, bound, round_sf):
    x = torch.randn(64, 512)
    out, sf = Q.per_token_cast(x, fmt, 32, round_sf=round_sf)
    back = Q.cast_back((out, sf), "fp32", (1, 32))
    assert calc_diff(back, x) < bound
    check_bias(back, x)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("flags", [(False, False, False), (False, True, False), (True, True, True)])
def test_sf_only_equals_full_sf(fmt, flags):
    x = torch.randn(9, 576, dtype=torch.bfloat16)
    assert_equal(Q.per_token_cast_with_sf_only(x, fmt, 128, None, *flags), Q.per_token_cast(x, fmt, 128, None, *flags)[1])


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_precomputed_with_own_sf_equals_full_data(fmt):
    x = torch.randn(6, 256)
    out, sf = Q.per_token_cast(x, fmt, 64, round_sf=True)  # power-of-two sf: 1/sf == the op's sf_inv
    assert_equal(Q.per_token_cast_with_precomputed_sf(x, fmt, 64, sf), out)


def test_precomputed_uses_reciprocal_of_given_sf():
    x = torch.randn(4, 128)
    sf = torch.rand(4, 2) * 0.02 + 0.001
    out = Q.per_token_cast_with_precomputed_sf(x, "e4m3", 64, sf, round_sf=True)  # round_sf is ignored
    codes, _ = block_cast(x.tolist(), "e4m3", 1, 64, False, given_sf=sf.tolist())
    assert out.view(torch.uint8).tolist() == codes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_strided_view_equals_contiguous(dtype):
    big = torch.randn(7, 1024).to(dtype)
    view = big[:, :576]
    for fmt in ("e4m3", "e2m1"):
        a = Q.per_token_cast(view, fmt, 128, round_sf=True)
        b = Q.per_token_cast(view.contiguous(), fmt, 128, round_sf=True)
        assert_equal(a[0], b[0])
        assert_equal(a[1], b[1])


def test_cpu_dispatch_equals_reference():
    x = torch.randn(11, 320)
    a = Q.per_token_cast(x, "e2m1", 64, None, True, True, True)
    b = R.cast(x, "e2m1", (1, 64), round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    assert_equal(a[0], b[0])
    assert_equal(a[1], b[1])


@pytest.mark.parametrize("flags,sf_shape,sf_dtype", [((False, False, False), (0, 5), torch.float32),
                                                     ((True, True, False), (0, 5), torch.float32),
                                                     ((True, True, True), (0, 2), torch.int32)])
def test_zero_tokens(flags, sf_shape, sf_dtype):
    x = torch.empty(0, 576)
    out, sf = Q.per_token_cast(x, "e2m1", 128, None, *flags)
    assert out.shape == (0, 288) and out.dtype == torch.int8
    assert sf.shape == sf_shape and sf.dtype == sf_dtype
    assert Q.per_token_cast_with_sf_only(x, "e4m3", 128, None, *flags).shape == sf_shape
    assert Q.per_token_cast_with_precomputed_sf(x, "e4m3", 128, torch.empty(0, 5)).shape == (0, 576)


# --------------------------------------------------------------------------------------------- errors

def test_errors():
    x = torch.randn(4, 256)
    with pytest.raises(ValueError, match="fmt"):
        Q.per_token_cast(x, "e3m4", 128)
    with pytest.raises(ValueError, match="num_per_channels"):
        Q.per_token_cast(x, "e4m3", 48)
    with pytest.raises(ValueError, match="num_per_channels"):
        Q.per_token_cast(torch.randn(4, 200), "e4m3", 200)      # npc == hidden needs hidden % 64 == 0
    with pytest.raises(ValueError, match="hidden"):
        Q.per_token_cast(torch.randn(4, 33), "e2m1", 16)
    with pytest.raises(TypeError, match="x"):
        Q.per_token_cast(x.half(), "e4m3", 128)
    with pytest.raises(ValueError, match="x"):
        Q.per_token_cast(x[None], "e4m3", 128)
    with pytest.raises(ValueError, match="use_packed_ue8m0"):
        Q.per_token_cast(x, "e4m3", 128, round_sf=True, use_packed_ue8m0=True)   # packed without col (v1)
    with pytest.raises(ValueError, match="round_sf"):
        Q.per_token_cast(x, "e4m3", 128, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    with pytest.raises(ValueError, match="x_block_size"):
        Q.per_token_cast(x, "e4m3", 128, x_block_size=(1, 128))
    pair = R.cast(x, "e4m3", (1, 128))
    with pytest.raises(ValueError, match="x_block_size"):
        Q.per_token_cast(pair, "e4m3", 128)
    with pytest.raises(ValueError, match="sf"):
        Q.per_token_cast(pair, "e4m3", 128, x_block_size=(1, 64))   # sf shape does not fit the block
    with pytest.raises(ValueError, match="num_per_channels"):
        Q.per_token_cast(pair, "e4m3", 16, x_block_size=(1, 128))
    with pytest.raises(TypeError, match="pair"):
        Q.per_token_cast_with_sf_only(pair, "e4m3", 128, x_block_size=(1, 128))
    with pytest.raises(ValueError, match="num_per_channels"):
        Q.per_token_cast_with_sf_only(torch.randn(2, 192), "e4m3", 192)
    with pytest.raises(ValueError, match="use_tma_aligned_col_major_sf"):
        Q.per_token_cast_with_precomputed_sf(x, "e4m3", 128, torch.ones(4, 2), use_tma_aligned_col_major_sf=True)
    with pytest.raises(ValueError, match="sf"):
        Q.per_token_cast_with_precomputed_sf(x, "e4m3", 128, torch.ones(4, 3))
    with pytest.raises(TypeError, match="sf"):
        Q.per_token_cast_with_precomputed_sf(x, "e4m3", 128, torch.ones(4, 2, dtype=torch.float64))
