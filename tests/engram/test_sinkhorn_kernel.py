"""Kernel tiers of the Engram Sinkhorn helpers (engram.md §2.9): ``engram_sinkhorn_momentum_update``,
``engram_sinkhorn_step``, ``engram_sinkhorn_step_reduce``, ``engram_sinkhorn_finalize``. Compile (sm_90 builds of
every config the tests use, only explicitly rounded fp32 operations, the generated CUDA run on the CPU, the launchers'
binding without a GPU) and gpu (grids against the CPU, poisoned outputs, determinism, batch invariance, CUDA graphs,
torch.compile). The step reduce's ``REDUCE_PIPE`` knob (``PIPE_KNOBS``): an sm_90 build, its CUDA on the CPU (named
barriers as host barriers), and on the GPU (``knob_kernels``) the default kernel's bits.

Tolerances (engram.md §3.3 / §3.4), written once here:
* bit for bit: the momentum update (the spec's fma formulation), the step reduce (sequential in ascending ``p``),
  and, *given the kernel's own row norms*, everything else the step and finalize compute: ``row_scale = r·ρ``,
  ``ρ = 1/(n + eps)``, the partial rows = the chunk sums of ``(y·ρ)²`` in the spec's chunking, and
  ``out = y·(alpha/(n + eps))`` (the finalize forms its norms as the step does: same code, same bits);
* the row norms themselves are a fixed blocked fp32 sum, not the reference's order: one ulp on every element gives a
  calc_diff of at most 2^-47 ≈ 7.1e-15, so ``ROW_DIFF = 1e-14`` for ``row_norm`` and ``row_scale`` (upstream
  measured 7e-16 and 1.5e-15) and ``FINAL_DIFF = 1e-14`` for finalize (upstream 1.7e-15);
* the reduced column statistics square ``ρ``, each a sum of many such terms: ``COL_DIFF = 1e-13`` (upstream measured
  4e-14 to 6e-14 against the reference).
"""
import re

import pytest
import torch

from tilefuse import _jit
from tilefuse import engram as E
from tilefuse.engram import _sinkhorn_kernel as S
from tilefuse.engram.ops import DEFAULT_NUM_SMS
from tilefuse.reference import engram as R
from tilefuse.reference import engram_sinkhorn_finalize_ref, engram_sinkhorn_step_ref
from tilefuse.testing import assert_equal, calc_diff
from tests.engram import kernel_emulation as emu
from tests.engram.configs_sinkhorn import GRID_D, MOMENTUM, WIDE_D, sinkhorn_configs
from tests.moe.poison import is_poison, poison_outputs
from tests.quant.kernel_binding import fake_jit

ROW_DIFF, FINAL_DIFF, COL_DIFF = 1e-14, 1e-14, 1e-13
ROWS = (0, 1, 7, 4001, 8192)
EPS, ALPHA = 1e-6, 0.7
DT = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _rows(r, d, device="cpu"):
    """``matrix (R, D)``, ``row_scale (R,)``, ``col_scale (D,)``: never all zero, scales in [0.5, 1.5)."""
    return (torch.randn(r, d, device=device), torch.rand(r, device=device) + 0.5,
            torch.rand(d, device=device) + 0.5)


def _exact_given_norm(matrix, row_scale, col_scale, norm, partials):
    """What the step must write bit for bit once its row norms are ``norm`` (CPU tensors): ``(row_scale, partial)``."""
    y = (row_scale.unsqueeze(1) * matrix) * col_scale.unsqueeze(0)
    rho = 1 / (norm + EPS)
    return row_scale * rho, R._chunk_sum((y * rho.unsqueeze(1)).square(), partials)


def _final_given_norm(matrix, row_scale, col_scale, norm):
    y = (row_scale.unsqueeze(1) * matrix) * col_scale.unsqueeze(0)
    return y * (torch.tensor(ALPHA, dtype=torch.float32) / (norm + EPS)).unsqueeze(1)


# ---- compile tier ----

def _all_configs():
    registered = [(name, cfg) for name in ("engram_sinkhorn_momentum", "engram_sinkhorn_step",
                                           "engram_sinkhorn_step_reduce", "engram_sinkhorn_finalize")
                  for cfg in _jit._FACTORIES[name][1]()]
    return sorted(set(sinkhorn_configs()) | set(registered), key=str)


def _explicit_only(src: str) -> None:
    """Every fp32 operation on a line with an intrinsic is an intrinsic: nothing nvcc could contract or reorder."""
    for line in (ln for ln in src.splitlines() if "__f" in ln and "=" in ln):
        rhs = re.sub(r"/\*.*?\*/", "", line.split("=", 1)[1])
        rhs = re.sub(r"0x[0-9a-f.]+p[+-]\d+f", "C", rhs)
        rhs = re.sub(r"\[[^\]]*\]", "", rhs)
        assert not re.search(r"[-+*/]", rhs), line


@pytest.mark.compile
@pytest.mark.parametrize("name, cfg", _all_configs(), ids=str)
def test_builds_for_sm90_with_the_explicit_operations(name, cfg):
    src = _jit.compile_kernel(name, cfg, "sm_90").get_kernel_source()
    assert "__global__" in src and "atomic" not in src
    _explicit_only(src)
    if name == "engram_sinkhorn_momentum":
        assert src.count("__fmaf_rn(") == (2 if cfg[2] else 1) and "__fadd_rn" not in src
    elif name == "engram_sinkhorn_step_reduce":
        assert src.count("__fadd_rn(") == 1
    else:  # the row kernels: the fixed-order sum of squares, IEEE sqrt, 16-byte row accesses
        assert "__fsqrt_rn(" in src and "sqrtf" not in src and src.count("__shfl_xor_sync(") == 5
        assert "*(float4*)(B +" in src and "*(float4*)(CS +" in src


@pytest.mark.compile
def test_registered_configs_are_the_bench_shapes():
    reg = {name: list(_jit._FACTORIES[name][1]()) for name in ("engram_sinkhorn_momentum", "engram_sinkhorn_step",
                                                               "engram_sinkhorn_step_reduce",
                                                               "engram_sinkhorn_finalize")}
    assert reg["engram_sinkhorn_step"] == reg["engram_sinkhorn_finalize"] == [(4096,), (7168,)]
    assert reg["engram_sinkhorn_step_reduce"] == [()]
    assert sorted(reg["engram_sinkhorn_momentum"]) == sorted(MOMENTUM) and len(MOMENTUM) == 8
    assert set(GRID_D) >= set(S.BENCH_D)


def _build(name, cfg, tmp_path, threaded=False):
    threads = {"engram_sinkhorn_momentum": S.MOMENTUM_THREADS, "engram_sinkhorn_step_reduce": S.REDUCE_THREADS}
    src = _jit.compile_kernel(name, cfg, "sm_90").get_kernel_source()
    return emu.build(src, f"{name}_kernel", threads.get(name) or S.row_threads(cfg[0]), tmp_path / name, threaded)


# The momentum knob's other value (the default before the H100 sweep): its kernels stay under test.
MOMENTUM_VEC_BASELINE = 8


def test_momentum_vec_default_is_not_the_baseline():
    assert S.VEC != MOMENTUM_VEC_BASELINE and 256 % S.VEC == 0 == 256 % MOMENTUM_VEC_BASELINE


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("vec", ("default", MOMENTUM_VEC_BASELINE))
@pytest.mark.parametrize("cfg", MOMENTUM, ids=str)
def test_momentum_source_on_the_cpu(cfg, vec, tmp_path, monkeypatch):
    """Bit for bit the spec's formulation (the CPU public op), the buffer rounded to its dtype; output poisoned. At
    the default VEC and at the knob's other value (8): the element count leaves a partial CTA at both."""
    if vec == "default":
        run = _build("engram_sinkhorn_momentum", cfg, tmp_path)
    else:  # not exported: the disk cache's key holds the knob values set at import
        monkeypatch.setattr(S, "VEC", vec)
        src = _jit.compile_kernel("engram_sinkhorn_momentum", cfg, "sm_90", export=False).get_kernel_source()
        run = emu.build(src, "engram_sinkhorn_momentum_kernel", S.MOMENTUM_THREADS, tmp_path / "momentum")
    n = 256 * 37
    assert (n // S.VEC) % S.MOMENTUM_THREADS
    grad, buf = torch.randn(n).to(DT[cfg[0]]), torch.randn(n).to(DT[cfg[1]])
    want_buf = buf.clone()
    want = E.engram_sinkhorn_momentum_update(grad, want_buf, 0.9, cfg[2])
    out = torch.full((n,), float("nan"))
    run(dict(G=grad, M=buf, OUT=out, beta=0.9, beta_c=1 - 0.9, vectors=n // S.VEC),
        (-(-n // S.VEC // S.MOMENTUM_THREADS),))
    assert_equal(out, want)
    assert_equal(buf, want_buf)


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("d", (256, 768, 2560))
def test_step_and_finalize_sources_on_the_cpu(d, tmp_path):
    """The step's CTAs as host threads (barriers, shuffles, shared memory): every output written (poisoned first);
    given its row norms, ``row_scale`` and the partial rows are the reference's chunk sums bit for bit, for chunk
    counts that divide R, do not, and exceed it (empty chunks: zero rows); a row's norm does not depend on the chunking
    (batch invariance); the norms within ROW_DIFF of the reference; finalize bit for bit given the step's norms."""
    step = _build("engram_sinkhorn_step", (d,), tmp_path, threaded=True)
    final = _build("engram_sinkhorn_finalize", (d,), tmp_path, threaded=True)
    matrix, row_scale, col_scale = _rows(40, d)
    norms = []
    for r, p in ((40, 8), (40, 9), (40, 64), (7, 3), (1, 5)):
        rs = row_scale[:r].clone()
        norm, part = torch.full((r,), float("nan")), torch.full((p, d), float("nan"))
        step(dict(B=matrix[:r].contiguous(), RS=rs, CS=col_scale, NORM=norm, PART=part, eps=EPS, rows=r, partials=p),
             (p,))
        want_rs, want_part = _exact_given_norm(matrix[:r], row_scale[:r], col_scale, norm, p)
        assert_equal(rs, want_rs)
        assert_equal(part, want_part)
        ref_norm, _ = R._sinkhorn_step(matrix[:r], row_scale[:r].clone(), col_scale, EPS, p)
        assert calc_diff(norm, ref_norm) < ROW_DIFF
        norms.append(norm)
    for norm in norms[1:]:
        assert_equal(norm, norms[0][:norm.shape[0]])
    out = torch.full((40, d), float("nan"))
    final(dict(B=matrix, RS=row_scale, CS=col_scale, OUT=out, eps=EPS, alpha=ALPHA, rows=40), (40,))
    assert_equal(out, _final_given_norm(matrix, row_scale, col_scale, norms[0]))


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
def test_step_reduce_source_on_the_cpu(tmp_path):
    """Bit for bit the sequential sum, for row counts inside one staged block, filling it, and past it (1100 rows:
    three blocks, the last partial)."""
    run = _build("engram_sinkhorn_step_reduce", (), tmp_path, threaded=True)
    for p, d in ((396, 512), (5, 256), (S.REDUCE_BLOCK, 256), (1100, 256), (1, 256)):
        part, out = torch.randn(p, d), torch.full((d,), float("nan"))
        run(dict(PART=part, OUT=out, partials=p, cols=d), (d // 32,))
        assert_equal(out, R._sequential_sum(part))


# REDUCE_PIPE (off by default): the knob sets the tests build, each against the default kernel's bits
PIPE_KNOBS = ({"REDUCE_PIPE": True}, {"REDUCE_PIPE": True, "REDUCE_GROUPS": 4})

# Named barriers on the CPU: ``bar.arrive`` arrives at the id's barrier of the CTA's threads without waiting,
# ``bar.sync`` arrives and waits, as the hardware's (a warp's 32 arrivals are its 32 host threads'). A count other
# than the CTA's threads or an id outside 1 .. 15 aborts.
NAMED_BARRIERS = r"""
namespace tl {
static std::barrier<>* g_named[16];
static inline void check_named(int id, int count) { if (id < 1 || id > 15 || count != THREADS) std::abort(); }
static inline void __sync_thread_partial(int id, int count) { check_named(id, count); g_named[id]->arrive_and_wait(); }
static inline void __named_barrier_arrive(int id, int count) { check_named(id, count); (void)g_named[id]->arrive(); }
static const bool g_named_made = [] {
  for (int i = 1; i < 16; ++i) g_named[i] = new std::barrier<>(THREADS);
  return true;
}();
}
"""


def _reduce_pipe_source(knobs, monkeypatch):
    """The step reduce's CUDA at ``knobs`` (not exported: the disk cache's key holds the knob values set at import)."""
    for name, value in knobs.items():
        monkeypatch.setattr(S, name, value)
    return _jit.compile_kernel("engram_sinkhorn_step_reduce", (), "sm_90", export=False).get_kernel_source()


@pytest.mark.compile
@pytest.mark.parametrize("knobs", PIPE_KNOBS, ids=str)
def test_reduce_pipe_builds_for_sm90(knobs, monkeypatch):
    """REDUCE_PIPE builds for sm_90: one explicit add, per group a ``bar.arrive`` for the loading warps and a
    ``bar.sync`` for warp 0 over the CTA's threads at ids 1 .. REDUCE_GROUPS, one ``__syncthreads`` (the block's end);
    the default kernel has no named barrier."""
    default = _jit.compile_kernel("engram_sinkhorn_step_reduce", (), "sm_90", export=False).get_kernel_source()
    assert "tl::__named_barrier_arrive(" not in default and "tl::__sync_thread_partial(" not in default
    src = _reduce_pipe_source(knobs, monkeypatch)
    assert "__global__" in src and "atomic" not in src
    _explicit_only(src)
    assert src.count("__fadd_rn(") == 1 and src.count("__syncthreads()") == 1
    groups = re.search(r"for \(int g = 0; g < (\d+); \+\+g\)", src)
    assert groups and int(groups.group(1)) == S.REDUCE_GROUPS
    assert src.count(f"tl::__named_barrier_arrive((g + 1), {S.REDUCE_THREADS});") == 1
    assert src.count(f"tl::__sync_thread_partial((g + 1), {S.REDUCE_THREADS});") == 1


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("knobs", PIPE_KNOBS, ids=str)
def test_reduce_pipe_source_on_the_cpu(knobs, tmp_path, monkeypatch):
    """REDUCE_PIPE's CUDA on the CPU (the CTA's threads as host threads, named barriers as above): bit for bit the
    sequential sum for P inside the first group, one group and one row past it, the bench's 396, one block, one row
    past it (a second block of one row) and 1100 (three blocks, the last partial), columns of one and several CTAs.
    The host threads' timing is not the GPU's: an add that read a group before its barrier would pass here only by
    chance, so the GPU knob test is the check of the barriers' placement."""
    src = _reduce_pipe_source(knobs, monkeypatch)
    monkeypatch.setattr(emu, "SHIM", emu.SHIM + NAMED_BARRIERS.replace("THREADS", str(S.REDUCE_THREADS)))
    run = emu.build(src, "engram_sinkhorn_step_reduce_kernel", S.REDUCE_THREADS, tmp_path / "pipe", threaded=True)
    gr = S.REDUCE_BLOCK // S.REDUCE_GROUPS
    for p, d in ((1, 32), (7, 256), (gr, 256), (gr + 1, 256), (396, 512), (S.REDUCE_BLOCK, 256),
                 (S.REDUCE_BLOCK + 1, 256), (1100, 256)):
        part, out = torch.randn(p, d), torch.full((d,), float("nan"))
        run(dict(PART=part, OUT=out, partials=p, cols=d), (d // 32,))
        assert_equal(out, R._sequential_sum(part))


@pytest.mark.compile
def test_launchers_bind_their_arguments(monkeypatch):
    calls = fake_jit(monkeypatch)
    grad, buf = torch.randn(4, 256).bfloat16(), torch.randn(1024)
    S.momentum_launch(grad, buf, torch.empty(1024), 0.9, True)
    matrix, row_scale, col_scale = _rows(9, 768)
    S.step_launch(matrix, row_scale, col_scale, torch.empty(9), torch.empty(12, 768), EPS)
    S.step_reduce_launch(torch.empty(12, 768), torch.empty(768))
    S.finalize_launch(matrix, row_scale, col_scale, torch.empty(9, 768), EPS, ALPHA)
    assert [(c.name, c.cfg) for c in calls] == [
        ("engram_sinkhorn_momentum", ("bf16", "fp32", True)), ("engram_sinkhorn_step", (768,)),
        ("engram_sinkhorn_step_reduce", ()), ("engram_sinkhorn_finalize", (768,))]
    assert calls[0].env["vectors"] == 1024 // S.VEC
    assert (calls[1].env["rows"], calls[1].env["partials"]) == (9, 12)
    assert (calls[2].env["partials"], calls[2].env["cols"]) == (12, 768)


def test_empty_launches_nothing(monkeypatch):
    """No elements / rows: no launch; a step over no rows has all-zero partials, a reduce over none zeros."""
    calls = fake_jit(monkeypatch)
    S.momentum_launch(torch.empty(0), torch.empty(0), torch.empty(0), 0.9, True)
    matrix, row_scale, col_scale = _rows(0, 256)
    part = torch.full((6, 256), float("nan"))
    S.step_launch(matrix, row_scale, col_scale, torch.empty(0), part, EPS)
    assert bool((part == 0).all())
    out = torch.full((256,), float("nan"))
    S.step_reduce_launch(torch.empty(0, 256), out)
    assert bool((out == 0).all())
    S.finalize_launch(matrix, row_scale, col_scale, torch.empty(0, 256), EPS, ALPHA)
    assert calls == []


def test_row_kernels_take_cuda_up_to_max_d():
    assert not S.takes_rows(torch.empty(3, 256))
    assert not S.takes_rows(torch.empty(3, 256, device="meta"))
    assert [S.row_threads(d) for d in (256, 512, 768, 1024, 2560, 7168)] == [64, 128, 64, 256, 128, 256]


# ---- gpu tier ----

@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256,), (7, 512), (1001, 256), (2048, 1024)], ids=str)
@pytest.mark.parametrize("cfg", MOMENTUM, ids=str)
def test_momentum_bitwise(cfg, shape, monkeypatch):
    poison_outputs(monkeypatch, S)
    g_dt, m_dt, nesterov = cfg
    grad, buf = torch.randn(shape).to(DT[g_dt]), torch.randn(shape).to(DT[m_dt])
    for beta in (0.9, 0.999):
        buf_d = buf.cuda()
        got = E.engram_sinkhorn_momentum_update(grad.flatten().cuda(), buf_d, beta, nesterov)
        want = E.engram_sinkhorn_momentum_update(grad.flatten(), buf, beta, nesterov)  # CPU: updates buf
        assert_equal(got.cpu(), want)
        assert_equal(buf_d.cpu(), buf)


@pytest.mark.gpu
def test_momentum_unaligned_views():
    """Views that start off a 16-byte boundary go through aligned copies: same bits, the buffer updated in place."""
    n = 256 * 9
    g_big, m_big = torch.randn(n + 1), torch.randn(n + 3).bfloat16()
    grad, buf = g_big[1:], m_big[3:]
    grad_d, m_big_d = g_big.cuda()[1:], m_big.cuda()
    buf_d = m_big_d[3:]
    got = E.engram_sinkhorn_momentum_update(grad_d, buf_d, 0.9)
    assert_equal(got.cpu(), E.engram_sinkhorn_momentum_update(grad, buf, 0.9))
    assert_equal(m_big_d.cpu(), m_big)


def _step_case(r, d, num_sms=None):
    """Run step + reduce + finalize on CUDA and check them against the CPU (see the module docstring)."""
    p = 3 * (num_sms or DEFAULT_NUM_SMS)
    matrix, row_scale, col_scale = _rows(r, d)
    rs_d = row_scale.cuda()
    norm_d, part_d = E.engram_sinkhorn_step(matrix.cuda(), rs_d, col_scale.cuda(), EPS, num_sms=num_sms)
    norm, part, rs = norm_d.cpu(), part_d.cpu(), rs_d.cpu()
    assert part.shape == (p, d) and norm.shape == (r,)
    want_rs, want_part = _exact_given_norm(matrix, row_scale, col_scale, norm, p)
    assert_equal(rs, want_rs)
    assert_equal(part, want_part)
    ref_rs = row_scale.clone()
    ref_sumsq = torch.empty(d)
    ref_norm = engram_sinkhorn_step_ref(matrix, ref_rs, col_scale, ref_sumsq, EPS)
    assert calc_diff(norm, ref_norm) < ROW_DIFF and calc_diff(rs, ref_rs) < ROW_DIFF
    sumsq_d = torch.full((d,), float("nan"), device="cuda")
    E.engram_sinkhorn_step_reduce(part_d, sumsq_d)
    assert_equal(sumsq_d.cpu(), R._sequential_sum(part))
    if p <= 3 * DEFAULT_NUM_SMS:  # COL_DIFF is for the spec's count: the sequential sum's error grows with p
        assert calc_diff(sumsq_d.cpu(), ref_sumsq) < COL_DIFF
    out_d = E.engram_sinkhorn_finalize(matrix.cuda(), row_scale.cuda(), col_scale.cuda(), EPS, ALPHA)
    assert_equal(out_d.cpu(), _final_given_norm(matrix, row_scale, col_scale, norm))
    assert calc_diff(out_d.cpu(), engram_sinkhorn_finalize_ref(matrix, row_scale, col_scale, EPS, ALPHA)) < FINAL_DIFF


@pytest.mark.gpu
@pytest.mark.parametrize("r", ROWS)
@pytest.mark.parametrize("d", GRID_D)
def test_step_reduce_finalize_grid(d, r, monkeypatch):
    poison_outputs(monkeypatch, S)
    _step_case(r, d)


@pytest.mark.gpu
@pytest.mark.parametrize("num_sms", [1, 7, 50, 3000])
def test_step_partial_counts(num_sms, monkeypatch):
    """The partial count is the one passed (3 num_sms), whatever the device: 4097 rows in chunks of 1366, 196, 28
    rows, and more chunks than rows (empty chunks give zero rows)."""
    poison_outputs(monkeypatch, S)
    _step_case(4097, 768, num_sms)


@pytest.mark.gpu
def test_widest_rows_and_the_reference_beyond(monkeypatch):
    """D = MAX_D runs the kernels (their widest rows); wider rows and D = 0 keep the reference."""
    poison_outputs(monkeypatch, S)
    assert WIDE_D == S.MAX_D
    _step_case(33, WIDE_D)
    for d in (WIDE_D + 256, 0):
        matrix, row_scale, col_scale = _rows(5, d)
        assert not S.takes_rows(matrix.cuda())
        rs_d = row_scale.cuda()
        norm_d, part_d = E.engram_sinkhorn_step(matrix.cuda(), rs_d, col_scale.cuda(), EPS)
        ref_norm, ref_part = R._sinkhorn_step(matrix, row_scale, col_scale, EPS, 3 * DEFAULT_NUM_SMS)
        assert calc_diff(norm_d.cpu(), ref_norm) < ROW_DIFF and calc_diff(rs_d.cpu(), row_scale) < ROW_DIFF
        assert calc_diff(part_d.cpu(), ref_part) < COL_DIFF
        out = E.engram_sinkhorn_finalize(matrix.cuda(), rs_d, col_scale.cuda(), EPS, ALPHA)
        assert calc_diff(out.cpu(), engram_sinkhorn_finalize_ref(matrix, row_scale, col_scale, EPS, ALPHA)) < FINAL_DIFF


@pytest.mark.gpu
def test_step_reduce_counts_bitwise():
    for p, d in ((1, 256), (5, 7168), (396, 4096), (600, 768)):
        part = torch.randn(p, d)
        out = torch.full((d,), float("nan"), device="cuda")
        E.engram_sinkhorn_step_reduce(part.cuda(), out)
        assert_equal(out.cpu(), R._sequential_sum(part))


@pytest.mark.gpu
@pytest.mark.knobs
@pytest.mark.parametrize("knobs", PIPE_KNOBS, ids=str)
def test_reduce_pipe_gives_the_defaults_bits(knobs, knob_kernels):
    """REDUCE_PIPE's sums (outputs poisoned with NaN first) are the default kernel's bits and the sequential sum's,
    at P inside a group, the bench's 396 and past one block (1100: three blocks), D = 256 (8 CTAs) and the bench's
    widths."""
    cases = []
    for p in (1, 7, 396, 1100):
        for d in (256, 4096, 7168):
            part = torch.randn(p, d, device="cuda")
            want = torch.full((d,), float("nan"), device="cuda")
            E.engram_sinkhorn_step_reduce(part, want)  # the shipped path: the package's kernel
            cases.append((part, want))
    knob_kernels(S, knobs)
    for part, want in cases:
        got = torch.full_like(want, float("nan"))
        E.engram_sinkhorn_step_reduce(part, got)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), part.shape
        assert_equal(got.cpu(), R._sequential_sum(part.cpu()))


@pytest.mark.gpu
def test_finalize_into_out():
    """A given ``out`` is written and returned (the same object), also when it starts off a 16-byte boundary."""
    matrix, row_scale, col_scale = _rows(33, 2560, device="cuda")
    want = E.engram_sinkhorn_finalize(matrix, row_scale, col_scale, EPS, ALPHA)
    out = torch.full((33, 2560), float("nan"), device="cuda")
    assert E.engram_sinkhorn_finalize(matrix, row_scale, col_scale, EPS, ALPHA, out=out) is out
    assert_equal(out, want)
    big = torch.full((33 * 2560 + 1,), float("nan"), device="cuda")
    odd = big[1:].view(33, 2560)
    assert E.engram_sinkhorn_finalize(matrix, row_scale, col_scale, EPS, ALPHA, out=odd) is odd
    assert_equal(odd, want)


@pytest.mark.gpu
def test_deterministic_and_batch_invariant():
    """Two runs give the same bits; a row's norm, new scale and finalized row do not depend on the other rows."""
    matrix, row_scale, col_scale = _rows(8192, 7168, device="cuda")
    runs = []
    for _ in range(2):
        rs = row_scale.clone()
        norm, part = E.engram_sinkhorn_step(matrix, rs, col_scale, EPS)
        sumsq = torch.empty(7168, device="cuda")
        E.engram_sinkhorn_step_reduce(part, sumsq)
        runs.append((norm, rs, part, sumsq, E.engram_sinkhorn_finalize(matrix, row_scale, col_scale, EPS, ALPHA)))
    for a, b in zip(*runs):
        assert_equal(a, b)
    norm, rs, _, _, out = runs[0]
    for sl in (slice(0, 1), slice(5, 4006), slice(8191, 8192)):
        rs_part = row_scale[sl].clone()
        n_part, _ = E.engram_sinkhorn_step(matrix[sl].contiguous(), rs_part, col_scale, EPS)
        assert_equal(n_part, norm[sl].contiguous())
        assert_equal(rs_part, rs[sl].contiguous())
        out_part = E.engram_sinkhorn_finalize(matrix[sl].contiguous(), row_scale[sl].contiguous(), col_scale, EPS,
                                              ALPHA)
        assert_equal(out_part, out[sl].contiguous())


def _pipeline(grad, buf, matrix, row_scale, col_scale, sumsq, out):
    """One of each op, as a training step would call them."""
    m = E.engram_sinkhorn_momentum_update(grad, buf, 0.9)
    norm, part = E.engram_sinkhorn_step(matrix, row_scale, col_scale, EPS)
    E.engram_sinkhorn_step_reduce(part, sumsq)
    E.engram_sinkhorn_finalize(matrix, row_scale, col_scale, EPS, ALPHA, out=out)
    return m, norm


def _pipeline_inputs(device):
    return (torch.randn(4001, 256, device=device), torch.randn(4001, 256, device=device).bfloat16(),
            *_rows(4001, 4096, device=device))


def _pipeline_check(cpu_inputs, got):
    """``got``: the CUDA results (on the CPU) of ``_pipeline`` on ``cpu_inputs``, and ``norm2``, the step kernel's
    norms at the updated row scales (those finalize forms: the same code, the same bits)."""
    grad, buf, matrix, row_scale, col_scale = (t.clone() for t in cpu_inputs)
    assert_equal(got["m"], E.engram_sinkhorn_momentum_update(grad, buf, 0.9))
    assert_equal(got["buf"], buf)
    p = 3 * DEFAULT_NUM_SMS
    want_rs, want_part = _exact_given_norm(matrix, row_scale, col_scale, got["norm"], p)
    assert calc_diff(got["norm"], R._sinkhorn_step(matrix, row_scale.clone(), col_scale, EPS, p)[0]) < ROW_DIFF
    assert_equal(got["row_scale"], want_rs)
    assert_equal(got["sumsq"], R._sequential_sum(want_part))
    assert_equal(got["out"], _final_given_norm(matrix, want_rs, col_scale, got["norm2"]))


@pytest.mark.gpu
def test_cuda_graph_replay():
    dev = list(_pipeline_inputs("cuda"))
    sumsq, out = torch.empty(4096, device="cuda"), torch.empty(4001, 4096, device="cuda")
    _pipeline(*[t.clone() for t in dev], sumsq, out)  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m, norm = _pipeline(*dev, sumsq, out)
    cpu = _pipeline_inputs("cpu")
    for a, b in zip(dev, cpu):
        a.copy_(b)
    for t in (sumsq, out, m, norm):
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    rs_after = dev[3].cpu()
    norm2, _ = E.engram_sinkhorn_step(dev[2], dev[3].clone(), dev[4], EPS)  # finalize's norms: the new scales'
    _pipeline_check(cpu, dict(m=m.cpu(), buf=dev[1].cpu(), norm=norm.cpu(), row_scale=rs_after, sumsq=sumsq.cpu(),
                              out=out.cpu(), norm2=norm2.cpu()))


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    cpu = _pipeline_inputs("cpu")
    dev = [t.cuda() for t in cpu]
    sumsq, out = torch.empty(4096, device="cuda"), torch.empty(4001, 4096, device="cuda")
    compiled = torch.compile(_pipeline, fullgraph=True)
    m, norm = compiled(*dev, sumsq, out)
    norm2, _ = E.engram_sinkhorn_step(dev[2], dev[3].clone(), dev[4], EPS)
    _pipeline_check(cpu, dict(m=m.cpu(), buf=dev[1].cpu(), norm=norm.cpu(), row_scale=dev[3].cpu(),
                              sumsq=sumsq.cpu(), out=out.cpu(), norm2=norm2.cpu()))


@pytest.mark.gpu
def test_outputs_fully_written(monkeypatch):
    """With every allocation poisoned, no poison survives in the outputs (row norms, partials, momentum output)."""
    poison_outputs(monkeypatch, S)
    matrix, row_scale, col_scale = _rows(4001, 768, device="cuda")
    norm, part = E.engram_sinkhorn_step(matrix, row_scale, col_scale, EPS, num_sms=2000)  # empty chunks too
    assert not is_poison(norm).any() and not is_poison(part).any()
    assert bool((part[4001:] == 0).all())
    out = E.engram_sinkhorn_finalize(matrix, row_scale, col_scale, EPS, ALPHA)
    m = E.engram_sinkhorn_momentum_update(torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda"), 0.9)
    assert not is_poison(out).any() and not is_poison(m).any()
