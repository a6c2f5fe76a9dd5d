"""TileLang kernels for the fused-layout token shuffles: ``expand_to_fused`` (moe.md §2.6),
``expand_to_fused_with_sf`` (§2.7) and ``reduce_fused`` (§2.8).

expand: pure byte moves. The launcher views rows as words (4-byte words when the row is a multiple of 4
bytes, else 2- or 1-byte words), so one binary per (word size, row words, K) serves every dtype. The grid's x
dimension holds two kinds of CTA:

* token CTAs ``bx < T``: each thread loads up to ``UNROLL_MAX`` vectors of row ``bx`` (16 bytes each when the
  row is a multiple of 16 bytes; consecutive threads take consecutive vectors) and stores them to every target
  ``p = token_topk_to_pos[bx, k]`` with ``0 <= p < N``: the row is read once and written K times. With scale
  factors the CTAs of the first row chunk also copy the token's sf words (row-major ``(N, H_sf)`` or the
  TMA-aligned column-major storage ``(H_sf, align(N, 4))``; packed UE8M0 words keep only their used bytes).
* zeroing CTAs ``bx >= T``: ``ZERO_ROWS`` consecutive positions each (their ``pos_to_expert`` entries loaded
  together up front); a position with ``pos_to_expert[p] < 0`` (padding) gets an all-zero row (and all-zero sf).

The row is split over ``gy`` CTAs (grid y) only when one CTA would need more than ``UNROLL_MAX`` vectors per
thread. Positions that are neither padding nor targeted stay unwritten (moe.md §2.6; valid maps have none).

reduce: CTA ``(t, by)`` owns a contiguous chunk of output row ``t``; each thread owns ``U`` 16-byte vectors
of input (8 bf16/fp16 or 4 fp32 elements), ``TX`` vectors apart. For ``k = 0 .. K-1`` in order, a slot with
``0 <= p < N`` loads the thread's ``U`` vectors of row ``p`` (a skipped slot loads nothing), then every element
takes ``acc = fma(float(x[p, h]), s_k, acc)`` with ``s_k = w[t, k] * x_sf[p]`` (one fp32 multiply, each factor
only when given); then ``acc * sf[0]`` and the output conversion (RNE; e4m3 saturating to +-448, NaN kept). No shared memory, no atomics: every output
element is a function of its own row only (deterministic, batch-invariant).

Data rules: both kernels check ``token_topk_to_pos < N`` (N = ``len(pos_to_expert)`` for expand, x's rows for
reduce) with ``device_assert`` on the entries they load anyway, so the CUDA path needs no host-side check;
every negative entry is a skipped slot (the reference's ``p >= 0``). The launches that run no kernel (empty
inputs, K > ``MAX_TOPK``) check the rule with ``torch._assert_async`` instead.
"""

import torch

from tilefuse import _jit, _ops, formats
from tilefuse._launch import aligned
from tilefuse.reference import moe as ref

# Tuning knobs (TILEFUSE_KNOBS; read when a kernel is built; results never depend on them).
THREADS = 128       # threads of an expand CTA (fewer when a row has fewer vectors)
UNROLL_MAX = 8      # vectors per thread before a row is split over more CTAs
ZERO_ROWS = 8       # positions checked by one zeroing CTA of expand
REDUCE_UNROLL_MAX = 8  # vectors per thread of reduce (a divisor of the row's; the rest spread over CTAs)
MAX_TOPK = 32       # slots a kernel unrolls (larger K runs the reference)

_WORD = {4: ("int32", torch.int32), 2: ("int16", torch.int16), 1: ("uint8", torch.uint8)}
_TL_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
             torch.float8_e4m3fn: "float8_e4m3fn"}
_MAX_INDEX = 2 ** 31 - 1  # CTA indices and position counts are int32 (element offsets are int64)
_MAX_GRID_Y = 65535       # CUDA's grid y limit (CTAs per row: <= row bytes / 1024 for expand, <= H / 128 reduce)


# ----------------------------------------------------------------------------------------------------
# expand_to_fused / expand_to_fused_with_sf
# ----------------------------------------------------------------------------------------------------

def expand_tile(word_bytes: int, row_words: int) -> tuple[int, int, int, int, int]:
    """``(vec, chunks, threads, unroll, gy)``: words per vector (4 = 16 bytes), vectors per row, threads per
    CTA, vectors per thread and CTAs per row."""
    vec = next(v for v in (4, 2, 1) if row_words % v == 0) if word_bytes == 4 else 1
    chunks = row_words // vec
    threads = min(THREADS, max(32, formats.cdiv(chunks, 32) * 32))
    gy = formats.cdiv(chunks, threads * UNROLL_MAX)
    unroll = formats.cdiv(chunks, threads * gy)
    return vec, chunks, threads, unroll, gy


def expand_kernel(word_bytes: int, row_words: int, num_topk: int, sf_mode: str = "", sf_words: int = 0,
                  sf_keep_bytes: int = 0):
    """Factory: rows of ``row_words`` words of ``word_bytes`` bytes, ``num_topk`` slots per token.

    ``sf_mode``: "" (no scale factors), "row" (output sf ``(N, sf_words)``) or "col" (output storage
    ``(sf_words, align(N, 4))``); sf are int32 words (fp32 bits or packed UE8M0). ``sf_keep_bytes`` in 1..3:
    the last sf word keeps only its low ``sf_keep_bytes`` bytes (packed UE8M0 whose block count is not a
    multiple of 4); 0: words are copied whole. Token count T and position count N are symbolic.
    """
    import tilelang.language as T

    K = num_topk
    wdt = _WORD[word_bytes][0]
    vec, chunks, threads, unroll, gy = expand_tile(word_bytes, row_words)
    masked = chunks % (threads * unroll) != 0
    with_sf = sf_mode != ""
    assert 0 <= sf_keep_bytes <= 3, sf_keep_bytes
    keep_mask = (1 << (8 * sf_keep_bytes)) - 1  # 0: the last word is copied whole
    sf_iters = formats.cdiv(sf_words, threads) if with_sf else 0
    ZR = ZERO_ROWS

    Tn, N, NA = T.dynamic("num_tokens, num_positions, sf_cols")

    def in_row(c):
        return c < chunks if masked else T.bool(True)

    def target(p):
        return (p >= 0) & (p < N)

    @T.macro
    def store_sf(OSF, p, j, value):
        if sf_mode == "row":
            OSF[p, j] = value
        else:
            OSF[j, p] = value

    @T.macro
    def body(X, TTP, PTE, Y, SF, OSF):
        with T.Kernel(Tn + T.ceildiv(N, ZR), gy, threads=threads) as (bx, by):
            T.pdl_sync()  # programmatic dependent launch: the launch overlaps the stream's previous grid's tail
            tid = T.get_thread_binding()
            raw = T.alloc_local((unroll * vec,), wdt)
            pos = T.alloc_local((K,), "int32")
            pte = T.alloc_local((ZR,), "int32")
            if bx < Tn:
                top = T.alloc_var("int32")  # the largest entry: one compare and one assert call per thread
                top = -1
                for k in T.unroll(K):
                    pos[k] = TTP[bx, k]
                    top = T.max(top, pos[k])
                for u in T.unroll(unroll):
                    c = (by * unroll + u) * threads + tid
                    if in_row(c):
                        for v in T.vectorized(vec):
                            raw[u * vec + v] = X[bx, c * vec + v]
                for k in T.unroll(K):
                    if target(pos[k]):
                        for u in T.unroll(unroll):
                            c = (by * unroll + u) * threads + tid
                            if in_row(c):
                                for v in T.vectorized(vec):
                                    Y[pos[k], c * vec + v] = raw[u * vec + v]
                if with_sf:
                    if by == 0:
                        w = T.alloc_var("int32")
                        for i in T.serial(sf_iters):
                            j = i * threads + tid
                            if j < sf_words:
                                w = SF[bx, j]
                                if keep_mask:
                                    if j == sf_words - 1:
                                        w = w & keep_mask
                                for k in T.unroll(K):
                                    if target(pos[k]):
                                        store_sf(OSF, pos[k], j, w)
                # moe.md 2.6 data rule (replaces the host-side check): entries < len(pos_to_expert). Checked
                # last (an out-of-range slot was skipped): no call site with the row's registers live across it
                T.call_extern("void", "device_assert", top < N)
            else:
                # every pos_to_expert load first (independent loads in flight, not one per row in turn)
                for r in T.unroll(ZR):
                    pte[r] = 0
                    if (bx - Tn) * ZR + r < N:
                        pte[r] = PTE[(bx - Tn) * ZR + r]
                for r in T.unroll(ZR):
                    p = (bx - Tn) * ZR + r
                    if pte[r] < 0:  # padding (a position >= N keeps 0: not written)
                        for u in T.unroll(unroll):
                            c = (by * unroll + u) * threads + tid
                            if in_row(c):
                                for v in T.vectorized(vec):
                                    Y[p, c * vec + v] = T.cast(0, wdt)
                        if with_sf:
                            if by == 0:
                                for i in T.serial(sf_iters):
                                    j = i * threads + tid
                                    if j < sf_words:
                                        store_sf(OSF, p, j, 0)

    x_p = T.Tensor((Tn, row_words), wdt)
    ttp_p = T.Tensor((Tn, K), "int32")
    pte_p = T.Tensor((N,), "int32")
    y_p = T.Tensor((N, row_words), wdt)
    if not with_sf:
        @T.prim_func
        def expand_to_fused(X: x_p, TTP: ttp_p, PTE: pte_p, Y: y_p):
            body(X, TTP, PTE, Y, None, None)

        return expand_to_fused

    sf_p = T.Tensor((Tn, sf_words), "int32")
    osf_p = T.Tensor((N, sf_words), "int32") if sf_mode == "row" else T.Tensor((sf_words, NA), "int32")

    @T.prim_func
    def expand_to_fused_with_sf(X: x_p, TTP: ttp_p, PTE: pte_p, Y: y_p, SF: sf_p, OSF: osf_p):
        body(X, TTP, PTE, Y, SF, OSF)

    return expand_to_fused_with_sf


def _word_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` (contiguous 2-D) as ``(T, row_words)`` words of the widest size dividing its row bytes."""
    row_bytes = x.size(1) * x.element_size()
    wb = next(b for b in (4, 2, 1) if row_bytes % b == 0)
    return x.view(torch.uint8).view(_WORD[wb][1]), wb


def _sf_layout(sf: torch.Tensor, num_per_channels: int, hidden: int) -> tuple[int, int]:
    """``(sf_words, sf_keep_bytes)`` of an sf tensor (fp32: whole words; packed UE8M0 int32: the last word
    keeps ``blocks % 4`` bytes)."""
    words = sf.size(1)
    if sf.dtype == torch.int32:
        return words, formats.cdiv(hidden, num_per_channels) % 4
    return words, 0


def _sf_out(sf: torch.Tensor, size: int, col: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel argument, returned tensor) of the output sf: row-major ``(N, H_sf)``, or the TMA-aligned
    column-major storage ``(H_sf, align(N, 4))`` and its first N columns transposed."""
    words = sf.size(1)
    if not col:
        out = torch.empty((size, words), dtype=sf.dtype, device=sf.device)
        return out, out
    storage = torch.empty((words, (size + 3) // 4 * 4), dtype=sf.dtype, device=sf.device)
    return storage, storage[:, :size].T


def _expand_reference(data, sf, num_per_channels, token_topk_to_pos, pos_to_expert, col):
    if sf is None:
        return ref.expand_to_fused(data, token_topk_to_pos, pos_to_expert)
    return ref.expand_to_fused_with_sf((data, sf), num_per_channels, token_topk_to_pos, pos_to_expert, col)


def _assert_positions(token_topk_to_pos: torch.Tensor, limit: int, op: str, what: str) -> None:
    """The op's data rule ``token_topk_to_pos < limit`` on the paths that launch no kernel (the kernels check
    it themselves with device_assert, so the public op needs no host-side check on CUDA)."""
    if token_topk_to_pos.numel():
        torch._assert_async((token_topk_to_pos < limit).all(), f"{op}: token_topk_to_pos entries must be < {what}")


def _expand_launch(data, sf, num_per_channels, token_topk_to_pos, pos_to_expert, col):
    """Allocate and launch (arguments validated by the public op); ``sf`` None: plain expand_to_fused."""
    rows, hidden = data.shape
    size = pos_to_expert.numel()
    k = token_topk_to_pos.size(1)
    row_bytes = hidden * data.element_size()
    if (rows == 0 or k == 0 or size == 0 or row_bytes == 0 or k > MAX_TOPK
            or (rows + size) * ZERO_ROWS > _MAX_INDEX or row_bytes > 1024 * _MAX_GRID_Y):
        # nothing to copy (T, K, N or H zero: the reference's shapes, no kernel; H = 0 would be an empty grid),
        # more slots than a kernel unrolls, or a grid beyond CUDA's limits
        op = "expand_to_fused" if sf is None else "expand_to_fused_with_sf"
        _assert_positions(token_topk_to_pos, size, op, f"len(pos_to_expert) = {size}")
        if row_bytes == 0:  # (N, 0) rows and (N, 0) sf in the requested layout
            out = torch.empty((size, 0), dtype=data.dtype, device=data.device)
            return out if sf is None else (out, _sf_out(sf, size, col)[1])
        return _expand_reference(data, sf, num_per_channels, token_topk_to_pos, pos_to_expert, col)
    out = torch.empty((size, hidden), dtype=data.dtype, device=data.device)
    xw, wb = _word_view(aligned(data))
    yw = out.view(torch.uint8).view(_WORD[wb][1])
    if sf is None:
        _jit.get("expand_to_fused", (wb, xw.size(1), k))(xw, token_topk_to_pos, pos_to_expert, yw)
        return out
    sf_arg, out_sf = _sf_out(sf, size, col)
    words, keep = _sf_layout(sf, num_per_channels, hidden)
    cfg = (wb, xw.size(1), k, "col" if col else "row", words, keep)
    _jit.get("expand_to_fused", cfg)(xw, token_topk_to_pos, pos_to_expert, yw, sf.view(torch.int32),
                                     sf_arg.view(torch.int32))
    return out, out_sf


# ----------------------------------------------------------------------------------------------------
# reduce_fused
# ----------------------------------------------------------------------------------------------------

def reduce_tile(in_dtype: str, hidden: int) -> tuple[int, int, int, int]:
    """``(vec, tx, unroll, gy)``: elements per 16-byte load, threads per CTA, vectors per thread (a divisor
    of the row's vectors per thread, so no masking) and CTAs per row. ``hidden % 256 == 0``."""
    vec = 16 // {"float32": 4, "bfloat16": 2, "float16": 2}[in_dtype]
    vpr = hidden // vec
    tx = next(t for t in (128, 64, 32) if vpr % t == 0)
    per_thread = vpr // tx
    unroll = max(d for d in range(1, REDUCE_UNROLL_MAX + 1) if per_thread % d == 0)
    return vec, tx, unroll, per_thread // unroll


def reduce_kernel(in_dtype: str, out_dtype: str, hidden: int, num_topk: int, with_weights: bool,
                  with_x_sf: bool, with_sf: bool):
    """Factory: ``x (N, hidden)`` of ``in_dtype`` -> ``out (T, hidden)`` of ``out_dtype``, ``num_topk`` slots.

    The optional inputs are always parameters (the launcher binds an unused tensor where one is absent):
    ``W (T, K)`` fp32 weights, ``XSF (NX,)`` fp32 per-row scales, ``SF (NS,)`` fp32 (element 0 is the scalar).
    """
    import tilelang.language as T

    assert hidden % 256 == 0, hidden
    K = num_topk
    vec, tx, unroll, gy = reduce_tile(in_dtype, hidden)
    Tn, N, NX, NS = T.dynamic("num_tokens, num_positions, x_sf_len, sf_len")

    @T.prim_func
    def reduce_fused(X: T.Tensor((N, hidden), in_dtype), XSF: T.Tensor((NX,), "float32"),
                     W: T.Tensor((Tn, K), "float32"), TTP: T.Tensor((Tn, K), "int32"),
                     SF: T.Tensor((NS,), "float32"), Y: T.Tensor((Tn, hidden), out_dtype)):
        with T.Kernel(Tn, gy, threads=tx) as (bx, by):
            T.pdl_sync()  # programmatic dependent launch: the launch overlaps the stream's previous grid's tail
            tid = T.get_thread_binding()
            pos = T.alloc_local((K,), "int32")
            ok = T.alloc_local((K,), "bool")
            scale = T.alloc_local((K,), "float32")
            res = T.alloc_local((vec,), out_dtype)
            out_sf = T.alloc_var("float32")
            top = T.alloc_var("int32")  # the largest entry: one compare and one assert call per thread
            top = -1
            for k in T.unroll(K):
                pos[k] = TTP[bx, k]
                top = T.max(top, pos[k])
                ok[k] = (pos[k] >= 0) & (pos[k] < N)  # every negative entry is skipped, as in the reference
                scale[k] = T.float32(1.0)
                if with_weights:
                    scale[k] = W[bx, k]
                if with_x_sf:
                    if ok[k]:
                        if with_weights:
                            scale[k] = scale[k] * XSF[pos[k]]
                        else:
                            scale[k] = XSF[pos[k]]
            if with_sf:
                out_sf = SF[0]
            # slots outer: all of the thread's vectors of slot k, then of slot k + 1 (per element the same
            # fma order); a skipped slot costs no load
            sacc = T.alloc_local((unroll * vec,), "float32")
            srow = T.alloc_local((unroll * vec,), in_dtype)
            for i in T.unroll(unroll * vec):
                sacc[i] = T.float32(0.0)
            for k in T.unroll(K):
                if ok[k]:
                    for u in T.unroll(unroll):
                        col = ((by * unroll + u) * tx + tid) * vec
                        for v in T.vectorized(vec):
                            srow[u * vec + v] = X[pos[k], col + v]
                    for i in T.unroll(unroll * vec):
                        sacc[i] = T.call_extern("float32", "__fmaf_rn", T.cast(srow[i], "float32"), scale[k],
                                                sacc[i])
            for u in T.unroll(unroll):
                col = ((by * unroll + u) * tx + tid) * vec
                for v in T.unroll(vec):
                    if with_sf:
                        res[v] = T.cast(sacc[u * vec + v] * out_sf, out_dtype)
                    else:
                        res[v] = T.cast(sacc[u * vec + v], out_dtype)
                for v in T.vectorized(vec):
                    Y[bx, col + v] = res[v]
            # moe.md 2.8 data rule (replaces the host-side check): entries < x rows. Checked last (an
            # out-of-range slot was skipped): no call site with the row's registers live across it
            T.call_extern("void", "device_assert", top < N)

    return reduce_fused


def _reduce_launch(x, topk_weights, token_topk_to_pos, fp8_format="", sf=None, out=None):
    """Allocate (unless ``out``) and launch (arguments validated by the public op); returns the output."""
    data, x_sf = x if isinstance(x, (tuple, list)) else (x, None)
    size, hidden = data.shape
    rows, k = token_topk_to_pos.shape
    out_dtype = torch.float8_e4m3fn if fp8_format == "e4m3" else data.dtype
    if rows == 0:
        return out if out is not None else torch.empty((0, hidden), dtype=out_dtype, device=data.device)
    if k == 0 or size == 0 or hidden == 0 or k > MAX_TOPK or hidden > 128 * _MAX_GRID_Y:
        # no slots, no rows (the rule leaves only negative entries) or H = 0 (an empty grid): the reference's
        # zeros times sf; or more slots than the kernel unrolls, or a grid beyond CUDA's limits
        _assert_positions(token_topk_to_pos, size, "reduce_fused", f"x rows ({size})")
        return ref.reduce_fused(x, topk_weights, token_topk_to_pos, fp8_format, sf, out=out)
    direct = out is not None and out.is_contiguous() and out.data_ptr() % 16 == 0
    y = out if direct else torch.empty((rows, hidden), dtype=out_dtype, device=data.device)
    spare = token_topk_to_pos.view(torch.float32)  # binds the parameters of absent optional inputs (unread)
    flat = spare.view(-1)
    data = aligned(data)
    cfg = (_TL_DTYPE[data.dtype], _TL_DTYPE[out_dtype], hidden, k, topk_weights is not None, x_sf is not None,
           sf is not None)
    _jit.get("reduce_fused", cfg)(data, flat if x_sf is None else x_sf,
                                  spare if topk_weights is None else topk_weights, token_topk_to_pos,
                                  flat if sf is None else sf.reshape(1), y)
    if out is None:
        return y
    if not direct:
        out.copy_(y)
    return out


# ----------------------------------------------------------------------------------------------------
# Static configs: the bench's (the tests' own are listed in tests/moe/configs.py)
# ----------------------------------------------------------------------------------------------------

def _expand_cfg(dtype: torch.dtype, hidden: int, k: int, sf=None) -> tuple:
    """The config key of an expand launch: ``sf`` None or ``(sf dtype, num_per_channels, col)``."""
    row_bytes = hidden * dtype.itemsize
    wb = next(b for b in (4, 2, 1) if row_bytes % b == 0)
    cfg = (wb, row_bytes // wb, k)
    if sf is None:
        return cfg
    sf_dtype, npc, col = sf
    blocks = formats.cdiv(hidden, npc)
    if sf_dtype == torch.int32:
        return cfg + ("col", formats.cdiv(blocks, 4), blocks % 4)
    return cfg + ("col" if col else "row", blocks, 0)


def _reduce_cfg(in_dtype: torch.dtype, e4m3: bool, hidden: int, k: int, w: bool, x_sf: bool, sf: bool) -> tuple:
    out = "float8_e4m3fn" if e4m3 else _TL_DTYPE[in_dtype]
    return (_TL_DTYPE[in_dtype], out, hidden, k, w, x_sf, sf)


BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def _bench_configs() -> list[tuple[str, tuple]]:
    """The launches of the MoE bench (tilefuse.bench.moe: T x 7168, top-8): bf16 expand; e4m3 expand with npc-128
    sf, row-major fp32 and column-major packed UE8M0; bf16 reduce with weights to bf16, and with x_sf and sf to
    e4m3. Other shapes compile on first use."""
    return [("expand_to_fused", _expand_cfg(BF16, 7168, 8)),
            ("expand_to_fused", _expand_cfg(FP8, 7168, 8, (torch.float32, 128, False))),
            ("expand_to_fused", _expand_cfg(FP8, 7168, 8, (torch.int32, 128, True))),
            ("reduce_fused", _reduce_cfg(BF16, False, 7168, 8, True, False, False)),
            ("reduce_fused", _reduce_cfg(BF16, True, 7168, 8, True, True, True))]


def _configs(name: str) -> list[tuple]:
    return list(dict.fromkeys(c for n, c in _bench_configs() if n == name))


_jit.register("expand_to_fused", expand_kernel, lambda: _configs("expand_to_fused"))
_jit.register("reduce_fused", reduce_kernel, lambda: _configs("reduce_fused"))


# ----------------------------------------------------------------------------------------------------
# torch.library ops (torch.compile) and the CUDA entries of the public ops
# ----------------------------------------------------------------------------------------------------

@_ops.kernel_op("tilefuse::expand_to_fused", mutates_args=(), device_types="cuda")
def _expand_op(x: torch.Tensor, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor) -> torch.Tensor:
    return _expand_launch(x, None, 0, token_topk_to_pos, pos_to_expert, False)


@_expand_op.register_fake
def _(x, token_topk_to_pos, pos_to_expert):
    return x.new_empty((pos_to_expert.numel(), x.size(1)))


@_ops.kernel_op("tilefuse::expand_to_fused_with_sf", mutates_args=(), device_types="cuda")
def _expand_sf_op(data: torch.Tensor, sf: torch.Tensor, num_per_channels: int, token_topk_to_pos: torch.Tensor,
                  pos_to_expert: torch.Tensor, use_tma_aligned_col_major_sf: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _expand_launch(data, sf, num_per_channels, token_topk_to_pos, pos_to_expert, use_tma_aligned_col_major_sf)


@_expand_sf_op.register_fake
def _(data, sf, num_per_channels, token_topk_to_pos, pos_to_expert, use_tma_aligned_col_major_sf):
    size = pos_to_expert.numel()
    out = data.new_empty((size, data.size(1)))
    if use_tma_aligned_col_major_sf:
        # N = 0: the strides of an empty (H_sf, 0) storage transposed, as the launcher (the reference) returns
        return out, sf.new_empty_strided((size, sf.size(1)), (1, (size + 3) // 4 * 4 if size else 1))
    return out, sf.new_empty((size, sf.size(1)))


@_ops.kernel_op("tilefuse::reduce_fused", mutates_args=(), device_types="cuda")
def _reduce_op(x: torch.Tensor, x_sf: torch.Tensor | None, topk_weights: torch.Tensor | None,
               token_topk_to_pos: torch.Tensor, fp8_format: str, sf: torch.Tensor | None) -> torch.Tensor:
    return _reduce_launch(x if x_sf is None else (x, x_sf), topk_weights, token_topk_to_pos, fp8_format, sf)


@_reduce_op.register_fake
def _(x, x_sf, topk_weights, token_topk_to_pos, fp8_format, sf):
    dtype = torch.float8_e4m3fn if fp8_format == "e4m3" else x.dtype
    return x.new_empty((token_topk_to_pos.size(0), x.size(1)), dtype=dtype)


@_ops.kernel_op("tilefuse::reduce_fused_out", mutates_args=("out",), device_types="cuda")
def _reduce_out_op(x: torch.Tensor, x_sf: torch.Tensor | None, topk_weights: torch.Tensor | None,
                   token_topk_to_pos: torch.Tensor, fp8_format: str, sf: torch.Tensor | None,
                   out: torch.Tensor) -> None:
    _reduce_launch(x if x_sf is None else (x, x_sf), topk_weights, token_topk_to_pos, fp8_format, sf, out)



def expand_to_fused_cuda(x, token_topk_to_pos, pos_to_expert):
    """CUDA entry for the public ``expand_to_fused``: a direct launch, the custom op under torch.compile."""
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.expand_to_fused(x, token_topk_to_pos, pos_to_expert)
    return _expand_launch(x, None, 0, token_topk_to_pos, pos_to_expert, False)


def expand_to_fused_with_sf_cuda(x, num_per_channels, token_topk_to_pos, pos_to_expert,
                                 use_tma_aligned_col_major_sf=False):
    """CUDA entry for the public ``expand_to_fused_with_sf`` (``x = (data, sf)``)."""
    data, sf = x
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.expand_to_fused_with_sf(data, sf, num_per_channels, token_topk_to_pos,
                                                          pos_to_expert, bool(use_tma_aligned_col_major_sf))
    return _expand_launch(data, sf, num_per_channels, token_topk_to_pos, pos_to_expert,
                          bool(use_tma_aligned_col_major_sf))


def reduce_fused_cuda(x, topk_weights, token_topk_to_pos, fp8_format="", sf=None, out=None):
    """CUDA entry for the public ``reduce_fused`` (``x`` a tensor or ``(x, x_sf)``); returns ``out`` when given."""
    if torch.compiler.is_compiling():
        data, x_sf = x if isinstance(x, (tuple, list)) else (x, None)
        if out is None:
            return torch.ops.tilefuse.reduce_fused(data, x_sf, topk_weights, token_topk_to_pos, fp8_format, sf)
        torch.ops.tilefuse.reduce_fused_out(data, x_sf, topk_weights, token_topk_to_pos, fp8_format, sf, out)
        return out
    return _reduce_launch(x, topk_weights, token_topk_to_pos, fp8_format, sf, out)
