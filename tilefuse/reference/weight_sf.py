"""Reference batched_transpose_weight_sf (quant.md 5.13).

Square-block power-of-two weight scales ``(G?, n/bs, k/bs)`` become the two packed UE8M0 layouts a
block-scaled GEMM reads for the weight as its N-side operand: ``sf0`` (one row per weight row, exponent
bytes along k) and ``sf1`` (one row per weight column, exponent bytes along n). Padding bytes are zero.
"""
from __future__ import annotations

import torch

__all__ = ["batched_transpose_weight_sf"]


def _exponent_bytes(sf: torch.Tensor) -> torch.Tensor:
    """Biased exponent byte of each fp32 value (0 for +0.0); sign and mantissa bits must be 0.

    The value check is a device-side assertion (``torch._assert_async``): it never synchronizes on the
    GPU, and raises at once on the CPU.
    """
    bits = sf.contiguous().view(torch.int32)
    torch._assert_async((bits & ~0x7F800000).eq(0).all(),
                        "batched_transpose_weight_sf: sf must hold non-negative powers of two or zero")
    return ((bits >> 23) & 0xFF).to(torch.uint8)


def _pack_rows(e: torch.Tensor, block_size: int) -> torch.Tensor:
    """Exponent bytes ``(G, R, C)`` -> packed storage int32 ``(G, cdiv(C, 4), R*bs)``.

    Row ``r`` of the repeated matrix (``R*bs`` rows) holds the bytes of row ``r // bs``; bytes of columns
    ``4c .. 4c+3`` go into word ``c``, column ``4c+u`` in byte ``u`` (little-endian), padding bytes are 0.
    The result is the column-major storage: its transpose is the ``(G, R*bs, cdiv(C, 4))`` logical tensor.
    """
    g, r, c = e.shape
    words = -(-c // 4)
    padded = torch.zeros((g, r, 4 * words), dtype=torch.uint8, device=e.device)
    padded[:, :, :c] = e
    rows = padded.repeat_interleave(block_size, dim=1)  # (G, R*bs, 4*words)
    # Explicit allocation: .contiguous() would keep odd strides on size-1 dims, and strides are contract.
    storage = torch.empty((g, words, r * block_size), dtype=torch.int32, device=e.device)
    return storage.copy_(rows.view(torch.int32).transpose(1, 2))


def batched_transpose_weight_sf(sf: list[torch.Tensor], block_size: int,
                                transpose_sf1s: list[bool]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per weight ``i``: ``(sf0, sf1)`` int32 per quant.md 5.13.

    ``sf0``: logical ``(G?, n, cdiv(nsk, 4))``, strides ``(cdiv(nsk,4)*n, 1, n)``, byte ``u`` of
    ``[g, r, c]`` = exponent of ``sf[g, r // bs, 4c + u]``.
    ``sf1``: logical ``(G?, k, cdiv(nsn, 4))``, strides ``(cdiv(nsn,4)*k, 1, k)``, byte ``u`` of
    ``[g, col, c]`` = exponent of ``sf[g, 4c + u, col // bs]``; when ``transpose_sf1s[i]`` it is returned as
    the ``(G?, cdiv(nsn, 4), k)`` view with strides ``(..., k, 1)``. 2-D inputs give outputs without ``G``.
    """
    result = []
    for s, transpose_sf1 in zip(sf, transpose_sf1s):
        e = _exponent_bytes(s)
        batched = e.dim() == 3
        e = e if batched else e[None]
        sf0 = _pack_rows(e, block_size).transpose(1, 2)
        sf1_storage = _pack_rows(e.transpose(1, 2), block_size)
        sf1 = sf1_storage if transpose_sf1 else sf1_storage.transpose(1, 2)
        if not batched:
            sf0, sf1 = sf0[0], sf1[0]
        result.append((sf0, sf1))
    return result
