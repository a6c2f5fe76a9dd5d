"""Kernel tiers for ``topk_gate``, ``topk_sum_and_topk_group_idx`` and ``normalize_weight`` (moe.md §2.1, §2.3, §2.4).

reference-free CPU checks: a numpy model of the kernels' sortable key and removal-based selection equals
``stable_topk`` on non-finite data too; the fakes give the reference's shapes.
compile: every registered config builds for sm_90 with IEEE arithmetic, and the launchers hand the kernels
arguments that fit their signatures (checked on CPU against the prim_func).
gpu: bit-exact against the reference on the same CUDA tensors (indices always; the normalisation is computed
in the reference's order), outputs poisoned first; determinism, batch invariance, CUDA graphs, torch.compile.
"""
import numpy as np
import pytest
import torch

from tilefuse import _jit, moe
from tilefuse.moe import _topk_kernel as K
from tilefuse.reference import moe as ref
from tests.quant.kernel_binding import fake_jit

TOKENS = (0, 1, 7, 4001, 8192)
GATE = [(e, k) for e in (8, 72, 256, 384) for k in (1, 2, 6, 8)]
GATE_EXTRA = [(33, 8), (5, 5), (72, 72), (1024, 9)]     # odd E, padded lanes, serial K (K = E), the widest rows
GROUP = [(8, 32, 2, 4), (12, 6, 1, 4), (16, 16, 2, 2), (32, 2, 2, 5), (3, 32, 2, 2), (5, 7, 2, 5), (2, 100, 2, 1),
         (1, 3, 1, 1), (8, 9, 2, 4), (12, 32, 2, 4)]
NORM_K = (1, 2, 6, 8, 9, 13, 40)


def _cfg_id(c):
    return "-".join(map(str, c))


# ---------------------------------------------------------------------------------------------------------
# CPU: the selection algorithm (a numpy model of the CUDA helpers) and the fakes
# ---------------------------------------------------------------------------------------------------------

def _key(x: np.ndarray) -> np.ndarray:
    """tf_topk_key: int32 keys whose order is the stable descending sort's (NaN first, -0 == +0)."""
    b = x.astype(np.float32).view(np.int32).astype(np.int64)
    b = np.where(b == -(2 ** 31), 0, b)                                  # -0.0 -> +0.0
    k = np.where(b < 0, b ^ 0x7FFFFFFF, b)
    return np.where(np.isnan(x), 2 ** 31 - 1, k)


def _model_select(scores: np.ndarray, k: int, lanes: int) -> np.ndarray:
    """The kernels' rounds: per lane the best key (strict >, ascending j), then the segment's largest
    (key, -index); the winner's key becomes INT_MIN. Candidate ``l + lanes * j`` sits on lane ``l``."""
    rows, e = scores.shape
    r = -(-e // lanes)
    key = np.full((rows, lanes * r), -(2 ** 31), dtype=np.int64)
    key[:, :e] = _key(scores)
    key = key.reshape(rows, r, lanes)                                   # [row, j, lane]
    out = np.empty((rows, k), dtype=np.int64)
    for slot in range(k):
        j_best = key.argmax(axis=1)                                     # first maximum: the smallest j
        best = np.take_along_axis(key, j_best[:, None, :], 1)[:, 0, :]
        idx = np.arange(lanes)[None, :] + lanes * j_best
        packed = best * 2 ** 12 + (2 ** 12 - 1 - idx)       # the packed word's order: key, then ~index (E < 4096)
        win = idx[np.arange(rows), packed.argmax(axis=1)]
        out[:, slot] = win
        key[np.arange(rows), win // lanes, win % lanes] = -(2 ** 31)
    return out


def _ties(shape, device="cpu"):
    """Integer-valued scores with many exact ties, zeros of both signs."""
    x = torch.randint(-3, 4, shape, device=device).to(torch.float32)
    neg_zero = (x == 0) & (torch.rand(shape, device=device) < 0.5)
    return torch.where(neg_zero, torch.full_like(x, -0.0), x)


@pytest.mark.parametrize("experts,k", [(8, 8), (33, 8), (72, 6), (5, 5), (256, 8), (72, 72)])
def test_key_selection_model_equals_stable_sort(experts, k):
    x = _ties((64, experts))
    special = torch.rand(x.shape)
    x[special < 0.1] = float("nan")
    x[(special >= 0.1) & (special < 0.2)] = float("-inf")
    x[(special >= 0.2) & (special < 0.25)] = float("inf")
    x[special > 0.97] = -float("nan")
    got = _model_select(x.numpy(), k, K._lanes(experts))
    assert np.array_equal(got, ref.stable_topk(x, k).numpy())


def test_key_order_on_every_class_of_value():
    vals = np.array([np.nan, np.inf, 3.0, 1e-45, 0.0, -0.0, -1e-45, -3.0, -np.inf], dtype=np.float32)
    keys = _key(vals)
    assert keys[0] > keys[1] > keys[2] > keys[3] > keys[4] == keys[5] > keys[6] > keys[7] > keys[8] > -(2 ** 31)


def test_fakes_give_reference_shapes():
    s = torch.empty(5, 72, device="meta")
    assert K._topk_gate_fake(s, 6).shape == (5, 6) and K._topk_gate_fake(s, 6).dtype == torch.int64
    g = torch.empty(5, 8, 32, device="meta")
    assert K._topk_group_fake(g, 2, 4).shape == (5, 4)
    den, norm = K._normalize_weight_fake(torch.empty(5, 6, device="meta"))
    assert den.shape == (5,) and norm.shape == (5, 6) and den.dtype == norm.dtype == torch.float32


def test_ops_trace_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        idx = torch.ops.tilefuse.topk_gate(mode.from_tensor(torch.empty(5, 72)), 6)
        gidx = torch.ops.tilefuse.topk_sum_and_topk_group_idx(mode.from_tensor(torch.empty(5, 8, 32)), 2, 4)
        den, norm = torch.ops.tilefuse.normalize_weight(mode.from_tensor(torch.empty(5, 9)))
    assert idx.shape == (5, 6) and idx.dtype == torch.int64 and gidx.shape == (5, 4) and gidx.dtype == torch.int64
    assert den.shape == (5,) and norm.shape == (5, 9) and norm.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------
# compile tier
# ---------------------------------------------------------------------------------------------------------

def test_gpu_configs_are_registered():
    assert set(GATE + GATE_EXTRA) <= set(K._gate_configs())
    assert set(GROUP) <= set(K._group_configs())
    assert {(k,) for k in NORM_K} <= set(K._normalize_configs())


@pytest.mark.compile
@pytest.mark.parametrize("name,cfg", [("topk_gate", c) for c in K._gate_configs()]
                         + [("topk_sum_and_topk_group_idx", c) for c in K._group_configs()]
                         + [("normalize_weight", c) for c in K._normalize_configs()], ids=str)
def test_builds_for_sm90(name, cfg):
    src = _jit.compile_kernel(name, cfg, "sm_90", export=False).get_kernel_source()
    assert "__global__" in src and "use_fast_math" not in src and "atomic" not in src
    if name != "normalize_weight":
        assert "tf_topk_seg_best(" in src and "__shfl_xor_sync" in src


@pytest.mark.compile
def test_wide_loads_where_aligned():
    """16-byte loads of a group's scores (n % 4 == 0) and of a row's weights (K % 4 == 0), 16-byte stores."""
    src = _jit.compile_kernel("topk_sum_and_topk_group_idx", (8, 32, 2, 4), "sm_90", export=False).get_kernel_source()
    assert "*(float4*)(S + " in src
    src = _jit.compile_kernel("normalize_weight", (8,), "sm_90", export=False).get_kernel_source()
    assert "*(float4*)(W + " in src and "*(float4*)(Y + " in src


@pytest.mark.compile
def test_launchers_bind_kernel_parameters(monkeypatch):
    calls = fake_jit(monkeypatch)
    out = K.topk_gate_launch(torch.randn(130, 72), 6)
    assert out.shape == (130, 6) and out.dtype == torch.int64
    out = K.topk_sum_and_topk_group_idx_launch(torch.randn(130, 8, 32), 2, 4)
    assert out.shape == (130, 4) and out.dtype == torch.int64
    den, norm = K.normalize_weight_launch(torch.rand(130, 9))
    assert den.shape == (130,) and norm.shape == (130, 9)
    assert [(c.name, c.cfg) for c in calls] == [("topk_gate", (72, 6)), ("topk_sum_and_topk_group_idx", (8, 32, 2, 4)),
                                               ("normalize_weight", (9,))]
    assert all(c.env["num_tokens"] == 130 for c in calls)


@pytest.mark.compile
def test_zero_tokens_and_wide_rows_launch_nothing(monkeypatch):
    calls = fake_jit(monkeypatch)
    assert K.topk_gate_launch(torch.empty(0, 72), 6).shape == (0, 6)
    assert K.topk_sum_and_topk_group_idx_launch(torch.empty(0, 8, 32), 2, 4).shape == (0, 4)
    den, norm = K.normalize_weight_launch(torch.empty(0, 8))
    assert den.shape == (0,) and norm.shape == (0, 8)
    den, norm = K.normalize_weight_launch(torch.empty(3, 0))   # K = 0: the epsilon alone
    assert torch.equal(den, ref.normalize_weight(torch.empty(3, 0))[0]) and norm.shape == (3, 0)
    wide = torch.randn(4, K.MAX_GATE_EXPERTS + 3)                 # beyond the register budget: the reference
    assert torch.equal(K.topk_gate_launch(wide, 5), ref.stable_topk(wide, 5))
    assert calls == []


# ---------------------------------------------------------------------------------------------------------
# gpu tier
# ---------------------------------------------------------------------------------------------------------

DEV = "cuda"


def _gate_kernel(scores, k):
    """The kernel itself into a poisoned output (-7 is no index)."""
    out = torch.full((scores.size(0), k), -7, dtype=torch.int64, device=scores.device)
    if scores.size(0):
        _jit.get("topk_gate", (scores.size(1), k))(scores, out)
    return out


def _group_kernel(scores, n_sum, n_groups):
    out = torch.full((scores.size(0), n_groups), -7, dtype=torch.int64, device=scores.device)
    if scores.size(0):
        _jit.get("topk_sum_and_topk_group_idx", (*scores.shape[1:], n_sum, n_groups))(scores, out)
    return out


def _norm_kernel(w):
    den = torch.full((w.size(0),), float("nan"), device=w.device)
    out = torch.full(w.shape, float("nan"), device=w.device)
    if w.size(0):
        _jit.get("normalize_weight", (w.size(1),))(w, den, out)
    return den, out


def _weights(rows, k):
    """Positive weights spanning nine decades (the summation order shows in the last bits); every 97th row 0."""
    w = torch.rand(rows, k, device=DEV) * torch.logspace(-6, 3, k, device=DEV)[torch.randperm(k, device=DEV)]
    w[::97] = 0.0
    return w


def _assert_same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous() and b.is_contiguous()
    assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                       b.view(torch.int32) if b.dtype == torch.float32 else b)


@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("experts,k", GATE)
def test_topk_gate_matches_reference(t, experts, k):
    for scores in (_ties((t, experts), DEV), torch.randn(t, experts, device=DEV)):
        _assert_same(_gate_kernel(scores, k), ref.stable_topk(scores, k))
        _assert_same(K.topk_gate_cuda(scores, k), ref.stable_topk(scores, k))


@pytest.mark.gpu
@pytest.mark.parametrize("experts,k", GATE_EXTRA)
def test_topk_gate_odd_widths_and_long_selections(experts, k):
    scores = _ties((4001, experts), DEV)
    _assert_same(_gate_kernel(scores, k), ref.stable_topk(scores, k))


@pytest.mark.gpu
@pytest.mark.parametrize("experts,k", [(72, 6), (33, 8), (8, 8), (72, 72)])
def test_topk_gate_non_finite_is_the_stable_sort(experts, k):
    """Beyond the spec's finite contract: NaN first, -inf in index order, no duplicates (removal, not overwrite)."""
    scores = _ties((4001, experts), DEV)
    u = torch.rand(scores.shape, device=DEV)
    scores[u < 0.1] = float("nan")
    scores[(u >= 0.1) & (u < 0.5)] = float("-inf")
    scores[(u >= 0.5) & (u < 0.55)] = float("inf")
    scores[:7] = float("-inf")
    scores[7:9] = float("nan")
    _assert_same(_gate_kernel(scores, k), ref.stable_topk(scores.cpu(), k).to(DEV))


@pytest.mark.gpu
def test_topk_gate_wide_rows_use_the_reference():
    scores = _ties((7, K.MAX_GATE_EXPERTS + 3), DEV)
    _assert_same(K.topk_gate_cuda(scores, 12), ref.stable_topk(scores, 12))


@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("cfg", GROUP, ids=_cfg_id)
def test_group_idx_matches_reference(t, cfg):
    groups, per_group, n_sum, n_groups = cfg
    for scores in (_ties((t, groups, per_group), DEV), torch.randn(t, groups, per_group, device=DEV)):
        want = ref.topk_sum_and_topk_group_idx(scores, n_sum, n_groups)
        _assert_same(_group_kernel(scores, n_sum, n_groups), want)
        _assert_same(K.topk_sum_and_topk_group_idx_cuda(scores, n_sum, n_groups), want)


@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("k", NORM_K)
def test_normalize_weight_matches_reference_bitwise(t, k):
    w = _weights(t, k)
    want = ref.normalize_weight(w)
    for got in (_norm_kernel(w), K.normalize_weight_cuda(w)):
        _assert_same(got[0], want[0])
        _assert_same(got[1], want[1])


def _all_ops(n):
    scores = _ties((n, 256), DEV)
    grouped = _ties((n, 8, 32), DEV)
    w = _weights(n, 8)
    return (lambda: K.topk_gate_cuda(scores, 8),
            lambda: K.topk_sum_and_topk_group_idx_cuda(grouped, 2, 4),
            lambda: K.normalize_weight_cuda(w)), (scores, grouped, w)


def _flat(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.gpu
def test_deterministic_and_batch_invariant():
    scores = _ties((8192, 256), DEV)
    grouped = _ties((8192, 8, 32), DEV)
    w = _weights(8192, 8)
    runs = {
        "gate": lambda s: K.topk_gate_cuda(scores[s], 8),
        "group": lambda s: K.topk_sum_and_topk_group_idx_cuda(grouped[s], 2, 4),
        "norm": lambda s: K.normalize_weight_cuda(w[s]),
    }
    for fn in runs.values():
        full = _flat(fn(slice(None)))
        for a, b in zip(full, _flat(fn(slice(None)))):
            _assert_same(a, b)
        for lo, hi in ((0, 1), (4000, 4007), (8191, 8192), (1, 8192)):
            for a, b in zip(_flat(fn(slice(lo, hi))), full):
                _assert_same(a, b[lo:hi].contiguous())


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager():
    fns, _ = _all_ops(4001)
    eager = [_flat(f()) for f in fns]    # compiled and loaded before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [_flat(f()) for f in fns]
    for outs in captured:
        for o in outs:
            o.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    for c, e in zip(captured, eager):
        for a, b in zip(c, e):
            _assert_same(a, b)


@pytest.mark.gpu
def test_torch_compile_through_public_ops():
    scores = _ties((4001, 72), DEV)
    grouped = _ties((4001, 12, 6), DEV)
    w = _weights(4001, 6)

    def f(scores, grouped, w):
        den, norm = moe.normalize_weight(w)
        return (moe.topk_gate(scores, 6), moe.topk_sum_and_topk_group_idx(grouped, 1, 4), den, norm)

    def g(scores, grouped, w):
        den, norm = K.normalize_weight_cuda(w)
        return (K.topk_gate_cuda(scores, 6), K.topk_sum_and_topk_group_idx_cuda(grouped, 1, 4), den, norm)

    want = (ref.stable_topk(scores, 6), ref.topk_sum_and_topk_group_idx(grouped, 1, 4), *ref.normalize_weight(w))
    for fn in (f, g):
        got = torch.compile(fn, fullgraph=True)(scores, grouped, w)
        for a, b in zip(got, want):
            _assert_same(a, b)
