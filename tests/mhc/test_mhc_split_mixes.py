"""mhc_pre_split_mixes / _fwd / _bwd (mhc.md §2.3) and the fixed-order token partials.

Tolerances (written once): the spec's contract for split mixes (§3): RTOL = 1e-5, ATOL = 2e-5, for
outputs and all gradients; the Python-scalar hand case (a handful of fp32 operations against float64)
uses HAND_RTOL = 1e-6.
"""
import math

import pytest
import torch

from tilefuse.mhc import mhc_pre_split_mixes, mhc_pre_split_mixes_bwd, mhc_pre_split_mixes_fwd
from tilefuse.mhc import _functions as F
from tilefuse.reference import mhc_pre_split_mixes_ref
from tilefuse.reference import mhc as R
from tests.mhc.mhc_helpers import F64, f64, leaf

RTOL, ATOL = 1e-5, 2e-5
HAND_RTOL = 1e-6
N, M = 4, 24
V, PRE_EPS = 2.0, 1e-2


def _inputs(A=2, B=5):
    return torch.randn(A, B, M), torch.randn(3), torch.randn(M)


def test_hand_python_loop():
    m = [0.1 * j - 1.0 for j in range(M)]
    s = [1.5, -0.5, 0.25]
    b = [0.05 * j for j in range(M)]
    pre, post, comb = mhc_pre_split_mixes(torch.tensor([[m]]), torch.tensor(s), torch.tensor(b), N, V, PRE_EPS)
    sig = lambda z: 1.0 / (1.0 + math.exp(-z))  # noqa: E731
    for i in range(N):
        assert pre[0, 0, i, 0].item() == pytest.approx(sig(m[i] * s[0] + b[i]) + PRE_EPS, rel=HAND_RTOL)
        assert post[0, 0, i, 0].item() == pytest.approx(sig(m[N + i] * s[1] + b[N + i]) * V, rel=HAND_RTOL)
        for o in range(N):
            j = 2 * N + i * N + o
            assert comb[0, 0, i, o].item() == pytest.approx(m[j] * s[2] + b[j], rel=HAND_RTOL, abs=1e-7)


def test_public_equals_reference_and_grads_match_autograd():
    m, s, b = _inputs()
    ml = [leaf(m), leaf(s), leaf(b)]
    outs = mhc_pre_split_mixes(*ml, N, V, PRE_EPS)
    for a, r in zip(outs, mhc_pre_split_mixes_ref(m, s, b, N, V, PRE_EPS)):
        assert torch.equal(a, r)
    grads = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, ml, grads)
    rl = [leaf(m), leaf(s), leaf(b)]
    want = torch.autograd.grad(mhc_pre_split_mixes_ref(*rl, N, V, PRE_EPS), rl, grads)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=RTOL, atol=ATOL)


def test_gradcheck_float64():
    m, s, b = f64(*_inputs(1, 3))
    fn = lambda m, s, b: F.MHCPreSplitMixesFn.apply(m, s, b, N, V, PRE_EPS)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (m, s, b))


def test_v21_ops():
    m, s, b = _inputs(1, 70)
    m = m[0]
    T = m.shape[0]
    pre, post, comb = (torch.full((T, w), float("nan")) for w in (N, N, N * N))
    mhc_pre_split_mixes_fwd(m, s, b, pre, post, comb, V, PRE_EPS)
    rp, rq, rc = mhc_pre_split_mixes_ref(m, s, b, N, V, PRE_EPS)
    assert torch.equal(pre, rp.view(T, N)) and torch.equal(post, rq.view(T, N)) and torch.equal(comb, rc.view(T, -1))
    gp, gq, gc = torch.randn(T, N), torch.randn(T, N), torch.randn(T, N * N)
    d_in = torch.full((T, M), float("nan"))
    d_s, d_b = torch.full((3,), 123.0), torch.full((M,), 123.0)  # overwritten, not accumulated
    mhc_pre_split_mixes_bwd(gp, gq, gc, m, post, s, b, d_in, d_s, d_b, V)
    rl = [leaf(m), leaf(s), leaf(b)]
    outs = mhc_pre_split_mixes_ref(*rl, N, V, PRE_EPS)
    want = torch.autograd.grad(outs, rl, (gp.view(T, N, 1), gq.view(T, N, 1), gc.view(T, N, N)))
    for a, w in zip((d_in, d_s, d_b), want):
        torch.testing.assert_close(a, w, rtol=RTOL, atol=ATOL)


def test_token_partials_fixed_assignment():
    # T = 70 tokens, blocks of 32: blocks 0, 1, 2 (tokens 64..69); with P = 2 block 2 joins partial 0
    t = torch.randn(70, 3, dtype=F64)
    p2 = R.token_partials(t, 2, 32)
    torch.testing.assert_close(p2[0], t[:32].sum(0) + t[64:].sum(0), rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(p2[1], t[32:64].sum(0), rtol=1e-15, atol=1e-15)
    p5 = R.token_partials(t, 5, 32)
    assert (p5[3:] == 0).all()
    torch.testing.assert_close(p5[2], t[64:].sum(0), rtol=1e-15, atol=1e-15)
    assert R.token_partials(t[:0], 3, 32).shape == (3, 3)


def test_zero_tokens():
    m = torch.empty(2, 0, M, requires_grad=True)
    s, b = torch.randn(3, requires_grad=True), torch.randn(M, requires_grad=True)
    pre, post, comb = mhc_pre_split_mixes(m, s, b, N, V, PRE_EPS)
    assert pre.shape == (2, 0, N, 1) and comb.shape == (2, 0, N, N)
    (pre.sum() + post.sum() + comb.sum()).backward()
    assert (s.grad == 0).all() and (b.grad == 0).all()


def test_errors():
    m, s, b = _inputs()
    with pytest.raises(ValueError, match="input_mixes"):
        mhc_pre_split_mixes(m[0], s, b, N, V, PRE_EPS)
    with pytest.raises(ValueError, match="input_mixes"):
        mhc_pre_split_mixes(m, s, b, 3, V, PRE_EPS)
    with pytest.raises(TypeError, match="mhc_scale"):
        mhc_pre_split_mixes(m, s.double(), b, N, V, PRE_EPS)
    with pytest.raises(ValueError, match="mhc_base"):
        mhc_pre_split_mixes(m, s, b[:20], N, V, PRE_EPS)
    with pytest.raises(ValueError, match="mhc_post_mult_value"):
        mhc_pre_split_mixes(m, s, b, N, 0.0, PRE_EPS)
    T = 5
    d_s = torch.zeros(3)
    with pytest.raises(ValueError, match="mhc_base_grad"):
        mhc_pre_split_mixes_bwd(torch.zeros(T, N), torch.zeros(T, N), torch.zeros(T, N * N), m[0], torch.zeros(T, N),
                                s, b, torch.zeros(T, M), d_s, torch.zeros(M + 1), V)
    assert (d_s == 0).all()
    with pytest.raises(ValueError, match="input_mixes"):
        mhc_pre_split_mixes_fwd(torch.zeros(T, 23), s, b, torch.zeros(T, N), torch.zeros(T, N),
                                torch.zeros(T, N * N), V, PRE_EPS)
