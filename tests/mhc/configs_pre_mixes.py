"""Static configs ``(n, S)`` of the fused pre's small-steps kernel that the tests build and the GPU tier launches
(test-only; the package registers the bench's in ``tilefuse/mhc/_pre_mixes_kernel.py``)."""

GRID_N = (2, 4)     # the Sinkhorn kernel's multiplicities (n = 8 keeps the four-step chain)
GRID_S = (1, 16)    # one split (the v1 op off the GEMM kernel's shapes) and the projection kernel's 16


def pre_mixes_configs() -> list[tuple]:
    """Every ``(n, S)`` the tests use."""
    return [(n, s) for n in GRID_N for s in GRID_S]
