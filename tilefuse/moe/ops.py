"""Public MoE routing ops (moe.md §2): validate on the host, then run the TileLang kernel (CUDA tensors,
``tilefuse/moe/_*_kernel.py``) or the reference (any other device).

Host-side errors name the argument: ``TypeError`` for wrong types/dtypes, ``ValueError`` for shapes,
values and devices. Conditions that need the data (moe.md's device-side assertions: non-finite logits,
indices out of range) are device-side assertions of the kernels on CUDA (no host sync, no extra launch); the
reference paths check them with ``torch._assert_async``, which on CPU raises ``RuntimeError`` before anything
is written.
"""
from __future__ import annotations

import functools

import torch

from tilefuse import _check, formats
from tilefuse._registry import public
from tilefuse.moe import (_checks as checks, _count_kernel, _mapping_kernel, _moe_gate_kernel, _shuffle_kernel,
                          _top2_sum_gate_kernel, _topk_kernel)
from tilefuse.reference import moe as ref

__all__ = [
    "aux_fi",
    "expand_to_fused",
    "expand_to_fused_with_sf",
    "get_fused_mapping",
    "group_count",
    "inplace_unique_group_indices",
    "mask_indices_by_tp",
    "moe_topk_gate",
    "moe_topk_gate_backward",
    "moe_topk_gate_forward",
    "normalize_weight",
    "reduce_fused",
    "top2_sum_gate",
    "topk_gate",
    "topk_sum_and_topk_group_idx",
]

MAX_TOPK = 32                 # compile-time limit of the gate kernels (K + S <= 32)
MAX_FUSED_EXPERTS = 1024      # get_fused_mapping: E <= 1024
MAX_UNIQUE_GROUPS = 128       # inplace_unique_group_indices: num_groups <= 128
MAX_GROUPS = 32               # group-limited routing / topk_sum_and_topk_group_idx: G <= 32
TOP2_SCORING_FUNCS = ("sigmoid", "sqrtsoftplus", "softmax")   # top2_sum_gate's scorings (not v1's identity)
INT64, INT32, FP32, BOOL = torch.int64, torch.int32, torch.float32, torch.bool


def _num_shared(op: str, use_shared_as_routed, num_shared_experts) -> int:
    """S: 0 unless ``use_shared_as_routed``, then ``num_shared_experts`` in {1, 2} (§2.2 step 6, §2.13 step 6)."""
    if not _check.flag(op, "use_shared_as_routed", use_shared_as_routed):
        return 0
    _check.integer(op, "num_shared_experts", num_shared_experts)
    if num_shared_experts not in (1, 2):
        _check.fail(op, f"num_shared_experts must be 1 or 2 with use_shared_as_routed, got {num_shared_experts}")
    return num_shared_experts


def _check_row_mask(op: str, name: str, t, rows: int, device) -> None:
    """A bool row mask with numel T (any shape, read as a flat (T,) vector)."""
    _check.tensor(op, name, t, dtype=BOOL, device=device)
    if t.numel() != rows:
        _check.fail(op, f"{name} must have numel == num_tokens ({rows}), got shape {tuple(t.shape)}")


def _check_physical_map(op: str, to_physical_map, logical_count, num_logical: int, device) -> None:
    """``to_physical_map`` int32 (E_r + S, D >= 1) and ``logical_count`` int32 (E_r + S,), both or neither."""
    _check.expect((to_physical_map is None) == (logical_count is None), op,
                  "to_physical_map and logical_count must be given together")
    if to_physical_map is None:
        return
    _check.tensor(op, "to_physical_map", to_physical_map, dtype=INT32, ndim=2, contiguous=True, device=device)
    _check.tensor(op, "to_physical_map", to_physical_map, shape=(num_logical, None))
    if not (to_physical_map.size(1) >= 1):
        _check.fail(op, "to_physical_map must have at least one column, got shape "
                        f"{tuple(to_physical_map.shape)}")
    _check.tensor(op, "logical_count", logical_count, dtype=INT32, shape=(num_logical,), contiguous=True,
                  device=device)


def _check_fixed_routing(op: str, fix_routing_mask, unmapped_topk_idx, rows: int, num_topk: int, device) -> None:
    """``unmapped_topk_idx`` int64 (T, K), unit last stride; ``fix_routing_mask`` bool (T,) needs it."""
    _check.optional(op, "unmapped_topk_idx", unmapped_topk_idx, dtype=INT64, shape=(rows, num_topk),
                    inner_contiguous=True, device=device)
    if fix_routing_mask is not None:
        _check.expect(unmapped_topk_idx is not None, op, "fix_routing_mask requires unmapped_topk_idx")
        _check.tensor(op, "fix_routing_mask", fix_routing_mask, dtype=BOOL, shape=(rows,), contiguous=True,
                      device=device)


# ----------------------------------------------------------------------------------------------------
# Top-k and gates
# ----------------------------------------------------------------------------------------------------

@public("moe", path="kernel")
def topk_gate(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    """Indices (int64 (T, K)) of the K largest scores per row, descending, ties -> smaller index (§2.1).

    v1 semantics: non-finite scores are not checked; for them the stable-sort order applies (NaN first).
    """
    out = _topk_kernel.topk_gate_fast(scores, num_topk)  # a call whose facts passed before: native plan, no checks
    if out is not None:
        return out
    op = "topk_gate"
    _check.tensor(op, "scores", scores, dtype=FP32, ndim=2, contiguous=True)
    _check.integer(op, "num_topk", num_topk, min=1, max=scores.size(1))
    if scores.is_cuda:
        return _topk_kernel.topk_gate_cuda(scores, num_topk)
    return ref.stable_topk(scores, num_topk)


@public("moe", path="kernel")
def topk_sum_and_topk_group_idx(scores: torch.Tensor, num_topk_sum: int, num_topk_groups: int) -> torch.Tensor:
    """Best ``num_topk_groups`` groups per token ranked by the sum of their top-1/top-2 scores (§2.3)."""
    op = "topk_sum_and_topk_group_idx"
    _check.tensor(op, "scores", scores, dtype=FP32, ndim=3, contiguous=True)
    _, groups, per_group = scores.shape
    if not (groups <= MAX_GROUPS):
        _check.fail(op, f"scores must have at most {MAX_GROUPS} groups, got shape "
                        f"{tuple(scores.shape)}")
    _check.integer(op, "num_topk_sum", num_topk_sum, min=1, max=min(2, per_group))
    _check.integer(op, "num_topk_groups", num_topk_groups, min=1, max=groups)
    if scores.is_cuda:
        return _topk_kernel.topk_sum_and_topk_group_idx_cuda(scores, num_topk_sum, num_topk_groups)
    return ref.topk_sum_and_topk_group_idx(scores, num_topk_sum, num_topk_groups)


@public("moe", path="kernel")
def top2_sum_gate(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
                  routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask=None,
                  fix_routing_mask=None, to_physical_map=None, logical_count=None, unmapped_topk_idx=None):
    """v1 routing gate (§2.2) -> ``(topk_idx int64 (T, K+S), topk_weights fp32 (T, K+S))``.

    Scores (sigmoid / sqrtsoftplus / softmax), bias, optional group-limited top-k, weights
    ``s / (((1e-20 + s_0) + s_1) + ...) * routed_scaling_factor``, S shared slots of weight 1, replica
    choice through the physical map, EP/TP masking (weights kept for masked slots). Writes
    ``unmapped_topk_idx`` (logical routed ids, -1 for masked tokens) if given.
    """
    op = "top2_sum_gate"
    _check.tensor(op, "logits", logits, dtype=FP32, ndim=2, contiguous=True)
    rows, num_routed = logits.shape
    device = logits.device
    _check.tensor(op, "bias", bias, dtype=FP32, shape=(num_routed,), contiguous=True, device=device)
    if mask is not None:
        _check_row_mask(op, "mask", mask, rows, device)
    _check.integer(op, "num_groups", num_groups, min=0, max=num_routed)
    _check.integer(op, "num_topk_groups", num_topk_groups, min=0, max=num_groups)
    if (num_groups == 0) != (num_topk_groups == 0):
        _check.fail(op, f"num_groups and num_topk_groups must both be 0 or both > 0, got {num_groups} and "
                        f"{num_topk_groups}")
    _check.integer(op, "num_topk", num_topk, min=1, max=min(num_routed, MAX_TOPK))
    if num_groups:
        if num_routed % num_groups != 0:
            _check.fail(op, f"num_groups must divide the number of experts {num_routed}, got {num_groups}")
    if num_groups != num_topk_groups:
        if not (num_groups <= MAX_GROUPS):
            _check.fail(op, f"num_groups must be <= {MAX_GROUPS} for group-limited routing, got {num_groups}")
        if not (2 <= num_routed // num_groups <= 32):  # groups rank by the sum of their top-2 scores
            _check.fail(op, f"logits must have 2 to 32 experts per group for group-limited routing, got "
                            f"{num_routed // num_groups}")
        candidates = num_topk_groups * (num_routed // num_groups)
        if not (num_topk <= candidates):
            _check.fail(op, f"num_topk must be <= num_topk_groups * experts per group ({candidates}), got {num_topk}")
    if not isinstance(scoring_func, str):
        _check.fail(op, f"scoring_func must be a str, got {type(scoring_func).__name__}", TypeError)
    if scoring_func.lower() not in TOP2_SCORING_FUNCS:
        _check.fail(op, f"scoring_func must be one of {', '.join(map(repr, TOP2_SCORING_FUNCS))} (any case), "
                        f"got {scoring_func!r}")
    num_shared = _num_shared(op, use_shared_as_routed, num_shared_experts)
    if num_shared:
        if num_topk % num_shared != 0:
            _check.fail(op, f"num_topk must be a multiple of num_shared_experts ({num_shared}), got {num_topk}")
        if num_routed % (num_topk // num_shared) != 0:
            _check.fail(op, f"logits experts ({num_routed}) must be a multiple of num_topk / num_shared_experts "
                            f"({num_topk // num_shared})")
    if not (num_topk + num_shared <= MAX_TOPK):
        _check.fail(op, f"num_topk + num_shared_experts must be <= {MAX_TOPK}, got {num_topk + num_shared}")
    if num_routed % 4 != 0:
        _check.fail(op, f"logits must have a multiple of 4 experts, got shape {tuple(logits.shape)}")
    _check_physical_map(op, to_physical_map, logical_count, num_routed + num_shared, device)
    num_extra = 0 if to_physical_map is None else to_physical_map.size(1) - 1
    if not (num_shared <= num_extra):
        _check.fail(op, f"to_physical_map must have at least num_shared_experts + 1 = {num_shared + 1} columns "
                        f"with shared experts, got {num_extra + 1 if to_physical_map is not None else 'none'}")
    _check_fixed_routing(op, fix_routing_mask, unmapped_topk_idx, rows, num_topk, device)
    _check.real(op, "routed_scaling_factor", routed_scaling_factor)
    _check.integer(op, "ep_rank", ep_rank, min=0)
    _check.integer(op, "num_ep_ranks", num_ep_ranks, min=1, max=num_routed + num_extra)
    _check.integer(op, "num_tp_ranks", num_tp_ranks, min=1)
    _check.integer(op, "tp_rank", tp_rank, min=0, max=num_tp_ranks - 1)
    if rows == 0:
        return (torch.empty(0, num_topk + num_shared, dtype=INT64, device=device),
                torch.empty(0, num_topk + num_shared, dtype=FP32, device=device))
    if logits.is_cuda:  # the kernel asserts the data rules on the device
        return _top2_sum_gate_kernel.top2_sum_gate_cuda(
            logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
            routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask, fix_routing_mask,
            to_physical_map, logical_count, unmapped_topk_idx)
    checks.check_top2_sum_gate_data(logits, mask, fix_routing_mask, unmapped_topk_idx, logical_count)
    return ref.top2_sum_gate(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed,
                             num_shared_experts, routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks,
                             scoring_func, mask, fix_routing_mask, to_physical_map, logical_count, unmapped_topk_idx)


@public("moe", path="kernel")
def moe_topk_gate_forward(logits, num_topk, use_shared_as_routed, num_shared_experts, routed_scaling_factor, ep_rank,
                          scoring_func="sqrtsoftplus", mask=None, bias=None, image_bias=None, image_token_mask=None,
                          fix_routing_mask=None, to_physical_map=None, logical_count=None, unmapped_topk_idx=None,
                          force_random=None, out=None, scores=None):
    """v2.1 gate (§2.13) -> ``(topk_idx int64 (T, K+S), topk_weights fp32 (T, K+S))``, into ``out`` if given.

    sqrt-softplus scores, optional bias / per-token image bias, top-k or fixed routes, weights
    ``u / (butterfly_sum(u) + 1e-20) * routed_scaling_factor``, shared slots, replica choice, and random
    routing for ``force_random`` tokens (cuRAND Philox draw seeded by ``ep_rank``, reproduced exactly).
    Writes ``unmapped_topk_idx`` and ``scores`` (unbiased, zero rows for masked / random tokens) if given.
    """
    plain = (mask is None and image_bias is None and image_token_mask is None and fix_routing_mask is None
             and to_physical_map is None and logical_count is None and unmapped_topk_idx is None
             and force_random is None and out is None and scores is None)
    if plain:  # a call whose facts passed before: native plan, no checks
        got = _moe_gate_kernel.gate_forward_fast(logits, num_topk, use_shared_as_routed, num_shared_experts,
                                                 routed_scaling_factor, ep_rank, scoring_func, bias)
        if got is not None:
            return got
    op = "moe_topk_gate_forward"
    if not (isinstance(scoring_func, str) and scoring_func == "sqrtsoftplus"):
        _check.fail(op, f"scoring_func must be 'sqrtsoftplus', got {scoring_func!r}")
    _check.tensor(op, "logits", logits, dtype=FP32, ndim=2, contiguous=True)
    rows, num_routed = logits.shape
    device = logits.device
    _check.optional(op, "bias", bias, dtype=FP32, shape=(num_routed,), contiguous=True, device=device)
    _check.expect((image_bias is None) == (image_token_mask is None), op,
                  "image_bias and image_token_mask must be given together")
    _check.optional(op, "image_bias", image_bias, dtype=FP32, shape=(num_routed,), contiguous=True, device=device)
    _check.optional(op, "image_token_mask", image_token_mask, dtype=BOOL, shape=(rows,), contiguous=True,
                    device=device)
    if mask is not None:
        _check_row_mask(op, "mask", mask, rows, device)
    _check.integer(op, "num_topk", num_topk, min=1, max=min(num_routed, MAX_TOPK))
    num_shared = _num_shared(op, use_shared_as_routed, num_shared_experts)
    if not (num_topk + num_shared <= MAX_TOPK):
        _check.fail(op, f"num_topk + num_shared_experts must be <= {MAX_TOPK}, got {num_topk + num_shared}")
    if num_routed % 4 != 0:
        _check.fail(op, f"logits must have a multiple of 4 experts, got shape {tuple(logits.shape)}")
    _check.real(op, "routed_scaling_factor", routed_scaling_factor)
    _check.integer(op, "ep_rank", ep_rank, min=0)
    width = num_topk + num_shared
    if out is not None:
        _check.expect(isinstance(out, (tuple, list)) and len(out) == 2, op,
                      "out must be a pair (topk_idx, topk_weights)", TypeError)
        _check.tensor(op, "out[0]", out[0], dtype=INT64, shape=(rows, width), device=device)
        _check.tensor(op, "out[1]", out[1], dtype=FP32, shape=(rows, width), device=device)
    _check.optional(op, "scores", scores, dtype=FP32, shape=(rows, num_routed), contiguous=True, device=device)
    _check_physical_map(op, to_physical_map, logical_count, num_routed + num_shared, device)
    _check_fixed_routing(op, fix_routing_mask, unmapped_topk_idx, rows, num_topk, device)
    _check.optional(op, "force_random", force_random, dtype=BOOL, shape=(rows,), device=device)
    if rows == 0:
        if out is not None:
            return out[0], out[1]
        return torch.empty(0, width, dtype=INT64, device=device), torch.empty(0, width, dtype=FP32, device=device)
    if logits.is_cuda:  # the kernel asserts the data rules on the device
        if plain:
            _moe_gate_kernel.remember_fast(logits, num_topk, use_shared_as_routed, num_shared_experts,
                                           routed_scaling_factor, ep_rank, scoring_func, bias)
        return _moe_gate_kernel.moe_topk_gate_forward_cuda(
            logits, num_topk, use_shared_as_routed, num_shared_experts, routed_scaling_factor, ep_rank, scoring_func,
            mask, bias, image_bias, image_token_mask, fix_routing_mask, to_physical_map, logical_count,
            unmapped_topk_idx, out, force_random=force_random, scores=scores)
    checks.check_gate_forward_data(logits, width, mask, fix_routing_mask, unmapped_topk_idx, logical_count,
                                   force_random)
    return ref.moe_topk_gate_forward(logits, num_topk, use_shared_as_routed, num_shared_experts, routed_scaling_factor,
                                     ep_rank, scoring_func, mask, bias, image_bias, image_token_mask, fix_routing_mask,
                                     to_physical_map, logical_count, unmapped_topk_idx, out,
                                     force_random=force_random, scores=scores)


@functools.wraps(moe_topk_gate_forward)
def moe_topk_gate(*args, **kwargs):
    """Alias of :func:`moe_topk_gate_forward` (v2.1)."""
    return moe_topk_gate_forward(*args, **kwargs)


moe_topk_gate.__name__ = moe_topk_gate.__qualname__ = "moe_topk_gate"
moe_topk_gate.__doc__ = "Alias of moe_topk_gate_forward (moe.md §2.13)."
public("moe", path="kernel")(moe_topk_gate)


@public("moe", path="kernel")
def moe_topk_gate_backward(scores, topk_idx, topk_weights, grad_topk_weights, routed_scaling_factor,
                           scoring_func="sqrtsoftplus", mask=None, grad_scores_sum=None, out=None):
    """Gradient of the v2.1 gate's routed weights (and optional auxiliary term) w.r.t. the logits (§2.14).

    ``topk_idx`` are the logical routed ids (the forward's ``unmapped_topk_idx``); -1 slots are skipped.
    Computed in fp64, returned as fp32 (T, E_r), into ``out`` if given.
    """
    op = "moe_topk_gate_backward"
    if not (isinstance(scoring_func, str) and scoring_func == "sqrtsoftplus"):
        _check.fail(op, f"scoring_func must be 'sqrtsoftplus', got {scoring_func!r}")
    _check.tensor(op, "scores", scores, dtype=FP32, ndim=2, contiguous=True)
    rows, num_routed = scores.shape
    device = scores.device
    _check.tensor(op, "topk_idx", topk_idx, dtype=INT64, ndim=2, contiguous=True, device=device)
    num_topk = topk_idx.size(1)
    _check.tensor(op, "topk_idx", topk_idx, shape=(rows, None))
    if not (num_topk <= min(num_routed, MAX_TOPK)):
        _check.fail(op, f"topk_idx must have at most min(E_r, {MAX_TOPK}) = {min(num_routed, MAX_TOPK)} columns, "
                        f"got shape {tuple(topk_idx.shape)}")
    for name, t in (("topk_weights", topk_weights), ("grad_topk_weights", grad_topk_weights)):
        _check.tensor(op, name, t, dtype=FP32, shape=(rows, num_topk), contiguous=True, device=device)
    _check.real(op, "routed_scaling_factor", routed_scaling_factor)
    _check.expect((mask is None) == (grad_scores_sum is None), op, "mask and grad_scores_sum must be given together")
    if grad_scores_sum is not None:
        _check.tensor(op, "grad_scores_sum", grad_scores_sum, dtype=FP32, ndim=2, contiguous=True, device=device)
        _check.tensor(op, "grad_scores_sum", grad_scores_sum, shape=(None, num_routed))
        num_seqs = grad_scores_sum.size(0)
        if not (num_seqs >= 1 and rows % num_seqs == 0):
            _check.fail(op, f"grad_scores_sum rows must divide num_tokens ({rows}), got shape "
                            f"{tuple(grad_scores_sum.shape)}")
        _check.tensor(op, "mask", mask, dtype=BOOL, shape=(rows,), contiguous=True, device=device)
    _check.optional(op, "out", out, dtype=FP32, shape=(rows, num_routed), contiguous=True, device=device)
    if rows == 0:
        return torch.empty(0, num_routed, dtype=FP32, device=device) if out is None else out
    if scores.is_cuda:  # the kernel asserts the index range on the device
        return _moe_gate_kernel.moe_topk_gate_backward_cuda(scores, topk_idx, topk_weights, grad_topk_weights,
                                                            routed_scaling_factor, scoring_func, mask,
                                                            grad_scores_sum, out)
    checks.check_gate_backward_data(topk_idx, num_routed)
    return ref.moe_topk_gate_backward(scores, topk_idx, topk_weights, grad_topk_weights, routed_scaling_factor,
                                      scoring_func, mask, grad_scores_sum, out)


@public("moe", path="kernel")
def normalize_weight(topk_weights: torch.Tensor):
    """``(denominator (T,), normalized (T, K))`` with the v1 denominator ``(((1e-20 + w0) + w1) + ...)`` (§2.4)."""
    op = "normalize_weight"
    _check.tensor(op, "topk_weights", topk_weights, dtype=FP32, ndim=2, contiguous=True)
    if topk_weights.is_cuda:
        return _topk_kernel.normalize_weight_cuda(topk_weights)
    return ref.normalize_weight(topk_weights)


# ----------------------------------------------------------------------------------------------------
# Fused layout
# ----------------------------------------------------------------------------------------------------

@public("moe", path="kernel")
def get_fused_mapping(topk_idx: torch.Tensor, num_experts: int, num_expanded_tokens: int, alignment: int,
                      force_no_sync: bool = False, *, num_sms: int | None = None):
    """Expert-major fused layout of §1.5 / §2.5 as the 8-tuple ``(pos_to_expert, pos_to_token,
    pos_to_token_topk, token_topk_to_pos, expert_start, expert_end, num_tokens_per_expert, list)``.

    ``num_expanded_tokens == 0`` without ``force_no_sync`` trims to the aligned total (one host sync)
    and returns the aligned counts as a list; otherwise the arrays have exactly ``num_expanded_tokens``
    entries (which must hold every aligned segment) and the list is empty. Rows inside a segment are
    in token order; ``num_sms=n`` reproduces upstream's order for an n-SM device instead.
    """
    op = "get_fused_mapping"
    _check.tensor(op, "topk_idx", topk_idx, dtype=INT64, ndim=2, contiguous=True)
    _check.integer(op, "num_experts", num_experts, min=1, max=MAX_FUSED_EXPERTS)
    _check.integer(op, "num_expanded_tokens", num_expanded_tokens, min=0)
    _check.integer(op, "alignment", alignment, min=1)
    _check.flag(op, "force_no_sync", force_no_sync)
    if num_sms is not None:
        _check.integer(op, "num_sms", num_sms, min=1)
    if topk_idx.is_cuda and num_sms is None:  # the kernels assert both data rules on the device
        return _mapping_kernel.get_fused_mapping_cuda(topk_idx, num_experts, num_expanded_tokens, alignment,
                                                      force_no_sync)
    checks.check_fused_mapping_data(topk_idx, num_experts, num_expanded_tokens, alignment, force_no_sync)
    # CPU, and upstream's worker order (num_sms) on any device: the reference
    return ref.get_fused_mapping(topk_idx, num_experts, num_expanded_tokens, alignment, force_no_sync, num_sms=num_sms)


def _check_expand_maps(op: str, rows: int, token_topk_to_pos, pos_to_expert, device) -> None:
    _check.tensor(op, "token_topk_to_pos", token_topk_to_pos, dtype=INT32, ndim=2, contiguous=True, device=device)
    _check.tensor(op, "token_topk_to_pos", token_topk_to_pos, shape=(rows, None))
    _check.tensor(op, "pos_to_expert", pos_to_expert, dtype=INT32, ndim=1, contiguous=True, device=device)
    size = pos_to_expert.numel()
    if not token_topk_to_pos.is_cuda:  # the CUDA kernels assert it on the device
        checks.assert_data(token_topk_to_pos < size, op,
                           f"token_topk_to_pos entries must be < len(pos_to_expert) = {size}")


@public("moe", path="kernel")
def expand_to_fused(x: torch.Tensor, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor) -> torch.Tensor:
    """``(N, H)`` copy of x's rows to their fused positions; padding rows are zero (§2.6). Any dtype."""
    op = "expand_to_fused"
    _check.tensor(op, "x", x, ndim=2, contiguous=True)
    _check_expand_maps(op, x.size(0), token_topk_to_pos, pos_to_expert, x.device)
    if x.is_cuda:
        return _shuffle_kernel.expand_to_fused_cuda(x, token_topk_to_pos, pos_to_expert)
    return ref.expand_to_fused(x, token_topk_to_pos, pos_to_expert)


@public("moe", path="kernel")
def expand_to_fused_with_sf(x, num_per_channels: int, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor,
                            use_tma_aligned_col_major_sf: bool = False):
    """expand_to_fused of a quantized pair ``(data, sf)`` -> ``(out (N, H), out_sf (N, H_sf))`` (§2.7).

    ``sf`` is row-major fp32 ``(T, ceil(H / num_per_channels))`` or packed-UE8M0 int32
    ``(T, ceil(ceil(H / num_per_channels) / 4))`` (int32 needs ``use_tma_aligned_col_major_sf``);
    ``out_sf`` is row-major or TMA-aligned column-major.
    """
    op = "expand_to_fused_with_sf"
    _check.expect(isinstance(x, (tuple, list)) and len(x) == 2, op, "x must be a pair (data, sf)", TypeError)
    data, sf = x
    _check.tensor(op, "x[0]", data, ndim=2, contiguous=True)
    rows, hidden = data.shape
    _check.tensor(op, "x[1]", sf, dtype=(FP32, INT32), ndim=2, contiguous=True, device=data.device)
    _check.choice(op, "num_per_channels", num_per_channels, (32, 128))
    _check.flag(op, "use_tma_aligned_col_major_sf", use_tma_aligned_col_major_sf)
    blocks = formats.cdiv(hidden, num_per_channels)
    sf_width = formats.cdiv(blocks, 4) if sf.dtype == INT32 else blocks
    _check.tensor(op, "x[1]", sf, shape=(rows, sf_width))
    _check.expect(sf.dtype != INT32 or use_tma_aligned_col_major_sf, op,
                  "x[1] (packed UE8M0 int32 sf) requires use_tma_aligned_col_major_sf=True")
    _check_expand_maps(op, rows, token_topk_to_pos, pos_to_expert, data.device)
    if data.is_cuda:
        return _shuffle_kernel.expand_to_fused_with_sf_cuda((data, sf), num_per_channels, token_topk_to_pos,
                                                            pos_to_expert, use_tma_aligned_col_major_sf)
    return ref.expand_to_fused_with_sf((data, sf), num_per_channels, token_topk_to_pos, pos_to_expert,
                                       use_tma_aligned_col_major_sf)


@public("moe", path="kernel")
def reduce_fused(x, topk_weights, token_topk_to_pos, fp8_format: str = "", sf=None, out=None):
    """Combine fused rows to tokens (§2.8): ``out[t] = sf * sum_k w_k * x_sf[p_k] * x[p_k]`` as an fp32 FMA
    chain in slot order, skipping ``p_k = -1``; output in x's dtype, or e4m3 (saturating) with
    ``fp8_format='e4m3'``. ``x`` is a tensor ``(N, H)`` or a pair ``(x, x_sf (N,))``.
    """
    op = "reduce_fused"
    if isinstance(x, (tuple, list)):
        _check.expect(len(x) == 2, op, "x must be a tensor or a pair (x, x_sf)", TypeError)
        data, x_sf = x
    else:
        data, x_sf = x, None
    _check.tensor(op, "x", data, dtype=(FP32, torch.bfloat16, torch.float16), ndim=2, contiguous=True)
    size, hidden = data.shape
    device = data.device
    if hidden % 256 != 0:
        _check.fail(op, f"x must have hidden % 256 == 0, got shape {tuple(data.shape)}")
    _check.optional(op, "x_sf", x_sf, dtype=FP32, shape=(size,), contiguous=True, device=device)
    _check.tensor(op, "token_topk_to_pos", token_topk_to_pos, dtype=INT32, ndim=2, contiguous=True, device=device)
    rows, num_topk = token_topk_to_pos.shape
    _check.optional(op, "topk_weights", topk_weights, dtype=FP32, shape=(rows, num_topk), contiguous=True,
                    device=device)
    _check.choice(op, "fp8_format", fp8_format, ("", "e4m3"))
    if sf is not None:
        _check.expect(fp8_format == "e4m3", op, "sf is only supported with fp8_format='e4m3' (FP8 output)")
        _check.tensor(op, "sf", sf, dtype=FP32, device=device)
        if sf.numel() != 1:
            _check.fail(op, f"sf must have one element, got shape {tuple(sf.shape)}")
    out_dtype = torch.float8_e4m3fn if fp8_format == "e4m3" else data.dtype
    _check.optional(op, "out", out, dtype=out_dtype, shape=(rows, hidden), device=device)
    if data.is_cuda:  # the kernel asserts token_topk_to_pos < x rows on the device
        return _shuffle_kernel.reduce_fused_cuda(x, topk_weights, token_topk_to_pos, fp8_format, sf, out)
    checks.assert_data(token_topk_to_pos < size, op, f"token_topk_to_pos entries must be < x rows ({size})")
    return ref.reduce_fused(x, topk_weights, token_topk_to_pos, fp8_format, sf, out=out)


# ----------------------------------------------------------------------------------------------------
# Counting utilities and EP/TP masking
# ----------------------------------------------------------------------------------------------------

@public("moe", path="kernel")
def aux_fi(topk_idx: torch.Tensor, num_experts: int, num_aux_topk: int) -> torch.Tensor:
    """Per-expert load fraction ``f_e = c_e * E / (T * num_aux_topk)``, fp32 (E,) (§2.9)."""
    op = "aux_fi"
    _check.tensor(op, "topk_idx", topk_idx, dtype=INT64, ndim=2, contiguous=True)
    _check.integer(op, "num_experts", num_experts, min=1)
    _check.integer(op, "num_aux_topk", num_aux_topk, min=1)
    if topk_idx.is_cuda:  # the kernel asserts the data rule on the device
        return _count_kernel.aux_fi_cuda(topk_idx, num_experts, num_aux_topk)
    checks.assert_data((topk_idx >= -1) & (topk_idx < num_experts), op,
                       f"topk_idx entries must be in [-1, {num_experts})")
    return ref.aux_fi(topk_idx, num_experts, num_aux_topk)


@public("moe", path="kernel")
def group_count(group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Number of entries equal to each group id, int32 (num_groups,) (§2.10)."""
    op = "group_count"
    _check.tensor(op, "group_idx", group_idx, dtype=INT64, ndim=2, contiguous=True)
    _check.integer(op, "num_groups", num_groups, min=1)
    if group_idx.is_cuda:
        return _count_kernel.group_count_cuda(group_idx, num_groups)
    checks.assert_data((group_idx >= -1) & (group_idx < num_groups), op,
                       f"group_idx entries must be in [-1, {num_groups})")
    return ref.group_count(group_idx, num_groups)


@public("moe", path="kernel")
def inplace_unique_group_indices(group_indices: torch.Tensor, num_groups: int) -> None:
    """In place: per row, repeated non-negative ids become -1 (first occurrence kept) (§2.11)."""
    op = "inplace_unique_group_indices"
    _check.tensor(op, "group_indices", group_indices, dtype=INT64, ndim=2, contiguous=True)
    _check.integer(op, "num_groups", num_groups, min=1, max=MAX_UNIQUE_GROUPS)
    if group_indices.is_cuda:
        return _count_kernel.inplace_unique_group_indices_cuda(group_indices, num_groups)
    limit = formats.align(num_groups, 64)
    checks.assert_data(group_indices < limit, op, f"group_indices entries must be < align(num_groups, 64) = {limit}")
    ref.inplace_unique_group_indices(group_indices, num_groups)


@public("moe", path="kernel")
def mask_indices_by_tp(indices: torch.Tensor, n: int, num_ep_ranks: int, tp_rank: int,
                       num_tp_ranks: int) -> torch.Tensor:
    """Keep the experts of TP rank ``tp_rank`` renumbered densely, others -1; same dtype (§1.2, §2.12)."""
    op = "mask_indices_by_tp"
    _check.tensor(op, "indices", indices, dtype=(INT64, INT32), ndim=2, contiguous=True)
    _check.integer(op, "num_ep_ranks", num_ep_ranks, min=1)
    _check.integer(op, "n", n, min=num_ep_ranks)
    _check.integer(op, "num_tp_ranks", num_tp_ranks, min=1)
    _check.integer(op, "tp_rank", tp_rank, min=0, max=num_tp_ranks - 1)
    if indices.is_cuda:
        return _count_kernel.mask_indices_by_tp_cuda(indices, n, num_ep_ranks, tp_rank, num_tp_ranks)
    return ref.mask_indices_by_tp(indices, n, num_ep_ranks, tp_rank, num_tp_ranks)
