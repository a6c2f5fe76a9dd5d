"""Static configs ``(N, L, K)`` of the ``engram_hash`` kernel that the tests launch (test-only; the package registers
the bench's in ``tilefuse/engram/_hash_kernel.py``): the spec's measured grid (engram.md §2.2.1), which holds the
bench's (3, 2, 8)."""

HASH_NLK = ((2, 1, 4), (3, 2, 1), (3, 2, 8), (4, 3, 2))


def hash_configs() -> list[tuple]:
    """Every ``(name, cfg)`` the tests build."""
    return [("engram_hash", nlk) for nlk in HASH_NLK]
