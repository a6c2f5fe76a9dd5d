"""Kernel tiers for the per-channel casts (quant.md 3.8-3.10): fake shapes and launcher logic (everywhere),
sm_90 builds, parameter binding and generated-code checks (compile), bit-exact kernel == reference (GPU).

GPU comparisons call the reference on the same CUDA tensors and compare bitwise (quant.md 6.2): data and
the row-major fp32 sf (no padding exists in these layouts). Outputs are poisoned (0xFF in the allocator's
free blocks) before each launch so unwritten elements show. These ops take contiguous inputs only, so
there is no strided-input case; the gather's input row count is free, so it runs T in {0, 1, 7, 4001, 8192}.
"""
import re

import numpy as np
import pytest
import torch

from tilefuse import _jit
from tilefuse.formats import CLAMP_MIN, cdiv
from tilefuse.quant import _per_channel_cast_kernel as K, _tl
from tilefuse.reference import quant as R
from tilefuse.testing import assert_equal, quant_adversarial
from tilefuse.testing.generators import QUANT_FILLS
from tests.quant.configs import PER_CHANNEL as CFG
from tests.quant.kernel_binding import fake_jit

TOKENS = (0, 1, 7, 4001, 8192)        # input rows of the gathering op
ALIGNED_TOKENS = (0, 128, 4096, 8192)  # ops that need T % 128 == 0
OUT_TOKENS = (0, 16, 112, 4000, 8192)  # gather lengths (% 16)
_ROW_BYTES = {"bfloat16": 16, "float32": 32, "pair": 8}  # one thread's bytes of one row (8 channels)


def _ref(x, x_sf, npt, rnd, transpose=False, pos=None):
    """The reference result of the launcher's arguments (quant.md 3.8-3.10)."""
    if x_sf is not None or pos is not None:
        src = (x, x_sf) if x_sf is not None else x
        out, sf = R.per_channel_cast_fused(src, npt, 128 if x_sf is not None else None, rnd, pos)
    else:
        out, sf = R.cast(x, "e4m3", (npt, 1), round_sf=rnd)
    return (out.T.contiguous() if transpose else out), sf


def _pos(t_out, t_in, device="cpu"):
    """A gather map of length t_out: about a quarter padding rows (-1), the rest random input rows."""
    if t_in == 0:
        return torch.full((t_out,), -1, dtype=torch.int32, device=device)
    pos = torch.randint(0, t_in, (t_out,), dtype=torch.int32, device=device)
    pos[torch.rand(t_out, device=device) < 0.25] = -1
    return pos


def _pair(t, hidden, device="cpu", scale=1.0):
    """A per-token e4m3 pair with non-power-of-two sf (the reference cast, round_sf off; quant.md 7.2)."""
    x = (torch.randn(t, hidden, device=device) * scale).to(torch.bfloat16)
    return R.cast(x, "e4m3", (1, 128))


# ---------------------------------------------------------------------------------------------------------
# Everywhere: fake (meta) implementations and the launcher's bookkeeping
# ---------------------------------------------------------------------------------------------------------

def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _same_meta(got: torch.Tensor, want: torch.Tensor):
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.numel():
        assert got.stride() == want.stride()


@pytest.mark.parametrize("t", (0, 128, 384))
@pytest.mark.parametrize("npt,transpose", ((128, False), (32, True), (128, True)))
def test_fake_per_channel_cast_matches_reference_metadata(t, npt, transpose):
    x = torch.randn(t, 192, dtype=torch.bfloat16)
    want = _ref(x, None, npt, True, transpose)
    got = torch.ops.tilefuse.per_channel_cast(_meta(x), npt, True, transpose)
    _same_meta(got[0], want[0])
    _same_meta(got[1], want[1])


@pytest.mark.parametrize("t_in,t_out", ((0, 16), (7, 0), (7, 144), (300, None)))
@pytest.mark.parametrize("pair", (False, True))
def test_fake_fused_matches_reference_metadata(t_in, t_out, pair):
    pos = None if t_out is None else _pos(t_out, t_in)
    t_ref = t_in if t_out is None else t_out
    if pair:
        data, sf_in = _pair(t_in, 256)
        want = _ref(data, sf_in, 128, False, pos=pos)
        got = torch.ops.tilefuse.per_channel_cast_fused(_meta(data), _meta(sf_in),
                                                        None if pos is None else _meta(pos), False)
    else:
        x = torch.randn(t_in, 200)
        want = _ref(x, None, 128, False, pos=pos) if pos is not None else R.cast(x, "e4m3", (128, 1))
        got = torch.ops.tilefuse.per_channel_cast_fused(_meta(x), None, None if pos is None else _meta(pos), False)
    assert want[0].shape[0] == t_ref
    _same_meta(got[0], want[0])
    _same_meta(got[1], want[1])


@pytest.mark.parametrize("case", ("no_rows", "no_gather_rows", "no_channels"))
def test_empty_outputs_launch_nothing(case, monkeypatch):
    def no_launch(name, cfg):
        raise AssertionError(f"launched {name} {cfg} for an empty output")
    monkeypatch.setattr(K._jit, "get", no_launch)
    if case == "no_rows":
        out, sf = K.per_channel_cast_launch(torch.randn(0, 576, dtype=torch.bfloat16), None, 32, True, True)
        assert out.shape == (576, 0) and sf.shape == (0, 576)
    elif case == "no_gather_rows":
        data, sf_in = _pair(7, 256)
        out, sf = K.per_channel_cast_launch(data, sf_in, 128, False, pos_to_token=_pos(0, 7))
        assert out.shape == (0, 256) and sf.shape == (0, 256)
    else:
        out, sf = K.per_channel_cast_launch(torch.randn(128, 0), None, 128, False)
        assert out.shape == (128, 0) and sf.shape == (1, 0)
    assert out.dtype == torch.float8_e4m3fn and sf.dtype == torch.float32


def test_fused_entry_takes_reference_for_unsupported_hidden():
    """hidden % 8 != 0 (allowed for plain fused inputs) is not a kernel shape: the entry must not launch."""
    assert not K.supported(12) and K.supported(200)
    x = torch.randn(50, 12)
    pos = _pos(32, 50)
    got = K.per_channel_cast_fused_cuda(x, "e4m3", 128, True, None, pos)
    want = R.per_channel_cast_fused(x, 128, None, True, pos)
    assert_equal(got[0], want[0])
    assert_equal(got[1], want[1])


# ---------------------------------------------------------------------------------------------------------
# Compile tier
# ---------------------------------------------------------------------------------------------------------

_SOURCES: dict[tuple, str] = {}


def _source(cfg) -> str:
    if cfg not in _SOURCES:
        _SOURCES[cfg] = _jit.compile_kernel("per_channel_cast", cfg, "sm_90").get_kernel_source()
    return _SOURCES[cfg]


@pytest.mark.compile
@pytest.mark.parametrize("role", tuple(CFG))
def test_builds_for_sm90_with_vector_accesses(role):
    """Each GPU-tier config builds; the generated CUDA keeps IEEE arithmetic, 8-byte e4m3 stores (one row of
    8 channels; 16-byte chunks of 16 rows of one channel when transposed), 16-byte bf16 loads, satfinite
    conversions."""
    cfg = CFG[role]
    src = _source(cfg)
    assert "__global__" in src and "use_fast_math" not in src
    assert ("*(fp8_e4_16_t*)(Y +" if cfg[4] else "*(fp8_e4_8_t*)(Y +") in src
    assert "__NV_SATFINITE" in src or "(fp8_e4_t)(" in src
    words = cfg[0] == "bfloat16" and not cfg[4] and K.BF16_WORDS and K.CAST_REMAT  # rows as 32-bit words
    if cfg[5] or words:  # gathered rows (GATHER_LDG) or bf16 words: one predicated helper load per row
        assert f"tf_pcc_ld{_ROW_BYTES[cfg[0]]}((&({'xw' if words else 'xr'}[" in src
    elif cfg[0] == "bfloat16":
        assert "*(uint4*)(X +" in src
    elif cfg[0] == "pair":
        assert "*(fp8_e4_8_t*)(D +" in src
    if cfg[4]:  # transposed: 16-byte chunks of the shared tile, the store's row stride is the token count
        assert re.search(r"\* \(\(int64_t\)num_tokens\)\)\)\) = \*\(fp8_e4_16_t\*\)\((\(\(fp8_e4_t\*\))?ys", src)


@pytest.mark.compile
@pytest.mark.parametrize("role", tuple(CFG))
def test_launcher_binds_kernel_parameters(role, monkeypatch):
    x_kind, hidden, npt, rnd, transpose, gather = CFG[role]
    calls = fake_jit(monkeypatch)
    t_in = 301 if gather else 256
    pos = _pos(144, t_in) if gather else None
    if x_kind == "pair":
        x, x_sf = _pair(t_in, hidden)
    else:
        x, x_sf = torch.randn(t_in, hidden).to(getattr(torch, x_kind)), None
    got = K.per_channel_cast_launch(x, x_sf, npt, rnd, transpose, pos)
    want = _ref(x, x_sf, npt, rnd, transpose, pos)
    _same_meta(got[0], want[0])
    _same_meta(got[1], want[1])
    assert [c.cfg for c in calls] == [CFG[role]]
    assert calls[0].env["num_tokens"] == (144 if gather else t_in)
    assert calls[0].env["num_row_blocks"] == cdiv(calls[0].env["num_tokens"], npt)
    if gather:
        assert calls[0].env["num_in_tokens"] == t_in


# ---------------------------------------------------------------------------------------------------------
# GPU tier
# ---------------------------------------------------------------------------------------------------------

def _poison():
    """Fill the caching allocator's free memory with 0xFF so freshly allocated outputs start poisoned."""
    free = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    free.fill_(0xFF)
    del free


def _check(x, x_sf, npt, rnd, transpose=False, pos=None):
    _poison()
    got = K.per_channel_cast_launch(x, x_sf, npt, rnd, transpose, pos)
    torch.cuda.synchronize()
    want = _ref(x, x_sf, npt, rnd, transpose, pos)
    assert_equal(got[0], want[0])
    assert_equal(got[1], want[1])
    return got


def _x(t, hidden, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(t, hidden, device="cuda") * scale).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("t", ALIGNED_TOKENS)
@pytest.mark.parametrize("role", ("cast_bf16", "cast_fp32"))
def test_per_channel_cast_matches_reference(t, role):
    x_kind, hidden, npt, rnd, _, _ = CFG[role]
    _check(_x(t, hidden, getattr(torch, x_kind), scale=3.0), None, npt, rnd)


@pytest.mark.gpu
@pytest.mark.parametrize("t", (8, 136, 4096))
@pytest.mark.parametrize("hidden", (1536, 2048, 7168))
@pytest.mark.parametrize("rnd", (False, True))
def test_per_channel_cast_bench_widths_match_reference(t, hidden, rnd):
    """Plain bf16 rows at the bench widths, ragged token counts (a partial
    CTA row of 8 or 136 rows) and the adversarial strips, against the reference."""
    _check(_x(t, hidden, scale=3.0), None, 128, rnd)
    if t == 4096:
        _check(_adversarial(t, hidden, torch.bfloat16, 128), None, 128, rnd)


@pytest.mark.gpu
@pytest.mark.parametrize("t", ALIGNED_TOKENS)
@pytest.mark.parametrize("role", ("transpose32", "transpose128"))
def test_per_channel_cast_and_transpose_matches_reference(t, role):
    _, hidden, npt, rnd, _, _ = CFG[role]
    _check(_x(t, hidden, scale=0.01), None, npt, rnd, transpose=True)


@pytest.mark.gpu
@pytest.mark.parametrize("t_in", TOKENS)
@pytest.mark.parametrize("t_out", OUT_TOKENS)
def test_fused_gather_matches_reference(t_in, t_out):
    _check(_x(t_in, 200), None, 128, False, pos=_pos(t_out, t_in, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("t_in", TOKENS)
@pytest.mark.parametrize("t_out", (16, 4000, 8192))
def test_fused_pair_gather_matches_reference(t_in, t_out):
    data, sf_in = _pair(t_in, 2048, "cuda", scale=5.0)
    _check(data, sf_in, 128, False, pos=_pos(t_out, t_in, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("t", ALIGNED_TOKENS)
def test_fused_pair_matches_reference(t):
    data, sf_in = _pair(t, 2048, "cuda")
    _check(data, sf_in, 128, True)


@pytest.mark.gpu
def test_fused_plain_without_gather_equals_per_channel_cast():
    x = _x(4096, 576)
    got = _check(x, None, 128, True)
    assert_equal(K.per_channel_cast_fused_cuda(x, "e4m3", 128, True)[0], got[0])


@pytest.mark.gpu
@pytest.mark.parametrize("role", ("cast_bf16", "transpose32", "pair_gather"))
def test_deterministic_and_batch_invariant(role):
    """Two runs are identical, and the first 4096 output rows do not depend on the rows after them."""
    x_kind, hidden, npt, rnd, transpose, gather = CFG[role]
    if x_kind == "pair":
        x, x_sf = _pair(8192, hidden, "cuda")
    else:
        x, x_sf = _x(8192, hidden), None
    pos = _pos(8192, 8192, "cuda") if gather else None
    a = K.per_channel_cast_launch(x, x_sf, npt, rnd, transpose, pos)
    b = K.per_channel_cast_launch(x, x_sf, npt, rnd, transpose, pos)
    assert_equal(a[0], b[0])
    assert_equal(a[1], b[1])
    if gather:
        part = K.per_channel_cast_launch(x, x_sf, npt, rnd, transpose, pos[:4096])
    else:
        part = K.per_channel_cast_launch(x[:4096], None if x_sf is None else x_sf[:4096], npt, rnd, transpose)
    whole = a[0][:, :4096] if transpose else a[0][:4096]
    assert_equal(part[0], whole.contiguous())
    assert_equal(part[1], a[1][:4096 // npt])


@pytest.mark.gpu
@pytest.mark.parametrize("role", ("transpose128", "pair_gather"))
def test_cuda_graph_replay_equals_eager(role):
    """A captured launch replays on new input values (same buffers) and equals an eager launch on them."""
    x_kind, hidden, npt, rnd, transpose, gather = CFG[role]
    if x_kind == "pair":
        x, x_sf = _pair(4096, hidden, "cuda")
        x2, x2_sf = _pair(4096, hidden, "cuda", scale=7.0)
    else:
        x, x_sf, x2, x2_sf = _x(4096, hidden), None, _x(4096, hidden, scale=7.0), None
    pos = _pos(4000, 4096, "cuda") if gather else None
    launch = lambda: K.per_channel_cast_launch(x, x_sf, npt, rnd, transpose, pos)  # noqa: E731
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        launch()  # warm (compile, load) off-graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = launch()
    x.copy_(x2)
    if x_sf is not None:
        x_sf.copy_(x2_sf)
    captured[0].fill_(0)
    captured[1].fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    eager = K.per_channel_cast_launch(x2, x2_sf, npt, rnd, transpose, pos)
    assert_equal(captured[0], eager[0])
    assert_equal(captured[1], eager[1])


@pytest.mark.gpu
def test_torch_compile_equals_eager():
    x = _x(4096, 576)
    data, sf_in = _pair(301, 2048, "cuda")
    pos = _pos(4000, 301, "cuda")

    def f(x, data, sf_in, pos):
        a = torch.ops.tilefuse.per_channel_cast(x, 32, False, True)
        b = torch.ops.tilefuse.per_channel_cast_fused(data, sf_in, pos, False)
        return a, b

    got = torch.compile(f, fullgraph=True)(x, data, sf_in, pos)
    want = (K.per_channel_cast_launch(x, None, 32, False, True), K.per_channel_cast_launch(data, sf_in, 128, False,
                                                                                           pos_to_token=pos))
    for g, w in zip(got, want):
        assert_equal(g[0], w[0])
        assert_equal(g[1], w[1])


def _adversarial(t, hidden, dtype, npt):
    """Random data with whole (npt x 8) channel strips replaced: all +0, all -0, subnormals only, exactly
    448, far beyond it (1e30 and the dtype's largest finite value), and one huge element among tiny ones."""
    x = torch.randn(t, hidden, device="cuda", dtype=torch.float32)
    tiny = torch.finfo(dtype).tiny
    fills = [lambda b: b.zero_(), lambda b: b.zero_().neg_(),
             lambda b: b.copy_(torch.randn_like(b).sign() * tiny * torch.rand_like(b) * 0.5),
             lambda b: b.copy_(torch.randn_like(b).sign() * 448.0),
             lambda b: b.copy_(torch.randn_like(b) * 1e30),
             lambda b: b.copy_(torch.randn_like(b).sign() * torch.finfo(dtype).max),
             lambda b: (b.copy_(torch.randn_like(b) * 1e-6), b[0, 0].fill_(3e4))]
    k = 0
    for r in range(0, t, npt):
        for c in range(0, hidden, 8):
            if (r // npt + c // 8) % 2 == 0:
                fills[k % len(fills)](x[r:r + npt, c:c + 8])
                k += 1
    return x.to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("role", ("cast_bf16", "cast_fp32", "transpose32", "transpose128"))
def test_adversarial_plain(role):
    x_kind, hidden, npt, rnd, transpose, _ = CFG[role]
    _check(_adversarial(1024, hidden, getattr(torch, x_kind), npt), None, npt, rnd, transpose)


@pytest.mark.gpu
@pytest.mark.parametrize("role", ("gather", "pair_gather", "pair"))
def test_adversarial_fused(role):
    x_kind, hidden, npt, rnd, _, gather = CFG[role]
    x = _adversarial(1024, hidden, torch.bfloat16, 128)
    x_sf = None
    if x_kind == "pair":
        x, x_sf = R.cast(x, "e4m3", (1, 128))
    _check(x, x_sf, 128, rnd, pos=_pos(1008, 1024, "cuda") if gather else None)


@pytest.mark.gpu
@pytest.mark.parametrize("fill", QUANT_FILLS)
@pytest.mark.parametrize("role", tuple(CFG))
def test_quant_adversarial_fills_match_reference(fill, role):
    """quant.md 6.2's fills (zero channel blocks, subnormals, huge values, NaN and +-inf, format maxima and
    ties) through every test config. Per quant.md 1.7 (the reference models the kernels): NaN is ignored by
    the block max and encodes as +NaN (0x7F); an inf makes its block's sf inf and sf_inv 0 (the inf itself
    becomes NaN, the block's finite values +-0). Pairs are the per-token reference cast of the fill, so an
    inf gives a per-token sf of inf and NaN data/products in the dequantized values."""
    x_kind, hidden, npt, rnd, transpose, gather = CFG[role]
    t_in = 301 if gather else 384
    dtype = torch.bfloat16 if x_kind == "pair" else getattr(torch, x_kind)
    x = quant_adversarial(t_in, hidden, fill, dtype=dtype, device="cuda")
    x_sf = None
    if x_kind == "pair":
        x, x_sf = R.cast(x, "e4m3", (1, 128))
    pos = _pos(400, t_in, "cuda") if gather else None
    _check(x, x_sf, npt, rnd, transpose, pos)


@pytest.mark.gpu
@pytest.mark.parametrize("role", ("gather", "pair_gather"))
def test_fused_gather_from_misaligned_pos_view(role):
    """The kernel reads pos_to_token as 32-byte runs of 8 rows: a view starting 4 bytes into its storage
    must still give the reference's result (the launcher realigns it)."""
    x_kind, hidden, npt, rnd, _, _ = CFG[role]
    if x_kind == "pair":
        x, x_sf = _pair(301, hidden, "cuda")
    else:
        x, x_sf = _x(301, hidden), None
    pos = _pos(4001, 301, "cuda")[1:]
    assert pos.data_ptr() % 16 != 0
    _check(x, x_sf, npt, rnd, pos=pos)


# ---------------------------------------------------------------------------------------------------------
# Knob variants (TILEFUSE_KNOBS sweeps): each must give the reference's bits exactly
# ---------------------------------------------------------------------------------------------------------

KNOB_VARIANTS = [
    {"GATHER_LDG": False, "PAIR_REMAT": False, "PAIR_MIN_WARPS": 20},  # the defaults before 2026-11-30
    {"PAIR_REMAT": False, "PAIR_MIN_WARPS": 20},
    {"CAST_PDL": True, "TRANSPOSE_PDL": False},
    {"CAST_PDL": True, "CAST_PDL_TRIGGER": True},
    {"CAST_CL": 4},
    {"CAST_CL": 4, "CAST_PDL": True, "CAST_PDL_TRIGGER": True},
    {"CAST_CL": 4, "CAST_RPT": 4, "MIN_WARPS": 40},
]


@pytest.mark.compile
@pytest.mark.parametrize("role", ("gather", "gather_fp32", "pair_gather"))
def test_gathered_rows_are_predicated_loads_without_branches(role):
    """GATHER_LDG: each of a thread's 8 gathered rows is one call of the predicated-load helper (data, and a
    pair's sf), taken only for a non-negative entry (zeros otherwise): no per-row branch around TileLang loads."""
    x_kind = CFG[role][0]
    src = _source(CFG[role])
    body = src[src.index("__launch_bounds__"):]
    words = x_kind == "bfloat16" and K.BF16_WORDS and K.CAST_REMAT  # bf16 rows as 32-bit words (4 a row)
    dst = r"xw\[\(j_\d+ \* 4\)\]" if words else r"xr\[\(j_\d+ \* 8\)\]"
    load = re.search(rf"tf_pcc_ld{_ROW_BYTES[x_kind]}\(\(&\({dst}\)\), \(&\([XD]\[0\]\)\), (.*), \(0 <= pl\[j_\d+\]\)\);", body)
    assert load, body[:2000]
    assert "if ((0 <= pl[" not in body and "if (0 <= pl[" not in body
    if x_kind == "pair":
        assert re.search(r"sl\[j_\d+\] = tf_pcc_ldf\(\(&\(S\[0\]\)\), .*, \(0 <= pl\[j_\d+\]\)\);", body)
        # the product data * sf_in is recomputed for the store (PAIR_REMAT), so 8 CTAs fit at 64 registers
        assert "__launch_bounds__(128, 8)" in src


@pytest.mark.compile
@pytest.mark.parametrize("role", ("cast_bf16", "pair_gather", "transpose128"))
def test_pdl_knob_waits_before_any_global_access(role, monkeypatch):
    """CAST_PDL: the grid-dependency wait is the kernel's first statement (before every load and store), so
    a launch overlapping the previous grid's tail reads and writes nothing early."""
    import tilelang

    monkeypatch.setattr(K, "CAST_PDL", True)
    monkeypatch.setattr(K, "TRANSPOSE_PDL", True)
    monkeypatch.setattr(K, "CAST_PDL_TRIGGER", True)
    src = tilelang.compile(K.per_channel_cast_kernel(*CFG[role]), target={"kind": "cuda", "arch": "sm_90"},
                           execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS)).get_kernel_source()
    body = src[src.index("__launch_bounds__"):]
    wait = body.index("cudaGridDependencySynchronize();")
    first_global = min(i for i in (body.find(p) for p in ("X +", "D +", "S +", "S[", "P +", "P[", "Y +", "SF +", "SF[",
                                                          "(&(X[", "(&(D[")) if i >= 0)
    assert wait < body.index("cudaTriggerProgrammaticLaunchCompletion();") < first_global


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", KNOB_VARIANTS, ids=str)
@pytest.mark.parametrize("role", ("cast_bf16", "gather", "pair_gather", "pair"))
def test_knob_variants_match_reference(knobs, role, knob_kernels):
    """The non-transposed configs built with a knob variant give the reference's bits (NaN and inf included),
    twice in a row (a PDL launch behind a PDL launch)."""
    x_kind, hidden, npt, rnd, transpose, gather = CFG[role]
    knob_kernels(K, knobs)
    t_in = 301 if gather else 4096
    if x_kind == "pair":
        x, x_sf = _pair(t_in, hidden, "cuda", scale=3.0)
    else:
        x, x_sf = _x(t_in, hidden), None
        x[3, 5], x[200, 9] = float("nan"), float("inf")
    pos = _pos(4000, t_in, "cuda") if gather else None
    first = _check(x, x_sf, npt, rnd, transpose, pos)
    again = K.per_channel_cast_launch(x, x_sf, npt, rnd, transpose, pos)
    assert_equal(again[0], first[0])
    assert_equal(again[1], first[1])


@pytest.mark.compile
def test_no_round_uses_the_exact_quotients():
    """No round_sf, bf16 (EXACT_DIV): the scale pair comes from the FMA-pipe quotients, no div.rn left."""
    src = _source(CFG["gather"])
    assert K.EXACT_DIV and "tf_quot_rn(" in src and "tf_inv_quot_rn(" in src
    assert " / a)" not in src and "/ 0x1.cp+8f" not in src


# ---------------------------------------------------------------------------------------------------------
# _tl.exact_quotient / exact_inverse_quotient: bit equality with IEEE division (CPU, exact binary32 FMA model)
# ---------------------------------------------------------------------------------------------------------

def _fma32(x, y, z):
    """binary32 fma (one rounding, ties to even) of float32 arrays: the float64 sum and its exact TwoSum error,
    rounded once (the error decides only a sum that lies exactly on a binary32 midpoint)."""
    x, y, z = (np.asarray(v, np.float32).astype(np.float64) for v in (x, y, z))
    p = x * y  # exact: 48 bits
    s = p + z
    bp = s - z
    err = (p - bp) + (z - (s - bp))
    r = s.astype(np.float32)
    d = s - r.astype(np.float64)
    n = np.nextafter(r, np.where(d > 0, np.float32(np.inf), np.float32(-np.inf)))
    mid = (d != 0) & (s == (r.astype(np.float64) + n.astype(np.float64)) * 0.5) & (err != 0)
    return np.where(mid & (np.sign(err) == np.sign(d)), n, r).astype(np.float32)


def _mul32(x, y):
    return (np.asarray(x, np.float32).astype(np.float64) * np.asarray(y, np.float32).astype(np.float64)).astype(
        np.float32)


def _split(a):
    ab = a.view(np.int32)
    m = ((ab & 0x007FFFFF) | 0x3F800000).view(np.float32)
    return ab, m, (ab & 0x7F800000) - 0x3F800000


def _model_quot(a, M):
    """tf_quot_rn of _tl.EXACT_DIV_SRC, step by step."""
    M = np.float32(M)
    R = np.float32(1) / M
    ab, m, e23 = _split(a)
    q = _mul32(m, R)
    q = _fma32(_fma32(-q, M, m), R, q)
    return np.where(ab >= 0x7F800000, a, (q.view(np.int32) + e23).view(np.float32))


def _model_inv_quot(M, a):
    """tf_inv_quot_rn of _tl.EXACT_DIV_SRC, step by step."""
    M = np.float32(M)
    ab, m, e23 = _split(a)
    y = _fma32(m, np.float32(_tl.RCP_START[1]), np.float32(_tl.RCP_START[0]))
    for _ in range(3):
        y = _fma32(y, _fma32(-m, y, np.float32(1)), y)
    q = _mul32(M, y)
    q = _fma32(_fma32(-q, m, M), y, q)
    return np.where(ab >= 0x7F800000, np.float32(0), (q.view(np.int32) - e23).view(np.float32))


def test_fma_model_is_exact():
    """The FMA model against exact rationals, including sums on binary32 midpoints."""
    from fractions import Fraction
    rng = np.random.default_rng(7)
    x = rng.standard_normal(4000).astype(np.float32)
    y = rng.standard_normal(4000).astype(np.float32)
    z = -_mul32(x, y)  # near-cancellation
    z[::2] = rng.standard_normal(2000).astype(np.float32)
    z[1::4] = (_mul32(x, y)[1::4] * np.float32(1 + 2 ** -24)).astype(np.float32)
    got = _fma32(x, y, z)
    for a, b, c, g in zip(x.tolist(), y.tolist(), z.tolist(), got.tolist()):
        exact = Fraction(a) * Fraction(b) + Fraction(c)
        lo = np.float32(float(exact))  # float() rounds once to binary64, then the candidates around it
        cands = [lo, np.nextafter(lo, np.float32(np.inf)), np.nextafter(lo, np.float32(-np.inf))]
        best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.float32(v).view(np.int32)) & 1))
        assert g == best, (a, b, c)


@pytest.mark.parametrize("M", [448.0, 6.0])
def test_exact_quotients_equal_ieee_division_on_every_mantissa(M):
    """For every binary32 m in [1, 2) (the helpers work on the mantissa; the exponent goes on exactly),
    both quotients equal numpy's IEEE binary32 division; plus every binade with sampled mantissas, the
    domain's edges and +inf."""
    m = (np.arange(2 ** 23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)
    Mf = np.float32(M)
    assert np.array_equal(_model_quot(m, M).view(np.int32), (m / Mf).view(np.int32))
    assert np.array_equal(_model_inv_quot(M, m).view(np.int32), (Mf / m).view(np.int32))
    lo = np.float32(max(CLAMP_MIN["e4m3" if M == 448.0 else "e2m1"], M * 2.0 ** -126))
    rng = np.random.default_rng(11)
    mant = rng.integers(0, 2 ** 23, 4096, dtype=np.int64)
    a = np.concatenate([((np.int64(e) << 23) | mant).astype(np.int32).view(np.float32) for e in range(1, 255)])
    a = np.concatenate([a, [lo, np.nextafter(lo, np.float32(1)), np.finfo(np.float32).max, np.float32(1)]])
    a = a[a >= lo].astype(np.float32)
    with np.errstate(over="ignore"):
        assert np.array_equal(_model_quot(a, M).view(np.int32), (a / Mf).view(np.int32))
        assert np.array_equal(_model_inv_quot(M, a).view(np.int32), (Mf / a).view(np.int32))
    inf = np.array([np.inf], np.float32)
    assert _model_quot(inf, M)[0] == np.inf and _model_inv_quot(M, inf)[0] == 0.0
