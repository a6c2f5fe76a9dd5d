"""Kernel tiers of the mix ops: split mixes (mhc.md §2.3) and head mix (§2.7), forward and backward.

compile: every config the GPU tests launch (and every registered one) builds for sm_90 with the library ``expf``
and IEEE division; the launchers bind their arguments to the kernels' parameters (CPU, no GPU).
gpu: the public ops against the reference over T in {0, 1, 7, 4001, 8192} and n in {2, 4, 8}, outputs poisoned
with NaN before every launch; the v1 autograd ops equal the v2.1 ops bitwise; determinism, batch invariance,
the token-block -> partial mapping, CUDA-graph replay and ``torch.compile(fullgraph=True)``.

Tolerances, derived once here:
* outputs through the sigmoid (pre, post, the head mix, their input gradients): the spec's contract (§3) against
  the fp32 reference, split rtol 1e-5 / atol 2e-5, head rtol 1e-4 / atol 1e-5;
* comb logits and the comb columns of the input gradient: bitwise (one rounded product and one rounded add,
  the reference's own chain);
* parameter gradients and partials (sums over tokens): against the same sums in float64,
  ``|err| <= (L + 8) * 2^-24 * sum env`` with ``L`` the additions on the longest path of the kernel's
  summation tree (a token's group sum, its token block, the rounds of its partial and, for the final sums, the
  P partials) and 8 ulps for each term's own rounding. A term's error is bounded by its envelope ``env``, not
  by the term: ``dz = d * sig * (1 - sig)`` inherits the few-ulp error of ``sig`` (``expf`` <= 2 ulp, a division,
  an add) in ``1 - sig``, which cancels as ``sig -> 1``, so ``|error| <= 8 u |d| sig`` (``|d| |post|`` for the
  post columns; comb terms are exact); ``env`` is that envelope (times ``|m|`` for scale terms), and it bounds
  ``|dz|`` too.
"""
import pytest
import torch

from tilefuse import _jit
from tilefuse.mhc import (mhc_head_compute_mix, mhc_head_compute_mix_bwd, mhc_head_compute_mix_fwd,
                          mhc_pre_split_mixes, mhc_pre_split_mixes_bwd, mhc_pre_split_mixes_fwd)
from tilefuse.mhc import _functions as F
from tilefuse.mhc import _mix_kernel as K
from tilefuse.reference import mhc as R
from tests.cuda_emulation import build_kernel
from tests.mhc.configs_mix import HEAD_BLOCKS, KNOB_MULTS, MULTS, mix_configs
from tests.quant.kernel_binding import fake_jit

SPLIT_TOL = dict(rtol=1e-5, atol=2e-5)
HEAD_TOL = dict(rtol=1e-4, atol=1e-5)
TERM_ULPS = 8
U = 2.0 ** -24
TOKENS = (0, 1, 7, 4001, 8192)
V, EPS = 2.0, 1e-2  # spec §4 grid: post_mult_value 2.0, pre_eps 1e-2
NAN = float("nan")


def _poisoned(*shape):
    return torch.full(shape, NAN, device="cuda")


def _within(got, exact, abs_sum, L):
    """``got`` (fp32) within ``(L + 8) 2^-24 sum|terms|`` of the float64 ``exact``, elementwise."""
    got = got.cpu().double()
    bound = (L + TERM_ULPS) * U * abs_sum
    err = (got - exact).abs()
    assert not torch.isnan(got).any(), "unwritten (NaN) elements"
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3e}, bound {bound.max().item():.3e}"


def _rounds(T, P, TB):
    return -(-(-(-T // TB)) // P)


# ---- compile tier ----

@pytest.mark.compile
@pytest.mark.parametrize("name, cfg", mix_configs(), ids=str)
def test_builds_for_sm90(name, cfg):
    src = _jit.compile_kernel(name, cfg, "sm_90").get_kernel_source()
    assert "__global__" in src
    if name != "mhc_partials_sum":
        assert "expf(" in src and "__expf" not in src  # the library exponential, never the fast intrinsic
        assert "__fdiv_rn(" in src


@pytest.mark.compile
def test_registered_configs_are_tested():
    regs = {(name, cfg) for name, cfgs in _jit.registered().items() if name.startswith("mhc_") and (
        name.startswith("mhc_split") or name.startswith("mhc_head") or name == "mhc_partials_sum") for cfg in cfgs}
    assert regs and regs <= set(mix_configs())


@pytest.mark.compile
@pytest.mark.parametrize("n", MULTS)
def test_launchers_bind(n, monkeypatch):
    calls = fake_jit(monkeypatch)
    T, M, P = 37, n * (n + 2), 5
    m, post = torch.randn(T, M), torch.rand(T, n)
    s, b = torch.randn(6)[::2], torch.randn(M)  # a strided scale is packed by the launcher
    pre, post_out, comb = torch.empty(T, n), torch.empty(T, n), torch.empty(T, n * n)
    K.split_mixes_fwd_launch(m, s, b, pre, post_out, comb, V, EPS)
    d_s, d_b = torch.empty(3), torch.empty(M)
    K.split_mixes_bwd_launch(torch.randn(T, n), torch.randn(T, n), torch.randn(T, n * n), m, post, s, b,
                             torch.empty(T, M), d_s, d_b, V, P)
    h = torch.randn(T, n)
    K.head_mix_fwd_launch(h, s[:1], b[:n], torch.empty(T, n), EPS)
    K.head_mix_bwd_launch(torch.randn(T, n), h, s[:1], b[:n], torch.empty(T, n), torch.empty(P, 1),
                          torch.empty(P, n), 8)
    assert [(c.name, c.cfg) for c in calls] == [
        ("mhc_split_mixes_fwd", (n,)), ("mhc_split_mixes_bwd", (n, 32)), ("mhc_partials_sum", ()),
        ("mhc_head_mix_fwd", (n,)), ("mhc_head_mix_bwd", (n, 8))]
    assert calls[1].env == {"Tn": T, "P": P}
    assert calls[2].env == {"P": P, "G": 3, "M": M}
    assert calls[4].env == {"Tn": T, "P": P}
    # the v1 backward entries take num_partials (a constant on CUDA, whatever the SM count)
    monkeypatch.setattr(K, "num_partials", lambda device: 7)
    del calls[:]
    K.split_mixes_bwd_launch(torch.randn(T, n), torch.randn(T, n), torch.randn(T, n * n), m, post, s, b,
                             torch.empty(T, M), d_s, d_b, V)
    K.head_mix_bwd_sums_launch(torch.randn(T, n), h, s[:1], b[:n], torch.empty(T, n), torch.empty(1), torch.empty(n))
    assert [(c.name, c.cfg, c.env.get("P")) for c in calls] == [
        ("mhc_split_mixes_bwd", (n, 32), 7), ("mhc_partials_sum", (), 7), ("mhc_head_mix_bwd", (n, 32), 7),
        ("mhc_partials_sum", (), 7)]


@pytest.mark.compile
def test_empty_launches_nothing_and_zeroes_the_sums(monkeypatch):
    calls = fake_jit(monkeypatch)
    n, M, P = 4, 24, 3
    e = torch.empty(0, n)
    K.split_mixes_fwd_launch(torch.empty(0, M), torch.randn(3), torch.randn(M), e, e, torch.empty(0, 16), V, EPS)
    d_s, d_b = torch.full((3,), NAN), torch.full((M,), NAN)
    K.split_mixes_bwd_launch(e, e, torch.empty(0, 16), torch.empty(0, M), e, torch.randn(3), torch.randn(M),
                             torch.empty(0, M), d_s, d_b, V, P)
    ps, pb = torch.full((P, 1), NAN), torch.full((P, n), NAN)
    K.head_mix_fwd_launch(e, torch.randn(1), torch.randn(n), e, EPS)
    K.head_mix_bwd_launch(e, e, torch.randn(1), torch.randn(n), e, ps, pb, 32)
    assert calls == []
    for t in (d_s, d_b, ps, pb):
        assert torch.equal(t, torch.zeros_like(t))


def test_kernel_ops_take_n_up_to_8():
    assert [n for n in range(0, 11) if K.supports(n)] == list(range(1, 9))


# ---- gpu tier: split mixes ----

def _split_data(T, n):
    M = n * (n + 2)
    m, s, b = torch.randn(T, M), torch.randn(3), torch.randn(M)
    _, post, _ = R.mhc_pre_split_mixes_ref(m, s, b, n, V, EPS)
    grads = torch.randn(T, n), torch.randn(T, n), torch.randn(T, n * n)
    return m, s, b, post.view(T, n), grads


def _split_fwd_cuda(m, s, b, n):
    T = m.shape[0]
    outs = _poisoned(T, n), _poisoned(T, n), _poisoned(T, n * n)
    mhc_pre_split_mixes_fwd(m.cuda(), s.cuda(), b.cuda(), *outs, V, EPS)
    return outs


def _split_bwd_cuda(m, s, b, post, grads):
    T, M = m.shape
    outs = _poisoned(T, M), _poisoned(3), _poisoned(M)
    mhc_pre_split_mixes_bwd(*[g.cuda() for g in grads], m.cuda(), post.cuda(), s.cuda(), b.cuda(), *outs, V)
    return outs


def _split_abs_sums(m, s, b, post, grads):
    """float64 sums over tokens of the terms' envelopes (see the module doc) behind d_scale ``[3]`` and
    d_base ``[M]``."""
    m, s, b, post = (t.double() for t in (m, s, b, post))
    d_pre, d_post, d_comb = (g.double() for g in grads)
    n = post.shape[1]
    sig = torch.sigmoid(m[:, :n] * s[0] + b[:n])
    dz = torch.cat([d_pre * sig, d_post * post, d_comb], -1).abs()
    prod = dz * m.abs()
    per_group = torch.stack([prod[:, :n].sum(-1), prod[:, n:2 * n].sum(-1), prod[:, 2 * n:].sum(-1)], -1)
    return per_group.sum(0), dz.sum(0)


@pytest.mark.gpu
@pytest.mark.parametrize("n", MULTS)
@pytest.mark.parametrize("T", TOKENS)
def test_split_fwd_matches_reference(T, n):
    m, s, b, _, _ = _split_data(T, n)
    pre, post, comb = _split_fwd_cuda(m, s, b, n)
    rp, rq, rc = R.mhc_pre_split_mixes_ref(m, s, b, n, V, EPS)
    torch.testing.assert_close(pre.cpu(), rp.view(T, n), **SPLIT_TOL)
    torch.testing.assert_close(post.cpu(), rq.view(T, n), **SPLIT_TOL)
    assert torch.equal(comb.cpu(), rc.reshape(T, n * n))


@pytest.mark.gpu
@pytest.mark.parametrize("n", MULTS)
@pytest.mark.parametrize("T", TOKENS)
def test_split_bwd_matches_reference(T, n):
    m, s, b, post, grads = _split_data(T, n)
    d_in, d_s, d_b = _split_bwd_cuda(m, s, b, post, grads)
    P = F.num_partials(torch.device("cuda"))
    ri, _, _ = R.mhc_pre_split_mixes_bwd_ref(*grads, m, post, s, b, V, P)
    torch.testing.assert_close(d_in.cpu()[:, :2 * n], ri[:, :2 * n], **SPLIT_TOL)
    assert torch.equal(d_in.cpu()[:, 2 * n:], ri[:, 2 * n:])
    _, es, eb = R.mhc_pre_split_mixes_bwd_ref(*[t.double() for t in (*grads, m, post, s, b)], V, P)
    abs_s, abs_b = _split_abs_sums(m, s, b, post, grads)
    L = n * n + K.TOKEN_BLOCK + _rounds(T, P, K.TOKEN_BLOCK) + P
    _within(d_s, es, abs_s, L)
    _within(d_b, eb, abs_b, L)


@pytest.mark.gpu
def test_split_strided_scale_and_base():
    n, T = 4, 4001
    m, s, b, post, grads = _split_data(T, n)
    s_view = torch.randn(3, 2, device="cuda")[:, 0].copy_(s)  # built on the device: .cuda() would pack them
    b_view = torch.randn(24, 3, device="cuda")[:, 1].copy_(b)
    assert not s_view.is_contiguous() and not b_view.is_contiguous()
    want = _split_fwd_cuda(m, s, b, n) + _split_bwd_cuda(m, s, b, post, grads)
    got = _split_fwd_cuda(m, s_view, b_view, n) + _split_bwd_cuda(m, s_view, b_view, post, grads)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("n", MULTS)
@pytest.mark.parametrize("A, B", [(1, 1), (2, 7), (1, 4001), (2, 4096)])
def test_split_autograd_equals_v21_ops(A, B, n):
    T, M = A * B, n * (n + 2)
    m, s, b, _, grads = _split_data(T, n)
    leaves = [t.cuda().requires_grad_(True) for t in (m.view(A, B, M), s, b)]
    pre, post, comb = mhc_pre_split_mixes(*leaves, n, V, EPS)
    pre2, post2, comb2 = _split_fwd_cuda(m, s, b, n)
    assert torch.equal(pre.detach().view(T, n), pre2) and torch.equal(post.detach().view(T, n), post2)
    assert torch.equal(comb.detach().view(T, n * n), comb2)
    torch.autograd.backward((pre, post, comb), [g.cuda().view(A, B, -1, w) for g, w in zip(grads, (1, 1, n))])
    d_in, d_s, d_b = _split_bwd_cuda(m, s, b, post2.cpu(), grads)
    assert torch.equal(leaves[0].grad.view(T, M), d_in)
    assert torch.equal(leaves[1].grad, d_s) and torch.equal(leaves[2].grad, d_b)


# ---- gpu tier: head mix ----

def _head_data(T, n):
    return torch.randn(T, n), torch.randn(1), torch.randn(n), torch.randn(T, n)


def _head_bwd_cuda(x, s, b, g, P, block):
    T, n = x.shape
    outs = _poisoned(T, n), _poisoned(P, 1), _poisoned(P, n)
    mhc_head_compute_mix_bwd(g.cuda(), x.cuda(), s.cuda(), b.cuda(), *outs, P, block)
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("n", MULTS)
@pytest.mark.parametrize("T", TOKENS)
def test_head_fwd_matches_reference(T, n):
    x, s, b, _ = _head_data(T, n)
    out = _poisoned(T, n)
    mhc_head_compute_mix_fwd(x.cuda(), s.cuda(), b.cuda(), out, EPS)
    torch.testing.assert_close(out.cpu(), R.mhc_head_compute_mix_ref(x, s, b, EPS), **HEAD_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("block", (0,) + HEAD_BLOCKS[1:])
@pytest.mark.parametrize("n", MULTS)
@pytest.mark.parametrize("T", TOKENS)
def test_head_bwd_matches_reference(T, n, block):
    x, s, b, g = _head_data(T, n)
    for P in (1, 3, F.num_partials(torch.device("cuda"))):
        d_in, ps, pb = _head_bwd_cuda(x, s, b, g, P, block)
        tb = block or R.TOKEN_BLOCK
        ri, _, _ = R.mhc_head_compute_mix_bwd_ref(g, x, s, b, P, tb)
        torch.testing.assert_close(d_in.cpu(), ri, **HEAD_TOL)
        _, es, eb = R.mhc_head_compute_mix_bwd_ref(g.double(), x.double(), s.double(), b.double(), P, tb)
        env = (torch.sigmoid(x.double() * s.double() + b.double()) * g.double()).abs()
        L = n + tb + _rounds(T, P, tb)
        _within(ps, es, R.token_partials((env * x.double().abs()).sum(-1, keepdim=True), P, tb), L)
        _within(pb, eb, R.token_partials(env, P, tb), L)


@pytest.mark.gpu
def test_head_bwd_block_goes_to_its_partial():
    """Only the tokens of block k are nonzero: only partial k mod P is written nonzero, every other row is 0."""
    T, n, P, tb = 4001, 4, 5, 8
    x, s, b, _ = _head_data(T, n)
    for k in (0, 7, T // tb):  # the last block is a 1-token tail
        g = torch.zeros(T, n)
        g[k * tb:(k + 1) * tb] = torch.randn(min(tb, T - k * tb), n)
        _, ps, pb = _head_bwd_cuda(x, s, b, g, P, tb)
        rows = torch.cat([ps, pb], 1).cpu()
        assert (rows[k % P] != 0).all()
        assert torch.equal(rows[torch.arange(P) != k % P], torch.zeros(P - 1, n + 1))


@pytest.mark.gpu
@pytest.mark.parametrize("n", MULTS)
@pytest.mark.parametrize("A, B", [(1, 1), (2, 7), (1, 4001), (2, 4096)])
def test_head_autograd_equals_v21_ops(A, B, n):
    T = A * B
    x, s, b, g = _head_data(T, n)
    leaves = [t.cuda().requires_grad_(True) for t in (x.view(A, B, n), s, b)]
    out = mhc_head_compute_mix(*leaves, EPS)
    want = _poisoned(T, n)
    mhc_head_compute_mix_fwd(x.cuda(), s.cuda(), b.cuda(), want, EPS)
    assert torch.equal(out.detach().view(T, n), want)
    out.backward(g.cuda().view(A, B, n))
    P = F.num_partials(torch.device("cuda"))
    d_in, ps, pb = _head_bwd_cuda(x, s, b, g, P, 0)
    assert torch.equal(leaves[0].grad.view(T, n), d_in)
    assert torch.equal(leaves[1].grad.cpu(), R.seq_sum(ps.cpu(), 0))
    assert torch.equal(leaves[2].grad.cpu(), R.seq_sum(pb.cpu(), 0))


# ---- gpu tier: the partial sum, determinism, batch invariance, graphs, compile ----

@pytest.mark.gpu
@pytest.mark.parametrize("P, M", [(1, 24), (132, 24), (133, 80), (7, 300)])
def test_partials_sum_is_the_in_order_sum(P, M):
    ps, pb = torch.randn(P, 3) * 100, torch.randn(P, M)
    d_s, d_b = _poisoned(3), _poisoned(M)
    K.partials_sum_launch(ps.cuda(), pb.cuda(), d_s, d_b)
    assert torch.equal(d_s.cpu(), R.seq_sum(ps, 0)) and torch.equal(d_b.cpu(), R.seq_sum(pb, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("n", MULTS)
def test_deterministic(n):
    T = 8192
    m, s, b, post, grads = _split_data(T, n)
    x, hs, hb, hg = _head_data(T, n)
    P = F.num_partials(torch.device("cuda"))
    runs = []
    for _ in range(2):
        outs = _split_fwd_cuda(m, s, b, n) + _split_bwd_cuda(m, s, b, post, grads)
        head = _poisoned(T, n)
        mhc_head_compute_mix_fwd(x.cuda(), hs.cuda(), hb.cuda(), head, EPS)
        runs.append(outs + (head,) + _head_bwd_cuda(x, hs, hb, hg, P, 0))
    for a, c in zip(*runs):
        assert torch.equal(a, c)


@pytest.mark.gpu
@pytest.mark.parametrize("n", MULTS)
def test_batch_invariance(n):
    """Per-token results (forward outputs, input gradients) of rows of a large batch equal the same rows alone."""
    T = 8192
    m, s, b, post, grads = _split_data(T, n)
    x, hs, hb, hg = _head_data(T, n)
    P = F.num_partials(torch.device("cuda"))

    def per_token(rows):
        sub = [t[rows] for t in grads]
        split = _split_fwd_cuda(m[rows], s, b, n) + _split_bwd_cuda(m[rows], s, b, post[rows], sub)[:1]
        head = _poisoned(rows.stop - rows.start, n)
        mhc_head_compute_mix_fwd(x[rows].cuda(), hs.cuda(), hb.cuda(), head, EPS)
        return split + (head, _head_bwd_cuda(x[rows], hs, hb, hg[rows], P, 0)[0])

    full = per_token(slice(0, T))
    for rows in (slice(0, 1), slice(5, 12), slice(4000, 8001), slice(T - 33, T)):
        for whole, alone in zip(full, per_token(rows)):
            assert torch.equal(whole[rows], alone)


@pytest.mark.gpu
def test_cuda_graph_replay():
    n, T = 4, 4001
    M = n * (n + 2)
    P = F.num_partials(torch.device("cuda"))
    m, s, b, post, grads = (t.cuda() if torch.is_tensor(t) else [g.cuda() for g in t] for t in _split_data(T, n))
    x, hs, hb, hg = (t.cuda() for t in _head_data(T, n))
    fwd = [torch.empty(T, w, device="cuda") for w in (n, n, n * n)]
    bwd = [torch.empty(T, M, device="cuda"), torch.empty(3, device="cuda"), torch.empty(M, device="cuda")]
    head = [torch.empty(T, n, device="cuda"), torch.empty(T, n, device="cuda"), torch.empty(P, 1, device="cuda"),
            torch.empty(P, n, device="cuda")]

    def step():
        mhc_pre_split_mixes_fwd(m, s, b, *fwd, V, EPS)
        mhc_pre_split_mixes_bwd(*grads, m, post, s, b, *bwd, V)
        mhc_head_compute_mix_fwd(x, hs, hb, head[0], EPS)
        mhc_head_compute_mix_bwd(hg, x, hs, hb, *head[1:], P)

    step()  # warm-up outside the capture (compile and load)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in (m, s, b, post, *grads, x, hs, hb, hg):
        t.copy_(torch.randn_like(t))
    for t in fwd + bwd + head:
        t.fill_(NAN)
    graph.replay()
    got = [t.clone() for t in fwd + bwd + head]
    step()
    for a, c in zip(got, fwd + bwd + head):
        assert torch.equal(a, c)


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    n, T = 4, 4001
    A, B = 1, T
    m, s, b, post, grads = _split_data(T, n)
    m, s, b = m.cuda(), s.cuda(), b.cuda()
    hg = torch.randn(A, B, n, device="cuda")

    def layer(m, s, b):
        pre, post, comb = mhc_pre_split_mixes(m, s, b, n, V, EPS)
        out = mhc_head_compute_mix(pre.squeeze(-1), s[:1], b[:n], EPS)
        return out, post, comb

    def run(fn):
        leaves = [t.clone().requires_grad_(True) for t in (m.view(A, B, -1), s, b)]
        out, post, comb = fn(*leaves)
        torch.autograd.backward((out, post, comb), (hg, grads[1].cuda().view(A, B, n, 1),
                                                    grads[2].cuda().view(A, B, n, n)))
        return [out, post, comb] + [t.grad for t in leaves]

    want = run(layer)
    got = run(torch.compile(layer, fullgraph=True))
    for a, c in zip(got, want):
        assert torch.equal(a, c)


def test_the_partial_count_is_a_constant_not_the_sm_count():
    """The parameter gradients' token grouping (and so their bits) must not depend on the GPU: the partial count of
    every CUDA device is ``PARTIALS``, read without asking the device (this test runs without one)."""
    from tilefuse.mhc import _functions as F

    for device in (torch.device("cuda", 0), torch.device("cuda", 3)):
        assert K.num_partials(device) == F.num_partials(device) == K.PARTIALS
    assert K.num_partials(torch.device("cpu")) == 1


# ---- the backward's warps a CTA (knob BWD_WARPS) and the partial sum's loads in flight (PARTIAL_ROWS) ----

# Knob sets, each run against the defaults' bits (the first, {}: 2 warps, the bench's two blocks a partial at
# T = 8192 in one round; the partial sum loading all 128 partials at once): one warp (a round a block) with 16
# partials a load round, 3 warps (rounds that end part-way, W not a power of two), 4 warps with 64 partials a load
# round.
MIX_VARIANTS = ({},
                {"BWD_WARPS": 1, "PARTIAL_ROWS": 16},
                {"BWD_WARPS": 3, "PARTIAL_ROWS": 16},
                {"BWD_WARPS": 4, "PARTIAL_ROWS": 64})


def test_the_variants_set_other_values():
    """Every knob set but the first sets each knob to another value than the module's default."""
    defaults = {"BWD_WARPS": K.BWD_WARPS, "PARTIAL_ROWS": K.PARTIAL_ROWS}
    assert MIX_VARIANTS[0] == {}
    assert all(set(kn) == set(defaults) and all(kn[k] != v for k, v in defaults.items()) for kn in MIX_VARIANTS[1:])


def _knob(knobs, name):
    return knobs.get(name, getattr(K, name))


def _variant_source(monkeypatch, knobs, name, cfg):
    import tilelang

    for k, v in knobs.items():
        monkeypatch.setattr(K, k, v)
    return tilelang.compile(_jit._FACTORIES[name][0](*cfg), target={"kind": "cuda", "arch": "sm_90"},
                            execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS)).get_kernel_source()


@pytest.mark.compile
@pytest.mark.parametrize("knobs", MIX_VARIANTS, ids=str)
@pytest.mark.parametrize("name, cfg", [c for c in mix_configs() if c[0].endswith("_bwd") or c[0] == "mhc_partials_sum"],
                         ids=str)
def test_variant_builds_for_sm90(knobs, name, cfg, monkeypatch):
    import re

    src = _variant_source(monkeypatch, knobs, name, cfg)
    assert "cudaGridDependencySynchronize" in src  # PDL
    if name == "mhc_partials_sum":
        assert re.search(rf"float vals\[{_knob(knobs, 'PARTIAL_ROWS')}\];", src)
        # one code path for the scale and base columns: its loads pick the source
        assert src.count("__fadd_rn(") == 1
        return
    assert "expf(" in src and "__expf" not in src and "__fdividef" not in src
    W = _knob(knobs, "BWD_WARPS")
    assert f"__launch_bounds__({32 * W}" in src
    # the round's block sums are added in block order, one unrolled add per warp: W adds of the tile per column
    assert W == 1 or re.search(rf"for \(int ww = 0; ww < {W}; \+\+ww\)", src)
    assert "atomic" not in src


def _mix_outputs(mults=MULTS, tokens=TOKENS, forward: bool = False) -> list:
    """Split-mixes backward (d_input, d_scale, d_base: the partial sum too) and head-mix backward outputs (d_input,
    partials; P in {1, 3, 128}, token blocks {32, 8, 50}) over ``mults`` x ``tokens`` on the current kernels, the
    split forward's too when ``forward``, then partial sums of drawn partials."""
    outs = []
    for n in mults:
        for T in tokens:
            m, s, b, post, grads = _split_data(T, n)
            outs += (list(_split_fwd_cuda(m, s, b, n)) if forward else []) + list(_split_bwd_cuda(m, s, b, post, grads))
            x, hs, hb, g = _head_data(T, n)
            for P in (1, 3, F.num_partials(torch.device("cuda"))):
                for block in (0,) + HEAD_BLOCKS[1:]:
                    outs += list(_head_bwd_cuda(x, hs, hb, g, P, block))
    for P, M in ((1, 24), (132, 24), (133, 80), (7, 300)):
        ps, pb = torch.randn(P, 3, device="cuda") * 100, torch.randn(P, M, device="cuda")
        d_s, d_b = _poisoned(3), _poisoned(M)
        K.partials_sum_launch(ps, pb, d_s, d_b)
        outs += [d_s, d_b]
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", MIX_VARIANTS[1:], ids=str)
def test_variant_gives_the_defaults_bits(knobs, knob_kernels):
    """Each knob set gives the default kernels' d_input, d_scale / d_base and head partials bit for bit (the same
    partial grouping and order) over T in {0, 1, 7, 4001, 8192}, n in {2, 4, 8}, P in {1, 3, 128} and token blocks
    {32, 8, 50} (50: two 32-token chunks a block); the data are drawn from the same seed for both runs."""
    seed = torch.initial_seed()
    want = _mix_outputs()  # the shipped path: the package's kernels
    knob_kernels(K, knobs)
    torch.manual_seed(seed)
    got = _mix_outputs()
    assert len(got) == len(want)
    for i, (a, c) in enumerate(zip(got, want)):
        assert torch.equal(a, c), i


# The backward kernels' generated CUDA on the CPU (g++): every CTA's threads as host threads, __syncthreads a
# barrier, shared memory one array a CTA (CTAs in turn), __f*_rn one rounded operation each (no contraction), expf
# the C library's (the same function for both kernels compared).
_CTA_SHIM = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>
typedef unsigned int uint;
typedef unsigned char uchar;
using std::max;
using std::min;
struct Idx { unsigned x; };
thread_local Idx threadIdx, blockIdx;
static std::barrier<>* g_bar;
#define __launch_bounds__(a, b)
#define __restrict__
static inline void __syncthreads() { g_bar->arrive_and_wait(); }
static inline void cudaGridDependencySynchronize() {}
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
"""


def _cta_emulated(src, kernel, threads, workdir):
    """``run(blocks, **args)``: ``kernel`` of ``src`` compiled for the CPU, a CTA's threads as host threads."""
    import re

    body = src[src.index('extern "C" __global__ void __launch_bounds__'):]
    body = re.sub(r"extern __shared__ __align__\(\d+\) (\w+) (\w+)\[\];", r"static \1 \2[1 << 18];", body)
    return build_kernel(_CTA_SHIM, body, kernel, threads, "cta", workdir)


def _cpu_bwd_outputs(fns, split, head, T, P, n) -> list:
    """The emulated backward kernels ``fns`` (``{(name, token block): fn}``) on one draw of ``_split_data`` and
    ``_head_data``: the split backward's d_input and partials (block 32), then the head backward's (blocks 32, 50),
    every output NaN-filled first."""
    m, s, b, post, grads = split
    x, hs, hb, hg = head
    M = n * (n + 2)
    dx, ps, pb = torch.full((T, M), NAN), torch.full((P, 3), NAN), torch.full((P, M), NAN)
    fns["mhc_split_mixes_bwd", 32](P, DPRE=grads[0], DPOST=grads[1], DCOMB=grads[2], X=m, POST=post, S=s, Bs=b,
                                   DX=dx, PS=ps, PB=pb, Tn=T, P=P, v=V)
    got = [dx, ps, pb]
    for tb in (32, 50):
        hdx, hps, hpb = torch.full((T, n), NAN), torch.full((P, 1), NAN), torch.full((P, n), NAN)
        fns["mhc_head_mix_bwd", tb](P, DOUT=hg, X=x, S=hs, Bs=hb, DX=hdx, PS=hps, PB=hpb, Tn=T, P=P)
        got += [hdx, hps, hpb]
    return got


@pytest.mark.compile
@pytest.mark.parametrize("knobs", MIX_VARIANTS[1:], ids=str)
@pytest.mark.parametrize("n", (2, 4))
def test_variant_on_the_cpu_gives_the_defaults_bits(knobs, n, tmp_path, monkeypatch):
    """The backward kernels' CUDA run on the CPU: each knob set writes the defaults' d_input and partials bit for bit
    (split mixes, token block 32; head mix, token blocks 32 and 50), over token counts with a partial last block and
    partial counts with 0 to 5 blocks each; the partials also equal the reference's grouping to its tolerance."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    runs = {}
    for tag, kn in (("default", {}), ("variant", knobs)):
        runs[tag] = {(name, tb): _cta_emulated(_variant_source(monkeypatch, kn, name, (n, tb)), f"{name}_kernel",
                                               32 * _knob(kn, "BWD_WARPS"), tmp_path)
                     for name, tb in (("mhc_split_mixes_bwd", 32), ("mhc_head_mix_bwd", 32), ("mhc_head_mix_bwd", 50))}
    for T, P in ((1, 3), (700, 7), (1000, 5), (4001, 40)):
        m, s, b, post, grads = split = _split_data(T, n)
        head = _head_data(T, n)
        outs = {tag: _cpu_bwd_outputs(fns, split, head, T, P, n) for tag, fns in runs.items()}
        for a, c in zip(outs["variant"], outs["default"]):
            assert torch.equal(a, c), (T, P)
        ri, rs, rb = R.mhc_pre_split_mixes_bwd_ref(*grads, m, post, s, b, V, P)
        assert torch.equal(outs["variant"][0][:, 2 * n:], ri[:, 2 * n:])
        torch.testing.assert_close(R.seq_sum(outs["variant"][1], 0), rs, **SPLIT_TOL)
        torch.testing.assert_close(R.seq_sum(outs["variant"][2], 0), rb, **SPLIT_TOL)


@pytest.mark.compile
@pytest.mark.parametrize("knobs", MIX_VARIANTS, ids=str)
def test_partials_sum_variant_on_the_cpu_is_the_in_order_sum(knobs, tmp_path, monkeypatch):
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    fns = {tag: _cta_emulated(_variant_source(monkeypatch, {**kn, "SUM_WARP": False}, "mhc_partials_sum", ()),
                              "mhc_partials_sum_kernel", K.THREADS, tmp_path)
           for tag, kn in (("default", {}), ("variant", knobs))}  # a thread a column (SUM_WARP: its own test)
    for P, G, M in ((1, 3, 24), (128, 3, 24), (133, 3, 80), (7, 1, 300)):
        ps, pb = torch.randn(P, G) * 100, torch.randn(P, M)
        for tag, fn in fns.items():
            os_, ob = torch.full((G,), NAN), torch.full((M,), NAN)
            fn(-(-(G + M) // K.THREADS), PS=ps, PB=pb, OS=os_, OB=ob, P=P, G=G, M=M)
            assert torch.equal(os_, R.seq_sum(ps, 0)) and torch.equal(ob, R.seq_sum(pb, 0)), (tag, P, M)


# ---- the split forward's threads per CTA (knob SPLIT_FWD_THREADS; one thread per token, nothing shared) ----

SPLIT_FWD_BASELINE = 128  # the knob's other value: THREADS, the split forward's CTA size before the knob


def test_split_fwd_threads_default_is_not_the_baseline():
    assert K.SPLIT_FWD_THREADS != SPLIT_FWD_BASELINE == K.THREADS  # the head forward keeps THREADS


@pytest.mark.compile
@pytest.mark.parametrize("n", (2, 4))
def test_split_fwd_threads_on_the_cpu_change_no_bit(n, tmp_path, monkeypatch):
    """The thread-a-token split forward's CUDA run on the CPU at 32 (the default), 64 and 128 threads a CTA: the
    same pre / post / comb bits, over token counts that leave a partial last CTA at each size; comb is the
    reference's bit for bit and pre / post within the split tolerance of it."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    name, default = "mhc_split_mixes_fwd", K.SPLIT_FWD_THREADS
    knobs = {"SPLIT_FWD_FLAT": False}  # the thread-a-token kernel (SPLIT_FWD_FLAT: its own tests)
    fns = {th: _cta_emulated(_variant_source(monkeypatch, {**knobs, "SPLIT_FWD_THREADS": th}, name, (n,)),
                             f"{name}_kernel", th, tmp_path)
           for th in (default, 64, SPLIT_FWD_BASELINE)}
    for T in (1, 37, 700):
        m, s, b, _, _ = _split_data(T, n)
        outs = {}
        for th, fn in fns.items():
            pre, post, comb = torch.full((T, n), NAN), torch.full((T, n), NAN), torch.full((T, n * n), NAN)
            fn(-(-T // th), X=m, S=s, Bs=b, PRE=pre, POST=post, COMB=comb, Tn=T, v=V, eps=EPS)
            outs[th] = (pre, post, comb)
        for th in fns:
            for a, c in zip(outs[th], outs[default]):
                assert torch.equal(a, c), (T, th)
        rp, rq, rc = R.mhc_pre_split_mixes_ref(m, s, b, n, V, EPS)
        pre, post, comb = outs[default]
        torch.testing.assert_close(pre, rp.view(T, n), **SPLIT_TOL)
        torch.testing.assert_close(post, rq.view(T, n), **SPLIT_TOL)
        assert torch.equal(comb, rc.reshape(T, n * n))


@pytest.mark.gpu
@pytest.mark.parametrize("n", MULTS)
def test_split_fwd_threads_change_no_bit(n, knob_kernels):
    """The thread-a-token split forward (``SPLIT_FWD_FLAT = False``) at the default threads a CTA gives the
    128-thread kernel's bits over the GPU grid (the data drawn from the same seed for both runs)."""
    seed, default, outs = torch.initial_seed(), K.SPLIT_FWD_THREADS, {}
    for th in (SPLIT_FWD_BASELINE, default):
        knob_kernels(K, {"SPLIT_FWD_THREADS": th, "SPLIT_FWD_FLAT": False})
        torch.manual_seed(seed)
        outs[th] = []
        for T in TOKENS:
            m, s, b, _, _ = _split_data(T, n)
            outs[th] += list(_split_fwd_cuda(m, s, b, n))
    assert len(outs[default]) == 3 * len(TOKENS)
    for a, c in zip(outs[default], outs[SPLIT_FWD_BASELINE]):
        assert torch.equal(a, c)


# ---- coalesced-access knobs: SPLIT_FWD_FLAT, SUM_WARP, BWD_STAGED (each value the same bits) ----

FAST_KNOBS = ("SPLIT_FWD_FLAT", "SUM_WARP", "BWD_STAGED")
FAST_TOKENS = (1, 7, 33, 4001, 8192)  # 0 < T < 32, T not a multiple of 32, and the bench's T
FAST_KERNELS = {"SPLIT_FWD_FLAT": ("mhc_split_mixes_fwd",), "SUM_WARP": ("mhc_partials_sum",),
                "BWD_STAGED": ("mhc_split_mixes_bwd", "mhc_head_mix_bwd")}


def test_fast_knob_defaults():
    """The shipped values (measured faster: docs/BENCHMARKS.md); the GPU knob test runs the other value of each."""
    assert {k: getattr(K, k) for k in FAST_KNOBS} == {"SPLIT_FWD_FLAT": True, "SUM_WARP": True, "BWD_STAGED": False}


@pytest.mark.compile
@pytest.mark.parametrize("knob, name, cfg", [(k, name, cfg) for k in FAST_KNOBS for name, cfg in mix_configs()
                                             if name in FAST_KERNELS[k]], ids=str)
def test_fast_knob_builds_for_sm90(knob, name, cfg, monkeypatch):
    import re

    src = _variant_source(monkeypatch, {knob: True}, name, cfg)
    assert "atomic" not in src
    if knob == "SUM_WARP":
        assert "__launch_bounds__(32" in src and "cudaGridDependencySynchronize" in src
        assert src.count("__fadd_rn(") == 1  # one in-order add path for the scale and base columns
        assert re.search(rf"float vals\[{K.PARTIAL_ROWS}\];", src)
        return
    assert "expf(" in src and "__expf" not in src and "__fdivide" not in src and "__fdiv_rn(" in src
    assert "extern __shared__" in src
    if knob == "SPLIT_FWD_FLAT":
        assert f"__launch_bounds__({K.FLAT_THREADS}" in src
        # every global access's last index term is the thread index: consecutive threads, consecutive floats
        for buf in ("X", "PRE", "POST", "COMB"):
            assert re.search(rf"\b{buf}\[[^\]]*\(\(int64_t\)\(\(int\)threadIdx\.x\)\)\)\]", src), buf
    else:
        assert f"__launch_bounds__({32 * K.BWD_WARPS}" in src and "cudaGridDependencySynchronize" in src
        assert re.search(r"\bDX\[[^\]]*\(\(\(int64_t\)\(\(int\)threadIdx\.x\)\) & \(int64_t\)31\)\)\] = __fmul_rn\("
                         r"\(\(float\*\)stage\)", src)  # d_input from the stage, lane-consecutive


def _emulated(monkeypatch, knobs, name, cfg, threads, tmp_path):
    return _cta_emulated(_variant_source(monkeypatch, knobs, name, cfg), f"{name}_kernel", threads, tmp_path)


@pytest.mark.compile
@pytest.mark.parametrize("n", (1, 2, 4))
def test_split_fwd_flat_on_the_cpu_gives_the_defaults_bits(n, tmp_path, monkeypatch):
    """SPLIT_FWD_FLAT's CUDA on the CPU writes the default forward's pre / post / comb bits (T with a partial last
    CTA at both kernels' token counts)."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    name, th = "mhc_split_mixes_fwd", K.SPLIT_FWD_THREADS
    fns = {False: (_emulated(monkeypatch, {"SPLIT_FWD_FLAT": False}, name, (n,), th, tmp_path), th),
           True: (_emulated(monkeypatch, {"SPLIT_FWD_FLAT": True}, name, (n,), K.FLAT_THREADS, tmp_path),
                  K.FLAT_TOKENS)}
    for T in (1, 7, 33, 700):
        m, s, b, _, _ = _split_data(T, n)
        outs = {}
        for flat, (fn, tokens) in fns.items():
            pre, post, comb = torch.full((T, n), NAN), torch.full((T, n), NAN), torch.full((T, n * n), NAN)
            fn(-(-T // tokens), X=m, S=s, Bs=b, PRE=pre, POST=post, COMB=comb, Tn=T, v=V, eps=EPS)
            outs[flat] = (pre, post, comb)
        for a, c in zip(outs[True], outs[False]):
            assert not torch.isnan(a).any() and torch.equal(a, c), T
        assert torch.equal(outs[True][2], R.mhc_pre_split_mixes_ref(m, s, b, n, V, EPS)[2].reshape(T, n * n))


@pytest.mark.compile
@pytest.mark.parametrize("n", (1, 2, 4))
def test_bwd_staged_on_the_cpu_gives_the_defaults_bits(n, tmp_path, monkeypatch):
    """BWD_STAGED's backward kernels on the CPU (split mixes, token block 32; head mix, token blocks 32 and 50) write
    the default kernels' d_input and partials bit for bit, over token counts with a partial last block and partial
    counts with 0 to 5 blocks each."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    th = 32 * K.BWD_WARPS
    runs = {st: {(name, tb): _emulated(monkeypatch, {"BWD_STAGED": st}, name, (n, tb), th, tmp_path)
                 for name, tb in (("mhc_split_mixes_bwd", 32), ("mhc_head_mix_bwd", 32), ("mhc_head_mix_bwd", 50))}
            for st in (False, True)}
    for T, P in ((1, 3), (7, 1), (33, 2), (700, 7), (4001, 40)):
        split, head = _split_data(T, n), _head_data(T, n)
        outs = {st: _cpu_bwd_outputs(fns, split, head, T, P, n) for st, fns in runs.items()}
        for a, c in zip(outs[True], outs[False]):
            assert not torch.isnan(a).any() and torch.equal(a, c), (T, P)


@pytest.mark.compile
def test_sum_warp_on_the_cpu_is_the_in_order_sum(tmp_path, monkeypatch):
    """SUM_WARP's partial sum on the CPU (a CTA a column) is the in-order sum (the default's bits), partial counts
    below, at and past a load round and column counts of both sources."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    fn = _emulated(monkeypatch, {"SUM_WARP": True}, "mhc_partials_sum", (), 32, tmp_path)
    for P, G, M in ((1, 3, 24), (31, 3, 3), (128, 3, 24), (133, 3, 80), (300, 1, 8)):
        ps, pb = torch.randn(P, G) * 100, torch.randn(P, M)
        os_, ob = torch.full((G,), NAN), torch.full((M,), NAN)
        fn(G + M, PS=ps, PB=pb, OS=os_, OB=ob, P=P, G=G, M=M)
        assert torch.equal(os_, R.seq_sum(ps, 0)) and torch.equal(ob, R.seq_sum(pb, 0)), (P, M)


@pytest.mark.gpu
@pytest.mark.knobs
@pytest.mark.parametrize("knob", FAST_KNOBS)
def test_fast_knob_gives_the_defaults_bits(knob, knob_kernels):
    """The knob's other value gives the shipped kernels' split forward outputs, d_input, d_scale / d_base, head
    partials and partial sums bit for bit (the data drawn from the same seed for both runs)."""
    seed = torch.initial_seed()
    want = _mix_outputs(KNOB_MULTS, FAST_TOKENS, forward=True)  # the shipped path: the package's kernels
    knob_kernels(K, {knob: not getattr(K, knob)})
    torch.manual_seed(seed)
    got = _mix_outputs(KNOB_MULTS, FAST_TOKENS, forward=True)
    assert len(got) == len(want)
    for i, (a, c) in enumerate(zip(got, want)):
        assert not torch.isnan(a).any() and torch.equal(a, c), i
