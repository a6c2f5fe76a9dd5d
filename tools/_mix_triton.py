"""Triton streaming kernels for ``tools/mix_ceiling.py`` (imported there on first use: Triton is on the GPU host
only). Each program moves BLOCK int32 elements of every input and output; no arithmetic to speak of."""
import triton
import triton.language as tl


@triton.jit
def copy_1_1(X, Y, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    tl.store(Y + o, tl.load(X + o, mask=m), mask=m)


@triton.jit
def copy_1_15(X, Y0, Y1, N, BLOCK: tl.constexpr):   # int32 in; int32 and int16 out
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    x = tl.load(X + o, mask=m)
    tl.store(Y0 + o, x, mask=m)
    tl.store(Y1 + o, x.to(tl.int16), mask=m)


@triton.jit
def widen_1_2(X, Y, N, BLOCK: tl.constexpr):   # int32 in, int64 out
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    tl.store(Y + o, tl.load(X + o, mask=m).to(tl.int64), mask=m)


@triton.jit
def add_2_4(X0, X1, Y0, Y1, Y2, Y3, N, BLOCK: tl.constexpr):   # two int32 in, four int32 out
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    s = tl.load(X0 + o, mask=m) + tl.load(X1 + o, mask=m)
    tl.store(Y0 + o, s, mask=m)
    tl.store(Y1 + o, s, mask=m)
    tl.store(Y2 + o, s, mask=m)
    tl.store(Y3 + o, s, mask=m)


@triton.jit
def add_2_1(X0, X1, Y, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    tl.store(Y + o, tl.load(X0 + o, mask=m) + tl.load(X1 + o, mask=m), mask=m)


@triton.jit
def mix(X, Y0, Y1, Y2, YN, N, IN: tl.constexpr, NOUT: tl.constexpr, NARROW: tl.constexpr, BLOCK: tl.constexpr):
    """One stream of a chosen byte mix per element: IN (0/1) int32 reads; NOUT (0-3) int32 writes, plus one int8
    (NARROW = 1) or int16 (NARROW = 2) write. With no write at all (a read-only stream) each program stores one
    sum, so the loads are not dead."""
    pid = tl.program_id(0)
    o = pid * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    x = tl.load(X + o, mask=m) if IN else o
    if NOUT >= 1:
        tl.store(Y0 + o, x, mask=m)
    if NOUT >= 2:
        tl.store(Y1 + o, x, mask=m)
    if NOUT >= 3:
        tl.store(Y2 + o, x, mask=m)
    if NARROW == 1:
        tl.store(YN + o, x.to(tl.int8), mask=m)
    if NARROW == 2:
        tl.store(YN + o, x.to(tl.int16), mask=m)
    if NOUT == 0 and NARROW == 0:
        tl.store(YN + pid, tl.sum(x, axis=0))
