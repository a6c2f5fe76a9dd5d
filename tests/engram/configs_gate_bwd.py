"""Static configs of the gate backward / grad_w_reduce kernels that the tests launch (test-only; the package
registers the bench's in ``tilefuse/engram/_gate_bwd_kernel.py``)."""

GRID_T = (0, 1, 7, 4001, 8192)
GRID_H = (1024, 4096, 7168)
PREFETCH_H = (1024, 2048, 4096)  # PREFETCH builds (its stages fit: one vector a thread and branch)
FALLBACK_H = (4608, 7168)  # PREFETCH on, two vectors a thread: the default kernel
XK_H = (4608, 6144, 7168)  # XK_ASYNC builds (two vectors a thread, the sums in shared memory)
XK_FALLBACK_H = (4096, 7680)  # XK_ASYNC on, one vector a thread / the sums in registers: the default kernel
BEYOND_H = 8704  # H % 512 == 0 but above MAX_H: the public op keeps the reference path (never compiled)


def gate_bwd_configs() -> list[tuple]:
    """Every ``(name, cfg)`` the tests build."""
    return [("engram_gate_bwd", (h,)) for h in GRID_H] + [("engram_grad_w_reduce", ())]
