"""cast_back / per_token_cast_back, unpack_from_e2m1fn_x2, the E5M6 cast and cast-back (quant.md 1.2, 3.4,
3.5, 2.3) and the in-place per_token_cast_and_cast_back (5.8)."""
import math

import pytest
import torch

from tilefuse import formats as F
from tilefuse import quant as Q
from tilefuse.reference import quant as R
from tilefuse.testing import assert_equal, calc_diff
from tests.formats.scalar_oracle import VALUE, e5m6_code, f32, scale

DIFF_E4M3, DIFF_E2M1 = 1e-3, 2e-2          # quant.md 6.3 round-trip bounds
DIFF_E5M6_RANDOM, DIFF_E5M6_SPECIAL = 1e-4, 5e-6


def loop_cast_back(codes, fmt, sf, bm, bk):
    """out[i][j] = value(code) * sf[i // bm][j // bk] in binary32, by loops."""
    return [[f32(VALUE[fmt](c) * sf[i // bm][j // bk]) for j, c in enumerate(row)] for i, row in enumerate(codes)]


# --------------------------------------------------------------------------------------------- cast_back

def test_hand_cast_back():
    data = torch.tensor([[0x38, 0xC0] + [0x7E] * 62], dtype=torch.uint8).view(torch.float8_e4m3fn)  # 1, -2, 448
    sf = torch.tensor([[0.5, 3.0]])
    out = Q.cast_back((data, sf), "fp32", (1, 32))
    assert out[0, :2].tolist() == [0.5, -1.0] and out[0, 31].item() == 224.0 and out[0, 32].item() == 1344.0
    fp4 = F.e2m1_pack(torch.tensor([[7, 9] + [2] * 62], dtype=torch.uint8))   # 6, -0.5, 1 ...
    out = Q.per_token_cast_back((fp4, torch.tensor([[0.25]])), "bf16", 64)
    assert out.dtype == torch.bfloat16 and out[0, :3].tolist() == [1.5, -0.125, 0.25]


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("out_fmt", ["fp32", "bf16"])
@pytest.mark.parametrize("block", [(1, 128), (128, 1), (32, 32)])
def test_cast_back_against_loop(fmt, out_fmt, block):
    x = torch.randn(130, 128)
    data, sf = R.cast(x, fmt, block)                      # non-power-of-two fp32 sf
    out = Q.cast_back((data, sf), out_fmt, block)
    codes = data.view(torch.uint8).tolist() if fmt == "e4m3" else F.e2m1_unpack(data).tolist()
    want = torch.tensor(loop_cast_back(codes, fmt, sf.tolist(), *block))
    assert_equal(out, want if out_fmt == "fp32" else want.bfloat16())


@pytest.mark.parametrize("fmt,bound", [("e4m3", DIFF_E4M3), ("e2m1", DIFF_E2M1)])
def test_cast_back_reads_col_and_packed_sf(fmt, bound):
    x = torch.randn(9, 576)
    row = Q.per_token_cast(x, fmt, 128, round_sf=True)
    col = Q.per_token_cast(x, fmt, 128, None, True, True, False)
    pk = Q.per_token_cast(x, fmt, 128, None, True, True, True)
    ref = Q.per_token_cast_back(row, "fp32", 128)
    assert_equal(Q.per_token_cast_back(col, "fp32", 128), ref)
    assert_equal(Q.cast_back(pk, "fp32", (1, 128)), ref)
    assert calc_diff(ref, x) < bound


def test_cast_back_zero_tokens_and_errors():
    data, sf = R.cast(torch.randn(4, 128), "e4m3", (1, 128))
    assert Q.cast_back((data[:0], sf[:0]), "bf16", (1, 128)).shape == (0, 128)
    with pytest.raises(ValueError, match="fmt"):
        Q.cast_back((data, sf), "fp16", (1, 128))
    with pytest.raises(ValueError, match="x_special_fmt"):
        Q.cast_back((data, sf), "fp32", (1, 128), x_special_fmt="e3m2")
    with pytest.raises(ValueError, match="sf"):
        Q.cast_back((data, sf), "fp32", (1, 64))
    with pytest.raises(ValueError, match="hidden"):
        Q.cast_back(R.cast(torch.randn(4, 96), "e4m3", (1, 32)), "fp32", (1, 32))
    with pytest.raises(TypeError, match="data"):
        Q.cast_back((data.float(), sf), "fp32", (1, 128))
    with pytest.raises(TypeError, match="x_block_size"):
        Q.cast_back((data, sf), "fp32", 128)


# --------------------------------------------------------------------------------------------- unpack

def test_unpack_from_e2m1fn_x2():
    x = torch.tensor([[0x21, 0x8F], [0x70, 0x09]], dtype=torch.uint8)
    out = Q.unpack_from_e2m1fn_x2(x)
    assert out.dtype == torch.float32 and out.tolist() == [[0.5, 1.0, -6.0, -0.0], [0.0, 6.0, -0.5, 0.0]]
    assert math.copysign(1, out[0, 3].item()) == -1
    out3 = Q.unpack_from_e2m1fn_x2(x.view(torch.int8).reshape(2, 1, 2), torch.bfloat16)
    assert out3.shape == (2, 1, 4) and out3.dtype == torch.bfloat16 and out3.float().flatten().tolist() == out.flatten().tolist()
    with pytest.raises(ValueError, match="x"):
        Q.unpack_from_e2m1fn_x2(torch.tensor(3, dtype=torch.int8))
    with pytest.raises(TypeError, match="x"):
        Q.unpack_from_e2m1fn_x2(torch.zeros(2))
    with pytest.raises(TypeError, match="out_dtype"):
        Q.unpack_from_e2m1fn_x2(x, "float32")


# --------------------------------------------------------------------------------------------- E5M6

def e5m6_loop(x, round_sf):
    """Per-row E5M6 cast by loops: (codes, sf)."""
    codes, sfs = [], []
    for row in x.float().tolist():
        sf, inv = scale(max(abs(v) for v in row), "e5m6", round_sf)
        codes.append([e5m6_code(f32(v * inv)) for v in row])
        sfs.append([sf])
    return codes, sfs


@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_e5m6_cast_against_loop(round_sf, dtype):
    x = (torch.randn(6, 64) * torch.exp2(torch.randint(-10, 10, (6, 1)).float())).to(dtype)
    data, sf = Q.per_token_cast(x, "e5m6", 64, round_sf=round_sf)
    assert data.dtype == torch.uint8 and data.shape == (6, 96) and sf.shape == (6, 1)
    codes, osf = e5m6_loop(x, round_sf)
    assert F.e5m6_unpack(data).tolist() == codes and sf.tolist() == osf
    assert_equal(Q.per_token_cast_to_e5m6(x, 64, False, round_sf)[0], data)
    back = Q.cast_back_e5m6((data, sf), "fp32", (1, 64))
    assert back.tolist() == loop_cast_back(codes, "e5m6", osf, 1, 64)
    assert_equal(Q.cast_back((data, sf), "bf16", (1, 64), "e5m6"), back.bfloat16())
    assert calc_diff(back, x.float()) < DIFF_E5M6_RANDOM


@pytest.mark.parametrize("fill", [2.0 ** -20, 2.0 ** -14 * 63 / 64, 2.0 ** -14])
def test_e5m6_special_value_inputs(fill):
    x = torch.full((4, 128), fill)
    x[:, -1] = 65024.0
    data, sf = Q.per_token_cast_to_e5m6(x, 128, round_sf=True)
    assert sf.tolist() == [[1.0]] * 4                       # 65024 / 65024 is already a power of two
    codes, _ = e5m6_loop(x, True)
    assert F.e5m6_unpack(data).tolist() == codes
    assert calc_diff(Q.cast_back_e5m6((data, sf), "fp32", (1, 128)), x) < DIFF_E5M6_SPECIAL


def test_e5m6_layouts_zero_tokens_and_errors():
    x = torch.randn(5, 64)
    d1, row = Q.per_token_cast_to_e5m6(x, 64, False, True)
    d2, pk = Q.per_token_cast_to_e5m6(x, 64, True, True, True)
    assert_equal(d1, d2)
    assert pk.dtype == torch.int32 and pk.shape == (5, 1) and pk.stride() == (1, 8)
    assert torch.equal(F.load_sf(pk, 1), row)
    assert_equal(Q.cast_back_e5m6((d2, pk), "fp32", (1, 64)), Q.cast_back_e5m6((d1, row), "fp32", (1, 64)))
    big = torch.randn(5, 128)
    assert_equal(Q.per_token_cast_to_e5m6(big[:, :64], 64)[0], Q.per_token_cast_to_e5m6(big[:, :64].contiguous(), 64)[0])
    d0, s0 = Q.per_token_cast(torch.empty(0, 64), "e5m6", 64)
    assert d0.shape == (0, 96) and s0.shape == (0, 1)
    with pytest.raises(ValueError, match="num_per_channels"):
        Q.per_token_cast(x, "e5m6", 32)
    with pytest.raises(ValueError, match="hidden"):
        Q.per_token_cast_to_e5m6(torch.randn(2, 12), 12)
    with pytest.raises(ValueError, match="x_block_size"):
        Q.per_token_cast(x, "e5m6", 64, x_block_size=(1, 64))
    with pytest.raises(ValueError, match="data"):
        Q.cast_back_e5m6((torch.zeros(2, 10, dtype=torch.uint8), torch.ones(2, 1)), "fp32", (1, 8))


# --------------------------------------------------------------------------------------------- in place

@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cast_and_cast_back_in_place_equals_the_round_trip(fmt, round_sf, dtype):
    big = torch.randn(8, 512).to(dtype)
    x = big[:, :256]                                         # row-strided, modified in place
    want = Q.cast_back(Q.per_token_cast(x, fmt, 32, round_sf=round_sf), "fp32", (1, 32)).to(dtype)
    rest = big[:, 256:].clone()
    assert Q.per_token_cast_and_cast_back(x, fmt, 32, round_sf) is None
    assert_equal(big[:, :256].contiguous(), want.contiguous())
    assert_equal(big[:, 256:].contiguous(), rest.contiguous())


def test_cast_and_cast_back_e4m3_sf_hand_case():
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1] = 500.0, 1.0
    Q.per_token_cast_and_cast_back(x, "e4m3", 64, use_e4m3_sf=True)
    # sf = e4m3(500/448 = 1.116) = 1.125; 500/1.125 = 444.4 -> 448 -> 504; 1/1.125 = 0.889 -> 0.875 -> 0.984375
    assert x[0, :3].tolist() == [504.0, 0.984375, 0.0]


def test_cast_and_cast_back_errors_leave_x_untouched():
    x = torch.randn(4, 128)
    keep = x.clone()
    with pytest.raises(ValueError, match="round_sf"):
        Q.per_token_cast_and_cast_back(x, "e4m3", 32, True, True)
    with pytest.raises(ValueError, match="num_per_channels"):
        Q.per_token_cast_and_cast_back(x, "e4m3", 8)
    with pytest.raises(ValueError, match="hidden"):
        Q.per_token_cast_and_cast_back(torch.randn(4, 96), "e4m3", 32)
    with pytest.raises(ValueError, match="fmt"):
        Q.per_token_cast_and_cast_back(x, "e5m6", 32)
    assert_equal(x, keep)
    empty = torch.empty(0, 128)
    Q.per_token_cast_and_cast_back(empty, "e2m1", 64)
    assert empty.shape == (0, 128)
