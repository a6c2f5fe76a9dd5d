"""Kernel tiers for the E5M6 per-token cast and cast-back (quant.md 3.4, 3.5, 2.3, 1.3).

compile: every config the GPU tier uses builds for sm_90 with IEEE arithmetic; the launcher's arguments fit
the kernel signature (checked on CPU against the prim_func). gpu: packed bytes, sf (strides included, packed
padding cleared) and cast-back outputs bit-exact against the reference run on the same CUDA tensors.
"""
import numpy as np
import pytest
import torch

from tilefuse import _jit
from tilefuse import formats as F
from tilefuse.quant import _e5m6_kernel as K
from tilefuse.reference import quant as R
from tilefuse.testing import assert_equal, clear_unused_sf, quant_adversarial
from tilefuse.testing.generators import QUANT_FILLS
from tests.quant.configs import E5M6_CAST, E5M6_CAST_BACK
from tests.quant.kernel_binding import fake_jit, tir_eval

TOKENS = (0, 1, 7, 4001, 8192)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# (use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0): the quant.md 7.1 sets
FLAGS = ((False, True, False), (True, True, True))


# ---------------------------------------------------------------------------------------------------------
# compile tier
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.compile
@pytest.mark.parametrize("cfg", E5M6_CAST, ids=str)
def test_cast_builds_for_sm90(cfg):
    src = _jit.compile_kernel("per_token_cast_to_e5m6", cfg, "sm_90").get_kernel_source()
    assert "__global__" in src and "use_fast_math" not in src
    assert "*(uint4*)(raw" in src or "*(float4*)(raw" in src  # 16-byte loads of x
    assert "__shfl_xor_sync" in src


@pytest.mark.compile
@pytest.mark.parametrize("cfg", E5M6_CAST_BACK, ids=str)
def test_cast_back_builds_for_sm90(cfg):
    src = _jit.compile_kernel("cast_back", cfg, "sm_90").get_kernel_source()
    assert "__global__" in src and "use_fast_math" not in src


def test_tiling_covers_each_row():
    """L lanes x NG groups of 8 cover the row; rows are whole warps; >= 128 threads per CTA."""
    for hidden in (8, 64, 576, 2048, 2560, 3072, 4096, 6144, 7168, 16384, 18432, 32768, 40000, 65536):
        lanes, ng, rows = K._tiling(hidden)
        assert lanes % 32 == 0 and lanes * rows >= 128
        assert (ng - 1) * lanes < hidden // 8 <= ng * lanes and ng <= 8
        assert lanes <= K.MAX_LANES or hidden > K.MAX_LANES * 64  # wider lanes only where 8 groups do not fit
    assert K._tiling(18432)[:2] == (K.MAX_LANES, -(-18432 // 8 // K.MAX_LANES))
    assert K._tiling(65536 + 8 * 1024 * 8) is None


def _edge_values(n: int) -> np.ndarray:
    """Random binary32 patterns plus patterns dense around binary16's range and the rounding boundaries
    of quant.md 1.3 (low 17 bits 0xFFFF / 0x10000 / 0x10001 / 0x1FFFF), NaNs and infinities."""
    rng = np.random.default_rng(1)
    anything = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    exp = rng.integers(90, 145, n).astype(np.uint32) << 23
    top = rng.integers(0, 64, n).astype(np.uint32) << 17
    low = rng.choice(np.array([0, 1, 0xFFFF, 0x10000, 0x10001, 0x1FFFF], dtype=np.uint32), n)
    sign = rng.integers(0, 2, n).astype(np.uint32) << 31
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001,
                        0x477E0000, 0x477F0000, 0x477FFFFF, 0x47800000, 0x387FFFFF, 0x38800000, 0x33800000],
                       dtype=np.uint32)
    return np.concatenate([anything, sign | exp | top | low, special]).view(np.float32)


def test_e5m6_expressions_are_exact():
    """The kernel's E5M6 expressions, evaluated with C integer semantics, equal ``formats``: the encoder
    (after the reference's NaN canonicalisation) on edge-dense binary32 values, the decoder on all 4096
    codes, the three-word packing and its inverse (used by the cast-back kernel)."""
    pytest.importorskip("tilelang")
    from tvm import tirx

    from tilefuse.quant import _cast_back_kernel as CB

    vals = _edge_values(200_000)
    got = tir_eval(K._e5m6_code(tirx.Var("v", "float32")), {"v": vals})
    t = torch.from_numpy(vals.copy())
    t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")).abs(), t)
    assert (got == F.e5m6_encode(t).numpy().astype(np.uint32)).all()

    codes = np.arange(4096, dtype=np.int32)
    got = tir_eval(CB._decode_e5m6(tirx.Var("c", "int32")), {"c": codes}).view(np.uint32)
    assert (got == F.e5m6_decode(torch.from_numpy(codes)).numpy().view(np.uint32)).all()

    rng = np.random.default_rng(2)
    c8 = rng.integers(0, 4096, (20_000, 8)).astype(np.uint32)
    words = K._e5m6_words([tirx.Var(f"c{i}", "uint32") for i in range(8)])
    got = np.stack([tir_eval(w, {f"c{i}": c8[:, i] for i in range(8)}) for w in words], -1)
    packed = F.e5m6_pack(torch.from_numpy(c8.astype(np.int64))).numpy()
    assert (got == packed.view(np.uint32).reshape(-1, 3)).all()
    ws = [tirx.Var(f"w{i}", "int32") for i in range(3)]
    back = np.stack([tir_eval(c, {f"w{i}": got[:, i].view(np.int32) for i in range(3)})
                     for c in CB._e5m6_codes(*ws)], -1)
    assert (back == c8.astype(np.int32)).all()


def _rz_half_bits(vals: np.ndarray) -> np.ndarray:
    """binary16 patterns of binary32 ``vals`` rounded toward zero (IEEE: subnormals kept, finite overflow to
    the largest finite), as ``__float2half_rz`` does: the correctly rounded conversion, stepped one unit
    toward zero where it rounded away."""
    with np.errstate(over="ignore"):
        rne = vals.astype(np.float64).astype(np.float16)
    bits = rne.view(np.uint16).astype(np.uint32)
    away = np.abs(rne.astype(np.float64)) > np.abs(vals.astype(np.float64))
    return np.where(away, bits - 1, bits).astype(np.uint32)


def test_e5m6_values_are_exact():
    """The cast-back's group decoder (codes placed in binary16 lanes, widened by the hardware; numpy's
    float16 -> float32 widening stands in for it) equals ``formats.e5m6_decode`` bit for bit on every non-NaN
    code, at every position of the group, and gives NaN for every NaN code."""
    pytest.importorskip("tilelang")
    from tvm import tirx

    from tilefuse.quant import _cast_back_kernel as CB

    rng = np.random.default_rng(3)
    c8 = rng.integers(0, 4096, (50_000, 8)).astype(np.int64)
    c8[:512] = np.arange(4096).reshape(512, 8)
    c8[512:1024] = np.roll(np.arange(4096).reshape(512, 8), 3, axis=1)
    words = F.e5m6_pack(torch.from_numpy(c8)).numpy().view(np.uint32).reshape(-1, 3)
    ws = [tirx.Var(f"w{i}", "uint32") for i in range(3)]
    got = np.stack([tir_eval(e, {f"w{i}": words[:, i] for i in range(3)}) for e in CB._e5m6_values(*ws)], -1)
    want = F.e5m6_decode(torch.from_numpy(c8)).numpy()
    nan = np.isnan(want)
    assert nan.any() and (np.isnan(got) == nan).all()
    assert (got[~nan].view(np.uint32) == want[~nan].view(np.uint32)).all()


def test_e5m6_fast_encoder_is_exact():
    """The cast's short encoder (hardware round-toward-zero binary16, then the 17-bit rounding) equals
    ``formats`` on every value it is used for: finite binary32 below 2^16 in magnitude (edge-dense values,
    every binary32 exponent, and all patterns of the top 16 bits with adversarial low bits)."""
    pytest.importorskip("tilelang")
    from tvm import tirx

    vals = _edge_values(200_000)
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    low = np.array([0, 1, 0xFFFF, 0x10000, 0x10001, 0x1FFFF, 0x8000, 0xFFFF8000 & 0xFFFF], dtype=np.uint32)
    every_top = (hi[:, None] | low[None, :]).reshape(-1).view(np.float32)
    vals = np.concatenate([vals, every_top])
    vals = vals[np.isfinite(vals) & (np.abs(vals) < 65536.0)]
    v, h = tirx.Var("v", "float32"), tirx.Var("h", "uint32")
    got = tir_eval(K._e5m6_code_of_rz_half(v, h), {"v": vals, "h": _rz_half_bits(vals)})
    assert (got == F.e5m6_encode(torch.from_numpy(vals.copy())).numpy().astype(np.uint32)).all()


@pytest.mark.compile
@pytest.mark.parametrize("flags", FLAGS + ((True, False, False), (False, False, False)), ids=str)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_launch_binds(monkeypatch, flags, dtype):
    calls = fake_jit(monkeypatch)
    x = torch.randn(9, 2 * 576, dtype=dtype)[:, :576]  # row-strided view
    out, sf = K.e5m6_cast_launch(x, 576, *flags)
    r_out, r_sf = R.cast_to_e5m6(x, 576, *flags)
    assert out.shape == r_out.shape and out.dtype == r_out.dtype
    assert sf.shape == r_sf.shape and sf.dtype == r_sf.dtype and sf.stride() == r_sf.stride()
    want_env = {"num_tokens": 9, "x_row_stride": 1152, **({"sf_pad": 12} if flags[0] else {})}
    assert [(c.name, c.env) for c in calls] == [("per_token_cast_to_e5m6", want_env)]
    # the cast-back of those bytes launches the shared cast-back kernel with E5M6 decoding
    calls = fake_jit(monkeypatch)
    got = K.cast_back_e5m6_cuda((r_out, r_sf), "bf16", (1, 576))
    assert got.shape == (9, 576) and got.dtype == torch.bfloat16
    assert calls[0].name == "cast_back" and calls[0].env["num_tokens"] == 9


def test_fake_shapes_match_reference():
    x = torch.randn(9, 64)
    for flags in FLAGS + ((True, False, False),):
        r_out, r_sf = R.cast_to_e5m6(x, 64, *flags)
        out, sf = torch.ops.tilefuse.per_token_cast_to_e5m6(x.to("meta"), 64, *flags)
        assert out.shape == r_out.shape and out.dtype == r_out.dtype
        assert sf.shape == r_sf.shape and sf.dtype == r_sf.dtype and sf.stride() == r_sf.stride()


# ---------------------------------------------------------------------------------------------------------
# gpu tier
# ---------------------------------------------------------------------------------------------------------

def _poison():
    """Fill the caching allocator's free memory with 0xFF so freshly allocated outputs start poisoned."""
    free = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    free.fill_(0xFF)
    del free


def _run(x, flags):
    _poison()
    got = K.e5m6_cast_launch(x, x.size(1), *flags)
    torch.cuda.synchronize()
    return got


def _same_sf(got, want, hidden, packed):
    assert got.stride() == want.stride() or got.numel() == 0
    if packed:
        got, want = clear_unused_sf(got, hidden, hidden), clear_unused_sf(want, hidden, hidden)
    assert_equal(got, want, check_stride=False)


def _check(x, flags):
    out, sf = _run(x, flags)
    r_out, r_sf = R.cast_to_e5m6(x, x.size(1), *flags)
    assert_equal(out, r_out)
    _same_sf(sf, r_sf, x.size(1), flags[2])
    return out, sf


@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("hidden", (576, 7168))
@pytest.mark.parametrize("x_dtype", ("bfloat16", "float32"))
@pytest.mark.parametrize("flags", FLAGS, ids=str)
def test_cast_matches_reference(t, hidden, x_dtype, flags):
    _check(torch.randn(t, hidden, dtype=DTYPES[x_dtype], device="cuda"), flags)


@pytest.mark.gpu
@pytest.mark.parametrize("flags", ((False, False, False), (True, False, False), (True, True, False)), ids=str)
def test_cast_other_layouts(flags):
    _check(torch.randn(4001, 2048, dtype=torch.bfloat16, device="cuda") * 100, flags)


def _special(value, t=4001, hidden=576, dtype=torch.float32):
    """quant.md 7.2: a tensor filled with ``value`` whose last column is 65024."""
    x = torch.full((t, hidden), value, dtype=dtype, device="cuda")
    x[:, -1] = 65024.0
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("value", (2.0 ** -20, 2.0 ** -14 * 63 / 64, 2.0 ** -14), ids=str)
@pytest.mark.parametrize("x_dtype", ("bfloat16", "float32"))
@pytest.mark.parametrize("flags", FLAGS, ids=str)
def test_special_values(value, x_dtype, flags):
    _check(_special(value, dtype=DTYPES[x_dtype]), flags)


@pytest.mark.gpu
@pytest.mark.parametrize("flags", FLAGS, ids=str)
def test_adversarial_fills(flags):
    """All-zero and -0 rows, bf16 subnormals, the largest bf16 values, values beyond E5M6's 65024, and rows
    whose scaled values span the binary16 subnormal range (the approximate rounding path of 1.3)."""
    t, hidden = 4001, 576
    mag = torch.exp2(torch.randint(-40, 1, (t, hidden), device="cuda").float())
    x = (torch.randn(t, hidden, device="cuda") * mag)
    x[:, 0] = 1.0  # row max 1: scaled values reach down to 65024 * 2^-40 (binary16 subnormals and below)
    x[10:20] = 0.0
    x[20:30] = -0.0
    x[30:40] = torch.randn(10, hidden, device="cuda") * 2.0 ** -133  # bf16/fp32 subnormals
    x[40:50] = torch.finfo(torch.bfloat16).max * torch.sign(torch.randn(10, hidden, device="cuda"))
    x[50:60] = torch.randn(10, hidden, device="cuda") * 1e6  # beyond 65024 before scaling
    for dtype in (torch.bfloat16, torch.float32):
        _check(x.to(dtype), flags)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", QUANT_FILLS)
@pytest.mark.parametrize("hidden", (576, 7168))
@pytest.mark.parametrize("x_dtype", ("bfloat16", "float32"))
@pytest.mark.parametrize("flags", FLAGS, ids=str)
def test_quant_adversarial_fills(kind, hidden, x_dtype, flags):
    """quant.md 6.2 fills, NaN and +-inf included (1.7: a NaN does not change its row's sf and encodes as the
    positive canonical NaN code; an inf makes the row's sf inf and sf_inv 0, so it encodes as NaN and every
    finite element as +-0): the cast's bytes and sf, then the cast-back of the reference's bytes."""
    x = quant_adversarial(4001, hidden, kind, dtype=DTYPES[x_dtype], device="cuda")
    _check(x, flags)
    data, sf = R.cast_to_e5m6(x, hidden, *flags)
    for out in ("bf16", "fp32"):
        _poison()
        got = K.cast_back_e5m6_cuda((data, sf), out, (1, hidden))
        torch.cuda.synchronize()
        want = R.cast_back_from_e5m6((data, sf), out, (1, hidden))
        nan = torch.isnan(want.float())  # NaN payloads are outside the contract (1.7): compare the positions
        assert torch.equal(torch.isnan(got.float()), nan)
        assert_equal(torch.where(nan, torch.zeros_like(got), got), torch.where(nan, torch.zeros_like(want), want))


@pytest.mark.gpu
def test_nan_and_inf_rows():
    """quant.md 1.7 by hand: one NaN in a row of ones keeps sf = 1 / 65024-ish and codes 0x7E0; one -inf
    gives sf = inf, the inf NaN and the rest +-0; a thread's NaN takes the full encoder, its neighbours the
    short one (both in one row)."""
    x = torch.ones(64, 7168, device="cuda")
    x[1::4, 5] = float("nan")
    x[2::4, 7000] = float("-inf")
    x[3::4, ::97] = float("nan")
    x[3::4, 1] = -0.0
    for flags in FLAGS:
        for dtype in (torch.bfloat16, torch.float32):
            _check(x.to(dtype), flags)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", (576, 7168))
def test_strided_rows_equal_contiguous(hidden):
    big = torch.randn(4001, 2 * hidden + 64, dtype=torch.bfloat16, device="cuda")
    x = big[:, :hidden]
    a = _check(x, FLAGS[1])
    b = _run(x.contiguous(), FLAGS[1])
    assert_equal(a[0], b[0])
    assert_equal(clear_unused_sf(a[1], hidden, hidden), clear_unused_sf(b[1], hidden, hidden))


@pytest.mark.gpu
def test_deterministic_and_batch_invariant():
    x = torch.randn(8192, 7168, dtype=torch.bfloat16, device="cuda")
    out1, sf1 = _run(x, FLAGS[0])
    out2, sf2 = _run(x, FLAGS[0])
    assert_equal(out1, out2)
    assert_equal(sf1, sf2)
    for lo, hi in ((0, 1), (4000, 4007), (8191, 8192)):
        o, s = _run(x[lo:hi], FLAGS[0])
        assert_equal(o, out1[lo:hi])
        assert_equal(s, sf1[lo:hi])


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager():
    x = torch.randn(4001, 7168, dtype=torch.bfloat16, device="cuda")
    eager = _run(x, FLAGS[1])
    K.e5m6_cast_launch(x, 7168, *FLAGS[1])  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = K.e5m6_cast_launch(x, 7168, *FLAGS[1])
    captured[0].fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    assert_equal(captured[0], eager[0])
    assert_equal(clear_unused_sf(captured[1], 7168, 7168), clear_unused_sf(eager[1], 7168, 7168))


@pytest.mark.gpu
def test_torch_compile_equals_eager():
    x = torch.randn(4001, 576, dtype=torch.float32, device="cuda")

    def f(x):
        out, sf = K.per_token_cast_to_e5m6_cuda(x, 576, False, True, False)
        return out, sf, K.cast_back_e5m6_cuda((out, sf), "bf16", (1, 576))

    got = torch.compile(f, fullgraph=True)(x)
    want = f(x)
    for g, w in zip(got, want):
        assert_equal(g, w)


# ---- cast-back ----

def _check_back(data, sf, out):
    _poison()
    hidden = data.size(1) * 2 // 3
    got = K.cast_back_e5m6_cuda((data, sf), out, (1, hidden))
    torch.cuda.synchronize()
    assert_equal(got, R.cast_back_from_e5m6((data, sf), out, (1, hidden)))
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("hidden", (576, 7168))
@pytest.mark.parametrize("out", ("bf16", "fp32"))
@pytest.mark.parametrize("flags", FLAGS, ids=str)
def test_cast_back_matches_reference(t, hidden, out, flags):
    x = torch.randn(t, hidden, dtype=torch.bfloat16 if out == "bf16" else torch.float32, device="cuda")
    data, sf = R.cast_to_e5m6(x, hidden, *flags)
    _check_back(data, sf, out)


@pytest.mark.gpu
@pytest.mark.parametrize("value", (2.0 ** -20, 2.0 ** -14 * 63 / 64, 2.0 ** -14), ids=str)
def test_cast_back_special_values(value):
    data, sf = R.cast_to_e5m6(_special(value), 576, *FLAGS[1])
    for out in ("bf16", "fp32"):
        _check_back(data, sf, out)


@pytest.mark.gpu
def test_cast_back_every_code():
    """Adversarial: every non-NaN 12-bit code (subnormals, +-0, max, +-inf) times scales from 2^-126 to 2^100."""
    t, hidden = 4001, 576
    codes = torch.randint(0, 4096, (t, hidden), device="cuda")
    nan = ((codes >> 6) & 31 == 31) & (codes & 63 != 0)
    codes = torch.where(nan, codes & 0xFC0, codes)  # NaN codes -> +-inf
    codes[0, :64] = torch.arange(64, device="cuda")  # all positive subnormal codes
    codes[1, :64] = torch.arange(0x800, 0x840, device="cuda")  # negative ones, -0 first
    codes[2, :4] = torch.tensor([0x7BF, 0xFBF, 0x7C0, 0xFC0], device="cuda")  # +-max, +-inf
    data = F.e5m6_pack(codes)
    sf = torch.exp2(torch.randint(-126, 101, (t, 1), device="cuda").float())
    for out in ("bf16", "fp32"):
        _check_back(data, sf, out)
    packed = torch.zeros(1, F.align(t, 4), dtype=torch.int32, device="cuda")
    packed[0, :t] = (F.ue8m0_encode(sf[:, 0]).to(torch.int32))
    _check_back(data, packed[:, :t].t(), "fp32")  # col + packed UE8M0 sf


# Knob variants (TILEFUSE_KNOBS sweeps, module doc of _jit.knobs): each must give the reference's bits exactly.
KNOB_VARIANTS = [
    {"MIN_BLOCKS": 5},
]


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", KNOB_VARIANTS, ids=str)
def test_knob_variants_match_reference(knobs, knob_kernels):
    """The cast built with a knob variant (compiled here, outside the caches) equals the reference: random
    rows, the quant.md 6.2 fills (NaN and inf included), NaN/inf rows by hand, both widths and dtypes."""
    knob_kernels(K, knobs)
    hand = torch.ones(64, 7168, device="cuda")
    hand[1::4, 5] = float("nan")
    hand[2::4, 7000] = float("-inf")
    hand[3::4, ::97] = float("nan")
    hand[3::4, 1] = -0.0
    for x_dtype in ("bfloat16", "float32"):
        dtype = DTYPES[x_dtype]
        for flags in FLAGS:
            _check(hand.to(dtype), flags)
            for hidden in (576, 7168):
                _check(torch.randn(4001, hidden, dtype=dtype, device="cuda"), flags)
                for kind in QUANT_FILLS:
                    _check(quant_adversarial(1001, hidden, kind, dtype=dtype, device="cuda"), flags)
