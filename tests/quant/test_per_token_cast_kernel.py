"""Kernel tiers for the per-token casts (quant.md 3.1-3.3): compile (sm_90, no GPU) and gpu (bit-exact vs reference).

Every GPU comparison is bitwise (quant.md 6.2): data, sf and sf strides, with packed-UE8M0 padding bytes
cleared on both sides (6.1 ``clear_unused_sf``). Outputs are poisoned (0xFF in the allocator's free blocks)
before each launch so unwritten elements show.
"""
import pytest
import torch

from tilefuse import _jit, _registry, quant
from tilefuse.quant import _per_token_cast_kernel as K
from tilefuse.reference.quant import cast as ref_cast
from tilefuse.testing import assert_equal, clear_unused_sf, every_bf16_in_groups, quant_adversarial
from tilefuse.testing.generators import QUANT_FILLS
from tests.quant.configs import PER_TOKEN, PER_TOKEN_HIDDEN, PER_TOKEN_ROW_WALK_HIDDEN
from tests.quant.kernel_binding import fake_jit

TOKENS = (0, 1, 7, 4001, 8192)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.mark.compile
@pytest.mark.parametrize("cfg", PER_TOKEN, ids=str)
def test_builds_for_sm90(cfg):
    kernel = _jit.compile_kernel("per_token_cast", cfg, "sm_90", export=False)
    src = kernel.get_kernel_source()
    assert "__global__" in src
    assert "use_fast_math" not in src



def _bind(monkeypatch) -> list:
    """``fake_jit`` with an empty launch-plan cache (a cached plan keeps the kernel it fetched first)."""
    monkeypatch.setattr(K, "_PLANS", {})
    return fake_jit(monkeypatch)


@pytest.mark.compile
@pytest.mark.parametrize("xd,fmt,h", [("bfloat16", "e4m3", 576), ("float32", "e2m1", 7168)], ids=str)
@pytest.mark.parametrize("flags", ((False, True, False), (True, False, False), (True, True, True)), ids=str)
@pytest.mark.parametrize("t,width", [(7, 0), (7, 64), (7, 3), (1, 3)], ids=str)
def test_cast_launcher_binds_kernel_parameters(xd, fmt, h, flags, t, width, monkeypatch):
    """mode "cast": every sf layout (row, column-major fp32, packed UE8M0 with its 4-aligned column stride),
    contiguous rows, aligned row strides passed as they are, other strides through a copy, one row."""
    col, round_sf, packed = flags
    calls = _bind(monkeypatch)
    x = torch.randn(t, h + width).to(DTYPES[xd])[:, :h]
    out, sf = K.per_token_cast_launch(x, None, fmt, 128, None, col, round_sf, packed)
    layout = "col_packed" if packed else ("col" if col else "row")
    assert [(c.name, c.cfg, c.env["num_tokens"]) for c in calls] == [
        ("per_token_cast", (xd, fmt, h, 128, round_sf, layout, "cast"), t)]
    if t > 1:
        aligned = (h + width) * x.element_size() % 16 == 0
        assert calls[0].env["x_row_stride"] == (h + width if aligned else h)
    if col:
        assert calls[0].env["sf_pad"] == (t + 3) // 4 * 4 == sf.stride(1)


@pytest.mark.compile
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("flags", ((False, True, False), (True, True, True)), ids=str)
def test_sf_only_launcher_binds_kernel_parameters(fmt, flags, monkeypatch):
    col, round_sf, packed = flags
    calls = _bind(monkeypatch)
    x = torch.randn(7, 2048 + 64).to(torch.bfloat16)[:, :2048]
    K.per_token_cast_launch(x, None, fmt, 128, None, col, round_sf, packed, mode="sf_only")
    layout = "col_packed" if packed else ("col" if col else "row")
    assert [(c.name, c.cfg, c.env["num_tokens"], c.env["x_row_stride"]) for c in calls] == [
        ("per_token_cast", ("bfloat16", fmt, 2048, 128, round_sf, layout, "sf_only"), 7, 2048 + 64)]


@pytest.mark.compile
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("sf_width", (16, 20), ids=("sf_contiguous", "sf_row_strided"))
def test_precomputed_launcher_binds_kernel_parameters(fmt, sf_width, monkeypatch):
    """mode "precomputed": a row-major fp32 sf, contiguous or with a longer row stride (inner-contiguous)."""
    calls = _bind(monkeypatch)
    x = torch.randn(7, 2048).to(torch.bfloat16)
    sf = (torch.rand(7, sf_width) + 0.5)[:, :16]
    K.per_token_cast_launch(x, None, fmt, 128, mode="precomputed", sf=sf)
    assert [(c.name, c.cfg, c.env["num_tokens"], c.env["sf_pad"]) for c in calls] == [
        ("per_token_cast", ("bfloat16", fmt, 2048, 128, False, "row", "precomputed"), 7, sf_width)]


@pytest.mark.compile
@pytest.mark.parametrize("in_fmt,fmt", [("e4m3", "e4m3"), ("e4m3", "e2m1"), ("e2m1", "e4m3"), ("e2m1", "e2m1")])
@pytest.mark.parametrize("sf_kind", ("packed_col", "fp32_row"))
def test_prequantized_launcher_binds_kernel_parameters(in_fmt, fmt, sf_kind, monkeypatch):
    """Pre-quantized (data, sf) pairs: e4m3 or packed-E2M1 data, with (128, 128) packed-UE8M0 column-major sf
    or (32, 32) row-major fp32 sf; the output in every layout the pair's config uses."""
    t = 300
    packed = sf_kind == "packed_col"
    bs = (128, 128) if packed else (32, 32)
    npc = 128 if packed else 32
    data, x_sf = ref_cast(torch.randn(t, 2048), in_fmt, bs, round_sf=packed, use_tma_aligned_col_major_sf=packed,
                          use_packed_ue8m0=packed)
    calls = _bind(monkeypatch)
    K.per_token_cast_launch(data, x_sf, fmt, npc, bs, packed, packed, packed)
    xd = "float8_e4m3fn" if in_fmt == "e4m3" else "e2m1"
    layout = "col_packed" if packed else "row"
    assert [(c.name, c.cfg, c.env["num_tokens"], c.env["in_sf_rows"]) for c in calls] == [
        ("per_token_cast", (xd, fmt, 2048, npc, packed, layout, "cast", *bs, packed), t, -(-t // bs[0]))]


def _poison():
    """Fill the caching allocator's free memory with 0xFF so freshly allocated outputs start poisoned."""
    free = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    free.fill_(0xFF)
    del free


def _compare_sf(got, want, hidden, npc, packed):
    """Strides compared on the device tensor (``.cpu()`` compacts a strided view), then the bytes."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.stride() == want.stride() or got.numel() == 0
    got = got.cpu().contiguous().view(-1).view(want.shape)  # fresh row-major strides on both sides
    want = want.contiguous().view(-1).view(want.shape)
    if packed:
        got, want = clear_unused_sf(got, hidden, npc), clear_unused_sf(want, hidden, npc)
    assert_equal(got, want)


def _run(x, fmt, npc, col, round_sf, packed, x_sf=None, x_block_size=None):
    _poison()
    got = K.per_token_cast_launch(x, x_sf, fmt, npc, x_block_size, col, round_sf, packed)
    torch.cuda.synchronize()
    return got


def _check(x, fmt, npc, col, round_sf, packed, x_sf=None, x_block_size=None):
    out, sf = _run(x, fmt, npc, col, round_sf, packed, x_sf, x_block_size)
    ref_in = x.cpu() if x_sf is None else (x.cpu(), x_sf.cpu())
    r_out, r_sf = ref_cast(ref_in, fmt, (1, npc), x_block_size=x_block_size, round_sf=round_sf,
                           use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)
    hidden = x.size(1) * (2 if x.dtype == torch.int8 else 1)
    assert_equal(out.cpu(), r_out)
    _compare_sf(sf, r_sf, hidden, npc, packed)
    return out, sf


@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("hidden", PER_TOKEN_HIDDEN)
def test_bf16_e4m3_col_packed_matches_reference(t, hidden):
    x = torch.randn(t, hidden, dtype=torch.bfloat16, device="cuda")
    _check(x, "e4m3", 128, True, True, True)


@pytest.mark.gpu
@pytest.mark.parametrize("t", (1, 7, 4001))
@pytest.mark.parametrize("hidden", (576, 7168))
@pytest.mark.parametrize("x_dtype", ("bfloat16", "float32"))
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("flags", ((False, True, False), (True, True, True), (True, False, False)), ids=str)
def test_grid_matches_reference(t, hidden, x_dtype, fmt, flags):
    col, round_sf, packed = flags
    x = torch.randn(t, hidden, dtype=DTYPES[x_dtype], device="cuda")
    _check(x, fmt, 128, col, round_sf, packed)


@pytest.mark.gpu
@pytest.mark.parametrize("t", (1, 7, 4001))
@pytest.mark.parametrize("hidden", PER_TOKEN_ROW_WALK_HIDDEN)
@pytest.mark.parametrize("x_dtype", ("bfloat16", "float32"))
@pytest.mark.parametrize("round_sf", (False, True))
def test_row_walk_tiles_match_reference(t, hidden, x_dtype, round_sf):
    """Row-major sf at hidden sizes whose row-walk CTA covers several rows or a third of a row."""
    x = torch.randn(t, hidden, dtype=DTYPES[x_dtype], device="cuda")
    _check(x, "e4m3", 128, False, round_sf, False)


def test_row_walk_threads_cover_whole_rows_or_equal_parts():
    """The CTA of a row-walk tile covers k whole rows or 1/d of one, with a thread count that is a multiple of 32
    and at most 1024; 7168 channels keep their one-row 448-thread CTA."""
    assert K.row_walk_threads(56, 16, 2) == 448 and K.row_walk_threads(56, 32, 2) == 448
    for h in (1536, 2048, 4096, 5120, 8192, 12288, 18432):
        for lanes in (16, 32):
            n = h // 128
            threads = K.row_walk_threads(n, lanes, 2)
            units = threads * 2 // lanes
            assert threads % 32 == 0 and threads <= 1024
            assert units % n == 0 or n % units == 0, (h, lanes, threads)


@pytest.mark.gpu
@pytest.mark.parametrize("fill", QUANT_FILLS)
@pytest.mark.parametrize("x_dtype", ("bfloat16", "float32"))
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("flags", ((False, True, False), (True, True, True), (True, False, False)), ids=str)
def test_adversarial_fills_match_reference(fill, x_dtype, fmt, flags):
    """Zero blocks, subnormals, huge values, NaN and +-inf (quant.md 1.7: NaN ignored by the amax, inf gives
    sf = inf and sf_inv = 0, NaN encodes as positive NaN / code 7), and rows of format maxima and ties."""
    x = quant_adversarial(61, 576, fill, dtype=DTYPES[x_dtype], device="cuda")
    _check(x, fmt, 128, *flags)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", ("bfloat16", "float32"))
def test_e2m1_groups_near_the_largest_float(x_dtype):
    """Group maxima above 6 * 2^125 make sf_inv = 6 / amax smaller than 2^-125, where halving it would round:
    the kernel then forms x * sf_inv before halving (unrounded sf), exactly like the reference."""
    x = torch.randn(61, 576) * 1e38
    x[:, ::128] = torch.linspace(2.5e38, 3.3e38, 61)[:, None]
    _check(x.to(DTYPES[x_dtype]).cuda(), "e2m1", 128, True, False, False)
    _check(x.to(DTYPES[x_dtype]).cuda(), "e2m1", 128, False, True, False)


@pytest.mark.gpu
@pytest.mark.parametrize("round_sf", (False, True))
def test_e2m1_encodes_every_bf16_pattern(round_sf):
    """Every finite bf16 pattern of magnitude <= 6 in groups whose amax is 6 (sf = 1): each E2M1 tie and
    rounding boundary of the nibble encoder, against the reference's decision table."""
    x = every_bf16_in_groups(128)
    x = torch.cat((x, torch.full((-x.size(0) % 56, 128), 6.0, dtype=x.dtype))).view(-1, 7168).cuda()
    _check(x, "e2m1", 128, not round_sf, round_sf, False)  # (col, plain) and (row, round): compiled configs
    _check(x.float(), "e2m1", 128, not round_sf, round_sf, False)


@pytest.mark.gpu
@pytest.mark.parametrize("npc", (16, 32, 64, 2048))
def test_num_per_channels(npc):
    x = torch.randn(4001, 2048, dtype=torch.bfloat16, device="cuda") * 3
    _check(x, "e4m3", npc, False, False, False)


@pytest.mark.gpu
@pytest.mark.parametrize("in_fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
def test_prequantized_input(in_fmt, fmt):
    base = torch.randn(4001, 2048, dtype=torch.bfloat16)
    data, sf = ref_cast(base, in_fmt, (128, 128), round_sf=True, use_tma_aligned_col_major_sf=True,
                        use_packed_ue8m0=True)
    _check(data.cuda(), fmt, 128, True, True, True, x_sf=sf.cuda(), x_block_size=(128, 128))


@pytest.mark.gpu
def test_prequantized_unrounded_sf_order_a():
    base = torch.randn(4001, 2048, dtype=torch.bfloat16)
    data, sf = ref_cast(base, "e4m3", (32, 32))
    _check(data.cuda(), "e4m3", 32, False, False, False, x_sf=sf.cuda(), x_block_size=(32, 32))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
def test_sf_only_equals_cast_sf(fmt):
    x = torch.randn(4001, 2048, dtype=torch.bfloat16, device="cuda")
    _, sf = _run(x, fmt, 128, False, True, False)
    _poison()
    got = K.per_token_cast_launch(x, None, fmt, 128, None, False, True, False, mode="sf_only")
    assert_equal(got, sf)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
def test_precomputed_sf(fmt):
    x = torch.randn(4001, 2048, dtype=torch.bfloat16, device="cuda")
    sf = torch.rand(4001, 16, device="cuda") * 0.01 + 1e-3
    _poison()
    got = K.per_token_cast_launch(x, None, fmt, 128, mode="precomputed", sf=sf)
    assert_equal(got.cpu(), ref_cast(x.cpu(), fmt, (1, 128), sf=sf.cpu()))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", (576, 7168))
def test_strided_rows_equal_contiguous(hidden):
    big = torch.randn(4001, 2 * hidden + 64, dtype=torch.bfloat16, device="cuda")
    x = big[:, :hidden]
    a = _run(x, "e4m3", 128, True, True, True)
    b = _run(x.contiguous(), "e4m3", 128, True, True, True)
    assert_equal(a[0], b[0])
    assert_equal(clear_unused_sf(a[1], hidden, 128), clear_unused_sf(b[1], hidden, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
def test_deterministic_and_batch_invariant(fmt):
    x = torch.randn(8192, 7168, dtype=torch.bfloat16, device="cuda")
    out1, sf1 = _run(x, fmt, 128, False, True, False)
    out2, sf2 = _run(x, fmt, 128, False, True, False)
    assert_equal(out1, out2)
    assert_equal(sf1, sf2)
    for lo, hi in ((0, 1), (4000, 4007), (8191, 8192)):
        o, s = _run(x[lo:hi], fmt, 128, False, True, False)
        assert_equal(o, out1[lo:hi])
        assert_equal(s, sf1[lo:hi])


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager():
    x = torch.randn(4001, 7168, dtype=torch.bfloat16, device="cuda")
    eager = _run(x, "e4m3", 128, True, True, True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        K.per_token_cast_launch(x, None, "e4m3", 128, None, True, True, True)  # warm (compile) off-graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = K.per_token_cast_launch(x, None, "e4m3", 128, None, True, True, True)
    captured[0].fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    assert_equal(captured[0], eager[0])
    assert_equal(clear_unused_sf(captured[1], 7168, 128), clear_unused_sf(eager[1], 7168, 128))


@pytest.mark.gpu
def test_torch_compile_equals_eager():
    x = torch.randn(4001, 2048, dtype=torch.bfloat16, device="cuda")

    def f(x):
        out, sf = K.per_token_cast_cuda(x, "e2m1", 128, None, False, True, False)
        return out, sf, K.per_token_cast_with_sf_only_cuda(x, "e2m1", 128, False, True, False)

    compiled = torch.compile(f, fullgraph=True)
    got = compiled(x)
    want = f(x)
    for g, w in zip(got, want):
        assert_equal(g, w)


@pytest.mark.gpu
def test_no_allocation_beyond_outputs():
    x = torch.randn(4001, 7168, dtype=torch.bfloat16, device="cuda")
    K.per_token_cast_launch(x, None, "e4m3", 128, None, True, True, True)  # compile first
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, sf = K.per_token_cast_launch(x, None, "e4m3", 128, None, True, True, True)
    torch.cuda.synchronize()
    sf_store = sf.untyped_storage().nbytes()
    # the caching allocator rounds large blocks up to 2 MiB: allow that rounding, nothing more
    allowed = sum(-(-n // (2 << 20)) * (2 << 20) for n in (out.untyped_storage().nbytes(), sf_store))
    assert torch.cuda.max_memory_allocated() - base <= allowed


# ---- the public ops on CUDA tensors (they dispatch to the kernel) ----

def _public_case(x):
    """Every public per-token cast of ``x`` that reaches the kernel, as a tuple of output tensors."""
    out, sf = quant.per_token_cast(x, "e4m3", 128, None, True, True, True)
    out2, sf2 = quant.per_token_cast(x, "e2m1", 128, None, False, True, False)
    only = quant.per_token_cast_with_sf_only(x, "e2m1", 128, None, False, True, False)
    pre = quant.per_token_cast_with_precomputed_sf(x, "e4m3", 128, sf2)
    return out, sf, out2, sf2, only, pre


@pytest.mark.gpu
def test_public_ops_take_the_kernel_and_match_reference():
    x = torch.randn(4001, 2048, dtype=torch.bfloat16, device="cuda")
    assert all(_registry.OPS[f"quant.{n}"]["path"] == "kernel" for n in
               ("per_token_cast", "per_token_cast_with_sf_only", "per_token_cast_with_precomputed_sf"))
    got = _public_case(x)
    want = _public_case(x.cpu())
    for g, w in zip(got, want):
        assert g.is_cuda and g.stride() == w.stride()
    for i in (0, 2, 3, 4, 5):
        assert_equal(got[i].cpu(), want[i])
    assert_equal(clear_unused_sf(got[1].cpu().contiguous(), 2048, 128), clear_unused_sf(want[1].contiguous(), 2048, 128))
    data, sf = ref_cast(x.cpu(), "e2m1", (128, 128), round_sf=True, use_tma_aligned_col_major_sf=True,
                        use_packed_ue8m0=True)
    pair_got = quant.per_token_cast((data.cuda(), sf.cuda()), "e4m3", 128, (128, 128))
    pair_want = quant.per_token_cast((data, sf), "e4m3", 128, (128, 128))
    assert_equal(pair_got[0].cpu(), pair_want[0])
    assert_equal(pair_got[1].cpu(), pair_want[1])


@pytest.mark.gpu
def test_public_ops_torch_compile_fullgraph_equals_eager():
    x = torch.randn(4001, 2048, dtype=torch.bfloat16, device="cuda")
    compiled = torch.compile(_public_case, fullgraph=True)
    got = compiled(x)
    want = _public_case(x)
    for g, w in zip(got, want):
        assert g.stride() == w.stride()
        assert_equal(g, w)


@pytest.mark.gpu
def test_public_ops_cuda_graph_replay_equals_eager():
    x = torch.randn(4001, 2048, dtype=torch.bfloat16, device="cuda")
    eager = _public_case(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _public_case(x)  # warm (load) off-graph
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _public_case(x)
    for t in captured:
        t.fill_(1)  # poison
    graph.replay()
    torch.cuda.synchronize()
    for g, w in zip(captured, eager):
        assert_equal(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
def test_public_op_allocates_only_its_outputs(fmt):
    x = torch.randn(4001, 7168, dtype=torch.bfloat16, device="cuda")
    quant.per_token_cast(x, fmt, 128, None, True, True, True)  # load first
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, sf = quant.per_token_cast(x, fmt, 128, None, True, True, True)
    torch.cuda.synchronize()
    # the caching allocator rounds each block up (512 B small blocks, 2 MiB large ones): allow that only
    rounded = [-(-n // (2 << 20)) * (2 << 20) if n > (1 << 20) else -(-n // 512) * 512
               for n in (out.untyped_storage().nbytes(), sf.untyped_storage().nbytes())]
    assert torch.cuda.max_memory_allocated() - base <= sum(rounded)


@pytest.mark.gpu
def test_public_op_validation_cache():
    """Repeated eager calls skip the checks once their facts passed them: results stay exact at any token
    count and row stride, and arguments that differ in a checked fact still raise."""
    x = torch.randn(4001, 2048, dtype=torch.bfloat16, device="cuda")
    for _ in range(2):  # first call validates and records, second takes the cached launch
        for fmt in ("e4m3", "e2m1"):
            out, sf = quant.per_token_cast(x, fmt, 128, None, False, True, False)
            r_out, r_sf = ref_cast(x.cpu(), fmt, (1, 128), round_sf=True)
            assert_equal(out.cpu(), r_out)
            assert_equal(sf.cpu(), r_sf)
            assert_equal(quant.per_token_cast_with_sf_only(x, fmt, 128, None, False, True, False).cpu(), r_sf)
    strided = torch.randn(7, 4096 + 64, dtype=torch.bfloat16, device="cuda")[:, :2048]
    out, sf = quant.per_token_cast(strided, "e4m3", 128, None, False, True, False)
    assert_equal(out.cpu(), ref_cast(strided.cpu(), "e4m3", (1, 128), round_sf=True)[0])
    column_major = torch.randn(2048, 16, dtype=torch.bfloat16, device="cuda").t()  # same dtype and hidden
    with pytest.raises(ValueError, match="x must have a unit stride"):
        quant.per_token_cast(column_major, "e4m3", 128, None, False, True, False)
    with pytest.raises(TypeError, match="num_per_channels"):
        quant.per_token_cast(x, "e4m3", 128.0, None, False, True, False)
    with pytest.raises(ValueError, match="num_per_channels"):
        quant.per_token_cast(x[:, :1024], "e4m3", 2048, None, False, True, False)
    for bad_rank in (x[0, 0], x[0], x.view(1, 4001, 2048)):  # 0-d, 1-d, 3-d: never the cached 2-d launch
        with pytest.raises(ValueError, match="x must"):
            quant.per_token_cast(bad_rank, "e4m3", 128, None, False, True, False)
