"""TileLang kernels for the Sinkhorn of mHC (mhc.md §2.4, §5.2): ``mhc_sinkhorn_fwd`` / ``mhc_sinkhorn_bwd`` on
``[T, n, n]`` fp32 logits, behind ``sinkhorn_normalize`` (v1) and the v2.1 destination-passing ops.

One matrix per thread: a thread holds a whole ``n x n`` matrix in registers. The kernels take ``n`` in ``KERNEL_N``
and a backward ``repeat`` up to ``MAX_BWD_REPEAT``; other inputs keep the reference (``fwd_supported`` /
``bwd_supported``).

Measured on an NVIDIA H200, 2026-12-05 (32768 x 4 x 4, 20 iterations, isolated timer, ``bench --compare --quick
--peers tk2``), forward / backward: 15.4 / 67.8 µs, TileKernels 2.1.0 19.1 / 60.7 in the same process (1.24x /
0.89x). On an NVIDIA H100 80GB HBM3 the same day: 15.6 / 67.1; with ``FAST_DIV=False`` 26.3 / 80.6; with
``PT_KEEP=2`` backward 84.6.

Arithmetic (§2.4): forward steps 1-5 are the softmax of the row (max, ``expf(x - max)``, divide by the sum),
``+ eps``, a column step, then ``repeat - 1`` (row step, column step) pairs, each dividing by ``sum + eps`` (IEEE
division: fast-math is off). ``repeat`` and ``eps`` are launch arguments of the forward: one binary per ``n``.
The backward (§2.4 backward, the order of ``sinkhorn_normalize_bwd_ref``) replays the forward keeping the softmax
``A0`` and, for each of the ``2 repeat - 1`` steps, its input value and its ``sum + eps``; walking the steps
back, ``tau = sum(g * U) / s`` and ``g = (g - tau) / s``; finally ``d_x = (g - sum_k g * A0) * A0``; ``repeat`` is
a compile-time constant of the backward. Every add of a sum is ``__fadd_rn`` and every product feeding one is
``__fmul_rn``, so nvcc contracts nothing into an fma (``expf`` ends in a multiply). No atomics: deterministic and
batch-invariant.

The kernels. A thread holds a whole matrix: its ``n^2`` values in registers, row and column sums and maxima as fixed
trees (``_tree``: the order lane 0 of an XOR butterfly over the row or column ends with, distances ``n/2, ..., 1``; for
n = 4 the sum of ``e0..e3`` is ``(e0 + e2) + (e1 + e3)``, the order of upstream's forward, mhc.md §2.4), IEEE quotients.
With ``FAST_DIV`` the quotients of a row or column by its ``d = sum + eps`` share ``y = RN(1/d)``: ``q0 = RN(a y)``, ``q
= RN(q0 + y RN-exact(a - d q0))`` is the IEEE quotient (Markstein's theorem; a g++ test checks it on 10^7 operand pairs)
while ``d`` is in [2^-30, 2^30] and every ``|a|`` in [2^-90, 2^90] (no subnormal quotient, remainder or reciprocal); one
check a step (min / max trees) picks that path or plain IEEE division for the whole matrix. ``y`` comes from
``__frcp_rn``'s own fast-path steps (``MUFU.RCP`` through ``__fdividef(1, d)``, one Newton step; ``RCP_APPROX``),
without its range branch. The plain IEEE division is a subroutine with its own range branch: 10 instructions, and ptxas
does not overlap two of them (each is a separate convergence region), so 16 of them a step in one thread would be a
16-deep serial chain. ptxas sm_90: forward 42 registers, backward 135 at repeat 20, no spills. A step costs one thread
about 150 SASS instructions (16 adds, 36 min / max for the range check, 4 x 7 for the reciprocals, 16 x 3 for the
quotients, the branch), some 4.7 warp-instructions a matrix-step. The backward keeps the iterate entering every
``PT_KEEP`` (4) steps in shared memory (``[segment, element, thread]``, 20 KB a CTA of 32 threads at repeat 20) and
replays each segment into registers on the way back (29 extra steps at repeat 20); threads past the last matrix compute
on zeros and store nothing. The kept iterates take ``ceil((2 repeat - 1) / PT_KEEP) n^2 PT_THREADS`` floats of shared
memory (32 KB at n = 4, repeat 32): ``MAX_BWD_REPEAT`` bounds them, and longer chains keep the reference.
What bounds them (Nsight Compute on the H200, the bench's launch): latency, not issue. The forward executes 6.4 M
warp-instructions (the estimate of 1024 warps x 40 steps x 150 instructions said 6.1 M) in 13.9 µs; 32768 threads
are 1.9 warps a scheduler, 0.92 of them eligible a cycle, so the issue slots are 45% busy (3.4 cycles between a warp's
instructions: the quotient and sum chains). The backward: 26.2 M warp-instructions in 74.7 µs, 0.53 eligible warps of
1.9, 34% busy. The issue-bound estimate (8-10 µs forward, 15-25 backward) assumed a busy scheduler. More threads a
matrix was tried as a knob (2 or 4 threads a matrix, each holding rows ``a, a + TPM, ...``, column sums by XOR
shuffles, the same bits): forward 16.3 / 19.8 µs, backward 65.8 / 79.9 on the H200 against 15.4 / 67.8 in the same
session, so the shuffles and the reciprocals each thread repeats cost what the extra warps gain.
"""
from __future__ import annotations

import torch

from tilefuse import _jit, _launch, _ops
from tilefuse._rn import add as _fadd, call as _call, fma as _fma, mul as _fmul
from tilefuse.mhc._rows import write_through

KERNEL_HELPERS = ("tilefuse._rn",)  # part of this module's kernel cache key (_jit._module_digest)

# ---- tuning knobs (TILEFUSE_KNOBS) ----
# PDL: the first statement waits for the stream's previous grid (griddepcontrol.wait), so the launch and CTA
# setup overlap the previous kernel's tail. Results unchanged.
PDL = True
PT_THREADS = 32   # threads (= matrices) per CTA
PT_KEEP = 4       # backward: the iterate before every PT_KEEP-th step is kept in shared memory
FAST_DIV = True   # the quotients by one sum share RN(1 / sum) (Markstein; module doc)
RCP_APPROX = True  # FAST_DIV: RN(1 / sum) by __frcp_rn's fast-path steps from MUFU.RCP (False: __frcp_rn itself)

KERNEL_N = (2, 4)       # multiplicities the kernels take (the trees' rows and columns); others keep the reference
MAX_BWD_REPEAT = 32     # backward: the longest chain it keeps in shared memory (module doc); longer: the reference
MAX_FWD_REPEAT = 2 ** 31 - 1  # the forward's repeat is an int32 launch argument


def _expf(v):
    import tilelang.language as T

    return T.call_extern("float32", "expf", v)


# ---- the kernels: one matrix per thread ----

# Operand ranges where the shared-reciprocal quotient is the IEEE quotient (module doc): the divisor in
# [2^-30, 2^30], every dividend's magnitude in [2^-90, 2^90] (so the quotient, the remainder's granule and 1 / d
# are normal numbers). Zeros, denormals, infinities and NaN fall outside and take IEEE division.
DIV_DEN_LO, DIV_DEN_HI = 2.0 ** -30, 2.0 ** 30
DIV_NUM_LO, DIV_NUM_HI = 2.0 ** -90, 2.0 ** 90


def _members(n: int, over: str, gi: int) -> tuple:
    """Element indices (``j * n + k``) of row ``gi`` (``"row"``) or column ``gi`` (``"col"``)."""
    return tuple(gi * n + k for k in range(n)) if over == "row" else tuple(j * n + gi for j in range(n))


def _group(n: int, over: str, q: int) -> int:
    """The row (``"row"``) or column (``"col"``) of element ``q``."""
    return q // n if over == "row" else q % n


def _tree(vals, op):
    """``op`` over a row's or column's values in the order of lane 0 of an XOR butterfly (distances n/2, ..., 1):
    pairs ``(l, l + d)``. For n = 4: ``op(op(v0, v2), op(v1, v3))``."""
    vals = list(vals)
    d = len(vals) // 2
    while d >= 1:
        vals = [op(vals[l], vals[l + d]) for l in range(d)]
        d //= 2
    return vals[0]


def _matrix_pairs(n: int, over: str, doff: int = 0, noff: int = 0) -> tuple:
    """``(dst index, dividend index, divisor slot)`` of dividing a matrix by its row / column sums."""
    return tuple((doff + q, noff + q, _group(n, over, q)) for q in range(n * n))


def _common(n: int):
    """Macros of the kernels: ``divide`` (quotients sharing a divisor), ``normalize`` (one Sinkhorn step)
    and ``softmax``."""
    import tilelang.language as T

    assert n in KERNEL_N, n
    rows = tuple(range(n))

    def fast_ok(num, den, pairs, dens):
        """Every divisor in [DIV_DEN_LO, DIV_DEN_HI] and every |dividend| in [DIV_NUM_LO, DIV_NUM_HI]: the
        extremes by min / max trees (no branch per operand)."""
        ds = [den[d] for d in dens]
        ns = [T.abs(num[i]) for _, i, _ in pairs]
        return T.And(T.And(_tree(ds, T.min) >= T.float32(DIV_DEN_LO), _tree(ds, T.max) <= T.float32(DIV_DEN_HI)),
                     T.And(_tree(ns, T.min) >= T.float32(DIV_NUM_LO), _tree(ns, T.max) <= T.float32(DIV_NUM_HI)))

    def quotient(a, d, y):
        """RN(a / d) from y = RN(1 / d): q0 = RN(a y), r = a - d q0 (exact), RN(q0 + r y) (Markstein)."""
        q0 = _fmul(a, y)
        return _fma(y, _fma(T.float32(0.0) - d, q0, a), q0)

    @T.macro
    def divide(dst, num, den, rcp, pairs, dens):
        """``dst[i] = num[j] / den[dens[k]]`` for ``(i, j, k)`` in ``pairs`` (IEEE quotients)."""
        if FAST_DIV:
            if fast_ok(num, den, pairs, dens):
                for k, d in tuple(enumerate(dens)):
                    if RCP_APPROX:  # RN(1 / d) by __frcp_rn's own steps (its range branch is the check above)
                        rcp[k] = _call("__fdividef", T.float32(1.0), den[d])
                        rcp[k] = _fma(rcp[k], _fma(T.float32(0.0) - den[d], rcp[k], T.float32(1.0)), rcp[k])
                    else:
                        rcp[k] = _call("__frcp_rn", den[d])
                for i, j, k in pairs:
                    dst[i] = quotient(num[j], den[dens[k]], rcp[k])
            else:
                for i, j, k in pairs:
                    dst[i] = num[j] / den[dens[k]]
        else:
            for i, j, k in pairs:
                dst[i] = num[j] / den[dens[k]]

    @T.macro
    def normalize(a, off, den, doff, rcp, over, eps, dst, dst_off):
        """One step: ``den[doff + g] = sum(group g of a[off:]) + eps``, ``dst[dst_off + q] = a[off + q] / den``."""
        for gi in rows:
            den[doff + gi] = _tree([a[off + q] for q in _members(n, over, gi)], _fadd) + eps
        divide(dst, a, den, rcp, _matrix_pairs(n, over, dst_off, off), tuple(doff + gi for gi in rows))

    @T.macro
    def softmax(a, den, rcp):
        """``a`` (logits) becomes the softmax of its rows; ``den`` (n) and ``rcp`` (n) are scratch."""
        for gi in rows:
            den[gi] = _tree([a[q] for q in _members(n, "row", gi)], T.max)
        for q in tuple(range(n * n)):
            a[q] = _expf(a[q] - den[q // n])
        for gi in rows:
            den[gi] = _tree([a[q] for q in _members(n, "row", gi)], _fadd)
        divide(a, a, den, rcp, _matrix_pairs(n, "row"), rows)

    @T.macro
    def forward(a, den, rcp, eps, repeat):
        """The forward (§2.4 steps 1-5) of the logits ``a`` in place: softmax, ``+ eps``, a column step, then
        ``repeat - 1`` (row step, column step) pairs."""
        softmax(a, den, rcp)
        for q in T.unroll(n * n):
            a[q] = a[q] + eps
        normalize(a, 0, den, 0, rcp, "col", eps, a, 0)
        for _ in T.serial(repeat - 1):
            normalize(a, 0, den, 0, rcp, "row", eps, a, 0)
            normalize(a, 0, den, 0, rcp, "col", eps, a, 0)

    return divide, normalize, softmax, forward


def sinkhorn_fwd_kernel(n: int):
    """Factory: the forward for multiplicity ``n`` (``KERNEL_N``). Launch: ``X``, ``Y`` fp32 ``[T, n, n]``
    contiguous (T symbolic), ``repeat`` (int32, >= 1), ``eps`` (fp32)."""
    import tilelang.language as T

    forward = _common(n)[3]
    NN, TPB = n * n, PT_THREADS
    Tn = T.dynamic("num_tokens", "int64")

    @T.prim_func
    def sinkhorn_fwd(X: T.Tensor((Tn, n, n), "float32"), Y: T.Tensor((Tn, n, n), "float32"),
                     repeat: T.int32, eps: T.float32):
        with T.Kernel(T.ceildiv(Tn, TPB), threads=TPB) as bx:
            if PDL:
                T.pdl_sync()
            t = T.cast(bx, "int64") * TPB + T.cast(T.get_thread_binding(), "int64")
            a = T.alloc_local((NN,), "float32")
            den = T.alloc_local((n,), "float32")
            rcp = T.alloc_local((n,), "float32")
            if t < Tn:
                for j in T.unroll(n):
                    for k in T.vectorized(n):
                        a[j * n + k] = X[t, j, k]
                forward(a, den, rcp, eps, repeat)
                for j in T.unroll(n):
                    for k in T.vectorized(n):
                        Y[t, j, k] = a[j * n + k]

    return sinkhorn_fwd


def sinkhorn_bwd_kernel(n: int, repeat: int):
    """Factory: the backward for multiplicity ``n`` (``KERNEL_N``) and ``1 <= repeat <= MAX_BWD_REPEAT``. Launch: ``G``
    (d_out), ``X``, ``DX`` fp32 ``[T, n, n]`` contiguous (T symbolic), ``eps`` (fp32). The steps are cut into segments
    of ``PT_KEEP`` (even: a step's row / column kind is its parity within the segment); the iterate entering each
    segment goes to shared memory (``[segment, element, thread]``: consecutive threads, consecutive words). Walking
    back, each segment is replayed from its kept iterate into registers (the same operations: the same bits) and then
    walked back. Full segments run in a loop (one copy of the code), the shorter last one unrolled."""
    import tilelang.language as T

    assert 1 <= repeat <= MAX_BWD_REPEAT, repeat
    divide, normalize, softmax, _ = _common(n)
    NN, TPB, K = n * n, PT_THREADS, PT_KEEP
    assert K >= 2 and K % 2 == 0, K
    S = 2 * repeat - 1
    FULL, TAIL = divmod(S, K)
    SLOTS = FULL + (TAIL > 0)
    rows = tuple(range(n))

    def over(i):
        return "col" if i % 2 == 0 else "row"

    Tn = T.dynamic("num_tokens", "int64")

    @T.macro
    def walk_segment(kept, seg, L, tid, u, den, g, tau, rcp, eps):
        """Replay the ``L`` steps of segment ``seg`` from its kept iterate, then walk ``g`` back through them."""
        for q in T.unroll(NN):
            u[q] = kept[seg, q, tid]
        for i in tuple(range(L)):
            if i + 1 < L:
                normalize(u, i * NN, den, i * n, rcp, over(i), eps, u, (i + 1) * NN)
            else:
                for gi in rows:
                    den[i * n + gi] = _tree([u[i * NN + q] for q in _members(n, over(i), gi)], _fadd) + eps
        for i in tuple(reversed(range(L))):
            for gi in rows:
                tau[gi] = _tree([_fmul(g[q], u[i * NN + q]) for q in _members(n, over(i), gi)], _fadd)
            divide(tau, tau, den, rcp, tuple((gi, gi, gi) for gi in rows), tuple(i * n + gi for gi in rows))
            for q in tuple(range(NN)):
                g[q] = g[q] - tau[_group(n, over(i), q)]
            divide(g, g, den, rcp, _matrix_pairs(n, over(i)), tuple(i * n + gi for gi in rows))

    @T.prim_func
    def sinkhorn_bwd(G: T.Tensor((Tn, n, n), "float32"), X: T.Tensor((Tn, n, n), "float32"),
                     DX: T.Tensor((Tn, n, n), "float32"), eps: T.float32):
        with T.Kernel(T.ceildiv(Tn, TPB), threads=TPB) as bx:
            if PDL:
                T.pdl_sync()
            tid = T.get_thread_binding()
            t = T.cast(bx, "int64") * TPB + T.cast(tid, "int64")
            kept = T.alloc_shared((SLOTS, NN, TPB), "float32")
            a0 = T.alloc_local((NN,), "float32")     # softmax output (before + eps)
            a = T.alloc_local((NN,), "float32")      # the replayed iterate
            g = T.alloc_local((NN,), "float32")      # the gradient walked back
            u = T.alloc_local((K * NN,), "float32")  # a segment's step inputs
            den = T.alloc_local((K * n,), "float32")  # a segment's sums + eps
            tau = T.alloc_local((n,), "float32")
            rcp = T.alloc_local((n,), "float32")
            for q in T.unroll(NN):
                a0[q] = T.float32(0.0)
                g[q] = T.float32(0.0)
            if t < Tn:  # threads past the last matrix compute on zeros and store nothing
                for j in T.unroll(n):
                    for k in T.vectorized(n):
                        a0[j * n + k] = X[t, j, k]
                        g[j * n + k] = G[t, j, k]
            softmax(a0, tau, rcp)
            for q in T.unroll(NN):
                a[q] = a0[q] + eps
            for seg in T.serial(FULL):
                for q in T.unroll(NN):
                    kept[seg, q, tid] = a[q]
                for i in tuple(range(K)):
                    normalize(a, 0, den, 0, rcp, over(i), eps, a, 0)
            if TAIL > 0:
                for q in T.unroll(NN):
                    kept[FULL, q, tid] = a[q]
                walk_segment(kept, FULL, TAIL, tid, u, den, g, tau, rcp, eps)
            for r in T.serial(FULL):
                walk_segment(kept, FULL - 1 - r, K, tid, u, den, g, tau, rcp, eps)
            for gi in rows:
                tau[gi] = _tree([_fmul(g[q], a0[q]) for q in _members(n, "row", gi)], _fadd)
            if t < Tn:
                for q in tuple(range(NN)):
                    DX[t, q // n, q % n] = (g[q] - tau[q // n]) * a0[q]

    return sinkhorn_bwd


BENCH_REPEATS = (10, 20)  # the spec's test grid (R = 10, mhc.md §4) and the bench row (20 iterations)


_jit.register("mhc_sinkhorn_fwd", sinkhorn_fwd_kernel, lambda: [(4,)])
_jit.register("mhc_sinkhorn_bwd", sinkhorn_bwd_kernel, lambda: [(4, r) for r in BENCH_REPEATS])


# ---- which inputs the kernels take ----

def fwd_supported(x: torch.Tensor, repeat: int) -> bool:
    """The forward kernel takes ``x`` (fp32 ``[..., n, n]`` on CUDA, ``n`` in ``KERNEL_N``) at this ``repeat``."""
    return (x.is_cuda and x.dtype == torch.float32 and x.dim() >= 2 and x.shape[-1] in KERNEL_N
            and 1 <= repeat <= MAX_FWD_REPEAT)


def bwd_supported(x: torch.Tensor, repeat: int) -> bool:
    """The backward kernel takes ``x`` at this ``repeat`` (``repeat <= MAX_BWD_REPEAT``)."""
    return fwd_supported(x, repeat) and repeat <= MAX_BWD_REPEAT


# ---- launchers (no validation: the public ops validate; tensors contiguous [T, n, n] fp32) ----

def sinkhorn_fwd_launch(x: torch.Tensor, out: torch.Tensor, repeat: int, eps: float) -> None:
    """Write the Sinkhorn of ``x`` into ``out`` (one launch; none for T = 0). The kernel's vector accesses need
    16-byte aligned rows: a misaligned ``x`` is bound through an aligned copy, a misaligned ``out`` written through
    one."""
    if x.size(0) == 0:
        return
    fn = _jit.get("mhc_sinkhorn_fwd", (x.size(-1),))
    write_through(out, lambda dst: fn(_launch.aligned(x), dst, int(repeat), float(eps)))


def sinkhorn_bwd_launch(d_out: torch.Tensor, x: torch.Tensor, d_x: torch.Tensor, repeat: int, eps: float) -> None:
    """Write the Sinkhorn input gradient into ``d_x`` (one launch; none for T = 0; misaligned tensors as in the
    forward)."""
    if x.size(0) == 0:
        return
    fn = _jit.get("mhc_sinkhorn_bwd", (x.size(-1), int(repeat)))
    write_through(d_x, lambda dst: fn(_launch.aligned(d_out), _launch.aligned(x), dst, float(eps)))


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::mhc_sinkhorn_fwd", mutates_args=("y",), device_types="cuda")
def _sinkhorn_fwd_op(x: torch.Tensor, y: torch.Tensor, repeat: int, eps: float) -> None:
    sinkhorn_fwd_launch(x, y, repeat, eps)



@_ops.kernel_op("tilefuse::mhc_sinkhorn_bwd", mutates_args=("d_x",), device_types="cuda")
def _sinkhorn_bwd_op(d_out: torch.Tensor, x: torch.Tensor, d_x: torch.Tensor, repeat: int, eps: float) -> None:
    sinkhorn_bwd_launch(d_out, x, d_x, repeat, eps)



def sinkhorn_fwd_cuda(x: torch.Tensor, out: torch.Tensor, repeat: int, eps: float) -> None:
    """CUDA entry (``[T, n, n]`` views): a direct launch in eager mode, the custom op under ``torch.compile``."""
    if torch.compiler.is_compiling():
        torch.ops.tilefuse.mhc_sinkhorn_fwd(x, out, repeat, eps)
    else:
        sinkhorn_fwd_launch(x, out, repeat, eps)


def sinkhorn_bwd_cuda(d_out: torch.Tensor, x: torch.Tensor, d_x: torch.Tensor, repeat: int, eps: float) -> None:
    """CUDA entry of the backward, as ``sinkhorn_fwd_cuda``."""
    if torch.compiler.is_compiling():
        torch.ops.tilefuse.mhc_sinkhorn_bwd(d_out, x, d_x, repeat, eps)
    else:
        sinkhorn_bwd_launch(d_out, x, d_x, repeat, eps)
