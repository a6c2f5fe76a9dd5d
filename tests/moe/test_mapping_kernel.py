"""get_fused_mapping kernels (tilefuse/moe/_mapping_kernel.py) against the reference (moe.md §1.5, §2.5).

CPU tier: the launcher end to end with the three kernels (count, scan, scatter) replaced by a plain-Python model of
what each CTA does (chunks, the scan's warps and their row runs, the scatter's warps and rounds of 32 lanes, the
padding and tail split over the grid, the device assertions), so the index arithmetic, the data rules and the
launcher's trimming are checked without a GPU; the no-launch and reference paths; the fake against the eager
launches. Compile tier: every config the GPU tests launch (tests/moe/configs.py) builds for sm_90. GPU tier: the
kernels themselves, bit-exact against the reference, and their device assertions.
"""
import warnings

import pytest
import torch

from tilefuse import _jit, moe
from tilefuse.moe import _mapping_kernel as MK
from tilefuse.reference import moe as ref
from tests.moe import configs

NAMES = ("moe_fused_mapping_count", "moe_fused_mapping_scan", "moe_fused_mapping_scatter")


def random_topk(rows: int, k: int, experts: int, unrouted: float = 0.25, device="cpu") -> torch.Tensor:
    """(T, K) int64 ids in [0, E) (repeats inside a row allowed: they count separately), about ``unrouted`` -1."""
    idx = torch.randint(0, experts, (rows, k))
    idx = torch.where(torch.rand(rows, k) < unrouted, -1, idx)
    return idx.to(device)


def tied_topk(rows: int, k: int, experts: int, device="cpu") -> torch.Tensor:
    """Top-k of scores with many ties (values from a 3-level grid): heavily skewed segments."""
    scores = torch.randint(0, 3, (rows, experts)).float()
    return ref.stable_topk(scores, k).to(device)


def assert_same(got, want):
    assert len(got) == len(want) == 8
    for i, (g, w) in enumerate(zip(got[:7], want[:7])):
        assert g.dtype == torch.int32 and g.shape == w.shape, (i, g.dtype, g.shape, w.shape)
        assert torch.equal(g.cpu(), w.cpu()), f"output {i} differs"
    assert got[7] == want[7] and all(type(v) is int for v in got[7])


# ----------------------------------------------------------------------------------------------------
# A model of the three kernels (what each CTA computes), run in place of the launches
# ----------------------------------------------------------------------------------------------------

JUNK = 0x5A5A5A5A


def _model_count(x, table):
    """Rows [0, chunks) of the table; the totals row is left as junk (the scan must write it). An entry outside
    {-1} u [0, E) is the kernel's device assertion."""
    flat, experts = x.reshape(-1).tolist(), table.size(1)
    chunks = table.size(0) - 1
    assert chunks == -(-len(flat) // MK.CHUNK)
    table.fill_(JUNK)
    table[:chunks].zero_()
    for i, v in enumerate(flat):
        assert -1 <= v < experts, "device_assert: topk_idx entry out of range"
        if v >= 0:
            table[i // MK.CHUNK, v] += 1


def _model_scan(table):
    """Per CTA of 32 columns: warp w sums its rows [w P, (w + 1) P), the warps' sums are scanned in order, then
    every row becomes its column's exclusive prefix; the last warp writes the totals row."""
    chunks, experts = table.size(0) - 1, table.size(1)
    cells = table.tolist()
    per = -(-chunks // MK.SCAN_WARPS)
    for e in range(experts):
        ranges = [(min(w * per, chunks), min(min(w * per, chunks) + per, chunks)) for w in range(MK.SCAN_WARPS)]
        own = [sum(cells[c][e] for c in range(lo, hi)) for lo, hi in ranges]
        for w, (lo, hi) in enumerate(ranges):
            run = sum(own[:w])
            if w == MK.SCAN_WARPS - 1:
                cells[chunks][e] = run + own[w]
            for c in range(lo, hi):
                cells[c][e], run = run, run + cells[c][e]
    table.copy_(torch.tensor(cells, dtype=torch.int32))


def _model_scatter(capacity, x, table, pos, ttp, ex, alignment, fill_end):
    flat = x.reshape(-1).tolist()
    chunks, experts = table.size(0) - 1, table.size(1)
    size = pos.size(1)
    warps, per_lane = MK._geometry(capacity)
    threads, span = 32 * warps, 32 * per_lane
    grid = max(chunks, -(-size // (8 * threads)))
    rows = table.tolist()
    assert JUNK not in rows[chunks], "the totals row was not written"
    total = rows[chunks]
    aligned = [-(-n // alignment) * alignment for n in total]
    start = [sum(aligned[:e]) for e in range(experts)]
    if fill_end >= 0:
        assert sum(aligned) <= fill_end, "device_assert: N must hold every aligned segment"
    out_pos, out_ttp = pos.tolist(), ttp.reshape(-1).tolist()
    for b in range(grid):
        before = rows[min(b, chunks)]
        warp_counts = []
        ranks = {}
        for w in range(warps):                       # phase 1: each warp's rounds of 32 lanes
            running = [0] * (experts + 1)
            for r in range(per_lane):
                lanes = [b * MK.CHUNK + w * span + r * 32 + lane for lane in range(32)]
                ev = [flat[i] if i < len(flat) and 0 <= flat[i] < experts else experts for i in lanes]
                for lane, i in enumerate(lanes):
                    ranks[i] = running[ev[lane]] + sum(ev[j] == ev[lane] for j in range(lane))
                for e in set(ev):
                    running[e] += ev.count(e)
            warp_counts.append(running)
        for w in range(warps):                       # phase 3: positions
            for r in range(per_lane):
                for lane in range(32):
                    i = b * MK.CHUNK + w * span + r * 32 + lane
                    if i >= len(flat):
                        continue
                    e = flat[i]
                    if not 0 <= e < experts:
                        out_ttp[i] = -1
                        continue
                    p = start[e] + before[e] + sum(warp_counts[v][e] for v in range(w)) + ranks[i]
                    out_ttp[i] = p
                    if 0 <= p < size:
                        out_pos[0][p], out_pos[1][p], out_pos[2][p] = e, i // x.size(1), i
        for e in range(b, experts, grid):            # phase 4: padding of CTA b's experts, then the tail
            for p in range(start[e] + total[e], min(start[e] + aligned[e], size)):
                for row in out_pos:
                    row[p] = -1
        for p in range(sum(aligned) + b * threads, min(fill_end, size), grid * threads):
            for q in range(p, min(p + threads, fill_end, size)):
                for row in out_pos:
                    row[q] = -1
    pos.copy_(torch.tensor(out_pos, dtype=torch.int32))
    ttp.copy_(torch.tensor(out_ttp, dtype=torch.int32).view(ttp.shape))
    ex.copy_(torch.tensor([start, [s + a for s, a in zip(start, aligned)], aligned], dtype=torch.int32))


@pytest.fixture
def model_kernels(monkeypatch):
    """Route ``_jit.get`` of the three kernels to the model; record the launches."""
    calls = []

    def get(name, cfg):
        assert name in NAMES

        def launch(*args):
            table = args[0] if name == NAMES[1] else args[1]     # the (chunks + 1, E) count table
            assert cfg == (() if name == NAMES[1] else (MK._capacity(table.size(1)),))
            calls.append((name, cfg, [tuple(a.shape) if torch.is_tensor(a) else a for a in args]))
            if name == NAMES[0]:
                _model_count(*args)
            elif name == NAMES[1]:
                _model_scan(*args)
            else:
                _model_scatter(cfg[0], *args)
        return launch

    monkeypatch.setattr(_jit, "get", get)
    return calls


def _run_model(calls, topk_idx, experts, size, alignment, force_no_sync=False):
    got = MK.get_fused_mapping_cuda(topk_idx, experts, size, alignment, force_no_sync)
    want = ref.get_fused_mapping(topk_idx, experts, size, alignment, force_no_sync)
    assert_same(got, want)
    return got


@pytest.mark.parametrize("rows,k,experts", [(1, 1, 8), (7, 6, 72), (300, 8, 256), (260, 8, 8), (129, 2, 384),
                                            (70, 6, 1000)])
@pytest.mark.parametrize("alignment", [1, 16, 48])
def test_launcher_with_kernel_model(model_kernels, rows, k, experts, alignment):
    """Token order, the trimmed (one-sync) mode, a given size and force_no_sync, through the kernel model."""
    topk_idx = random_topk(rows, k, experts)
    got = _run_model(model_kernels, topk_idx, experts, 0, alignment)
    need = sum(got[7])
    _run_model(model_kernels, topk_idx, experts, need + 3 * alignment + 5, alignment)
    _run_model(model_kernels, topk_idx, experts, need, alignment, force_no_sync=True)
    table = (-(-(rows * k) // MK.CHUNK) + 1, experts)
    bound = (rows * k + (alignment - 1) * experts) // alignment * alignment
    assert [c[0] for c in model_kernels] == list(NAMES) * 3
    assert model_kernels[0][2] == [(rows, k), table]
    assert model_kernels[1][2] == [table]
    assert model_kernels[2][2] == [(rows, k), table, (3, bound), (rows, k), (3, experts), alignment, -1]
    assert model_kernels[5][2][2] == (3, need + 3 * alignment + 5) and model_kernels[5][2][6] == need + 3 * alignment + 5
    assert model_kernels[8][2][2] == (3, max(need, 1)) and model_kernels[8][2][6] == need


def test_launcher_with_kernel_model_ties_and_big_tail(model_kernels):
    """Skewed (tied) routing, several chunks, and a tail spread over extra fill CTAs (size > chunks * 8 * threads)."""
    topk_idx = tied_topk(600, 8, 72)
    _run_model(model_kernels, topk_idx, 72, 0, 32)
    _run_model(model_kernels, topk_idx, 72, 30000, 32, force_no_sync=True)


def test_launcher_with_kernel_model_many_chunks(model_kernels):
    """17 chunks: the scan's warps own runs of 2, 1 and 0 rows; E = 1000 spans 32 scan CTAs."""
    topk_idx = random_topk(4100, 8, 1000, unrouted=0.1)
    _run_model(model_kernels, topk_idx, 1000, 0, 16)


def test_zero_size_with_force_no_sync(model_kernels):
    """N = 0 with force_no_sync: zero-length arrays, valid only when every entry is -1 (asserted otherwise)."""
    _run_model(model_kernels, torch.full((5, 3), -1), 8, 0, 4, force_no_sync=True)
    assert model_kernels[-1][2][2] == (3, 1) and model_kernels[-1][2][6] == 0
    with pytest.raises(AssertionError, match="N must hold"):
        MK.get_fused_mapping_cuda(random_topk(5, 3, 8, unrouted=0.0), 8, 0, 4, True)


@pytest.mark.parametrize("bad", [8, 100, -2])
def test_data_rules_reach_the_kernels(model_kernels, bad):
    """The kernels' device assertions (modelled): an entry outside {-1} u [0, E) in every mode; an N smaller than
    sum a_e with a given N, never in the trimmed mode (the launcher passes fill_end = -1 there)."""
    topk_idx = random_topk(50, 4, 8)
    wild = topk_idx.clone()
    wild[17, 2] = bad
    for size, sync in ((0, False), (1000, False), (1000, True)):
        with pytest.raises(AssertionError, match="out of range"):
            MK.get_fused_mapping_cuda(wild, 8, size, 4, sync)
    need = sum(_run_model(model_kernels, topk_idx, 8, 0, 4)[7])
    for sync in (False, True):
        with pytest.raises(AssertionError, match="N must hold"):
            MK.get_fused_mapping_cuda(topk_idx, 8, need - 1, 4, sync)
        _run_model(model_kernels, topk_idx, 8, need, 4, sync)


def test_reference_path_past_the_int32_bound(monkeypatch):
    """Past ``_MAX_INDEX`` the launcher runs the reference and checks the data rules with torch assertions (on
    CPU: RuntimeError), since the public op leaves them to the CUDA path."""
    monkeypatch.setattr(_jit, "get", lambda *a: pytest.fail("launched"))
    monkeypatch.setattr(MK, "_MAX_INDEX", 100)
    topk_idx = random_topk(30, 4, 8)
    for size, sync in ((0, False), (200, False), (200, True)):
        assert_same(MK.get_fused_mapping_cuda(topk_idx, 8, size, 4, sync), ref.get_fused_mapping(topk_idx, 8, size, 4, sync))
    wild = topk_idx.clone()
    wild[3, 1] = -2
    with pytest.raises(RuntimeError, match="topk_idx entries"):
        MK.get_fused_mapping_cuda(wild, 8, 0, 4, False)
    with pytest.raises(RuntimeError, match="aligned expert segment"):
        MK.get_fused_mapping_cuda(topk_idx, 8, 50, 4, True)


def test_no_launch_paths(monkeypatch):
    """T*K == 0 and the int32 guard (positions that would not fit in int32) never launch."""
    monkeypatch.setattr(_jit, "get", lambda *a: pytest.fail("launched"))
    for shape, size, sync in (((0, 6), 0, False), ((0, 6), 5, False), ((0, 6), 0, True), ((3, 0), 4, True)):
        topk_idx = torch.empty(shape, dtype=torch.int64)
        assert_same(MK.get_fused_mapping_cuda(topk_idx, 4, size, 16, sync), ref.get_fused_mapping(topk_idx, 4, size, 16, sync))
    unrouted = torch.full((3, 2), -1)
    big = 2 ** 31 - 1
    assert_same(MK.get_fused_mapping_cuda(unrouted, 1, 4, big, True), ref.get_fused_mapping(unrouted, 1, 4, big, True))


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(7, 6, dtype=torch.int64)
        pos, ttp, ex = torch.ops.tilefuse.get_fused_mapping(x, 72, 100, 16, 100)
        assert pos.shape == (3, 100) and ttp.shape == (7, 6) and ex.shape == (3, 72)
        assert pos.dtype == ttp.dtype == ex.dtype == torch.int32


@pytest.mark.parametrize("size,fill_end", [(0, 0), (1, 1), (3000, 3000), (4000, -1)])
def test_fake_matches_the_eager_layout(model_kernels, size, fill_end):
    """The fake (torch.compile's path) gives the eager launches' shapes, dtypes and strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    topk_idx = random_topk(40, 6, 72, unrouted=1.0 if size <= 1 else 0.25)
    eager = MK._layout(topk_idx, 72, size, 16, fill_end)
    with FakeTensorMode() as mode:
        fake = torch.ops.tilefuse.get_fused_mapping(mode.from_tensor(topk_idx), 72, size, 16, fill_end)
    for e, f in zip(eager, fake, strict=True):
        assert (e.shape, e.dtype, e.stride()) == (f.shape, f.dtype, f.stride())


def test_capacity_and_geometry():
    assert [MK._capacity(e) for e in (1, 256, 257, 512, 513, 1024)] == [256, 256, 512, 512, 1024, 1024]
    for cap in MK.CAPACITIES:
        warps, per_lane = MK._geometry(cap)
        assert warps * 32 * per_lane == MK.CHUNK and warps * (cap + 1) * 4 <= 33 * 1024


# ----------------------------------------------------------------------------------------------------
# Compile tier
# ----------------------------------------------------------------------------------------------------

@pytest.mark.compile
@pytest.mark.parametrize("name,cfg", configs.mapping_kernel_configs(), ids=str)
def test_builds_for_sm90(name, cfg):
    import tilelang

    fn = _jit._FACTORIES[name][0](*cfg)
    kernel = tilelang.compile(fn, target={"kind": "cuda", "arch": "sm_90"}, execution_backend="tvm_ffi",
                              pass_configs=dict(_jit._PASS_CONFIGS))
    src = kernel.get_kernel_source()
    assert "__global__" in src and "use_fast_math" not in src
    assert "cudaGridDependencySynchronize" in src            # programmatic dependent launch
    assert "atomic" not in src or name == NAMES[0]            # positions never come from atomics
    assert ("device_assert(" in src) == (name != NAMES[1])    # the data rules (count: indices, scatter: N)


# ----------------------------------------------------------------------------------------------------
# GPU tier
# ----------------------------------------------------------------------------------------------------

cuda = pytest.mark.gpu


def _check(topk_idx, experts, alignment):
    """All three size modes against the reference, bit-exact."""
    got = MK.get_fused_mapping_cuda(topk_idx, experts, 0, alignment, False)
    assert_same(got, ref.get_fused_mapping(topk_idx, experts, 0, alignment, False))
    need = sum(got[7])
    for size, sync in ((need + 2 * alignment + 3, False), (need, True)):
        assert_same(MK.get_fused_mapping_cuda(topk_idx, experts, size, alignment, sync),
                    ref.get_fused_mapping(topk_idx, experts, size, alignment, sync))


@cuda
@pytest.mark.parametrize("k", [1, 2, 6, 8])
@pytest.mark.parametrize("experts", [8, 72, 256, 384])
@pytest.mark.parametrize("rows", [0, 1, 7, 4001, 8192])
def test_matches_reference(rows, experts, k):
    _check(random_topk(rows, k, experts, device="cuda"), experts, 128 if rows % 2 else 16)


@cuda
@pytest.mark.parametrize("alignment", [1, 3, 64, 128, 1000])
@pytest.mark.parametrize("experts", [1, 512, 1000, 1024])
def test_alignments_and_capacities(experts, alignment):
    _check(random_topk(2500, 8, experts, device="cuda"), experts, alignment)


@cuda
@pytest.mark.parametrize("slots", [2047, 2048, 2049, 4096 + 31])
def test_chunk_boundaries_ties_and_unrouted(slots):
    """Chunk edges, tied scores (skewed segments), all-unrouted and single-expert inputs."""
    _check(tied_topk(slots, 1, 72, device="cuda"), 72, 16)
    _check(torch.full((slots, 1), -1, device="cuda"), 72, 16)
    _check(torch.full((slots, 1), 5, device="cuda"), 72, 128)


@cuda
def test_deterministic():
    topk_idx = random_topk(8192, 8, 256, device="cuda")
    a = MK.get_fused_mapping_cuda(topk_idx, 256, 0, 128, False)
    b = MK.get_fused_mapping_cuda(topk_idx, 256, 0, 128, False)
    assert_same(a, b)


@cuda
@pytest.mark.parametrize("chunk", [256, 1024])
def test_chunk_knob_variants_gpu(chunk, knob_kernels):
    """Other chunk sizes (a knob: the layout never depends on it) give the reference's arrays (compiled here)."""
    knob_kernels(MK, {"CHUNK": chunk})
    for rows, experts, k in ((1, 8, 1), (4001, 72, 6), (8192, 256, 8), (8192, 384, 8)):
        test_matches_reference(rows, experts, k)
    for experts in (1, 1024):
        test_alignments_and_capacities(experts, 64)
    for slots in (chunk - 1, chunk, chunk + 1, 4 * chunk + 31):
        test_chunk_boundaries_ties_and_unrouted(slots)
    test_many_chunks()


@cuda
def test_many_chunks():
    """Hundreds of chunks (the scan's warps own 10 rows each) and the widest table."""
    for experts in (256, 1024):
        _check(random_topk(40000, 8, experts, unrouted=0.05, device="cuda"), experts, 128)


_BAD_DATA = """
import torch
from tilefuse.moe import _mapping_kernel as MK
torch.manual_seed(0)
x = torch.randint(0, 256, (3000, 8), device="cuda")
x[::5, 1] = -1
case = "{case}"
size, sync = 0, False
if case == "high":
    x[1234, 5] = 256
elif case == "low":
    x[2999, 7] = -2
elif case == "small":
    size, sync = int((x >= 0).sum()) - 1, True   # alignment 1: sum a_e is the routed slots
MK.get_fused_mapping_cuda(x, 256, size, 1, sync)
torch.cuda.synchronize()
print("no error")
"""


@cuda
@pytest.mark.parametrize("case", ["valid", "high", "low", "small"])
def test_data_rules_assert_on_device(case):
    """moe.md 2.5: an entry outside {-1} u [0, E), or a given N below sum a_e, trips the kernels' device-side
    assertion (in a child process: a device assert leaves the CUDA context unusable); valid data runs clean."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", _BAD_DATA.format(case=case)], capture_output=True, text=True,
                         timeout=600, cwd=root)
    if case == "valid":
        assert res.returncode == 0 and "no error" in res.stdout, res.stdout + res.stderr
    else:
        assert res.returncode != 0 and "no error" not in res.stdout, res.stdout + res.stderr
        # tl's device_assert is CUDA's assert: "Assertion `cond` failed", then CUDA_ERROR_ASSERT on the next call
        assert "Assertion `cond` failed" in res.stdout + res.stderr, res.stderr[-2000:]


@cuda
def test_batch_invariance():
    """A token's slots keep their order among the earlier tokens' slots whatever follows them: the positions of
    a prefix batch equal the big batch's positions relative to each segment, for alignment 1."""
    big = random_topk(6000, 8, 72, device="cuda")
    small = big[:2500].contiguous()
    full = MK.get_fused_mapping_cuda(big, 72, 0, 1, False)
    part = MK.get_fused_mapping_cuda(small, 72, 0, 1, False)
    e = small.clamp_min(0)
    rel_full = torch.where(small >= 0, full[3][:2500] - full[4][e], -1)
    rel_part = torch.where(small >= 0, part[3] - part[4][e], -1)
    assert torch.equal(rel_full, rel_part)


@cuda
def test_host_syncs():
    """Exactly one synchronising copy in the trimmed mode, none with force_no_sync or a given size."""
    topk_idx = random_topk(4001, 8, 256, device="cuda")
    MK.get_fused_mapping_cuda(topk_idx, 256, 0, 128, False)     # compile / load outside the count
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        MK.get_fused_mapping_cuda(topk_idx, 256, 60000, 128, False)
        MK.get_fused_mapping_cuda(topk_idx, 256, 60000, 128, True)
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            MK.get_fused_mapping_cuda(topk_idx, 256, 0, 128, False)
        assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1
    finally:
        torch.cuda.set_sync_debug_mode("default")


@cuda
def test_cuda_graph_replay():
    topk_idx = random_topk(4001, 8, 256, device="cuda")
    MK.get_fused_mapping_cuda(topk_idx, 256, 70000, 128, True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = MK.get_fused_mapping_cuda(topk_idx, 256, 70000, 128, True)
    for _ in range(2):
        topk_idx.copy_(random_topk(4001, 8, 256, device="cuda"))
        graph.replay()
        assert_same(out, ref.get_fused_mapping(topk_idx, 256, 70000, 128, True))


@cuda
def test_torch_compile_fullgraph():
    topk_idx = random_topk(4001, 6, 72, device="cuda")

    def kernel(x):
        return MK.get_fused_mapping_cuda(x, 72, 40000, 16, True)

    def public(x):
        return moe.get_fused_mapping(x, 72, 40000, 16, True)

    want = ref.get_fused_mapping(topk_idx, 72, 40000, 16, True)
    for fn in (kernel, public):
        torch._dynamo.reset()
        assert_same(torch.compile(fn, fullgraph=True)(topk_idx), want)
