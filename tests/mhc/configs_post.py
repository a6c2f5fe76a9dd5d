"""Static configs ``(n, C)`` of the post kernels that the GPU tier launches (test-only; the package registers
the bench's in ``tilefuse/mhc/_post_kernel.py``)."""

GRID_N = (2, 4, 8)
GRID_C = (1280, 2560, 4096, 7168)
# odd hidden sizes: one lane per token (8), a warp's lane steps not a multiple of 32 (264: 33 lanes)
ODD_C = (8, 264)


def post_configs() -> list[tuple]:
    """Every ``(n, C)`` the GPU tests of the post kernels use (forward and backward alike)."""
    return [(n, c) for n in GRID_N for c in GRID_C + ODD_C]
