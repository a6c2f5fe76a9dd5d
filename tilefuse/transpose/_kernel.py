"""TileLang kernel for ``transpose`` / ``batched_transpose`` (quant.md 3.15): a bitwise ``(B, M, N) -> (B, N, M)``.

The kernel moves raw bits as 32-bit words: the launcher views both tensors as int32, so an element of
``es`` bytes is one of ``P = 4 / es`` lanes of a word, and one binary per element size (1, 2 or 4 bytes)
serves every dtype and, with all sizes symbolic, every shape.

A CTA owns a ``BM x BN`` input tile (``BN x BM`` output tile). With ``V = 16 / es`` elements per 16 bytes:

1. each thread loads ``V x V`` blocks as ``V`` rows of one 16-byte vector (4 words); consecutive lanes take
   consecutive column blocks, so a warp reads whole tile rows (``BN * es >= 128`` contiguous bytes);
2. it transposes each block in registers: word moves for fp32, ``prmt`` halfword pairs for 2-byte and a
   two-stage ``prmt`` 4 x 4 byte transpose for 1-byte elements, and writes the ``V`` transposed rows as
   16-byte vectors into a shared-memory output tile;
3. after a barrier, consecutive lanes read consecutive 16-byte chunks of an output-tile row and store them,
   so a warp writes whole output-tile rows (``BM * es >= 128`` contiguous bytes).

Shared-memory banks: chunk ``j`` of output-tile row ``c`` lives at chunk ``j ^ (c // V % 8)``. In step 2 the
8 lanes of a quarter warp write rows ``V`` apart at one logical chunk, in step 3 they read 8 consecutive
chunks of one row; the XOR puts both on 8 distinct 16-byte bank groups.

``M % 64 == N % 64 == 0`` and ``V <= 16``, so a ``V x V`` block or a 16-byte output chunk lies wholly inside
or wholly outside the matrix: bounds are checked per block, never per element.
"""
from __future__ import annotations

import torch

from tilefuse import _jit, _ops

# (BM, BN, threads, m_major) per element size: the fastest tiling of a sweep on the H200 (B=8 8192x7168:
# bf16 94%, e4m3 92%, fp32 99% of the copy ceiling; docs/BENCHMARKS.md). m_major puts the M tiles on
# blockIdx.x, so consecutive CTAs fill one output row: 3% faster for fp32, equal within run-to-run spread for
# bf16 and e4m3. Smaller tiles (64-byte or 128-byte rows, fewer threads) were 2-13% slower.
TILING = {1: (256, 256, 256, False), 2: (128, 128, 256, True), 4: (64, 64, 256, True)}


def _prmt(a, b, selector: int):
    """``__byte_perm(a, b, selector)``: byte ``n`` of the result is byte ``selector[n]`` of ``b:a``."""
    import tilelang.language as T

    return T.call_extern("int32", "__byte_perm", a, b, selector)


def transpose_kernel(elem_bytes: int, tiling: tuple | None = None):
    """Factory: batched transpose of ``elem_bytes``-byte elements held in int32 words (see module doc).

    Arguments at launch: ``X`` int32 ``(B, M, N / P)`` with row stride ``SW`` words, ``Y`` int32 ``(B, N, M / P)``.
    """
    import tilelang.language as T

    P = 4 // elem_bytes
    V = 4 * P
    BM, BN, threads, m_major = tiling or TILING[elem_bytes]
    CR, CC = BM // V, BN // V  # 16-byte chunks per output-tile row; per input-tile row
    KL = CR * CC // threads    # V x V blocks per thread
    KS = BN * CR // threads    # output chunks per thread
    assert CR % 8 == 0 and CC % 8 == 0 and KL * threads == CR * CC and KS * threads == BN * CR, tiling
    B, MW, NW, SW = T.dynamic("batch, rows_words, cols_words, row_stride_words")
    M, N = MW * P, NW * P

    @T.prim_func
    def batched_transpose(X: T.StridedTensor((B, M, NW), (M * SW, SW, 1), "int32"),
                          Y: T.Tensor((B, N, MW), "int32")):
        T.assume(MW % (64 // P) == 0)  # M % 64 == 0
        T.assume(NW % (64 // P) == 0)  # N % 64 == 0
        T.assume(SW % 4 == 0)
        grid = (T.ceildiv(M, BM), T.ceildiv(N, BN)) if m_major else (T.ceildiv(N, BN), T.ceildiv(M, BM))
        with T.Kernel(grid[0], grid[1], B, threads=threads) as (gx, gy, bz):
            t = T.get_thread_binding()
            m0 = (gx if m_major else gy) * BM
            n0 = (gy if m_major else gx) * BN
            tile = T.alloc_shared((BN * BM // P,), "int32")
            blk = T.alloc_local((KL * V * 4,), "int32")    # [k][input row r][word]
            blk_t = T.alloc_local((KL * V * 4,), "int32")  # [k][output row u][word]
            for k in T.unroll(KL):
                rb = (t + k * threads) // CC
                cb = (t + k * threads) % CC
                if m0 + rb * V < M and n0 + cb * V < N:
                    for r in T.unroll(V):
                        for w in T.vectorized(4):
                            blk[(k * V + r) * 4 + w] = X[bz, m0 + rb * V + r, (n0 + cb * V) // P + w]
            for k in T.unroll(KL):
                for cw in T.unroll(4):      # input column word = output rows P*cw .. P*cw + P - 1
                    for g in T.unroll(4):   # input rows P*g .. P*g + P - 1 = output word g
                        src = [blk[(k * V + P * g + i) * 4 + cw] for i in range(P)]
                        dst = [(k * V + P * cw + n) * 4 + g for n in range(P)]
                        if P == 1:
                            blk_t[dst[0]] = src[0]
                        elif P == 2:
                            blk_t[dst[0]] = _prmt(src[0], src[1], 0x5410)
                            blk_t[dst[1]] = _prmt(src[0], src[1], 0x7632)
                        else:
                            lo_ab, hi_ab = _prmt(src[0], src[1], 0x5140), _prmt(src[0], src[1], 0x7362)
                            lo_cd, hi_cd = _prmt(src[2], src[3], 0x5140), _prmt(src[2], src[3], 0x7362)
                            blk_t[dst[0]] = _prmt(lo_ab, lo_cd, 0x5410)
                            blk_t[dst[1]] = _prmt(lo_ab, lo_cd, 0x7632)
                            blk_t[dst[2]] = _prmt(hi_ab, hi_cd, 0x5410)
                            blk_t[dst[3]] = _prmt(hi_ab, hi_cd, 0x7632)
            for k in T.unroll(KL):
                rb = (t + k * threads) // CC
                cb = (t + k * threads) % CC
                for u in T.unroll(V):
                    for w in T.vectorized(4):
                        tile[((cb * V + u) * CR + T.bitwise_xor(rb, cb % 8)) * 4 + w] = blk_t[(k * V + u) * 4 + w]
            T.sync_threads()
            for k in T.unroll(KS):
                c = (t + k * threads) // CR
                j = (t + k * threads) % CR
                if n0 + c < N and m0 + j * V < M:
                    for w in T.vectorized(4):
                        Y[bz, n0 + c, (m0 + j * V) // P + w] = tile[(c * CR + T.bitwise_xor(j, (c // V) % 8)) * 4 + w]

    return batched_transpose


ELEM_SIZES = (1, 2, 4)  # element sizes the kernel handles; others take torch's copy


def _configs() -> list[tuple]:
    return [(size,) for size in ELEM_SIZES]


_jit.register("batched_transpose", transpose_kernel, _configs)


def batched_transpose_launch(x: torch.Tensor) -> torch.Tensor:
    """Allocate ``(B, N, M)`` and launch; no validation (the public op validates, quant.md 3.15).

    ``x.element_size()`` must be in ``ELEM_SIZES``. Inputs whose rows are not 16-byte aligned (pointer or
    row stride), or whose batch stride is not ``M * row_stride``, are first made contiguous: correct, at
    the cost of one copy.
    """
    b, m, n = x.shape
    out = torch.empty(b, n, m, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    size = x.element_size()
    if (x.data_ptr() % 16 or (x.stride(1) * size) % 16 or (b > 1 and x.stride(0) != m * x.stride(1))
            or x.stride(2) != 1):
        x = x.clone(memory_format=torch.contiguous_format)  # aligned even where x is contiguous
    _jit.get("batched_transpose", (size,))(x.view(torch.int32), out.view(torch.int32))
    return out


def transpose_launch(x: torch.Tensor) -> torch.Tensor:
    """``(M, N) -> (N, M)`` through the batched kernel with ``B = 1``."""
    return batched_transpose_launch(x.unsqueeze(0))[0]


@_ops.kernel_op("tilefuse::batched_transpose", mutates_args=(), device_types="cuda")
def _batched_transpose_op(x: torch.Tensor) -> torch.Tensor:
    return batched_transpose_launch(x)


@_batched_transpose_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    b, m, n = x.shape
    return x.new_empty((b, n, m))


def batched_transpose_cuda(x: torch.Tensor) -> torch.Tensor:
    """CUDA entry for the public op: a direct launch in eager mode, the custom op under ``torch.compile``."""
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.batched_transpose(x)
    return batched_transpose_launch(x)


def transpose_cuda(x: torch.Tensor) -> torch.Tensor:
    """CUDA entry for ``transpose``."""
    return batched_transpose_cuda(x.unsqueeze(0))[0]
