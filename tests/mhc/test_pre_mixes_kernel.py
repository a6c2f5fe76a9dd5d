"""Kernel tiers of the fused pre's small steps (``_pre_mixes_kernel``: reduce + RMS, split mixes and Sinkhorn in one
launch; mhc.md §2.8, §3 contract 2).

* compile tier: the kernel builds for sm_90 at n in {2, 4}, S in {1, 16} with IEEE arithmetic (no fast-math
  exponential, only the Sinkhorn reciprocal's seed is an approximate division); the launcher binds its arguments;
  the generated CUDA of this kernel and of the chain's three kernels (reduce/RMS, split, Sinkhorn), run on the
  CPU with g++, give the same bits for T = 1, 7 and 4001 (a partial last CTA), standard, large and small logits and
  Sinkhorn eps 0 (zero column sums: the IEEE fallback, NaN), also under the knob sets (the Sinkhorn macros' plain
  division and reciprocal, 64 threads a CTA); ``pre_chain``'s fused path binds one launch (none at
  T = 0) and hands the pre mix to the apply; ``takes`` is the chain's kernel conditions.
* gpu tier: ``mhc_pre_big_fuse_fwd`` and ``mhc_pre_big_fuse`` with the kernel against the four-kernel chain
  (``ENABLED = False``), ``torch.equal`` on NaN-poisoned outputs, T in {0, 1, 7, 4001, 8192}; the kernel is the
  path taken; CUDA-graph replay; batch invariance; ``torch.compile(fullgraph=True)`` (the custom op).

No tolerances: the contract is bit-identity with the unfused chain.
"""
import ctypes

import pytest
import torch

from tilefuse import _jit
from tilefuse.mhc import _mix_kernel as MK, _pre_mixes_kernel as K, _reduce_norm_kernel as RK
from tilefuse.mhc import _sinkhorn_kernel as SK
from tilefuse.mhc import mhc_pre_big_fuse, mhc_pre_big_fuse_fwd
from tests.cuda_emulation import HAS_GXX, compile_run, signature, values
from tests.mhc import norm_emulation
from tests.mhc.configs_pre_mixes import pre_mixes_configs
from tests.mhc import post_emulation as emu
from tests.mhc.mhc_helpers import BF16
from tests.quant.kernel_binding import fake_jit

CONFIGS = pre_mixes_configs()  # (n, S) the tests build and launch
EPS, V, REPEAT = 1e-6, 1.0, 10
TOKENS = (0, 1, 7, 4001, 8192)


def _partials(S, t, n, c, device="cpu", scale=1.0):
    """Split partials as the projection's (``[S, t, M]``, ``[S, t]``: sums of squares positive), scale and base;
    ``scale`` multiplies the mix scale, so the logits are ``scale`` times their usual spread."""
    m, k = n * (n + 2), n * c
    ps = torch.randn(S, t, m, device=device) * (k / S) ** 0.5 * 1e-2
    qs = (0.5 + torch.rand(S, t, device=device)) * (k / S)
    return ps, qs, torch.randn(3, device=device) * 0.1 * scale, torch.randn(m, device=device) * 0.1


def _bits(x):
    return x.view(torch.int32)  # NaN payloads and the sign of zero count too


# ---- compile tier ----

def _source(name, cfg):
    return _jit.compile_kernel(name, cfg, "sm_90", export=False).get_kernel_source()


@pytest.mark.compile
@pytest.mark.parametrize("n,S", sorted(set(CONFIGS) | set(K._configs())), ids=str)
def test_builds_for_sm90_with_ieee_arithmetic(n, S):
    import re

    src = _source("mhc_pre_mixes_fwd", (n, S))
    assert "__global__" in src and "__shfl" not in src and "__syncthreads" not in src
    assert "expf(" in src and "__expf" not in src and "rsqrtf(" in src
    if SK.FAST_DIV and SK.RCP_APPROX:  # the only approximate division: the Sinkhorn reciprocal's MUFU seed
        assert not re.search(r"__fdividef\((?!0x1p\+0f)", src)
    else:
        assert "__fdividef" not in src
    # the split partials: S unrolled adds into each of the M sums and into Q, each an explicit __fadd_rn
    m = n * (n + 2)
    assert len(re.findall(r"p\[\w+\] = __fadd_rn\(p\[\w+\], ld\[\w+\]\)", src)) == 1  # one unrolled loop
    assert re.search(rf"for \(int s = 0; s < {S}; \+\+s\)", src) or S == 1
    assert re.search(rf"float p\[{m}\];", src)


@pytest.mark.compile
@pytest.mark.parametrize("n,S", CONFIGS, ids=str)
def test_launcher_binds_its_arguments(n, S, monkeypatch):
    calls = fake_jit(monkeypatch)
    for t in (7, 0):
        ps, qs, scale, base = _partials(S, t, n, 8)
        outs = (torch.empty(t, n), torch.empty(t, n), torch.empty(t, n * n))
        K.pre_mixes_launch(ps, qs, scale, base, *outs, n * 8, EPS, V, EPS, REPEAT, EPS)
    assert [(c.name, c.cfg) for c in calls] == [("mhc_pre_mixes_fwd", (n, S))]
    assert calls[0].env["num_tokens"] == 7


@pytest.mark.compile
@pytest.mark.parametrize("t", (0, 7))
@pytest.mark.parametrize("given", (False, True), ids=("fresh", "out"))
def test_pre_chain_launches_the_kernel_then_the_apply(t, given, monkeypatch):
    """``pre_chain``'s fused path on CPU tensors standing for CUDA ones (``takes`` forced, launches bound by
    ``fake_jit``): one launch of this kernel (none at T = 0), its pre mix into the apply, post and comb written
    into the caller's buffers where given, the chain's shapes returned."""
    from tilefuse.mhc import _functions as F

    n, S, c = 4, 16, 64
    calls = fake_jit(monkeypatch)
    monkeypatch.setattr(K, "takes", lambda *args: True)
    applied = []
    monkeypatch.setattr(F, "apply_mix_fwd_into", lambda x, mix, o: applied.append((x, mix, o)))
    ps, qs, sc, bs = _partials(S, t, n, c)
    res = torch.randn(t, n, c).to(BF16)
    out = (torch.empty(t, n), torch.empty(t, n * n), torch.empty(t, c, dtype=BF16)) if given else None
    post, comb, li = F.pre_chain(ps.unsqueeze(2), qs.unsqueeze(2), res, sc, bs, EPS, EPS, EPS, V, REPEAT, out)
    assert post.shape == (t, n, 1) and comb.shape == (t, n, n) and li.shape == (t, c) and li.dtype == BF16
    assert [(call.name, call.cfg) for call in calls] == ([("mhc_pre_mixes_fwd", (n, S))] if t else [])
    assert len(applied) == 1 and applied[0][0] is res and applied[0][1].shape == (t, n) and applied[0][2] is li
    if given:
        assert li is out[2]
        assert post.untyped_storage().data_ptr() == out[0].untyped_storage().data_ptr()
        assert comb.untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()


def test_takes_exactly_where_the_chain_takes_its_kernels(monkeypatch):
    """``takes`` on meta tensors standing for CUDA ones: the reduce kernel's S and group-size limits, one group,
    fp32 partials, the Sinkhorn kernel's n and repeat, and the knob."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    ps, qs = torch.empty(16, 5, 1, 24, device="meta"), torch.empty(16, 5, 1, device="meta")
    assert K.takes(ps, qs, 4, 4096, 10)
    assert not K.takes(ps, qs, 4, 4096, 0)
    assert not K.takes(ps, qs.double(), 4, 4096, 10)
    assert not K.takes(ps.double(), qs, 4, 4096, 10)
    assert not K.takes(torch.empty(65, 5, 1, 24, device="meta"), qs, 4, 4096, 10)  # S > MAX_S
    assert not K.takes(ps, qs, 4, 2 ** 22, 10)  # n C = 2^24: not exact in fp32 for the reduce kernel
    assert not K.takes(torch.empty(16, 5, 1, 80, device="meta"), qs, 8, 4096, 10)  # n = 8: the reference Sinkhorn
    assert K.takes(torch.empty(1, 5, 1, 8, device="meta"), qs[:1], 2, 8, 1)
    monkeypatch.setattr(K, "ENABLED", False)
    assert not K.takes(ps, qs, 4, 4096, 10)


# The chain's kernels and this one, their generated CUDA run on the CPU. Shim: post_emulation's (IEEE __f*_rn, a
# warp's exchange through 32 host threads), rsqrtf as norm_emulation's, PDL's wait as nothing,
# __syncthreads a barrier of the CTA's host threads, shared memory one array (CTAs in turn), and the Sinkhorn
# reciprocal's seed __fdividef(1, d) = RN(1 / d) (the sinkhorn tests' shim: the Newton step ends at RN(1 / d) from
# either).
_EXTRA = norm_emulation.EXTRA + r"""
static inline void cudaGridDependencySynchronize() {}
static inline void __syncthreads() { g_bar->arrive_and_wait(); }
static inline float __fdividef(float a, float b) { volatile float r = a / b; return r; }
static inline float __frcp_rn(float b) { volatile float r = 1.0f / b; return r; }
"""


def _cpu_kernel(src, name, threads, mode, workdir):
    """``run(args: dict, blocks)`` of kernel ``name`` of ``src`` on the CPU. ``mode``: ``"warps"``, each warp's 32
    threads run as host threads (shuffles); ``"cta"``, a CTA's threads as host threads
    (``__syncthreads``); ``"serial"``, a CTA's threads one after another."""
    import re

    body = src[src.index('extern "C" __global__ void __launch_bounds__'):]
    body = re.sub(r"extern __shared__ __align__\(\d+\) float (\w+)\[\];", r"alignas(16) static float \1[1 << 16];", body)
    decl, cargs, call = signature(body, name)
    loop = emu.launch_loop(mode, name, call, threads)
    cpp = emu.SHIM + _EXTRA + body.replace('extern "C" __global__', "static") + f"""
extern "C" void run({cargs}, int64_t blocks) {{
  {loop}
}}
"""
    fn = compile_run(cpp, name, workdir)

    def run(args, blocks):
        fn(*values(decl, args), ctypes.c_int64(blocks))

    return run


def _cdiv(a, b):
    return -(-a // b)


# knob sets the CPU run also covers (results unchanged): the Sinkhorn macros' plain IEEE division and __frcp_rn
# reciprocal, 64 threads a CTA
KNOB_SETS = ((SK, "FAST_DIV", False), (SK, "RCP_APPROX", False), (K, "THREADS", 64))


@pytest.mark.compile
@pytest.mark.skipif(not HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("n,S,knob", [(n, s, None) for n, s in CONFIGS] + [(4, 16, k) for k in KNOB_SETS],
                         ids=lambda v: f"{v[1]}={v[2]}" if isinstance(v, tuple) else str(v))
def test_cpu_run_is_the_chain_bit_for_bit(n, S, knob, tmp_path, monkeypatch):
    if knob is not None:
        monkeypatch.setattr(*knob)
    # the chain's split forward as a thread a token (run serially here); SPLIT_FWD_FLAT gives its bits (test_mix_kernel)
    monkeypatch.setattr(MK, "SPLIT_FWD_FLAT", False)
    m, nn, c = n * (n + 2), n * n, 64
    fused = _cpu_kernel(_source("mhc_pre_mixes_fwd", (n, S)), "mhc_pre_mixes_kernel", K.THREADS, "cta",
                        tmp_path / "fused")
    reduce = _cpu_kernel(_source("mhc_reduce_rmsnorm_fwd", (S, 1, m)), "mhc_reduce_rmsnorm_fwd_kernel",
                         RK.FWD_THREADS, "serial", tmp_path / "reduce")
    split = _cpu_kernel(_source("mhc_split_mixes_fwd", (n,)), "mhc_split_mixes_fwd_kernel", MK.SPLIT_FWD_THREADS,
                        "serial", tmp_path / "split")
    # the chain's Sinkhorn kernel shares its macros with the fused kernel; the sinkhorn tests' CPU runs hold those
    # macros to a torch model of the butterflies bit for bit
    sinkhorn = _cpu_kernel(_source("mhc_sinkhorn_fwd", (n,)), "sinkhorn_fwd_kernel", SK.PT_THREADS, "serial",
                           tmp_path / "sinkhorn")
    # (tokens, logit scale, Sinkhorn eps, repeat): tails, large (30, 1e3) and small (1e-4) logits, huge logits at
    # eps 0 (underflowing exponentials: zero sums, NaN through the IEEE fallback), one step, a long chain
    cases = [(1, 1.0, EPS, REPEAT), (7, 1.0, EPS, 1), (4001, 1.0, EPS, REPEAT), (7, 30.0, EPS, 20),
             (37, 1e3, EPS, 3), (37, 1e-4, EPS, REPEAT), (37, 1e3, 0.0, 3), (37, 30.0, 0.0, 5)]
    for t, scale, sk_eps, repeat in cases:
        ps, qs, sc, bs = _partials(S, t, n, c, scale=scale)
        ps[:, : min(t, 2), :3] = -0.0  # signed zeros through the sums
        kg = float(n * c)
        pre, post, comb = (torch.full((t, w), float("nan")) for w in (n, n, nn))
        fused({"PS": ps, "QS": qs, "SC": sc, "BS": bs, "PRE": pre, "POST": post, "COMB": comb, "kg": kg,
               "rms_eps": EPS, "v": V, "pre_eps": EPS, "repeat": repeat, "eps": sk_eps, "num_tokens": t},
              _cdiv(t, K.THREADS))
        pm, qm, mixes = torch.full((t, 1, m), float("nan")), torch.full((t, 1), float("nan")), torch.empty(t, m)
        reduce({"PS": ps.unsqueeze(2), "QS": qs.unsqueeze(2), "PM": pm, "QM": qm, "OUT": mixes, "kg": kg,
                "eps": EPS, "num_tokens": t}, _cdiv(t * m, RK.FWD_THREADS))
        pre_u, post_u, logits = (torch.full((t, w), float("nan")) for w in (n, n, nn))
        split({"X": mixes, "S": sc, "Bs": bs, "PRE": pre_u, "POST": post_u, "COMB": logits, "v": V, "eps": EPS,
               "Tn": t}, _cdiv(t, MK.SPLIT_FWD_THREADS))
        comb_u = torch.full((t, nn), float("nan"))
        sinkhorn({"X": logits, "Y": comb_u, "repeat": repeat, "eps": sk_eps, "num_tokens": t},
                 _cdiv(t, SK.PT_THREADS))
        case = (t, scale, sk_eps, repeat)
        assert not pre_u.isnan().any() and not post_u.isnan().any(), case
        assert torch.equal(_bits(pre), _bits(pre_u)), case
        assert torch.equal(_bits(post), _bits(post_u)), case
        assert torch.equal(_bits(comb), _bits(comb_u)), case
        if sk_eps > 0:
            assert not comb.isnan().any(), case
            assert (comb.view(t, n, n).sum(-2) - 1).abs().max() < 1e-3, case  # columns normalised: a real Sinkhorn


# ---- gpu tier ----

def _fwd(ps, qs, scale, base, res, repeat=REPEAT):
    t, n, c = res.shape
    post, comb, li = (torch.full((t, n), float("nan"), device="cuda"),
                      torch.full((t, n * n), float("nan"), device="cuda"),
                      torch.full((t, c), float("nan"), device="cuda", dtype=BF16))
    mhc_pre_big_fuse_fwd(ps, qs, scale, base, res, post, comb, li, EPS, EPS, EPS, V, repeat, ps.shape[0])
    return post, comb, li


def _equal(a, b):
    for x, y in zip(a, b):
        assert x.shape == y.shape and torch.equal(x.view(torch.int16 if x.dtype == BF16 else torch.int32),
                                                  y.view(torch.int16 if y.dtype == BF16 else torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("n,S", CONFIGS, ids=str)
@pytest.mark.parametrize("t", TOKENS)
def test_kernel_is_the_four_kernel_chain(n, S, t, monkeypatch):
    c = 1280
    launches = []
    real = K.pre_mixes_launch
    monkeypatch.setattr(K, "pre_mixes_launch", lambda *a: (launches.append(a), real(*a)))
    for scale, repeat in ((1.0, REPEAT), (30.0, 20), (1e-4, 1)):
        ps, qs, sc, bs = _partials(S, t, n, c, "cuda", scale)
        res = torch.randn(t, n, c, device="cuda").to(BF16)
        got = _fwd(ps, qs, sc, bs, res, repeat)
        monkeypatch.setattr(K, "ENABLED", False)
        want = _fwd(ps, qs, sc, bs, res, repeat)
        monkeypatch.setattr(K, "ENABLED", True)
        _equal(got, want)
    assert len(launches) == 3  # the fused path ran with ENABLED (its launcher launches nothing at T = 0)


@pytest.mark.gpu
def test_v1_op_is_the_four_kernel_chain(monkeypatch):
    n, c = 4, 4096
    res = torch.randn(2, 2001, n, c, device="cuda").to(BF16)
    fn = torch.randn(n * (n + 2), n * c, device="cuda") * 1e-2
    scale, base = torch.randn(3, device="cuda") * 0.1, torch.randn(n * (n + 2), device="cuda") * 0.1
    got = mhc_pre_big_fuse(res, fn, scale, base, EPS, EPS, EPS, V, REPEAT)
    monkeypatch.setattr(K, "ENABLED", False)
    _equal(got, mhc_pre_big_fuse(res, fn, scale, base, EPS, EPS, EPS, V, REPEAT))


@pytest.mark.gpu
def test_batch_invariance_and_graph_replay():
    n, S, c, t = 4, 16, 4096, 8192
    ps, qs, sc, bs = _partials(S, t, n, c, "cuda")
    res = torch.randn(t, n, c, device="cuda").to(BF16)
    want = _fwd(ps, qs, sc, bs, res)
    for lo, hi in ((0, 1), (5, 12), (4001, 4001 + 37), (t - 1, t)):
        _equal(_fwd(ps[:, lo:hi].contiguous(), qs[:, lo:hi].contiguous(), sc, bs, res[lo:hi].contiguous()),
               [w[lo:hi] for w in want])
    outs = (torch.full((t, n), float("nan"), device="cuda"), torch.full((t, n * n), float("nan"), device="cuda"),
            torch.full((t, c), float("nan"), device="cuda", dtype=BF16))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mhc_pre_big_fuse_fwd(ps, qs, sc, bs, res, *outs, EPS, EPS, EPS, V, REPEAT, S)
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _equal(outs, want)


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    n, S, c, t = 4, 16, 4096, 4001
    ps, qs, sc, bs = _partials(S, t, n, c, "cuda")
    res = torch.randn(t, n, c, device="cuda").to(BF16)

    def step(ps, qs, sc, bs, res, post, comb, li):
        mhc_pre_big_fuse_fwd(ps, qs, sc, bs, res, post, comb, li, EPS, EPS, EPS, V, REPEAT, S)
        return comb.sum()

    def poisoned():
        return (torch.full((t, n), float("nan"), device="cuda"), torch.full((t, n * n), float("nan"), device="cuda"),
                torch.full((t, c), float("nan"), device="cuda", dtype=BF16))

    got_outs, want_outs = poisoned(), poisoned()
    got = torch.compile(step, fullgraph=True)(ps, qs, sc, bs, res, *got_outs)
    want = step(ps, qs, sc, bs, res, *want_outs)
    _equal(got_outs, want_outs)
    assert torch.equal(got, want)
