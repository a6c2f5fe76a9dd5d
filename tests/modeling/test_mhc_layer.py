"""tilefuse.modeling.mhc: mhc_pre, mhc_head, expand_from_embedding (mhc.md §2.10) and the fused
residual-gradient side channel end to end (§2.12).

Tolerances (written once), in calc_diff = sum((a-b)^2) / sum(a^2+b^2), against torch autograd through
the references in the same dtypes (spec §2.12: measured ~3e-6 for the residual gradient, <= 3e-8 for the
parameter gradients):
* RESIDUAL_DIFF = 1e-5: each element passes ~4 independent bf16 roundings (relative 2^-9 rms each ->
  about 4 * (2^-9)^2 ~ 1.5e-5 worst case in the mean square; measured values are well below).
* PARAM_DIFF = 1e-6: fp32 parameter gradients, differing only through rare 1-ulp differences of bf16
  intermediate gradients.
"""
import pytest
import torch

from tilefuse.mhc import (mhc_post, mhc_post_bwd, mhc_pre_apply_mix, mhc_pre_apply_mix_bwd, mhc_pre_norm_fn,
                          mhc_pre_split_mixes, mhc_reduce_partials_and_rmsnorm_bwd, sinkhorn_normalize)
from tilefuse.mhc import _functions as F
from tilefuse.modeling.mhc import expand_from_embedding, mhc_head, mhc_pre
from tilefuse.reference import mhc as R
from tilefuse.testing import assert_equal, calc_diff
from tests.mhc.mhc_helpers import BF16, leaf

RESIDUAL_DIFF = 1e-5
PARAM_DIFF = 1e-6
N, C, B, S = 4, 16, 2, 3
K, M = N * C, N * (N + 2)
KW = dict(norm_eps=1e-6, post_mult_value=2.0, pre_eps=1e-2, sinkhorn_eps=1e-6, sinkhorn_repeat=10)


def _params(with_weight=True):
    fn = leaf(torch.randn(M, K) * 0.05)
    scale, base = leaf(0.5 * torch.randn(3)), leaf(0.5 * torch.randn(M))
    normw = leaf(1 + 0.1 * torch.randn(K)) if with_weight else None
    return fn, scale, base, normw


def _sublayer(u, w):
    return (u.float() * w).to(BF16)


def _reference_layer(e, fn, scale, base, normw, w, G):
    """The same layer through the references and torch autograd (no side channel)."""
    r0 = R.expand_to_mhc_ref(e, N)
    mixes = R.mhc_pre_norm_fn_ref(r0, fn, normw, KW["norm_eps"])
    pre, post, comb = R.mhc_pre_split_mixes_ref(mixes, scale, base, N, KW["post_mult_value"], KW["pre_eps"])
    comb = R.sinkhorn_normalize_ref(comb, KW["sinkhorn_repeat"], KW["sinkhorn_eps"])
    r1 = R.mhc_post_ref(_sublayer(R.mhc_pre_apply_mix_ref(r0, pre), w), r0, post, comb)
    return (r1.float() * G).sum()


@pytest.mark.parametrize("with_weight", [False, True])
def test_pre_no_grad_bit_identical_to_grad_mode(with_weight):
    residual = torch.randn(B, S, N, C).to(BF16)
    fn, scale, base, normw = _params(with_weight)
    u, (post, comb) = mhc_pre(residual, fn, scale, base, norm_weight=normw, **KW)
    with torch.no_grad():
        u2, (post2, comb2) = mhc_pre(residual, fn, scale, base, norm_weight=normw, **KW)
    assert u.shape == (B, S, C) and post.shape == (B, S, N, 1) and comb.shape == (B, S, N, N)
    assert_equal(u, u2)
    assert_equal(post, post2)
    assert_equal(comb, comb2)


@pytest.mark.parametrize("with_weight", [False, True])
def test_layer_gradients_match_reference_autograd(with_weight):
    e = torch.randn(B, S, C).to(BF16)
    fn, scale, base, normw = _params(with_weight)
    w = 1 + 0.5 * torch.randn(C)
    G = torch.randn(B, S, N, C).to(BF16).float()
    el = leaf(e)
    r0 = expand_from_embedding(el, N)
    u, (post, comb) = mhc_pre(r0, fn, scale, base, norm_weight=normw, **KW)
    r1 = mhc_post(_sublayer(u, w), r0, post, comb)
    params = [fn, scale, base] + ([normw] if with_weight else [])
    got = torch.autograd.grad((r1.float() * G).sum(), [el] + params)
    assert not hasattr(r0.untyped_storage(), F.SIDE_CHANNEL)  # consumed by the prenorm backward
    ref_leaves = [leaf(t) for t in [e] + params]
    ref_w = ref_leaves[4] if with_weight else None
    want = torch.autograd.grad(_reference_layer(ref_leaves[0], *ref_leaves[1:4], ref_w, w, G), ref_leaves)
    assert calc_diff(got[0], want[0]) <= RESIDUAL_DIFF
    for a, b in zip(got[1:], want[1:]):
        assert calc_diff(a, b) <= PARAM_DIFF


def test_side_channel_equals_explicit_accumulation():
    """The residual gradient through the side channel is bit-equal to the explicit v2.1 composition
    bf(bf(post_grad + apply_grad) + prenorm_grad) (§2.12)."""
    r0 = leaf(torch.randn(B, S, N, C).to(BF16))
    fn, scale, base, _ = _params(False)
    w = 1 + 0.5 * torch.randn(C)
    G = torch.randn(B, S, N, C).to(BF16)
    captured = {}
    mixes = mhc_pre_norm_fn(r0, fn, None, KW["norm_eps"])
    mixes.register_hook(lambda g: captured.setdefault("mixes", g))
    pre, post, comb = mhc_pre_split_mixes(mixes, scale, base, N, KW["post_mult_value"], KW["pre_eps"])
    comb = sinkhorn_normalize(comb, KW["sinkhorn_repeat"], KW["sinkhorn_eps"])
    u = mhc_pre_apply_mix(r0, pre)
    u.register_hook(lambda g: captured.setdefault("u", g))
    r1 = mhc_post(_sublayer(u, w), r0, post, comb)
    r1.backward(G)
    T = B * S
    with torch.no_grad():
        buf = mhc_post_bwd(_sublayer(u, w), r0, post, comb, G, fuse_grad_acc=False)[1].view(T, N, C)
        mhc_pre_apply_mix_bwd(captured["u"].view(T, C), r0.view(T, N, C), pre.view(T, N), buf)
        out_mul, sqrsum = R.mhc_pre_norm_fn_partials_ref(r0, fn, 1)
        out_mul, sqrsum, _ = R.mhc_reduce_partials_and_rmsnorm_ref(out_mul, sqrsum, K, KW["norm_eps"])
        d_mul, d_sq = torch.empty(T, 1, M), torch.empty(T, 1)
        mhc_reduce_partials_and_rmsnorm_bwd(captured["mixes"].view(T, M), out_mul, sqrsum, d_mul, d_sq, K,
                                            KW["norm_eps"])
        expect, _ = R.mhc_pre_norm_fn_gemm_bwd_ref(d_mul[:, 0], d_sq[:, 0], r0, fn, buf)
    assert_equal(r0.grad, expect.view(B, S, N, C))


def test_pre_training_without_post_raises():
    r0 = leaf(torch.randn(B, S, N, C).to(BF16))
    fn, scale, base, _ = _params(False)
    u, (post, comb) = mhc_pre(r0, fn, scale, base, **KW)
    with pytest.raises(AttributeError, match="mhc_post"):
        (u.float().sum() + post.sum() + comb.sum()).backward()


@pytest.mark.parametrize("with_weight", [False, True])
def test_head_matches_reference(with_weight):
    residual = torch.randn(B, S, N, C).to(BF16)
    fn, scale, base = leaf(torch.randn(N, K) * 0.05), leaf(torch.tensor([0.7])), leaf(torch.randn(N))
    normw = leaf(1 + 0.1 * torch.randn(K)) if with_weight else None
    rl = leaf(residual)
    out = mhc_head(rl, fn, scale, base, norm_weight=normw, pre_eps=1e-2)
    assert out.shape == (B, S, C)
    g = torch.randn(B, S, C).to(BF16)
    inputs = [rl, fn, scale, base] + ([normw] if with_weight else [])
    got = torch.autograd.grad(out, inputs, g)
    assert got[1].shape == (N, K)
    ref = [leaf(t) for t in inputs]
    mixes = R.mhc_pre_norm_fn_ref(ref[0], ref[1], ref[4] if with_weight else None, 1e-6)
    mix = R.mhc_head_compute_mix_ref(mixes, ref[2], ref[3], 1e-2)
    ref_out = R.mhc_pre_apply_mix_ref(ref[0], mix.unsqueeze(-1))
    assert_equal(out, ref_out)
    want = torch.autograd.grad(ref_out, ref, g)
    assert calc_diff(got[0], want[0]) <= RESIDUAL_DIFF
    for a, b in zip(got[1:], want[1:]):
        assert calc_diff(a, b) <= PARAM_DIFF


def test_expand_from_embedding_default_four_streams():
    e = torch.randn(2, 3, C).to(BF16)
    r = expand_from_embedding(e)
    assert r.shape == (2, 3, 4, C)
    assert_equal(r, R.expand_to_mhc_ref(e, 4))


def test_zero_tokens():
    r0 = torch.empty(1, 0, N, C, dtype=BF16)
    fn, scale, base, normw = _params()
    with torch.no_grad():
        u, (post, comb) = mhc_pre(r0, fn, scale, base, norm_weight=normw, **KW)
    assert u.shape == (1, 0, C) and post.shape == (1, 0, N, 1) and comb.shape == (1, 0, N, N)
    out = mhc_head(r0, torch.randn(N, K), torch.ones(1), torch.zeros(N))
    assert out.shape == (1, 0, C)


def test_errors():
    residual = torch.randn(B, S, N, C).to(BF16)
    fn, scale, base, _ = _params(False)
    with pytest.raises(ValueError, match="residual"):
        mhc_pre(residual[0], fn, scale, base)
    with pytest.raises(ValueError, match="residual"):
        mhc_pre(residual, fn, scale, base, mhc_mult=2)
    with pytest.raises(ValueError, match="fn"):
        mhc_head(residual, fn, torch.ones(1), torch.zeros(N))
    with pytest.raises(ValueError, match="scale"):
        mhc_head(residual, torch.randn(N, K), torch.ones(3), torch.zeros(N))
