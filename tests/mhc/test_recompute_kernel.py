"""Kernel tiers of mhc_multilayer_recompute (mhc.md §2.9): compile (sm_90 builds of every config the tests use, the
explicit chains in the source, the launcher's binding, the generated source run on the CPU) and gpu (the issue's grid
bitwise against the layer-by-layer chain of the apply-mix and post kernels, each step against the reference, poisoned
outputs, misaligned tensors, determinism, batch invariance, CUDA graphs, torch.compile).

Tolerances: none against the chain (the spec's bit-identity, §3: every ``layer_input_list[l]`` and
``residual_list[l]`` ``torch.equal`` to the unfused ops). Against the reference, each step is checked from the
kernel's own residual ``R^l`` (errors do not compound) with the spec's bf16 contract (§3, ``assert_close`` bf16
defaults), as the apply-mix and post kernels' tests do.

Outputs are poisoned: every tensor of ``layer_input_list`` and ``residual_list`` is filled with NaN before the call.
"""
import functools

import pytest
import torch

from tilefuse import _jit
from tilefuse.mhc import _recompute_kernel as K
from tilefuse.mhc import mhc_multilayer_recompute
from tilefuse.reference.mhc import mhc_post_ref, mhc_pre_apply_mix_ref
from tests.mhc.configs_recompute import EMU_CONFIGS, GRID_C, GRID_LAYERS, GRID_N, recompute_configs
from tests.mhc.mhc_helpers import BF16
from tests.mhc import post_emulation as emu
from tests.quant.kernel_binding import fake_jit

BF16_RTOL, BF16_ATOL = 1.6e-2, 1e-5  # spec §3: assert_close bf16 defaults
TOKENS = (0, 1, 7, 4001, 8192)


def _layers(tokens, n, c, L, P, device="cuda", batch=1):
    """Inputs of §2.9 (``[batch, tokens / batch, ...]``, mixes ``[..., n, 1]``) and NaN-poisoned outputs."""
    s = tokens // batch
    r0 = torch.randn(batch, s, n, c, device=device).to(BF16)
    pre = [torch.rand(batch, s, n, 1, device=device) for _ in range(L)]
    ys = [torch.randn(batch, s, c, device=device).to(BF16) for _ in range(P)]
    posts = [torch.rand(batch, s, n, 1, device=device) * 2 for _ in range(P)]
    # not normalised, signed; scaled so the residual's spread stays about 1 across ten layers (the reference checks
    # use absolute tolerances near zero)
    combs = [torch.randn(batch, s, n, n, device=device) / (2 * n ** 0.5) for _ in range(P)]
    return r0, pre, ys, posts, combs, *_poisoned(r0, L, P)


def _poisoned(r0, L, P):
    return ([torch.full(r0.shape[:-2] + r0.shape[-1:], float("nan"), dtype=BF16, device=r0.device)
             for _ in range(L)],
            [torch.full_like(r0, float("nan")) for _ in range(P)])


def _chain(monkeypatch, r0, pre, ys, posts, combs):
    """The public op's layer-by-layer chain (the apply-mix and post kernels on CUDA) into fresh poisoned outputs."""
    lis, rss = _poisoned(r0, len(pre), len(posts))
    with monkeypatch.context() as m:
        m.setattr(K, "takes", lambda *args: False)
        mhc_multilayer_recompute(r0, pre, ys, posts, combs, lis, rss)
    return lis, rss


def _assert_same(got, want):
    for a, b in zip(got, want, strict=True):
        assert len(a) == len(b)
        for l, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"layer {l}: {int((x.view(torch.int16) != y.view(torch.int16)).sum())} differ"


def _check_reference(r0, pre, ys, posts, combs, lis, rss):
    """Each step against the reference, from the kernel's own residual before it (§3 bf16 contract)."""
    r = r0
    for l in range(len(pre)):
        torch.testing.assert_close(lis[l], mhc_pre_apply_mix_ref(r, pre[l]), rtol=BF16_RTOL, atol=BF16_ATOL)
        if l < len(posts):
            torch.testing.assert_close(rss[l], mhc_post_ref(ys[l], r, posts[l], combs[l]), rtol=BF16_RTOL,
                                       atol=BF16_ATOL)
            r = rss[l]


# ---- compile tier ----

def _all_configs():
    return sorted(set(recompute_configs()) | set(K._configs()) | set(EMU_CONFIGS))


@pytest.mark.compile
@pytest.mark.parametrize("cfg", _all_configs(), ids=str)
def test_builds_for_sm90_with_the_exact_chains(cfg):
    n, c, L, P = cfg
    src = _jit.compile_kernel("mhc_multilayer_recompute", cfg, "sm_90").get_kernel_source()
    assert "__global__" in src and "atomic" not in src and "__shared__" not in src
    # per layer one apply chain (RN product, n - 1 fmas); per post step one post chain (RN product, n fmas)
    assert src.count("__fmul_rn(") == L + P
    assert src.count("__fmaf_rn(") == L * (n - 1) + P * n
    # 16-byte accesses; the initial residual is read in one place (once, before the layers)
    for l in range(L):
        assert f"*(uint4*)(LI{l} + " in src
    for l in range(P):
        assert f"*(uint4*)(Y{l} + " in src and f"*(uint4*)(RS{l} + " in src
    assert src.count("(R0 + ") == 1
    assert f"PRE{L} " not in src and f"Y{P} " not in src


def _param_names(L, P) -> list[str]:
    """The kernel's buffer names in the order the launcher passes the public op's tensors."""
    return ["R0"] + [f"{p}{l}" for p, count in zip(("PRE", "Y", "PM", "CM", "LI", "RS"), (L, P, P, P, L, P))
                     for l in range(count)]


@pytest.mark.compile
@pytest.mark.parametrize("L, P", [(3, 2), (10, 9), (1, 0)])
def test_parameters_in_the_public_order(L, P):
    """The prim_func declares its parameters in the public op's argument order (the launcher binds by position; the
    CPU emulation below binds these names)."""
    func = K.recompute_kernel(4, 264, L, P)
    assert [func.buffer_map[p].name for p in func.params if p in func.buffer_map] == _param_names(L, P)
    assert len(func.params) == 1 + 2 * L + 4 * P


@pytest.mark.compile
@pytest.mark.parametrize("L, P", [(3, 2), (2, 2), (1, 0)])
def test_launcher_binds_its_arguments(L, P, monkeypatch):
    """The launcher hands the kernel flat tensors of the factory's shapes in its parameter order: ``[..., n, 1]`` and
    ``[..., n]`` mixes, two batch rows, a misaligned input and output."""
    calls = fake_jit(monkeypatch)
    n, c = 4, 264
    r0, pre, ys, posts, combs, lis, rss = _layers(2 * 5, n, c, L, P, device="cpu", batch=2)
    pre[0] = pre[0][..., 0].contiguous()
    odd = torch.empty(1 + lis[-1].numel(), dtype=BF16)[1:].view(lis[-1].shape)
    lis[-1] = odd
    K.recompute_launch(r0, pre, ys, posts, combs, lis, rss)
    assert [(call.name, call.cfg) for call in calls] == [("mhc_multilayer_recompute", (n, c, L, P))]
    assert calls[0].env["num_tokens"] == 10


@pytest.mark.compile
def test_zero_tokens_launch_nothing(monkeypatch):
    calls = fake_jit(monkeypatch)
    K.recompute_launch(*_layers(0, 4, 16, 2, 1, device="cpu"))
    assert calls == []


def test_kernel_takes_only_what_it_was_built_for():
    r0 = torch.randn(1, 2, 4, 16).to(BF16)
    assert not K.takes(r0)  # CPU: the reference
    assert not K.takes(r0.to("meta"))


@functools.cache
def _emulated(cfg, tmp_path):
    """The kernel at ``cfg`` run on the CPU by ``post_emulation`` (its generated CUDA, bit for bit): a stand-in for
    ``_jit.get`` that binds the launcher's arguments to the kernel's parameters by position."""
    n, c, L, P = cfg
    src = _jit.compile_kernel("mhc_multilayer_recompute", cfg, "sm_90").get_kernel_source()
    run = emu.build(src, "mhc_recompute_kernel", K.THREADS, False, tmp_path / "_".join(map(str, cfg)))
    names = _param_names(L, P)

    def launch(*args):
        tokens = args[0].shape[0]
        run(dict(zip(names, args, strict=True)), tokens, -(-tokens * (c // K.V) // K.THREADS))
    return launch


@functools.cache
def _emulated_post(n, c, tmp_path):
    from tilefuse.mhc import _post_kernel as PK

    src = _jit.compile_kernel("mhc_post_fwd", (n, c), "sm_90").get_kernel_source()
    run = emu.build(src, "mhc_post_fwd_kernel", PK.FWD_THREADS, False, tmp_path / f"post_{n}_{c}")

    def post(y, r, p, cm):
        out = torch.full_like(r, float("nan"))
        tokens = r.numel() // (n * c)
        run(dict(X=y.contiguous(), Rs=r.contiguous(), P=p.contiguous(), Cm=cm.contiguous(), O=out), tokens,
            -(-tokens * (c // PK.V) // PK.FWD_THREADS))
        return out
    return post


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("cfg", EMU_CONFIGS, ids=str)
def test_generated_source_on_the_cpu(cfg, tmp_path, monkeypatch):
    """The fused kernel's CUDA source run on the CPU through the launcher: every output written (NaN-poisoned
    before); each ``residual_list[l]`` bitwise equal to the post kernel's generated source (also run on the CPU) on
    the residual before it, each ``layer_input_list[l]`` bitwise equal to the §2.5 chain (``emu.fma_chain``: fixed
    seeded data, see its note); so the layers chain through the stored bf16 residuals. A misaligned output and
    ``[..., n]`` mixes give the same bits."""
    n, c, L, P = cfg
    tokens = 13
    monkeypatch.setattr(_jit, "get", lambda name, config: _emulated(config, tmp_path))
    r0, pre, ys, posts, combs, lis, rss = _layers(tokens, n, c, L, P, device="cpu")
    K.recompute_launch(r0, pre, ys, posts, combs, lis, rss)
    post = _emulated_post(n, c, tmp_path)
    r = r0
    for l in range(L):
        rf = r.float()
        model = emu.fma_chain(pre[l][..., 0, :] * rf[..., 0, :],
                              [(pre[l][..., i, :], rf[..., i, :]) for i in range(1, n)]).to(BF16)
        assert torch.equal(lis[l], model), l
        if l < P:
            assert torch.equal(rss[l], post(ys[l], r, posts[l], combs[l])), l
            r = rss[l]
    _check_reference(r0, pre, ys, posts, combs, lis, rss)
    # the same through an odd output buffer and flat mixes
    lis2, rss2 = _poisoned(r0, L, P)
    lis2[0] = torch.full((1 + lis[0].numel(),), float("nan"), dtype=BF16)[1:].view(lis[0].shape)
    K.recompute_launch(r0, [p[..., 0].contiguous() for p in pre], ys, [p[..., 0].contiguous() for p in posts],
                       combs, lis2, rss2)
    _assert_same((lis2, rss2), (lis, rss))


# ---- gpu tier ----

@pytest.fixture
def spy(monkeypatch):
    """Count the fused kernel's launches through the public op."""
    seen = []
    real = K.recompute_launch

    def launch(*args):
        seen.append(len(args[1]))
        real(*args)

    monkeypatch.setattr(K, "recompute_launch", launch)
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("L, P", GRID_LAYERS, ids=str)
@pytest.mark.parametrize("c", GRID_C)
@pytest.mark.parametrize("n", GRID_N)
@pytest.mark.parametrize("tokens", TOKENS)
def test_grid_bitwise_against_the_chain(tokens, n, c, L, P, spy, monkeypatch):
    r0, pre, ys, posts, combs, lis, rss = _layers(tokens, n, c, L, P)
    assert mhc_multilayer_recompute(r0, pre, ys, posts, combs, lis, rss) is None
    assert spy == [L]  # the fused kernel ran
    _assert_same((lis, rss), _chain(monkeypatch, r0, pre, ys, posts, combs))
    _check_reference(r0, pre, ys, posts, combs, lis, rss)


@pytest.mark.gpu
def test_flat_mixes_batch_rows_and_misaligned_tensors(spy, monkeypatch):
    n, c, L, P = 4, 4096, 3, 2
    r0, pre, ys, posts, combs, lis, rss = _layers(2 * 301, n, c, L, P, batch=2)
    mhc_multilayer_recompute(r0, pre, ys, posts, combs, lis, rss)
    _assert_same((lis, rss), _chain(monkeypatch, r0, pre, ys, posts, combs))

    def odd(t):  # contiguous, 2 bytes (bf16) or 4 bytes (fp32) off a 16-byte boundary
        flat = torch.full((1 + t.numel(),), float("nan"), dtype=t.dtype, device=t.device)[1:]
        return flat.view(t.shape).copy_(t)

    lis2, rss2 = _poisoned(r0, L, P)
    lis2[1], rss2[0] = odd(lis2[1]), odd(rss2[0])
    mhc_multilayer_recompute(odd(r0), [odd(p[..., 0]) for p in pre], [odd(y) for y in ys],
                             [p[..., 0].contiguous() for p in posts], [odd(cm) for cm in combs], lis2, rss2)
    _assert_same((lis2, rss2), (lis, rss))
    assert spy == [L, L]


@pytest.mark.gpu
@pytest.mark.parametrize("n, c", [(3, 64), (4, 12), (1, 16)])
def test_other_shapes_take_the_chain(n, c, spy):
    r0, pre, ys, posts, combs, lis, rss = _layers(7, n, c, 3, 2)
    mhc_multilayer_recompute(r0, pre, ys, posts, combs, lis, rss)
    assert spy == []
    _check_reference(r0, pre, ys, posts, combs, lis, rss)


@pytest.mark.gpu
def test_deterministic_and_batch_invariant():
    n, c, L, P = 4, 4096, 10, 10
    args = _layers(4001, n, c, L, P)
    mhc_multilayer_recompute(*args)
    again = _poisoned(args[0], L, P)
    mhc_multilayer_recompute(*args[:5], *again)
    _assert_same(again, args[5:])
    for sl in (slice(1234, 1241), slice(4000, 4001), slice(0, 1)):
        part = [args[0][:, sl].clone()] + [[t[:, sl].clone() for t in lst] for lst in args[1:5]]
        outs = _poisoned(part[0], L, P)
        mhc_multilayer_recompute(*part, *outs)
        _assert_same(outs, ([t[:, sl] for t in args[5]], [t[:, sl] for t in args[6]]))


@pytest.mark.gpu
def test_cuda_graph_replay():
    n, c, L, P = 4, 4096, 10, 9
    static = _layers(4001, n, c, L, P)
    mhc_multilayer_recompute(*static)  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mhc_multilayer_recompute(*static)
    fresh = _layers(4001, n, c, L, P)
    static[0].copy_(fresh[0])
    for s, f in zip(static[1:5], fresh[1:5]):
        for a, b in zip(s, f):
            a.copy_(b)
    for lst in static[5:]:
        for t in lst:
            t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    mhc_multilayer_recompute(*fresh)
    _assert_same(static[5:], fresh[5:])


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    n, c, L, P = 4, 4096, 3, 3
    r0, pre, ys, posts, combs, lis, rss = _layers(4001, n, c, L, P)

    def step(r0, pre, ys, posts, combs, lis, rss):
        mhc_multilayer_recompute(r0, pre, ys, posts, combs, lis, rss)
        return rss[-1].float() * 2  # elementwise and exact: inductor's fused reduction would sum in its own order

    compiled = torch.compile(step, fullgraph=True)
    got = compiled(r0, pre, ys, posts, combs, lis, rss)
    lis_e, rss_e = _poisoned(r0, L, P)
    want = step(r0, pre, ys, posts, combs, lis_e, rss_e)
    _assert_same((lis, rss), (lis_e, rss_e))
    assert torch.equal(got, want)
