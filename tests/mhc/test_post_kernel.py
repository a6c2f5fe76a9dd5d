"""Kernel tiers of mhc_post / mhc_post_fwd / mhc_post_bwd (mhc.md §2.6, §5.2): compile (sm_90 builds of every
config the tests use, the explicit fma chains in the source, the launchers' binding without a GPU) and gpu (the
issue's grid against float64 and the reference, poisoned outputs, strided inputs, determinism, batch invariance,
CUDA graphs, torch.compile). The backward's TOKEN_WARPS knob (2 and 4): sm_90 builds at every config, the generated
source on the CPU (the default's d_x / d_residual bits, d_post / d_comb in the order of ``mix_model``), and a GPU
knob test beside the default kernel.

Tolerances (derived, written once):
* bf16 results (out, d_x, d_residual) are one fp32 chain of k products (k = n + 1 for out, n for the gradients)
  rounded once to bf16. Against the float64 value, elementwise: 1 bf16 ulp plus the chain's fp32 error bound,
  ``k * 2^-23 * sum|terms|`` (twice the textbook ``k u`` bound; the term matters only where the terms cancel).
  Against the reference: the spec's contract (§3, bf16 ``assert_close`` defaults).
* d_post, d_comb are fp32 sums over C in an order the spec leaves open (§2.6): the spec's RTOL = ATOL = 1e-4
  against the reference.
* Everything that runs the same kernel on the same values is bitwise: determinism, batch invariance, graph replay,
  torch.compile, strided and misaligned inputs.

GPU tests call the public ops, so they cover the dispatch, the eager launch and (compile test) the custom ops.
Outputs are poisoned before each launch: ``out=`` buffers filled with NaN, and the launchers' own allocations
replaced by NaN-filled ones (``_post_kernel._new``).
"""
import re

import pytest
import torch

from tilefuse import _jit
from tilefuse.mhc import _post_kernel as K
from tilefuse.mhc import mhc_post, mhc_post_bwd, mhc_post_fwd
from tilefuse.mhc import _functions as F
from tilefuse.reference.mhc import mhc_post_bwd_ref, mhc_post_ref
from tests.mhc.configs_post import GRID_C, GRID_N, ODD_C, post_configs
from tests.mhc.mhc_helpers import BF16, F64, bf16_ulp
from tests.mhc import post_emulation as emu
from tests.quant.kernel_binding import fake_jit

BF16_RTOL, BF16_ATOL = 1.6e-2, 1e-5  # spec §3: assert_close bf16 defaults
MIX_RTOL = MIX_ATOL = 1e-4           # spec §3: d_post, d_comb
CHAIN_UNIT = 2.0 ** -23              # twice the fp32 unit roundoff, per product of a chain
TOKENS = (0, 1, 7, 4001, 8192)
CHUNK = 512                          # tokens per float64 check (bounds the checks' memory)


# ---- compile tier ----

def _all_configs():
    return sorted(set(post_configs()) | set(K._configs()))


@pytest.mark.compile
@pytest.mark.parametrize("cfg", _all_configs(), ids=str)
def test_forward_builds_for_sm90_with_the_exact_chain(cfg):
    n, c = cfg
    src = _jit.compile_kernel("mhc_post_fwd", cfg, "sm_90").get_kernel_source()
    assert "__global__" in src
    # one chain per output element: RN(comb[0, o] R_0), then fma with post * x, then n - 1 fmas
    assert src.count("__fmul_rn(") == 1 and src.count("__fmaf_rn(") == n
    chain = [line for line in src.splitlines() if "__fmaf_rn(" in line]
    assert len(chain) == 1
    rhs = re.sub(r"\[[^\]]*\]", "", chain[0].split("=", 1)[1])
    assert not re.search(r"[-+*/]", rhs), chain[0]  # nothing contractible around the explicit operations
    # 16-byte accesses of x, the residual and the output
    for buf in ("X", "Rs", "O"):
        assert re.search(rf"\*\(uint4\*\)\({buf} \+", src), buf
    assert "atomic" not in src


@pytest.mark.compile
@pytest.mark.parametrize("cfg", _all_configs(), ids=str)
def test_backward_builds_for_sm90_with_the_exact_chains(cfg):
    n, c = cfg
    src = _jit.compile_kernel("mhc_post_bwd", cfg, "sm_90").get_kernel_source()
    assert "__global__" in src
    # d_x and d_residual: RN(a_0 g_0), then n - 1 fmas; the two mix-gradient partial sums: one fma each
    assert src.count("__fmul_rn(") == 2
    assert src.count("__fmaf_rn(") == 2 * (n - 1) + 2
    for line in (line for line in src.splitlines() if "__fmul_rn(" in line):
        rhs = re.sub(r"\[[^\]]*\]", "", line.split("=", 1)[1])
        assert not re.search(r"[-+*/]", rhs), line
    for buf in ("X", "Rs", "G", "DX", "DR"):
        assert re.search(rf"\*\(uint4\*\)\({buf} \+", src), buf
    assert "__shfl_xor_sync" in src and "atomic" not in src and "__shared__" not in src


@pytest.mark.compile
@pytest.mark.parametrize("shape", [(1, 7, 4, 264), (2, 3, 2, 8), (1, 1, 8, 1280)], ids=str)
def test_launchers_bind_their_arguments(shape, monkeypatch):
    """The launchers hand the kernels flat, contiguous tensors of the factory's shapes, also for a strided
    residual and d_o (copied first) and a non-contiguous ``out`` (written through a fresh buffer)."""
    b, s, n, c = shape
    calls = fake_jit(monkeypatch)
    x = torch.randn(b, s, c).to(BF16)
    residual = torch.randn(b, s, c, n).to(BF16).transpose(-1, -2)  # strided
    post, comb = torch.rand(b, s, n, 1), torch.randn(b, s, n, n)
    d_o = torch.randn(b, s, c, n).to(BF16).transpose(-1, -2)
    out = torch.empty(b, s, c, n, dtype=BF16).transpose(-1, -2)
    assert K.post_fwd_launch(x, residual, post, comb, out) is out
    assert K.post_fwd_launch(x, residual, post, comb).shape == residual.shape
    d_x, d_r, d_p, d_c = K.post_bwd_launch(x, residual, post, comb, d_o)
    assert (d_x.shape, d_r.shape, d_p.shape, d_c.shape) == (x.shape, residual.shape, post.shape, comb.shape)
    assert [(call.name, call.cfg) for call in calls] == [("mhc_post_fwd", (n, c))] * 2 + [("mhc_post_bwd", (n, c))]
    assert all(call.env["num_tokens"] == b * s for call in calls)


def _cpu_bwd(cfg, workdir):
    """The backward's generated source at the module's current knobs, built for the CPU (``post_emulation``)."""
    src = _jit.compile_kernel("mhc_post_bwd", cfg, "sm_90", export=False).get_kernel_source()
    return emu.build(src, "mhc_post_bwd_kernel", K.BWD_WARPS * K.WARP, True, workdir)


def _run_bwd(bwd, x, r, p, cm, g):
    """``(d_x, d_residual, d_post, d_comb)`` of the CPU-built backward ``bwd`` (outputs NaN-poisoned before), launched
    as the launcher does at the module's current knobs."""
    tokens, n = r.shape[1:3]
    got = (torch.full_like(x, float("nan")), torch.full_like(r, float("nan")),
           torch.full((1, tokens, n, 1), float("nan")), torch.full((1, tokens, n, n), float("nan")))
    bwd(dict(X=x, Rs=r, G=g, P=p, Cm=cm, DX=got[0], DR=got[1], DP=got[2], DC=got[3]), tokens,
        -(-tokens // (K.BWD_WARPS // K.TOKEN_WARPS)))
    return got


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("n, c, tokens", [(4, 264, 7), (2, 8, 5), (8, 264, 9), (4, 1280, 13)])
def test_generated_source_on_the_cpu(n, c, tokens, tmp_path):
    """The kernels' CUDA source, run on the CPU (``post_emulation``: the same arithmetic bit for bit): every output
    written (NaN-poisoned before), the forward and d_x bitwise equal to the chains of §2.6, d_residual bitwise equal
    to the reference (§3 item 1), the rest within the tolerances above. Small T and odd C exercise the lane guards
    and the last partial CTA."""
    x, r = torch.randn(1, tokens, c).to(BF16), torch.randn(1, tokens, n, c).to(BF16)
    p, cm = torch.rand(1, tokens, n, 1) * 2, torch.randn(1, tokens, n, n)
    g = torch.randn(1, tokens, n, c).to(BF16)
    lanes = tokens * c // K.V
    fwd = emu.build(_jit.compile_kernel("mhc_post_fwd", (n, c), "sm_90").get_kernel_source(), "mhc_post_fwd_kernel",
                    K.FWD_THREADS, False, tmp_path)
    out = torch.full_like(r, float("nan"))
    fwd(dict(X=x, Rs=r, P=p, Cm=cm, O=out), tokens, -(-lanes // K.FWD_THREADS))
    xf, rf, gf = x.float(), r.float(), g.float()
    model = torch.stack([emu.fma_chain(emu.fma_chain(cm[..., 0, o, None] * rf[..., 0, :], [(p[..., o, :], xf)]),
                                       [(cm[..., i, o, None], rf[..., i, :]) for i in range(1, n)])
                         for o in range(n)], dim=-2).to(BF16)
    assert torch.equal(out, model)
    _check_forward(out, x, r, p, cm)

    got = _run_bwd(_cpu_bwd((n, c), tmp_path), x, r, p, cm, g)
    d_x_model = emu.fma_chain(p[..., 0, :] * gf[..., 0, :], [(p[..., o, :], gf[..., o, :]) for o in range(1, n)])
    assert torch.equal(got[0], d_x_model.to(BF16))
    assert torch.equal(got[1], mhc_post_bwd_ref(x, r, p, cm, g)[1])
    _check_backward(got, x, r, p, cm, g)


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
def test_backward_unroll_knob_changes_no_result(tmp_path, monkeypatch):
    """BWD_UNROLL only groups loads: U = 1, 2 and 3 give bitwise the same four gradients (CPU emulation; C = 1280
    has 5 lane steps, so U = 2 and 3 end on a partly guarded group)."""
    n, c, tokens = 4, 1280, 5
    x, r = torch.randn(1, tokens, c).to(BF16), torch.randn(1, tokens, n, c).to(BF16)
    p, cm = torch.rand(1, tokens, n, 1) * 2, torch.randn(1, tokens, n, n)
    g = torch.randn(1, tokens, n, c).to(BF16)
    results = []
    for u in (1, 2, 3):
        monkeypatch.setattr(K, "BWD_UNROLL", u)
        results.append(_run_bwd(_cpu_bwd((n, c), tmp_path / str(u)), x, r, p, cm, g))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


TOKEN_WARPS = (2, 4)


@pytest.mark.compile
@pytest.mark.parametrize("h", TOKEN_WARPS)
@pytest.mark.parametrize("cfg", _all_configs(), ids=str)
def test_token_warps_builds_for_sm90(cfg, h, monkeypatch):
    """TOKEN_WARPS = h: the default's chains and 16-byte accesses, CTAs of BWD_WARPS warps, the warps' sums through
    shared memory behind one barrier, no atomics."""
    n, c = cfg
    monkeypatch.setattr(K, "TOKEN_WARPS", h)
    src = _jit.compile_kernel("mhc_post_bwd", cfg, "sm_90", export=False).get_kernel_source()
    assert src.count("__fmul_rn(") == 2 and src.count("__fmaf_rn(") == 2 * (n - 1) + 2
    for buf in ("X", "Rs", "G", "DX", "DR"):
        assert re.search(rf"\*\(uint4\*\)\({buf} \+", src), buf
    assert f"__launch_bounds__({K.BWD_WARPS * K.WARP}," in src
    assert src.count("__syncthreads()") == 1 and "__shared__" in src
    assert "__shfl_xor_sync" in src and "atomic" not in src


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("n, c, tokens", [(4, 264, 7), (2, 8, 5), (8, 264, 9), (2, 4096, 3)])
def test_token_warps_on_the_cpu(n, c, tokens, tmp_path, monkeypatch):
    """TOKEN_WARPS = 2 and 4, the generated source on the CPU: d_x and d_residual have the default kernel's bits;
    d_post and d_comb are bit for bit the order of ``emu.mix_model`` (which depends on C only; the default kernel's
    values are its order with one warp), within the tolerances above of the reference, and the last token alone
    has its bits in the batch. Small C leaves warps of a token without lanes; odd T, a partial last CTA."""
    x, r = torch.randn(1, tokens, c).to(BF16), torch.randn(1, tokens, n, c).to(BF16)
    p, cm = torch.rand(1, tokens, n, 1) * 2, torch.randn(1, tokens, n, n)
    g = torch.randn(1, tokens, n, c).to(BF16)
    xf, rf, gf = x.float(), r.float(), g.float()

    def model(h):
        d_post = torch.stack([emu.mix_model(xf, gf[..., o, :], h) for o in range(n)], dim=-1).unsqueeze(-1)
        d_comb = torch.stack([torch.stack([emu.mix_model(rf[..., i, :], gf[..., o, :], h) for o in range(n)], dim=-1)
                              for i in range(n)], dim=-2)
        return d_post, d_comb

    want = _run_bwd(_cpu_bwd((n, c), tmp_path / "1"), x, r, p, cm, g)
    assert all(torch.equal(a, b) for a, b in zip(want[2:], model(1)))
    for h in TOKEN_WARPS:
        monkeypatch.setattr(K, "TOKEN_WARPS", h)
        bwd = _cpu_bwd((n, c), tmp_path / str(h))
        got = _run_bwd(bwd, x, r, p, cm, g)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        d_post, d_comb = model(h)
        assert torch.equal(got[2], d_post) and torch.equal(got[3], d_comb)
        _check_backward(got, x, r, p, cm, g)
        alone = _run_bwd(bwd, *(t[:, -1:] for t in (x, r, p, cm, g)))
        for a, b in zip(alone, got):
            assert torch.equal(a, b[:, -1:])


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
def test_launchers_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    """The launchers with the kernels run by the CPU emulation: a strided residual and d_o, a residual 2 bytes off
    a 16-byte boundary, a non-contiguous and a misaligned ``out``, two batch rows: the same results as contiguous
    inputs, and those as the reference within the tolerances above."""
    def get(name, cfg):
        n, c = cfg
        src = _jit.compile_kernel(name, cfg, "sm_90").get_kernel_source()
        fwd = name == "mhc_post_fwd"
        threads = K.FWD_THREADS if fwd else K.BWD_WARPS * K.WARP
        run = emu.build(src, name + "_kernel", threads, not fwd, tmp_path / name)
        keys = ("X", "Rs", "P", "Cm", "O") if fwd else ("X", "Rs", "G", "P", "Cm", "DX", "DR", "DP", "DC")

        def launch(*args):
            tokens = args[0].shape[0]
            blocks = -(-tokens * c // K.V // threads) if fwd else -(-tokens // K.BWD_WARPS)
            run(dict(zip(keys, args)), tokens, blocks)
        return launch

    monkeypatch.setattr(_jit, "get", get)
    b, s_, n, c = 2, 3, 4, 264
    x, r = torch.randn(b, s_, c).to(BF16), torch.randn(b, s_, n, c).to(BF16)
    p, cm = torch.rand(b, s_, n, 1) * 2, torch.randn(b, s_, n, n)
    g = torch.randn(b, s_, n, c).to(BF16)
    want_f = K.post_fwd_launch(x, r, p, cm)
    want_b = K.post_bwd_launch(x, r, p, cm, g)
    _check_forward(want_f, x, r, p, cm)
    _check_backward(want_b, x, r, p, cm, g)
    strided_r = torch.full((b, s_, c, n), float("nan"), dtype=BF16).transpose(-1, -2)
    strided_r.copy_(r)
    odd_r = torch.full((1 + r.numel(),), float("nan"), dtype=BF16)[1:].view(r.shape)
    odd_r.copy_(r)
    strided_g = torch.full((b, s_, n, c + 16), float("nan"), dtype=BF16)[..., 8:8 + c]
    strided_g.copy_(g)
    for rr in (strided_r, odd_r):
        assert torch.equal(K.post_fwd_launch(x, rr, p, cm), want_f)
        for a, b_ in zip(K.post_bwd_launch(x, rr, p, cm, strided_g), want_b):
            assert torch.equal(a, b_)
    for out in (torch.full((b, s_, c, n), float("nan"), dtype=BF16).transpose(-1, -2),
                torch.full((1 + r.numel(),), float("nan"), dtype=BF16)[1:].view(r.shape),
                torch.full_like(r, float("nan"))):
        assert K.post_fwd_launch(x, r, p, cm, out) is out and torch.equal(out, want_f)


def test_kernel_takes_only_what_it_was_built_for():
    x, r, p, c = torch.randn(1, 2, 16).to(BF16), torch.randn(1, 2, 4, 16).to(BF16), torch.rand(1, 2, 4, 1), \
        torch.randn(1, 2, 4, 4)
    assert not K.takes(x, r, p, c)  # CPU tensors: the reference
    meta = [t.to("meta") for t in (x, r, p, c)]
    assert not K.takes(*meta)


def test_zero_tokens_launch_nothing(monkeypatch):
    calls = fake_jit(monkeypatch)
    x, r = torch.empty(1, 0, 16, dtype=BF16), torch.empty(1, 0, 4, 16, dtype=BF16)
    p, c = torch.empty(1, 0, 4, 1), torch.empty(1, 0, 4, 4)
    assert K.post_fwd_launch(x, r, p, c).shape == r.shape
    outs = K.post_bwd_launch(x, r, p, c, r)
    assert [t.shape for t in outs] == [x.shape, r.shape, p.shape, c.shape]
    assert calls == []


# ---- gpu tier ----

@pytest.fixture
def poisoned(poison_outputs):
    """The launchers allocate their outputs filled with NaN."""
    poison_outputs(K)


def _inputs(tokens, n, c, batch=1):
    s = tokens // batch
    x = torch.randn(batch, s, c, device="cuda").to(BF16)
    residual = torch.randn(batch, s, n, c, device="cuda").to(BF16)
    post = torch.rand(batch, s, n, 1, device="cuda") * 2
    comb = torch.randn(batch, s, n, n, device="cuda")  # not normalised, as upstream's tests
    d_o = torch.randn(batch, s, n, c, device="cuda").to(BF16)
    return x, residual, post, comb, d_o


def _assert_chain(actual, exact, mag, k):
    """``actual`` (bf16) within 1 bf16 ulp of ``exact`` plus the fp32 error bound of a k-product chain."""
    err = (actual.to(F64) - exact).abs()
    bound = bf16_ulp(exact) + k * CHAIN_UNIT * mag
    bad = err > bound
    assert not bad.any(), f"{int(bad.sum())} elements beyond the bound; worst excess {(err - bound).max().item():.3g}"


def _check_forward(out, x, residual, post, comb):
    n = residual.shape[-2]
    for a in range(0, x.shape[1], CHUNK):
        sl = slice(a, a + CHUNK)
        xd, rd, pd, cd = (t[:, sl].to(F64) for t in (x, residual, post, comb))
        exact = torch.einsum("bsio,bsic->bsoc", cd, rd) + xd.unsqueeze(-2) * pd
        mag = torch.einsum("bsio,bsic->bsoc", cd.abs(), rd.abs()) + xd.abs().unsqueeze(-2) * pd.abs()
        _assert_chain(out[:, sl], exact, mag, n + 1)
    torch.testing.assert_close(out, mhc_post_ref(x, residual, post, comb), rtol=BF16_RTOL, atol=BF16_ATOL)


def _check_backward(got, x, residual, post, comb, d_o):
    n = residual.shape[-2]
    d_x, d_r, d_p, d_c = got
    for a in range(0, x.shape[1], CHUNK):
        sl = slice(a, a + CHUNK)
        pd, cd, gd = (t[:, sl].to(F64) for t in (post, comb, d_o))
        _assert_chain(d_x[:, sl], (gd * pd).sum(-2), (gd.abs() * pd.abs()).sum(-2), n)
        _assert_chain(d_r[:, sl], torch.einsum("bsio,bsoc->bsic", cd, gd),
                      torch.einsum("bsio,bsoc->bsic", cd.abs(), gd.abs()), n)
    ref = mhc_post_bwd_ref(x, residual, post, comb, d_o)
    for a, b in zip(got[:2], ref[:2]):
        torch.testing.assert_close(a, b, rtol=BF16_RTOL, atol=BF16_ATOL)
    for a, b in zip(got[2:], ref[2:]):
        torch.testing.assert_close(a, b, rtol=MIX_RTOL, atol=MIX_ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("c", GRID_C + ODD_C)
@pytest.mark.parametrize("n", GRID_N)
@pytest.mark.parametrize("tokens", TOKENS)
def test_forward_grid(tokens, n, c, poisoned):
    x, residual, post, comb, _ = _inputs(tokens, n, c)
    out = torch.full_like(residual, float("nan"))
    assert mhc_post_fwd(x, residual, post, comb, out=out) is out
    _check_forward(out, x, residual, post, comb)
    assert torch.equal(mhc_post_fwd(x, residual, post, comb), out)  # a fresh (poisoned) buffer


@pytest.mark.gpu
@pytest.mark.parametrize("c", GRID_C + ODD_C)
@pytest.mark.parametrize("n", GRID_N)
@pytest.mark.parametrize("tokens", TOKENS)
def test_backward_grid(tokens, n, c, poisoned):
    x, residual, post, comb, d_o = _inputs(tokens, n, c)
    got = mhc_post_bwd(x, residual, post, comb, d_o, fuse_grad_acc=False)
    assert [t.shape for t in got] == [x.shape, residual.shape, post.shape, comb.shape]
    _check_backward(got, x, residual, post, comb, d_o)


@pytest.mark.gpu
def test_two_batch_rows(poisoned):
    x, residual, post, comb, d_o = _inputs(2 * 300, 4, 2560, batch=2)
    _check_forward(mhc_post_fwd(x, residual, post, comb), x, residual, post, comb)
    _check_backward(mhc_post_bwd(x, residual, post, comb, d_o, fuse_grad_acc=False), x, residual, post, comb, d_o)


@pytest.mark.gpu
def test_autograd_op_takes_the_kernels(poisoned):
    x, residual, post, comb, d_o = _inputs(300, 4, 1280)
    leaves = [t.clone().requires_grad_(True) for t in (x, residual, post, comb)]
    out = mhc_post(*leaves)
    assert torch.equal(out, mhc_post_fwd(x, residual, post, comb))
    grads = torch.autograd.grad(out, leaves, d_o)
    for a, b in zip(grads, mhc_post_bwd(x, residual, post, comb, d_o, fuse_grad_acc=False)):
        assert torch.equal(a, b)
    attached = getattr(leaves[1].untyped_storage(), F.SIDE_CHANNEL)  # §2.12 side channel still attached
    assert torch.equal(attached.view_as(grads[1]), grads[1])
    # out= through autograd
    buf = torch.full_like(residual, float("nan"))
    assert mhc_post(*leaves, out=buf) is buf and torch.equal(buf, out)


@pytest.mark.gpu
def test_strided_misaligned_inputs_and_outputs(poisoned):
    tokens, n, c = 301, 4, 2560
    x, residual, post, comb, d_o = _inputs(tokens, n, c)
    want_f = mhc_post_fwd(x, residual, post, comb)
    want_b = mhc_post_bwd(x, residual, post, comb, d_o, fuse_grad_acc=False)
    strided_r = torch.full((1, tokens, c, n), float("nan"), dtype=BF16, device="cuda").transpose(-1, -2)
    strided_r.copy_(residual)
    wide_g = torch.full((1, tokens, n, c + 64), float("nan"), dtype=BF16, device="cuda")[..., 32:32 + c]
    wide_g.copy_(d_o)
    flat = torch.full((1 + residual.numel(),), float("nan"), dtype=BF16, device="cuda")
    odd_r = flat[1:].view(residual.shape)  # contiguous, 2 bytes off a 16-byte boundary
    odd_r.copy_(residual)
    for r in (strided_r, odd_r):
        assert torch.equal(mhc_post_fwd(x, r, post, comb), want_f)
        for a, b in zip(mhc_post_bwd(x, r, post, comb, wide_g, fuse_grad_acc=False), want_b):
            assert torch.equal(a, b)
    out = torch.full((1, tokens, c, n), float("nan"), dtype=BF16, device="cuda").transpose(-1, -2)
    assert mhc_post_fwd(x, residual, post, comb, out=out) is out and torch.equal(out, want_f)
    odd_out = torch.full((1 + residual.numel(),), float("nan"), dtype=BF16, device="cuda")[1:].view(residual.shape)
    assert mhc_post_fwd(x, residual, post, comb, out=odd_out) is odd_out and torch.equal(odd_out, want_f)


@pytest.mark.gpu
@pytest.mark.parametrize("n", GRID_N)
def test_deterministic(n, poisoned):
    x, residual, post, comb, d_o = _inputs(4001, n, 7168)
    assert torch.equal(mhc_post_fwd(x, residual, post, comb), mhc_post_fwd(x, residual, post, comb))
    first = mhc_post_bwd(x, residual, post, comb, d_o, fuse_grad_acc=False)
    second = mhc_post_bwd(x, residual, post, comb, d_o, fuse_grad_acc=False)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("n", GRID_N)
def test_batch_invariant(n, poisoned):
    x, residual, post, comb, d_o = _inputs(4001, n, 2560)
    full_f = mhc_post_fwd(x, residual, post, comb)
    full_b = mhc_post_bwd(x, residual, post, comb, d_o, fuse_grad_acc=False)
    for sl in (slice(1234, 1241), slice(4000, 4001), slice(0, 1)):
        part = [t[:, sl].clone() for t in (x, residual, post, comb, d_o)]
        assert torch.equal(mhc_post_fwd(*part[:4]), full_f[:, sl])
        for a, b in zip(mhc_post_bwd(*part, fuse_grad_acc=False), full_b):
            assert torch.equal(a, b[:, sl])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == BF16 else torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("h", TOKEN_WARPS)
@pytest.mark.parametrize("c", (1280, 4096, 7168))
@pytest.mark.parametrize("n", GRID_N)
def test_token_warps_beside_the_default(n, c, h, knob_kernels, poisoned):
    """TOKEN_WARPS = h against the default kernel on the same inputs (T in {1, 7, 4001}): d_x and d_residual have
    the default's bits; d_post and d_comb are within the tolerances above, two launches give the same bits, and
    tokens launched alone (the first, the last, seven in the middle) have their bits in the batch."""
    cases = [_inputs(tokens, n, c) for tokens in (1, 7, 4001)]
    want = [K.post_bwd_launch(*case) for case in cases]
    knob_kernels(K, {"TOKEN_WARPS": h})
    for case, default in zip(cases, want):
        got = K.post_bwd_launch(*case)
        for a, b in zip(got[:2], default[:2]):
            assert torch.equal(_bits(a), _bits(b))
        _check_backward(got, *case)
        for a, b in zip(K.post_bwd_launch(*case), got):
            assert torch.equal(_bits(a), _bits(b))
        tokens = case[0].shape[1]
        for sl in (slice(0, 1), slice(tokens - 1, tokens), slice(tokens // 2, tokens // 2 + 7)):
            for a, b in zip(K.post_bwd_launch(*(t[:, sl].clone() for t in case)), got):
                assert torch.equal(_bits(a), _bits(b[:, sl]))


@pytest.mark.gpu
def test_cuda_graph_replay():
    x, residual, post, comb, d_o = _inputs(4001, 4, 4096)
    static = [t.clone() for t in (x, residual, post, comb, d_o)]
    mhc_post_fwd(*static[:4])  # compile and load outside the capture
    mhc_post_bwd(*static, fuse_grad_acc=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mhc_post_fwd(*static[:4])
        grads = mhc_post_bwd(*static, fuse_grad_acc=False)
    fresh = _inputs(4001, 4, 4096)
    for s, f in zip(static, fresh):
        s.copy_(f)
    out.fill_(float("nan"))
    for g in grads:
        g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, mhc_post_fwd(*fresh[:4]))
    for a, b in zip(grads, mhc_post_bwd(*fresh, fuse_grad_acc=False)):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    x, residual, post, comb, d_o = _inputs(4001, 4, 2560)

    def step(x, residual, post, comb, d_o, out):
        mhc_post_fwd(x, residual, post, comb, out=out)
        return mhc_post_fwd(x, residual, post, comb), *mhc_post_bwd(x, residual, post, comb, d_o, fuse_grad_acc=False)

    compiled = torch.compile(step, fullgraph=True)
    out_c = torch.full_like(residual, float("nan"))
    got = compiled(x, residual, post, comb, d_o, out_c)
    out_e = torch.full_like(residual, float("nan"))
    want = step(x, residual, post, comb, d_o, out_e)
    assert torch.equal(out_c, out_e)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("n, c", [(3, 64), (4, 12), (1, 16)])
def test_other_shapes_take_the_reference(n, c):
    x, residual, post, comb, d_o = _inputs(7, n, c)
    assert not K.takes(x, residual, post, comb, d_o)
    assert torch.equal(mhc_post_fwd(x, residual, post, comb), mhc_post_ref(x, residual, post, comb))
    for a, b in zip(mhc_post_bwd(x, residual, post, comb, d_o, fuse_grad_acc=False),
                    mhc_post_bwd_ref(x, residual, post, comb, d_o)):
        assert torch.equal(a, b)
