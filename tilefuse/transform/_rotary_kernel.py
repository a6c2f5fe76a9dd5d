"""TileLang kernel for ``apply_rotary`` (transform.md): in-place rotary embedding of queries and keys.

One launch rotates both tensors. The grid's first ``a_blocks`` CTAs take tensor A (``query``, or ``key`` when
``query`` is empty) and the rest take tensor B (``key``); each tensor is bound as it is, a strided ``(T, H, D)``
or ``(B, S, H, D)`` view (the rank is a static config) whose sizes and strides are all runtime values (64-bit),
so one binary serves every token count, head count and view.

Work split (one tensor): a head row of ``D`` elements is ``C = D / (2 V)`` lanes; lane ``c`` holds two
``V``-element vectors of the row, at columns ``c V`` and ``D/2 + c V`` (``V``: elements per vector access, a
static config chosen at launch from the strides and pointer alignment, so misaligned and odd-stride views
work without a copy). For NeoX pairs these two vectors are ``V`` whole pairs ``(x[j], x[j + D/2])``; for
interleaved pairs each vector holds ``V/2`` adjacent pairs (with ``V = 1``, the lane holds ``x[2c]`` and
``x[2c + 1]``, one pair). A CTA's ``THREADS / C`` lane groups are split at launch into ``tl`` tokens times
``hl`` head lanes; a thread loads its token's cache values once into registers and walks heads
``hl`` apart, ``UNROLL`` heads' loads in flight before their stores. Consecutive lanes cover consecutive
bytes of a head, so a warp reads whole 32-byte sectors even of a 64-wide tail inside a 192-wide head.

Arithmetic (transform.md 3.3): per pair ``f, s`` (fp32) with ``c, n`` from the cache,
``first = fma(f, c, -RN(s n'))``, ``second = fma(f, n', RN(s c))``, with ``n' = RN(n * sign)`` and ``sign`` = -1
for ``conjugate`` (exact: a negated sine, 3.4 item 1). The fma is ``__fmaf_rn`` and the two products are
``__fmul_rn``, so nvcc cannot contract them any other way; results are rounded to the data dtype once.

A token whose cache row ``p = position + offset`` is outside ``[0, R)`` is skipped whole: neither the cache nor
its heads are read or written. No shared memory, no atomics: deterministic and batch-invariant.

Host path: the configuration of a layout (kernel, vector widths, work split: a ``Plan``) is computed once and kept
under ``plan_key`` (metadata, flags and pointer alignment), so a repeated call costs a key, a lookup and the launch.
"""

from typing import NamedTuple

import torch

from tilefuse import _jit, _launch, _ops
from tilefuse._rn import fma as _fma, mul as _fmul

KERNEL_HELPERS = ("tilefuse._rn",)  # part of this module's kernel cache key (_jit._module_digest)

# ---- tuning knobs (TILEFUSE_KNOBS) ----
THREADS = 128  # per CTA
UNROLL = 4     # heads a thread has in flight (loads of UNROLL heads before their stores)
# PDL: the first statement waits for the stream's previous grid (griddepcontrol.wait), so the launch and CTA
# setup overlap the previous kernel's tail. Results unchanged.
PDL = True
# heads per thread the launcher aims at for large calls; small calls take one head per thread (more CTAs)
HEADS_PER_THREAD = 4
SMALL_WORK = 1 << 18  # lane count (tokens * heads * C) below which a thread takes one head

_DT = {"bf16": "bfloat16", "fp32": "float32"}
_DT_NAME = {torch.bfloat16: "bf16", torch.float32: "fp32"}
_POS_NAME = {torch.int32: "int32", torch.int64: "int64"}
VECS = {"bf16": (8, 4, 2, 1), "fp32": (4, 2, 1)}  # elements per data access, widest first (16 bytes max)
CACHE_VECS = (4, 2, 1)                              # fp32 cache values per access


def rotary_kernel(dtype: str, D: int, V: int, CW: int, interleaved: bool, pos: str, rank: int = 3):
    """Factory: data dtype ("bf16" | "fp32"), rotary width ``D`` (64 | 128), ``V`` elements per data vector,
    ``CW`` cache floats per access, pairing, positions dtype ("none" | "int32" | "int64") and the tensors' rank
    (3: ``(T, H, D)`` with positions ``(T,)``; 4: ``(B, S, H, D)`` with positions ``(B, S)``; the 3-D binary takes
    the caller's tensors as they are, with no view made per call).

    Arguments at launch: A, B (strided views), CS (cache ``(R, D)``, row stride symbolic), P (positions, a
    placeholder for "none"), the int64 ``offset``, the float ``sign`` (+1 or -1), and per tensor ``hl`` (head
    lanes), ``tl`` (tokens per CTA), ``bpb`` (CTAs per batch row) and its CTA count.
    """
    import tilelang.language as T

    dt = _DT[dtype]
    half = D // 2
    assert D in (64, 128) and V in VECS[dtype] and CW in CACHE_VECS
    C = D // (2 * V)               # lanes per head row
    split = interleaved and V >= 2  # interleaved: each vector holds V/2 adjacent pairs
    pairs = tuple(range(V))         # the lane's pairs (a Python tuple: unrolled while building)
    # cache columns of the lane's pairs: NeoX / interleaved V = 1: c V + i; split: c V/2 + i and D/4 + c V/2 + i
    cgroups = ((0, V // 2), (D // 4, V // 2)) if split else ((0, V),)
    cw = min(CW, *(n for _, n in cgroups))
    U = UNROLL
    pdt = "int32" if pos == "none" else pos
    i64 = "int64"
    AB, AS, AH, aB, aS, aH = T.dynamic("a_batch, a_seq, a_heads, a_sb, a_ss, a_sh", i64)
    BB, BS, BH, bB, bS, bH = T.dynamic("b_batch, b_seq, b_heads, b_sb, b_ss, b_sh", i64)
    R, cR = T.dynamic("cache_rows, cache_stride", i64)
    PB, PS, pB = T.dynamic("pos_batch, pos_seq, pos_sb", i64)

    four = rank == 4

    def at(b, s, h, col):
        """The index tuple of element ``col`` of head ``h`` of token ``s`` of batch row ``b``."""
        return (b, s, h, col) if four else (s, h, col)

    def pos_at(b, s):
        return (b, s) if four else (s,)

    def lane_cols(c):
        """Element columns of the lane's two vectors."""
        if interleaved and V == 1:
            return 2 * c, 2 * c + 1
        return c * V, half + c * V

    def pair_of(i):
        """(vector, index of first, index of second) of the lane's pair ``i``."""
        if not interleaved:
            return (0, i, V + i)
        if V == 1:
            return (0, 0, V)
        g, k = divmod(i, V // 2)
        return (g, g * V + 2 * k, g * V + 2 * k + 1)

    @T.macro
    def rotate(X, hl, tl, bpb, blk, CS, P, offset, sign, tid, cosv, sinv, nsinv, w):
        # X's sizes are read as X.shape[i] (binding them to names here would rename the symbolic variables)
        c = tid % C
        r = tid // C
        b = T.cast(T.truncdiv(blk, bpb), i64)
        s = T.cast(T.truncmod(blk, bpb) * tl + T.truncdiv(r, hl), i64)
        hlane = T.cast(T.truncmod(r, hl), i64)
        if r < hl * tl and s < X.shape[-3] and (not four or b < X.shape[0]) and (
                pos == "none" or (s < PS and (not four or b < PB))):
            p = T.alloc_var(i64, init=s + offset if pos == "none" else T.cast(P[pos_at(b, s)], i64) + offset)
            if p >= 0 and p < R:
                ca = T.cast(c, i64) * (V // 2 if split else V)
                for g, (base, n) in enumerate(cgroups):
                    for k in T.unroll(n // cw):
                        for e in T.vectorized(cw):
                            cosv[g * (V // 2) + k * cw + e] = CS[p, base + ca + k * cw + e]
                        for e in T.vectorized(cw):
                            sinv[g * (V // 2) + k * cw + e] = CS[p, half + base + ca + k * cw + e]
                for i in T.unroll(V):
                    nsinv[i] = _fmul(sinv[i], _fmul(sign, T.float32(-1.0)))
                    sinv[i] = _fmul(sinv[i], sign)
                c0, c1 = lane_cols(T.cast(c, i64))
                nheads = T.ceildiv(X.shape[-2] - hlane, T.cast(hl, i64))
                for it in T.serial(T.ceildiv(nheads, U)):
                    for u in T.unroll(U):
                        h = hlane + (it * U + u) * hl
                        if h < X.shape[-2]:
                            for e in T.vectorized(V):
                                w[u * 2 * V + e] = X[at(b, s, h, c0 + e)]
                            for e in T.vectorized(V):
                                w[u * 2 * V + V + e] = X[at(b, s, h, c1 + e)]
                    for u in T.unroll(U):
                        h = hlane + (it * U + u) * hl
                        if h < X.shape[-2]:
                            for i in pairs:
                                _, fi, si = pair_of(i)
                                f = T.cast(w[u * 2 * V + fi], "float32")
                                sv = T.cast(w[u * 2 * V + si], "float32")
                                # first = fma(f, c, -RN(s n)) = fma(f, c, RN(s (-n))); second = fma(f, n, RN(s c))
                                w[u * 2 * V + fi] = T.cast(_fma(f, cosv[i], _fmul(sv, nsinv[i])), dt)
                                w[u * 2 * V + si] = T.cast(_fma(f, sinv[i], _fmul(sv, cosv[i])), dt)
                            for e in T.vectorized(V):
                                X[at(b, s, h, c0 + e)] = w[u * 2 * V + e]
                            for e in T.vectorized(V):
                                X[at(b, s, h, c1 + e)] = w[u * 2 * V + V + e]

    if four:
        a_param = T.StridedTensor((AB, AS, AH, D), (aB, aS, aH, 1), dt)
        b_param = T.StridedTensor((BB, BS, BH, D), (bB, bS, bH, 1), dt)
        p_param = T.StridedTensor((PB, PS), (pB, 1), pdt)
    else:
        a_param = T.StridedTensor((AS, AH, D), (aS, aH, 1), dt)
        b_param = T.StridedTensor((BS, BH, D), (bS, bH, 1), dt)
        p_param = T.StridedTensor((PS,), (1,), pdt)

    @T.prim_func
    def rotary(A: a_param, Bt: b_param, CS: T.StridedTensor((R, D), (cR, 1), "float32"), P: p_param,
               offset: T.int64, sign: T.float32,
               a_hl: T.int32, a_tl: T.int32, a_bpb: T.int32, a_blocks: T.int32,
               b_hl: T.int32, b_tl: T.int32, b_bpb: T.int32, b_blocks: T.int32):
        # the launcher's contract: every stride of a dimension of size > 1 is a multiple of the access width
        # (others are bound as 0), so every vector access is aligned
        if four:
            T.assume(aB % V == 0)
            T.assume(bB % V == 0)
        T.assume(aS % V == 0)
        T.assume(aH % V == 0)
        T.assume(bS % V == 0)
        T.assume(bH % V == 0)
        T.assume(a_hl > 0)
        T.assume(a_tl > 0)
        T.assume(a_bpb > 0)
        T.assume(b_hl > 0)
        T.assume(b_tl > 0)
        T.assume(b_bpb > 0)
        T.assume(cR % cw == 0)
        with T.Kernel(a_blocks + b_blocks, threads=THREADS) as bx:
            if PDL:
                T.pdl_sync()
            tid = T.get_thread_binding()
            cosv = T.alloc_local((V,), "float32")
            sinv = T.alloc_local((V,), "float32")
            nsinv = T.alloc_local((V,), "float32")
            w = T.alloc_local((U * 2 * V,), dt)
            if bx < a_blocks:
                rotate(A, a_hl, a_tl, a_bpb, bx, CS, P, offset, sign, tid, cosv, sinv, nsinv, w)
            else:
                rotate(Bt, b_hl, b_tl, b_bpb, bx - a_blocks, CS, P, offset, sign, tid, cosv, sinv,
                       nsinv, w)

    return rotary


def _bench_configs() -> list[tuple]:
    """The configs the bench launches (tilefuse.bench.transform, transform.md 9): contiguous bf16 with the
    widest vectors, head dim 128 paired halves (3-D without and with int64 positions, 4-D) and 64 interleaved
    (3-D without and with int64 positions); fp32, head dim 64 paired halves, int32 positions. Other configs
    compile on first use."""
    return [("bf16", 128, 8, 4, False, "none", 3), ("bf16", 128, 8, 4, False, "int64", 3),
            ("bf16", 128, 8, 4, False, "none", 4), ("bf16", 64, 8, 4, True, "none", 3),
            ("bf16", 64, 8, 4, True, "int64", 3), ("fp32", 64, 4, 4, False, "int32", 3)]


_jit.register("apply_rotary", rotary_kernel, _bench_configs)


# ---- launcher ----

def _vec_width(x: torch.Tensor, widths: tuple) -> int:
    """The widest ``V`` of ``widths`` such that ``x``'s data pointer and every stride of a dimension of size > 1
    (other than the unit last one) are multiples of ``V`` elements."""
    g = x.data_ptr() // x.element_size()
    for size, st in zip(x.shape[:-1], x.stride()[:-1]):
        if size > 1:
            g |= st
    for v in widths:
        if g % v == 0:
            return v
    return 1


def _bind(x: torch.Tensor, v: int) -> torch.Tensor:
    """``x`` with stride 0 on its size-1 dimensions where theirs is not a multiple of ``v`` (the kernel assumes every
    stride is; a size-1 dimension's stride is never used)."""
    st = x.stride()
    if any(s % v for s in st[:-1]):
        x = x.as_strided(x.shape, [0 if n == 1 else s for n, s in zip(x.shape, st)])
    return x


def _split(n_batch: int, n_seq: int, heads: int, C: int) -> tuple:
    """``(hl, tl, bpb, blocks)`` of one tensor: head lanes, tokens per CTA, CTAs per batch row and CTAs."""
    rl = THREADS // C
    per_thread = 1 if n_batch * n_seq * heads * C < SMALL_WORK else HEADS_PER_THREAD
    want = -(-heads // per_thread)
    hl = 1
    while hl < want and hl < rl:
        hl *= 2
    tl = rl // hl
    bpb = -(-n_seq // tl)
    return hl, tl, bpb, n_batch * bpb


def plan_key(query, cos_sin_cache, key, positions, interleaved, conjugate) -> tuple:
    """Everything the validation and the launch configuration read of the arguments (metadata, flags and the
    pointers' alignment; not the offset) as one flat dict key. Raises AttributeError for arguments that are not
    tensors."""
    q, c = query, cos_sin_cache
    k = (None,) * 6 if key is None else (key.__class__, key.shape, key.stride(), key.dtype, key.device,
                                           key.data_ptr() & 15)
    p = (None,) * 5 if positions is None else (positions.__class__, positions.shape, positions.stride(),
                                               positions.dtype, positions.device)
    return (q.__class__, q.shape, q.stride(), q.dtype, q.device, q.data_ptr() & 15,
            c.__class__, c.shape, c.stride(), c.dtype, c.device, c.data_ptr() & 15,
            *k, *p, interleaved.__class__, interleaved, conjugate.__class__, conjugate)


class Plan(NamedTuple):
    """The launch configuration of one layout."""
    fn: object          # the kernel
    split: tuple        # (hl, tl, bpb, blocks) of A, then of B
    direct: bool        # A = query, B = key (or query), P = positions (or the placeholder), as they are
    holder: object      # the positions placeholder (no positions)
    v: int              # elements per data vector
    offset_max: int     # without positions: the largest valid seqlen_offset (R - the largest S > 0)


def _plan(query, cos_sin_cache, key, positions, interleaved: bool) -> Plan | None:
    """The configuration of one layout; ``None`` when both tensors are empty (no launch)."""
    tensors = [t for t in (query, key) if t is not None and t.numel() > 0]
    if not tensors:
        return None
    dtype = _DT_NAME[query.dtype]
    d = cos_sin_cache.size(1)
    v = VECS[dtype][0]
    for t in tensors:
        v = _vec_width(t, VECS[dtype][:VECS[dtype].index(v) + 1])
    n = v // 2 if interleaved and v >= 2 else v
    cw = _vec_width(cos_sin_cache, tuple(w for w in CACHE_VECS if w <= n))
    pos = "none" if positions is None else _POS_NAME[positions.dtype]
    rank = query.dim()
    fn = _jit.get("apply_rotary", (dtype, d, v, cw, interleaved, pos, rank))
    c = d // (2 * v)
    lead = (lambda t: (1, t.size(0), t.size(1))) if rank == 3 else (lambda t: tuple(t.shape[:3]))
    split = _split(*lead(tensors[0]), c) + (_split(*lead(tensors[1]), c) if len(tensors) == 2 else (1, 1, 1, 0))
    direct = (tensors[0] is query and (key is None or len(tensors) == 2)  # an empty tensor is never bound
              and all(_bind(t, v) is t for t in tensors)
              and (positions is None or positions.size(-1) > 1 or positions.stride(-1) == 1))
    holder = _launch.placeholder(query.device, torch.int32, (1,) * (rank - 2)) if positions is None else None
    seqs = [t.shape[-3] for t in (query, key) if t is not None and t.shape[-3] > 0]
    offset_max = cos_sin_cache.size(0) - max(seqs, default=0)
    return Plan(fn, split, direct, holder, v, offset_max)


_PLANS: dict = {}


def get_plan(pk: tuple, query, cos_sin_cache, key, positions, interleaved) -> Plan | None:
    """The kept plan of key ``pk`` (``plan_key``), made on first use."""
    plan = _PLANS.get(pk, _PLANS)
    if plan is _PLANS:
        if len(_PLANS) > 4096:  # a bounded cache: views of ever-new shapes start it over
            _PLANS.clear()
        plan = _PLANS[pk] = _plan(query, cos_sin_cache, key, positions, bool(interleaved))
    return plan


def launch(plan: Plan | None, query, cos_sin_cache, key, positions, conjugate, seqlen_offset: int) -> None:
    """One launch of ``plan`` on these tensors (nothing for ``None``: both empty)."""
    if plan is None:
        return
    sign = -1.0 if conjugate else 1.0
    if plan.direct:
        plan.fn(query, query if key is None else key, cos_sin_cache, plan.holder if positions is None else positions,
                seqlen_offset, sign, *plan.split)
        return
    tensors = [_bind(t, plan.v) for t in (query, key) if t is not None and t.numel() > 0]
    p = plan.holder
    if positions is not None:
        p = positions if positions.size(-1) > 1 or positions.stride(-1) == 1 else positions.as_strided(
            positions.shape, positions.stride()[:-1] + (1,))
    plan.fn(tensors[0], tensors[-1], cos_sin_cache, p, seqlen_offset, sign, *plan.split)


def apply_rotary_launch(query: torch.Tensor, cos_sin_cache: torch.Tensor, key: torch.Tensor | None,
                        positions: torch.Tensor | None, interleaved: bool, conjugate: bool, seqlen_offset: int) -> None:
    """Rotate ``query`` and ``key`` in place with one launch; validates nothing (the public op does).

    Every layout that passes validation is taken as it is, without a copy: ``V`` (and the cache's access width)
    narrows down to one element for misaligned pointers or odd strides. The configuration of a layout (kernel,
    vector widths, work split) is computed once and kept, keyed by ``plan_key``.
    """
    pk = plan_key(query, cos_sin_cache, key, positions, interleaved, conjugate)
    launch(get_plan(pk, query, cos_sin_cache, key, positions, interleaved), query, cos_sin_cache, key, positions,
           conjugate, seqlen_offset)


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::apply_rotary", mutates_args=("query", "key"), device_types="cuda")
def _apply_rotary_op(query: torch.Tensor, cos_sin_cache: torch.Tensor, key: torch.Tensor | None,
                     positions: torch.Tensor | None, interleaved: bool, conjugate: bool, seqlen_offset: int) -> None:
    apply_rotary_launch(query, cos_sin_cache, key, positions, interleaved, conjugate, seqlen_offset)



def apply_rotary_cuda(query, cos_sin_cache, key, positions, interleaved: bool, conjugate: bool,
                      seqlen_offset: int) -> None:
    """CUDA entry for the public op: a direct launch in eager mode, the custom op under ``torch.compile``."""
    if torch.compiler.is_compiling():
        torch.ops.tilefuse.apply_rotary(query, cos_sin_cache, key, positions, interleaved, conjugate, seqlen_offset)
    else:
        apply_rotary_launch(query, cos_sin_cache, key, positions, interleaved, conjugate, seqlen_offset)
