"""Kernel tiers for expand_to_fused, expand_to_fused_with_sf and reduce_fused (moe.md §2.6-§2.8): the tile rules
and the registered fakes (CPU), every test config builds for sm_90 and every launch binds its kernel's
parameters (compile), and the kernels equal the reference bit for bit on the H200 (gpu)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tilefuse import _jit, formats
from tilefuse.moe import _shuffle_kernel as K
from tilefuse.reference import moe as ref
from tilefuse.testing import assert_equal
from tests.moe import configs
from tests.quant.kernel_binding import fake_jit

TOKENS = (0, 1, 7, 4001, 8192)
EXPERTS_TOPK = ((8, 2), (72, 6), (256, 8), (384, 1))   # (E, K) pairs: every E of the grid, every K
FP8 = torch.float8_e4m3fn
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def routed_topk_idx(rows: int, k: int, experts: int, device, drop: float = 0.3) -> torch.Tensor:
    """int64 ``(rows, k)``: distinct experts per row (ties broken by index: bf16 scores have many), a fraction
    ``drop`` of the slots -1 (routed to another EP rank)."""
    scores = torch.rand(rows, experts, device=device).to(torch.bfloat16)
    idx = ref.stable_topk(scores.float(), k)
    return torch.where(torch.rand(rows, k, device=device) < drop, -1, idx).contiguous()


def fused_maps(topk_idx: torch.Tensor, experts: int, alignment: int, size: int = 0):
    """``(token_topk_to_pos, pos_to_expert)`` of the reference fused layout (the caller's N when ``size``)."""
    maps = ref.get_fused_mapping(topk_idx, experts, size, alignment, bool(size))
    return maps[3], maps[0]


# ------------------------------------------------------------------------------------------------ CPU tier

def test_expand_tile_rule_cpu():
    """Every row width (words of 1, 2, 4 bytes up to 64 KB rows): the CTAs of a row cover its vectors, at most
    UNROLL_MAX per thread, the fewest CTAs, with 16-byte vectors whenever the row is a multiple of 16 bytes."""
    for wb in (4, 2, 1):
        for words in list(range(1, 300)) + list(range(300, 65536 // wb, 97)):
            vec, chunks, threads, unroll, gy = K.expand_tile(wb, words)
            assert vec * chunks == words and words % vec == 0
            assert vec == (next(v for v in (4, 2, 1) if words % v == 0) if wb == 4 else 1)
            assert threads % 32 == 0 and 32 <= threads <= K.THREADS
            assert 1 <= unroll <= K.UNROLL_MAX and gy * threads * unroll >= chunks
            assert (gy - 1) * threads * K.UNROLL_MAX < chunks and (gy * (unroll - 1)) * threads < chunks
            assert gy <= formats.cdiv(words * wb, 1024)                  # the launcher's grid-y bound
    assert K.expand_tile(4, 3584) == (4, 896, 128, 7, 1)        # bf16 7168: 7 16-byte vectors per thread


def test_reduce_tile_rule_cpu():
    """Every hidden % 256 == 0 up to 32768: the row's 16-byte vectors are covered exactly (no masking)."""
    for dtype, vec in (("bfloat16", 8), ("float16", 8), ("float32", 4)):
        for h in range(256, 32768 + 1, 256):
            v, tx, unroll, gy = K.reduce_tile(dtype, h)
            assert v == vec and v * tx * unroll * gy == h and tx in (32, 64, 128), (dtype, h)
            assert 1 <= unroll <= K.REDUCE_UNROLL_MAX and gy <= h // 128  # the launcher's grid-y bound
    assert K.reduce_tile("bfloat16", 7168) == (8, 128, 7, 1)


def _expand_model(data, sf, npc, ttp, pte, col):
    """CPU model of an expand launch, lane by lane in index form: the launcher's word view and sf layout, the
    kernel's (bx, by, thread, u) plan, the packed-sf keep mask, the zeroing CTAs. Outputs start poisoned (0xA5
    bytes) so what the kernel leaves unwritten shows. Returns ``(out, out_sf, sf storage)``."""
    rows, hidden = data.shape
    size = pte.numel()
    xw, wb = K._word_view(data)
    vec, chunks, threads, unroll, gy = K.expand_tile(wb, xw.size(1))
    c = ((torch.arange(gy)[:, None, None] * unroll + torch.arange(unroll)[None, :, None]) * threads
         + torch.arange(threads)[None, None, :]).reshape(-1)
    c = c[c < chunks]
    cols = (c[:, None] * vec + torch.arange(vec)).reshape(-1)
    assert torch.equal(cols.sort().values, torch.arange(xw.size(1)))       # every word once, none past the row
    out = torch.full((size, hidden * data.element_size()), 0xA5, dtype=torch.uint8)
    yw = out.view(xw.dtype)
    if sf is not None:
        st, out_sf = K._sf_out(sf, size, col)
        st.view(torch.uint8).fill_(0xA5)
        words, keep = K._sf_layout(sf, npc, hidden)
        j = torch.arange(formats.cdiv(words, threads) * threads)
        j = j[j < words]
        src = sf.view(torch.int32)[:, j]
        if keep:
            src[:, -1] &= (1 << (8 * keep)) - 1
        stw = st.view(torch.int32)
    t, k = torch.nonzero((ttp >= 0) & (ttp < size), as_tuple=True)          # token CTAs, slot by slot
    for kk in range(ttp.size(1)):
        sel = k == kk
        p = ttp[t[sel], kk].long()
        yw[p[:, None], cols[None, :]] = xw[t[sel]][:, cols]
        if sf is not None:
            if col:
                stw[j[:, None], p[None, :]] = src[t[sel]].T
            else:
                stw[p[:, None], j[None, :]] = src[t[sel]]
    zr = K.ZERO_ROWS
    p = torch.arange(formats.cdiv(size, zr) * zr)                                 # zeroing CTAs
    p = p[p < size]
    p = p[pte[p] < 0]
    yw[p[:, None], cols[None, :]] = 0
    if sf is not None:
        if col:
            stw[j[:, None], p[None, :]] = 0
        else:
            stw[p[:, None], j[None, :]] = 0
    out = out.view(data.dtype).view(size, hidden)
    return (out, None, None) if sf is None else (out, out_sf, st)


@pytest.mark.parametrize("dtype,hidden,k,sf", configs.EXPAND_SF + [(d, h, k, None) for d, h, k in configs.EXPAND],
                         ids=str)
def test_expand_model_equals_reference_cpu(dtype, hidden, k, sf):
    """The lane model of every test config equals the reference bit for bit on valid maps (trailing padding
    rows, random packed-UE8M0 high bytes); the column-major storage's pad columns stay unwritten."""
    rows, experts = 37, 16
    idx = routed_topk_idx(rows, k, experts, "cpu")
    maps = ref.get_fused_mapping(idx, experts, 0, 8, False)
    size = maps[0].numel() + 13
    maps = ref.get_fused_mapping(idx, experts, size, 8, True)
    ttp, pte = maps[3], maps[0]
    data = torch.randint(0, 256, (rows, hidden * dtype.itemsize), dtype=torch.uint8).view(dtype)
    if sf is None:
        for t, p in ((ttp, pte), _negative_entries(ttp, pte)):
            got, _, _ = _expand_model(data, None, 0, t, p, False)
            assert_equal(got.view(torch.uint8), ref.expand_to_fused(data, t, p).view(torch.uint8))
        return
    sf_dtype, npc, col = sf
    blocks = formats.cdiv(hidden, npc)
    if sf_dtype == torch.int32:
        s = torch.randint(-2**31, 2**31 - 1, (rows, formats.cdiv(blocks, 4)), dtype=torch.int32)
    else:
        s = torch.rand(rows, blocks) + 0.5
    got, got_sf, storage = _expand_model(data, s, npc, ttp, pte, col)
    want, want_sf = ref.expand_to_fused_with_sf((data, s), npc, ttp, pte, col)
    assert_equal(got.view(torch.uint8), want.view(torch.uint8))
    assert_equal(got_sf, want_sf)
    if col:
        assert storage.shape == (s.size(1), formats.align(size, 4))
        assert (storage[:, size:].contiguous().view(torch.uint8) == 0xA5).all()


def test_e4m3_satfinite_model_equals_reference_cpu():
    """reduce_fused's e4m3 output is the kernel's cvt.rn.satfinite.e4m3x2.f32 (cutlass float_e4m3_t on sm_90):
    round to nearest even on the e4m3 grid, a result beyond +-448 (inf included) becomes +-448, the sign of
    zero kept, NaN stays NaN. A brute-force model of that instruction equals the reference's
    formats.e4m3_encode on every code, every midpoint and its neighbours, the saturation range and specials."""
    mags = torch.arange(127, dtype=torch.uint8).view(FP8).double()          # codes 0x00..0x7E, increasing
    mid = (mags[1:] + mags[:-1]) / 2
    x = torch.cat([mags, mid, torch.tensor([448.0, 464.0, 470.0, 480.0, 1e4, 3.4e38, float("inf"), 2.0**-149,
                                             2.0**-126, 2.0**-10, 2.0**-11])]).float()
    x = torch.cat([x, torch.nextafter(x, torch.tensor(0.0)), torch.nextafter(x, torch.tensor(float("inf"))),
                   torch.exp(torch.randn(4096) * 6).float()])
    x = torch.cat([x, -x, torch.tensor([float("nan")])])
    a = x.abs().double().clamp(max=448.0)
    hi = torch.searchsorted(mags, a).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - mags[lo], mags[hi] - a
    code = torch.where((dlo < dhi) | ((dlo == dhi) & (lo % 2 == 0)), lo, hi)
    code = code | torch.where(torch.signbit(x), 0x80, 0)
    got = formats.e4m3_encode(x).view(torch.uint8).long()
    nan = x.isnan()
    assert torch.equal(got[~nan], code[~nan])
    assert formats.e4m3_encode(x)[nan].float().isnan().all()


def test_fakes_cpu():
    """The registered fakes give the kernels' output shapes, dtypes and strides (moe.md §2.6-§2.8)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # N = 0: the reference's column-major sf (what the launcher returns then) has an empty storage's strides
    empty_col_stride = ref.expand_to_fused_with_sf((torch.zeros(5, 576, dtype=torch.uint8).view(FP8),
                                                    torch.zeros(5, 2, dtype=torch.int32)), 128,
                                                   torch.full((5, 6), -1, dtype=torch.int32),
                                                   torch.empty(0, dtype=torch.int32), True)[1].stride()
    with FakeTensorMode():
        x = torch.empty(5, 576, dtype=torch.bfloat16)
        ttp, pte = torch.empty(5, 6, dtype=torch.int32), torch.empty(38, dtype=torch.int32)
        out = torch.ops.tilefuse.expand_to_fused.default(x, ttp, pte)
        assert out.shape == (38, 576) and out.dtype == torch.bfloat16
        data, sf = torch.empty(5, 576, dtype=FP8), torch.empty(5, 2, dtype=torch.int32)
        o, osf = torch.ops.tilefuse.expand_to_fused_with_sf.default(data, sf, 128, ttp, pte, True)
        assert o.shape == (38, 576) and o.dtype == FP8
        assert osf.shape == (38, 2) and osf.stride() == (1, 40) and osf.dtype == torch.int32
        empty = torch.empty(0, dtype=torch.int32)
        o, osf = torch.ops.tilefuse.expand_to_fused_with_sf.default(data, sf, 128, ttp, empty, True)
        assert osf.shape == (0, 2) and osf.stride() == empty_col_stride
        o, osf = torch.ops.tilefuse.expand_to_fused_with_sf.default(data, torch.empty(5, 5), 128, ttp, pte, False)
        assert osf.shape == (38, 5) and osf.stride() == (5, 1) and osf.dtype == torch.float32
        xr = torch.empty(30, 2048)
        y = torch.ops.tilefuse.reduce_fused.default(xr, torch.empty(30), None, ttp, "e4m3", torch.empty(1))
        assert y.shape == (5, 2048) and y.dtype == FP8
        y = torch.ops.tilefuse.reduce_fused.default(xr, None, torch.empty(5, 6), ttp, "", None)
        assert y.shape == (5, 2048) and y.dtype == torch.float32


def test_registered_configs_are_the_bench_launches_cpu():
    """The precompile list holds the bench launches (moe bench: T x 7168, top-8); the tests' own compile on first
    use (tests/moe/configs.py)."""
    listed = {(n, c) for n, cfgs in (("expand_to_fused", K._configs("expand_to_fused")),
                                     ("reduce_fused", K._configs("reduce_fused"))) for c in cfgs}
    assert len(listed) == 5
    assert ("expand_to_fused", K._expand_cfg(torch.bfloat16, 7168, 8)) in listed
    assert ("expand_to_fused", K._expand_cfg(FP8, 7168, 8, (torch.int32, 128, True))) in listed
    assert ("expand_to_fused", K._expand_cfg(FP8, 7168, 8, (torch.float32, 128, False))) in listed
    assert ("reduce_fused", K._reduce_cfg(torch.bfloat16, False, 7168, 8, True, False, False)) in listed
    assert ("reduce_fused", K._reduce_cfg(torch.bfloat16, True, 7168, 8, True, True, True)) in listed


# -------------------------------------------------------------------------------------------- compile tier

@pytest.mark.compile
@pytest.mark.parametrize("name,cfg", configs.shuffle_kernel_configs(), ids=str)
def test_builds_for_sm90(name, cfg):
    src = _jit.compile_kernel(name, cfg, "sm_90", export=False).get_kernel_source()
    assert "__global__" in src and "use_fast_math" not in src
    assert "(int64_t)" in src                             # element offsets in 64 bits (fused buffers > 2^31 elements)
    # the data rule token_topk_to_pos < N (len(pos_to_expert) / x rows) is the kernel's own device_assert
    assert "device_assert((top < num_positions));" in src
    if name == "reduce_fused":
        assert "__fmaf_rn" in src                         # the slot chain is fused multiply-adds (moe.md §2.8)
    elif cfg[0] == 4 and cfg[1] % 4 == 0:
        assert "int4" in src                              # 16-byte vector copies


@pytest.mark.compile
@pytest.mark.parametrize("dtype,hidden,k,sf", configs.EXPAND_SF + [(d, h, k, None) for d, h, k in configs.EXPAND],
                         ids=str)
def test_expand_launcher_binds_kernel_parameters(dtype, hidden, k, sf, monkeypatch):
    """CPU tensors through the launcher with ``_jit.get`` replaced by a parameter check: the config is the
    listed one, tensors fit the prim_func (T, N, and the column-major storage's align(N, 4) columns)."""
    calls = fake_jit(monkeypatch)
    rows, size = 7, 30
    x = torch.zeros(rows, hidden, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else torch.zeros(
        rows, hidden, dtype=dtype)
    ttp = torch.randint(-1, size, (rows, k), dtype=torch.int32)
    pte = torch.zeros(size, dtype=torch.int32)
    if sf is None:
        out = K._expand_launch(x, None, 0, ttp, pte, False)
        assert out.shape == (size, hidden) and out.dtype == dtype
    else:
        sf_dtype, npc, col = sf
        blocks = formats.cdiv(hidden, npc)
        width = formats.cdiv(blocks, 4) if sf_dtype == torch.int32 else blocks
        s = torch.zeros(rows, width, dtype=sf_dtype)
        out, out_sf = K._expand_launch(x, s, npc, ttp, pte, col)
        assert out_sf.shape == (size, width) and out_sf.dtype == sf_dtype
        assert out_sf.stride() == ((1, 32) if col else (width, 1))
    (call,) = calls
    assert call.name == "expand_to_fused" and call.cfg == K._expand_cfg(dtype, hidden, k, sf)
    assert call.env["num_tokens"] == rows and call.env["num_positions"] == size
    if sf is not None and sf[2]:
        assert call.env["sf_cols"] == 32


@pytest.mark.compile
@pytest.mark.parametrize("cfg", configs.REDUCE, ids=str)
def test_reduce_launcher_binds_kernel_parameters(cfg, monkeypatch):
    in_dtype, e4m3, hidden, k, with_w, with_xsf, with_sf = cfg
    calls = fake_jit(monkeypatch)
    rows, size = 5, 17
    x = torch.zeros(size, hidden, dtype=in_dtype)
    ttp = torch.randint(-1, size, (rows, k), dtype=torch.int32)
    w = torch.rand(rows, k) if with_w else None
    xin = (x, torch.rand(size)) if with_xsf else x
    sf = torch.rand(1) if with_sf else None
    out = K._reduce_launch(xin, w, ttp, "e4m3" if e4m3 else "", sf)
    assert out.shape == (rows, hidden) and out.dtype == (FP8 if e4m3 else in_dtype)
    (call,) = calls
    assert call.name == "reduce_fused" and call.cfg == K._reduce_cfg(*cfg)
    assert call.env["num_tokens"] == rows and call.env["num_positions"] == size
    # a given non-contiguous out is filled through a contiguous result (one launch)
    view = torch.zeros(rows, 2 * hidden, dtype=out.dtype)[:, :hidden]
    assert K._reduce_launch(xin, w, ttp, "e4m3" if e4m3 else "", sf, out=view) is view
    assert len(calls) == 2


@pytest.mark.compile
def test_zero_sizes_launch_nothing(monkeypatch):
    """T = 0 (expand, reduce), N = 0 (expand; reduce: every slot negative) and K > MAX_TOPK return the
    reference's results without a launch; those paths check the data rule themselves (the kernels' device_assert
    does on the others), so a position >= N raises."""
    calls = fake_jit(monkeypatch)
    out = K._expand_launch(torch.zeros(0, 64), None, 0, torch.zeros(0, 2, dtype=torch.int32),
                           torch.zeros(0, dtype=torch.int32), False)
    assert out.shape == (0, 64)
    none = torch.tensor([[-1, -1], [-2, -1], [-1, -7]], dtype=torch.int32)
    out, out_sf = K._expand_launch(torch.zeros(3, 64), torch.zeros(3, 2), 32, none, torch.zeros(0, dtype=torch.int32),
                                   True)
    assert out.shape == (0, 64) and out_sf.shape == (0, 2)
    with pytest.raises(RuntimeError, match="len\\(pos_to_expert\\) = 0"):
        K._expand_launch(torch.zeros(3, 64), None, 0, torch.tensor([[0, -1]] * 3, dtype=torch.int32),
                         torch.zeros(0, dtype=torch.int32), False)
    y = K._reduce_launch(torch.zeros(4, 256), None, torch.zeros(0, 2, dtype=torch.int32))
    assert y.shape == (0, 256)
    sf = torch.tensor([-0.5])
    y = K._reduce_launch((torch.zeros(0, 256), torch.zeros(0)), None, none, "e4m3", sf)
    assert y.shape == (3, 256) and (y.view(torch.uint8) == 0x80).all()        # +0 * -0.5 = -0
    with pytest.raises(RuntimeError, match="x rows \\(0\\)"):
        K._reduce_launch(torch.zeros(0, 256), None, torch.tensor([[-1, 0]], dtype=torch.int32))
    big = K.MAX_TOPK + 1
    ttp = torch.randperm(200)[:5 * big].view(5, big).to(torch.int32)      # distinct targets (valid maps)
    ttp = torch.where(torch.rand(5, big) < 0.2, -1, ttp)
    x = torch.randn(5, 64).to(torch.bfloat16)
    pte = torch.zeros(200, dtype=torch.int32)
    assert_equal(K._expand_launch(x, None, 0, ttp, pte, False), ref.expand_to_fused(x, ttp, pte))
    ttp = torch.where(ttp < 0, ttp, ttp % 40)
    xr = torch.randn(40, 256)
    assert_equal(K._reduce_launch(xr, None, ttp), ref.reduce_fused(xr, None, ttp))
    with pytest.raises(RuntimeError, match="x rows \\(40\\)"):
        K._reduce_launch(xr, None, torch.full((5, big), 40, dtype=torch.int32))
    # H = 0: the reference's empty rows (a kernel would have an empty grid)
    ttp = torch.tensor([[0, 1], [-1, 2]], dtype=torch.int32)
    pte = torch.zeros(3, dtype=torch.int32)
    assert K._expand_launch(torch.zeros(2, 0), None, 0, ttp, pte, False).shape == (3, 0)
    out, out_sf = K._expand_launch(torch.zeros(2, 0), torch.zeros(2, 0), 32, ttp, pte, True)
    assert out.shape == (3, 0) and out_sf.shape == (3, 0)
    assert K._reduce_launch(torch.zeros(3, 0), None, ttp).shape == (2, 0)
    assert not calls


# ------------------------------------------------------------------------------------------------ GPU tier

def _random_bits(rows: int, hidden: int, dtype, device="cuda") -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, -0, subnormals) in a contiguous (rows, hidden) tensor of dtype."""
    raw = torch.randint(0, 256, (rows, hidden * dtype.itemsize), dtype=torch.uint8, device=device)
    return raw.view(dtype)


def _check_expand(x, ttp, pte):
    got = K.expand_to_fused_cuda(x, ttp, pte)
    assert_equal(got.view(torch.uint8), ref.expand_to_fused(x, ttp, pte).view(torch.uint8))
    assert got.dtype == x.dtype and got.shape == (pte.numel(), x.size(1))
    return got


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("experts,k", EXPERTS_TOPK, ids=str)
def test_expand_gpu(t, experts, k):
    idx = routed_topk_idx(t, k, experts, "cuda")
    ttp, pte = fused_maps(idx, experts, 16)
    _check_expand(_random_bits(t, 576, torch.bfloat16), ttp, pte)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,hidden,k", configs.EXPAND, ids=str)
def test_expand_widths_gpu(dtype, hidden, k):
    """16-byte, 8-byte, 4-byte, 2-byte and 1-byte words; rows split over CTAs (fp32 7168); a caller's N beyond
    the aligned total (trailing padding rows); an input that is not 16-byte aligned."""
    idx = routed_topk_idx(301, k, 72, "cuda")
    ttp, pte = fused_maps(idx, 72, 64)
    x = _random_bits(301, hidden, dtype)
    _check_expand(x, ttp, pte)
    ttp2, pte2 = fused_maps(idx, 72, 64, pte.numel() + 37)
    _check_expand(x, ttp2, pte2)
    flat = _random_bits(1, 301 * hidden + 1, dtype).view(-1)
    _check_expand(flat[1:].view(301, hidden), ttp, pte)
    _check_expand(x, *_negative_entries(ttp, pte))


def _negative_entries(ttp, pte):
    """Valid maps where a fifth of the routed slots become arbitrary negative values and their positions padding
    with arbitrary negative pos_to_expert: every negative slot is skipped, every negative position zeroed
    (the reference's ``p >= 0`` and ``pos_to_expert < 0``), and the output stays fully defined."""
    drop = (ttp >= 0) & (torch.rand(ttp.shape, device=ttp.device) < 0.2)
    neg = torch.randint(-2**31, -1, ttp.shape, dtype=torch.int32, device=ttp.device)
    pte = pte.clone()
    pte[ttp[drop].long()] = torch.randint(-2**31, 0, (int(drop.sum()),), dtype=torch.int32, device=ttp.device)
    return torch.where(drop, neg, ttp), pte


@gpu
@pytest.mark.gpu
def test_expand_bench_shape_gpu():
    idx = routed_topk_idx(8192, 8, 256, "cuda", drop=0.0)
    ttp, pte = fused_maps(idx, 256, 128)
    x = torch.randn(8192, 7168, device="cuda").to(torch.bfloat16)
    got = _check_expand(x, ttp, pte)
    assert_equal(K.expand_to_fused_cuda(x, ttp, pte), got)                    # deterministic


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,hidden,k,sf", configs.EXPAND_SF, ids=str)
@pytest.mark.parametrize("t", (1, 4001))
def test_expand_with_sf_gpu(dtype, hidden, k, sf, t):
    """Data and sf against the reference, strides included; packed UE8M0 words with random high bytes (the
    reference zeroes the bytes past the block count, so must the kernel)."""
    sf_dtype, npc, col = sf
    idx = routed_topk_idx(t, k, 256, "cuda")
    ttp, pte = fused_maps(idx, 256, 16)
    data = _random_bits(t, hidden, dtype)
    blocks = formats.cdiv(hidden, npc)
    if sf_dtype == torch.int32:
        s = torch.randint(-2**31, 2**31 - 1, (t, formats.cdiv(blocks, 4)), dtype=torch.int32, device="cuda")
    else:
        s = torch.rand(t, blocks, device="cuda") + 0.5
    out, out_sf = K.expand_to_fused_with_sf_cuda((data, s), npc, ttp, pte, col)
    want, want_sf = ref.expand_to_fused_with_sf((data, s), npc, ttp, pte, col)
    assert_equal(out.view(torch.uint8), want.view(torch.uint8))
    assert_equal(out_sf, want_sf)                                             # dtype, shape, strides, bits


@gpu
@pytest.mark.gpu
def test_expand_zero_sizes_gpu():
    out = K.expand_to_fused_cuda(torch.empty(0, 576, device="cuda", dtype=torch.bfloat16),
                                 torch.empty(0, 8, dtype=torch.int32, device="cuda"),
                                 torch.empty(0, dtype=torch.int32, device="cuda"))
    assert out.shape == (0, 576)
    x = _random_bits(5, 576, torch.bfloat16)
    none = torch.full((5, 2), -1, dtype=torch.int32, device="cuda")
    assert K.expand_to_fused_cuda(x, none, torch.empty(0, dtype=torch.int32, device="cuda")).shape == (0, 576)
    _check_expand(x, none, torch.full((9,), -1, dtype=torch.int32, device="cuda"))   # all padding: zeros


@gpu
@pytest.mark.gpu
def test_expand_batch_invariance_graph_compile_gpu():
    """The rows a prefix of the tokens targets equal the full batch's; CUDA-graph replay on new data;
    torch.compile(fullgraph=True) of the CUDA entry and of the public op."""
    from tilefuse import moe

    idx = routed_topk_idx(4001, 6, 72, "cuda")
    ttp, pte = fused_maps(idx, 72, 16)
    x = _random_bits(4001, 576, torch.bfloat16)
    full = K.expand_to_fused_cuda(x, ttp, pte)
    part = K.expand_to_fused_cuda(x[:7].contiguous(), ttp[:7].contiguous(), pte)
    rows = ttp[:7][ttp[:7] >= 0].long()
    assert rows.numel() > 0
    assert_equal(part[rows], full[rows])
    xs = x.clone()
    graph = torch.cuda.CUDAGraph()
    K.expand_to_fused_cuda(xs, ttp, pte)                                       # warm (compiles outside capture)
    with torch.cuda.graph(graph):
        captured = K.expand_to_fused_cuda(xs, ttp, pte)
    x2 = _random_bits(4001, 576, torch.bfloat16)
    xs.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert_equal(captured.view(torch.uint8), ref.expand_to_fused(x2, ttp, pte).view(torch.uint8))
    want = ref.expand_to_fused(x, ttp, pte)
    assert_equal(torch.compile(K.expand_to_fused_cuda, fullgraph=True)(x, ttp, pte), want)
    assert_equal(torch.compile(moe.expand_to_fused, fullgraph=True)(x, ttp, pte), want)
    s = torch.randint(-2**31, 2**31 - 1, (4001, 2), dtype=torch.int32, device="cuda")
    fn = torch.compile(lambda a, b, c, d: moe.expand_to_fused_with_sf((a, b), 128, c, d, True), fullgraph=True)
    data = _random_bits(4001, 576, FP8)
    got, got_sf = fn(data, s, ttp, pte)
    want, want_sf = ref.expand_to_fused_with_sf((data, s), 128, ttp, pte, True)
    assert_equal(got.view(torch.uint8), want.view(torch.uint8))
    assert_equal(got_sf, want_sf)


def _reduce_inputs(t, k, experts, cfg, device="cuda", maps=True):
    """Fused rows ``x (N, H)`` (N = T K), ``token_topk_to_pos`` (from the fused layout with alignment 1, or random
    positions with repeats, -1 and -2 entries), weights, x_sf, sf per the config."""
    in_dtype, e4m3, hidden, _, with_w, with_xsf, with_sf = cfg
    size = t * k
    if maps:
        ttp, _ = fused_maps(routed_topk_idx(t, k, experts, device), experts, 1, size)
    else:
        ttp = torch.randint(0, max(size, 1), (t, k), dtype=torch.int32, device=device)
        ttp = torch.where(torch.rand(t, k, device=device) < 0.2, -1, ttp)
        ttp = torch.where(torch.rand(t, k, device=device) < 0.05, -2, ttp)
        if t and k > 1:
            ttp[:, 1] = torch.where(torch.rand(t, device=device) < 0.3, ttp[:, 0], ttp[:, 1])   # a row used twice
    scale = 40.0 if e4m3 else 1.0                          # e4m3 outputs beyond +-448 saturate (moe.md §2.8)
    x = (torch.randn(size, hidden, device=device) * scale).to(in_dtype)
    w = torch.rand(t, k, device=device) if with_w else None
    x_sf = torch.randn(size, device=device) if with_xsf else None
    sf = torch.randn(1, device=device) * 2 if with_sf else None
    return ((x, x_sf) if with_xsf else x), w, ttp, ("e4m3" if e4m3 else ""), sf


def _check_reduce(args):
    x, w, ttp, fmt, sf = args
    got = K.reduce_fused_cuda(x, w, ttp, fmt, sf)
    assert_equal(got, ref.reduce_fused(x, w, ttp, fmt, sf))
    return got


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", configs.REDUCE, ids=str)
@pytest.mark.parametrize("maps", (True, False), ids=("maps", "random_positions"))
def test_reduce_gpu(cfg, maps):
    _check_reduce(_reduce_inputs(401, cfg[3], 72, cfg, maps=maps))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("experts,k", ((8, 2), (72, 6), (256, 8), (384, 1)), ids=str)
def test_reduce_tokens_experts_gpu(t, experts, k):
    cfg = (torch.bfloat16, False, 2048, k, True, False, False) if k != 6 else (
        torch.bfloat16, True, 2048, 6, True, True, True)
    _check_reduce(_reduce_inputs(t, k, experts, cfg))


@gpu
@pytest.mark.gpu
def test_reduce_bench_shape_determinism_gpu():
    cfg = (torch.bfloat16, True, 7168, 8, True, True, True)
    args = _reduce_inputs(8192, 8, 256, cfg)
    got = _check_reduce(args)
    assert_equal(K.reduce_fused_cuda(*args), got)


@gpu
@pytest.mark.gpu
def test_reduce_saturation_zero_rows_and_out_gpu():
    """e4m3 saturates (+-1300 -> +-448); all-(-1) tokens give +0; N = 0; a given out (contiguous: written in
    place; a strided view: filled, its neighbours untouched)."""
    x = torch.zeros(3, 256, device="cuda")
    x[0, :3] = torch.tensor([1300.0, -1000.0, 3.0])
    ttp = torch.tensor([[0, -1], [-1, -1], [2, 0]], dtype=torch.int32, device="cuda")
    got = K.reduce_fused_cuda(x, None, ttp, "e4m3")
    assert got[0, :3].float().tolist() == [448.0, -448.0, 3.0]
    assert (got[1].view(torch.uint8) == 0).all()
    assert_equal(got, ref.reduce_fused(x, None, ttp, "e4m3"))
    sf = torch.tensor([0.5], device="cuda")
    none = torch.full((4, 3), -1, dtype=torch.int32, device="cuda")
    z = K.reduce_fused_cuda((torch.empty(0, 512, device="cuda"), torch.empty(0, device="cuda")), None, none, "e4m3", sf)
    assert_equal(z, ref.reduce_fused((torch.empty(0, 512, device="cuda"), torch.empty(0, device="cuda")), None, none,
                                     "e4m3", sf))
    assert (z.view(torch.uint8) == 0).all()
    args = _reduce_inputs(301, 6, 72, (torch.float32, False, 2048, 6, True, True, False))
    want = ref.reduce_fused(*args)
    out = torch.full_like(want, float("nan"))
    assert K.reduce_fused_cuda(*args, out=out) is out
    assert_equal(out, want)
    wide = torch.full((301, 4096), float("nan"), device="cuda")
    view = wide[:, 1024:3072]
    assert K.reduce_fused_cuda(*args, out=view) is view
    assert_equal(view.contiguous(), want)
    assert wide[:, :1024].isnan().all() and wide[:, 3072:].isnan().all()
    assert K.reduce_fused_cuda(x, None, torch.empty(0, 2, dtype=torch.int32, device="cuda")).shape == (0, 256)


@gpu
@pytest.mark.gpu
def test_reduce_batch_invariance_graph_compile_gpu():
    """Rows of a big batch equal the same rows alone; CUDA-graph replay on new data; torch.compile(fullgraph)
    of the CUDA entry and of the public op, with and without out."""
    from tilefuse import moe

    cfg = (torch.bfloat16, False, 2048, 6, True, True, False)
    x, w, ttp, fmt, sf = _reduce_inputs(4001, 6, 72, cfg)
    full = K.reduce_fused_cuda(x, w, ttp, fmt, sf)
    for sl in (slice(0, 1), slice(1000, 1007), slice(3990, 4001)):
        assert_equal(K.reduce_fused_cuda(x, w[sl].contiguous(), ttp[sl].contiguous(), fmt, sf), full[sl])
    (xd, xs) = x
    xd2 = xd.clone()
    graph = torch.cuda.CUDAGraph()
    K.reduce_fused_cuda((xd2, xs), w, ttp, fmt, sf)
    with torch.cuda.graph(graph):
        captured = K.reduce_fused_cuda((xd2, xs), w, ttp, fmt, sf)
    new = torch.randn_like(xd)
    xd2.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert_equal(captured, ref.reduce_fused((new, xs), w, ttp, fmt, sf))
    want = ref.reduce_fused(x, w, ttp, fmt, sf)
    fn = torch.compile(lambda a, b, c, d: K.reduce_fused_cuda((a, b), c, d), fullgraph=True)
    assert_equal(fn(xd, xs, w, ttp), want)
    fn = torch.compile(lambda a, b, c, d: moe.reduce_fused((a, b), c, d), fullgraph=True)
    assert_equal(fn(xd, xs, w, ttp), want)
    out = torch.empty_like(want)
    fn = torch.compile(lambda a, b, c, d, o: moe.reduce_fused((a, b), c, d, out=o), fullgraph=True)
    fn(xd, xs, w, ttp, out)
    assert_equal(out, want)


_ASSERT_CHILD = """
import sys, torch
from tilefuse.moe import _shuffle_kernel as K
dev = "cuda"
def run(last):
    ttp = torch.tensor([[0, -1], [-3, last]], dtype=torch.int32, device=dev)
    if sys.argv[1] == "expand":
        K.expand_to_fused_cuda(torch.ones(2, 576, dtype=torch.bfloat16, device=dev), ttp,
                               torch.zeros(5, dtype=torch.int32, device=dev))
    else:
        K.reduce_fused_cuda(torch.ones(5, 256, device=dev), None, ttp)
    torch.cuda.synchronize()
run(4)
print("valid ok", flush=True)
run(5)
print("no assert", flush=True)
"""


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [{"REDUCE_UNROLL_MAX": 1}], ids=str)
def test_reduce_knob_variants_gpu(knobs, knob_kernels):
    """The other reduce schedule (one vector a thread) equals the reference on the reduce cases of this tier
    (compiled here, outside the caches)."""
    knob_kernels(K, knobs)
    for cfg in configs.REDUCE:
        for maps in (True, False):
            test_reduce_gpu(cfg, maps)
    for t in TOKENS:
        for experts, k in ((72, 6), (256, 8)):
            test_reduce_tokens_experts_gpu(t, experts, k)
    test_reduce_saturation_zero_rows_and_out_gpu()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("op", ("expand", "reduce"))
def test_data_rule_device_assert_gpu(op):
    """The data rule the public op no longer checks on the host: a position >= N (len(pos_to_expert), x rows)
    trips the kernel's device_assert, in-range and negative entries do not. In a child process, since a
    device-side assertion leaves the CUDA context unusable."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
    r = subprocess.run([sys.executable, "-c", _ASSERT_CHILD, op], capture_output=True, text=True, timeout=300,
                       cwd=root, env=env)
    assert "valid ok" in r.stdout, r.stdout + r.stderr
    assert r.returncode != 0 and "no assert" not in r.stdout, r.stdout + r.stderr
    assert "Assertion `cond` failed" in r.stdout + r.stderr, r.stdout + r.stderr
