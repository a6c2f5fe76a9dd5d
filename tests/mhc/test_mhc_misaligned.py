"""Misaligned buffers (gpu tier): contiguous views whose data starts one element past a 16-byte boundary, as inputs
and as destinations, for the ops whose kernels use 16-byte vector accesses and whose launchers bind such a view
through an aligned copy (inputs) or write through one (destinations): the norm-weight merge forward, the Sinkhorn
forward and backward, and the fused pre (``mhc_pre_big_fuse_fwd``). The results are the aligned call's bits, and
nothing is written outside the destination view."""
import pytest
import torch

from tilefuse import mhc

pytestmark = pytest.mark.gpu


def _shifted(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(base, view)``: ``view`` holds ``t``'s values, contiguous, one element past the start of ``base`` (whose
    first element is NaN): its data is 4 (fp32) or 2 (bf16) bytes off a 16-byte boundary."""
    base = torch.full((t.numel() + 1,), float("nan"), dtype=t.dtype, device=t.device)
    view = base[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 != 0
    return base, view


def _untouched(base: torch.Tensor) -> None:
    assert torch.isnan(base[0].float())


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _poison(shape, dtype=torch.float32) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def test_normw_merge_fwd():
    M, K = 24, 16384
    fn, w = torch.randn(M, K, device="cuda"), torch.randn(K, device="cuda")
    want = _poison((M, K))
    mhc.mhc_fn_normw_merge_fwd(fn, w, want)
    (_, fn_s), (_, w_s), (out_base, out_s) = _shifted(fn), _shifted(w), _shifted(_poison((M, K)))
    mhc.mhc_fn_normw_merge_fwd(fn_s, w_s, out_s)
    _same(out_s, want)
    _untouched(out_base)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_sinkhorn_fwd_bwd(n):
    T, repeat, eps = 1001, 20, 1e-6
    x, g = torch.randn(T, n, n, device="cuda"), torch.randn(T, n, n, device="cuda")
    want_y, want_dx = _poison((T, n, n)), _poison((T, n, n))
    mhc.mhc_sinkhorn_fwd(x, want_y, repeat, eps)
    mhc.mhc_sinkhorn_bwd(g, x, want_dx, repeat, eps)
    (_, x_s), (_, g_s) = _shifted(x), _shifted(g)
    (y_base, y_s), (dx_base, dx_s) = _shifted(_poison((T, n, n))), _shifted(_poison((T, n, n)))
    mhc.mhc_sinkhorn_fwd(x_s, y_s, repeat, eps)
    mhc.mhc_sinkhorn_bwd(g_s, x_s, dx_s, repeat, eps)
    _same(y_s, want_y)
    _same(dx_s, want_dx)
    _untouched(y_base)
    _untouched(dx_base)


def test_pre_big_fuse_fwd():
    T, n, C, S = 777, 4, 1280, 16
    M, K = n * (n + 2), n * C
    partials = torch.randn(S, T, M, device="cuda") * (K / S) ** 0.5 * 1e-2
    sqrsum = (0.5 + torch.rand(S, T, device="cuda")) * (K / S)
    scale, base = torch.randn(3, device="cuda") * 0.1, torch.randn(M, device="cuda") * 0.1
    residual = torch.randn(T, n, C, device="cuda").to(torch.bfloat16)
    args = (1e-6, 1e-2, 1e-6, 2.0, 20, S)  # rms_eps, pre_eps, sinkhorn_eps, post_mult_value, repeat, n_splits
    want = (_poison((T, n)), _poison((T, n * n)), _poison((T, C), torch.bfloat16))
    mhc.mhc_pre_big_fuse_fwd(partials, sqrsum, scale, base, residual, *want, *args)
    shifted_in = [_shifted(t)[1] for t in (partials, sqrsum, scale, base, residual)]
    outs = [_shifted(t) for t in (_poison((T, n)), _poison((T, n * n)), _poison((T, C), torch.bfloat16))]
    mhc.mhc_pre_big_fuse_fwd(*shifted_in, *(view for _, view in outs), *args)
    for (out_base, view), w in zip(outs, want):
        _same(view, w)
        _untouched(out_base)
