"""Kernel tiers of apply_rotary (transform.md 4, 8.2): compile (sm_90 builds, the exact-fma source check, the
launcher's binding and work split without a GPU) and gpu (bitwise against the reference over the grid and every
layout case, the parent buffers outside the views untouched, determinism, batch invariance, CUDA graphs,
torch.compile, out-of-range positions, 64-bit offsets).

GPU tests call the public op, so they cover the dispatch, the eager launch and the custom op. Parent buffers
are filled with a sentinel before each call (0x7FBF / 0x7FBFBFBF: NaN patterns never produced from random
data), so a stray write shows anywhere in the storage.
"""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tilefuse import _jit
from tilefuse.reference import rotary_embedding_ref
from tilefuse.transform import _rotary_kernel as K
from tilefuse.transform import apply_rotary
from tests.quant.kernel_binding import bind
from tests.transform.configs import rotary_configs
from tests.transform.rotary_data import bits, draw_positions, make_cos_sin_cache, special_values

DTYPES = (torch.bfloat16, torch.float32)


# ---- compile tier ----

@pytest.mark.compile
@pytest.mark.parametrize("cfg", rotary_configs(), ids=str)
def test_builds_for_sm90_with_exact_fma(cfg):
    dtype, d, v, cw, interleaved, pos, rank = cfg
    src = _jit.compile_kernel("apply_rotary", cfg, "sm_90").get_kernel_source()
    assert "__global__" in src
    # two fused multiply-adds per pair (V pairs per lane, once for A and once for B), every one explicit
    assert src.count("__fmaf_rn(") == 4 * v
    arith = [line for line in src.splitlines() if "__fmaf_rn(" in line]
    for line in arith:
        rhs = re.sub(r"\[[^\]]*\]", "", line.split("=", 1)[1])  # drop the index expressions
        assert not re.search(r"[-+*/]", rhs), line  # no plain (contractible) arithmetic on the values
        assert re.search(r"__fmaf_rn\(\(?(\(float\))?\w+\)?, \w+, __fmul_rn\(", rhs), line
    # the sine's sign: IEEE multiplies only
    assert not re.search(r"[^_]sign \*|\* sign", src)
    # vector accesses of the configured width: 16 bytes for the widest, scalar for V = 1
    vec = {16: r"(uint4|float4)", 8: r"(uint2|float2)", 4: r"(uint1|float|int)"}.get(v * (2 if dtype == "bf16" else 4))
    if v > 1 and vec:
        assert re.search(rf"\*\({vec}\*\)\(A \+", src), cfg
        assert not re.search(r"(?<![\w*(])A\[", src), cfg
    if cw == 4:
        assert re.search(r"\*\(float4\*\)\(CS \+", src), cfg
    # 64-bit addressing: the sizes and strides are int64 kernel parameters
    assert re.search(r"int64_t cache_stride", src)


def _layouts(dtype):
    """(name, query, key, cache, positions) built on the CPU: every layout case of section 8.2."""
    d = 64
    cache = make_cos_sin_cache(64, d)
    qkv = torch.randn(5, (3 + 2 * 2) * d).to(dtype)
    big = make_cos_sin_cache(128, d)
    kv = torch.randn(5, 576).to(dtype)
    flat = torch.randn(1 + 5 * 3 * d).to(dtype)
    return [
        ("contiguous", torch.randn(5, 3, d).to(dtype), torch.randn(5, 1, d).to(dtype), cache, None),
        ("tail", torch.randn(5, 3, d + 64).to(dtype)[..., -d:], None, cache, torch.arange(5)),
        ("leading", torch.randn(5, 3, d + 64).to(dtype)[..., :d], None, cache, None),
        ("fused", qkv.view(5, 7, d)[:, :3], qkv.view(5, 7, d)[:, 3:5], cache, None),
        ("deepseek", torch.randn(5, 128, 192).to(dtype)[..., 128:], kv[:, 512:].unsqueeze(1), cache, None),
        ("batch stride", torch.randn(3, 7, 2, d).to(dtype)[:, 1:6], None, cache, None),
        ("storage offset 1", flat.as_strided((5, 3, d), (3 * d, d, 1), 1), None, cache, None),
        ("cache row stride", torch.randn(5, 3, d).to(dtype), None,
         torch.randn(64, d + 32)[:, :d], None),
        ("cache big[::2]", torch.randn(5, 3, d).to(dtype), None, big[::2], None),
        ("cache storage offset 1", torch.randn(5, 3, d).to(dtype), None,
         torch.randn(1 + 64 * d).as_strided((64, d), (d, 1), 1), None),
        ("positions (B, 1)", torch.randn(4, 1, 3, d).to(dtype), None, cache,
         torch.arange(8).view(2, 4).t()[:, :1]),  # a size-1 last dimension of stride 4
    ]


def _record(monkeypatch):
    """Replace ``_jit.get`` by a recorder that binds each launch's arguments to the prim_func."""
    calls = []

    def get(name, cfg):
        func = K.rotary_kernel(*cfg)
        return lambda *args: calls.append((cfg, bind(func, args), args))

    monkeypatch.setattr(_jit, "get", get)
    monkeypatch.setattr(K, "_PLANS", {})  # plans hold the kernels they were made with
    return calls


def _covered(x4, hl, tl, bpb, blocks, c):
    """Model of the kernel's work split (block, thread, head loop): how often each (batch, token, head, lane) is
    visited."""
    nb, ns, nh, _ = x4.shape
    blk = torch.arange(blocks)[:, None]
    tid = torch.arange(K.THREADS)[None, :]
    lane, r = (tid % c).expand(blocks, -1), tid // c
    b, s, hlane = (blk // bpb).expand(-1, K.THREADS), (blk % bpb) * tl + r // hl, (r % hl).expand(blocks, -1)
    ok = (r < hl * tl) & (s < ns) & (b < nb)
    h = hlane[..., None] + torch.arange(-(-nh // hl)) * hl  # the heads hl apart from the thread's lane
    ok = ok[..., None] & (h < nh)
    idx = tuple(t[..., None].expand_as(h)[ok] for t in (b, s)) + (h[ok], lane[..., None].expand_as(h)[ok])
    seen = torch.zeros(nb, ns, nh, c, dtype=torch.int64)
    seen.index_put_(idx, torch.ones(idx[0].numel(), dtype=torch.int64), accumulate=True)
    return seen


@pytest.mark.compile
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(11))
def test_launcher_binds_every_layout_without_a_copy(dtype, case, monkeypatch):
    name, q, k, cache, pos = _layouts(dtype)[case]
    calls = _record(monkeypatch)
    K.apply_rotary_launch(q, cache, k, pos, True, False, 0)
    K.apply_rotary_launch(q, cache, k, pos, True, False, 0)  # the kept plan binds the same
    assert len(calls) == 2 and calls[0][:2] == calls[1][:2] and calls[0][2][4:] == calls[1][2][4:]
    assert all(x is y for x, y in zip(calls[0][2][:4], calls[1][2][:4])) == (len(K._PLANS) == 1 and next(
        iter(K._PLANS.values()))[2])  # the direct path passes the caller's tensors themselves
    cfg, env, args = calls[0]
    a, b, cs = args[0], args[1], args[2]
    assert a.data_ptr() == q.data_ptr() and cs.data_ptr() == cache.data_ptr()  # views, never copies
    if k is not None:
        assert b.data_ptr() == k.data_ptr()
    _, d, v, cw, _, _, rank = cfg
    assert rank == q.dim()
    esize = q.element_size()
    for t in (a, b, cs):  # the kernel's assumption: every stride is a multiple of the access width
        width = cw if t is cs else v
        assert t.data_ptr() % (width * t.element_size()) == 0, name
        assert all(st % width == 0 for st in t.stride()[:-1]), (name, t.stride(), width)
    widest = {torch.bfloat16: 8, torch.float32: 4}[dtype]
    aligned = all(t.data_ptr() % 16 == 0 and all(st * esize % 16 == 0 or n == 1
                                                 for n, st in zip(t.shape[:-1], t.stride()[:-1]))
                  for t in (q, k) if t is not None)
    assert (v == widest) == aligned, (name, v)
    n = min(4, v // 2 if v >= 2 else 1)  # cache floats per pair group (interleaved)
    cache_aligned = cache.data_ptr() % (4 * n) == 0 and cache.stride(0) % n == 0
    assert (cw == n) == cache_aligned, (name, cw)
    c = d // (2 * v)
    for x4, split in ((a, args[6:10]), (b, args[10:14])):
        if split[3] == 0:
            continue
        x4 = x4 if x4.dim() == 4 else x4.unsqueeze(0)
        seen = _covered(x4, *split, c)
        assert torch.equal(seen, torch.ones_like(seen)), name


@pytest.mark.compile
def test_launcher_never_binds_an_empty_tensor(monkeypatch):
    """With one tensor empty the other is bound as both A and B (B's CTA count 0); both empty: no launch."""
    calls = _record(monkeypatch)
    cache = make_cos_sin_cache(16, 64)
    q, k = torch.randn(3, 2, 64), torch.randn(3, 1, 64)
    for a, b, want in ((q, k[:, :0], q), (q[:, :0], k, k), (q[:0], k[:0], None)):
        calls.clear()
        K.apply_rotary_launch(a, cache, b, None, False, False, 1)
        if want is None:
            assert calls == []
        else:
            (_, _, args), = calls
            assert args[0] is want and args[1] is want and args[13] == 0


@pytest.mark.compile
@pytest.mark.parametrize("shape", ((1, 1, 1), (1, 4001, 1), (1, 129, 3), (3, 37, 32), (2, 100, 128),
                                   (1, 2000, 8), (1, 7, 128), (1, 700, 128)))
@pytest.mark.parametrize("c", (1, 4, 8, 16, 32, 64))
def test_work_split_covers_every_lane_once(shape, c):
    x4 = torch.empty(*shape, 1)
    split = K._split(*shape, c)
    seen = _covered(x4, *split, c)
    assert torch.equal(seen, torch.ones_like(seen))


# ---- gpu tier ----

SENTINEL = {torch.bfloat16: (torch.int16, 0x7FBF), torch.float32: (torch.int32, 0x7FBFBFBF)}
GRID = {
    "shape": [(0,), (1,), (7,), (129,), (4001,), (1, 1), (3, 37), (2, 1024), (0, 5)],
    "heads": [(1, None), (3, 1), (8, 8), (32, 8), (128, 1)],
    "d": [64, 128],
    "dtype": list(DTYPES),
    "positions": [None, torch.int32, torch.int64],
    "offset": [0, 17, -3],
    "flags": [(False, False), (False, True), (True, False), (True, True)],
}
# "every value at least once": case i takes value (i + shift) of each dimension, twice around the longest one
N_GRID = 2 * max(len(v) for v in GRID.values())


def _grid_case(i):
    pick = {k: vals[(i + 3 * j) % len(vals)] for j, (k, vals) in enumerate(GRID.items())}
    if pick["positions"] is None and pick["offset"] < 0:
        pick["offset"] = 0
    return pick


def _ref(x, cache, positions, offset, interleaved, conjugate):
    half = cache.shape[1] // 2
    return rotary_embedding_ref(x, cache[:, :half], cache[:, half:], positions, offset, interleaved, conjugate)


def _same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(bits(a), bits(b))


def _check(q, cache, key=None, positions=None, interleaved=False, conjugate=False, offset=0, parents=()):
    """Run the op on ``q``/``key`` in place and compare with the reference on clones; the parents' bytes outside
    the views must be unchanged."""
    want_q = _ref(q.clone(), cache, positions, offset, interleaved, conjugate)
    want_k = None if key is None else _ref(key.clone(), cache, positions, offset, interleaved, conjugate)
    snapshots = [(p, p.clone()) for p in parents]
    apply_rotary(q, cache, key, positions, interleaved, conjugate, offset)
    torch.cuda.synchronize()
    _same(q, want_q)
    if key is not None:
        _same(key, want_k)
    for parent, before in snapshots:
        outside = torch.ones(parent.shape, dtype=torch.bool, device=parent.device)
        for view in (q, key):
            if view is not None and view.numel() and view.untyped_storage().data_ptr() == \
                    parent.untyped_storage().data_ptr():
                idx = torch.arange(parent.numel(), device=parent.device).view(parent.shape)
                inside = idx.as_strided(view.shape, view.stride(), view.storage_offset() - parent.storage_offset())
                outside.view(-1)[inside.reshape(-1)] = False
        assert torch.equal(bits(parent)[outside], bits(before)[outside])


def _sentinel(shape, dtype):
    int_dtype, value = SENTINEL[dtype]
    return torch.full(shape, value, dtype=int_dtype, device="cuda").view(dtype)


def _fill(view, dtype):
    view.copy_(torch.randn(view.shape, device="cuda").to(dtype))
    return view


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(N_GRID))
def test_grid_bitwise(i):
    c = _grid_case(i)
    dtype, d, offset = c["dtype"], c["d"], c["offset"]
    h, hk = c["heads"]
    lead = c["shape"]
    R = 8192
    cache = make_cos_sin_cache(R, d, device="cuda")
    q = torch.randn(*lead, h, d, device="cuda").to(dtype)
    k = None if hk is None else torch.randn(*lead, hk, d, device="cuda").to(dtype)
    pos = None
    if c["positions"] is not None:
        pos = draw_positions(lead, R, offset, c["positions"], "cuda")
    _check(q, cache, k, pos, *c["flags"], offset)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_cache_and_special_values(dtype):
    d = 128
    cache = torch.randn(300, d, device="cuda")
    q = torch.randn(129, 8, d, device="cuda").to(dtype)
    k = special_values(129 * 2 * d, dtype).view(129, 2, d).cuda()
    _check(q, cache, k, draw_positions((129,), 300, 0, device="cuda"), True, False)
    cache = special_values(64 * d, torch.float32).view(64, d).cuda()
    q = special_values(7 * 3 * d, dtype).view(7, 3, d).cuda()
    _check(q, cache, None, None, False, True, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("flags", [(False, False), (True, True)])
def test_layout_cases(dtype, d, flags):
    """Section 8.2's layout cases, each in a sentinel-filled parent whose other bytes must stay as they were."""
    T, H, Hk = 129, 4, 2
    cache = make_cos_sin_cache(4096, d, device="cuda")
    pos = draw_positions((T,), 4096, 0, device="cuda")
    # tail and leading slices of (T, H, D + 64)
    for sl in (slice(-d, None), slice(0, d)):
        parent = _sentinel((T, H, d + 64), dtype)
        q = _fill(parent[..., sl], dtype)
        _check(q, cache, None, pos, *flags, parents=(parent,))
    # q and k as views of one fused (T, (H + 2 H_kv) D) buffer
    parent = _sentinel((T, (H + 2 * Hk) * d), dtype)
    heads = parent.view(T, H + 2 * Hk, d)
    q, k = _fill(heads[:, :H], dtype), _fill(heads[:, H:H + Hk], dtype)
    _check(q, cache, k, None, *flags, 3, parents=(parent,))
    # DeepSeek: q tail of (T, H, 192), k = kv[:, 512:].unsqueeze(1) of a (T, 576) buffer
    if d == 64:
        qp, kvp = _sentinel((T, 16, 192), dtype), _sentinel((T, 576), dtype)
        q, k = _fill(qp[..., 128:], dtype), _fill(kvp[:, 512:], dtype).unsqueeze(1)
        _check(q, cache, k, pos, *flags, parents=(qp, kvp))
    # 4-D batch slice whose batch stride (7 S H D... sliced) is not a multiple of 8 elements
    parent = _sentinel((3, 37, 3, d + 2), dtype)
    q = _fill(parent[:, 1:36, :, 1:d + 1], dtype)  # batch stride 37 * 3 * (D + 2), pointer 1 element in
    _check(q, cache, None, None, *flags, 17, parents=(parent,))
    # data pointer one element past an aligned address
    parent = _sentinel((1 + T * H * d,), dtype)
    q = _fill(parent.as_strided((T, H, d), (H * d, d, 1), 1), dtype)
    _check(q, cache, None, pos, *flags, parents=(parent,))
    # caches with row stride D + 32, every other row of a bigger one, and one element off alignment
    q = torch.randn(T, H, d, device="cuda").to(dtype)
    wide = torch.randn(4096, d + 32, device="cuda")
    _check(q, wide[:, :d], None, pos, *flags)
    _check(q, make_cos_sin_cache(8192, d, device="cuda")[::2], None, pos, *flags)
    odd = torch.randn(1 + 4096 * d, device="cuda").as_strided((4096, d), (d, 1), 1)
    _check(q, odd, None, pos, *flags)


@pytest.mark.gpu
def test_offsets_beyond_2_to_31_bytes():
    d = 64
    n = (2 ** 31 + 2 ** 20) // 2  # bf16 elements: the view starts past 2^31 bytes
    parent = _sentinel((n + 8 * 2 * d,), torch.bfloat16)
    q = _fill(parent[n:].view(8, 2, d), torch.bfloat16)
    cache = make_cos_sin_cache(64, d, device="cuda")
    _check(q, cache, None, None, True, False, 1)
    assert torch.equal(bits(parent[:n:4096]), bits(_sentinel((n,), torch.bfloat16)[::4096]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_deterministic(dtype):
    cache = make_cos_sin_cache(8192, 128, device="cuda")
    q = torch.randn(4001, 32, 128, device="cuda").to(dtype)
    k = torch.randn(4001, 8, 128, device="cuda").to(dtype)
    pos = draw_positions((4001,), 8192, 0, device="cuda")
    runs = []
    for _ in range(2):
        qq, kk = q.clone(), k.clone()
        apply_rotary(qq, cache, kk, pos)
        runs.append((qq, kk))
    _same(runs[0][0], runs[1][0])
    _same(runs[0][1], runs[1][1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batch_invariance(dtype):
    """Every token of a 4001-token call equals the same token processed alone (T = 1, same position)."""
    cache = make_cos_sin_cache(8192, 64, device="cuda")
    q = torch.randn(4001, 16, 64, device="cuda").to(dtype)
    k = torch.randn(4001, 2, 64, device="cuda").to(dtype)
    pos = draw_positions((4001,), 8192, 0, device="cuda")
    qq, kk = q.clone(), k.clone()
    apply_rotary(qq, cache, kk, pos, True, False)
    alone_q, alone_k = q.clone(), k.clone()
    for t in range(4001):
        apply_rotary(alone_q[t:t + 1], cache, alone_k[t:t + 1], pos[t:t + 1], True, False)
    _same(alone_q, qq)
    _same(alone_k, kk)


@pytest.mark.gpu
def test_cuda_graph_replay():
    cache = make_cos_sin_cache(8192, 128, device="cuda")
    q0 = torch.randn(128, 32, 128, device="cuda").to(torch.bfloat16)
    k0 = torch.randn(128, 8, 128, device="cuda").to(torch.bfloat16)
    pos = draw_positions((128,), 8192, 0, device="cuda")
    q, k = q0.clone(), k0.clone()
    apply_rotary(q, cache, k, pos)  # warm-up outside the capture (compile and load)
    q.copy_(q0)
    k.copy_(k0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_rotary(q, cache, k, pos)
    q.copy_(q0)
    k.copy_(k0)
    graph.replay()
    torch.cuda.synchronize()
    _same(q, _ref(q0, cache, pos, 0, False, False))
    _same(k, _ref(k0, cache, pos, 0, False, False))
    pos.copy_(draw_positions((128,), 8192, 0, device="cuda"))  # positions are read on the device at replay
    q.copy_(q0)
    graph.replay()
    torch.cuda.synchronize()
    _same(q, _ref(q0, cache, pos, 0, False, False))


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    cache = make_cos_sin_cache(8192, 64, device="cuda")
    q0 = torch.randn(129, 16, 192, device="cuda").to(torch.bfloat16)
    kv0 = torch.randn(129, 576, device="cuda").to(torch.bfloat16)
    pos = draw_positions((129,), 8192, 0, device="cuda")

    def fn(q, kv, pos):
        apply_rotary(q[..., 128:], cache, kv[:, 512:].unsqueeze(1), pos, True, False, 0)
        return q * 1, kv + 0

    q, kv = q0.clone(), kv0.clone()
    got_q, got_kv = torch.compile(fn, fullgraph=True)(q, kv, pos)
    eq, ekv = q0.clone(), kv0.clone()
    want_q, want_kv = fn(eq, ekv, pos)
    _same(got_q, want_q)
    _same(got_kv, want_kv)
    _same(q, eq)  # the mutation is visible in the caller's tensors
    _same(kv, ekv)

    def no_positions(q, k, offset):  # the offset changes between calls: a specialized, then a dynamic int
        apply_rotary(q, cache, k, None, False, True, offset)
        return q + 0, k + 0

    compiled = torch.compile(no_positions, fullgraph=True)
    for offset in (3, 5, 7):
        q = torch.randn(33, 8, 64, device="cuda").to(torch.bfloat16)
        k = torch.randn(33, 2, 64, device="cuda").to(torch.bfloat16)
        got = compiled(q.clone(), k.clone(), offset)
        want = no_positions(q.clone(), k.clone(), offset)
        _same(got[0], want[0])
        _same(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("pdtype", (torch.int32, torch.int64), ids=str)
def test_out_of_range_positions_leave_tokens_unchanged(pdtype):
    R = 64
    cache = make_cos_sin_cache(R, 128, device="cuda")
    vals = [-1, R, 5, 2 ** 31 - 1, -(2 ** 31), 0, R - 1 - 7]
    pos = torch.tensor(vals * 20, dtype=pdtype, device="cuda")
    q = torch.randn(len(vals) * 20, 8, 128, device="cuda").to(torch.bfloat16)
    k = torch.randn(len(vals) * 20, 2, 128, device="cuda").to(torch.bfloat16)
    q0, k0 = q.clone(), k.clone()
    _check(q, cache, k, pos, False, False, 7)  # rows 6, R + 7, 12, 2^31 + 6, -2^31 + 7, 7, R - 1
    valid = ((pos.long() + 7) >= 0) & ((pos.long() + 7) < R)
    _same(q[~valid], q0[~valid])
    _same(k[~valid], k0[~valid])
    assert not torch.equal(q[valid], q0[valid])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_sizes_skip_the_launch_but_rotate_the_other_tensor(dtype):
    cache = make_cos_sin_cache(16, 64, device="cuda")
    for q, k in ((torch.empty(0, 4, 64), torch.randn(0, 1, 64)), (torch.empty(3, 0, 64), torch.randn(3, 1, 64)),
                 (torch.randn(3, 2, 64), torch.empty(3, 0, 64)), (torch.empty(0, 5, 2, 64), torch.randn(2, 3, 1, 64))):
        _check(q.cuda().to(dtype), cache, k.cuda().to(dtype), None, True, True, 2)


MEMCHECK_SCRIPT = """
import torch
from tilefuse.transform import apply_rotary
from tests.transform.rotary_data import make_cos_sin_cache
cache = make_cos_sin_cache(64, 128, device="cuda")
for pdtype in (torch.int32, torch.int64):
    pos = torch.tensor([-1, 64, 2 ** 31 - 1, -(2 ** 31), 3] * 7, dtype=pdtype, device="cuda")
    q = torch.randn(35, 8, 128, device="cuda").to(torch.bfloat16)
    k = torch.randn(35, 2, 128, device="cuda").to(torch.bfloat16)
    apply_rotary(q, cache, k, pos, False, False, 5)
    apply_rotary(q, cache, k, pos, True, True, 0)
flat = torch.randn(1 + 35 * 8 * 128, device="cuda").to(torch.bfloat16)
apply_rotary(flat.as_strided((35, 8, 128), (8 * 128, 128, 1), 1), cache[::2], None, None, True, False, 0)
torch.cuda.synchronize()
print("done")
"""


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="needs compute-sanitizer")
def test_out_of_range_positions_and_misaligned_views_under_memcheck():
    """Section 8.2: out-of-range positions (int32 and int64 extremes) and a misaligned view, with no invalid access."""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-c",
                           MEMCHECK_SCRIPT], cwd=repo, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "done" in out, out[-4000:]
    assert "ERROR SUMMARY: 0 errors" in out, out[-4000:]
