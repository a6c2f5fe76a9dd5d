"""SwiGLU references and fused casts (quant.md 3.11-3.14)."""
from fractions import Fraction

import pytest
import torch

from tilefuse import formats as F
from tilefuse.quant import (swiglu_backward_and_per_token_cast, swiglu_forward_and_per_channel_cast_and_transpose,
                            swiglu_forward_and_per_token_cast)
from tilefuse.reference import cast, cast_back, swiglu_backward, swiglu_forward
from tilefuse.reference.swiglu import fma_f32

# Unit roundoff of binary32. The forward is exp (<= 2 ulp on CPU and CUDA), 1 + e, one division and up to
# two products, all of positive-factor form (no cancellation): relative error <= 8u against float64.
U = 2.0 ** -24
FWD_RTOL = 8 * U


def _f64_swiglu(x, c=None):
    """Independent float64 SwiGLU: silu(l) * r with the 3.11 clamps."""
    h = x.size(1) // 2
    left, right = x[:, :h].double(), x[:, h:].double()
    if c is not None:
        left, right = left.clamp(max=c), right.clamp(-c, c)
    return left * torch.sigmoid(left) * right


def _moe_mapping(t, k, t_e):
    """token_topk_to_pos (T, K) and pos_to_token_topk (T_e,) inverse maps; some (t,k) dropped (-1), some rows
    unused (padding, -1)."""
    slots = torch.randperm(t * k)[: min(t * k - 2, t_e - 2)]
    rows = torch.randperm(t_e)[: slots.numel()]
    t2p = torch.full((t * k,), -1, dtype=torch.int32)
    p2t = torch.full((t_e,), -1, dtype=torch.int32)
    t2p[slots] = rows.int()
    p2t[rows] = slots.int()
    return t2p.view(t, k), p2t


# ---------------------------------------------------------------------------------------------------------
# Forward reference
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_against_float64(dtype):
    x = (torch.randn(16, 256) * 3).to(dtype)
    out = swiglu_forward(x)
    assert out.dtype == torch.float32 and out.shape == (16, 128)
    torch.testing.assert_close(out.double(), _f64_swiglu(x), rtol=FWD_RTOL, atol=1e-37)


def test_forward_hand_values():
    """l = 0: t = 2, act = (0 / 2) * r = +-0 with r's sign; l = -inf-ish large negative gives -0 * r."""
    x = torch.tensor([[0.0, 0.0, 3.0, -3.0]])
    out = swiglu_forward(x)
    assert out.tolist() == [[0.0, -0.0]] and not torch.signbit(out[0, 0]) and torch.signbit(out[0, 1])
    # Large l: exp(-l) underflows below 2^-24 relative, t = 1 exactly, act = l * r.
    x = torch.tensor([[40.0, 100.0, 0.5, -2.0]])
    assert swiglu_forward(x).tolist() == [[20.0, -200.0]]


def test_forward_clamp_and_counts():
    c = 0.5
    x = torch.tensor([[0.25, 0.75, 2.0, 0.5, -0.6, 0.6, 0.5, -0.5],
                      [-3.0, 0.5, 0.75, 0.4, 0.1, -0.2, -0.7, -0.9]])
    # Hand counts on pre-clamp values: l > c: 0.75, 2.0, 0.75 -> 3; r > c: 0.6 -> 1; r < -c: -0.6, -0.7, -0.9 -> 3.
    counts = torch.tensor([10, 20, 30], dtype=torch.int64)
    out = swiglu_forward(x, swiglu_clamp_value=c, clamped_count=counts)
    assert counts.tolist() == [13, 21, 33]
    clamped = x.clone()
    clamped[:, :4] = clamped[:, :4].clamp(max=c)
    clamped[:, 4:] = clamped[:, 4:].clamp(-c, c)
    assert torch.equal(out, swiglu_forward(clamped))


def test_forward_clamp_random_bitwise_equals_preclamped():
    x = (torch.randn(8, 256) * 4).bfloat16()
    c = 10.0 if torch.rand(()) < 0.5 else 0.5
    h = 128
    pre = torch.cat([x[:, :h].clamp(max=c), x[:, h:].clamp(-c, c)], 1)
    assert torch.equal(swiglu_forward(x, swiglu_clamp_value=c), swiglu_forward(pre))


def test_forward_topk_weights():
    t, k, t_e = 4, 3, 10
    t2p, p2t = _moe_mapping(t, k, t_e)
    w = torch.rand(t, k)
    x = torch.randn(t_e, 128)
    out = swiglu_forward(x, p2t, w)
    plain = swiglu_forward(x)
    for row in range(t_e):
        p = p2t[row].item()
        expect = plain[row] * w.flatten()[p] if p >= 0 else torch.zeros(64)
        assert torch.equal(out[row], expect)


# ---------------------------------------------------------------------------------------------------------
# Forward + per-token cast
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("col,round_sf,packed", [(False, False, False), (False, True, False), (True, True, True),
                                                 (True, False, False)])
def test_forward_per_token_cast_equals_reference(col, round_sf, packed):
    t, k, t_e = 5, 2, 12
    t2p, p2t = _moe_mapping(t, k, t_e)
    w = torch.randn(t, k)
    x = torch.randn(t_e, 512).bfloat16()
    out, sf = swiglu_forward_and_per_token_cast(x, "e4m3", 128, p2t, w, use_tma_aligned_col_major_sf=col,
                                                round_sf=round_sf, use_packed_ue8m0=packed)
    act = swiglu_forward(x, p2t, w)
    ed, es = cast(act, "e4m3", (1, 128), round_sf=round_sf, use_tma_aligned_col_major_sf=col,
                  use_packed_ue8m0=packed)
    assert torch.equal(out.view(torch.uint8), ed.view(torch.uint8))
    assert sf.dtype == es.dtype and sf.shape == es.shape and sf.stride() == es.stride() and torch.equal(sf, es)
    # Quantization quality against the float64 activation (spec 6.3 threshold for e4m3).
    deq = cast_back((out, sf), "fp32", (1, 128)).double()
    ref64 = _f64_swiglu(x) * torch.where(p2t >= 0, w.flatten()[p2t.long().clamp(min=0)], 0).double()[:, None]
    assert (deq - ref64).square().sum() / (deq.square() + ref64.square()).sum() < 1e-3


def test_forward_per_token_cast_npc_h_and_sf_clamp_min():
    x = torch.randn(4, 256)
    x[2] = 0.0  # all-zero row: sf = sf_clamp_min / 448
    out, sf = swiglu_forward_and_per_token_cast(x, "e4m3", 128, sf_clamp_min=0.5)
    assert sf.shape == (4, 1)
    assert sf[2, 0].item() == torch.tensor(0.5, dtype=torch.float32).div(448).item()
    assert (out[2].float() == 0).all()
    amax = swiglu_forward(x).abs().amax(1)
    assert torch.equal(sf[:, 0], amax.clamp_min(0.5) / 448)


def test_forward_pos_to_expert_masks_counts():
    c = 0.5
    x = torch.randn(6, 256) * 2
    p2e = torch.tensor([0, -1, 1, -1, 2, 0], dtype=torch.int32)
    counts = torch.zeros(3, dtype=torch.int64)
    out, sf = swiglu_forward_and_per_token_cast(x, "e4m3", 128, pos_to_expert=p2e, swiglu_clamp_value=c,
                                                clamped_count=counts)
    kept = x[p2e >= 0]
    expect = [int((kept[:, :128] > c).sum()), int((kept[:, 128:] > c).sum()), int((kept[:, 128:] < -c).sum())]
    assert counts.tolist() == expect and sum(expect) > 0
    ed, es = cast(swiglu_forward(x, swiglu_clamp_value=c), "e4m3", (1, 128))
    rows = p2e >= 0  # skipped rows are unspecified: compare only processed rows
    assert torch.equal(out[rows].view(torch.uint8), ed[rows].view(torch.uint8)) and torch.equal(sf[rows], es[rows])


def test_forward_per_token_cast_zero_tokens():
    out, sf = swiglu_forward_and_per_token_cast(torch.empty(0, 256), "e4m3", 128, use_tma_aligned_col_major_sf=True,
                                                round_sf=True, use_packed_ue8m0=True)
    assert out.shape == (0, 128) and out.dtype == torch.float8_e4m3fn and sf.shape == (0, 1)
    assert sf.dtype == torch.int32


def test_forward_per_token_cast_errors():
    x = torch.randn(4, 256)
    with pytest.raises(ValueError, match="x must have shape"):
        swiglu_forward_and_per_token_cast(torch.randn(4, 200), "e4m3", 128)
    with pytest.raises(ValueError, match="x must be contiguous"):
        swiglu_forward_and_per_token_cast(torch.randn(512, 4).T, "e4m3", 128)
    with pytest.raises(ValueError, match="fmt"):
        swiglu_forward_and_per_token_cast(x, "e2m1", 128)
    with pytest.raises(ValueError, match="num_per_channels must be 128 or H"):
        swiglu_forward_and_per_token_cast(x, "e4m3", 32)
    with pytest.raises(ValueError, match="use_packed_ue8m0 requires"):
        swiglu_forward_and_per_token_cast(x, "e4m3", 128, round_sf=True, use_packed_ue8m0=True)
    with pytest.raises(ValueError, match="clamped_count requires swiglu_clamp_value"):
        swiglu_forward_and_per_token_cast(x, "e4m3", 128, clamped_count=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="clamped_count must have dtype int64"):
        swiglu_forward_and_per_token_cast(x, "e4m3", 128, swiglu_clamp_value=1.0, clamped_count=torch.zeros(3))
    with pytest.raises(ValueError, match="topk_weights and pos_to_token_topk"):
        swiglu_forward_and_per_token_cast(x, "e4m3", 128, pos_to_token_topk=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="pos_to_expert must have shape"):
        swiglu_forward_and_per_token_cast(x, "e4m3", 128, pos_to_expert=torch.zeros(5, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------------------
# FMA and backward
# ---------------------------------------------------------------------------------------------------------

def _fma_oracle(a: float, b: float, c: float) -> float:
    """Correctly rounded binary32 a*b+c from exact rational arithmetic (ties to even)."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    guess = torch.tensor(float(exact), dtype=torch.float32)
    cands = [guess, torch.nextafter(guess, torch.tensor(float("inf"))),
             torch.nextafter(guess, torch.tensor(float("-inf")))]
    best = min(cands, key=lambda v: (abs(Fraction(v.item()) - exact), v.view(torch.int32).item() & 1))
    return best.item()


def test_fma_single_rounding():
    # 641 * 6700417 = 2^32 + 1, so a*b = 2^-24 + 2^-56: 1 + a*b lies just above the midpoint 1 + 2^-24.
    # Rounding a*b+1 in binary64 first lands on the midpoint and ties to 1.0; the FMA gives 1 + 2^-23.
    a = torch.tensor([641 * 2.0 ** -28, -641 * 2.0 ** -28])
    b = torch.tensor([6700417 * 2.0 ** -28, 6700417 * 2.0 ** -28])
    c = torch.tensor([1.0, -1.0])
    assert (a.double() * b.double() + c.double()).float().tolist() == [1.0, -1.0]
    assert fma_f32(a, b, c).tolist() == [1.0 + 2.0 ** -23, -1.0 - 2.0 ** -23]
    xs = torch.randn(200) * torch.logspace(-6, 6, 200)
    ys = torch.rand(200)
    zs = torch.where(torch.rand(200) < 0.5, torch.ones(200), torch.randn(200))
    got = fma_f32(xs, ys, zs)
    for i in range(200):
        assert got[i].item() == _fma_oracle(xs[i].item(), ys[i].item(), zs[i].item())


def _f32(v: float) -> float:
    """Round a Python float to binary32. Python float ops on binary32 operands then rounding to binary32 are
    correctly rounded binary32 ops (+, *, / at 53 >= 2*24 + 2 bits: double rounding is innocuous)."""
    return torch.tensor(v, dtype=torch.float32).item()


def test_forward_scalar_loop_bitwise():
    """The reference's operation order, (l / t) * r then * w, against a Python-scalar loop."""
    x = torch.randn(3, 64) * 3
    w = torch.rand(3, 1)
    p2t = torch.tensor([0, 2, 1], dtype=torch.int32)
    out = swiglu_forward(x, p2t, w)
    e = torch.exp(-x[:, :32])  # the exp itself is torch's (libdevice expf on CUDA)
    for i in range(3):
        wi = w.flatten()[p2t[i]].item()
        for j in range(32):
            t = _f32(1.0 + e[i, j].item())
            act = _f32(_f32(x[i, j].item() / t) * x[i, 32 + j].item())
            assert out[i, j].item() == _f32(act * wi)


def test_backward_scalar_loop_bitwise():
    """Section 3.13's exact operation order (incl. the single-rounding FMA) against a Python-scalar loop."""
    pair, g, w, p2t, t2p = _backward_inputs(t=3, k=2, t_e=4, h=64, npc=32)
    c = 0.5
    out, x_grad, _ = swiglu_backward(pair, g, w, p2t, t2p, 32, c)
    xv = cast_back(pair, "fp32", (1, 32))
    xc, yc = xv[:, :64].clamp(max=c), xv[:, 64:].clamp(-c, c)
    e = torch.exp(-xc)
    for i in range(4):
        p = p2t[i].item()
        wi = w.flatten()[p].item() if p >= 0 else 0.0
        for j in range(64):
            x0, y0, gj = xc[i, j].item(), yc[i, j].item(), g[i, j].item()
            t = _f32(1.0 + e[i, j].item())
            s = _f32(1.0 / t)
            gws = _f32(_f32(gj * wi) * s)
            dx = _f32(_f32(gws * y0) * _fma_oracle(x0, _f32(1.0 - s), 1.0))
            dy = _f32(gws * x0)
            dx = 0.0 if xv[i, j].item() > c else dx
            dy = 0.0 if abs(xv[i, 64 + j].item()) > c else dy
            assert x_grad[i, j].item() == dx and x_grad[i, 64 + j].item() == dy
            assert out[i, j].item() == _f32(_f32(_f32(x0 / t) * y0) * wi)


def _backward_inputs(t=5, k=2, t_e=12, h=128, npc=128, scale=2.0):
    t2p, p2t = _moe_mapping(t, k, t_e)
    w = torch.rand(t, k)
    x_bf16 = (torch.randn(t_e, 2 * h) * scale).bfloat16()
    pair = cast(x_bf16, "e4m3", (1, npc))
    g = torch.randn(t_e, h).bfloat16()
    return pair, g, w, p2t, t2p


@pytest.mark.parametrize("c", [None, 0.5])
def test_backward_reference_matches_autograd_float64(c):
    h, npc = 128, 32
    pair, g, w, p2t, t2p = _backward_inputs(h=h, npc=npc)
    xv = cast_back(pair, "fp32", (1, npc))  # exact dequantized binary32 values
    x64 = xv.double().requires_grad_()
    w64 = w.double().requires_grad_()
    out64 = swiglu_forward(x64, p2t, w64, c)
    out64.backward(g.double())
    out, x_grad, weight_grad = swiglu_backward(pair, g, w, p2t, t2p, npc, c)
    valid = torch.ones_like(xv, dtype=torch.bool) if c is None else (xv.abs() != c)
    # Elementwise bounds: dx has ~8 roundings and exp (2 ulp) on |g w s y| (1 + |x|) (the fma factor may cancel);
    # dy has ~5 on |g w s x|.
    xl, yr = x64[:, :h].detach(), x64[:, h:].detach()
    if c is not None:
        xl, yr = xl.clamp(max=c), yr.clamp(-c, c)
    s = torch.sigmoid(xl)
    ww = torch.where(p2t >= 0, w64.detach().flatten()[p2t.long().clamp(min=0)], 0)[:, None]
    gws = (g.double() * ww * s).abs()
    bound = torch.cat([12 * U * gws * yr.abs() * (1 + xl.abs()), 8 * U * gws * xl.abs()], 1) + 1e-40
    err = (x_grad.double() - x64.grad).abs()
    assert (err[valid] <= bound[valid]).all()
    torch.testing.assert_close(out.double(), out64.detach(), rtol=FWD_RTOL + U, atol=1e-37)
    # weight_grad: a length-H binary32 sum: |error| <= (H + 8) u sum |g act|.
    act64 = swiglu_forward(x64.detach(), swiglu_clamp_value=c)
    wg_bound = (h + 8) * U * (g.double() * act64).abs().sum(1)
    reached = t2p >= 0
    assert torch.equal(weight_grad[~reached], torch.zeros(int((~reached).sum())))
    rows = t2p[reached].long()
    assert ((weight_grad[reached].double() - w64.grad[reached]).abs() <= wg_bound[rows]).all()


def test_backward_clamp_zeroes_and_padding_rows():
    c = 0.5
    pair, g, w, p2t, t2p = _backward_inputs(npc=128)
    xv = cast_back(pair, "fp32", (1, 128))
    out, x_grad, weight_grad = swiglu_backward(pair, g, w, p2t, t2p, 128, c)
    dx, dy = x_grad[:, :128], x_grad[:, 128:]
    assert (dx[xv[:, :128] > c] == 0).all() and (dy[xv[:, 128:].abs() > c] == 0).all()
    assert (dx[xv[:, :128] < c] != 0).any()
    pad = p2t < 0
    assert pad.any() and (x_grad[pad] == 0).all() and (out[pad] == 0).all()


@pytest.mark.parametrize("round_sf,c", [(False, None), (True, 10.0), (False, 0.5)])
def test_backward_public_equals_reference(round_sf, c):
    npc = 32
    pair, g, w, p2t, t2p = _backward_inputs(t_e=16, h=256, npc=npc)
    out, (fp8, fp8_sf), x_grad, weight_grad = swiglu_backward_and_per_token_cast(pair, g, w, p2t, t2p, npc,
                                                                                 round_sf, c)
    r_out, r_xg, r_wg = swiglu_backward(pair, g, w, p2t, t2p, npc, c)
    assert out.dtype == torch.bfloat16 and torch.equal(out, r_out.bfloat16())
    assert x_grad.dtype == torch.bfloat16 and x_grad.shape == (16, 512) and torch.equal(x_grad, r_xg.bfloat16())
    ed, es = cast(r_xg, "e4m3", (1, npc), round_sf=round_sf)  # cast of the binary32 gradient, not the bf16 one
    assert torch.equal(fp8.view(torch.uint8), ed.view(torch.uint8)) and torch.equal(fp8_sf, es)
    assert fp8_sf.shape == (16, 512 // npc) and fp8_sf.dtype == torch.float32
    assert torch.equal(weight_grad, r_wg) and weight_grad.shape == w.shape


def test_backward_3d_data_and_zero_tokens():
    pair, g, w, p2t, t2p = _backward_inputs(t_e=12)
    data, sf = pair
    res = swiglu_backward_and_per_token_cast((data.view(3, 4, 256), sf), g.view(3, 4, 128), w, p2t, t2p, 128)
    ref = swiglu_backward_and_per_token_cast(pair, g, w, p2t, t2p, 128)
    assert torch.equal(res[2], ref[2]) and torch.equal(res[1][1], ref[1][1])
    empty = (torch.empty(0, 256, dtype=torch.float8_e4m3fn), torch.empty(0, 2))
    t2p0 = torch.full((3, 2), -1, dtype=torch.int32)
    out, (fp8, fsf), xg, wg = swiglu_backward_and_per_token_cast(
        empty, torch.empty(0, 128, dtype=torch.bfloat16), torch.rand(3, 2), torch.empty(0, dtype=torch.int32),
        t2p0, 128)
    assert out.shape == (0, 128) and xg.shape == (0, 256) and fp8.shape == (0, 256) and fsf.shape == (0, 2)
    assert torch.equal(wg, torch.zeros(3, 2))


def test_backward_errors():
    pair, g, w, p2t, t2p = _backward_inputs()
    with pytest.raises(TypeError, match="x must be a"):
        swiglu_backward_and_per_token_cast(pair[0], g, w, p2t, t2p, 128)
    with pytest.raises(ValueError, match="num_per_channels"):
        swiglu_backward_and_per_token_cast(pair, g, w, p2t, t2p, 64)
    with pytest.raises(ValueError, match=r"x\[1\] must have shape"):
        swiglu_backward_and_per_token_cast((pair[0], pair[1][:, :1].contiguous()), g, w, p2t, t2p, 128)
    with pytest.raises(TypeError, match="grad_out must have dtype bfloat16"):
        swiglu_backward_and_per_token_cast(pair, g.float(), w, p2t, t2p, 128)
    with pytest.raises(ValueError, match="token_topk_to_pos must have shape"):
        swiglu_backward_and_per_token_cast(pair, g, w, p2t, t2p[:1], 128)
    with pytest.raises(ValueError, match="x\\[0\\] must have a last dim 2H"):
        swiglu_backward_and_per_token_cast((pair[0][:, :192].contiguous(), pair[1]), g, w, p2t, t2p, 128)


# ---------------------------------------------------------------------------------------------------------
# Forward + per-channel cast (+ transpose)
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("npt,round_sf,without_transpose,c", [(32, False, False, None), (128, True, True, 0.5),
                                                              (32, True, False, 10.0)])
def test_per_channel_cast_and_transpose(npt, round_sf, without_transpose, c):
    x = (torch.randn(256, 256) * 3).bfloat16()
    out, sf = swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", npt, round_sf, without_transpose, c)
    act = swiglu_forward(x, swiglu_clamp_value=c).bfloat16()  # rounded to bf16 before quantization
    ed, es = cast(act, "e4m3", (npt, 1), round_sf=round_sf)
    assert sf.shape == (256 // npt, 128) and sf.stride() == (128, 1) and torch.equal(sf, es)
    if without_transpose:
        assert out.shape == (256, 128) and torch.equal(out.view(torch.uint8), ed.view(torch.uint8))
    else:
        assert out.shape == (128, 256) and out.is_contiguous()
        assert torch.equal(out.view(torch.uint8), ed.T.contiguous().view(torch.uint8))
    # Independent scale check: amax of the bf16 activation over each (npt x 1) block.
    amax = act.float().view(256 // npt, npt, 128).abs().amax(1).clamp_min(F.CLAMP_MIN["e4m3"])
    expect = F.round_sf_pow2(amax / 448) if round_sf else amax / 448
    assert torch.equal(sf, expect)


def test_per_channel_zero_tokens_and_errors():
    out, sf = swiglu_forward_and_per_channel_cast_and_transpose(torch.empty(0, 256, dtype=torch.bfloat16), "e4m3", 128)
    assert out.shape == (128, 0) and sf.shape == (0, 128)
    x = torch.randn(128, 256).bfloat16()
    with pytest.raises(ValueError, match="T % 128"):
        swiglu_forward_and_per_channel_cast_and_transpose(x[:64], "e4m3", 128)
    with pytest.raises(ValueError, match="num_per_tokens"):
        swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 64)
    with pytest.raises(TypeError, match="x must have dtype bfloat16"):
        swiglu_forward_and_per_channel_cast_and_transpose(x.float(), "e4m3", 128)
