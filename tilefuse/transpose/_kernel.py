"""TileLang kernel for ``transpose`` / ``batched_transpose`` (quant.md 3.15): a bitwise ``(B, M, N) -> (B, N, M)``.

The kernel moves raw bits, so it is compiled per element size (1, 2, 4 or 8 bytes), not per dtype: the
launcher views the tensor as the integer type of that size. Every size is symbolic, so one binary per
element size serves every shape.

Each thread owns a ``V x V`` block, ``V = 16 / element size``: it reads ``V`` rows of 16 bytes, transposes
them in registers and writes ``V`` rows of 16 bytes, so every global access is a full 16-byte vector and
no shared memory is used. In a warp, 8 consecutive lanes take 8 consecutive row blocks (so stores cover
128 contiguous bytes of an output row) and 4 lane groups take 4 consecutive column blocks (so loads cover
64 contiguous bytes of an input row).
"""
from __future__ import annotations

import torch

from tilefuse import _jit

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TL_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
_THREADS = 128
_COL_LANES = 4  # column blocks per 32 lanes


def transpose_kernel(elem_bytes: int):
    """Factory: batched transpose of ``elem_bytes``-byte elements; ``M % 64 == N % 64 == 0``, 16-byte aligned rows."""
    import tilelang.language as T

    dtype = _TL_INT_OF_SIZE[elem_bytes]
    V = 16 // elem_bytes if elem_bytes < 16 else 1
    RB = _THREADS // _COL_LANES
    TM, TN = RB * V, _COL_LANES * V
    B, M, N, S = T.dynamic("batch, rows, cols, row_stride")

    @T.prim_func
    def batched_transpose(X: T.StridedTensor((B, M, N), (M * S, S, 1), dtype),
                          Y: T.Tensor((B, N, M), dtype)):
        T.assume(S % V == 0)
        T.assume(M % 64 == 0)
        T.assume(N % 64 == 0)
        with T.Kernel(T.ceildiv(N, TN), T.ceildiv(M, TM), B, threads=_THREADS) as (bx, by, bz):
            t = T.get_thread_binding()
            rb = (t % 8) + (t // (8 * _COL_LANES)) * 8
            cb = (t // 8) % _COL_LANES
            r0 = by * TM + rb * V
            c0 = bx * TN + cb * V
            blk = T.alloc_local((V * V,), dtype)
            blk_t = T.alloc_local((V * V,), dtype)
            if r0 < M and c0 < N:
                for r in T.unroll(V):
                    for c in T.vectorized(V):
                        blk[r * V + c] = X[bz, r0 + r, c0 + c]
                for u in T.unroll(V):
                    for v in T.unroll(V):
                        blk_t[u * V + v] = blk[v * V + u]
                for u in T.unroll(V):
                    for v in T.vectorized(V):
                        Y[bz, c0 + u, r0 + v] = blk_t[u * V + v]

    return batched_transpose


def _configs() -> list[tuple]:
    return [(1,), (2,), (4,)]


_jit.register("batched_transpose", transpose_kernel, _configs)


def batched_transpose_launch(x: torch.Tensor) -> torch.Tensor:
    """Allocate ``(B, N, M)`` and launch; no validation (the public op validates, quant.md 3.15).

    Inputs whose rows are not 16-byte aligned (pointer or row stride), or whose batch stride is not
    ``M * row_stride``, are first made contiguous: correct, at the cost of one copy.
    """
    b, m, n = x.shape
    out = torch.empty((b, n, m), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    size = x.element_size()
    if (x.data_ptr() % 16 or (x.stride(1) * size) % 16 or (b > 1 and x.stride(0) != m * x.stride(1))
            or x.stride(2) != 1):
        x = x.contiguous()
    ity = _INT_OF_SIZE[size]
    _jit.get("batched_transpose", (size,))(x.view(ity), out.view(ity))
    return out


def transpose_launch(x: torch.Tensor) -> torch.Tensor:
    """``(M, N) -> (N, M)`` through the batched kernel with ``B = 1``."""
    return batched_transpose_launch(x.unsqueeze(0))[0]


@torch.library.custom_op("tilefuse::batched_transpose", mutates_args=(), device_types="cuda")
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
