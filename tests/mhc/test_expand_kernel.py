"""Kernel tiers of expand_to_mhc (mhc.md §2.1, §5.2): compile (sm_90 builds, the source's exact chain, the
launchers' binding without a GPU) and gpu (bitwise against the reference over the issue's grid, misaligned and
strided buffers, the reference path for C % 8 != 0, determinism, batch invariance, CUDA graphs, torch.compile).

Tolerance: none. The forward is a copy and the backward is the spec's chain ``bf(((0 + g_0) + g_1) + ...)`` in
fp32, exactly what the reference computes (``seq_sum``), so every comparison is bitwise (on the int16 patterns,
so NaN poison left in an output shows). Outputs are filled with NaN before each launch.
"""
import re

import pytest
import torch

from tilefuse import _jit
from tilefuse.mhc import _expand_kernel as K
from tilefuse.mhc import expand_to_mhc, expand_to_mhc_bwd, expand_to_mhc_fwd
from tilefuse.reference import mhc as R
from tests.mhc.configs_expand import GPU_C, GPU_N, GPU_T, ODD_C, expand_configs
from tests.quant.kernel_binding import fake_jit

BF16 = torch.bfloat16


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    bad = _bits(a).cpu() != _bits(b).cpu()
    assert not bad.any(), f"{int(bad.sum())} of {a.numel()} elements differ bitwise"


def _nan(shape, device="cuda") -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=BF16, device=device)


def _grad(shape, device="cuda") -> torch.Tensor:
    """A bf16 gradient with signed zeros and exact cancellations among the streams (the chain's +0 start)."""
    g = torch.randn(shape, device=device).to(BF16)
    if len(shape) == 3 and shape[0] > 0:
        g[0, :, : shape[2] // 4] = -0.0           # all-negative-zero streams: the sum is +0
        g[0, 1 % shape[1], shape[2] // 4: shape[2] // 2] = -g[0, 0, shape[2] // 4: shape[2] // 2]
    return g


# ---- CPU: launch geometry ----

def test_takes_whole_chunks_and_at_most_max_n_streams():
    assert K.takes(4, 7168) and K.takes(1, 8) and K.takes(K.MAX_N, 2400)
    assert not K.takes(4, 100) and not K.takes(K.MAX_N + 1, 7168) and not K.takes(0, 7168) and not K.takes(4, 0)


@pytest.mark.parametrize("C", sorted({*GPU_C, ODD_C, 8, 16, 1288}))
def test_row_threads_whole_warps_cover_the_row(C):
    t = K.row_threads(C, K.MAX_THREADS)
    cv = C // K.V
    assert t % 32 == 0 and 32 <= t <= K.MAX_THREADS
    assert -(-cv // t) * t >= cv  # every chunk has a thread
    if C in GPU_C:
        assert cv % t == 0  # the rows: no idle lane


def test_ops_mutate_only_their_outputs():
    for name, out in (("mhc_expand_fwd", "o"), ("mhc_expand_bwd", "x_grad")):
        schema = getattr(torch.ops.tilefuse, name).default._schema
        assert [a.name for a in schema.arguments if a.is_write] == [out]
        assert not schema.returns


# ---- compile tier ----

@pytest.mark.compile
@pytest.mark.parametrize("cfg", expand_configs(), ids=str)
@pytest.mark.parametrize("name", ("mhc_expand_fwd", "mhc_expand_bwd"))
def test_builds_for_sm90(name, cfg):
    src = _jit.compile_kernel(name, cfg, "sm_90", export=False).get_kernel_source()
    n, C = cfg
    assert "__global__" in src
    # two 16-byte register copies ``*(uint4*)a = *(uint4*)b``: the load and the store (in the stream loop)
    assert src.count("*(uint4*)") == 4
    assert "int64_t num_tokens" in src  # 64-bit addressing
    if name == "mhc_expand_bwd":
        # the in-order chain from an explicit 0: IEEE adds that nothing can fold or reassociate
        assert re.search(r"acc\[\w+\] = __fadd_rn\(acc\[\w+\], \(\(float\)g\[", src)
        assert re.search(r"acc\[\w+\] = 0x0p\+0f", src)


@pytest.mark.compile
@pytest.mark.parametrize("name", ("mhc_expand_fwd", "mhc_expand_bwd"))
def test_builds_with_several_tokens_per_cta(monkeypatch, name):
    monkeypatch.setattr(K, "TOKENS_PER_CTA", 3)
    src = _jit.compile_kernel(name, (4, ODD_C), "sm_90", export=False).get_kernel_source()
    assert "num_tokens" in src and src.count("*(uint4*)") == 4


@pytest.mark.compile
def test_registered_configs_are_the_bench_shapes():
    assert set(K._configs()) >= {(4, c) for c in (2560, 4096, 7168)}
    assert set(_jit.registered()["mhc_expand_fwd"]) == set(K._configs())


@pytest.mark.compile
@pytest.mark.parametrize("n,C", [(4, 7168), (2, 1280), (8, ODD_C)])
def test_launchers_bind_their_arguments(monkeypatch, n, C):
    calls = fake_jit(monkeypatch)
    x = torch.randn(5, C).to(BF16)
    o = torch.empty(5, n, C, dtype=BF16)
    K.expand_fwd_launch(x, o)
    K.expand_bwd_launch(o, x)
    assert [(c.name, c.cfg, c.env["num_tokens"]) for c in calls] == [("mhc_expand_fwd", (n, C), 5),
                                                                     ("mhc_expand_bwd", (n, C), 5)]
    # misaligned views are bound through aligned copies; empty inputs launch nothing
    flat = torch.zeros(1 + 5 * n * C, dtype=BF16)
    K.expand_fwd_launch(torch.zeros(1 + 5 * C, dtype=BF16)[1:].view(5, C), flat[1:].view(5, n, C))
    K.expand_fwd_launch(x[:0], o[:0])
    K.expand_bwd_launch(o[:0], x[:0])
    assert len(calls) == 3


# ---- gpu tier ----

@pytest.mark.gpu
@pytest.mark.parametrize("T", GPU_T)
@pytest.mark.parametrize("n", GPU_N)
@pytest.mark.parametrize("C", (*GPU_C, ODD_C))
def test_fwd_bwd_bitwise(T, n, C):
    if C == ODD_C and n != 4:
        pytest.skip("the odd hidden size runs at n = 4")
    x = torch.randn(T, C, device="cuda").to(BF16)
    o = _nan((T, n, C))
    expand_to_mhc_fwd(x, o)
    _same(o, R.expand_to_mhc_ref(x.cpu(), n))
    g = _grad((T, n, C))
    xg = _nan((T, C))
    expand_to_mhc_bwd(g, xg)
    _same(xg, R.expand_to_mhc_bwd_ref(g.cpu()))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 7, 2560), (4001, 1280), (3, 5, 7, 4096)], ids=str)
@pytest.mark.parametrize("n", (2, 4))
def test_autograd_op_bitwise(shape, n):
    h = torch.randn(shape, device="cuda").to(BF16).requires_grad_(True)
    out = _nan((*shape[:-1], n, shape[-1]))
    got = expand_to_mhc(h, n, out=out)
    assert got.data_ptr() == out.data_ptr()
    _same(got, R.expand_to_mhc_ref(h.detach().cpu(), n))
    g = _grad((int(torch.tensor(shape[:-1]).prod()), n, shape[-1])).view(*shape[:-1], n, shape[-1])
    got.backward(g)
    _same(h.grad, R.expand_to_mhc_bwd_ref(g.cpu()))
    # a non-contiguous upstream gradient (an expanded one) is made dense first
    h.grad = None
    expand_to_mhc(h, n).sum().backward()
    _same(h.grad, torch.full(shape, float(n), dtype=BF16))


@pytest.mark.gpu
def test_misaligned_buffers_and_reference_path():
    T, n, C = 33, 4, 1280
    base_x = torch.randn(1 + T * C, device="cuda").to(BF16)
    x = base_x[1:].view(T, C)  # contiguous, 2 bytes off a 16-byte boundary
    base_o = _nan((1 + T * n * C,))
    o = base_o[1:].view(T, n, C)
    expand_to_mhc_fwd(x, o)
    _same(o, R.expand_to_mhc_ref(x.cpu(), n))
    assert torch.isnan(base_o[0].float())  # nothing written outside the view
    base_g = _nan((1 + T * C,))
    xg = base_g[1:].view(T, C)
    g = _grad((T, n, C))
    expand_to_mhc_bwd(g, xg)
    _same(xg, R.expand_to_mhc_bwd_ref(g.cpu()))
    assert torch.isnan(base_g[0].float())
    # C % 8 != 0: the reference path on CUDA, same bits
    x, g = torch.randn(T, 100, device="cuda").to(BF16), _grad((T, n, 100))
    o, xg = _nan((T, n, 100)), _nan((T, 100))
    expand_to_mhc_fwd(x, o)
    expand_to_mhc_bwd(g, xg)
    _same(o, R.expand_to_mhc_ref(x.cpu(), n))
    _same(xg, R.expand_to_mhc_bwd_ref(g.cpu()))
    # n > MAX_N: the reference path on CUDA
    x, g = torch.randn(T, 64, device="cuda").to(BF16), _grad((T, K.MAX_N + 1, 64))
    o, xg = _nan((T, K.MAX_N + 1, 64)), _nan((T, 64))
    expand_to_mhc_fwd(x, o)
    expand_to_mhc_bwd(g, xg)
    _same(o, R.expand_to_mhc_ref(x.cpu(), K.MAX_N + 1))
    _same(xg, R.expand_to_mhc_bwd_ref(g.cpu()))


@pytest.mark.gpu
@pytest.mark.parametrize("C", GPU_C)
def test_deterministic_and_batch_invariant(C):
    n, T = 4, 8192
    g = _grad((T, n, C))
    runs = []
    for _ in range(2):
        xg = _nan((T, C))
        expand_to_mhc_bwd(g, xg)
        runs.append(xg)
    _same(runs[0], runs[1])
    for rows in (slice(0, 1), slice(5, 12), slice(4001, 8192)):
        alone = _nan((rows.stop - rows.start, C))
        expand_to_mhc_bwd(g[rows].contiguous(), alone)
        _same(alone, runs[0][rows])


@pytest.mark.gpu
@pytest.mark.parametrize("T", (1, 7, 4001))
def test_tokens_per_cta_knob_changes_no_bit(knob_kernels, T):
    knob_kernels(K, {"TOKENS_PER_CTA": 3})
    n, C = 4, ODD_C
    x, g = torch.randn(T, C, device="cuda").to(BF16), _grad((T, n, C))
    o, xg = _nan((T, n, C)), _nan((T, C))
    expand_to_mhc_fwd(x, o)
    expand_to_mhc_bwd(g, xg)
    _same(o, R.expand_to_mhc_ref(x.cpu(), n))
    _same(xg, R.expand_to_mhc_bwd_ref(g.cpu()))


@pytest.mark.gpu
def test_cuda_graph_replay():
    T, n, C = 257, 4, 7168
    x, g = torch.randn(T, C, device="cuda").to(BF16), _grad((T, n, C))
    o, xg = _nan((T, n, C)), _nan((T, C))
    expand_to_mhc_fwd(x, o)  # warm-up outside the capture (compile and load)
    expand_to_mhc_bwd(g, xg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        expand_to_mhc_fwd(x, o)
        expand_to_mhc_bwd(g, xg)
    for _ in range(2):
        x.copy_(torch.randn(T, C, device="cuda").to(BF16))
        g.copy_(_grad((T, n, C)))
        o.fill_(float("nan"))
        xg.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _same(o, R.expand_to_mhc_ref(x.cpu(), n))
        _same(xg, R.expand_to_mhc_bwd_ref(g.cpu()))


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    T, n, C = 129, 4, 2560

    def v21(x, g, o, xg):
        expand_to_mhc_fwd(x, o)
        expand_to_mhc_bwd(g, xg)
        return o * 1, xg + 0

    def v1(h):
        return expand_to_mhc(h, n) * 1

    x, g = torch.randn(T, C, device="cuda").to(BF16), _grad((T, n, C))
    o, xg = _nan((T, n, C)), _nan((T, C))
    got_o, got_xg = torch.compile(v21, fullgraph=True)(x, g, o, xg)
    _same(got_o, R.expand_to_mhc_ref(x.cpu(), n))
    _same(got_xg, R.expand_to_mhc_bwd_ref(g.cpu()))
    _same(o, got_o)  # the mutation is visible in the caller's buffers
    _same(xg, got_xg)
    h = x.view(3, 43, C).clone().requires_grad_(True)
    out = torch.compile(v1, fullgraph=True)(h)
    _same(out, R.expand_to_mhc_ref(h.detach().cpu(), n))
    out.backward(g.view(3, 43, n, C))
    _same(h.grad, R.expand_to_mhc_bwd_ref(g.view(3, 43, n, C).cpu()))


def test_write_through_takes_a_ready_buffer_as_it_is_and_others_through_an_aligned_copy():
    """``_rows.write_through``: a contiguous 16-byte-aligned destination is the kernel's buffer; a misaligned one is
    written through an aligned copy (holding its values when the kernel reads them) and copied back."""
    from tilefuse.mhc._rows import ready, write_through

    base = torch.arange(1, 34, dtype=torch.bfloat16)
    aligned, misaligned = base[:32].view(4, 8), base[1:33].view(4, 8)
    assert ready(aligned) and not ready(misaligned)
    seen = []
    write_through(aligned, lambda buf: seen.append(buf))
    assert seen[-1] is aligned
    for read in (False, True):
        before = misaligned.clone()

        def launch(buf):
            assert ready(buf) and buf is not misaligned
            if read:
                assert torch.equal(buf, before)
            buf.fill_(7)

        write_through(misaligned, launch, read=read)
        assert torch.equal(misaligned, torch.full((4, 8), 7, dtype=torch.bfloat16))
        misaligned.copy_(before)
