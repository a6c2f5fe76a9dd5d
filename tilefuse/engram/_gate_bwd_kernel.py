"""TileLang kernels of the Engram gate backward (engram.md §2.5, v1) and of the weight-gradient reduction (§2.6):
``engram_gate_bwd`` and ``engram_grad_w_reduce``.

Gate backward. Layout: ``grad_out``, ``x`` ``(T, 4, H)`` bf16 contiguous; ``k`` ``(T, 4, H)`` and ``v`` ``(T, H)``
bf16 with runtime (64-bit) token/branch strides and a unit last stride; ``w`` ``(4, H)`` fp32; the statistics
``dot, gate_score, rstd_x, rstd_k`` ``(T, 4)`` fp32; outputs ``grad_x``, ``grad_k`` ``(T, 4, H)``, ``grad_v``
``(T, H)`` bf16 (contiguous) and ``grad_w_partial`` ``(P, 4, H)`` fp32. ``T`` and ``P`` are runtime values; ``H``
is compile-time (the only key). ``c_H = fp32(H^-1/2)``, ``fp32(clamp_value)`` and ``fp32(H)`` are launch arguments.

One CTA per partial ``p``: it walks the tokens of chunk ``p`` (``q = ceil(T / P)`` consecutive tokens from ``p q``,
§2.5.4; an empty chunk walks none) in ascending order. A *vector* is ``V = 8`` adjacent columns of one branch (16
bytes of bf16); thread ``i`` owns the vectors ``j * threads + i`` (``j < J``) of every branch, so each warp access
is coalesced. Per token:

1. loads its ``grad_out`` vectors of the 4 branches, its ``v`` vectors and the token's 4 statistics of each kind
   (one 16-byte load each); ``grad_v = bf16(((0 + RN(G_0 g_0)) + RN(G_1 g_1)) + ...)`` (branches ascending, §2.5.2);
2. ``dg_h = Σ_d G v`` (∂L/∂g): the thread's partial by fma in column order, an XOR butterfly in the warp (16, 8, 4,
   2, 1), the warps' sums in shared memory (double-buffered by token parity: one barrier a token), then every
   thread adds the warp sums in warp order. The order depends only on ``H``, never on ``T``, ``P`` or the token's
   place: deterministic and batch-invariant (the spec leaves this order free, §2.5.2 informative note);
3. ``β``, ``qx``, ``qk`` exactly as the reference (``tilefuse.reference.engram._gate_bwd``) rounds them:
   ``β = 0`` if ``((|D| c_H) rx) rk < clamp`` else ``(((dg g) (1 - g)) 0.5) sqrt((c_H rx) rk / |D|)``,
   ``qx = ((D rx) rx) / H``; then per column ``grad_x = bf16(G + β (k w - x qx))``,
   ``grad_k = bf16(β (x w - k qk))`` and the chunk's weight-gradient sum ``acc = acc + (β x) k`` (from 0, two
   roundings a term as the reference's ``_chunk_sum``; written to ``grad_w_partial[p]`` after the last token, zeros
   for an empty chunk).

Every fp32 operation is an explicit ``__f*_rn`` intrinsic (no contraction, IEEE division and square root), in the
reference's order: given the same ``dg`` every output is the reference's bits (the tests make ``dg`` exact to check
this); ``dg`` itself differs from the reference's sum by rounding only. No atomics.

Storage (changes no result): ``w`` is staged in shared memory, each thread reading back only what it wrote (no
barrier). ``grad_out`` stays in registers across the barrier (``KEEP_GO_J``). With one vector a branch (``J = 1``,
H <= 4096) the sums, ``x`` and ``k`` are in registers too, and ``x``, ``k`` are loaded with ``grad_out`` and ``v``,
before the barrier (``EARLY_XK_J``). With two (``J = 2``) the sums live in shared memory when they fit
(``ACC_SMEM_J``; H <= 7168: 224 KiB with ``w``) and ``x``, ``k`` are loaded after the barrier.

Prefetch (``PREFETCH``, off by default; ``H <= 4096``, where the stages fit: other ``H`` build the kernel above).
Two shared-memory stages of a token's inputs: each thread's vectors of grad_out, x, k (4 branches) and v
(``[stage, plane, thread, 16 bytes]``, 26 H bytes a stage) and each warp's copy of the token's statistics (64 bytes,
copied by its lane 0). Token ``s + 1``'s ``cp.async`` copies (one commit group a token) are issued before token
``s``'s work; a thread then waits for its own group of token ``s``, and the warp's barrier (``__syncwarp``) hands
lane 0's statistics to the warp. Each thread reads back only the vectors it copied, and a stage is copied over only
after the CTA's barrier of the token that read it, so a token keeps one CTA barrier (the dg reduction's). grad_out,
x and k are read from the stage where used (not held across the barrier;
``EARLY_XK_J``, ``KEEP_GO_J`` do not apply) and ``w`` is in registers (32 a thread), not shared memory. At H = 4096:
208 KiB of stages, 2 KiB of statistics, 512 bytes of dg sums; ptxas (sm_90): 128 registers (512 threads), no
spills; H = 2048 163, H = 1024 186. The same operations in the same order: the default kernel's bits.

Early x and k (``XK_ASYNC``, on by default; two vectors a thread with the sums in shared memory, ``4608 <= H <=
7168``: other ``H`` build the kernel above). At a token's start, with its grad_out and v loads, each thread issues
``cp.async`` copies of its vectors of the token's x and k (4 branches, 2 vectors, 2 planes; one commit group) into a
shared stage (``[plane, j, thread, 16 bytes]``, 16 H bytes: 112 KiB at H = 7168) that takes the place of ``w``'s;
after the dg barrier it waits for its group, and step 4 reads x and k from the stage. One stage: each thread reads
back only the vectors it copied, and issues the next token's copies after those reads (a warp barrier before the
copies keeps the compiler from moving the reads past them; the wait, an extern call, is followed by one too). The
token loop keeps one CTA barrier (TileLang's planner adds one after the loop at H = 5632, 6144). ``w`` is read from
global memory where used (the same ``16 H`` bytes each token); ``EARLY_XK_J`` does not apply. ptxas (sm_90, no
spills): H = 7168 127 registers (448 threads), H = 4608 153 (288). Held in registers instead, ``w`` would spill at H
= 7168 (292 bytes; 448 threads leave a thread at most 128 registers). The same operations in the same order: the
bits of the kernel above (``XK_ASYNC = False``).

Weight-gradient reduction: one thread per ``REDUCE_VEC`` consecutive elements of the flattened ``(M·H)``
accumulators; ``S = 0 + partial[0] + partial[1] + ...`` in ascending ``p`` (the loads of ``REDUCE_ROWS`` rows issued
before their adds, so about ``M·H·REDUCE_ROWS·4`` bytes are in flight: the order is the same), then
``acc_h = fma(S, w_e, acc_h)`` and ``acc_e = fma(S, w_h, acc_e)`` (§2.6): the reference's bits. Every size is a
runtime value (one binary).

Kernel constraints: CUDA tensors; the gate backward needs ``M == 4``, ``H % 512 == 0`` and
``1024 <= H <= MAX_H`` (at most two vectors a thread and branch); the public op keeps the reference path for
``H > MAX_H``. The reduction takes every validated input.

Speed: docs/BENCHMARKS.md (its mHC and Engram section). One CTA an SM (``P = 132`` CTAs); ptxas (sm_90, no spills): H
= 4096 128 registers (512 threads), H = 7168 128 (448 threads, 224 KiB shared memory), H = 1024 212 (128 threads);
every H % 512 == 0 from 1024 to 8192 builds, and only H = 7680, 8192 (sums in registers: shared memory too small)
spill, about 300 bytes a thread. The reduction: 254 registers at ``REDUCE_ROWS = 132`` (all of the op's 132
partials in flight), no spills. What a CTA overlaps without the knobs is one token's loads with the previous token's
stores; with ``PREFETCH`` the next token's loads overlap this token's work too; with ``XK_ASYNC`` a token's x and k
loads are in flight with its grad_out and v loads.
"""

import struct

import torch

from tilefuse import _jit, _launch, _ops
from tilefuse._rn import add as _add, call as _f, div as _div, fma as _fma, mul as _mul, sub as _sub

KERNEL_HELPERS = ("tilefuse._rn",)  # part of this module's kernel cache key (_jit._module_digest)

# ---- tuning knobs (TILEFUSE_KNOBS; results unchanged) ----
EARLY_XK_J = 1      # gate backward: x and k loaded with grad_out and v (before the barrier) when J <= this
KEEP_GO_J = 2       # gate backward: grad_out kept in registers across the barrier when J <= this, else read again
ACC_SMEM_J = 2      # gate backward: weight-gradient sums in shared memory (not registers) when J >= this and they fit
REDUCE_THREADS = 128  # reduction: threads per CTA
REDUCE_ROWS = 132     # reduction: partial rows whose loads a thread issues before their adds
REDUCE_VEC = 1        # reduction: consecutive elements a thread (1, 2 or 4; M·H must be a multiple)
PREFETCH = False    # gate backward: the next token's inputs copied into shared memory (cp.async) where they fit
XK_ASYNC = True     # gate backward, two vectors a thread: x and k copied to shared memory (cp.async) at a token's start

# Most threads a gate-backward CTA; a thread takes J = ceil(H / 8 / MAX_THREADS) vectors a branch. Not a knob: the
# thread layout fixes the order of the dg sums (lanes, then warps), so it is part of the results.
MAX_THREADS = 512

M = 4            # branches (the v1 backward's only multiplicity)
V = 8            # bf16 columns per vector (16 bytes)
WARP = 32
MAX_H = 8192
SMEM_BYTES = 227 * 1024  # shared memory a CTA may take (sm_90)
PLANES = 3 * M + 1       # a token's planes in a prefetch stage: grad_out, x, k of each branch, then v
STAGES = 2               # prefetch stages: the token computed and the next one in flight
BF, F32, I64 = "bfloat16", "float32", "int64"


def takes_hidden(H: int) -> bool:
    """Whether the gate backward kernel is built for hidden size ``H``."""
    return H % 512 == 0 and 1024 <= H <= MAX_H


def layout(H: int) -> tuple[int, int]:
    """``(J, threads)``: vectors a thread takes in each branch row, and threads a CTA (a multiple of 32)."""
    lanes = H // V
    J = -(-lanes // MAX_THREADS)
    threads = -(-(-(-lanes // J)) // WARP) * WARP
    return J, threads


def sums_in_smem(H: int) -> bool:
    """Whether the gate backward at ``H`` keeps the weight-gradient sums in shared memory (``ACC_SMEM_J``)."""
    J, threads = layout(H)
    return J >= ACC_SMEM_J and 2 * M * J * V * threads * 4 + 2 * (threads // WARP) * M * 4 <= SMEM_BYTES


def prefetches(H: int) -> bool:
    """Whether the gate backward at ``H`` takes ``PREFETCH``: the sums are in registers and the stages (each thread's
    vectors, each warp's copy of the statistics) and the dg buffer fit the shared memory: ``H <= 4096``."""
    J, threads = layout(H)
    warps = threads // WARP
    stages = STAGES * (PLANES * J * threads * V * 2 + warps * 4 * M * 4)
    return PREFETCH and not sums_in_smem(H) and stages + 2 * warps * M * 4 <= SMEM_BYTES


def xk_async(H: int) -> bool:
    """Whether the gate backward at ``H`` takes ``XK_ASYNC``: two vectors a thread with the sums in shared memory,
    where the stage of x and k (16 H bytes) takes the place of ``w``'s: ``4608 <= H <= 7168``."""
    return XK_ASYNC and layout(H)[0] == 2 and sums_in_smem(H)


def gate_bwd_kernel(H: int):
    """Factory: the gate backward at hidden size ``H`` (``takes_hidden(H)``). Launch: ``GO, X`` ``(T, 4, H)``,
    ``K`` ``(T, 4, H)`` strided, ``Vt`` ``(T, H)`` strided (bf16), ``W`` ``(4, H)``, ``D, GS, RX, RK`` ``(T, 4)``
    (fp32); outputs ``DX, DK`` ``(T, 4, H)``, ``DV`` ``(T, H)`` (bf16), ``DWP`` ``(P, 4, H)`` (fp32); then the floats
    ``c_h``, ``clamp``, ``hf`` (fp32 ``H``)."""
    import tilelang.language as T
    from tilelang import tvm

    assert takes_hidden(H), H
    J, threads = layout(H)
    lanes = H // V
    assert J * threads == lanes, (H, J, threads)  # H % 512 == 0 and J <= 2: the threads tile each row exactly
    warps = threads // WARP
    xk = xk_async(H)
    early = J <= EARLY_XK_J and not xk
    keep_go = J <= KEEP_GO_J
    MJV = M * J * V
    acc_smem = sums_in_smem(H)
    prefetch = prefetches(H)
    Tn, P, kT, kM, vT = T.dynamic("num_tokens, num_partials, k_token_stride, k_branch_stride, v_token_stride", I64)

    def vec(j, tid):
        """First column of the thread's vector ``j``."""
        return (j * threads + tid) * V

    def slot(h, j, half, tid):
        """Shared-memory offset of the thread's 4 fp32 ``half`` of vector ``j`` of branch ``h``."""
        return (((h * J + j) * 2 + half) * threads + tid) * 4

    def staged(st, plane, j, tid):
        """Offset in the prefetch stages of the thread's vector ``j`` of ``plane`` in stage ``st``."""
        return (((st * PLANES + plane) * J + j) * threads + tid) * V

    def stat(st, warp, kind):
        """Offset in the statistics' stages of warp ``warp``'s copy of ``kind`` (0 dot, 1 gate, 2 rstd_x, 3 rstd_k)."""
        return ((st * warps + warp) * 4 + kind) * M

    def cp16(dst, src):
        """16 bytes global -> shared by ``cp.async`` (TileLang's ``tl::cp_async_gs``) into element ``dst`` of a shared
        buffer, as an extern call given the destination as a byte offset from the buffer's base, so that TileLang's
        barrier planner sees no access: it cannot see that the copies are ordered by their issuer's wait (and, for
        the statistics, the warp's barrier) and would add CTA barriers (an element's address is an access it cannot
        bound, which it orders against every store to the same dynamic shared memory)."""
        offset = dst.indices[0] * (tvm.DataType(dst.buffer.dtype).bits // 8)
        return T.call_extern("void", "tl::cp_async_gs<16>", T.handle_add_byte_offset(dst.buffer.data, offset),
                             T.address_of(src))

    @T.macro
    def issue_xk(X, K, stg, t, st, x0, tid):
        """``cp.async`` of the thread's vectors of token ``t``'s x and k into stage ``st``: planes ``x0 + h`` (x)
        and ``x0 + M + h`` (k)."""
        for j in T.unroll(J):
            for h in T.unroll(M):
                cp16(stg[staged(st, x0 + h, j, tid)], X[t, h, vec(j, tid)])
                cp16(stg[staged(st, x0 + M + h, j, tid)], K[t, h, vec(j, tid)])

    @T.macro
    def issue(GO, X, K, Vt, D, GS, RX, RK, stg, sst, t, st, tid, lane, warp):
        """``cp.async`` of token ``t``'s inputs into stage ``st``: the thread's vectors of grad_out, x, k (plane
        ``h``, ``M + h``, ``2 M + h``) and v (plane ``3 M``), and by lane 0 the token's statistics for its warp."""
        for j in T.unroll(J):
            for h in T.unroll(M):
                cp16(stg[staged(st, h, j, tid)], GO[t, h, vec(j, tid)])
            cp16(stg[staged(st, 3 * M, j, tid)], Vt[t, vec(j, tid)])
        issue_xk(X, K, stg, t, st, M, tid)
        if lane == 0:
            cp16(sst[stat(st, warp, 0)], D[t, 0])
            cp16(sst[stat(st, warp, 1)], GS[t, 0])
            cp16(sst[stat(st, warp, 2)], RX[t, 0])
            cp16(sst[stat(st, warp, 3)], RK[t, 0])

    @T.prim_func
    def engram_gate_bwd(GO: T.Tensor((Tn, M, H), BF), X: T.Tensor((Tn, M, H), BF),
                        K: T.StridedTensor((Tn, M, H), (kT, kM, 1), BF),
                        Vt: T.StridedTensor((Tn, H), (vT, 1), BF),
                        W: T.Tensor((M, H), F32), D: T.Tensor((Tn, M), F32), GS: T.Tensor((Tn, M), F32),
                        RX: T.Tensor((Tn, M), F32), RK: T.Tensor((Tn, M), F32),
                        DX: T.Tensor((Tn, M, H), BF), DK: T.Tensor((Tn, M, H), BF), DV: T.Tensor((Tn, H), BF),
                        DWP: T.Tensor((P, M, H), F32), c_h: T.float32, clamp: T.float32, hf: T.float32):
        # the launcher's contract: k's and v's token and branch strides are multiples of 8 (16-byte vectors)
        T.assume(kT % V == 0)
        T.assume(kM % V == 0)
        T.assume(vT % V == 0)
        with T.Kernel(P, threads=threads) as bp:
            tid = T.get_thread_binding()
            lane = tid % WARP
            warp = tid // WARP
            if prefetch:
                stg = T.alloc_shared((STAGES * PLANES * J * threads * V,), BF)  # [stage, plane, j, thread, 8]
                sst = T.alloc_shared((STAGES * warps * 4 * M,), F32)  # [stage, warp, kind, branch]
                wr = T.alloc_local((MJV,), F32)  # w in registers
            elif xk:
                xks = T.alloc_shared((2 * MJV * threads,), BF)  # [plane (x: h, k: M + h), j, thread, 8]
            else:
                ws = T.alloc_shared((MJV * threads,), F32)  # [h, j, half, thread, 4]: conflict-free 16 bytes
            accs = T.alloc_shared((MJV * threads if acc_smem else 4,), F32)  # the sums, laid out as ws
            red = T.alloc_shared((2 * warps * M,), F32)  # [token parity, warp, branch]
            go = T.alloc_local((MJV,), BF)
            xv = T.alloc_local((MJV,), BF)
            kv = T.alloc_local((MJV,), BF)
            vv = T.alloc_local((J * V,), BF)
            acc = T.alloc_local((V if acc_smem else MJV,), F32)
            wl = T.alloc_local((V,), F32)
            ov = T.alloc_local((V,), BF)
            sd = T.alloc_local((M,), F32)
            sg = T.alloc_local((M,), F32)
            srx = T.alloc_local((M,), F32)
            srk = T.alloc_local((M,), F32)
            part = T.alloc_local((M,), F32)
            sv = T.alloc_local((1,), F32)
            beta = T.alloc_local((M,), F32)
            qx = T.alloc_local((M,), F32)
            qk = T.alloc_local((M,), F32)
            pp = T.cast(bp, I64)
            q = T.ceildiv(Tn, P)  # tokens a chunk
            start = pp * q
            ntok = T.max(T.min(q, Tn - start), T.int64(0))  # this chunk's (0 past the last token)

            if prefetch:
                for h in T.unroll(M):
                    for j in T.unroll(J):
                        for e in T.vectorized(V):
                            wr[(h * J + j) * V + e] = W[h, vec(j, tid) + e]
                if ntok > 0:
                    issue(GO, X, K, Vt, D, GS, RX, RK, stg, sst, start, 0, tid, lane, warp)
                T.ptx_commit_group()
            else:
                for h in T.unroll(M):
                    for j in T.unroll(J):
                        for half in T.unroll(2):
                            for e in T.vectorized(4):
                                if not xk:
                                    ws[slot(h, j, half, tid) + e] = W[h, vec(j, tid) + half * 4 + e]
                                if acc_smem:
                                    accs[slot(h, j, half, tid) + e] = T.float32(0.0)
            if not acc_smem:
                for i in T.unroll(MJV):
                    acc[i] = T.float32(0.0)

            for s in T.serial(ntok):
                t = start + s
                buf = (s % 2) * (warps * M)
                # ---- 1. loads; grad_v; the thread's dg partials ----
                if prefetch:
                    st = s % STAGES
                    # the previous token's reads of the stage copied over next are this thread's own: the warp
                    # barrier keeps the compiler from moving them past the copies (cp.async's asm names no memory)
                    T.sync_warp()
                    if s + 1 < ntok:
                        issue(GO, X, K, Vt, D, GS, RX, RK, stg, sst, t + 1, (s + 1) % STAGES, tid, lane, warp)
                    T.ptx_commit_group()  # (empty for the last token)
                    # this thread's copies of token t have landed (an extern call: TileLang follows its own wait
                    # with a CTA barrier)
                    T.call_extern("void", "tl::cp_async_wait<1>")
                    T.sync_warp()  # and lane 0's statistics, for the whole warp
                    for h in T.vectorized(M):
                        sd[h] = sst[stat(st, warp, 0) + h]
                    for h in T.vectorized(M):
                        sg[h] = sst[stat(st, warp, 1) + h]
                    for h in T.vectorized(M):
                        srx[h] = sst[stat(st, warp, 2) + h]
                    for h in T.vectorized(M):
                        srk[h] = sst[stat(st, warp, 3) + h]
                    for j in T.unroll(J):
                        for e in T.vectorized(V):
                            vv[j * V + e] = stg[staged(st, 3 * M, j, tid) + e]
                        for h in T.unroll(M):
                            for e in T.vectorized(V):
                                go[(h * J + j) * V + e] = stg[staged(st, h, j, tid) + e]
                else:
                    if xk:
                        # the previous token's reads of the stage are this thread's own: the warp barrier keeps
                        # them before the copies
                        T.sync_warp()
                        issue_xk(X, K, xks, t, 0, 0, tid)
                        T.ptx_commit_group()
                    for h in T.vectorized(M):
                        sd[h] = D[t, h]
                    for h in T.vectorized(M):
                        sg[h] = GS[t, h]
                    for h in T.vectorized(M):
                        srx[h] = RX[t, h]
                    for h in T.vectorized(M):
                        srk[h] = RK[t, h]
                    for j in T.unroll(J):
                        for e in T.vectorized(V):
                            vv[j * V + e] = Vt[t, vec(j, tid) + e]
                        for h in T.unroll(M):
                            for e in T.vectorized(V):
                                go[(h * J + j) * V + e] = GO[t, h, vec(j, tid) + e]
                        if early:
                            for h in T.unroll(M):
                                for e in T.vectorized(V):
                                    xv[(h * J + j) * V + e] = X[t, h, vec(j, tid) + e]
                                for e in T.vectorized(V):
                                    kv[(h * J + j) * V + e] = K[t, h, vec(j, tid) + e]
                for h in T.unroll(M):
                    part[h] = T.float32(0.0)
                for j in T.unroll(J):
                    for e in T.unroll(V):
                        sv[0] = T.float32(0.0)
                        for h in T.unroll(M):
                            sv[0] = _add(sv[0], _mul(T.cast(go[(h * J + j) * V + e], F32), sg[h]))
                        ov[e] = T.cast(sv[0], BF)
                    for e in T.vectorized(V):
                        DV[t, vec(j, tid) + e] = ov[e]
                    for h in T.unroll(M):
                        for e in T.unroll(V):
                            part[h] = _fma(T.cast(go[(h * J + j) * V + e], F32), T.cast(vv[j * V + e], F32),
                                           part[h])
                # ---- 2. dg: warp butterfly, then the warps' sums in warp order ----
                for h in T.unroll(M):
                    for m in T.unroll(5):
                        part[h] = part[h] + T.shfl_xor(part[h], 16 >> m)
                if lane == 0:
                    for h in T.unroll(M):
                        red[buf + warp * M + h] = part[h]
                T.sync_threads()
                for h in T.unroll(M):
                    part[h] = red[buf + h]
                    for w in T.unroll(1, warps):
                        part[h] = part[h] + red[buf + w * M + h]
                # ---- 3. beta, qx, qk (the reference's roundings) ----
                for h in T.unroll(M):
                    ad = _f("fabsf", sd[h])
                    below = _mul(_mul(_mul(ad, c_h), srx[h]), srk[h]) < clamp
                    b = _mul(_mul(_mul(_mul(part[h], sg[h]), _sub(T.float32(1.0), sg[h])), T.float32(0.5)),
                             _f("__fsqrt_rn", _div(_mul(_mul(c_h, srx[h]), srk[h]), ad)))
                    beta[h] = T.if_then_else(below, T.float32(0.0), b)
                    qx[h] = _div(_mul(_mul(sd[h], srx[h]), srx[h]), hf)
                    qk[h] = _div(_mul(_mul(sd[h], srk[h]), srk[h]), hf)
                if xk:
                    # this thread's copies of token t have landed; the warp barrier keeps the stage's reads after
                    # the wait (an extern call, as PREFETCH's)
                    T.call_extern("void", "tl::cp_async_wait<0>")
                    T.sync_warp()
                # ---- 4. elementwise gradients and the chunk's weight-gradient sums ----
                for h in T.unroll(M):
                    for j in T.unroll(J):
                        o = (h * J + j) * V
                        a0 = 0 if acc_smem else o
                        if prefetch:
                            for e in T.vectorized(V):
                                xv[o + e] = stg[staged(st, M + h, j, tid) + e]
                            for e in T.vectorized(V):
                                kv[o + e] = stg[staged(st, 2 * M + h, j, tid) + e]
                            for e in T.vectorized(V):
                                go[o + e] = stg[staged(st, h, j, tid) + e]
                            for e in T.unroll(V):
                                wl[e] = wr[o + e]
                        else:
                            if xk:
                                for e in T.vectorized(V):
                                    xv[o + e] = xks[staged(0, h, j, tid) + e]
                                for e in T.vectorized(V):
                                    kv[o + e] = xks[staged(0, M + h, j, tid) + e]
                            elif not early:
                                for e in T.vectorized(V):
                                    xv[o + e] = X[t, h, vec(j, tid) + e]
                                for e in T.vectorized(V):
                                    kv[o + e] = K[t, h, vec(j, tid) + e]
                            if not keep_go:
                                for e in T.vectorized(V):
                                    go[o + e] = GO[t, h, vec(j, tid) + e]
                            for half in T.unroll(2):
                                for e in T.vectorized(4):
                                    if xk:
                                        wl[half * 4 + e] = W[h, vec(j, tid) + half * 4 + e]
                                    else:
                                        wl[half * 4 + e] = ws[slot(h, j, half, tid) + e]
                        if acc_smem:
                            for half in T.unroll(2):
                                for e in T.vectorized(4):
                                    acc[half * 4 + e] = accs[slot(h, j, half, tid) + e]
                        for e in T.unroll(V):
                            xf = T.cast(xv[o + e], F32)
                            kf = T.cast(kv[o + e], F32)
                            gf = T.cast(go[o + e], F32)
                            ov[e] = T.cast(_add(gf, _mul(beta[h], _sub(_mul(kf, wl[e]), _mul(xf, qx[h])))), BF)
                            acc[a0 + e] = _add(acc[a0 + e], _mul(_mul(beta[h], xf), kf))
                        if acc_smem:
                            for half in T.unroll(2):
                                for e in T.vectorized(4):
                                    accs[slot(h, j, half, tid) + e] = acc[half * 4 + e]
                        for e in T.vectorized(V):
                            DX[t, h, vec(j, tid) + e] = ov[e]
                        for e in T.unroll(V):
                            xf = T.cast(xv[o + e], F32)
                            kf = T.cast(kv[o + e], F32)
                            ov[e] = T.cast(_mul(beta[h], _sub(_mul(xf, wl[e]), _mul(kf, qk[h]))), BF)
                        for e in T.vectorized(V):
                            DK[t, h, vec(j, tid) + e] = ov[e]

            for h in T.unroll(M):
                for j in T.unroll(J):
                    if acc_smem:
                        for half in T.unroll(2):
                            for e in T.vectorized(4):
                                acc[half * 4 + e] = accs[slot(h, j, half, tid) + e]
                    for e in T.vectorized(V):
                        DWP[pp, h, vec(j, tid) + e] = acc[(0 if acc_smem else (h * J + j) * V) + e]

    return engram_gate_bwd


def grad_w_reduce_kernel():
    """Factory: the reduction (every size symbolic). Launch: ``PART`` ``(P, N)`` fp32, ``WH, WE`` ``(N,)`` bf16,
    ``AH, AE`` ``(N,)`` fp32 accumulators (read and written); ``N % REDUCE_VEC == 0``."""
    import tilelang.language as T

    threads, U, RV = REDUCE_THREADS, max(1, REDUCE_ROWS), REDUCE_VEC
    assert RV in (1, 2, 4), RV
    Pn, N = T.dynamic("num_partials, numel", I64)

    @T.prim_func
    def engram_grad_w_reduce(PART: T.Tensor((Pn, N), F32), WH: T.Tensor((N,), BF), WE: T.Tensor((N,), BF),
                             AH: T.Tensor((N,), F32), AE: T.Tensor((N,), F32)):
        T.assume(N % RV == 0)
        with T.Kernel(T.ceildiv(N, RV * threads), threads=threads) as bx:
            s = T.alloc_local((RV,), F32)
            rows = T.alloc_local((U * RV,), F32)
            wh = T.alloc_local((RV,), BF)
            we = T.alloc_local((RV,), BF)
            ah = T.alloc_local((RV,), F32)
            ae = T.alloc_local((RV,), F32)
            e0 = (T.cast(bx, I64) * threads + T.get_thread_binding()) * RV
            if e0 < N:
                for e in T.unroll(RV):
                    s[e] = T.float32(0.0)
                for it in T.serial(T.ceildiv(Pn, U)):
                    for u in T.unroll(U):  # the loads of U rows, then their adds in row order
                        if it * U + u < Pn:
                            for e in T.vectorized(RV):
                                rows[u * RV + e] = PART[it * U + u, e0 + e]
                    for u in T.unroll(U):
                        if it * U + u < Pn:
                            for e in T.unroll(RV):
                                s[e] = _add(s[e], rows[u * RV + e])
                for e in T.vectorized(RV):
                    wh[e] = WH[e0 + e]
                for e in T.vectorized(RV):
                    we[e] = WE[e0 + e]
                for e in T.vectorized(RV):
                    ah[e] = AH[e0 + e]
                for e in T.vectorized(RV):
                    ae[e] = AE[e0 + e]
                for e in T.unroll(RV):
                    ah[e] = _fma(s[e], T.cast(we[e], F32), ah[e])
                    ae[e] = _fma(s[e], T.cast(wh[e], F32), ae[e])
                for e in T.vectorized(RV):
                    AH[e0 + e] = ah[e]
                for e in T.vectorized(RV):
                    AE[e0 + e] = ae[e]

    return engram_grad_w_reduce


# The bench's launches: gate backward at T = 8192 (symbolic), M = 4, H in {4096, 7168}; the reduction at P = 132,
# M = 4 and the same H (one binary: every size is a runtime value).
BENCH_H = (4096, 7168)

_jit.register("engram_gate_bwd", gate_bwd_kernel, lambda: [(h,) for h in BENCH_H])
_jit.register("engram_grad_w_reduce", grad_w_reduce_kernel, lambda: [()])


# ---- launchers (no validation: the public ops validate) ----

def takes(hidden_states: torch.Tensor) -> bool:
    """Whether the gate backward kernel takes this (validated) ``hidden_states (T, 4, H)``: CUDA, bf16, ``M == 4``
    and ``takes_hidden(H)``. Other inputs keep the reference path."""
    return (hidden_states.is_cuda and hidden_states.dtype == torch.bfloat16 and hidden_states.dim() == 3
            and hidden_states.shape[1] == M and takes_hidden(hidden_states.shape[2]))


def takes_reduce(grad_w_partial: torch.Tensor) -> bool:
    """Whether the reduction kernel takes this (validated) ``(P, M, H)`` fp32 partial: CUDA and
    ``M·H % REDUCE_VEC == 0``."""
    return grad_w_partial.is_cuda and grad_w_partial.dtype == torch.float32 and (
        grad_w_partial.shape[1] * grad_w_partial.shape[2]) % REDUCE_VEC == 0


def _new(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised output buffer (one place, so tests can hand out poisoned buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _vectors(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its 16-byte vectors are aligned (data pointer, and every stride but the last a multiple of 8
    elements), else a contiguous aligned copy."""
    if t.data_ptr() % 16 == 0 and all(s % V == 0 for s in t.stride()[:-1]):
        return t
    return _launch.aligned(t.contiguous())


def _f32(x: float) -> float:
    """``x`` rounded once (to nearest even) to fp32."""
    return struct.unpack("f", struct.pack("f", x))[0]


def gate_bwd_launch(grad_out: torch.Tensor, hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    weight_fused: torch.Tensor, dot: torch.Tensor, gate_score: torch.Tensor, rstd_x: torch.Tensor,
                    rstd_k: torch.Tensor, clamp_value: float, num_partials: int):
    """``(grad_x, grad_k, grad_v, grad_w_partial)`` of §2.5 (v1) with ``num_partials`` rows of the partial; fresh
    contiguous outputs. Validates nothing (the public op does)."""
    t, m, h = hidden_states.shape
    dev = hidden_states.device
    grad_x = _new((t, m, h), torch.bfloat16, dev)
    grad_k = _new((t, m, h), torch.bfloat16, dev)
    grad_v = _new((t, h), torch.bfloat16, dev)
    partial = _new((num_partials, m, h), torch.float32, dev)
    if t == 0:  # every chunk is empty: zero rows
        partial.zero_()
        return grad_x, grad_k, grad_v, partial
    a = _launch.aligned
    _jit.get("engram_gate_bwd", (h,))(
        a(grad_out), a(hidden_states), _vectors(k), _vectors(v), a(weight_fused), a(dot), a(gate_score), a(rstd_x),
        a(rstd_k), grad_x, grad_k, grad_v, partial, _f32(h ** -0.5), _f32(clamp_value), float(h))
    return grad_x, grad_k, grad_v, partial


def grad_w_reduce_launch(grad_w_partial: torch.Tensor, weight_hidden: torch.Tensor, weight_embed: torch.Tensor,
                         grad_weight_hidden: torch.Tensor, grad_weight_embed: torch.Tensor) -> None:
    """``S = Σ_p partial[p]`` (ascending); ``grad_weight_hidden ← fma(S, w_e, ·)``, ``grad_weight_embed ←
    fma(S, w_h, ·)`` in place (§2.6). Contiguous inputs; the accumulators are written in place when 16-byte
    aligned, else through an aligned copy. Validates nothing."""
    p, m, h = grad_w_partial.shape
    n = m * h
    if n == 0:
        return
    a = _launch.aligned
    acc_h, acc_e = a(grad_weight_hidden), a(grad_weight_embed)
    _jit.get("engram_grad_w_reduce", ())(a(grad_w_partial).view(p, n), a(weight_hidden).view(n),
                                         a(weight_embed).view(n), acc_h.view(n), acc_e.view(n))
    if acc_h is not grad_weight_hidden:
        grad_weight_hidden.copy_(acc_h)
    if acc_e is not grad_weight_embed:
        grad_weight_embed.copy_(acc_e)


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::engram_gate_bwd", mutates_args=(), device_types="cuda")
def _gate_bwd_op(grad_out: torch.Tensor, hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 weight_fused: torch.Tensor, dot: torch.Tensor, gate_score: torch.Tensor, rstd_x: torch.Tensor,
                 rstd_k: torch.Tensor, clamp_value: float,
                 num_partials: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return gate_bwd_launch(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k,
                           clamp_value, num_partials)


@_gate_bwd_op.register_fake
def _(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, clamp_value, num_partials):
    t, m, h = hidden_states.shape
    return (hidden_states.new_empty((t, m, h)), hidden_states.new_empty((t, m, h)),
            hidden_states.new_empty((t, h)), weight_fused.new_empty((num_partials, m, h)))


@_ops.kernel_op("tilefuse::engram_grad_w_reduce", mutates_args=("grad_weight_hidden", "grad_weight_embed"),
                device_types="cuda")
def _grad_w_reduce_op(grad_w_partial: torch.Tensor, weight_hidden: torch.Tensor, weight_embed: torch.Tensor,
                      grad_weight_hidden: torch.Tensor, grad_weight_embed: torch.Tensor) -> None:
    grad_w_reduce_launch(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)


# ---- CUDA entries: a direct launch in eager mode, the custom op under torch.compile ----

def gate_bwd_cuda(*args):
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.engram_gate_bwd(*args)
    return gate_bwd_launch(*args)


def grad_w_reduce_cuda(*args) -> None:
    if torch.compiler.is_compiling():
        torch.ops.tilefuse.engram_grad_w_reduce(*args)
    else:
        grad_w_reduce_launch(*args)
