"""Static configs of the Engram Sinkhorn kernels that the tests launch (test-only; the package registers the bench's
in ``tilefuse/engram/_sinkhorn_kernel.py``)."""

# row widths by threads a row (row_threads): 64 (256, 768), 128 (2560), 256 (4096, 7168: the bench's)
GRID_D = (256, 768, 2560, 4096, 7168)
WIDE_D = 16384  # the widest row the kernels take (MAX_D)
MOMENTUM = tuple((g, m, n) for g in ("bf16", "fp32") for m in ("bf16", "fp32") for n in (True, False))


def sinkhorn_configs() -> list[tuple]:
    """Every ``(name, cfg)`` the tests build."""
    rows = [(name, (d,)) for name in ("engram_sinkhorn_step", "engram_sinkhorn_finalize") for d in GRID_D + (WIDE_D,)]
    return ([("engram_sinkhorn_momentum", cfg) for cfg in MOMENTUM] + rows
            + [("engram_sinkhorn_step_reduce", ())])
