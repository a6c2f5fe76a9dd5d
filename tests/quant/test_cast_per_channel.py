"""per_channel_cast, per_channel_cast_and_transpose, per_channel_cast_fused (quant.md 3.8-3.10)."""
import pytest
import torch

from tilefuse import formats as F
from tilefuse import quant as Q
from tilefuse.reference import quant as R
from tilefuse.testing import assert_equal, calc_diff, check_bias
from tests.formats.scalar_oracle import block_cast, f32

DIFF_E4M3 = 1e-3  # quant.md 6.3


def u8(t):
    return t.view(torch.uint8).tolist()


def test_hand_per_channel():
    x = torch.ones(128, 64)
    x[7, 3] = -4.0
    x[:, 5] = 0.0
    out, sf = Q.per_channel_cast(x, "e4m3", 128)
    assert sf.shape == (1, 64) and sf[0, 3].item() == f32(4 / 448) and sf[0, 0].item() == f32(1 / 448)
    assert sf[0, 5].item() == f32(f32(1e-4) / 448) and out.view(torch.uint8)[7, 3].item() == 0xFE
    assert u8(out[:, 5]) == [0] * 128


@pytest.mark.parametrize("round_sf", [False, True])
def test_per_channel_against_scalar_loop(round_sf):
    x = (torch.randn(256, 64) * torch.exp2(torch.randint(-5, 5, (1, 64)).float())).bfloat16()
    out, sf = Q.per_channel_cast(x, "e4m3", 128, round_sf)
    codes, osf = block_cast(x.float().tolist(), "e4m3", 128, 1, round_sf)
    assert u8(out) == codes and sf.tolist() == osf and sf.is_contiguous()
    back = Q.cast_back((out, sf), "fp32", (128, 1))
    assert calc_diff(back, x.float()) < DIFF_E4M3
    check_bias(back, x.float())


@pytest.mark.parametrize("npt", [32, 128])
@pytest.mark.parametrize("round_sf", [False, True])
def test_and_transpose(npt, round_sf):
    x = torch.randn(128, 128, dtype=torch.bfloat16)
    out, sf = Q.per_channel_cast_and_transpose(x, "e4m3", npt, round_sf)
    assert out.shape == (128, 128) and out.is_contiguous() and sf.shape == (128 // npt, 128)
    codes, osf = block_cast(x.float().tolist(), "e4m3", npt, 1, round_sf)
    assert u8(out.T) == codes and sf.tolist() == osf


def test_fused_without_gather_equals_per_channel_cast():
    x = torch.randn(256, 128)
    a = Q.per_channel_cast_fused(x, "e4m3", 128, True)
    b = Q.per_channel_cast(x, "e4m3", 128, True)
    assert_equal(a[0], b[0])
    assert_equal(a[1], b[1])


def test_fused_gather_with_padding_rows_and_partial_block():
    x = torch.randn(50, 64)
    pos = torch.randint(-1, 50, (144,), dtype=torch.int32)     # T_out = 144: one full block and a partial one
    pos[:3] = -1
    out, sf = Q.per_channel_cast_fused(x, "e4m3", 128, False, pos_to_token=pos)
    assert out.shape == (144, 64) and sf.shape == (2, 64)
    rows = [[0.0] * 64 if p < 0 else x[p].tolist() for p in pos.tolist()]
    codes, osf = block_cast(rows, "e4m3", 128, 1, False)
    assert u8(out) == codes and sf.tolist() == osf
    assert u8(out[0]) == [0] * 64


@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("gather", [False, True])
def test_fused_pre_quantized_pair_uses_order_b(round_sf, gather):
    src = torch.randn(128, 256, dtype=torch.bfloat16)
    data, sf_in = R.cast(src, "e4m3", (1, 128))               # unrounded per-token input sf
    pos = torch.randint(-1, 128, (128,), dtype=torch.int32) if gather else None
    out, sf = Q.per_channel_cast_fused((data, sf_in), "e4m3", 128, round_sf, 128, pos)
    vals = data.float()
    sfe = R.expand_blocks(sf_in, 1, 128, 128, 256)
    if gather:
        idx = pos.clamp_min(0).long()
        keep = (pos >= 0)[:, None]
        vals = torch.where(keep, vals[idx], 0.0)
        sfe = torch.where(keep, sfe[idx], 0.0)
    codes, osf = block_cast(vals.tolist(), "e4m3", 128, 1, round_sf, sf_in=sfe.tolist(), order="B")
    assert u8(out) == codes and sf.tolist() == osf


def test_zero_tokens():
    out, sf = Q.per_channel_cast(torch.empty(0, 64), "e4m3", 128)
    assert out.shape == (0, 64) and sf.shape == (0, 64)
    out, sf = Q.per_channel_cast_and_transpose(torch.empty(0, 64, dtype=torch.bfloat16), "e4m3", 32)
    assert out.shape == (64, 0) and sf.shape == (0, 64)
    out, sf = Q.per_channel_cast_fused(torch.randn(5, 64), "e4m3", 128, pos_to_token=torch.empty(0, dtype=torch.int32))
    assert out.shape == (0, 64) and sf.shape == (0, 64)


def test_errors():
    x = torch.randn(128, 64)
    with pytest.raises(ValueError, match="num_tokens"):
        Q.per_channel_cast(torch.randn(100, 64), "e4m3", 128)
    with pytest.raises(ValueError, match="hidden"):
        Q.per_channel_cast(torch.randn(128, 96), "e4m3", 128)
    with pytest.raises(ValueError, match="num_per_tokens"):
        Q.per_channel_cast(x, "e4m3", 32)
    with pytest.raises(ValueError, match="fmt"):
        Q.per_channel_cast(x, "e2m1", 128)
    with pytest.raises(TypeError, match="x"):
        Q.per_channel_cast_and_transpose(x, "e4m3", 32)           # bf16 only
    with pytest.raises(ValueError, match="num_per_tokens"):
        Q.per_channel_cast_and_transpose(x.bfloat16(), "e4m3", 64)
    with pytest.raises(TypeError, match="pos_to_token"):
        Q.per_channel_cast_fused(x, "e4m3", 128, pos_to_token=torch.zeros(16, dtype=torch.int64))
    with pytest.raises(ValueError, match="pos_to_token"):
        Q.per_channel_cast_fused(x, "e4m3", 128, pos_to_token=torch.zeros(20, dtype=torch.int32))
    with pytest.raises(ValueError, match="num_per_channels"):
        Q.per_channel_cast_fused(x, "e4m3", 128, num_per_channels=128)
    pair = R.cast(torch.randn(128, 128), "e4m3", (1, 128))
    with pytest.raises(ValueError, match="num_per_channels"):
        Q.per_channel_cast_fused(pair, "e4m3", 128)
    with pytest.raises(ValueError, match="num_tokens"):
        Q.per_channel_cast_fused(torch.randn(100, 64), "e4m3", 128)
