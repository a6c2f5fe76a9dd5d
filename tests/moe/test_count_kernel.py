"""Kernel tiers for aux_fi, group_count, inplace_unique_group_indices and mask_indices_by_tp (moe.md §1.2,
§2.9-§2.12): compile (sm_90, no GPU), launcher bindings and fakes (CPU), and gpu (bit-exact vs the reference
run on the same CUDA tensors)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tilefuse import _jit, moe
from tilefuse.moe import _count_kernel as K
from tilefuse.reference import moe as ref
from tilefuse.testing import assert_equal
from tests.moe import configs
from tests.quant.kernel_binding import fake_jit

TOKENS = (0, 1, 7, 4001, 8192)
EXPERTS = (8, 72, 256, 384)
TOPK = configs.COUNT_TOPK


# ------------------------------------------------------------------------------------------------- compile

@pytest.mark.compile
@pytest.mark.parametrize("name,cfg", configs.count_kernel_configs(), ids=str)
def test_builds_for_sm90(name, cfg):
    src = _jit.compile_kernel(name, cfg, "sm_90", export=False).get_kernel_source()
    assert "__global__" in src and "use_fast_math" not in src


# --------------------------------------------------------------------------------------- launcher bindings

@pytest.mark.compile
@pytest.mark.parametrize("rows,k,bins", [(1, 1, 8), (7, 6, 72), (8192, 8, 256), (70000, 8, 384), (4001, 2, 8192)],
                         ids=str)
def test_count_launchers_bind_kernel_parameters(rows, k, bins, monkeypatch):
    """Both passes of aux_fi and group_count get the flat entries, a (C, E) partial buffer with C within the
    limits, and the output; the chunks cover every entry."""
    calls = fake_jit(monkeypatch)
    x = torch.randint(-1, bins, (rows, k))
    K.aux_fi_launch(x, bins, k)
    K.group_count_launch(x, bins)
    hist = (K.HIST_SMALL if bins <= K.HIST_SMALL else K.MAX_BINS,)  # the histogram build that holds E
    assert ("moe_count_partial", hist) in configs.count_kernel_configs()
    assert [(c.name, c.cfg) for c in calls] == [("moe_count_partial", hist), ("moe_count_finish", ("fi",)),
                                               ("moe_count_partial", hist), ("moe_count_finish", ("count",))]
    for c in calls:
        chunks = c.env["num_chunks"]
        assert c.env["num_bins"] == bins and 1 <= chunks <= K.MAX_CHUNKS
        assert chunks * bins <= max(K.PARTIAL_BUDGET, bins)
        if c.name == "moe_count_partial":
            assert c.env["num_entries"] == rows * k
            span = -(-rows * k // chunks)
            assert (chunks - 1) * span < rows * k <= chunks * span


@pytest.mark.compile
def test_launchers_bind_unique_and_mask(monkeypatch):
    calls = fake_jit(monkeypatch)
    g = torch.randint(-1, 72, (33, 6))
    K.inplace_unique_group_indices_launch(g, 72)
    for dtype in (torch.int64, torch.int32):
        K.mask_indices_by_tp_launch(torch.randint(-1, 300, (33, 6), dtype=dtype), 256, 8, 1, 4)
    assert [(c.name, c.cfg, c.env["num_tokens" if "unique" in c.name else "num_entries"]) for c in calls] == [
        ("moe_unique_group_indices", (6,), 33), ("moe_mask_indices_by_tp", ("int64",), 198),
        ("moe_mask_indices_by_tp", ("int32",), 198)]


def _capture(monkeypatch) -> list:
    """Replace ``_jit.get`` by a recorder of ``(name, cfg, args)``; nothing runs."""
    calls = []
    monkeypatch.setattr(_jit, "get", lambda name, cfg: lambda *args: calls.append((name, cfg, args)))
    return calls


def _count_model(flat: np.ndarray, bins: int, denom=None) -> np.ndarray:
    """numpy model of both counting passes, lane by lane: the partial pass's chunk/round/unroll/thread
    offsets (each entry must be read exactly once), its per-chunk histograms, then the finish pass's
    round/unroll/warp walk over the chunk rows (each row exactly once) and its int32 total, or
    ``(float(total) * float(E)) / denom`` in fp32 with ``denom`` C-cast to binary32 as the host stub does."""
    n = flat.size
    chunks, th, u, tile = K._num_chunks(n, bins), K.COUNT_THREADS, K.COUNT_UNROLL, K.COUNT_THREADS * K.COUNT_UNROLL
    span = (n + chunks - 1) // chunks
    c, r, uu, tx = np.ix_(np.arange(chunks), np.arange((span + tile - 1) // tile), np.arange(u), np.arange(th))
    offset = c * span + tx + (r * tile + uu * th)
    read = offset < np.minimum(c * span + span, n)
    assert (np.bincount(offset[read], minlength=n) == 1).all()  # every entry once, nothing past N
    vals = np.where(read, flat[np.where(read, offset, 0)], -1)
    assert ((vals >= -1) & (vals < bins)).all()  # the device assertion would fire otherwise
    part = np.zeros((chunks, bins), np.int64)
    inside = (vals >= 0) & (vals < bins)
    np.add.at(part, (np.broadcast_to(c, vals.shape)[inside], vals[inside]), 1)
    warps = K.FINISH_THREADS // 32
    per_round = warps * K.FINISH_UNROLL
    rr, fu, g = np.ix_(np.arange((chunks + per_round - 1) // per_round), np.arange(K.FINISH_UNROLL),
                       np.arange(warps))
    row = (rr * per_round + fu * warps + g).ravel()
    row = row[row < chunks]
    assert np.array_equal(np.sort(row), np.arange(chunks))  # every chunk row once
    total = part[row].sum(0).astype(np.int32)
    if denom is None:
        return total
    return (total.astype(np.float32) * np.float32(bins)) / np.float32(denom)


@pytest.mark.parametrize("rows,k,bins", [(1, 1, 1), (1, 8, 8), (7, 6, 72), (64, 8, 256), (4001, 8, 384),
                                         (70001, 8, 256), (9, 7, 8192), (20000, 6, 5000), (513, 1, 33)],
                         ids=str)
def test_count_passes_model_matches_reference(rows, k, bins, monkeypatch):
    """The lanes' offsets of both passes (numpy model) read every entry and chunk row once and give the
    reference's counts and fractions bit for bit, with the denominator the launcher passes."""
    calls = _capture(monkeypatch)
    x = torch.randint(0, bins, (rows, k))
    x = torch.where(torch.rand(rows, k) < 0.25, -1, x)
    flat = x.reshape(-1).numpy()
    assert np.array_equal(_count_model(flat, bins), ref.group_count(x, bins).numpy())
    # num_aux_topk values whose T * num_aux_topk is not an fp32 (the denominator is rounded), and the largest
    # one below the fp32 overflow (results down to subnormals)
    for aux in (1, k, 3 * 2 ** 24 + 1, 2 ** 40 + 12345, int(K._FLT_MAX) // rows):
        calls.clear()
        K.aux_fi_launch(x, bins, aux)
        (_, _, (_, _)), (_, cfg, (_, _, denom)) = calls
        assert cfg == ("fi",) and type(denom) is float
        want = ref.aux_fi(x, bins, aux).numpy()
        assert np.array_equal(_count_model(flat, bins, denom).view(np.int32), want.view(np.int32)), aux


def test_count_model_subnormal_fractions(monkeypatch):
    """c * E / FLT_MAX is subnormal: the kernel's fp32 formula (no flush to zero) keeps the reference's bits."""
    calls = _capture(monkeypatch)
    tiny = torch.tensor([[0, -1, 2], [-1, 1, -1]])
    aux = int(K._FLT_MAX) // 2
    want = ref.aux_fi(tiny, 3, aux).numpy()
    assert (want > 0).all() and (want < np.finfo(np.float32).tiny).all()
    K.aux_fi_launch(tiny, 3, aux)
    denom = calls[1][2][2]
    assert np.array_equal(_count_model(tiny.reshape(-1).numpy(), 3, denom).view(np.int32), want.view(np.int32))


def test_aux_fi_denominator_beyond_fp32_takes_the_reference(monkeypatch):
    """T * num_aux_topk above the largest fp32: the reference's fp32 fill refuses it (RuntimeError), and so
    does the launcher (no launch); T = 0 returns zeros whatever num_aux_topk."""
    calls = fake_jit(monkeypatch)
    x = torch.randint(-1, 8, (3, 2))
    for aux in (2 ** 127, 10 ** 40, (int(K._FLT_MAX) + 2 ** 80) // 3 + 1):
        with pytest.raises(RuntimeError, match="overflow"):
            ref.aux_fi(x, 8, aux)
        with pytest.raises(RuntimeError, match="overflow"):
            K.aux_fi_launch(x, 8, aux)
    assert K.aux_fi_launch(x[:0], 8, 10 ** 40).tolist() == [0.0] * 8
    assert calls == []
    K.aux_fi_launch(x, 8, 2 ** 100)  # 3 * 2^100 is finite in fp32: the kernel
    K.aux_fi_launch(x[:1], 8, int(K._FLT_MAX))  # the largest finite fp32 itself: the kernel
    assert [c.name for c in calls] == ["moe_count_partial", "moe_count_finish"] * 2


def test_unique_launcher_passes_unit_strides(monkeypatch):
    """A (T, 1) tensor is torch-contiguous whatever its column stride; the kernel's buffer has strides (K, 1)
    (TVM checks them): the launcher passes a view with those strides on the same storage."""
    calls = _capture(monkeypatch)
    g = torch.randint(-1, 8, (1, 5)).t()  # shape (5, 1), strides (1, 5)
    h = torch.randint(-1, 8, (1, 1)).as_strided((1, 1), (7, 3))
    for t in (g, h, torch.randint(-1, 8, (33, 6))[3:]):
        assert t.is_contiguous()
        calls.clear()
        K.inplace_unique_group_indices_launch(t, 8)
        [(name, cfg, (arg, limit))] = calls
        assert (name, cfg, limit) == ("moe_unique_group_indices", (t.size(1),), 64)
        assert arg.shape == t.shape and arg.stride() == (t.size(1), 1) and arg.data_ptr() == t.data_ptr()
        assert torch.equal(arg, t)


_TRUNC = {"Div": lambda a, b: _trunc_div(a, b), "Mod": lambda a, b: a - _trunc_div(a, b) * b}
_BINARY = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "EQ": np.equal, "NE": np.not_equal,
           "LT": np.less, "LE": np.less_equal, "GT": np.greater, "GE": np.greater_equal, "And": np.logical_and,
           "Or": np.logical_or}


def _trunc_div(a, b):
    """C integer division (truncation toward zero), exact for int64."""
    q = np.floor_divide(a, b)
    return q + ((a - q * b != 0) & ((a < 0) != (b < 0))).astype(q.dtype)


def _c_eval(e, env):
    """numpy evaluation of a TIR integer expression with C semantics (wrapping arithmetic, truncating / and %,
    both branches of a select evaluated: the kernel's expressions must be safe for that too)."""
    name = type(e).__name__
    dtype = np.bool_ if str(e.dtype) == "bool" else np.dtype(str(e.dtype))
    ev = lambda x: _c_eval(x, env)  # noqa: E731
    with np.errstate(over="ignore"):
        if name == "IntImm":
            return np.array(e.value).astype(dtype)
        if name == "Var":
            return env[e.name]
        if name == "Cast":
            return ev(e.value).astype(dtype)
        if name == "Not":
            return np.logical_not(ev(e.a))
        if name in _TRUNC:
            b = ev(e.b)
            assert (b != 0).all()
            return _TRUNC[name](ev(e.a), b).astype(dtype)
        if name in _BINARY:
            return _BINARY[name](ev(e.a), ev(e.b)).astype(dtype)
        if name == "Select":
            return np.where(ev(e.condition), ev(e.true_value), ev(e.false_value)).astype(dtype)
        if name == "Call" and e.op.name.endswith("if_then_else"):
            return np.where(ev(e.args[0]), ev(e.args[1]), ev(e.args[2])).astype(dtype)
    raise NotImplementedError(name)


@pytest.mark.compile
@pytest.mark.parametrize("dtype", (torch.int64, torch.int32), ids=str)
def test_tp_renumber_expression_matches_reference(dtype):
    """The kernel's TIR formula (32-bit below 2^31, 64-bit above, -1 for negatives) evaluated with C semantics
    equals the reference on the extremes of the dtype, values just around 2^31 and random values, for every
    (n, num_ep_ranks, tp_rank, num_tp_ranks) the kernel path takes."""
    import tilelang  # noqa: F401  (puts TileLang's tvm on the path)
    from tvm import tirx

    name = str(dtype).replace("torch.", "")
    info = torch.iinfo(dtype)
    extremes = [info.min, info.min + 1, -(2 ** 31) + 1, -5, -2, -1, 0, 1, 2 ** 31 - 2, 2 ** 31 - 1, info.max,
                info.max - 1]
    if dtype == torch.int64:
        extremes += [2 ** 31, 2 ** 31 + 1, 2 ** 32 + 7, 3 * 2 ** 40 + 5, 2 ** 62 + 3, -(2 ** 31) - 1]
    v = torch.cat([torch.tensor(extremes, dtype=dtype), torch.randint(-5, 700, (2000,), dtype=dtype),
                   torch.randint(info.min, info.max, (2000,), dtype=dtype)])
    if dtype == torch.int64:
        v = torch.cat([v, torch.randint(2 ** 31 - 3000, 2 ** 31 + 3000, (2000,))])
    expr = K.tp_renumber(name, tirx.Var("v", name), *(tirx.Var(s, "int32") for s in ("p", "num_tp", "tp")))
    cases = [(256, 8, 0, 1), (256, 8, 1, 2), (256, 8, 3, 4), (72, 9, 2, 3), (384, 4, 7, 8), (8, 8, 0, 8),
             (2 ** 30, 1, 0, 1), (2 ** 31 - 1, 1, 0, 1), (3 * 2 ** 28, 3, 1, 7), (10 ** 9, 7, 5, 14), (5, 5, 0, 3)]
    for n, ranks, tp, num_tp in cases:
        p = n // ranks
        assert p * num_tp <= K._INT32_MAX  # the kernel path
        env = {"v": v.numpy(), "p": np.int32(p), "num_tp": np.int32(num_tp), "tp": np.int32(tp)}
        got = _c_eval(expr, env)
        want = ref.mask_indices_by_tp(v.view(-1, 1), n, ranks, tp, num_tp).view(-1).numpy()
        assert got.dtype == want.dtype and np.array_equal(got, want), (n, ranks, tp, num_tp)


def test_empty_inputs_launch_nothing(monkeypatch):
    calls = fake_jit(monkeypatch)
    for k in (0, 6):
        x = torch.empty(0 if k else 5, k, dtype=torch.int64)
        assert K.aux_fi_launch(x, 9, 2).tolist() == [0.0] * 9
        assert K.group_count_launch(x, 9).tolist() == [0] * 9
        assert K.inplace_unique_group_indices_launch(x, 9) is None
        assert K.mask_indices_by_tp_launch(x, 8, 4, 0, 2).shape == x.shape
    assert calls == []


def test_unsupported_sizes_take_the_reference(monkeypatch):
    """E beyond the shared histogram, K beyond the unrolled row, P * num_tp_ranks >= 2^31: the reference."""
    calls = fake_jit(monkeypatch)
    x = torch.randint(-1, K.MAX_BINS + 5, (5, 3))
    assert torch.equal(K.group_count_launch(x, K.MAX_BINS + 5), ref.group_count(x, K.MAX_BINS + 5))
    assert torch.equal(K.aux_fi_launch(x, K.MAX_BINS + 5, 3), ref.aux_fi(x, K.MAX_BINS + 5, 3))
    g = torch.randint(-1, 8, (4, K.MAX_UNIQUE_K + 1))
    want = g.clone()
    ref.inplace_unique_group_indices(want, 8)
    K.inplace_unique_group_indices_launch(g, 8)
    assert torch.equal(g, want)
    v = torch.randint(-1, 2 ** 40, (4, 3))
    assert torch.equal(K.mask_indices_by_tp_launch(v, 2 ** 33, 4, 1, 2), ref.mask_indices_by_tp(v, 2 ** 33, 4, 1, 2))
    assert calls == []


def test_reference_fallbacks_check_the_data_rule():
    """The fallbacks assert the ops' data rules as the kernels do on the device (RuntimeError on the CPU)."""
    bins = K.MAX_BINS + 5
    with pytest.raises(RuntimeError, match="topk_idx"):
        K.aux_fi_launch(torch.tensor([[0, bins]]), bins, 2)
    with pytest.raises(RuntimeError, match="group_idx"):
        K.group_count_launch(torch.tensor([[-2, 0]]), bins)
    with pytest.raises(RuntimeError, match="group_indices"):
        K.inplace_unique_group_indices_launch(torch.full((1, K.MAX_UNIQUE_K + 1), 64), 8)


def test_fakes_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(7, 6, dtype=torch.int64)
        f = torch.ops.tilefuse.aux_fi.default(x, 72, 6)
        c = torch.ops.tilefuse.group_count.default(x, 72)
        m = torch.ops.tilefuse.mask_indices_by_tp.default(x.int(), 256, 8, 0, 2)
        assert torch.ops.tilefuse.inplace_unique_group_indices.default(x, 72) is None
    assert (f.shape, f.dtype) == ((72,), torch.float32)
    assert (c.shape, c.dtype) == ((72,), torch.int32)
    assert (m.shape, m.dtype) == ((7, 6), torch.int32)
    arg = torch.ops.tilefuse.inplace_unique_group_indices.default._schema.arguments[0]
    assert arg.name == "group_indices" and arg.alias_info.is_write     # declared as written in place


# ----------------------------------------------------------------------------------------------------- gpu

def _topk_idx(rows, k, experts, hot=False):
    """int64 (rows, k) in [-1, E): about a quarter -1; ``hot``: most entries on one expert (contention)."""
    x = torch.randint(0, experts, (rows, k), device="cuda")
    x = torch.where(torch.rand(rows, k, device="cuda") < 0.25, -1, x)
    if hot:
        x = torch.where(torch.rand(rows, k, device="cuda") < 0.9, experts - 1, x)
    return x.contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("rows", TOKENS)
def test_counts_match_reference(rows, experts):
    for k in TOPK:
        for hot in (False, True):
            x = _topk_idx(rows, k, experts, hot)
            for aux in sorted({1, k}):
                assert_equal(K.aux_fi_cuda(x, experts, aux), ref.aux_fi(x, experts, aux))
            assert_equal(K.group_count_cuda(x, experts), ref.group_count(x, experts))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,k,experts", [(70001, 8, 256), (3, 5, 1), (4001, 6, K.MAX_BINS), (200000, 8, 33),
                                            (9, 7, K.MAX_BINS + 1)], ids=str)
def test_counts_sizes_beyond_one_round(rows, k, experts):
    """Chunks of several rounds (large T), a single expert, the largest histogram and the reference fallback."""
    x = _topk_idx(rows, k, experts)
    assert_equal(K.group_count_cuda(x, experts), ref.group_count(x, experts))
    assert_equal(K.aux_fi_cuda(x, experts, k), ref.aux_fi(x, experts, k))


@pytest.mark.gpu
def test_aux_fi_rounded_denominators():
    """T * num_aux_topk that fp32 cannot hold (the denominator rounds as the reference's fill rounds it)."""
    x = _topk_idx(4001, 8, 256)
    x[0, 0] = 0  # expert 0 has an entry
    for aux in (3 * 2 ** 24 + 1, 2 ** 40 + 12345, 2 ** 100 + 1, int(K._FLT_MAX) // 4001):
        assert_equal(K.aux_fi_cuda(x, 256, aux), ref.aux_fi(x, 256, aux))
    tiny = torch.tensor([[0, -1, 2], [-1, 1, -1]], device="cuda")  # c * E / FLT_MAX: subnormal results
    want = ref.aux_fi(tiny, 3, int(K._FLT_MAX) // 2)
    assert (want > 0).all() and (want < torch.finfo(torch.float32).tiny).all()
    assert_equal(K.aux_fi_cuda(tiny, 3, int(K._FLT_MAX) // 2), want)


_ASSERT_SCRIPT = """
import sys
import torch
from tilefuse.moe import _count_kernel as K

case = sys.argv[1]
x = torch.randint(0, 72, (4001, 8), device="cuda")
g = torch.randint(0, 72, (4001, 8), device="cuda")
if case == "aux_fi_high":
    x[1234, 5] = 72
elif case in ("aux_fi_below", "group_count_below"):
    x[4000, 7] = -2
elif case == "unique_high":
    g[17, 2] = 128  # align(72, 64)
g[5, 1] = -7  # below -1: allowed by inplace_unique_group_indices (left as it is)
if case.startswith("aux_fi") or case == "valid":
    K.aux_fi_cuda(x, 72, 8)
if case.startswith("group_count") or case == "valid":
    K.group_count_cuda(x, 72)
if case.startswith("unique") or case == "valid":
    K.inplace_unique_group_indices_cuda(g, 72)
torch.cuda.synchronize()
assert int(g[5, 1]) == -7
print("NO ASSERTION")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["valid", "aux_fi_high", "aux_fi_below", "group_count_below", "unique_high"])
def test_kernels_assert_the_data_rules(case):
    """The ops' data rules are device assertions of the kernels themselves (ops.py checks nothing on CUDA):
    an entry outside [-1, E) (aux_fi, group_count) or >= align(num_groups, 64) (unique) stops the process with
    a device-side assertion; valid data, values below -1 in unique included, passes. One process per case
    (a device assertion leaves the CUDA context unusable)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", _ASSERT_SCRIPT, case], capture_output=True, text=True, cwd=root,
                         env=env, timeout=600)
    if case == "valid":
        assert run.returncode == 0 and "NO ASSERTION" in run.stdout, run.stderr[-2000:]
    else:
        assert run.returncode != 0 and "NO ASSERTION" not in run.stdout
        # tl's device_assert prints "Assertion `cond` failed"; the next CUDA call reports CUDA_ERROR_ASSERT
        assert "Assertion `cond` failed" in run.stderr, run.stderr[-2000:]


@pytest.mark.gpu
def test_counts_all_minus_one_and_strided_slices():
    x = torch.full((4001, 8), -1, dtype=torch.int64, device="cuda")
    assert_equal(K.group_count_cuda(x, 256), torch.zeros(256, dtype=torch.int32, device="cuda"))
    assert_equal(K.aux_fi_cuda(x, 256, 8), torch.zeros(256, device="cuda"))
    y = _topk_idx(4001, 7, 72)[5:]  # a contiguous view at an odd 8-byte offset
    assert_equal(K.group_count_cuda(y, 72), ref.group_count(y, 72))
    assert_equal(K.aux_fi_cuda(y, 72, 7), ref.aux_fi(y, 72, 7))


@pytest.mark.gpu
def test_counts_deterministic_and_split_invariant():
    """Two runs equal; the counts of a batch are the sums of the counts of its parts (any chunking)."""
    x = _topk_idx(8192, 8, 256)
    a, b = K.group_count_cuda(x, 256), K.group_count_cuda(x, 256)
    assert_equal(a, b)
    assert_equal(K.aux_fi_cuda(x, 256, 8), K.aux_fi_cuda(x, 256, 8))
    for cut in (1, 4000, 8191):
        assert_equal(K.group_count_cuda(x[:cut], 256) + K.group_count_cuda(x[cut:], 256), a)


def _groups(rows, k, num_groups, below=False):
    """int64 (rows, k) group ids with many repeats per row, -1 entries, values in [G, align(G, 64)) and, with
    ``below``, values < -1."""
    limit = -(-num_groups // 64) * 64
    g = torch.randint(0, min(num_groups, 5), (rows, k), device="cuda")
    wide = torch.randint(0, limit, (rows, k), device="cuda")
    pick = torch.rand(rows, k, device="cuda")
    g = torch.where(pick < 0.5, wide, g)
    g = torch.where(pick > 0.85, -1, g)
    if below:
        g = torch.where(pick > 0.95, torch.randint(-4, -1, (rows, k), device="cuda"), g)
    return g.contiguous()


def _unique_expected(g, num_groups):
    """The kernel's semantics (moe.md §2.11): the reference, with values < -1 left as they are."""
    low = g < -1
    want = torch.where(low, -1, g)
    ref.inplace_unique_group_indices(want, num_groups)
    return torch.where(low, g, want)


@pytest.mark.gpu
@pytest.mark.parametrize("num_groups", (8, 16, 72, 128))
@pytest.mark.parametrize("rows", TOKENS)
def test_unique_matches_reference(rows, num_groups):
    for k in TOPK:
        g = _groups(rows, k, num_groups)
        want = g.clone()
        ref.inplace_unique_group_indices(want, num_groups)
        assert K.inplace_unique_group_indices_cuda(g, num_groups) is None
        assert_equal(g, want)
        h = _groups(rows, k, num_groups, below=True)
        want = _unique_expected(h, num_groups)
        K.inplace_unique_group_indices_cuda(h, num_groups)
        assert_equal(h, want)


@pytest.mark.gpu
def test_unique_spec_example_wide_rows_and_batch_invariance():
    g = torch.tensor([[3, 3, -1, -1, -2, -2, 70, 70]], device="cuda")
    K.inplace_unique_group_indices_cuda(g, 72)
    assert g.tolist() == [[3, -1, -1, -1, -2, -2, 70, -1]]
    column = _groups(1, 4001, 72).t()  # (T, 1) with strides (1, T): torch-contiguous, no repeats possible
    want = column.clone()
    K.inplace_unique_group_indices_cuda(column, 72)
    assert_equal(column, want)
    for k in (3, 16, K.MAX_UNIQUE_K):  # K outside the listed configs compiles on first use
        h = _groups(777, k, 128)
        want = h.clone()
        ref.inplace_unique_group_indices(want, 128)
        K.inplace_unique_group_indices_cuda(h, 128)
        assert_equal(h, want)
    big = _groups(8192, 8, 72)
    whole = big.clone()
    K.inplace_unique_group_indices_cuda(whole, 72)
    again = big.clone()
    K.inplace_unique_group_indices_cuda(again, 72)
    assert_equal(again, whole)
    for lo, hi in ((0, 1), (4000, 4007), (8191, 8192)):
        part = big[lo:hi].clone()
        K.inplace_unique_group_indices_cuda(part, 72)
        assert_equal(part, whole[lo:hi])


def _tp_values(shape, n, dtype):
    """Values in [-5, n + 40), plus extremes of the dtype and (int64) values beyond 2^31."""
    v = torch.randint(-5, n + 40, shape, device="cuda", dtype=dtype)
    info = torch.iinfo(dtype)
    extremes = [info.min, -2, info.max, info.max - 1, 2 ** 31 - 1]
    if dtype == torch.int64:
        extremes += [2 ** 31, 2 ** 31 + 37, 3 * 2 ** 40 + 5]
    flat = v.view(-1)
    count = min(len(extremes), flat.numel())
    flat[:count] = torch.tensor(extremes[:count], dtype=dtype, device="cuda")
    return v


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.int64, torch.int32), ids=str)
@pytest.mark.parametrize("rows", TOKENS)
def test_mask_indices_by_tp_matches_reference(rows, dtype):
    for k, (n, ranks) in zip(TOPK, ((256, 8), (72, 9), (384, 4), (8, 8))):
        v = _tp_values((rows, k), n, dtype)
        for num_tp in (1, 2, 3, 4, 8):
            for tp in sorted({0, num_tp - 1, num_tp // 2}):
                assert_equal(K.mask_indices_by_tp_cuda(v, n, ranks, tp, num_tp),
                             ref.mask_indices_by_tp(v, n, ranks, tp, num_tp))


@pytest.mark.gpu
def test_mask_indices_by_tp_deterministic_and_batch_invariant():
    v = _tp_values((8192, 8), 256, torch.int64)
    whole = K.mask_indices_by_tp_cuda(v, 256, 8, 1, 4)
    assert_equal(K.mask_indices_by_tp_cuda(v, 256, 8, 1, 4), whole)
    for lo, hi in ((0, 1), (4000, 4007), (8191, 8192)):
        assert_equal(K.mask_indices_by_tp_cuda(v[lo:hi], 256, 8, 1, 4), whole[lo:hi])


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager():
    x = _topk_idx(4001, 8, 256)
    g0 = _groups(4001, 8, 72)
    v = _tp_values((4001, 8), 256, torch.int32)

    def run(g):
        return (K.aux_fi_cuda(x, 256, 8), K.group_count_cuda(x, 256), K.mask_indices_by_tp_cuda(v, 256, 8, 1, 2),
                K.inplace_unique_group_indices_cuda(g, 72))

    eager_g = g0.clone()
    eager = run(eager_g)[:3]
    run(g0.clone())  # every kernel loaded before capture
    torch.cuda.synchronize()
    g = g0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(g)[:3]
    for t in captured:
        t.fill_(-7)
    g.copy_(g0)
    graph.replay()
    torch.cuda.synchronize()
    for c, e in zip(captured, eager):
        assert_equal(c, e)
    assert_equal(g, eager_g)


@pytest.mark.gpu
def test_torch_compile_equals_eager():
    x = _topk_idx(4001, 8, 256)
    v = _tp_values((4001, 6), 256, torch.int64)
    g0 = _groups(4001, 8, 72)

    def f_kernel(x, v, g):
        K.inplace_unique_group_indices_cuda(g, 72)
        return K.aux_fi_cuda(x, 256, 8), K.group_count_cuda(x, 256), K.mask_indices_by_tp_cuda(v, 256, 8, 1, 2)

    def f_public(x, v, g):
        moe.inplace_unique_group_indices(g, 72)
        return moe.aux_fi(x, 256, 8), moe.group_count(x, 256), moe.mask_indices_by_tp(v, 256, 8, 1, 2)

    want_g = g0.clone()
    want = f_kernel(x, v, want_g)
    for f in (f_kernel, f_public):
        g = g0.clone()
        got = torch.compile(f, fullgraph=True)(x, v, g)
        for a, b in zip(got, want):
            assert_equal(a, b)
        assert_equal(g, want_g)
