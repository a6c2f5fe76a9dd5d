"""Kernel tiers for ``topk_gate``, ``topk_sum_and_topk_group_idx`` and ``normalize_weight`` (moe.md §2.1, §2.3, §2.4).

reference-free CPU checks: a numpy model of the kernels' sortable key and removal-based selection equals
``stable_topk`` on non-finite data too; the fakes give the reference's shapes.
compile: every config the GPU tests launch (tests/moe/configs.py) builds for sm_90 with IEEE arithmetic, and the
launchers hand the kernels arguments that fit their signatures (checked on CPU against the prim_func).
gpu: bit-exact against the reference on the same CUDA tensors (indices always; the normalisation is computed
in the reference's order), outputs poisoned first; determinism, batch invariance, CUDA graphs, torch.compile.
"""
import numpy as np
import pytest
import torch

from tilefuse import _jit, moe
from tilefuse.moe import _topk_kernel as K
from tilefuse.reference import moe as ref
from tests.moe.configs import NORM_K, TOPK_GATE as GATE, TOPK_GATE_EXTRA as GATE_EXTRA, TOPK_GROUP as GROUP
from tests.quant.kernel_binding import fake_jit

TOKENS = (0, 1, 7, 4001, 8192)


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


def _model_group(scores: np.ndarray, n_sum: int, n_groups: int) -> np.ndarray:
    """topk_group: lane g scans its group's values in column order keeping the best two keys (a key equal to
    the best goes second: the multiset's top two), adds their values in fp32, then the lanes' selection."""
    rows, groups, n = scores.shape
    keys = _key(scores)
    tk = np.full((rows, groups, 2), -(2 ** 31), dtype=np.int64)
    tv = np.zeros((rows, groups, 2), dtype=np.float32)
    for i in range(n):
        kv, v = keys[:, :, i], scores[:, :, i]
        up = kv > tk[..., 0]
        second = ~up & (kv > tk[..., 1])
        if n_sum == 2:
            tk[..., 1] = np.where(up, tk[..., 0], np.where(second, kv, tk[..., 1]))
            tv[..., 1] = np.where(up, tv[..., 0], np.where(second, v, tv[..., 1]))
        tk[..., 0] = np.where(up, kv, tk[..., 0])
        tv[..., 0] = np.where(up, v, tv[..., 0])
    gs = tv[..., 0] if n_sum == 1 else tv[..., 0] + tv[..., 1]
    return _model_select(gs.astype(np.float32), n_groups, K._lanes(groups))


@pytest.mark.parametrize("cfg", GROUP, ids=_cfg_id)
def test_group_model_equals_reference(cfg):
    groups, per_group, n_sum, n_groups = cfg
    for x in (_ties((257, groups, per_group)), torch.randn(257, groups, per_group)):
        got = _model_group(x.numpy(), n_sum, n_groups)
        assert np.array_equal(got, ref.topk_sum_and_topk_group_idx(x, n_sum, n_groups).numpy())


def test_normalize_epsilon_is_the_reference_fp32_constant():
    want = torch.full((1,), ref.EPS, dtype=torch.float32).view(torch.int32).item()
    assert K._EPS_BITS == want and np.float32(ref.EPS).view(np.int32) == want


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

@pytest.mark.compile
@pytest.mark.parametrize("name,cfg", [("topk_gate", c) for c in GATE + GATE_EXTRA]
                         + [("topk_sum_and_topk_group_idx", c) for c in GROUP]
                         + [("normalize_weight", (k,)) for k in NORM_K], ids=str)
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


def _capture_jit(monkeypatch) -> list:
    """``_jit.get`` replaced by a recorder of each launch's tensors (name, cfg, args)."""
    calls = []
    monkeypatch.setattr(_jit, "get", lambda name, cfg: lambda *args: calls.append((name, cfg, args)))
    return calls


def _misaligned(shape, offset=1):
    """A contiguous fp32 tensor whose start is ``offset`` elements past a fresh allocation."""
    numel = int(np.prod(shape))
    return torch.rand(numel + offset)[offset:].view(shape)


@pytest.mark.compile
def test_vector_loads_get_aligned_inputs(monkeypatch):
    """The 16-byte group loads (n % 4 == 0) and the 8/16-byte weight loads never see a misaligned start: such
    a (contiguous) view is copied; scalar loads take any start as it is."""
    calls = _capture_jit(monkeypatch)
    for shape, align in (((5, 8, 32), 16), ((5, 8, 9), 4)):
        x = _misaligned(shape)
        K.topk_sum_and_topk_group_idx_launch(x, 2, 4)
        got = calls.pop()[2][0]
        assert got.data_ptr() % align == 0 and torch.equal(got, x) and got.is_contiguous()
        assert (got.data_ptr() == x.data_ptr()) == (align == 4)
    for k, align in ((8, 16), (6, 8), (9, 4), (40, 4)):
        w = _misaligned((5, k))
        K.normalize_weight_launch(w)
        got = calls.pop()[2][0]
        assert got.data_ptr() % align == 0 and torch.equal(got, w) and got.is_contiguous()
        assert (got.data_ptr() == w.data_ptr()) == (align == 4)
    aligned = torch.rand(5, 8, 32)
    K.topk_sum_and_topk_group_idx_launch(aligned, 2, 4)
    assert calls.pop()[2][0].data_ptr() == aligned.data_ptr()    # nothing copied where the start is aligned


def _ffi_recorder():
    import tvm_ffi

    seen = []

    def kernel(*args):
        seen.append([(tuple(a.shape), tuple(a.strides), str(a.dtype)) for a in args])

    return tvm_ffi.convert(kernel), seen


@pytest.mark.compile
@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_gate_launcher_plan(monkeypatch, native):
    """gate_launcher: the native plan (output allocated and kernel called in one C++ call) where the extension
    is available, the Python path otherwise; both hand the kernel (scores, topk_idx (t, K) int64) and launch
    nothing at t = 0; one launcher per config."""
    from tilefuse import _native

    if native:
        assert _native.module() is not None, _native.error()
    else:
        monkeypatch.setattr(_native, "_STATE", {"module": None})
    fn, seen = _ffi_recorder()
    monkeypatch.setattr(_jit, "get", lambda name, cfg: fn)
    monkeypatch.setattr(K, "_GATE_LAUNCHERS", {})
    launch = K.gate_launcher(72, 6)
    assert (type(launch).__module__ == "tilefuse_native") == native
    assert K.gate_launcher(72, 6) is launch
    for t in (0, 1, 130):
        x = torch.randn(t, 72)
        out = launch(x, t)
        assert out.shape == (t, 6) and out.dtype == torch.int64 and out.is_contiguous()
        assert seen.pop() == [((t, 72), (72, 1), "float32"), ((t, 6), (6, 1), "int64")] if t else seen == []
    assert K.topk_gate_launch(torch.randn(3, 72), 6).shape == (3, 6)   # the public launcher takes the same plan
    assert seen.pop()[1] == ((3, 6), (6, 1), "int64")


@pytest.mark.compile
def test_gate_launcher_caches_no_stand_in(monkeypatch):
    fake_jit(monkeypatch)
    monkeypatch.setattr(K, "_GATE_LAUNCHERS", {})
    K.gate_launcher(72, 6)(torch.randn(2, 72), 2)
    assert K._GATE_LAUNCHERS == {}


def test_fast_path_declines_what_it_cannot_take():
    """topk_gate_fast answers None (the public op then validates) for anything but an eager CUDA call."""
    x = torch.randn(4, 72)
    assert K.topk_gate_fast(x, 6) is None
    assert K.topk_gate_fast(x.numpy(), 6) is None
    assert K.topk_gate_fast(torch.empty(4, 72, device="meta"), 6) is None
    assert K._VALIDATED == {} or all(k[0] == torch.float32 for k in K._VALIDATED)


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


@pytest.mark.gpu
@pytest.mark.parametrize("experts,k", [(256, 8), (72, 6), (8, 1), (1024, 9)])
def test_topk_gate_fast_path(experts, k):
    """The eager fast path equals the reference at every token count once its key is validated (first call
    validates, later calls hit the cache; the token count is free), and declines every call it cannot take."""
    for t in (1, 7, 4001, 1, 0):
        scores = _ties((t, experts), DEV)
        got = K.topk_gate_fast(scores, k)
        if t == 0 and (torch.float32, scores.stride(), experts, k) not in K._VALIDATED:
            assert got is None
            continue
        _assert_same(got, ref.stable_topk(scores, k))
    assert (torch.float32, (experts, 1), experts, k) in K._VALIDATED
    assert type(K._VALIDATED[(torch.float32, (experts, 1), experts, k)]).__module__ == "tilefuse_native"
    s = torch.randn(9, experts, device=DEV)
    wide = torch.randn(9, experts + 5, device=DEV)
    assert K.topk_gate_fast(wide[:, :experts], k) is None                  # not contiguous
    assert K.topk_gate_fast(s.t(), k) is None
    assert K.topk_gate_fast(s, experts + 1) is None                       # K > E
    assert K.topk_gate_fast(s, 0) is None
    assert K.topk_gate_fast(s, True) is None                              # a bool is no int
    assert K.topk_gate_fast(s.half(), k) is None
    assert K.topk_gate_fast(s[None], k) is None
    assert K.topk_gate_fast(torch.randn(3, K.MAX_GATE_EXPERTS + 1, device=DEV), 4) is None


@pytest.mark.gpu
def test_topk_gate_fast_path_under_graph_capture():
    scores = _ties((1, 256), DEV)
    _assert_same(K.topk_gate_fast(scores, 8), ref.stable_topk(scores, 8))   # validated and loaded before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = K.topk_gate_fast(scores, 8)
    captured.fill_(-1)
    scores.copy_(_ties((1, 256), DEV))
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(captured, ref.stable_topk(scores, 8))


@pytest.mark.gpu
def test_topk_gate_unaligned_start_matches_reference():
    """The 16-byte layout reads an aligned copy of a start 4 bytes past a 16-byte boundary: same indices."""
    base = _ties((7 * 256 + 1, ), DEV)
    scores = base[1:].view(7, 256)
    _assert_same(K.topk_gate_cuda(scores, 8), ref.stable_topk(scores, 8))
