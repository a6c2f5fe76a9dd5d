"""RMSNorm ops (quant.md 5.11): forward, forward + per-token cast, backward."""
import pytest
import torch

from tilefuse import formats as F
from tilefuse.quant import norm_backward, norm_forward, norm_forward_and_per_token_cast
from tilefuse.reference import cast, norm_backward_ref, norm_forward_ref

# Relative error of a binary32 RMSNorm against float64: a length-H sum of squares (<= H*u, u = 2^-24),
# rsqrt/divide/eps (a few u) and three products (3u). Outputs rounded to bf16 add a half ulp (2^-8 rel).
U = 2.0 ** -24


def fp32_rtol(h):
    return (h + 8) * U


BF16_RTOL = 2.0 ** -8


def _f64_forward(x, w, eps, residual, out_scale):
    """Independent float64 RMSNorm of the (already rounded) norm input."""
    h = x.double() if residual is None else (x.float() + residual.float()).to(x.dtype).double()
    rstd = 1 / torch.sqrt(h.square().mean(-1) + eps)
    y = h * rstd[..., None] * out_scale
    return (y if w is None else y * w.double()), rstd, h


def test_forward_hand_values():
    """x = 2 everywhere, eps = 0: rstd = rsqrt(4) = 0.5 exactly, so out = w * out_scale exactly."""
    x = torch.full((3, 16), 2.0)
    w = 2.0 ** torch.arange(-8, 8).float()
    out, rstd, ni = norm_forward(x, w, 0.0, out_scale=0.25, with_rstd=True)
    assert torch.equal(rstd, torch.full((3,), 0.5))
    assert torch.equal(out, (w * 0.25).expand(3, 16))
    assert ni is x
    # Residual: h = bf16(x + r); x = 1.5, r = 0.5 -> h = 2 exactly.
    xb, rb = torch.full((2, 32), 1.5, dtype=torch.bfloat16), torch.full((2, 32), 0.5, dtype=torch.bfloat16)
    out, rstd, ni = norm_forward(xb, None, 0.0, residual=rb, with_rstd=True)
    assert torch.equal(ni, torch.full((2, 32), 2.0, dtype=torch.bfloat16))
    assert torch.equal(out, torch.ones(2, 32, dtype=torch.bfloat16)) and torch.equal(rstd, torch.full((2,), 0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_weight,with_residual,out_scale", [(True, False, 1.0), (False, True, 0.5),
                                                                 (True, True, 3.0)])
def test_forward_against_float64(dtype, with_weight, with_residual, out_scale):
    h = 256
    x = torch.randn(33, h).to(dtype)
    w = torch.randn(h).to(dtype) if with_weight else None
    r = torch.randn(33, h).to(dtype) if with_residual else None
    out, rstd, ni = norm_forward(x, w, 1e-6, residual=r, out_scale=out_scale, with_rstd=True)
    y64, rstd64, h64 = _f64_forward(x, w, 1e-6, r, out_scale)
    assert out.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (33,)
    torch.testing.assert_close(rstd.double(), rstd64, rtol=fp32_rtol(h), atol=0)
    rtol = fp32_rtol(h) + (BF16_RTOL if dtype == torch.bfloat16 else 0)
    torch.testing.assert_close(out.double(), y64, rtol=rtol, atol=1e-30)
    if with_residual:
        assert torch.equal(ni.double(), h64)
    else:
        assert ni is x


def test_forward_3d_rows_independent_and_buffers():
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    r = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    out_buf = torch.full_like(x, float("nan"))
    res_buf = torch.full_like(x, float("nan"))
    out, rstd, ni = norm_forward(x, w, 1e-5, r, 2.0, out=out_buf, residual_out=res_buf, with_rstd=True)
    assert out is out_buf and ni is res_buf and rstd.shape == (2, 5)
    flat = norm_forward(x.reshape(10, 64), w, 1e-5, r.reshape(10, 64), 2.0, with_rstd=True)
    assert torch.equal(out.reshape(10, 64), flat[0]) and torch.equal(rstd.reshape(10), flat[1])
    ref = norm_forward_ref(x, w, 1e-5, r, 2.0)
    assert torch.equal(out, ref[0]) and torch.equal(rstd, ref[1]) and torch.equal(ni, ref[2])
    assert norm_forward(x, w, 1e-5)[1] is None  # rstd only with_rstd


def test_forward_row_strided_view():
    big = torch.randn(8, 128)
    out = norm_forward(big[:, :64], None, 1e-6)[0]
    assert torch.equal(out, norm_forward(big[:, :64].contiguous(), None, 1e-6)[0])


def test_forward_zero_tokens():
    out, rstd, ni = norm_forward(torch.empty(0, 64), torch.ones(64), 1e-6, with_rstd=True)
    assert out.shape == (0, 64) and rstd.shape == (0,)
    (d, s), _, _, _ = norm_forward_and_per_token_cast(torch.empty(0, 64), None, 1e-6, "e4m3", 32)
    assert d.shape == (0, 64) and d.dtype == torch.float8_e4m3fn and s.shape == (0, 2)


@pytest.mark.parametrize("col,round_sf,packed", [(False, False, False), (False, True, False), (True, True, True),
                                                 (False, True, True), (True, False, False)])
def test_cast_equals_per_token_cast_of_norm(col, round_sf, packed):
    x = torch.randn(9, 128, dtype=torch.bfloat16) * 4
    w = torch.randn(128, dtype=torch.bfloat16)
    r = torch.randn(9, 128, dtype=torch.bfloat16)
    (d, s), ob, rstd, ni = norm_forward_and_per_token_cast(
        x, w, 1e-6, "e4m3", 32, r, 0.5, col, round_sf, packed, with_out_bf16=True, with_rstd=True)
    o, rstd_n, ni_n = norm_forward(x, w, 1e-6, r, 0.5, with_rstd=True)
    ed, es = cast(o, "e4m3", (1, 32), round_sf=round_sf, use_tma_aligned_col_major_sf=col,
                  use_packed_ue8m0=packed)
    assert torch.equal(d.view(torch.uint8), ed.view(torch.uint8))
    assert s.dtype == es.dtype and s.shape == es.shape and s.stride() == es.stride() and torch.equal(s, es)
    assert torch.equal(ob, o) and torch.equal(rstd, rstd_n) and torch.equal(ni, ni_n)
    # Independent check of the scale: sf = amax(|o|) / 448 per 32-group (clamped), or its power of two.
    amax = o.float().abs().view(9, 4, 32).amax(-1).clamp_min(F.CLAMP_MIN["e4m3"])
    sf_vals = F.load_sf(s, 4)
    expect = amax / 448 if not round_sf else 2.0 ** torch.ceil(torch.log2(amax.double() / 448)).float()
    if round_sf:
        assert torch.equal(sf_vals, expect)
    else:
        torch.testing.assert_close(sf_vals, expect, rtol=U, atol=0)


@pytest.mark.parametrize("col,packed", [(False, False), (True, False), (True, True)])
def test_cast_3d(col, packed):
    x = torch.randn(3, 6, 64)
    (d, s), _, _, _ = norm_forward_and_per_token_cast(x, None, 1e-6, "e4m3", 32, use_tma_aligned_col_major_sf=col,
                                                      round_sf=True, use_packed_ue8m0=packed)
    nbk = 1 if packed else 2
    assert s.shape == (3, 6, nbk)
    if col:
        assert s.stride() == (nbk * 8, 1, 8)  # leading dimension align(6, 4) = 8, batches consecutive
    for b in range(3):
        (db, sb), _, _, _ = norm_forward_and_per_token_cast(x[b], None, 1e-6, "e4m3", 32, round_sf=True,
                                                            use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)
        assert torch.equal(d[b].view(torch.uint8), db.view(torch.uint8)) and torch.equal(s[b], sb)


def test_cast_out_buffers_and_unquantized_mode():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    ox = torch.empty(4, 64, dtype=torch.float8_e4m3fn)
    osf = torch.empty(4, 2)
    obf = torch.empty(4, 64, dtype=torch.bfloat16)
    (d, s), ob, rstd, ni = norm_forward_and_per_token_cast(x, None, 1e-6, "e4m3", 32, with_out_bf16=True,
                                                           out=(ox, osf), out_bf16=obf)
    assert d is ox and s is osf and ob is obf and rstd is None and ni is x
    ed, es = cast(norm_forward(x, None, 1e-6)[0], "e4m3", (1, 32))
    assert torch.equal(d.view(torch.uint8), ed.view(torch.uint8)) and torch.equal(s, es)
    buf = torch.empty_like(x)
    res = norm_forward_and_per_token_cast(x, None, 1e-6, "bf16", None, out=(buf, None), with_rstd=True)
    assert res[0] is buf and res[1] is None and torch.equal(buf, norm_forward(x, None, 1e-6)[0])
    assert torch.equal(res[2], norm_forward(x, None, 1e-6, with_rstd=True)[1])


def test_mega_moe_sf():
    t, h, bm = 5, 256, 2
    x = torch.randn(t, h) * torch.logspace(-3, 3, t)[:, None]
    rows_total = 3 * 128  # cdiv(5, 2) * align(2, 128)
    ld = rows_total + 4
    storage = torch.full((2 * ld,), -1, dtype=torch.int32)  # 0xFF bytes mark "untouched"
    mega = storage.as_strided((t, h // 128), (1, ld))
    (d, s), _, _, _ = norm_forward_and_per_token_cast(x, None, 1e-6, "e4m3", 32, round_sf=True,
                                                      mega_moe_sf=mega, mega_moe_block_m=bm)
    exps = F.ue8m0_encode(s)  # (T, 8) exponent bytes of the 32-groups
    expect = torch.full((2 * ld * 4,), 0xFF, dtype=torch.uint8)
    for tok in range(t):
        i = tok % bm
        row = (tok // bm) * 128 + (i // 128) * 128 + (i % 32) * 4 + (i % 128) // 32  # = (tok//2)*128 + 4*i
        assert row == (tok // 2) * 128 + 4 * i
        for g in range(h // 32):
            expect[((g // 4) * ld + row) * 4 + g % 4] = exps[tok, g]
    assert torch.equal(storage.view(torch.uint8), expect)


@pytest.mark.parametrize("with_weight,with_residual", [(True, False), (False, True), (True, True)])
def test_backward_ref_matches_autograd_float64(with_weight, with_residual):
    x = torch.randn(6, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(32, dtype=torch.float64, requires_grad=True) if with_weight else None
    scale = 0.75
    out, rstd, _ = norm_forward_ref(x, w, 1e-5, None, scale)
    dy = torch.randn_like(out)
    rog = torch.randn_like(out) if with_residual else None
    out.backward(dy)
    dx, dw = norm_backward_ref(dy, x.detach(), None if w is None else w.detach(), rstd.detach(), rog, scale)
    expect_dx = x.grad + (0 if rog is None else rog)
    torch.testing.assert_close(dx, expect_dx, rtol=1e-12, atol=1e-12)
    if with_weight:
        torch.testing.assert_close(dw, w.grad, rtol=1e-12, atol=1e-12)
    else:
        assert dw is None


def test_forward_ref_gradcheck_float64():
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: norm_forward_ref(a, b, 1e-5, None, 1.5)[0], (x, w))


@pytest.mark.parametrize("wg_dtype", [None, torch.float32, torch.bfloat16])
def test_backward_public_vs_float64_autograd(wg_dtype):
    t, h = 17, 128
    x = torch.randn(t, h)
    w = torch.randn(h)
    dy = torch.randn(t, h)
    rog = torch.randn(t, h)
    _, rstd, _ = norm_forward(x, w, 1e-6, out_scale=2.0, with_rstd=True)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    norm_forward_ref(x64, w64, 1e-6, None, 2.0)[0].backward(dy.double())
    buf = None if wg_dtype is None else torch.randn(h).to(wg_dtype)
    before = None if buf is None else buf.clone()
    dx, dw = norm_backward(dy, x, w, rstd, rog, 2.0, weight_grad=buf)
    # dx sums H products (relative error <= (H + 8) u of the largest terms); compare to the term scale.
    term = (x64.grad.abs() + rog.double().abs()).max().item()
    torch.testing.assert_close(dx.double(), x64.grad + rog.double(), rtol=0, atol=fp32_rtol(h) * 8 * term)
    total = w64.grad if before is None else before.double() + w64.grad
    atol = fp32_rtol(t) * (x64 * dy.double()).abs().sum(0).max().item() * 4
    if wg_dtype == torch.bfloat16:
        atol += BF16_RTOL * total.abs().max().item()
    assert dw.dtype == (wg_dtype or torch.float32)
    if buf is not None:
        assert dw is buf
    torch.testing.assert_close(dw.double(), total, rtol=0, atol=atol)
    ref = norm_backward_ref(dy, x, w, rstd, rog, 2.0)
    assert torch.equal(dx, ref[0])


def test_backward_deterministic_and_zero_tokens():
    x, dy = torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(64, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    rstd = norm_forward(x, w, 1e-6, with_rstd=True)[1]
    a, b = norm_backward(dy, x, w, rstd), norm_backward(dy, x, w, rstd)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[1].dtype == torch.bfloat16
    dx, dw = norm_backward(torch.empty(0, 64), torch.empty(0, 64), torch.ones(64), torch.empty(0))
    assert dx.shape == (0, 64) and torch.equal(dw, torch.zeros(64))
    assert norm_backward(dy, x, None, rstd)[1] is None


def test_errors():
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match="x must have dtype"):
        norm_forward(x.double(), None, 1e-6)
    with pytest.raises(ValueError, match="x must have 0 < hidden <= 8192"):
        norm_forward(torch.randn(4, 40), None, 1e-6)
    with pytest.raises(ValueError, match="x must have strides that are multiples of 16"):
        norm_forward(torch.randn(4, 72)[:, :64], None, 1e-6)
    with pytest.raises(ValueError, match="weight must have shape"):
        norm_forward(x, torch.ones(32), 1e-6)
    with pytest.raises(TypeError, match="eps must be a float, got bool"):
        norm_forward(x, None, True)
    for eps in (-1e-6, float("nan"), float("inf")):  # a negative eps gives NaN rows where mean(h^2) < -eps
        with pytest.raises(ValueError, match=f"norm_forward: eps must be finite and >= 0, got {eps}"):
            norm_forward(x, None, eps)
        with pytest.raises(ValueError, match="norm_forward_and_per_token_cast: eps must be finite and >= 0"):
            norm_forward_and_per_token_cast(x, None, eps, "e4m3", 32)
    assert norm_forward(x, None, 0)[0].isfinite().all()  # eps 0 is allowed: x has no all-zero row
    with pytest.raises(TypeError, match="out_scale must be a float, got str"):
        norm_forward(x, None, 1e-6, out_scale="1")
    with pytest.raises(ValueError, match=r"x must have strides that are multiples of 16 elements except the last, "
                                         r"got \(2304, 72, 1\)"):
        norm_forward(torch.randn(2, 32, 72)[:, :, :64], None, 1e-6)
    with pytest.raises(TypeError, match="weight must have dtype"):
        norm_forward(x, torch.ones(64, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="residual must have shape"):
        norm_forward(x, None, 1e-6, residual=torch.randn(4, 128))
    with pytest.raises(ValueError, match="residual_out requires residual"):
        norm_forward(x, None, 1e-6, residual_out=torch.empty_like(x))
    with pytest.raises(ValueError, match="num_per_channels must be 32"):
        norm_forward_and_per_token_cast(x, None, 1e-6, "e4m3", 128)
    with pytest.raises(ValueError, match="fmt must be 'e4m3' or the name of x's dtype"):
        norm_forward_and_per_token_cast(x, None, 1e-6, "bf16", None)
    with pytest.raises(ValueError, match="use_packed_ue8m0 requires round_sf"):
        norm_forward_and_per_token_cast(x, None, 1e-6, "e4m3", 32, use_packed_ue8m0=True)
    with pytest.raises(ValueError, match="mega_moe_sf requires"):
        norm_forward_and_per_token_cast(x, None, 1e-6, "e4m3", 32, mega_moe_sf=torch.zeros(4, 0, dtype=torch.int32),
                                        mega_moe_block_m=4)
    with pytest.raises(TypeError, match=r"out\[1\] must have dtype float32"):
        norm_forward_and_per_token_cast(x, None, 1e-6, "e4m3", 32,
                                        out=(torch.empty(4, 64, dtype=torch.float8_e4m3fn),
                                             torch.empty(4, 2, dtype=torch.int32)))
    rstd = torch.ones(4)
    with pytest.raises(ValueError, match="rstd must have shape"):
        norm_backward(x, x, None, torch.ones(5))
    with pytest.raises(ValueError, match="weight_grad requires weight"):
        norm_backward(x, x, None, rstd, weight_grad=torch.zeros(64))
    with pytest.raises(TypeError, match="out_grad must have dtype"):
        norm_backward(x.bfloat16(), x, None, rstd)
