"""Static configs of the gate forward kernel that the tests launch (test-only; the package registers the bench's in
``tilefuse/engram/_gate_fwd_kernel.py``)."""

TOKENS = (0, 1, 7, 4001, 8192)
GRID_M = (4, 2)
GRID_H = (512, 1024, 4096, 7168)
# an odd branch count with an odd chunk count (the load groups' guards), and the largest H the kernel takes
ODD = ((3, 768), (1, 12288))


def gate_fwd_configs() -> list[tuple]:
    """Every ``(M, H, save)`` the tests of the gate forward kernel build or launch."""
    shapes = [(m, h) for m in GRID_M for h in GRID_H] + list(ODD)
    return [(m, h, save) for m, h in shapes for save in (True, False)]
