"""TileLang kernels for the RMSNorm ops (quant.md 5.11): norm_forward, norm_forward_and_per_token_cast,
norm_backward.

Forward: one CTA per row ``(b, t)`` of a ``(B, T, H)`` view (2-D inputs are ``B = 1``). Thread ``tx`` owns
the 16-byte vectors ``c * threads + tx`` of the row and keeps them in registers: ``h`` (``round(x + res)``
with a residual), the sum of squares (thread sum, warp butterfly, one shared slot per warp, every thread
adds the warp sums in warp order: a fixed order), ``rstd = rsqrtf(S / H + eps)``,
``o = round((h * rstd) * (w * out_scale))``. The quantizing variant then casts ``o`` exactly as
``per_token_cast(o, 'e4m3', 32)`` (1.4, 1.6): a 32-channel group is ``L`` consecutive lanes, its maximum a
shuffle butterfly; packed UE8M0 words (and mega-MoE words) collect the four group bytes by shuffles. With
FWD_HALF_ROWS, rows whose last vector slot would leave threads 64-127 idle take 64 threads each, two rows per CTA,
and add their squares in the same order (``_pair_total``).

Backward: a fixed grid of ``NP`` CTAs (``_bwd_ctas``: a constant of the dtype, H and whether there is a
weight); CTA ``p`` walks rows
``p, p + NP, ...`` in order, writes ``dx`` per row and accumulates ``xh * g`` per column in registers, then
stores partial row ``p`` of an fp32 ``(NP, H)`` workspace; in bf16 with a weight, clusters of two CTAs
first add their sums (rank 0's plus rank 1's, through distributed shared memory) into row ``p // 2`` of an
``(NP / 2, H)`` one. A second kernel sums the partials in a fixed two-level order (``_RED_GROUPS`` group
sums of consecutive partials, each in order p, then the group sums in order) onto the existing
``weight_grad`` (quant.md 5.11). No atomics: deterministic, and a row's ``dx`` never depends on other rows.

Optional tensors absent from a static config are passed as a 1-element dummy, so every config has one
signature. ``eps`` and ``out_scale`` are binary32 scalar arguments.
"""

import functools

import torch

from tilefuse import _jit, _native, _ops
from tilefuse._launch import aligned
from tilefuse import formats as F
from tilefuse.quant import _tl

_TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_THREADS = 128     # forward threads per CTA: fixes the order of the row sum of squares (not a knob)
_CL_BF16 = 2       # bf16 norm_backward with a weight: CTAs per thread-block cluster. The pair adds its weight-gradient
                   # sums (rank 0's + rank 1's) through distributed shared memory, each CTA half of the columns, into
                   # NP / 2 partial rows: half the partial stores and reduce reads. H200, bf16 8192 x 7168: 94.4-95.5
                   # us unpaired, 92.2-92.7 paired (register path); 4 CTAs per cluster 130 us (not all resident). It
                   # fixes the weight_grad bits: not a knob
_RED_GROUPS = 8    # the weight-gradient reduce adds the P partials of a column in _RED_GROUPS groups of ceil(P / 8)
                   # consecutive ones, the last group the rest (each in order p, one thread per group and column, all
                   # its loads in flight at once), then the 8 group sums in order: with P = 256 a dependent chain of
                   # 32 + 8 additions instead of 256
                   # (the bench row 97.5 us with one chain of 256, 96.4 grouped, H200; the dx kernel alone 92.8). It
                   # fixes the weight_grad bits: not a knob
_M = F.FMT_MAX["e4m3"]
_CLAMP = F.CLAMP_MIN["e4m3"]
_BT = 448          # bf16 norm_backward threads per CTA, at most (2 CTAs per SM at <= 72 registers); it fixes the
                   # order of the row reduction A, so dx's bits: not a knob. 14 warps: two 16-byte vectors per thread
                   # at H = 7168, every warp the same work (256 threads gave warps 0-3 four vectors and 4-7 three, the
                   # per-row barrier waiting on the slow half: 99.6 -> 97.5 us at the bench shape, H200). Smaller
                   # rows: _bwd_threads
_BT_F32 = 512      # fp32 norm_backward threads per CTA (the same rule); two CTAs per SM
_SMS = 132         # an H200's SMs: the bf16 backward's CTA count is sized for all of them at once (a constant, so
                   # results never depend on the GPU that runs them)


def _fwd_blocks(quant: bool, vectors: int) -> int:
    """Rows (CTAs) per SM the bf16 forward's register cap provides for, by its 16-byte vectors per thread: the
    quantizing op FWD_BLOCKS_QUANT_NARROW at <= 2, FWD_BLOCKS_QUANT_WIDE at >= 8, else FWD_BLOCKS_QUANT;
    norm_forward FWD_BLOCKS. Scheduling only: the same arithmetic."""
    if not quant:
        return FWD_BLOCKS
    if vectors <= 2:
        return FWD_BLOCKS_QUANT_NARROW
    return FWD_BLOCKS_QUANT_WIDE if vectors >= 8 else FWD_BLOCKS_QUANT


def _half_rows(vectors: int) -> bool:
    """FWD_HALF_ROWS applies to a forward row of ``vectors`` 16-byte vectors: ``_THREADS`` threads would leave
    threads 64-127 idle in its last vector slot (``ceil(vectors / 64)`` odd)."""
    return FWD_HALF_ROWS and -(-vectors // (_THREADS // 2)) % 2 == 1


def _clusters(x_dtype: str, has_weight: bool) -> int:
    """CTAs per cluster of the backward (``_CL_BF16`` in bf16 with a weight, else 1)."""
    return _CL_BF16 if (x_dtype == "bfloat16" and has_weight) else 1


def _bwd_threads(x_dtype: str, hidden: int) -> int:
    """Threads per CTA of the backward: fp32 _BT_F32; bf16 two 16-byte vectors per thread (``H / 16`` rounded up to
    whole warps), at most _BT. Fixes dx's bits (the order of A)."""
    if x_dtype == "bfloat16":
        return min(_BT, max(32, -(-hidden // 16 // 32) * 32))
    return _BT_F32


def _bwd_ctas(x_dtype: str, hidden: int, has_weight: bool) -> int:
    """CTAs of the backward (rows walked in parallel, one partial weight gradient each: it fixes which rows each
    partial sums, so it is a constant of the dtype, H and the weight, never of the GPU that runs it). fp32: two
    CTAs of _BT_F32 threads per SM, 264 (H200, fp32 T = 8192, H = 2048 without a weight: 51.3-51.5 us with 256
    CTAs, 49.4-49.5 with 264; the other H within 1 us, none slower). bf16: one CTA of
    ``_bwd_threads`` per slot of the 132 SMs of an H200 at 72 registers, at most 1024: 264 at H = 7168 (2 per SM),
    396 at H = 4096 (3), 924 at H = 2048 (7). Each CTA has one row in flight (it is latency-bound), so every slot
    counts: H200, bf16 8192 x 7168 with a weight, 256 -> 264 CTAs: 91.7-92.3 -> 90.6-90.7 us.
    Smaller bf16 rows take more, smaller CTAs for the same reason (448-thread CTAs -> these, T = 8192 with a
    weight: H = 2048 37.6 -> 30.2 us, H = 4096 65.5 -> 56.2).
    Cluster pairs (bf16 with a weight) with an odd number of CTAs per SM leave 12 slots free (the multiple of 16
    below): a pair needs two free slots in one GPC, and 924 pairs at H = 2048 ran slower than 912 (31.0 against
    30.1 us; 396 against 384 at H = 4096 even), as if some pairs waited for a second wave."""
    if x_dtype != "bfloat16":
        return 2 * _SMS
    per_sm = 65536 // (72 * _bwd_threads(x_dtype, hidden))
    n = per_sm * _SMS
    if _clusters(x_dtype, has_weight) > 1 and per_sm % 2:
        n = n // 16 * 16
    return min(1024, n)


@functools.cache   # (the launcher's per-call path)
def _partials(x_dtype: str, hidden: int) -> int:
    """Partial weight-gradient rows the backward of ``x_dtype`` writes (the reduce's ``partials``)."""
    return _bwd_ctas(x_dtype, hidden, True) // _clusters(x_dtype, True)


# Knobs (TILEFUSE_KNOBS, read when a kernel is built): scheduling only, never the arithmetic order.
FWD_PDL = True  # one-CTA-per-row forward: programmatic dependent launch (see _per_token_cast_kernel.PDL)
FWD_W_AHEAD = True  # forward: the weight vector of column block c + 1 is loaded before block c's math and stores
                     # (block 0's before the row reduction). With FWD_PDL the pointers are not __restrict__, so the
                     # compiler cannot hoist a weight load above the previous block's output stores: each block
                     # otherwise waits a full load latency after the barrier. Same arithmetic.
FWD_W_EARLY = True   # with FWD_W_AHEAD: block 0's weight load first, then a barrier, then the row's loads. Without it
                     # ptxas issues that weight load only once the sum of squares has consumed x (it reuses x's
                     # registers), a full round trip after x arrived; no load moves across a barrier. Scheduling
                     # only: the same values. H200, bench shape: norm_forward_and_per_token_cast 46.7 -> 46.0 us
                     # (89.2-89.4 -> 90.7% of the copy ceiling), norm_forward 94.0 -> 94.5%
FWD_HALF_ROWS = True   # forward rows whose last vector slot leaves threads 64-127 idle (ceil(V / 64) odd for a row of
                       # V 16-byte vectors: bf16 H = 512, 1536, 2560, ..., fp32 H = 768, ...): 64 threads per row, two
                       # rows per 128-thread CTA. Row thread j holds vectors j + 64 s, s = 0, 1, ...: the vectors of the
                       # 128-thread layout's thread j (even s) and thread j + 64 (odd s). It keeps their two sums apart
                       # (each over its slots in order), butterflies each over its warp and adds the four warp sums in
                       # the 128-thread layout's warp order (_pair_total): the same bits. Other widths keep one row per
                       # CTA
FWD_HALF_BLOCKS = 0    # with FWD_HALF_ROWS: CTAs (row pairs) per SM of the launch bounds; 0 = _fwd_blocks by the
                       # vectors per thread (bf16 H = 1536: 3, so 8, <= 64 registers; ptxas takes 40-48, no spills,
                       # so 10 CTAs = 20 rows fit). 12 (<= 40 registers) spills 8-12 bytes with IEEE sf
FWD_BLOCKS = 6    # bf16 norm_forward CTAs (rows) resident per SM: <= 80 registers, no spills
FWD_BLOCKS_QUANT = 8  # the quantizing bf16 forward: <= 64 registers (it needs 72 unconstrained: 7 per SM)
FWD_BLOCKS_QUANT_WIDE = 5  # FWD_BLOCKS_QUANT for rows of more than 7 vectors per thread (bf16 H > 7168): <= 96
                           # registers. ptxas, H = 8192 with round_sf: 64 registers spill 60-76 bytes (Nsight Compute:
                           # 2.4 M local requests, +50 MB DRAM writes at 16384 rows), 80 spill 0-4, 96 none (89 used).
                           # 8 restores the single rule
FWD_BLOCKS_QUANT_NARROW = 12  # FWD_BLOCKS_QUANT for rows of at most 2 vectors per thread (bf16 H <= 2048): <= 40
                              # registers, 12 rows per SM (unconstrained it takes 42, allocated as 48: 10 per SM).
                              # 8 restores the single rule
BWD_STAGES = 0     # norm_backward: 0 = rows loaded into registers one row ahead; S >= 2 = an S-stage
                   # shared-memory ring filled by per-thread cp.async (each thread copies and later reads only its
                   # own 16-byte vectors: no barrier), S - 1 rows of x, dy and rstd in flight per CTA (bf16; fp32:
                   # FP32_STAGES), when an SM's CTAs of S stages (and the cluster's sums) fit in shared memory, else
                   # the register path. Same arithmetic. H200, bf16 T = 8192 x 7168 with a weight: the
                   # register path with the weight in shared memory 94.4-95.5 us against 95.7-96.8 for the 3-stage
                   # ring (which no longer fits beside the cluster's sums at H = 7168); 448-thread CTAs at H = 4096 /
                   # 2048: 66 / 38 us against 73 / 50
BWD_PIPE = False   # norm_backward with BWD_STAGES == 3 only: software-pipelined rows. Iteration k reduces row k (its
                   # warp sums go to one of two red slots, by parity) and writes dx of row k - 1 (its A read from the
                   # other slot), the butterfly of row k interleaved with that dx pass: one barrier per row instead of
                   # two, and row k's reduction latency overlaps row k - 1's dx work. Row k + 1 is in flight (stage
                   # (k + 1) % 3; stage (k - 1) % 3 still holds row k - 1 for its dx pass). Same per-row arithmetic.
                   # Off with the 448-thread CTA: the staged body's two rows in flight won, 97.5 vs
                   # 98.7 us at the bench shape (on with 256 threads: 99.6 vs 103.6 us)
BWD_STAGES_NW = 0  # BWD_STAGES for a backward without a weight (no weight gradient). Same arithmetic. H200,
                   # bf16 T = 8192 x 7168: the register path 86.9 us (95.6% of the copy ceiling) against
                   # 98.2 us for the 3-stage ring (84.6%); 2 stages 96.7, BWD_PIPE 98.5
FP32_STAGES = 3   # norm_backward fp32: the ring's stages (BWD_STAGES's ring; rstd comes through a register loaded one
                  # row ahead, not through the ring, so that 2 CTAs of 2 fp32 stages fit at H = 7168); where 2 CTAs of
                  # that many do not fit, the deepest ring down to 2 stages that does. Same arithmetic. H200,
                  # fp32 T = 8192, register path -> ring: H = 7168 (2 stages) 272 -> 180 us with a weight (61 -> 92%
                  # of the copy ceiling), 251 -> 178 us without (66 -> 93%); H = 2048 56.4 -> 52.1 us (84 -> 91%);
                  # H = 4096 even
BWD_STORE_NA = True  # register path without residual_out_grad: dx stores do not allocate in L1
                     # (st.global.L1::no_allocate), so the x and dy lines of the row's loads stay in L1 for the dx
                     # pass, which reads them again (with allocating stores 3% of those reads hit L1, Nsight Compute).
                     # Same values. H200, bf16 T = 8192 with a weight, allocating -> no-allocate stores: H = 7168
                     # 90.5-90.6 -> 89.5-89.9 us, H = 4096 55.8-55.9 -> 55.4-55.5, H = 2048 30.1 -> 29.9; without a
                     # weight H = 4096 54.7-54.8 -> 50.3, H = 7168 even. With residual_out_grad (its rows read in the
                     # dx pass) 122 -> 129 us at H = 7168: off there
BWD_HOLD = True    # bf16 register path: the reduction pass copies each vector of the row (x, dy) from its registers
                   # into a shared row buffer, each thread its own vectors (read back only by itself: no barrier),
                   # and the dx pass reads it there. False: the dx pass reads the row from global memory again,
                   # hoping for L1 hits (Nsight Compute, bf16 16384 x 8192: 3% hits, the re-reads doubling the L2 read
                   # traffic and adding 9% DRAM reads). Keeping the row in registers instead spills under the
                   # 72-register cap at every H (ptxas, C = 2 and 3). Same arithmetic; 2 H bytes more shared memory
                   # per CTA
BWD_PDL = False    # norm_backward: programmatic dependent launch (griddepcontrol.wait before any global access)
RED_PDL = True     # weight-gradient reduce: programmatic dependent launch (it waits for the dx kernel's partials)
BWD_TRIGGER = False  # norm_backward: launch the dependent grid (the reduce, with RED_PDL) at the start instead of at
                     # exit: its CTAs wait resident for the partials (griddepcontrol.wait waits for the whole grid)
WG_ASSIGN = True   # norm_backward without a given weight_grad: allocate it uninitialized (no zero-fill kernel) and
                   # let the reduce store round(s) instead of round(float(0) + s). Exact: s adds partials that are FADD
                   # chains started at +0.0 (none is -0.0, a NaN among them is the canonical one), by FADDs, so s is
                   # never -0.0 and its NaN is canonical; +0.0 + s == s bitwise.
                   # T = 0 still returns a zeroed buffer.
_NPC = 32          # quant.md 5.11: the quantizing op casts with 32-channel groups

# bf16 -> binary32 from the 32-bit register word holding elements 2k (low half) and 2k + 1 (high half): one
# shift or one AND per element (TileLang's own conversion extracts the high half with PRMT, then shifts: two
# ALU instructions). Exact: a bf16 is the high half of its binary32 value. The two L2-prefetch helpers are no
# longer called (their knobs were removed) but stay: this text is part of the generated source of every kernel
# that imports it.
_CUDA_HELPERS = """
template <typename T> __device__ __forceinline__ float nf_bf16(const T* v, int i) {
  unsigned w;  // memcpy: no type-punned load (aliasing-safe); it becomes a register move once unrolled
  memcpy(&w, reinterpret_cast<const char*>(v) + 4 * (i >> 1), 4);
  return __uint_as_float((i & 1) ? (w & 0xFFFF0000u) : (w << 16)); }
__device__ __forceinline__ void nf_prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" : : "l"(p)); }
__device__ __forceinline__ void nf_bulk_prefetch_l2(const void* p, unsigned bytes) {  // sm_90 TMA: one row
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" : : "l"(p), "r"(bytes)); }
// cp.async to a shared-window address given as base + byte offset (the base taken once: the copies are private to
// the issuing thread, which alone reads them back, so no barrier is needed)
__device__ __forceinline__ unsigned nf_smem_addr(const void* s) { return (unsigned)__cvta_generic_to_shared(s); }
__device__ __forceinline__ void nf_cp16(unsigned base, int off, const void* g) {  // 16 bytes, bypassing L1
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" : : "r"(base + off), "l"(g) : "memory"); }
__device__ __forceinline__ void nf_cp4(unsigned base, int off, const void* g) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" : : "r"(base + off), "l"(g) : "memory"); }
__device__ __forceinline__ void nf_cp_commit() { asm volatile("cp.async.commit_group;" : : : "memory"); }
template <int N> __device__ __forceinline__ void nf_cp_wait() {
  asm volatile("cp.async.wait_group %0;" : : "n"(N) : "memory"); }
// 16 bytes from a thread's registers (s) to global memory, not allocated in L1
__device__ __forceinline__ void nf_st16_na(void* g, const void* s) {
  uint4 v;
  memcpy(&v, s, 16);
  asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1, %2, %3, %4};"
               : : "l"(g), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory"); }
// 16 bytes between a thread's registers and shared memory (BWD_HOLD's staged row: an extern call, so that
// TileLang's barrier planner, which cannot see that each thread reads back only its own vectors, adds none)
__device__ __forceinline__ void nf_copy16(void* d, const void* s) {
  *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(s); }
"""
# thread-block cluster helpers (the bf16 backward with a weight: _CL_BF16)
_CLUSTER_HELPERS = """
__device__ __forceinline__ void nf_cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" : : : "memory"); }
__device__ __forceinline__ void nf_cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" : : : "memory"); }
__device__ __forceinline__ void nf_cluster_sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\\n\\tbarrier.cluster.wait.aligned;" : : : "memory"); }
__device__ __forceinline__ float4 nf_ld_cluster4(unsigned addr, unsigned rank) {
  unsigned a; float4 v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a));
  return v; }
__device__ __forceinline__ float4 nf_add4(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w); }
template <int CL> __device__ __forceinline__ void nf_cluster_sum4(float* dst, unsigned addr) {
  float4 s = nf_ld_cluster4(addr, 0);  // the CTAs' vectors at this shared-window address, added in rank order
  #pragma unroll
  for (int r = 1; r < CL; ++r) s = nf_add4(s, nf_ld_cluster4(addr, r));
  *reinterpret_cast<float4*>(dst) = s; }
"""

def _f32_of(T, x_dtype: str, buf, *idx):
    """binary32 value of element ``buf[idx]`` of a local array of 16-byte vectors (the last index: the
    element within its vector, a constant once unrolled): bf16 through the word helper, fp32 as is."""
    if x_dtype != "bfloat16":
        return T.cast(buf[idx], "float32")
    *lead, e = idx
    return T.call_extern("float32", "nf_bf16", T.address_of(buf[(*lead, 0)]), e)


def _block_total(T, NW: int, wait_readers: bool):
    """A macro ``block_total(acc, red, tx)``: the CTA's total of its threads' ``acc`` (five warp butterfly steps,
    then the NW warp sums from shared ``red`` in order). ``wait_readers``: a barrier first, so that the warp sums
    of the previous row in ``red`` have been read."""
    @T.macro
    def block_total(acc, red, tx):
        tot = T.alloc_var("float32")
        tot = acc
        for st in T.unroll(5):
            tot = tot + T.shfl_xor(tot, T.shift_right(16, st))
        if wait_readers:
            T.sync_threads()
        if tx % 32 == 0:
            red[tx // 32] = tot
        T.sync_threads()
        tot = red[0]
        for i in T.unroll(1, NW):
            tot = tot + red[i]
        return tot

    return block_total


def _pair_total(T, TPR: int):
    """A macro ``pair_total(acc, acc2, red, tx)`` for rows of ``TPR`` (half the CTA's) threads, two per CTA:
    the row's total of its threads' ``acc`` (the sums of the 128-thread layout's threads 0 .. TPR - 1) and
    ``acc2`` (those of its threads TPR .. 127). Each is butterflied over its warp; the row's warp sums go to
    shared ``red[4 r ..]`` (row r of the CTA) in the 128-thread layout's warp order (acc's warps, then acc2's)
    and are added in that order: the bits of ``_block_total`` over the 128-thread layout."""
    RW = TPR // 32   # warps per row

    @T.macro
    def pair_total(acc, acc2, red, tx):
        ta = T.alloc_var("float32")
        tb = T.alloc_var("float32")
        ta = acc
        tb = acc2
        for st in T.unroll(5):
            ta = ta + T.shfl_xor(ta, T.shift_right(16, st))
            tb = tb + T.shfl_xor(tb, T.shift_right(16, st))
        base = (tx // TPR) * (2 * RW)
        if tx % 32 == 0:
            red[base + (tx % TPR) // 32] = ta
            red[base + RW + (tx % TPR) // 32] = tb
        T.sync_threads()
        ta = red[base]
        for i in T.unroll(1, 2 * RW):
            ta = ta + red[base + i]
        return ta

    return pair_total


def norm_forward_kernel(x_dtype: str, hidden: int, has_weight: bool, has_residual: bool, quant: bool,
                        sf_layout: str, round_sf: bool, with_bf16: bool, with_rstd: bool, mega_bm: int = 0):
    """Factory for one static config (see module doc).

    sf_layout: "row" | "row_packed" | "col" | "col_packed" (ignored unless ``quant``). ``mega_bm`` > 0 adds the mega-MoE sf
    output with that block M (quant.md 5.11; needs round_sf and hidden % 128 == 0)."""
    import tilelang.language as T

    E = 16 // (2 if x_dtype == "bfloat16" else 4)   # elements per 16-byte vector
    VPR = hidden // E
    HALF = _half_rows(VPR)                           # two rows per CTA (FWD_HALF_ROWS)
    TPR = _THREADS // 2 if HALF else _THREADS        # threads per row
    RPC = _THREADS // TPR                            # rows per CTA
    C = -(-VPR // TPR)                               # vectors per thread
    NW = _THREADS // 32
    block_total = _block_total(T, NW, wait_readers=False)
    pair_total = _pair_total(T, TPR)
    blocks = (FWD_HALF_BLOCKS if HALF else 0) or _fwd_blocks(quant, C)   # CTAs per SM of the launch bounds
    L = _NPC // E                                    # lanes per 32-channel group
    ng = hidden // _NPC
    nw4 = -(-ng // 4)
    assert hidden % 16 == 0 and (not quant or hidden % _NPC == 0)
    assert not mega_bm or (quant and round_sf and hidden % 128 == 0)
    packed = quant and sf_layout in ("col_packed", "row_packed")
    words = quant and x_dtype == "bfloat16"   # bf16 -> binary32 through the word helpers (the cast variants)
    W_AHEAD = FWD_W_AHEAD and has_weight

    def f32(buf, *idx):
        return _f32_of(T, x_dtype if words else "float32", buf, *idx)

    B, Tn = T.dynamic("batch, num_tokens")
    XB, XS, RB, RS, OB, OS, QB, QS, PB, PS, BB, BS = T.dynamic(
        "x_sb, x_st, res_sb, res_st, rout_sb, rout_st, out_sb, out_st, sf_pad, sf_sb, bf_sb, bf_st")
    MR, ML = T.dynamic("mega_rows, mega_ld")

    def rows3(dtype, sb, st):
        return T.StridedTensor((B, Tn, hidden), (sb, st, 1), dtype)

    def dummy(dtype):
        return T.Tensor((1,), dtype)

    x_p = rows3(x_dtype, XB, XS)
    w_p = T.Tensor((hidden,), x_dtype) if has_weight else dummy(x_dtype)
    r_p = rows3(x_dtype, RB, RS) if has_residual else dummy(x_dtype)
    ro_p = rows3(x_dtype, OB, OS) if has_residual else dummy(x_dtype)
    o_p = rows3("float8_e4m3fn" if quant else x_dtype, QB, QS)
    if not quant:
        sf_p = dummy("float32")
    elif sf_layout in ("row", "row_packed"):  # row-major (B, T, ng) or packed words (B, T, nw4), contiguous
        sf_p = T.Tensor((B, Tn, nw4 if packed else ng), "int32" if packed else "float32")
    else:  # per batch a column-major (T, ng') matrix with leading dimension PB = align(T, 4)
        sf_p = T.StridedTensor((B, Tn, nw4 if packed else ng), (PS, 1, PB), "int32" if packed else "float32")
    bf_p = rows3("bfloat16", BB, BS) if with_bf16 else dummy("bfloat16")
    rstd_p = T.Tensor((B, Tn), "float32") if with_rstd else dummy("float32")
    mega_p = T.StridedTensor((hidden // 128, MR), (ML, 1), "int32") if mega_bm else dummy("int32")

    # FWD_HALF_ROWS: row t of a CTA's two may be past the last row; it loads and stores nothing, but takes part in the
    # CTA's barriers
    def live(t, col):   # row t's column col exists (its loads and stores)
        return T.And(t < Tn, col < hidden) if HALF else col < hidden

    def row_thread(tx):   # the thread's index in its row
        return tx % TPR if HALF else tx

    def row_lead(t, tx):   # the thread that stores the row's rstd
        return T.And(t < Tn, tx % TPR == 0) if HALF else tx == 0

    # the kernel body: row (b, t)
    @T.macro
    def body(X, W, Res, ResOut, Out, SF, Bf, Rstd, Mega, eps, out_scale, t, b):
        tx = T.get_thread_binding()
        j = row_thread(tx)
        io = T.alloc_local((C, E), x_dtype)   # h = round(x + res) in x.dtype: binary32 values are float(io)
        red = T.alloc_shared((NW * RPC,), "float32")
        acc = T.alloc_var("float32")
        wn = T.alloc_local((E,), x_dtype)     # FWD_W_AHEAD: the next block's weight vector
        if W_AHEAD and FWD_W_EARLY:   # block 0's weight first, a barrier keeping it ahead of the row's loads
            if j * E < hidden:
                for e in T.vectorized(E):
                    wn[e] = W[j * E + e]
            T.sync_threads()
        # 1. h = x (+ residual, rounded to x.dtype and written to residual_out); sum of squares
        acc = T.float32(0.0)
        for c in T.unroll(C):
            col = (c * TPR + j) * E
            if live(t, col):
                for e in T.vectorized(E):
                    io[c, e] = X[b, t, col + e]
                if has_residual:
                    rr = T.alloc_local((E,), x_dtype)
                    for e in T.vectorized(E):
                        rr[e] = Res[b, t, col + e]
                    for e in T.vectorized(E):
                        io[c, e] = T.cast(T.cast(io[c, e], "float32") + T.cast(rr[e], "float32"), x_dtype)
                    for e in T.vectorized(E):
                        ResOut[b, t, col + e] = io[c, e]
            else:
                for e in T.vectorized(E):
                    io[c, e] = T.cast(0, x_dtype)
        if W_AHEAD and not FWD_W_EARLY:
            if j * E < hidden:
                for e in T.vectorized(E):
                    wn[e] = W[j * E + e]
        if not HALF:
            for c in T.unroll(C):
                for e in T.unroll(E):
                    hv = f32(io, c, e)
                    acc = acc + hv * hv
            rstd = T.rsqrt(block_total(acc, red, tx) / T.float32(hidden) + eps)
        else:
            # the 128-thread layout's thread j holds the even slots, its thread j + TPR the odd ones: each sum in
            # slot order (its padded slots add 0 * 0, which leaves a sum of squares unchanged)
            acc2 = T.alloc_var("float32")
            acc2 = T.float32(0.0)
            for k in T.unroll((C + 1) // 2):
                for e in T.unroll(E):
                    hv = f32(io, 2 * k, e)
                    acc = acc + hv * hv
            if C > 1:
                for k in T.unroll(C // 2):
                    for e in T.unroll(E):
                        hv = f32(io, 2 * k + 1, e)
                        acc2 = acc2 + hv * hv
            rstd = T.rsqrt(pair_total(acc, acc2, red, tx) / T.float32(hidden) + eps)
        if with_rstd:
            if row_lead(t, tx):
                Rstd[b, t] = rstd
        # 2. per vector: o = round((h * rstd) * (w * out_scale)); the quantizing op then casts o exactly as
        #    per_token_cast(o, 'e4m3', 32) (its 32-channel group: L lanes of this vector index)
        for c in T.unroll(C):
            col = (c * TPR + j) * E
            g = col // _NPC
            of = T.alloc_local((E,), "float32")
            ob = T.alloc_local((E,), x_dtype)
            if col < hidden:
                if has_weight:
                    ww = T.alloc_local((E,), x_dtype)
                    if W_AHEAD:
                        for e in T.vectorized(E):
                            ww[e] = wn[e]
                        if T.And(c + 1 < C, col + TPR * E < hidden):
                            for e in T.vectorized(E):
                                wn[e] = W[col + TPR * E + e]
                    else:
                        for e in T.vectorized(E):
                            ww[e] = W[col + e]
                    for e in T.unroll(E):
                        of[e] = (f32(io, c, e) * rstd) * (f32(ww, e) * out_scale)
                else:
                    for e in T.unroll(E):
                        of[e] = (f32(io, c, e) * rstd) * out_scale
            else:
                for e in T.unroll(E):
                    of[e] = T.float32(0.0)
            for e in T.vectorized(E):
                ob[e] = T.cast(of[e], x_dtype)
            if with_bf16:
                if live(t, col):
                    bb = T.alloc_local((E,), "bfloat16")
                    for e in T.vectorized(E):
                        bb[e] = T.cast(ob[e], "bfloat16")
                    for e in T.vectorized(E):
                        Bf[b, t, col + e] = bb[e]
            if not quant:
                if live(t, col):
                    for e in T.vectorized(E):
                        Out[b, t, col + e] = ob[e]
            else:
                am = T.alloc_var("float32")
                am = T.float32(0.0)
                for e in T.unroll(E):
                    of[e] = f32(ob, e)
                    am = T.max(am, T.abs(of[e]))
                for st in T.unroll(L.bit_length() - 1):
                    am = T.max(am, T.shfl_xor(am, T.shift_right(L // 2, st)))
                a = T.max(am, T.float32(_CLAMP))
                inv = T.alloc_var("float32")
                eb = T.alloc_var("int32")
                if round_sf:
                    # division-free 2^ceil(log2(a / M)); the clamp keeps a >= M 2^-126; an infinite amax
                    # gives eb = 255, sf = inf and sf_inv = 0 (quant.md 1.7)
                    eb = _tl.pow2_sf_exponent(a, _M)
                    inv = _tl.pow2_inverse_from_exponent(eb)
                    sf = _tl.pow2_from_exponent(eb)
                else:
                    eb = 0
                    sf = a / T.float32(_M)
                    inv = T.float32(_M) / a
                if packed or mega_bm:
                    # bytes of groups 4k..4k+3 (lanes L apart); groups past ng give 0 bytes
                    byte = T.if_then_else(col < hidden, eb, 0)
                    word = (byte | T.shift_left(T.shfl_down(byte, L), 8) | T.shift_left(T.shfl_down(byte, 2 * L), 16)
                            | T.shift_left(T.shfl_down(byte, 3 * L), 24))
                    lead = T.And(live(t, col), T.And(j % L == 0, g % 4 == 0))
                    if packed:
                        if lead:
                            SF[b, t, g // 4] = word
                    if mega_bm:
                        if lead:
                            i = t % mega_bm
                            mrow = ((t // mega_bm) * (-(-mega_bm // 128) * 128) + (i // 128) * 128
                                    + (i % 32) * 4 + (i % 128) // 32)
                            Mega[g // 4, mrow] = word
                if not packed:
                    if T.And(live(t, col), j % L == 0):
                        SF[b, t, g] = sf
                if live(t, col):
                    # the E4M3 conversion saturates finite values to +-448 and keeps NaN
                    qb = T.alloc_local((E,), "float8_e4m3fn")
                    for e in T.vectorized(E):
                        qb[e] = T.cast(of[e] * inv, "float8_e4m3fn")
                    for e in T.vectorized(E):
                        Out[b, t, col + e] = qb[e]

    @T.prim_func
    def norm_forward(X: x_p, W: w_p, Res: r_p, ResOut: ro_p, Out: o_p, SF: sf_p, Bf: bf_p, Rstd: rstd_p,
                     Mega: mega_p, eps: T.float32, out_scale: T.float32):
        # quant.md 5.11: non-last strides are multiples of 16 elements (the launcher zeroes those of size-1 dims)
        T.assume(XB % 16 == 0)
        T.assume(XS % 16 == 0)
        if has_residual:
            T.assume(RB % 16 == 0)
            T.assume(RS % 16 == 0)
            T.assume(OB % 16 == 0)
            T.assume(OS % 16 == 0)
        T.assume(QB % 16 == 0)
        T.assume(QS % 16 == 0)
        if with_bf16:
            T.assume(BB % 16 == 0)
            T.assume(BS % 16 == 0)
        with T.Kernel(T.ceildiv(Tn, RPC) if HALF else Tn, B, threads=_THREADS) as (t, b):
            if x_dtype == "bfloat16":
                T.annotate_min_blocks_per_sm(blocks)  # rows (row pairs) per SM: loads in flight
            if words:
                T.import_source(_CUDA_HELPERS)
            if FWD_PDL:
                T.pdl_sync()
            if HALF:   # row pair t: rows 2 t (threads 0 .. TPR - 1) and 2 t + 1
                body(X, W, Res, ResOut, Out, SF, Bf, Rstd, Mega, eps, out_scale,
                     t * RPC + T.get_thread_binding() // TPR, b)
            else:
                body(X, W, Res, ResOut, Out, SF, Bf, Rstd, Mega, eps, out_scale, t, b)

    return norm_forward


def _dx_value(T, x, dy, w, r, mean, out_scale, rg):
    """One dx element of quant.md 5.11 with every rounding spelled out, so that no body of the backward depends on
    which product nvcc chooses to fuse (``g w - xh (A/H)`` has two): ``t = fma(g, w, -(xh (A/H)))`` with ``g = dy
    out_scale`` and ``xh = x rstd`` rounded (without a weight ``t = fma(dy, out_scale, -(xh (A/H)))``), then
    ``fma(t, rstd, rg)`` with residual_out_grad, else ``t rstd``: the operations the first kernels compiled to."""
    def mul(a, b):
        return T.call_extern("float32", "__fmul_rn", a, b)

    def fma(a, b, c):
        return T.call_extern("float32", "__fmaf_rn", a, b, c)

    xhm = mul(mul(x, r), mean)
    t = fma(mul(dy, out_scale), w, -xhm) if w is not None else fma(dy, out_scale, -xhm)
    return fma(t, r, rg) if rg is not None else mul(t, r)


def norm_backward_kernel(x_dtype: str, hidden: int, has_weight: bool, has_res_grad: bool):
    """Factory: ``dx`` per row and the per-CTA partial weight gradients ``(NP, hidden)`` fp32 (module doc).

    Registers hold only the weight-gradient accumulators and one row of x and dy: the row is loaded one
    iteration ahead (its loads are in flight during the previous row's reduction and dx); the dx pass reads the
    current row's x and dy from a shared copy each thread made of its own vectors (bf16, BWD_HOLD), else from
    global memory again."""
    import tilelang.language as T

    E = 16 // (2 if x_dtype == "bfloat16" else 4)
    VPR = hidden // E
    TB = _bwd_threads(x_dtype, hidden)   # H = 7168: 16 bf16 elements per thread; fp32 12 or 16
    NP = _bwd_ctas(x_dtype, hidden, has_weight)
    CPS = max(2, -(-NP // _SMS))   # CTAs per SM (all NP at once on an H200)
    C = -(-VPR // TB)
    NW = TB // 32
    rowbytes = hidden * (2 if x_dtype == "bfloat16" else 4)   # a multiple of 16 (H % 32 == 0)
    CL = _clusters(x_dtype, has_weight)
    SV = hidden // (4 * CL)   # float4 columns each CTA of a cluster adds up

    def f32(buf, *idx):
        return _f32_of(T, x_dtype, buf, *idx)

    Tn = T.dynamic("num_tokens")
    XS, GS, RS = T.dynamic("x_st, dy_st, rg_st")

    x_p = T.StridedTensor((Tn, hidden), (XS, 1), x_dtype)
    dy_p = T.StridedTensor((Tn, hidden), (GS, 1), x_dtype)
    rg_p = T.StridedTensor((Tn, hidden), (RS, 1), x_dtype) if has_res_grad else T.Tensor((1,), x_dtype)
    w_p = T.Tensor((hidden,), x_dtype) if has_weight else T.Tensor((1,), x_dtype)
    rstd_p = T.Tensor((Tn,), "float32")
    dx_p = T.Tensor((Tn, hidden), x_dtype)
    part_p = T.Tensor((NP // CL, hidden), "float32") if has_weight else T.Tensor((1,), "float32")

    ST = (BWD_STAGES if has_weight else BWD_STAGES_NW) if x_dtype == "bfloat16" else FP32_STAGES
    RR = x_dtype == "bfloat16"   # rstd through the ring (fp32: a register, one row ahead)
    ES = 2 if x_dtype == "bfloat16" else 4

    def ring_fits(st):   # an SM's CTAs, each with st stages and the cluster's sums (1 KB per CTA reserved)
        ring = st * (2 * rowbytes + (4 * TB if RR else 0))
        return CPS * (ring + (4 * hidden if CL > 1 else 0) + 128 + 1024) <= 228 * 1024

    while x_dtype != "bfloat16" and ST > 2 and not ring_fits(ST):
        ST -= 1   # fp32: the deepest ring that fits
    if ST == 1 or not ring_fits(ST):
        ST = 0   # no ring, or 2 CTAs of ST stages do not fit: the register path

    block_total = _block_total(T, NW, wait_readers=True)

    @T.macro
    def dx_store(XV, DV, lead, row, col, W, RG, DX, wl, io, r, mean, out_scale, na):
        """dx of row ``row`` at columns ``col .. col + E`` from the local vectors ``XV[*lead, :]``, ``DV[*lead, :]``
        of x and dy. ``na``: the store does not allocate in L1."""
        if has_weight:
            for e in T.vectorized(E):
                wl[e] = W[col + e]
        if has_res_grad:
            rg = T.alloc_local((E,), x_dtype)
            for e in T.vectorized(E):
                rg[e] = RG[row, col + e]
        for e in T.unroll(E):
            io[e] = T.cast(_dx_value(T, f32(XV, *lead, e), f32(DV, *lead, e), f32(wl, e) if has_weight else None,
                                     r, mean, out_scale, f32(rg, e) if has_res_grad else None), x_dtype)
        if na:   # (a 16-byte vector: E elements)
            T.call_extern("void", "nf_st16_na", T.address_of(DX[row, col]), T.address_of(io[0]))
        else:
            for e in T.vectorized(E):
                DX[row, col + e] = io[e]

    @T.macro
    def dx_vector(XR, DR, i, row, col, W, RG, DX, wl, xl, dl, io, r, mean, out_scale, na=False):
        """``dx_store`` with x and dy from ``XR[i, col:]`` and ``DR[i, col:]`` (the row in global memory, or its
        shared-ring stage)."""
        for e in T.vectorized(E):
            xl[e] = XR[i, col + e]
        for e in T.vectorized(E):
            dl[e] = DR[i, col + e]
        dx_store(xl, dl, (), row, col, W, RG, DX, wl, io, r, mean, out_scale, na)

    @T.macro
    def dx_row(XR, DR, i, row, W, RG, DX, wl, xl, dl, io, tx, r, mean, out_scale, na=False):
        """The dx pass of row ``row`` (``dx_vector`` over this thread's columns)."""
        for c in T.unroll(C):
            col = (c * TB + tx) * E
            if col < hidden:
                dx_vector(XR, DR, i, row, col, W, RG, DX, wl, xl, dl, io, r, mean, out_scale, na)

    @T.macro
    def store_partial(Part, wacc, p, tx, accs):
        """This CTA's weight-gradient accumulators into partial row ``p``; in a cluster (CL > 1) the cluster's sum
        into partial row ``p // CL``: each CTA puts its sums in its shared ``accs``, then CTA ``p % CL`` adds
        slice ``p % CL`` of the columns over the cluster's CTAs in rank order (distributed shared memory)."""
        if CL > 1:
            for c in T.unroll(C):
                col = (c * TB + tx) * E
                if col < hidden:
                    for e in T.vectorized(E):
                        accs[col + e] = wacc[c, e]
            T.call_extern("void", "nf_cluster_arrive")   # release: the cluster's CTAs see accs
            T.call_extern("void", "nf_cluster_wait")
            ab = T.alloc_var("uint32")
            ab = T.call_extern("uint32", "nf_smem_addr", accs.access_ptr("r"))
            for i in T.unroll(-(-SV // TB)):
                v = i * TB + tx
                if v < SV:
                    col = ((p % CL) * SV + v) * 4
                    T.call_extern("void", f"nf_cluster_sum4<{CL}>",
                                  Part.access_ptr("w", offset=(p // CL) * hidden + col), ab + col * 4)
            T.call_extern("void", "nf_cluster_sync_relaxed")   # no CTA leaves while another reads its accs
        elif has_weight:
            for c in T.unroll(C):
                col = (c * TB + tx) * E
                if col < hidden:
                    for e in T.vectorized(E):
                        Part[p, col + e] = wacc[c, e]

    @T.macro
    def issue_row(X, DY, Rstd, xb, db, rb, row, sn, tx):
        """cp.async of row ``row`` into ring stage ``sn`` (shared-window bases ``xb``, ``db``, ``rb``): this thread's
        x and dy vectors and (bf16) its own copy of the row's rstd."""
        if RR:
            T.call_extern("void", "nf_cp4", rb, (sn * TB + tx) * 4, Rstd.access_ptr("r", offset=row))
        for c in T.unroll(C):
            col = (c * TB + tx) * E
            if col < hidden:
                T.call_extern("void", "nf_cp16", xb, (sn * hidden + col) * ES,
                              X.access_ptr("r", offset=row * XS + col))
                T.call_extern("void", "nf_cp16", db, (sn * hidden + col) * ES,
                              DY.access_ptr("r", offset=row * GS + col))

    @T.macro
    def stage_vector(xs, ds, s, col, W, wl, xl, dl):
        """x, dy and w of columns ``col .. col + E`` from ring stage ``s`` into ``xl``, ``dl``, ``wl``: zeros (w: ones)
        past the row, whose lanes then add nothing."""
        for e in T.vectorized(E):
            wl[e] = T.cast(1, x_dtype)
            xl[e] = T.cast(0, x_dtype)
            dl[e] = T.cast(0, x_dtype)
        if col < hidden:
            if has_weight:
                for e in T.vectorized(E):
                    wl[e] = W[col + e]
            for e in T.vectorized(E):
                xl[e] = xs[s, col + e]
            for e in T.vectorized(E):
                dl[e] = ds[s, col + e]

    @T.macro
    def accumulate(acc, XV, DV, lead, wl, wacc, c, r, out_scale):
        """This thread's vector ``c`` of a row (x and dy at ``XV[*lead, e]`` / ``DV[*lead, e]``): its weight-gradient
        terms into ``wacc[c, :]``; returns ``acc`` plus its terms of A."""
        a = T.alloc_var("float32")
        a = acc
        for e in T.unroll(E):
            xh = f32(XV, *lead, e) * r
            g = f32(DV, *lead, e) * out_scale
            if has_weight:
                wacc[c, e] = wacc[c, e] + xh * g
                a = a + xh * (g * f32(wl, e))
            else:
                a = a + xh * g
        return a

    def make_body(hold: bool):
        """The kernel body: rows in registers, loaded one row ahead. The weight comes from shared memory, where
        each thread copies its own vectors once (no barrier: no thread reads another's): read from global memory,
        ptxas keeps its 16 values in registers from the reduction pass to the dx pass and spills (72 registers).
        ``hold`` (BWD_HOLD): the dx pass reads the row from the shared ``xs``, ``ds``, where the reduction pass
        copies each vector of ``xn``, ``dn`` (``nf_copy16``) before the next row's loads reuse the registers;
        otherwise it reads the row from global memory again."""
        @T.macro
        def body(DY, X, W, Rstd, RG, DX, Part, p, out_scale):
            tx = T.get_thread_binding()
            xn = T.alloc_local((C, E), x_dtype)     # the row to reduce next (loaded one iteration ahead)
            dn = T.alloc_local((C, E), x_dtype)
            if hold:
                xc = T.alloc_local((1, E), x_dtype)     # the dx pass: one vector of the row from xs, ds
                dc = T.alloc_local((1, E), x_dtype)
            wacc = T.alloc_local((C, E), "float32")
            wl = T.alloc_local((E,), x_dtype)
            if not hold:
                xl = T.alloc_local((E,), x_dtype)
                dl = T.alloc_local((E,), x_dtype)
            io = T.alloc_local((E,), x_dtype)
            red = T.alloc_shared((NW,), "float32")
            acc = T.alloc_var("float32")
            accs = T.alloc_shared((hidden,), "float32") if CL > 1 else None   # the cluster's sums
            ws = T.alloc_shared((hidden,), x_dtype) if has_weight else W
            if hold:
                xs = T.alloc_shared((hidden,), x_dtype)
                ds = T.alloc_shared((hidden,), x_dtype)
            for c in T.unroll(C):
                col = (c * TB + tx) * E
                if has_weight:
                    if col < hidden:
                        for e in T.vectorized(E):
                            ws[col + e] = W[col + e]
                for e in T.unroll(E):
                    wacc[c, e] = T.float32(0.0)
                for e in T.vectorized(E):
                    xn[c, e] = T.cast(0, x_dtype)
                    dn[c, e] = T.cast(0, x_dtype)
                if T.And(col < hidden, p < Tn):
                    for e in T.vectorized(E):
                        xn[c, e] = X[p, col + e]
                    for e in T.vectorized(E):
                        dn[c, e] = DY[p, col + e]
            for k in T.serial(T.ceildiv(Tn, NP)):
                row = k * NP + p
                if row < Tn:
                    r = Rstd[row]
                    acc = T.float32(0.0)
                    for c in T.unroll(C):
                        col = (c * TB + tx) * E
                        for e in T.vectorized(E):
                            wl[e] = T.cast(1, x_dtype)
                        if has_weight:
                            if col < hidden:
                                for e in T.vectorized(E):
                                    wl[e] = ws[col + e]
                        acc = accumulate(acc, xn, dn, (c,), wl, wacc, c, r, out_scale)
                        if hold:
                            if col < hidden:
                                T.call_extern("void", "nf_copy16", T.address_of(xs[col]), T.address_of(xn[c, 0]))
                                T.call_extern("void", "nf_copy16", T.address_of(ds[col]), T.address_of(dn[c, 0]))
                    # the next row's loads, in flight during this row's reduction and dx pass
                    for c in T.unroll(C):
                        col = (c * TB + tx) * E
                        if T.And(col < hidden, row + NP < Tn):
                            for e in T.vectorized(E):
                                xn[c, e] = X[row + NP, col + e]
                            for e in T.vectorized(E):
                                dn[c, e] = DY[row + NP, col + e]
                    mean = block_total(acc, red, tx) / T.float32(hidden)
                    if hold:
                        for c in T.unroll(C):
                            col = (c * TB + tx) * E
                            if col < hidden:
                                T.call_extern("void", "nf_copy16", T.address_of(xc[0, 0]), T.address_of(xs[col]))
                                T.call_extern("void", "nf_copy16", T.address_of(dc[0, 0]), T.address_of(ds[col]))
                                dx_store(xc, dc, (0,), row, col, ws, RG, DX, wl, io, r, mean, out_scale,
                                         BWD_STORE_NA and not has_res_grad)
                    else:
                        dx_row(X, DY, row, row, ws, RG, DX, wl, xl, dl, io, tx, r, mean, out_scale,
                               BWD_STORE_NA and not has_res_grad)
            store_partial(Part, wacc, p, tx, accs)

        return body

    def make_ring_body(rows):
        """BWD_STAGES >= 2: the same per-row arithmetic as ``make_body`` (each thread owns the same columns and
        computes the same expressions in the same order); x, dy and rstd come from an ST-stage shared ring that
        per-thread cp.async fills ahead (each thread copies and later reads only its own vectors and its own rstd
        copy: no barrier guards a stage), and the dx pass reads the row from shared memory again. ``rows``: the
        row loop (``staged_rows`` or ``pipe_rows``)."""
        @T.macro
        def body(DY, X, W, Rstd, RG, DX, Part, p, out_scale):
            tx = T.get_thread_binding()
            xs = T.alloc_shared((ST, hidden), x_dtype)
            ds = T.alloc_shared((ST, hidden), x_dtype)
            rs = T.alloc_shared((ST, TB if RR else 1), "float32")   # bf16: each thread its own copy of the rstd
            wacc = T.alloc_local((C, E), "float32")
            wl = T.alloc_local((E,), x_dtype)
            xl = T.alloc_local((E,), x_dtype)
            dl = T.alloc_local((E,), x_dtype)
            io = T.alloc_local((E,), x_dtype)
            xb = T.alloc_var("uint32")   # shared-window addresses of the rings
            db = T.alloc_var("uint32")
            rb = T.alloc_var("uint32")
            xb = T.call_extern("uint32", "nf_smem_addr", xs.access_ptr("w"))
            db = T.call_extern("uint32", "nf_smem_addr", ds.access_ptr("w"))
            rb = T.call_extern("uint32", "nf_smem_addr", rs.access_ptr("w"))
            accs = T.alloc_shared((hidden,), "float32") if CL > 1 else None   # the cluster's sums
            for c in T.unroll(C):
                for e in T.unroll(E):
                    wacc[c, e] = T.float32(0.0)
            rows(DY, X, W, Rstd, RG, DX, p, out_scale, tx, xs, ds, rs, wacc, wl, xl, dl, io, xb, db, rb)
            T.call_extern("void", "nf_cp_wait<0>")   # no copy outlives the CTA
            store_partial(Part, wacc, p, tx, accs)

        return body

    @T.macro
    def staged_rows(DY, X, W, Rstd, RG, DX, p, out_scale, tx, xs, ds, rs, wacc, wl, xl, dl, io, xb, db, rb):
        """The ring's row loop: ST - 1 rows in flight, two barriers per row (in ``block_total``)."""
        red = T.alloc_shared((NW,), "float32")
        acc = T.alloc_var("float32")
        if not RR:
            rn = T.alloc_var("float32")   # the next row's rstd
            if p < Tn:
                rn = Rstd[p]
        for a in T.unroll(ST - 1):   # prologue: rows p + a NP, a < ST - 1, into stage a
            if p + a * NP < Tn:
                issue_row(X, DY, Rstd, xb, db, rb, p + a * NP, a, tx)
            T.call_extern("void", "nf_cp_commit")
        for k in T.serial(T.ceildiv(Tn, NP)):
            row = k * NP + p
            if row < Tn:
                nxt = row + (ST - 1) * NP
                sn = (k + ST - 1) % ST
                if nxt < Tn:   # the row ST - 1 ahead into the stage the previous row left
                    issue_row(X, DY, Rstd, xb, db, rb, nxt, sn, tx)
                T.call_extern("void", "nf_cp_commit")
                T.call_extern("void", f"nf_cp_wait<{ST - 1}>")   # this row's group (this thread's copies)
                s = k % ST
                if RR:
                    r = rs[s, tx]
                else:
                    r = T.alloc_var("float32")
                    r = rn
                    if row + NP < Tn:
                        rn = Rstd[row + NP]
                acc = T.float32(0.0)
                for c in T.unroll(C):
                    col = (c * TB + tx) * E
                    stage_vector(xs, ds, s, col, W, wl, xl, dl)
                    acc = accumulate(acc, xl, dl, (), wl, wacc, c, r, out_scale)
                mean = block_total(acc, red, tx) / T.float32(hidden)
                dx_row(xs, ds, s, row, W, RG, DX, wl, xl, dl, io, tx, r, mean, out_scale)

    CF = VPR // TB   # column blocks inside the row for every thread

    @T.macro
    def pipe_rows(DY, X, W, Rstd, RG, DX, p, out_scale, tx, xs, ds, rs, wacc, wl, xl, dl, io, xb, db, rb):
        """BWD_PIPE (ST == 3): the staged loop software-pipelined by one row. Iteration k (k = 0 .. ceil(T / NP)):
        issue row k + 1 into stage (k + 1) % 3; reduce row k (pass 1: wacc and the thread sum); write dx of row
        k - 1 (stage (k - 1) % 3, its A from red slot (k - 1) % 2), the five butterfly steps of row k interleaved
        between its column blocks; store row k's warp sums into red slot k % 2; one barrier. Slot k % 2 was last
        read in iteration k - 1, before that iteration's barrier."""
        red = T.alloc_shared((2, NW), "float32")
        acc = T.alloc_var("float32")
        am = T.alloc_var("float32")
        acc = T.float32(0.0)
        if p < Tn:   # prologue: row p into stage 0
            issue_row(X, DY, Rstd, xb, db, rb, p, 0, tx)
        T.call_extern("void", "nf_cp_commit")
        for k in T.serial(T.ceildiv(Tn, NP) + 1):
            row = k * NP + p
            nxt = row + NP
            sn = (k + 1) % ST
            if nxt < Tn:   # row k + 1 into the stage row k - 2 left
                issue_row(X, DY, Rstd, xb, db, rb, nxt, sn, tx)
            T.call_extern("void", "nf_cp_commit")
            T.call_extern("void", "nf_cp_wait<1>")   # row k's group (this thread's copies)
            # pass 1 of row k
            if row < Tn:
                s = k % ST
                r = rs[s, tx]
                acc = T.float32(0.0)
                for c in T.unroll(C):
                    col = (c * TB + tx) * E
                    if c < CF:   # a block every thread fills: no defaults, no predicate
                        if has_weight:
                            for e in T.vectorized(E):
                                wl[e] = W[col + e]
                        else:
                            for e in T.vectorized(E):
                                wl[e] = T.cast(1, x_dtype)
                        for e in T.vectorized(E):
                            xl[e] = xs[s, col + e]
                        for e in T.vectorized(E):
                            dl[e] = ds[s, col + e]
                    else:        # the tail block: lanes past the row compute on zeros, as the other bodies
                        stage_vector(xs, ds, s, col, W, wl, xl, dl)
                    acc = accumulate(acc, xl, dl, (), wl, wacc, c, r, out_scale)
            # dx of row k - 1 (A from red slot (k - 1) % 2), row k's butterfly steps between its column blocks
            prev = row - NP
            on = T.And(k > 0, prev < Tn)
            sp = (k + ST - 1) % ST
            rp = T.alloc_var("float32")
            am = T.float32(0.0)
            rp = T.float32(0.0)
            if on:
                am = red[(k + 1) % 2, 0]
                for i in T.unroll(1, NW):
                    am = am + red[(k + 1) % 2, i]
                am = am / T.float32(hidden)
                rp = rs[sp, tx]
            for c in T.unroll(max(C, 5)):
                if c < 5:
                    acc = acc + T.shfl_xor(acc, T.shift_right(16, c))
                if c < C:
                    col = (c * TB + tx) * E
                    if T.And(on, T.Or(c < CF, col < hidden)):
                        dx_vector(xs, ds, sp, prev, col, W, RG, DX, wl, xl, dl, io, rp, am, out_scale)
            if T.And(row < Tn, tx % 32 == 0):
                red[k % 2, tx // 32] = acc
            T.sync_threads()

    if not ST:
        body = make_body(bool(BWD_HOLD) and x_dtype == "bfloat16")
    elif BWD_PIPE and ST == 3 and RR:   # (bf16: its rstd comes through the ring)
        body = make_ring_body(pipe_rows)
    else:
        body = make_ring_body(staged_rows)

    @T.prim_func
    def norm_backward(DY: dy_p, X: x_p, W: w_p, Rstd: rstd_p, RG: rg_p, DX: dx_p, Part: part_p,
                      out_scale: T.float32):
        T.assume(XS % 16 == 0)
        T.assume(GS % 16 == 0)
        if has_res_grad:
            T.assume(RS % 16 == 0)
        with T.Kernel(NP, threads=TB, cluster_dims=CL if CL > 1 else None) as p:
            T.annotate_min_blocks_per_sm(CPS)  # registers: all NP CTAs at once
            T.import_source(_CUDA_HELPERS + (_CLUSTER_HELPERS if CL > 1 else ""))
            if BWD_PDL:
                T.pdl_sync()
            if BWD_TRIGGER:
                T.pdl_trigger()
            body(DY, X, W, Rstd, RG, DX, Part, p, out_scale)

    return norm_backward


def weight_grad_reduce_kernel(wg_dtype: str, hidden: int, assign: bool, partials: int):
    """Factory: ``WG[j] = round(float(WG[j]) + s_j)``, ``s_j`` the sum of ``Part[:, j]`` in the fixed two-level
    order of ``_RED_GROUPS``. One CTA of 256 threads per ``256 / G`` columns; thread ``(g, c)`` adds group ``g``'s
    partials of its column, then thread ``c`` adds the ``G`` group sums from shared memory.

    ``assign`` (WG_ASSIGN, a new buffer): ``WG[j] = round(s)``, the same bits as adding s to a zeroed buffer."""
    import tilelang.language as T

    G, NT = _RED_GROUPS, 256
    CW = NT // G                  # columns per CTA
    PG = -(-partials // G)        # partials per group (the last group: the rest)
    assert NT % G == 0 and CW % 32 == 0 and (G - 1) * PG < partials   # no group is empty

    @T.prim_func
    def weight_grad_reduce(Part: T.Tensor((partials, hidden), "float32"), WG: T.Tensor((hidden,), wg_dtype)):
        with T.Kernel(T.ceildiv(hidden, CW), threads=NT) as bx:
            if RED_PDL:
                T.pdl_sync()
            tx = T.get_thread_binding()
            g = tx // CW
            j = bx * CW + tx % CW
            buf = T.alloc_local((PG,), "float32")
            grp = T.alloc_shared((G, CW), "float32")
            s = T.alloc_var("float32")
            if j < hidden:
                for i in T.unroll(PG):   # every load of the group first
                    if partials % PG == 0 or g * PG + i < partials:
                        buf[i] = Part[g * PG + i, j]
                s = buf[0]
                for i in T.unroll(1, PG):   # in order p
                    if partials % PG == 0 or g * PG + i < partials:
                        s = s + buf[i]
                grp[g, tx % CW] = s
            T.sync_threads()
            if T.And(tx < CW, j < hidden):
                s = grp[0, tx]
                for i in T.unroll(1, G):   # in order g
                    s = s + grp[i, tx]
                if assign:
                    WG[j] = T.cast(s, wg_dtype)
                else:
                    WG[j] = T.cast(T.cast(WG[j], "float32") + s, wg_dtype)

    return weight_grad_reduce


# ---- static configs: those the bench launches (``precompile``); any other compiles on first use ----

BENCH_HIDDEN = (1536, 2048, 4096, 7168, 8192)  # tilefuse.bench.quant.NORM_HIDDEN

# the quick rows (tilefuse/bench/quant.py): bf16 8192 x 7168 with a weight, no residual, no rstd
_BENCH_FORWARD = [("bfloat16", 7168, True, False, False, "row", False, False, False, 0),
                  ("bfloat16", 7168, True, False, True, "col_packed", True, False, False, 0)]


def _forward_configs() -> list[tuple]:
    """The forward launches of the bench, as (x dtype, hidden, weight, residual, quant, layout, round, bf16, rstd,
    mega): the quick rows, and the grid's bf16 rows with a weight: no cast, and the e4m3 cast with row sf (round
    both ways) and packed column sf (rounded)."""
    grid = [("bfloat16", h, True, False, quant, layout, rnd, False, False, 0) for quant, layout, rnd in (
        (False, "row", False), (True, "row", False), (True, "row", True), (True, "col_packed", True))
        for h in BENCH_HIDDEN]
    return list(dict.fromkeys(_BENCH_FORWARD + grid))


def _backward_configs() -> list[tuple]:
    """The backward launches of the bench: bf16 with a weight, no residual, every grid hidden size."""
    return [("bfloat16", h, True, False) for h in BENCH_HIDDEN]


_jit.register("norm_forward", norm_forward_kernel, _forward_configs)
_jit.register("norm_backward", norm_backward_kernel, _backward_configs)
_jit.register("norm_weight_grad_reduce", weight_grad_reduce_kernel,   # (weight_grad dtype, H, assign, partials)
              lambda: [("bfloat16", h, WG_ASSIGN, _partials("bfloat16", h)) for h in BENCH_HIDDEN])

_DUMMY: dict[tuple, torch.Tensor] = {}


def _dummy(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)   # (a torch.device hashes by type and index: no string per call)
    t = _DUMMY.get(key)
    if t is None:
        t = _DUMMY[key] = torch.empty((1,), dtype=dtype, device=device)
    return t


def _rows3(t: torch.Tensor) -> torch.Tensor:
    """``(B, T, H)`` view of a 2-D/3-D row tensor, strides of size-1 dims set to 0 (kernel assumes % 16); one
    ``as_strided`` call (the launcher's per-call cost at one row)."""
    if t.dim() == 2:
        n, h = t.shape
        return t.as_strided((1, n, h), (0, t.stride(0) if n > 1 else 0, 1))
    b, n, h = t.shape
    sb, sn, _ = t.stride()
    return t.as_strided((b, n, h), (sb if b > 1 else 0, sn if n > 1 else 0, 1))


def _sf_alloc(x: torch.Tensor, col: bool, packed: bool) -> torch.Tensor:
    """out_sf in the layout the op returns (quant.md 5.11): row-major, or per batch column-major with leading
    dimension align(T, 4); 2-D x gives a 2-D sf."""
    lead = tuple(x.shape[:-1])
    ng = x.size(-1) // _NPC
    width, dtype = (-(-ng // 4), torch.int32) if packed else (ng, torch.float32)
    if not col:
        return x.new_empty((*lead, width), dtype=dtype)
    t = lead[-1]
    pad = (t + 3) // 4 * 4
    if x.dim() == 2:
        return x.new_empty_strided((t, width), (1, pad), dtype=dtype)
    return x.new_empty_strided((lead[0], t, width), (width * pad, 1, pad), dtype=dtype)


def _sf3(sf: torch.Tensor) -> torch.Tensor:
    return sf if sf.dim() == 3 else sf.unsqueeze(0)


_PLANS: dict[tuple, object] = {}


def _plan(x_dtype: torch.dtype, hidden: int, has_weight: bool, quant: bool, layout: str, round_sf: bool,
          with_rstd: bool):
    """The native launch plan of a forward config without residual, bf16 copy or mega-MoE sf
    (``tilefuse._native.norm_plan``), built once per config; None where the extension is unavailable."""
    key = (x_dtype, hidden, has_weight, quant, layout, round_sf, with_rstd)
    plan = _PLANS.get(key)
    if plan is None:
        cfg = (_TL_DTYPE[x_dtype], hidden, has_weight, False, quant, layout, round_sf, False, with_rstd, 0)
        plan = _native.norm_plan(_jit.get("norm_forward", cfg), hidden, x_dtype,
                                 torch.float8_e4m3fn if quant else x_dtype, layout if quant else None, has_weight,
                                 with_rstd)
        _PLANS[key] = plan = plan if plan is not None else False
    return plan or None


def norm_forward_launch(x, weight, eps, residual=None, out_scale=1.0, out=None, residual_out=None,
                        with_rstd=False, quant=False, use_tma_aligned_col_major_sf=False, round_sf=False,
                        use_packed_ue8m0=False, with_out_bf16=False, out_sf=None, out_bf16=None, mega_moe_sf=None,
                        mega_moe_block_m=0):
    """Allocate missing outputs and launch the forward kernel (quant.md 5.11). Validates nothing.

    Returns ``(out, out_sf, out_bf16, rstd, residual_out)`` (None where absent). A 2-D x with no residual, caller
    buffers, bf16 copy or mega-MoE sf takes the config's native launch plan (the same outputs and launch)."""
    col, packed = use_tma_aligned_col_major_sf, use_packed_ue8m0
    layout = ("col_packed" if col else "row_packed") if packed else ("col" if col else "row")
    has_res = residual is not None
    if (x.dim() == 2 and not has_res and out is None and out_sf is None and not with_out_bf16 and mega_moe_sf is None
            and x.size(0) > 0):
        plan = _plan(x.dtype, x.size(1), weight is not None, bool(quant), layout, bool(round_sf), bool(with_rstd))
        if plan is not None:
            o, sf, rstd = plan(x, weight, float(eps), float(out_scale))
            return o, sf, None, rstd, None
    if out is None:
        out = torch.empty_like(x, dtype=torch.float8_e4m3fn if quant else x.dtype,
                               memory_format=torch.contiguous_format)
    if has_res and residual_out is None:
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if quant and out_sf is None:
        out_sf = _sf_alloc(x, col, packed)
    if with_out_bf16 and out_bf16 is None:
        out_bf16 = torch.empty_like(x, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
    rstd = x.new_empty(tuple(x.shape[:-1]), dtype=torch.float32) if with_rstd else None
    if x.numel() == 0:
        return out, out_sf, out_bf16, rstd, residual_out
    mega = bool(mega_moe_sf is not None)
    cfg = (_TL_DTYPE[x.dtype], x.size(-1), weight is not None, has_res, quant, layout, round_sf,
           with_out_bf16, with_rstd, mega_moe_block_m if mega else 0)
    fn = _jit.get("norm_forward", cfg)
    dev = x.device
    if mega:
        t = x.size(0)
        rows = -(-t // mega_moe_block_m) * (-(-mega_moe_block_m // 128) * 128)
        mega_arg = mega_moe_sf.as_strided((x.size(-1) // 128, rows), (mega_moe_sf.stride(1), 1))
    else:
        mega_arg = _dummy(torch.int32, dev)
    if quant:
        sf_arg = _sf3(out_sf)
        if col:
            b, t, w = sf_arg.shape
            pad = (t + 3) // 4 * 4
            sf_arg = sf_arg.as_strided((b, t, w), (w * pad, 1, pad))
    else:
        sf_arg = _dummy(torch.float32, dev)
    # outputs written through a 16-byte-aligned temporary when the caller's buffer is not aligned
    o_arg = out if out.data_ptr() % 16 == 0 else torch.empty_like(out, memory_format=torch.contiguous_format)
    x3 = _rows3(aligned(x))
    fn(x3,
       aligned(weight) if weight is not None else _dummy(x.dtype, dev),
       _rows3(aligned(residual)) if has_res else _dummy(x.dtype, dev),
       _rows3(residual_out) if has_res else _dummy(x.dtype, dev),
       _rows3(o_arg), sf_arg,
       _rows3(out_bf16) if with_out_bf16 else _dummy(torch.bfloat16, dev),
       rstd.view(x3.shape[:2]) if with_rstd else _dummy(torch.float32, dev),
       mega_arg, float(eps), float(out_scale))
    if o_arg is not out:
        out.copy_(o_arg)
    return out, out_sf, out_bf16, rstd, residual_out


def _backward_plan(x_dtype: torch.dtype, hidden: int, wg_dtype: torch.dtype | None):
    """The native launch plan of a backward config without residual_out_grad or a given weight_grad (WG_ASSIGN's
    assigning reduce; ``tilefuse._native.norm_backward_plan``), built once; None where the extension is
    unavailable."""
    key = ("backward", x_dtype, hidden, wg_dtype)
    plan = _PLANS.get(key)
    if plan is None:
        has_w = wg_dtype is not None
        fn = _jit.get("norm_backward", (_TL_DTYPE[x_dtype], hidden, has_w, False))
        npr = _partials(_TL_DTYPE[x_dtype], hidden)
        red = _jit.get("norm_weight_grad_reduce", (_TL_DTYPE[wg_dtype], hidden, True, npr)) if has_w else None
        plan = _native.norm_backward_plan(fn, red, hidden, npr)
        _PLANS[key] = plan = plan if plan is not None else False
    return plan or None


def norm_backward_launch(out_grad, x, weight, rstd, residual_out_grad=None, out_scale=1.0, weight_grad=None):
    """``(x_grad, weight_grad)`` of quant.md 5.11: dx kernel with NP partial weight gradients, then the ordered
    reduction onto ``weight_grad`` (a new zeroed buffer of weight.dtype when not given). Validates nothing. Without
    residual_out_grad or a given weight_grad (and with WG_ASSIGN) it takes the config's native launch plan."""
    t, hidden = x.shape
    dev = x.device
    if residual_out_grad is None and weight_grad is None and WG_ASSIGN and t > 0:
        plan = _backward_plan(x.dtype, hidden, None if weight is None else weight.dtype)
        if plan is not None:
            return plan(out_grad, x, weight, rstd, float(out_scale))
    x_grad = torch.empty((t, hidden), dtype=x.dtype, device=dev)
    assign = False
    if weight is not None and weight_grad is None:
        assign = WG_ASSIGN and t > 0   # the reduce stores round(s): no zero fill (knob WG_ASSIGN)
        weight_grad = (torch.empty if assign else torch.zeros)((hidden,), dtype=weight.dtype, device=dev)
    if t == 0:
        return x_grad, weight_grad
    has_w, has_rg = weight is not None, residual_out_grad is not None
    fn = _jit.get("norm_backward", (_TL_DTYPE[x.dtype], hidden, has_w, has_rg))
    npr = _partials(_TL_DTYPE[x.dtype], hidden)
    part = torch.empty((npr, hidden), dtype=torch.float32, device=dev) if has_w else _dummy(torch.float32, dev)

    def rows(a):
        a = aligned(a)
        return a.as_strided(a.shape, (0 if a.size(0) == 1 else a.stride(0), 1))

    fn(rows(out_grad), rows(x), aligned(weight) if has_w else _dummy(x.dtype, dev), rstd,
       rows(residual_out_grad) if has_rg else _dummy(x.dtype, dev), x_grad, part, float(out_scale))
    if has_w:
        _jit.get("norm_weight_grad_reduce", (_TL_DTYPE[weight_grad.dtype], hidden, assign, npr))(part, weight_grad)
    return x_grad, weight_grad


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::norm_forward", mutates_args=(), device_types="cuda")
def _norm_forward_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None,
                     out_scale: float, with_rstd: bool) -> list[torch.Tensor]:
    """[out, rstd?, residual_out?] (the optional ones present per with_rstd / residual)."""
    out, _, _, rstd, res_out = norm_forward_launch(x, weight, eps, residual, out_scale, with_rstd=with_rstd)
    return [t for t in (out, rstd, res_out) if t is not None]


@_norm_forward_op.register_fake
def _(x, weight, eps, residual, out_scale, with_rstd):
    rstd = x.new_empty(tuple(x.shape[:-1]), dtype=torch.float32) if with_rstd else None
    res = [torch.empty_like(x, memory_format=torch.contiguous_format), rstd,
           (torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None)]
    return [t for t in res if t is not None]


@_ops.kernel_op("tilefuse::norm_forward_and_per_token_cast", mutates_args=(), device_types="cuda")
def _norm_cast_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None,
                  out_scale: float, use_tma_aligned_col_major_sf: bool, round_sf: bool, use_packed_ue8m0: bool,
                  with_out_bf16: bool, with_rstd: bool) -> list[torch.Tensor]:
    """[out, out_sf, out_bf16?, rstd?, residual_out?]."""
    res = norm_forward_launch(x, weight, eps, residual, out_scale, with_rstd=with_rstd, quant=True,
                              use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, round_sf=round_sf,
                              use_packed_ue8m0=use_packed_ue8m0, with_out_bf16=with_out_bf16)
    return [t for t in res if t is not None]


@_norm_cast_op.register_fake
def _(x, weight, eps, residual, out_scale, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, with_out_bf16,
      with_rstd):
    cf = torch.contiguous_format
    res = (torch.empty_like(x, dtype=torch.float8_e4m3fn, memory_format=cf),
           _sf_alloc(x, use_tma_aligned_col_major_sf, use_packed_ue8m0),
           torch.empty_like(x, dtype=torch.bfloat16, memory_format=cf) if with_out_bf16 else None,
           x.new_empty(tuple(x.shape[:-1]), dtype=torch.float32) if with_rstd else None,
           torch.empty_like(x, memory_format=cf) if residual is not None else None)
    return [t for t in res if t is not None]


@_ops.kernel_op("tilefuse::norm_backward", mutates_args=(), device_types="cuda")
def _norm_backward_op(out_grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                      residual_out_grad: torch.Tensor | None, out_scale: float) -> list[torch.Tensor]:
    """[x_grad, weight_grad?]."""
    return [t for t in norm_backward_launch(out_grad, x, weight, rstd, residual_out_grad, out_scale) if t is not None]


@_norm_backward_op.register_fake
def _(out_grad, x, weight, rstd, residual_out_grad, out_scale):
    res = [torch.empty_like(x, memory_format=torch.contiguous_format)]
    return res if weight is None else res + [torch.empty_like(weight)]


def _simple(*tensors) -> bool:
    """True when no caller-provided output buffer is involved: the custom op path works under torch.compile."""
    return all(t is None for t in tensors)


def norm_forward_cuda(x, weight, eps, residual=None, out_scale=1.0, out=None, residual_out=None, with_rstd=False):
    """CUDA entry for the public ``norm_forward``: ``(out, rstd, norm_input)``."""
    if torch.compiler.is_compiling() and _simple(out, residual_out):
        res = list(torch.ops.tilefuse.norm_forward(x, weight, float(eps), residual, float(out_scale), with_rstd))
        o = res.pop(0)
        rstd = res.pop(0) if with_rstd else None
        res_out = res.pop(0) if residual is not None else None
    else:
        o, _, _, rstd, res_out = norm_forward_launch(x, weight, eps, residual, out_scale, out, residual_out,
                                                     with_rstd)
    return o, rstd, (x if residual is None else res_out)


def norm_forward_and_per_token_cast_cuda(x, weight, eps, fmt, num_per_channels, residual=None, out_scale=1.0,
                                         use_tma_aligned_col_major_sf=False, round_sf=False, use_packed_ue8m0=False,
                                         with_out_bf16=False, out=None, out_bf16=None, residual_out=None,
                                         mega_moe_sf=None, mega_moe_block_m=0, with_rstd=False):
    """CUDA entry for the public ``norm_forward_and_per_token_cast``: ``((out, out_sf), out_bf16, rstd,
    norm_input)``, or ``(out, None, rstd, norm_input)`` when ``fmt`` names x's dtype."""
    if fmt != "e4m3":
        o, rstd, norm_input = norm_forward_cuda(x, weight, eps, residual, out_scale,
                                                None if out is None else out[0], residual_out, with_rstd)
        return o, None, rstd, norm_input
    out_x, out_sf = (None, None) if out is None else out
    if torch.compiler.is_compiling() and _simple(out_x, out_sf, out_bf16, residual_out, mega_moe_sf):
        res = list(torch.ops.tilefuse.norm_forward_and_per_token_cast(
            x, weight, float(eps), residual, float(out_scale), use_tma_aligned_col_major_sf, round_sf,
            use_packed_ue8m0, with_out_bf16, with_rstd))
        o, sf = res.pop(0), res.pop(0)
        bf = res.pop(0) if with_out_bf16 else None
        rstd = res.pop(0) if with_rstd else None
        res_out = res.pop(0) if residual is not None else None
    else:
        o, sf, bf, rstd, res_out = norm_forward_launch(
            x, weight, eps, residual, out_scale, out_x, residual_out, with_rstd, True, use_tma_aligned_col_major_sf,
            round_sf, use_packed_ue8m0, with_out_bf16, out_sf, out_bf16, mega_moe_sf, mega_moe_block_m)
    return (o, sf), bf, rstd, (x if residual is None else res_out)


def norm_backward_cuda(out_grad, x, weight, rstd, residual_out_grad=None, out_scale=1.0, weight_grad=None):
    """CUDA entry for the public ``norm_backward``: ``(x_grad, weight_grad)``."""
    if torch.compiler.is_compiling() and weight_grad is None:
        res = list(torch.ops.tilefuse.norm_backward(out_grad, x, weight, rstd, residual_out_grad, float(out_scale)))
        return res[0], (res[1] if weight is not None else None)
    return norm_backward_launch(out_grad, x, weight, rstd, residual_out_grad, out_scale, weight_grad)
