"""Kernel tiers of the mHC Sinkhorn (mhc.md §2.4, §5.2): ``sinkhorn_normalize``, ``mhc_sinkhorn_fwd``,
``mhc_sinkhorn_bwd`` on CUDA.

* reference tier: a model of the kernels' arithmetic (butterfly sums, the backward's walk) stays within the
  spec's tolerance of the reference; the kernels' trees are the butterflies' sums; CPU tensors never reach a
  launcher.
* compile tier: every config the package registers and the GPU tests launch builds for sm_90 with IEEE ``expf``
  and division and no contractible sums, and so do the swept knob sets; the kernels' CUDA run on the CPU (g++),
  at the defaults and the swept knob sets, is the model bit for bit; the launchers bind their arguments to the
  prim_funcs.
* gpu tier: kernel against the reference over T in {0, 1, 7, 4001, 8192}, n in {2, 4}, repeat in
  {1, 3, 10, 20, 32}, outputs poisoned with NaN; the v1 op with leading dims, a strided input and autograd;
  n = 8 and repeat 33 (reference path); determinism and batch invariance, forward and backward; CUDA-graph
  replay; ``torch.compile(fullgraph=True)``; every swept knob set gives the defaults' bits; the bench row's
  batch invariance and graph replay.

Tolerance (written once): the spec's contract for Sinkhorn forward and d_x is ``assert_close``'s fp32
defaults (mhc.md §3): FP32_RTOL = 1.3e-6, FP32_ATOL = 1e-5. Upstream's kernels measured 1.8e-7 / 3e-7 max abs
error. The kernels use another summation order than torch (butterflies), so nothing is bitwise against the
reference, but everything is bitwise against itself (determinism, batch invariance, graphs, compile).
"""
import pytest
import torch

from tilefuse import _jit
from tilefuse.mhc import _sinkhorn_kernel as SK
from tilefuse.mhc import mhc_sinkhorn_bwd, mhc_sinkhorn_fwd, sinkhorn_normalize
from tilefuse.reference.mhc import sinkhorn_normalize_bwd_ref, sinkhorn_normalize_ref
from tests.cuda_emulation import build_kernel
from tests.mhc.configs_sinkhorn import MAX_REPEAT, N_VALUES, REPEATS, bwd_configs, fwd_configs
from tests.quant.kernel_binding import fake_jit

FP32_RTOL, FP32_ATOL = 1.3e-6, 1e-5
EPS = 1e-6
TOKENS = (0, 1, 7, 4001, 8192)


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=FP32_RTOL, atol=FP32_ATOL)


# ---- a model of the kernels' arithmetic (fp32, CPU) ----

def _distances(n, over):
    """XOR distances of a butterfly over a row (``"row"``: across k, ``n/2, ..., 1``) or a column (``"col"``: across
    j, ``n^2/2, ..., n``) of the ``n^2`` lanes ``l = j n + k``."""
    out, d, stop = [], (n // 2 if over == "row" else n * n // 2), (1 if over == "row" else n)
    while d >= stop:
        out.append(d)
        d //= 2
    return tuple(out)


def _butterfly(v, over, op):
    """An XOR butterfly on ``[T, n, n]``: lane ``l`` of a matrix combines with lane ``l ^ d``; every lane of a row
    or column ends with the same bits (``op`` commutes)."""
    n = v.shape[-1]
    flat = v.reshape(-1, n * n)
    lane = torch.arange(n * n)
    for d in _distances(n, over):
        flat = op(flat, flat[:, lane ^ d])
    return flat.view(v.shape)


def _bsum(v, over):
    return _butterfly(v, over, torch.add)


def _softmax(x, exp=torch.exp):
    e = exp(x - _butterfly(x, "row", torch.maximum))
    return e / _bsum(e, "row")


def _steps(repeat):
    return ["col" if s % 2 == 0 else "row" for s in range(2 * repeat - 1)]


def model_fwd(x, repeat, eps, exp=torch.exp):
    a = _softmax(x, exp) + eps
    for over in _steps(repeat):
        a = a / (_bsum(a, over) + eps)
    return a


def model_bwd(g, x, repeat, eps, exp=torch.exp):
    a0 = _softmax(x, exp)
    a, kept = a0 + eps, []
    for over in _steps(repeat):
        den = _bsum(a, over) + eps
        kept.append((over, a, den))
        a = a / den
    for over, u, den in reversed(kept):
        g = (g - _bsum(g * u, over) / den) / den
    return (g - _bsum(g * a0, "row")) * a0


def test_distances_are_the_row_and_column_butterflies():
    assert _distances(4, "row") == (2, 1) and _distances(4, "col") == (8, 4)
    assert _distances(2, "row") == (1,) and _distances(2, "col") == (2,)
    # n = 4: a row sums to (e0 + e2) + (e1 + e3), upstream's forward order (mhc.md §2.4), in the model and the kernels
    row = [1.0, 2.0 ** -24, -1.0, 2.0 ** -24]
    want = (1.0 + -1.0) + (2.0 ** -24 + 2.0 ** -24)
    e = torch.tensor([row]).expand(4, 4).reshape(1, 4, 4)
    assert _bsum(e, "row")[0, 0, 0].item() == want
    assert SK._tree([torch.tensor(v) for v in row], torch.add).item() == want


@pytest.mark.parametrize("n", N_VALUES)
@pytest.mark.parametrize("repeat", REPEATS + (MAX_REPEAT,))
@pytest.mark.parametrize("scale", (1.0, 30.0, 1e4))  # standard normal (the spec's data) and wide logits
def test_model_of_the_kernels_is_within_the_spec_tolerance(n, repeat, scale):
    x = torch.randn(2000, n, n) * scale
    g = torch.randn(2000, n, n)  # worst model error seen: 3.6e-7 (fwd), 6.6e-7 (bwd)
    _close(model_fwd(x, repeat, EPS), sinkhorn_normalize_ref(x, repeat, EPS))
    _close(model_bwd(g, x, repeat, EPS), sinkhorn_normalize_bwd_ref(g, x, repeat, EPS))


def test_cpu_tensors_never_reach_a_launcher(monkeypatch):
    def refuse(*args):
        raise AssertionError("a CPU tensor reached a launcher")

    for name in ("sinkhorn_fwd_launch", "sinkhorn_bwd_launch", "sinkhorn_fwd_cuda", "sinkhorn_bwd_cuda"):
        monkeypatch.setattr(SK, name, refuse)
    x = torch.randn(5, 4, 4, requires_grad=True)
    sinkhorn_normalize(x, 3, EPS).sum().backward()
    out, d_x = torch.empty(5, 4, 4), torch.empty(5, 4, 4)
    mhc_sinkhorn_fwd(x.detach(), out, 3, EPS)
    mhc_sinkhorn_bwd(torch.randn(5, 4, 4), x.detach(), d_x, 3, EPS)
    assert not SK.fwd_supported(x, 3) and not SK.bwd_supported(x, 3)


# ---- compile tier ----

def _build_with(monkeypatch, knobs, name, cfg):
    import tilelang

    for k, v in knobs.items():
        monkeypatch.setattr(SK, k, v)
    return tilelang.compile(_jit._FACTORIES[name][0](*cfg), target={"kind": "cuda", "arch": "sm_90"},
                            execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS)).get_kernel_source()


def _compiled_configs():
    cfgs = {("mhc_sinkhorn_fwd", c) for c in fwd_configs()} | {("mhc_sinkhorn_bwd", c) for c in bwd_configs()}
    cfgs |= {(name, c) for name, lst in _jit.registered().items() if name.startswith("mhc_sinkhorn")
             for c in lst}
    return sorted(cfgs)


@pytest.mark.compile
@pytest.mark.parametrize("name,cfg", _compiled_configs(), ids=str)
def test_builds_for_sm90_with_ieee_arithmetic(name, cfg):
    import re

    src = _jit.compile_kernel(name, cfg, "sm_90").get_kernel_source()
    n = cfg[0]
    assert "__global__" in src
    assert "__shfl" not in src and "__syncthreads" not in src  # no lane exchange: every thread owns its matrix
    assert "expf(" in src and "__expf" not in src and "__fdividef(0x1p+0f" in src
    assert not re.search(r"__fdividef\((?!0x1p\+0f)", src)  # only the reciprocal's MUFU seed
    # the per-step sums are trees of __fadd_rn: softmax row sums (n - 1 adds each) at least
    assert src.count("__fadd_rn(") >= n * (n - 1)
    if name == "mhc_sinkhorn_bwd":  # the kept iterates live in shared memory, the segment in registers
        assert "kept[" in src and re.search(r"float u\[\d+\];", src)


@pytest.mark.compile
@pytest.mark.parametrize("n", N_VALUES)
def test_launchers_bind_their_arguments(n, monkeypatch):
    calls = fake_jit(monkeypatch)
    for t in (7, 0):
        x, y, g = (torch.randn(t, n, n) for _ in range(3))
        SK.sinkhorn_fwd_launch(x, y, 10, EPS)
        SK.sinkhorn_bwd_launch(g, x, y, 20, EPS)
    assert [(c.name, c.cfg) for c in calls] == [("mhc_sinkhorn_fwd", (n,)), ("mhc_sinkhorn_bwd", (n, 20))]
    assert all(c.env["num_tokens"] == 7 for c in calls)


# ---- gpu tier ----

def _nan(*shape):
    return torch.full(shape, float("nan"), device="cuda")


def _inputs(t, n, scale=1.0):
    return torch.randn(t, n, n, device="cuda") * scale, torch.randn(t, n, n, device="cuda")


def _fwd(x, repeat):
    out = _nan(*x.shape)
    mhc_sinkhorn_fwd(x, out, repeat, EPS)
    return out


def _bwd(g, x, repeat):
    d_x = _nan(*x.shape)
    mhc_sinkhorn_bwd(g, x, d_x, repeat, EPS)
    return d_x


@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("n", N_VALUES)
@pytest.mark.parametrize("repeat", REPEATS + (MAX_REPEAT,))
def test_v21_ops_match_reference(t, n, repeat):
    x, g = _inputs(t, n)
    _close(_fwd(x, repeat), sinkhorn_normalize_ref(x, repeat, EPS))
    _close(_bwd(g, x, repeat), sinkhorn_normalize_bwd_ref(g, x, repeat, EPS))


@pytest.mark.gpu
def test_bench_row_32768_tokens_20_iterations():
    x, g = _inputs(32768, 4)
    _close(_fwd(x, 20), sinkhorn_normalize_ref(x, 20, EPS))
    _close(_bwd(g, x, 20), sinkhorn_normalize_bwd_ref(g, x, 20, EPS))


@pytest.mark.gpu
def test_extreme_logits():
    # wide logits (softmax entries near 0 and 1), equal logits (uniform 1/n exactly at eps = 0), huge logits
    x, g = _inputs(1000, 4, scale=30.0)
    _close(_fwd(x, 10), sinkhorn_normalize_ref(x, 10, EPS))
    _close(_bwd(g, x, 10), sinkhorn_normalize_bwd_ref(g, x, 10, EPS))
    u = torch.full((3, 4, 4), 7.0, device="cuda")
    out = _nan(3, 4, 4)
    mhc_sinkhorn_fwd(u, out, 5, 0.0)
    assert (out == 0.25).all()
    big, g = _inputs(1000, 4, scale=1e4)
    _close(_fwd(big, 10), sinkhorn_normalize_ref(big, 10, EPS))
    _close(_bwd(g, big, 10), sinkhorn_normalize_bwd_ref(g, big, 10, EPS))


@pytest.mark.gpu
@pytest.mark.parametrize("n0,n1", [(1, 1), (1, 1024), (2, 4096)])
def test_v1_op_with_autograd_matches_reference(n0, n1):
    x = torch.randn(n0, n1, 4, 4, device="cuda")
    d_out = torch.randn_like(x)
    xl = x.clone().requires_grad_()
    out = sinkhorn_normalize(xl, 10, EPS)
    (d_x,) = torch.autograd.grad(out, xl, d_out)
    xr = x.clone().requires_grad_()
    ref = sinkhorn_normalize_ref(xr, 10, EPS)
    (d_ref,) = torch.autograd.grad(ref, xr, d_out)
    _close(out, ref)
    _close(d_x, d_ref)


@pytest.mark.gpu
def test_v1_op_strided_input_and_expanded_gradient():
    base = torch.randn(4, 4, 300, device="cuda")
    x = base.permute(2, 0, 1).detach().requires_grad_()  # not contiguous: the op makes it so
    out = sinkhorn_normalize(x, 20, EPS)
    out.sum().backward()  # d_out is an expanded (stride 0) tensor of ones
    xr = base.permute(2, 0, 1).contiguous().requires_grad_()
    sinkhorn_normalize_ref(xr, 20, EPS).sum().backward()
    _close(out, sinkhorn_normalize_ref(xr.detach(), 20, EPS))
    _close(x.grad, xr.grad)


@pytest.mark.gpu
def test_reference_path_for_n8_and_long_backward_chains():
    x, g = _inputs(33, 8)
    assert not SK.fwd_supported(x, 10)
    assert torch.equal(_fwd(x, 10), sinkhorn_normalize_ref(x, 10, EPS))
    assert torch.equal(_bwd(g, x, 10), sinkhorn_normalize_bwd_ref(g, x, 10, EPS))
    x, g = _inputs(33, 4)
    assert SK.fwd_supported(x, MAX_REPEAT + 1) and not SK.bwd_supported(x, MAX_REPEAT + 1)
    _close(_fwd(x, MAX_REPEAT + 1), sinkhorn_normalize_ref(x, MAX_REPEAT + 1, EPS))
    assert torch.equal(_bwd(g, x, MAX_REPEAT + 1), sinkhorn_normalize_bwd_ref(g, x, MAX_REPEAT + 1, EPS))


@pytest.mark.gpu
@pytest.mark.parametrize("n", N_VALUES)
def test_deterministic(n):
    x, g = _inputs(8192, n)
    assert torch.equal(_fwd(x, 20), _fwd(x, 20))
    assert torch.equal(_bwd(g, x, 20), _bwd(g, x, 20))


@pytest.mark.gpu
@pytest.mark.parametrize("n", N_VALUES)
def test_batch_invariance(n):
    x, g = _inputs(8192, n)
    full_y, full_d = _fwd(x, 20), _bwd(g, x, 20)
    for lo, hi in ((0, 1), (5, 12), (4001, 4001 + 37), (8191, 8192)):
        assert torch.equal(_fwd(x[lo:hi].clone(), 20), full_y[lo:hi])
        assert torch.equal(_bwd(g[lo:hi].clone(), x[lo:hi].clone(), 20), full_d[lo:hi])


@pytest.mark.gpu
def test_cuda_graph_replay():
    x, g = _inputs(4001, 4)
    out, d_x = _nan(4001, 4, 4), _nan(4001, 4, 4)
    mhc_sinkhorn_fwd(x, out, 20, EPS)  # warm-up outside the capture (compile and load)
    mhc_sinkhorn_bwd(g, x, d_x, 20, EPS)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mhc_sinkhorn_fwd(x, out, 20, EPS)
        mhc_sinkhorn_bwd(g, x, d_x, 20, EPS)
    for _ in range(2):  # new inputs in the captured buffers, outputs poisoned before each replay
        x.copy_(torch.randn_like(x) * 2)
        g.copy_(torch.randn_like(g))
        out.fill_(float("nan"))
        d_x.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _fwd(x, 20))
        assert torch.equal(d_x, _bwd(g, x, 20))


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    x, g = _inputs(4001, 4)

    def v21(x, g):
        out, d_x = torch.empty_like(x), torch.empty_like(x)
        mhc_sinkhorn_fwd(x, out, 20, EPS)
        mhc_sinkhorn_bwd(g, x, d_x, 20, EPS)
        return out, d_x

    out, d_x = torch.compile(v21, fullgraph=True)(x, g)
    assert torch.equal(out, _fwd(x, 20))
    assert torch.equal(d_x, _bwd(g, x, 20))

    xl = x.view(1, 4001, 4, 4).clone().requires_grad_()
    y = torch.compile(lambda v: sinkhorn_normalize(v, 20, EPS), fullgraph=True)(xl)
    (d,) = torch.autograd.grad(y, xl, g.view(1, 4001, 4, 4))
    assert torch.equal(y.detach().view(4001, 4, 4), _fwd(x, 20))
    assert torch.equal(d.view(4001, 4, 4), _bwd(g, x, 20))


# ---- the kernels' trees and quotients, their CUDA on the CPU, and their swept knob sets ----

# Knob sets: the defaults ({}) and swept ones, which give the defaults' bits (the CPU runs against the model; the GPU
# tier against the default kernels, at the bench's n = 4 at a short and the bench's chain).
VARIANTS = ({},
            {"FAST_DIV": False, "PT_KEEP": 2},
            {"RCP_APPROX": False, "PT_KEEP": 6, "PT_THREADS": 64})


def test_trees_are_the_butterflies_lane_sums():
    """The kernels' row / column trees end with lane 0's bits of the butterfly model, for every group."""
    for n in N_VALUES:
        v = torch.randn(50, n, n) * torch.tensor([1.0, 2.0 ** -24, 1e3, -1.0][:n]).view(1, 1, n)
        for over in ("row", "col"):
            want = _bsum(v, over).reshape(50, n * n)
            flat = v.reshape(50, n * n)
            for gi in range(n):
                got = SK._tree([flat[:, q] for q in SK._members(n, over, gi)], torch.add)
                assert torch.equal(got, want[:, SK._members(n, over, gi)[0]])


def test_shared_reciprocal_quotient_is_ieee_in_its_range(tmp_path):
    """q0 = RN(a y), q = RN(q0 + y (a - d q0)) with y = RN(1/d) is RN(a/d) (Markstein), checked bit for bit on 10^7
    random operand pairs across the whole range the kernels take it in (g++, no contraction)."""
    import ctypes
    import shutil
    import subprocess

    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    src = tmp_path / "markstein.cpp"
    src.write_text(r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
static float from(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static uint32_t to(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
extern "C" long run(long count, int dlo, int dhi, int nlo, int nhi) {
  std::mt19937_64 r(12345);
  long bad = 0;
  for (long i = 0; i < count; i++) {
    float d = from(uint32_t(127 + dlo + long(r() % (dhi - dlo))) << 23 | uint32_t(r() & 0x7fffff));
    float a = from(uint32_t(127 + nlo + long(r() % (nhi - nlo))) << 23 | uint32_t(r() & 0x7fffff) | uint32_t(r() & 1) << 31);
    float y = 1.0f / d, q0 = a * y;
    float q = std::fmaf(y, std::fmaf(-d, q0, a), q0);
    bad += to(q) != to(a / d);
  }
  return bad;
}
""")
    lib = tmp_path / "markstein.so"
    subprocess.run(["g++", "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    run = ctypes.CDLL(str(lib)).run
    run.restype = ctypes.c_long
    log2 = lambda v: int(round(__import__("math").log2(v)))  # noqa: E731
    dlo, dhi, nlo, nhi = (log2(v) for v in (SK.DIV_DEN_LO, SK.DIV_DEN_HI, SK.DIV_NUM_LO, SK.DIV_NUM_HI))
    assert run(ctypes.c_long(10_000_000), dlo, dhi, nlo, nhi) == 0
    # outside the range (subnormal quotients) the shortcut is wrong for some pairs: the range check is needed
    assert run(ctypes.c_long(1_000_000), 1, 20, -126, -110) > 0


@pytest.mark.compile
@pytest.mark.parametrize("knobs", VARIANTS[1:], ids=str)
def test_knob_sets_build_for_sm90(knobs, monkeypatch):
    for name, cfg in (("mhc_sinkhorn_fwd", (4,)), ("mhc_sinkhorn_bwd", (4, 20))):
        src = _build_with(monkeypatch, knobs, name, cfg)
        assert "__shfl" not in src
        assert ("__fdividef" in src) == (knobs.get("FAST_DIV", True) and knobs.get("RCP_APPROX", True))


# The kernels' generated CUDA run on the CPU (g++; one host call a thread, threads in turn: no thread
# reads another's data). Shim: __fadd_rn / __fmul_rn one rounded operation (no contraction), __fmaf_rn = fmaf, the
# reciprocal's MUFU seed __fdividef(1, d) = RN(1 / d) (the GPU's is within an ulp; the Newton step ends at RN(1 / d)
# from either), expf = the float64 exponential rounded to fp32, the same exponential as the model below gets.
_EMU_SHIM = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
typedef unsigned int uint;
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
struct Idx { unsigned x; };
static Idx threadIdx, blockIdx;
#define __launch_bounds__(a, b)
#define __restrict__
static inline void cudaGridDependencySynchronize() {}
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
static inline float __fdividef(float a, float b) { volatile float r = a / b; return r; }
static inline float __frcp_rn(float b) { volatile float r = 1.0f / b; return r; }
static inline float emu_expf(float x) { return (float)std::exp((double)x); }
static inline float max(float a, float b) { return std::fmax(a, b); }
static inline float min(float a, float b) { return std::fmin(a, b); }
#define expf emu_expf
"""


def _emulated(src, kernel, threads, workdir):
    """``run(blocks, **args)`` of ``kernel`` in ``src`` compiled for the CPU, a CTA's threads one after another,
    arguments by the kernel's parameter names (pointers: CPU tensors)."""
    import re

    body = src[src.index('extern "C" __global__ void __launch_bounds__'):]
    body = re.sub(r"extern __shared__ __align__\(\d+\) float (\w+)\[\];", r"static float \1[1 << 20];", body)
    return build_kernel(_EMU_SHIM, body, kernel, threads, "serial", workdir)


def _exp64(v):
    return torch.exp(v.double()).float()


@pytest.mark.compile
@pytest.mark.parametrize("knobs", VARIANTS, ids=str)
@pytest.mark.parametrize("n,repeat", [(2, 1), (2, 3), (4, 1), (4, 3), (4, 10)])
def test_kernels_on_the_cpu_are_the_model_bit_for_bit(knobs, n, repeat, tmp_path, monkeypatch):
    """The kernels' CUDA (``knobs`` {}: the defaults), run on the CPU, equals the model of their arithmetic
    (butterfly sums, the backward's walk) bit for bit: standard, wide and huge logits, eps = 1e-6 and 0 (exact zeros: the IEEE
    fallback), 37 matrices (a partial last CTA)."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    fwd_src = _build_with(monkeypatch, knobs, "mhc_sinkhorn_fwd", (n,))
    bwd_src = _build_with(monkeypatch, knobs, "mhc_sinkhorn_bwd", (n, repeat))
    tpb = knobs.get("PT_THREADS", SK.PT_THREADS)
    fwd = _emulated(fwd_src, "sinkhorn_fwd_kernel", tpb, tmp_path)
    bwd = _emulated(bwd_src, "sinkhorn_bwd_kernel", tpb, tmp_path)
    t = 37
    blocks = -(-t // tpb)
    for scale, eps in ((1.0, EPS), (30.0, EPS), (1e4, EPS), (30.0, 0.0)):
        x, g = torch.randn(t, n, n) * scale, torch.randn(t, n, n)
        y, d = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        fwd(blocks, X=x, Y=y, eps=eps, num_tokens=t, repeat=repeat)
        bwd(blocks, G=g, X=x, DX=d, eps=eps, num_tokens=t)
        bits = lambda v: v.view(torch.int32)  # noqa: E731  (NaN and the sign of zero count too)
        assert torch.equal(bits(y), bits(model_fwd(x, repeat, eps, _exp64))), (scale, eps)
        assert torch.equal(bits(d), bits(model_bwd(g, x, repeat, eps, _exp64))), (scale, eps)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", VARIANTS[1:], ids=str)
def test_knob_set_gives_the_defaults_bits(knobs, knob_kernels):
    """Every swept knob set gives the default kernels' bits, forward and backward, at n = 4, repeat 3 and 20, over T
    in the issue's list, standard, wide (30) and huge (1e4) logits, eps = 1e-6 and eps = 0 (exact zeros: the IEEE
    fallback)."""
    cases = []
    for repeat in (3, 20):
        for t in (1, 7, 4001, 8192):
            for scale, eps in ((1.0, EPS), (30.0, EPS), (1e4, EPS), (30.0, 0.0)):
                if (t, scale, eps) != (8192, 1.0, EPS) and t == 8192:
                    continue
                x = torch.randn(t, 4, 4, device="cuda") * scale
                g = torch.randn(t, 4, 4, device="cuda")
                y, d = _nan(t, 4, 4), _nan(t, 4, 4)
                mhc_sinkhorn_fwd(x, y, repeat, eps)  # the shipped path: the package's kernels
                mhc_sinkhorn_bwd(g, x, d, repeat, eps)
                cases.append((x, g, repeat, eps, y, d))
    knob_kernels(SK, knobs)
    for x, g, repeat, eps, want_y, want_d in cases:
        y, d = _nan(*x.shape), _nan(*x.shape)
        mhc_sinkhorn_fwd(x, y, repeat, eps)
        mhc_sinkhorn_bwd(g, x, d, repeat, eps)
        # bit patterns: NaN (a zero column at eps = 0) and the sign of zero count too
        assert torch.equal(y.view(torch.int32), want_y.view(torch.int32)), (x.shape, repeat, eps)
        assert torch.equal(d.view(torch.int32), want_d.view(torch.int32)), (x.shape, repeat, eps)
    x, g = _inputs(4001, 4)  # and the reference (the spec's tolerance)
    _close(_fwd(x, 20), sinkhorn_normalize_ref(x, 20, EPS))
    _close(_bwd(g, x, 20), sinkhorn_normalize_bwd_ref(g, x, 20, EPS))


@pytest.mark.gpu
def test_bench_row_batch_invariance_and_graphs():
    x, g = _inputs(32768, 4)
    want_y, want_d = _fwd(x, 20), _bwd(g, x, 20)
    for lo, hi in ((0, 1), (5, 12), (4001, 4001 + 37), (32767, 32768)):
        assert torch.equal(_fwd(x[lo:hi].clone(), 20), want_y[lo:hi])
        assert torch.equal(_bwd(g[lo:hi].clone(), x[lo:hi].clone(), 20), want_d[lo:hi])
    out, d_x = _nan(4001, 4, 4), _nan(4001, 4, 4)
    xs, gs = x[:4001].clone(), g[:4001].clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mhc_sinkhorn_fwd(xs, out, 20, EPS)
        mhc_sinkhorn_bwd(gs, xs, d_x, 20, EPS)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want_y[:4001]) and torch.equal(d_x, want_d[:4001])
