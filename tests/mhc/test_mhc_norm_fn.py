"""mhc_pre_norm_fn, the norm-weight merge, the split-K partials and the reduce/RMS ops (mhc.md §2.2).

Tolerances (written once). Outputs are dot products of length K <= 128 of O(1) terms computed in fp32
against float64: error <= K * 2^-24 * sum|terms| ~ 1e-5 * sum|terms|; we compare with
RTOL = ATOL = 2e-5 (relative to O(1) values). The residual gradient is bf16: within 1 bf16 ulp of the
float64 value (helper ``assert_bf16_round_of``); the v2.1 RMS-backward op against autograd of the
forward reference, both fp32, uses the same RTOL/ATOL.
"""
import pytest
import torch

from tilefuse.mhc import (mhc_fn_normw_merge_bwd, mhc_fn_normw_merge_fwd, mhc_pre_norm_fn,
                          mhc_reduce_partials_and_rmsnorm_bwd, mhc_reduce_partials_and_rmsnorm_fwd)
from tilefuse.mhc import _functions as F
from tilefuse.reference import mhc_pre_norm_fn_partials_ref, mhc_pre_norm_fn_ref
from tilefuse.reference import mhc as R
from tests.mhc.mhc_helpers import BF16, F64, assert_bf16_round_of, f64, leaf

RTOL = ATOL = 2e-5
N, C = 4, 8
K, M = N * C, N * (N + 2)
EPS = 1e-6


def _inputs(A=1, B=6):
    residual = (torch.randn(A, B, N, C) * (1 + 0.1 * torch.arange(N)).view(N, 1)).to(BF16)
    fn = torch.randn(M, K) * 0.1
    normw = 1 + 0.1 * torch.randn(K)
    return residual, fn, normw


def test_hand_python_loop():
    residual, fn, normw = _inputs(1, 2)
    out = mhc_pre_norm_fn(residual, fn, normw, EPS, fuse_grad_acc=False)
    for t in range(2):
        x = residual[0, t].flatten().double().tolist()
        r = (sum(v * v for v in x) / K + EPS) ** -0.5
        for j in range(M):
            dot = sum(x[k] * float(fn[j, k]) * float(normw[k]) for k in range(K))
            assert out[0, t, j].item() == pytest.approx(dot * r, rel=RTOL, abs=ATOL)


def test_hand_rms_factor():
    # every element 2 -> sum of squares 4K, r = 1/2; a row of ones in fn gives (2K) * 1/2 = K
    residual = torch.full((1, 1, N, C), 2.0, dtype=BF16)
    fn = torch.zeros(M, K)
    fn[3] = 1.0
    fn[5, :2] = torch.tensor([1.0, -3.0])
    out = mhc_pre_norm_fn(residual, fn, None, 0.0)
    expect = torch.zeros(M)
    expect[3], expect[5] = K, -2.0
    assert torch.equal(out[0, 0], expect)


def test_partials_cover_split_slices():
    residual, fn, _ = _inputs(1, 3)
    out_mul, sqrsum = mhc_pre_norm_fn_partials_ref(residual, fn, 3)  # width K // 3 = 10, tail of 2 dropped
    assert out_mul.shape == (3, 3, 1, M) and sqrsum.shape == (3, 3, 1)
    x = residual.reshape(3, K).double()
    for s in range(3):
        cols = slice(10 * s, 10 * s + 10)
        torch.testing.assert_close(out_mul[s, :, 0].double(), x[:, cols] @ fn[:, cols].double().T, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(sqrsum[s, :, 0].double(), (x[:, cols] ** 2).sum(-1), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("with_weight", [False, True])
def test_public_equals_reference_and_grads(with_weight):
    residual, fn, normw = _inputs()
    w = normw if with_weight else None
    rl, fl = leaf(residual), leaf(fn)
    wl = leaf(normw) if with_weight else None
    out = mhc_pre_norm_fn(rl, fl, wl, EPS, fuse_grad_acc=False)
    assert torch.equal(out, mhc_pre_norm_fn_ref(residual, fn, w, EPS))
    g = torch.randn_like(out)
    inputs = [rl, fl] + ([wl] if with_weight else [])
    got = torch.autograd.grad(out, inputs, g)
    exact_in = f64(*[residual, fn] + ([normw] if with_weight else []))
    want = torch.autograd.grad(mhc_pre_norm_fn_ref(exact_in[0], exact_in[1], exact_in[2] if with_weight else None,
                                                   EPS), exact_in, g.double())
    assert_bf16_round_of(got[0], want[0])
    for a, e in zip(got[1:], want[1:]):
        torch.testing.assert_close(a.double(), e, rtol=RTOL, atol=ATOL)


def test_gradcheck_float64():
    # n = 2, C = 3 (K = 6), M = 5: the math is the same for every shape; small keeps gradcheck fast
    residual, fn, normw = f64(torch.randn(1, 2, 2, 3), torch.randn(5, 6), 1 + 0.1 * torch.randn(6))
    f = lambda r, fn: F.MHCPreNormFn.apply(r, fn, 1e-3, False)  # noqa: E731
    assert torch.autograd.gradcheck(f, (residual, fn))
    assert torch.autograd.gradcheck(F.MHCFnNormwMergeFn.apply, (fn, normw))


def test_fused_grad_accumulates_into_side_channel():
    residual, fn, _ = _inputs()
    g = torch.randn(1, 6, M)
    rl = leaf(residual)
    out = mhc_pre_norm_fn(rl, fn, None, EPS, fuse_grad_acc=True)
    with pytest.raises(AttributeError, match="fuse_grad_acc"):
        out.backward(g, retain_graph=True)
    buf = torch.randn(1, 6, N, C).to(BF16)
    start = buf.clone()
    F.attach_residual_grad(rl, buf)
    out.backward(g)
    assert rl.grad is None
    assert not hasattr(rl.untyped_storage(), F.SIDE_CHANNEL)
    r64 = f64(residual)[0]
    (exact,) = torch.autograd.grad(mhc_pre_norm_fn_ref(r64, fn.double(), None, EPS), r64, g.double())
    assert_bf16_round_of(buf, start.double() + exact)


def test_main_grad_receives_weight_gradients():
    residual, fn, normw = _inputs()
    g = torch.randn(1, 6, M)
    fl, wl = leaf(fn), leaf(normw)
    mhc_pre_norm_fn(residual, fl, wl, EPS, fuse_grad_acc=False).backward(g)
    fm, wm = leaf(fn), leaf(normw)
    fm.main_grad = torch.ones_like(fn)
    wm.main_grad = torch.ones_like(normw)
    mhc_pre_norm_fn(residual, fm, wm, EPS, fuse_grad_acc=False).backward(g)
    assert fm.grad is None and wm.grad is None
    torch.testing.assert_close(fm.main_grad, 1 + fl.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(wm.main_grad, 1 + wl.grad, rtol=RTOL, atol=ATOL)


def test_v21_merge_ops_accumulate():
    _, fn, normw = _inputs()
    out_fn = torch.full_like(fn, float("nan"))
    mhc_fn_normw_merge_fwd(fn, normw, out_fn)
    assert torch.equal(out_fn, fn * normw)
    dW = torch.randn(M, K)
    fn_grad, w_grad = torch.randn(M, K), torch.randn(K)
    fn_grad0, w_grad0 = fn_grad.clone(), w_grad.clone()
    mhc_fn_normw_merge_bwd(fn, normw, dW, fn_grad, w_grad)
    assert torch.equal(fn_grad, fn_grad0 + dW * normw)
    w_sum = torch.zeros(K)
    for j in range(M):  # rows in order, from 0, added once (§2.2.1)
        w_sum = w_sum + dW[j] * fn[j]
    assert torch.equal(w_grad, w_grad0 + w_sum)


def test_v21_reduce_and_rmsnorm():
    S, T, G, Kg = 3, 5, 2, 16
    pm_s, q_s = torch.randn(S, T, G, M), torch.rand(S, T, G) * Kg
    pm, q, out = torch.full((T, G, M), float("nan")), torch.full((T, G), float("nan")), torch.full((T, M), float("nan"))
    mhc_reduce_partials_and_rmsnorm_fwd(pm_s, q_s, pm, q, out, Kg, EPS, S)
    pm64, q64 = pm_s.double().sum(0), q_s.double().sum(0)
    torch.testing.assert_close(pm.double(), pm64, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(q.double(), q64, rtol=RTOL, atol=ATOL)
    r64 = (q64 / Kg + EPS).rsqrt()
    torch.testing.assert_close(out.double(), (pm64 * r64.unsqueeze(-1)).sum(1), rtol=RTOL, atol=ATOL)
    # backward op vs autograd of the forward reference
    g = torch.randn(T, M)
    d_pm, d_q = torch.full((T, G, M), float("nan")), torch.full((T, G), float("nan"))
    mhc_reduce_partials_and_rmsnorm_bwd(g, pm, q, d_pm, d_q, Kg, EPS)
    pl, ql = leaf(pm), leaf(q)
    r = torch.rsqrt(ql / Kg + EPS)
    want = torch.autograd.grad(R.seq_sum(pl * r.unsqueeze(-1), -2), (pl, ql), g)
    torch.testing.assert_close(d_pm, want[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(d_q, want[1], rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="n_splits"):
        mhc_reduce_partials_and_rmsnorm_fwd(pm_s, q_s, pm, q, out, Kg, EPS, 16)


def test_zero_tokens():
    residual = torch.empty(1, 0, N, C, dtype=BF16, requires_grad=True)
    fn = torch.randn(M, K, requires_grad=True)
    out = mhc_pre_norm_fn(residual, fn, None, EPS, fuse_grad_acc=False)
    assert out.shape == (1, 0, M)
    out.sum().backward()
    assert (fn.grad == 0).all() and residual.grad.shape == residual.shape


def test_errors():
    residual, fn, normw = _inputs()
    with pytest.raises(TypeError, match="residual"):
        mhc_pre_norm_fn(residual.float(), fn, None, EPS)
    with pytest.raises(TypeError, match="mhc_fn"):
        mhc_pre_norm_fn(residual, fn.to(BF16), None, EPS)
    with pytest.raises(ValueError, match="mhc_fn"):
        mhc_pre_norm_fn(residual, fn[:, :-1], None, EPS)
    with pytest.raises(ValueError, match="mhc_norm_weight"):
        mhc_pre_norm_fn(residual, fn, normw[:-1], EPS)
    with pytest.raises(ValueError, match="n_splits"):
        mhc_pre_norm_fn(residual, fn, None, EPS, n_splits=0)
    with pytest.raises(TypeError, match="fuse_grad_acc"):
        mhc_pre_norm_fn(residual, fn, None, EPS, fuse_grad_acc=1)
    fn_grad = torch.zeros(M, K)
    with pytest.raises(ValueError, match="normw_grad"):
        mhc_fn_normw_merge_bwd(fn, normw, fn, fn_grad, torch.zeros(K + 1))
    assert (fn_grad == 0).all()
