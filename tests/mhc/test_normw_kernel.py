"""Kernel tiers of the norm-weight merge, ``mhc_fn_normw_merge_fwd`` / ``mhc_fn_normw_merge_bwd`` (mhc.md §2.2.1,
§5.2): compile (sm_90 builds of every config the tests use, the explicit operations in the source, the generated
CUDA run on the CPU, the launchers' binding without a GPU) and gpu (the issue's K = n C grid against the reference,
poisoned outputs, determinism, row-batch invariance, CUDA graphs, torch.compile, the autograd Function).

Tolerance: none. Both kernels do exactly the reference's operations in the reference's order (one rounded product
a element; the norm-weight gradient summed over rows 0..M-1 from 0, then added once to the destination; the
weight gradient added to its destination), so every output is compared bit for bit. The spec's inputs are packed
(``contiguous=True`` in the public checks), so there is no strided case.
"""
import re

import pytest
import torch

from tilefuse import _jit
from tilefuse.mhc import mhc_fn_normw_merge_bwd, mhc_fn_normw_merge_fwd
from tilefuse.mhc import _functions as F
from tilefuse.mhc import _normw_kernel as K
from tilefuse.reference.mhc import mhc_fn_normw_merge_bwd_ref
from tests.mhc import norm_emulation as emu
from tests.mhc.configs_normw import GRID_K, ODD_K, ODD_K_BWD, normw_configs
from tests.quant.kernel_binding import fake_jit

ROWS = (0, 1, 7, 24)  # M: none, one, odd, the layer's n(n + 2) at n = 4


def _nan(*shape, device="cpu"):
    return torch.full(shape, float("nan"), device=device)


def _ref_bwd(fn, normw, dw, fn_grad, normw_grad):
    """The reference's accumulation into copies of the destinations."""
    d_fn, d_w = mhc_fn_normw_merge_bwd_ref(fn, normw, dw)
    return fn_grad.clone().add_(d_fn), normw_grad.clone().add_(d_w)


# ---- compile tier ----

BWD_VECS = (2, 4)  # the BWD_VEC knob's vector values (2: the default)


def _all_configs():
    """The tests' and the registered configs, and the backward's at BWD_VEC 2 and 4 (the bench's K and K = 264,
    a partial CTA at either)."""
    registered = [(name, cfg) for name in ("mhc_normw_merge_fwd", "mhc_normw_merge_bwd")
                  for cfg in _jit._FACTORIES[name][1]()]
    vec = [("mhc_normw_merge_bwd", (k, v)) for k in K.BENCH_K + ODD_K for v in BWD_VECS]
    return sorted(set(normw_configs()) | set(registered) | set(vec))


@pytest.mark.compile
@pytest.mark.parametrize("name, cfg", _all_configs(), ids=str)
def test_builds_for_sm90_with_the_explicit_operations(name, cfg):
    src = _jit.compile_kernel(name, cfg, "sm_90").get_kernel_source()
    assert "__global__" in src and "atomic" not in src and "__shared__" not in src
    if name == "mhc_normw_merge_fwd":
        assert src.count("__fmul_rn(") == 1 and "__fadd_rn(" not in src
        for buf in ("FN", "W", "OUT"):  # 16-byte accesses
            assert f"*(float4*)({buf} +" in src, buf
    else:  # one product and one add per destination, then the one add into normw_grad
        assert src.count("__fmul_rn(") == 2 and src.count("__fadd_rn(") == 3
        vec = {2: "float2", 4: "float4"}.get(cfg[1])
        if vec:  # 8- / 16-byte accesses: the loads of every input, the stores of both destinations
            for buf in ("FN", "W", "DW", "DFN", "DNW"):
                assert f"*({vec}*)({buf} +" in src, buf
            for buf in ("DFN", "DNW"):
                assert re.search(rf"^ *\*\({vec}\*\)\({buf} \+.*\) = ", src, re.M), buf
        else:
            assert "float2" not in src and "float4" not in src
    for line in (line for line in src.splitlines() if "__f" in line):  # nothing contractible around them
        rhs = re.sub(r"\[[^\]]*\]", "", line.split("=", 1)[1])
        assert not re.search(r"[-+*/]", rhs), line


@pytest.mark.compile
def test_registered_configs_are_the_bench_shapes(monkeypatch):
    bench = [4 * c for c in (2560, 4096, 7168)]
    assert list(_jit._FACTORIES["mhc_normw_merge_fwd"][1]()) == [(k,) for k in bench]
    assert K.BWD_VEC == 2 and list(_jit._FACTORIES["mhc_normw_merge_bwd"][1]()) == [(k, 2) for k in bench]
    for vec in BWD_VECS:
        monkeypatch.setattr(K, "BWD_VEC", vec)
        assert list(_jit._FACTORIES["mhc_normw_merge_bwd"][1]()) == [(k, vec) for k in bench]
    assert set(GRID_K) >= set(K.BENCH_K)


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("rows, k", [(24, 264), (7, 1280), (1, 264), (5, 100)])
def test_generated_source_on_the_cpu(rows, k, tmp_path):
    """The kernels' CUDA source run on the CPU (``norm_emulation``, the same arithmetic bit for bit): every output
    written (the forward's poisoned with NaN), both equal to the reference bit for bit, accumulating into the
    destinations' previous contents. K = 264 and 100 leave a partial CTA (and K = 100 has no forward kernel)."""
    fn, normw, dw = torch.randn(rows, k), 1 + 0.1 * torch.randn(k), torch.randn(rows, k)
    if k % K.V == 0:
        fwd = emu.build(_jit.compile_kernel("mhc_normw_merge_fwd", (k,), "sm_90").get_kernel_source(),
                        "mhc_normw_merge_fwd_kernel", K.FWD_THREADS, tmp_path)
        out = _nan(rows, k)
        fwd(dict(FN=fn, W=normw, OUT=out, rows=rows), -(-rows * k // K.V // K.FWD_THREADS))
        assert torch.equal(out, fn * normw)
    bwd = emu.build(_jit.compile_kernel("mhc_normw_merge_bwd", (k, 1), "sm_90").get_kernel_source(),
                    "mhc_normw_merge_bwd_kernel", K.BWD_THREADS, tmp_path)
    fn_grad, normw_grad = torch.randn(rows, k), torch.randn(k)
    want = _ref_bwd(fn, normw, dw, fn_grad, normw_grad)
    bwd(dict(FN=fn, W=normw, DW=dw, DFN=fn_grad, DNW=normw_grad, rows=rows), -(-k // K.BWD_THREADS))
    assert torch.equal(fn_grad, want[0]) and torch.equal(normw_grad, want[1])


# The backward knobs' other values (the defaults before the H100 sweep): the baseline of the knob test.
BWD_BASELINE = {"BWD_THREADS": 128, "BWD_ROWS": 8}


def test_backward_defaults_are_not_the_baseline():
    assert K.BWD_THREADS != BWD_BASELINE["BWD_THREADS"] and K.BWD_ROWS != BWD_BASELINE["BWD_ROWS"]


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
def test_backward_knobs_change_no_result(tmp_path, monkeypatch):
    """BWD_THREADS only shapes the launch and BWD_ROWS only groups loads: the defaults, the baseline (128 threads, 8
    rows), 32 threads, and 1 and 3 rows give bitwise the reference's gradients (CPU emulation; K = 264 leaves a partial
    CTA at every thread count; 7 and 30 rows end on a partly guarded group for 8 and 24 rows, 7 for 3)."""
    k = 264
    cases = [(K.BWD_THREADS, K.BWD_ROWS), tuple(BWD_BASELINE.values()), (32, 8), (64, 1), (64, 3)]
    runs = {}
    for threads, u in cases:
        monkeypatch.setattr(K, "BWD_THREADS", threads)
        monkeypatch.setattr(K, "BWD_ROWS", u)
        src = _jit.compile_kernel("mhc_normw_merge_bwd", (k, 1), "sm_90", export=False).get_kernel_source()
        runs[threads, u] = emu.build(src, "mhc_normw_merge_bwd_kernel", threads, tmp_path / f"{threads}-{u}")
    for rows in (7, 30):
        fn, normw, dw = torch.randn(rows, k), 1 + 0.1 * torch.randn(k), torch.randn(rows, k)
        start = (torch.randn(rows, k), torch.randn(k))
        want = _ref_bwd(fn, normw, dw, *start)
        for (threads, u), bwd in runs.items():
            fn_grad, normw_grad = start[0].clone(), start[1].clone()
            bwd(dict(FN=fn, W=normw, DW=dw, DFN=fn_grad, DNW=normw_grad, rows=rows), -(-k // threads))
            assert torch.equal(fn_grad, want[0]) and torch.equal(normw_grad, want[1]), (rows, threads, u)


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("vec", BWD_VECS)
def test_backward_vec_knob_on_the_cpu(vec, tmp_path):
    """BWD_VEC 2 and 4 (a thread's consecutive columns, vector accesses) give bitwise the one-column kernel's and the
    reference's gradients, accumulating into random buffers (CPU emulation; K = 264 leaves a partial CTA; 7 and 30
    rows end on a partly guarded group of BWD_ROWS)."""
    k = 264
    builds = {v: emu.build(_jit.compile_kernel("mhc_normw_merge_bwd", (k, v), "sm_90", export=False)
                           .get_kernel_source(), "mhc_normw_merge_bwd_kernel", K.BWD_THREADS, tmp_path / str(v))
              for v in (1, vec)}
    for rows in (7, 30):
        fn, normw, dw = torch.randn(rows, k), 1 + 0.1 * torch.randn(k), torch.randn(rows, k)
        start = (torch.randn(rows, k), torch.randn(k))
        got = {}
        for v, bwd in builds.items():
            fn_grad, normw_grad = start[0].clone(), start[1].clone()
            bwd(dict(FN=fn, W=normw, DW=dw, DFN=fn_grad, DNW=normw_grad, rows=rows), -(-k // (v * K.BWD_THREADS)))
            got[v] = fn_grad, normw_grad
        want = _ref_bwd(fn, normw, dw, *start)
        for v in builds:
            assert torch.equal(got[v][0], want[0]) and torch.equal(got[v][1], want[1]), (rows, v)


@pytest.mark.compile
@pytest.mark.parametrize("vec", BWD_VECS)
def test_backward_launcher_takes_the_vector_kernel_when_it_fits(vec, monkeypatch):
    """At BWD_VEC = vec the launcher builds the vector kernel when K is a multiple of vec and every tensor starts
    on a 4 * vec-byte boundary; else the one-column kernel."""
    calls = fake_jit(monkeypatch)
    monkeypatch.setattr(K, "BWD_VEC", vec)

    def launch(rows, k, shift=0):  # shift: fn starts that many elements into its storage
        fn = torch.randn(rows * k + shift)[shift:].view(rows, k)
        K.normw_merge_bwd_launch(fn, torch.randn(k), torch.randn(rows, k), torch.zeros(rows, k), torch.zeros(k))
        return calls.pop().cfg

    assert launch(24, 264) == (264, vec) and launch(1, 4) == (4, vec)
    assert launch(24, 262) == (262, 2 if vec == 2 else 1)  # 262 = 2 * 131
    assert launch(3, 101) == (101, 1)
    assert launch(24, 264, shift=1) == (264, 1)
    assert launch(24, 264, shift=2) == (264, 2 if vec == 2 else 1)  # 8-byte aligned, not 16


@pytest.mark.compile
def test_launchers_bind_their_arguments(monkeypatch):
    calls = fake_jit(monkeypatch)
    fn, normw = torch.randn(24, 264), torch.randn(264)
    K.normw_merge_fwd_launch(fn, normw, torch.empty_like(fn))
    K.normw_merge_bwd_launch(fn, normw, fn, torch.zeros_like(fn), torch.zeros_like(normw))
    assert [(c.name, c.cfg, c.env["rows"]) for c in calls] == [("mhc_normw_merge_fwd", (264,), 24),
                                                               ("mhc_normw_merge_bwd", (264, K.BWD_VEC), 24)]


def test_empty_shapes_launch_nothing(monkeypatch):
    """No rows or no columns: nothing to launch; with no rows the norm-weight gradient gets its one add of an
    empty sum, as the reference (``-0`` becomes ``+0``)."""
    calls = fake_jit(monkeypatch)
    for rows, k in ((0, 16), (3, 0)):
        fn = torch.randn(rows, k)
        normw = torch.randn(k)
        K.normw_merge_fwd_launch(fn, normw, torch.empty_like(fn))
        normw_grad = torch.full((k,), -0.0)
        K.normw_merge_bwd_launch(fn, normw, fn, torch.zeros_like(fn), normw_grad)
        want = _ref_bwd(fn, normw, fn, torch.zeros_like(fn), torch.full((k,), -0.0))[1]
        assert torch.equal(normw_grad, want) and not torch.signbit(normw_grad).any()
    assert calls == []


def test_kernel_takes_only_cuda_fp32():
    fn = torch.randn(24, 16)
    assert not K.takes_fwd(fn) and not K.takes_bwd(fn)
    meta = fn.to("meta")
    assert not K.takes_fwd(meta) and not K.takes_bwd(meta)


# ---- gpu tier ----

def _inputs(rows, k):
    fn = torch.randn(rows, k, device="cuda") * 1e-2
    normw = 1 + 0.1 * torch.randn(k, device="cuda")
    return fn, normw


@pytest.mark.gpu
@pytest.mark.parametrize("k", GRID_K + ODD_K + ODD_K_BWD)
@pytest.mark.parametrize("rows", ROWS)
def test_grid_bitwise(rows, k):
    fn, normw = _inputs(rows, k)
    out = _nan(rows, k, device="cuda")
    mhc_fn_normw_merge_fwd(fn, normw, out)
    assert torch.equal(out, fn * normw)
    dw = torch.randn(rows, k, device="cuda")
    fn_grad, normw_grad = torch.randn(rows, k, device="cuda"), torch.randn(k, device="cuda")
    want = _ref_bwd(fn, normw, dw, fn_grad, normw_grad)
    mhc_fn_normw_merge_bwd(fn, normw, dw, fn_grad, normw_grad)
    assert torch.equal(fn_grad, want[0]) and torch.equal(normw_grad, want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("vec", BWD_VECS)
def test_backward_vec_knob_bitwise(vec, knob_kernels):
    """BWD_VEC 2 and 4: fn_grad and normw_grad bitwise the default kernel's (and the reference's), accumulating into
    random buffers; K = 16390 (not a multiple of 4) and a misaligned fn take the one-column fallback at 4."""
    cases = [(m, k, 0) for m in (1, 24, 40) for k in (4, 16384, 16388, 16390)] + [(24, 16384, 1), (24, 16384, 2)]
    data, default = [], []
    for rows, k, shift in cases:
        fn = torch.randn(rows * k + shift, device="cuda")[shift:].view(rows, k)
        normw, dw = 1 + 0.1 * torch.randn(k, device="cuda"), torch.randn(rows, k, device="cuda")
        start = (torch.randn(rows, k, device="cuda"), torch.randn(k, device="cuda"))
        data.append((fn, normw, dw, start))
        grads = (start[0].clone(), start[1].clone())
        K.normw_merge_bwd_launch(fn, normw, dw, *grads)
        default.append(grads)
    knob_kernels(K, {"BWD_VEC": vec})
    for (rows, k, shift), (fn, normw, dw, start), want in zip(cases, data, default):
        assert K.bwd_vec(k, fn) == (vec if k % vec == 0 and (4 * shift) % (4 * vec) == 0 else 1)
        grads = (start[0].clone(), start[1].clone())
        K.normw_merge_bwd_launch(fn, normw, dw, *grads)
        ref = _ref_bwd(fn, normw, dw, *start)
        for got, d, r in zip(grads, want, ref):
            assert torch.equal(got, d) and torch.equal(got, r), (rows, k, shift)


@pytest.mark.gpu
def test_deterministic_and_row_invariant():
    fn, normw = _inputs(24, 4 * 7168)
    dw = torch.randn_like(fn)
    outs = []
    for _ in range(2):
        out = _nan(*fn.shape, device="cuda")
        mhc_fn_normw_merge_fwd(fn, normw, out)
        grads = (torch.zeros_like(fn), torch.zeros_like(normw))
        mhc_fn_normw_merge_bwd(fn, normw, dw, *grads)
        outs.append((out, *grads))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    for sl in (slice(3, 10), slice(23, 24)):  # the forward of a row batch is that part of the full result
        part = _nan(sl.stop - sl.start, fn.shape[1], device="cuda")
        mhc_fn_normw_merge_fwd(fn[sl].clone(), normw, part)
        assert torch.equal(part, outs[0][0][sl])


@pytest.mark.gpu
def test_cuda_graph_replay():
    fn, normw = _inputs(24, 4 * 4096)
    dw = torch.randn_like(fn)
    out, fn_grad, normw_grad = torch.empty_like(fn), torch.zeros_like(fn), torch.zeros_like(normw)
    mhc_fn_normw_merge_fwd(fn, normw, out)  # compile and load outside the capture
    mhc_fn_normw_merge_bwd(fn, normw, dw, fn_grad, normw_grad)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mhc_fn_normw_merge_fwd(fn, normw, out)
        mhc_fn_normw_merge_bwd(fn, normw, dw, fn_grad, normw_grad)
    for t, new in zip((fn, normw, dw), (*_inputs(24, 4 * 4096), torch.randn_like(dw))):
        t.copy_(new)
    out.fill_(float("nan"))
    start = (torch.randn_like(fn_grad), torch.randn_like(normw_grad))
    fn_grad.copy_(start[0])
    normw_grad.copy_(start[1])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fn * normw)
    want = _ref_bwd(fn, normw, dw, *start)
    assert torch.equal(fn_grad, want[0]) and torch.equal(normw_grad, want[1])


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    fn, normw = _inputs(24, 4 * 2560)
    dw = torch.randn_like(fn)

    def step(fn, normw, dw, out, fn_grad, normw_grad):
        mhc_fn_normw_merge_fwd(fn, normw, out)
        mhc_fn_normw_merge_bwd(fn, normw, dw, fn_grad, normw_grad)
        return out * 2

    compiled = torch.compile(step, fullgraph=True)
    start = (torch.randn_like(fn), torch.randn_like(normw))
    got = [_nan(*fn.shape, device="cuda"), start[0].clone(), start[1].clone()]
    doubled = compiled(fn, normw, dw, *got)
    assert torch.equal(got[0], fn * normw) and torch.equal(doubled, 2 * (fn * normw))
    want = _ref_bwd(fn, normw, dw, *start)
    assert torch.equal(got[1], want[0]) and torch.equal(got[2], want[1])


@pytest.mark.gpu
def test_autograd_function_takes_the_kernels():
    """``MHCFnNormwMergeFn`` (used by ``mhc_pre_norm_fn`` with a norm weight): the forward is the kernel's product;
    the backward accumulates into ``main_grad`` when the parameter has one, else returns fresh gradients."""
    fn, normw = _inputs(24, 4 * 1280)
    dw = torch.randn_like(fn)
    fn_l, w_l = fn.clone().requires_grad_(True), normw.clone().requires_grad_(True)
    w_merged = F.MHCFnNormwMergeFn.apply(fn_l, w_l)
    assert torch.equal(w_merged, fn * normw)
    g_fn, g_w = torch.autograd.grad(w_merged, (fn_l, w_l), dw)
    want = _ref_bwd(fn, normw, dw, torch.zeros_like(fn), torch.zeros_like(normw))
    assert torch.equal(g_fn, want[0]) and torch.equal(g_w, want[1])
    w_l.main_grad = torch.randn_like(normw)
    start = w_l.main_grad.clone()
    w_merged = F.MHCFnNormwMergeFn.apply(fn_l, w_l)
    w_merged.backward(dw)
    assert w_l.grad is None
    assert torch.equal(w_l.main_grad, _ref_bwd(fn, normw, dw, torch.zeros_like(fn), start)[1])


@pytest.mark.gpu
def test_forward_other_k_takes_the_reference():
    fn, normw = _inputs(7, 102)
    assert not K.takes_fwd(fn) and K.takes_bwd(fn)
    out = _nan(7, 102, device="cuda")
    mhc_fn_normw_merge_fwd(fn, normw, out)
    assert torch.equal(out, fn * normw)
