"""sinkhorn_normalize / mhc_sinkhorn_fwd / mhc_sinkhorn_bwd (mhc.md §2.4).

Tolerances (written once):
* FP32_ATOL, FP32_RTOL: the spec's contract for Sinkhorn forward and d_x (§3: fp32 assert_close
  defaults, rtol 1.3e-6, atol 1e-5).
* Column sums after the final column step equal ``c / (c + eps)`` with c ~ 1, so they miss 1 by at most
  ~eps plus the rounding of a 4-term fp32 sum and one division: COL_TOL = 2*eps + 8*n*2^-24.
* Row sums only converge: with 200 rounds in float64 and eps = 0 the iteration error of a positive 4x4
  matrix is far below float64 rounding, leaving n*(2R) roundings of 2^-53: ROW_TOL_F64 = 1e-12.
"""
import math

import pytest
import torch

from tilefuse.mhc import mhc_sinkhorn_bwd, mhc_sinkhorn_fwd, sinkhorn_normalize
from tilefuse.mhc import _functions as F
from tilefuse.reference import sinkhorn_normalize_ref
from tests.mhc.mhc_helpers import F32, F64, leaf

FP32_RTOL, FP32_ATOL = 1.3e-6, 1e-5
EPS = 1e-6
N = 4
COL_TOL = 2 * EPS + 8 * N * 2.0 ** -24
ROW_TOL_F64 = 1e-12


def _python_sinkhorn(x, repeat, eps):
    """The five steps of §2.4 on nested Python lists (float64 scalars)."""
    n = len(x)
    a = []
    for row in x:
        m = max(row)
        e = [math.exp(v - m) for v in row]
        s = sum(e)
        a.append([v / s + eps for v in e])

    def col_step(a):
        c = [sum(a[j][k] for j in range(n)) + eps for k in range(n)]
        return [[a[j][k] / c[k] for k in range(n)] for j in range(n)]

    def row_step(a):
        return [[v / (sum(r) + eps) for v in r] for r in a]

    a = col_step(a)
    for _ in range(repeat - 1):
        a = col_step(row_step(a))
    return a


@pytest.mark.parametrize("repeat", [1, 3, 10])
def test_hand_python_loop(repeat):
    x = torch.randn(3, N, N)
    out = sinkhorn_normalize(x, repeat, EPS)
    for t in range(3):
        expect = torch.tensor(_python_sinkhorn(x[t].double().tolist(), repeat, EPS), dtype=F64)
        torch.testing.assert_close(out[t].double(), expect, rtol=FP32_RTOL, atol=FP32_ATOL)


def test_hand_equal_logits_give_uniform():
    # identical logits in a row -> softmax 1/4; every later step keeps all entries equal: 1/4 exactly
    x = torch.tensor([[2.0, 2.0, 2.0, 2.0]] * 4).expand(2, 4, 4) + torch.tensor([0.0, 5.0]).view(2, 1, 1)
    out = sinkhorn_normalize(x, 5, 0.0)
    assert (out == 0.25).all()


def test_sums_to_one():
    x = torch.randn(64, N, N)
    out = sinkhorn_normalize(x, 10, EPS)
    assert (out.sum(-2) - 1).abs().max() <= COL_TOL
    x64 = x.double()
    out64 = sinkhorn_normalize_ref(x64, 200, 0.0)
    assert (out64.sum(-1) - 1).abs().max() <= ROW_TOL_F64
    assert (out64.sum(-2) - 1).abs().max() <= ROW_TOL_F64
    assert (out64 > 0).all()


def test_public_equals_reference_and_grad_matches_autograd():
    x = torch.randn(2, 5, N, N)
    out = sinkhorn_normalize(leaf(x), 10, EPS)
    assert torch.equal(out, sinkhorn_normalize_ref(x, 10, EPS))
    g = torch.randn_like(x)
    xl = leaf(x)
    (d_x,) = torch.autograd.grad(sinkhorn_normalize(xl, 10, EPS), xl, g)
    xr = leaf(x)
    (d_ref,) = torch.autograd.grad(sinkhorn_normalize_ref(xr, 10, EPS), xr, g)
    torch.testing.assert_close(d_x, d_ref, rtol=FP32_RTOL, atol=FP32_ATOL)


def test_v21_ops_write_destinations():
    x = torch.randn(7, N, N)
    out = torch.full_like(x, float("nan"))
    mhc_sinkhorn_fwd(x, out, 10, EPS)
    assert torch.equal(out, sinkhorn_normalize_ref(x, 10, EPS))
    g = torch.randn_like(x)
    d_x = torch.full_like(x, float("nan"))
    mhc_sinkhorn_bwd(g, x, d_x, 10, EPS)
    xr = leaf(x)
    (d_ref,) = torch.autograd.grad(sinkhorn_normalize_ref(xr, 10, EPS), xr, g)
    torch.testing.assert_close(d_x, d_ref, rtol=FP32_RTOL, atol=FP32_ATOL)


@pytest.mark.parametrize("n", [2, 4])
def test_gradcheck_float64(n):
    x = torch.randn(3, n, n, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: F.SinkhornNormalizeFn.apply(v, 3, 1e-3), (x,))


def test_noncontiguous_input_and_zero_tokens():
    x = torch.randn(N, N, 6).permute(2, 0, 1)
    assert torch.equal(sinkhorn_normalize(x), sinkhorn_normalize_ref(x.contiguous()))
    e = torch.empty(0, N, N, requires_grad=True)
    out = sinkhorn_normalize(e)
    assert out.shape == (0, N, N)
    out.sum().backward()
    d = torch.empty(0, N, N)
    mhc_sinkhorn_bwd(torch.empty(0, N, N), torch.empty(0, N, N), d, 10, EPS)


def test_errors():
    x = torch.randn(3, N, N)
    with pytest.raises(TypeError, match="x"):
        sinkhorn_normalize(x.double())
    with pytest.raises(ValueError, match="x"):
        sinkhorn_normalize(torch.randn(3, 4, 3))
    with pytest.raises(ValueError, match="repeat"):
        sinkhorn_normalize(x, 0)
    with pytest.raises(TypeError, match="eps"):
        sinkhorn_normalize(x, 10, "1e-6")
    out = torch.zeros(3, N, N, dtype=F32)
    with pytest.raises(ValueError, match="comb_res_mix_out"):
        mhc_sinkhorn_fwd(x, out[:2], 10, EPS)
    with pytest.raises(ValueError, match="grad_input"):
        mhc_sinkhorn_bwd(x, x, torch.zeros(3, N, 2), 10, EPS)
