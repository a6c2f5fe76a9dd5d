"""Kernel tiers of ``engram_gate_fwd`` and ``fused_weight`` (engram.md §2.3, §2.4, §3; ``_gate_fwd_kernel``):
compile (sm_90 builds of every config the tests use, the explicit arithmetic in the source, the launchers' binding
and the generated source run on the CPU) and gpu (the issue's grid against the kernel's order and the reference,
strided and misaligned k and v, save on/off, the sign convention, determinism, batch invariance, CUDA graphs,
torch.compile, poisoned outputs).

What is compared, and how closely (derived, written once):
* ``dot``, ``rstd_x``, ``rstd_k``: bitwise against ``gate_fwd_emulation.model`` (upstream's order of §2.4.2, every
  operation correctly rounded; the kernel's explicit ``__f*_rn`` operations are the same roundings).
* ``gate_score``: within ``G_ULPS`` fp32 ulps of the model. The model's ``u`` is the kernel's bits, but its ``exp``
  is the device library's, not the kernel's ``expf``: each within 2 ulp of ``e^-u`` (CUDA's documented bound), so
  the two ``e`` differ by at most 4 ulp, and ``1 / (1 + e)`` (two correctly rounded steps) moves ``g`` by at most
  that relative amount plus one rounding.
* ``output``: bitwise ``bf16(fma(g, v, x))`` of the kernel's own ``g`` (``out_model``).
* Against the reference ``engram_gate_ref`` (upstream's test, §3.2): every output ``calc_diff < 2e-10`` (the
  output at upstream's token counts; at every T elementwise, see ``_check_against_reference``).
* ``fused_weight``: bitwise ``fp32(w_h) * fp32(w_e)`` (exact).
* The same kernel on the same values: bitwise (save on/off output, determinism, batch invariance, graph replay,
  torch.compile, strided / misaligned / contiguous k and v).

GPU tests call the public ops (the dispatch, the eager launch and, in the compile test, the custom ops). The
launchers' own allocations are NaN-filled (``_gate_fwd_kernel._new``), so an unwritten element shows.
"""
import pytest
import torch

from tilefuse import _jit
from tilefuse import engram as E
from tilefuse.engram import _gate_fwd_kernel as K
from tilefuse.reference.engram import _gate_fwd, engram_gate_ref
from tilefuse.testing import calc_diff
from tests.engram import gate_fwd_emulation as emu
from tests.engram.configs_gate_fwd import (GRID_H, GRID_M, ODD, ROW_KNOBS, ROW_SHAPES, TOKENS, gate_fwd_configs,
                                          token_variant_cases)
from tests.quant.kernel_binding import fake_jit

BF16, F32 = torch.bfloat16, torch.float32
EPS, CLAMP = 1e-20, 1e-6      # upstream's values (§4)
FWD_DIFF = 2e-10              # §3.2: every forward output against the reference
CONTRACT_TOKENS = 4001        # §4: upstream's smallest token count, where the output's calc_diff is asserted
G_ULPS = 4                    # gate_score against the model (see the module docstring)
CHUNK = 512                   # tokens per model check (bounds its float64 temporaries)


# ---- inputs and checks shared by the tiers ----

def _inputs(t, m, h, device="cpu"):
    """``x``, and ``k``, ``v`` as views into one fused ``[T, (M + 1) H]`` projection (upstream's use), the two
    norm weights and the fused weight (fp32 product, as ``fused_weight``)."""
    x = torch.randn(t, m, h, device=device).to(BF16)
    kv = torch.randn(t, (m + 1) * h, device=device).to(BF16).view(t, m + 1, h)
    w_h, w_e = torch.randn(m, h, device=device).to(BF16), torch.randn(m, h, device=device).to(BF16)
    return x, kv[:, :m], kv[:, m], w_h, w_e, w_h.float() * w_e.float()


def _check_g(g, want):
    bad = (g.double() - want.double()).abs() > G_ULPS * emu.f32_ulp(want)
    assert not bad.any(), f"{int(bad.sum())} gate scores beyond {G_ULPS} ulp of the model"


def _check_against_model(got, x, k, v, w):
    """``got = (out, dot, g, rx, rk)``: the statistics against the kernel-order model, the output against
    ``bf16(fma(g, v, x))`` of the kernel's own ``g`` (in token chunks)."""
    out, dot, g, rx, rk = got
    for a in range(0, x.shape[0], CHUNK):
        sl = slice(a, a + CHUNK)
        m_dot, m_rx, m_rk, _, m_g = emu.model(x[sl], k[sl], v[sl], w, EPS, CLAMP)
        assert torch.equal(dot[sl], m_dot)
        assert torch.equal(rx[sl], m_rx)
        assert torch.equal(rk[sl], m_rk)
        _check_g(g[sl], m_g)
        assert torch.equal(out[sl], emu.out_model(x[sl], v[sl], g[sl]))


def _bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at ``|t|`` (float64; 2^-8 at 0)."""
    _, e = torch.frexp(t.double().abs())
    return torch.ldexp(torch.ones_like(t, dtype=torch.float64), e - 8)


def _check_against_reference(got, x, k, v, w_h, w_e):
    """§3.2 against ``engram_gate_ref`` (fp32, on the inputs' device): the statistics ``calc_diff < 2e-10``; the
    output ``calc_diff < 2e-10`` at upstream's token counts (``T >= CONTRACT_TOKENS``: below them a single bf16
    rounding flip of a small row set exceeds it), and at every T elementwise within one bf16 ulp of the reference
    (a rounding flip) plus what the two gate scores' difference moves ``g·v`` plus the fp32 error of ``x + g·v``."""
    ref = engram_gate_ref(x, k, v, w_h, w_e, CLAMP, EPS, save_for_backward=True)
    for name, a, b in zip(("output", "dot", "gate_score", "rstd_x", "rstd_k"), got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if name != "output":
            assert calc_diff(a, b) < FWD_DIFF, name
    if x.shape[0] >= CONTRACT_TOKENS:
        assert calc_diff(got[0], ref[0]) < FWD_DIFF
    for a in range(0, x.shape[0], CHUNK):
        sl = slice(a, a + CHUNK)
        out, r_out = got[0][sl].double(), ref[0][sl].double()
        g, r_g = got[2][sl].double().unsqueeze(-1), ref[2][sl].double().unsqueeze(-1)
        xd, vd = x[sl].double(), v[sl].double().unsqueeze(-2)
        bound = _bf16_ulp(r_out) + (g - r_g).abs() * vd.abs() + 2.0 ** -23 * (xd.abs() + (g * vd).abs())
        bad = (out - r_out).abs() > bound
        assert not bad.any(), f"{int(bad.sum())} outputs beyond the bound"


# ---- compile tier ----

def _hex(value: float) -> str:
    """An fp32 constant as TileLang prints it in CUDA source (a hexadecimal float literal)."""
    mant, exp = float.hex(value).split("p")
    return f"{mant.rstrip('0').rstrip('.')}p{exp}f"


@pytest.mark.compile
@pytest.mark.parametrize("cfg", sorted(set(gate_fwd_configs()) | set(K._gate_configs())), ids=str)
def test_gate_builds_for_sm90_with_the_explicit_arithmetic(cfg):
    """The default dispatch's kernel at every config the tests use: the token schedule (x staged in shared memory,
    a warp a branch) where ``token_schedule`` takes the shape, else the row schedule (the weight row staged)."""
    m, h, save = cfg
    src = _jit.compile_kernel("engram_gate_fwd", cfg, "sm_90").get_kernel_source()
    body = src[src.index("__launch_bounds__"):]
    # three partial chains (Sxx, Skk, D) and the output: every fp32 operation an explicit intrinsic
    assert body.count("__fmaf_rn(") == 4 and body.count("__fmul_rn(") == 4
    assert body.count("__shfl_xor_sync(") == 5 and "atomic" not in body
    assert _hex(K._c_h(h)) in body and "copysignf(__fsqrt_rn(" in body and "expf(__fsub_rn(" in body
    for buf in ("X", "K", "Vv", "OUT"):  # 16-byte accesses of every row operand
        assert f"*(uint4*)({buf} + " in body, buf
    if K.token_schedule(m, h):
        assert f"__launch_bounds__({m * 32}, " in src and "__shared__ __align__(1024) bfloat16_t xs[]" in body
        assert "float ws[]" not in body
    else:
        assert f"__launch_bounds__({K.WARPS * 32}, " in src and "__shared__ __align__(1024) float ws[]" in body
        assert "xs[]" not in body
    stores = [s in body for s in ("DOT[", "G[", "RX[", "RK[")]
    assert stores == [save] * 4  # no statistics written without save


@pytest.mark.compile
def test_fused_weight_builds_for_sm90():
    src = _jit.compile_kernel("engram_fused_weight", (), "sm_90").get_kernel_source()
    body = src[src.index("__launch_bounds__"):]
    assert body.count("__fmul_rn(") == 1 and "*(uint4*)(A + " in body and "*(float4*)(OUT + " in body


def test_registered_configs_are_the_bench_shapes():
    assert K._gate_configs() == [(4, 4096, True), (4, 4096, False), (4, 7168, True), (4, 7168, False)]
    assert _jit.registered()["engram_fused_weight"] == [()]
    # the default launches the token schedule without the v stage at H = 4096 and the row schedule at 7168 (the
    # winners on the H200)
    assert K.TOKEN_CTA and not K.TOKEN_STAGE_V and K.TOKEN_ROWS == 1
    assert [K.token_schedule(m, h) for m, h, _ in K._gate_configs()] == [True, True, False, False]


def test_the_dispatch_keeps_the_row_schedule_where_the_token_schedule_does_not_fit():
    """``token_schedule`` takes a shape only with at most ``TOKEN_MAX_M`` branches and an x stage within
    ``TOKEN_SMEM_MAX`` (within the 227 KiB an sm_90 CTA may have); elsewhere the launch is the row schedule's."""
    assert K.TOKEN_SMEM_MAX <= 227 * 1024
    for m, h in [(m, h) for m in GRID_M for h in GRID_H if (m, h) not in ROW_SHAPES] + list(ODD):
        assert K.token_schedule(m, h)
        assert K.gate_fwd_grid(8192, m, h) == (8192, m * 32, m * h * 2)
    for m, h in ROW_SHAPES:
        assert not K.token_schedule(m, h)
        assert K.gate_fwd_grid(8192, m, h) == (8192 // (K.WARPS * K.ROWS_PER_WARP) * m, K.WARPS * 32, h * 4)
    assert not K.token_schedule(K.TOKEN_MAX_M + 1, 512)
    h_max = K.TOKEN_SMEM_MAX // (2 * K.TOKEN_MAX_M) // K.CHUNK * K.CHUNK  # the largest H whose stage fits at M = 8
    assert K.token_schedule(K.TOKEN_MAX_M, h_max) and not K.token_schedule(K.TOKEN_MAX_M, h_max + K.CHUNK)


@pytest.mark.compile
@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("t, m, h", [(5, 4, 512), (1, 2, 768), (3, 1, 1024)], ids=str)
def test_launchers_bind_their_arguments(t, m, h, save, monkeypatch):
    """The launcher hands the kernel the fused projection's k and v in place (their strides in 16-byte vectors),
    and the factory's shapes; ``T = 0`` launches nothing."""
    calls = fake_jit(monkeypatch)
    x, k, v, _, _, w = _inputs(t, m, h)
    got = K.gate_fwd_launch(x, k, v, w, EPS, CLAMP, save)
    assert got[0].shape == x.shape and got[0].dtype == BF16
    assert all((s is None) != save for s in got[1:])
    (call,) = calls
    assert call.name == "engram_gate_fwd" and call.cfg == (m, h, save) and call.env["num_tokens"] == t
    row = (m + 1) * h // 8
    assert call.env["k_vectors"] == (t - 1) * row + (m - 1) * h // 8 + h // 8
    assert call.env["v_vectors"] == (t - 1) * row + h // 8
    calls.clear()
    empty = K.gate_fwd_launch(x[:0], k[:0], v[:0], w, EPS, CLAMP, save)
    assert calls == [] and empty[0].shape == (0, m, h)
    assert all(s is None for s in empty[1:]) if not save else all(s.shape == (0, m) for s in empty[1:])
    assert K.fused_weight_launch(w.to(BF16), w.to(BF16)).shape == (m, h)
    assert calls[-1].name == "engram_fused_weight" and calls[-1].env["num_vectors"] == m * h // 8


def test_vector_rows_keep_views_and_copy_what_the_vectors_cannot_read():
    t, m, h = 3, 2, 512
    kv = torch.randn(t, (m + 1) * h).to(BF16).view(t, m + 1, h)
    flat, strides = K._vector_rows(kv[:, :m])
    assert flat.data_ptr() == kv.data_ptr() and strides == [(m + 1) * h // 8, h // 8]
    assert flat.shape == ((t - 1) * (m + 1) * h // 8 + (m - 1) * h // 8 + h // 8, 8)
    padded = torch.randn(t, m, h + 4).to(BF16)[..., :h]  # row stride not a multiple of 8 elements
    flat, strides = K._vector_rows(padded)
    assert flat.data_ptr() != padded.data_ptr() and strides == [m * h // 8, h // 8]
    assert torch.equal(flat.view(t, m, h), padded)
    shifted = torch.randn(t * m * h + 1).to(BF16)[1:].view(t, m, h)  # base 2 bytes past a 16-byte boundary
    flat, _ = K._vector_rows(shifted)
    assert flat.data_ptr() % 16 == 0 and torch.equal(flat.view(t, m, h), shifted)
    single = torch.randn(1, 1, h).to(BF16).as_strided((1, 1, h), (5, 3, 1))  # size-1 strides are never used
    flat, strides = K._vector_rows(single)
    assert flat.data_ptr() == single.data_ptr() and strides == [0, 0]


def _run_emulated(tmp_path, m, h, x, k, v, w, save, name="gate"):
    src = _jit.compile_kernel("engram_gate_fwd", (m, h, save), "sm_90", export=False).get_kernel_source()
    t = x.shape[0]
    blocks, threads, smem = K.gate_fwd_grid(t, m, h)
    run = emu.build(src, "engram_gate_fwd_kernel", threads, tmp_path / name)
    out = torch.full((t, m, h), float("nan"), dtype=BF16)
    stats = [torch.full((t, m), float("nan")) for _ in range(4)] if save else []
    k_flat, (k_s0, k_s1) = K._vector_rows(k)
    v_flat, (v_s0,) = K._vector_rows(v)
    args = dict(X=x, K=k_flat, Vv=v_flat, W=w, OUT=out, k_s0=k_s0, k_s1=k_s1, v_s0=v_s0, eps=EPS, clamp=CLAMP,
                num_tokens=t, k_vectors=k_flat.shape[0], v_vectors=v_flat.shape[0])
    if save:
        args.update(DOT=stats[0], G=stats[1], RX=stats[2], RK=stats[3])
    run(args, blocks, -(-smem // 4))
    return (out, *stats)


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("t, m, h", [(37, 2, 768), (5, 3, 512), (17, 1, 1024), (3, 4, 4096), (19, 9, 512)], ids=str)
def test_generated_source_on_the_cpu(t, m, h, tmp_path):
    """The default dispatch's CUDA source run on the CPU (``gate_fwd_emulation``; the token schedule, and at M = 9
    the row schedule): every output written (NaN before), the statistics and output as the model says, the
    reference's contract, and the same output without save. k and v are views into one fused projection; T not a
    multiple of the row schedule's token block leaves the last CTA's warps partly idle."""
    assert K.token_schedule(m, h) == (m <= K.TOKEN_MAX_M)
    x, k, v, w_h, w_e, w = _inputs(t, m, h)
    got = _run_emulated(tmp_path, m, h, x, k, v, w, True)
    assert not any(torch.isnan(a.float()).any() for a in got)
    _check_against_model(got, x, k, v, w)
    _check_against_reference(got, x, k, v, w_h, w_e)
    (plain,) = _run_emulated(tmp_path, m, h, x, k, v, w, False, "plain")
    assert torch.equal(plain, got[0])


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
def test_sign_convention_on_the_cpu(tmp_path):
    """§2.4.2: u takes the sign bit of s. An all-zero x row (s = +0) gives g = σ(+√clamp) > 1/2 and rstd_x =
    1/√eps, where ``engram_gate_ref`` gives exactly 1/2 (§7.1: the spec follows the kernel); a row whose s
    underflows to -0 gives σ(-√clamp) < 1/2. The ops' CPU path follows the kernel too."""
    t, m, h = 3, 2, 512
    x, k, v, w_h, w_e, w = _inputs(t, m, h)
    x[0, 0] = 0
    x[1, 1] = 1
    k[1, 1] = 1
    w[1] = 0
    w[1, 0] = -(2.0 ** -149)  # token 1, branch 1: D = -2^-149, rx = rk = 1, so s = D * c_H rounds to -0
    out, dot, g, rx, rk = _run_emulated(tmp_path, m, h, x, k, v, w, True)
    _, m_rx, _, m_u, m_g = emu.model(x, k, v, w, EPS, CLAMP)
    assert dot[0, 0] == 0 and rx[0, 0] == m_rx[0, 0] and m_u[0, 0] == torch.tensor(CLAMP, dtype=F32).sqrt()
    assert dot[1, 1] == -(2.0 ** -149) and rx[1, 1] == 1 and rk[1, 1] == 1 and m_u[1, 1] < 0
    _check_g(g, m_g)
    assert g[0, 0] > 0.5 and g[1, 1] < 0.5 and abs(float(g[0, 0]) + float(g[1, 1]) - 1) < 1e-7
    cpu = E.engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    assert cpu[2][0, 0] > 0.5 and cpu[2][1, 1] < 0.5
    ref_g = engram_gate_ref(x, k, v, w_h, w_e, CLAMP, EPS, save_for_backward=True)[2]
    assert ref_g[0, 0] == 0.5  # the oracle's sign(s) = 0: the documented difference


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
def test_tuning_knobs_change_no_result(tmp_path, monkeypatch):
    """The row schedule's LOADS_AHEAD, WARPS and ROWS_PER_WARP only schedule: the same bits for every value (C = 5
    chunks, so load groups of 2 and 3 end partly guarded; T = 23 leaves CTAs partly idle)."""
    t, m, h = 23, 2, 1280
    x, k, v, _, _, w = _inputs(t, m, h)
    for name, value in ROW_KNOBS.items():
        monkeypatch.setattr(K, name, value)
    assert not K.token_schedule(m, h)
    results = []
    for ahead, warps, rows in ((4, 4, 2), (1, 4, 4), (2, 2, 3), (3, 8, 1)):
        monkeypatch.setattr(K, "LOADS_AHEAD", ahead)
        monkeypatch.setattr(K, "WARPS", warps)
        monkeypatch.setattr(K, "ROWS_PER_WARP", rows)
        results.append(_run_emulated(tmp_path, m, h, x, k, v, w, True, f"k{ahead}{warps}{rows}"))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.compile
@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("knobs, shape", token_variant_cases(), ids=str)
def test_token_variant_builds_for_sm90(knobs, shape, save, monkeypatch):
    """The TOKEN_CTA variant at every knob set and shape its GPU test launches: an sm_90 build with the same explicit
    arithmetic, x staged in shared memory, no statistics written without save."""
    for name, value in knobs.items():
        monkeypatch.setattr(K, name, value)
    _, m, h = shape
    src = _jit.compile_kernel("engram_gate_fwd", (m, h, save), "sm_90", export=False).get_kernel_source()
    body = src[src.index("__launch_bounds__"):]
    assert f"__launch_bounds__({m * 32}, " in src and "__shared__ __align__(1024) bfloat16_t xs[]" in body
    assert body.count("__fmaf_rn(") == 4 and body.count("__fmul_rn(") == 4
    assert body.count("__shfl_xor_sync(") == 5 and "atomic" not in body
    assert _hex(K._c_h(h)) in body and "copysignf(__fsqrt_rn(" in body and "expf(__fsub_rn(" in body
    for buf in ("X", "K", "Vv", "OUT"):
        assert f"*(uint4*)({buf} + " in body, buf
    assert [s in body for s in ("DOT[", "G[", "RX[", "RK[")] == [save] * 4


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("knobs", [{"TOKEN_CTA": True, "TOKEN_STAGE_V": False},
                                   {"TOKEN_CTA": True, "TOKEN_STAGE_V": True},
                                   {"TOKEN_CTA": True, "TOKEN_STAGE_V": True, "TOKEN_ROWS": 2, "LOADS_AHEAD": 2,
                                    "TOKEN_SMEM_MAX": 96 * 1024},
                                   {"TOKEN_CTA": True, "TOKEN_STAGE_V": True, "TOKEN_ROWS": 3, "LOADS_AHEAD": 8,
                                    "TOKEN_SMEM_MAX": 128 * 1024},
                                   {"TOKEN_CTA": True, "TOKEN_STAGE_V": False, "LOADS_AHEAD": 3}], ids=str)
@pytest.mark.parametrize("t, m, h", [(7, 3, 768), (5, 2, 1280), (3, 1, 512), (2, 4, 4096), (3, 8, 512)], ids=str)
def test_token_variant_source_on_the_cpu(t, m, h, knobs, tmp_path, monkeypatch):
    """The token schedule's CUDA source (the default's knobs first) run on the CPU gives the row schedule's bits
    (``ROW_KNOBS``: statistics and output, save on and off) and the model's: T not a multiple of TOKEN_ROWS leaves
    the last CTA's tokens partly idle, C = 5 chunks leaves the last load group partly guarded, more warps than chunks
    in a group leave some warps without a v chunk to stage, and every x vector (and v vector, with TOKEN_STAGE_V)
    makes its round trip through shared memory."""
    x, k, v, _, _, w = _inputs(t, m, h)
    for name, value in ROW_KNOBS.items():
        monkeypatch.setattr(K, name, value)
    assert not K.token_schedule(m, h)
    want = _run_emulated(tmp_path, m, h, x, k, v, w, True, "rows")
    for name, value in knobs.items():
        monkeypatch.setattr(K, name, value)
    assert K.token_schedule(m, h)
    got = _run_emulated(tmp_path, m, h, x, k, v, w, True, "token")
    assert not any(torch.isnan(a.float()).any() for a in got)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    _check_against_model(got, x, k, v, w)
    (plain,) = _run_emulated(tmp_path, m, h, x, k, v, w, False, "token_plain")
    assert torch.equal(plain, want[0])


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
def test_fused_weight_source_on_the_cpu(tmp_path):
    m, h = 3, 768
    w_h, w_e = torch.randn(m, h).to(BF16), torch.randn(m, h).to(BF16)
    src = _jit.compile_kernel("engram_fused_weight", (), "sm_90", export=False).get_kernel_source()
    run = emu.build(src, "engram_fused_weight_kernel", K.FW_THREADS, tmp_path)
    out = torch.full((m, h), float("nan"))
    n = m * h // 8
    run(dict(A=w_h, B=w_e, OUT=out, num_vectors=n), -(-n // K.FW_THREADS))
    assert torch.equal(out, w_h.float() * w_e.float())


def test_cpu_tensors_take_the_reference():
    x, k, v, _, _, w = _inputs(7, 2, 512)
    assert not K.takes(x)
    got = E.engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    for a, b in zip(got, _gate_fwd(x, k, v, w, EPS, CLAMP)):
        assert torch.equal(a, b)


# ---- gpu tier ----

@pytest.fixture
def poisoned(poison_outputs):
    """The launchers allocate their outputs filled with NaN."""
    poison_outputs(K)


@pytest.mark.gpu
@pytest.mark.parametrize("h", GRID_H)
@pytest.mark.parametrize("m", GRID_M)
@pytest.mark.parametrize("t", TOKENS)
def test_forward_grid(t, m, h, poisoned):
    x, k, v, w_h, w_e, w = _inputs(t, m, h, "cuda")
    # views into one packed projection (at T <= 1 a view of one token is contiguous by definition)
    assert K.takes(x) and k.stride(0) == v.stride(0) == (m + 1) * h
    got = E.engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    assert [a.shape for a in got] == [x.shape] + [(t, m)] * 4
    _check_against_model(got, x, k, v, w)
    _check_against_reference(got, x, k, v, w_h, w_e)
    plain = E.engram_gate_fwd(x, k, v, w, EPS, CLAMP, save_for_backward=False)
    assert plain[1:] == (None,) * 4 and torch.equal(plain[0], got[0])


@pytest.mark.gpu
@pytest.mark.parametrize("m, h", ODD + ROW_SHAPES, ids=str)
def test_odd_shapes(m, h, poisoned):
    """Odd branch and chunk counts and the largest H (the token schedule), and the shapes the dispatch keeps on the
    row schedule."""
    assert K.token_schedule(m, h) == ((m, h) not in ROW_SHAPES)
    x, k, v, w_h, w_e, w = _inputs(1000, m, h, "cuda")
    got = E.engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    _check_against_model(got, x, k, v, w)
    _check_against_reference(got, x, k, v, w_h, w_e)


@pytest.mark.gpu
def test_sign_convention(poisoned):
    """As ``test_sign_convention_on_the_cpu``, on the GPU: s = +0 gives σ(+√clamp), s = -0 gives σ(-√clamp)."""
    x, k, v, w_h, w_e, w = _inputs(3, 2, 512, "cuda")
    x[0, 0] = 0
    x[1, 1] = 1
    k[1, 1] = 1
    w[1] = 0
    w[1, 0] = -(2.0 ** -149)
    got = E.engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    _check_against_model(got, x, k, v, w)
    g = got[2]
    assert g[0, 0] > 0.5 and g[1, 1] < 0.5 and got[1][1, 1] == -(2.0 ** -149)
    assert engram_gate_ref(x, k, v, w_h, w_e, CLAMP, EPS, save_for_backward=True)[2][0, 0] == 0.5


@pytest.mark.gpu
def test_strided_misaligned_and_contiguous_inputs_agree(poisoned):
    t, m, h = 4001, 4, 4096
    x, k, v, _, _, w = _inputs(t, m, h, "cuda")
    want = E.engram_gate_fwd(x, k.contiguous(), v.contiguous(), w, EPS, CLAMP)
    padded_k = torch.empty(t, m, h + 4, dtype=BF16, device="cuda")[..., :h]
    padded_k.copy_(k)
    shifted_v = torch.empty(t * h + 1, dtype=BF16, device="cuda")[1:].view(t, h)
    shifted_v.copy_(v)
    shifted_x = torch.empty(x.numel() + 8 * 3 + 1, dtype=BF16, device="cuda")[1:1 + x.numel()].view(x.shape)
    shifted_x.copy_(x)
    shifted_w = torch.empty(w.numel() + 1, device="cuda")[1:].view(w.shape)
    shifted_w.copy_(w)
    for args in ((x, k, v, w), (x, padded_k, shifted_v, w), (shifted_x, k, v, shifted_w)):
        for a, b in zip(E.engram_gate_fwd(*args, EPS, CLAMP), want):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_deterministic(poisoned):
    x, k, v, _, _, w = _inputs(4001, 4, 7168, "cuda")
    first = E.engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    second = E.engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("m, h", [(4, 4096), (2, 512)], ids=str)
def test_batch_invariant(m, h, poisoned):
    x, k, v, _, _, w = _inputs(8192, m, h, "cuda")
    full = E.engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    for sl in (slice(1234, 1241), slice(8191, 8192), slice(0, 1), slice(17, 4018)):
        part = E.engram_gate_fwd(x[sl].clone(), k[sl], v[sl], w, EPS, CLAMP)  # k, v still views
        for a, b in zip(part, full):
            assert torch.equal(a, b[sl])


@pytest.mark.gpu
def test_cuda_graph_replay():
    t, m, h = 4001, 4, 4096
    static = list(_inputs(t, m, h, "cuda"))
    x, k, v, w = static[0], static[1], static[2], static[5]
    E.engram_gate_fwd(x, k, v, w, EPS, CLAMP)  # compile and load outside the capture
    E.engram_gate_fwd(x, k, v, w, EPS, CLAMP, save_for_backward=False)
    E.fused_weight(static[3], static[4])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w_g = E.fused_weight(static[3], static[4])
        saved = E.engram_gate_fwd(x, k, v, w_g, EPS, CLAMP)
        plain = E.engram_gate_fwd(x, k, v, w_g, EPS, CLAMP, save_for_backward=False)[0]
    fresh = _inputs(t, m, h, "cuda")
    x.copy_(fresh[0])
    k.copy_(fresh[1])  # writes the fused projection through the views
    v.copy_(fresh[2])
    static[3].copy_(fresh[3])
    static[4].copy_(fresh[4])
    for out in (w_g, plain, *saved):
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(w_g, fresh[5])
    want = E.engram_gate_fwd(fresh[0], fresh[1], fresh[2], fresh[5], EPS, CLAMP)
    for a, b in zip(saved, want):
        assert torch.equal(a, b)
    assert torch.equal(plain, want[0])


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    x, k, v, w_h, w_e, _ = _inputs(4001, 4, 7168, "cuda")

    def step(x, k, v, w_h, w_e):
        w = E.fused_weight(w_h, w_e)
        out, dot, g, rx, rk = E.engram_gate_fwd(x, k, v, w, EPS, CLAMP)
        plain = E.engram_gate_fwd(x, k, v, w, EPS, CLAMP, save_for_backward=False)
        assert plain[1] is None
        return w, out, dot, g, rx, rk, plain[0]

    compiled = torch.compile(step, fullgraph=True)
    got = compiled(x, k, v, w_h, w_e)
    want = step(x, k, v, w_h, w_e)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("h", (256,) + GRID_H)
@pytest.mark.parametrize("m", (1,) + GRID_M)
def test_fused_weight_exact(m, h, poisoned):
    w_h, w_e = torch.randn(m, h, device="cuda").to(BF16), torch.randn(m, h, device="cuda").to(BF16)
    got = E.fused_weight(w_h, w_e)
    assert got.dtype == F32 and got.is_contiguous() and torch.equal(got, w_h.float() * w_e.float())


@pytest.mark.gpu
@pytest.mark.parametrize("knobs, shape", token_variant_cases(), ids=str)
def test_token_variant_bit_identical_gpu(knobs, shape, poisoned, knob_kernels):
    """The token schedule at each knob set (the default's among them; k and v views into the packed projection)
    gives the row schedule's bits (``ROW_KNOBS``), save on and off, and a token slice gives the full run's rows
    (batch invariance)."""
    t, m, h = shape
    x, k, v, _, _, w = _inputs(t, m, h, "cuda")
    knob_kernels(K, ROW_KNOBS)
    assert not K.token_schedule(m, h)
    want = E.engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    knob_kernels(K, knobs)
    assert K.token_schedule(m, h)
    got = E.engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(E.engram_gate_fwd(x, k, v, w, EPS, CLAMP, save_for_backward=False)[0], want[0])
    sl = slice(t // 3, t - t // 5)
    for a, b in zip(E.engram_gate_fwd(x[sl].clone(), k[sl], v[sl], w, EPS, CLAMP), want):
        assert torch.equal(a, b[sl])


@pytest.mark.gpu
def test_larger_hidden_takes_the_reference():
    x, k, v, _, _, w = _inputs(7, 2, K.MAX_H + 256, "cuda")
    assert not K.takes(x)
    for a, b in zip(E.engram_gate_fwd(x, k, v, w, EPS, CLAMP), _gate_fwd(x, k, v, w, EPS, CLAMP)):
        assert torch.equal(a, b)
