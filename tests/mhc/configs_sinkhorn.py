"""Static configs of the Sinkhorn GPU tests, listed once: the GPU tests launch them and the compile tier builds
each for sm_90. The kernel module registers only the bench's configs; these compile on first use."""
from tilefuse.mhc import _sinkhorn_kernel as SK

N_VALUES = SK.KERNEL_N              # multiplicities the kernels take (n = 8 keeps the reference)
REPEATS = (1, 3, 10, 20)            # 1: no row step; 10: the spec's grid (mhc.md §4); 20: the bench row
MAX_REPEAT = SK.MAX_BWD_REPEAT      # the longest chain the backward kernel takes


def fwd_configs() -> list[tuple]:
    """``(n,)`` of the forward (repeat is a launch argument)."""
    return [(n,) for n in N_VALUES]


def bwd_configs() -> list[tuple]:
    """``(n, repeat)`` of the backward the GPU tests launch."""
    return [(n, r) for n in N_VALUES for r in REPEATS + (MAX_REPEAT,)]
