"""Kernel tiers for the per-block casts (quant.md 3.6, 3.7): fake shapes (everywhere), launcher/kernel
interface and sm_90 builds (compile), and bit-exact kernel == reference on the GPU.

GPU comparisons call the reference on the same CUDA tensors and compare bitwise (quant.md 6.2): data, sf
and sf strides, with packed-UE8M0 padding bytes cleared on both sides (6.1 ``clear_unused_sf``). Outputs
are poisoned (0xFF in the allocator's free blocks) before each launch so unwritten elements show.
"""
import pytest
import torch

from tilefuse import _jit
from tilefuse.formats import cdiv, load_sf
from tilefuse.quant import _per_block_cast_kernel as K
from tilefuse.reference import quant as R
from tilefuse.testing import assert_equal, clear_unused_sf
from tests.quant.configs import LOSSLESS_OUT_BLOCKS, PER_BLOCK_CAST, PER_BLOCK_LOSSLESS
from tests.quant.configs import PER_BLOCK_BLOCKS as BLOCKS, PER_BLOCK_FLAG_SETS as FLAG_SETS
from tests.quant.kernel_binding import fake_jit

TOKENS = (0, 1, 7, 4001, 8192)
LAYOUT_FLAGS = {"row": (False, False), "col": (True, False), "col_packed": (True, True)}  # (col, packed)


# ---------------------------------------------------------------------------------------------------------
# Everywhere: the fake (meta) implementations give the reference's shapes, dtypes and strides
# ---------------------------------------------------------------------------------------------------------

def _meta_like(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def _same_meta(got: torch.Tensor, want: torch.Tensor):
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.numel():
        assert got.stride() == want.stride()


@pytest.mark.parametrize("t", (0, 1, 7, 300))
@pytest.mark.parametrize("block", ((128, 128), (32, 32), (32, 128)))
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("flags", ((False, True, False), (True, True, True), (True, False, False)), ids=str)
def test_fake_per_block_cast_matches_reference_metadata(t, block, fmt, flags):
    col, rnd, packed = flags
    x = torch.randn(t, 320, dtype=torch.bfloat16)
    want = R.cast(x, fmt, block, round_sf=rnd, use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)
    xm = _meta_like(x.shape, x.dtype)
    got = torch.ops.tilefuse.per_block_cast(xm, fmt, list(block), col, rnd, packed)
    _same_meta(got[0], want[0])
    _same_meta(got[1], want[1])
    _same_meta(torch.ops.tilefuse.per_block_cast_with_sf_only(xm, fmt, list(block), col, rnd, packed), want[1])


@pytest.mark.parametrize("t", (0, 7, 300))
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
def test_fake_precomputed_matches_reference_metadata(t, fmt):
    x = torch.randn(t, 320, dtype=torch.float32)
    sf = torch.rand(cdiv(t, 32), cdiv(320, 32)) + 0.5
    want = R.cast(x, fmt, (32, 32), sf=sf)
    got = torch.ops.tilefuse.per_block_cast_with_precomputed_sf(_meta_like(x.shape, x.dtype), fmt, [32, 32],
                                                                _meta_like(sf.shape, sf.dtype))
    _same_meta(got, want)


@pytest.mark.parametrize("t", (0, 1, 7, 300))
@pytest.mark.parametrize("out_block", LOSSLESS_OUT_BLOCKS)
@pytest.mark.parametrize("layout", tuple(LAYOUT_FLAGS))
def test_fake_lossless_matches_reference_metadata(t, out_block, layout):
    col, packed = LAYOUT_FLAGS[layout]
    data, sf_in = R.cast(torch.randn(t, 320), "e2m1", (1, 32), round_sf=True)
    want = R.per_block_cast_lossless((data, sf_in), (1, 32), out_block, col, packed)
    got = torch.ops.tilefuse.per_block_cast_lossless(_meta_like(data.shape, data.dtype),
                                                     _meta_like(sf_in.shape, sf_in.dtype),
                                                     [1, 32], list(out_block), col, packed)
    _same_meta(got[0], want[0])
    _same_meta(got[1], want[1])


@pytest.mark.parametrize("shape", ((0, 576), (5, 0)))
def test_empty_inputs_launch_nothing(shape, monkeypatch):
    def no_launch(name, cfg):
        raise AssertionError(f"launched {name} {cfg} for an empty input")
    monkeypatch.setattr(K._jit, "get", no_launch)
    x = torch.randn(shape, dtype=torch.bfloat16)
    out, sf = K.per_block_cast_launch(x, "e2m1", (32, 128), True, True, True)
    assert out.shape == (shape[0], shape[1] // 2) and out.dtype == torch.int8
    assert sf.shape == (cdiv(shape[0], 32), cdiv(cdiv(shape[1], 128), 4)) and sf.dtype == torch.int32
    data = torch.zeros(shape[0], shape[1] // 2, dtype=torch.int8)
    sf_in = torch.ones(shape[0], cdiv(shape[1], 32))
    out, sf = K.per_block_cast_lossless_launch(data, sf_in, (1, 32), (32, 32))
    assert out.shape == shape and out.dtype == torch.float8_e4m3fn
    assert sf.shape == (cdiv(shape[0], 32), cdiv(shape[1], 32)) and sf.dtype == torch.float32


def test_lossless_supported_covers_the_tested_blocks():
    for out_block in LOSSLESS_OUT_BLOCKS:
        assert K.lossless_supported((1, 32), out_block)
    assert not K.lossless_supported((1, 4), (1, 128))     # input blocks narrower than a thread's 8 channels
    assert not K.lossless_supported((1, 32), (1, 512))    # output blocks wider than a warp's 256 channels
    assert not K.lossless_supported((3, 32), (96, 128))   # non-power-of-two heights


# ---------------------------------------------------------------------------------------------------------
# Compile tier: every config the GPU tests use builds for sm_90; the launchers' arguments bind to the
# kernels' parameters (shapes, strides, dtypes), checked on CPU tensors without running anything
# ---------------------------------------------------------------------------------------------------------

_ALL = [("per_block_cast", c) for c in PER_BLOCK_CAST] + \
       [("per_block_cast_lossless", c) for c in PER_BLOCK_LOSSLESS]


@pytest.mark.compile
@pytest.mark.parametrize("name,cfg", _ALL, ids=str)
def test_builds_for_sm90(name, cfg):
    src = _jit.compile_kernel(name, cfg, "sm_90").get_kernel_source()
    assert "__global__" in src
    assert "use_fast_math" not in src


@pytest.mark.compile
@pytest.mark.parametrize("cfg", [("bfloat16", "e4m3", 2048, 32, 128, False, "row", "cast"),
                                 ("bfloat16", "e2m1", 2048, 128, 32, False, "col", "cast")], ids=str)
def test_no_round_uses_the_exact_quotients(cfg):
    """EXACT_DIV: without round_sf the scale pair comes from _tl's FMA-pipe quotients (bit-equal to IEEE
    division: tests/quant/test_per_channel_cast_kernel.py checks them for M = 448 and 6), no div.rn left."""
    assert K.EXACT_DIV
    src = _jit.compile_kernel("per_block_cast", cfg, "sm_90", export=False).get_kernel_source()
    assert "tf_quot_rn(" in src and "tf_inv_quot_rn(" in src and " / a)" not in src


@pytest.mark.compile
@pytest.mark.parametrize("name,cfg", [_ALL[0], ("per_block_cast", ("bfloat16", "e4m3", 576, 32, 32, False, "row",
                                                                   "precomputed")), _ALL[-1]], ids=str)
def test_pdl_wait_precedes_global_access(name, cfg):
    """CAST_PDL / LOSSLESS_PDL (on by default): the grid-dependency wait comes before every global load and store
    (a launch overlapping the previous grid's tail reads and writes nothing early)."""
    assert K.CAST_PDL and K.LOSSLESS_PDL
    src = _jit.compile_kernel(name, cfg, "sm_90", export=False).get_kernel_source()
    body = src[src.index("__launch_bounds__"):]
    body = body[body.index("{"):]
    wait = body.index("cudaGridDependencySynchronize();")
    first_global = min(i for i in (body.find(p) for p in ("X[", "X +", "D[", "D +", "SFI", "Y[", "Y +", "SF[", "SF +"))
                       if i >= 0)
    assert wait < first_global


@pytest.mark.compile
@pytest.mark.parametrize("cfg", [c for i, c in enumerate(PER_BLOCK_CAST)
                                 if i in (0, 5) or c[0] == "float32" or c[7] != "cast" or c[6] == "col"], ids=str)
def test_cast_launcher_binds_kernel_parameters(cfg, monkeypatch):
    x_dtype, fmt, hidden, bm, bk, rnd, layout, mode = cfg
    col, packed = LAYOUT_FLAGS[layout]
    calls = fake_jit(monkeypatch)
    t = 301
    x = torch.randn(t, hidden).to(getattr(torch, x_dtype))
    if mode == "precomputed":
        sf = torch.rand(cdiv(t, bm), 2 * cdiv(hidden, bk))[:, ::2].contiguous() + 0.5
        got = K.per_block_cast_launch(x, fmt, (bm, bk), mode=mode, sf=sf)
        _same_meta(got, R.cast(x, fmt, (bm, bk), sf=sf))
    else:
        got = K.per_block_cast_launch(x, fmt, (bm, bk), col, rnd, packed, mode=mode)
        want = R.cast(x, fmt, (bm, bk), round_sf=rnd, use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)
        if mode == "sf_only":
            _same_meta(got, want[1])
        else:
            _same_meta(got[0], want[0])
            _same_meta(got[1], want[1])
    assert [(n, c) for n, c, _ in calls] == [("per_block_cast", cfg)]
    assert calls[0][2]["num_tokens"] == t


@pytest.mark.compile
@pytest.mark.parametrize("cfg", PER_BLOCK_LOSSLESS, ids=str)
def test_lossless_launcher_binds_kernel_parameters(cfg, monkeypatch):
    hidden, ibm, ibk, obm, obk, in_packed, layout = cfg
    col, packed = LAYOUT_FLAGS[layout]
    calls = fake_jit(monkeypatch)
    data, sf_in = R.cast(torch.randn(301, hidden), "e2m1", (ibm, ibk), round_sf=True,
                         use_tma_aligned_col_major_sf=in_packed, use_packed_ue8m0=in_packed)
    got = K.per_block_cast_lossless_launch(data, sf_in, (ibm, ibk), (obm, obk), col, packed)
    want = R.per_block_cast_lossless((data, sf_in), (ibm, ibk), (obm, obk), col, packed)
    _same_meta(got[0], want[0])
    _same_meta(got[1], want[1])
    assert [(n, c) for n, c, _ in calls] == [("per_block_cast_lossless", cfg)]


# ---------------------------------------------------------------------------------------------------------
# GPU tier
# ---------------------------------------------------------------------------------------------------------

def _poison():
    """Fill the caching allocator's free memory with 0xFF so freshly allocated outputs start poisoned."""
    free = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    free.fill_(0xFF)
    del free


def _compare_sf(got, want, hidden, bk):
    """Strides compared on the device tensors, then the bytes with packed padding cleared on both sides."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.stride() == want.stride() or got.numel() == 0
    assert_equal(clear_unused_sf(got, hidden, bk), clear_unused_sf(want, hidden, bk))


def _cast(x, fmt, block, col, rnd, packed):
    _poison()
    got = K.per_block_cast_launch(x, fmt, block, col, rnd, packed)
    torch.cuda.synchronize()
    return got


def _check_cast(x, fmt, block, col, rnd, packed):
    out, sf = _cast(x, fmt, block, col, rnd, packed)
    r_out, r_sf = R.cast(x, fmt, block, round_sf=rnd, use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)
    assert_equal(out, r_out)
    _compare_sf(sf, r_sf, x.size(1), block[1])
    return out, sf


def _x(t, hidden, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(t, hidden, device="cuda") * scale).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("flags", FLAG_SETS, ids=str)
def test_cast_matches_reference(t, block, fmt, flags):
    col, rnd, packed = flags
    _check_cast(_x(t, 576, scale=3.0), fmt, block, col, rnd, packed)


@pytest.mark.gpu
@pytest.mark.parametrize("t", (1, 4001, 8192))
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
def test_cast_large_hidden(t, fmt):
    _check_cast(_x(t, 7168), fmt, (128, 128), True, True, True)


@pytest.mark.gpu
@pytest.mark.parametrize("t", (7, 4001))
@pytest.mark.parametrize("cfg", (("e4m3", (32, 128), False), ("e2m1", (128, 32), True)), ids=str)
def test_cast_mixed_blocks_plain_sf(t, cfg):
    fmt, block, col = cfg
    _check_cast(_x(t, 2048, scale=0.01), fmt, block, col, False, False)


@pytest.mark.gpu
@pytest.mark.parametrize("t", (7, 4001))
def test_cast_fp32_input(t):
    _check_cast(_x(t, 576, torch.float32, scale=100.0), "e4m3", (128, 128), True, True, True)


# fp32 input with 128-row blocks at the 128 x 128 CTA tile (FP32_NARROW_MAX_H): 16 lanes per row, two row groups
# per warp. H = 576: a partial last tile (half its lanes past the end) and a partial 128-channel block; 1536 and 4096:
# whole tiles; T = 1, 7: one partial CTA row; 4001, 4099: many CTA rows, partial last block. The shipped kernels
# (FP32_NARROW_MAX_H = 4096 is the default).
FP32_NARROW = (("e4m3", (128, 128), True, True, True), ("e4m3", (128, 128), False, False, False),
               ("e2m1", (128, 128), True, True, True), ("e2m1", (128, 32), True, False, False))


@pytest.mark.gpu
@pytest.mark.parametrize("t", (1, 7, 4001, 4099))
@pytest.mark.parametrize("hidden", (576, 1536, 4096))
@pytest.mark.parametrize("cfg", FP32_NARROW, ids=str)
def test_cast_fp32_narrow_tile(t, hidden, cfg):
    fmt, block, col, rnd, packed = cfg
    assert K.row_lanes("float32", hidden, block[0]) == 16  # the geometry under test
    _check_cast(_x(t, hidden, torch.float32, scale=50.0), fmt, block, col, rnd, packed)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", (576, 1536))
@pytest.mark.parametrize("cfg", FP32_NARROW, ids=str)
def test_adversarial_fp32_narrow_tile(hidden, cfg):
    fmt, block, col, rnd, packed = cfg
    _check_cast(_adversarial(4001, hidden, torch.float32, *block), fmt, block, col, rnd, packed)
    _check_cast(_nan_inf_x(300, hidden, *block).float(), fmt, block, col, rnd, packed)


@pytest.mark.gpu
@pytest.mark.parametrize("t", (7, 4001))
def test_sf_only_and_precomputed_fp32_narrow_tile(t):
    x = _x(t, 576, torch.float32, scale=10.0)
    _poison()
    got = K.per_block_cast_launch(x, "e4m3", (128, 128), True, True, True, mode="sf_only")
    r_sf = R.cast(x, "e4m3", (128, 128), round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)[1]
    _compare_sf(got, r_sf, 576, 128)
    sf = _precomputed_sf(t, 128, 128, 576)
    _poison()
    got = K.per_block_cast_launch(x, "e4m3", (128, 128), mode="precomputed", sf=sf)
    torch.cuda.synchronize()
    assert_equal(got, R.cast(x, "e4m3", (128, 128), sf=sf))


@pytest.mark.gpu
def test_fp32_narrow_tile_batch_invariant():
    """Row slices of whole 128-row blocks (a CTA row each), the last one partial at the input's end, give the full
    input's rows and sf (the 128 x 128 tile). A slice that cuts a block changes its maximum, so it is not one."""
    assert K.row_lanes("float32", 1536, 128) == 16
    x = _x(4099, 1536, torch.float32, scale=5.0)
    out, sf = _cast(x, "e4m3", (128, 128), False, False, False)
    for lo, hi in ((0, 128), (128, 640), (3968, 4099)):
        o, s = _cast(x[lo:hi], "e4m3", (128, 128), False, False, False)
        assert_equal(o, out[lo:hi])
        assert_equal(s, sf[lo // 128:cdiv(hi, 128)])


# Knob variants of the fp32 128-row-block cast: each must give the default kernel's bits.
FP32_KNOB_VARIANTS = [{"FP32_NARROW_MAX_H": 0},                            # the 128 x 256 tile at every width
                      {"FP32_NARROW_MAX_H": 4096, "FP32_NARROW_CTAS": 0},  # no residency bound (2 CTAs per SM)
                      {"FP32_NARROW_MAX_H": 18432}]                        # the narrow tile at every bench width


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", FP32_KNOB_VARIANTS, ids=str)
def test_fp32_knob_variants(knobs, knob_kernels):
    cases = [(_x(t, h, torch.float32, scale=50.0), cfg) for t, h in ((7, 576), (4001, 1536), (4099, 7168))
             for cfg in FP32_NARROW]
    want = [_cast(x, *cfg) for x, cfg in cases]
    knob_kernels(K, knobs)
    for (x, cfg), (w_out, w_sf) in zip(cases, want):
        out, sf = _cast(x, *cfg)
        assert_equal(out, w_out)
        _compare_sf(sf, w_sf, x.size(1), cfg[1][1])


@pytest.mark.gpu
@pytest.mark.parametrize("t", (1, 4001))
def test_sf_only_equals_cast_sf_and_reference(t):
    x = _x(t, 576)
    _, sf = _cast(x, "e2m1", (128, 128), True, True, True)
    _poison()
    got = K.per_block_cast_launch(x, "e2m1", (128, 128), True, True, True, mode="sf_only")
    r_sf = R.cast(x, "e2m1", (128, 128), round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)[1]
    _compare_sf(got, sf, 576, 128)
    _compare_sf(got, r_sf, 576, 128)


def _precomputed_sf(t, bm, bk, hidden):
    """A row-strided positive sf grid with a few zero entries and a few tiny ones (scaled values far beyond
    the format maximum, so the conversion saturates)."""
    nbm, nbk = cdiv(t, bm), cdiv(hidden, bk)
    wide = torch.rand(nbm, nbk + 3, device="cuda") * 0.02 + 1e-3
    sf = wide[:, :nbk]  # row stride nbk + 3: the kernel must honour it
    sf[::3, 0] = 0.0
    sf[1::4, -1] = 1e-9
    return sf


@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("cfg", (("e4m3", (32, 32)), ("e2m1", (128, 128))), ids=str)
def test_precomputed_matches_reference(t, cfg):
    fmt, (bm, bk) = cfg
    x = _x(t, 576, scale=2.0)
    sf = _precomputed_sf(t, bm, bk, 576)
    _poison()
    got = K.per_block_cast_launch(x, fmt, (bm, bk), mode="precomputed", sf=sf)
    torch.cuda.synchronize()
    assert_equal(got, R.cast(x, fmt, (bm, bk), sf=sf))


def _adversarial(t, hidden, dtype, bm, bk):
    """Random data with whole blocks replaced: all +0, all -0, subnormals only, exactly the format maxima
    (448, 6), far beyond them (1e30 and the dtype's largest finite value), and one huge element among tiny
    ones (the others flush to zero codes)."""
    x = torch.randn(t, hidden, device="cuda", dtype=torch.float32)
    tiny = torch.finfo(dtype).tiny
    fills = [lambda b: b.zero_(), lambda b: b.zero_().neg_(),
             lambda b: b.copy_(torch.randn_like(b).sign() * tiny * torch.rand_like(b) * 0.5),
             lambda b: b.copy_(torch.randn_like(b).sign() * 448.0),
             lambda b: b.copy_(torch.randn_like(b).sign() * 6.0),
             lambda b: b.copy_(torch.randn_like(b) * 1e30),
             lambda b: b.copy_(torch.randn_like(b).sign() * torch.finfo(dtype).max),
             lambda b: (b.copy_(torch.randn_like(b) * 1e-6), b[0, 0].fill_(3e4))]
    k = 0
    for r in range(0, t, bm):
        for c in range(0, hidden, bk):
            if (r // bm + c // bk) % 2 == 0:
                fills[k % len(fills)](x[r:r + bm, c:c + bk])
                k += 1
    x = x.to(dtype)
    if dtype == torch.bfloat16 and t > 0:
        x[0, :8] = torch.tensor([tiny / 4, -tiny / 8, tiny * 0.75, 0, -0.0, 448, -6, 1e-3], dtype=dtype)
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("t", (7, 4001))
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("flags", FLAG_SETS, ids=str)
def test_adversarial_round_sf(t, fmt, block, flags):
    col, rnd, packed = flags
    _check_cast(_adversarial(t, 576, torch.bfloat16, *block), fmt, block, col, rnd, packed)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", (("e4m3", (32, 128), False), ("e2m1", (128, 32), True)), ids=str)
def test_adversarial_plain_sf(cfg):
    fmt, block, col = cfg
    _check_cast(_adversarial(4001, 2048, torch.bfloat16, *block), fmt, block, col, False, False)


@pytest.mark.gpu
def test_adversarial_fp32_subnormals():
    _check_cast(_adversarial(4001, 576, torch.float32, 128, 128), "e4m3", (128, 128), True, True, True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
def test_nan_and_inf_policy(fmt):
    """quant.md 1.7 / 9.2 (implementation-defined, the reference models upstream's kernels): NaN is ignored
    by the block max and encodes as +NaN / +6; an inf makes the block's sf inf and its sf_inv 0."""
    x = _x(300, 576)
    x[3, 5] = float("nan")
    x[130, 300] = float("inf")
    x[260, 70] = -float("inf")
    x[261, 71] = float("nan")
    _check_cast(x, fmt, (128, 128), True, True, True)


def _nan_inf_x(t, hidden, bm, bk):
    """Random bf16 data with quant.md 1.7's specials placed per block: a lone +NaN, a lone NaN with the sign
    bit set, +inf and -inf (the block's sf becomes inf, sf_inv 0, so its finite values encode as +-0 and the
    infs as NaN / code 7), an all-NaN block (max ignores NaN: the clamp decides the sf), and a block of
    NaN mixed with the bf16 maximum; one element per 8-channel vector so every lane position is hit."""
    x = _x(t, hidden, scale=2.0)
    neg_nan = torch.tensor([-1], dtype=torch.int16, device="cuda").view(torch.bfloat16)[0]  # 0xFFFF: -NaN
    k = 0
    for r in range(0, t, bm):
        for c in range(0, hidden, bk):
            blk = x[r:r + bm, c:c + bk]
            i, j = k % blk.size(0), (3 * k) % blk.size(1)
            kind = k % 6
            if kind == 0:
                blk[i, j] = float("nan")
            elif kind == 1:
                blk[i, j] = neg_nan
            elif kind == 2:
                blk[i, j] = float("inf")
                blk[(i + 1) % blk.size(0), (j + 9) % blk.size(1)] = float("nan")
            elif kind == 3:
                blk[i, j] = -float("inf")
            elif kind == 4:
                blk.fill_(float("nan"))
            else:
                blk[::2, 1::3] = float("nan")
                blk[i, j] = torch.finfo(torch.bfloat16).max
            k += 1
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("t", (7, 300))
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("flags", FLAG_SETS, ids=str)
def test_nan_inf_every_block_and_layout(t, fmt, block, flags):
    """quant.md 1.7 over every registered block x format x sf layout (H = 576): NaN (either sign) ignored by
    the max and encoded as the reference does, inf giving sf inf / sf_inv 0, all-NaN blocks."""
    col, rnd, packed = flags
    _check_cast(_nan_inf_x(t, 576, *block), fmt, block, col, rnd, packed)


@pytest.mark.gpu
def test_nan_inf_sf_only():
    x = _nan_inf_x(300, 576, 128, 128)
    _poison()
    got = K.per_block_cast_launch(x, "e2m1", (128, 128), True, True, True, mode="sf_only")
    r_sf = R.cast(x, "e2m1", (128, 128), round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)[1]
    _compare_sf(got, r_sf, 576, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", (("e4m3", (32, 32)), ("e2m1", (128, 128))), ids=str)
def test_nan_inf_precomputed(cfg):
    """Precomputed sf with NaN/inf data, and sf entries of +inf (sf_inv 0), 0 (sf_inv 0) and the smallest
    normal (products far beyond the format maximum)."""
    fmt, (bm, bk) = cfg
    t = 300
    x = _nan_inf_x(t, 576, bm, bk)
    sf = _precomputed_sf(t, bm, bk, 576)
    sf[::2, 1] = float("inf")
    sf[1::5, 2] = torch.finfo(torch.float32).tiny
    _poison()
    got = K.per_block_cast_launch(x, fmt, (bm, bk), mode="precomputed", sf=sf)
    torch.cuda.synchronize()
    assert_equal(got, R.cast(x, fmt, (bm, bk), sf=sf))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", (1, 8001))
def test_bench_shapes_match_reference(rows):
    """The benchmark rows' configs (bf16 x 7168): e4m3 128x128 col packed (cast, sf-only, precomputed sf) and
    e2m1 32x32 row round, on random and adversarial data (specials included)."""
    for x in (_x(rows, 7168, scale=3.0), _nan_inf_x(rows, 7168, 128, 128),
              _adversarial(rows, 7168, torch.bfloat16, 32, 32)):
        out, sf = _check_cast(x, "e4m3", (128, 128), True, True, True)
        _poison()
        only = K.per_block_cast_launch(x, "e4m3", (128, 128), True, True, True, mode="sf_only")
        _compare_sf(only, sf, 7168, 128)
        _check_cast(x, "e2m1", (32, 32), False, True, False)
        plain_sf = R.cast(x, "e4m3", (128, 128))[1]
        _poison()
        got = K.per_block_cast_launch(x, "e4m3", (128, 128), mode="precomputed", sf=plain_sf)
        torch.cuda.synchronize()
        assert_equal(got, R.cast(x, "e4m3", (128, 128), sf=plain_sf))


@pytest.mark.gpu
@pytest.mark.parametrize("t", (1, 8001))
def test_lossless_bench_shape(t):
    """The benchmark row: fp32 row-major sf in (block 1x32), e4m3 128x128 col packed UE8M0 out, H = 7168."""
    data, sf_in = _lossless_input(t, 7168, False)
    _check_lossless(data, sf_in, (128, 128), "col_packed")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
def test_deterministic_and_batch_invariant(fmt):
    x = _x(8192, 7168)
    out1, sf1 = _cast(x, fmt, (128, 128), True, True, True)
    out2, sf2 = _cast(x, fmt, (128, 128), True, True, True)
    assert_equal(out1, out2)
    assert_equal(clear_unused_sf(sf1, 7168, 128), clear_unused_sf(sf2, 7168, 128))
    for lo, hi in ((0, 128), (4096, 4352), (8064, 8192)):  # whole 128-row blocks
        o, s = _cast(x[lo:hi], fmt, (128, 128), True, True, True)
        assert_equal(o, out1[lo:hi])
        assert_equal(clear_unused_sf(s, 7168, 128), clear_unused_sf(sf1[lo // 128:hi // 128], 7168, 128))


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager():
    x = _x(4001, 7168)
    eager = _cast(x, "e4m3", (128, 128), True, True, True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        K.per_block_cast_launch(x, "e4m3", (128, 128), True, True, True)  # warm (compile) off-graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = K.per_block_cast_launch(x, "e4m3", (128, 128), True, True, True)
    captured[0].fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    assert_equal(captured[0], eager[0])
    assert_equal(clear_unused_sf(captured[1], 7168, 128), clear_unused_sf(eager[1], 7168, 128))


@pytest.mark.gpu
def test_torch_compile_equals_eager():
    x = _x(4001, 576)
    sf = torch.rand(cdiv(4001, 32), cdiv(576, 32), device="cuda") + 0.01
    data, sf_in = R.cast(_x(4001, 576), "e2m1", (1, 32), round_sf=True, use_tma_aligned_col_major_sf=True,
                         use_packed_ue8m0=True)

    def f(x, sf, data, sf_in):
        out, out_sf = K.per_block_cast_cuda(x, "e2m1", (128, 128), True, True, True)
        only = K.per_block_cast_with_sf_only_cuda(x, "e2m1", (128, 128), True, True, True)
        pre = K.per_block_cast_with_precomputed_sf_cuda(x, "e4m3", (32, 32), sf)
        lo, lo_sf = K.per_block_cast_lossless_cuda((data, sf_in), "e4m3", (1, 32), (1, 128), True, True, True)
        return out, out_sf, only, pre, lo, lo_sf

    got = torch.compile(f, fullgraph=True)(x, sf, data, sf_in)
    want = f(x, sf, data, sf_in)
    for g, w, bk in zip(got, want, (None, 128, 128, None, None, 128)):
        if bk is None:
            assert_equal(g, w)
        else:
            _compare_sf(g, w, 576, bk)


# ---- per_block_cast_lossless ----

def _lossless_input(t, hidden, in_packed):
    """quant.md 7.2: randn * 2^e (e uniform in [-110, 126]) clamped to +-FLT_MAX/8, every magnitude raised
    to >= max/2^9 keeping its sign, then the reference e2m1 cast with block (1, 32) and power-of-two sf."""
    e = torch.randint(-110, 127, (t, hidden), device="cuda").float()
    v = (torch.randn(t, hidden, device="cuda") * torch.exp2(e)).clamp(-torch.finfo(torch.float32).max / 8,
                                                                      torch.finfo(torch.float32).max / 8)
    if t > 0:
        floor = v.abs().max() / 2 ** 9
        v = torch.where(v < 0, -1.0, 1.0) * torch.maximum(v.abs(), floor)
    return R.cast(v, "e2m1", (1, 32), round_sf=True, use_tma_aligned_col_major_sf=in_packed,
                  use_packed_ue8m0=in_packed)


def _check_lossless(data, sf_in, out_block, layout, x_block=(1, 32)):
    col, packed = LAYOUT_FLAGS[layout]
    _poison()
    out, sf = K.per_block_cast_lossless_launch(data, sf_in, x_block, out_block, col, packed)
    torch.cuda.synchronize()
    r_out, r_sf = R.per_block_cast_lossless((data, sf_in), x_block, out_block, col, packed)
    hidden = 2 * data.size(1)
    assert_equal(out, r_out)
    _compare_sf(sf, r_sf, hidden, out_block[1])
    # the spec's contract: dequantizing either side gives the same fp32 bits wherever both scales are nonzero.
    # Two spec-defined exceptions (quant.md 3.7, 1.4): an output block whose input exponents are all <= 6 has
    # E_B = 0 and stores sf +0.0 (it dequantizes to zeros), and an input block with exponent byte 0 has sf +0.0
    # although its data is re-encoded with the factor 2^(0 - E_B).
    back_out = R.cast_back((out, sf), "fp32", out_block)
    back_in = R.cast_back((data, sf_in), "fp32", x_block)
    live_out = _elementwise(load_sf(sf, cdiv(hidden, out_block[1])) > 0, out_block, back_out.shape)
    live_in = _elementwise(load_sf(sf_in, cdiv(hidden, x_block[1])) > 0, x_block, back_out.shape)
    assert_equal(back_out[live_out & live_in], back_in[live_out & live_in])
    assert (back_out[~live_out] == 0).all()


def _elementwise(grid, block, shape):
    """Expand a per-block grid to the elements it covers, cropped to ``shape``."""
    return grid.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]


@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("out_block", LOSSLESS_OUT_BLOCKS)
@pytest.mark.parametrize("packed", (False, True))
def test_lossless_matches_reference(t, out_block, packed):
    data, sf_in = _lossless_input(t, 576, packed)
    _check_lossless(data, sf_in, out_block, "col_packed" if packed else "row")


@pytest.mark.gpu
@pytest.mark.parametrize("t", (1, 4001, 8192))
def test_lossless_large_hidden(t):
    data, sf_in = _lossless_input(t, 7168, True)
    _check_lossless(data, sf_in, (1, 128), "col_packed")


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,t", ((2048, 2 * 33 * 128 + 77), (7168, 4 * 9 * 128 + 5)), ids=str)
@pytest.mark.parametrize("in_packed,layout", ((False, "row"), (True, "col_packed"), (False, "col_packed")), ids=str)
def test_lossless_tall_blocks_many_rows(hidden, t, in_packed, layout):
    """128x128 output blocks over many CTA rows with a partial last CTA row, against the reference."""
    data, sf_in = _lossless_input(t, hidden, in_packed)
    _check_lossless(data, sf_in, (128, 128), layout)


@pytest.mark.gpu
def test_lossless_fp32_col_sf_out():
    data, sf_in = _lossless_input(4001, 576, True)
    _check_lossless(data, sf_in, (32, 32), "col")


@pytest.mark.gpu
@pytest.mark.parametrize("in_layout", ("col_major", "row_strided"))
def test_lossless_strided_fp32_sf_in(in_layout):
    data, sf_in = _lossless_input(4001, 576, False)
    if in_layout == "col_major":
        strided = sf_in.t().contiguous().t()
    else:
        strided = torch.empty(sf_in.size(0), sf_in.size(1) + 5, device="cuda")[:, :sf_in.size(1)]
        strided.copy_(sf_in)
    assert not strided.is_contiguous()
    _check_lossless(data, strided, (1, 128), "row")


@pytest.mark.gpu
@pytest.mark.parametrize("exp_range", ((0, 6), (0, 11), (100, 111), (243, 254)), ids=str)
@pytest.mark.parametrize("packed", (False, True))
def test_lossless_adversarial_exponents(exp_range, packed):
    """Random nibbles (every code, -0 included), all-zero data rows, and input exponents drawn from a range
    of 12 (the widest the exactness precondition allows), down to byte 0 (sf +0.0) and up to 254."""
    t, hidden = 4001, 576
    data = torch.randint(-128, 128, (t, hidden // 2), device="cuda", dtype=torch.int8)
    data[::5] = 0
    ebytes = torch.randint(exp_range[0], exp_range[1] + 1, (t, hidden // 32), device="cuda", dtype=torch.int64)
    if packed:
        words = torch.nn.functional.pad(ebytes, (0, 4 * cdiv(hidden // 32, 4) - hidden // 32))
        words = (words.view(t, -1, 4) << torch.tensor([0, 8, 16, 24], device="cuda")).sum(-1)
        words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
        sf_in = words.t().contiguous().t()  # column-major packed, as the reference cast returns it
    else:
        sf_in = (ebytes << 23).to(torch.int32).view(torch.float32)
    for out_block in LOSSLESS_OUT_BLOCKS:
        _check_lossless(data, sf_in, out_block, "col_packed" if packed else "row")


@pytest.mark.gpu
def test_lossless_deterministic_and_batch_invariant():
    data, sf_in = _lossless_input(8192, 7168, True)
    out1, sf1 = K.per_block_cast_lossless_launch(data, sf_in, (1, 32), (1, 128), True, True)
    out2, sf2 = K.per_block_cast_lossless_launch(data, sf_in, (1, 32), (1, 128), True, True)
    assert_equal(out1, out2)
    assert_equal(clear_unused_sf(sf1, 7168, 128), clear_unused_sf(sf2, 7168, 128))
    for lo, hi in ((0, 1), (4000, 4007), (8191, 8192)):  # output blocks are one row high
        o, s = K.per_block_cast_lossless_launch(data[lo:hi], sf_in[lo:hi], (1, 32), (1, 128), True, True)
        assert_equal(o, out1[lo:hi])
        assert_equal(clear_unused_sf(s, 7168, 128), clear_unused_sf(sf1[lo:hi], 7168, 128))


@pytest.mark.gpu
def test_lossless_cuda_graph_replay_equals_eager():
    data, sf_in = _lossless_input(4001, 7168, True)
    eager = K.per_block_cast_lossless_launch(data, sf_in, (1, 32), (1, 128), True, True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = K.per_block_cast_lossless_launch(data, sf_in, (1, 32), (1, 128), True, True)
    captured[0].fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    assert_equal(captured[0], eager[0])
    assert_equal(clear_unused_sf(captured[1], 7168, 128), clear_unused_sf(eager[1], 7168, 128))


# Knob variants of per_block_cast_lossless (TILEFUSE_KNOBS sweeps): each must give the default kernel's bits.
LOSSLESS_KNOB_VARIANTS = [  # the defaults: LOSSLESS_PRMT, _I32, _FULL, _EXP23 on
    {"LOSSLESS_PRMT": 0, "LOSSLESS_I32": 0, "LOSSLESS_FULL": 0, "LOSSLESS_EXP23": 0},  # the float path alone
    {"LOSSLESS_CTAS": 4},
    {"LOSSLESS_PDL": 0},
]


def _wide_exponent_input(t, hidden, packed, lo=0, hi=254):
    """Random nibbles (every code, -0 included) with input exponents drawn from [lo, hi]: wider than the spec's
    precondition (12 values), so some rows have e(b) - E_B < -5 (the reference raises there)."""
    data = torch.randint(-128, 128, (t, hidden // 2), device="cuda", dtype=torch.int8)
    ebytes = torch.randint(lo, hi + 1, (t, hidden // 32), device="cuda", dtype=torch.int64)
    if packed:
        words = torch.nn.functional.pad(ebytes, (0, 4 * cdiv(hidden // 32, 4) - hidden // 32))
        words = (words.view(t, -1, 4) << torch.tensor([0, 8, 16, 24], device="cuda")).sum(-1)
        words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
        return data, words.t().contiguous().t()
    return data, (ebytes << 23).to(torch.int32).view(torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", LOSSLESS_KNOB_VARIANTS, ids=str)
def test_lossless_knob_variants(knobs, knob_kernels):
    """A lossless knob variant (compiled here, outside the caches; H = 576 and 7168 only, to bound the compile
    time) equals the reference on the spec's inputs (tails: T = 1, 7, 4001 and a partial last CTA row, strided
    fp32 sf, adversarial exponent ranges), and the default kernel's bits where the precondition fails (the
    fallback path)."""
    wide = []
    for t, hidden in ((4001, 576), (4 * 9 * 128 + 5, 7168)):
        for packed in (False, True):
            data, sf_in = _wide_exponent_input(t, hidden, packed)
            for out_block in LOSSLESS_OUT_BLOCKS:
                layout = "col_packed" if packed else "row"
                col, pk = LAYOUT_FLAGS[layout]
                want = K.per_block_cast_lossless_launch(data, sf_in, (1, 32), out_block, col, pk)
                wide.append((data, sf_in, hidden, out_block, col, pk, want))
    knob_kernels(K, knobs)
    for data, sf_in, hidden, out_block, col, pk, (w_out, w_sf) in wide:
        out, sf = K.per_block_cast_lossless_launch(data, sf_in, (1, 32), out_block, col, pk)
        assert_equal(out, w_out)
        assert_equal(clear_unused_sf(sf, hidden, out_block[1]), clear_unused_sf(w_sf, hidden, out_block[1]))
    for t, hidden in ((1, 576), (7, 7168), (4001, 576), (4 * 9 * 128 + 5, 7168)):
        for packed in (False, True):
            data, sf_in = _lossless_input(t, hidden, packed)
            for out_block in LOSSLESS_OUT_BLOCKS:
                _check_lossless(data, sf_in, out_block, "col_packed" if packed else "row")
    data, sf_in = _lossless_input(4001, 576, False)
    _check_lossless(data, sf_in.t().contiguous().t(), (1, 128), "row")
    _check_lossless(data, sf_in, (128, 128), "col_packed")
    for exp_range in ((0, 6), (0, 11), (100, 111), (243, 254)):
        for packed in (False, True):
            data, sf_in = _wide_exponent_input(4001, 576, packed, *exp_range)
            data[::5] = 0
            for out_block in LOSSLESS_OUT_BLOCKS:
                _check_lossless(data, sf_in, out_block, "col_packed" if packed else "row")
