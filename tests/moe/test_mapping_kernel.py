"""get_fused_mapping kernels (tilefuse/moe/_mapping_kernel.py) against the reference (moe.md §1.5, §2.5).

CPU tier: the launcher end to end with the two kernels replaced by a plain-Python model of what each CTA does
(chunks, warps, rounds of 32 lanes, the padding and tail split over the grid), so the index arithmetic and the
launcher's trimming are checked without a GPU; the no-launch paths; the fake. Compile tier: every registered config
builds for sm_90. GPU tier: the kernels themselves, bit-exact against the reference.
"""
import warnings

import pytest
import torch

from tilefuse import _jit, moe
from tilefuse.moe import _mapping_kernel as MK
from tilefuse.reference import moe as ref

NAMES = ("moe_fused_mapping_count", "moe_fused_mapping_scatter")


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
# A model of the two kernels (what each CTA computes), run in place of the launches
# ----------------------------------------------------------------------------------------------------

def _model_count(x, counts):
    flat, experts = x.reshape(-1).tolist(), counts.size(1)
    counts.zero_()
    for i, v in enumerate(flat):
        if 0 <= v < experts:
            counts[i // MK.CHUNK, v] += 1


def _model_scatter(capacity, x, counts, pos, ttp, ex, alignment, fill_end):
    flat = x.reshape(-1).tolist()
    chunks, experts = counts.shape
    size = pos.size(1)
    warps, per_lane = MK._geometry(capacity)
    threads, span = 32 * warps, 32 * per_lane
    grid = max(chunks, -(-size // (8 * threads)))
    table = counts.tolist()
    total = [sum(table[c][e] for c in range(chunks)) for e in range(experts)]
    aligned = [-(-n // alignment) * alignment for n in total]
    start = [sum(aligned[:e]) for e in range(experts)]
    out_pos, out_ttp = pos.tolist(), ttp.reshape(-1).tolist()
    for b in range(grid):
        before = [sum(table[c][e] for c in range(min(b, chunks))) for e in range(experts)]
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
    """Route ``_jit.get`` of the two kernels to the model; record the launches."""
    calls = []

    def get(name, cfg):
        assert name in NAMES

        def launch(*args):
            assert cfg == (MK._capacity(args[1].size(1)),)     # args[1]: the (chunks, E) count table
            calls.append((name, cfg, [tuple(a.shape) if torch.is_tensor(a) else a for a in args]))
            if name == NAMES[0]:
                _model_count(*args)
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
    chunks = -(-(rows * k) // MK.CHUNK)
    assert [c[0] for c in model_kernels] == list(NAMES) * 3
    assert model_kernels[0][2] == [(rows, k), (chunks, experts)]
    assert model_kernels[1][2][1:] == [(chunks, experts), (3, (rows * k + (alignment - 1) * experts) // alignment
                                                          * alignment), (rows, k), (3, experts), alignment, 0]
    assert model_kernels[3][2][2] == (3, need + 3 * alignment + 5) and model_kernels[3][2][6] == need + 3 * alignment + 5


def test_launcher_with_kernel_model_ties_and_big_tail(model_kernels):
    """Skewed (tied) routing, several chunks, and a tail spread over extra fill CTAs (size > chunks * 8 * threads)."""
    topk_idx = tied_topk(600, 8, 72)
    _run_model(model_kernels, topk_idx, 72, 0, 32)
    _run_model(model_kernels, topk_idx, 72, 30000, 32, force_no_sync=True)


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


def test_capacity_and_geometry():
    assert [MK._capacity(e) for e in (1, 256, 257, 512, 513, 1024)] == [256, 256, 512, 512, 1024, 1024]
    for cap in MK.CAPACITIES:
        warps, per_lane = MK._geometry(cap)
        assert warps * 32 * per_lane == MK.CHUNK and warps * (cap + 1) * 4 <= 33 * 1024


# ----------------------------------------------------------------------------------------------------
# Compile tier
# ----------------------------------------------------------------------------------------------------

@pytest.mark.compile
@pytest.mark.parametrize("name,cfg", [(n, c) for n in NAMES for c in MK._configs()], ids=str)
def test_builds_for_sm90(name, cfg):
    import tilelang

    fn = _jit._FACTORIES[name][0](*cfg)
    kernel = tilelang.compile(fn, target={"kind": "cuda", "arch": "sm_90"}, execution_backend="tvm_ffi",
                              pass_configs=dict(_jit._PASS_CONFIGS))
    src = kernel.get_kernel_source()
    assert "__global__" in src and "use_fast_math" not in src
    assert "cudaGridDependencySynchronize" in src            # programmatic dependent launch
    assert "atomic" not in src or name == NAMES[0]            # positions never come from atomics


# ----------------------------------------------------------------------------------------------------
# GPU tier
# ----------------------------------------------------------------------------------------------------

cuda = pytest.mark.gpu


def _poison():
    """Fill freed caching-allocator blocks with a pattern, so that unwritten outputs show."""
    junk = torch.full((1 << 22,), 0x5A5A5A5A, dtype=torch.int32, device="cuda")
    del junk


def _check(topk_idx, experts, alignment):
    """All three size modes against the reference, bit-exact."""
    _poison()
    got = MK.get_fused_mapping_cuda(topk_idx, experts, 0, alignment, False)
    assert_same(got, ref.get_fused_mapping(topk_idx, experts, 0, alignment, False))
    need = sum(got[7])
    for size, sync in ((need + 2 * alignment + 3, False), (need, True)):
        _poison()
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
def test_deterministic_and_out_of_range_values_ignored():
    topk_idx = random_topk(8192, 8, 256, device="cuda")
    a = MK.get_fused_mapping_cuda(topk_idx, 256, 0, 128, False)
    b = MK.get_fused_mapping_cuda(topk_idx, 256, 0, 128, False)
    assert_same(a, b)
    wild = topk_idx.clone()
    wild[::7, 3] = 300          # outside [0, E): the op asserts on it; the kernel must treat it as unrouted
    wild[::5, 1] = -9
    assert_same(MK.get_fused_mapping_cuda(wild, 256, 0, 128, False), ref.get_fused_mapping(wild, 256, 0, 128, False))
    # a size too small for the segments (the op asserts on it): writes stay inside the arrays
    out = MK.get_fused_mapping_cuda(topk_idx, 256, 100, 128, True)
    torch.cuda.synchronize()
    assert out[0].shape == (100,)


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
