"""Kernel tiers for the RMSNorm ops (quant.md 5.11): compile (sm_90, no GPU) and gpu (vs the reference).

Tolerances (quant.md 6.3, RMSNorm is tolerance-compared): the kernel sums H squares (or H products in the
backward) in its own order, so a binary32 sum differs from torch's by at most about ``H * u`` relative
(u = 2^-24), and rsqrtf adds a few ulp. Everything downstream of rstd is compared exactly where it can be:
``o`` is recomputed from the kernel's own rstd with the spec's products (no sums), and the quantized output
must equal ``per_token_cast`` of that ``o`` bit for bit.
"""
import pytest
import torch

from tilefuse import _jit
from tilefuse.quant import _norm_kernel as K
from tilefuse.reference.norm import norm_backward_ref, norm_forward_ref
from tilefuse.reference.quant import cast as ref_cast
from tilefuse.testing import assert_equal, clear_unused_sf
from tests.quant.configs import NORM_BACKWARD, NORM_FORWARD
from tests.quant.kernel_binding import fake_jit

TOKENS = (0, 1, 7, 4001, 8192)
DT = {"bfloat16": torch.bfloat16, "float32": torch.float32}
U = 2.0 ** -24


def rtol_sum(h: int) -> float:
    """Relative tolerance of a binary32 length-h reduction in another order, plus rsqrtf's error (8 ulp)."""
    return (h + 8) * U


@pytest.mark.compile
@pytest.mark.parametrize("name,cfg", [("norm_forward", c) for c in NORM_FORWARD]
                         + [("norm_backward", c) for c in NORM_BACKWARD]
                         + [("norm_weight_grad_reduce", (d, 7168, False, K._partials(d, 7168)))
                            for d in ("bfloat16", "float32")], ids=str)
def test_builds_for_sm90(name, cfg):
    src = _jit.compile_kernel(name, cfg, "sm_90", export=False).get_kernel_source()
    assert "__global__" in src and "use_fast_math" not in src


@pytest.mark.compile
@pytest.mark.parametrize("cfg", K._BENCH_FORWARD, ids=str)
def test_forward_weight_load_precedes_row_loads(cfg):
    """FWD_W_EARLY (default): block 0's weight load, then a barrier, then the row's loads (ptxas cannot move a load
    across the barrier; without it, it issued the weight load after the sum of squares)."""
    assert K.FWD_W_EARLY and K.FWD_W_AHEAD
    src = _jit.compile_kernel("norm_forward", cfg, "sm_90", export=False).get_kernel_source()
    body = src[src.index("__launch_bounds__"):]
    w = body.index("*(uint4*)(wn + 0) = *(uint4*)(W + ")
    assert w < body.index("__syncthreads()", w) < body.index("*(uint4*)(io + ")


@pytest.mark.compile
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("cfg", [("bfloat16", 4096, True, True), ("bfloat16", 576, False, False)], ids=str)
def test_backward_staged_builds_for_sm90(stages, cfg, monkeypatch):
    """BWD_STAGES: the cp.async shared-memory ring builds (bf16), with no barrier in the row loop beyond the
    reduction's two."""
    import tilelang

    monkeypatch.setattr(K, "BWD_STAGES", stages)
    monkeypatch.setattr(K, "BWD_STAGES_NW", stages)   # the no-weight config's own knob
    monkeypatch.setattr(K, "BWD_PIPE", False)  # the staged body (BWD_PIPE has its own test)
    src = tilelang.compile(K.norm_backward_kernel(*cfg), target={"kind": "cuda", "arch": "sm_90"},
                           execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS)).get_kernel_source()
    assert f"nf_cp_wait<{stages - 1}>" in src and "nf_cp16(" in src
    loop = src[src.index("for (int k = 0;"):src.index("nf_cp_wait<0>")]
    assert loop.count("__syncthreads()") == 2


@pytest.mark.compile
@pytest.mark.parametrize("cfg,ring", [(("bfloat16", 7168, True, False), False), (("bfloat16", 4096, True, False), True),
                                      (("bfloat16", 7168, False, False), True)], ids=str)
def test_backward_ring_fits_beside_the_cluster_sums(cfg, ring, monkeypatch):
    """A 3-stage bf16 ring takes the register path where two CTAs' rings and cluster sums (4 H bytes each, with a
    weight) exceed an SM's shared memory: at H = 7168 with a weight, not without one or at H = 4096."""
    import tilelang

    monkeypatch.setattr(K, "BWD_STAGES", 3)
    monkeypatch.setattr(K, "BWD_STAGES_NW", 3)
    src = tilelang.compile(K.norm_backward_kernel(*cfg), target={"kind": "cuda", "arch": "sm_90"},
                           execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS)).get_kernel_source()
    assert ("nf_cp16(" in src[src.index("__launch_bounds__"):]) == ring


@pytest.mark.compile
@pytest.mark.parametrize("cfg,stages", [(("float32", 7168, True, True), 2), (("float32", 2048, True, False), 3),
                                        (("float32", 576, False, False), 3)], ids=str)
def test_backward_fp32_ring_builds_for_sm90(cfg, stages):
    """FP32_STAGES: fp32 rows come through the cp.async ring too, as deep as two CTAs' shared memory allows (2 stages
    of 28 KB rows at H = 7168), with rstd loaded into a register one row ahead instead of copied through the ring."""
    import tilelang

    src = tilelang.compile(K.norm_backward_kernel(*cfg), target={"kind": "cuda", "arch": "sm_90"},
                           execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS)).get_kernel_source()
    body = src[src.index("__launch_bounds__"):]
    assert f"nf_cp_wait<{stages - 1}>" in body and "nf_cp16(" in body and "nf_cp4(" not in body
    loop = body[body.index("for (int k = 0;"):]
    assert loop.count("__syncthreads()") == 2


@pytest.mark.compile
@pytest.mark.parametrize("cfg,clustered", [(("bfloat16", 7168, True, False), True),
                                           (("bfloat16", 2048, True, True), True),
                                           (("bfloat16", 7168, False, False), False),
                                           (("float32", 7168, True, False), False)], ids=str)
def test_backward_cluster_pairs_for_sm90(cfg, clustered):
    """bf16 with a weight: CTA pairs (a 2-CTA cluster launch) add their weight-gradient sums through distributed
    shared memory into NP / 2 partial rows, between a releasing barrier and a relaxed one before exit; fp32 and the
    no-weight backward keep one CTA per cluster and NP rows (or none)."""
    import tilelang

    kernel = tilelang.compile(K.norm_backward_kernel(*cfg), target={"kind": "cuda", "arch": "sm_90"},
                              execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS))
    body = kernel.get_kernel_source()
    body = body[body.index("__launch_bounds__"):]
    assert ("nf_cluster_sum4<2>(" in body) == clustered
    if clustered:
        assert body.index("nf_cluster_arrive()") < body.index("nf_cluster_wait()") < body.index("nf_cluster_sum4<2>(")
        assert body.rstrip().endswith("nf_cluster_sync_relaxed();\n}")
        assert K._partials(cfg[0], cfg[1]) == K._bwd_ctas(cfg[0], cfg[1], True) // 2
    assert "cluster" not in body or clustered


def test_backward_cta_shapes():
    """bf16 backward CTAs: two 16-byte vectors per thread (whole warps, at most 448 threads), one CTA per slot of
    132 SMs at 72 registers (at most 1024); cluster pairs with an odd count per SM: the multiple of 16 below.
    fp32: two 512-thread CTAs per SM (264)."""
    want = {576: (64, 1024, 1024), 2048: (128, 912, 924), 2560: (160, 656, 660), 4096: (256, 384, 396),
            7168: (448, 264, 264), 16384: (448, 264, 264)}
    for h, (tb, with_w, without) in want.items():
        assert (K._bwd_threads("bfloat16", h), K._bwd_ctas("bfloat16", h, True), K._bwd_ctas("bfloat16", h, False)) \
            == (tb, with_w, without), h
        assert K._partials("bfloat16", h) == with_w // 2
        assert (K._bwd_threads("float32", h), K._bwd_ctas("float32", h, True), K._partials("float32", h)) \
            == (512, 264, 264)


@pytest.mark.compile
@pytest.mark.parametrize("cfg,stages,na", [(("bfloat16", 7168, True, False), 0, True),
                                           (("bfloat16", 2048, False, False), 0, True),
                                           (("bfloat16", 7168, True, True), 0, False),
                                           (("bfloat16", 4096, True, False), 2, False)], ids=str)
def test_backward_dx_stores_skip_l1_on_the_register_path(cfg, stages, na, monkeypatch):
    """BWD_STORE_NA: the register path without residual_out_grad stores dx with st.global.L1::no_allocate (one
    16-byte store per vector), so the row's x and dy stay in L1 for the dx pass; with residual_out_grad, and in the
    ring, plain stores."""
    import tilelang

    monkeypatch.setattr(K, "BWD_STAGES", stages)
    src = tilelang.compile(K.norm_backward_kernel(*cfg), target={"kind": "cuda", "arch": "sm_90"},
                           execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS)).get_kernel_source()
    body = src[src.index("__launch_bounds__"):]
    assert ("nf_st16_na(" in body) == na


def test_forward_register_cap_rule():
    """The bf16 forward's rows per SM (its register cap) by vectors per thread: the quantizing op 12 at <= 2
    (H <= 2048), 5 at >= 8 (H > 7168), 8 between; norm_forward 6 everywhere. 8 for both restores one rule."""
    assert [K._fwd_blocks(True, c) for c in (1, 2, 3, 7, 8)] == [12, 12, 8, 8, 5]
    assert {K._fwd_blocks(False, c) for c in (1, 2, 3, 7, 8)} == {6}


@pytest.mark.compile
@pytest.mark.parametrize("h,blocks", [(8192, 5), (2048, 12)])
def test_forward_cast_launch_bounds(h, blocks):
    """FWD_BLOCKS_QUANT_WIDE / _NARROW reach the kernel as its minimum CTAs per SM."""
    import tilelang

    cfg = ("bfloat16", h, True, False, True, "row", True, False, False, 0)
    src = tilelang.compile(K.norm_forward_kernel(*cfg), target={"kind": "cuda", "arch": "sm_90"},
                           execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS)).get_kernel_source()
    assert f"__launch_bounds__(128, {blocks})" in src


@pytest.mark.compile
@pytest.mark.parametrize("cfg", [("bfloat16", 8192, True, False), ("bfloat16", 1536, False, True)], ids=str)
def test_backward_hold_dx_pass_reads_the_shared_row(cfg):
    """BWD_HOLD (default): the register path's row loop reads x and dy from global memory once (the next row's
    loads); the reduction pass copies each vector to the shared row and the dx pass reads it back (four
    nf_copy16 calls per vector), with no barrier beyond the reduction's two."""
    import tilelang

    assert K.BWD_HOLD and K.BWD_STAGES == 0
    src = tilelang.compile(K.norm_backward_kernel(*cfg), target={"kind": "cuda", "arch": "sm_90"},
                           execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS)).get_kernel_source()
    body = src[src.index("__launch_bounds__"):]
    loop = body[body.index("for (int k = 0;"):]
    loop = loop[:loop.index("\n  }\n") + 4]   # the row loop (to its closing brace)
    assert loop.count("__syncthreads()") == 2
    assert loop.count("nf_copy16(") == 4
    assert loop.count("*(uint4*)(X + ") == 1 and loop.count("*(uint4*)(DY + ") == 1


@pytest.mark.compile
@pytest.mark.parametrize("cfg", [("bfloat16", 4096, True, True), ("bfloat16", 576, False, False)], ids=str)
def test_backward_pipe_builds_for_sm90(cfg, monkeypatch):
    """BWD_PIPE (with BWD_STAGES = 3): one barrier per row, one row in flight, the same per-element expressions as
    the staged body (FFMA contraction included: the same FMUL/FFMA counts are checked on the GPU tier's bits)."""
    import tilelang

    monkeypatch.setattr(K, "BWD_STAGES", 3)
    monkeypatch.setattr(K, "BWD_STAGES_NW", 3)
    monkeypatch.setattr(K, "BWD_PIPE", True)
    src = tilelang.compile(K.norm_backward_kernel(*cfg), target={"kind": "cuda", "arch": "sm_90"},
                           execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS)).get_kernel_source()
    assert "nf_cp_wait<1>" in src and "nf_cp16(" in src
    loop = src[src.index("for (int k = 0;"):src.index("nf_cp_wait<0>")]
    assert loop.count("__syncthreads()") == 1
    assert "__fmaf_rn(" in src and "__fmul_rn(" in src   # dx through _dx_value, as in the other bodies


@pytest.mark.compile
@pytest.mark.parametrize("stages,pipe", [(3, False), (0, False), (3, True)], ids=["staged", "registers", "pipe"])
@pytest.mark.parametrize("cfg", [("bfloat16", 7168, True, True), ("bfloat16", 576, False, False)], ids=str)
def test_backward_dx_roundings_are_explicit(stages, pipe, cfg, monkeypatch):
    """Every body writes dx through _dx_value's explicit roundings (``g w - xh (A/H)`` has two products nvcc could
    fuse; it once fused them differently in two bodies): one __fmaf_rn for t, one more with residual_out_grad."""
    import tilelang

    monkeypatch.setattr(K, "BWD_STAGES", stages)
    monkeypatch.setattr(K, "BWD_STAGES_NW", stages)   # the no-weight config's own knob
    monkeypatch.setattr(K, "BWD_PIPE", pipe)
    src = tilelang.compile(K.norm_backward_kernel(*cfg), target={"kind": "cuda", "arch": "sm_90"},
                           execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS)).get_kernel_source()
    body = src[src.index("__launch_bounds__"):]
    assert body.count("__fmaf_rn(") == (2 if cfg[3] else 1)
    assert "(gw - " not in body


@pytest.mark.compile
@pytest.mark.parametrize("assign", [False, True])
def test_backward_wg_assign_launches(assign, monkeypatch):
    """WG_ASSIGN: a new weight_grad is left uninitialized and the reduce runs in its assigning config; a given
    buffer still accumulates; T = 0 returns zeros."""
    monkeypatch.setattr(K, "WG_ASSIGN", assign)
    calls = fake_jit(monkeypatch)
    h = 576
    x, dy, w, rstd = torch.randn(3, h).bfloat16(), torch.randn(3, h).bfloat16(), torch.randn(h).bfloat16(), torch.rand(3)
    K.norm_backward_launch(dy, x, w, rstd)
    K.norm_backward_launch(dy, x, w, rstd, weight_grad=torch.zeros(h))
    assert [c.cfg for c in calls if c.name == "norm_weight_grad_reduce"] == [
        ("bfloat16", h, assign, K._partials("bfloat16", h)), ("float32", h, False, K._partials("bfloat16", h))]
    _, wg = K.norm_backward_launch(dy[:0], x[:0], w, rstd[:0])
    assert torch.equal(wg, torch.zeros(h, dtype=torch.bfloat16))


@pytest.mark.compile
@pytest.mark.parametrize("cfg", [("bfloat16", 576, False, 128), ("float32", 7168, True, 264),
                                 ("bfloat16", 7168, True, 132)], ids=str)
def test_reduce_builds_for_sm90(cfg):
    """The weight-gradient reduce builds: group sums, one barrier, then the group sums added in order. A partial
    count that 8 does not divide: groups of ceil(P / 8), the last one's loads and additions cut at P."""
    import tilelang

    src = tilelang.compile(K.weight_grad_reduce_kernel(*cfg), target={"kind": "cuda", "arch": "sm_90"},
                           execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS)).get_kernel_source()
    assert src.count("__syncthreads()") == 1 and "grp[" in src
    pg = -(-cfg[3] // K._RED_GROUPS)
    assert f"float buf[{pg}];" in src
    assert src.count(f") < {cfg[3]})") == (2 if cfg[3] % pg else 0)


def test_misaligned_weight_is_passed_as_an_aligned_copy(monkeypatch):
    """A contiguous weight 2 bytes past a 16-byte boundary reaches the forward and backward kernels (16-byte vector
    loads) as an aligned copy of itself."""
    got = []
    monkeypatch.setattr(_jit, "get", lambda name, cfg: lambda *args: got.append(args))
    h = 2048
    w = torch.randn(h + 8, dtype=torch.bfloat16)[1:h + 1]
    assert w.is_contiguous() and w.data_ptr() % 16 == 2
    x = torch.randn(3, h, dtype=torch.bfloat16)
    K.norm_forward_launch(x, w, 1e-6)
    K.norm_backward_launch(torch.randn_like(x), x, w, torch.ones(3))
    for args, i in ((got[0], 1), (got[1], 2)):  # forward (x, weight, ...), backward (dy, x, weight, ...)
        assert args[i].data_ptr() % 16 == 0 and torch.equal(args[i], w)


def _fast_path(monkeypatch):
    """The forward ops' _VALIDATED path on the CPU: CPU tensors taken for eager CUDA ones, launches recorded, and
    the number of times the full checks ran."""
    from tilefuse.quant import norm as N

    monkeypatch.setattr(N, "_eager_cuda", lambda x: True)
    monkeypatch.setattr(N, "_VALIDATED", set())
    checks = []
    real = N._check_forward

    def counted(*args):
        checks.append(args[0])
        return real(*args)

    monkeypatch.setattr(N, "_check_forward", counted)
    return N, checks, fake_jit(monkeypatch)


@pytest.mark.parametrize("quant", [False, True])
def test_validated_fast_path_skips_only_checks_that_passed(monkeypatch, quant):
    """A repeated eager call with the same facts skips the checks and launches what the checked CUDA path launches,
    with the same arguments (any token count); facts outside the cached key -- another weight dtype, more than
    one row with a row stride the checks reject -- still fail with the checks' messages. (The checked calls of
    these CPU tensors then take the reference: only the fast path and the direct launches are recorded.)"""
    N, checks, calls = _fast_path(monkeypatch)
    h = 2048

    def call(x, w):
        if quant:
            return N.norm_forward_and_per_token_cast(x, w, 1e-6, "e4m3", 32, None, 1.0, True, True, True,
                                                     with_rstd=True)
        return N.norm_forward(x, w, 1e-6, with_rstd=True)

    x = torch.randn(5, h, dtype=torch.bfloat16)
    w = torch.randn(h, dtype=torch.bfloat16)
    call(x, w)  # checked, cached
    call(x, w)
    call(x[:3], w)
    assert len(checks) == 1 and len(calls) == 2
    if quant:  # the checked CUDA path's launch
        K.norm_forward_and_per_token_cast_cuda(x, w, 1e-6, "e4m3", 32, None, 1.0, True, True, True, False, None,
                                               None, None, None, 0, True)
    else:
        K.norm_forward_cuda(x, w, 1e-6, None, 1.0, None, None, True)
    assert calls[0] == calls[2] and calls[1].cfg == calls[0].cfg
    assert calls[1].env["num_tokens"] == 3 and calls[0].env["num_tokens"] == 5
    with pytest.raises(TypeError, match="weight must have dtype bfloat16"):
        call(x, w.float())
    rows = torch.randn(4, h + 8, dtype=torch.bfloat16)[:, :h]  # row stride h + 8: not a multiple of 16
    call(rows[:1], w)  # one row: its row stride is not checked
    with pytest.raises(ValueError, match="strides that are multiples of 16"):
        call(rows, w)
    assert len(checks) == 4 and len(calls) == 3


@pytest.mark.parametrize("quant", [False, True])
def test_validated_fast_path_checks_eps(monkeypatch, quant):
    """eps's value is outside the cached key but its range is in it: after a cached call, a negative, NaN or
    infinite eps still fails with the checks' message, and another valid eps takes the fast path."""
    N, checks, calls = _fast_path(monkeypatch)
    x, w = torch.randn(5, 2048, dtype=torch.bfloat16), torch.randn(2048, dtype=torch.bfloat16)

    def call(eps):
        if quant:
            return N.norm_forward_and_per_token_cast(x, w, eps, "e4m3", 32)
        return N.norm_forward(x, w, eps)

    call(1e-6)  # checked, cached
    call(1e-5)
    assert len(checks) == 1 and len(calls) == 1
    for eps in (-1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps must be finite and >= 0"):
            call(eps)
    assert len(checks) == 4 and len(calls) == 1


def test_validated_fast_path_backward(monkeypatch):
    """norm_backward's _VALIDATED path: repeated calls skip the checks and launch what the checked CUDA path
    launches (any token count); a weight_grad of another dtype, or a strided rstd, still fail with the checks'
    messages."""
    from tilefuse.quant import norm as N

    monkeypatch.setattr(N, "_eager_cuda", lambda x: True)
    monkeypatch.setattr(N, "_VALIDATED", set())
    checks = []
    real = N._check_hidden

    def counted(op, x, multiple):
        checks.append(op)
        return real(op, x, multiple)

    monkeypatch.setattr(N, "_check_hidden", counted)
    calls = fake_jit(monkeypatch)
    h = 2048
    x = torch.randn(5, h, dtype=torch.bfloat16)
    dy, w, wg = torch.randn_like(x), torch.randn(h, dtype=torch.bfloat16), torch.zeros(h)
    rstd = torch.ones(5)
    N.norm_backward(dy, x, w, rstd, None, 0.5, wg)  # checked, cached (CPU tensors: the reference)
    N.norm_backward(dy, x, w, rstd, None, 0.5, wg)
    N.norm_backward(dy[:3], x[:3], w, rstd[:3], None, 0.5, wg)
    assert len(checks) == 1 and len(calls) == 4  # the dx kernel and the weight-gradient reduce, twice
    K.norm_backward_cuda(dy, x, w, rstd, None, 0.5, wg)  # the checked CUDA path's launches
    assert calls[:2] == calls[4:] and calls[2].cfg == calls[0].cfg
    with pytest.raises(TypeError, match="weight_grad must have dtype"):
        N.norm_backward(dy, x, w, rstd, None, 0.5, torch.zeros(h, dtype=torch.float16))
    spread = torch.ones(10)[::2]  # the cached call's facts but rstd's stride
    with pytest.raises(ValueError, match="rstd must be contiguous"):
        N.norm_backward(dy, x, w, spread, None, 0.5, wg)
    assert len(checks) == 3 and len(calls) == 6


def test_fake_shapes_cpu():
    """Output allocation of the launcher's helpers (no kernel): sf layouts of 2-D and 3-D inputs."""
    x = torch.empty((7, 576))
    sf = K._sf_alloc(x, col=True, packed=True)
    assert sf.shape == (7, 5) and sf.stride() == (1, 8) and sf.dtype == torch.int32
    sf = K._sf_alloc(torch.empty((3, 7, 576)), col=True, packed=False)
    assert sf.shape == (3, 7, 18) and sf.stride() == (18 * 8, 1, 8)
    assert K._sf_alloc(x, col=False, packed=False).stride() == (18, 1)
    v = K._rows3(torch.empty((1, 64))[:, :32])
    assert v.shape == (1, 1, 32) and v.stride() == (0, 0, 1)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _poison():
    free = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    free.fill_(0xFF)
    del free


def _inputs(t, h, dtype, residual=True, weight=True, strided=False):
    g = torch.Generator(device="cuda").manual_seed(t * 7 + h)
    x = torch.randn((t, h + (32 if strided else 0)), generator=g, device="cuda").to(dtype)[:, :h]
    r = torch.randn((t, h), generator=g, device="cuda").to(dtype) if residual else None
    w = (torch.rand((h,), generator=g, device="cuda") + 0.5).to(dtype) if weight else None
    return x, r, w


def _o_from_rstd(h_in, w, rstd, scale, dtype):
    """The spec's o from a given rstd: products only, so exact in torch."""
    hf = h_in.float()
    f = torch.tensor(scale, device=hf.device) if w is None else w.float() * scale
    return ((hf * rstd.unsqueeze(-1)) * f).to(dtype)



@pytest.mark.parametrize("shape", ((1, 64), (5, 64), (1, 1, 64), (3, 1, 64), (1, 4, 64), (2, 3, 64)), ids=str)
def test_rows3_view(shape):
    """The launcher's (B, T, H) view: the same elements at the same storage offset, unit last stride, the strides
    of size-1 dimensions 0 (the kernel assumes every non-last stride is a multiple of 16) and the others kept."""
    base = torch.arange(4 * 5 * 96, dtype=torch.float32).view(4, 5, 96)
    t = base[1:1 + shape[0], :shape[1], 16:16 + shape[-1]] if len(shape) == 3 else base[2, :shape[0], 32:32 + shape[1]]
    v = K._rows3(t)
    want = t if t.dim() == 3 else t.unsqueeze(0)
    assert v.shape == want.shape and v.storage_offset() == t.storage_offset()
    assert v.stride() == tuple(0 if n == 1 else s for n, s in zip(want.shape[:-1], want.stride()[:-1])) + (1,)
    assert torch.equal(v, want)


@pytest.mark.compile
@pytest.mark.parametrize("shape", ((7, 576), (2, 7, 576)), ids=str)
@pytest.mark.parametrize("layout", ((False, False), (True, True)), ids=str)
def test_forward_launcher_binds_kernel_parameters(shape, layout, monkeypatch):
    """2-D and 3-D rows, rstd and every sf layout: each launch argument fits the kernel's parameters under one
    binding of the symbolic sizes (batch, tokens, strides)."""
    col, packed = layout
    calls = fake_jit(monkeypatch)
    x = torch.randn(shape).to(torch.bfloat16)
    w = torch.randn(shape[-1]).to(torch.bfloat16)
    K.norm_forward_launch(x, w, 1e-6, None, 1.0, with_rstd=True, quant=True, use_tma_aligned_col_major_sf=col,
                          round_sf=True, use_packed_ue8m0=packed)
    batch = shape[0] if len(shape) == 3 else 1
    assert [(c.name, c.env["batch"], c.env["num_tokens"]) for c in calls] == [("norm_forward", batch, shape[-2])]

@pytest.mark.compile
@pytest.mark.parametrize("t", (1, 7))
@pytest.mark.parametrize("xd,has_w,has_rg", [("bfloat16", True, True), ("float32", False, False),
                                              ("float32", True, False)], ids=str)
def test_backward_launcher_binds_kernel_parameters(t, xd, has_w, has_rg, monkeypatch):
    """Row-strided ``x``/``out_grad``/``residual_out_grad`` (three different row strides), weight and residual
    grad present or absent, one row: the dx launch and the weight-grad reduce each fit their kernel."""
    dtype, h = DT[xd], 576
    calls = fake_jit(monkeypatch)
    x = torch.randn(t, h + 32).to(dtype)[:, :h]
    dy = torch.randn(t, h + 64).to(dtype)[:, :h]
    rg = torch.randn(t, h).to(dtype) if has_rg else None
    w = torch.randn(h).to(dtype) if has_w else None
    rstd = torch.rand(t)
    K.norm_backward_launch(dy, x, w, rstd, rg, 0.75, None)
    want = [("norm_backward", (xd, h, has_w, has_rg), t)]
    if has_w:
        want.append(("norm_weight_grad_reduce", (xd, h, K.WG_ASSIGN, K._partials(xd, h)), None))  # assigns
    assert [(c.name, c.cfg, c.env.get("num_tokens")) for c in calls] == want
    if t > 1:
        assert (calls[0].env["x_st"], calls[0].env["dy_st"]) == (h + 32, h + 64)
    if has_w:  # an existing fp32 accumulator for a bf16 weight picks the fp32 reduce
        calls.clear()
        K.norm_backward_launch(dy, x, w, rstd, rg, 0.75, torch.zeros(h))
        assert [(c.name, c.cfg) for c in calls][1:] == [("norm_weight_grad_reduce", ("float32", h, False,
                                                                                     K._partials(xd, h)))]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("xd,h,has_w,has_r", [("bfloat16", 7168, True, True), ("float32", 7168, True, True),
                                              ("bfloat16", 576, False, False), ("float32", 576, False, False)])
def test_forward_gpu(t, xd, h, has_w, has_r):
    dtype = DT[xd]
    x, r, w = _inputs(t, h, dtype, has_r, has_w, strided=True)
    _poison()
    out, _, _, rstd, res_out = K.norm_forward_launch(x, w, 1e-6, r, 0.5, with_rstd=True)
    ro, rrstd, rh = norm_forward_ref(x, w, 1e-6, r, 0.5)
    if has_r:
        assert_equal(res_out, rh)  # one rounded add: exact
    torch.testing.assert_close(rstd, rrstd, rtol=rtol_sum(h), atol=0)
    assert_equal(out, _o_from_rstd(rh if has_r else x, w, rstd, 0.5, dtype))
    # determinism and batch invariance: rerun, and rerun on the first row alone
    out2, _, _, rstd2, _ = K.norm_forward_launch(x, w, 1e-6, r, 0.5, with_rstd=True)
    assert_equal(out2, out)
    assert_equal(rstd2, rstd)
    if t > 1:
        o1, _, _, s1, _ = K.norm_forward_launch(x[:1], w, 1e-6, None if r is None else r[:1], 0.5, with_rstd=True)
        assert_equal(o1, out[:1])
        assert_equal(s1, rstd[:1])


def _assert_cast_of(o, out, sf, h, round_sf, col, packed):
    """``out``, ``sf`` are the reference's per_token_cast(o, 'e4m3', 32) with these sf flags (packed words compared
    on their used bytes); returns the reference's sf."""
    r_out, r_sf = ref_cast(o, "e4m3", (1, 32), round_sf=round_sf, use_tma_aligned_col_major_sf=col,
                           use_packed_ue8m0=packed)
    assert_equal(out, r_out)
    got, want = sf.contiguous(), r_sf.contiguous()
    if packed:
        got, want = clear_unused_sf(got, h, 32), clear_unused_sf(want, h, 32)
    assert_equal(got, want)
    return r_sf


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("xd", ["bfloat16", "float32"])
@pytest.mark.parametrize("col,round_sf,packed", [(False, False, False), (True, False, False), (True, True, True)])
def test_forward_cast_gpu(t, xd, col, round_sf, packed):
    dtype, h = DT[xd], 7168
    x, r, w = _inputs(t, h, dtype)
    if t > 2:  # adversarial rows: an all-zero row, tiny (subnormal-scale) values, huge values
        x[0] = 0
        r[0] = 0
        x[1] = x[1] * 1e-30
        r[1] = 0
        x[2] = x[2] * 1e4
    _poison()
    out, sf, bf, rstd, _ = K.norm_forward_launch(x, w, 1e-6, r, 1.0, with_rstd=True, quant=True,
                                                 use_tma_aligned_col_major_sf=col, round_sf=round_sf,
                                                 use_packed_ue8m0=packed, with_out_bf16=True)
    _, rrstd, rh = norm_forward_ref(x, w, 1e-6, r, 1.0)
    torch.testing.assert_close(rstd, rrstd, rtol=rtol_sum(h), atol=0)
    o = _o_from_rstd(rh, w, rstd, 1.0, dtype)
    assert_equal(bf, o.to(torch.bfloat16))
    r_sf = _assert_cast_of(o, out, sf, h, round_sf, col, packed)
    assert sf.shape == r_sf.shape and (sf.stride() == r_sf.stride() or t == 0)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
def test_forward_cast_given_row_packed_out_gpu(t):
    """Pre-allocated out and row-major packed out_sf (quant.md 5.11), written in place."""
    h = 7168
    x, _, w = _inputs(t, h, torch.bfloat16, residual=False)
    out = torch.empty((t, h), dtype=torch.float8_e4m3fn, device="cuda")
    out_sf = torch.full((t, h // 32 // 4), -1, dtype=torch.int32, device="cuda")
    got, sf, _, rstd, _ = K.norm_forward_launch(x, w, 1e-6, None, 1.0, out=out, with_rstd=True, quant=True,
                                                round_sf=True, use_packed_ue8m0=True, out_sf=out_sf)
    assert got is out and sf is out_sf
    o = _o_from_rstd(x, w, rstd, 1.0, torch.bfloat16)
    r_out, r_sf = ref_cast(o, "e4m3", (1, 32), round_sf=True, use_tma_aligned_col_major_sf=True,
                           use_packed_ue8m0=True)
    assert_equal(out, r_out)
    assert_equal(out_sf, r_sf.contiguous())  # 224 groups: whole words, no padding


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("quant", [False, True])
def test_validated_fast_path_gpu(quant):
    """The public forward ops called again with the same facts (the _VALIDATED path, no checks) give the first
    call's bits, at another token count too; a misaligned weight is read as its aligned copy; facts outside the
    cached key still fail with the checks' messages."""
    from tilefuse.quant import norm as N

    h = 2048
    x, _, w = _inputs(7, h, torch.bfloat16, residual=False)

    def call(x, w):
        if quant:
            (d, sf), _, rstd, _ = N.norm_forward_and_per_token_cast(x, w, 1e-6, "e4m3", 32, None, 1.0, True, True,
                                                                    True, with_rstd=True)
            return d.view(torch.uint8), sf, rstd
        o, rstd, _ = N.norm_forward(x, w, 1e-6, with_rstd=True)
        return o, rstd

    first = call(x, w)
    for got, want in zip(call(x, w), first):
        assert_equal(got, want)
    for got, want in zip(call(x[:3], w), first):
        assert_equal(got[:3], want[:3], check_stride=False)   # sf: column-major, leading dimension align(T, 4)
    w_odd = torch.empty(h + 8, dtype=w.dtype, device="cuda")[1:h + 1].copy_(w)  # 2 bytes past 16-byte alignment
    for got, want in zip(call(x, w_odd), first):
        assert_equal(got, want)
    with pytest.raises(TypeError, match="weight must have dtype bfloat16"):
        call(x, w.float())
    rows = torch.randn(4, h + 8, device="cuda").to(torch.bfloat16)[:, :h]  # row stride h + 8
    call(rows[:1], w)
    with pytest.raises(ValueError, match="strides that are multiples of 16"):
        call(rows, w)


@pytest.mark.gpu
def test_validated_fast_path_backward_gpu():
    """norm_backward called again with the same facts (no checks) gives the first call's bits, at another token
    count too (dx); a strided rstd still fails."""
    from tilefuse.quant import norm as N

    h = 2048
    x, dy, w = _inputs(7, h, torch.bfloat16)
    rstd = torch.rand(7, device="cuda") + 0.5
    first = N.norm_backward(dy, x, w, rstd, None, 0.5)
    for got, want in zip(N.norm_backward(dy, x, w, rstd, None, 0.5), first):
        assert_equal(got, want)
    assert_equal(N.norm_backward(dy[:3], x[:3], w, rstd[:3], None, 0.5)[0], first[0][:3])
    with pytest.raises(ValueError, match="rstd must be contiguous"):
        N.norm_backward(dy, x, w, torch.ones(14, device="cuda")[::2], None, 0.5)


@pytest.mark.gpu
def test_forward_cast_3d_col_and_mega_gpu():
    x, _, w = _inputs(2 * 7, 576, torch.bfloat16, residual=False)
    x3 = x.view(2, 7, 576)
    out, sf, _, rstd, _ = K.norm_forward_launch(x3, w, 1e-6, None, 1.0, with_rstd=True, quant=True,
                                                use_tma_aligned_col_major_sf=True, round_sf=True,
                                                use_packed_ue8m0=True)
    o = _o_from_rstd(x3, w, rstd, 1.0, torch.bfloat16)
    for b in range(2):
        r_out, r_sf = ref_cast(o[b], "e4m3", (1, 32), round_sf=True, use_tma_aligned_col_major_sf=True,
                               use_packed_ue8m0=True)
        assert_equal(out[b], r_out)
        assert_equal(clear_unused_sf(sf[b].contiguous(), 576, 32), clear_unused_sf(r_sf.contiguous(), 576, 32))
    # mega-MoE sf (H % 128 == 0, round_sf): the spec's scatter (public op helper) of the kernel's own o
    from tilefuse import formats as F
    from tilefuse.quant.norm import _write_mega_moe_sf
    t, h, bm = 300, 7168, 64
    x, _, w = _inputs(t, h, torch.bfloat16, residual=False)
    ld = F.cdiv(t, bm) * F.align(bm, 128) + 5
    store = torch.full((h // 128, ld), -1, dtype=torch.int32, device="cuda")
    want_store = store.clone()
    _, _, _, rstd, _ = K.norm_forward_launch(x, w, 1e-6, None, 1.0, with_rstd=True, quant=True, round_sf=True,
                                             mega_moe_sf=store.t()[:t], mega_moe_block_m=bm)
    o = _o_from_rstd(x, w, rstd, 1.0, torch.bfloat16)
    _write_mega_moe_sf(want_store.t()[:t], F.ue8m0_encode(ref_cast(o, "e4m3", (1, 32), round_sf=True)[1]), bm)
    assert_equal(store, want_store)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("xd,h,has_w,has_r", [("bfloat16", 7168, True, True), ("float32", 7168, True, True),
                                              ("bfloat16", 576, False, False)])
def test_backward_gpu(t, xd, h, has_w, has_r):
    dtype = DT[xd]
    x, dy, w = _inputs(t, h, dtype, True, has_w, strided=True)
    rg = torch.randn((t, h), device="cuda").to(dtype) if has_r else None
    rstd = torch.rand((t,), device="cuda") + 0.5
    wg0 = torch.randn((h,), device="cuda").to(dtype) if has_w else None
    _poison()
    dx, wg = K.norm_backward_launch(dy, x, w, rstd, rg, 0.75, None if wg0 is None else wg0.clone())
    rdx, rwg = norm_backward_ref(dy, x, w, rstd, rg, 0.75)
    # dx: one length-h dot product per row, then per-element products: tolerance of the sum times |xh * A/H|
    tol = {"bfloat16": 2 ** -7, "float32": rtol_sum(h) * 16}[xd]
    torch.testing.assert_close(dx.float(), rdx.float(), rtol=tol, atol=tol)
    if has_w:
        # weight_grad: a length-t sum per column, in NP partials; tolerance relative to the sum of |terms|
        mag = ((x.float() * rstd[:, None]).abs() * (dy.float() * 0.75).abs()).sum(0) + wg0.float().abs()
        err = (wg.float() - (wg0.float() + rwg).to(dtype).float()).abs()
        ulp = 2 ** -7 if dtype == torch.bfloat16 else 0.0
        assert bool((err <= (t + 8) * U * mag + ulp * (wg0.float() + rwg).abs()).all())
    dx2, wg2 = K.norm_backward_launch(dy, x, w, rstd, rg, 0.75, None if wg0 is None else wg0.clone())
    assert_equal(dx2, dx)
    if has_w:
        assert_equal(wg2, wg)
    if t > 1:
        dx1, _ = K.norm_backward_launch(dy[:1], x[:1], w, rstd[:1], None if rg is None else rg[:1], 0.75)
        assert_equal(dx1, dx[:1])


@gpu
@pytest.mark.gpu
def test_graph_and_compile_gpu():
    x, r, w = _inputs(64, 7168, torch.bfloat16)
    eager = K.norm_forward_and_per_token_cast_cuda(x, w, 1e-6, "e4m3", 32, r, round_sf=True,
                                                   use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True,
                                                   with_rstd=True)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        K.norm_forward_launch(x, w, 1e-6, r, 1.0, with_rstd=True, quant=True, use_tma_aligned_col_major_sf=True,
                              round_sf=True, use_packed_ue8m0=True)  # warm up (load the kernel)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = K.norm_forward_launch(x, w, 1e-6, r, 1.0, with_rstd=True, quant=True,
                                         use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)
    g.replay()
    torch.cuda.synchronize()
    assert_equal(captured[0], eager[0][0])
    assert_equal(captured[1], eager[0][1])

    def f(x, w, r):
        return K.norm_forward_and_per_token_cast_cuda(x, w, 1e-6, "e4m3", 32, r, round_sf=True,
                                                      use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True,
                                                      with_rstd=True)

    comp = torch.compile(f, fullgraph=True)(x, w, r)
    assert_equal(comp[0][0], eager[0][0])
    assert_equal(comp[0][1], eager[0][1])
    assert_equal(comp[2], eager[2])
    dy = torch.randn_like(x)
    rstd = eager[2]

    def b(dy, x, w, rstd):
        return K.norm_backward_cuda(dy, x, w, rstd)

    got = torch.compile(b, fullgraph=True)(dy, x, w, rstd)
    want = K.norm_backward_cuda(dy, x, w, rstd)
    assert_equal(got[0], want[0])
    assert_equal(got[1], want[1])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fill", ("nan", "inf"))
@pytest.mark.parametrize("col,round_sf,packed", [(False, False, False), (True, False, False), (True, True, True)])
def test_forward_cast_nan_inf_gpu(fill, col, round_sf, packed):
    """quant.md 1.7 in the quantizing forward: a NaN/inf input makes its row NaN (rstd NaN or 0); a weight
    beyond the bf16 range makes ``o`` overflow to +-inf in some groups (sf = inf, sf_inv = 0: the round mode
    used to give sf_inv = -inf). The cast of the kernel's own ``o`` must equal the reference's bit for bit."""
    dtype, h, t = torch.bfloat16, 7168, 37
    x, r, w = _inputs(t, h, dtype)
    x[3, 5] = float(fill)
    x[4, 100] = -float(fill)
    w[64:70] = 3e38  # |o| = |h| * rstd * 3e38 overflows to inf for |h * rstd| > ~1.13
    out, sf, bf, rstd, _ = K.norm_forward_launch(x, w, 1e-6, r, 1.0, with_rstd=True, quant=True,
                                                 use_tma_aligned_col_major_sf=col, round_sf=round_sf,
                                                 use_packed_ue8m0=packed, with_out_bf16=True)
    _, _, rh = norm_forward_ref(x, w, 1e-6, r, 1.0)
    o = _o_from_rstd(rh, w, rstd, 1.0, dtype)
    assert bool(o.isinf().any())
    nan = bf.isnan()
    assert torch.equal(nan, o.isnan())  # NaN payloads are not part of the contract
    assert_equal(torch.where(nan, 0, bf), torch.where(nan, 0, o.to(torch.bfloat16)))
    _assert_cast_of(o, out, sf, h, round_sf, col, packed)


# Knob variants (TILEFUSE_KNOBS sweeps, module doc of _jit.knobs): each must give the default's bits exactly.
KNOB_VARIANTS = [  # the defaults: BWD_STAGES=0, BWD_STAGES_NW=0 (BWD_PIPE off), WG_ASSIGN, RED_PDL, FWD_W_AHEAD,
    #                 FWD_W_EARLY (FP32_STAGES: test_fp32_backward_ring_matches_register_path_gpu). At H = 7168 a
    #                 3-stage ring does not fit beside the weight gradient's cluster sums (the register path)
    {"BWD_STAGES": 2, "WG_ASSIGN": False, "RED_PDL": False, "FWD_W_AHEAD": False},
    {"FWD_BLOCKS": 7, "FWD_BLOCKS_QUANT": 7},
    {"BWD_STAGES": 2},
    {"BWD_STAGES_NW": 3},
    {"BWD_STAGES_NW": 3, "BWD_PIPE": True},
    {"BWD_PDL": True, "BWD_TRIGGER": True},
    {"WG_ASSIGN": False, "RED_PDL": False},
    {"FWD_W_EARLY": False},
    {"BWD_STORE_NA": False},
    {"BWD_HOLD": False},
]


def _bits(t):
    if t is None:
        return None
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).cpu()


def _knob_outputs(x, w, dy, rstd, rg, scale):
    fwd = K.norm_forward_launch(x, w, 1e-6, None, scale)[0]
    q = K.norm_forward_launch(x, w, 1e-6, None, scale, quant=True, use_tma_aligned_col_major_sf=True,
                              round_sf=True, use_packed_ue8m0=True)
    bwd = K.norm_backward_launch(dy, x, w, rstd, rg, scale, w.clone())
    bwd = (*bwd, K.norm_backward_launch(dy, x, w, rstd, rg, scale)[1])   # a new weight_grad (WG_ASSIGN)
    bwd = (*bwd, K.norm_backward_launch(dy, x, None, rstd, rg, scale)[0])  # no weight (BWD_STAGES_NW)
    # 3-D (4 batches of 250 rows)
    x3 = x[:1000].view(4, 250, -1)
    fwd3 = K.norm_forward_launch(x3, w, 1e-6, None, scale)[0]
    q3 = K.norm_forward_launch(x3, w, 1e-6, None, scale, quant=True, use_tma_aligned_col_major_sf=True,
                               round_sf=True, use_packed_ue8m0=True)
    # residual (rounded sum written back), rstd, the bf16 copy, row-major fp32 sf, and the mega-MoE sf words
    res = x.flip(0)
    fr = K.norm_forward_launch(x, w, 1e-6, res, scale, with_rstd=True)
    qr = K.norm_forward_launch(x, w, 1e-6, res, scale, with_rstd=True, quant=True, with_out_bf16=True)
    t, bm = x.size(0), 64
    mega = torch.full((x.size(1) // 128, -(-t // bm) * 128 + 5), -1, dtype=torch.int32, device=x.device)
    qm = K.norm_forward_launch(x, w, 1e-6, None, scale, with_rstd=True, quant=True, round_sf=True,
                               mega_moe_sf=mega.t()[:t], mega_moe_block_m=bm)
    return [_bits(t) for t in (fwd, q[0], q[1], *bwd, fwd3, q3[0], q3[1], fr[0], fr[3], fr[4], qr[0], qr[1], qr[2],
                               qr[3], qm[0], qm[1], qm[3], mega)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("knobs", KNOB_VARIANTS, ids=str)
@pytest.mark.parametrize("scale,has_rg", [(1.0, False), (0.75, True)])
def test_knob_variants_bit_identical_gpu(knobs, scale, has_rg, knob_kernels):
    """The kernels built with a knob variant (compiled here, outside the caches) give the default's bits,
    NaN and inf inputs included."""

    dtype, h, t = torch.bfloat16, 7168, 1001
    x, _, w = _inputs(t, h, dtype, residual=False)
    dy = torch.randn((t, h), device="cuda").to(dtype)
    rg = torch.randn((t, h), device="cuda").to(dtype) if has_rg else None
    rstd = torch.rand((t,), device="cuda") + 0.5
    x[3, 5], x[700, 9] = float("nan"), float("inf")
    dy[5, 11], dy[300, 4000] = float("nan"), -float("inf")
    want = _knob_outputs(x, w, dy, rstd, rg, scale)
    knob_kernels(K, knobs)
    got = _knob_outputs(x, w, dy, rstd, rg, scale)
    for i, (g, e) in enumerate(zip(got, want)):
        assert torch.equal(g, e), f"output {i}"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("h", [8192, 1536])
@pytest.mark.parametrize("scale,has_rg", [(1.0, False), (0.75, True)])
def test_wide_and_narrow_rows_knob_variants_bit_identical_gpu(h, scale, has_rg, knob_kernels):
    """At H = 8192 (three vectors per backward thread, eight per forward thread) and H = 1536 (two): the previous
    register caps and the backward's dx pass reading the row from global memory again (FWD_BLOCKS_QUANT_WIDE = 8,
    FWD_BLOCKS_QUANT_NARROW = 8, BWD_HOLD = False) give the defaults' bits, NaN and inf inputs included."""
    t = 1001
    x, _, w = _inputs(t, h, torch.bfloat16, residual=False)
    dy = torch.randn((t, h), device="cuda").to(torch.bfloat16)
    rg = torch.randn((t, h), device="cuda").to(torch.bfloat16) if has_rg else None
    rstd = torch.rand((t,), device="cuda") + 0.5
    x[3, 5], x[700, 9] = float("nan"), float("inf")
    dy[5, 11], dy[300, h - 1] = float("nan"), -float("inf")
    want = _knob_outputs(x, w, dy, rstd, rg, scale)
    knob_kernels(K, {"FWD_BLOCKS_QUANT_WIDE": 8, "FWD_BLOCKS_QUANT_NARROW": 8, "BWD_HOLD": False})
    got = _knob_outputs(x, w, dy, rstd, rg, scale)
    for i, (g, e) in enumerate(zip(got, want)):
        assert torch.equal(g, e), f"output {i}"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("h,has_w,has_rg", [(7168, True, True), (7168, False, False), (2048, True, False)], ids=str)
def test_fp32_backward_ring_matches_register_path_gpu(h, has_w, has_rg, knob_kernels):
    """The fp32 ring (FP32_STAGES, the default) and the register path (FP32_STAGES = 0) give the same dx and
    weight_grad bits, NaN and inf inputs included."""
    t = 1001
    x, _, w = _inputs(t, h, torch.float32, residual=False, weight=has_w)
    dy = torch.randn((t, h), device="cuda")
    rg = torch.randn((t, h), device="cuda") if has_rg else None
    rstd = torch.rand((t,), device="cuda") + 0.5
    x[3, 5], x[700, 9] = float("nan"), float("inf")
    dy[5, 11], dy[300, h - 1] = float("nan"), -float("inf")

    def run():
        dx, wg = K.norm_backward_launch(dy, x, w, rstd, rg, 0.75)
        return [_bits(dx)] + ([_bits(wg)] if has_w else [])

    want = run()
    knob_kernels(K, {"FP32_STAGES": 0})
    got = run()
    for i, (g, e) in enumerate(zip(got, want)):
        assert torch.equal(g, e), f"output {i}"


# FWD_HALF_ROWS (on by default; False is the one-row-per-CTA layout): rows whose last vector slot leaves threads 64-127 idle take 64 threads each, two
# rows per CTA, in the same order of the sum of squares: the one-row layout's bits.
HALF_SF = [(False, False, False), (False, True, False), (True, True, True)]   # (col, round_sf, packed)


def _forward_source(cfg) -> str:
    """The generated CUDA of one forward config (lowered only: no nvcc)."""
    import tilelang
    from tilelang import tvm

    tgt = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with tgt, tvm.transform.PassContext(config=dict(_jit._PASS_CONFIGS)):
        return tilelang.lower(K.norm_forward_kernel(*cfg), target=tgt).kernel_source


def test_half_rows_rule(monkeypatch):
    """FWD_HALF_ROWS applies where ceil(V / 64) is odd for a row of V 16-byte vectors (bf16 H = 512, 1536, 2560;
    fp32 H = 576, 768), not at bf16 H = 576, 2048, 7168; False turns it off everywhere."""
    vectors = {"bf16 512": 64, "bf16 576": 72, "bf16 1536": 192, "bf16 2048": 256, "bf16 2560": 320,
               "bf16 7168": 896, "fp32 576": 144, "fp32 768": 192, "fp32 1536": 384}
    assert K.FWD_HALF_ROWS is True
    assert {k for k, v in vectors.items() if K._half_rows(v)} == {"bf16 512", "bf16 1536", "bf16 2560", "fp32 576",
                                                                   "fp32 768"}
    monkeypatch.setattr(K, "FWD_HALF_ROWS", False)
    assert not any(K._half_rows(v) for v in vectors.values())


@pytest.mark.compile
@pytest.mark.parametrize("h", [576, 2048, 7168])
def test_half_rows_leave_other_widths_alone(h, monkeypatch):
    """Where the rule does not apply the knob changes nothing: the same generated CUDA."""
    cfgs = [("bfloat16", h, True, False, True, "col_packed", True, False, False, 0),
            ("bfloat16", h, True, True, False, "row", False, False, True, 0)]
    monkeypatch.setattr(K, "FWD_HALF_ROWS", False)
    want = [_forward_source(c) for c in cfgs]
    monkeypatch.setattr(K, "FWD_HALF_ROWS", True)
    assert [_forward_source(c) for c in cfgs] == want


@pytest.mark.compile
@pytest.mark.parametrize("rnd,layout", [(False, "row"), (True, "row"), (True, "col_packed")], ids=str)
def test_half_rows_builds_for_sm90(rnd, layout, monkeypatch):
    """bf16 H = 1536 with FWD_HALF_ROWS: a CTA of 128 threads per row pair, 3 vectors per thread, two
    accumulators, 8 CTAs per SM in the launch bounds (ptxas: 40-47 registers, no spills); it builds."""
    import tilelang

    monkeypatch.setattr(K, "FWD_HALF_ROWS", True)
    cfg = ("bfloat16", 1536, True, False, True, layout, rnd, False, False, 0)
    src = tilelang.compile(K.norm_forward_kernel(*cfg), target={"kind": "cuda", "arch": "sm_90"},
                           execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS)).get_kernel_source()
    assert "__launch_bounds__(128, 8)" in src and "bfloat16_t io[24];" in src and "acc2" in src


def _rstd_in_kernel_order(h_in, eps):
    """rstd with the forward's fixed order of the sum of squares (the 128-thread layout): thread tx adds the
    squares of its vectors c * 128 + tx in order, element by element; a butterfly over each warp; the four warp
    sums in warp order; then ``rsqrtf(S / H + eps)`` (a true division, torch's CUDA rsqrt). The squares of bf16
    values of normal scale are exact in binary32, so the kernel's fused multiply-adds equal these adds."""
    hf = h_in.float()
    t, hdim = hf.shape
    n, e_per = K._THREADS, 16 // h_in.element_size()
    c_n = -(-hdim // e_per // n)
    sq = torch.zeros((t, c_n * n * e_per), device=hf.device)
    sq[:, :hdim] = hf * hf
    sq = sq.view(t, c_n, n, e_per)
    acc = torch.zeros((t, n), device=hf.device)
    for c in range(c_n):
        for e in range(e_per):
            acc = acc + sq[:, c, :, e]
    lanes = acc.view(t, n // 32, 32)
    idx = torch.arange(32, device=hf.device)
    for m in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[:, :, idx ^ m]
    tot = lanes[:, 0, 0]
    for w in range(1, n // 32):
        tot = tot + lanes[:, w, 0]
    eps_t = torch.tensor(eps, dtype=torch.float32, device=hf.device)
    return torch.rsqrt(tot / torch.full_like(tot, hdim) + eps_t)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("h", [1536, 576, 7168])
@pytest.mark.parametrize("has_w", [True, False])
def test_forward_sum_order_gpu(h, has_w):
    """The default forward's rstd equals the fixed-order reference (_rstd_in_kernel_order) bit for bit."""
    for t in (1, 7, 4001):
        x, _, w = _inputs(t, h, torch.bfloat16, residual=False, weight=has_w)
        rstd = K.norm_forward_launch(x, w, 1e-6, None, 1.0, with_rstd=True, quant=True, round_sf=True)[3]
        assert_equal(rstd, _rstd_in_kernel_order(x, 1e-6))


def _half_rows_outputs(x, xs, w, r, col, rnd, packed):
    """The quantizing forward of clean rows x (the plan path with rstd, the bench kernel without it, and the
    launcher with a residual, the bf16 copy and rstd) and of rows xs with NaN and inf."""
    kw = dict(quant=True, use_tma_aligned_col_major_sf=col, round_sf=rnd, use_packed_ue8m0=packed)
    plain = K.norm_forward_launch(x, w, 1e-6, None, 0.75, with_rstd=True, **kw)
    bench = K.norm_forward_launch(x, w, 1e-6, None, 0.75, **kw)
    res = K.norm_forward_launch(x, w, 1e-6, r, 0.75, with_rstd=True, with_out_bf16=True, **kw)
    special = K.norm_forward_launch(xs, w, 1e-6, None, 0.75, with_rstd=True, **kw)
    return plain, bench, res, special


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("col,rnd,packed", HALF_SF, ids=str)
@pytest.mark.parametrize("has_w", [True, False])
def test_half_rows_bit_identical_gpu(has_w, col, rnd, packed, knob_kernels):
    """bf16 H = 1536, T = 1, 7, 4001 (an odd T leaves the last CTA's second row empty): FWD_HALF_ROWS gives the
    one-row kernel's bits (NaN and inf rows included) and the reference's: rstd of the fixed order bit for bit,
    o from that rstd, the cast of o exactly."""
    h, dtype = 1536, torch.bfloat16
    knob_kernels(K, {"FWD_HALF_ROWS": False})
    data, want = {}, {}
    for t in (1, 7, 4001):
        x, r, w = _inputs(t, h, dtype, residual=True, weight=has_w)
        xs = x.clone()
        xs[0, 5] = float("nan")
        xs[t // 2, 700] = float("inf")
        xs[t - 1, 1535] = -float("inf")
        data[t] = (x, xs, w, r)
        want[t] = _half_rows_outputs(x, xs, w, r, col, rnd, packed)
    knob_kernels(K, {"FWD_HALF_ROWS": True})
    for t, (x, xs, w, r) in data.items():
        got = _half_rows_outputs(x, xs, w, r, col, rnd, packed)
        for i, (g, e) in enumerate(zip(got, want[t])):
            for j, (gg, ee) in enumerate(zip(g, e)):
                assert (gg is None) == (ee is None), (t, i, j)
                if gg is not None:
                    assert torch.equal(_bits(gg), _bits(ee)), f"t={t} launch {i} output {j}"
        (out, sf, _, rstd, _), bench, (r_out_res, r_sf_res, bf, rstd_res, res_out) = got[0], got[1], got[2]
        assert_equal(rstd, _rstd_in_kernel_order(x, 1e-6))
        assert_equal(bench[0], out)
        assert_equal(bench[1], sf)
        _, _, rh = norm_forward_ref(x, w, 1e-6, r, 0.75)
        assert_equal(res_out, rh)
        assert_equal(rstd_res, _rstd_in_kernel_order(rh, 1e-6))
        for (o_k, sf_k), h_in, s in (((out, sf), x, rstd), ((r_out_res, r_sf_res), rh, rstd_res)):
            o = _o_from_rstd(h_in, w, s, 0.75, dtype)
            _assert_cast_of(o, o_k, sf_k, h, rnd, col, packed)
        assert_equal(bf, _o_from_rstd(rh, w, rstd_res, 0.75, dtype).to(torch.bfloat16))


@gpu
@pytest.mark.gpu
def test_half_rows_knob_outputs_gpu(knob_kernels):
    """bf16 H = 1536, T = 1001 with NaN and inf: FWD_HALF_ROWS gives the one-row kernel's bits in every forward of
    _knob_outputs (norm_forward, 3-D rows, residual, rstd, the bf16 copy, row-major sf, mega-MoE words)."""
    h, t = 1536, 1001
    x, _, w = _inputs(t, h, torch.bfloat16, residual=False)
    dy = torch.randn((t, h), device="cuda").to(torch.bfloat16)
    rstd = torch.rand((t,), device="cuda") + 0.5
    x[3, 5], x[700, 9] = float("nan"), float("inf")
    knob_kernels(K, {"FWD_HALF_ROWS": False})
    want = _knob_outputs(x, w, dy, rstd, None, 0.75)
    knob_kernels(K, {"FWD_HALF_ROWS": True})
    got = _knob_outputs(x, w, dy, rstd, None, 0.75)
    for i, (g, e) in enumerate(zip(got, want)):
        assert torch.equal(g, e), f"output {i}"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("xd,h", [("bfloat16", 512), ("bfloat16", 2560), ("float32", 768), ("float32", 576)], ids=str)
def test_half_rows_other_widths_gpu(xd, h, knob_kernels):
    """The other widths the rule takes (one vector slot, five, fp32): FWD_HALF_ROWS gives the one-row kernel's bits,
    norm_forward and the quantizing op (col, round, packed), T = 1, 7, 4001, NaN and inf included."""
    dtype = DT[xd]

    def run(x, w, r):
        f = K.norm_forward_launch(x, w, 1e-6, r, 0.75, with_rstd=True)
        q = K.norm_forward_launch(x, None, 1e-6, None, 0.75, with_rstd=True, quant=True,
                                  use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)
        return [_bits(v) for v in (f[0], f[3], f[4], q[0], q[1], q[3])]

    knob_kernels(K, {"FWD_HALF_ROWS": False})
    data, want = {}, {}
    for t in (1, 7, 4001):
        x, r, w = _inputs(t, h, dtype)
        x[t - 1, 3] = float("nan")
        x[0, h - 1] = float("inf")
        data[t] = (x, w, r)
        want[t] = run(x, w, r)
    knob_kernels(K, {"FWD_HALF_ROWS": True})
    for t, (x, w, r) in data.items():
        for i, (g, e) in enumerate(zip(run(x, w, r), want[t])):
            assert torch.equal(g, e), f"t={t} output {i}"
