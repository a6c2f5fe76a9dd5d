"""Static configs of the expand kernel tests, listed once: the GPU tests launch them and the compile tier builds
each for sm_90. The kernel module registers only the bench's configs; these compile on first use."""
from tilefuse.mhc import _expand_kernel as K

GPU_N = (2, 4, 8)                   # mhc.md §4: expand is tested for n in {2, 4, 8}
GPU_C = (1280, 2560, 4096, 7168)    # the hidden sizes
ODD_C = 2400                        # 300 chunks: no warp multiple divides them, so the last CTA of a row is partial
GPU_T = (0, 1, 7, 4001, 8192)


def expand_configs() -> list[tuple]:
    """``(n, C)`` of every launch of the GPU tests, and the registered (bench) configs."""
    cfgs = {(n, c) for n in GPU_N for c in GPU_C} | {(4, ODD_C)} | set(K._configs())
    return sorted(cfgs)
