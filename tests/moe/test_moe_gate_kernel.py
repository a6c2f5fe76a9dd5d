"""TileLang kernels of the v2.1 gate (moe.md §2.13, §2.14): compile (sm_90, no GPU), launcher binding (CPU) and
gpu (bit-exact against the reference run on the same CUDA tensors)."""
import pytest
import torch

from tilefuse import _jit
from tilefuse import moe
from tilefuse.moe import _moe_gate_kernel as G
from tilefuse.reference import moe as ref
from tilefuse.testing.numeric import calc_diff
from tests.moe.configs import MOE_GATE_BACKWARD, MOE_GATE_FORWARD
from tests.moe.models import backward_model, sqrt_softplus_grad32
from tests.quant.kernel_binding import fake_jit

TOKENS = (0, 1, 7, 4001, 8192)
SHAPES = ((8, 1), (72, 2), (256, 6), (384, 8))          # (E_r, K)
ALL_BUT_RANDOM = "bias,fix,image,map,mask,scores,unmapped"
ALL = "bias,fix,image,map,mask,random,scores,unmapped"
FP32, I64, I32, BOOL = torch.float32, torch.int64, torch.int32, torch.bool


# ------------------------------------------------------------------------------------------------ compile

@pytest.mark.compile
@pytest.mark.parametrize("name,cfg", [("moe_topk_gate_forward", c) for c in MOE_GATE_FORWARD]
                         + [("moe_topk_gate_backward", c) for c in MOE_GATE_BACKWARD], ids=str)
def test_builds_for_sm90(name, cfg):
    import tilelang

    kernel = tilelang.compile(_jit._FACTORIES[name][0](*cfg), target={"kind": "cuda", "arch": "sm_90"},
                              execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS))
    src = kernel.get_kernel_source()
    assert "__global__" in src and "use_fast_math" not in src
    assert "atomic" not in src                                           # deterministic: no atomics at all


def test_configs_cover_the_tests():
    """The GPU tests' launches are listed in tests/moe/configs.py (the compile tier builds them)."""
    fwd, bwd = set(MOE_GATE_FORWARD), set(MOE_GATE_BACKWARD)
    for e, k in SHAPES:
        assert (e, k, 0, "bias") in fwd and (e, k, False) in bwd and (e, k, True) in bwd
    assert {(30, 3, False), (30, 3, True), (30, 1, False), (30, 1, True)} <= bwd      # odd E_r; K = 0 -> 1
    assert (72, 6, 1, "fix,map,mask,random,unmapped") in fwd
    for cfg in ((256, 8, 0, "bias,scores"), (72, 6, 2, ALL_BUT_RANDOM), (256, 8, 1, ALL), (64, 6, 0, "random"),
                (32, 2, 0, "")):
        assert cfg in fwd


def _key_model(r: torch.Tensor) -> torch.Tensor:
    """tfg_key of the kernel: ordered float bits (high word), 0xffff - expert (low word)."""
    b = r.view(torch.int32).to(torch.int64)
    b = torch.where(b >= 0, b, b ^ 0x7FFFFFFF)
    return b * 2 ** 32 + (0xFFFF - torch.arange(r.size(1)))


def test_topk_key_order_is_the_stable_sort_cpu():
    """The kernel's top-k (K arg-maxes of unique 64-bit keys) equals the reference's stable descending sort,
    with heavy ties, +-inf and +0 (a ranking score u + b is never -0: u >= +0)."""
    vals = torch.tensor([float("-inf"), -3.5, -1.0, -2.0 ** -140, 0.0, 2.0 ** -149, 1.0, 1.0 + 2.0 ** -23,
                         float("inf")])
    r = vals[torch.randint(0, len(vals), (512, 72))]
    want = ref.stable_topk(r, 32)
    got = torch.sort(_key_model(r), dim=1, descending=True).indices[:, :32]
    assert torch.equal(got, want)


def _forward_inputs(rows, experts, k, s, device="cpu", flags=ALL):
    fl = set(flags.split(","))
    g = dict(device=device)
    logits = 2 * torch.randn(rows, experts, **g)
    kw = {}
    if "bias" in fl:
        kw["bias"] = 0.1 * torch.randn(experts, **g)
    if "image" in fl:
        kw["image_bias"] = 0.1 * torch.randn(experts, **g)
        kw["image_token_mask"] = torch.rand(rows, **g) > 0.5
    if "mask" in fl:
        kw["mask"] = torch.rand(rows, **g) > 0.2
    if "unmapped" in fl:                                                 # rows apart by K + 3 (unit last stride)
        kw["unmapped_topk_idx"] = torch.randint(0, experts, (rows, k + 3), **g)[:, :k]
    if "fix" in fl:
        kw["fix_routing_mask"] = torch.rand(rows, **g) > 0.7
    if "map" in fl:
        kw["to_physical_map"] = torch.randint(0, 1000, (experts + s, 3), dtype=I32, **g)
        kw["logical_count"] = torch.randint(1, 5, (experts + s,), dtype=I32, **g)   # 4 > 3 columns: physical 0
    if "random" in fl:
        kw["force_random"] = torch.rand(rows, **g) > 0.6
    if "scores" in fl:
        kw["scores"] = torch.full((rows, experts), float("nan"), **g)
    return logits, kw


@pytest.mark.parametrize("flags", ["bias", "", "random", ALL_BUT_RANDOM, ALL])
@pytest.mark.parametrize("given_out", [False, True])
def test_forward_launcher_binds_kernel_parameters(flags, given_out, monkeypatch):
    """The launcher's arguments fit the prim_func of the config it asks for (dummies for absent tensors)."""
    calls = fake_jit(monkeypatch)
    rows, experts, k, s = 5, 72, 6, 2 if "map" in flags else 0
    logits, kw = _forward_inputs(rows, experts, k, s, flags=flags or "none")
    out = None
    if given_out:                                                        # strided out pair (a column slice)
        out = (torch.empty(rows, 2 * (k + s), dtype=I64)[:, ::2], torch.empty(k + s, rows).t())
    idx, w = G.moe_topk_gate_forward_cuda(logits, k, s > 0, s, 1.5, 3, "sqrtsoftplus", out=out, **kw)
    assert len(calls) == 1 and calls[0].cfg == (experts, k, s, flags)
    assert calls[0].env["num_tokens"] == rows and idx.shape == w.shape == (rows, k + s)
    if given_out:
        assert idx is out[0] and w is out[1]
    empty = G.moe_topk_gate_forward_cuda(logits[:0], k, False, 0, 1.0, 0)
    assert len(calls) == 1 and empty[0].shape == (0, k)                  # T = 0: no launch


@pytest.mark.parametrize("aux", [False, True])
@pytest.mark.parametrize("experts,k", ((72, 6), (30, 3), (72, 0)))
def test_backward_launcher_binds_kernel_parameters(experts, k, aux, monkeypatch):
    """K = 0 launches the K = 1 kernel with one -1 slot; E_r above the kernel's limit runs the reference."""
    calls = fake_jit(monkeypatch)
    rows = 8
    scores, idx = torch.rand(rows, experts), torch.randint(-1, experts, (rows, k))
    w, g = torch.rand(rows, k), torch.randn(rows, k)
    extra = dict(mask=torch.rand(rows) > 0.5, grad_scores_sum=torch.randn(2, experts)) if aux else {}
    out = G.moe_topk_gate_backward_cuda(scores, idx, w, g, 1.5, **extra)
    assert len(calls) == 1 and calls[0].cfg == (experts, max(k, 1), aux) and out.shape == (rows, experts)
    assert calls[0].env["num_tokens"] == rows
    wide = G._MAX_EXPERTS + 4
    scores = torch.rand(rows, wide)
    extra = dict(mask=torch.rand(rows) > 0.5, grad_scores_sum=torch.randn(2, wide)) if aux else {}
    got = G.moe_topk_gate_backward_cuda(scores, idx, w, g, 1.5, **extra)
    assert len(calls) == 1
    assert torch.equal(got, ref.moe_topk_gate_backward(scores, idx, w, g, 1.5, **extra))


def test_seed_words_cpu():
    """ep_rank mod 2^64 as two signed int32 words (low, high), the kernel's Philox key scalars."""
    assert G._seed_words(0) == (0, 0) and G._seed_words(3) == (3, 0)
    assert G._seed_words(2 ** 33 + 7) == (7, 2)
    assert G._seed_words(2 ** 63 + 2 ** 31) == (-(2 ** 31), -(2 ** 31))
    assert G._seed_words(2 ** 64 - 1) == (-1, -1) and G._seed_words(2 ** 64 + 5) == (5, 0)


def test_forward_wide_rows_run_the_reference_cpu(monkeypatch):
    calls = fake_jit(monkeypatch)
    logits, kw = _forward_inputs(5, G._MAX_EXPERTS + 4, 6, 1, flags=ALL)
    out = (torch.empty(5, 7, dtype=I64), torch.empty(5, 7))
    got = G.moe_topk_gate_forward_cuda(logits, 6, True, 1, 1.5, 3, "sqrtsoftplus", out=out, **kw)
    want = ref.moe_topk_gate_forward(logits, 6, True, 1, 1.5, 3, "sqrtsoftplus",
                                     **dict(kw, scores=kw["scores"].clone(),
                                            unmapped_topk_idx=kw["unmapped_topk_idx"].clone()))
    assert not calls and got[0] is out[0] and got[1] is out[1]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])



def test_fake_ops_cpu():
    """The torch.library ops trace under FakeTensorMode (what torch.compile runs): outputs are written in place."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, b = torch.empty(5, 72, device="cuda"), torch.empty(72, device="cuda")
        idx, w = torch.empty(5, 6, dtype=I64, device="cuda"), torch.empty(5, 6, device="cuda")
        assert torch.ops.tilefuse.moe_topk_gate_forward(x, 6, 0, 1.5, 3, None, b, None, None, None, None, None, None,
                                                        None, idx, w, None) is None
        out = torch.empty(5, 72, device="cuda")
        assert torch.ops.tilefuse.moe_topk_gate_backward(x, idx, w, w, 1.5, None, None, out) is None


# ---------------------------------------------------------------------------------------------------- gpu

def _cuda_inputs(rows, experts, k, s, flags, ties=False):
    logits, kw = _forward_inputs(rows, experts, k, s, device="cuda", flags=flags)
    if ties:                                                             # few distinct values: many ties
        logits = torch.randint(-2, 3, (rows, experts), device="cuda").float()
        if "bias" in kw:
            kw["bias"] = torch.randint(0, 2, (experts,), device="cuda").float() * 0.5
    return logits, kw


def _clone_strided(t):
    """A copy with t's strides (clone() makes a column slice contiguous)."""
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _run_both(logits, k, s, rsf, ep_rank, kw, out=False):
    """(kernel outputs, reference outputs): idx, weights, unmapped, scores (None where absent)."""
    results = []
    for fn in (G.moe_topk_gate_forward_cuda, ref.moe_topk_gate_forward):
        mine = {n: (_clone_strided(t) if n in ("unmapped_topk_idx", "scores") else t) for n, t in kw.items()}
        extra = {}
        if out:                                                          # strided: every other column, transposed
            rows = logits.size(0)
            idx_buf = torch.full((rows, 2 * (k + s)), 12345, dtype=I64, device="cuda")
            extra["out"] = (idx_buf[:, 1::2], torch.full((k + s, rows), float("nan"), device="cuda").t())
        idx, w = fn(logits, k, s > 0, s, rsf, ep_rank, "sqrtsoftplus", **mine, **extra)
        if out:
            assert idx is extra["out"][0] and w is extra["out"][1]
            assert (idx_buf[:, 0::2] == 12345).all()                     # nothing written between the columns
        results.append((idx, w, mine.get("unmapped_topk_idx"), mine.get("scores")))
    return results


def _assert_same(got, want):
    for a, b in zip(got, want):
        if a is None or b is None:
            assert a is None and b is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), (a != b).nonzero()[:8].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", TOKENS)
@pytest.mark.parametrize("experts,k", SHAPES)
def test_forward_matches_reference(rows, experts, k):
    logits, kw = _cuda_inputs(rows, experts, k, 0, "bias")
    got, want = _run_both(logits, k, 0, 2.5, 0, kw)
    _assert_same(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", (1, 7, 4001))
def test_forward_ties_pick_smaller_index(rows):
    logits, kw = _cuda_inputs(rows, 32, 2, 0, "", ties=True)
    got, want = _run_both(logits, 2, 0, 1.0, 0, kw)
    _assert_same(got, want)
    logits, kw = _cuda_inputs(rows, 256, 8, 0, "bias", ties=True)
    got, want = _run_both(logits, 8, 0, 1.0, 0, kw)
    _assert_same(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", (1, 7, 4001, 92100))                 # 92100: the int32 wrap of the replica
@pytest.mark.parametrize("out", [False, True])
def test_forward_all_features(rows, out):
    """Bias, image bias, mask, fixed routes, map with replica columns past the map, S = 2, out, unmapped,
    scores (NaN-poisoned), ep_rank 5."""
    logits, kw = _cuda_inputs(rows, 72, 6, 2, ALL_BUT_RANDOM)
    logits[~kw["mask"]] = float("nan")                                   # masked rows are never read
    got, want = _run_both(logits, 6, 2, 1.5, 5, kw, out=out)
    _assert_same(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", (1, 7, 4001))
@pytest.mark.parametrize("ep_rank", (0, 3, 2**33 + 7))
def test_forward_random_routing(rows, ep_rank):
    logits, kw = _cuda_inputs(rows, 256, 8, 1, ALL)
    kw["mask"][0] = False
    kw["force_random"][0] = True                                         # masked beats random
    got, want = _run_both(logits, 8, 1, 1.5, ep_rank, kw)
    _assert_same(got, want)
    logits, kw = _cuda_inputs(rows, 64, 6, 0, "random")
    got, want = _run_both(logits, 6, 0, 1.0, ep_rank, kw)
    _assert_same(got, want)


def _shifted(t):
    """A contiguous copy of t whose data starts 4 bytes into its storage (not 16-byte aligned)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    return buf[1:].view(t.shape).copy_(t)


@pytest.mark.gpu
def test_forward_unaligned_views():
    """Logits and scores at a 4-byte storage offset (the kernel's 16-byte accesses go through aligned copies)."""
    logits, kw = _cuda_inputs(7, 72, 6, 2, ALL_BUT_RANDOM)
    got, want = _run_both(logits, 6, 2, 1.5, 5, kw)
    _assert_same(got, want)
    scores = _shifted(torch.full_like(logits, float("nan")))
    mine = dict(kw, scores=scores, unmapped_topk_idx=kw["unmapped_topk_idx"].clone())
    idx, w = G.moe_topk_gate_forward_cuda(_shifted(logits), 6, True, 2, 1.5, 5, **mine)
    _assert_same((idx, w, mine["unmapped_topk_idx"], scores), want)


@pytest.mark.gpu
@pytest.mark.parametrize("experts,k,s,with_bias", [(256, 8, 0, True), (72, 6, 2, False), (8, 1, 1, True)])
def test_forward_fast_path(experts, k, s, with_bias):
    """A plain eager call (logits, at most a bias) validates once, then takes the native plan: equal to the
    reference at every token count (the count is free) and at an unaligned start; other facts validate again
    (a bad bias still raises)."""
    G._FAST.clear()
    bias = torch.randn(experts, device="cuda") if with_bias else None
    for rows in (1, 7, 4001, 0, 1):
        logits = torch.randn(rows, experts, device="cuda") * 2
        got = moe.moe_topk_gate_forward(logits, k, s > 0, s, 1.5, 3, bias=bias)
        want = ref.moe_topk_gate_forward(logits, k, s > 0, s, 1.5, 3, bias=bias)
        _assert_same(got, want)
    assert len(G._FAST) == 1 and type(next(iter(G._FAST.values()))).__module__ == "tilefuse_native"
    logits = _shifted(torch.randn(7, experts, device="cuda"))
    _assert_same(moe.moe_topk_gate_forward(logits, k, s > 0, s, 1.5, 3, bias=bias),
                 ref.moe_topk_gate_forward(logits, k, s > 0, s, 1.5, 3, bias=bias))
    with pytest.raises(ValueError, match="bias"):
        moe.moe_topk_gate_forward(logits, k, s > 0, s, 1.5, 3, bias=torch.randn(experts + 4, device="cuda"))
    with pytest.raises((ValueError, TypeError), match="num_topk"):
        moe.moe_topk_gate_forward(logits, experts + 1, s > 0, s, 1.5, 3, bias=bias)


@pytest.mark.gpu
def test_forward_fast_path_under_graph_capture():
    """The native plan of a validated plain call captures and replays (outputs from the graph's pool, the launch on
    the capture stream)."""
    bias = torch.randn(256, device="cuda")
    logits = torch.randn(7, 256, device="cuda")
    moe.moe_topk_gate_forward(logits, 8, False, 0, 2.5, 0, bias=bias)                # validated and loaded first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx, w = moe.moe_topk_gate_forward(logits, 8, False, 0, 2.5, 0, bias=bias)
    logits.copy_(2 * torch.randn_like(logits))
    graph.replay()
    _assert_same((idx, w), ref.moe_topk_gate_forward(logits, 8, False, 0, 2.5, 0, bias=bias))


@pytest.mark.gpu
def test_forward_wide_rows_use_reference():
    """E_r above the kernel's limit: the reference on the same tensors (into out)."""
    logits, kw = _cuda_inputs(7, G._MAX_EXPERTS + 4, 6, 0, "bias,scores")
    got, want = _run_both(logits, 6, 0, 1.5, 0, kw, out=True)
    _assert_same(got, want)


@pytest.mark.gpu
def test_forward_random_spec_example():
    """moe.md §3.2: E_r = 64, K = 6, S = 0, ep_rank = 0, token 0."""
    idx, w = G.moe_topk_gate_forward_cuda(torch.randn(1, 64, device="cuda"), 6, False, 0, 1.0, 0,
                                          force_random=torch.tensor([True], device="cuda"))
    assert idx.tolist() == [[13, 20, 57, 53, 7, 18]]
    assert torch.allclose(w.cpu(), torch.tensor([[0.399046, 0.516679, 0.024930, 0.940079, 0.945854, 0.796731]]),
                          rtol=0, atol=1e-6)


def _bench_forward(logits, bias, scores):
    return G.moe_topk_gate_forward_cuda(logits, 8, False, 0, 2.5, 0, "sqrtsoftplus", bias=bias, scores=scores)


@pytest.mark.gpu
def test_forward_deterministic_and_batch_invariant():
    logits, kw = _cuda_inputs(8192, 256, 8, 0, "bias")
    scores = torch.empty_like(logits)
    a = _bench_forward(logits, kw["bias"], scores)
    s_a = scores.clone()
    b = _bench_forward(logits, kw["bias"], scores)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(s_a, scores)
    for lo, hi in ((0, 1), (1000, 1007), (4001, 8192)):
        part_scores = torch.empty(hi - lo, 256, device="cuda")
        part = _bench_forward(logits[lo:hi].clone(), kw["bias"], part_scores)
        assert torch.equal(part[0], a[0][lo:hi]) and torch.equal(part[1], a[1][lo:hi])
        assert torch.equal(part_scores, s_a[lo:hi])


@pytest.mark.gpu
def test_forward_cuda_graph():
    logits, kw = _cuda_inputs(4001, 256, 8, 0, "bias")
    scores = torch.empty_like(logits)
    _bench_forward(logits, kw["bias"], scores)                           # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx, w = _bench_forward(logits, kw["bias"], scores)
    logits.copy_(2 * torch.randn_like(logits))
    graph.replay()
    want_scores = torch.empty_like(scores)
    want = ref.moe_topk_gate_forward(logits, 8, False, 0, 2.5, 0, bias=kw["bias"], scores=want_scores)
    assert torch.equal(idx, want[0]) and torch.equal(w, want[1]) and torch.equal(scores, want_scores)


@pytest.mark.gpu
def test_forward_torch_compile_fullgraph():
    logits, kw = _cuda_inputs(4001, 256, 8, 0, "bias")

    def f(x, b):
        return moe.moe_topk_gate_forward(x, 8, False, 0, 2.5, 0, "sqrtsoftplus", bias=b)

    def g(x, b):
        return G.moe_topk_gate_forward_cuda(x, 8, False, 0, 2.5, 0, "sqrtsoftplus", bias=b)

    want = ref.moe_topk_gate_forward(logits, 8, False, 0, 2.5, 0, bias=kw["bias"])
    for fn in (f, g):
        got = torch.compile(fn, fullgraph=True)(logits, kw["bias"])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ----------------------------------------------------------------------------------------------- backward

def _backward_inputs(rows, experts, k, aux, device="cuda"):
    """A forward's scores / unmapped indices / routed weights, with -1 slots, pairs and (K >= 3) triples of
    duplicated experts (fixed routes)."""
    g = dict(device=device)
    logits = 2 * torch.randn(rows, experts, **g)
    mask = torch.rand(rows, **g) > 0.2
    fix = torch.rand(rows, **g) > 0.8
    unmapped = torch.randint(0, experts, (rows, k), **g)
    if k >= 2:
        unmapped[:, 1] = torch.where(torch.rand(rows, **g) > 0.5, unmapped[:, 0], unmapped[:, 1])
    if k >= 3:
        unmapped[:, 2] = torch.where(torch.rand(rows, **g) > 0.7, unmapped[:, 0], unmapped[:, 2])
    scores = torch.empty(rows, experts, **g)
    _, w = ref.moe_topk_gate_forward(logits, k, False, 0, 1.5, 0, "sqrtsoftplus", mask, fix_routing_mask=fix,
                                     unmapped_topk_idx=unmapped, scores=scores)
    idx = unmapped.clone()
    if k >= 2:
        idx[:, -1] = torch.where(torch.rand(rows, **g) > 0.7, -1, idx[:, -1])
    grad = torch.randn(rows, k, **g)
    extra = {}
    if aux:
        seqs = 4 if rows % 4 == 0 else 1
        extra = dict(mask=mask, grad_scores_sum=torch.randn(seqs, experts, **g))
    return scores, idx, w.contiguous(), grad, extra


def _backward_tolerance(scores, idx, w, grad, rho, got, want, mask=None, grad_scores_sum=None):
    """Per-element bound on |got - want| for the kernel's evaluation of the backward against the fp64
    reference (any summation orders), each rounded once to fp32: one fp32 ulp (two half-ulp roundings), twice
    the fp64 error bound gamma_n * phi(u_e) * M_e, with M_e the sum of the absolute values the element's
    gradient before phi is built from (standard bounds: a sum of n terms errs by at most gamma_(n-1) times
    their absolute sum; n = 4 (K + E) + 32 covers every rounding of the routing and auxiliary terms and of the
    reference's phi), plus the kernel's fp32 phi: u*u (2^-24; the derivative's relative condition in u^2 is
    below 1), expm1f (1 ulp: 2^-23 of a value in (-1, 0]) and the division (2^-24) compose to 2^-22 (1 + 2^-21)
    relative, and below 2^-60 an absolute 2^-150 (u / 2 rounded into the subnormals)."""
    f64 = torch.float64
    rows, experts = scores.shape
    u = scores.to(f64)
    valid = idx >= 0
    col = idx.clamp(0, experts - 1)
    zero = torch.zeros((), dtype=f64, device=u.device)
    g = torch.where(valid, grad.to(f64), zero)
    u_k = torch.where(valid, u.gather(1, col), zero)
    absdot = (g * w.to(f64)).abs().sum(1, keepdim=True)
    slot = torch.where(valid, (abs(rho) * g.abs() + absdot) / (u_k.sum(1, keepdim=True) + ref.EPS), zero)
    m = torch.zeros_like(u).scatter_add_(1, col, slot)
    if grad_scores_sum is not None:
        seq = torch.arange(rows, device=u.device) // max(rows // grad_scores_sum.size(0), 1)
        h = grad_scores_sum.to(f64)[seq]
        inv = torch.where(mask.reshape(-1, 1), 1.0 / u.sum(1, keepdim=True), zero)
        m = m + (h.abs() + (h * u).abs().sum(1, keepdim=True) * inv) * inv
    n = 4 * (idx.size(1) + experts) + 32
    gamma = n * 2.0 ** -53 / (1 - n * 2.0 ** -53)
    big = torch.maximum(got.abs(), want.abs())
    ulp = (torch.nextafter(big, torch.full_like(big, float("inf"))) - big).to(f64)
    phi = ref.sqrt_softplus_grad(u)
    return ulp + (2 * gamma + 2.0 ** -22 * (1 + 2.0 ** -21) * (1 + gamma)) * phi * m + 2.0 ** -150 * m


def _assert_close_to_reference(got, want, tol):
    """NaN / inf where the reference has them, every finite element within the derived bound."""
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    fin = torch.isfinite(want)
    assert torch.equal(got[~fin & ~want.isnan()], want[~fin & ~want.isnan()])
    err = (got.to(torch.float64) - want.to(torch.float64)).abs()
    bad = fin & (err > tol)
    assert not bad.any(), (bad.nonzero()[:8].tolist(), err[bad][:8].tolist(), tol[bad][:8].tolist())


def _bits(x):
    return x.view(torch.int32)


@pytest.mark.parametrize("aux", [False, True])
@pytest.mark.parametrize("rows", (1, 7, 257))
@pytest.mark.parametrize("experts,k", SHAPES + ((32, 32),))
def test_backward_model_matches_reference_cpu(rows, experts, k, aux):
    """The kernel's arithmetic (backward_model) against the fp64 reference: within the derived bound, and
    calc_diff (moe.md §3.1) far below the 1e-10 class moe.md §3.2 asks for."""
    scores, idx, w, grad, extra = _backward_inputs(rows, experts, k, aux, device="cpu")
    got = backward_model(scores, idx, w, grad, 1.5, **extra)
    want = ref.moe_topk_gate_backward(scores, idx, w, grad, 1.5, "sqrtsoftplus", **extra)
    assert got.dtype == torch.float32 and got.shape == want.shape
    _assert_close_to_reference(got, want, _backward_tolerance(scores, idx, w, grad, 1.5, got, want, **extra))
    assert calc_diff(got, want) < 1e-12
    # masked / random tokens of the forward (zero scores, -1 routes) get exactly zero
    dead = ~(idx >= 0).any(1)
    assert not got[dead].any()


def _scores_of_every_magnitude(scores, device):
    """The forward's scores replaced by 2^-70 .. 2^70 and, in every 7th row, 0, -0, subnormals, the edges of the
    derivative's fast range, 2^-60 and inf; the forward's zero rows (masked, random) stay zero."""
    rows, experts = scores.shape
    wide = torch.exp2(torch.empty(rows, experts, device=device).uniform_(-70, 70))
    specials = torch.tensor([0.0, -0.0, 1e-45, 1e-39, 2.0 ** -40, 2.0 ** 40, 2.0 ** -60, float("inf")],
                            device=device)
    wide[::7, :8] = specials
    return torch.where(scores > 0, wide, scores)


@pytest.mark.parametrize("aux", [False, True])
def test_backward_model_matches_reference_at_every_magnitude_cpu(aux):
    """The model the GPU tests of extreme magnitudes, unaligned views and graphs/compile hold the kernel to, against
    the fp64 reference on the same extreme scores (2^-70 .. 2^70, subnormals, +-0, inf): NaN and inf where the
    reference has them, every finite element within the derived bound."""
    rows, experts = 203, 256
    scores, idx, w, grad, extra = _backward_inputs(rows, experts, 8, aux, device="cpu")
    scores = _scores_of_every_magnitude(scores, "cpu")
    assert (scores == float("inf")).any() and ((scores > 0) & (scores < 2.0 ** -126)).any()
    got = backward_model(scores, idx, w, grad, 1.5, **extra)
    want = ref.moe_topk_gate_backward(scores, idx, w, grad, 1.5, "sqrtsoftplus", **extra)
    tol = _backward_tolerance(scores, idx, w, grad, 1.5, got, want, **extra)
    _assert_close_to_reference(got, want, tol)
    finite = torch.isfinite(want)
    assert torch.isfinite(tol[finite]).float().mean() > 0.5      # most rows hold no inf: a real bound there
    assert (want[finite] != 0).any()


def test_backward_model_order_is_its_own():
    """backward_model sums the K slots in the documented butterfly order, not sequentially: with g_k w_k =
    (1, 2^-53, 0, 2^-53) the butterfly gives (1 + 0) + (2^-53 + 2^-53) = 1 + 2^-52, a sequential sum 1."""
    k, experts = 4, 8
    scores = torch.ones(1, experts)
    idx = torch.arange(k)[None]
    w = torch.tensor([[1.0, 2.0 ** -29, 0.0, 2.0 ** -29]])
    g = torch.tensor([[1.0, 2.0 ** -24, 2.0 ** -24, 2.0 ** -24]])
    got = backward_model(scores, idx, w, g, 1.0)
    phi = sqrt_softplus_grad32(torch.tensor(1.0)).double()
    for dot, same in ((1.0 + 2.0 ** -52, True), (1.0, False)):
        want = (phi * (g[0].double() - dot) / (4.0 + ref.EPS)).float()
        assert torch.equal(got[0, :k], want) == same
    assert not got[0, k:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("aux", [False, True])
@pytest.mark.parametrize("rows", TOKENS)
@pytest.mark.parametrize("experts,k", SHAPES)
def test_backward_matches_reference(rows, experts, k, aux):
    """Bit-exact against the kernel's own order (backward_model on the same device), and within the derived
    fp64-then-fp32 bound of the reference (whose torch reductions have no fixed order)."""
    scores, idx, w, grad, extra = _backward_inputs(rows, experts, k, aux)
    out = torch.full((rows, experts), float("nan"), device="cuda")
    got = G.moe_topk_gate_backward_cuda(scores, idx, w, grad, 1.5, "sqrtsoftplus", out=out, **extra)
    assert got is out
    model = backward_model(scores, idx, w, grad, 1.5, **extra)
    assert torch.equal(_bits(got), _bits(model)), (got != model).nonzero()[:8].tolist()
    want = ref.moe_topk_gate_backward(scores, idx, w, grad, 1.5, "sqrtsoftplus", **extra)
    _assert_close_to_reference(got, want, _backward_tolerance(scores, idx, w, grad, 1.5, got, want, **extra))
    fresh = G.moe_topk_gate_backward_cuda(scores, idx, w, grad, 1.5, "sqrtsoftplus", **extra)
    assert torch.equal(_bits(fresh), _bits(got))                         # deterministic, fresh output


@pytest.mark.gpu
def test_backward_scores_of_every_magnitude():
    """The fp32 derivative on scores from 2^-70 to 2^70 (both sides of every range the kernel's derivative
    schedules distinguish), 0, -0, subnormals and inf: the kernel's bits are backward_model's."""
    rows, experts = 4001, 256
    scores, idx, w, grad, extra = _backward_inputs(rows, experts, 8, True)
    scores = _scores_of_every_magnitude(scores, "cuda")
    for aux in (False, True):
        kw = extra if aux else {}
        got = G.moe_topk_gate_backward_cuda(scores, idx, w, grad, 1.5, "sqrtsoftplus", **kw)
        assert torch.equal(_bits(got), _bits(backward_model(scores, idx, w, grad, 1.5, **kw)))


@pytest.mark.gpu
@pytest.mark.parametrize("min_blocks", [0, 6])
def test_backward_min_blocks_knob_gpu(min_blocks, knob_kernels):
    """The other register caps (BWD_MIN_BLOCKS; 0: none) give the same bits (compiled here)."""
    knob_kernels(G, {"BWD_MIN_BLOCKS": min_blocks})
    for aux in (False, True):
        for experts, k in SHAPES:
            test_backward_matches_reference(4001, experts, k, aux)
    test_backward_scores_of_every_magnitude()


@pytest.mark.gpu
@pytest.mark.parametrize("aux", [False, True])
@pytest.mark.parametrize("experts,k", ((30, 3), (30, 0), (G._MAX_EXPERTS + 4, 6)))
def test_backward_odd_shapes(experts, k, aux):
    """E_r not a multiple of 4 (element-wise accesses), K = 0 (no routed slot), E_r above the kernel's limit
    (the reference)."""
    rows = 4001
    scores, idx, w, grad, extra = _backward_inputs(rows, experts, max(k, 1), aux)
    idx, w, grad = idx[:, :k].contiguous(), w[:, :k].contiguous(), grad[:, :k].contiguous()
    got = G.moe_topk_gate_backward_cuda(scores, idx, w, grad, 1.5, "sqrtsoftplus", **extra)
    want = ref.moe_topk_gate_backward(scores, idx, w, grad, 1.5, "sqrtsoftplus", **extra)
    _assert_close_to_reference(got, want, _backward_tolerance(scores, idx, w, grad, 1.5, got, want, **extra))
    if experts <= G._MAX_EXPERTS:
        assert torch.equal(_bits(got), _bits(backward_model(scores, idx, w, grad, 1.5, **extra)))


@pytest.mark.gpu
def test_backward_batch_invariant_graph_compile():
    scores, idx, w, grad, extra = _backward_inputs(8192, 256, 8, True)
    full = G.moe_topk_gate_backward_cuda(scores, idx, w, grad, 1.5, "sqrtsoftplus", **extra)
    rows_per_seq = 8192 // extra["grad_scores_sum"].size(0)
    for lo, hi in ((0, 2048), (2048, 4096), (4096, 4097)):               # whole sequences: same h rows
        seq = lo // rows_per_seq
        part = G.moe_topk_gate_backward_cuda(scores[lo:hi].contiguous(), idx[lo:hi].contiguous(),
                                             w[lo:hi].contiguous(), grad[lo:hi].contiguous(), 1.5, "sqrtsoftplus",
                                             extra["mask"][lo:hi].contiguous(),
                                             extra["grad_scores_sum"][seq:seq + 1].contiguous())
        assert torch.equal(_bits(part), _bits(full[lo:hi]))
    out = torch.empty_like(full)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        G.moe_topk_gate_backward_cuda(scores, idx, w, grad, 1.5, "sqrtsoftplus", out=out, **extra)
    grad.copy_(torch.randn_like(grad))
    graph.replay()
    want = backward_model(scores, idx, w, grad, 1.5, **extra)
    assert torch.equal(_bits(out), _bits(want))

    def f(s, i, ww, g, m, h):
        return moe.moe_topk_gate_backward(s, i, ww, g, 1.5, "sqrtsoftplus", m, h)

    got = torch.compile(f, fullgraph=True)(scores, idx, w, grad, extra["mask"], extra["grad_scores_sum"])
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.gpu
def test_backward_unaligned_views():
    """Contiguous views at a 4-byte storage offset (the kernel's 16-byte accesses go through aligned copies)."""
    scores, idx, w, grad, extra = _backward_inputs(7, 72, 6, True)
    shifted = _shifted
    out = shifted(torch.full_like(scores, float("nan")))
    got = G.moe_topk_gate_backward_cuda(shifted(scores), idx, w, grad, 1.5, "sqrtsoftplus", extra["mask"],
                                        shifted(extra["grad_scores_sum"]), out=out)
    assert got is out
    assert torch.equal(_bits(got), _bits(backward_model(scores, idx, w, grad, 1.5, **extra)))


# ------------------------------------------------------------------------------------- device-side rules

_BAD_INPUT = """
import torch
from tilefuse.moe import _moe_gate_kernel as G
torch.manual_seed(0)
rows, experts, k = 9, 72, 6
case = {case!r}
if case.startswith("backward"):
    scores = torch.rand(rows, experts, device="cuda")
    idx = torch.randint(0, experts, (rows, k), device="cuda")
    w, g = torch.rand(rows, k, device="cuda"), torch.randn(rows, k, device="cuda")
    idx[5, 3] = {{"backward_low": -2, "backward_high": experts, "backward_wrap": 2 ** 32 + 3,
                  "backward_ok": -1}}[case]
    G.moe_topk_gate_backward_cuda(scores, idx, w, g, 1.5)
else:
    logits = torch.randn(rows, experts, device="cuda")
    kw = dict(to_physical_map=torch.randint(0, 99, (experts + 1, 2), dtype=torch.int32, device="cuda"),
              logical_count=torch.randint(1, 3, (experts + 1,), dtype=torch.int32, device="cuda"),
              unmapped_topk_idx=torch.randint(0, experts, (rows, k), device="cuda"),
              fix_routing_mask=torch.zeros(rows, dtype=torch.bool, device="cuda"),
              force_random=torch.zeros(rows, dtype=torch.bool, device="cuda"),
              mask=torch.ones(rows, dtype=torch.bool, device="cuda"))
    kw["fix_routing_mask"][4] = True
    kw["force_random"][6] = True
    if case == "forward_nan":
        logits[3, 70] = float("nan")
    if case == "forward_inf_fixed":
        logits[4, 0] = float("-inf")
    if case == "forward_fixed_range":
        kw["unmapped_topk_idx"][4, 2] = experts
    if case == "forward_count":
        kw["logical_count"][17] = 0
    if case == "forward_ok":                                       # non-finite logits of unchecked rows
        logits[6] = float("nan")                                   # random
        kw["mask"][2] = False
        logits[2] = float("inf")                                   # masked
        kw["unmapped_topk_idx"][3, 0] = -5                         # not a fixed row
    G.moe_topk_gate_forward_cuda(logits, k, True, 1, 1.5, 3, **kw)
torch.cuda.synchronize()
print("no error")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("case", ("forward_nan", "forward_inf_fixed", "forward_fixed_range", "forward_count",
                                  "forward_ok", "backward_low", "backward_high", "backward_wrap", "backward_ok"))
def test_data_rules_assert_on_device(case):
    """moe.md §2.13 step 11 / §2.14 (the rules of tilefuse/moe/_checks.py): the kernels' device-side assertions
    (a child process each: a device assert leaves the CUDA context unusable); the *_ok cases run clean."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", _BAD_INPUT.format(case=case)], capture_output=True, text=True,
                         timeout=600, cwd=root)
    if case.endswith("_ok"):
        assert res.returncode == 0 and "no error" in res.stdout, res.stdout + res.stderr
    else:
        assert res.returncode != 0 and "no error" not in res.stdout, res.stdout + res.stderr
        # tl's device_assert is CUDA's assert: "Assertion `cond` failed", then CUDA_ERROR_ASSERT on the next call
        assert "Assertion `cond` failed" in res.stdout + res.stderr, res.stderr[-2000:]


_PHILOX_HOST = r"""
#include <cstdio>
#include <cstring>
#define __device__
#define __forceinline__ inline
static unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
static float __uint2float_rn(unsigned x) { return (float)x; }
static float __fmul_rn(float a, float b) { return a * b; }
static float __fadd_rn(float a, float b) { return a + b; }
%s
int main() {
  unsigned c2, c3, k0, k1;
  while (scanf("%%u %%u %%u %%u", &c2, &c3, &k0, &k1) == 4) {
    unsigned long long v = tfg_philox01(c2, c3, k0, k1);
    unsigned x = (unsigned)v;
    float u = __fadd_rn(__fmul_rn(__uint2float_rn(x), 2.3283064365386963e-10f), 1.1641532182693481e-10f);
    unsigned ub; memcpy(&ub, &u, 4);
    printf("%%u %%u %%u\n", x, (unsigned)(v >> 32), ub);
  }
  return 0;
}
"""


def test_kernel_philox_matches_reference_cpu(tmp_path):
    """The kernel's Philox4x32-10 block and uniform (its C source, built for the host) against the reference's
    ``philox4x32_10`` / ``random_routing`` words for counters (0, 0, lo, hi) of subsequences 32 t + l."""
    import re
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    body = re.search(r"__device__ __forceinline__ unsigned long long tfg_philox01.*?\n}\n", G._HELPERS, re.S)
    (tmp_path / "p.cc").write_text(_PHILOX_HOST % body.group(0))
    subprocess.run([cxx, "-O1", "-o", str(tmp_path / "p"), str(tmp_path / "p.cc")], check=True)
    sub = torch.cat([torch.arange(64), torch.randint(0, 2 ** 62, (64,))]).to(torch.int64)
    seed = torch.tensor([0, 3, 2 ** 33 + 7, 2 ** 63 - 25], dtype=torch.int64)
    sub, seed = sub.repeat(4), seed.repeat_interleave(128)
    lines = [f"{s & 0xFFFFFFFF} {s >> 32} {k & 0xFFFFFFFF} {k >> 32}" for s, k in zip(sub.tolist(), seed.tolist())]
    res = subprocess.run([str(tmp_path / "p")], input="\n".join(lines) + "\n", capture_output=True, text=True,
                         check=True)
    got = torch.tensor([[int(v) for v in line.split()] for line in res.stdout.split("\n") if line])
    zero = torch.zeros_like(sub)
    x, y, _, _ = ref.philox4x32_10((zero, zero, sub & 0xFFFFFFFF, sub >> 32), (seed & 0xFFFFFFFF, seed >> 32))
    uniform = x.to(torch.float32) * 2.0 ** -32 + 2.0 ** -33
    assert torch.equal(got[:, 0], x) and torch.equal(got[:, 1], y)
    assert torch.equal(got[:, 2], uniform.view(torch.int32).to(torch.int64) & 0xFFFFFFFF)
