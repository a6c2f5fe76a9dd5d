"""Static configs of the transform GPU tests, listed once: the GPU tests launch them and the compile tier builds
each for sm_90. The kernel modules register only the bench's configs; these compile on first use."""
from tilefuse.transform import _rotary_kernel as rotary


def rotary_configs() -> list[tuple]:
    """The apply_rotary configs ``(dtype, head dim, V, cache V, interleaved, positions, rank)`` the GPU tests launch:
    for every dtype, width and pairing, the widest vectors with every positions dtype and rank (aligned views),
    single elements (views one element off an aligned address: 4-D without positions, 3-D with and without) and
    the widest data vectors with a misaligned cache (3-D, with and without positions)."""
    cfgs = []
    for dtype in ("bf16", "fp32"):
        v = rotary.VECS[dtype][0]
        for d in (64, 128):
            for inter in (False, True):
                cw = min(4, v // 2 if inter else v)
                cfgs += [(dtype, d, v, cw, inter, pos, rank) for pos in ("none", "int32", "int64") for rank in (3, 4)]
                cfgs += [(dtype, d, 1, 1, inter, pos, rank) for pos, rank in (("none", 4), ("none", 3), ("int64", 3))]
                cfgs += [(dtype, d, v, 1, inter, pos, 3) for pos in ("none", "int64")]
    return cfgs
