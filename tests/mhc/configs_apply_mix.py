"""Static configs of the pre_apply_mix kernel tests, listed once: the GPU tests launch them and the compile tier
builds each for sm_90. The kernel module registers only the bench's configs; these compile on first use."""
from tilefuse.mhc import _apply_mix_kernel as K

GPU_N = (2, 4, 8)                   # the issue: n in {2, 4} and 8 where the spec allows it (§0.3: general n)
GPU_C = (1280, 2560, 4096, 7168)    # the hidden sizes
ODD_C = 2400                        # 300 chunks: partial CTAs (forward), two steps with a partial second (backward)
GPU_T = (0, 1, 7, 4001, 8192)


def fwd_configs() -> list[tuple]:
    """``(n, C)`` of every forward launch of the GPU tests, and the registered (bench) configs."""
    return sorted({(n, c) for n in GPU_N for c in GPU_C} | {(4, ODD_C)} | set(K._fwd_configs()))


def bwd_configs() -> list[tuple]:
    """``(n, C, accumulate)``: v2.1 accumulates into x_grad, the v1 op without a side channel does not."""
    return sorted({(n, c, acc) for n, c in fwd_configs() for acc in (True, False)} | set(K._bwd_configs()))
