"""v2.1 Sinkhorn helpers (engram.md §2.9): momentum update, row-normalisation step, its column-statistics
reduction, finalisation, and their references."""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from tilefuse.engram import (engram_sinkhorn_finalize, engram_sinkhorn_momentum_update, engram_sinkhorn_step,
                             engram_sinkhorn_step_reduce)
from tilefuse.engram.ops import DEFAULT_NUM_SMS
from tilefuse.reference import (engram_sinkhorn_finalize_ref, engram_sinkhorn_momentum_update_ref,
                                engram_sinkhorn_step_ref)
from tilefuse.testing import assert_equal

U = 2.0 ** -24  # fp32 unit roundoff
BF16, FP32 = torch.bfloat16, torch.float32


def within(got: torch.Tensor, exact: torch.Tensor, rel) -> bool:
    """Every element of ``got`` within ``rel`` (scalar or tensor) relative error of float64 ``exact``."""
    return bool(((got.double() - exact).abs() <= rel * exact.abs()).all())


# ----------------------------------------------------------------------------------------------------
# Momentum update (§2.9.1)
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("grad_dtype,buf_dtype", [(BF16, BF16), (BF16, FP32), (FP32, BF16), (FP32, FP32)])
def test_momentum_exact_definition(grad_dtype, buf_dtype, nesterov, round_f32):
    """m' = fma(m, β, RN(β'·g)); buffer = RN_dtype(m'); out = fma(g, β', RN(β·m')) or m' — evaluated per
    element with numpy fp32 products and exactly rounded rationals."""
    beta1 = 0.9
    grad = torch.randn(256).to(grad_dtype)  # only the element count has to match the buffer
    buf = torch.randn(2, 128).to(buf_dtype)
    g_list, m_list = grad.float().tolist(), buf.float().flatten().tolist()
    before = buf.clone()
    out = engram_sinkhorn_momentum_update(grad, buf, beta1, nesterov)
    assert out.shape == buf.shape and out.dtype == FP32 and out.data_ptr() != buf.data_ptr()
    beta, beta_c = np.float32(beta1), np.float32(1 - beta1)
    m_new, expected = [], []
    for g, m in zip(g_list, m_list):
        mp = round_f32(Fraction(m) * Fraction(float(beta)) + Fraction(float(beta_c * np.float32(g))))
        m_new.append(mp)
        if nesterov:
            mp = round_f32(Fraction(g) * Fraction(float(beta_c)) + Fraction(float(beta * np.float32(mp))))
        expected.append(mp)
    assert out.flatten().tolist() == expected
    assert_equal(buf, torch.tensor(m_new).view(2, 128).to(buf_dtype))
    assert not torch.equal(buf, before)


def test_momentum_beta_zero_copies_grad():
    grad, buf = torch.randn(512), torch.randn(512)
    out = engram_sinkhorn_momentum_update(grad, buf, 0.0, nesterov=True)
    assert_equal(buf, grad)
    assert_equal(out, grad)


@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_vs_reference(nesterov):
    """fma and two-rounding formulations agree to a few ulp of the terms; both update the buffer."""
    grad, buf = torch.randn(4, 256), torch.randn(4, 256)
    buf_ref = buf.clone()
    out = engram_sinkhorn_momentum_update(grad, buf, 0.95, nesterov)
    ref = engram_sinkhorn_momentum_update_ref(grad, buf_ref, 0.95, nesterov)
    scale = grad.double().abs() + buf_ref.double().abs() + buf.double().abs()
    assert bool(((buf.double() - buf_ref.double()).abs() <= 4 * U * scale).all())
    assert bool(((out.double() - ref.double()).abs() <= 8 * U * scale).all())


def test_momentum_zero_elements():
    out = engram_sinkhorn_momentum_update(torch.empty(0), torch.empty(0, 256), 0.9)
    assert out.shape == (0, 256) and out.dtype == FP32


@pytest.mark.parametrize("name,grad,buf,beta1,exc", [
    ("grad", torch.zeros(256, dtype=torch.float64), torch.zeros(256), 0.9, TypeError),
    ("grad", torch.zeros(512), torch.zeros(256), 0.9, ValueError),
    ("momentum_buffer", torch.zeros(128), torch.zeros(128), 0.9, ValueError),
    ("momentum_buffer", torch.zeros(256), torch.zeros(16, 32).t(), 0.9, ValueError),
    ("momentum_buffer", torch.zeros(256), torch.zeros(256, dtype=torch.float16), 0.9, TypeError),
    ("beta1", torch.zeros(256), torch.zeros(256), "0.9", TypeError),
])
def test_momentum_errors_leave_buffer(name, grad, buf, beta1, exc):
    grad = grad + torch.randn(grad.shape, dtype=grad.dtype) if grad.numel() else grad
    buf.copy_(torch.randn(buf.shape))
    before = buf.clone()
    with pytest.raises(exc, match=name):
        engram_sinkhorn_momentum_update(grad, buf, beta1)
    assert_equal(buf, before)


# ----------------------------------------------------------------------------------------------------
# Step and step_reduce (§2.9.2, §2.9.3)
# ----------------------------------------------------------------------------------------------------

def test_step_hand_computed():
    # B = 1, r = (1, 2), c = 1, D = 256: y_i = r_i, n_i = 16·r_i, r_i <- 1/16, z = 1/16, z² = 1/256.
    # num_sms = 1 -> 3 chunks of ceil(2/3) = 1 row: rows 0 and 1 in partials 0 and 1, partial 2 is zero.
    matrix = torch.ones(2, 256)
    row_scale = torch.tensor([1.0, 2.0])
    row_norm, partial = engram_sinkhorn_step(matrix, row_scale, torch.ones(256), 0.0, num_sms=1)
    assert row_norm.tolist() == [16.0, 32.0]
    assert row_scale.tolist() == [1 / 16, 1 / 16]
    assert partial.shape == (3, 256)
    assert_equal(partial, torch.tensor([1 / 256, 1 / 256, 0.0])[:, None].expand(3, 256).contiguous())
    col_sumsq = torch.full((256,), float("nan"))
    assert engram_sinkhorn_step_reduce(partial, col_sumsq) is None
    assert_equal(col_sumsq, torch.full((256,), 2 / 256))


@pytest.mark.parametrize("rows,num_sms", [(50, 4), (7, 4), (300, 2)])
def test_step_matches_float64(rows, num_sms):
    d, eps = 512, 1e-6
    matrix, col_scale = torch.randn(rows, d), torch.rand(d) + 0.5
    row_scale = torch.rand(rows) + 0.5
    r0 = row_scale.clone()
    row_norm, partial = engram_sinkhorn_step(matrix, row_scale, col_scale, eps, num_sms=num_sms)
    y64 = r0.double()[:, None] * matrix.double() * col_scale.double()
    n64 = y64.norm(dim=1)
    # y: two roundings (4U on y²); Σ of d positive terms; sqrt halves the relative error
    rel_n = (d / 2 + 4) * U
    assert within(row_norm, n64, rel_n)
    assert within(row_scale, r0.double() / (n64 + eps), rel_n + 4 * U)
    z2 = (y64 / (n64 + eps)[:, None]) ** 2
    p = 3 * num_sms
    assert partial.shape == (p, d)
    q = math.ceil(rows / p)
    for i in range(p):
        exact = z2[i * q:(i + 1) * q].sum(0)  # empty slice -> zeros
        assert within(partial[i], exact, (q + 2 * rel_n / U + 8) * U) if i * q < rows else bool((partial[i] == 0).all())


def test_step_and_reduce_vs_reference():
    rows, d, eps = 40, 256, 1e-6
    matrix, col_scale, row_scale = torch.randn(rows, d), torch.rand(d) + 0.5, torch.rand(rows) + 0.5
    ref_scale, ref_sumsq = row_scale.clone(), torch.empty(d)
    ref_norm = engram_sinkhorn_step_ref(matrix, ref_scale, col_scale, ref_sumsq, eps)
    row_norm, partial = engram_sinkhorn_step(matrix, row_scale, col_scale, eps)
    assert partial.shape == (3 * DEFAULT_NUM_SMS, d)
    col_sumsq = torch.empty(d)
    engram_sinkhorn_step_reduce(partial, col_sumsq)
    rel_n = (d / 2 + 8) * U
    assert within(row_norm, ref_norm.double(), 2 * rel_n)
    assert within(row_scale, ref_scale.double(), 2 * rel_n + 8 * U)
    assert within(col_sumsq, ref_sumsq.double(), (2 * rows + 4 * rel_n / U + 16) * U)
    # the normalised rows have unit norm up to eps: Σ_j col_sumsq ≈ rows
    assert abs(col_sumsq.double().sum().item() - rows) <= rows * 1e-5


def test_step_reduce_sequential_order():
    """col_sumsq[j] = Σ_p partial[p, j] summed in ascending p from 0 (numpy fp32, bitwise)."""
    partial = torch.randn(396, 256) * torch.exp2(torch.randint(-10, 10, (396, 1)).float())
    col_sumsq = torch.empty(256)
    engram_sinkhorn_step_reduce(partial, col_sumsq)
    acc = np.zeros(256, dtype=np.float32)
    for row in partial.numpy():
        acc = acc + row
    assert_equal(col_sumsq, torch.from_numpy(acc))


def test_step_zero_rows():
    row_scale = torch.empty(0)
    row_norm, partial = engram_sinkhorn_step(torch.empty(0, 256), row_scale, torch.rand(256), 1e-6)
    assert row_norm.shape == (0,) and partial.shape == (3 * DEFAULT_NUM_SMS, 256)
    assert bool((partial == 0).all())


@pytest.mark.parametrize("name,change,exc", [
    ("matrix", dict(matrix=torch.randn(4, 128)), ValueError),
    ("matrix", dict(matrix=torch.randn(4, 256).double()), TypeError),
    ("row_scale", dict(row_scale=torch.rand(5)), ValueError),
    ("col_scale", dict(col_scale=torch.rand(256).bfloat16()), TypeError),
    ("eps", dict(eps=None), TypeError),
    ("num_sms", dict(num_sms=0), ValueError),
])
def test_step_errors_leave_row_scale(name, change, exc):
    args = dict(matrix=torch.randn(4, 256), row_scale=torch.rand(4), col_scale=torch.rand(256), eps=1e-6)
    args.update(change)
    before = args["row_scale"].clone()
    with pytest.raises(exc, match=name):
        engram_sinkhorn_step(**args)
    assert_equal(args["row_scale"], before)


@pytest.mark.parametrize("name,partial,col_sumsq,exc", [
    ("col_sumsq_partial", torch.zeros(8, 128), torch.zeros(128), ValueError),
    ("col_sumsq_partial", torch.zeros(8, 256).double(), torch.zeros(256), TypeError),
    ("col_sumsq", torch.zeros(8, 256), torch.zeros(512), ValueError),
    ("col_sumsq", torch.zeros(8, 256), torch.zeros(256).bfloat16(), TypeError),
])
def test_step_reduce_errors(name, partial, col_sumsq, exc):
    with pytest.raises(exc, match=name):
        engram_sinkhorn_step_reduce(partial, col_sumsq)


# ----------------------------------------------------------------------------------------------------
# Finalize (§2.9.4)
# ----------------------------------------------------------------------------------------------------

def test_finalize_hand_computed():
    # B = 1, r = (1, 2), c = 1, D = 256: y_i = r_i, n_i = 16·r_i, out = r_i·3/(16·r_i) = 3/16.
    row_scale = torch.tensor([1.0, 2.0])
    out = engram_sinkhorn_finalize(torch.ones(2, 256), row_scale, torch.ones(256), 0.0, 3.0)
    assert_equal(out, torch.full((2, 256), 3 / 16))
    assert row_scale.tolist() == [1.0, 2.0]  # read only


def test_finalize_rows_and_reference():
    rows, d, eps, alpha = 30, 512, 1e-6, 0.7
    matrix, row_scale, col_scale = torch.randn(rows, d), torch.rand(rows) + 0.5, torch.rand(d) + 0.5
    buffer = torch.full((rows, d), float("nan"))
    out = engram_sinkhorn_finalize(matrix, row_scale, col_scale, eps, alpha, out=buffer)
    assert out is buffer
    y64 = row_scale.double()[:, None] * matrix.double() * col_scale.double()
    n64 = y64.norm(dim=1, keepdim=True)
    exact = y64 * alpha / (n64 + eps)
    assert within(out, exact, (d / 2 + 12) * U)
    ref = engram_sinkhorn_finalize_ref(matrix, row_scale, col_scale, eps, alpha)
    assert within(ref, exact, (d / 2 + 12) * U)
    assert within(out.norm(dim=1), torch.full((rows,), alpha, dtype=torch.float64), 1e-5)


def test_finalize_zero_rows():
    out = engram_sinkhorn_finalize(torch.empty(0, 256), torch.empty(0), torch.rand(256), 1e-6, 1.0)
    assert out.shape == (0, 256) and out.dtype == FP32


@pytest.mark.parametrize("name,change,exc", [
    ("out", dict(out=torch.empty(4, 512)), ValueError),
    ("out", dict(out=torch.empty(4, 256).bfloat16()), TypeError),
    ("alpha", dict(alpha="1"), TypeError),
    ("matrix", dict(matrix=torch.randn(256, 4).t()), ValueError),
])
def test_finalize_errors(name, change, exc):
    args = dict(matrix=torch.randn(4, 256), row_scale=torch.rand(4), col_scale=torch.rand(256), eps=1e-6, alpha=1.0)
    args.update(change)
    with pytest.raises(exc, match=name):
        engram_sinkhorn_finalize(**args)
