"""Row geometry shared by the streaming mHC kernels (expand, apply_mix): a row of ``C`` bf16 is ``C / V`` chunks of
16 bytes, and a CTA's threads take consecutive chunks of a row. No TileLang here; kernel modules import it and name it
in their ``KERNEL_HELPERS``, so its source is part of their cache keys (``_jit._module_digest``)."""
import torch

V = 8      # bf16 per 16-byte chunk
MAX_N = 8  # the most streams the kernels take (a thread holds n chunks in registers); more take the reference


def takes(n: int, C: int) -> bool:
    """Whether the kernels take ``n`` streams of ``C`` bf16: whole chunks and at most ``MAX_N`` streams (else the
    public ops keep the reference path)."""
    return 1 <= n <= MAX_N and C > 0 and C % V == 0


def row_threads(C: int, max_threads: int) -> int:
    """Threads per CTA for rows of ``C / V`` chunks: the largest multiple of 32 up to ``max_threads`` that divides
    the chunk count (no idle lane); else the whole row when it fits one CTA (rounded up to a warp); else
    ``max_threads`` rounded down to a warp (the last CTA of a row guards its tail)."""
    cv = C // V
    top = max(32, max_threads - max_threads % 32)
    for t in range(top, 31, -32):
        if cv % t == 0:
            return t
    return min(top, -(-cv // 32) * 32)


def ready(t) -> bool:
    """Whether a tensor can be bound as it is: contiguous, its data on a 16-byte boundary (the kernels' vector
    accesses; a contiguous view may start at any storage offset)."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def write_through(dst, launch, read: bool = False) -> None:
    """``launch(buffer)`` with ``dst`` itself as the buffer when it is :func:`ready`, else an aligned contiguous
    buffer (holding ``dst``'s values when the kernel ``read``s it, i.e. accumulates) copied back into ``dst``."""
    if ready(dst):
        launch(dst)
        return
    buf = dst.contiguous().clone() if read else torch.empty_like(dst, memory_format=torch.contiguous_format)
    launch(buf)
    dst.copy_(buf)
