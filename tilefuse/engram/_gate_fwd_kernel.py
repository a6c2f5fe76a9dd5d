"""TileLang kernels of the Engram gate forward (engram.md §2.4, v1) and its weight prep ``fused_weight`` (§2.3).

Gate forward. Layout: ``x``, ``out`` ``[T, M, H]`` bf16 contiguous; ``k`` ``[T, M, H]`` and ``v`` ``[T, H]`` bf16
with runtime 64-bit token/branch strides and a unit last stride (views into one fused projection work as they
are); ``w`` ``[M, H]`` fp32; the saved statistics ``[T, M]`` fp32. ``T`` and the strides are runtime values;
``M``, ``H`` and ``save`` are compile-time; ``eps`` and ``clamp_value`` are runtime fp32 scalars.

Two schedules compute the same bits (the same arithmetic, operation for operation). The default is the token
schedule (``TOKEN_CTA = True``, ``TOKEN_STAGE_V = False``; "Token schedule" below) where it measured fastest: a
shape with at most ``TOKEN_MAX_M`` branches whose x stage fits ``TOKEN_SMEM_MAX`` (``token_schedule``). The row
schedule (``TOKEN_CTA = False``) takes every other shape, and is the baseline the tests compare the token schedule
against.

Row schedule: CTA ``b * M + h`` takes branch ``h`` of the token block ``b`` (``WARPS * ROWS_PER_WARP`` tokens). It
first stages the branch's weight row in shared memory (read once per CTA from L2, not once per token); each of its
warps then handles one (token, branch) row at a time: tokens ``b * TB + r * WARPS + warp`` for
``r = 0 .. ROWS_PER_WARP - 1``. A row is read in chunks of 256 columns; lane ``l`` owns the 8 columns
``256 c + 8 l .. 256 c + 8 l + 7`` of chunk ``c``: one 16-byte vector of ``x``, ``k``, ``v`` and ``out``, so every
warp access is a coalesced 512-byte line. Shared memory holds chunk ``c``'s weights as two 128-float halves
(``w[256 c + 8 l + 4 q + e]`` at ``256 c + 128 q + 4 l + e``), so each lane's two 16-byte reads of a chunk are
conflict-free.

Arithmetic per row (all fp32; every operation an explicit ``__f*_rn`` intrinsic, so nvcc cannot contract or
reorder it), in upstream's order (§2.4.2):

* lane ``l`` keeps the partial sums ``Sxx``, ``Skk``, ``D`` of its columns, visited in increasing ``c`` then
  ``i`` from 0: ``Sxx = fma(x, x, Sxx)``, ``Skk = fma(k, k, Skk)``, ``D = fma(RN(x * w), k, D)``;
* the 32 partials are added by an XOR butterfly (distances 16, 8, 4, 2, 1): every lane ends with the same bits;
* ``rx = 1 / sqrt(Sxx / H + eps)``, ``rk`` likewise (IEEE division and square root);
  ``s = ((D * rx) * rk) * c_H`` with ``c_H = fp32(H^-0.5)`` (rounded once from double);
  ``u = copysign(sqrt(max(|s|, clamp)), s)`` (the sign *bit* of ``s``: ``s = -0`` gives ``-sqrt(clamp)``;
  a NaN ``s`` stays NaN, as the reference's ``clamp_min``); ``g = 1 / (1 + expf(0 - u))``;
* ``out = bf16(fma(g, v, x))`` (one fp32 rounding, then round-to-nearest-even to bf16).

With ``save``, lane 0 writes the raw ``D``, ``g``, ``rx``, ``rk``; without it nothing but ``out`` is written, and
``out`` is the same bits either way (the same code up to those four stores). The order depends only on ``H``, never
on ``T``, the token's place or the device: deterministic and batch-invariant, no atomics.

The output pass reads the row's ``x`` again, chunks in decreasing order, so the chunks read last by the reduction
(the likeliest still in L1) come first; the rest are L2 hits. Keeping the row in registers between the passes was
tried: ptxas (sm_90) then also hoisted the k and v loads of the unrolled chunks (208 registers at H = 4096, spills
at 7168). Each pass issues the loads of ``LOADS_AHEAD`` chunks before their arithmetic (the order of the
arithmetic is the same for every value).

Kernel constraints: ``512 <= H <= MAX_H``, ``H % 256 == 0`` (the public op's), any ``M >= 1``. The public op keeps
the reference path for larger ``H`` (``takes``). A ``k`` / ``v`` whose base is not 16-byte aligned or whose
strides are not multiples of 8 elements is copied to a contiguous tensor first.

fused_weight: ``out = RN(fp32(w_h) * fp32(w_e))`` (exact: 16 significant bits), one thread per 8 elements of the
flattened ``[M, H]`` (16-byte loads, two 16-byte stores); the element count is a runtime value.

Row schedule occupancy, ptxas (sm_90, M = 4, no spills): at ``LOADS_AHEAD = 4`` 86 registers at H = 4096 with and
without save, 90 / 84 at 7168: 5 CTAs of 128 threads an SM (20 warps, each with 4 KiB of x and k loads in flight); at
``LOADS_AHEAD = 8`` (the default: faster at H = 7168, docs/BENCHMARKS.md) 144 at 7168: 3 CTAs an SM, 8 KiB in flight a
warp. 16-28 KiB of shared memory a CTA. ``v`` is read by the ``M`` CTAs of a token block (one HBM read, the others L2
hits). Save and no save compile to the same loops (SASS at H = 4096: the same 24 16-byte loads, in the same groups and
order up to one swap in the output pass, the same 86 registers and occupancy; save adds four 4-byte stores of lane 0
between the passes): no save being slower is not in the generated code; look at the measurement (row order, the buffers'
addresses: ``out`` is written at the offsets ``x`` is read at) before the kernel. The row schedule's knobs:
``ROWS_PER_WARP`` (CTA granularity against weight reloads: at T = 8192, M = 4 ``ROWS_PER_WARP = 2`` makes 4096 CTAs of 8
rows, about 6 per CTA slot, and each CTA's 16-28 KiB weight fill is about 6% of its L2 reads), ``LOADS_AHEAD``,
``WARPS``.

Token schedule (the default: ``TOKEN_CTA = True``, ``TOKEN_STAGE_V = False``). CTA ``b`` takes tokens
``b * TW .. b * TW + TW - 1`` (``TW = TOKEN_ROWS``) and all their branches, warp ``h`` branch ``h`` (``M * 32``
threads). One pass over the row reads x, k and the weight (the row schedule's lane layout and load groups, the
weight straight from global memory, 32 bytes a lane a chunk, once for the ``TW`` tokens); every x vector goes to
shared memory (``TW * M * H`` bf16: 32 KiB at H = 4096, 56 KiB at 7168). After one barrier the butterfly and scalar
chain, then the output pass reads x from shared memory and loads v, ``LOADS_AHEAD`` chunks ahead (the M warps read
the same v row: one DRAM read, the others L1 / L2 hits, kept together by the barrier). So every byte of x and k
comes from DRAM once and is read once by an SM (the row schedule reads x twice and v ``M`` times, the second reads
from L2). Each lane writes and reads back its own x vectors (no bank conflicts: a warp's 16-byte accesses are
contiguous). ``TOKEN_STAGE_V = True`` also stages the v row (``TW * (M + 1) * H`` bf16: 40 / 70 KiB), its chunks
loaded in the reduction pass, split between the warps, so the output pass has no global load.

Measured (isolated timer, T = 8192, M = 4, kv packed; save / no save, µs), each column a knob variant beside the
default in one session:

==========================  ===============  ===============  ===========================
GPU, H                      row schedule     TOKEN_STAGE_V    token schedule, no v stage
==========================  ===============  ===============  ===========================
H100 80GB HBM3, 4096        357.8 / 358.1    343.3 / 342.6    297.6 / 296.9
H100 80GB HBM3, 7168        660.1 / 660.4    604.3 / 603.3    613.7 / 611.6
H200, 4096                  252.2 / 250.9    277.5 / 276.9    222.9 / 221.0
H200, 7168                  467.5 / 466.7    488.7 / 488.0    495.4 / 493.3
==========================  ===============  ===============  ===========================

(2026-12-05; on the H200 the no-stage column at 7168 read 539.8 / 538.5 in another invocation of the same
session.) The default follows the H200: the token schedule where its x stage is at most ``TOKEN_SMEM_MAX`` = 44
KiB (5 CTAs an SM, as the row schedule has; H up to 5632 at M = 4), the row schedule above (H = 7168: 56 KiB, 4 CTAs).
At H = 4096 the token schedule moves the op's 873 MB in 222 µs on the H200 (94% of its same-bytes copy) and in
297 µs on the H100 (~98%). TileKernels 2.1.0 on that H200: 232.1 / 230.9 at 4096, 406.2 / 402.9 at 7168. Every
knob set's GPU test gave the row schedule's bits.

Why staging v costs at H = 4096 (computed, sm_90, M = 4, 128 threads a CTA; ptxas of CUDA 13.0): registers 95 with the v
stage (save and not, both sizes), 90 / 88 (save / no save) without; 95 and 90 round to 96 a thread, 3072 a warp, 21
warps of the SM's 65536 registers; 88 to 2816 a warp, 23 warps: 5 CTAs of 4 warps either way. Shared memory: the stage
plus the 1 KiB the system reserves a CTA, of 228 KiB an SM: 41 KiB with the v stage (5 CTAs), 33 KiB without (6). So
both run 5 CTAs (20 warps) an SM at 4096: staging v costs no occupancy there. What differs is the L1 the stage leaves:
shared memory and L1 share 256 KiB an SM, the shared part one of 0, 8, 16, 32, 64, 100, 132, 164, 196, 228 KiB; 5 x 41 =
205 KiB needs the 228 KiB split (28 KiB of L1), 5 x 33 = 165 KiB (1 KiB over 164) the 196 KiB split (60 KiB of L1). The
5 CTAs of an SM read the same weight (``M * H * 4`` = 64 KiB) through L1, and without the v stage the M warps' v reads
too: 60 KiB can keep most of the weight, 28 KiB under half, so with the v stage more of the weight's reads go on to L2.
At 7168 both leave 28 KiB of L1 (3 x 71 = 213 KiB and 4 x 57 = 228 KiB: the 228 KiB split) and the v stage is the faster
(604.3 against 613.7 µs) despite 3 CTAs an SM against 4: the measurements follow the L1 left, not the CTAs an SM. Not
measured: that the driver picks the smallest split that keeps the occupancy (ncu's "Shared Memory Configuration Size"),
and the L1 hit rates themselves (ncu's l1tex hit rate and lts throughput would show them).

Other knob values of the token schedule (each gives the same bits; its GPU test passed in that H100 run):
``TOKEN_ROWS = 2`` loads the weight once for two tokens (its stage is twice the size, so fewer shapes fit
``TOKEN_SMEM_MAX``); ``LOADS_AHEAD = 7`` with ``TOKEN_MIN_WARPS = 12`` deepens the load groups less than the
default's 8 with 20 (more bytes in flight an SM).
"""

import struct

import torch

from tilefuse import _jit, _launch, _ops
from tilefuse._rn import add as _add, call as _f, div as _div, fma as _fma, mul as _mul, sub as _sub

KERNEL_HELPERS = ("tilefuse._rn",)  # part of this module's kernel cache key (_jit._module_digest)

# ---- tuning knobs (TILEFUSE_KNOBS; results unchanged) ----
WARPS = 4            # gate forward: warps per CTA, one (token, branch) row at a time each
ROWS_PER_WARP = 2    # gate forward: tokens each warp handles in turn (token block = WARPS * ROWS_PER_WARP)
LOADS_AHEAD = 8      # gate forward: chunks whose loads are issued before their arithmetic
FW_THREADS = 128     # fused_weight: threads per CTA (8 elements each)
TOKEN_CTA = True     # gate forward: the token schedule (a CTA per TOKEN_ROWS tokens, warp h = branch h, x staged
                     # in smem) where token_schedule takes the shape; False: the row schedule everywhere
TOKEN_ROWS = 1       # token schedule: tokens each warp carries at once (one weight load serves them all)
# token schedule: the largest stage (bytes) a CTA takes; larger: the row schedule. 44 KiB (+ 1 KiB reserved) keeps
# 5 CTAs an SM, the row schedule's occupancy; the H200 measured the row schedule faster at a larger stage (module
# doc: H = 7168 at M = 4, 56 KiB, 4 CTAs)
TOKEN_SMEM_MAX = 44 * 1024
TOKEN_MAX_M = 8      # token schedule: the most branches (warps) a CTA takes; more: the row schedule
TOKEN_MIN_WARPS = 20  # token schedule: __launch_bounds__' minimum CTAs per SM is TOKEN_MIN_WARPS // M (a register
                      # cap of 65536 / (32 * TOKEN_MIN_WARPS) a thread whatever M; 0: none)
TOKEN_STAGE_V = False  # token schedule: v staged in shared memory in the reduction pass (False: the output
                      # pass loads it, LOADS_AHEAD chunks at a time; the M warps' reads of it are L1 / L2 hits)

CHUNK = 256      # columns of one warp step (32 lanes x 8)
V = 8            # bf16 columns per lane per chunk: one 16-byte vector
LANES = 32
MIN_H = 512
MAX_H = 12288    # the weight row staged in shared memory: H * 4 bytes <= 48 KiB
BF16, F32, I64 = "bfloat16", "float32", "int64"


def _c_h(H: int) -> float:
    """``c_H``: ``H^-0.5`` evaluated in double and rounded once to fp32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", H ** -0.5))[0]


# ---- gate forward ----

def gate_fwd_kernel(M: int, H: int, save: bool):
    """Factory: the gate forward for ``M`` branches of hidden size ``H``; ``save`` adds the four statistics.

    Arguments at launch: ``X [T, M, H]`` bf16; ``K``, ``Vv``: the storage ``k [T, M, H]`` and ``v [T, H]`` span,
    from their first element, viewed as ``[vectors, 8]`` bf16; ``W [M, H]`` fp32; ``OUT [T, M, H]`` bf16; with
    ``save`` ``DOT``, ``G``, ``RX``, ``RK`` ``[T, M]`` fp32; then the ints ``k_s0``, ``k_s1``, ``v_s0`` (the
    strides of ``k``'s token and branch and of ``v``'s token dimension, in vectors) and the floats ``eps``,
    ``clamp``.
    """
    import tilelang.language as T

    assert M >= 1 and H % CHUNK == 0 and MIN_H <= H <= MAX_H, (M, H)
    Tn, k_vecs, v_vecs = T.dynamic("num_tokens, k_vectors, v_vectors", I64)
    body = (_token_body if token_schedule(M, H) else _row_body)(T, M, H, save, Tn)

    # every parameter gets its own annotation object: TileLang binds parameters by their buffer objects
    if save:
        @T.prim_func
        def engram_gate_fwd(X: T.Tensor((Tn, M, H), BF16), K: T.Tensor((k_vecs, V), BF16),
                            Vv: T.Tensor((v_vecs, V), BF16), W: T.Tensor((M, H), F32),
                            OUT: T.Tensor((Tn, M, H), BF16), DOT: T.Tensor((Tn, M), F32), G: T.Tensor((Tn, M), F32),
                            RX: T.Tensor((Tn, M), F32), RK: T.Tensor((Tn, M), F32), k_s0: T.int64, k_s1: T.int64,
                            v_s0: T.int64, eps: T.float32, clamp: T.float32):
            body(X, K, Vv, W, OUT, (DOT, G, RX, RK), k_s0, k_s1, v_s0, eps, clamp)
    else:
        @T.prim_func
        def engram_gate_fwd(X: T.Tensor((Tn, M, H), BF16), K: T.Tensor((k_vecs, V), BF16),
                            Vv: T.Tensor((v_vecs, V), BF16), W: T.Tensor((M, H), F32),
                            OUT: T.Tensor((Tn, M, H), BF16), k_s0: T.int64, k_s1: T.int64, v_s0: T.int64,
                            eps: T.float32, clamp: T.float32):
            body(X, K, Vv, W, OUT, None, k_s0, k_s1, v_s0, eps, clamp)

    return engram_gate_fwd


def _row_body(T, M: int, H: int, save: bool, Tn):
    """The row schedule (``TOKEN_CTA = False`` or a shape ``token_schedule`` does not take; "Row schedule" in the
    module docstring): CTA ``b * M + h`` takes branch ``h`` of token block ``b``."""
    C = H // CHUNK
    U = max(1, min(LOADS_AHEAD, C))  # chunks per load group
    groups = -(-C // U)
    threads = WARPS * LANES
    TB = WARPS * ROWS_PER_WARP
    quads = H // 4
    fill_steps = -(-quads // threads)

    @T.macro
    def body(X, K, Vv, W, OUT, stats, k_s0, k_s1, v_s0, eps, clamp):
        with T.Kernel(T.ceildiv(Tn, TB) * M, threads=threads) as bx:
            tid = T.get_thread_binding()
            lane = tid % LANES
            warp = tid // LANES
            h = bx % M
            blk = T.cast(bx // M, I64)
            ws = T.alloc_shared((H,), F32)
            wq = T.alloc_local((4,), F32)
            xb = T.alloc_local((U * V,), BF16)
            kb = T.alloc_local((U * V,), BF16)
            vb = T.alloc_local((U * V,), BF16)
            wv = T.alloc_local((V,), F32)
            ob = T.alloc_local((V,), BF16)
            acc = T.alloc_local((3,), F32)  # Sxx, Skk, D
            sc = T.alloc_local((4,), F32)   # rx, rk, s, then u and g
            # the branch's weight row, chunk halves interleaved (see the module docstring)
            for f in T.serial(fill_steps):
                j = f * threads + tid
                if j < quads:
                    for e in T.vectorized(4):
                        wq[e] = W[h, j * 4 + e]
                    for e in T.vectorized(4):
                        ws[(j // 64) * CHUNK + (j % 2) * 128 + ((j % 64) // 2) * 4 + e] = wq[e]
            T.sync_threads()
            for r in T.serial(ROWS_PER_WARP):
                t = blk * TB + r * WARPS + warp
                if t < Tn:  # the same for the whole warp: every lane takes part in the shuffles
                    k_row = t * k_s0 + h * k_s1 + lane  # the lane's vector of chunk 0 (vectors of 8 elements)
                    v_row = t * v_s0 + lane
                    for a in T.unroll(3):
                        acc[a] = T.float32(0.0)
                    # reduction: chunks in increasing order, U loaded ahead of their arithmetic
                    for s in T.serial(groups):
                        for u in T.unroll(U):
                            c = s * U + u
                            if c < C:
                                for e in T.vectorized(V):
                                    xb[u * V + e] = X[t, h, c * CHUNK + lane * V + e]
                                for e in T.vectorized(V):
                                    kb[u * V + e] = K[k_row + c * LANES, e]
                        for u in T.unroll(U):
                            c = s * U + u
                            if c < C:
                                for e in T.vectorized(4):
                                    wv[e] = ws[c * CHUNK + lane * 4 + e]
                                for e in T.vectorized(4):
                                    wv[4 + e] = ws[c * CHUNK + 128 + lane * 4 + e]
                                for i in T.unroll(V):
                                    xf = T.cast(xb[u * V + i], F32)
                                    kf = T.cast(kb[u * V + i], F32)
                                    acc[0] = _fma(xf, xf, acc[0])
                                    acc[1] = _fma(kf, kf, acc[1])
                                    acc[2] = _fma(_mul(xf, wv[i]), kf, acc[2])
                    for d in (16, 8, 4, 2, 1):
                        for a in T.unroll(3):
                            acc[a] = _add(acc[a], T.shfl_xor(acc[a], d))
                    one = T.float32(1.0)
                    sc[0] = _div(one, _f("__fsqrt_rn", _add(_div(acc[0], T.float32(H)), eps)))
                    sc[1] = _div(one, _f("__fsqrt_rn", _add(_div(acc[1], T.float32(H)), eps)))
                    sc[2] = _mul(_mul(_mul(acc[2], sc[0]), sc[1]), T.float32(_c_h(H)))
                    sc[3] = _f("fabsf", sc[2])
                    sc[3] = _f("copysignf", _f("__fsqrt_rn", T.if_then_else(sc[3] < clamp, clamp, sc[3])), sc[2])
                    sc[3] = _div(one, _add(one, _f("expf", _sub(T.float32(0.0), sc[3]))))
                    if save:
                        DOT, G, RX, RK = stats
                        if lane == 0:
                            DOT[t, h] = acc[2]
                            G[t, h] = sc[3]
                            RX[t, h] = sc[0]
                            RK[t, h] = sc[1]
                    # output: chunks in decreasing order (the last ones read are the likeliest still in L1)
                    for s in T.serial(groups):
                        for u in T.unroll(U):
                            c = C - 1 - (s * U + u)
                            if c >= 0:
                                for e in T.vectorized(V):
                                    xb[u * V + e] = X[t, h, c * CHUNK + lane * V + e]
                                for e in T.vectorized(V):
                                    vb[u * V + e] = Vv[v_row + c * LANES, e]
                        for u in T.unroll(U):
                            c = C - 1 - (s * U + u)
                            if c >= 0:
                                for i in T.unroll(V):
                                    ob[i] = T.cast(_fma(sc[3], T.cast(vb[u * V + i], F32), T.cast(xb[u * V + i], F32)),
                                                   BF16)
                                for e in T.vectorized(V):
                                    OUT[t, h, c * CHUNK + lane * V + e] = ob[e]

    return body


def token_schedule(M: int, H: int) -> bool:
    """Whether the gate forward of ``(M, H)`` takes the token schedule (``TOKEN_CTA``): one warp a branch, at most
    ``TOKEN_MAX_M`` warps a CTA, the CTA's stage within ``TOKEN_SMEM_MAX`` bytes; otherwise the row schedule."""
    return bool(TOKEN_CTA) and M <= TOKEN_MAX_M and _token_smem(M, H) <= TOKEN_SMEM_MAX


def _token_smem(M: int, H: int) -> int:
    """Shared bytes of a token-schedule CTA: the x rows and (``TOKEN_STAGE_V``) the v row of its ``TOKEN_ROWS`` tokens,
    bf16."""
    return TOKEN_ROWS * (M + int(bool(TOKEN_STAGE_V))) * H * 2


def gate_fwd_grid(num_tokens: int, M: int, H: int) -> tuple[int, int, int]:
    """``(CTAs, threads, shared bytes)`` of the gate forward launch for ``(M, H)`` under the current knobs."""
    if token_schedule(M, H):
        return -(-num_tokens // TOKEN_ROWS), M * LANES, _token_smem(M, H)
    return -(-num_tokens // (WARPS * ROWS_PER_WARP)) * M, WARPS * LANES, H * 4


def _token_body(T, M: int, H: int, save: bool, Tn):
    """The token schedule (``TOKEN_CTA``, see "Token schedule" in the module docstring): CTA ``b`` takes tokens
    ``b * TW .. b * TW + TW - 1`` (``TW = TOKEN_ROWS``), warp ``h`` their branch ``h``; the arithmetic is the row
    schedule's, operation for operation (the same per-row chains, butterfly and scalar chain), so the bits are too."""
    C = H // CHUNK
    U = max(1, min(LOADS_AHEAD, C))  # chunks per load group
    groups = -(-C // U)
    VQ = -(-U // M) if TOKEN_STAGE_V else 0  # v chunks a warp stages per group: chunk s * U + q * M + h
    R = M + 1 if TOKEN_STAGE_V else M  # rows of a token's stage: its M x rows, then the v row
    TW = TOKEN_ROWS
    threads = M * LANES

    @T.macro
    def body(X, K, Vv, W, OUT, stats, k_s0, k_s1, v_s0, eps, clamp):
        with T.Kernel(T.ceildiv(Tn, TW), threads=threads) as bx:
            if TOKEN_MIN_WARPS:
                T.annotate_min_blocks_per_sm(max(1, TOKEN_MIN_WARPS // M))
            tid = T.get_thread_binding()
            lane = tid % LANES
            h = tid // LANES
            t0 = T.cast(bx, I64) * TW
            xs = T.alloc_shared((TW * R * H,), BF16)  # [token, M x rows then the v row, H]
            xb = T.alloc_local((TW * U * V,), BF16)
            kb = T.alloc_local((TW * U * V,), BF16)
            vb = T.alloc_local(((TW * VQ if VQ else U) * V,), BF16)
            wv = T.alloc_local((U * V,), F32)
            ob = T.alloc_local((V,), BF16)
            acc = T.alloc_local((TW * 3,), F32)  # per token: Sxx, Skk, D
            sc = T.alloc_local((TW * 4,), F32)   # per token: rx, rk, s, then u and g
            for a in T.unroll(TW * 3):
                acc[a] = T.float32(0.0)
            # reduction: chunks in increasing order, U loaded ahead of their arithmetic; the group's v chunks are
            # loaded by the warps in turn and staged for the output pass
            for s in T.serial(groups):
                for u in T.unroll(U):
                    c = s * U + u
                    if c < C:
                        for e in T.vectorized(4):
                            wv[u * V + e] = W[h, c * CHUNK + lane * V + e]
                        for e in T.vectorized(4):
                            wv[u * V + 4 + e] = W[h, c * CHUNK + lane * V + 4 + e]
                        for j in T.unroll(TW):
                            if t0 + j < Tn:  # the same for the whole CTA
                                for e in T.vectorized(V):
                                    xb[(j * U + u) * V + e] = X[t0 + j, h, c * CHUNK + lane * V + e]
                                for e in T.vectorized(V):
                                    kb[(j * U + u) * V + e] = K[(t0 + j) * k_s0 + h * k_s1 + c * LANES + lane, e]
                if VQ:
                    for q in T.unroll(VQ):
                        c = s * U + q * M + h
                        if q * M + h < U and c < C:
                            for j in T.unroll(TW):
                                if t0 + j < Tn:
                                    for e in T.vectorized(V):
                                        vb[(j * VQ + q) * V + e] = Vv[(t0 + j) * v_s0 + c * LANES + lane, e]
                for u in T.unroll(U):
                    c = s * U + u
                    if c < C:
                        for j in T.unroll(TW):
                            if t0 + j < Tn:
                                for e in T.vectorized(V):
                                    xs[(j * R + h) * H + c * CHUNK + lane * V + e] = xb[(j * U + u) * V + e]
                                for i in T.unroll(V):
                                    xf = T.cast(xb[(j * U + u) * V + i], F32)
                                    kf = T.cast(kb[(j * U + u) * V + i], F32)
                                    acc[j * 3] = _fma(xf, xf, acc[j * 3])
                                    acc[j * 3 + 1] = _fma(kf, kf, acc[j * 3 + 1])
                                    acc[j * 3 + 2] = _fma(_mul(xf, wv[u * V + i]), kf, acc[j * 3 + 2])
                if VQ:
                    for q in T.unroll(VQ):
                        c = s * U + q * M + h
                        if q * M + h < U and c < C:
                            for j in T.unroll(TW):
                                if t0 + j < Tn:
                                    for e in T.vectorized(V):
                                        xs[(j * R + M) * H + c * CHUNK + lane * V + e] = vb[(j * VQ + q) * V + e]
            T.sync_threads()  # the v rows, staged by all warps (TileLang would place one here in any case)
            for j in T.unroll(TW):
                t = t0 + j
                if t < Tn:  # the same for the whole CTA: every lane takes part in the shuffles
                    for d in (16, 8, 4, 2, 1):
                        for a in T.unroll(3):
                            acc[j * 3 + a] = _add(acc[j * 3 + a], T.shfl_xor(acc[j * 3 + a], d))
                    one = T.float32(1.0)
                    sc[j * 4] = _div(one, _f("__fsqrt_rn", _add(_div(acc[j * 3], T.float32(H)), eps)))
                    sc[j * 4 + 1] = _div(one, _f("__fsqrt_rn", _add(_div(acc[j * 3 + 1], T.float32(H)), eps)))
                    sc[j * 4 + 2] = _mul(_mul(_mul(acc[j * 3 + 2], sc[j * 4]), sc[j * 4 + 1]), T.float32(_c_h(H)))
                    sc[j * 4 + 3] = _f("fabsf", sc[j * 4 + 2])
                    sc[j * 4 + 3] = _f("copysignf", _f("__fsqrt_rn", T.if_then_else(sc[j * 4 + 3] < clamp, clamp,
                                                                                     sc[j * 4 + 3])), sc[j * 4 + 2])
                    sc[j * 4 + 3] = _div(one, _add(one, _f("expf", _sub(T.float32(0.0), sc[j * 4 + 3]))))
                    if save:
                        DOT, G, RX, RK = stats
                        if lane == 0:
                            DOT[t, h] = acc[j * 3 + 2]
                            G[t, h] = sc[j * 4 + 3]
                            RX[t, h] = sc[j * 4]
                            RK[t, h] = sc[j * 4 + 1]
                    if TOKEN_STAGE_V:  # output: x and v from the stage, no global loads
                        for c in T.serial(C):
                            for e in T.vectorized(V):
                                xb[e] = xs[(j * R + h) * H + c * CHUNK + lane * V + e]
                            for e in T.vectorized(V):
                                xb[V + e] = xs[(j * R + M) * H + c * CHUNK + lane * V + e]
                            for i in T.unroll(V):
                                ob[i] = T.cast(_fma(sc[j * 4 + 3], T.cast(xb[V + i], F32), T.cast(xb[i], F32)), BF16)
                            for e in T.vectorized(V):
                                OUT[t, h, c * CHUNK + lane * V + e] = ob[e]
                    else:  # output: x from the stage, v loaded U chunks ahead of their arithmetic
                        for s in T.serial(groups):
                            for u in T.unroll(U):
                                c = s * U + u
                                if c < C:
                                    for e in T.vectorized(V):
                                        vb[u * V + e] = Vv[t * v_s0 + c * LANES + lane, e]
                            for u in T.unroll(U):
                                c = s * U + u
                                if c < C:
                                    for e in T.vectorized(V):
                                        xb[e] = xs[(j * R + h) * H + c * CHUNK + lane * V + e]
                                    for i in T.unroll(V):
                                        ob[i] = T.cast(_fma(sc[j * 4 + 3], T.cast(vb[u * V + i], F32),
                                                            T.cast(xb[i], F32)), BF16)
                                    for e in T.vectorized(V):
                                        OUT[t, h, c * CHUNK + lane * V + e] = ob[e]

    return body


# ---- fused_weight ----

def fused_weight_kernel():
    """Factory: ``OUT[j, e] = fp32(A[j, e]) * fp32(B[j, e])`` over ``n`` rows of 8 elements (``n`` runtime).
    Arguments at launch: ``A [n, 8]``, ``B [n, 8]`` bf16, ``OUT [n, 8]`` fp32 (the flattened ``[M, H]``)."""
    import tilelang.language as T

    threads = FW_THREADS
    n = T.dynamic("num_vectors", I64)

    @T.prim_func
    def engram_fused_weight(A: T.Tensor((n, V), BF16), B: T.Tensor((n, V), BF16), OUT: T.Tensor((n, V), F32)):
        with T.Kernel(T.ceildiv(n, threads), threads=threads) as bx:
            a = T.alloc_local((V,), BF16)
            b = T.alloc_local((V,), BF16)
            o = T.alloc_local((V,), F32)
            j = T.cast(bx, I64) * threads + T.get_thread_binding()
            if j < n:
                for e in T.vectorized(V):
                    a[e] = A[j, e]
                for e in T.vectorized(V):
                    b[e] = B[j, e]
                for e in T.unroll(V):
                    o[e] = _mul(T.cast(a[e], F32), T.cast(b[e], F32))
                for e in T.vectorized(V):
                    OUT[j, e] = o[e]

    return engram_fused_weight


# The bench's launches (the T = 8192, M = 4, H in {4096, 7168}, statistics saved and not); any other
# config compiles on first use.
BENCH_M = 4
BENCH_H = (4096, 7168)


def _gate_configs() -> list[tuple]:
    return [(BENCH_M, h, save) for h in BENCH_H for save in (True, False)]


_jit.register("engram_gate_fwd", gate_fwd_kernel, _gate_configs)
_jit.register("engram_fused_weight", fused_weight_kernel, lambda: [()])


# ---- launchers (no validation: the public ops validate) ----

def takes(hidden_states: torch.Tensor) -> bool:
    """Whether the gate kernel takes these (validated) arguments: CUDA and ``H <= MAX_H``."""
    return hidden_states.is_cuda and hidden_states.shape[-1] <= MAX_H


def _new(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised output buffer (one place, so tests can hand out poisoned buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _packed(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor with the standard strides (a size-1 dimension may carry any stride) and a 16-byte
    aligned base (copied when not)."""
    t = _launch.aligned(t)
    want, step = [], 1
    for size in reversed(t.shape):
        want.append(step)
        step *= size
    want = tuple(reversed(want))
    return t if t.stride() == want else t.as_strided(t.shape, want)


def _vector_rows(t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``t`` (unit last stride) as the kernel reads it: the storage span from its first element to its last, viewed
    as rows of 8 elements (16-byte vectors), and its other strides in vectors (0 for a dimension of size 1, whose
    stride is never used). A base that is not 16-byte aligned, or a stride that is not a multiple of 8 elements,
    makes a contiguous copy first (the kernel's 16-byte vectors)."""
    dims = list(zip(t.shape[:-1], t.stride()[:-1]))
    if t.data_ptr() % 16 or any(s % V for n, s in dims if n > 1):
        t = _packed(t.contiguous())
        dims = list(zip(t.shape[:-1], t.stride()[:-1]))
    span = t.shape[-1] + sum((n - 1) * s for n, s in dims)
    return t.as_strided((span // V, V), (V, 1)), [s // V if n > 1 else 0 for n, s in dims]


def gate_fwd_launch(hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight_fused: torch.Tensor,
                    eps: float, clamp_value: float, save_for_backward: bool):
    """``(out, dot, gate_score, rstd_x, rstd_k)`` of §2.4 (the last four ``None`` unless ``save_for_backward``).
    Validates nothing; ``T = 0`` launches nothing."""
    t, m, h = hidden_states.shape
    dev = hidden_states.device
    out = _new((t, m, h), torch.bfloat16, dev)
    stats = [_new((t, m), torch.float32, dev) for _ in range(4)] if save_for_backward else []
    if t:
        k_flat, (k_s0, k_s1) = _vector_rows(k)
        v_flat, (v_s0,) = _vector_rows(v)
        _jit.get("engram_gate_fwd", (m, h, bool(save_for_backward)))(
            _packed(hidden_states), k_flat, v_flat, _packed(weight_fused), out, *stats, k_s0, k_s1, v_s0,
            float(eps), float(clamp_value))
    if not save_for_backward:
        return out, None, None, None, None
    return (out, *stats)


def fused_weight_launch(weight_hidden: torch.Tensor, weight_embed: torch.Tensor) -> torch.Tensor:
    """``fp32(w_h) * fp32(w_e)`` as a new ``[M, H]`` fp32 tensor (``H % 8 == 0``). Validates nothing."""
    out = _new(tuple(weight_hidden.shape), torch.float32, weight_hidden.device)
    n = out.numel() // V
    if n:
        _jit.get("engram_fused_weight", ())(_packed(weight_hidden).view(n, V), _packed(weight_embed).view(n, V),
                                            out.view(n, V))
    return out


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::engram_gate_fwd", mutates_args=(), device_types="cuda")
def _gate_fwd_op(hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight_fused: torch.Tensor,
                 eps: float, clamp_value: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                          torch.Tensor]:
    return gate_fwd_launch(hidden_states, k, v, weight_fused, eps, clamp_value, True)


@_gate_fwd_op.register_fake
def _(hidden_states, k, v, weight_fused, eps, clamp_value):
    t, m, _ = hidden_states.shape
    return (hidden_states.new_empty(hidden_states.shape),
            *(weight_fused.new_empty((t, m)) for _ in range(4)))


@_ops.kernel_op("tilefuse::engram_gate_fwd_nosave", mutates_args=(), device_types="cuda")
def _gate_fwd_nosave_op(hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight_fused: torch.Tensor,
                        eps: float, clamp_value: float) -> torch.Tensor:
    return gate_fwd_launch(hidden_states, k, v, weight_fused, eps, clamp_value, False)[0]


@_gate_fwd_nosave_op.register_fake
def _(hidden_states, k, v, weight_fused, eps, clamp_value):
    return hidden_states.new_empty(hidden_states.shape)


@_ops.kernel_op("tilefuse::engram_fused_weight", mutates_args=(), device_types="cuda")
def _fused_weight_op(weight_hidden: torch.Tensor, weight_embed: torch.Tensor) -> torch.Tensor:
    return fused_weight_launch(weight_hidden, weight_embed)


@_fused_weight_op.register_fake
def _(weight_hidden, weight_embed):
    return weight_hidden.new_empty(weight_hidden.shape, dtype=torch.float32)


# ---- CUDA entries: a direct launch in eager mode, the custom op under torch.compile ----

def gate_fwd_cuda(hidden_states, k, v, weight_fused, eps: float, clamp_value: float, save_for_backward: bool):
    """CUDA entry of the gate forward: ``(out, dot, gate_score, rstd_x, rstd_k)``, statistics ``None`` unless
    ``save_for_backward``."""
    if torch.compiler.is_compiling():
        if save_for_backward:
            return torch.ops.tilefuse.engram_gate_fwd(hidden_states, k, v, weight_fused, eps, clamp_value)
        out = torch.ops.tilefuse.engram_gate_fwd_nosave(hidden_states, k, v, weight_fused, eps, clamp_value)
        return out, None, None, None, None
    return gate_fwd_launch(hidden_states, k, v, weight_fused, eps, clamp_value, save_for_backward)


def fused_weight_cuda(weight_hidden, weight_embed) -> torch.Tensor:
    """CUDA entry of ``fused_weight``."""
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.engram_fused_weight(weight_hidden, weight_embed)
    return fused_weight_launch(weight_hidden, weight_embed)
