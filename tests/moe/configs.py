"""Static configs of the MoE GPU tests, listed once: the tests parametrize over them and the compile tier builds
each for sm_90. The kernel modules register only the bench's configs; these compile on first use."""
import torch

from tilefuse.moe import _count_kernel as count
from tilefuse.moe import _mapping_kernel as mapping
from tilefuse.moe import _shuffle_kernel as shuffle

BF16, FP32, FP16, FP8 = torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn

# topk_gate: (E, K) of the test grid, then odd E, padded lanes, a serial K (K = E) and the widest rows
TOPK_GATE = [(e, k) for e in (8, 72, 256, 384) for k in (1, 2, 6, 8)]
TOPK_GATE_EXTRA = [(33, 8), (5, 5), (72, 72), (1024, 9)]
# topk_sum_and_topk_group_idx: (G, n, num_topk_sum, num_topk_groups): moe.md §3.2's observed shapes (E = 256 / 72 /
# 64 / 96), then odd n, several chunks with a tail, one group; then E = 72 and 384 as the bench groups them
TOPK_GROUP = [(8, 32, 2, 4), (12, 6, 1, 4), (16, 16, 2, 2), (32, 2, 2, 5), (3, 32, 2, 2), (5, 7, 2, 5),
              (2, 100, 2, 1), (1, 3, 1, 1), (8, 9, 2, 4), (12, 32, 2, 4)]
NORM_K = (1, 2, 6, 8, 9, 13, 40)  # normalize_weight's K

# moe_topk_gate_forward: (E_r, K, S, flags); the plain shapes with a bias (256 x 8 also with scores), every
# optional input, random routing, none, and the device-assertion tests' set
MOE_GATE_FORWARD = [(256, 8, 0, "bias,scores"), (256, 8, 0, "bias")] + [
    (e, k, 0, "bias") for e, k in ((8, 1), (72, 2), (256, 6), (384, 8))] + [
    (72, 6, 2, "bias,fix,image,map,mask,scores,unmapped"),
    (256, 8, 1, "bias,fix,image,map,mask,random,scores,unmapped"),
    (64, 6, 0, "random"),
    (32, 2, 0, ""),
    (72, 6, 1, "fix,map,mask,random,unmapped")]
# moe_topk_gate_backward: (E_r, K, aux); 30: rows not a multiple of 4
MOE_GATE_BACKWARD = [(e, k, aux) for e, k in ((256, 8), (8, 1), (72, 2), (256, 6), (384, 8), (30, 3), (30, 1))
                     for aux in (False, True)]

# expand_to_fused: (dtype, hidden, K); with sf: (dtype, hidden, K, (sf dtype, num_per_channels, column-major))
EXPAND = [(BF16, 576, k) for k in (1, 2, 6, 8)] + [
    (BF16, 7168, 8), (FP32, 200, 6), (FP32, 7168, 2), (FP8, 33, 2), (BF16, 3, 2), (FP8, 200, 2)]
EXPAND_SF = [(FP8, h, k, (d, npc, col)) for h, k in ((576, 6), (7168, 8)) for npc in (32, 128)
             for d, col in ((FP32, False), (FP32, True), (torch.int32, True))] + [
    (FP8, 1024, 2, (FP32, 128, False))]
# reduce_fused: (x dtype, e4m3 output, hidden, K, weights, x_sf, sf)
REDUCE = [(d, e4m3, 2048, 6, w, xs, e4m3) for d in (BF16, FP32) for e4m3 in (False, True)
          for w, xs in ((True, False), (False, True), (True, True))] + [
    (BF16, False, 2048, k, True, False, False) for k in (1, 2, 8)] + [
    (FP16, False, 2560, 8, True, True, False), (FP16, True, 2560, 8, True, False, False),
    (BF16, True, 7168, 8, True, True, True), (BF16, False, 7168, 8, True, False, False),
    (FP32, True, 4096, 6, False, False, False), (BF16, False, 256, 2, False, False, False),
    (FP32, True, 256, 2, False, False, False), (FP32, True, 512, 3, False, True, True)]


def shuffle_kernel_configs() -> list[tuple[str, tuple]]:
    """Every ``(kernel name, config)`` the expand / reduce GPU tests launch."""
    cfgs = [("expand_to_fused", shuffle._expand_cfg(*c)) for c in EXPAND + EXPAND_SF]
    cfgs += [("reduce_fused", shuffle._reduce_cfg(*c)) for c in REDUCE]
    return list(dict.fromkeys(cfgs))


def top2_sum_gate_configs() -> list[tuple]:
    """Every top2_sum_gate config ``(E, K, G, TG, S, scoring, mask, fix, unmapped, map)`` the GPU tests launch."""
    out = []
    for sc in ("sigmoid", "sqrtsoftplus", "softmax"):
        for E, K, G, TG in ((8, 1, 0, 0), (72, 6, 0, 0), (256, 8, 8, 4), (384, 2, 0, 0), (384, 8, 12, 4),
                            (72, 6, 6, 3), (64, 4, 32, 8)):
            out.append((E, K, G, TG, 0, sc, False, False, False, False))
    # every optional input, shared slots, group restriction
    for sc in ("sigmoid", "softmax"):
        out.append((72, 6, 0, 0, 2, sc, True, True, True, True))
        out.append((256, 8, 8, 4, 1, sc, True, False, True, True))
        out.append((256, 8, 8, 4, 2, sc, True, True, True, True))
    out.append((16, 4, 4, 2, 2, "sqrtsoftplus", True, True, True, True))
    out.append((256, 6, 0, 0, 0, "sqrtsoftplus", False, False, True, False))
    out.append((8, 1, 0, 0, 0, "softmax", True, True, True, False))   # K = 1: unmapped's last stride is free
    return list(dict.fromkeys(out))


COUNT_TOPK = (1, 2, 6, 8)  # K of the unique and mask_indices_by_tp GPU tests


def count_kernel_configs() -> list[tuple[str, tuple]]:
    """Every ``(kernel name, config)`` the aux_fi / group_count / unique / mask GPU tests launch: both shared
    histogram builds (E up to HIST_SMALL, and up to MAX_BINS), both finish kinds, each K, both index dtypes."""
    return ([("moe_count_partial", (bins,)) for bins in (count.HIST_SMALL, count.MAX_BINS)]
            + [("moe_count_finish", (kind,)) for kind in ("fi", "count")]
            + [("moe_unique_group_indices", (k,)) for k in COUNT_TOPK]
            + [("moe_mask_indices_by_tp", (dtype,)) for dtype in ("int64", "int32")])


def mapping_kernel_configs() -> list[tuple[str, tuple]]:
    """Every ``(kernel name, config)`` the get_fused_mapping GPU tests launch: E up to 1024, so the count and
    scatter builds of each capacity, and the scan."""
    return ([("moe_fused_mapping_count", (cap,)) for cap in mapping.CAPACITIES] + [("moe_fused_mapping_scan", ())]
            + [("moe_fused_mapping_scatter", (cap,)) for cap in mapping.CAPACITIES])
