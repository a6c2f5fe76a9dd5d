"""TileLang kernels for ``get_fused_mapping`` (moe.md §1.5, §2.5): the fused layout in token order.

The flat slots ``i = t*K + k`` are cut into fixed chunks of ``CHUNK`` slots; chunk ``b`` is CTA ``b`` of the count
and scatter launches, so the layout never depends on the SM count, the batch size or timing. Three launches,
chained by programmatic dependent launch (PDL). Every kernel waits (``griddepcontrol.wait``: its predecessor has
completed and its writes are visible) before it writes global memory or reads anything a kernel of the op wrote,
and triggers its dependent only after that wait, so a dependent that reads the input early reads it complete:

1. ``count``: per chunk and expert the number of slots routed there, into rows ``[0, chunks)`` of a
   ``(chunks + 1, E)`` int32 table (shared-memory integer counting: a count does not depend on the order of its
   increments). It loads every entry of ``topk_idx`` once, so it device-asserts the index rule there.
2. ``scan``: each expert's column of the table becomes its exclusive prefix over the chunks (slots of ``e`` in
   earlier chunks), and row ``chunks`` gets the column total ``c_e``. A CTA owns 32 columns, each of its warps a
   contiguous run of rows (two reads and one write of every count in all: linear in ``chunks x E``).
3. ``scatter``: each chunk ranks its own slots first (a warp owns ``32 R`` consecutive slots; inside it
   ``__match_any_sync`` groups equal experts, lower lanes of a group come first and a per-warp, per-expert shared
   counter carries the rank over the warp's rounds; a prefix over the warps in order turns it into the rank inside
   the chunk). That reads only the input, so it runs while ``scan`` is still running. After the wait a CTA reads
   two rows of the table (its chunk's prefixes and the totals), aligns the totals and scans them over the experts
   (``expert_start``), and writes its slots' positions ``expert_start[e] + earlier chunks + earlier warps + rank in
   the warp``: ascending flat index inside every segment, the reference's order. CTA 0 writes the per-expert
   arrays and device-asserts ``sum a_e <= N``. The padding rows of expert ``e`` (``[start + c_e, end)``) are
   written -1 by a warp of CTA ``e mod grid``; the rows past ``sum a_e`` up to ``N`` by all CTAs, grid-strided.

No atomic's return value is ever used; the results are the integers of the reference, bit for bit. Sizes (T, K,
E, chunks, N), the alignment and N are runtime values; a binary serves every E up to its capacity (256, 512 or
1024: the shared tables' width). Index arithmetic is int32: the launcher takes the reference path (with the data
checks as torch assertions) when ``T*K + (A - 1) E`` or N exceeds ``_MAX_INDEX``.
"""
from __future__ import annotations

import torch

from tilefuse import _jit, _ops
from tilefuse.moe import _checks as checks
from tilefuse.reference import moe as ref

CHUNK = 512             # flat slots per CTA (count and scatter kernels; a power of two >= 32)
COUNT_THREADS = 512     # count kernel: at most this many threads, CHUNK / threads slots each
SCAN_WARPS = 16         # scan kernel: warps per CTA, each a contiguous run of the table's rows (32 columns a CTA)
CAPACITIES = (256, 512, 1024)   # the builds: the largest E each serves (the smallest that holds E runs)
_UNROLL = 4             # scan kernel: table rows a thread loads at once
# int32 index arithmetic: slots, positions and every intermediate (positions past the end by up to one grid
# stride, slot indices of fill CTAs) stay below 2^31 while T*K + (A - 1) E and N are at most 2^30
_MAX_INDEX = 2 ** 30

# Warp-level helpers. ``tf_fm_load``: the int64 entry of flat slot i, or -1 past the end. ``tf_fm_expert``: the
# same as an expert in [0, E], with E for -1, out-of-range values and i >= n. ``tf_fm_rank``: the rank of this
# lane's expert ``e`` among the warp's earlier slots of the same expert (``row[e]``, the warp's running count, then
# the lower lanes of the round that hold ``e``); the round's lowest such lane adds the group's size. All 32 lanes
# call it. ``tf_fm_scan``: in-place exclusive prefix sum of ``a[0, n)`` by the whole CTA (contiguous runs per
# thread, warp shuffles, then the warp totals); returns the total; every thread calls it.
_CUDA_HELPERS = """
template <typename P> __device__ __forceinline__ long long tf_fm_load(P x, int i, int n) {
  return i < n ? __ldg(reinterpret_cast<const long long*>(x) + i) : -1LL;
}
template <typename P> __device__ __forceinline__ int tf_fm_expert(P x, int i, int n, int experts) {
  const long long v = tf_fm_load(x, i, n);
  return (v >= 0 && v < experts) ? static_cast<int>(v) : experts;
}
template <typename P> __device__ __forceinline__ void tf_fm_store(P p, int i, int v) { reinterpret_cast<int*>(p)[i] = v; }
__device__ __forceinline__ int tf_fm_rank(int* row, int e) {
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const int below = __popc(peers & ((1u << (threadIdx.x & 31)) - 1u));
  const int old = row[e];
  __syncwarp();
  if (below == 0) row[e] = old + __popc(peers);
  __syncwarp();
  return old + below;
}
__device__ __forceinline__ int tf_fm_scan(int* a, int n, int* warp_sums) {
  const int nt = blockDim.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = (n + nt - 1) / nt;
  const int lo = min(n, tid * per), hi = min(n, lo + per);
  int s = 0;
  for (int j = lo; j < hi; ++j) s += a[j];
  int x = s;
  #pragma unroll
  for (int o = 1; o < 32; o <<= 1) { const int y = __shfl_up_sync(0xffffffffu, x, o); if (lane >= o) x += y; }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    const int v = lane < (nt >> 5) ? warp_sums[lane] : 0;
    int y = v;
    #pragma unroll
    for (int o = 1; o < 32; o <<= 1) { const int z = __shfl_up_sync(0xffffffffu, y, o); if (lane >= o) y += z; }
    if (lane < (nt >> 5)) warp_sums[lane] = y - v;
    if (lane == 31) warp_sums[32] = y;
  }
  __syncthreads();
  int run = warp_sums[warp] + x - s;
  for (int j = lo; j < hi; ++j) { const int v = a[j]; a[j] = run; run += v; }
  const int total = warp_sums[32];
  __syncthreads();
  return total;
}
"""


def _geometry(capacity: int) -> tuple[int, int]:
    """(warps per scatter CTA, slots per lane): the per-warp table ``warps x (capacity + 1)`` stays <= 33 KB, and
    a lane owns at least one slot."""
    warps = min({256: 32, 512: 16, 1024: 8}[capacity], CHUNK // 32)
    return warps, CHUNK // (32 * warps)


def _align(T, n, alignment):
    """``align(n, A)`` of non-negative int32 values (a truncating division)."""
    return T.truncdiv(n + alignment - 1, alignment) * alignment


def count_kernel(capacity: int):
    """Factory: ``topk (T, K) int64 -> table (chunks + 1, E) int32``: rows ``[0, chunks)`` get the counts of
    chunk ``b`` = slots ``[b CHUNK, (b+1) CHUNK)`` (row ``chunks`` is the scan's). Device-asserts every entry is
    -1 or in ``[0, E)``; entries outside (if the assertion is compiled out) are not counted."""
    import tilelang.language as T

    rows, num_topk, table_rows, experts = T.dynamic("num_tokens num_topk num_rows num_experts")
    threads = min(COUNT_THREADS, CHUNK)
    assert CHUNK % threads == 0, (CHUNK, threads)
    per_thread = CHUNK // threads
    zero_steps = -(-capacity // threads)

    @T.prim_func
    def fused_mapping_count(X: T.Tensor((rows, num_topk), "int64"), Counts: T.Tensor((table_rows, experts), "int32")):
        with T.Kernel(table_rows - 1, threads=threads) as b:
            T.import_source(_CUDA_HELPERS)
            tx = T.get_thread_binding()
            cnt = T.alloc_shared((capacity,), "int32")
            ev = T.alloc_local((per_thread,), "int32")
            T.pdl_sync()     # the input is ready (the stream's previous grid has completed)
            T.pdl_trigger()  # the scan grid may start: it waits for this grid before it reads the table
            for j in T.unroll(zero_steps):
                if j * threads + tx < capacity:
                    cnt[j * threads + tx] = 0
            for j in T.unroll(per_thread):
                v = T.call_extern("int64", "tf_fm_load", T.address_of(X[0, 0]), b * CHUNK + j * threads + tx,
                                  rows * num_topk)
                # moe.md 2.5: every entry is -1 or in [0, E) (slots past the end load as -1)
                T.call_extern("void", "device_assert", T.And(v >= -1, v < T.cast(experts, "int64")))
                ev[j] = T.if_then_else(T.And(v >= 0, v < T.cast(experts, "int64")), T.cast(v, "int32"), experts)
            T.sync_threads()
            for j in T.unroll(per_thread):
                if ev[j] < experts:
                    T.call_extern("int32", "atomicAdd", T.address_of(cnt[ev[j]]), 1)
            T.sync_threads()
            for j in T.unroll(zero_steps):
                e = j * threads + tx
                if e < experts:
                    Counts[b, e] = cnt[e]

    return fused_mapping_count


def scan_kernel():
    """Factory: the count table ``(chunks + 1, E)`` in place: ``[c, e]`` becomes the slots of ``e`` in chunks
    ``< c`` and row ``chunks`` their total ``c_e``. Grid ``cdiv(E, 32)``; CTA ``g`` owns columns ``[32 g, 32 g +
    32)`` (one per lane), warp ``w`` the rows ``[w P, (w + 1) P)``, ``P = cdiv(chunks, SCAN_WARPS)``."""
    import tilelang.language as T

    table_rows, experts = T.dynamic("num_rows num_experts")
    threads = 32 * SCAN_WARPS

    @T.prim_func
    def fused_mapping_scan(Counts: T.Tensor((table_rows, experts), "int32")):
        with T.Kernel(T.ceildiv(experts, 32), threads=threads) as g:
            tx = T.get_thread_binding()
            w = tx // 32
            lane = tx % 32
            sums = T.alloc_shared((SCAN_WARPS * 32,), "int32")   # per warp and column: its rows' sum
            vals = T.alloc_local((_UNROLL,), "int32")
            own = T.alloc_var("int32")
            run = T.alloc_var("int32")
            chunks = table_rows - 1
            e = g * 32 + lane
            per = T.ceildiv(chunks, SCAN_WARPS)
            lo = T.min(w * per, chunks)
            hi = T.min(lo + per, chunks)
            steps = T.ceildiv(hi - lo, _UNROLL)
            T.pdl_sync()     # the count grid has completed: its rows are visible
            T.pdl_trigger()  # the scatter grid may start its input-only phase
            own = 0
            if e < experts:
                for q in T.serial(steps):
                    for u in T.unroll(_UNROLL):   # independent loads in flight
                        c = lo + q * _UNROLL + u
                        own = own + T.if_then_else(c < hi, Counts[c, e], 0)
            sums[tx] = own
            T.sync_threads()
            run = 0
            for v in T.unroll(SCAN_WARPS):
                run = run + T.if_then_else(v < w, sums[v * 32 + lane], 0)
            if e < experts:
                if w == SCAN_WARPS - 1:
                    Counts[chunks, e] = run + own
                for q in T.serial(steps):
                    for u in T.unroll(_UNROLL):
                        c = lo + q * _UNROLL + u
                        vals[u] = T.if_then_else(c < hi, Counts[c, e], 0)
                    for u in T.unroll(_UNROLL):
                        c = lo + q * _UNROLL + u
                        if c < hi:
                            Counts[c, e] = run
                        run = run + vals[u]

    return fused_mapping_scan


def scatter_kernel(capacity: int):
    """Factory: ``(topk (T, K) int64, table (chunks + 1, E) after the scan) -> pos (3, NB)`` (rows: expert, token,
    flat slot), ``token_topk_to_pos (T, K)``, ``experts (3, E)`` (rows: start, end, aligned count); scalars
    ``alignment`` and ``fill_end`` (the caller's N: rows ``[sum a_e, N)`` are set to -1 and ``sum a_e <= N`` is
    device-asserted; -1 in the trimmed mode: neither). Writes to ``pos`` are kept inside ``[0, NB)`` whatever the
    data. Grid: ``max(chunks, cdiv(NB, 8 * threads))`` CTAs (CTAs past the last chunk only fill)."""
    import tilelang.language as T

    rows, num_topk, table_rows, experts, size = T.dynamic("num_tokens num_topk num_rows num_experts num_pos")
    warps, per_lane = _geometry(capacity)
    threads = 32 * warps
    span = 32 * per_lane                      # slots per warp
    width = capacity + 1                      # table columns: the experts and one for unrouted slots
    expert_steps = -(-capacity // threads)

    @T.prim_func
    def fused_mapping_scatter(X: T.Tensor((rows, num_topk), "int64"), Counts: T.Tensor((table_rows, experts), "int32"),
                              Pos: T.Tensor((3, size), "int32"), TTP: T.Tensor((rows, num_topk), "int32"),
                              Ex: T.Tensor((3, experts), "int32"), alignment: T.int32, fill_end: T.int32):
        T.assume(experts <= capacity)   # the launcher picks the capacity (table columns never alias)
        chunks = table_rows - 1
        grid = T.max(chunks, T.ceildiv(size, 8 * threads))
        with T.Kernel(grid, threads=threads) as b:
            T.import_source(_CUDA_HELPERS)
            tx = T.get_thread_binding()
            w = tx // 32
            lane = tx % 32
            table = T.alloc_shared((warps * width,), "int32")     # per warp and expert: count, then its base
            before = T.alloc_shared((capacity,), "int32")         # slots of e in earlier chunks
            total = T.alloc_shared((capacity,), "int32")          # slots of e in all chunks
            start = T.alloc_shared((capacity,), "int32")          # aligned counts, then expert_start
            scratch = T.alloc_shared((33,), "int32")
            ev = T.alloc_local((per_lane,), "int32")
            rank = T.alloc_local((per_lane,), "int32")
            run = T.alloc_var("int32")
            n = T.alloc_var("int32")
            aligned_total = T.alloc_var("int32")
            pad_lo = T.alloc_var("int32")
            pad_hi = T.alloc_var("int32")
            num_slots = rows * num_topk

            # 1. rank the chunk's slots (the input only: overlaps the scan grid; no global write before the wait)
            for j in T.unroll(-(-(warps * width) // threads)):
                if j * threads + tx < warps * width:
                    table[j * threads + tx] = 0
            for r in T.unroll(per_lane):
                ev[r] = T.call_extern("int32", "tf_fm_expert", T.address_of(X[0, 0]),
                                      b * CHUNK + w * span + r * 32 + lane, num_slots, experts)
            T.sync_threads()
            for r in T.unroll(per_lane):
                rank[r] = T.call_extern("int32", "tf_fm_rank", T.address_of(table[w * width]), ev[r])
            T.sync_threads()
            for j in T.unroll(expert_steps):
                e = j * threads + tx
                if e < experts:
                    run = 0
                    for ww in T.unroll(warps):
                        c = table[ww * width + e]
                        table[ww * width + e] = run
                        run = run + c

            # 2. the chunk's prefixes and the totals (the scan grid has completed and its writes are visible)
            T.pdl_sync()
            for j in T.unroll(expert_steps):
                e = j * threads + tx
                if e < experts:
                    n = Counts[chunks, e]
                    before[e] = Counts[T.min(b, chunks), e]   # fill CTAs (no slots) read the totals row
                    total[e] = n
                    start[e] = _align(T, n, alignment)
            T.sync_threads()
            aligned_total = T.call_extern("int32", "tf_fm_scan", T.address_of(start[0]), experts,
                                          T.address_of(scratch[0]))
            if b == 0:
                for j in T.unroll(expert_steps):
                    e = j * threads + tx
                    if e < experts:
                        a = _align(T, total[e], alignment)
                        Ex[0, e] = start[e]
                        Ex[1, e] = start[e] + a
                        Ex[2, e] = a
                # moe.md 2.5: N must hold every aligned segment (the trimmed mode's N is sum a_e itself)
                if T.And(tx == 0, fill_end >= 0):
                    T.call_extern("void", "device_assert", aligned_total <= fill_end)

            # 3. the chunk's rows and token_topk_to_pos
            for r in T.unroll(per_lane):
                i = b * CHUNK + w * span + r * 32 + lane
                if i < num_slots:
                    e = ev[r]
                    if e < experts:
                        p = start[e] + before[e] + table[w * width + e] + rank[r]
                        T.call_extern("void", "tf_fm_store", T.address_of(TTP[0, 0]), i, p)
                        if T.And(p >= 0, p < size):
                            Pos[0, p] = e
                            Pos[1, p] = T.truncdiv(i, num_topk)
                            Pos[2, p] = i
                    else:
                        T.call_extern("void", "tf_fm_store", T.address_of(TTP[0, 0]), i, -1)

            # 4. padding rows: expert e's tail by warp (e div grid) mod warps of CTA e mod grid; then [sum a_e, N)
            for m in T.serial(T.ceildiv(T.max(experts - b, 0), grid * warps)):
                pe = b + (m * warps + w) * grid
                pad_lo = 0
                pad_hi = 0
                if pe < experts:
                    pad_lo = start[pe] + total[pe]
                    pad_hi = T.min(start[pe] + _align(T, total[pe], alignment), size)
                for q in T.serial(T.ceildiv(T.max(pad_hi - pad_lo, 0), 32)):
                    p = pad_lo + q * 32 + lane
                    if T.And(p >= 0, p < pad_hi):
                        Pos[0, p] = -1
                        Pos[1, p] = -1
                        Pos[2, p] = -1
            tail_hi = T.min(fill_end, size)
            for q in T.serial(T.ceildiv(T.max(tail_hi - aligned_total, 0), grid * threads)):
                p = aligned_total + (q * grid + b) * threads + tx
                if T.And(p >= 0, p < tail_hi):
                    Pos[0, p] = -1
                    Pos[1, p] = -1
                    Pos[2, p] = -1

    return fused_mapping_scatter


# Static configs: those the bench launches (``precompile``); any other (the tests' own, tests/moe/configs.py)
# compiles on first use. The bench's (local) expert counts (tilefuse.bench.moe): 256 on one rank, EP rank 0's 32
# of 256, and OFF_GATES' 64, 128 and 160.
BENCH_EXPERTS = (256, 32, 64, 128, 160)


def _configs() -> list[tuple]:
    return sorted({(_capacity(e),) for e in BENCH_EXPERTS})


_jit.register("moe_fused_mapping_count", count_kernel, _configs)
_jit.register("moe_fused_mapping_scan", scan_kernel, lambda: [()])
_jit.register("moe_fused_mapping_scatter", scatter_kernel, _configs)


def _capacity(num_experts: int) -> int:
    return next(c for c in CAPACITIES if num_experts <= c)


def _layout(topk_idx: torch.Tensor, num_experts: int, size: int, alignment: int, fill_end: int):
    """``(pos (3, max(size, 1)), token_topk_to_pos, experts (3, E))`` from the three launches (T*K > 0)."""
    rows, k = topk_idx.shape
    device = topk_idx.device
    cfg = (_capacity(num_experts),)
    table = torch.empty((-(-(rows * k) // CHUNK) + 1, num_experts), dtype=torch.int32, device=device)
    pos = torch.empty((3, max(size, 1)), dtype=torch.int32, device=device)   # a zero-size buffer is never passed
    ttp = torch.empty((rows, k), dtype=torch.int32, device=device)
    ex = torch.empty((3, num_experts), dtype=torch.int32, device=device)
    _jit.get("moe_fused_mapping_count", cfg)(topk_idx, table)
    _jit.get("moe_fused_mapping_scan", ())(table)
    _jit.get("moe_fused_mapping_scatter", cfg)(topk_idx, table, pos, ttp, ex, alignment, fill_end)
    return pos, ttp, ex


@_ops.kernel_op("tilefuse::get_fused_mapping", mutates_args=())
def _mapping_op(topk_idx: torch.Tensor, num_experts: int, size: int, alignment: int,
                fill_end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _layout(topk_idx, num_experts, size, alignment, fill_end)


@_mapping_op.register_fake
def _(topk_idx, num_experts, size, alignment, fill_end):
    return (topk_idx.new_empty((3, max(size, 1)), dtype=torch.int32),
            topk_idx.new_empty(topk_idx.shape, dtype=torch.int32),
            topk_idx.new_empty((3, num_experts), dtype=torch.int32))


def get_fused_mapping_cuda(topk_idx: torch.Tensor, num_experts: int, num_expanded_tokens: int, alignment: int,
                           force_no_sync: bool = False):
    """CUDA entry for the public ``get_fused_mapping`` in token order (arguments validated by the op). The
    kernels device-assert the data rules (entries -1 or in ``[0, E)``; with a given N, ``sum a_e <= N``): the op
    needs no torch-side check. With ``num_expanded_tokens == 0`` and not ``force_no_sync`` the arrays are sized by
    the upper bound ``((T K + (A - 1) E) div A) A``, and one copy of the aligned counts to the host (the only
    sync) trims them."""
    rows, k = topk_idx.shape
    slots = rows * k
    trim = num_expanded_tokens == 0 and not force_no_sync
    bound = slots + (alignment - 1) * num_experts
    size = bound // alignment * alignment if trim else num_expanded_tokens
    device = topk_idx.device
    if slots == 0:   # no routed slot: all counts 0, every row padding (no launch; the data rules hold)
        zeros = torch.zeros(num_experts, dtype=torch.int32, device=device)
        rows_out = 0 if trim else num_expanded_tokens
        pos = [torch.full((rows_out,), -1, dtype=torch.int32, device=device) for _ in range(3)]
        ttp = torch.empty((rows, k), dtype=torch.int32, device=device)
        return (*pos, ttp, zeros, zeros.clone(), zeros.clone(), [0] * num_experts if trim else [])
    if max(bound, size) > _MAX_INDEX:   # int32 index arithmetic would not hold
        checks.check_fused_mapping_data(topk_idx, num_experts, num_expanded_tokens, alignment, force_no_sync)
        return ref.get_fused_mapping(topk_idx, num_experts, num_expanded_tokens, alignment, force_no_sync)
    fill_end = -1 if trim else size   # trimmed arrays end at sum(a_e): nothing past it is returned or checked
    if torch.compiler.is_compiling():
        pos, ttp, ex = _mapping_op(topk_idx, num_experts, size, alignment, fill_end)
    else:
        pos, ttp, ex = _layout(topk_idx, num_experts, size, alignment, fill_end)
    start, end, aligned = ex.unbind(0)
    if trim:
        sizes = aligned.tolist()      # the one host sync: E int32 values, after the launches are enqueued
        pos = pos[:, :sum(sizes)]
        return (*pos.unbind(0), ttp, start, end, aligned, sizes)
    if size == 0:
        pos = pos[:, :0]
    return (*pos.unbind(0), ttp, start, end, aligned, [])
