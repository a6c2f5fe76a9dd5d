"""Kernel tiers of the prenorm projection ``mhc_pre_norm_fn`` (mhc.md §2.2): the split-K forward GEMM (bf16 MMAs on
the exact split of W~), the TF32 rounding of the backward's operands, the backward GEMMs with fixed-order
weight-gradient partials.

compile: every config the GPU tests launch (and every registered one) builds for sm_90 (async copies and bf16
``mma.m16n8k16`` in the forward, TF32 and bf16 MMAs with ``ldmatrix.trans`` in the backward, 16-byte accesses in the
rounding; no wgmma, ``setmaxnreg`` or atomics); the launchers bind their arguments to the kernels' parameters; the
TF32 rounding, the forward's split of W~ into bf16 halves (a torch model of the kernel's bit operations: exact over
the exponent range where it can be, within 2^-134 below) and the split count (CPU, no GPU).
gpu: against the reference over T in {0, 1, 7, 4001, 8192}, n in {2, 4} (n = 8: M = 80, the reference path),
C in {1280, 2560, 4096, 7168}, the spec's data (§4); launches with poisoned destinations against the float64 GEMMs
of their operands; determinism, batch invariance, CUDA-graph replay and ``torch.compile(fullgraph=True)``; the
rounding kernel's bits against ``tf32_round``.

Tolerances, derived once here from §3 (norm_fn rows):
* output: ``atol = rtol = 1e-3`` against the reference with the TF32-rounded weight (the spec compares with a
  TF32 torch reference; MMA order is not contractual);
* residual gradient: bf16 ``assert_close`` defaults (rtol 1.6e-2, atol 1e-5) against the float64 reference of
  the TF32-rounded operands; weight gradient: ``atol 3e-2, rtol 1e-3``;
* bitwise where the chain is fixed: the partial sum ``mhc_norm_fn_dw_sum`` (the partials added in increasing ``p``
  from zero, rounded adds that torch reproduces) and the rounding ``mhc_norm_fn_tf32_round``.

The GEMMs sum in the MMAs' order: their results are held to the tolerances above against the reference and their
launches against the float64 GEMMs, plus determinism, batch invariance, dW's bits independent of dx's destination
and of zero tokens appended, graph replay and compile. On the CPU the kernels' generated CUDA runs with the warp
instructions emulated (``MMA_SHIM``), the backward at its defaults and at a swept set of its tiling knobs
(``MMA_SWEPT``, also through ``knob_kernels`` on the GPU).
"""
import pytest
import torch

from tilefuse import _jit
from tilefuse.mhc import mhc_pre_norm_fn
from tilefuse.mhc import _functions as F
from tilefuse.mhc import _norm_fn_kernel as K
from tilefuse.reference import mhc as R
from tests.cuda_emulation import CP_ASYNC
from tests.mhc.configs_norm_fn import GRID_C, GRID_N, norm_fn_configs
from tests.quant.kernel_binding import fake_jit

OUT_TOL = dict(atol=1e-3, rtol=1e-3)
DX_TOL = dict(rtol=1.6e-2, atol=1e-5)
DW_TOL = dict(atol=3e-2, rtol=1e-3)
TOKENS = (0, 1, 7, 4001, 8192)
EPS = 1e-6
NAN = float("nan")
BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64


# ---- compile tier ----

@pytest.mark.compile
@pytest.mark.parametrize("name, cfg", norm_fn_configs(), ids=str)
def test_builds_for_sm90(name, cfg):
    _check_source(name, _jit.compile_kernel(name, cfg, "sm_90").get_kernel_source())


def _check_source(name, src):
    """The generated CUDA of a kernel: no atomics, no wgmma or ``setmaxnreg`` (sm_90 without the a). The forward:
    async copies, bf16 MMAs (no TF32). The backward: the first GEMM on TF32 MMAs, the second on bf16
    ``mma.m16n8k16`` from token-major shared tiles (``ldmatrix.trans``). The rounding: 16-byte loads and stores and
    the spec recipe's bit operation (4096 / 0xFFFFE000) on each of the two ranges' vector and element paths."""
    assert "__global__" in src and "atomic" not in src and "wgmma" not in src and "setmaxnreg" not in src
    if name == "mhc_norm_fn_fwd":
        assert "cp_async_gs" in src and "cp_async_wait" in src
        assert "kBFloat16" in src and "kTensorFloat32" not in src
        if K.FWD_MIN_BLOCKS:
            assert f"__launch_bounds__({K.FWD_THREADS}, {K.FWD_MIN_BLOCKS})" in src
    if name == "mhc_norm_fn_bwd":
        assert "kTensorFloat32" in src and "kBFloat16, tl::DataType::kBFloat16" in src and "__fmaf_rn(" not in src
        assert "ptx_ldmatrix_x4_trans" in src
        assert f"__launch_bounds__({K.MMA_THREADS}, {K.MMA_MIN_BLOCKS})" in src
    if name == "mhc_norm_fn_tf32_round":
        assert all(src.count(f"*(float4*)({a} + ") == 1 for a in ("DP", "DPR", "W", "WR"))
        assert src.count("(uint)4096) & (uint)4294959104") == 4


BENCH_ONLY = [("mhc_norm_fn_fwd", (8192, 24)), ("mhc_norm_fn_bwd", (8192, 24, True))]  # C = 2048: not in the grid


@pytest.mark.compile
def test_registered_configs_are_tested():
    regs = {(name, cfg) for name, cfgs in _jit.registered().items() if name.startswith("mhc_norm_fn")
            for cfg in cfgs}
    assert regs and regs <= set(norm_fn_configs()) | set(BENCH_ONLY)


@pytest.mark.compile
@pytest.mark.parametrize("name, cfg", BENCH_ONLY, ids=str)
def test_bench_only_configs_build(name, cfg):
    _check_source(name, _jit.compile_kernel(name, cfg, "sm_90").get_kernel_source())


def _build(monkeypatch, factory, cfg, knobs):
    """``factory`` (a kernel factory of the module) at ``cfg`` with ``knobs`` set, built for sm_90 outside tilefuse's
    caches (whose keys hold the module's knob values as set at import)."""
    import tilelang

    for name, value in knobs.items():
        monkeypatch.setattr(K, name, value)
    return tilelang.compile(factory(*cfg), target={"kind": "cuda", "arch": "sm_90"},
                            execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS))


@pytest.mark.compile
def test_fwd_builds_with_128_tokens(monkeypatch):
    kernel = _build(monkeypatch, K.norm_fn_fwd_kernel, (8192, 24), {"FWD_TOKENS": 128})
    _check_source("mhc_norm_fn_fwd", kernel.get_kernel_source())


@pytest.mark.compile
def test_fwd_launcher_passes_the_weight_unrounded(monkeypatch):
    calls = fake_jit(monkeypatch)  # binds the launch's arguments to the prim_func
    T, k, m = 37, 2 * 1280, 8
    s = K.splits(k)
    x = torch.randn(T, k).to(BF16)
    fn = torch.randn(m, k)
    K.norm_fn_partials_launch(x, fn, torch.empty(s, T, m), torch.empty(s, T))
    assert [(cl.name, cl.cfg, cl.env) for cl in calls] == [("mhc_norm_fn_fwd", (k, m), {"Tn": T})]
    got = []
    monkeypatch.setattr(_jit, "get", lambda name, cfg: lambda *args: got.append(args))
    K.norm_fn_partials_launch(x, fn, torch.empty(s, T, m), torch.empty(s, T))
    assert torch.equal(got[0][1], fn) and not torch.equal(got[0][1], K.tf32_round(fn))  # the kernel rounds it


def _fwd_split(w: torch.Tensor):
    """The forward's split of fp32 ``w`` (a model of the kernel's bit operations): ``W~ =
    tf32_round(w)``, ``hi`` = W~'s upper 16 bits, ``lo = bf16(W~ - hi)`` (round to nearest even). Returns ``(W~, hi,
    lo, W~ - hi)`` (``hi``, ``lo`` bf16; the difference in fp32)."""
    wt = K.tf32_round(w)
    hi = (wt.view(torch.int32) & -0x10000).view(F32)
    d = wt - hi
    return wt, hi.to(BF16), d.to(BF16), d


def test_fwd_split_is_exact():
    # random values over the whole exponent range, both signs, and the edges: zeros, fp32's and TF32's largest
    # finite values, the smallest normal, subnormals, all TF32 mantissa bits set, ties of the TF32 rounding
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (200000,), dtype=torch.int32)
    w = bits.view(F32)
    edges = [0.0, -0.0, 2.0 ** -126, 2.0 ** -123, 2.0 ** -124 * 1.5, 2.0 ** -149, 2.0 ** -140 * 1.75,
             2.0 ** -127 * (2 - 2.0 ** -10), 1.0, 1 + 2 ** -11, 1 + 2 ** -10 + 2 ** -11, 2 - 2.0 ** -10, 3e38,
             (2 - 2.0 ** -10) * 2.0 ** 127, 1e-4, 7e-5]
    edges = torch.tensor(edges, dtype=F64).to(F32)
    edges = torch.cat([edges, -edges, torch.tensor([0x7F7FEFFF, 0x007FEFFF, 0x3FFFF000], dtype=torch.int32).view(F32)])
    w = torch.cat([w[torch.isfinite(K.tf32_round(w))], edges, torch.randn(10000) * 1e-4])
    wt, hi, lo, d = _fwd_split(w)
    assert torch.isfinite(wt).all()
    # hi: W~ truncated to bf16 (its upper 16 bits), the same value in bf16, never larger than W~ in magnitude
    assert torch.equal(hi.float().view(torch.int32), wt.view(torch.int32) & -0x10000)
    assert (hi.float().abs() <= wt.abs()).all() and (hi.float() * lo.float() >= 0).all()  # lo: W~'s sign or 0
    exact = (wt.abs() >= 2.0 ** -123) | (wt == 0)
    assert exact.sum() > 0.9 * len(w) and (~exact).sum() > 100
    # lo = W~ - hi, exact in bf16 (at most 3 significant bits): hi + lo == W~, bitwise for nonzero W~ (0: +-0)
    assert torch.equal(lo.float()[exact], d[exact])
    assert torch.equal((hi.double() + lo.double())[exact], wt.double()[exact])
    s = hi.float() + lo.float()
    nz = exact & (wt != 0)
    assert torch.equal(s[nz].view(torch.int32), wt[nz].view(torch.int32))
    # lo = m ulp_tf32(W~), |m| <= 7 an integer: at most 3 significant bits
    m = lo.double()[nz] / 2.0 ** (torch.floor(torch.log2(wt.double()[nz].abs())) - 10)
    assert (m == m.round()).all() and (m.abs() <= 7).all()
    # below 2^-123, ulp_tf32(W~) is under bf16's smallest subnormal 2^-133: lo is rounded, by at most 2^-134
    err = (hi.double() + lo.double() - wt.double()).abs()
    assert (err[~exact] <= 2.0 ** -134).all()


@pytest.mark.compile
def test_bwd_builds_with_swept_knobs(monkeypatch):
    kernel = _build(monkeypatch, K.norm_fn_bwd_kernel, (8192, 24, True), MMA_SWEPT)
    _check_source("mhc_norm_fn_bwd", kernel.get_kernel_source())


@pytest.mark.compile
def test_tf32_round_is_the_spec_recipe():
    # 1 + 2^-11 is a tie at bit 13: away from zero -> 1 + 2^-10; just below rounds down; negatives mirror
    v = torch.tensor([1.0, 1 + 2 ** -11, 1 + 2 ** -11 - 2 ** -23, -(1 + 2 ** -11), 1 + 3 * 2 ** -11, 0.0, -0.0])
    want = torch.tensor([1.0, 1 + 2 ** -10, 1.0, -(1 + 2 ** -10), 1 + 2 ** -9, 0.0, -0.0])
    got = K.tf32_round(v)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    x = torch.randn(1000)
    r = K.tf32_round(x)
    assert (r.view(torch.int32) & 0x1FFF == 0).all()  # 10 explicit mantissa bits left
    assert ((r - x).abs() <= x.abs() * 2.0 ** -11).all()  # at most half an ulp of TF32


@pytest.mark.compile
def test_split_count_depends_on_k_alone():
    assert [K.splits(n * c) for n in (2, 4) for c in (1280, 2048, 2560, 4096, 7168)] == [
        2, 16, 4, 16, 8, 4, 16, 8, 16, 16]
    for k in range(256, 1 << 16, 256):
        s = K.splits(k)
        assert k % s == 0 and (k // s) % K.FWD_BK == 0 and 1 <= s <= K.MAX_SPLITS
    assert K.takes(256, 32) and not K.takes(384, 24) and not K.takes(512, 33) and not K.takes(0, 24)


@pytest.mark.compile
@pytest.mark.parametrize("n, c", [(2, 1280), (4, 4096)])
def test_launchers_bind(n, c, monkeypatch):
    calls = fake_jit(monkeypatch)
    T, k, m = 37, n * c, n * (n + 2)
    s = K.splits(k)
    x = torch.randn(T, k).to(BF16)
    fn = torch.randn(m, k)
    K.norm_fn_partials_launch(x, fn, torch.empty(s, T, m), torch.empty(s, T))
    for acc in (False, True):
        K.norm_fn_gemm_bwd_launch(torch.randn(T, m), torch.randn(T), x, fn, torch.empty(T, k, dtype=BF16),
                                  torch.empty(m, k), acc)
    rnd = ("mhc_norm_fn_tf32_round", ())
    assert [(cl.name, cl.cfg) for cl in calls] == [
        ("mhc_norm_fn_fwd", (k, m)), rnd, ("mhc_norm_fn_bwd", (k, m, False)), ("mhc_norm_fn_dw_sum", ()),
        rnd, ("mhc_norm_fn_bwd", (k, m, True)), ("mhc_norm_fn_dw_sum", ())]
    assert calls[0].env == {"Tn": T}
    # one rounding launch over dP and W; the backward's partials buffer and the partial sum's count are MMA_PARTIALS
    for i in (1, 4):
        assert calls[i].env == {"Nd": T * m, "Nw": m * k}
        assert calls[i + 1].env == {"Tn": T, "P": K.MMA_PARTIALS}
        assert calls[i + 2].env == {"P": K.MMA_PARTIALS, "N": m * k}


@pytest.mark.compile
def test_empty_launches_nothing_and_zeroes_the_weight_gradient(monkeypatch):
    calls = fake_jit(monkeypatch)
    k, m = 1024, 24
    x = torch.empty(0, k, dtype=BF16)
    K.norm_fn_partials_launch(x, torch.randn(m, k), torch.empty(4, 0, m), torch.empty(4, 0))
    d_fn = torch.full((m, k), NAN)
    K.norm_fn_gemm_bwd_launch(torch.empty(0, m), torch.empty(0), x, torch.randn(m, k), torch.empty(0, k, dtype=BF16),
                              d_fn, False)
    assert calls == [] and torch.equal(d_fn, torch.zeros(m, k))


def test_cpu_tensors_take_the_reference(monkeypatch):
    def boom(*args):
        raise AssertionError("kernel launched for CPU tensors")

    monkeypatch.setattr(K, "norm_fn_partials_cuda", boom)
    monkeypatch.setattr(K, "norm_fn_gemm_bwd_cuda", boom)
    residual = torch.randn(1, 5, 4, 64).to(BF16).requires_grad_(True)
    fn = (torch.randn(24, 256) * 1e-2).requires_grad_(True)
    out = mhc_pre_norm_fn(residual, fn, None, EPS, fuse_grad_acc=False)
    out.sum().backward()
    want = R.mhc_pre_norm_fn_ref(residual.detach(), fn.detach(), None, EPS)
    assert torch.equal(out.detach(), want)


# ---- GPU tier ----

def _inputs(T, n, c, weight=False):
    """mhc.md §4 norm_fn data: residual N (1 + 0.01 i) for stream i, fn N 1e-4 (1 + 0.01 i) built [M, n, C]."""
    m = n * (n + 2)
    scale = 1 + 0.01 * torch.arange(n, device="cuda")
    residual = (torch.randn(1, T, n, c, device="cuda") * scale.view(n, 1)).to(BF16)
    fn = (torch.randn(m, n, c, device="cuda") * 1e-4 * scale.view(n, 1)).flatten(1)
    normw = 1 + 0.1 * torch.randn(n * c, device="cuda") if weight else None
    d_out = torch.randn(1, T, m, device="cuda")
    return residual, fn, normw, d_out


def _ref_out(residual, fn, normw):
    """The forward in float64 with the TF32-rounded (merged) weight."""
    w = fn if normw is None else fn * normw
    return R.mhc_pre_norm_fn_ref(residual.to(F64), K.tf32_round(w).to(F64), None, EPS)


def _grads(residual, fn, normw, d_out):
    r, f = residual.detach().requires_grad_(True), fn.detach().clone().requires_grad_(True)  # keeps r's strides
    w = None if normw is None else normw.detach().clone().requires_grad_(True)
    out = mhc_pre_norm_fn(r, f, w, EPS, fuse_grad_acc=False)
    out.backward(d_out)
    return out.detach(), r.grad, f.grad, None if w is None else w.grad


class _TF32Grad(torch.autograd.Function):
    """Identity; its backward rounds the gradient to TF32: the backward GEMMs' input ``dP~ = tf32(dP)`` (§2.2.3),
    as the forward's weight is ``tf32(W)``."""

    @staticmethod
    def forward(ctx, p):
        return p.view_as(p)

    @staticmethod
    def backward(ctx, g):
        return K.tf32_round(g.float()).to(g.dtype)


def _ref_grads(residual, fn, normw, d_out):
    """The reference's ``(dx, d_fn, d_w)`` in float64 through autograd, with the spec's TF32 operands: the weight
    ``tf32(W)`` forward and the GEMMs' gradient ``tf32(dP)`` (without the latter, the rounding of ``dP`` alone
    moves ``d_fn`` by about ``2^-12 sqrt(T)`` at unit-size terms, 0.1 at 8192 tokens, against the spec's atol 3e-2,
    which upstream's test meets by running its reference on TF32 too)."""
    k = residual.shape[-2] * residual.shape[-1]
    r64, f64 = residual.to(F64).requires_grad_(True), fn.to(F64).requires_grad_(True)
    w64 = None if normw is None else normw.to(F64).requires_grad_(True)
    w = f64 if w64 is None else f64 * w64
    w = w + (K.tf32_round(w.detach().float()).to(F64) - w.detach())  # tf32(W) forward, identity backward
    out_mul, sqrsum = R.mhc_pre_norm_fn_partials_ref(r64, w, 1)
    _, _, out = R.mhc_reduce_partials_and_rmsnorm_ref(_TF32Grad.apply(out_mul), sqrsum, k, EPS)
    out.view(d_out.shape).backward(d_out.to(F64))
    return r64.grad, f64.grad, None if w64 is None else w64.grad


def _model_bwd64(d_mul, d_sq, x, fn, D=None):
    """``(dx, dW)`` of the backward GEMMs in float64 from the kernels' TF32 operands (dx before its bf16 rounding)."""
    dp, w, xd = K.tf32_round(d_mul).to(F64), K.tf32_round(fn).to(F64), x.to(F64)
    dx = dp @ w + 2 * xd * d_sq.to(F64).unsqueeze(1)
    return dx if D is None else dx + D.to(F64), dp.T @ xd


@pytest.mark.gpu
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("n", GRID_N)
@pytest.mark.parametrize("c", GRID_C)
def test_forward_against_reference(T, n, c):
    residual, fn, _, _ = _inputs(T, n, c)
    out = mhc_pre_norm_fn(residual, fn, None, EPS, fuse_grad_acc=False)
    assert out.shape == (1, T, n * (n + 2)) and out.dtype == F32
    torch.testing.assert_close(out.to(F64), _ref_out(residual, fn, None), **OUT_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("T", (7, 4001))
@pytest.mark.parametrize("n, c", [(2, 1280), (4, 2560), (4, 7168)])
def test_partials_launch_poisoned(T, n, c):
    residual, fn, _, _ = _inputs(T, n, c)
    k, m = n * c, n * (n + 2)
    s = K.splits(k)
    out_mul, sqrsum = torch.full((s, T, m), NAN, device="cuda"), torch.full((s, T), NAN, device="cuda")
    K.norm_fn_partials_launch(residual.view(T, k), fn, out_mul, sqrsum)
    pm, qm = R.mhc_pre_norm_fn_partials_ref(residual.to(F64), K.tf32_round(fn).to(F64), s)
    # each split: a 2 K/S-term dot product of exact products (bf16 x bf16 fits fp32: ``x hi`` and ``x lo``, ``|hi| +
    # |lo| = |W~|``, so the same sum of magnitudes); every MMA addition errs by at most one fp32 ulp of the running
    # sum (2u: the tensor core's accumulator need not round to nearest), so |err| <= 2 (2 K/S) u sum|terms|; the
    # squares (exact) are added on CUDA cores in round to nearest: (K/S) u Q
    env = R.mhc_pre_norm_fn_partials_ref(residual.to(F64).abs(), K.tf32_round(fn).abs().to(F64), s)[0]
    assert not out_mul.isnan().any() and not sqrsum.isnan().any()
    assert ((out_mul.to(F64) - pm[:, :, 0]).abs() <= 2 * (2 * k // s) * 2.0 ** -24 * env[:, :, 0]).all()
    assert ((sqrsum.to(F64) - qm[:, :, 0]).abs() <= (k // s) * 2.0 ** -24 * qm[:, :, 0]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("n", GRID_N)
@pytest.mark.parametrize("c", GRID_C)
def test_backward_against_reference(T, n, c):
    _check_backward_against_reference(T, n, c)


def _check_backward_against_reference(T, n, c):
    """The op's residual and weight gradients against ``_ref_grads`` (DX_TOL, DW_TOL)."""
    residual, fn, _, d_out = _inputs(T, n, c)
    _, dx, d_fn, _ = _grads(residual, fn, None, d_out)
    want_dx, want_fn, _ = _ref_grads(residual, fn, None, d_out)
    torch.testing.assert_close(dx.to(F64), want_dx.to(BF16).to(F64), **DX_TOL)
    torch.testing.assert_close(d_fn.to(F64), want_fn, **DW_TOL)


@pytest.mark.gpu
def test_side_channel_accumulates():
    T, n, c = 4001, 4, 2560
    residual, fn, _, d_out = _inputs(T, n, c)
    buf = torch.randn_like(residual, dtype=F32).to(BF16)
    start = buf.clone()
    r = residual.clone().requires_grad_(True)
    F.attach_residual_grad(r, buf)
    mhc_pre_norm_fn(r, fn, None, EPS, fuse_grad_acc=True).backward(d_out)
    assert r.grad is None
    # the RMS step's gradients as the op computes them, then the backward launch accumulating into the buffer's old
    # content: the same bits; and that is the float64 GEMMs plus the old content within the bf16 tolerance
    _, out_mul, sqrsum = F.norm_fn_forward(residual, fn, EPS)
    d_mul, d_sq = torch.empty_like(out_mul), torch.empty_like(sqrsum)
    F.reduce_rmsnorm_bwd_into(d_out.view(T, -1), out_mul, sqrsum, d_mul, d_sq, n * c, EPS)
    x, k = residual.view(T, -1), n * c
    want = start.view(T, k).clone()
    K.norm_fn_gemm_bwd_launch(d_mul[:, 0], d_sq[:, 0], x, fn, want, torch.empty(fn.shape, device="cuda"), True)
    assert torch.equal(buf.view(T, k), want)
    model, _ = _model_bwd64(d_mul[:, 0], d_sq[:, 0], x, fn, start.view(T, k))
    torch.testing.assert_close(want.to(F64), model.to(BF16).to(F64), **DX_TOL)


@pytest.mark.gpu
def test_strided_residual():
    residual, fn, _, d_out = _inputs(2 * 4001, 4, 1280)
    view = residual[:, ::2]
    assert not view.is_contiguous()
    got = _grads(view, fn, None, d_out[:, ::2])
    want = _grads(view.contiguous(), fn, None, d_out[:, ::2].contiguous())
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_norm_weight_merge():
    residual, fn, normw, d_out = _inputs(4001, 4, 2560, weight=True)
    out, dx, d_fn, d_w = _grads(residual, fn, normw, d_out)
    torch.testing.assert_close(out.to(F64), _ref_out(residual, fn, normw), **OUT_TOL)
    want_dx, want_fn, _ = _ref_grads(residual, fn, normw, d_out)
    torch.testing.assert_close(dx.to(F64), want_dx.to(BF16).to(F64), **DX_TOL)
    torch.testing.assert_close(d_fn.to(F64), want_fn, **DW_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("n", GRID_N)
def test_deterministic(n):
    residual, fn, _, d_out = _inputs(8192, n, 4096)
    first = _grads(residual, fn, None, d_out)
    for _ in range(2):
        again = _grads(residual, fn, None, d_out)
        for a, b in zip(first[:3], again[:3]):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("n", GRID_N)
def test_batch_invariant(n):
    residual, fn, _, d_out = _inputs(4001, n, 2560)
    full_out, full_dx, _, _ = _grads(residual, fn, None, d_out)
    for sl in (slice(1234, 1241), slice(4000, 4001), slice(0, 1), slice(64, 4001)):
        out, dx, _, _ = _grads(residual[:, sl].clone(), fn, None, d_out[:, sl].clone())
        assert torch.equal(out, full_out[:, sl])
        assert torch.equal(dx, full_dx[:, sl])


def _check_zero_tokens_keep_the_weight_gradient():
    """1000 zero tokens appended to 4001 leave the weight gradient's bits unchanged."""
    residual, fn, _, d_out = _inputs(4001, 4, 2560)
    _, _, d_fn, _ = _grads(residual, fn, None, d_out)
    pad_r = torch.cat([residual, torch.zeros_like(residual[:, :1000])], 1)
    pad_d = torch.cat([d_out, torch.zeros_like(d_out[:, :1000])], 1)
    _, _, d_fn_pad, _ = _grads(pad_r, fn, None, pad_d)
    assert torch.equal(d_fn, d_fn_pad)


@pytest.mark.gpu
def test_weight_gradient_bits_follow_the_token_blocks():
    # the partial count is fixed (not the SM count) and a token's block is t // MMA_TOKENS: zero tokens appended
    # are zero rows of the block's MMA (the same operands where the kernel masked them) and whole MMAs of zeros
    # after it, which leave every partial's bits unchanged
    _check_zero_tokens_keep_the_weight_gradient()


@pytest.mark.gpu
def test_cuda_graph_replay():
    residual, fn, _, d_out = _inputs(4001, 4, 4096)
    k, m = 4 * 4096, 24
    s = K.splits(k)
    x = residual.view(4001, k)
    static = [x.clone(), fn.clone(), torch.randn(4001, m, device="cuda"), torch.randn(4001, device="cuda")]
    pm, qm = torch.empty(s, 4001, m, device="cuda"), torch.empty(s, 4001, device="cuda")
    dx, d_fn = torch.empty_like(x), torch.empty(m, k, device="cuda")

    def launch():
        K.norm_fn_partials_launch(static[0], static[1], pm, qm)
        K.norm_fn_gemm_bwd_launch(static[2], static[3], static[0], static[1], dx, d_fn, False)

    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    fresh = [torch.randn_like(static[0], dtype=F32).to(BF16), torch.randn_like(fn) * 1e-4,
             torch.randn_like(static[2]), torch.randn_like(static[3])]
    for a, b in zip(static, fresh):
        a.copy_(b)
    for t in (pm, qm, dx, d_fn):
        t.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    got = [t.clone() for t in (pm, qm, dx, d_fn)]
    launch()
    for a, b in zip(got, (pm, qm, dx, d_fn)):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    residual, fn, _, d_out = _inputs(4001, 4, 2560)
    compiled = torch.compile(lambda r, f: mhc_pre_norm_fn(r, f, None, EPS, fuse_grad_acc=False), fullgraph=True)
    r, f = residual.detach().clone().requires_grad_(True), fn.detach().clone().requires_grad_(True)
    out = compiled(r, f)
    out.backward(d_out)
    want = _grads(residual, fn, None, d_out)
    for a, b in zip((out.detach(), r.grad, f.grad), want[:3]):
        assert torch.equal(a, b)


# ---- the backward's launch on TF32 tensor cores, at its defaults and a swept knob set ----

MMA_SWEPT = {"MMA_TOKENS": 32, "MMA_PARTIALS": 16, "MMA_MIN_BLOCKS": 5}
MMA_VARIANTS = [{}, MMA_SWEPT]  # the defaults and a swept set of the backward's tiling knobs


def _check_gemm_backward_launch(n, c):
    """The launch with poisoned destinations against the float64 GEMMs of its operands: dx is ``bf16`` of a sum
    off the exact one by at most the MMA's accumulation error (``M <= 32`` exact products: a few fp32 ulps of
    their magnitudes), so within the bf16 tolerance; dW by the spec's; and the weight gradient's bits do not depend
    on the residual gradient's destination (accumulated into or not, whatever its content)."""
    k, m = n * c, n * (n + 2)
    for T in (1, 7, 4001):
        residual, fn, _, _ = _inputs(T, n, c)
        x = residual.view(T, k)
        d_mul = torch.randn(T, m, device="cuda") * 1e-1
        d_sq = torch.randn(T, device="cuda") * 1e-3
        D = torch.randn(T, k, device="cuda").to(BF16)
        dws = []
        for accumulate in (False, True):
            dx = D.clone() if accumulate else torch.full((T, k), NAN, device="cuda", dtype=BF16)
            d_fn = torch.full((m, k), NAN, device="cuda")
            K.norm_fn_gemm_bwd_launch(d_mul, d_sq, x, fn, dx, d_fn, accumulate)
            want_dx, want_dw = _model_bwd64(d_mul, d_sq, x, fn, D if accumulate else None)
            torch.testing.assert_close(dx.to(F64), want_dx.to(BF16).to(F64), **DX_TOL)
            torch.testing.assert_close(d_fn.to(F64), want_dw, **DW_TOL)
            dws.append(d_fn)
        assert torch.equal(dws[0], dws[1])


@pytest.mark.gpu
@pytest.mark.parametrize("n, c", [(2, 1280), (4, 4096)])
def test_gemm_backward_launch(n, c):
    _check_gemm_backward_launch(n, c)


@pytest.mark.gpu
@pytest.mark.parametrize("n, c", [(2, 1280), (4, 4096)])
def test_mma_swept_gemm_backward_launch(n, c, knob_kernels):
    knob_kernels(K, MMA_SWEPT)
    _check_gemm_backward_launch(n, c)


# ---- the forward over the whole grid; the TF32 rounding kernel ----

@pytest.mark.gpu
@pytest.mark.parametrize("n", GRID_N)
@pytest.mark.parametrize("c", GRID_C)
def test_forward_over_the_grid(n, c):
    """At every (n, C): the op's forward against the reference (``test_forward_against_reference``'s assertion)
    over the tests' token counts, two runs bitwise equal; the split partials of poisoned launches within the bound
    of ``test_partials_launch_poisoned``; a token's output bits independent of the batch."""
    k, m = n * c, n * (n + 2)
    s = K.splits(k)
    for T in TOKENS:
        residual, fn, _, _ = _inputs(T, n, c)
        out = mhc_pre_norm_fn(residual, fn, None, EPS, fuse_grad_acc=False)
        assert out.shape == (1, T, m) and out.dtype == F32
        torch.testing.assert_close(out.to(F64), _ref_out(residual, fn, None), **OUT_TOL)
        assert torch.equal(out, mhc_pre_norm_fn(residual, fn, None, EPS, fuse_grad_acc=False))
        if T in (7, 4001):
            out_mul, sqrsum = torch.full((s, T, m), NAN, device="cuda"), torch.full((s, T), NAN, device="cuda")
            K.norm_fn_partials_launch(residual.view(T, k), fn, out_mul, sqrsum)
            wt = K.tf32_round(fn).to(F64)
            pm, qm = R.mhc_pre_norm_fn_partials_ref(residual.to(F64), wt, s)
            env = R.mhc_pre_norm_fn_partials_ref(residual.to(F64).abs(), wt.abs(), s)[0]
            assert not out_mul.isnan().any() and not sqrsum.isnan().any()
            assert ((out_mul.to(F64) - pm[:, :, 0]).abs() <= 2 * (2 * k // s) * 2.0 ** -24 * env[:, :, 0]).all()
            assert ((sqrsum.to(F64) - qm[:, :, 0]).abs() <= (k // s) * 2.0 ** -24 * qm[:, :, 0]).all()
    residual, fn, _, _ = _inputs(4001, n, c)
    full = mhc_pre_norm_fn(residual, fn, None, EPS, fuse_grad_acc=False)
    for sl in (slice(1234, 1241), slice(4000, 4001), slice(0, 1), slice(64, 4001)):
        out = mhc_pre_norm_fn(residual[:, sl].clone(), fn, None, EPS, fuse_grad_acc=False)
        assert torch.equal(out, full[:, sl])


@pytest.mark.gpu
@pytest.mark.parametrize("T", (1, 7, 33, 4001, 8192))
@pytest.mark.parametrize("m, k", [(8, 2 * 1280), (24, 4 * 7168)])
def test_tf32_round_kernel_bits(T, m, k):
    """The rounding kernel on dP ``[T, M]`` and W ``[M, K]`` writes ``tf32_round``'s bits of both (ties, negatives,
    infinities, NaNs, subnormals: ``_rounding_operands``), every element; the launcher's operands as it passes them:
    views that start off a 16-byte boundary are copied (``_launch.aligned``) and give the same bits."""
    from tilefuse import _launch

    dp, w = _rounding_operands(T * m + 1, m * k + 3, device="cuda")
    for a, b in ((dp[:-1], w[:-3]), (dp[1:], w[3:])):  # aligned, and views 4 and 12 bytes off
        dpr, wr = _poison(T * m, "cuda"), _poison(m * k, "cuda")
        _jit.get("mhc_norm_fn_tf32_round", ())(_launch.aligned(a), _launch.aligned(b), dpr, wr)
        assert torch.equal(dpr.view(torch.int32), K.tf32_round(a).view(torch.int32))
        assert torch.equal(wr.view(torch.int32), K.tf32_round(b).view(torch.int32))


# ---- the kernels' CUDA source, run on the CPU ----

EMU_EXTRA = r"""
static inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
alignas(1024) static uchar g_shmem[1 << 16];
static std::barrier<>* g_cta_bar;
static inline void __syncthreads() { g_cta_bar->arrive_and_wait(); }
"""


def _emulate(src: str, name: str, threads: int, workdir, extra: str = ""):
    """Compile ``name`` of the generated CUDA ``src`` for the CPU (``post_emulation``'s shim plus
    the CTA's dynamic shared memory and ``__syncthreads`` as a barrier of the CTA's host threads; CTAs run one
    after another; ``extra``: more shim). Returns ``run(tensors: dict, scalars: dict, grid: (x, y))``."""
    import ctypes
    import re

    from tests.mhc import post_emulation as emu

    body = src[src.index('extern "C" __global__ void __launch_bounds__'):]
    body = body.replace("extern __shared__ __align__(1024) uchar buf_dyn_shmem[];", "uchar* buf_dyn_shmem = g_shmem;")
    params = [p.strip() for p in re.search(re.escape(name) + r"\(([^)]*)\)", body).group(1).split(",")]
    names = [p.split()[-1] for p in params]
    scalar = [p.startswith("int64_t") for p in params]
    cargs = ", ".join(f"int64_t {a}" if s else f"void* {a}" for a, s in zip(names, scalar))
    call = ", ".join(a if s else f"({p.rsplit(' ', 1)[0].replace('__restrict__', '').strip()}){a}"
                     for p, a, s in zip(params, names, scalar))
    shim = emu.SHIM + EMU_EXTRA + extra
    cpp = shim + body.replace('extern "C" __global__', "static") + f"""
extern "C" void run({cargs}, int64_t gx, int64_t gy) {{
  std::barrier<> bar({threads}); g_cta_bar = &bar;
  for (int64_t by = 0; by < gy; ++by) for (int64_t bx = 0; bx < gx; ++bx) {{
    std::vector<std::thread> th;
    for (unsigned t = 0; t < {threads}; ++t)
      th.emplace_back([=]() {{ blockIdx.x = bx; blockIdx.y = by; threadIdx.x = t; {name}({call}); }});
    for (auto& h : th) h.join();
  }}
}}
"""
    fn = emu.compile_run(cpp, name, workdir)

    def run(tensors: dict, scalars: dict, grid) -> None:
        for t in tensors.values():
            assert t.device.type == "cpu" and t.is_contiguous()
        fn(*[ctypes.c_int64(scalars[a]) if s else ctypes.c_void_p(tensors[a].data_ptr())
             for a, s in zip(names, scalar)], ctypes.c_int64(grid[0]), ctypes.c_int64(grid[1]))

    return run


# The warp-level instructions of the GEMM kernels, for the CPU: each warp's 32 host threads exchange their registers
# through arrays at a barrier of the warp. ``ldmatrix.x4`` (b16): lane l gives the address of row l % 8 of matrix l /
# 8 and receives, of each matrix i, the 32-bit word (l / 4, l % 4). ``mma.m16n8k8`` TF32 (PTX ISA fragment layouts, g
# = l / 4, c = l % 4): A (g, c) (g + 8, c) (g, c + 4) (g + 8, c + 4); B (k = c, n = g) (c + 4, g); C/D (g, 2c) (g, 2c
# + 1) (g + 8, 2c) (g + 8, 2c + 1); the forward's in-warp sum ``tl::AllReduce`` as its butterfly of
# ``__shfl_xor_sync``. The operands' low 13 bits are dropped (TF32). ``mma.m16n8k16`` bf16 (the forward, the
# backward's second GEMM; each 32-bit register holds two bf16, the lower index in the low half): A (g, 2c..2c+1) (g +
# 8, 2c..) (g, 2c + 8..) (g + 8, 2c + 8..); B (k = 2c..2c+1, n = g) (2c + 8.., g); C/D as above. ``ldmatrix.x4.trans``
# (b16): the same addresses; lane l receives, of each matrix i, the elements (2 (l % 4), l / 4) (low half) and (2 (l %
# 4) + 1, l / 4) (high half) (the backward's bf16 operands). The async copies (``cp.async``) copy when issued
# (zero-fill where the guard is false) and their waits do nothing: a copy lands no later than on the GPU. The products
# are exact in double and their sum with C is rounded once to fp32 (the hardware's order and rounding of the sum are
# not specified: the test compares the result with a bound, not bitwise).
MMA_SHIM = r"""
struct uint1 { uint x; };
struct __nv_bfloat162 { bfloat16_t x, y; };
static inline float2 __bfloat1622float2(__nv_bfloat162 v) { return float2{(float)v.x, (float)v.y}; }
static inline uint __pack_nv_bfloat162(bfloat16_t a, bfloat16_t b) { return (uint)a.s | ((uint)b.s << 16); }
static inline float2 make_float2(float a, float b) { return float2{a, b}; }
static inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
static inline uint4 make_uint4(uint a, uint b, uint c, uint d) { return uint4{a, b, c, d}; }
static inline uint1 make_uint1(uint a) { return uint1{a}; }
namespace tl {
enum class DataType { kTensorFloat32, kFloat32, kBFloat16 };
static std::barrier<> g_warp_bar[8] = {std::barrier<>(32), std::barrier<>(32), std::barrier<>(32),
  std::barrier<>(32), std::barrier<>(32), std::barrier<>(32), std::barrier<>(32), std::barrier<>(32)};
static const void* g_rows[8][32];
static unsigned g_a[8][32][4], g_b[8][32][2];
static float g_shfl[8][32];
static inline float warp_xor(float v, int d) {
  unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
  g_shfl[w][l] = v;
  g_warp_bar[w].arrive_and_wait();
  float r = g_shfl[w][l ^ d];
  g_warp_bar[w].arrive_and_wait();
  return r;
}
struct SumOp {};
template <int> struct NamedBarrier {};
template <class Op, int threads, int scale, int offset, class Bar> struct AllReduce {
  static float run(float x) { for (int d = threads / 2; d >= scale; d /= 2) x = x + warp_xor(x, d); return x; }
};
static inline double tf32(unsigned u) { u &= ~0x1FFFu; float f; std::memcpy(&f, &u, 4); return f; }
static inline double bf16(unsigned u, int h) {
  u = h ? u & 0xFFFF0000u : u << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline void mma_bf16_m16n8k16(float* c, const unsigned* a, const unsigned* b) {
  unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
  for (int i = 0; i < 4; ++i) g_a[w][l][i] = a[i];
  for (int i = 0; i < 2; ++i) g_b[w][l][i] = b[i];
  g_warp_bar[w].arrive_and_wait();
  double As[16][16], Bs[16][8];
  for (int q = 0; q < 32; ++q) {
    int g = q / 4, k = q % 4;
    for (int h = 0; h < 2; ++h) {
      As[g][2 * k + h] = bf16(g_a[w][q][0], h); As[g + 8][2 * k + h] = bf16(g_a[w][q][1], h);
      As[g][2 * k + 8 + h] = bf16(g_a[w][q][2], h); As[g + 8][2 * k + 8 + h] = bf16(g_a[w][q][3], h);
      Bs[2 * k + h][g] = bf16(g_b[w][q][0], h); Bs[2 * k + 8 + h][g] = bf16(g_b[w][q][1], h);
    }
  }
  g_warp_bar[w].arrive_and_wait();
  int g = l / 4, k = l % 4;
  const int row[4] = {g, g, g + 8, g + 8}, col[4] = {2 * k, 2 * k + 1, 2 * k, 2 * k + 1};
  for (int i = 0; i < 4; ++i) {
    double acc = c[i];
    for (int j = 0; j < 16; ++j) acc += As[row[i]][j] * Bs[j][col[i]];
    c[i] = (float)acc;
  }
}
static inline void ptx_ldmatrix_x4(const void* p, void* out) {
  unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
  g_rows[w][l] = p;
  g_warp_bar[w].arrive_and_wait();
  for (int i = 0; i < 4; ++i) ((unsigned*)out)[i] = ((const unsigned*)g_rows[w][i * 8 + l / 4])[l % 4];
  g_warp_bar[w].arrive_and_wait();
}
static inline void ptx_ldmatrix_x4_trans(const void* p, void* out) {
  unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
  g_rows[w][l] = p;
  g_warp_bar[w].arrive_and_wait();
  for (int i = 0; i < 4; ++i) {
    const uint16_t* r0 = (const uint16_t*)g_rows[w][i * 8 + 2 * (l % 4)];
    const uint16_t* r1 = (const uint16_t*)g_rows[w][i * 8 + 2 * (l % 4) + 1];
    ((unsigned*)out)[i] = (unsigned)r0[l / 4] | ((unsigned)r1[l / 4] << 16);
  }
  g_warp_bar[w].arrive_and_wait();
}
template <DataType A, DataType B, DataType C, int M, int N, int K, bool TA, bool TB>
static inline void mma_sync(float* c, const unsigned* a, const unsigned* b) {
  if constexpr (A == DataType::kBFloat16) {
    static_assert(B == DataType::kBFloat16 && M == 16 && N == 8 && K == 16 && !TA && TB, "bf16: m16n8k16 TN only");
    mma_bf16_m16n8k16(c, a, b);
  } else {
    static_assert(M == 16 && N == 8 && K == 8 && !TA && TB, "m16n8k8 TN only");
    unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
    for (int i = 0; i < 4; ++i) g_a[w][l][i] = a[i];
    for (int i = 0; i < 2; ++i) g_b[w][l][i] = b[i];
    g_warp_bar[w].arrive_and_wait();
    double As[16][8], Bs[8][8];
    for (int q = 0; q < 32; ++q) {
      int g = q / 4, k = q % 4;
      As[g][k] = tf32(g_a[w][q][0]); As[g + 8][k] = tf32(g_a[w][q][1]);
      As[g][k + 4] = tf32(g_a[w][q][2]); As[g + 8][k + 4] = tf32(g_a[w][q][3]);
      Bs[k][g] = tf32(g_b[w][q][0]); Bs[k + 4][g] = tf32(g_b[w][q][1]);
    }
    g_warp_bar[w].arrive_and_wait();
    int g = l / 4, k = l % 4;
    const int row[4] = {g, g, g + 8, g + 8}, col[4] = {2 * k, 2 * k + 1, 2 * k, 2 * k + 1};
    for (int i = 0; i < 4; ++i) {
      double acc = c[i];
      for (int j = 0; j < 8; ++j) acc += As[row[i]][j] * Bs[j][col[i]];
      c[i] = (float)acc;
    }
  }
}
}  // namespace tl
""" + CP_ASYNC + r"""
static inline uint2 make_uint2(uint a, uint b) { return uint2{a, b}; }
static inline __nv_bfloat162 __float22bfloat162_rn(float2 v) {
  return __nv_bfloat162{bfloat16_t(v.x), bfloat16_t(v.y)};
}
"""


@pytest.mark.compile
@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("n, c", [(2, 256), (4, 256)])
@pytest.mark.parametrize("accumulate", (False, True))
@pytest.mark.parametrize("knobs", MMA_VARIANTS, ids=str)
def test_mma_backward_source_on_cpu(n, c, accumulate, knobs, tmp_path, monkeypatch):
    """The backward's generated CUDA (``knobs`` {}: the registered kernel tilefuse launches; else built with the
    swept knobs), run on the CPU with the warp instructions emulated (``MMA_SHIM``: TF32 m16n8k8, bf16 m16n8k16,
    ldmatrix, ldmatrix.trans): its tiles, fragment layouts, guards and barriers give the GEMMs of the float64 model
    (dx within one bf16 rounding of it: the emulated MMA errs by an fp32 rounding per call; dW within 2^-20 of the
    sum of |terms|: ``dP~ = hi + lo`` exactly, the same exact products split in two), every element written; tiny
    (hi + lo exact down to 2^-123), huge and zero dP~; token counts that leave partials empty, end mid-block and
    wrap the partials more than once; dW's bits the same whether dx accumulates or not. The partial sum's generated
    CUDA, run on the CPU, adds those partials in increasing ``p`` from zero, bit for bit."""
    k, m = n * c, n * (n + 2)
    runs = {}
    for acc in {accumulate, False}:  # the kernel, and without accumulation to compare dW's bits
        if knobs:
            src = _build(monkeypatch, K.norm_fn_bwd_kernel, (k, m, acc), knobs).get_kernel_source()
        else:
            src = _jit.compile_kernel("mhc_norm_fn_bwd", (k, m, acc), "sm_90").get_kernel_source()
        _check_source("mhc_norm_fn_bwd", src)
        runs[acc] = _emulate(src, "mhc_norm_fn_bwd_kernel", K.MMA_THREADS, tmp_path / f"bwd{acc}", MMA_SHIM)
    dws = _emulate(_jit.compile_kernel("mhc_norm_fn_dw_sum", (), "sm_90").get_kernel_source(),
                   "mhc_norm_fn_dw_sum_kernel", K.SUM_THREADS, tmp_path / "sum")
    parts = K.MMA_PARTIALS
    for T in (1, 37, 100, 2 * parts * K.MMA_TOKENS + 5):
        x = torch.randn(T, k).to(BF16)
        fn = torch.randn(m, k) * 1e-2
        d_mul, d_sq = torch.randn(T, m), torch.randn(T) * 1e-2
        if T == 37:  # tiny (hi + lo exact down to 2^-123), huge and zero dP~
            d_mul[5, :4] = torch.tensor([3.0 * 2.0 ** -120, -2.0 ** -100, 1e30, 0.0])
        D = torch.randn(T, k).to(BF16)
        outs = {}
        for acc, run in runs.items():
            dx = D.clone() if acc else torch.full((T, k), NAN, dtype=BF16)
            dwp = torch.full((parts, m, k), NAN)
            run(dict(DP=K.tf32_round(d_mul), DQ=d_sq, X=x, W=K.tf32_round(fn), DX=dx, DWP=dwp),
                dict(P=parts, Tn=T), (k // K.MMA_COLS, parts))
            outs[acc] = dx, dwp
        dx, dwp = outs[accumulate]
        assert not dx.isnan().any() and not dwp.isnan().any(), T
        assert torch.equal(dwp.view(torch.int32), outs[False][1].view(torch.int32)), T
        want_dx, want_dw = _model_bwd64(d_mul, d_sq, x, fn, D if accumulate else None)
        env_dx, env_dw = _model_bwd64(d_mul.abs(), d_sq.abs(), x.abs(), fn.abs(), D.abs() if accumulate else None)
        # bf16 of a value within 2^-20 env of the model: off the model by half a bf16 ulp of it plus that
        assert ((dx.to(F64) - want_dx).abs() <= want_dx.abs() * 2.0 ** -8 + env_dx * 2.0 ** -20).all(), T
        dw = dwp.to(F64).sum(0)
        assert ((dw - want_dw).abs() <= env_dw * 2.0 ** -20).all(), T
        d_fn = torch.full((m * k,), NAN)
        dws(dict(DWP=dwp.view(parts, m * k), DW=d_fn), dict(P=parts, N=m * k), (-(-(m * k) // K.SUM_THREADS), 1))
        in_order = torch.zeros(m, k)
        for p in range(parts):
            in_order = in_order + dwp[p]
        assert torch.equal(d_fn.view(m, k), in_order), T


@pytest.mark.compile
@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("n, c", [(2, 256), (4, 256)])
def test_forward_source_on_cpu(n, c, tmp_path):
    """The forward's generated CUDA run on the CPU (``MMA_SHIM``: its bf16 MMA, async copies, ldmatrix and in-warp
    sums): from unrounded fp32 weights (the kernel rounds them to TF32 and splits them), every split's partials
    within the bound of ``test_partials_launch_poisoned`` (2 K/S exact products, ``x hi`` and ``x lo``), every
    element written; a partial last token tile (T = 100) and a single token; more steps than stages (K/S = 256: 4
    steps)."""
    k, m = n * c, n * (n + 2)
    s = K.splits(k)
    assert (k // s) // K.FWD_BK > K.FWD_STAGES
    src = _jit.compile_kernel("mhc_norm_fn_fwd", (k, m), "sm_90", export=False).get_kernel_source()
    _check_source("mhc_norm_fn_fwd", src)
    fwd = _emulate(src, "mhc_norm_fn_fwd_kernel", K.FWD_THREADS, tmp_path / "fwd", MMA_SHIM)
    for T in (100, 1):
        x = torch.randn(T, k).to(BF16)
        w = torch.randn(m, k) * 1e-2
        out_mul, sqrsum = torch.full((s, T, m), NAN), torch.full((s, T), NAN)
        fwd(dict(X=x, W=w, P=out_mul, Q=sqrsum), dict(Tn=T), (-(-T // K.FWD_TOKENS), s))
        wt = K.tf32_round(w)
        pm, qm = R.mhc_pre_norm_fn_partials_ref(x.view(1, T, n, c).to(F64), wt.to(F64), s)
        env = R.mhc_pre_norm_fn_partials_ref(x.view(1, T, n, c).to(F64).abs(), wt.abs().to(F64), s)[0]
        assert not out_mul.isnan().any() and not sqrsum.isnan().any()
        assert ((out_mul.to(F64) - pm[:, :, 0]).abs() <= 2 * (2 * k // s) * 2.0 ** -24 * env[:, :, 0]).all(), T
        assert ((sqrsum.to(F64) - qm[:, :, 0]).abs() <= (k // s) * 2.0 ** -24 * qm[:, :, 0]).all(), T


ROUND_SIZES = [(1, 1), (7, 5), (24, 4096), (37 * 8, 8 * 512 + 3), (4001 * 24, 24 * 2560)]  # (Nd, Nw)


@pytest.mark.compile
@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="needs g++")
def test_tf32_round_source_on_cpu(tmp_path):
    """The rounding kernel's generated CUDA run on the CPU (its threads one after another): ``tf32_round``'s bits
    of both ranges (``_rounding_operands``: ties, negatives, infinities, NaNs, subnormals), every element written;
    ranges that end mid-chunk (the element path) and a W range whose chunks start right after DP's last, cut one."""
    from tests.mhc import norm_emulation

    src = _jit.compile_kernel("mhc_norm_fn_tf32_round", (), "sm_90", export=False).get_kernel_source()
    _check_source("mhc_norm_fn_tf32_round", src)
    run = norm_emulation.build(src, "mhc_norm_fn_tf32_round_kernel", K.ROUND_THREADS, tmp_path)
    for nd, nw in ROUND_SIZES:
        dp, w = _rounding_operands(nd, nw)
        dpr, wr = _poison(nd), _poison(nw)
        chunks = -(-nd // K.ROUND_V) - (-nw // K.ROUND_V)
        run(dict(DP=dp, W=w, DPR=dpr, WR=wr, Nd=nd, Nw=nw), -(-chunks // K.ROUND_THREADS))
        assert torch.equal(dpr.view(torch.int32), K.tf32_round(dp).view(torch.int32)), (nd, nw)
        assert torch.equal(wr.view(torch.int32), K.tf32_round(w).view(torch.int32)), (nd, nw)


def _rounding_operands(nd: int, nw: int, device="cpu"):
    """``(dP, W)``: ``nd`` and ``nw`` fp32 values of random bits (every exponent and sign, NaNs and infinities among
    them) with the edges at both ends of each: ±0, ties at bit 13 (ties away from zero) and their neighbours, ±inf,
    NaNs (one whose rounding carries into the sign bit), subnormals (one that rounds up to the smallest normal),
    fp32's largest finite value (it rounds to inf)."""
    edges = [0, 0x80000000, 0x3F801000, 0xBF801000, 0x3F800FFF, 0x3F801001, 0x3F803000, 0xBF803000, 0x7F800000,
             0xFF800000, 0x7FC00000, 0x7FFFFFFF, 0xFFFFF000, 0x7F800001, 0x00000001, 0x00001000, 0x80001000,
             0x007FFFFF, 0x807FF000, 0x7F7FFFFF, 0xFF7FF000]
    edges = torch.tensor([e - (1 << 32) if e >> 31 else e for e in edges], dtype=torch.int32)
    out = []
    for n in (nd, nw):
        v = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32)
        e = edges[:n]
        v[:len(e)] = e
        v[n - len(e):] = e
        out.append(v.view(F32).to(device))
    return out


def _poison(n: int, device="cpu"):
    """``n`` fp32 values with low bits that no ``tf32_round`` result has (an element left unwritten shows)."""
    return torch.full((n,), 0x12345, dtype=torch.int32, device=device).view(F32)
