"""TileLang kernels of the v2.1 gate (moe.md §2.13, §2.14): compile (sm_90, no GPU), launcher binding (CPU) and
gpu (bit-exact against the reference run on the same CUDA tensors)."""
import pytest
import torch

from tilefuse import _jit
from tilefuse import moe
from tilefuse.moe import _moe_gate_kernel as G
from tilefuse.reference import moe as ref
from tests.quant.kernel_binding import fake_jit

TOKENS = (0, 1, 7, 4001, 8192)
SHAPES = ((8, 1), (72, 2), (256, 6), (384, 8))          # (E_r, K)
ALL_BUT_RANDOM = "bias,fix,image,map,mask,scores,unmapped"
ALL = "bias,fix,image,map,mask,random,scores,unmapped"
FP32, I64, I32, BOOL = torch.float32, torch.int64, torch.int32, torch.bool


# ------------------------------------------------------------------------------------------------ compile

@pytest.mark.compile
@pytest.mark.parametrize("name,cfg", [("moe_topk_gate_forward", c) for c in G._forward_configs()]
                         + [("moe_topk_gate_backward", c) for c in G._backward_configs()], ids=str)
def test_builds_for_sm90(name, cfg):
    import tilelang

    kernel = tilelang.compile(_jit._FACTORIES[name][0](*cfg), target={"kind": "cuda", "arch": "sm_90"},
                              execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS))
    src = kernel.get_kernel_source()
    assert "__global__" in src and "use_fast_math" not in src
    assert "atomic" not in src                                           # deterministic: no atomics at all


def test_configs_cover_the_tests():
    fwd, bwd = set(G._forward_configs()), set(G._backward_configs())
    for e, k in SHAPES:
        assert (e, k, 0, "bias") in fwd and (e, k, False) in bwd and (e, k, True) in bwd
    for cfg in ((256, 8, 0, "bias,scores"), (72, 6, 2, ALL_BUT_RANDOM), (256, 8, 1, ALL), (64, 6, 0, "random"),
                (32, 2, 0, "")):
        assert cfg in fwd


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
    if "unmapped" in fl:
        kw["unmapped_topk_idx"] = torch.randint(0, experts, (rows, k), **g)
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
def test_backward_launcher_binds_kernel_parameters(aux, monkeypatch):
    calls = fake_jit(monkeypatch)
    rows, experts, k = 8, 72, 6
    scores, idx = torch.rand(rows, experts), torch.randint(-1, experts, (rows, k))
    w, g = torch.rand(rows, k), torch.randn(rows, k)
    extra = dict(mask=torch.rand(rows) > 0.5, grad_scores_sum=torch.randn(2, experts)) if aux else {}
    out = G.moe_topk_gate_backward_cuda(scores, idx, w, g, 1.5, **extra)
    assert len(calls) == 1 and calls[0].cfg == (experts, k, aux) and out.shape == (rows, experts)
    assert calls[0].env["num_tokens"] == rows


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


def _run_both(logits, k, s, rsf, ep_rank, kw, out=False):
    """(kernel outputs, reference outputs): idx, weights, unmapped, scores (None where absent)."""
    results = []
    for fn in (G.moe_topk_gate_forward_cuda, ref.moe_topk_gate_forward):
        mine = {n: (t.clone() if n in ("unmapped_topk_idx", "scores") else t) for n, t in kw.items()}
        extra = {}
        if out:
            rows = logits.size(0)
            extra["out"] = (torch.full((rows, k + s), 12345, dtype=I64, device="cuda"),
                            torch.full((rows, k + s), float("nan"), device="cuda"))
        idx, w = fn(logits, k, s > 0, s, rsf, ep_rank, "sqrtsoftplus", **mine, **extra)
        if out:
            assert idx is extra["out"][0] and w is extra["out"][1]
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

def _backward_inputs(rows, experts, k, aux):
    """A forward's scores / unmapped indices / routed weights, with -1 slots and pairs of duplicated experts."""
    logits = 2 * torch.randn(rows, experts, device="cuda")
    mask = torch.rand(rows, device="cuda") > 0.2
    fix = torch.rand(rows, device="cuda") > 0.8
    unmapped = torch.randint(0, experts, (rows, k), device="cuda")
    if k >= 2:
        unmapped[:, 1] = torch.where(torch.rand(rows, device="cuda") > 0.5, unmapped[:, 0], unmapped[:, 1])
    scores = torch.empty(rows, experts, device="cuda")
    _, w = ref.moe_topk_gate_forward(logits, k, False, 0, 1.5, 0, "sqrtsoftplus", mask, fix_routing_mask=fix,
                                     unmapped_topk_idx=unmapped, scores=scores)
    idx = unmapped.clone()
    if k >= 2:
        idx[:, -1] = torch.where(torch.rand(rows, device="cuda") > 0.7, -1, idx[:, -1])
    grad = torch.randn(rows, k, device="cuda")
    extra = {}
    if aux:
        seqs = 4 if rows % 4 == 0 else 1
        extra = dict(mask=mask, grad_scores_sum=torch.randn(seqs, experts, device="cuda"))
    return scores, idx, w.contiguous(), grad, extra


@pytest.mark.gpu
@pytest.mark.parametrize("aux", [False, True])
@pytest.mark.parametrize("rows", TOKENS)
@pytest.mark.parametrize("experts,k", SHAPES)
def test_backward_matches_reference(rows, experts, k, aux):
    scores, idx, w, grad, extra = _backward_inputs(rows, experts, k, aux)
    out = torch.full((rows, experts), float("nan"), device="cuda")
    got = G.moe_topk_gate_backward_cuda(scores, idx, w, grad, 1.5, "sqrtsoftplus", out=out, **extra)
    assert got is out
    want = ref.moe_topk_gate_backward(scores, idx, w, grad, 1.5, "sqrtsoftplus", **extra)
    assert torch.equal(got, want), (got != want).nonzero()[:8].tolist()
    fresh = G.moe_topk_gate_backward_cuda(scores, idx, w, grad, 1.5, "sqrtsoftplus", **extra)
    assert torch.equal(fresh, want)                                      # deterministic, fresh output


@pytest.mark.gpu
def test_backward_batch_invariant_graph_compile():
    scores, idx, w, grad, extra = _backward_inputs(8192, 256, 8, True)
    full = G.moe_topk_gate_backward_cuda(scores, idx, w, grad, 1.5, "sqrtsoftplus", **extra)
    rows_per_seq = 8192 // extra["grad_scores_sum"].size(0)
    for lo, hi in ((0, 2048), (2048, 4096)):                             # whole sequences: same h rows
        seq = lo // rows_per_seq
        part = G.moe_topk_gate_backward_cuda(scores[lo:hi].contiguous(), idx[lo:hi].contiguous(),
                                             w[lo:hi].contiguous(), grad[lo:hi].contiguous(), 1.5, "sqrtsoftplus",
                                             extra["mask"][lo:hi].contiguous(),
                                             extra["grad_scores_sum"][seq:seq + 1].contiguous())
        assert torch.equal(part, full[lo:hi])
    out = torch.empty_like(full)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        G.moe_topk_gate_backward_cuda(scores, idx, w, grad, 1.5, "sqrtsoftplus", out=out, **extra)
    grad.copy_(torch.randn_like(grad))
    graph.replay()
    want = ref.moe_topk_gate_backward(scores, idx, w, grad, 1.5, "sqrtsoftplus", **extra)
    assert torch.equal(out, want)

    def f(s, i, ww, g, m, h):
        return moe.moe_topk_gate_backward(s, i, ww, g, 1.5, "sqrtsoftplus", m, h)

    got = torch.compile(f, fullgraph=True)(scores, idx, w, grad, extra["mask"], extra["grad_scores_sum"])
    assert torch.equal(got, want)


def _torch_sum_model(v: torch.Tensor) -> torch.Tensor:
    """The kernel's model of PyTorch's CUDA row sum (>= 16 rows, contiguous), in fp64 (module docstring)."""
    n = v.size(1)
    vec = n > 128
    width = min(G._last_pow2(n // 4 if vec else n), 32)
    zero = torch.zeros(v.size(0), dtype=v.dtype, device=v.device)
    lanes = []
    for x in range(width):
        acc = [zero.clone() for _ in range(4)]
        if vec:
            for c in range(-(-n // 128)):
                for j in range(4):
                    e = 4 * (x + 32 * c) + j
                    if e < n:
                        acc[j] = acc[j] + v[:, e]
        else:
            m = 0
            while x + m * width < n:
                acc[m % 4] = acc[m % 4] + v[:, x + m * width]
                m += 1
        lanes.append(((acc[0] + acc[1]) + acc[2]) + acc[3])
    o = 1
    while o < width:
        lanes = [lanes[x] + lanes[x + o] if x + o < width else lanes[x] for x in range(width)]
        o *= 2
    return lanes[0]


@pytest.mark.gpu
@pytest.mark.parametrize("n", (1, 2, 6, 8, 32, 72, 256, 384))
def test_torch_cuda_sum_order_model(n):
    """The summation order the backward reproduces is torch's own (values of wide range: order shows)."""
    v = torch.randn(64, n, dtype=torch.float64, device="cuda") * torch.exp2(
        torch.randint(-40, 40, (64, n), device="cuda").double())
    assert torch.equal(v.sum(1), _torch_sum_model(v))
