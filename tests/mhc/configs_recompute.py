"""Static configs ``(n, C, L, P)`` of the multi-layer recompute kernel that the GPU tier launches (test-only; the
package registers the bench's in ``tilefuse/mhc/_recompute_kernel.py``)."""

GRID_N = (2, 4)
GRID_C = (1280, 4096)
# (L, P): one, three and ten layers, with P = L and P = L - 1 post steps
GRID_LAYERS = ((1, 1), (1, 0), (3, 3), (3, 2), (10, 10), (10, 9))
# the CPU emulation's configs: odd C (33 lanes a token: a CTA's lanes straddle tokens), n = 8, a tail apply
EMU_CONFIGS = ((4, 264, 3, 2), (2, 8, 2, 2), (8, 264, 2, 1), (4, 1280, 10, 10))


def recompute_configs() -> list[tuple]:
    """Every ``(n, C, L, P)`` the GPU tests use."""
    return [(n, c, l, p) for n in GRID_N for c in GRID_C for l, p in GRID_LAYERS]
