"""Static configs (forward ``(K,)``, backward ``(K, vec)``) of the norm-weight merge kernels that the tests launch (test-only; the package registers
the bench's in ``tilefuse/mhc/_normw_kernel.py``)."""

GRID_N = (2, 4, 8)
GRID_C = (1280, 2560, 4096, 7168)
GRID_K = tuple(n * c for n in GRID_N for c in GRID_C)
# a column count not a multiple of the CTA width (both kernels) and one not a multiple of 4 (backward only; the
# forward keeps the reference path there)
ODD_K = (264,)
ODD_K_BWD = (100,)


def normw_configs() -> list[tuple]:
    """Every ``(name, cfg)`` the tests build."""
    fwd = [("mhc_normw_merge_fwd", (k,)) for k in GRID_K + ODD_K]
    bwd = [("mhc_normw_merge_bwd", (k, 1)) for k in GRID_K + ODD_K + ODD_K_BWD]
    return fwd + bwd
