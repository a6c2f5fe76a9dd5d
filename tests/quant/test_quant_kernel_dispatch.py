"""The public quant ops hand CUDA tensors to their kernels (after validation) and return exactly what the
reference returns for the same CUDA tensors: data, sf and strides, bitwise (packed-sf padding cleared, as
quant.md 6.1 allows). The kernels' own tiers are in the test_*_kernel.py files; this checks the wiring."""
import pytest
import torch

import tilefuse.quant as Q
from tilefuse import _registry, formats as F
from tilefuse.reference import quant as R
from tilefuse.testing import assert_equal, clear_unused_sf

WIRED = ("per_token_cast", "per_token_cast_with_sf_only", "per_token_cast_with_precomputed_sf", "per_block_cast",
         "per_block_cast_with_sf_only", "per_block_cast_with_precomputed_sf", "per_block_cast_lossless",
         "cast_back", "per_token_cast_back", "cast_back_e5m6", "unpack_from_e2m1fn_x2", "per_token_cast_to_e5m6",
         "per_channel_cast", "per_channel_cast_and_transpose", "per_channel_cast_fused",
         "swiglu_backward_and_per_token_cast", "swiglu_forward_and_per_channel_cast_and_transpose",
         "batched_transpose_weight_sf")
T, H = 133, 512


def test_registry_says_kernel():
    ops = _registry.load_all()
    assert {name for name in WIRED if ops[f"quant.{name}"]["path"] != "kernel"} == set()


def _x(dtype=torch.bfloat16):
    return (torch.randn(T, H, device="cuda") * torch.exp2(torch.randint(-8, 9, (T, 1), device="cuda"))).to(dtype)


def _same_sf(got, want, hidden, npc):
    if want.dtype == torch.int32:  # packed UE8M0: the padding bytes of the last word are unspecified
        assert_equal(clear_unused_sf(got, hidden, npc), clear_unused_sf(want, hidden, npc))
    else:
        assert_equal(got, want)


def _same(got, want, hidden=H, npc=None):
    assert_equal(got[0], want[0])
    _same_sf(got[1], want[1], hidden, npc)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("block", ((32, 128), (128, 32)))
@pytest.mark.parametrize("layout", ((False, False, False), (True, True, True)))
def test_per_block_family(fmt, block, layout):
    x = _x(torch.float32)
    want = R.cast(x, fmt, block, round_sf=layout[1], use_tma_aligned_col_major_sf=layout[0],
                  use_packed_ue8m0=layout[2])
    _same(Q.per_block_cast(x, fmt, block, *layout), want, npc=block[1])
    _same_sf(Q.per_block_cast_with_sf_only(x, fmt, block, *layout), want[1], H, block[1])
    sf = R.cast(x, fmt, block)[1]
    assert_equal(Q.per_block_cast_with_precomputed_sf(x, fmt, block, sf), R.cast(x, fmt, block, sf=sf))


@pytest.mark.gpu
@pytest.mark.parametrize("out_block", ((1, 128), (128, 128)))
def test_lossless(out_block):
    pair = R.cast(torch.randn(T, H, device="cuda"), "e2m1", (1, 32), round_sf=True)  # exponents within 11
    want = R.per_block_cast_lossless(pair, (1, 32), out_block, False, False)
    _same(Q.per_block_cast_lossless(pair, "e4m3", (1, 32), out_block), want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("out", ("bf16", "fp32"))
def test_cast_back_family(fmt, out):
    pair = R.cast(_x(), fmt, (1, 128), round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    want = R.cast_back(pair, out, (1, 128))
    assert_equal(Q.cast_back(pair, out, (1, 128)), want)
    assert_equal(Q.per_token_cast_back(pair, out, 128), want)
    block_pair = R.cast(_x(), fmt, (128, 128))
    assert_equal(Q.cast_back(block_pair, out, (128, 128)), R.cast_back(block_pair, out, (128, 128)))


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", (torch.float32, torch.bfloat16))
def test_unpack(out_dtype):
    packed = torch.randint(-128, 128, (T, H // 2), device="cuda", dtype=torch.int8)
    want = F.e2m1_decode(F.e2m1_unpack(packed)).to(out_dtype)
    assert_equal(Q.unpack_from_e2m1fn_x2(packed, out_dtype), want)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ((False, False, False), (True, True, False), (True, True, True)))
def test_e5m6(layout):
    x = _x()
    want = R.cast_to_e5m6(x, H, *layout)
    _same(Q.per_token_cast_to_e5m6(x, H, *layout), want, npc=H)
    _same(Q.per_token_cast(x, "e5m6", H, None, *layout), want, npc=H)
    pair = R.cast_to_e5m6(x, H)
    back = R.cast_back_from_e5m6(pair, "fp32", (1, H))
    assert_equal(Q.cast_back_e5m6(pair, "fp32", (1, H)), back)
    assert_equal(Q.cast_back(pair, "fp32", (1, H), "e5m6"), back)


@pytest.mark.gpu
@pytest.mark.parametrize("round_sf", (False, True))
def test_per_channel_family(round_sf):
    x = _x()[:128]
    want = R.cast(x, "e4m3", (128, 1), round_sf=round_sf)
    _same(Q.per_channel_cast(x, "e4m3", 128, round_sf), want)
    got = Q.per_channel_cast_and_transpose(x, "e4m3", 128, round_sf)
    assert_equal(got[0], want[0].T.contiguous())
    assert_equal(got[1], want[1])
    pos = torch.randint(-1, 128, (144,), dtype=torch.int32, device="cuda")
    _same(Q.per_channel_cast_fused(x, "e4m3", 128, round_sf, None, pos),
          R.per_channel_cast_fused(x, 128, None, round_sf, pos))


@pytest.mark.gpu
@pytest.mark.parametrize("without_transpose", (False, True))
def test_swiglu_per_channel(without_transpose):
    x = torch.randn(256, 2 * H, device="cuda").to(torch.bfloat16)
    from tilefuse.reference import swiglu as RS
    data, sf = R.cast(RS.swiglu_forward(x, swiglu_clamp_value=0.5).to(torch.bfloat16), "e4m3", (128, 1))
    got = Q.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 128, False, without_transpose, 0.5)
    assert_equal(got[0], data if without_transpose else data.T.contiguous())
    assert_equal(got[1], sf)
