"""fused_weight, engram_gate_fwd, engram_gate_bwd, grad_w_reduce and engram_gate_ref (engram.md §2.3-§2.6, §2.8)."""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from tilefuse.engram import engram_gate_bwd, engram_gate_fwd, fused_weight, grad_w_reduce
from tilefuse.engram.ops import DEFAULT_NUM_SMS
from tilefuse.reference import engram as ref_engram
from tilefuse.reference import engram_gate_ref
from tilefuse.testing import assert_equal, calc_diff

EPS, CLAMP = 1e-20, 1e-6  # upstream values (§2.4.1)
U = 2.0 ** -24  # fp32 unit roundoff
# Accuracy contract of engram.md §3.2 (calc_diff bounds of the upstream tests).
FWD_STAT_DIFF = 2e-10
BWD_DIFF = 1e-8
REDUCE_DIFF = 1e-10


def bf16(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).bfloat16()


def gate_inputs(t, m, h):
    return bf16(t, m, h), bf16(t, m, h), bf16(t, h), bf16(m, h), bf16(m, h)


def bf16_ulp(a: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers (8 significant bits) at ``|a|``."""
    return torch.ldexp(torch.ones_like(a), torch.frexp(a).exponent - 8)


def assert_bf16_rounding(out: torch.Tensor, exact: torch.Tensor, slack) -> None:
    """``out`` (bf16) is within half an ulp of ``exact`` (float64) plus ``slack`` (the error of the value
    before its bf16 rounding)."""
    out = out.double()
    bound = 0.5 * bf16_ulp(torch.maximum(out.abs(), exact.abs())) + slack
    assert bool(((out - exact).abs() <= bound).all())


def gate64(x, k, v, w_h, w_e, eps, clamp):
    """Independent float64 formulation: inner product of the two weighted RMS-normed vectors over √H."""
    x, k, v = x.double(), k.double(), v.double()
    h = x.shape[-1]
    xn = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w_h.double()
    kn = k / torch.sqrt((k * k).mean(-1, keepdim=True) + eps) * w_e.double()
    s = (xn * kn).sum(-1) / math.sqrt(h)
    u = torch.sign(s) * torch.sqrt(torch.clamp_min(s.abs(), clamp))
    g = 1 / (1 + torch.exp(-u))
    return x + g.unsqueeze(-1) * v.unsqueeze(-2), s, g


def gate_g_tolerance(x, k, w, s64, clamp):
    """Derived bound on |g_fp32 - g_exact| per (token, branch).

    |ΔD| <= (H+1)·u·Σ|x·w·k| (recursive-summation bound); rx, rk: sums of positive terms, rel. error
    <= ((H+1)/2 + 4)·u after rsqrt; s = D·rx·rk·c_H adds 4u; u = √|s| gives Δu <= Δs / (2√|s|); σ' <= 1/4.
    """
    x, k, w = x.double(), k.double(), w.double()
    h = x.shape[-1]
    rx = 1 / torch.sqrt((x * x).mean(-1))
    rk = 1 / torch.sqrt((k * k).mean(-1))
    d_abs = (x * w * k).abs().sum(-1)
    rel_r = ((h + 1) / 2 + 4) * U
    ds = (h + 1) * U * d_abs * rx * rk / math.sqrt(h) + s64.abs() * (2 * rel_r + 4 * U)
    du = ds / (2 * torch.sqrt(torch.clamp_min(s64.abs() - ds, clamp)))
    return du / 4 + 4 * U


# ----------------------------------------------------------------------------------------------------
# fused_weight (§2.3)
# ----------------------------------------------------------------------------------------------------

def test_fused_weight_exact():
    w_h, w_e = bf16(3, 256), bf16(3, 256)
    expected = torch.tensor([[a * b for a, b in zip(ra, rb)] for ra, rb in zip(w_h.tolist(), w_e.tolist())],
                            dtype=torch.float32)  # bf16·bf16 is exact in double and in fp32
    assert_equal(fused_weight(w_h, w_e), expected)


def test_fused_weight_errors():
    with pytest.raises(ValueError, match="weight_hidden"):
        fused_weight(bf16(4, 128), bf16(4, 128))
    with pytest.raises(ValueError, match="weight_embed"):
        fused_weight(bf16(4, 256), bf16(2, 256))
    with pytest.raises(TypeError, match="weight_embed"):
        fused_weight(bf16(4, 256), bf16(4, 256).float())


# ----------------------------------------------------------------------------------------------------
# engram_gate_fwd (§2.4)
# ----------------------------------------------------------------------------------------------------

def test_gate_fwd_hand_computed():
    # Constant rows x = a, k = b, w = c give rx = 1/|a|, rk = 1/|b|, D = H·a·b·c, s = sign(ab)·c·√H.
    # Branch 0: a = 2, b = -0.5, c = 0.5·0.5 -> D = -256, rx = 0.5, rk = 2, s = -8, g = σ(-√8).
    # Branch 1: c = 2^-10·2^-10 -> s = -2^-20·32 = -2^-15, below clamp 1e-4 -> u = -0.01.
    h, clamp = 1024, 1e-4
    x = torch.full((1, 2, h), 2.0).bfloat16()
    k = torch.full((1, 2, h), -0.5).bfloat16()
    v = torch.linspace(-3, 3, h).bfloat16()[None]
    w_h = torch.tensor([[0.5], [2.0**-10]]).expand(2, h).bfloat16().contiguous()
    out, dot, g, rx, rk = engram_gate_fwd(x, k, v, fused_weight(w_h, w_h), EPS, clamp)
    assert dot.tolist() == [[-256.0, -256.0 * 2.0**-20 / 0.25]]
    assert rx.tolist() == [[0.5, 0.5]] and rk.tolist() == [[2.0, 2.0]]
    g_exact = [1 / (1 + math.exp(math.sqrt(8))), 1 / (1 + math.exp(0.01))]
    assert g[0].tolist() == pytest.approx(g_exact, rel=8 * U)
    exact = 2.0 + torch.tensor(g_exact, dtype=torch.float64)[:, None] * v.double()
    assert_bf16_rounding(out[0], exact, 8 * U * v.double().abs() + 2 * U * exact.abs())


@pytest.mark.parametrize("t,m,h", [(5, 3, 512), (3, 4, 768)])
def test_gate_fwd_matches_float64(t, m, h):
    x, k, v, w_h, w_e = gate_inputs(t, m, h)
    w = fused_weight(w_h, w_e)
    out, dot, g, rx, rk = engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    exact, s64, g64 = gate64(x, k, v, w_h, w_e, EPS, CLAMP)
    xd, kd = x.double(), k.double()
    d64 = (xd * w.double() * kd).sum(-1)
    assert bool(((dot.double() - d64).abs() <= (h + 1) * U * (xd * w.double() * kd).abs().sum(-1)).all())
    rel_r = ((h + 1) / 2 + 4) * U
    assert bool(((rx.double() * torch.sqrt((xd * xd).mean(-1)) - 1).abs() <= rel_r).all())
    assert bool(((rk.double() * torch.sqrt((kd * kd).mean(-1)) - 1).abs() <= rel_r).all())
    tol_g = gate_g_tolerance(x, k, w, s64, CLAMP)
    assert bool(((g.double() - g64).abs() <= tol_g).all())
    # out is the bf16 rounding of x + g·v: within half an ulp of the exact value, plus the gate error
    # and two fp32 roundings (the product and the sum) before the bf16 rounding.
    vd = v.double().abs().unsqueeze(1)
    assert_bf16_rounding(out, exact, vd * tol_g.unsqueeze(-1) + 2 * U * (exact.abs() + vd))


def test_gate_fwd_vs_reference():
    """The upstream test (§3.2): statistics within calc_diff 2e-10 of engram_gate_ref; the output may only
    differ by single bf16 rounding flips."""
    x, k, v, w_h, w_e = gate_inputs(16, 4, 1024)
    got = engram_gate_fwd(x, k, v, fused_weight(w_h, w_e), EPS, CLAMP)
    ref = engram_gate_ref(x, k, v, w_h, w_e, CLAMP, EPS, save_for_backward=True)
    for a, b in zip(got[1:], ref[1:]):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
        assert calc_diff(a, b) < FWD_STAT_DIFF
    diff = (got[0].double() - ref[0].double()).abs()
    assert bool((diff <= bf16_ulp(torch.maximum(got[0].double().abs(), ref[0].double().abs()))).all())
    assert int((diff > 0).sum()) <= got[0].numel() // 1000


def test_gate_fwd_save_flag_and_layout():
    x, k, v, w_h, w_e = gate_inputs(7, 4, 512)
    w = fused_weight(w_h, w_e)
    saved = engram_gate_fwd(x, k, v, w, EPS, CLAMP, save_for_backward=True)
    plain = engram_gate_fwd(x, k, v, w, EPS, CLAMP, save_for_backward=False)
    assert plain[1:] == (None, None, None, None)
    assert_equal(plain[0], saved[0])
    assert saved[0].shape == x.shape and saved[0].dtype == torch.bfloat16 and saved[0].is_contiguous()
    for stat in saved[1:]:
        assert stat.shape == (7, 4) and stat.dtype == torch.float32


def test_gate_fwd_strided_k_v_bit_identical():
    t, m, h = 6, 4, 512
    x, _, _, w_h, w_e = gate_inputs(t, m, h)
    proj = bf16(t, (m + 1) * h)  # k and v as views into one projection output
    k, v = proj[:, : m * h].view(t, m, h), proj[:, m * h:]
    assert not k.is_contiguous() and not v.is_contiguous()
    w = fused_weight(w_h, w_e)
    for a, b in zip(engram_gate_fwd(x, k, v, w, EPS, CLAMP), engram_gate_fwd(x, k.contiguous(), v.contiguous(), w, EPS, CLAMP)):
        assert_equal(a, b)


def test_gate_fwd_zero_row_sign_convention():
    """§2.4.2: s = +0 gives u = +√clamp (kernel), while the reference multiplies by sign(0) = 0 -> g = 0.5."""
    x, k, v, w_h, w_e = gate_inputs(2, 4, 512)
    x[0, 1] = 0
    k, w_h, w_e = k.abs(), w_h.abs(), w_e.abs()  # every product x·w·k of the zero row is +0, so D = +0
    _, dot, g, rx, _ = engram_gate_fwd(x, k, v, fused_weight(w_h, w_e), EPS, CLAMP)
    assert dot[0, 1].item() == 0.0 and math.copysign(1.0, dot[0, 1].item()) == 1.0
    assert g[0, 1].item() == torch.sigmoid(torch.tensor(math.sqrt(CLAMP), dtype=torch.float32)).item()
    assert rx[0, 1].item() == pytest.approx(1e10, rel=1e-6)
    ref_g = engram_gate_ref(x, k, v, w_h, w_e, CLAMP, EPS, save_for_backward=True)[2]
    assert ref_g[0, 1].item() == 0.5


def test_gate_fwd_zero_tokens():
    x, k, v, w_h, w_e = gate_inputs(0, 4, 512)
    out, dot, g, rx, rk = engram_gate_fwd(x, k, v, fused_weight(w_h, w_e), EPS, CLAMP)
    assert out.shape == (0, 4, 512) and out.dtype == torch.bfloat16
    assert dot.shape == g.shape == rx.shape == rk.shape == (0, 4)


def _fwd_args(t=2, m=4, h=512):
    x, k, v, w_h, w_e = gate_inputs(t, m, h)
    return dict(hidden_states=x, k=k, v=v, weight_fused=w_h.float() * w_e.float(), eps=EPS, clamp_value=CLAMP)


@pytest.mark.parametrize("name,bad,exc", [
    ("hidden_states", lambda a: a["hidden_states"].float(), TypeError),
    ("hidden_states", lambda a: bf16(4, 2, 512).transpose(0, 1), ValueError),
    ("k", lambda a: a["k"].float(), TypeError),
    ("k", lambda a: bf16(2, 4, 1024)[..., ::2], ValueError),
    ("v", lambda a: bf16(2, 1024)[:, ::2], ValueError),
    ("v", lambda a: bf16(3, 512), ValueError),
    ("weight_fused", lambda a: a["weight_fused"].bfloat16(), TypeError),
    ("weight_fused", lambda a: a["weight_fused"][:3], ValueError),
    ("clamp_value", lambda a: 0.0, ValueError),
    ("eps", lambda a: "1e-20", TypeError),
])
def test_gate_fwd_errors(name, bad, exc):
    args = _fwd_args()
    args[name] = bad(args)
    with pytest.raises(exc, match=name):
        engram_gate_fwd(**args)


# ----------------------------------------------------------------------------------------------------
# engram_gate_bwd (§2.5)
# ----------------------------------------------------------------------------------------------------

def test_gate_bwd_matches_autograd_of_reference():
    """The upstream test (§3.2): the op fed the reference's statistics vs autograd through engram_gate_ref
    with fp32 weight leaves."""
    t, m, h = 12, 4, 1024
    x, k, v, w_h, w_e = gate_inputs(t, m, h)
    grad_out = bf16(t, m, h)
    leaves = [a.clone().requires_grad_() for a in (x, k, v, w_h.float(), w_e.float())]
    out, dot, g, rx, rk = engram_gate_ref(*leaves, CLAMP, EPS, save_for_backward=True)
    out.backward(grad_out)
    grad_x, grad_k, grad_v, partial = engram_gate_bwd(grad_out, x, k, v, fused_weight(w_h, w_e), dot.detach(),
                                                      g.detach(), rx.detach(), rk.detach(), CLAMP)
    for got, leaf in zip((grad_x, grad_k, grad_v), leaves):
        assert got.dtype == torch.bfloat16 and got.shape == leaf.shape and got.is_contiguous()
        assert calc_diff(got, leaf.grad) < BWD_DIFF
    gw = partial.sum(0)
    assert calc_diff(gw * w_e.float(), leaves[3].grad) < BWD_DIFF
    assert calc_diff(gw * w_h.float(), leaves[4].grad) < BWD_DIFF


class _FormulaGate(torch.autograd.Function):
    """The forward (§2.4.2) with the backward formulas of §2.5.2 as its gradient, dtype-generic."""

    @staticmethod
    def forward(ctx, x, k, v, w_h, w_e, clamp):
        w = w_h * w_e
        out, dot, g, rx, rk = ref_engram._gate_fwd(x, k, v, w, 1e-6, clamp)
        ctx.save_for_backward(x, k, v, w_h, w_e, w, dot, g, rx, rk)
        ctx.clamp = clamp
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, k, v, w_h, w_e, w, dot, g, rx, rk = ctx.saved_tensors
        gx, gk, gv, partial = ref_engram._gate_bwd(grad_out, x, k, v, w, dot, g, rx, rk, ctx.clamp, 2)
        gw = partial.sum(0)
        return gx, gk, gv, gw * w_e, gw * w_h, None


@pytest.mark.parametrize("clamp", [1e-6, 1e3])  # 1e3 clamps every |s|: u is constant and β = 0
def test_gate_bwd_formulas_gradcheck_float64(clamp):
    """The §2.5.2 formulas are the derivative of the §2.4.2 forward (numerical gradcheck in float64).

    The public ops only accept bf16/fp32 (the spec's dtypes), so gradcheck runs on the same formulas
    through the dtype-generic reference helpers, at a small shape the public ops would reject.
    """
    t, m, h = 3, 2, 8
    args = [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((t, m, h), (t, m, h), (t, h), (m, h), (m, h))]
    assert torch.autograd.gradcheck(lambda *a: _FormulaGate.apply(*a, clamp), args)


def test_gate_ref_gradcheck_float64():
    t, m, h = 3, 2, 8
    args = [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((t, m, h), (t, m, h), (t, h), (m, h), (m, h))]
    assert torch.autograd.gradcheck(lambda *a: engram_gate_ref(*a, CLAMP, 1e-6), args)


def _bwd_inputs(t, h=1024, clamp=CLAMP):
    x, k, v, w_h, w_e = gate_inputs(t, 4, h)
    w = fused_weight(w_h, w_e)
    _, dot, g, rx, rk = engram_gate_fwd(x, k, v, w, EPS, clamp)
    return [bf16(t, 4, h), x, k, v, w, dot, g, rx, rk, clamp]


@pytest.mark.parametrize("num_sms", [4, 8])
def test_gate_bwd_partial_layout(num_sms):
    """§2.5.4: chunk p of ceil(T/P) tokens, accumulated from 0 in token order; empty chunks are zero.
    Each chunk equals the whole-sum buffer of its own tokens (bitwise); grad_x/k/v do not depend on P."""
    t = 10
    args = _bwd_inputs(t)
    grad_x, grad_k, grad_v, partial = engram_gate_bwd(*args, num_sms=num_sms)
    assert partial.shape == (num_sms, 4, 1024) and partial.dtype == torch.float32
    q = math.ceil(t / num_sms)
    for p in range(num_sms):
        lo, hi = p * q, min((p + 1) * q, t)
        if lo >= hi:
            assert bool((partial[p] == 0).all())
            continue
        sub = [a[lo:hi] if isinstance(a, torch.Tensor) and a.shape[0] == t else a for a in args]
        sub_x, sub_k, sub_v, sub_partial = engram_gate_bwd(*sub, num_sms=1)
        assert_equal(partial[p], sub_partial[0])
        assert_equal(grad_x[lo:hi], sub_x)  # per-token results are batch invariant
        assert_equal(grad_k[lo:hi], sub_k)
        assert_equal(grad_v[lo:hi], sub_v)
    ref = engram_gate_bwd(*args, num_sms=1)
    for a, b in zip((grad_x, grad_k, grad_v), ref[:3]):
        assert_equal(a, b)
    assert calc_diff(partial.sum(0), ref[3][0]) < REDUCE_DIFF


def test_gate_bwd_below_clamp_is_identity():
    """β = 0 when |s| < clamp: grad_x = grad_out exactly, grad_k = 0, no weight gradient; grad_v = Σ_h G·g."""
    args = _bwd_inputs(5, clamp=1e3)
    grad_x, grad_k, grad_v, partial = engram_gate_bwd(*args, num_sms=4)
    grad_out, g = args[0], args[6]
    assert_equal(grad_x, grad_out)
    assert bool((grad_k == 0).all()) and bool((partial == 0).all())
    expected = (grad_out.double() * g.double().unsqueeze(-1)).sum(1)
    torch.testing.assert_close(grad_v.double(), expected, rtol=2.0**-8, atol=1e-6)


def test_gate_bwd_default_partials_and_zero_tokens():
    grad_x, grad_k, grad_v, partial = engram_gate_bwd(*_bwd_inputs(0))
    assert grad_x.shape == grad_k.shape == (0, 4, 1024) and grad_v.shape == (0, 1024)
    assert partial.shape == (DEFAULT_NUM_SMS, 4, 1024) and bool((partial == 0).all())


@pytest.mark.parametrize("h", [256, 640])  # H < 512, H % 256 != 0
def test_gate_fwd_rejects_hidden(h):
    with pytest.raises(ValueError, match="hidden_states"):
        engram_gate_fwd(**_fwd_args(h=h))


_BWD_NAMES = ["grad_out", "hidden_states", "k", "v", "weight_fused", "dot", "gate_score", "rstd_x", "rstd_k",
              "clamp_value"]


@pytest.mark.parametrize("name,bad,exc", [
    ("grad_out", lambda a: a["grad_out"].float(), TypeError),
    ("grad_out", lambda a: bf16(4, 2, 1024).transpose(0, 1), ValueError),
    ("dot", lambda a: a["dot"][:1].contiguous(), ValueError),
    ("gate_score", lambda a: a["gate_score"].bfloat16(), TypeError),
    ("rstd_x", lambda a: a["rstd_x"].t(), ValueError),
    ("rstd_k", lambda a: a["rstd_k"].double(), TypeError),
    ("clamp_value", lambda a: -1.0, ValueError),
])
def test_gate_bwd_errors(name, bad, exc):
    args = dict(zip(_BWD_NAMES, _bwd_inputs(2)))
    args[name] = bad(args)
    with pytest.raises(exc, match=name):
        engram_gate_bwd(**args)


@pytest.mark.parametrize("m,h", [(4, 512), (4, 768), (3, 1024)])  # v1 backward: M == 4, H % 512 == 0, H >= 1024
def test_gate_bwd_rejects_shape(m, h):
    x, k, v, w_h, w_e = gate_inputs(2, m, h)
    stats = [torch.rand(2, m) for _ in range(4)]
    with pytest.raises(ValueError, match="hidden_states"):
        engram_gate_bwd(bf16(2, m, h), x, k, v, w_h.float() * w_e.float(), *stats, CLAMP)


def test_gate_bwd_num_sms_error():
    with pytest.raises(ValueError, match="num_sms"):
        engram_gate_bwd(*_bwd_inputs(2), num_sms=0)


# ----------------------------------------------------------------------------------------------------
# grad_w_reduce (§2.6) and the fp32 fma it relies on
# ----------------------------------------------------------------------------------------------------

def test_fma_f32_correctly_rounded(round_f32):
    a = torch.randn(400) * torch.exp2(torch.randint(-20, 20, (400,)).float())
    b = torch.randn(400)
    c = torch.randn(400) * torch.exp2(torch.randint(-20, 20, (400,)).float())
    c[:100] = -(a[:100] * b[:100])  # heavy cancellation: the result is the product's rounding error
    # a·b = 1 + 2^-11 + 2^-24 is a tie between two fp32 numbers; a tiny c decides the direction, which a
    # double sum followed by a float rounding gets wrong (double rounding)
    tie = 1 + 2.0**-12
    a[100:104], b[100:104] = tie, tie
    c[100:104] = torch.tensor([0.0, 2.0**-60, -(2.0**-60), 2.0**-30])
    got = ref_engram._fma_f32(a, b, c).tolist()
    expected = [round_f32(Fraction(x) * Fraction(y) + Fraction(z)) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())]
    assert got == expected
    assert got[100] == 1 + 2.0**-11 and got[101] == 1 + 2.0**-11 + 2.0**-23


def test_grad_w_reduce_exact_definition(round_f32):
    """Every element equals fma(S, w_other, acc) with S the ascending fp32 sum over p (§2.6), computed
    with numpy float32 scalars and exact rationals."""
    p, m, h = 8, 1, 512
    partial = torch.randn(p, m, h)
    w_h, w_e = bf16(m, h), bf16(m, h)
    acc_h, acc_e = torch.randn(m, h), torch.randn(m, h)
    new_h, new_e = acc_h.clone(), acc_e.clone()
    grad_w_reduce(partial, w_h, w_e, new_h, new_e)
    parts = partial.numpy()
    for d in range(h):
        s = np.float32(0)
        for i in range(p):
            s = np.float32(s + parts[i, 0, d])
        for new, acc, w_other in ((new_h, acc_h, w_e), (new_e, acc_e, w_h)):
            exact = Fraction(float(s)) * Fraction(w_other[0, d].item()) + Fraction(acc[0, d].item())
            assert new[0, d].item() == round_f32(exact)


def test_grad_w_reduce_vs_upstream_check():
    partial = torch.randn(DEFAULT_NUM_SMS, 4, 1024)
    w_h, w_e = bf16(4, 1024), bf16(4, 1024)
    acc_h, acc_e = torch.randn(4, 1024), torch.randn(4, 1024)
    new_h, new_e = acc_h.clone(), acc_e.clone()
    assert grad_w_reduce(partial, w_h, w_e, new_h, new_e) is None
    assert calc_diff(new_h, acc_h + partial.sum(0) * w_e.float()) < REDUCE_DIFF
    assert calc_diff(new_e, acc_e + partial.sum(0) * w_h.float()) < REDUCE_DIFF


_REDUCE_NAMES = ["grad_w_partial", "weight_hidden", "weight_embed", "grad_weight_hidden", "grad_weight_embed"]


@pytest.mark.parametrize("name,bad,exc", [
    ("grad_w_partial", lambda a: torch.randn(6, 4, 512), ValueError),  # P % 4 != 0
    ("grad_w_partial", lambda a: torch.randn(8, 4, 256), ValueError),  # H % 512 != 0
    ("grad_w_partial", lambda a: a["grad_w_partial"].double(), TypeError),
    ("weight_hidden", lambda a: a["weight_hidden"].float(), TypeError),
    ("weight_embed", lambda a: bf16(3, 512), ValueError),
    ("grad_weight_hidden", lambda a: a["grad_weight_hidden"].bfloat16(), TypeError),
    ("grad_weight_embed", lambda a: torch.randn(512, 4).t(), ValueError),
])
def test_grad_w_reduce_errors_leave_accumulators(name, bad, exc):
    args = dict(zip(_REDUCE_NAMES, [torch.randn(8, 4, 512), bf16(4, 512), bf16(4, 512), torch.randn(4, 512),
                                    torch.randn(4, 512)]))
    before = {n: args[n].clone() for n in ("grad_weight_hidden", "grad_weight_embed")}
    args[name] = bad(args)
    with pytest.raises(exc, match=name):
        grad_w_reduce(**args)
    for n, t in before.items():
        if n != name:
            assert_equal(args[n], t)
