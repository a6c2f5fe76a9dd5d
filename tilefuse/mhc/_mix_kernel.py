"""TileLang kernels of the mHC mix ops: split mixes (mhc.md §2.3) and head mix (§2.7), forward and backward,
and the in-order sum of parameter-gradient partials.

Per-token math (one thread per token, everything in registers; fp32 IEEE operations written as explicit
``__f*_rn`` intrinsics so nvcc cannot contract them, and ``expf``, the library exponential):

* ``z = RN(m * s) + b`` (the product rounded first, as the reference's separate multiply and add);
* ``sigmoid(z) = 1 / (1 + expf(-z))`` (IEEE division);
* split forward: ``pre = sigmoid + eps``, ``post = sigmoid * v``, ``comb = z``; head forward: ``sigmoid + eps``;
* split backward: ``dz_pre = (d_pre * sig) * (1 - sig)``, ``dz_post = (d_post * post) * (1 - post / v)``,
  ``dz_comb = d_comb``, ``d_input = dz * s_grp``; head backward: ``dz = (sig * (1 - sig)) * d_out``,
  ``d_input = dz * s``;
* per-token scale terms: ``sum_j dz[j] * m[j]`` over a group's columns, summed left to right.

A fused kernel that must equal the unfused chain bit for bit (``mhc_pre_big_fuse``, §2.8, §3 contract 2) uses
this same split chain.

Parameter gradients (``d_scale``, ``d_base``) are sums over tokens, made deterministic and independent of
the launch (no atomics): tokens are cut into blocks of ``TB`` tokens (the spec's ``token_block_size``,
default 32); partial ``p`` of ``P`` (a runtime count: ``PARTIALS`` for split mixes and the v1 head-mix
backward, the caller's ``num_sms`` for the v2.1 head-mix backward) is the sum of blocks
``p, p + P, p + 2P, ...`` added in increasing block order to a zero start; a block's sum adds its tokens
one after another in token order (tail tokens past ``T`` add nothing). This is the grouping of
``reference.mhc.token_partials``; only the order inside a block differs from torch's ``sum``. The partials
``[P, G]``, ``[P, M]`` are then summed over ``p`` in increasing order from zero by ``mhc_partials_sum``
(one thread per column) -- the order of ``reference.mhc.seq_sum``, so that step is bit-identical to it.

Backward: one CTA per partial, ``BWD_WARPS`` (W, 2 by default) warps a CTA. Warp ``w`` of partial ``p``'s CTA takes
the partial's blocks ``r = w, w + W, ...`` (at T = 8192, 256 blocks, P = 128: the two blocks of a partial in one
round at W = 2): for each 32-token chunk of a block, lane ``l`` computes token ``l``'s row -- its ``M`` column
gradients ``dz`` (writing ``d_input``) and ``G`` scale terms -- into row ``l`` of the warp's shared 32-row stage
(zeros past the block or past ``T``); after a barrier lane ``c`` adds the stage's column ``c`` (and ``c + 32``, ...)
row by row (token order, its 32 stage loads unrolled ahead of the adds) into the block's sums. After a barrier thread
``c`` adds the round's block sums (``r < R``) to its running partial in block order: the same additions in the same
order whatever W, so ``d_scale`` / ``d_base`` / the head partials have the same bits (GPU and g++ knob tests). The
partial sum (one thread per column) loads ``PARTIAL_ROWS`` partials a thread at a time before adding them in order
(128 by default: all of a split backward's partials in one round trip); its scale and base columns are one code path
whose loads pick their source. The backward and the partial sum start with ``griddepcontrol.wait`` (PDL), so the
partial sum's launch overlaps the backward's tail (results unchanged).

Measured on an NVIDIA H100 80GB HBM3, 2026-12-05 (T = 8192, n = 4): at the defaults (``BWD_WARPS = 2``,
``PARTIAL_ROWS = 128``) the split-mixes backward (both launches) takes 16.8 µs and the v1 head-mix backward 5.8 µs;
``BWD_WARPS = 4``: 16.8 and 6.0 µs.

Forward: one thread per token and nothing shared between threads, so a token's outputs do not depend on the threads
a CTA. ``SPLIT_FWD_THREADS`` (split mixes) and ``THREADS`` (head mix, and the partial sum's columns) are the CTA
sizes. Measured on the same H100, 2026-12-05 (T = 8192, n = 4): split forward 7.7 µs at 128 threads, 6.7 at 64, 6.6
at 32 (the default); head forward 4.2 µs at 128 (the default), 4.7 at 64, 4.8 at 32.

Knobs, each value giving the same bits (the same fp32 operations on each element in the same order; only which
thread computes what and how memory is accessed change). ``SPLIT_FWD_FLAT`` and ``SUM_WARP`` are on (measured faster,
docs/BENCHMARKS.md), ``BWD_STAGED`` off; "the default thread" below is the kernel with the knob off:

* ``SPLIT_FWD_FLAT`` (split forward): a CTA of ``FLAT_THREADS`` threads takes ``FLAT_TOKENS`` tokens; it copies
  their input rows (one contiguous block) into shared memory, thread ``e`` of a round taking float ``e`` of the block,
  then writes ``PRE`` / ``POST`` / ``COMB`` one thread per output element in memory order, each element computed
  from its shared input as the default thread computes it.
* ``SUM_WARP`` (``mhc_partials_sum``, also the v1 head-mix backward's sum): one 32-thread CTA per output column;
  for each round of ``PARTIAL_ROWS`` partials lane ``l`` copies partials ``l, l + 32, ...`` of the column into
  shared memory, then lane 0 loads the round from shared memory into registers and adds them in increasing ``p`` to
  its running sum from zero, and stores it.
* ``BWD_STAGED`` (split and head backward): for each 32-token chunk a warp first copies its tokens' input rows
  (split ``DPRE``, ``DPOST``, ``DCOMB``, ``X``, ``POST``; head ``DOUT``, ``X``: each a contiguous block) into its
  shared tiles, lane ``l`` taking floats ``l, l + 32, ...`` of a block (rows of odd length: a lane a row reads no
  bank twice); lane ``l`` then computes token ``l``'s row from the tiles, and after the stage's barrier the warp
  writes ``d_input`` (the stage's ``dz`` times its group's scale) in memory order. The block sums and partials are
  the default's; the copy and store loops are rolled (``T.serial``) to keep registers below the spill point at
  ``n = 8``.

Kernels take ``1 <= n <= MAX_N``; the public ops keep the reference path for larger n. Token counts and
partial counts are symbolic (int64 indices): one binary per n (and token block) serves every batch.
"""

import torch

from tilefuse import _jit, _ops
from tilefuse.reference.mhc import TOKEN_BLOCK  # default token block of the parameter-gradient partials
from tilefuse._rn import add as _add, call as _f, div as _div, mul as _mul, sub as _sub

KERNEL_HELPERS = ("tilefuse._rn",)  # part of this module's kernel cache key (_jit._module_digest)

MAX_N = 8        # largest multiplicity the kernels take (per-token arrays of n(n+2) floats in registers)
THREADS = 128    # head-mix forward and the partial sum: threads per CTA, one token (column) per thread
SPLIT_FWD_THREADS = 32  # split-mixes forward: threads per CTA, one token per thread (results do not depend on it)
LANES = 32       # backward kernels: threads a warp (BWD_WARPS warps a CTA), one token of a 32-token chunk each
# backward kernels: warps per CTA (>= 1). Warp w of partial p's CTA takes its blocks r = w, w + W, ... (one 32-token
# chunk per warp at a time), and the CTA adds the W block sums of a round in block order: the same sums in the same
# order (the same bits) whatever W, W blocks in flight
BWD_WARPS = 2
PARTIAL_ROWS = 128  # mhc_partials_sum: partials a thread loads at a time (in flight) before adding them in order

# ---- knobs (TILEFUSE_KNOBS; results unchanged: the same fp32 operations in the same order) ----
SPLIT_FWD_FLAT = True   # split forward: a CTA stages its tokens' input rows in shared memory, outputs written flat
FLAT_TOKENS = 32        # SPLIT_FWD_FLAT: tokens a CTA
FLAT_THREADS = 128      # SPLIT_FWD_FLAT: threads a CTA
SUM_WARP = True         # mhc_partials_sum: one warp a column (a CTA each), lane 0 adds the partials from shared memory
BWD_STAGED = False      # backward: a warp's input rows loaded to shared memory and d_input stored from it, coalesced

F32 = "float32"
I64 = "int64"


def supports(n: int) -> bool:
    """Whether the kernels take multiplicity ``n``."""
    return 1 <= n <= MAX_N


# ---- device arithmetic (explicitly rounded fp32 operations) ----

def _sigmoid(z):
    """``1 / (1 + expf(0 - z))`` (mhc.md §0)."""
    import tilelang.language as T

    one = T.float32(1.0)
    return _div(one, _add(one, _f("expf", _sub(T.float32(0.0), z))))


def _groups(n: int) -> tuple:
    """Column ranges of the three scale groups of a split-mixes row: pre, post, comb."""
    return ((0, n), (n, 2 * n), (2 * n, n * (n + 2)))


# ---- forward kernels ----

def split_mixes_fwd_kernel(n: int):
    """Factory: split mixes forward at multiplicity ``n``.

    Arguments at launch: ``X [T, M]``, ``S [3]``, ``Bs [M]``, outputs ``PRE [T, n]``, ``POST [T, n]``,
    ``COMB [T, n*n]``, then the floats ``v`` (post_mult_value) and ``eps`` (pre_eps).
    """
    import tilelang.language as T

    assert supports(n), n
    M = n * (n + 2)
    groups = _groups(n)
    TT, NT = FLAT_TOKENS, FLAT_THREADS
    Tn = T.dynamic("Tn", I64)

    if SPLIT_FWD_FLAT:
        @T.prim_func
        def mhc_split_mixes_fwd(X: T.Tensor((Tn, M), F32), S: T.Tensor((3,), F32), Bs: T.Tensor((M,), F32),
                                     PRE: T.Tensor((Tn, n), F32), POST: T.Tensor((Tn, n), F32),
                                     COMB: T.Tensor((Tn, n * n), F32), v: T.float32, eps: T.float32):
            with T.Kernel(T.ceildiv(Tn, TT), threads=NT) as bx:
                tid = T.get_thread_binding()
                t0 = T.cast(bx, I64) * TT
                xs = T.alloc_shared((TT, M), F32)
                for k in T.unroll(-(-TT * M // NT)):  # the CTA's rows [t0, t0 + TT) of X: one contiguous block
                    e = k * NT + tid
                    if e < TT * M and t0 + e // M < Tn:
                        xs[e // M, e % M] = X[t0 + e // M, e % M]
                T.sync_threads()
                for k in T.unroll(-(-TT * n // NT)):  # PRE and POST element e = token * n + i, in memory order
                    e = k * NT + tid
                    if e < TT * n and t0 + e // n < Tn:
                        PRE[t0 + e // n, e % n] = _add(_sigmoid(_add(_mul(xs[e // n, e % n], S[0]), Bs[e % n])), eps)
                        POST[t0 + e // n, e % n] = _mul(_sigmoid(_add(_mul(xs[e // n, n + e % n], S[1]),
                                                                      Bs[n + e % n])), v)
                for k in T.unroll(-(-TT * n * n // NT)):  # COMB element e = token * n * n + q
                    e = k * NT + tid
                    if e < TT * n * n and t0 + e // (n * n) < Tn:
                        COMB[t0 + e // (n * n), e % (n * n)] = _add(_mul(xs[e // (n * n), 2 * n + e % (n * n)], S[2]),
                                                                     Bs[2 * n + e % (n * n)])

        return mhc_split_mixes_fwd

    @T.prim_func
    def mhc_split_mixes_fwd(X: T.Tensor((Tn, M), F32), S: T.Tensor((3,), F32), Bs: T.Tensor((M,), F32),
                            PRE: T.Tensor((Tn, n), F32), POST: T.Tensor((Tn, n), F32),
                            COMB: T.Tensor((Tn, n * n), F32), v: T.float32, eps: T.float32):
        with T.Kernel(T.ceildiv(Tn, SPLIT_FWD_THREADS), threads=SPLIT_FWD_THREADS) as bx:
            t = T.cast(bx, I64) * SPLIT_FWD_THREADS + T.get_thread_binding()
            z = T.alloc_local((M,), F32)
            if t < Tn:
                for g, (lo, hi) in enumerate(groups):
                    for j in T.unroll(lo, hi):
                        z[j] = _add(_mul(X[t, j], S[g]), Bs[j])
                for i in T.unroll(n):
                    PRE[t, i] = _add(_sigmoid(z[i]), eps)
                for i in T.unroll(n):
                    POST[t, i] = _mul(_sigmoid(z[n + i]), v)
                for q in T.unroll(n * n):
                    COMB[t, q] = z[2 * n + q]

    return mhc_split_mixes_fwd


def head_mix_fwd_kernel(n: int):
    """Factory: head mix forward at multiplicity ``n``: ``X [T, n]``, ``S [1]``, ``Bs [n]`` -> ``OUT [T, n]``;
    then the float ``eps``."""
    import tilelang.language as T

    assert supports(n), n
    Tn = T.dynamic("Tn", I64)

    @T.prim_func
    def mhc_head_mix_fwd(X: T.Tensor((Tn, n), F32), S: T.Tensor((1,), F32), Bs: T.Tensor((n,), F32),
                         OUT: T.Tensor((Tn, n), F32), eps: T.float32):
        with T.Kernel(T.ceildiv(Tn, THREADS), threads=THREADS) as bx:
            t = T.cast(bx, I64) * THREADS + T.get_thread_binding()
            z = T.alloc_local((n,), F32)
            if t < Tn:
                for i in T.unroll(n):
                    z[i] = _add(_mul(X[t, i], S[0]), Bs[i])
                for i in T.unroll(n):
                    OUT[t, i] = _add(_sigmoid(z[i]), eps)

    return mhc_head_mix_fwd


# ---- backward kernels (per-token gradient + per-CTA token partials) ----

def _token_row(split: bool, n: int, write_dx: bool = True):
    """The backward kernels' per-token part, as a macro ``token_row(t, row, bufs)``: token ``t``'s ``M`` column
    gradients ``dz`` into ``row[:M]`` (and, with ``write_dx``, ``dz`` times its group's scale into ``d_input``), then
    its ``G`` scale terms ``sum_j dz[j] * m[j]`` into ``row[M:]``. ``bufs``: split ``(DPRE, DPOST, DCOMB, X, POST, S,
    Bs, DX, v)``, head ``(DOUT, X, S, Bs, DX)``."""
    import tilelang.language as T

    M = n * (n + 2) if split else n
    groups = _groups(n) if split else ((0, n),)

    @T.macro
    def token_row(t, row, bufs):
        if split:
            DPRE, DPOST, DCOMB, X, POST, S, Bs, DX, v = bufs
            for i in T.unroll(n):
                sig = _sigmoid(_add(_mul(X[t, i], S[0]), Bs[i]))
                row[i] = _mul(_mul(DPRE[t, i], sig), _sub(T.float32(1.0), sig))
            for i in T.unroll(n):
                po = POST[t, i]
                row[n + i] = _mul(_mul(DPOST[t, i], po), _sub(T.float32(1.0), _div(po, v)))
            for q in T.unroll(n * n):
                row[2 * n + q] = DCOMB[t, q]
        else:
            DOUT, X, S, Bs, DX = bufs
            for i in T.unroll(n):
                sig = _sigmoid(_add(_mul(X[t, i], S[0]), Bs[i]))
                row[i] = _mul(_mul(sig, _sub(T.float32(1.0), sig)), DOUT[t, i])
        for g, (lo, hi) in enumerate(groups):
            if write_dx:
                for j in T.unroll(lo, hi):
                    DX[t, j] = _mul(row[j], S[g])
            row[M + g] = _mul(row[lo], X[t, lo])
            for j in T.unroll(lo + 1, hi):
                row[M + g] = _add(row[M + g], _mul(row[j], X[t, j]))

    return token_row


def split_mixes_bwd_kernel(n: int, TB: int):
    """Factory: split mixes backward at multiplicity ``n``, token block ``TB``.

    Arguments at launch: ``DPRE [T, n]``, ``DPOST [T, n]``, ``DCOMB [T, n*n]``, ``X [T, M]``, ``POST [T, n]``,
    ``S [3]``, ``Bs [M]``, outputs ``DX [T, M]``, ``PS [P, 3]``, ``PB [P, M]`` (one CTA per partial), then the
    float ``v``.
    """
    assert supports(n) and TB >= 1, (n, TB)
    return _bwd_kernel(True, n, TB)


def head_mix_bwd_kernel(n: int, TB: int):
    """Factory: head mix backward at multiplicity ``n``, token block ``TB``.

    Arguments at launch: ``DOUT [T, n]``, ``X [T, n]``, ``S [1]``, ``Bs [n]``, outputs ``DX [T, n]``,
    ``PS [P, 1]``, ``PB [P, n]`` (one CTA per partial).
    """
    assert supports(n) and TB >= 1, (n, TB)
    return _bwd_kernel(False, n, TB)


def _bwd_kernel(split: bool, n: int, TB: int):
    """The backward kernels, ``BWD_WARPS`` (W) warps per CTA, one CTA per partial. Partial ``p`` sums its blocks ``p,
    p + P, ...`` in increasing order from zero, and a block's sum adds its tokens in token order from zero (zero rows
    past ``TB`` or ``Tn``): warp ``w`` computes the block sums of blocks ``r = w, w + W, ...`` of the partial (its own
    32-row stage; column ``c`` summed by lane ``c`` of that warp, the 32 loads unrolled ahead of the adds), puts them
    in a ``[W, F]`` tile, and after a barrier thread ``c`` adds the round's W block sums (those with ``r < R``) in
    order to its running partial; at the end the partials go to ``PS [P, G]`` (scale) and ``PB [P, M]`` (base)."""
    import tilelang.language as T

    W = BWD_WARPS
    assert W >= 1, W
    M, G = (n * (n + 2), 3) if split else (n, 1)
    F = M + G
    CPT = -(-F // LANES)             # columns a lane sums in its warp's stage
    CPW = -(-F // (W * LANES))       # columns a thread adds into the partials
    CHUNKS = -(-TB // LANES)
    NT = W * LANES
    token_row = _token_row(split, n, write_dx=not BWD_STAGED)
    widths = (n, n, n * n, M, n) if split else (n, n)  # the staged inputs: split DPRE, DPOST, DCOMB, X, POST; head
    # DOUT, X
    Tn, P = T.dynamic("Tn, P", I64)

    def staged_bufs(bufs):
        """``bufs`` as ``token_row`` reads them: unchanged by default; with BWD_STAGED each input replaced by its
        shared tile (a warp's 32 rows, odd row length: a lane a row reads no bank twice) and no ``DX`` (stored from
        the stage)."""
        if not BWD_STAGED:
            return bufs
        tiles = tuple(T.alloc_shared((W * LANES, wd | 1), F32) for wd in widths)
        if split:
            return tiles + bufs[len(widths):-2] + (None, bufs[-1])
        return tiles + bufs[len(widths):-1] + (None,)

    def dx_and_scale(bufs):
        return (bufs[-2], bufs[-4]) if split else (bufs[-1], bufs[-3])

    def group(j):
        """The scale group of column ``j``."""
        return T.if_then_else(j < n, 0, T.if_then_else(j < 2 * n, 1, 2)) if split else 0

    @T.macro
    def load_rows(SRC, DST, width, w, lane, t0, rows):
        # rows [t0, t0 + rows) of SRC [Tn, width] (one contiguous block) into rows w * 32 + ... of DST, element
        # e = k * 32 + lane of the block per lane: coalesced
        for k in T.serial(width):
            if (k * LANES + lane) // width < rows:
                DST[w * LANES + (k * LANES + lane) // width, (k * LANES + lane) % width] = SRC[
                    t0 + (k * LANES + lane) // width, (k * LANES + lane) % width]

    @T.macro
    def store_dx(bufs, stage, w, lane, t0, rows):
        # d_input rows [t0, t0 + rows) from the warp's stage (dz times its group's scale), coalesced as load_rows
        DX, S = dx_and_scale(bufs)
        for k in T.serial(M):
            if (k * LANES + lane) // M < rows:
                DX[t0 + (k * LANES + lane) // M, (k * LANES + lane) % M] = _mul(
                    stage[w, (k * LANES + lane) // M, (k * LANES + lane) % M], S[group((k * LANES + lane) % M)])

    @T.macro
    def body(Tn, P, p, tid, PS, PB, bufs):
        # the CTA of partial p (thread tid): PDL's wait, then its stages, tile and registers
        T.pdl_sync()
        stage = T.alloc_shared((W, LANES, F), F32)
        tile = T.alloc_shared((W, F), F32)
        row = T.alloc_local((F,), F32)
        acc = T.alloc_local((CPW,), F32)
        bsum = T.alloc_local((CPT,), F32)
        w = tid // LANES
        lane = tid % LANES
        R = T.ceildiv(T.ceildiv(Tn, TB) - p, P)  # blocks of this partial (<= 0: none)
        sbufs = staged_bufs(bufs)
        for k in T.unroll(CPW):
            acc[k] = T.float32(0.0)
        for rr in T.serial(T.ceildiv(R, W)):
            r = rr * W + w
            blk = p + r * P
            for k in T.unroll(CPT):
                bsum[k] = T.float32(0.0)
            for c in T.serial(CHUNKS):
                within = c * LANES + lane
                t = blk * TB + within
                # BWD_STAGED: the chunk's tokens [t0, t0 + rows) (in the partial's blocks, in the block, before Tn)
                t0 = blk * TB + c * LANES
                rows = T.if_then_else(r < R, T.max(T.min(T.min(LANES, TB - c * LANES), Tn - t0), 0), 0)
                if BWD_STAGED:
                    load_rows(bufs[0], sbufs[0], widths[0], w, lane, t0, rows)
                    load_rows(bufs[1], sbufs[1], widths[1], w, lane, t0, rows)
                    if split:
                        load_rows(bufs[2], sbufs[2], widths[2], w, lane, t0, rows)
                        load_rows(bufs[3], sbufs[3], widths[3], w, lane, t0, rows)
                        load_rows(bufs[4], sbufs[4], widths[4], w, lane, t0, rows)
                    T.sync_threads()
                if r < R and within < TB and t < Tn:
                    if BWD_STAGED:
                        token_row(w * LANES + lane, row, sbufs)
                    else:
                        token_row(t, row, bufs)
                else:
                    for j in T.unroll(F):
                        row[j] = T.float32(0.0)
                for j in T.unroll(F):
                    stage[w, lane, j] = row[j]
                T.sync_threads()
                if BWD_STAGED:
                    store_dx(bufs, stage, w, lane, t0, rows)
                for k in T.unroll(CPT):
                    if k * LANES + lane < F:
                        for s in T.unroll(LANES):
                            bsum[k] = _add(bsum[k], stage[w, s, k * LANES + lane])
                T.sync_threads()
            for k in T.unroll(CPT):
                if k * LANES + lane < F:
                    tile[w, k * LANES + lane] = bsum[k]
            T.sync_threads()
            for k in T.unroll(CPW):
                if k * NT + tid < F:
                    for ww in T.unroll(W):
                        if rr * W + ww < R:
                            acc[k] = _add(acc[k], tile[ww, k * NT + tid])
            T.sync_threads()
        for k in T.unroll(CPW):
            col = k * NT + tid
            if col < M:
                PB[p, col] = acc[k]
            elif col < F:
                PS[p, col - M] = acc[k]

    if split:
        @T.prim_func
        def mhc_split_mixes_bwd(DPRE: T.Tensor((Tn, n), F32), DPOST: T.Tensor((Tn, n), F32),
                                DCOMB: T.Tensor((Tn, n * n), F32), X: T.Tensor((Tn, M), F32),
                                POST: T.Tensor((Tn, n), F32), S: T.Tensor((3,), F32), Bs: T.Tensor((M,), F32),
                                DX: T.Tensor((Tn, M), F32), PS: T.Tensor((P, 3), F32), PB: T.Tensor((P, M), F32),
                                v: T.float32):
            with T.Kernel(P, threads=NT) as p:
                body(Tn, P, T.cast(p, I64), T.get_thread_binding(), PS, PB, (DPRE, DPOST, DCOMB, X, POST, S, Bs, DX, v))

        return mhc_split_mixes_bwd

    @T.prim_func
    def mhc_head_mix_bwd(DOUT: T.Tensor((Tn, n), F32), X: T.Tensor((Tn, n), F32), S: T.Tensor((1,), F32),
                         Bs: T.Tensor((n,), F32), DX: T.Tensor((Tn, n), F32), PS: T.Tensor((P, 1), F32),
                         PB: T.Tensor((P, n), F32)):
        with T.Kernel(P, threads=NT) as p:
            body(Tn, P, T.cast(p, I64), T.get_thread_binding(), PS, PB, (DOUT, X, S, Bs, DX))

    return mhc_head_mix_bwd


def partials_sum_kernel():
    """Factory: ``OS[g] = sum_p PS[p, g]`` and ``OB[j] = sum_p PB[p, j]``, each a left-to-right sum over
    ``p`` from zero, one thread per output column (all sizes symbolic: one binary). A thread loads ``ROWS``
    partials at a time into registers (independent loads in flight), then adds them in order."""
    import tilelang.language as T

    P, G, M = T.dynamic("P, G, M", I64)
    ROWS = PARTIAL_ROWS

    @T.macro
    def one_path_sum(PS, PB, col, acc, vals, OS, OB):
        # column col of [PS | PB]: the load picks PS or PB (indices clamped into both), then the adds in order
        acc[0] = T.float32(0.0)
        for ch in T.serial(T.ceildiv(P, ROWS)):
            for r in T.unroll(ROWS):
                if ch * ROWS + r < P:
                    vals[r] = T.if_then_else(col < G, PS[ch * ROWS + r, T.min(col, G - 1)],
                                             PB[ch * ROWS + r, T.max(col - G, 0)])
            for r in T.unroll(ROWS):
                if ch * ROWS + r < P:
                    acc[0] = _add(acc[0], vals[r])
        if col < G:
            OS[col] = acc[0]
        else:
            OB[col - G] = acc[0]

    if SUM_WARP:
        @T.prim_func
        def mhc_partials_sum(PS: T.Tensor((P, G), F32), PB: T.Tensor((P, M), F32), OS: T.Tensor((G,), F32),
                                  OB: T.Tensor((M,), F32)):
            with T.Kernel(G + M, threads=LANES) as bx:
                T.pdl_sync()
                col = T.cast(bx, I64)
                lane = T.get_thread_binding()
                buf = T.alloc_shared((ROWS,), F32)
                acc = T.alloc_local((1,), F32)
                vals = T.alloc_local((ROWS,), F32)
                acc[0] = T.float32(0.0)
                for ch in T.serial(T.ceildiv(P, ROWS)):
                    for k in T.unroll(-(-ROWS // LANES)):  # lane l: partials l, l + 32, ... of the chunk
                        if k * LANES + lane < ROWS and ch * ROWS + k * LANES + lane < P:
                            buf[k * LANES + lane] = T.if_then_else(
                                col < G, PS[ch * ROWS + k * LANES + lane, T.min(col, G - 1)],
                                PB[ch * ROWS + k * LANES + lane, T.max(col - G, 0)])
                    T.sync_threads()
                    if lane == 0:
                        for r in T.unroll(ROWS):  # every shared load of the chunk ahead of the adds
                            if ch * ROWS + r < P:
                                vals[r] = buf[r]
                        for r in T.unroll(ROWS):
                            if ch * ROWS + r < P:
                                acc[0] = _add(acc[0], vals[r])
                    T.sync_threads()
                if lane == 0:
                    if col < G:
                        OS[col] = acc[0]
                    else:
                        OB[col - G] = acc[0]

        return mhc_partials_sum

    @T.prim_func
    def mhc_partials_sum(PS: T.Tensor((P, G), F32), PB: T.Tensor((P, M), F32), OS: T.Tensor((G,), F32),
                         OB: T.Tensor((M,), F32)):
        with T.Kernel(T.ceildiv(G + M, THREADS), threads=THREADS) as bx:
            T.pdl_sync()
            col = T.cast(bx, I64) * THREADS + T.get_thread_binding()
            acc = T.alloc_local((1,), F32)
            vals = T.alloc_local((ROWS,), F32)
            if col < G + M:
                one_path_sum(PS, PB, col, acc, vals, OS, OB)

    return mhc_partials_sum


# ---- registration of the configs the bench launches ----

BENCH_N = (4,)


def _n_configs() -> list[tuple]:
    return [(n,) for n in BENCH_N]


def _bwd_configs() -> list[tuple]:
    return [(n, TOKEN_BLOCK) for n in BENCH_N]


_jit.register("mhc_split_mixes_fwd", split_mixes_fwd_kernel, _n_configs)
_jit.register("mhc_split_mixes_bwd", split_mixes_bwd_kernel, _bwd_configs)
_jit.register("mhc_head_mix_fwd", head_mix_fwd_kernel, _n_configs)
_jit.register("mhc_head_mix_bwd", head_mix_bwd_kernel, _bwd_configs)
_jit.register("mhc_partials_sum", partials_sum_kernel, lambda: [()])


# ---- launchers (no validation: the public ops validate; ``n`` must satisfy ``supports``) ----

def _packed(t: torch.Tensor) -> torch.Tensor:
    """Scale and base may be strided views (the public ops accept them); the kernels take packed vectors."""
    return t if t.is_contiguous() else t.contiguous()


def split_mixes_fwd_launch(input_mixes, scale, base, pre, post, comb, post_mult_value: float,
                           pre_eps: float) -> None:
    """Write ``pre [T, n]``, ``post [T, n]``, ``comb [T, n*n]`` from ``input_mixes [T, M]`` (one launch)."""
    T_, n = pre.shape
    if T_ == 0:
        return
    _jit.get("mhc_split_mixes_fwd", (n,))(input_mixes, _packed(scale), _packed(base), pre, post, comb,
                                           float(post_mult_value), float(pre_eps))


# The partial count P of the parameter gradients' token reductions (the split-mixes backward and the v1 head-mix
# backward): a constant, not the device's SM count as upstream takes it (mhc.md 2.3), so the gradients' bits do not
# depend on the GPU; about one partial an SM of an H100 or H200.
PARTIALS = 128


def num_partials(device: torch.device) -> int:
    """``PARTIALS`` on CUDA, 1 elsewhere (the reference's plain token sum)."""
    return PARTIALS if device.type == "cuda" else 1


def partials_sum_launch(scale_partial, base_partial, d_scale, d_base) -> None:
    """Overwrite ``d_scale [G]``, ``d_base [M]`` with the in-order sums of ``[P, G]``, ``[P, M]`` partials."""
    _jit.get("mhc_partials_sum", ())(scale_partial, base_partial, d_scale, d_base)


def split_mixes_bwd_launch(d_pre, d_post, d_comb, input_mixes, post, scale, base, d_input, d_scale, d_base,
                           post_mult_value: float, partials: int = 0) -> None:
    """Write ``d_input [T, M]`` and overwrite ``d_scale [3]``, ``d_base [M]`` (two launches: per-token
    gradients with ``partials`` token partials (0: ``num_partials``), then their in-order sum).
    ``T == 0`` zeroes the sums."""
    T_, M = input_mixes.shape
    n = post.shape[1]
    if T_ == 0:
        d_scale.zero_()
        d_base.zero_()
        return
    P = partials or num_partials(input_mixes.device)
    ps = torch.empty(P, 3, dtype=torch.float32, device=input_mixes.device)
    pb = torch.empty(P, M, dtype=torch.float32, device=input_mixes.device)
    _jit.get("mhc_split_mixes_bwd", (n, TOKEN_BLOCK))(d_pre, d_post, d_comb, input_mixes, post, _packed(scale),
                                                      _packed(base), d_input, ps, pb, float(post_mult_value))
    partials_sum_launch(ps, pb, d_scale, d_base)


def head_mix_fwd_launch(input_mix, scale, base, output_mix, pre_eps: float) -> None:
    """Write ``output_mix [T, n]`` (one launch)."""
    T_, n = input_mix.shape
    if T_ == 0:
        return
    _jit.get("mhc_head_mix_fwd", (n,))(input_mix, _packed(scale), _packed(base), output_mix, float(pre_eps))


def head_mix_bwd_launch(d_out, input_mix, scale, base, d_input, scale_partial, base_partial,
                        token_block: int) -> None:
    """Write ``d_input [T, n]`` and the partials ``[P, 1]``, ``[P, n]`` (P = their first dim; token blocks of
    ``token_block``). ``T == 0`` zeroes the partials."""
    T_, n = input_mix.shape
    if T_ == 0:
        scale_partial.zero_()
        base_partial.zero_()
        return
    _jit.get("mhc_head_mix_bwd", (n, int(token_block)))(d_out, input_mix, _packed(scale), _packed(base), d_input,
                                                         scale_partial, base_partial)


def head_mix_bwd_sums_launch(d_out, input_mix, scale, base, d_input, d_scale, d_base) -> None:
    """The v1 head-mix backward: ``d_input [T, n]`` and the final ``d_scale [1]``, ``d_base [n]``: SM-count
    partials in token blocks of ``TOKEN_BLOCK``, then their in-order sum (two launches)."""
    P = num_partials(input_mix.device)
    n = input_mix.shape[1]
    ps = torch.empty(P, 1, dtype=torch.float32, device=input_mix.device)
    pb = torch.empty(P, n, dtype=torch.float32, device=input_mix.device)
    head_mix_bwd_launch(d_out, input_mix, scale, base, d_input, ps, pb, TOKEN_BLOCK)
    partials_sum_launch(ps, pb, d_scale, d_base)


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::mhc_split_mixes_fwd", mutates_args=("pre", "post", "comb"), device_types="cuda")
def _split_fwd_op(input_mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, pre: torch.Tensor,
                  post: torch.Tensor, comb: torch.Tensor, post_mult_value: float, pre_eps: float) -> None:
    split_mixes_fwd_launch(input_mixes, scale, base, pre, post, comb, post_mult_value, pre_eps)



@_ops.kernel_op("tilefuse::mhc_split_mixes_bwd", mutates_args=("d_input", "d_scale", "d_base"),
                device_types="cuda")
def _split_bwd_op(d_pre: torch.Tensor, d_post: torch.Tensor, d_comb: torch.Tensor, input_mixes: torch.Tensor,
                  post: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, d_input: torch.Tensor,
                  d_scale: torch.Tensor, d_base: torch.Tensor, post_mult_value: float) -> None:
    split_mixes_bwd_launch(d_pre, d_post, d_comb, input_mixes, post, scale, base, d_input, d_scale, d_base,
                           post_mult_value)



@_ops.kernel_op("tilefuse::mhc_head_mix_fwd", mutates_args=("output_mix",), device_types="cuda")
def _head_fwd_op(input_mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, output_mix: torch.Tensor,
                 pre_eps: float) -> None:
    head_mix_fwd_launch(input_mix, scale, base, output_mix, pre_eps)



@_ops.kernel_op("tilefuse::mhc_head_mix_bwd", mutates_args=("d_input", "scale_partial", "base_partial"),
                device_types="cuda")
def _head_bwd_op(d_out: torch.Tensor, input_mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                 d_input: torch.Tensor, scale_partial: torch.Tensor, base_partial: torch.Tensor,
                 token_block: int) -> None:
    head_mix_bwd_launch(d_out, input_mix, scale, base, d_input, scale_partial, base_partial, token_block)



@_ops.kernel_op("tilefuse::mhc_head_mix_bwd_sums", mutates_args=("d_input", "d_scale", "d_base"),
                device_types="cuda")
def _head_bwd_sums_op(d_out: torch.Tensor, input_mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                      d_input: torch.Tensor, d_scale: torch.Tensor, d_base: torch.Tensor) -> None:
    head_mix_bwd_sums_launch(d_out, input_mix, scale, base, d_input, d_scale, d_base)



# ---- CUDA entries: a direct launch in eager mode, the custom op while tracing ----

def _tracing(x) -> bool:
    """torch.compile is tracing, or ``x`` is not a plain tensor (a fake or functional tensor of a trace that
    does not set the compiling flag, or a subclass): take the registered op."""
    return torch.compiler.is_compiling() or type(x) is not torch.Tensor


def split_mixes_fwd_cuda(*args) -> None:
    (torch.ops.tilefuse.mhc_split_mixes_fwd if _tracing(args[0]) else split_mixes_fwd_launch)(*args)


def split_mixes_bwd_cuda(*args) -> None:
    (torch.ops.tilefuse.mhc_split_mixes_bwd if _tracing(args[0]) else split_mixes_bwd_launch)(*args)


def head_mix_fwd_cuda(*args) -> None:
    (torch.ops.tilefuse.mhc_head_mix_fwd if _tracing(args[0]) else head_mix_fwd_launch)(*args)


def head_mix_bwd_cuda(*args) -> None:
    (torch.ops.tilefuse.mhc_head_mix_bwd if _tracing(args[0]) else head_mix_bwd_launch)(*args)


def head_mix_bwd_sums_cuda(*args) -> None:
    (torch.ops.tilefuse.mhc_head_mix_bwd_sums if _tracing(args[0]) else head_mix_bwd_sums_launch)(*args)
