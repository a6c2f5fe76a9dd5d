"""Kernel tiers for the v1 routing gate top2_sum_gate (moe.md §2.2): compile (sm_90, no GPU), launcher binding
and fallbacks (CPU), and gpu (bit-exact against the reference run on the same CUDA tensors)."""
import subprocess
import sys

import pytest
import torch

from tilefuse import _jit, moe
from tilefuse.moe import _top2_sum_gate_kernel as K
from tilefuse.reference import moe as ref
from tests.moe import configs
from tests.quant.kernel_binding import fake_jit

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOKENS = (1, 7, 4001)
# (E, K, num_groups, num_topk_groups) of the plain configs in configs.top2_sum_gate_configs()
# groups of 32 (256, 384) and of 12 / 2 experts (72 / 64: not aligned lane runs, the kernel's generic group pass)
SHAPES = ((8, 1, 0, 0), (72, 6, 0, 0), (256, 8, 8, 4), (384, 2, 0, 0), (384, 8, 12, 4), (72, 6, 6, 3), (64, 4, 32, 8))
SCORINGS = ("sigmoid", "sqrtsoftplus", "softmax")
# (E, K, G, TG, S, scoring, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, map columns) with every optional
# input; each maps to a config of configs.top2_sum_gate_configs()
OPTION_CASES = (
    (72, 6, 4, 4, 2, "sigmoid", 3, 2, 1, 2, 3),           # G == TG: no group restriction
    (72, 6, 0, 0, 2, "softmax", 2**31 - 7, 1, 0, 1, 4),  # ep_rank + t * 23333 wraps in int32
    (256, 8, 8, 4, 2, "sigmoid", 5, 4, 1, 2, 4),
    (256, 8, 8, 4, 2, "softmax", 0, 3, 2, 3, 3),
    (16, 4, 4, 2, 2, "sqrtsoftplus", 7, 3, 0, 3, 5),
)


def call_args(E, k, G, TG, S, scoring, ep=0, nep=1, tp=0, ntp=1):
    return (k, TG, G, S > 0, S, 1.5, ep, nep, tp, ntp, scoring)


# ------------------------------------------------------------------------------------------------ compile

@pytest.mark.compile
@pytest.mark.parametrize("cfg", configs.top2_sum_gate_configs(), ids=str)
def test_builds_for_sm90(cfg):
    src = _jit.compile_kernel("top2_sum_gate", cfg, "sm_90", export=False).get_kernel_source()
    assert "__global__" in src and "use_fast_math" not in src
    assert "__expf" not in src and "__fdividef" not in src          # IEEE expf and division, as PyTorch's
    assert src.count("device_assert(") == 2 + cfg[9]  # finite logits, fixed routes (dead code if no fix), counts
    if cfg[5] == "softmax":  # the lane sums add stored exp values, like the reference: no fused multiply-add
        assert "den = __fadd_rn(den, expf(" in src
    else:                    # PyTorch's sigmoid lambda, verbatim
        assert ("1.000000e+00*/ / (0x1p+0f/*1.000000e+00*/ + expf(" in src) == (cfg[5] == "sigmoid")


def test_every_test_call_has_a_listed_config():
    """Every call of these tests has its config in tests/moe/configs.py (the compile tier builds them), and the
    registry holds the bench's."""
    cfgs = set(configs.top2_sum_gate_configs())
    for E, k, G, TG in SHAPES:
        for sc in SCORINGS:
            assert K.gate_config(torch.empty(1, E), k, TG, G, 0, sc, None, None, None, None) in cfgs
    t = torch.empty(1, 1)
    for E, k, G, TG, S, sc, *_ in OPTION_CASES:
        assert K.gate_config(torch.empty(1, E), k, TG, G, S, sc, t, t, t, t) in cfgs
    assert (256, 8, 8, 4, 0, "sigmoid", False, False, False, False) in K._configs()   # the bench
    assert (256, 8, 8, 4, 0, "sqrtsoftplus", False, False, False, False) in cfgs


# ------------------------------------------------------------------------------- launcher (CPU tensors)

def make_inputs(E, k, G, TG, S, rows, device="cpu", d=3, options=True, ties=False):
    """Random logits / bias and, with ``options``, a mask, fixed routes (duplicates allowed), a row-strided
    unmapped_topk_idx and a physical map with -1 entries, ids past the physical range and counts past D."""
    if ties:  # few distinct values: ties in scores, rankings and group sums
        logits = torch.randint(-3, 4, (rows, E), device=device).float() * 0.5
        bias = torch.randint(-1, 2, (E,), device=device).float() * 0.25
    else:
        logits = torch.randn(rows, E, device=device) * 2
        bias = torch.randn(E, device=device) * 0.1
    extra = {}
    if options:
        mask = torch.rand(rows, device=device) > 0.2
        logits[~mask] = float("nan")                                          # masked rows are never read
        fix = torch.rand(rows, device=device) > 0.7
        store = torch.full((rows, k + 3), -5, dtype=torch.int64, device=device)
        unmapped = store[:, :k]
        unmapped[fix] = torch.randint(0, E, (int(fix.sum()), k), device=device)
        pmap = torch.randint(-1, E + d + 2, (E + S, d), dtype=torch.int32, device=device)
        count = torch.randint(1, d + 2, (E + S,), dtype=torch.int32, device=device)
        extra = dict(mask=mask, fix_routing_mask=fix, to_physical_map=pmap, logical_count=count,
                     unmapped_topk_idx=unmapped)
    return logits, bias, extra


@pytest.mark.compile
@pytest.mark.parametrize("case", OPTION_CASES, ids=str)
def test_launcher_binds_kernel_parameters(case, monkeypatch):
    E, k, G, TG, S, sc, ep, nep, tp, ntp, d = case
    logits, bias, extra = make_inputs(E, k, G, TG, S, 9, d=d)
    calls = fake_jit(monkeypatch)
    idx, w = K.top2_sum_gate_launch(logits, bias, *call_args(E, k, G, TG, S, sc, ep, nep, tp, ntp), **extra)
    assert idx.shape == w.shape == (9, k + S) and idx.dtype == torch.int64 and w.dtype == torch.float32
    (call,) = calls
    assert call.cfg in configs.top2_sum_gate_configs()
    assert call.env["num_tokens"] == 9 and call.env["unmapped_stride"] == k + 3
    assert call.env["map_rows"] == E + S and call.env["map_cols"] == d


@pytest.mark.compile
def test_launcher_binds_without_options_and_skips_empty(monkeypatch):
    calls = fake_jit(monkeypatch)
    logits, bias, _ = make_inputs(256, 8, 8, 4, 0, 5, options=False)
    K.top2_sum_gate_launch(logits, bias, *call_args(256, 8, 8, 4, 0, "sqrtsoftplus"))
    idx, w = K.top2_sum_gate_launch(logits[:0], bias, *call_args(256, 8, 8, 4, 0, "sqrtsoftplus"))
    assert [c.cfg for c in calls] == [(256, 8, 8, 4, 0, "sqrtsoftplus", False, False, False, False)]
    assert idx.shape == w.shape == (0, 8)


def capture_jit(monkeypatch) -> list:
    """``_jit.get`` replaced by a recorder of the launch arguments (after checking them with ``bind``)."""
    from tests.quant.kernel_binding import bind

    calls = []

    def get(name, cfg):
        func = _jit._FACTORIES[name][0](*cfg)
        return lambda *args: calls.append((bind(func, args), args))

    monkeypatch.setattr(_jit, "get", get)
    return calls


@pytest.mark.compile
def test_launcher_input_layouts(monkeypatch):
    """Layouts the public op accepts but the kernel's binding or 16-byte loads do not: a contiguous logits /
    bias view at an odd element offset (cloned), a mask of another shape that is not contiguous (made so),
    and (K = 1) an unmapped_topk_idx with a non-unit last stride (re-viewed in place: writes still land)."""
    calls = capture_jit(monkeypatch)
    rows, E = 5, 8
    flat = torch.randn(rows * E + E + 1)
    logits, bias = flat[1:1 + rows * E].view(rows, E), flat[rows * E + 1:]
    assert logits.is_contiguous() and logits.data_ptr() % 16 and bias.data_ptr() % 16
    mask = (torch.rand(rows, 2) > 0.3)[:, :1]                          # (T, 1), row stride 2
    store = torch.full((rows, 8), -5, dtype=torch.int64)
    unmapped = store[:, 3::7]                                            # (T, 1), strides (8, 7)
    assert unmapped.shape == (rows, 1) and unmapped.stride() == (8, 7)
    fix = torch.rand(rows) > 0.5
    K.top2_sum_gate_launch(logits, bias, *call_args(E, 1, 0, 0, 0, "softmax"), mask=mask, fix_routing_mask=fix,
                           unmapped_topk_idx=unmapped)
    (env, args), = calls
    x, b, m, _, u = args[:5]
    assert x.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0 and torch.equal(x, logits) and torch.equal(b, bias)
    assert m.is_contiguous() and torch.equal(m.bool(), mask.reshape(rows))
    assert u.data_ptr() == unmapped.data_ptr() and u.stride() == (8, 1) and env["unmapped_stride"] == 8
    aligned = torch.randn(rows, E)
    K.top2_sum_gate_launch(aligned, bias.clone(), *call_args(E, 1, 0, 0, 0, "softmax"), mask=mask,
                           fix_routing_mask=fix, unmapped_topk_idx=unmapped)
    assert calls[1][1][0] is aligned                                     # no copy of aligned input


def test_fallback_checks_the_data_rules():
    """The reference fallback (E > MAX_EXPERTS) keeps the public op's data checks (the kernel's are device
    assertions)."""
    E = K.MAX_EXPERTS + 4
    logits, bias, _ = make_inputs(E, 3, 0, 0, 0, 6, options=False)
    logits[2, 7] = float("inf")
    with pytest.raises(RuntimeError, match="nan or inf"):
        K.top2_sum_gate_launch(logits, bias, *call_args(E, 3, 0, 0, 0, "sigmoid"))
    logits[2, 7] = 0.0
    mask = torch.ones(6, dtype=torch.bool)
    mask[2] = False
    logits[2, 7] = float("nan")                                          # masked rows are not checked
    K.top2_sum_gate_launch(logits, bias, *call_args(E, 3, 0, 0, 0, "sigmoid"), mask=mask)


# the kernel's lane layout and selection, emulated on the CPU (every lane of one warp as a tensor dim)

def emulate_routes(r, E, k, G, TG):
    """Logical routes (T, K) as the kernel picks them from the ranking scores r (T, E): lane l holds experts
    c*128 + 4l + j; group top-2 by a max/min XOR butterfly, ranks by shuffles (ties -> smaller group), then K
    rounds of per-lane then butterfly arg-max (ties -> smaller index) with a live mask."""
    rows, V = r.size(0), 4 * -(-E // 128)
    lane = torch.arange(32)
    slot = torch.arange(V)
    expert = (slot // 4) * 128 + lane[:, None] * 4 + slot % 4                  # (32, V)
    owned = expert < E
    neg = torch.tensor(float("-inf"))
    rl = torch.where(owned, r[:, expert.clamp(max=E - 1)], neg)               # (T, 32, V)

    def butterfly(vals, merge):
        for o in (16, 8, 4, 2, 1):
            vals = merge(vals, [v[:, lane ^ o] for v in vals])
        return vals

    if G != TG:
        per = E // G
        gs = []
        for g in range(G):
            a1 = a2 = torch.full((rows, 32), float("-inf"))
            for v in range(V):
                inside = (expert[:, v] >= g * per) & (expert[:, v] < (g + 1) * per)
                a2 = torch.where(inside, torch.maximum(a2, torch.minimum(a1, rl[:, :, v])), a2)
                a1 = torch.where(inside, torch.maximum(a1, rl[:, :, v]), a1)
            a1, a2 = butterfly([a1, a2], lambda a, b: [torch.maximum(a[0], b[0]), torch.maximum(
                torch.maximum(a[1], b[1]), torch.minimum(a[0], b[0]))])
            assert torch.equal(a1, a1[:, :1].expand(-1, 32)) and torch.equal(a2, a2[:, :1].expand(-1, 32))
            gs.append(a1[:, 0] + a2[:, 0])
        gs = torch.stack(gs, 1)                                                # (T, G)
        gi = torch.arange(G)
        better = (gs[:, None, :] > gs[:, :, None]) | ((gs[:, None, :] == gs[:, :, None]) & (gi < gi[:, None]))
        kept = better.sum(2) < TG                                              # (T, G)
        grp = (expert // per).clamp(max=G - 1)
        rl = torch.where(kept[:, grp] & owned, rl, neg)
    live = owned.expand(rows, 32, V).clone()
    sentinel = K._SENTINEL
    routes = []
    for _ in range(k):
        bv = torch.full((rows, 32), float("-inf"))
        bi = torch.full((rows, 32), sentinel)
        for v in range(V):
            take = live[:, :, v] & ((rl[:, :, v] > bv) | (bi == sentinel))
            bv = torch.where(take, rl[:, :, v], bv)
            bi = torch.where(take, expert[:, v], bi)

        def merge(a, b):
            take = (b[0] > a[0]) | ((b[0] == a[0]) & (b[1] < a[1]))
            return [torch.where(take, b[0], a[0]), torch.where(take, b[1], a[1])]

        bv, bi = butterfly([bv, bi], merge)
        assert torch.equal(bi, bi[:, :1].expand(-1, 32))
        routes.append(bi[:, 0])
        live &= expert != bi[:, :1, None]
    return torch.stack(routes, 1)


@pytest.mark.parametrize("shape", SHAPES + ((16, 4, 4, 2), (96, 8, 3, 2), (1024, 32, 32, 1), (1024, 8, 32, 31),
                                            (64, 32, 32, 16), (1024, 5, 0, 0)), ids=str)
@pytest.mark.parametrize("ties", (False, True))
def test_emulated_lane_selection_matches_reference(shape, ties):
    E, k, G, TG = shape
    logits, bias, _ = make_inputs(E, k, G, TG, 0, 64, options=False, ties=ties)
    logits[:2] = 0.0                                                           # all equal
    if ties:
        bias[: E // 2] = 0.0
    store = torch.empty(64, k, dtype=torch.int64)
    ref.top2_sum_gate(logits, bias, *call_args(E, k, G, TG, 0, "sigmoid"), unmapped_topk_idx=store)
    assert torch.equal(emulate_routes(torch.sigmoid(logits) + bias, E, k, G, TG), store)


def test_unsupported_configs_run_the_reference(monkeypatch):
    """E > MAX_EXPERTS and num_tp_ranks * P >= 2^31 fall back to the reference (no kernel launch)."""
    monkeypatch.setattr(_jit, "get", lambda *a: pytest.fail("launched an unsupported config"))
    E = K.MAX_EXPERTS + 4
    logits, bias, _ = make_inputs(E, 3, 0, 0, 0, 6, options=False)
    got = K.top2_sum_gate_launch(logits, bias, *call_args(E, 3, 0, 0, 0, "sigmoid"))
    want = ref.top2_sum_gate(logits, bias, *call_args(E, 3, 0, 0, 0, "sigmoid"))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    logits, bias, _ = make_inputs(16, 2, 0, 0, 0, 6, options=False)
    args = call_args(16, 2, 0, 0, 0, "sigmoid", tp=1, ntp=2**28)
    got = K.top2_sum_gate_launch(logits, bias, *args)
    want = ref.top2_sum_gate(logits, bias, *args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not K.supported((E, 3, 0, 0, 0, "sigmoid", False, False, False, False))
    assert K.supported((384, 8, 12, 4, 0, "softmax", False, False, False, False))


def test_fake_shapes_cpu():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits, bias = torch.empty(5, 72), torch.empty(72)
        idx, w = torch.ops.tilefuse.top2_sum_gate.default(logits, bias, 6, 0, 0, True, 2, 1.0, 0, 1, 0, 1,
                                                          "sigmoid", None, None, None, None, None)
    assert idx.shape == w.shape == (5, 8) and idx.dtype == torch.int64 and w.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------- gpu

def run_both(logits, bias, args, extra):
    """(kernel idx, weights, unmapped), (reference idx, weights, unmapped) on the same inputs."""
    ex_k = dict(extra)
    ex_r = dict(extra)
    if "unmapped_topk_idx" in extra:
        ex_r["unmapped_topk_idx"] = extra["unmapped_topk_idx"].clone()
    got = K.top2_sum_gate_cuda(logits, bias, *args, **ex_k)
    want = ref.top2_sum_gate(logits, bias, *args, **ex_r)
    return (*got, ex_k.get("unmapped_topk_idx")), (*want, ex_r.get("unmapped_topk_idx"))


def assert_same(got, want):
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.dtype == w.dtype and g.shape == w.shape
        if not torch.equal(g, w):
            bad = (g != w).nonzero()[:5].tolist()
            raise AssertionError(f"mismatch at {bad}: got {[g[tuple(b)].item() for b in bad]}, "
                                 f"want {[w[tuple(b)].item() for b in bad]}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", TOKENS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("scoring", SCORINGS)
def test_matches_reference_gpu(scoring, shape, rows, monkeypatch):
    E, k, G, TG = shape
    logits, bias, _ = make_inputs(E, k, G, TG, 0, rows, "cuda", options=False)
    assert_same(*run_both(logits, bias, call_args(E, k, G, TG, 0, scoring), {}))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", ((72, 6, 0, 0), (256, 8, 8, 4), (384, 8, 12, 4)), ids=str)
@pytest.mark.parametrize("scoring", SCORINGS)
def test_ties_gpu(scoring, shape, monkeypatch):
    """Few distinct logits and bias values: ties in scores, group sums and rankings (smaller index wins)."""
    E, k, G, TG = shape
    logits, bias, _ = make_inputs(E, k, G, TG, 0, 4001, "cuda", options=False, ties=True)
    assert_same(*run_both(logits, bias, call_args(E, k, G, TG, 0, scoring), {}))
    zeros = torch.zeros(64, E, device="cuda")                                  # all equal: experts 0..K-1
    idx, _ = K.top2_sum_gate_cuda(zeros, torch.zeros(E, device="cuda"), *call_args(E, k, G, TG, 0, scoring))
    assert torch.equal(idx, ref.top2_sum_gate(zeros, torch.zeros(E, device="cuda"),
                                              *call_args(E, k, G, TG, 0, scoring))[0])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", (1, 7, 4001, 8192))
@pytest.mark.parametrize("case", OPTION_CASES, ids=str)
def test_all_options_gpu(case, rows, monkeypatch):
    """Mask, fixed routes with duplicates, row-strided unmapped_topk_idx, shared slots, physical map (with -1
    and out-of-range ids, counts past D), EP/TP renumbering."""
    E, k, G, TG, S, sc, ep, nep, tp, ntp, d = case
    logits, bias, extra = make_inputs(E, k, G, TG, S, rows, "cuda", d=d)
    got, want = run_both(logits, bias, call_args(E, k, G, TG, S, sc, ep, nep, tp, ntp), extra)
    assert_same(got, want)
    assert torch.equal(extra["unmapped_topk_idx"]._base[:, k:], torch.full((rows, 3), -5, device="cuda"))


@gpu
@pytest.mark.gpu
def test_unmapped_only_gpu(monkeypatch):
    logits, bias, _ = make_inputs(256, 6, 0, 0, 0, 4001, "cuda", options=False)
    store = torch.full((4001, 9), -5, dtype=torch.int64, device="cuda")
    got, want = run_both(logits, bias, call_args(256, 6, 0, 0, 0, "sqrtsoftplus"),
                         {"unmapped_topk_idx": store[:, :6]})
    assert_same(got, want)
    assert torch.equal(got[2], got[0]) and (store[:, 6:] == -5).all()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("scoring", ("sigmoid", "sqrtsoftplus"))
def test_bench_shape_gpu(scoring, monkeypatch):
    logits, bias, _ = make_inputs(256, 8, 8, 4, 0, 8192, "cuda", options=False)
    assert_same(*run_both(logits, bias, call_args(256, 8, 8, 4, 0, scoring), {}))


@gpu
@pytest.mark.gpu
def test_zero_tokens_gpu():
    logits = torch.empty(0, 256, device="cuda")
    idx, w = K.top2_sum_gate_cuda(logits, torch.zeros(256, device="cuda"), *call_args(256, 8, 8, 4, 0, "sigmoid"))
    assert idx.shape == w.shape == (0, 8) and idx.device.type == "cuda"


@gpu
@pytest.mark.gpu
def test_deterministic_and_batch_invariant_gpu():
    logits, bias, _ = make_inputs(256, 8, 8, 4, 0, 4001, "cuda", options=False)
    args = call_args(256, 8, 8, 4, 0, "sqrtsoftplus")
    a = K.top2_sum_gate_cuda(logits, bias, *args)
    b = K.top2_sum_gate_cuda(logits, bias, *args)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for lo, hi in ((0, 1), (1000, 1007), (3990, 4001)):
        part = K.top2_sum_gate_cuda(logits[lo:hi].clone(), bias, *args)
        assert torch.equal(part[0], a[0][lo:hi]) and torch.equal(part[1], a[1][lo:hi])


@gpu
@pytest.mark.gpu
def test_cuda_graph_replay_gpu():
    E, k, G, TG, S, sc, ep, nep, tp, ntp, d = OPTION_CASES[2]
    logits, bias, extra = make_inputs(E, k, G, TG, S, 777, "cuda", d=d)
    args = call_args(E, k, G, TG, S, sc, ep, nep, tp, ntp)
    K.top2_sum_gate_cuda(logits, bias, *args, **{**extra, "unmapped_topk_idx": extra["unmapped_topk_idx"].clone()})
    given = extra["unmapped_topk_idx"].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx, w = K.top2_sum_gate_cuda(logits, bias, *args, **extra)
    new_logits, new_bias, _ = make_inputs(E, k, G, TG, S, 777, "cuda", options=False)
    logits.copy_(torch.where(extra["mask"][:, None], new_logits, logits))
    bias.copy_(new_bias)
    extra["unmapped_topk_idx"].copy_(given)
    graph.replay()
    torch.cuda.synchronize()
    want = ref.top2_sum_gate(logits, bias, *args, **{**extra, "unmapped_topk_idx": given})
    assert_same((idx, w, extra["unmapped_topk_idx"]), (*want, given))


@gpu
@pytest.mark.gpu
def test_torch_compile_fullgraph_gpu():
    E, k, G, TG, S, sc, ep, nep, tp, ntp, d = OPTION_CASES[3]
    logits, bias, extra = make_inputs(E, k, G, TG, S, 301, "cuda", d=d)
    args = call_args(E, k, G, TG, S, sc, ep, nep, tp, ntp)
    given = extra["unmapped_topk_idx"].clone()
    want = ref.top2_sum_gate(logits, bias, *args, **{**extra, "unmapped_topk_idx": given})

    def gate(x, b, m, f, pm, pc, u):
        return K.top2_sum_gate_cuda(x, b, *args, m, f, pm, pc, u)

    def public(x, b, m, f, pm, pc, u):
        return moe.top2_sum_gate(x, b, *args, m, f, pm, pc, u)

    for fn in (gate, public):
        torch._dynamo.reset()
        u = extra["unmapped_topk_idx"].clone()
        u[~extra["fix_routing_mask"]] = -5
        got = torch.compile(fn, fullgraph=True)(logits, bias, extra["mask"], extra["fix_routing_mask"],
                                                extra["to_physical_map"], extra["logical_count"], u)
        assert_same((*got, u), (*want, given))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("shape", ((72, 6, 0, 0), (384, 8, 12, 4)), ids=str)
def test_extreme_logits_gpu(scoring, shape, monkeypatch):
    """Logits spread over +-200: expf overflows and underflows to subnormals (softmax lane sums of
    subnormal exp values: no fused multiply-add), softplus takes its x > 20 branch, sigmoid saturates."""
    E, k, G, TG = shape
    logits = torch.randn(4001, E, device="cuda") * 60
    logits[::3] = logits[::3].clamp(-200, 200)
    logits[1::3, : E // 2] -= 95                                        # x - max < -87: subnormal exp values
    bias = torch.randn(E, device="cuda") * 0.1
    assert_same(*run_both(logits, bias, call_args(E, k, G, TG, 0, scoring), {}))


@gpu
@pytest.mark.gpu
def test_input_layouts_gpu(monkeypatch):
    """Odd-offset logits / bias (16-byte loads), a non-contiguous (T, 1) mask and a K = 1 unmapped_topk_idx
    with a non-unit last stride, against the reference on the same views."""
    rows, E = 4001, 8
    flat = torch.randn(rows * E + E + 1, device="cuda") * 2
    logits, bias = flat[1:1 + rows * E].view(rows, E), flat[rows * E + 1:]
    mask = (torch.rand(rows, 2, device="cuda") > 0.2)[:, :1]
    store = torch.full((rows, 8), -5, dtype=torch.int64, device="cuda")
    fix = torch.rand(rows, device="cuda") > 0.7
    store[fix, 3] = torch.randint(0, E, (int(fix.sum()),), device="cuda")
    extra = dict(mask=mask, fix_routing_mask=fix, unmapped_topk_idx=store[:, 3::7])
    got, want = run_both(logits, bias, call_args(E, 1, 0, 0, 0, "softmax"), extra)
    assert_same(got, want)
    kept = torch.ones(8, dtype=torch.bool)
    kept[3] = False
    assert (store[:, kept] == -5).all()


_ASSERT_CASES = {
    "clean": "",                                                     # masked rows may hold NaN
    "nonfinite": "logits[5, 3] = float('inf')",
    "fixed_negative": "fix[9] = True; unmapped[9, 2] = -1",
    "fixed_too_large": "fix[9] = True; unmapped[9, 0] = E",
    "zero_count": "count[E + 1] = 0",
}
_ASSERT_SCRIPT = """
import sys, torch
from tilefuse.moe import _top2_sum_gate_kernel as K
E, k, rows = 72, 6, 40
logits = torch.randn(rows, E, device="cuda")
mask = torch.ones(rows, dtype=torch.bool, device="cuda")
mask[7] = False
logits[7] = float("nan")
fix = torch.zeros(rows, dtype=torch.bool, device="cuda")
unmapped = torch.zeros(rows, k, dtype=torch.int64, device="cuda")
count = torch.ones(E + 2, dtype=torch.int32, device="cuda")
pmap = (torch.arange(3 * (E + 2), dtype=torch.int32, device="cuda") % (E + 2)).view(E + 2, 3)
exec(sys.argv[1])
K.top2_sum_gate_cuda(logits, torch.zeros(E, device="cuda"), k, 0, 0, True, 2, 1.0, 0, 1, 0, 1, "sigmoid",
                     mask, fix, pmap, count, unmapped)
torch.cuda.synchronize()
print("clean run")
"""


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(_ASSERT_CASES))
def test_device_asserts_gpu(case):
    """The data rules of §2.2 step 13 abort the kernel (device_assert; a fresh process per case, since an
    assertion poisons the CUDA context); the script without a fault runs clean."""
    res = subprocess.run([sys.executable, "-c", _ASSERT_SCRIPT, _ASSERT_CASES[case]], capture_output=True,
                         text=True, timeout=300)
    if case == "clean":
        assert res.returncode == 0 and "clean run" in res.stdout, res.stderr[-2000:]
    else:
        assert res.returncode != 0 and "clean run" not in res.stdout, res.stdout
        assert "Assertion `cond` failed" in res.stdout + res.stderr, res.stderr[-2000:]
