"""Static configs of the prenorm-projection kernels that the GPU tier launches (test-only; the package registers
the bench's in ``tilefuse/mhc/_norm_fn_kernel.py``)."""

GRID_N = (2, 4)   # n = 8 has M = 80 > 32 rows: the reference path (the kernel takes M <= 32)
GRID_C = (1280, 2560, 4096, 7168)


def norm_fn_configs() -> list[tuple[str, tuple]]:
    """``(kernel name, config)`` of every launch of the GPU tests."""
    cfgs = [("mhc_norm_fn_dw_sum", ()), ("mhc_norm_fn_tf32_round", ())]
    for n in GRID_N:
        for c in GRID_C:
            K, M = n * c, n * (n + 2)
            cfgs += [("mhc_norm_fn_fwd", (K, M)), ("mhc_norm_fn_bwd", (K, M, False)),
                     ("mhc_norm_fn_bwd", (K, M, True))]
    return cfgs
