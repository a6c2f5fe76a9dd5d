"""Kernel tiers for ``cast_back`` / ``per_token_cast_back`` (quant.md 3.5) and ``unpack_from_e2m1fn_x2`` (1.2).

compile: every config the GPU tier uses builds for sm_90 with IEEE arithmetic, and the launchers hand each
kernel arguments whose dtypes, shapes and strides fit its signature (checked on CPU against the prim_func).
gpu: bit-exact against the reference run on the same CUDA tensors (quant.md 6.2), outputs poisoned first.
"""
import numpy as np
import pytest
import torch

from tilefuse import _jit
from tilefuse import formats as F
from tilefuse.quant import _cast_back_kernel as K
from tilefuse.reference import quant as R
from tilefuse.testing import assert_equal, quant_adversarial
from tilefuse.testing.generators import QUANT_FILLS
from tests.quant.configs import CAST_BACK
from tests.quant.kernel_binding import fake_jit, tir_eval

TOKENS = (0, 1, 7, 4001, 8192)
OUT = {"bf16": torch.bfloat16, "fp32": torch.float32}
# (use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0): quant.md 7.1 sets plus a non-rounded col sf
FLAGS = ((False, True, False), (True, True, True), (True, False, False))


# ---------------------------------------------------------------------------------------------------------
# compile tier
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.compile
@pytest.mark.parametrize("cfg", CAST_BACK, ids=str)
def test_cast_back_builds_for_sm90(cfg):
    src = _jit.compile_kernel("cast_back", cfg, "sm_90").get_kernel_source()
    assert "__global__" in src and "use_fast_math" not in src
    # a chunk is one 16-byte store (its data load is 2-8 bytes, coalesced across the warp like the stores)
    assert ("*(uint4*)(Y" in src) if cfg[1] == "bf16" else ("*(float4*)(Y" in src)


@pytest.mark.compile
@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "float16"))
def test_unpack_builds_for_sm90(dtype):
    src = _jit.compile_kernel("unpack_from_e2m1fn_x2", (dtype,), "sm_90").get_kernel_source()
    hint = K._STORE_FN.get(K.UNPACK_STORE_HINT)  # 16-byte stores: the hinted helper's, else a vector store
    assert (hint + "((&(Y[") in src if hint else ("*(float4*)(Y" if dtype == "float32" else "*(uint4*)(Y") in src


@pytest.mark.compile
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("flags", FLAGS, ids=str)
@pytest.mark.parametrize("block", ((1, 128), (128, 128), (128, 1), (1, 576)), ids=str)
def test_cast_back_launch_binds(monkeypatch, fmt, flags, block):
    col, round_sf, packed = flags
    if block[1] == 1 and packed:
        pytest.skip("packed UE8M0 is per channel block")
    x = torch.randn(130, 576)
    data, sf = R.cast(x, fmt, block, round_sf=round_sf, use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)
    calls = fake_jit(monkeypatch)
    out = K.cast_back_launch(data, sf, "bf16", block)
    assert out.shape == (130, 576) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert len(calls) == 1 and calls[0].env["num_tokens"] == 130
    # a row-strided data view is passed as it is when its rows stay 16-byte aligned
    wide = torch.zeros(130, 2 * data.size(1), dtype=data.dtype)
    wide[:, :data.size(1)] = data
    K.cast_back_launch(wide[:, :data.size(1)], sf, "fp32", block)
    assert calls[1].env["data_row_stride"] == 2 * data.size(1)


@pytest.mark.compile
def test_unpack_launch_binds(monkeypatch):
    calls = fake_jit(monkeypatch)
    x = torch.randint(-128, 128, (3, 5, 7), dtype=torch.int8)
    out = K.unpack_e2m1_launch(x, torch.float64)
    assert out.shape == (3, 5, 14) and out.dtype == torch.float64
    assert [c.env for c in calls] == [{"num_bytes": 105}]
    out = K.unpack_e2m1_launch(x.view(torch.uint8)[:, ::2], torch.bfloat16)  # non-contiguous: copied
    assert out.shape == (3, 3, 14) and out.dtype == torch.bfloat16
    assert calls[1].env == {"num_bytes": 63}
    assert K.unpack_e2m1_launch(torch.empty(0, 4, dtype=torch.int8)).shape == (0, 8)
    assert len(calls) == 2  # nothing launched for an empty input


def test_per_format_knobs_fall_back_to_the_shared_ones(monkeypatch):
    """E4M3_* / E2M1_* / E5M6_* override THREADS / UNROLL / MIN_BLOCKS for their format only; None reads the
    shared knob (every default but E2M1_UNROLL = E5M6_UNROLL = 2)."""
    for dfmt in ("e4m3", "e2m1", "e5m6"):
        for name in ("THREADS", "UNROLL", "MIN_BLOCKS"):
            own = getattr(K, f"{dfmt.upper()}_{name}")
            assert own == (2 if (dfmt, name) in (("e2m1", "UNROLL"), ("e5m6", "UNROLL")) else None)
            assert K._knob(dfmt, name) == (getattr(K, name) if own is None else own)
    monkeypatch.setattr(K, "E2M1_THREADS", 64)
    assert K._knob("e2m1", "THREADS") == 64 and K._knob("e4m3", "THREADS") == K.THREADS == K._knob("e5m6", "THREADS")


def test_e2m1_decode_expression_is_exact():
    """The kernel's E2M1 decoding expression, evaluated with C integer semantics, gives the bits of
    ``formats.e2m1_decode`` for all 16 nibbles (including -0.0)."""
    pytest.importorskip("tilelang")
    from tvm import tirx

    nib = np.arange(16, dtype=np.int32)
    got = tir_eval(K._decode_e2m1(tirx.Var("c", "int32")), {"c": nib}).view(np.uint32)
    want = F.e2m1_decode(torch.from_numpy(nib)).numpy().view(np.uint32)
    assert (got == want).all()
    assert got[8] == 0x80000000 and got[7] == np.float32(6.0).view(np.uint32)


def test_e2m1_x4_decoder_is_exact():
    """The four-nibble decoder of both kernels (binary16 lanes widened by the hardware, times 2^14) gives the
    bits of the one-nibble expression, hence of ``formats.e2m1_decode``, on all 65536 two-byte inputs."""
    pytest.importorskip("tilelang")
    from tvm import tirx

    xs = np.arange(1 << 16, dtype=np.uint32)
    got = np.stack([tir_eval(e, {"x": xs}) for e in K._decode_e2m1_x4(tirx.Var("x", "uint32"))], -1)
    table = F.e2m1_decode(torch.arange(16)).numpy().astype(np.float32)
    want = np.stack([table[(xs >> (4 * k)) & 15] for k in range(4)], -1)
    assert (got.view(np.uint32) == want.view(np.uint32)).all()


def test_fake_shapes_match_reference():
    """The fake implementations (torch.compile's view of the ops) give the reference's shapes and dtypes."""
    x = torch.randn(9, 256)
    for fmt in ("e4m3", "e2m1"):
        pair = R.cast(x, fmt, (1, 128))
        for out in ("bf16", "fp32"):
            want = R.cast_back(pair, out, (1, 128))
            got = torch.ops.tilefuse.cast_back(pair[0].to("meta"), pair[1].to("meta"), out, [1, 128], None)
            assert got.shape == want.shape and got.dtype == want.dtype
    packed = torch.randint(-128, 128, (2, 3, 5), dtype=torch.int8)
    got = torch.ops.tilefuse.unpack_from_e2m1fn_x2(packed.to("meta"), torch.float16)
    assert got.shape == (2, 3, 10) and got.dtype == torch.float16


# ---------------------------------------------------------------------------------------------------------
# gpu tier
# ---------------------------------------------------------------------------------------------------------

def _poison():
    """Fill the caching allocator's free memory with 0xFF so freshly allocated outputs start as NaN."""
    free = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    free.fill_(0xFF)
    del free


def _run(data, sf, out, block):
    _poison()
    got = K.cast_back_launch(data, sf, out, block)
    torch.cuda.synchronize()
    return got


def _check(data, sf, out, block):
    got = _run(data, sf, out, block)
    assert_equal(got, R.cast_back((data, sf), out, block))
    return got


def _quantized(t, hidden, fmt, block, flags, dtype=torch.bfloat16):
    col, round_sf, packed = flags
    x = torch.randn(t, hidden, dtype=dtype, device="cuda")
    return R.cast(x, fmt, block, round_sf=round_sf, use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)


@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("out", ("bf16", "fp32"))
@pytest.mark.parametrize("flags", FLAGS, ids=str)
@pytest.mark.parametrize("h", (576, 7168))
def test_per_token_matches_reference(t, fmt, out, flags, h):
    """576 channels: a masked last chunk per row; 7168, the bench width: rows of whole CTA tiles."""
    data, sf = _quantized(t, h, fmt, (1, 128), flags, OUT[out])
    _check(data, sf, out, (1, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("out", ("bf16", "fp32"))
def test_one_group_per_row(fmt, out):
    data, sf = _quantized(4001, 2048, fmt, (1, 2048), (False, False, False))
    _check(data, sf, out, (1, 2048))


@pytest.mark.gpu
@pytest.mark.parametrize("t", (1, 7, 4001))
@pytest.mark.parametrize("block", ((128, 1), (128, 128)), ids=str)
@pytest.mark.parametrize("round_sf", (False, True))
@pytest.mark.parametrize("out", ("bf16", "fp32"))
def test_block_matches_reference(t, block, round_sf, out):
    data, sf = _quantized(t, 2048, "e4m3", block, (False, round_sf, False))
    _check(data, sf, out, block)


@pytest.mark.gpu
@pytest.mark.parametrize("t", (1, 7, 130, 4001))
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("block", ((128, 1), (4, 1)), ids=str)
@pytest.mark.parametrize("col", (False, True))
def test_per_element_sf_row_walk(t, fmt, block, col):
    """Blocks narrower than a chunk (one sf per element): a thread walks the rows of one sf row block, R = 8 of
    128 or all 4 of a 4-row block; 576 channels leave chunk columns past the row; row-major and column-major sf."""
    for out in ("bf16", "fp32"):
        data, sf = _quantized(t, 576, fmt, block, (col, False, False), OUT[out])
        _check(data, sf, out, block)


@pytest.mark.gpu
def test_block_col_packed_sf():
    data, sf = _quantized(4001, 2048, "e4m3", (128, 128), (True, True, True))
    _check(data, sf, "fp32", (128, 128))


@pytest.mark.gpu
def test_e2m1_block_32():
    data, sf = _quantized(4001, 2048, "e2m1", (32, 32), (False, False, False))
    _check(data, sf, "bf16", (32, 32))


@pytest.mark.gpu
def test_per_token_cast_back_entry():
    data, sf = _quantized(4001, 576, "e2m1", (1, 128), (True, True, True))
    _poison()
    got = K.per_token_cast_back_cuda((data, sf), "fp32", 128)
    assert_equal(got, R.cast_back((data, sf), "fp32", (1, 128)))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
def test_random_codes_and_scales(fmt):
    """Adversarial: every code (subnormals, +-max, -0; no NaN codes) times sf from 2^-126 up to 2^100 in a
    column-major fp32 sf that is not TMA-aligned, so products also overflow and go subnormal."""
    t, hidden = 4001, 576
    width = hidden if fmt == "e4m3" else hidden // 2
    raw = torch.randint(0, 256, (t, width), dtype=torch.uint8, device="cuda")
    if fmt == "e4m3":
        raw[(raw & 0x7F) == 0x7F] = 0x7E  # NaN -> max
        raw[:, :8] = torch.tensor([0x7E, 0xFE, 0x01, 0x81, 0x80, 0x00, 0x07, 0x08], dtype=torch.uint8)
        data = raw.view(torch.float8_e4m3fn)
    else:
        data = raw.view(torch.int8)
    exps = torch.randint(-126, 101, (t, 5), device="cuda").float()
    sf = (torch.exp2(exps) * (1 + torch.rand(t, 5, device="cuda"))).t().contiguous().t()
    sf[:3] = torch.tensor([0.0, float(torch.finfo(torch.float32).max), 2.0 ** -149], device="cuda")[:, None]
    for out in ("bf16", "fp32"):
        _check(data, sf, out, (1, 128))


@pytest.mark.gpu
def test_all_zero_blocks():
    x = torch.randn(4001, 576, device="cuda")
    x[100:300] = 0
    x[:, 128:256] = -0.0
    for fmt in ("e4m3", "e2m1"):
        data, sf = R.cast(x, fmt, (1, 128), round_sf=True)
        got = _check(data, sf, "fp32", (1, 128))
        assert (got[100:300] == 0).all()


def _assert_equal_nan_mask(got, want):
    """Bit-exact outside NaNs and NaN at the same positions (quant.md 1.7: NaN/inf are outside the contract;
    a NaN's payload is whatever the multiply and the conversion make of it)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan)
    assert_equal(torch.where(nan, torch.zeros_like(got), got), torch.where(nan, torch.zeros_like(want), want))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", QUANT_FILLS)
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("flags", FLAGS, ids=str)
def test_adversarial_fills(kind, fmt, flags):
    """quant.md 6.2 fills (zero blocks, subnormals, huge values, NaN, +-inf, mixed ties) quantized by the
    reference (1.7: a NaN element encodes as NaN / +6, an inf makes its group's sf inf), then cast back:
    inf sf times a zero code is NaN. Per token (1, 128) and per block (128, 128), bf16 and fp32 outputs."""
    col, round_sf, packed = flags
    for block in ((1, 128), (128, 128)):
        if fmt == "e2m1" and block[0] == 128:
            continue  # no such config (e2m1 block casts are 32 x 32; covered by test_e2m1_block_32)
        x = quant_adversarial(4001, 2048, kind, dtype=torch.float32, device="cuda")
        data, sf = R.cast(x, fmt, block, round_sf=round_sf, use_tma_aligned_col_major_sf=col,
                          use_packed_ue8m0=packed)
        for out in (("fp32",) if packed and block[0] == 128 else ("bf16", "fp32")):  # registered configs
            got = _run(data, sf, out, block)
            _assert_equal_nan_mask(got, R.cast_back((data, sf), out, block))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
def test_strided_data_equals_contiguous(fmt):
    data, sf = _quantized(4001, 576, fmt, (1, 128), (True, True, True))
    wide = torch.zeros(data.size(0), data.size(1) + 64, dtype=data.dtype, device="cuda")
    wide[:, :data.size(1)] = data
    view = wide[:, :data.size(1)]
    assert_equal(_check(view, sf, "bf16", (1, 128)), _run(data, sf, "bf16", (1, 128)))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
def test_deterministic_and_batch_invariant(fmt):
    data, sf = _quantized(8192, 576, fmt, (1, 128), (False, True, False))
    a = _run(data, sf, "bf16", (1, 128))
    b = _run(data, sf, "bf16", (1, 128))
    assert_equal(a, b)
    for lo, hi in ((0, 1), (4000, 4007), (8191, 8192)):
        assert_equal(_run(data[lo:hi], sf[lo:hi], "bf16", (1, 128)), a[lo:hi])


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager():
    data, sf = _quantized(4001, 576, "e4m3", (1, 128), (True, True, True))
    eager = _run(data, sf, "fp32", (1, 128))
    K.cast_back_launch(data, sf, "fp32", (1, 128))  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = K.cast_back_launch(data, sf, "fp32", (1, 128))
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_equal(captured, eager)


@pytest.mark.gpu
def test_torch_compile_equals_eager():
    data, sf = _quantized(4001, 576, "e2m1", (1, 128), (False, True, False))

    def f(data, sf):
        return (K.cast_back_cuda((data, sf), "bf16", (1, 128)),
                K.unpack_from_e2m1fn_x2_cuda(data, torch.float32))

    got = torch.compile(f, fullgraph=True)(data, sf)
    want = f(data, sf)
    for g, w in zip(got, want):
        assert_equal(g, w)


def _unpack_ref(x, out_dtype):
    return F.e2m1_decode(F.e2m1_unpack(x)).to(out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ((1,), (3, 5, 7), (4001, 1024), (0, 4), (7, 0)), ids=str)
@pytest.mark.parametrize("out_dtype", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
def test_unpack_matches_reference(shape, out_dtype):
    x = torch.randint(-128, 128, shape, dtype=torch.int8, device="cuda")
    _poison()
    got = K.unpack_e2m1_launch(x, out_dtype)
    torch.cuda.synchronize()
    assert_equal(got, _unpack_ref(x, out_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("n", (1, 2, 3, 4, 5, 255, 256 * 2 * 8 + 3, 256 * 4 * 8 * 3 + 1, 256 * 4 * 8 * 5 + 77))
def test_unpack_ragged_lengths(n):
    """Lengths around the kernel's chunk (2 or 4 bytes) and CTA (UNPACK_UNROLL chunks x 256 threads) tails."""
    x = torch.randint(-128, 128, (n,), dtype=torch.int8, device="cuda")
    for out_dtype in (torch.float32, torch.bfloat16):
        _poison()
        assert_equal(K.unpack_e2m1_launch(x, out_dtype), _unpack_ref(x, out_dtype))


@pytest.mark.gpu
def test_unpack_uint8_and_strided_input():
    x = torch.randint(0, 256, (257, 66), dtype=torch.uint8, device="cuda")
    view = x[:, 1:65]  # misaligned, row-strided
    _poison()
    assert_equal(K.unpack_e2m1_launch(view, torch.float32), _unpack_ref(view, torch.float32))
    every = torch.arange(256, dtype=torch.uint8, device="cuda")  # every byte
    assert_equal(K.unpack_e2m1_launch(every, torch.bfloat16), _unpack_ref(every, torch.bfloat16))


# ---------------------------------------------------------------------------------------------------------
# knob variants (TILEFUSE_KNOBS sweeps, module doc of _jit.knobs): each must give the reference's bits exactly
# ---------------------------------------------------------------------------------------------------------

KNOB_VARIANTS = [  # the defaults are SF_HOIST=True, UNPACK_STORE_HINT=2, ROW_WALK=4
    {"SF_HOIST": False, "UNPACK_STORE_HINT": 0, "ROW_WALK": 0},
    {"E4M3_MIN_BLOCKS": 16, "E2M1_MIN_BLOCKS": 16, "E5M6_MIN_BLOCKS": 12},
    {"STORE_HINT": 1, "UNPACK_STORE_HINT": 1, "UNPACK_MIN_BLOCKS": 8},
    {"STORE_HINT": 2, "E2M1_STORE_HINT": 1, "ROW_WALK": 16},
    {"E2M1_UNROLL": 8, "E5M6_UNROLL": 8, "UNPACK_UNROLL": 8},
]


def _build_with(monkeypatch, knobs, name, cfg):
    """CUDA source of ``name`` at ``cfg`` built with ``knobs`` set (outside tilefuse's caches)."""
    import tilelang

    for k, v in knobs.items():
        monkeypatch.setattr(K, k, v)
    factory = K.cast_back_kernel if name == "cast_back" else K.unpack_e2m1_kernel
    return tilelang.compile(factory(*cfg), target={"kind": "cuda", "arch": "sm_90"}, execution_backend="tvm_ffi",
                            pass_configs=dict(_jit._PASS_CONFIGS)).get_kernel_source()


@pytest.mark.compile
@pytest.mark.parametrize("knobs", KNOB_VARIANTS, ids=str)
def test_knob_variants_build(monkeypatch, knobs):
    """The bench configs, a masked one (576 channels: chunks past the row) and a per-element sf one build with each
    variant; hinted stores go through the helper, and a hoisted sf leaves no sf load between the stores."""
    pytest.importorskip("tilelang")
    for cfg in (("e4m3", "bf16", 7168, 1, 128, True), ("e2m1", "fp32", 576, 1, 128, True),
                ("e4m3", "fp32", 2048, 128, 1, False), ("e5m6", "bf16", 7168, 1, 7168, False),
                ("e2m1", "fp32", 7168, 1, 128, False), ("e2m1", "bf16", 2048, 1, 2048, True)):
        src = _build_with(monkeypatch, knobs, "cast_back", cfg)
        hint = knobs.get(f"{cfg[0].upper()}_STORE_HINT", knobs.get("STORE_HINT"))
        if hint:
            assert K._STORE_FN[hint] + "(" in src
    src = _build_with(monkeypatch, knobs, "unpack_from_e2m1fn_x2", ("float32",))
    unpack_hint = knobs.get("UNPACK_STORE_HINT", K.UNPACK_STORE_HINT)
    if unpack_hint:
        assert K._STORE_FN[unpack_hint] + "(" in src
    else:
        assert not any(fn + "(" in src for fn in K._STORE_FN.values())


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", KNOB_VARIANTS, ids=str)
def test_knob_variants_match_reference(knobs, knob_kernels):
    """The kernels built with a knob variant (compiled here, outside the caches) equal the reference: per token
    (every sf layout, T = 0/1/7/4001/8192, masked 576-channel rows, one group per row), per block, random codes
    and scales, the quant.md 6.2 fills (NaN and inf included), strided data, E5M6 and the unpack."""
    knob_kernels(K, knobs)
    for fmt in ("e4m3", "e2m1"):
        for out in ("bf16", "fp32"):
            for flags in FLAGS:
                for t in TOKENS:
                    test_per_token_matches_reference(t, fmt, out, flags, 576)
            test_one_group_per_row(fmt, out)
        test_random_codes_and_scales(fmt)
        test_strided_data_equals_contiguous(fmt)
        for flags in FLAGS:
            for kind in QUANT_FILLS:
                test_adversarial_fills(kind, fmt, flags)
    for t in (1, 7, 4001):
        for block in ((128, 1), (128, 128)):
            for out in ("bf16", "fp32"):
                test_block_matches_reference(t, block, True, out)
        test_per_element_sf_row_walk(t, "e4m3", (128, 1), True)
    test_block_col_packed_sf()
    test_e2m1_block_32()
    for t in (1, 7, 4001):  # E5M6 (quant.md 2.3): the cast_back_e5m6 bench config and a masked one
        for hidden in (576, 7168):
            x = torch.randn(t, hidden, dtype=torch.bfloat16, device="cuda")
            data, sf = R.cast_to_e5m6(x, hidden, False, True, False)
            _poison()
            got = K.cast_back_cuda((data, sf), "bf16", (1, hidden), "e5m6")
            torch.cuda.synchronize()
            assert_equal(got, R.cast_back_from_e5m6((data, sf), "bf16", (1, hidden)))
    for shape in ((1,), (3, 5, 7), (4001, 1024), (8001, 3584)):
        test_unpack_matches_reference(shape, torch.float32)
        test_unpack_matches_reference(shape, torch.bfloat16)
    for n in (1, 2, 3, 5, 255, 256 * 2 * 8 + 3, 256 * 4 * 8 * 3 + 1, 256 * 4 * 8 * 5 + 77):
        test_unpack_ragged_lengths(n)
    for t in (1, 7, 4001):  # the bench width: rows of whole CTA tiles
        for out in ("bf16", "fp32"):
            for flags in FLAGS:
                test_per_token_matches_reference(t, "e2m1", out, flags, 7168)
