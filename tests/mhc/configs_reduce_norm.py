"""Static configs of the reduce/RMS kernels that the tests launch (test-only; the package registers the bench's in
``tilefuse/mhc/_reduce_norm_kernel.py``): forward ``(S, G, M)``, backward ``(G, M)``."""

GRID_M = (8, 24, 80)   # M = n(n + 2) for n in {2, 4, 8}
SPLITS = (1, 16)
GROUPS = (1, 2)
ODD = (3, 3, 5)        # S, G, M off every grid value


def reduce_configs() -> list[tuple]:
    """Every ``(name, cfg)`` the tests build."""
    fwd = [(s, g, m) for s in SPLITS for g in GROUPS for m in GRID_M] + [ODD]
    bwd = sorted({(g, m) for _, g, m in fwd})
    return [("mhc_reduce_rmsnorm_fwd", c) for c in fwd] + [("mhc_reduce_rmsnorm_bwd", c) for c in bwd]
