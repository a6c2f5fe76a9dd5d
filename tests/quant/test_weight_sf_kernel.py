"""Kernel tiers for batched_transpose_weight_sf (quant.md 5.13) and per_token_cast_and_cast_back (5.8):
compile (sm_90, no GPU) and gpu (bit-exact vs the reference run on the CUDA tensors)."""
import pytest
import torch

from tilefuse import _jit
from tilefuse.quant import _cast_and_cast_back_kernel as CB
from tilefuse.quant import _weight_sf_kernel as WS
from tilefuse.reference.quant import per_token_cast_and_cast_back_values
from tilefuse.reference.weight_sf import batched_transpose_weight_sf as ref_wsf
from tilefuse.testing import assert_equal
from tests.quant.configs import CAST_AND_CAST_BACK
from tests.quant.kernel_binding import fake_jit

TOKENS = (0, 1, 7, 4001, 8192)
DT = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.mark.compile
@pytest.mark.parametrize("name,cfg", [("batched_transpose_weight_sf", c) for c in WS._configs()]
                         + [("per_token_cast_and_cast_back", c) for c in CAST_AND_CAST_BACK], ids=str)
def test_builds_for_sm90(name, cfg):
    src = _jit.compile_kernel(name, cfg, "sm_90", export=False).get_kernel_source()
    assert "__global__" in src and "use_fast_math" not in src


def test_weight_sf_fake_shapes_cpu():
    """The registered fake gives the spec's shapes and strides (quant.md 5.13)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        sf = [torch.empty((2, 8, 12)), torch.empty((4, 5))]
        out = torch.ops.tilefuse.batched_transpose_weight_sf.default(sf, 128, [False, True])
    assert out[0].shape == (2, 1024, 3) and out[0].stride() == (3 * 1024, 1, 1024)
    assert out[1].shape == (2, 1536, 2) and out[1].stride() == (2 * 1536, 1, 1536)
    assert out[2].shape == (512, 2) and out[2].stride() == (1, 512)
    assert out[3].shape == (1, 640) and out[3].stride() == (640, 1)



@pytest.mark.compile
@pytest.mark.parametrize("shapes", ([(5, 7), (2, 3, 6)], [(5, 7)], [(5, 7), (2, 3, 6), (4, 9)]), ids=("two", "one", "three"))
@pytest.mark.parametrize("given_outs", (False, True), ids=("pool", "outs"))
@pytest.mark.parametrize("bs", (32, 128))
def test_weight_sf_launcher_binds_kernel_parameters(bs, given_outs, shapes, monkeypatch):
    """2-D and 3-D sf, sf1 transposed or not, outputs from the pool or given (in the returned strides): every
    output is one job of a launch (up to 4 per launch: 4, 2, then 1), each job's arguments fit the kernel
    (``rows``/``cols`` swap for sf1, ``out_rows = rows * bs``), in order."""
    flags = [True, False, True][:len(shapes)]
    sf = [torch.exp2(torch.randint(-20, 20, s).float()) for s in shapes]
    outs = None
    if given_outs:
        outs = [(torch.full_like(a, -1), torch.full_like(b, -1)) for a, b in ref_wsf(sf, bs, flags)]
    calls = fake_jit(monkeypatch)
    WS.batched_transpose_weight_sf_launch(sf, bs, flags, outs)
    want = []
    for s in shapes:
        g, r, c = (1, *s) if len(s) == 2 else s
        want += [(g, r, c, -(-c // 4), r * bs), (g, c, r, -(-r // 4), c * bs)]
    keys = ("groups", "rows", "cols", "words", "out_rows")
    assert [c.name for c in calls] == ["batched_transpose_weight_sf"] * len(calls)
    assert [c.cfg[1] for c in calls] == {2: [2], 4: [4], 6: [4, 2]}[len(want)]
    assert all(c.cfg in WS._configs() for c in calls)
    got = [tuple(c.env[f"{k}{j}"] for k in keys) for c in calls for j in range(c.cfg[1])]
    assert got == want


@pytest.mark.compile
@pytest.mark.parametrize("t,width", [(7, 2048), (7, 2048 + 64), (7, 2048 + 3), (1, 2048 + 3)], ids=str)
@pytest.mark.parametrize("xd", ("bfloat16", "float32"))
def test_cast_and_cast_back_launcher_binds_kernel_parameters(xd, t, width, monkeypatch):
    """Contiguous rows, 16-byte-multiple row strides (passed as they are) and other row strides (through a
    contiguous copy): the launch fits the kernel's strided parameter."""
    calls = fake_jit(monkeypatch)
    x = torch.randn(t, width).to(DT[xd])[:, :2048]
    CB.cast_and_cast_back_launch(x, "e4m3", 128, round_sf=True)
    vec = 16 // x.element_size()
    stride = width if width % vec == 0 else 2048
    assert [(c.name, c.cfg, c.env["num_tokens"]) for c in calls] == [
        ("per_token_cast_and_cast_back", (xd, "e4m3", 2048, 128, "round"), t)]
    if t > 1:
        assert calls[0].env["row_stride"] == stride


@pytest.mark.parametrize("balance", (True, False))
@pytest.mark.parametrize("threads,r_max", ((128, 8), (128, 4), (64, 4)))
@pytest.mark.parametrize("xd", ("bfloat16", "float32"))
def test_cast_and_cast_back_tile_rule_cpu(xd, threads, r_max, balance, monkeypatch):
    """Every width (multiples of 64 up to 32768): NX CTAs of R vectors per thread cover the row, R <= R_MAX,
    with the fewest CTAs; BALANCE_R: the fewest vectors per thread for those CTAs (bench widths spelled out)."""
    for name, value in (("THREADS", threads), ("R_MAX", r_max), ("BALANCE_R", balance)):
        monkeypatch.setattr(CB, name, value)
    vec = 8 if xd == "bfloat16" else 4
    for h in range(64, 32768 + 1, 64):
        vpr = h // vec
        r, nx = CB.tile(xd, h)
        assert 1 <= r <= r_max and nx * r * threads >= vpr and (nx - 1) * r_max * threads < vpr, h
        if balance:
            assert nx * (r - 1) * threads < vpr, h
    if (xd, threads, r_max, balance) == ("bfloat16", 128, 8, True):
        assert [CB.tile(xd, h) for h in (1536, 2048, 4096, 7168, 18432)] == [(2, 1), (2, 1), (4, 1), (7, 1), (6, 3)]


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _poison():
    free = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    free.fill_(0xFF)
    del free


def _pow2_sf(shape, gen):
    """Powers of two 2^-40 .. 2^20 with some zeros (exponent byte 0)."""
    e = torch.randint(-40, 21, shape, generator=gen, device="cuda").float()
    v = torch.exp2(e)
    return torch.where(torch.rand(shape, generator=gen, device="cuda") < 0.05, torch.zeros_like(v), v)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bs", [32, 128])
def test_weight_sf_gpu(bs):
    g = torch.Generator(device="cuda").manual_seed(bs)
    shapes = [(7168 // bs, 2048 // bs), (3, 4096 // bs, 7168 // bs), (128 // bs, 640 // bs), (2, 384 // bs, 128 // bs)]
    sf = [_pow2_sf(s, g) for s in shapes]
    flags = [False, True, True, False]
    _poison()
    got = WS.batched_transpose_weight_sf_launch(sf, bs, flags, None)
    want = ref_wsf(sf, bs, flags)
    for (a0, a1), (b0, b1) in zip(got, want):
        for a, b in ((a0, b0), (a1, b1)):
            assert a.shape == b.shape and a.stride() == b.stride()
            assert_equal(a, b)  # the reference zero-fills padding bytes; so does the kernel
    # in place into given outputs, and CUDA-graph replay
    outs = [(torch.full_like(a, -1), torch.full_like(b, -1)) for a, b in want]
    res = WS.batched_transpose_weight_sf_launch(sf, bs, flags, outs)
    for (o0, o1), (r0, r1), (b0, b1) in zip(outs, res, want):
        assert r0 is o0 and r1 is o1
        assert_equal(o0, b0)
        assert_equal(o1, b1)
    graph = torch.cuda.CUDAGraph()
    outs2 = [(torch.full_like(a, -1), torch.full_like(b, -1)) for a, b in want]
    with torch.cuda.graph(graph):
        WS.batched_transpose_weight_sf_launch(sf, bs, flags, outs2)
    graph.replay()
    torch.cuda.synchronize()
    for (o0, o1), (b0, b1) in zip(outs2, want):
        assert_equal(o0, b0)
        assert_equal(o1, b1)
    comp = torch.compile(lambda s: WS.batched_transpose_weight_sf_cuda(s, bs, flags), fullgraph=True)(sf)
    for (a0, a1), (b0, b1) in zip(comp, want):
        assert_equal(a0, b0)
        assert_equal(a1, b1)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bs", [32, 128])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_weight_sf_launch_groups_gpu(bs, n):
    """1, 2, 3 and 5 weights: launches of 2 outputs, 4, 4 + 2 and 4 + 4 + 2 (every job's CTA range of a
    launch decoded right: each output equals the reference, padding bytes included)."""
    _check_weights(bs, n, torch.Generator(device="cuda").manual_seed(100 * bs + n))


def _check_weights(bs: int, n: int, g: torch.Generator) -> None:
    """The first ``n`` of five weights' sf (batched and not, partial column blocks) through the launcher, each
    output against the reference: shape, strides and every byte (padding included; outputs poisoned first)."""
    pick = [(3, 4096 // bs, 7168 // bs), (7168 // bs, 2048 // bs), (2, 384 // bs, 128 // bs), (128 // bs, 640 // bs),
            (5, 256 // bs, 1152 // bs)]
    sf = [_pow2_sf(s, g) for s in pick[:n]]
    flags = [True, False, True, False, True][:n]
    _poison()
    got = WS.batched_transpose_weight_sf_launch(sf, bs, flags, None)
    for (a0, a1), (b0, b1) in zip(got, ref_wsf(sf, bs, flags)):
        for a, b in ((a0, b0), (a1, b1)):
            assert a.shape == b.shape and a.stride() == b.stride()
            assert_equal(a, b)


def _adversarial(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows: all zero; -0 and subnormal-scale values; values at and beyond the format max; random."""
    t = x.size(0)
    if t >= 4:
        x[0] = 0
        x[1] = x[1] * 1e-38
        x[1, :3] = -0.0
        x[2, ::2] = {"e4m3": 448.0, "e2m1": 6.0}[fmt]
        x[3] = x[3] * 1e5
    return x


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("cfg", CAST_AND_CAST_BACK, ids=str)
def test_cast_and_cast_back_gpu(t, cfg):
    xd, fmt, h, npc, mode = cfg
    dtype = DT[xd]
    g = torch.Generator(device="cuda").manual_seed(t + npc)
    base = torch.randn((t, h + 64), generator=g, device="cuda") * 3
    base = _adversarial(base, fmt).to(dtype)
    round_sf, e4m3_sf = mode == "round", mode == "e4m3"
    for strided in (False, True):
        x = base[:, :h].clone() if not strided else base.clone()[:, :h]
        want = per_token_cast_and_cast_back_values(x.clone(), fmt, npc, round_sf, e4m3_sf)
        tail = None if not strided else base[:, h:].clone()
        CB.cast_and_cast_back_launch(x, fmt, npc, round_sf, e4m3_sf)
        torch.cuda.synchronize()
        assert_equal(x, want, check_stride=False)  # in place: x keeps its row stride, want is a fresh tensor
        if strided:
            assert_equal(x._base[:, h:] if x._base is not None else tail, tail, check_stride=False)  # the row tail is untouched
    if t > 1:  # batch invariance and determinism: the first row alone, and a second run
        x1 = base[:1, :h].clone()
        CB.cast_and_cast_back_launch(x1, fmt, npc, round_sf, e4m3_sf)
        assert_equal(x1, want[:1], check_stride=False)  # a one-row clone may keep the source's row stride


@gpu
@pytest.mark.gpu
def test_cast_and_cast_back_graph_and_compile_gpu():
    x = torch.randn((64, 2048), device="cuda").to(torch.bfloat16)
    want = per_token_cast_and_cast_back_values(x.clone(), "e4m3", 128, True, False)
    y = x.clone()
    CB.per_token_cast_and_cast_back_cuda(y, "e4m3", 128, True)  # warm up
    y.copy_(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        CB.per_token_cast_and_cast_back_cuda(y, "e4m3", 128, True)
    y.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert_equal(y, want)

    def f(z):
        CB.per_token_cast_and_cast_back_cuda(z, "e4m3", 128, True)
        return z

    z = x.clone()
    torch.compile(f, fullgraph=True)(z)
    assert_equal(z, want)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fill", ("nan", "inf", "zero_blocks", "subnormal", "huge", "mixed"))
@pytest.mark.parametrize("cfg", [c for c in CAST_AND_CAST_BACK if c[3] == 128], ids=str)
def test_cast_and_cast_back_adversarial_fills_gpu(fill, cfg):
    """quant.md 1.7: NaN ignored by the group amax (encodes as NaN / code 7), +-inf gives sf = inf and
    sf_inv = 0 (the round mode used to give sf_inv = -inf); compared with the reference exactly."""
    from tilefuse.testing import quant_adversarial

    xd, fmt, h, npc, mode = cfg
    x = quant_adversarial(61, h, fill, dtype=DT[xd], device="cuda")
    want = per_token_cast_and_cast_back_values(x.clone(), fmt, npc, mode == "round", mode == "e4m3")
    CB.cast_and_cast_back_launch(x, fmt, npc, mode == "round", mode == "e4m3")
    torch.cuda.synchronize()
    # NaN payloads are not part of the contract (1.7): NaN positions must agree, every other value bit-exactly
    assert torch.equal(x.isnan(), want.isnan())
    assert_equal(torch.where(x.isnan(), 0, x), torch.where(want.isnan(), 0, want), check_stride=False)


_BAD_SF = """
import torch
from tilefuse.quant import _weight_sf_kernel as WS
sf = torch.exp2(torch.randint(-8, 8, (2, 32, 56), device="cuda").float())
sf[1, 17, 40] = {value}
WS.batched_transpose_weight_sf_launch([sf], 128, [True], None)
torch.cuda.synchronize()
print("no error")
"""


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("value", ("3.0", "-2.0", "float('nan')"))
def test_weight_sf_value_rule_asserts_on_device_gpu(value):
    """quant.md 5.13: an sf with sign or mantissa bits set trips the kernel's device-side assertion (run in a
    child process: a device assert leaves the CUDA context unusable). Valid values run clean (last test)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", _BAD_SF.format(value=value)], capture_output=True, text=True,
                         timeout=600, cwd=root)
    assert res.returncode != 0 and "no error" not in res.stdout, res.stdout + res.stderr
    ok = subprocess.run([sys.executable, "-c", _BAD_SF.format(value="0.25")], capture_output=True, text=True,
                        timeout=600, cwd=root)
    assert ok.returncode == 0 and "no error" in ok.stdout, ok.stdout + ok.stderr


@gpu
@pytest.mark.gpu
def test_cast_and_cast_back_many_rows_gpu():
    """More rows than a grid's y dimension holds (65535): rows are on grid x."""
    x = torch.randn((70001, 2048), device="cuda").to(torch.bfloat16)
    want = per_token_cast_and_cast_back_values(x.clone(), "e4m3", 128, True, False)
    CB.cast_and_cast_back_launch(x, "e4m3", 128, round_sf=True)
    torch.cuda.synchronize()
    assert_equal(x, want)


# cast_and_cast_back knob variants: the wide-tile code (every pass reads a kept binary32 copy, R = min(R_MAX,
# ceil(vectors / THREADS)), one register cap), smaller tiles, and 64-thread CTAs; each gives the reference's bits.
CB_KNOB_VARIANTS = [
    {"WIDE_TILE": True, "BALANCE_R": False, "E2M1_DIV_MIN_BLOCKS": None},
    {"R_MAX": 4},
    {"THREADS": 64, "R_MAX": 4, "MIN_BLOCKS": 16},
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("knobs", CB_KNOB_VARIANTS, ids=str)
@pytest.mark.parametrize("cfg", [c for c in CAST_AND_CAST_BACK if c[2] != 2048 or c[3] == 32], ids=str)
def test_cast_and_cast_back_knob_variants_gpu(cfg, knobs, knob_kernels):
    """Wide rows and npc 32 built with a knob variant (compiled here, outside the caches): strided rows, in
    place, bit-exact against the reference; the row tail past H is untouched."""
    knob_kernels(CB, knobs)
    xd, fmt, h, npc, mode = cfg
    g = torch.Generator(device="cuda").manual_seed(h + npc)
    base = _adversarial(torch.randn((515, h + 64), generator=g, device="cuda") * 3, fmt).to(DT[xd])
    x = base.clone()[:, :h]
    want = per_token_cast_and_cast_back_values(x.clone(), fmt, npc, mode == "round", mode == "e4m3")
    CB.cast_and_cast_back_launch(x, fmt, npc, mode == "round", mode == "e4m3")
    torch.cuda.synchronize()
    assert_equal(x, want, check_stride=False)
    assert_equal(x._base[:, h:], base[:, h:], check_stride=False)


# Knob variants (TILEFUSE_KNOBS sweeps, module doc of _jit.knobs): each must give the reference's bits exactly.
KNOB_VARIANTS = [
    {"MIN_BLOCKS": 8},
    {"MIN_BLOCKS": 6, "_THREADS": 128},
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("knobs", KNOB_VARIANTS, ids=str)
@pytest.mark.parametrize("bs", [32, 128])
def test_weight_sf_knob_variants_gpu(knobs, bs, knob_kernels):
    """The kernel built with a knob variant (compiled here, outside the caches) equals the reference, padding
    bytes included, for 1 to 5 weights (launches of 2 and 4 outputs, partial column blocks)."""
    knob_kernels(WS, knobs)
    g = torch.Generator(device="cuda").manual_seed(7 * bs)
    for n in (1, 3, 5):
        _check_weights(bs, n, g)
