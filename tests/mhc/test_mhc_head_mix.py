"""mhc_head_compute_mix / _fwd / _bwd (mhc.md §2.7).

Tolerances (written once): the spec's contract for the head mix (§3): RTOL = 1e-4, ATOL = 1e-5; the
Python-scalar hand case (three fp32 operations and a sigmoid against float64) uses HAND_RTOL = 1e-6.
"""
import math

import pytest
import torch

from tilefuse.mhc import mhc_head_compute_mix, mhc_head_compute_mix_bwd, mhc_head_compute_mix_fwd
from tilefuse.mhc import _functions as F
from tilefuse.reference import mhc_head_compute_mix_ref
from tests.mhc.mhc_helpers import f64, leaf

RTOL, ATOL = 1e-4, 1e-5
HAND_RTOL = 1e-6
N, PRE_EPS = 4, 1e-2


def test_hand_python_loop():
    m, s, b = [0.5, -1.0, 2.0, 0.0], 0.75, [0.1, 0.2, -0.3, 1.0]
    out = mhc_head_compute_mix(torch.tensor([[m]]), torch.tensor([s]), torch.tensor(b), PRE_EPS)
    for i in range(N):
        want = 1.0 / (1.0 + math.exp(-(m[i] * s + b[i]))) + PRE_EPS
        assert out[0, 0, i].item() == pytest.approx(want, rel=HAND_RTOL)


def test_public_equals_reference_and_grads_match_autograd():
    m, s, b = torch.randn(2, 9, N), torch.randn(1), torch.randn(N)
    ml = [leaf(m), leaf(s), leaf(b)]
    out = mhc_head_compute_mix(*ml, PRE_EPS)
    assert torch.equal(out, mhc_head_compute_mix_ref(m, s, b, PRE_EPS))
    g = torch.randn_like(out)
    rl = [leaf(m), leaf(s), leaf(b)]
    want = torch.autograd.grad(mhc_head_compute_mix_ref(*rl, PRE_EPS), rl, g)
    for a, w in zip(torch.autograd.grad(out, ml, g), want):
        torch.testing.assert_close(a, w, rtol=RTOL, atol=ATOL)


def test_gradcheck_float64():
    m, s, b = f64(torch.randn(1, 3, N), torch.randn(1), torch.randn(N))
    assert torch.autograd.gradcheck(lambda m, s, b: F.MHCHeadComputeMixFn.apply(m, s, b, PRE_EPS), (m, s, b))


@pytest.mark.parametrize("block", [0, 8])
def test_v21_ops_partials(block):
    T, P = 100, 3
    m, s, b = torch.randn(T, N), torch.randn(1), torch.randn(N)
    out = torch.full((T, N), float("nan"))
    mhc_head_compute_mix_fwd(m, s, b, out, PRE_EPS, block)
    assert torch.equal(out, mhc_head_compute_mix_ref(m, s, b, PRE_EPS))
    g = torch.randn(T, N)
    d_in = torch.full((T, N), float("nan"))
    sp, bp = torch.full((P, 1), float("nan")), torch.full((P, N), float("nan"))
    mhc_head_compute_mix_bwd(g, m, s, b, d_in, sp, bp, P, block)
    rl = [leaf(m), leaf(s), leaf(b)]
    want = torch.autograd.grad(mhc_head_compute_mix_ref(*rl, PRE_EPS), rl, g)
    torch.testing.assert_close(d_in, want[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(sp.sum(0), want[1], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(bp.sum(0), want[2], rtol=RTOL, atol=ATOL)
    # partial p holds exactly the token blocks b with b mod P == p
    size = block or 32
    sig = torch.sigmoid(m.double() * s.double() + b.double())
    dz = sig * (1 - sig) * g.double()
    owner = (torch.arange(T) // size) % P
    for p in range(P):
        torch.testing.assert_close(bp[p].double(), dz[owner == p].sum(0), rtol=RTOL, atol=ATOL)


def test_zero_tokens():
    m = torch.empty(1, 0, N, requires_grad=True)
    s, b = torch.randn(1, requires_grad=True), torch.randn(N, requires_grad=True)
    out = mhc_head_compute_mix(m, s, b, PRE_EPS)
    assert out.shape == (1, 0, N)
    out.sum().backward()
    assert (s.grad == 0).all() and (b.grad == 0).all()


def test_errors():
    m, s, b = torch.randn(2, 3, N), torch.randn(1), torch.randn(N)
    with pytest.raises(ValueError, match="input_mix"):
        mhc_head_compute_mix(m[0], s, b, PRE_EPS)
    with pytest.raises(ValueError, match="mhc_scale"):
        mhc_head_compute_mix(m, torch.randn(3), b, PRE_EPS)
    with pytest.raises(TypeError, match="mhc_base"):
        mhc_head_compute_mix(m, s, b.half(), PRE_EPS)
    with pytest.raises(ValueError, match="num_sms"):
        mhc_head_compute_mix_bwd(m[0], m[0], s, b, torch.zeros(3, N), torch.zeros(1, 1), torch.zeros(1, N), 0)
    with pytest.raises(ValueError, match="mhc_base_grad_partial"):
        mhc_head_compute_mix_bwd(m[0], m[0], s, b, torch.zeros(3, N), torch.zeros(2, 1), torch.zeros(1, N), 2)
