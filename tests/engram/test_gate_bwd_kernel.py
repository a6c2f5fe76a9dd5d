"""Kernel tiers of ``engram_gate_bwd`` and ``grad_w_reduce`` (engram.md §2.5, §2.6; ``_gate_bwd_kernel``): compile
(sm_90 builds of every config the tests use, the explicit operations in the source, the generated CUDA run on the
CPU, the launchers' binding without a GPU) and gpu (the issue's grid against the reference, poisoned outputs,
strided inputs, determinism, batch invariance, num_sms, CUDA graphs, torch.compile).

What is asserted:
* The backward is fed the reference's forward statistics (``engram_gate_ref(..., save_for_backward=True)``, spec
  §3.4). With random ``grad_out`` and ``v``, ``grad_x``, ``grad_k``, ``grad_v`` and ``grad_w_partial`` (element by
  element) are within the spec's ``calc_diff < 1e-8`` of the reference ``_gate_bwd``; ``grad_v`` does not involve
  ``dg`` and is compared bit for bit.
* The kernel does the reference's operations in its order except the sum ``dg = Σ_d G v`` (order free, §2.5.2).
  With small integer ``grad_out`` and ``v`` every order gives the exact ``dg``, and then all four outputs equal
  bit for bit ``_gate_bwd`` run on the CPU with an IEEE square root (``ieee_reference``; torch's CPU ``sqrt``
  is 1 ulp off on some inputs): grad_w_partial's chunks, their ascending-token order and its two roundings a term.
* ``grad_w_reduce`` is order-fixed: bit for bit the reference (``_sequential_sum`` and a correctly rounded fma),
  for partial counts that are not multiples of 8 too.
* ``PREFETCH`` (the next token's inputs copied by ``cp.async``) gives the bits of the kernel without it: its
  generated CUDA on the CPU, and on the GPU.
* ``XK_ASYNC`` (a token's x and k copied by ``cp.async`` with its grad_out / v loads) likewise, and both keep one CTA
  barrier in the token loop (the generated source).
* Same kernel, same values: bitwise (determinism, rows of a sub-batch, a chunk alone as one partial, strided or
  misaligned ``k``/``v`` against contiguous copies, graph replay, torch.compile).

Outputs start poisoned: the launchers' allocations are replaced by NaN-filled ones (``_gate_bwd_kernel._new``).
"""
import re

import numpy as np
import pytest
import torch

from tilefuse import _jit
from tilefuse import engram as E
from tilefuse.engram import _gate_bwd_kernel as K
from tilefuse.engram.ops import DEFAULT_NUM_SMS
from tilefuse.reference import engram as R
from tilefuse.testing import calc_diff
from tests.engram import gate_bwd_emulation as emu
from tests.engram.configs_gate_bwd import (BEYOND_H, FALLBACK_H, GRID_H, GRID_T, PREFETCH_H, XK_FALLBACK_H, XK_H,
                                           gate_bwd_configs)
from tests.quant.kernel_binding import fake_jit

CLAMP, EPS = 1e-6, 1e-20
BWD_DIFF = 1e-8  # spec §3.2


# ---- inputs and oracles ----

def make_inputs(t: int, h: int, device="cpu", exact: bool = False) -> dict:
    """Random gate inputs and the reference forward's statistics. ``exact``: ``grad_out`` and ``v`` are integers
    in [-3, 3], so ``dg`` (|dg| <= 9 H < 2^24) is exact in fp32 in any order."""
    x = torch.randn(t, 4, h, device=device).bfloat16()
    k = torch.randn(t, 4, h, device=device).bfloat16()
    wh, we = torch.randn(4, h, device=device).bfloat16(), torch.randn(4, h, device=device).bfloat16()
    if exact:
        v = torch.randint(-3, 4, (t, h), device=device).bfloat16()
        go = torch.randint(-3, 4, (t, 4, h), device=device).bfloat16()
    else:
        v = torch.randn(t, h, device=device).bfloat16()
        go = torch.randn(t, 4, h, device=device).bfloat16()
    _, d, g, rx, rk = R.engram_gate_ref(x, k, v, wh, we, CLAMP, EPS, save_for_backward=True)
    return dict(go=go, x=x, k=k, v=v, w=wh.float() * we.float(), d=d, g=g, rx=rx, rk=rk, wh=wh, we=we)


def bwd_args(a: dict) -> tuple:
    return a["go"], a["x"], a["k"], a["v"], a["w"], a["d"], a["g"], a["rx"], a["rk"]


def _ieee_sqrt(t: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.sqrt(t.numpy()))  # numpy's fp32 sqrt is correctly rounded


def ieee_reference(a: dict, partials: int, monkeypatch) -> tuple:
    """``_gate_bwd`` on CPU copies with a correctly rounded square root (the kernel's ``__fsqrt_rn``)."""
    cpu = [t.cpu() for t in bwd_args(a)]
    with monkeypatch.context() as m:
        m.setattr(torch, "sqrt", _ieee_sqrt)
        return R._gate_bwd(*cpu, CLAMP, partials)


def assert_bits(got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, i
        assert torch.equal(g.cpu(), w.cpu()), (i, calc_diff(g.cpu().float(), w.cpu().float()))


def assert_close_to_reference(got, a: dict, partials: int):
    """grad_x, grad_k, grad_w_partial within the spec's calc_diff of the reference; grad_v bit for bit."""
    want = R._gate_bwd(*bwd_args(a), CLAMP, partials)
    assert torch.equal(got[2], want[2])
    for i in (0, 1, 3):
        assert got[i].shape == want[i].shape and not got[i].isnan().any(), i
        assert calc_diff(got[i].float(), want[i].float()) < BWD_DIFF, i


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


# ---- compile tier ----

def _all_configs():
    registered = [(name, cfg) for name in ("engram_gate_bwd", "engram_grad_w_reduce")
                  for cfg in _jit._FACTORIES[name][1]()]
    return sorted(set(gate_bwd_configs()) | set(registered))


def _assert_explicit_operations(name: str, src: str) -> None:
    assert "__global__" in src and "atomic" not in src
    if name == "engram_gate_bwd":
        # beta's square root and quotient, and qx, qk: IEEE; the per-column chains as the reference's
        assert src.count("__fsqrt_rn(") == 1 and src.count("__fdiv_rn(") == 3
        assert "__fadd_rn(gf, __fmul_rn(beta[" in src  # grad_x = G + beta (k w - x qx)
        assert "__fmul_rn(__fmul_rn(beta[" in src      # the weight-gradient term (beta x) k
        assert "__syncthreads()" in src
    else:
        assert src.count("__fadd_rn(") == 1 and src.count("__fmaf_rn(") == 2
    for line in (line for line in src.splitlines() if "__f" in line):  # nothing contractible around them
        rhs = re.sub(r"\[[^\]]*\]", "", line.split("=", 1)[1])
        rhs = re.sub(r"/\*.*?\*/|0x[0-9a-f.]+p[-+]?\d+f", "", rhs)  # comments, hexadecimal float literals
        assert not re.search(r"[-+*/]", rhs), line


@pytest.mark.compile
@pytest.mark.parametrize("name, cfg", _all_configs(), ids=str)
def test_builds_for_sm90_with_the_explicit_operations(name, cfg):
    _assert_explicit_operations(name, _jit.compile_kernel(name, cfg, "sm_90").get_kernel_source())


def _gate_source(h: int) -> str:
    return _jit.compile_kernel("engram_gate_bwd", (h,), "sm_90", export=False).get_kernel_source()


def _token_loop(src: str) -> str:
    """The body of the generated kernel's token loop."""
    start = src.index("{", src.index("for (int64_t s = "))
    depth = 0
    for end, c in enumerate(src[start:], start):
        depth += {"{": 1, "}": -1}.get(c, 0)
        if depth == 0:
            return src[start:end + 1]
    raise AssertionError("unbalanced braces")


def _assert_async_copies(src: str, wait: int) -> str:
    """The explicit operations; in the token loop the copies are cp.async behind a warp barrier (the previous
    token's reads of the stage stay before them), a thread waits for all but ``wait`` of its groups, the warp's
    barrier follows, and the loop keeps one CTA barrier (the dg reduction's). Returns the token loop's body."""
    _assert_explicit_operations("engram_gate_bwd", src)
    assert "tl::cp_async_gs<16>(" in src and "tl::cp_async_commit();" in src
    assert re.search(rf"tl::cp_async_wait<{wait}>\(\);\s*__syncwarp\(\);", src)
    loop = _token_loop(src)
    assert loop.count("__syncwarp();") == 2 and loop.index("__syncwarp();") < loop.index("tl::cp_async_gs<16>(")
    assert loop.count("__syncthreads()") == 1 and src.count("tl::cp_async_wait<") == 1
    return loop


@pytest.mark.compile
@pytest.mark.parametrize("h", PREFETCH_H)
def test_prefetch_builds_for_sm90(h, monkeypatch):
    """PREFETCH: the copies' pattern (``_assert_async_copies``); a thread waits for all but its newest group."""
    monkeypatch.setattr(K, "PREFETCH", True)
    assert K.prefetches(h)
    src = _gate_source(h)
    _assert_async_copies(src, 1)
    assert src.count("__syncthreads()") == 1


@pytest.mark.compile
@pytest.mark.parametrize("h", XK_H)
def test_xk_async_builds_for_sm90(h, monkeypatch):
    """XK_ASYNC: the copies' pattern (``_assert_async_copies``); the token's x and k copies (two statements, in
    loops over branches and vectors) are all in the token loop, issued before the dg barrier and waited for (all of
    them) after it; w is not staged in shared memory and is read from global memory in the token loop. (TileLang's
    barrier planner adds a CTA barrier after the loop at some H, 5632 and 6144: once a CTA.)"""
    monkeypatch.setattr(K, "XK_ASYNC", True)
    assert K.xk_async(h)
    src = _gate_source(h)
    loop = _assert_async_copies(src, 0)
    assert src.count("tl::cp_async_gs<16>(") == loop.count("tl::cp_async_gs<16>(") == 2
    assert src.count("tl::cp_async_commit();") == 1
    barrier = loop.index("__syncthreads()")
    assert loop.rindex("tl::cp_async_gs<16>(") < loop.index("tl::cp_async_commit();") < barrier
    assert barrier < loop.index("tl::cp_async_wait<0>();") < loop.index("((bfloat16_t*)xks)")
    assert "ws" not in re.findall(r"void\* (\w+) = ", src) and "*(float4*)(W + " in loop
    assert src.count("__syncthreads()") <= 2


def test_prefetch_takes_one_vector_a_thread(monkeypatch):
    sizes = range(1024, K.MAX_H + 1, 512)
    assert not any(K.prefetches(h) for h in sizes)  # off by default
    monkeypatch.setattr(K, "PREFETCH", True)
    assert [h for h in sizes if K.prefetches(h)] == [h for h in sizes if K.layout(h)[0] == 1] == list(
        range(1024, 4097, 512))
    assert set(PREFETCH_H) <= {h for h in sizes if K.prefetches(h)}
    assert not any(K.prefetches(h) for h in FALLBACK_H)


@pytest.mark.compile
@pytest.mark.parametrize("h", FALLBACK_H)
def test_prefetch_falls_back_where_the_stages_do_not_fit(h, monkeypatch):
    """Two vectors a thread: two stages would take 52 H bytes; PREFETCH builds the default kernel."""
    want = _gate_source(h)
    monkeypatch.setattr(K, "PREFETCH", True)
    assert _gate_source(h) == want


def test_xk_async_takes_two_vectors_with_the_sums_in_shared_memory(monkeypatch):
    sizes = range(1024, K.MAX_H + 1, 512)
    assert K.XK_ASYNC  # on by default (measured faster at H = 7168: docs/BENCHMARKS.md)
    monkeypatch.setattr(K, "XK_ASYNC", False)
    assert not any(K.xk_async(h) for h in sizes)
    monkeypatch.setattr(K, "XK_ASYNC", True)
    assert [h for h in sizes if K.xk_async(h)] == [h for h in sizes if K.layout(h)[0] == 2 and K.sums_in_smem(h)] == (
        list(range(4608, 7169, 512)))
    assert set(XK_H) <= {h for h in sizes if K.xk_async(h)}
    assert not any(K.xk_async(h) for h in XK_FALLBACK_H)
    monkeypatch.setattr(K, "ACC_SMEM_J", 3)  # the sums in registers: no room taken by w to give to the stage
    assert not any(K.xk_async(h) for h in sizes)


@pytest.mark.compile
@pytest.mark.parametrize("h", XK_FALLBACK_H)
def test_xk_async_falls_back_elsewhere(h, monkeypatch):
    """One vector a thread (x and k already loaded with grad_out), or the sums in registers (shared memory holds w
    alone): XK_ASYNC builds the kernel without it."""
    monkeypatch.setattr(K, "XK_ASYNC", False)
    want = _gate_source(h)
    monkeypatch.setattr(K, "XK_ASYNC", True)
    assert _gate_source(h) == want


@pytest.mark.compile
def test_registered_configs_are_the_bench_shapes():
    assert list(_jit._FACTORIES["engram_gate_bwd"][1]()) == [(4096,), (7168,)]
    assert list(_jit._FACTORIES["engram_grad_w_reduce"][1]()) == [()]
    assert set(GRID_H) >= set(K.BENCH_H)


def test_layout_tiles_every_hidden_size():
    for h in range(1024, K.MAX_H + 1, 512):
        j, threads = K.layout(h)
        assert K.takes_hidden(h) and j * threads * K.V == h and threads <= K.MAX_THREADS and threads % 32 == 0
    assert K.layout(4096) == (1, 512) and K.layout(7168) == (2, 448)
    assert not any(K.takes_hidden(h) for h in (512, 768, 1280, BEYOND_H))


def _emulated_gate(h: int, tmp_path):
    _, threads = K.layout(h)
    src = _jit.compile_kernel("engram_gate_bwd", (h,), "sm_90", export=False).get_kernel_source()
    run = emu.build(src, "engram_gate_bwd_kernel", threads, tmp_path)

    def launch(a: dict, partials: int):
        """The kernel on CPU tensors (any strides of k, v with a unit last one); fresh NaN-filled outputs."""
        t, _, _ = a["x"].shape
        out = (torch.full((t, 4, h), float("nan")).bfloat16(), torch.full((t, 4, h), float("nan")).bfloat16(),
               torch.full((t, h), float("nan")).bfloat16(), torch.full((partials, 4, h), float("nan")))
        k, v = a["k"], a["v"]
        run(dict(GO=a["go"], X=a["x"], K=k, Vt=v, W=a["w"], D=a["d"], GS=a["g"], RX=a["rx"], RK=a["rk"],
                 DX=out[0], DK=out[1], DV=out[2], DWP=out[3], c_h=_f32(h ** -0.5), clamp=_f32(CLAMP), hf=float(h),
                 k_token_stride=k.stride(0), k_branch_stride=k.stride(1), v_token_stride=v.stride(0),
                 num_partials=partials, num_tokens=t), partials)
        return out

    return launch


def _strided(a: dict) -> dict:
    """``k`` and ``v`` as views into one fused ``(T, 5, H)`` projection (token stride 5 H), on ``x``'s device."""
    t, _, h = a["x"].shape
    kv = torch.empty(t, 5, h, dtype=torch.bfloat16, device=a["x"].device)
    kv[:, :4] = a["k"]
    kv[:, 4] = a["v"]
    return dict(a, k=kv[:, :4], v=kv[:, 4])


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("h, tokens, partials, strided", [(1024, 7, 3, False), (1024, 37, 8, True),
                                                         (1024, 1, 4, False), (1024, 5, 9, False),
                                                         (7168, 5, 2, True)])
def test_generated_source_on_the_cpu(h, tokens, partials, strided, tmp_path, monkeypatch):
    """The kernel's CUDA source run on the CPU (``gate_bwd_emulation``, the same arithmetic bit for bit): every
    output written (NaN before), bit for bit the reference (IEEE square root) when ``dg`` is exact, within the
    spec's bound otherwise. 5 tokens in 9 partials leave empty chunks (zero rows); 37 in 8 a short last chunk."""
    launch = _emulated_gate(h, tmp_path)
    for exact in (True, False):
        a = make_inputs(tokens, h, exact=exact)
        got = launch(_strided(a) if strided else a, partials)
        if exact:
            assert_bits(got, ieee_reference(a, partials, monkeypatch))
        else:
            assert_close_to_reference(got, a, partials)


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("h, variants", [
    (1024, [dict(EARLY_XK_J=0, KEEP_GO_J=0), dict(ACC_SMEM_J=1), dict(ACC_SMEM_J=1, EARLY_XK_J=0)]),
    (7168, [dict(KEEP_GO_J=1), dict(ACC_SMEM_J=3), dict(ACC_SMEM_J=3, EARLY_XK_J=2, KEEP_GO_J=1),
            dict(XK_ASYNC=True, KEEP_GO_J=1), dict(XK_ASYNC=True, EARLY_XK_J=2)])])
def test_gate_knobs_change_no_result(h, variants, tmp_path, monkeypatch):
    """EARLY_XK_J, KEEP_GO_J and ACC_SMEM_J only move loads and storage: the same bits (CPU emulation; at H = 7168
    ACC_SMEM_J = 3 keeps the sums of two vectors a thread in registers, the path of H = 8192; KEEP_GO_J = 1 reads
    grad_out again after the barrier, with XK_ASYNC too; XK_ASYNC takes x and k from its stage whatever
    EARLY_XK_J). The baseline is the kernel without XK_ASYNC."""
    monkeypatch.setattr(K, "XK_ASYNC", False)
    tokens, partials = 9, 2
    a = make_inputs(tokens, h)
    want = _emulated_gate(h, tmp_path / "default")(a, partials)
    for i, knobs in enumerate(variants):
        with monkeypatch.context() as m:
            for name, value in knobs.items():
                m.setattr(K, name, value)
            assert_bits(_emulated_gate(h, tmp_path / str(i))(a, partials), want)


_TAKES = {"PREFETCH": K.prefetches, "XK_ASYNC": K.xk_async}
# (tokens, partials, strided): one token, odd counts, 5 tokens in 9 partials leave empty chunks, ``k``, ``v`` views
# into one projection
_CPU_CASES = [(1, 3, False), (7, 2, True), (33, 5, False), (33, 4, True), (5, 9, True)]


def _assert_knob_gives_the_defaults_bits_on_the_cpu(knob: str, h: int, cases, tmp_path, monkeypatch) -> None:
    """The knob's CUDA source on the CPU gives the bits of the kernel without it (``cases``: ``(tokens, partials,
    strided)``)."""
    monkeypatch.setattr(K, knob, False)
    default = _emulated_gate(h, tmp_path / "default")
    monkeypatch.setattr(K, knob, True)
    assert _TAKES[knob](h)
    variant = _emulated_gate(h, tmp_path / knob)
    for tokens, partials, strided in cases:
        a = make_inputs(tokens, h)
        if strided:
            a = _strided(a)
        assert_bits(variant(a, partials), default(a, partials))


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("h, cases", [(1024, _CPU_CASES), (4096, [(7, 3, True)])])
def test_prefetch_gives_the_defaults_bits_on_the_cpu(h, cases, tmp_path, monkeypatch):
    """PREFETCH's CUDA source on the CPU: the default kernel's bits."""
    _assert_knob_gives_the_defaults_bits_on_the_cpu("PREFETCH", h, cases, tmp_path, monkeypatch)


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("h, cases", [(7168, _CPU_CASES), (4608, [(7, 3, True)])])
def test_xk_async_gives_the_defaults_bits_on_the_cpu(h, cases, tmp_path, monkeypatch):
    """XK_ASYNC's CUDA source on the CPU: the default kernel's bits."""
    _assert_knob_gives_the_defaults_bits_on_the_cpu("XK_ASYNC", h, cases, tmp_path, monkeypatch)


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
def test_reduce_source_on_the_cpu(tmp_path, monkeypatch):
    """grad_w_reduce's CUDA source on the CPU: bit for bit the reference for P = 0, 4, 12, 132 (not multiples of the
    rows a thread loads ahead: 32 by default, 3 and 8 here) and with 1 or 4 elements a thread."""
    m_, h = 4, 1024
    n = m_ * h
    for rows, vec in ((K.REDUCE_ROWS, K.REDUCE_VEC), (3, 4), (8, 1)):
        monkeypatch.setattr(K, "REDUCE_ROWS", rows)
        monkeypatch.setattr(K, "REDUCE_VEC", vec)
        src = _jit.compile_kernel("engram_grad_w_reduce", (), "sm_90", export=False).get_kernel_source()
        run = emu.build(src, "engram_grad_w_reduce_kernel", K.REDUCE_THREADS, tmp_path / f"{rows}-{vec}")
        for p in (0, 4, 12, 132):
            partial = torch.randn(p, m_, h)
            wh, we = torch.randn(m_, h).bfloat16(), torch.randn(m_, h).bfloat16()
            acc_h, acc_e = torch.randn(m_, h), torch.randn(m_, h)
            want_h, want_e = acc_h.clone(), acc_e.clone()
            R._grad_w_reduce(partial, wh, we, want_h, want_e)
            run(dict(PART=partial, WH=wh, WE=we, AH=acc_h, AE=acc_e, num_partials=p, numel=n),
                -(-n // (vec * K.REDUCE_THREADS)))
            assert torch.equal(acc_h, want_h) and torch.equal(acc_e, want_e), p


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
def test_public_ops_take_the_kernel_path_on_the_cpu(tmp_path, monkeypatch):
    """The public ops end to end (validation, dispatch, launcher, kernel) with the kernels emulated on the CPU:
    ``k``, ``v`` views into one projection and a ``v`` row stride that is not a multiple of 8 (copied), one token,
    no tokens; then grad_w_reduce of the partial into random accumulators. Bit for bit (``dg`` exact)."""
    emu.emulate_launches(monkeypatch, tmp_path)
    a = make_inputs(37, 1024, exact=True)
    want = ieee_reference(a, 8, monkeypatch)
    odd = torch.empty(37, 1025, dtype=torch.bfloat16)[:, :1024]
    odd.copy_(a["v"])
    for args in (_strided(a), dict(a, v=odd)):
        got = E.engram_gate_bwd(*bwd_args(args), CLAMP, num_sms=8)
        assert_bits(got, want)
    acc = [torch.randn(4, 1024), torch.randn(4, 1024)]
    want_acc = [t.clone() for t in acc]
    R._grad_w_reduce(want[3], a["wh"], a["we"], *want_acc)
    E.grad_w_reduce(got[3], a["wh"], a["we"], *acc)
    assert_bits(acc, want_acc)
    for tokens in (1, 0):
        one = make_inputs(tokens, 1024, exact=True)
        assert_bits(E.engram_gate_bwd(*bwd_args(one), CLAMP, num_sms=4), ieee_reference(one, 4, monkeypatch))


@pytest.mark.compile
def test_launchers_bind_their_arguments(monkeypatch):
    """Strided, 16-byte-aligned ``k``/``v`` views are passed as they are; a stride that is not a multiple of 8
    elements goes through a contiguous copy; no tokens: no launch, zero partial rows."""
    calls = fake_jit(monkeypatch)
    a = _strided(make_inputs(6, 1024))
    out = K.gate_bwd_launch(*bwd_args(a), CLAMP, 5)
    assert [o.shape for o in out] == [(6, 4, 1024), (6, 4, 1024), (6, 1024), (5, 4, 1024)]
    assert [o.dtype for o in out] == [torch.bfloat16] * 3 + [torch.float32]
    env = calls[-1].env
    assert calls[-1].cfg == (1024,)
    assert (env["num_tokens"], env["num_partials"], env["k_token_stride"], env["v_token_stride"]) == (6, 5, 5120, 5120)
    odd = torch.empty(6, 1025, dtype=torch.bfloat16)[:, :1024]  # row stride 1025
    odd.copy_(a["v"])
    K.gate_bwd_launch(*bwd_args(dict(a, v=odd)), CLAMP, 5)
    assert calls[-1].env["v_token_stride"] == 1024
    empty = make_inputs(0, 1024)
    out = K.gate_bwd_launch(*bwd_args(empty), CLAMP, 3)
    assert len(calls) == 2 and torch.equal(out[3], torch.zeros(3, 4, 1024))
    K.grad_w_reduce_launch(torch.randn(12, 4, 1024), a["wh"], a["we"], torch.zeros(4, 1024), torch.zeros(4, 1024))
    assert calls[-1].name == "engram_grad_w_reduce" and calls[-1].env == {"num_partials": 12, "numel": 4096}


def test_cpu_tensors_keep_the_reference():
    a = make_inputs(3, 1024)
    assert not K.takes(a["x"]) and not K.takes_reduce(torch.zeros(4, 4, 1024))
    got = E.engram_gate_bwd(*bwd_args(a), CLAMP, num_sms=4)
    assert_bits(got, R._gate_bwd(*bwd_args(a), CLAMP, 4))


# ---- gpu tier ----

@pytest.fixture
def poisoned(poison_outputs):
    """The launchers allocate their outputs filled with NaN."""
    poison_outputs(K)


@pytest.mark.gpu
@pytest.mark.parametrize("h", GRID_H)
@pytest.mark.parametrize("tokens", GRID_T)
def test_grid_against_the_reference(tokens, h, poisoned):
    a = make_inputs(tokens, h, device="cuda")
    assert K.takes(a["x"])
    got = E.engram_gate_bwd(*bwd_args(a), CLAMP)
    assert got[3].shape == (DEFAULT_NUM_SMS, 4, h)
    assert_close_to_reference(got, a, DEFAULT_NUM_SMS)
    if tokens == 0:
        assert torch.equal(got[3], torch.zeros_like(got[3]))


@pytest.mark.gpu
@pytest.mark.parametrize("h", GRID_H)
@pytest.mark.parametrize("partials", (DEFAULT_NUM_SMS, 5))
def test_exact_dg_gives_the_reference_bits(h, partials, poisoned, monkeypatch):
    a = make_inputs(257, h, device="cuda", exact=True)
    assert_bits(E.engram_gate_bwd(*bwd_args(a), CLAMP, num_sms=partials), ieee_reference(a, partials, monkeypatch))


@pytest.mark.gpu
def test_weight_gradients_against_autograd(poisoned):
    """Spec §3.2's backward check: autograd through ``engram_gate_ref`` (weights as fp32 leaves) against the kernel
    fed the reference's statistics, the weight gradients formed by grad_w_reduce into zero accumulators."""
    t, h = 4001, 4096
    a = make_inputs(t, h, device="cuda")
    got = E.engram_gate_bwd(*bwd_args(a), CLAMP)
    gw_h, gw_e = torch.zeros(4, h, device="cuda"), torch.zeros(4, h, device="cuda")
    E.grad_w_reduce(got[3], a["wh"], a["we"], gw_h, gw_e)
    leaves = [a["x"].clone().requires_grad_(), a["k"].clone().requires_grad_(), a["v"].clone().requires_grad_(),
              a["wh"].float().requires_grad_(), a["we"].float().requires_grad_()]
    R.engram_gate_ref(*leaves, CLAMP, EPS).backward(a["go"])
    for mine, leaf in zip((got[0], got[1], got[2], gw_h, gw_e), leaves):
        assert calc_diff(mine.float(), leaf.grad.float()) < BWD_DIFF


@pytest.mark.gpu
@pytest.mark.parametrize("partials", (4, 12, 132, 396))
def test_grad_w_reduce_bitwise(partials):
    h = 7168
    partial = torch.randn(partials, 4, h, device="cuda")
    wh, we = torch.randn(4, h, device="cuda").bfloat16(), torch.randn(4, h, device="cuda").bfloat16()
    acc_h, acc_e = torch.randn(4, h, device="cuda"), torch.randn(4, h, device="cuda")
    want_h, want_e = acc_h.cpu(), acc_e.cpu()
    R._grad_w_reduce(partial.cpu(), wh.cpu(), we.cpu(), want_h, want_e)
    E.grad_w_reduce(partial, wh, we, acc_h, acc_e)
    assert torch.equal(acc_h.cpu(), want_h) and torch.equal(acc_e.cpu(), want_e)


@pytest.mark.gpu
def test_strided_and_misaligned_k_v(poisoned):
    """Views into one fused projection, and views starting 2 bytes into their storage (copied by the launcher):
    the bits of contiguous copies."""
    a = make_inputs(300, 4096, device="cuda")
    want = E.engram_gate_bwd(*bwd_args(a), CLAMP)
    t, _, h = a["x"].shape
    kv = torch.empty(t, 5, h, dtype=torch.bfloat16, device="cuda")
    kv[:, :4], kv[:, 4] = a["k"], a["v"]
    assert_bits(E.engram_gate_bwd(*bwd_args(dict(a, k=kv[:, :4], v=kv[:, 4])), CLAMP), want)
    kb = torch.empty(t, 4, h + 1, dtype=torch.bfloat16, device="cuda")[..., 1:]
    vb = torch.empty(t, h + 1, dtype=torch.bfloat16, device="cuda")[:, 1:]
    kb.copy_(a["k"])
    vb.copy_(a["v"])
    assert_bits(E.engram_gate_bwd(*bwd_args(dict(a, k=kb, v=vb)), CLAMP), want)


@pytest.mark.gpu
def test_deterministic_and_batch_invariant(poisoned):
    """Two runs: the same bits. A token's grad_x/k/v rows do not depend on the batch around it; a chunk's partial
    row is that chunk alone reduced into one partial (so grad_w_reduce sees the same rows whatever else is in the
    batch); grad_w_reduce of the same partials is the same bits."""
    t, h, p = 300, 7168, 8
    a = make_inputs(t, h, device="cuda")
    first = E.engram_gate_bwd(*bwd_args(a), CLAMP, num_sms=p)
    assert_bits(E.engram_gate_bwd(*bwd_args(a), CLAMP, num_sms=p), first)
    rows = slice(100, 180)
    sub = {n: (v[rows].clone() if n not in ("w", "wh", "we") else v) for n, v in a.items()}
    got = E.engram_gate_bwd(*bwd_args(sub), CLAMP, num_sms=p)
    assert_bits(got[:3], [o[rows] for o in first[:3]])
    q = -(-t // p)
    for c in (0, 3, p - 1):  # the last chunk is short (300 = 7 * 38 + 34)
        span = slice(c * q, min((c + 1) * q, t))
        one = {n: (v[span].clone() if n not in ("w", "wh", "we") else v) for n, v in a.items()}
        assert torch.equal(E.engram_gate_bwd(*bwd_args(one), CLAMP, num_sms=1)[3][0], first[3][c])
    acc = [torch.zeros(4, h, device="cuda") for _ in range(4)]
    E.grad_w_reduce(first[3], a["wh"], a["we"], acc[0], acc[1])
    E.grad_w_reduce(first[3].clone(), a["wh"], a["we"], acc[2], acc[3])
    assert torch.equal(acc[0], acc[2]) and torch.equal(acc[1], acc[3])


@pytest.mark.gpu
@pytest.mark.parametrize("partials", (1, 7, 300))
def test_other_partial_counts(partials, poisoned, monkeypatch):
    """num_sms sets the partial rows (never the device's SM count); more partials than tokens leave zero rows."""
    t, h = 257, 1024
    a = make_inputs(t, h, device="cuda", exact=True)
    got = E.engram_gate_bwd(*bwd_args(a), CLAMP, num_sms=partials)
    assert got[3].shape == (partials, 4, h)
    assert_bits(got, ieee_reference(a, partials, monkeypatch))
    if partials > t:
        assert torch.equal(got[3][t:], torch.zeros_like(got[3][t:]))


def _assert_knob_gives_the_defaults_bits(knob: str, h: int, knob_kernels) -> None:
    """The knob's other value gives the shipped kernel's bits at one token, odd counts and the bench's 8192 tokens,
    contiguous and strided ``k``, ``v``, with one partial and with the default's."""
    cases = []
    for tokens in (1, 7, 33, 4001, 8192):
        a = make_inputs(tokens, h, device="cuda")
        for args in (a, _strided(a)):
            for partials in (1, DEFAULT_NUM_SMS):
                cases.append((args, partials, E.engram_gate_bwd(*bwd_args(args), CLAMP, num_sms=partials)))
    value = not getattr(K, knob)
    knob_kernels(K, {knob: value})
    assert _TAKES[knob](h) == value
    for args, partials, want in cases:
        got = E.engram_gate_bwd(*bwd_args(args), CLAMP, num_sms=partials)
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), (args["x"].shape, partials, i)


@pytest.mark.gpu
@pytest.mark.knobs
@pytest.mark.parametrize("h", (1024, 4096))
def test_prefetch_gives_the_defaults_bits(h, poisoned, knob_kernels):
    """PREFETCH on (outputs poisoned with NaN first): the shipped kernel's bits."""
    _assert_knob_gives_the_defaults_bits("PREFETCH", h, knob_kernels)


@pytest.mark.gpu
@pytest.mark.knobs
@pytest.mark.parametrize("h", (4608, 7168))
def test_xk_async_gives_the_defaults_bits(h, poisoned, knob_kernels):
    """XK_ASYNC off (outputs poisoned with NaN first): the shipped kernel's (XK_ASYNC on) bits."""
    _assert_knob_gives_the_defaults_bits("XK_ASYNC", h, knob_kernels)


@pytest.mark.gpu
def test_hidden_beyond_the_kernel_keeps_the_reference():
    a = make_inputs(3, BEYOND_H, device="cuda")
    assert not K.takes(a["x"])
    assert_bits(E.engram_gate_bwd(*bwd_args(a), CLAMP), R._gate_bwd(*bwd_args(a), CLAMP, DEFAULT_NUM_SMS))


def _step(go, x, k, v, w, d, g, rx, rk, wh, we, acc_h, acc_e):
    grads = E.engram_gate_bwd(go, x, k, v, w, d, g, rx, rk, CLAMP)
    E.grad_w_reduce(grads[3], wh, we, acc_h, acc_e)
    return grads


@pytest.mark.gpu
def test_cuda_graph_replay():
    h = 4096
    a = make_inputs(513, h, device="cuda")
    acc = [torch.zeros(4, h, device="cuda"), torch.zeros(4, h, device="cuda")]
    args = [*bwd_args(a), a["wh"], a["we"]]
    _step(*args, *acc)  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(*args, *acc)
    new = make_inputs(513, h, device="cuda")
    for t, n in zip(args, [*bwd_args(new), new["wh"], new["we"]]):
        t.copy_(n)
    start = [torch.randn(4, h, device="cuda"), torch.randn(4, h, device="cuda")]
    for t, s in zip(acc, start):
        t.copy_(s)
    for o in out:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want_acc = [s.clone() for s in start]
    want = _step(*[t.clone() for t in args], *want_acc)
    assert_bits(out, want)
    assert_bits(acc, want_acc)


@pytest.mark.gpu
def test_torch_compile_fullgraph(poisoned):
    h = 1024
    a = make_inputs(129, h, device="cuda")
    args = [*bwd_args(a), a["wh"], a["we"]]
    start = torch.randn(4, h, device="cuda")
    eager_acc = [start.clone(), start.clone()]
    want = _step(*args, *eager_acc)
    acc = [start.clone(), start.clone()]
    got = torch.compile(_step, fullgraph=True)(*args, *acc)
    assert_bits(got, want)
    assert_bits(acc, eager_acc)
