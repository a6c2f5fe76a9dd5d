"""TileLang kernels for the MoE counting utilities: ``aux_fi`` (moe.md §2.9), ``group_count`` (§2.10),
``inplace_unique_group_indices`` (§2.11) and ``mask_indices_by_tp`` (§1.2, §2.12).

Counting (``aux_fi``, ``group_count``) takes two launches and no float atomics:

1. ``moe_count_partial``: the flat ``(T K,)`` entries are cut into ``C`` equal chunks, one CTA each
   (``C`` from the entry count and E only, at most ``MAX_CHUNKS``: every SM busy at the bench shape). A CTA
   counts its chunk into a shared-memory histogram of E int32 bins (shared integer atomics: a count does
   not depend on their order) and stores it as row ``c`` of an int32 ``(C, E)`` partial buffer. The
   histogram's shared allocation is static per build: ``HIST_SMALL`` bins for E up to it, else ``MAX_BINS``
   (a launch-dependent size would make TVM reset the function's dynamic shared-memory limit per call).
2. ``moe_count_finish``: one CTA per 32 experts; warp ``g`` of a CTA adds chunk rows ``g, g + G, ...`` of
   its 32 columns (every load of a round first), then one warp adds the ``G`` warp sums. ``group_count``
   stores the int32 total; ``aux_fi`` stores ``(float(c) * float(E)) / denom``, the reference's fp32 multiply
   and IEEE division, ``denom`` being fp32 ``T * num_aux_topk`` rounded as the reference rounds it (the
   Python int to a double, the double to binary32 by a C cast); a denominator beyond the fp32 range takes
   the reference, which raises as torch does for an fp32 fill that overflows.

Integer sums are exact, so both results are bitwise deterministic and independent of the chunking. Entries
outside ``[0, E)`` are skipped (as the reference does); values outside ``[-1, E)`` also fail a device assertion
(the op's data rule; the reference fallbacks check it with ``torch._assert_async``). The second launch overlaps
the first one's tail (programmatic dependent launch: every kernel's ``griddepcontrol.wait`` precedes its first
global access, so its launch and CTA setup overlap the previous grid's tail; the partial pass lets the finish pass
launch at its start).

``inplace_unique_group_indices``: one thread per row, ``UNIQUE_ROWS`` rows per CTA. The CTA's rows are staged
through shared memory with coalesced loads, then each thread scans its row left to right with a 128-bit set
of the non-negative values seen (two 64-bit registers) and writes -1 over each repeat, in place; nothing
else is stored. Negative values are never changed. K is static (one build per K). The kernel's buffer is
``(T, K)`` with strides ``(K, 1)``: a torch-contiguous tensor whose size-1 dimension has another stride is
passed as a view with those strides (same storage, same elements).

``mask_indices_by_tp``: elementwise, int32 or int64 in and out. For ``v = r P + q`` (``0 <= q < P``) it keeps
``v`` when ``v >= 0`` and ``r mod num_tp_ranks == tp_rank``, as ``(r div num_tp_ranks) P + q`` (§1.2's second
formulation, equal to the reference's for every ``v >= 0``); every other value becomes -1. Values below 2^31
take the 32-bit divisions.
"""
import torch

from tilefuse import _jit, _ops

# Knobs (read when a factory runs; TILEFUSE_KNOBS overrides them for sweeps; results never change):
COUNT_THREADS = 256   # partial pass: threads per CTA
COUNT_UNROLL = 2      # partial pass: entries per thread per round (all loads of a round first)
MAX_CHUNKS = 128      # partial pass: most CTAs (rows of the partial buffer)
PARTIAL_BUDGET = 1 << 16  # most int32 partial counts (C * E): fewer chunks for large E
FINISH_THREADS = 512  # finish pass: (threads / 32) warps per 32 experts
FINISH_UNROLL = 8     # finish pass: loads in flight per thread per round
UNIQUE_ROWS = 64      # unique: rows (= threads) per CTA
MASK_THREADS = 256    # mask_indices_by_tp: threads per CTA
MASK_UNROLL = 2       # mask_indices_by_tp: entries per thread

MAX_BINS = 8192       # largest E / num_groups with a kernel (the shared histogram); larger take the reference
HIST_SMALL = 1024     # bins of the small shared-histogram build (E <= HIST_SMALL); larger E use MAX_BINS bins
MAX_ENTRIES = 1 << 30  # most T * K entries with a kernel (int32 offsets); more take the reference
MAX_UNIQUE_K = 32     # widest rows of the unique kernel (K is unrolled); wider take the reference
_INT32_MAX = 2 ** 31 - 1
_FLT_MAX = 3.4028234663852886e38  # largest finite binary32 (exact as a double)


# ------------------------------------------------------------------------------------------------ counting

def count_partial_kernel(hist_bins: int):
    """Factory: ``X`` int64 ``(N,)`` -> ``Part`` int32 ``(C, E)``, ``Part[c, e]`` = entries equal to ``e`` in
    chunk ``c`` = ``[c S, min((c + 1) S, N))``, ``S = ceil(N / C)``. N, C and E are symbolic; the launcher
    guarantees ``E <= hist_bins`` (the shared histogram's size). Entries outside ``[-1, E)`` fail a device
    assertion."""
    import tilelang.language as T

    N, C, E = T.dynamic("num_entries num_chunks num_bins")
    TH, U = COUNT_THREADS, COUNT_UNROLL
    tile = TH * U

    @T.prim_func
    def count_partial(X: T.Tensor((N,), "int64"), Part: T.Tensor((C, E), "int32")):
        with T.Kernel(C, threads=TH) as c:
            T.pdl_trigger()  # the finish pass may launch now (its CTAs wait resident for this whole grid)
            tx = T.get_thread_binding()
            hist = T.alloc_shared((hist_bins,), "int32")
            vals = T.alloc_local((U,), "int64")
            for j in T.serial(T.ceildiv(E, TH)):
                if j * TH + tx < E:
                    hist[j * TH + tx] = 0
            T.pdl_sync()  # the previous grid's writes are visible from here
            T.sync_threads()
            span = T.alloc_var("int32")  # entries per chunk
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            span = T.truncdiv(N + C - 1, C)
            lo = c * span + tx
            hi = T.min(c * span + span, N)
            for r in T.serial(T.truncdiv(span + tile - 1, tile)):
                for u in T.unroll(U):  # every load of the round first
                    vals[u] = T.int64(-1)
                    if lo + (r * tile + u * TH) < hi:
                        vals[u] = X[lo + (r * tile + u * TH)]
                for u in T.unroll(U):
                    T.call_extern("void", "device_assert", T.And(vals[u] >= -1, vals[u] < T.cast(E, "int64")))
                    if T.And(vals[u] >= 0, vals[u] < T.cast(E, "int64")):
                        T.atomic_add(hist[T.cast(vals[u], "int32")], 1)
            T.sync_threads()
            for j in T.serial(T.ceildiv(E, TH)):
                if j * TH + tx < E:
                    Part[c, j * TH + tx] = hist[j * TH + tx]

    return count_partial


def count_finish_kernel(kind: str):
    """Factory: ``Part`` int32 ``(C, E)`` -> per-expert totals over the C rows: ``kind == "count"``: int32
    ``Out (E,)``; ``kind == "fi"``: fp32 ``Out[e] = (float(total) * float(E)) / denom``."""
    import tilelang.language as T

    assert kind in ("count", "fi")
    C, E = T.dynamic("num_chunks num_bins")
    TH, U = FINISH_THREADS, FINISH_UNROLL
    G = TH // 32      # warps: chunk rows g, g + G, ... go to warp g
    rows = G * U      # chunk rows per round
    out_dtype = "float32" if kind == "fi" else "int32"

    @T.macro
    def body(Part, Out, denom, bx):
        T.pdl_sync()
        tx = T.get_thread_binding()
        g = tx // 32
        lane = tx % 32
        e = bx * 32 + lane
        buf = T.alloc_local((U,), "int32")
        acc = T.alloc_var("int32")
        red = T.alloc_shared((G, 32), "int32")
        acc = 0
        if e < E:
            for r in T.serial(T.ceildiv(C, rows)):
                for u in T.unroll(U):  # every load of the round first
                    buf[u] = 0
                    if r * rows + u * G + g < C:
                        buf[u] = Part[r * rows + u * G + g, e]
                for u in T.unroll(U):
                    acc = acc + buf[u]
        red[g, lane] = acc
        T.sync_threads()
        if T.And(tx < 32, e < E):
            acc = red[0, lane]
            for j in T.unroll(1, G):
                acc = acc + red[j, lane]
            if kind == "fi":
                Out[e] = (T.cast(acc, "float32") * T.cast(E, "float32")) / denom
            else:
                Out[e] = acc

    if kind == "fi":
        @T.prim_func
        def count_finish(Part: T.Tensor((C, E), "int32"), Out: T.Tensor((E,), out_dtype), denom: T.float32):
            with T.Kernel(T.ceildiv(E, 32), threads=TH) as bx:
                body(Part, Out, denom, bx)
    else:
        @T.prim_func
        def count_finish(Part: T.Tensor((C, E), "int32"), Out: T.Tensor((E,), out_dtype)):
            with T.Kernel(T.ceildiv(E, 32), threads=TH) as bx:
                body(Part, Out, None, bx)

    return count_finish


# Static configs: those the bench launches (``precompile``); any other (the tests' own, tests/moe/configs.py)
# compiles on first use. The bench (tilefuse.bench.moe) counts T x 8 slots over 256 experts and over EP rank 0's
# 32 local ones (aux_fi, group_count), makes K = 8 rows unique and masks int64 indices.
BENCH_BINS = (256, 32)
BENCH_TOPK = 8
_jit.register("moe_count_partial", count_partial_kernel, lambda: sorted({(_hist_bins(e),) for e in BENCH_BINS}))
_jit.register("moe_count_finish", count_finish_kernel, lambda: [("fi",), ("count",)])


def _num_chunks(entries: int, bins: int) -> int:
    """Rows of the partial buffer: one per ``COUNT_THREADS * COUNT_UNROLL`` entries, at most ``MAX_CHUNKS``
    and ``PARTIAL_BUDGET / E`` (any value gives the same counts)."""
    tile = COUNT_THREADS * COUNT_UNROLL
    return max(1, min(-(-entries // tile), MAX_CHUNKS, PARTIAL_BUDGET // bins))


def _hist_bins(bins: int) -> int:
    """The shared histogram build (its bins) for ``bins <= MAX_BINS`` bins."""
    return HIST_SMALL if bins <= HIST_SMALL < MAX_BINS else MAX_BINS


def _count_into(x: torch.Tensor, bins: int, out: torch.Tensor, *denom) -> torch.Tensor:
    """Both passes of a count of ``x``'s entries into ``out`` (finish kind from ``out``'s dtype)."""
    entries = x.numel()
    part = torch.empty((_num_chunks(entries, bins), bins), dtype=torch.int32, device=x.device)
    _jit.get("moe_count_partial", (_hist_bins(bins),))(x.view(entries), part)
    _jit.get("moe_count_finish", ("fi" if denom else "count",))(part, out, *denom)
    return out


def _assert_range(x: torch.Tensor, lo, hi: int, message: str) -> None:
    """The op's data rule ``lo <= x < hi`` on the reference fallbacks (the kernels assert it on the device)."""
    ok = x < hi if lo is None else (x >= lo) & (x < hi)
    torch._assert_async(ok.all(), message)


def _count_supported(x: torch.Tensor, bins: int) -> bool:
    return bins <= MAX_BINS and x.numel() <= MAX_ENTRIES


def aux_fi_launch(topk_idx: torch.Tensor, num_experts: int, num_aux_topk: int) -> torch.Tensor:
    """fp32 ``(E,)`` load fractions; arguments validated by the public op (moe.md §2.9)."""
    rows = topk_idx.size(0)
    if rows == 0:  # zeros, no division (as the reference)
        return torch.zeros(num_experts, dtype=torch.float32, device=topk_idx.device)
    # The fp32 denominator as the reference's torch.full_like(counts, float(v)) makes it: the Python int to a
    # double, then (the kernel's host stub) a C cast to binary32. torch refuses a fill beyond the fp32 range,
    # and so does the reference fallback taken then.
    denom = float(rows * num_aux_topk)
    if denom > _FLT_MAX or not _count_supported(topk_idx, num_experts):
        from tilefuse.reference import moe as ref

        _assert_range(topk_idx, -1, num_experts, f"aux_fi: topk_idx entries must be in [-1, {num_experts})")
        return ref.aux_fi(topk_idx, num_experts, num_aux_topk)
    if topk_idx.numel() == 0:  # K = 0: no entries, every count is 0
        return torch.zeros(num_experts, dtype=torch.float32, device=topk_idx.device)
    out = torch.empty(num_experts, dtype=torch.float32, device=topk_idx.device)
    return _count_into(topk_idx, num_experts, out, denom)


def group_count_launch(group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """int32 ``(num_groups,)`` counts; arguments validated by the public op (moe.md §2.10)."""
    if group_idx.numel() == 0:
        return torch.zeros(num_groups, dtype=torch.int32, device=group_idx.device)
    if not _count_supported(group_idx, num_groups):
        from tilefuse.reference import moe as ref

        _assert_range(group_idx, -1, num_groups, f"group_count: group_idx entries must be in [-1, {num_groups})")
        return ref.group_count(group_idx, num_groups)
    out = torch.empty(num_groups, dtype=torch.int32, device=group_idx.device)
    return _count_into(group_idx, num_groups, out)


# ------------------------------------------------------------------------------------------- unique groups

def unique_group_indices_kernel(num_topk: int):
    """Factory: in place on ``G`` int64 ``(T, K)``: per row, a value ``v`` in ``[0, 128)`` already seen
    earlier in the row becomes -1. ``v >= limit`` (``align(num_groups, 64)``) fails a device assertion; values
    outside ``[0, 128)`` are never changed. T is symbolic."""
    import tilelang.language as T

    K, R = num_topk, UNIQUE_ROWS
    KP = K + 1 if K % 2 == 0 else K  # shared row stride (int64 words): odd, so rows fall on different banks
    Tn = T.dynamic("num_tokens")

    @T.prim_func
    def unique_group_indices(G: T.Tensor((Tn, K), "int64"), limit: T.int32):
        with T.Kernel(T.ceildiv(Tn, R), threads=R) as b:
            T.pdl_sync()
            tx = T.get_thread_binding()
            tile = T.alloc_shared((R * KP,), "int64")
            for j in T.unroll(K):  # coalesced: the CTA's R K entries, K loads per thread in flight
                if b * R + (j * R + tx) // K < Tn:
                    tile[(j * R + tx) // K * KP + (j * R + tx) % K] = G[b * R + (j * R + tx) // K, (j * R + tx) % K]
            T.sync_threads()
            seen_lo = T.alloc_var("uint64")  # values 0..63
            seen_hi = T.alloc_var("uint64")  # values 64..127
            bit = T.alloc_var("uint64")
            seen_lo = T.uint64(0)
            seen_hi = T.uint64(0)
            if b * R + tx < Tn:
                for k in T.unroll(K):
                    v = tile[tx * KP + k]
                    T.call_extern("void", "device_assert", v < T.cast(limit, "int64"))
                    if T.And(v >= 0, v < 128):
                        bit = T.shift_left(T.uint64(1), T.cast(v % 64, "uint64"))
                        if v < 64:
                            if (seen_lo & bit) != T.uint64(0):
                                G[b * R + tx, k] = T.int64(-1)
                            seen_lo = seen_lo | bit
                        else:
                            if (seen_hi & bit) != T.uint64(0):
                                G[b * R + tx, k] = T.int64(-1)
                            seen_hi = seen_hi | bit

    return unique_group_indices


_jit.register("moe_unique_group_indices", unique_group_indices_kernel, lambda: [(BENCH_TOPK,)])


def inplace_unique_group_indices_launch(group_indices: torch.Tensor, num_groups: int) -> None:
    """In place (moe.md §2.11); arguments validated by the public op (num_groups <= 128)."""
    rows, k = group_indices.shape
    if rows == 0 or k == 0:
        return None
    limit = -(-num_groups // 64) * 64
    if k > MAX_UNIQUE_K or rows > MAX_ENTRIES // k:
        from tilefuse.reference import moe as ref

        _assert_range(group_indices, None, limit, "inplace_unique_group_indices: group_indices entries must be < "
                                                  f"align(num_groups, 64) = {limit}")
        return ref.inplace_unique_group_indices(group_indices, num_groups)
    if group_indices.stride(1) != 1:  # K = 1 with another stride (torch ignores a size-1 dimension's stride)
        group_indices = group_indices.as_strided((rows, k), (k, 1))
    _jit.get("moe_unique_group_indices", (k,))(group_indices, limit)
    return None


# ---------------------------------------------------------------------------------------------- TP masking

def _tp_keep32(v, p, num_tp, tp):
    """TIR: int32 ``v >= 0`` renumbered for TP rank ``tp`` (§1.2), or -1 (``p, num_tp, tp`` int32, ``p, num_tp
    >= 1``). ``r = v div p``; ``r p <= v`` and ``(r div num_tp) p <= v``: nothing wraps."""
    import tilelang.language as T

    r = T.truncdiv(v, p)
    return T.if_then_else(T.truncmod(r, num_tp) == tp, T.truncdiv(r, num_tp) * p + (v - r * p), T.int32(-1))


def tp_renumber(dtype: str, v, p, num_tp, tp):
    """TIR: the kernel's value for one entry ``v`` of ``dtype``: -1 for ``v < 0``; values below 2^31 take the
    32-bit divisions, larger int64 ones the 64-bit divisions of the same formula."""
    import tilelang.language as T

    if dtype == "int32":
        return T.if_then_else(v >= 0, _tp_keep32(v, p, num_tp, tp), T.int32(-1))
    p64, n64, t64 = T.cast(p, "int64"), T.cast(num_tp, "int64"), T.cast(tp, "int64")
    r = T.truncdiv(v, p64)
    wide = T.if_then_else(T.truncmod(r, n64) == t64, T.truncdiv(r, n64) * p64 + (v - r * p64), T.int64(-1))
    small = T.cast(_tp_keep32(T.cast(v, "int32"), p, num_tp, tp), "int64")
    return T.if_then_else(v < 0, T.int64(-1), T.if_then_else(v <= _INT32_MAX, small, wide))


def mask_indices_by_tp_kernel(dtype: str):
    """Factory: ``Y = tp_renumber(X)`` elementwise, ``X``, ``Y`` ``(N,)`` of ``dtype`` (int32 or int64), with
    ``P`` = experts per EP rank, ``num_tp`` TP ranks, ``num_tp * P < 2^31``. N is symbolic."""
    import tilelang.language as T

    assert dtype in ("int32", "int64")
    N = T.dynamic("num_entries")
    TH, U = MASK_THREADS, MASK_UNROLL
    tile = TH * U

    @T.prim_func
    def mask_by_tp(X: T.Tensor((N,), dtype), Y: T.Tensor((N,), dtype), p: T.int32, num_tp: T.int32,
                   tp: T.int32):
        with T.Kernel(T.ceildiv(N, tile), threads=TH) as b:
            T.pdl_sync()
            tx = T.get_thread_binding()
            vals = T.alloc_local((U,), dtype)
            for u in T.unroll(U):  # every load first
                if b * tile + u * TH + tx < N:
                    vals[u] = X[b * tile + u * TH + tx]
            for u in T.unroll(U):
                if b * tile + u * TH + tx < N:
                    Y[b * tile + u * TH + tx] = tp_renumber(dtype, vals[u], p, num_tp, tp)

    return mask_by_tp


_DTYPES = {torch.int32: "int32", torch.int64: "int64"}
_jit.register("moe_mask_indices_by_tp", mask_indices_by_tp_kernel, lambda: [("int64",)])


def mask_indices_by_tp_launch(indices: torch.Tensor, n: int, num_ep_ranks: int, tp_rank: int,
                              num_tp_ranks: int) -> torch.Tensor:
    """Same shape and dtype as ``indices`` (moe.md §2.12); arguments validated by the public op."""
    out = torch.empty_like(indices)
    entries = indices.numel()
    if entries == 0:
        return out
    p = n // num_ep_ranks
    if p * num_tp_ranks > _INT32_MAX or entries > MAX_ENTRIES:
        from tilefuse.reference import moe as ref

        return ref.mask_indices_by_tp(indices, n, num_ep_ranks, tp_rank, num_tp_ranks)
    _jit.get("moe_mask_indices_by_tp", (_DTYPES[indices.dtype],))(indices.view(entries), out.view(entries), p,
                                                                  num_tp_ranks, tp_rank)
    return out


# ------------------------------------------------------------------------------------ torch.library ops

@_ops.kernel_op("tilefuse::aux_fi", mutates_args=(), device_types="cuda")
def _aux_fi_op(topk_idx: torch.Tensor, num_experts: int, num_aux_topk: int) -> torch.Tensor:
    return aux_fi_launch(topk_idx, num_experts, num_aux_topk)


@_aux_fi_op.register_fake
def _(topk_idx, num_experts, num_aux_topk):
    return topk_idx.new_empty((num_experts,), dtype=torch.float32)


@_ops.kernel_op("tilefuse::group_count", mutates_args=(), device_types="cuda")
def _group_count_op(group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    return group_count_launch(group_idx, num_groups)


@_group_count_op.register_fake
def _(group_idx, num_groups):
    return group_idx.new_empty((num_groups,), dtype=torch.int32)


@_ops.kernel_op("tilefuse::inplace_unique_group_indices", mutates_args=("group_indices",), device_types="cuda")
def _unique_op(group_indices: torch.Tensor, num_groups: int) -> None:
    inplace_unique_group_indices_launch(group_indices, num_groups)



@_ops.kernel_op("tilefuse::mask_indices_by_tp", mutates_args=(), device_types="cuda")
def _mask_op(indices: torch.Tensor, n: int, num_ep_ranks: int, tp_rank: int, num_tp_ranks: int) -> torch.Tensor:
    return mask_indices_by_tp_launch(indices, n, num_ep_ranks, tp_rank, num_tp_ranks)


@_mask_op.register_fake
def _(indices, n, num_ep_ranks, tp_rank, num_tp_ranks):
    return torch.empty_like(indices)


# ------------------------------------------------------------------------------------------ CUDA entries

def aux_fi_cuda(topk_idx: torch.Tensor, num_experts: int, num_aux_topk: int) -> torch.Tensor:
    """CUDA entry for the public ``aux_fi`` (through the custom op under ``torch.compile``)."""
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.aux_fi(topk_idx, num_experts, num_aux_topk)
    return aux_fi_launch(topk_idx, num_experts, num_aux_topk)


def group_count_cuda(group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """CUDA entry for the public ``group_count``."""
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.group_count(group_idx, num_groups)
    return group_count_launch(group_idx, num_groups)


def inplace_unique_group_indices_cuda(group_indices: torch.Tensor, num_groups: int) -> None:
    """CUDA entry for the public ``inplace_unique_group_indices`` (writes ``group_indices``)."""
    if torch.compiler.is_compiling():
        torch.ops.tilefuse.inplace_unique_group_indices(group_indices, num_groups)
        return None
    return inplace_unique_group_indices_launch(group_indices, num_groups)


def mask_indices_by_tp_cuda(indices: torch.Tensor, n: int, num_ep_ranks: int, tp_rank: int,
                            num_tp_ranks: int) -> torch.Tensor:
    """CUDA entry for the public ``mask_indices_by_tp``."""
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.mask_indices_by_tp(indices, n, num_ep_ranks, tp_rank, num_tp_ranks)
    return mask_indices_by_tp_launch(indices, n, num_ep_ranks, tp_rank, num_tp_ranks)
