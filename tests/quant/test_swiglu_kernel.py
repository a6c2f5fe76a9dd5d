"""Kernel tiers for the fused SwiGLU casts (quant.md 3.11-3.14).

* compile (sm_90, no GPU): each static config the GPU tier launches (tests/quant/configs.py) builds, with
  precise ``expf``, no fast math and 16-byte vector loads.
* CPU: the fake implementations give the reference's shapes, strides and dtypes.
* gpu: bit-exact vs the reference run ON THE GPU (CUDA ``expf`` can differ from the CPU's by an ulp), outputs
  poisoned before each launch; ``weight_grad`` within quant.md 6.3's 1e-4 abs/rel (free sum order). Rows with
  ``pos_to_expert < 0`` are masked out (3.12: unspecified). Packed-UE8M0 padding bytes are cleared (6.1).
"""
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tilefuse import _jit
from tilefuse import quant
from tilefuse.quant import _swiglu_kernel as K
from tilefuse.reference import swiglu as ref
from tilefuse.reference.quant import cast as ref_cast
from tilefuse.testing import assert_equal, clear_unused_sf, quant_adversarial
from tests.quant.configs import SWIGLU_BWD as BWD_CASES, SWIGLU_FWD as FWD_CASES, SWIGLU_PCC as PCC_CASES
from tests.quant.configs import swiglu_kernel_configs
from tests.quant.kernel_binding import fake_jit

TOKENS = (0, 1, 7, 4001, 8192)
PCC_TOKENS = (0, 128, 4096, 8192)  # 3.14 requires T % 128 == 0
WG_TOL = 1e-4                      # quant.md 6.3: weight_grad, abs and rel
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.mark.compile
@pytest.mark.parametrize("name,cfg", swiglu_kernel_configs(), ids=str)
def test_builds_for_sm90(name, cfg):
    src = _jit.compile_kernel(name, cfg, "sm_90", export=False).get_kernel_source()
    assert "__global__" in src
    assert "expf(" in src and "__expf" not in src and "use_fast_math" not in src  # precise expf (3.11)
    assert "uint4" in src or "float4" in src  # 16-byte vector loads


# ---- CPU: config bookkeeping and fake implementations ----

def test_f32_bits_is_binary32_rounding():
    assert K.f32_bits(1.0) == 0x3F800000
    assert K.f32_bits(0.5) == 0x3F000000
    # 0.1 rounds to the nearest binary32 (0x3DCCCCCD), not a truncation
    assert K.f32_bits(0.1) == 0x3DCCCCCD
    assert K.f32_bits(-2.0) == -0x40000000


def _cpu_fwd(x, npc, col, round_sf, packed):
    return quant.swiglu_forward_and_per_token_cast(x, "e4m3", npc, use_tma_aligned_col_major_sf=col,
                                                   round_sf=round_sf, use_packed_ue8m0=packed)


@pytest.mark.parametrize("t", (0, 1, 7))
@pytest.mark.parametrize("flags", ((True, True, True), (True, False, False), (False, True, False)), ids=str)
def test_fwd_ptc_fake_matches_reference_layout(t, flags):
    col, round_sf, packed = flags
    x = torch.randn(t, 2 * 1280, dtype=torch.bfloat16)
    want = _cpu_fwd(x, 128, col, round_sf, packed)
    with FakeTensorMode():
        fx = torch.empty(t, 2 * 1280, dtype=torch.bfloat16, device="cuda")
        got = torch.ops.tilefuse.swiglu_forward_and_per_token_cast(fx, 128, None, None, None, col, round_sf,
                                                                     packed, None, None, None)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and (g.stride() == w.stride() or w.numel() == 0)


@pytest.mark.parametrize("npc", (32, 128))
def test_bwd_ptc_fake_matches_reference_layout(npc):
    t, h = 7, 256
    data, sf = ref_cast(torch.randn(t, 2 * h), "e4m3", (1, npc))
    grad = torch.randn(t, h, dtype=torch.bfloat16)
    weight = torch.rand(t, 2)
    p2t = torch.arange(t, dtype=torch.int32)
    tt2p = torch.full((t, 2), -1, dtype=torch.int32)
    want = quant.swiglu_backward_and_per_token_cast((data, sf), grad, weight, p2t, tt2p, npc)
    want = (want[0], want[1][0], want[1][1], want[2], want[3])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        args = [mode.from_tensor(a) for a in (data, sf, grad, weight, p2t, tt2p)]
        got = torch.ops.tilefuse.swiglu_backward_and_per_token_cast(*args, npc, False, None)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and g.stride() == w.stride()


@pytest.mark.parametrize("without_transpose", (False, True))
def test_fwd_pcc_fake_matches_reference_layout(without_transpose):
    x = torch.randn(128, 2 * 64, dtype=torch.bfloat16)
    want = quant.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 32,
                                                                   without_transpose=without_transpose)
    with FakeTensorMode() as mode:
        got = torch.ops.tilefuse.swiglu_forward_and_per_channel_cast_and_transpose(mode.from_tensor(x), 32, False,
                                                                                   without_transpose, None)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and g.stride() == w.stride()


@pytest.mark.compile
@pytest.mark.parametrize("case", FWD_CASES, ids=str)
def test_fwd_ptc_launcher_binds_kernel_parameters(case, monkeypatch):
    """Every argument the launcher passes fits the kernel's parameters, absent optional inputs included
    (their stand-ins must match static sizes, e.g. the (3,) clamp counter)."""
    x_dtype, hidden, npc, col, round_sf, packed, weighted, skip, clamp, count = case
    calls = fake_jit(monkeypatch)
    t = 7
    x = torch.randn(t, 2 * hidden).to(DTYPES[x_dtype])
    w = torch.randn(t, 4) if weighted else None
    p2t = torch.randint(-1, 4 * t, (t,), dtype=torch.int32) if weighted else None
    p2e = torch.randint(-1, 3, (t,), dtype=torch.int32) if skip else None
    cnt = torch.zeros(3, dtype=torch.int64) if count else None
    K.swiglu_fwd_ptc_launch(x, npc, p2t, w, p2e, col, round_sf, packed, clamp, cnt)
    assert [(c.name, c.env["num_tokens"]) for c in calls] == [("swiglu_fwd_ptc", t)]



@pytest.mark.compile
@pytest.mark.parametrize("rows3d", (False, True), ids=("2d", "3d"))
@pytest.mark.parametrize("weights", (True, False), ids=("weights", "no_weights"))
def test_bwd_ptc_launcher_binds_kernel_parameters(rows3d, weights, monkeypatch):
    """3-D data/grad (flattened to rows) and an empty ``weight`` (dummy stand-ins): every argument fits the
    kernel's parameters; ``num_weights`` is ``T * K``, or the 1-element dummy without weights."""
    hidden, npc, round_sf, clamp = BWD_CASES[1]
    calls = fake_jit(monkeypatch)
    t, k = 6, 2
    data, sf = ref_cast(torch.randn(t, 2 * hidden), "e4m3", (1, npc))
    grad = torch.randn(t, hidden).to(torch.bfloat16)
    if rows3d:
        data, grad = data.view(2, 3, -1), grad.view(2, 3, -1)
    nt = t if weights else 0
    weight = torch.rand(nt, k)
    p2t = torch.full((t,), -1, dtype=torch.int32)
    if weights:
        p2t[:4] = torch.tensor([0, 3, 5, 10], dtype=torch.int32)
    tt2p = torch.full((nt, k), -1, dtype=torch.int32)
    K.swiglu_bwd_ptc_launch(data, sf, grad, weight, p2t, tt2p, npc, round_sf, clamp)
    assert [(c.name, c.cfg, c.env["num_tokens"], c.env["num_weights"]) for c in calls] == [
        ("swiglu_bwd_ptc", K._bwd_ptc_cfg(hidden, npc, round_sf, clamp), t, t * k if weights else 1)]


@pytest.mark.compile
@pytest.mark.parametrize("case", PCC_CASES, ids=str)
def test_fwd_pcc_launcher_binds_kernel_parameters(case, monkeypatch):
    """Transposed (H, T) and untransposed (T, H) e4m3 outputs, npt 32 and 128: every argument fits."""
    hidden, npt, round_sf, transpose, clamp = case
    calls = fake_jit(monkeypatch)
    t = 256
    x = torch.randn(t, 2 * hidden).to(torch.bfloat16)
    out, out_sf = K.swiglu_fwd_pcc_launch(x, npt, round_sf, not transpose, clamp)
    assert out.shape == ((hidden, t) if transpose else (t, hidden)) and out_sf.shape == (t // npt, hidden)
    assert [(c.name, c.cfg, c.env["num_tokens"]) for c in calls] == [("swiglu_fwd_pcc", K._pcc_cfg(*case), t)]


# ---- GPU tier ----

def _poison():
    """Fill the caching allocator's free memory with 0xFF so freshly allocated outputs start poisoned."""
    free = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    free.fill_(0xFF)
    del free


def _fill(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Adversarial fills (in place): all-zero 128-column blocks, subnormal magnitudes, values beyond the e4m3
    maximum (|act| up to ~1e5, ``exp`` overflowing to inf for l << 0)."""
    if kind == "zero_blocks":
        x.view(x.size(0), -1, 128)[:, ::3] = 0
    elif kind == "subnormal":
        tiny = torch.finfo(x.dtype).tiny
        x.copy_(torch.randn_like(x, dtype=torch.float32).mul_(tiny * 0.25).to(x.dtype))
    elif kind == "huge":
        x.copy_(torch.randn_like(x, dtype=torch.float32).mul_(300.0).to(x.dtype))
    return x


def _assert_equal_but_nan_payload(got, want, rows=None):
    """Bit-exact except NaN payloads and signs (quant.md 1.7: NaN is not part of the contract): the NaN positions
    must agree (e4m3: codes 0x7F / 0xFF), every other element bit for bit. ``rows``: a bool row mask."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)  # fp8 has no bool indexing
    if rows is not None:
        got, want = got[rows], want[rows]
    if got.dtype == torch.uint8:
        g_nan, w_nan = (got & 0x7F) == 0x7F, (want & 0x7F) == 0x7F
    else:
        g_nan, w_nan = got.isnan(), want.isnan()
    assert torch.equal(g_nan, w_nan)
    assert_equal(torch.where(g_nan, torch.zeros_like(got), got), torch.where(w_nan, torch.zeros_like(want), want),
                 check_stride=False)


def _special_x(t, width, fill, dtype):
    """quant.md 1.7 fills: ~1 element in 97 NaN or +-inf (either sign), in both halves (gate and up)."""
    return quant_adversarial(t, width, fill, dtype=dtype, device="cuda")


def _fwd_inputs(t, x_dtype, hidden, weighted, skip, fill="randn"):
    x = torch.randn(t, 2 * hidden, dtype=DTYPES[x_dtype], device="cuda") * 2
    x = _fill(x, fill)
    p2t = w = p2e = None
    if weighted:
        w = torch.randn(max(t, 1), 4, dtype=torch.float32, device="cuda")
        p2t = torch.randint(-1, w.numel(), (t,), dtype=torch.int32, device="cuda")
    if skip:
        p2e = torch.randint(-1, 3, (t,), dtype=torch.int32, device="cuda")
    return x, p2t, w, p2e


def _fwd_check(case, x, p2t, w, p2e):
    x_dtype, hidden, npc, col, round_sf, packed, weighted, skip, clamp, count = case
    cnt = torch.tensor([5, 6, 7], dtype=torch.int64, device="cuda") if count else None
    want_cnt = None if cnt is None else cnt.clone()
    _poison()
    out, sf = K.swiglu_fwd_ptc_launch(x, npc, p2t, w, p2e, col, round_sf, packed, clamp, cnt)
    torch.cuda.synchronize()
    act = ref.swiglu_forward(x, p2t, w, clamp)
    r_out, r_sf = ref_cast(act, "e4m3", (1, npc), round_sf=round_sf, use_tma_aligned_col_major_sf=col,
                           use_packed_ue8m0=packed)
    keep = torch.ones(x.size(0), dtype=torch.bool, device="cuda") if p2e is None else p2e >= 0
    assert out.shape == r_out.shape and out.dtype == r_out.dtype
    assert sf.shape == r_sf.shape and sf.dtype == r_sf.dtype
    assert sf.stride() == r_sf.stride() or sf.numel() == 0
    assert_equal(out.view(torch.uint8)[keep], r_out.view(torch.uint8)[keep])  # fp8 has no bool indexing
    assert_equal(clear_unused_sf(sf, hidden, npc)[keep], clear_unused_sf(r_sf, hidden, npc)[keep])
    if cnt is not None:
        want_cnt += ref.clamp_counts(x, clamp, keep)
        assert_equal(cnt, want_cnt)
    return out, sf


@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("case", FWD_CASES, ids=str)
def test_fwd_ptc_matches_reference(case, t):
    x, p2t, w, p2e = _fwd_inputs(t, case[0], case[1], case[6], case[7])
    _fwd_check(case, x, p2t, w, p2e)


@pytest.mark.gpu
@pytest.mark.parametrize("fill", ("zero_blocks", "subnormal", "huge"))
@pytest.mark.parametrize("case", (FWD_CASES[0], FWD_CASES[1], FWD_CASES[3]), ids=str)
def test_fwd_ptc_adversarial(case, fill):
    x, p2t, w, p2e = _fwd_inputs(257, case[0], case[1], case[6], case[7], fill)
    _fwd_check(case, x, p2t, w, p2e)


@pytest.mark.gpu
@pytest.mark.parametrize("case,fill", [(FWD_CASES[0], "nan"), (FWD_CASES[0], "inf"), (FWD_CASES[3], "nan"),
                                       (FWD_CASES[3], "inf"), (FWD_CASES[1], "inf")], ids=str)
def test_fwd_ptc_nan_inf(case, fill):
    """quant.md 1.7 inside the fused forward: NaN/inf in ``l`` or ``r`` (an inf ``l`` gives ``t`` = 1 or inf, so
    act = +-inf or NaN; groups with an inf get sf = inf, sf_inv = 0, and NaN is dropped from the group maximum).
    The clamp is only tested with inf: min/max with a NaN operand is not specified (3.11 + 1.7)."""
    x_dtype, hidden, npc, col, round_sf, packed, weighted, skip, clamp, count = case
    x = _special_x(257, 2 * hidden, fill, DTYPES[x_dtype])
    _, p2t, w, p2e = _fwd_inputs(257, x_dtype, hidden, weighted, skip)
    cnt = torch.tensor([5, 6, 7], dtype=torch.int64, device="cuda") if count else None
    want_cnt = None if cnt is None else cnt.clone()
    _poison()
    out, sf = K.swiglu_fwd_ptc_launch(x, npc, p2t, w, p2e, col, round_sf, packed, clamp, cnt)
    torch.cuda.synchronize()
    act = ref.swiglu_forward(x, p2t, w, clamp)
    assert bool(act.isnan().any())  # (an inf l below the clamp gives t = inf and act = NaN)
    r_out, r_sf = ref_cast(act, "e4m3", (1, npc), round_sf=round_sf, use_tma_aligned_col_major_sf=col,
                           use_packed_ue8m0=packed)
    keep = torch.ones(x.size(0), dtype=torch.bool, device="cuda") if p2e is None else p2e >= 0
    _assert_equal_but_nan_payload(out, r_out, keep)
    assert_equal(clear_unused_sf(sf, hidden, npc)[keep], clear_unused_sf(r_sf, hidden, npc)[keep])
    if cnt is not None:
        want_cnt += ref.clamp_counts(x, clamp, keep)
        assert_equal(cnt, want_cnt)


@pytest.mark.gpu
def test_fwd_ptc_deterministic_and_batch_invariant():
    case = FWD_CASES[1]
    x, p2t, w, p2e = _fwd_inputs(4001, case[0], case[1], case[6], case[7])
    args = (128, p2t, w, p2e, False, True, False, 0.5)
    c1 = torch.zeros(3, dtype=torch.int64, device="cuda")
    c2 = torch.zeros(3, dtype=torch.int64, device="cuda")
    o1, s1 = K.swiglu_fwd_ptc_launch(x, *args, c1)
    o2, s2 = K.swiglu_fwd_ptc_launch(x, *args, c2)
    keep = p2e >= 0
    assert_equal(o1.view(torch.uint8)[keep], o2.view(torch.uint8)[keep])
    assert_equal(s1[keep], s2[keep])
    assert_equal(c1, c2)
    lo, hi = 1000, 1777  # a sub-batch gives the same rows
    o3, s3 = K.swiglu_fwd_ptc_launch(x[lo:hi], 128, p2t[lo:hi], w, p2e[lo:hi], False, True, False, 0.5, None)
    k = keep[lo:hi]
    assert_equal(o3.view(torch.uint8)[k], o1[lo:hi].view(torch.uint8)[k])
    assert_equal(s3[k], s1[lo:hi][k])


def _graph_equals_eager(launch):
    eager = launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = launch()
    for c in captured:
        c.untyped_storage().fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    return eager, captured


@pytest.mark.gpu
def test_fwd_ptc_cuda_graph_replay_equals_eager():
    x = torch.randn(4001, 2048, dtype=torch.bfloat16, device="cuda")
    eager, captured = _graph_equals_eager(lambda: K.swiglu_fwd_ptc_launch(x, 128, None, None, None, True, True,
                                                                          True))
    assert_equal(captured[0], eager[0])
    assert_equal(clear_unused_sf(captured[1], 1024, 128), clear_unused_sf(eager[1], 1024, 128))


@pytest.mark.gpu
def test_fwd_ptc_torch_compile_equals_eager():
    case = FWD_CASES[1]
    x, p2t, w, p2e = _fwd_inputs(4001, case[0], case[1], case[6], case[7])
    c_eager = torch.zeros(3, dtype=torch.int64, device="cuda")
    c_comp = torch.zeros(3, dtype=torch.int64, device="cuda")

    def f(x, p2t, w, p2e, cnt):
        return K.swiglu_forward_and_per_token_cast_cuda(x, "e4m3", 128, p2t, w, p2e, False, True, False, 0.5, cnt)

    got = torch.compile(f, fullgraph=True)(x, p2t, w, p2e, c_comp)
    want = f(x, p2t, w, p2e, c_eager)
    keep = p2e >= 0
    assert_equal(got[0].view(torch.uint8)[keep], want[0].view(torch.uint8)[keep])
    assert_equal(got[1][keep], want[1][keep])
    assert_equal(c_comp, c_eager)


def _bwd_inputs(t, hidden, npc, fill="randn"):
    xb = _fill(torch.randn(t, 2 * hidden, dtype=torch.bfloat16, device="cuda"), fill)
    data, sf = ref_cast(xb, "e4m3", (1, npc))  # per-token e4m3, unrounded row-major sf (7.2)
    grad = torch.randn(t, hidden, dtype=torch.bfloat16, device="cuda")
    weight = torch.rand(max(t, 1), 2, dtype=torch.float32, device="cuda")
    # a consistent mapping: some rows point at a (t, k) slot, the rest of the slots are -1
    perm = torch.randperm(weight.numel(), device="cuda")[:t].to(torch.int32)
    p2t = torch.where(torch.rand(t, device="cuda") < 0.2, torch.full_like(perm, -1), perm)
    tt2p = torch.full(weight.shape, -1, dtype=torch.int32, device="cuda")
    rows = torch.arange(t, dtype=torch.int32, device="cuda")
    tt2p.view(-1)[p2t[p2t >= 0].long()] = rows[p2t >= 0]
    return data, sf, grad, weight, p2t, tt2p


def _bwd_check(case, data, sf, grad, weight, p2t, tt2p):
    hidden, npc, round_sf, clamp = case
    _poison()
    out, q, q_sf, x_grad, wg = K.swiglu_bwd_ptc_launch(data, sf, grad, weight, p2t, tt2p, npc, round_sf, clamp)
    torch.cuda.synchronize()
    r_out, r_xg, r_wg = ref.swiglu_backward((data, sf), grad, weight, p2t, tt2p, npc, clamp)
    r_q, r_qsf = ref_cast(r_xg, "e4m3", (1, npc), round_sf=round_sf)
    assert_equal(out, r_out.to(torch.bfloat16))
    assert_equal(x_grad, r_xg.to(torch.bfloat16))
    assert_equal(q, r_q)
    assert_equal(q_sf, r_qsf)
    torch.testing.assert_close(wg, r_wg, atol=WG_TOL, rtol=WG_TOL)
    return out, q, q_sf, x_grad, wg


@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("case", BWD_CASES, ids=str)
def test_bwd_ptc_matches_reference(case, t):
    _bwd_check(case, *_bwd_inputs(t, case[0], case[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("fill", ("zero_blocks", "subnormal", "huge"))
@pytest.mark.parametrize("case", BWD_CASES[:2], ids=str)
def test_bwd_ptc_adversarial(case, fill):
    _bwd_check(case, *_bwd_inputs(257, case[0], case[1], fill))


@pytest.mark.gpu
@pytest.mark.parametrize("fill", ("nan", "inf"))
@pytest.mark.parametrize("case", (BWD_CASES[0], (7168, 128, True, None)), ids=str)  # a test and the bench config
def test_bwd_ptc_nan_inf(case, fill):
    """quant.md 1.7 through the backward: the e4m3 input comes from a per-token cast of x with NaN/inf (NaN
    codes, inf input sf, so NaN/inf gate and up values), and the grad has them too. Outputs bit-exact but
    NaN payloads; weight_grad within 6.3's tolerance with NaN where the reference has NaN. Unclamped only: a
    clamp with a NaN operand is not specified."""
    hidden, npc, round_sf, clamp = case
    data, sf, grad, weight, p2t, tt2p = _bwd_inputs(129, hidden, npc)
    data, sf = ref_cast(_special_x(129, 2 * hidden, fill, torch.bfloat16), "e4m3", (1, npc))
    grad = _special_x(129, hidden, fill, torch.bfloat16)
    _poison()
    out, q, q_sf, x_grad, wg = K.swiglu_bwd_ptc_launch(data, sf, grad, weight, p2t, tt2p, npc, round_sf, clamp)
    torch.cuda.synchronize()
    r_out, r_xg, r_wg = ref.swiglu_backward((data, sf), grad, weight, p2t, tt2p, npc, clamp)
    assert bool(r_xg.isnan().any())
    r_q, r_qsf = ref_cast(r_xg, "e4m3", (1, npc), round_sf=round_sf)
    _assert_equal_but_nan_payload(out, r_out.to(torch.bfloat16))
    _assert_equal_but_nan_payload(x_grad, r_xg.to(torch.bfloat16))
    _assert_equal_but_nan_payload(q, r_q)
    assert_equal(q_sf, r_qsf)
    torch.testing.assert_close(wg, r_wg, atol=WG_TOL, rtol=WG_TOL, equal_nan=True)


@pytest.mark.gpu
def test_bwd_ptc_3d_data_and_grad():
    case = BWD_CASES[0]
    data, sf, grad, weight, p2t, tt2p = _bwd_inputs(4000, case[0], case[1])
    flat = K.swiglu_bwd_ptc_launch(data, sf, grad, weight, p2t, tt2p, case[1], case[2], case[3])
    got = K.swiglu_bwd_ptc_launch(data.view(40, 100, -1), sf, grad.view(40, 100, -1), weight, p2t, tt2p,
                                  case[1], case[2], case[3])
    for g, w in zip(got, flat):
        assert_equal(g, w)


@pytest.mark.gpu
def test_bwd_ptc_deterministic_and_batch_invariant():
    case = BWD_CASES[1]
    args = _bwd_inputs(4001, case[0], case[1])
    a = K.swiglu_bwd_ptc_launch(*args, case[1], case[2], case[3])
    b = K.swiglu_bwd_ptc_launch(*args, case[1], case[2], case[3])
    for g, w in zip(a, b):
        assert_equal(g, w)  # weight_grad included: a fixed butterfly order
    data, sf, grad, weight, p2t, tt2p = args
    lo, hi = 1000, 1777
    c = K.swiglu_bwd_ptc_launch(data[lo:hi], sf[lo:hi], grad[lo:hi], weight, p2t[lo:hi], tt2p, case[1], case[2],
                                case[3])
    for i in range(4):
        assert_equal(c[i], a[i][lo:hi])
    reached = p2t[lo:hi][p2t[lo:hi] >= 0].long()
    assert_equal(c[4].view(-1)[reached], a[4].view(-1)[reached])


@pytest.mark.gpu
def test_bwd_ptc_cuda_graph_and_torch_compile_equal_eager():
    case = BWD_CASES[0]
    args = _bwd_inputs(4001, case[0], case[1])
    eager, captured = _graph_equals_eager(lambda: K.swiglu_bwd_ptc_launch(*args, case[1], case[2], case[3]))
    for g, w in zip(captured, eager):
        assert_equal(g, w)
    data, sf, grad, weight, p2t, tt2p = args

    def f(data, sf, grad, weight, p2t, tt2p):
        out, (q, q_sf), x_grad, wg = K.swiglu_backward_and_per_token_cast_cuda((data, sf), grad, weight, p2t, tt2p,
                                                                              case[1], case[2], case[3])
        return out, q, q_sf, x_grad, wg

    got = torch.compile(f, fullgraph=True)(*args)
    for g, w in zip(got, eager):
        assert_equal(g, w)


def _pcc_check(case, x):
    hidden, npt, round_sf, transpose, clamp = case
    _poison()
    out, sf = K.swiglu_fwd_pcc_launch(x, npt, round_sf, not transpose, clamp)
    torch.cuda.synchronize()
    act = ref.swiglu_forward(x, swiglu_clamp_value=clamp).to(torch.bfloat16)
    r_out, r_sf = ref_cast(act, "e4m3", (npt, 1), round_sf=round_sf)
    assert_equal(out, r_out.T.contiguous() if transpose else r_out)
    assert_equal(sf, r_sf)
    return out, sf


@pytest.mark.gpu
@pytest.mark.parametrize("t", PCC_TOKENS)
@pytest.mark.parametrize("case", PCC_CASES, ids=str)
def test_fwd_pcc_matches_reference(case, t):
    _pcc_check(case, torch.randn(t, 2 * case[0], dtype=torch.bfloat16, device="cuda") * 2)


@pytest.mark.gpu
@pytest.mark.parametrize("fill", ("zero_blocks", "subnormal", "huge"))
@pytest.mark.parametrize("case", PCC_CASES, ids=str)
def test_fwd_pcc_adversarial(case, fill):
    x = _fill(torch.randn(256, 2 * case[0], dtype=torch.bfloat16, device="cuda"), fill)
    _pcc_check(case, x)


@pytest.mark.gpu
@pytest.mark.parametrize("case,fill", [(PCC_CASES[0], "nan"), (PCC_CASES[0], "inf"), (PCC_CASES[2], "inf"),
                                       ((7168, 128, True, True, None), "nan"), ((7168, 128, True, True, None), "inf")],
                         ids=str)
def test_fwd_pcc_nan_inf(case, fill):
    """quant.md 1.7 in the per-channel forward (NaN dropped from the channel maximum; an inf act gives sf = inf,
    sf_inv = 0): bit-exact but NaN payloads. The clamp only with inf (min/max of NaN is not specified)."""
    hidden, npt, round_sf, transpose, clamp = case
    x = _special_x(256, 2 * hidden, fill, torch.bfloat16)
    _poison()
    out, sf = K.swiglu_fwd_pcc_launch(x, npt, round_sf, not transpose, clamp)
    torch.cuda.synchronize()
    act = ref.swiglu_forward(x, swiglu_clamp_value=clamp).to(torch.bfloat16)
    assert bool(act.isnan().any())
    r_out, r_sf = ref_cast(act, "e4m3", (npt, 1), round_sf=round_sf)
    _assert_equal_but_nan_payload(out, r_out.T.contiguous() if transpose else r_out)
    assert_equal(sf, r_sf)


@pytest.mark.gpu
def test_fwd_pcc_deterministic_batch_invariant_graph_and_compile():
    case = PCC_CASES[1]
    x = torch.randn(8192, 2 * case[0], dtype=torch.bfloat16, device="cuda")
    launch = lambda x: K.swiglu_fwd_pcc_launch(x, case[1], case[2], not case[3], case[4])  # noqa: E731
    a, b = launch(x), launch(x)
    assert_equal(a[0], b[0])
    assert_equal(a[1], b[1])
    part = launch(x[1024:2048])  # token blocks are independent
    assert_equal(part[0], a[0][:, 1024:2048], check_stride=False)
    assert_equal(part[1], a[1][1024 // case[1]:2048 // case[1]])
    eager, captured = _graph_equals_eager(lambda: launch(x))
    assert_equal(captured[0], eager[0])
    assert_equal(captured[1], eager[1])

    def f(x):
        return K.swiglu_forward_and_per_channel_cast_and_transpose_cuda(x, "e4m3", case[1], case[2], not case[3],
                                                                        case[4])

    got = torch.compile(f, fullgraph=True)(x)
    assert_equal(got[0], a[0])
    assert_equal(got[1], a[1])


# ---- performance knobs: the alternatives a bench sweep may switch to still build ----

_KNOB_CASES = (
    # (module constant, alternative value, kernel, config): bench and GPU-test configs and quant.md 7.2-7.3 shapes
    ("BWD_ROW_THREADS", 32, "swiglu_bwd_ptc", K._bwd_ptc_cfg(2048, 32, True, 0.5)),     # one warp per row
    ("BWD_ROW_THREADS", 64, "swiglu_bwd_ptc", K._bwd_ptc_cfg(2560, 32, False, 0.5)),   # 2 warps per row
    ("FWD_PTC_DEPTH", 1, "swiglu_fwd_ptc",
     K._fwd_ptc_cfg("bfloat16", 3584, 128, True, True, False, True, False, 0.5, False)),
    ("FWD_PTC_ROW_THREADS", 64, "swiglu_fwd_ptc",
     K._fwd_ptc_cfg("bfloat16", 3584, 128, True, True, False, True, False, 0.5, False)),   # 2 warps per row
    ("BWD_ROW_WARPS", 7, "swiglu_bwd_ptc", K._bwd_ptc_cfg(7168, 128, True, None)),   # 224-thread row CTAs
    ("BWD_ROW_WARPS", 7, "swiglu_bwd_ptc", K._bwd_ptc_cfg(2048, 32, True, 0.5)),     # not covered: default team
    ("BWD_PDL", False, "swiglu_bwd_ptc", K._bwd_ptc_cfg(7168, 128, True, None)),
    ("BWD_ROW_WARPS", 0, "swiglu_bwd_ptc", K._bwd_ptc_cfg(7168, 128, True, None)),   # the 128-thread team
    ("BWD_WG_ZERO", False, "swiglu_bwd_ptc", K._bwd_ptc_cfg(7168, 128, True, None)),
    ("BWD_WG_ZERO", False, "swiglu_bwd_ptc", K._bwd_ptc_cfg(2560, 32, False, 0.5)),    # 2 rows per CTA
    ("BWD_WG_STAGE", True, "swiglu_bwd_ptc", K._bwd_ptc_cfg(7168, 128, True, None)),  # the 128-lane sum order
    ("BWD_L2_PREFETCH", False, "swiglu_bwd_ptc", K._bwd_ptc_cfg(7168, 128, True, None)),  # no prefetch before the wait
    ("PCC_STAGE", False, "swiglu_fwd_pcc", (7168, 128, True, True, None)),  # per-thread transposed stores
)


@pytest.mark.compile
@pytest.mark.parametrize("knob,value,name,cfg", _KNOB_CASES, ids=lambda v: str(v))
def test_knob_alternatives_build_for_sm90(knob, value, name, cfg, monkeypatch):
    _jit.registered()
    monkeypatch.setattr(K, knob, value)
    src = _jit.compile_kernel(name, cfg, "sm_90", export=False).get_kernel_source()
    assert "__global__" in src and "expf(" in src and "__expf" not in src
    if knob == "BWD_ROW_THREADS" and value == 32:  # one warp per row: no shared-memory row sum
        assert "__syncthreads" not in src


# The defaults (round 4, timed 16:33; BWD_WG_STAGE off since the 2026-11-29 19:20 run): BWD_ROW_WARPS=14 (448-thread
# row CTAs at H = 7168, 2 per SM), BWD_WG_ZERO, BWD_PDL, BWD_PDL_TRIGGER. Knob combinations from there (TILEFUSE_KNOBS
# names without the module prefix). Tilings and sums in another fixed order (weight_grad: the reference's tolerance):
# 7-warp row CTAs, the 128-thread team, the staged sum (the 128-thread team's order in the row CTA)
BWD_KNOB_VARIANTS = (
    {"BWD_ROW_WARPS": 7, "BWD_ROW_WARPS_MIN_BLOCKS": 4, "BWD_WG_ZERO": False},
    {"BWD_ROW_WARPS": 0, "BWD_WG_ZERO": False},
    {"BWD_WG_STAGE": True},
)
# bit-identical to the defaults (scheduling only): no PDL and the zero-fill kernel; no early trigger
BWD_R4_VARIANTS = (
    {"BWD_WG_ZERO": False, "BWD_PDL": False, "BWD_PDL_TRIGGER": False},
    {"BWD_PDL_TRIGGER": False},
    {"BWD_L2_PREFETCH": False},   # no L2 prefetches before the PDL wait (2026-11-30)
)


def _knob_source(monkeypatch, knobs, name, cfg):
    import tilelang

    for k, v in knobs.items():
        monkeypatch.setattr(K, k, v)
    return tilelang.compile(_jit._FACTORIES[name][0](*cfg), target={"kind": "cuda", "arch": "sm_90"},
                            execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS)).get_kernel_source()


def _bwd_launch_bounds(knobs: dict, hidden: int = 7168) -> str:
    """The ``__launch_bounds__(threads, min blocks)`` the backward gets at ``hidden`` with ``knobs`` over the defaults:
    one CTA of 32 * BWD_ROW_WARPS threads per row where H / 8 is a multiple of it, else the 128-thread team."""
    warps = knobs.get("BWD_ROW_WARPS", K.BWD_ROW_WARPS)
    if warps and (hidden // 8) % (32 * warps) == 0:
        return f"__launch_bounds__({32 * warps}, {knobs.get('BWD_ROW_WARPS_MIN_BLOCKS', K.BWD_ROW_WARPS_MIN_BLOCKS)})"
    return f"__launch_bounds__(128, {knobs.get('BWD_MIN_BLOCKS', K.BWD_MIN_BLOCKS)})"


@pytest.mark.compile
@pytest.mark.parametrize("case", FWD_CASES + (("bfloat16", 3584, 128, True, True, False, True, False, 0.5, False),),
                         ids=str)
def test_fwd_ptc_register_cap_only_for_chunk_teams(case, monkeypatch):
    """FWD_PTC_MIN_BLOCKS (16 two-warp CTAs per SM: 64 registers) bounds the npc = 128 kernels of these cases (the
    bench row among them, last case); the whole-row (npc = H) kernel keeps nvcc's own register count, as do packed-sf
    kernels left in one-warp teams (test_fwd_ptc_packed_sf_byte_stores's H = 1280 and fp32 cases)."""
    _jit.registered()
    hidden, npc = case[1:3]
    src = _knob_source(monkeypatch, {}, "swiglu_fwd_ptc", K._fwd_ptc_cfg(*case))
    assert ("__launch_bounds__(64, 16)" in src) == (npc != hidden)
    assert "__launch_bounds__(64" in src


@pytest.mark.compile
@pytest.mark.parametrize("sf_bytes", (True, False))
@pytest.mark.parametrize("x_dtype,hidden", (("bfloat16", 1024), ("bfloat16", 1280), ("float32", 1024)))
def test_fwd_ptc_packed_sf_byte_stores(x_dtype, hidden, sf_bytes, monkeypatch):
    """FWD_PTC_SF_BYTES: with packed sf, a 64-lane team whose stages cover whole words (bf16 H = 1024: 128
    chunks, 4 groups a stage) stores each group's UE8M0 byte on its own (byte g % 4 of word g // 4: a word's groups
    span both warps). A 32-lane team (bf16 H = 1280: 160 chunks), a team whose stage would cover half a word (fp32
    H = 1024: 2 groups, so the last word's padding bytes would go unwritten) and the knob's False gather each word by
    shuffles and store it whole."""
    _jit.registered()
    src = _knob_source(monkeypatch, {"FWD_PTC_SF_BYTES": sf_bytes}, "swiglu_fwd_ptc",
                       K._fwd_ptc_cfg(x_dtype, hidden, 128, True, True, True, False, False, None, False))
    body = src[src.index("__launch_bounds__"):]
    stores = re.findall(r"tf_sw_st8\(\(&\(SF\[0\]\)\), (.*), eb(?:_\d+)?\);", body)
    if sf_bytes and (x_dtype, hidden) == ("bfloat16", 1024):  # 2 stages of 4 groups: row + (g // 4) * sf_pad words
        assert len(stores) == 2 and all("threadIdx.x)) >> (int64_t)4)" in st for st in stores)
        assert "sf_pad" in stores[1] and "SF[" not in body.replace("(&(SF[0]))", "")
    else:
        assert not stores and "SF[" in body


@pytest.mark.compile
@pytest.mark.parametrize("knobs", BWD_KNOB_VARIANTS + ({"BWD_L2_PREFETCH": False},), ids=str)
def test_bwd_knob_variants_source(knobs, monkeypatch):
    """The PDL wait precedes every load (only L2 prefetches before it: the row's data and grad, its sf and
    pos_to_token_topk lines); 7 warps per row gives 224-thread CTAs at H = 7168 only."""
    _jit.registered()
    bounds = _bwd_launch_bounds(knobs)
    src = _knob_source(monkeypatch, knobs, "swiglu_bwd_ptc", K._bwd_ptc_cfg(7168, 128, True, None))
    head = src[src.index("__launch_bounds__"):]
    assert head.startswith(bounds)
    body = head[head.index("{"):]  # past the parameter list
    wait = body.index("cudaGridDependencySynchronize();")
    before, after = body[:wait], body[wait:]
    prefetches = [ln.strip() for ln in before.splitlines() if "sw_prefetch" in ln]
    if knobs.get("BWD_L2_PREFETCH", K.BWD_L2_PREFETCH):
        assert [p.split("(")[0] for p in prefetches] == ["sw_prefetch_rows", "sw_prefetch_line", "sw_prefetch_line"]
        assert "(&(D[" in prefetches[0] and "(&(G[" in prefetches[0] and "P2T[" in prefetches[1]
        assert "SFI[" in prefetches[2]
    else:
        assert not prefetches
    for p in prefetches:
        before = before.replace(p, "")
    assert not any(p in before for p in ("P2T[", "W[", "TT2P[", "D +", "SFI", "G +", "D[", "G["))
    first_global = min(i for i in (after.find(p) for p in ("P2T[", "W[", "TT2P[", "D +", "SFI", "G +")) if i >= 0)
    assert after.index("cudaTriggerProgrammaticLaunchCompletion();") < first_global


@pytest.mark.compile
@pytest.mark.parametrize("knobs", BWD_R4_VARIANTS, ids=str)
def test_bwd_r4_variants_source(knobs, monkeypatch):
    """Round-4 variants: the zero stores guarded by token_topk_to_pos == -1; the staged row sum (ROW_WARPS) is
    read back by the default team's 128 lanes, 7 chunks of 8 FMAs each in the default's order."""
    _jit.registered()
    eff = {**{k: getattr(K, k) for k in ("BWD_ROW_WARPS", "BWD_WG_STAGE", "BWD_WG_ZERO")}, **knobs}
    bounds = _bwd_launch_bounds(knobs)
    src = _knob_source(monkeypatch, knobs, "swiglu_bwd_ptc", K._bwd_ptc_cfg(7168, 128, True, None))
    assert bounds in src
    assert (("] == -1) {" in src and "= 0x0p+0f" in src) == bool(eff["BWD_WG_ZERO"]))
    if eff["BWD_WG_STAGE"] and eff["BWD_ROW_WARPS"]:
        assert "act_s" in src and "if (((int)threadIdx.x) < 128) {" in src and "c0 < 7;" in src
        assert "acc[0] = (acc[0] + (((float)gv[" in src
    else:
        assert "act_s" not in src


@pytest.mark.compile
def test_bwd_wg_zero_launcher_allocates_uninitialized(monkeypatch):
    """BWD_WG_ZERO: no zero-fill ahead of the kernel (torch.empty), except T = 0 (no launch: zeros)."""
    calls = []

    def fake_get(name, cfg):
        return lambda *args: calls.append((name, cfg))

    monkeypatch.setattr(_jit, "get", fake_get)
    monkeypatch.setattr(K, "BWD_WG_ZERO", True)
    made = []
    real_empty, real_zeros = torch.empty, torch.zeros
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append("empty") or real_empty(*a, **k))
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: made.append("zeros") or real_zeros(*a, **k))
    for t in (3, 0):
        data = real_zeros((t, 512), dtype=torch.float8_e4m3fn)
        sf = real_zeros((t, 4), dtype=torch.float32)
        grad = real_zeros((t, 256), dtype=torch.bfloat16)
        weight = real_zeros((4, 2), dtype=torch.float32)
        p2t = real_zeros((t,), dtype=torch.int32)
        tt2p = real_zeros((4, 2), dtype=torch.int32)
        made.clear()
        wg = K.swiglu_bwd_ptc_launch(data, sf, grad, weight, p2t, tt2p, 128, True)[4]
        assert made == (["empty"] if t else ["zeros"])
        if not t:
            assert not bool(wg.any())


@pytest.mark.gpu
@pytest.mark.parametrize("t", (1, 7, 4001))
def test_fwd_ptc_packed_word_knob_matches_reference(t, knob_kernels):
    """FWD_PTC_SF_BYTES=False (one-warp teams, each packed word gathered by shuffles) gives the reference's bits
    for the packed-sf case that the default stores byte by byte."""
    knob_kernels(K, {"FWD_PTC_SF_BYTES": False})
    case = FWD_CASES[0]
    _fwd_check(case, *_fwd_inputs(t, case[0], case[1], case[6], case[7]))


# (hidden, num_per_channels, round_sf, clamp) of the backward knob-variant GPU tests
_BWD_KNOB_CASES = ((7168, 128, True, None), (7168, 128, False, 10.0), (2560, 32, False, 0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", BWD_KNOB_VARIANTS, ids=str)
@pytest.mark.parametrize("t", (1, 7, 4001))
@pytest.mark.parametrize("case", _BWD_KNOB_CASES, ids=str)
def test_bwd_knob_variants_match_reference(knobs, t, case, knob_kernels):
    """Round-3 backward knob variants give the reference's bits (weight_grad within 6.3), twice in a row."""
    knob_kernels(K, knobs)
    inputs = _bwd_inputs(t, case[0], case[1])
    first = _bwd_check(case, *inputs)
    again = K.swiglu_bwd_ptc_launch(*inputs, case[1], case[2], case[3])
    for a, b in zip(again, first):
        assert_equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", BWD_R4_VARIANTS, ids=str)
@pytest.mark.parametrize("t", (1, 7, 4001))
@pytest.mark.parametrize("case", _BWD_KNOB_CASES, ids=str)
def test_bwd_r4_variants_bitwise_equal_default(knobs, t, case, knob_kernels):
    """Scheduling variants: every output bit-identical to the default kernel's, weight_grad included (the kernel's
    own zeros land where token_topk_to_pos is -1, the fill kernel's elsewhere), on a weight_grad buffer that starts
    as garbage (the caching allocator's poisoned blocks)."""
    inputs = _bwd_inputs(t, case[0], case[1])
    want = K.swiglu_bwd_ptc_launch(*inputs, case[1], case[2], case[3])
    knob_kernels(K, knobs)
    got = _bwd_check(case, *inputs)
    for a, b in zip(got, want):
        assert_equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("fill", ("nan", "inf"))
def test_bwd_r4_variant_nan_inf(fill, knob_kernels):
    """quant.md 1.7 through the staged-sum variant (bench config)."""
    knob_kernels(K, BWD_KNOB_VARIANTS[2])
    test_bwd_ptc_nan_inf((7168, 128, True, None), fill)


@pytest.mark.gpu
@pytest.mark.parametrize("fill", ("nan", "inf"))
def test_bwd_knob_variant_nan_inf(fill, knob_kernels):
    """quant.md 1.7 through the first backward variant (the default's NaN/inf test, bench config)."""
    knob_kernels(K, BWD_KNOB_VARIANTS[0])
    test_bwd_ptc_nan_inf((7168, 128, True, None), fill)


@pytest.mark.compile
@pytest.mark.parametrize("stage", (True, False))
def test_pcc_transposed_store_source(stage, monkeypatch):
    """PCC_STAGE: the transposed e4m3 tile leaves through the swizzled shared tile (16-byte chunks, eight lanes per
    channel row) after a barrier; without it each thread stores its own 32 bytes. The untransposed output never
    stages."""
    _jit.registered()
    monkeypatch.setattr(K, "PCC_STAGE", stage)
    src = _knob_source(monkeypatch, {}, "swiglu_fwd_pcc", (7168, 128, True, True, None))
    tail = src[src.rindex("__syncthreads();"):]  # after the last barrier: the global stores
    assert ("(fp8_e4_t*)ys)" in src) == stage
    assert ("(fp8_e4_t*)ys)" in tail and "& (int64_t)7) * (int64_t)16)" in tail) == stage  # 8 lanes x 16 bytes
    plain = _knob_source(monkeypatch, {}, "swiglu_fwd_pcc", (7168, 128, True, False, None))
    assert "(fp8_e4_t*)ys)" not in plain


# ---- wide rows (npc = 128): chunks per lane capped by wider teams, or a serial loop over unrolled chunks ----

# (x dtype, H, npc, col, round_sf, packed, weighted, skip, clamp, count) at 2H = 36864 (the bench's widest rows)
WIDE_FWD_CASES = (
    ("bfloat16", 18432, 128, False, False, False, False, False, None, False),
    ("bfloat16", 18432, 128, True, True, True, False, False, 0.5, False),
    ("bfloat16", 18432, 128, True, True, False, True, True, 0.5, True),
    ("float32", 18432, 128, False, True, False, False, False, 10.0, False),
)
# the default (wider teams), the previous tiling (64-lane teams, every chunk unrolled), the serial loops
WIDE_FWD_KNOBS = (
    {},
    {"FWD_PTC_MAX_CHUNKS": 0},
    {"FWD_PTC_MAX_CHUNKS": 0, "FWD_PTC_UNROLL": 9},
    {"FWD_PTC_SF_BYTES": False, "FWD_PTC_UNROLL": 12},
)


def _tiling(monkeypatch, knobs, *args):
    for k, v in knobs.items():
        monkeypatch.setattr(K, k, v)
    return K.fwd_ptc_tiling(*args)


def test_fwd_ptc_tiling_caps_chunks_per_lane(monkeypatch):
    """FWD_PTC_MAX_CHUNKS: a lane walks at most 16 chunks where a power-of-two team up to FWD_PTC_MAX_TEAM lanes allows
    it (one row per CTA, the 64-register budget kept); rows that fit keep their 64-lane team; 0 restores 64 lanes."""
    t = _tiling(monkeypatch, {}, "bfloat16", 18432, 128, "row")
    assert (t["L"], t["C"], t["U"], t["threads"], t["min_blocks"]) == (256, 9, 9, 256, 4)
    t = _tiling(monkeypatch, {}, "float32", 18432, 128, "col")
    assert (t["L"], t["C"], t["threads"], t["min_blocks"]) == (512, 9, 512, 2)
    t = _tiling(monkeypatch, {}, "bfloat16", 18432, 128, "col_packed")
    assert (t["L"], t["C"], t["byte_sf"]) == (256, 9, True)
    for h, c in ((1024, 2), (2048, 4), (4096, 8), (7168, 14)):  # unchanged
        t = _tiling(monkeypatch, {}, "bfloat16", h, 128, "row")
        assert (t["L"], t["C"], t["threads"], t["min_blocks"]) == (64, c, 64, 16)
    t = _tiling(monkeypatch, {}, "bfloat16", 1536, 1536, "row")  # npc = H: the whole row, no cap
    assert (t["L"], t["C"], t["min_blocks"]) == (32, 6, 0)
    t = _tiling(monkeypatch, {"FWD_PTC_MAX_CHUNKS": 0}, "bfloat16", 18432, 128, "row")
    assert (t["L"], t["C"], t["U"], t["threads"], t["min_blocks"]) == (64, 36, 36, 64, 16)


def test_fwd_ptc_tiling_serial_loop(monkeypatch):
    """FWD_PTC_UNROLL: the loop body is the largest divisor of the chunk count in (FWD_PTC_DEPTH, UNROLL]; packed words
    gathered over stages (one-warp teams) never straddle two iterations; lanes with few chunks stay unrolled."""
    t = _tiling(monkeypatch, {"FWD_PTC_MAX_CHUNKS": 0, "FWD_PTC_UNROLL": 9}, "bfloat16", 18432, 128, "row")
    assert (t["C"], t["U"]) == (36, 9)
    t = _tiling(monkeypatch, {"FWD_PTC_MAX_CHUNKS": 0, "FWD_PTC_UNROLL": 8}, "bfloat16", 7168, 128, "row")
    assert (t["C"], t["U"]) == (14, 7)
    t = _tiling(monkeypatch, {"FWD_PTC_SF_BYTES": False, "FWD_PTC_UNROLL": 12}, "bfloat16", 18432, 128, "col_packed")
    assert (t["L"], t["C"], t["U"], t["byte_sf"]) == (32, 72, 12, False)
    t = _tiling(monkeypatch, {"FWD_PTC_SF_BYTES": False, "FWD_PTC_UNROLL": 3}, "bfloat16", 18432, 128, "col_packed")
    assert t["U"] == 72  # 3 chunks = 6 groups: half a word left over; no other divisor in (2, 3]
    t = _tiling(monkeypatch, {"FWD_PTC_UNROLL": 9}, "bfloat16", 4096, 128, "row")
    assert (t["C"], t["U"]) == (8, 8)


@pytest.mark.compile
@pytest.mark.parametrize("knobs", WIDE_FWD_KNOBS[:3], ids=str)
def test_fwd_ptc_wide_row_source(knobs, monkeypatch):
    """2H = 36864: 256-lane row CTAs with 9 unrolled chunks a lane (default), 64-lane teams with 36 (MAX_CHUNKS=0), or
    a serial loop of 4 iterations of 9 chunks whose loads ahead are guarded (UNROLL=9). Every register-slot index is
    static: no local-memory arrays."""
    _jit.registered()
    src = _knob_source(monkeypatch, knobs, "swiglu_fwd_ptc", K._fwd_ptc_cfg(*WIDE_FWD_CASES[1]))
    body = src[src.index("__launch_bounds__"):]
    if not knobs:
        assert body.startswith("__launch_bounds__(256, 4)") and "for (int j" not in body
    else:
        assert body.startswith("__launch_bounds__(64, 16)")
    if knobs.get("FWD_PTC_UNROLL"):
        assert "for (int j = 0; j < 4; ++j) {" in body and "if (j < 3) {" in body
    else:
        assert "for (int j" not in body
    assert not re.search(r"for \(int (s|si|u|c) ", body)  # stages and slots unrolled (static slot indices)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", WIDE_FWD_KNOBS, ids=str)
@pytest.mark.parametrize("t", (1, 7, 257))
@pytest.mark.parametrize("case", WIDE_FWD_CASES, ids=str)
def test_fwd_ptc_wide_rows_match_reference(case, t, knobs, knob_kernels):
    """2H = 36864 under each wide-row tiling gives the reference's bits (sf, e4m3, clamp counts)."""
    knob_kernels(K, knobs)
    _fwd_check(case, *_fwd_inputs(t, case[0], case[1], case[6], case[7]))


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", WIDE_FWD_KNOBS, ids=str)
@pytest.mark.parametrize("fill", ("zero_blocks", "huge"))
def test_fwd_ptc_wide_rows_adversarial(fill, knobs, knob_kernels):
    knob_kernels(K, knobs)
    case = WIDE_FWD_CASES[1]
    _fwd_check(case, *_fwd_inputs(33, case[0], case[1], case[6], case[7], fill))


# ---- FWD_PTC_UPFRONT: lanes with few chunks issue every load up front ----

# (x dtype, H, npc, col, round_sf, packed, weighted, skip, clamp, count) at 2H = 4096 (4 chunks a lane): the bench's
# round / packed-round rows, and the IEEE-divided row (which changes from 2 to 3 chunks ahead as well)
UPFRONT_FWD_CASES = (
    ("bfloat16", 2048, 128, False, True, False, False, False, None, False),
    ("bfloat16", 2048, 128, True, True, True, False, False, 0.5, False),
    ("bfloat16", 2048, 128, False, False, False, True, True, 0.5, True),
)


def test_fwd_ptc_tiling_upfront(monkeypatch):
    """A lane with at most FWD_PTC_UPFRONT chunks loads them all before its first chunk (D = C - 1); longer walks
    and the whole-row (npc = H) kernel keep FWD_PTC_DEPTH; 0 restores DEPTH everywhere."""
    for args, d in (((2048, 128, "row", True), 3), ((2048, 128, "col_packed", True), 3),
                    ((4096, 128, "row", False), 3),   # 128-lane teams: 4 chunks
                    ((1536, 128, "row", True), 2),    # 3 chunks: DEPTH 2 already loads them all
                    ((4096, 128, "row", True), 2),    # 8 chunks
                    ((1536, 1536, "row", True), 2)):
        t = _tiling(monkeypatch, {"FWD_PTC_UPFRONT": 4}, "bfloat16", args[0], args[1], args[2], args[3])
        assert t["D"] == d, (args, t)
    t = _tiling(monkeypatch, {"FWD_PTC_UPFRONT": 0}, "bfloat16", 2048, 128, "row", True)
    assert (t["L"], t["C"], t["D"]) == (64, 4, 2)


@pytest.mark.compile
@pytest.mark.parametrize("upfront", (4, 0))
def test_fwd_ptc_upfront_source(upfront, monkeypatch):
    """2H = 4096: every one of a lane's 8 vector loads (4 chunks, gate and up) precedes its first exp with
    FWD_PTC_UPFRONT=4 (the default); 0 leaves the 4th chunk's two loads to the second stage."""
    _jit.registered()
    src = _knob_source(monkeypatch, {"FWD_PTC_UPFRONT": upfront}, "swiglu_fwd_ptc",
                       K._fwd_ptc_cfg(*UPFRONT_FWD_CASES[0]))
    body = src[src.index("__launch_bounds__"):]
    first_exp = body.index("expf(")
    assert body.count("= *(uint4*)(X + ") == 8
    assert body[:first_exp].count("= *(uint4*)(X + ") == (8 if upfront else 6)


@pytest.mark.gpu
@pytest.mark.parametrize("upfront", (4, 0))
@pytest.mark.parametrize("t", (1, 7, 4001))
@pytest.mark.parametrize("case", UPFRONT_FWD_CASES, ids=str)
def test_fwd_ptc_upfront_matches_reference(case, t, upfront, knob_kernels):
    """2H = 4096 with all loads up front (FWD_PTC_UPFRONT=4) and two chunks ahead (0): the reference's bits."""
    knob_kernels(K, {"FWD_PTC_UPFRONT": upfront})
    _fwd_check(case, *_fwd_inputs(t, case[0], case[1], case[6], case[7]))


@pytest.mark.gpu
@pytest.mark.parametrize("fill", ("zero_blocks", "huge", "subnormal"))
def test_fwd_ptc_upfront_adversarial(fill, knob_kernels):
    knob_kernels(K, {"FWD_PTC_UPFRONT": 4})
    case = UPFRONT_FWD_CASES[1]
    _fwd_check(case, *_fwd_inputs(129, case[0], case[1], case[6], case[7], fill))
