"""The MoE ops' data rules as torch assertions, for the paths that do not run a kernel (CPU tensors, and the
reference fallbacks of the CUDA launchers for shapes the kernels do not take). The kernels assert the same rules
on the device (moe.md's device-side assertions). Below both the public ops (``ops.py``) and the kernel modules:
imports nothing of ``tilefuse.moe``.
"""
from __future__ import annotations

import torch

from tilefuse.reference import moe as ref


def assert_data(cond: torch.Tensor, op: str, message: str) -> None:
    """Data-dependent check (a device-side assertion upstream): RuntimeError on CPU, no host sync on CUDA."""
    torch._assert_async(cond.all(), f"{op}: {message}")


def row_flags(flags, rows: int, device) -> torch.Tensor:
    """A bool row mask as a flat ``(rows,)`` vector; all True when absent."""
    return torch.ones(rows, dtype=torch.bool, device=device) if flags is None else flags.reshape(rows)


def assert_gate_data(op: str, logits, checked_rows, fix_routing_mask, unmapped_topk_idx, logical_count) -> None:
    """The gates' device assertions (§2.2 step 13, §2.13 step 11): finite logits of every checked row,
    fixed routes inside [0, E_r), replica counts >= 1."""
    assert_data(torch.isfinite(logits) | ~checked_rows[:, None], op, "logits contain nan or inf")
    if fix_routing_mask is not None:
        fixed = checked_rows & fix_routing_mask
        inside = (unmapped_topk_idx >= 0) & (unmapped_topk_idx < logits.size(1))
        assert_data(inside | ~fixed[:, None], op,
                    f"unmapped_topk_idx of fixed-routing tokens must be in [0, {logits.size(1)})")
    if logical_count is not None:
        assert_data(logical_count >= 1, op, "logical_count must be >= 1 for every logical expert")


def check_top2_sum_gate_data(logits, mask, fix_routing_mask, unmapped_topk_idx, logical_count) -> None:
    """top2_sum_gate's data rules (§2.2 step 13) for the rows the mask keeps."""
    checked = row_flags(mask, logits.size(0), logits.device)
    assert_gate_data("top2_sum_gate", logits, checked, fix_routing_mask, unmapped_topk_idx, logical_count)


def check_gate_forward_data(logits, width: int, mask, fix_routing_mask, unmapped_topk_idx, logical_count,
                            force_random) -> None:
    """moe_topk_gate_forward's data rules: those of ``assert_gate_data`` for rows neither masked nor random, and
    with ``force_random`` enough replicas for ``width`` distinct draws."""
    op = "moe_topk_gate_forward"
    checked = row_flags(mask, logits.size(0), logits.device)
    if force_random is not None:
        checked = checked & ~force_random
        if logical_count is not None:
            assert_data(logical_count.to(torch.int64).sum() >= width, op,
                        f"force_random needs sum(logical_count) >= num_topk + num_shared_experts ({width})")
    assert_gate_data(op, logits, checked, fix_routing_mask, unmapped_topk_idx, logical_count)


def check_gate_backward_data(topk_idx, num_routed: int) -> None:
    """moe_topk_gate_backward's data rule (§2.14): every slot -1 or a routed expert."""
    assert_data((topk_idx >= -1) & (topk_idx < num_routed), "moe_topk_gate_backward",
                f"topk_idx must be -1 or in [0, {num_routed})")


def check_fused_mapping_data(topk_idx, num_experts: int, num_expanded_tokens: int, alignment: int,
                             force_no_sync: bool) -> None:
    """get_fused_mapping's data rules: entries in [-1, E), and a given ``num_expanded_tokens`` holds every aligned
    segment."""
    op = "get_fused_mapping"
    assert_data((topk_idx >= -1) & (topk_idx < num_experts), op,
                f"topk_idx entries must be -1 or in [0, {num_experts})")
    if num_expanded_tokens or force_no_sync:
        counts = ref.group_count(topk_idx, num_experts).to(torch.int64)
        needed = ((counts + alignment - 1) // alignment * alignment).sum()
        assert_data(needed <= num_expanded_tokens, op,
                    f"num_expanded_tokens ({num_expanded_tokens}) must hold every aligned expert segment")
