"""TileLang kernels of the Engram Sinkhorn helpers (engram.md §2.9, v2.1): ``engram_sinkhorn_momentum_update``,
``engram_sinkhorn_step``, ``engram_sinkhorn_step_reduce`` and ``engram_sinkhorn_finalize``.

Every fp32 operation is an explicit ``__f*_rn`` intrinsic (``tilefuse._rn``) or ``__fsqrt_rn``, so nvcc can neither
contract a product and a sum into an fma nor reorder anything: the order of roundings is the one written here.

Momentum update (§2.9.1), element-wise over the flattened ``n`` elements (``n % 256 == 0``, so ``n % VEC == 0``): one
thread per ``VEC = 4`` consecutive elements (one 16-byte fp32 / 8-byte bf16 access a tensor; the knob's other value 8
makes them two 16-byte fp32 / one 16-byte bf16 access). ``m' = fma(m, β, RN(β'·g))``; the buffer gets ``m'`` rounded to
its dtype; the output is ``fma(g, β', RN(β·m'))`` (nesterov) or ``m'``. ``β = fp32(beta1)`` and ``β' = fp32(1 - beta1)``
(the subtraction in double) are launch arguments. The dtypes of ``grad`` and the buffer and the flag are compile keys.
Bit for bit the spec's formulation.

Row normalisation (step and finalize): a row of ``D`` fp32 (``D % 256 == 0``, a compile key) is spread over
``RT`` threads (256 if ``D % 1024 == 0``, else 128 if ``D % 512 == 0``, else 64), each holding ``S = D / (4 RT)``
16-byte vectors: vector ``s`` of thread ``x`` is columns ``4 (s RT + x) .. + 3`` (a warp reads whole lines).
``y = RN(RN(r·B)·c)``. The sum of squares has a fixed blocked order that depends only on ``D``: per thread four
lane accumulators ``a_e = fma(y, y, a_e)`` over its vectors ``s = 0, 1, ...`` (from 0); the thread's sum
``(a_0 + a_1) + (a_2 + a_3)``; an XOR butterfly across the warp (distances 16, 8, 4, 2, 1; every lane ends with
the same bits); the ``RT / 32`` warp sums, through shared memory, added by a pairwise tree in warp order.
``n = √sum`` (``__fsqrt_rn``). A row's results therefore never depend on ``R`` or on the other rows.

Step (§2.9.2): ``P`` CTAs (the partial buffer's rows, a runtime value: the public op's ``3 S_m``, never the device's
SM count). CTA ``p`` walks rows ``p q .. min((p + 1) q, R) - 1`` in ascending order, ``q = ceil(R / P)``; per row
it forms ``n``, ``ρ = RN(1 / RN(n + eps))``, writes ``row_norm = n`` and ``row_scale ← RN(r·ρ)`` (one thread,
after every thread has read ``r``), and adds ``RN(z·z)``, ``z = RN(y·ρ)``, to per-column accumulators that start
at 0 (the reference's chunk sums, bit for bit given ``n``). It then writes its partial row, zeros for an empty
chunk. Finalize (§2.9.4): one CTA per row, ``out = RN(y · RN(fp32(alpha) / RN(n + eps)))``.

Step reduce (§2.9.3): a CTA takes 32 columns. Its warps stage blocks of ``REDUCE_BLOCK`` partial rows in shared
memory (each warp a row at a time, 128 contiguous bytes: every load of the block in flight at once); then lane ``l``
of warp 0 adds the block's rows to column ``l``'s sum: ``acc = 0``, ``acc = RN(acc + partial[p, j])`` for ``p = 0,
1, ..., P - 1``. That is the reference's sequential sum, bit for bit; ``D`` and ``P`` are runtime values.

``REDUCE_PIPE`` (a knob, off by default): the same loads, issued up front, and the same order of adds, but a block's
rows are signalled in ``REDUCE_GROUPS`` groups of consecutive rows (``REDUCE_BLOCK / REDUCE_GROUPS`` each): each
other warp stores its rows of group ``g`` and arrives at named barrier ``g + 1`` (``bar.arrive``); warp 0 stores its
own, waits there (``bar.sync``) and adds group ``g`` while the later groups' rows are still arriving from memory,
its shared loads 16 rows ahead of its adds (a group's rows if 16 does not divide them). So the ordered adds overlap
the loads instead of following the last of them. Every group is signalled whatever ``P`` (warp 0 skips the adds of a
group past ``P``), and the ``__syncthreads`` that ends a block comes before the next block's stores reuse the tile
and the barrier ids. ptxas (sm_90), ``REDUCE_GROUPS`` = 8 / 4: 110 registers (102 without the knob), 9 / 5 barriers,
no spills, the same 64 KB of shared memory.

No atomics. Shared memory: the row kernels' warp sums, the step's column sums (each thread its own columns), the
reduce's staged rows. Deterministic and batch-invariant.

Speed, measured on an NVIDIA H100 80GB HBM3, 2026-12-05: the momentum update of 4096 x 7168 elements
(grad / buffer bf16 / bf16, bf16 / fp32, fp32 / bf16, fp32 / fp32) 103.6 / 142.6 / 121.7 / 161.2 µs at ``VEC = 4``
(the default), 105.7 / 157.2 / 124.0 / 173.7 µs at ``VEC = 8``; ``MOMENTUM_THREADS = 128`` gained nothing. The step
reduce (the bench's two shapes, P = 396, D = 4096 / 7168) 11.2 / 12.9 µs at ``REDUCE_THREADS = 256``, 12.5 / 14.0 at
128. ptxas (sm_90, no spills): step 79 registers at D = 7168 (capped for 3 CTAs an SM, see STEP_MIN_BLOCKS) and 64 at
4096; finalize 64 at 7168; reduce 102; momentum 21 at VEC = 4 (28 at 8; bf16 grad, fp32 buffer).
"""
import torch

from tilefuse import _jit, _launch, _ops
from tilefuse._rn import add as _add, call as _f, div as _div, fma as _fma, mul as _mul

KERNEL_HELPERS = ("tilefuse._rn",)  # part of this module's kernel cache key (_jit._module_digest)

# ---- tuning knobs (TILEFUSE_KNOBS; results unchanged) ----
MOMENTUM_THREADS = 256  # momentum update: threads per CTA (VEC elements each)
REDUCE_THREADS = 256    # step reduce: threads per CTA (32 columns; the warps stage rows, warp 0 adds them)
REDUCE_BLOCK = 512      # step reduce: partial rows staged in shared memory at once (the public op's 396 in one)
REDUCE_PIPE = False     # step reduce: warp 0 adds each group of a block's rows once it is stored (named barriers)
REDUCE_GROUPS = 8       # step reduce, REDUCE_PIPE: groups of a block (ids 1 .. 15 at most; divides a warp's rows)
# step: CTAs an SM must hold at once (registers capped to fit): the public op's 3 S_m partials are 3 CTAs per SM of
# a 132-SM GPU, so all of them run in one wave. ptxas (sm_90): 79 registers at D = 7168 (117 uncapped), 64 at 4096,
# no spills. Applied up to STEP_CAP_D columns (wider rows would spill). 0: no cap
STEP_MIN_BLOCKS = 3
STEP_CAP_D = 8192

VEC = 4      # momentum update: elements per thread (knob, 4 or 8: the public op's n % 256 == 0 makes n a multiple)
LANES = 4    # row kernels: fp32 per vector access (16 bytes)
MAX_D = 16384  # row kernels: widest row held in registers (S = 16 vectors a thread); wider rows keep the reference
F32, I64 = "float32", "int64"
_DT_NAME = {torch.bfloat16: "bf16", torch.float32: "fp32"}
_DT_TL = {"bf16": "bfloat16", "fp32": "float32"}


def momentum_kernel(grad_dtype: str, buf_dtype: str, nesterov: bool):
    """Factory: ``grad`` and buffer dtypes (``"bf16"`` | ``"fp32"``) and the flag. Launch: ``G``, ``M`` (updated),
    ``OUT`` (fp32), each the ``n`` elements viewed ``(n / VEC, VEC)`` (``n / VEC`` symbolic), then ``beta`` and
    ``beta_c`` (fp32 scalars)."""
    import tilelang.language as T

    gd, md = _DT_TL[grad_dtype], _DT_TL[buf_dtype]
    threads = MOMENTUM_THREADS
    Nv = T.dynamic("vectors", I64)  # n / VEC

    @T.prim_func
    def engram_sinkhorn_momentum(G: T.Tensor((Nv, VEC), gd), M: T.Tensor((Nv, VEC), md),
                                 OUT: T.Tensor((Nv, VEC), F32), beta: T.float32, beta_c: T.float32):
        with T.Kernel(T.ceildiv(Nv, threads), threads=threads) as bx:
            g = T.alloc_local((VEC,), gd)
            m = T.alloc_local((VEC,), md)
            mo = T.alloc_local((VEC,), md)
            mn = T.alloc_local((VEC,), F32)
            o = T.alloc_local((VEC,), F32)
            v = T.cast(bx, I64) * threads + T.cast(T.get_thread_binding(), I64)
            if v < Nv:
                for e in T.vectorized(VEC):
                    g[e] = G[v, e]
                for e in T.vectorized(VEC):
                    m[e] = M[v, e]
                for e in T.unroll(VEC):
                    mn[e] = _fma(T.cast(m[e], F32), beta, _mul(beta_c, T.cast(g[e], F32)))
                    mo[e] = T.cast(mn[e], md)
                    if nesterov:
                        o[e] = _fma(T.cast(g[e], F32), beta_c, _mul(beta, mn[e]))
                    else:
                        o[e] = mn[e]
                for e in T.vectorized(VEC):
                    M[v, e] = mo[e]
                for e in T.vectorized(VEC):
                    OUT[v, e] = o[e]

    return engram_sinkhorn_momentum


def row_threads(D: int) -> int:
    """Threads per row of the row kernels: the most of 256, 128, 64 whose vectors tile ``D`` exactly."""
    assert D > 0 and D % 256 == 0, D
    return next(rt for rt in (256, 128, 64) if D % (LANES * rt) == 0)


def _row_parts(D: int):
    """Helpers of the row kernels at ``D`` columns: ``(RT, S, load_y, row_norm)``."""
    import tilelang.language as T

    RT = row_threads(D)
    S = D // (LANES * RT)
    W = RT // 32
    levels = tuple(W >> k for k in range(1, W.bit_length()))  # tree widths: W/2, ..., 1

    @T.macro
    def load_y(B, CS, i, r, tid, b, c, y):
        """``y[s, e] = RN(RN(r·B[i, col])·c[col])`` for the thread's ``S`` vectors."""
        for s in T.unroll(S):
            for e in T.vectorized(LANES):
                b[s * LANES + e] = B[i, (s * RT + tid) * LANES + e]
        for s in T.unroll(S):
            for e in T.vectorized(LANES):
                c[s * LANES + e] = CS[(s * RT + tid) * LANES + e]
        for q in T.unroll(S * LANES):
            y[q] = _mul(_mul(r, b[q]), c[q])

    @T.macro
    def row_norm(y, acc, red, parity, tid):
        """``acc[0] = √Σ y²`` of the row (every thread the same bits), in the fixed order of the module docstring;
        ``red`` is the shared ``(2, W)`` buffer, used at ``parity`` (alternate rows alternate halves, so one
        barrier a row suffices)."""
        for e in T.unroll(LANES):
            acc[e] = T.float32(0.0)
        for s in T.unroll(S):
            for e in T.unroll(LANES):
                acc[e] = _fma(y[s * LANES + e], y[s * LANES + e], acc[e])
        acc[0] = _add(_add(acc[0], acc[1]), _add(acc[2], acc[3]))
        for d in (16, 8, 4, 2, 1):
            acc[0] = _add(acc[0], T.shfl_xor(acc[0], d))
        if tid % 32 == 0:
            red[parity, tid // 32] = acc[0]
        T.sync_threads()
        for w in T.unroll(W):
            acc[w] = red[parity, w]
        for width in levels:  # pairwise tree in warp order
            for w in T.unroll(width):
                acc[w] = _add(acc[2 * w], acc[2 * w + 1])
        acc[0] = _f("__fsqrt_rn", acc[0])

    return RT, S, W, load_y, row_norm


def step_kernel(D: int):
    """Factory: the step at ``D`` columns. Launch: ``B (R, D)``, ``RS (R,)`` (updated), ``CS (D,)``, ``NORM (R,)``,
    ``PART (P, D)`` fp32, ``eps`` (fp32); ``R`` and ``P`` symbolic, the grid is ``P`` CTAs."""
    import tilelang.language as T

    RT, S, W, load_y, row_norm = _row_parts(D)
    Q = S * LANES
    Rn = T.dynamic("rows", I64)
    Pn = T.dynamic("partials", I64)

    @T.prim_func
    def engram_sinkhorn_step(B: T.Tensor((Rn, D), F32), RS: T.Tensor((Rn,), F32), CS: T.Tensor((D,), F32),
                             NORM: T.Tensor((Rn,), F32), PART: T.Tensor((Pn, D), F32), eps: T.float32):
        with T.Kernel(Pn, threads=RT) as bx:
            if STEP_MIN_BLOCKS and D <= STEP_CAP_D:
                T.annotate_min_blocks_per_sm(STEP_MIN_BLOCKS)
            red = T.alloc_shared((2, W), F32)
            col = T.alloc_shared((D,), F32)  # the column sums; a thread touches only its own columns
            b = T.alloc_local((Q,), F32)
            c = T.alloc_local((Q,), F32)
            y = T.alloc_local((Q,), F32)
            z = T.alloc_local((LANES,), F32)
            acc = T.alloc_local((max(LANES, W),), F32)
            r = T.alloc_local((1,), F32)
            rho = T.alloc_local((1,), F32)
            span = T.alloc_local((2,), I64)  # the chunk's first row and its row count
            tid = T.get_thread_binding()
            span[1] = T.truncdiv(Rn + Pn - 1, Pn)  # q = ceil(R / P)
            span[0] = T.cast(bx, I64) * span[1]
            span[1] = T.max(T.min(span[1], Rn - span[0]), T.int64(0))
            for s in T.unroll(S):
                for e in T.vectorized(LANES):
                    col[(s * RT + tid) * LANES + e] = T.float32(0.0)
            for k in T.serial(span[1]):
                i = span[0] + k
                r[0] = RS[i]
                load_y(B, CS, i, r[0], tid, b, c, y)
                row_norm(y, acc, red, k % 2, tid)
                rho[0] = _div(T.float32(1.0), _add(acc[0], eps))
                if tid == 0:
                    NORM[i] = acc[0]
                    RS[i] = _mul(r[0], rho[0])
                for s in T.unroll(S):
                    for e in T.vectorized(LANES):
                        z[e] = col[(s * RT + tid) * LANES + e]
                    for e in T.unroll(LANES):
                        z[e] = _add(z[e], _mul(_mul(y[s * LANES + e], rho[0]), _mul(y[s * LANES + e], rho[0])))
                    for e in T.vectorized(LANES):
                        col[(s * RT + tid) * LANES + e] = z[e]
            for s in T.unroll(S):
                for e in T.vectorized(LANES):
                    PART[bx, (s * RT + tid) * LANES + e] = col[(s * RT + tid) * LANES + e]

    return engram_sinkhorn_step


def finalize_kernel(D: int):
    """Factory: finalize at ``D`` columns. Launch: ``B (R, D)``, ``RS (R,)``, ``CS (D,)``, ``OUT (R, D)`` fp32,
    ``eps``, ``alpha`` (fp32); ``R`` symbolic, one CTA a row."""
    import tilelang.language as T

    RT, S, W, load_y, row_norm = _row_parts(D)
    Q = S * LANES
    Rn = T.dynamic("rows", I64)

    @T.prim_func
    def engram_sinkhorn_finalize(B: T.Tensor((Rn, D), F32), RS: T.Tensor((Rn,), F32), CS: T.Tensor((D,), F32),
                                 OUT: T.Tensor((Rn, D), F32), eps: T.float32, alpha: T.float32):
        with T.Kernel(Rn, threads=RT) as bx:
            red = T.alloc_shared((2, W), F32)
            b = T.alloc_local((Q,), F32)
            c = T.alloc_local((Q,), F32)
            y = T.alloc_local((Q,), F32)
            o = T.alloc_local((Q,), F32)
            acc = T.alloc_local((max(LANES, W),), F32)
            scale = T.alloc_local((1,), F32)
            tid = T.get_thread_binding()
            i = T.cast(bx, I64)
            load_y(B, CS, i, RS[i], tid, b, c, y)
            row_norm(y, acc, red, 0, tid)
            scale[0] = _div(alpha, _add(acc[0], eps))
            for e in T.unroll(Q):
                o[e] = _mul(y[e], scale[0])
            for s in T.unroll(S):
                for e in T.vectorized(LANES):
                    OUT[i, (s * RT + tid) * LANES + e] = o[s * LANES + e]

    return engram_sinkhorn_finalize


def reduce_kernel():
    """Factory: the step reduce. Launch: ``PART (P, D)``, ``OUT (D,)`` fp32; ``P`` and ``D`` symbolic (``D % 32 ==
    0``); the grid is ``D / 32`` CTAs, one warp's width of columns each."""
    import tilelang.language as T

    threads = REDUCE_THREADS
    WR = threads // 32          # warps: warp w loads rows w, w + WR, ... of a block
    PB = REDUCE_BLOCK           # rows a block stages in shared memory
    assert PB % WR == 0, (PB, WR)
    U = PB // WR
    G = REDUCE_GROUPS if REDUCE_PIPE else 1  # groups of a block signalled apart (named barriers 1 .. G)
    assert 1 <= G <= 15 and U % G == 0, (G, U)
    GR, UG = PB // G, U // G    # rows of a group; of them, each warp's
    AH = 16 if GR % 16 == 0 else GR  # REDUCE_PIPE: shared loads warp 0 issues ahead of its adds
    Pn = T.dynamic("partials", I64)
    Dn = T.dynamic("cols", I64)

    @T.prim_func
    def engram_sinkhorn_step_reduce(PART: T.Tensor((Pn, Dn), F32), OUT: T.Tensor((Dn,), F32)):
        with T.Kernel(T.ceildiv(Dn, 32), threads=threads) as bx:
            tile = T.alloc_shared((PB, 32), F32)
            acc = T.alloc_local((1,), F32)
            v = T.alloc_local((U,), F32)
            tid = T.get_thread_binding()
            w = tid // 32
            lane = tid % 32
            j = T.cast(bx, I64) * 32 + T.cast(lane, I64)
            acc[0] = T.float32(0.0)
            for blk in T.serial(T.ceildiv(Pn, PB)):
                for u in T.unroll(U):  # every warp loads U rows of the block (whole 128-byte lines), then stages them
                    v[u] = T.float32(0.0)
                    if T.And(T.cast(blk, I64) * PB + w + u * WR < Pn, j < Dn):
                        v[u] = PART[T.cast(blk, I64) * PB + w + u * WR, j]
                if REDUCE_PIPE:
                    t = T.alloc_local((2, AH), F32)
                    for g in T.unroll(G):  # group g: rows g GR .. (g + 1) GR - 1 of the block
                        for u in T.unroll(UG):
                            tile[w + (g * UG + u) * WR, lane] = v[g * UG + u]
                        if w == 0:  # waits for the group's rows only, then adds them in ascending order
                            T.sync_threads(g + 1, threads)
                            if T.cast(blk, I64) * PB + g * GR < Pn:
                                for e in T.unroll(AH):
                                    t[0, e] = tile[g * GR + e, lane]
                                for c in T.unroll(GR // AH):  # chunk c + 1's loads ahead of chunk c's adds
                                    if c + 1 < GR // AH:
                                        for e in T.unroll(AH):
                                            t[(c + 1) % 2, e] = tile[g * GR + (c + 1) * AH + e, lane]
                                    for e in T.unroll(AH):
                                        if T.cast(blk, I64) * PB + g * GR + c * AH + e < Pn:
                                            acc[0] = _add(acc[0], t[c % 2, e])
                        else:
                            T.named_barrier_arrive(g + 1, threads)
                else:
                    for u in T.unroll(U):
                        tile[w + u * WR, lane] = v[u]
                    T.sync_threads()
                    if w == 0:  # warp 0 adds the block's rows to its column sums in ascending order
                        for g in T.serial(T.ceildiv(T.min(T.cast(PB, I64), Pn - T.cast(blk, I64) * PB), 8)):
                            for u in T.unroll(8):
                                if T.cast(blk, I64) * PB + g * 8 + u < Pn:
                                    acc[0] = _add(acc[0], tile[g * 8 + u, lane])
                T.sync_threads()
            if T.And(w == 0, j < Dn):
                OUT[j] = acc[0]

    return engram_sinkhorn_step_reduce


# ---- registered configs: the bench's launches ----
# engram.md gives no Sinkhorn benchmark shape; the bench takes R = 4096 rows at D in {4096, 7168} (the spec's tuned
# hidden sizes). The momentum update: every dtype pair and both flags (the element count is symbolic).
BENCH_D = (4096, 7168)
BENCH_MOMENTUM = tuple((g, m, n) for g in ("bf16", "fp32") for m in ("bf16", "fp32") for n in (True, False))

_jit.register("engram_sinkhorn_momentum", momentum_kernel, lambda: list(BENCH_MOMENTUM))
_jit.register("engram_sinkhorn_step", step_kernel, lambda: [(d,) for d in BENCH_D])
_jit.register("engram_sinkhorn_step_reduce", reduce_kernel, lambda: [()])
_jit.register("engram_sinkhorn_finalize", finalize_kernel, lambda: [(d,) for d in BENCH_D])


# ---- which inputs the kernels take ----

def takes_rows(matrix: torch.Tensor) -> bool:
    """Whether the step and finalize kernels take this (validated) ``matrix (R, D)``: CUDA and ``0 < D <= MAX_D``."""
    return matrix.is_cuda and 0 < matrix.shape[1] <= MAX_D


# ---- launchers (no validation: the public ops validate; tensors contiguous) ----

def momentum_launch(grad: torch.Tensor, momentum_buffer: torch.Tensor, out: torch.Tensor, beta1: float,
                    nesterov: bool) -> None:
    """Update ``momentum_buffer`` in place and write ``out`` (fp32, the buffer's shape); no launch for ``n = 0``.
    Tensors that do not start on a 16-byte boundary (the kernel's vector accesses) go through aligned copies."""
    n = momentum_buffer.numel()
    if n == 0:
        return
    cfg = (_DT_NAME[grad.dtype], _DT_NAME[momentum_buffer.dtype], bool(nesterov))
    shape = (n // VEC, VEC)
    buf = _launch.aligned(momentum_buffer)
    dest = _launch.aligned(out)
    _jit.get("engram_sinkhorn_momentum", cfg)(_launch.aligned(grad).view(shape), buf.view(shape), dest.view(shape),
                                              float(beta1), float(1 - beta1))
    if buf is not momentum_buffer:
        momentum_buffer.copy_(buf)
    if dest is not out:
        out.copy_(dest)


def step_launch(matrix: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, row_norm: torch.Tensor,
                partial: torch.Tensor, eps: float) -> None:
    """Write ``row_norm (R,)`` and ``partial (P, D)``, update ``row_scale``. With ``R = 0`` every chunk is empty:
    the partial is zeros, no launch."""
    if matrix.shape[0] == 0:
        partial.zero_()
        return
    dest = _launch.aligned(partial)
    _jit.get("engram_sinkhorn_step", (matrix.shape[1],))(_launch.aligned(matrix), row_scale, _launch.aligned(col_scale),
                                                         row_norm, dest, float(eps))
    if dest is not partial:
        partial.copy_(dest)


def step_reduce_launch(col_sumsq_partial: torch.Tensor, col_sumsq: torch.Tensor) -> None:
    """``col_sumsq = Σ_p partial[p]`` in ascending ``p`` (zeros for ``P = 0``); nothing runs for ``D = 0``."""
    if col_sumsq.shape[0] == 0:
        return
    if col_sumsq_partial.shape[0] == 0:
        col_sumsq.zero_()
        return
    _jit.get("engram_sinkhorn_step_reduce", ())(col_sumsq_partial, col_sumsq)


def finalize_launch(matrix: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, out: torch.Tensor,
                    eps: float, alpha: float) -> None:
    """Write ``out (R, D)``; no launch for ``R = 0``. Tensors that do not start on a 16-byte boundary (the kernel's
    vector accesses) go through aligned copies."""
    if matrix.shape[0] == 0:
        return
    dest = _launch.aligned(out)
    _jit.get("engram_sinkhorn_finalize", (matrix.shape[1],))(_launch.aligned(matrix), row_scale,
                                                             _launch.aligned(col_scale), dest, float(eps),
                                                             float(alpha))
    if dest is not out:
        out.copy_(dest)


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::engram_sinkhorn_momentum_update", mutates_args=("momentum_buffer",))
def _momentum_op(grad: torch.Tensor, momentum_buffer: torch.Tensor, beta1: float, nesterov: bool) -> torch.Tensor:
    out = torch.empty(momentum_buffer.shape, dtype=torch.float32, device=momentum_buffer.device)
    momentum_launch(grad, momentum_buffer, out, beta1, nesterov)
    return out


@_momentum_op.register_fake
def _momentum_fake(grad, momentum_buffer, beta1, nesterov):
    return momentum_buffer.new_empty(momentum_buffer.shape, dtype=torch.float32)


@_ops.kernel_op("tilefuse::engram_sinkhorn_step", mutates_args=("row_scale", "row_norm", "partial"))
def _step_op(matrix: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, row_norm: torch.Tensor,
             partial: torch.Tensor, eps: float) -> None:
    step_launch(matrix, row_scale, col_scale, row_norm, partial, eps)


@_ops.kernel_op("tilefuse::engram_sinkhorn_step_reduce", mutates_args=("col_sumsq",))
def _step_reduce_op(col_sumsq_partial: torch.Tensor, col_sumsq: torch.Tensor) -> None:
    step_reduce_launch(col_sumsq_partial, col_sumsq)


@_ops.kernel_op("tilefuse::engram_sinkhorn_finalize", mutates_args=("out",))
def _finalize_op(matrix: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, out: torch.Tensor,
                 eps: float, alpha: float) -> None:
    finalize_launch(matrix, row_scale, col_scale, out, eps, alpha)


# ---- CUDA entries: a direct launch in eager mode, the custom op under torch.compile ----

def _tracing() -> bool:
    return torch.compiler.is_compiling()


def momentum_cuda(grad: torch.Tensor, momentum_buffer: torch.Tensor, beta1: float, nesterov: bool) -> torch.Tensor:
    if _tracing():
        return torch.ops.tilefuse.engram_sinkhorn_momentum_update(grad, momentum_buffer, beta1, nesterov)
    out = torch.empty(momentum_buffer.shape, dtype=torch.float32, device=momentum_buffer.device)
    momentum_launch(grad, momentum_buffer, out, beta1, nesterov)
    return out


def step_cuda(matrix: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, eps: float,
              num_partials: int):
    """``(row_norm, col_sumsq_partial)`` with ``num_partials`` partial rows; ``row_scale`` updated in place."""
    r, d = matrix.shape
    row_norm = torch.empty((r,), dtype=torch.float32, device=matrix.device)
    partial = torch.empty((num_partials, d), dtype=torch.float32, device=matrix.device)
    (torch.ops.tilefuse.engram_sinkhorn_step if _tracing() else step_launch)(
        matrix, row_scale, col_scale, row_norm, partial, eps)
    return row_norm, partial


def step_reduce_cuda(col_sumsq_partial: torch.Tensor, col_sumsq: torch.Tensor) -> None:
    (torch.ops.tilefuse.engram_sinkhorn_step_reduce if _tracing() else step_reduce_launch)(col_sumsq_partial,
                                                                                          col_sumsq)


def finalize_cuda(matrix: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, eps: float, alpha: float,
                  out: torch.Tensor | None) -> torch.Tensor:
    """``out`` (new when ``None``), written."""
    if out is None:
        out = torch.empty(matrix.shape, dtype=torch.float32, device=matrix.device)
    (torch.ops.tilefuse.engram_sinkhorn_finalize if _tracing() else finalize_launch)(
        matrix, row_scale, col_scale, out, eps, alpha)
    return out
