"""mhc_post / mhc_post_fwd / mhc_post_bwd (mhc.md §2.6) and the side-channel store (§2.12).

Tolerances (written once): bf16 results (out, d_x, d_residual) must be within 1 bf16 ulp of the float64
value (fp32 sums of n + 1 = 5 products rounded once, ``assert_bf16_round_of``); d_post and d_comb are
fp32 sums of C products: the spec's contract (§3) RTOL = ATOL = 1e-4.
"""
import pytest
import torch

from tilefuse.mhc import mhc_post, mhc_post_bwd, mhc_post_fwd
from tilefuse.mhc import _functions as F
from tilefuse.reference import mhc_post_ref
from tilefuse.testing import assert_equal
from tests.mhc.mhc_helpers import BF16, F64, assert_bf16_round_of, f64, leaf

RTOL = ATOL = 1e-4
N, C = 4, 32


def _inputs(B=1, S=5):
    x = torch.randn(B, S, C).to(BF16)
    residual = torch.randn(B, S, N, C).to(BF16)
    post = torch.rand(B, S, N, 1) * 2
    comb = torch.randn(B, S, N, N)  # not normalised, as upstream tests
    return x, residual, post, comb


def test_hand_exact_values():
    # stream o gets post[o] * x + sum_i comb[i, o] * R_i; comb = identity + 0.5 in column 0 from stream 1
    x = torch.tensor([[[2.0, -1.0]]], dtype=BF16)
    residual = torch.tensor([[[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]]], dtype=BF16)
    post = torch.tensor([[[[1.0], [0.5], [0.0], [-1.0]]]])
    comb = torch.eye(4).view(1, 1, 4, 4).clone()
    comb[0, 0, 1, 0] = 0.5
    out = mhc_post(x, residual, post, comb)
    assert out[0, 0].tolist() == [[2 + 1 + 1.5, -1 + 2 + 2], [1 + 3, -0.5 + 4], [5, 6], [-2 + 7, 1 + 8]]


def test_forward_matches_float64_and_reference():
    x, residual, post, comb = _inputs()
    out = mhc_post(x, residual, post, comb)
    assert_equal(out, mhc_post_ref(x, residual, post, comb))
    assert_equal(mhc_post_fwd(x, residual, post, comb), out)
    exact = torch.einsum("bsio,bsic->bsoc", comb.double(), residual.double()) + x.double().unsqueeze(-2) * post.double()
    assert_bf16_round_of(out, exact)


def test_backward_matches_float64_autograd_and_attaches_side_channel():
    x, residual, post, comb = _inputs()
    inputs = [leaf(t) for t in (x, residual, post, comb)]
    g = torch.randn(1, 5, N, C).to(BF16)
    got = torch.autograd.grad(mhc_post(*inputs), inputs, g)
    attached = getattr(inputs[1].untyped_storage(), F.SIDE_CHANNEL)
    assert attached is not None and torch.equal(attached.view_as(got[1]), got[1])
    e = f64(x, residual, post, comb)
    want = torch.autograd.grad(mhc_post_ref(*e), e, g.double())
    assert_bf16_round_of(got[0], want[0])
    assert_bf16_round_of(got[1], want[1])
    torch.testing.assert_close(got[2].double(), want[2], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got[3].double(), want[3], rtol=RTOL, atol=ATOL)
    # the explicit backward computes the same values; with fuse_grad_acc=False it attaches nothing
    r2 = residual.clone()
    explicit = mhc_post_bwd(x, r2, post, comb, g, fuse_grad_acc=False)
    assert not hasattr(r2.untyped_storage(), F.SIDE_CHANNEL)
    for a, b in zip(explicit, got):
        assert_equal(a, b)
    mhc_post_bwd(x, r2, post, comb, g)
    assert hasattr(r2.untyped_storage(), F.SIDE_CHANNEL)


def test_gradcheck_float64():
    e = f64(torch.randn(1, 2, 3), torch.randn(1, 2, N, 3), torch.randn(1, 2, N, 1), torch.randn(1, 2, N, N))
    assert torch.autograd.gradcheck(lambda *a: F.MHCPostFn.apply(*a, None), e)


def test_out_and_zero_tokens():
    x, residual, post, comb = _inputs()
    out = torch.full((1, 5, N, C), float("nan"), dtype=BF16)
    assert mhc_post(x, residual, post, comb, out=out) is out
    assert_equal(out, mhc_post_ref(x, residual, post, comb))
    z = [leaf(t) for t in _inputs(1, 0)]
    res = mhc_post(*z)
    assert res.shape == (1, 0, N, C)
    res.float().sum().backward()
    assert z[2].grad.shape == (1, 0, N, 1)


def test_errors():
    x, residual, post, comb = _inputs()
    with pytest.raises(ValueError, match="residual"):
        mhc_post(x, residual[0], post, comb)
    with pytest.raises(TypeError, match="residual"):
        mhc_post(x, residual.float(), post, comb)
    with pytest.raises(ValueError, match="x"):
        mhc_post(x[..., :-1], residual, post, comb)
    with pytest.raises(ValueError, match="comb_res_mix"):
        mhc_post(x, residual, post, comb.transpose(-1, -2))
    with pytest.raises(ValueError, match="post_layer_mix"):
        mhc_post(x, residual, post[..., 0], comb)
    with pytest.raises(ValueError, match="d_o"):
        mhc_post_bwd(x, residual, post, comb, x)
