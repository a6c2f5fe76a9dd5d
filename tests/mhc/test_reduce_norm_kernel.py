"""Kernel tiers of ``mhc_reduce_partials_and_rmsnorm_fwd`` / ``_bwd`` (mhc.md §2.2.2 steps 4-6, §2.2.3 first three
bullets, §5.2): compile (sm_90 builds of every config the tests use, the explicit operations in the source, the
generated CUDA run on the CPU, the launchers' binding without a GPU) and gpu (the issue's grid against the
reference, poisoned outputs, determinism, batch invariance, CUDA graphs, torch.compile, the v1 autograd op).

Tolerances (derived, written once; ``u = 2^-23``, one fp32 ulp at 1):
* ``out_mul``, ``sqrsum``: sums of the splits in increasing order from 0, exactly the reference's ``seq_sum``:
  bitwise.
* ``r``: the kernel's argument ``RN(RN(Q / K_g) + eps)`` is within ``2 2^-24`` (relative) of the exact value; the
  reference's on CUDA, where torch divides by a Python scalar as a multiply by ``RN(1 / K_g)``, within
  ``3 2^-24``; so the two arguments differ by ``2.5 u`` and their inverse square roots by ``1.25 u``. ``rsqrtf``
  and torch's ``rsqrt`` are each within 2 ulp (``<= 2 u r``): the two r differ by at most ``6 u r``. Then
  ``out = sum_g RN(Pm_g r_g)`` (groups in order): ``|out - ref| <= (G + 6) u sum_g |Pm_g| r_g`` (6 u from r, one
  rounded product on each side, one rounded add on each side per further group).
* ``out_mul_grad = RN(d_out r)``: ``|dP - ref| <= 7 u |d_out| r``.
* ``sqrsum_grad = ((dr r) / (Q + E)) / -2`` with ``dr = sum_j d_out[j] Pm[j]`` in an order the spec leaves open:
  each side's ``dr`` is within ``M 2^-24 A`` of the exact sum (``A = sum_j |d_out[j] Pm[j]|``), r as above, three
  rounded operations a side: ``|dQ - ref| <= (M + 9) u r A / (2 (Q + E))``.
The CPU emulation computes ``rsqrtf`` correctly rounded, so there it is also compared bit for bit with a float32
model of the kernel's operations.

Inputs are packed (the spec's ``contiguous=True``), so there is no strided case.
"""
import re

import pytest
import torch

from tilefuse import _jit
from tilefuse.mhc import (mhc_pre_norm_fn, mhc_reduce_partials_and_rmsnorm_bwd,
                          mhc_reduce_partials_and_rmsnorm_fwd)
from tilefuse.mhc import _functions as F
from tilefuse.mhc import _reduce_norm_kernel as K
from tilefuse.reference import mhc as R
from tests.mhc import norm_emulation as emu
from tests.mhc.configs_reduce_norm import GRID_M, GROUPS, ODD, SPLITS, reduce_configs
from tests.mhc.mhc_helpers import BF16, F64
from tests.quant.kernel_binding import fake_jit

U = 2.0 ** -23
EPS = 1e-6
TOKENS = (0, 1, 7, 4001, 8192)
GRID_C = (1280, 2560, 4096, 7168)


def _nan(*shape, device="cpu"):
    return torch.full(shape, float("nan"), device=device)


def _partials(S, T, G, M, kg, device="cpu"):
    """Split partials of the size a real GEMM gives: ``Q / K_g`` about 1, ``|P|`` about ``sqrt(K_g)`` x 1e-2."""
    ps = torch.randn(S, T, G, M, device=device) * (kg / S) ** 0.5 * 1e-2
    qs = (0.5 + torch.rand(S, T, G, device=device)) * (kg / S)
    return ps, qs


def _r64(qm, kg, eps=EPS):
    return (qm.to(F64) / kg + eps).rsqrt()


def _check_fwd(pm, qm, out, ps, qs, kg, eps=EPS):
    want = R.mhc_reduce_partials_and_rmsnorm_ref(ps, qs, kg, eps)
    assert torch.equal(pm, want[0]) and torch.equal(qm, want[1])
    G = pm.shape[1]
    bound = (G + 6) * U * (pm.to(F64).abs() * _r64(qm, kg, eps).unsqueeze(-1)).sum(1)
    err = (out.to(F64) - want[2].to(F64)).abs()
    assert not (err > bound).any(), f"out: worst excess {(err - bound).max().item():.3g}"


def _check_bwd(dpm, dqm, d_out, pm, qm, kg, eps=EPS):
    want = R.mhc_reduce_partials_and_rmsnorm_bwd_ref(d_out, pm, qm, kg, eps)
    M = pm.shape[-1]
    r = _r64(qm, kg, eps)
    d = d_out.to(F64).unsqueeze(1)
    err = (dpm.to(F64) - want[0].to(F64)).abs()
    bound = 7 * U * d.abs() * r.unsqueeze(-1)
    assert not (err > bound).any(), f"out_mul_grad: worst excess {(err - bound).max().item():.3g}"
    A = (d * pm.to(F64)).abs().sum(-1)
    bound = (M + 9) * U * r * A / (2 * (qm.to(F64) + eps * kg))
    err = (dqm.to(F64) - want[1].to(F64)).abs()
    assert not (err > bound).any(), f"sqrsum_grad: worst excess {(err - bound).max().item():.3g}"


# ---- compile tier ----

def _all_configs():
    registered = [(name, cfg) for name in ("mhc_reduce_rmsnorm_fwd", "mhc_reduce_rmsnorm_bwd")
                  for cfg in _jit._FACTORIES[name][1]()]
    return sorted(set(reduce_configs()) | set(registered))


@pytest.mark.compile
@pytest.mark.parametrize("name, cfg", _all_configs(), ids=str)
def test_builds_for_sm90_with_the_explicit_operations(name, cfg):
    src = _jit.compile_kernel(name, cfg, "sm_90").get_kernel_source()
    assert "__global__" in src and "atomic" not in src and "__shared__" not in src
    assert src.count("rsqrtf(") == 1  # one RMS factor per group: the group loop is unrolled only when G > 1
    for line in src.splitlines():  # nothing contractible: every fp32 operation is an explicit intrinsic
        if "__f" in line and "=" in line:
            rhs = re.sub(r"\[[^\]]*\]", "", line.split("=", 1)[1])  # index arithmetic is integer
            rhs = re.sub(r"-?0x[0-9a-f.]+p[-+]?[0-9]+f(/\*[^*]*\*/)?", "c", rhs)  # fp32 literals
            assert not re.search(r"[-+*/]", rhs), line


@pytest.mark.compile
def test_registered_configs_are_the_bench_shapes():
    assert list(_jit._FACTORIES["mhc_reduce_rmsnorm_fwd"][1]()) == [(16, 1, 24)]
    assert list(_jit._FACTORIES["mhc_reduce_rmsnorm_bwd"][1]()) == [(1, 24)]


def _model_r(qm, kg, eps):
    """The kernel's r in fp32 with a correctly rounded rsqrt (the emulation's)."""
    x = qm / torch.tensor(float(kg)) + torch.tensor(eps, dtype=torch.float32)
    return (1.0 / x.double().sqrt()).float()


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("S, G, M, T", [(16, 1, 24, 7), (1, 1, 24, 13), (16, 2, 8, 5), (3, 3, 5, 9)])
def test_generated_source_on_the_cpu(S, G, M, T, tmp_path):
    """The kernels' CUDA source run on the CPU (``norm_emulation``): every output written (poisoned with NaN
    before), ``out_mul`` and ``sqrsum`` bitwise equal to the reference, everything bitwise equal to a float32 model
    of the kernels' operations (r correctly rounded, as emulated) and within the bounds above of the reference.
    T x M not a multiple of the CTA width leaves a partial last CTA. Token 0 has a zero sum of squares, so its
    ``Q + E`` is ``E``, and K_g = 300 makes fp32(eps K_g) formed in double differ from fp32(eps) x 300 rounded:
    the model's ``E`` (the former) is checked there."""
    kg = 300
    ps, qs = _partials(S, T, G, M, kg)
    qs[:, 0] = 0.0
    fwd = emu.build(_jit.compile_kernel("mhc_reduce_rmsnorm_fwd", (S, G, M), "sm_90").get_kernel_source(),
                    "mhc_reduce_rmsnorm_fwd_kernel", K.FWD_THREADS, tmp_path)
    pm, qm, out = _nan(T, G, M), _nan(T, G), _nan(T, M)
    fwd(dict(PS=ps, QS=qs, PM=pm, QM=qm, OUT=out, num_tokens=T, kg=float(kg), eps=EPS),
        -(-T * M // K.FWD_THREADS))
    r = _model_r(qm, kg, EPS)
    assert torch.equal(out, R.seq_sum(pm * r.unsqueeze(-1), 1))
    _check_fwd(pm, qm, out, ps, qs, kg)

    bwd = emu.build(_jit.compile_kernel("mhc_reduce_rmsnorm_bwd", (G, M), "sm_90").get_kernel_source(),
                    "mhc_reduce_rmsnorm_bwd_kernel", K.BWD_THREADS, tmp_path)
    d_out = torch.randn(T, M)
    dpm, dqm = _nan(T, G, M), _nan(T, G)
    E = EPS * kg
    bwd(dict(DO=d_out, PM=pm, QM=qm, DPM=dpm, DQM=dqm, num_tokens=T, kg=float(kg), eps=EPS, E=E),
        -(-T * G * M // K.BWD_THREADS))
    d = d_out.unsqueeze(1)
    assert torch.equal(dpm, d * r.unsqueeze(-1))
    dr = R.seq_sum(d * pm, -1)
    assert torch.equal(dqm, dr * r / (qm + torch.tensor(E, dtype=torch.float32)) / -2)
    _check_bwd(dpm, dqm, d_out, pm, qm, kg)


@pytest.mark.compile
def test_launchers_bind_their_arguments(monkeypatch):
    calls = fake_jit(monkeypatch)
    S, T, G, M = 16, 7, 1, 24
    ps, qs = _partials(S, T, G, M, 256)
    K.reduce_fwd_launch(ps, qs, torch.empty(T, G, M), torch.empty(T, G), torch.empty(T, M), 256, EPS)
    K.reduce_bwd_launch(torch.empty(T, M), torch.empty(T, G, M), torch.empty(T, G), torch.empty(T, G, M),
                        torch.empty(T, G), 256, EPS)
    assert [(c.name, c.cfg, c.env["num_tokens"]) for c in calls] == [("mhc_reduce_rmsnorm_fwd", (S, G, M), T),
                                                                     ("mhc_reduce_rmsnorm_bwd", (G, M), T)]


def test_zero_tokens_launch_nothing(monkeypatch):
    calls = fake_jit(monkeypatch)
    K.reduce_fwd_launch(torch.empty(16, 0, 1, 24), torch.empty(16, 0, 1), torch.empty(0, 1, 24), torch.empty(0, 1),
                        torch.empty(0, 24), 256, EPS)
    K.reduce_bwd_launch(torch.empty(0, 24), torch.empty(0, 1, 24), torch.empty(0, 1), torch.empty(0, 1, 24),
                        torch.empty(0, 1), 256, EPS)
    assert calls == []


def test_kernel_takes_only_what_it_was_built_for():
    t = torch.empty(1)
    assert not K.takes(t, 16, 1, 24, 256)  # CPU: the reference
    assert K.supports(16, 1, 24) and K.supports(64, 8, 80)
    assert not K.supports(65, 1, 24) and not K.supports(1, 9, 24) and not K.supports(1, 1, 81)


# ---- gpu tier ----

def _fwd(ps, qs, kg, eps=EPS):
    S, T, G, M = ps.shape
    bufs = (_nan(T, G, M, device="cuda"), _nan(T, G, device="cuda"), _nan(T, M, device="cuda"))
    mhc_reduce_partials_and_rmsnorm_fwd(ps, qs, *bufs, kg, eps, S)
    return bufs


def _bwd(d_out, pm, qm, kg, eps=EPS):
    T, G, M = pm.shape
    bufs = (_nan(T, G, M, device="cuda"), _nan(T, G, device="cuda"))
    mhc_reduce_partials_and_rmsnorm_bwd(d_out, pm, qm, *bufs, kg, eps)
    return bufs


@pytest.mark.gpu
@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("S", SPLITS)
@pytest.mark.parametrize("c", GRID_C)
@pytest.mark.parametrize("M", GRID_M)
@pytest.mark.parametrize("T", TOKENS)
def test_grid(T, M, c, S, G):
    n = {8: 2, 24: 4, 80: 8}[M]
    kg = n * c // G
    ps, qs = _partials(S, T, G, M, kg, "cuda")
    pm, qm, out = _fwd(ps, qs, kg)
    _check_fwd(pm, qm, out, ps, qs, kg)
    d_out = torch.randn(T, M, device="cuda")
    dpm, dqm = _bwd(d_out, pm, qm, kg)
    _check_bwd(dpm, dqm, d_out, pm, qm, kg)


@pytest.mark.gpu
def test_odd_config():
    S, G, M = ODD
    ps, qs = _partials(S, 4001, G, M, 300, "cuda")
    pm, qm, out = _fwd(ps, qs, 300)
    _check_fwd(pm, qm, out, ps, qs, 300)
    d_out = torch.randn(4001, M, device="cuda")
    _check_bwd(*_bwd(d_out, pm, qm, 300), d_out, pm, qm, 300)


@pytest.mark.gpu
@pytest.mark.parametrize("G", GROUPS)
def test_deterministic_and_batch_invariant(G):
    S, T, M, kg = 16, 8192, 24, 4 * 7168 // G
    ps, qs = _partials(S, T, G, M, kg, "cuda")
    d_out = torch.randn(T, M, device="cuda")
    full = _fwd(ps, qs, kg)
    full_b = _bwd(d_out, full[0], full[1], kg)
    for a, b in zip(full, _fwd(ps, qs, kg)):
        assert torch.equal(a, b)
    for a, b in zip(full_b, _bwd(d_out, full[0], full[1], kg)):
        assert torch.equal(a, b)
    for sl in (slice(1234, 1241), slice(8191, 8192), slice(0, 1), slice(100, 4101)):
        part = _fwd(ps[:, sl].contiguous(), qs[:, sl].contiguous(), kg)
        for a, b in zip(part, full):
            assert torch.equal(a, b[sl])
        part_b = _bwd(d_out[sl].contiguous(), full[0][sl].contiguous(), full[1][sl].contiguous(), kg)
        for a, b in zip(part_b, full_b):
            assert torch.equal(a, b[sl])


@pytest.mark.gpu
def test_cuda_graph_replay():
    S, T, G, M, kg = 16, 4001, 1, 24, 4 * 4096
    ps, qs = _partials(S, T, G, M, kg, "cuda")
    d_out = torch.randn(T, M, device="cuda")
    fwd_bufs = (torch.empty(T, G, M, device="cuda"), torch.empty(T, G, device="cuda"), torch.empty(T, M, device="cuda"))
    bwd_bufs = (torch.empty(T, G, M, device="cuda"), torch.empty(T, G, device="cuda"))
    mhc_reduce_partials_and_rmsnorm_fwd(ps, qs, *fwd_bufs, kg, EPS, S)  # compile and load outside the capture
    mhc_reduce_partials_and_rmsnorm_bwd(d_out, fwd_bufs[0], fwd_bufs[1], *bwd_bufs, kg, EPS)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mhc_reduce_partials_and_rmsnorm_fwd(ps, qs, *fwd_bufs, kg, EPS, S)
        mhc_reduce_partials_and_rmsnorm_bwd(d_out, fwd_bufs[0], fwd_bufs[1], *bwd_bufs, kg, EPS)
    new = _partials(S, T, G, M, kg, "cuda")
    ps.copy_(new[0])
    qs.copy_(new[1])
    d_out.copy_(torch.randn_like(d_out))
    for b in fwd_bufs + bwd_bufs:
        b.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = _fwd(ps, qs, kg)
    for a, b in zip(fwd_bufs, want):
        assert torch.equal(a, b)
    for a, b in zip(bwd_bufs, _bwd(d_out, want[0], want[1], kg)):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    S, T, G, M, kg = 16, 4001, 1, 24, 4 * 2560
    ps, qs = _partials(S, T, G, M, kg, "cuda")
    d_out = torch.randn(T, M, device="cuda")

    def step(ps, qs, d_out, pm, qm, out, dpm, dqm):
        mhc_reduce_partials_and_rmsnorm_fwd(ps, qs, pm, qm, out, kg, EPS, S)
        mhc_reduce_partials_and_rmsnorm_bwd(d_out, pm, qm, dpm, dqm, kg, EPS)
        return out + 1

    compiled = torch.compile(step, fullgraph=True)
    bufs = [_nan(T, G, M, device="cuda"), _nan(T, G, device="cuda"), _nan(T, M, device="cuda"),
            _nan(T, G, M, device="cuda"), _nan(T, G, device="cuda")]
    plus = compiled(ps, qs, d_out, *bufs)
    want = _fwd(ps, qs, kg)
    for a, b in zip(bufs[:3], want):
        assert torch.equal(a, b)
    assert torch.equal(plus, want[2] + 1)
    for a, b in zip(bufs[3:], _bwd(d_out, want[0], want[1], kg)):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_v1_autograd_op_takes_the_kernels():
    """``mhc_pre_norm_fn`` (v1): its RMS step is the v2.1 kernels' on the projection kernel's split partials,
    forward and backward, and its weight gradient the projection's backward GEMM on the RMS step's gradients
    (``fuse_grad_acc=False``)."""
    from tilefuse.mhc import _norm_fn_kernel as NF

    n, C, T = 4, 1280, 301
    k = n * C
    residual = torch.randn(1, T, n, C, device="cuda").to(BF16)
    fn = torch.randn(24, k, device="cuda") * 1e-2
    fn_l = fn.clone().requires_grad_(True)
    out = mhc_pre_norm_fn(residual, fn_l, None, EPS, fuse_grad_acc=False)
    s = NF.splits(k)
    ps, qs = torch.empty(s, T, 24, device="cuda"), torch.empty(s, T, device="cuda")
    NF.norm_fn_partials_launch(residual.view(T, k), fn, ps, qs)
    pm, qm, want = _fwd(ps.unsqueeze(2), qs.unsqueeze(2), k)
    assert torch.equal(out.view(T, 24), want)
    d_out = torch.randn(1, T, 24, device="cuda")
    (g_fn,) = torch.autograd.grad(out, (fn_l,), d_out)
    dpm, dqm = _bwd(d_out.view(T, 24), pm, qm, k)
    dx, want_fn = torch.empty(T, k, dtype=BF16, device="cuda"), torch.empty(24, k, device="cuda")
    NF.norm_fn_gemm_bwd_launch(dpm[:, 0], dqm[:, 0], residual.view(T, k), fn, dx, want_fn, False)
    assert torch.equal(g_fn, want_fn)


@pytest.mark.gpu
@pytest.mark.parametrize("S, G, M", [(65, 1, 24), (1, 9, 24), (1, 1, 81)])
def test_other_shapes_take_the_reference(S, G, M):
    T, kg = 7, 256
    assert not F._reduce_takes(torch.empty(1, G, M, device="cuda"), S, kg)
    ps, qs = _partials(S, T, G, M, kg, "cuda")
    got = _fwd(ps, qs, kg)
    for a, b in zip(got, R.mhc_reduce_partials_and_rmsnorm_ref(ps, qs, kg, EPS)):
        assert torch.equal(a, b)
    if F._reduce_takes(got[0], 1, kg):
        return  # the backward has no splits: S = 65 alone leaves its shape to the kernel (tested above)
    d_out = torch.randn(T, M, device="cuda")
    for a, b in zip(_bwd(d_out, got[0], got[1], kg),
                    R.mhc_reduce_partials_and_rmsnorm_bwd_ref(d_out, got[0], got[1], kg, EPS)):
        assert torch.equal(a, b)
