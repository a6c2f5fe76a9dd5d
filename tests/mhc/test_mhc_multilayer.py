"""mhc_multilayer_recompute (mhc.md §2.9).

No tolerances: the spec requires bit-identity with the library's own apply-mix / post chain (§3).
"""
import pytest
import torch

from tilefuse.mhc import mhc_multilayer_recompute, mhc_post, mhc_pre_apply_mix
from tilefuse.testing import assert_equal
from tests.mhc.mhc_helpers import BF16

N, C, B, S = 4, 16, 1, 7


def _layers(L, P, S=S):
    r0 = torch.randn(B, S, N, C).to(BF16)
    pre = [torch.softmax(torch.randn(B, S, N, 1), dim=-2) for _ in range(L)]
    ys = [torch.randn(B, S, C).to(BF16) for _ in range(P)]
    posts = [torch.rand(B, S, N, 1) for _ in range(P)]
    combs = [torch.randn(B, S, N, N) for _ in range(P)]
    inputs = [torch.full((B, S, C), float("nan"), dtype=BF16) for _ in range(L)]
    residuals = [torch.full((B, S, N, C), float("nan"), dtype=BF16) for _ in range(P)]
    return r0, pre, ys, posts, combs, inputs, residuals


@pytest.mark.parametrize("L,P", [(1, 0), (1, 1), (3, 2), (3, 3)])
def test_bit_identical_to_own_chain(L, P):
    r0, pre, ys, posts, combs, inputs, residuals = _layers(L, P)
    assert mhc_multilayer_recompute(r0, pre, ys, posts, combs, inputs, residuals) is None
    r = r0
    for l in range(L):
        assert_equal(inputs[l], mhc_pre_apply_mix(r, pre[l]))
        if l < P:
            r = mhc_post(ys[l], r, posts[l], combs[l])
            assert_equal(residuals[l], r)


def test_flat_mix_shapes_and_zero_tokens():
    r0, pre, ys, posts, combs, inputs, residuals = _layers(2, 2)
    flat = [p[..., 0].contiguous() for p in pre]  # [..., n] is accepted as well as [..., n, 1]
    mhc_multilayer_recompute(r0, flat, ys, [p[..., 0].contiguous() for p in posts], combs, inputs, residuals)
    assert_equal(inputs[1], mhc_pre_apply_mix(mhc_post(ys[0], r0, posts[0], combs[0]), pre[1]))
    z = _layers(2, 1, S=0)
    mhc_multilayer_recompute(*z)


def test_errors():
    r0, pre, ys, posts, combs, inputs, residuals = _layers(3, 2)
    with pytest.raises(ValueError, match="layer_input_list"):
        mhc_multilayer_recompute(r0, pre, ys, posts, combs, inputs[:2], residuals)
    with pytest.raises(ValueError, match="post_mix_list"):
        mhc_multilayer_recompute(r0, pre[:1], ys, posts, combs, inputs[:1], residuals)
    with pytest.raises(ValueError, match="comb_mix_list"):
        mhc_multilayer_recompute(r0, pre, ys, posts, combs[:1], inputs, residuals)
    with pytest.raises(ValueError, match="pre_mix_list"):
        mhc_multilayer_recompute(r0, [], [], [], [], [], [])
    with pytest.raises(TypeError, match="residual_list\\[1\\]"):
        mhc_multilayer_recompute(r0, pre, ys, posts, combs, inputs, [residuals[0], residuals[1].float()])
    with pytest.raises(ValueError, match="pre_mix_list\\[0\\]"):
        mhc_multilayer_recompute(r0, [pre[0][:, :3]] + pre[1:], ys, posts, combs, inputs, residuals)
    assert torch.isnan(inputs[0].float()).all()  # nothing written when a check fails
