"""mhc_pre_apply_mix / _fwd / _bwd (mhc.md §2.5) and its side-channel accumulation (§2.12).

Tolerances (written once): bf16 results (out, d_x) must be within 1 bf16 ulp of the float64 value
(an fp32 sum of n = 4 products rounded once, ``assert_bf16_round_of``); d_mix is an fp32 sum of C <= 64
products of O(1) values: D_MIX_RTOL = D_MIX_ATOL = 64 * 2^-24 * 4 ~ 2e-5 (4x margin).
"""
import pytest
import torch

from tilefuse.mhc import mhc_pre_apply_mix, mhc_pre_apply_mix_bwd, mhc_pre_apply_mix_fwd
from tilefuse.mhc import _functions as F
from tilefuse.reference import mhc_pre_apply_mix_ref
from tilefuse.testing import assert_equal
from tests.mhc.mhc_helpers import BF16, F64, assert_bf16_round_of, f64, leaf

D_MIX_RTOL = D_MIX_ATOL = 2e-5
N, C = 4, 24


def _inputs(A=2, B=3):
    x = torch.sigmoid(torch.randn(A, B, N, C)).to(BF16)
    mix = torch.softmax(torch.randn(A, B, N, 1), dim=-2)
    return x, mix


def test_hand_exact_values():
    # powers of two and small integers: every product and sum is exact, so is the bf16 result
    x = torch.tensor([[[1.0, 2.0], [3.0, -4.0], [0.5, 8.0], [-1.0, 0.0]]], dtype=BF16)
    mix = torch.tensor([[[0.5], [0.25], [2.0], [1.0]]])
    out = mhc_pre_apply_mix(x, mix)
    assert out.tolist() == [[0.5 + 0.75 + 1.0 - 1.0, 1.0 - 1.0 + 16.0 + 0.0]]


def test_matches_float64_and_reference():
    x, mix = _inputs()
    out = mhc_pre_apply_mix(x, mix)
    assert_equal(out, mhc_pre_apply_mix_ref(x, mix))
    assert_bf16_round_of(out, (x.double() * mix.double()).sum(-2))


def test_grads_match_float64_autograd():
    x, mix = _inputs()
    xl, ml = leaf(x), leaf(mix)
    g = torch.randn(2, 3, C).to(BF16)
    d_x, d_mix = torch.autograd.grad(mhc_pre_apply_mix(xl, ml), (xl, ml), g)
    x64, m64 = f64(x, mix)
    e_x, e_mix = torch.autograd.grad(mhc_pre_apply_mix_ref(x64, m64), (x64, m64), g.double())
    assert_bf16_round_of(d_x, e_x)
    torch.testing.assert_close(d_mix.double(), e_mix, rtol=D_MIX_RTOL, atol=D_MIX_ATOL)


def test_gradcheck_float64():
    x, mix = f64(torch.randn(1, 2, N, 3), torch.randn(1, 2, N, 1))
    assert torch.autograd.gradcheck(lambda x, m: F.MHCPreApplyMixFn.apply(x, m, None), (x, mix))


def test_side_channel_accumulates_in_place():
    x, mix = _inputs()
    xl = leaf(x)
    g = torch.randn(2, 3, C).to(BF16)
    buf = torch.randn(2, 3, N, C).to(BF16)
    start = buf.clone()
    F.attach_residual_grad(xl, buf)
    mhc_pre_apply_mix(xl, mix).backward(g)
    assert xl.grad is None  # the gradient lives in the buffer (§2.12 step 2)
    assert_bf16_round_of(buf, start.double() + mix.double() * g.double().unsqueeze(-2))
    delattr(xl.untyped_storage(), F.SIDE_CHANNEL)


def test_v21_ops():
    x, mix = _inputs(1, 7)
    x, mix = x[0], mix[0, ..., 0]
    o = torch.full((7, C), float("nan"), dtype=BF16)
    mhc_pre_apply_mix_fwd(x, mix, o)
    assert_equal(o, mhc_pre_apply_mix_ref(x, mix.unsqueeze(-1)))
    g = torch.randn(7, C).to(BF16)
    x_grad = torch.randn(7, N, C).to(BF16)  # always accumulated into
    start = x_grad.clone()
    d_mix = mhc_pre_apply_mix_bwd(g, x, mix, x_grad)
    assert d_mix.shape == (7, N)
    assert_bf16_round_of(x_grad, start.double() + mix.double().unsqueeze(-1) * g.double().unsqueeze(-2))
    torch.testing.assert_close(d_mix.double(), (g.double().unsqueeze(-2) * x.double()).sum(-1),
                               rtol=D_MIX_RTOL, atol=D_MIX_ATOL)


def test_out_and_zero_tokens():
    x, mix = _inputs()
    out = torch.full((2, 3, C), float("nan"), dtype=BF16)
    assert mhc_pre_apply_mix(x, mix, out=out) is out
    assert_equal(out, mhc_pre_apply_mix_ref(x, mix))
    xe = torch.empty(0, N, C, dtype=BF16, requires_grad=True)
    me = torch.empty(0, N, 1, requires_grad=True)
    res = mhc_pre_apply_mix(xe, me)
    assert res.shape == (0, C)
    res.float().sum().backward()
    assert xe.grad.shape == xe.shape


def test_errors():
    x, mix = _inputs()
    with pytest.raises(TypeError, match="x"):
        mhc_pre_apply_mix(x.float(), mix)
    with pytest.raises(ValueError, match="mix"):
        mhc_pre_apply_mix(x, mix[..., 0])
    with pytest.raises(TypeError, match="mix"):
        mhc_pre_apply_mix(x, mix.to(F64))
    with pytest.raises(ValueError, match="out"):
        mhc_pre_apply_mix(x, mix, out=torch.empty(2, 3, N, C, dtype=BF16))
    x_grad = torch.zeros(3, N, C, dtype=BF16)
    with pytest.raises(ValueError, match="o_grad"):
        mhc_pre_apply_mix_bwd(torch.zeros(3, C + 1, dtype=BF16), x[0], mix[0, ..., 0], x_grad)
    assert (x_grad == 0).all()
