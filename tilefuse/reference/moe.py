"""Reference MoE routing (moe.md): plain PyTorch, the CPU path of every ``tilefuse.moe`` op and the
oracle of every MoE test.

Where upstream's own reference and upstream's kernel differ only in rounding order (softmax sum, weight
denominators), these functions follow the kernel's order, which the spec calls normative (moe.md §2.2
step 2 and 6, §2.4, §2.13 step 6, §3.2): the result is then bit-exact against a faithful kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tilefuse import _check, formats

__all__ = [
    "aux_fi",
    "expand_to_fused",
    "expand_to_fused_with_sf",
    "group_count",
    "inplace_unique_group_indices",
    "mask_indices_by_tp",
    "moe_topk_gate_backward",
    "moe_topk_gate_forward",
    "normalize_weight",
    "reduce_fused",
    "stable_topk",
    "top2_sum_gate",
    "topk_sum_and_topk_group_idx",
]

EPS = 1e-20                   # weight-denominator epsilon (moe.md §2.2 step 6, §2.4, §2.13 step 6)
REPLICA_STRIDE = 23333        # replica choice d = (ep_rank + t * 23333) mod count (§2.2 step 9)
SCORING_FUNCS = ("sigmoid", "sqrtsoftplus", "softmax", "identity")   # v1 ScoringFunc members 0..3
_SENTINEL = 2**31 - 1


# ----------------------------------------------------------------------------------------------------
# Scoring functions and fixed-order sums (§2.0, §2.2 step 2, §2.4)
# ----------------------------------------------------------------------------------------------------

def scoring_name(label) -> str:
    """Parse a v1 ScoringFunc label case-insensitively (§2.0); unknown labels raise ValueError."""
    name = str(label).lower() if isinstance(label, str) else None
    if name not in SCORING_FUNCS:
        raise ValueError(f"{label} is not a valid ScoringFunc")
    return name


def sqrt_softplus(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(softplus(x))`` with PyTorch's softplus (threshold 20), §2.0."""
    return F.softplus(x).sqrt()


def butterfly_sum32(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (<= 32 entries) in the 32-lane XOR-butterfly order of §2.4 (v2.1).

    Lanes beyond ``v.size(-1)`` hold +0.0; for o = 16, 8, 4, 2, 1 every lane adds lane ``l ^ o``; the
    result is lane 0.
    """
    lanes = F.pad(v, (0, 32 - v.size(-1)))
    partner = torch.arange(32, device=v.device)
    for o in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[..., partner ^ o]
    return lanes[..., 0]


def sequential_sum_from_eps(v: torch.Tensor) -> torch.Tensor:
    """``(((1e-20 + v0) + v1) + ...)`` over the last dim of a 2-D tensor, in v's dtype (§2.2 step 6, §2.4 v1)."""
    acc = torch.full(v.shape[:1], EPS, dtype=v.dtype, device=v.device)
    for k in range(v.size(1)):
        acc = acc + v[:, k]
    return acc


def softmax_lane_order(x: torch.Tensor) -> torch.Tensor:
    """Row softmax whose normaliser is summed in the kernel's order (§2.2 step 2).

    Lane l accumulates experts ``c*128 + 4l + j`` (c ascending, then j = 0..3) sequentially from 0;
    the 32 lane sums are combined by the XOR butterfly. Needs ``E % 4 == 0``.
    """
    rows, experts = x.shape
    z = torch.exp(x - x.max(dim=1, keepdim=True).values)
    chunks = formats.cdiv(experts, 128)
    zp = F.pad(z, (0, chunks * 128 - experts)).view(rows, chunks, 32, 4)
    acc = torch.zeros(rows, 32, dtype=x.dtype, device=x.device)
    for c in range(chunks):
        for j in range(4):
            acc = acc + zp[:, c, :, j]   # padding adds +0.0: no change
    return z / butterfly_sum32(acc)[:, None]


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Unbiased scores s_e of §2.2 step 2."""
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    if scoring == "sqrtsoftplus":
        return sqrt_softplus(logits)
    if scoring == "softmax":
        return softmax_lane_order(logits)
    raise ValueError(f"scoring function {scoring!r} is not supported by the gates")


# ----------------------------------------------------------------------------------------------------
# Top-k (§2.1, §2.3)
# ----------------------------------------------------------------------------------------------------

def stable_topk(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    """Indices of the K largest entries per row, descending, ties -> smaller index (§2.1)."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    return order[:, :num_topk].contiguous()


def topk_sum_and_topk_group_idx(scores: torch.Tensor, num_group_sum_topk: int, num_topk_groups: int) -> torch.Tensor:
    """Rank groups by the sum of their top-1/top-2 scores and return the best groups' indices (§2.3)."""
    group_scores = scores.topk(num_group_sum_topk, dim=-1, sorted=False).values.sum(-1)
    return stable_topk(group_scores, num_topk_groups)


# ----------------------------------------------------------------------------------------------------
# Replica choice and EP/TP renumbering (§1.2, §2.2 steps 9-10, §2.12, §2.13 step 9)
# ----------------------------------------------------------------------------------------------------

def _wrap_int32(v: torch.Tensor) -> torch.Tensor:
    """Two's-complement wrap of int64 values to the int32 range (kept as int64)."""
    return torch.remainder(v + 2**31, 2**32) - 2**31


def to_physical(logical: torch.Tensor, ep_rank: int, to_physical_map: torch.Tensor | None,
                logical_count: torch.Tensor | None) -> torch.Tensor:
    """Map logical expert ids (T, W) to physical ids: ``map[l, (ep_rank + t*23333) mod count[l]]``.

    Upstream kernel semantics (§2.13 step 9): ``ep_rank + t*23333`` wraps in int32 before the floor
    modulo; a logical id outside the map or a replica column ``>= D`` gives physical id 0.
    """
    if to_physical_map is None:
        return logical
    rows, cols = to_physical_map.shape
    t = torch.arange(logical.size(0), dtype=torch.int64, device=logical.device)
    base = _wrap_int32(_wrap_int32(torch.tensor(ep_rank, dtype=torch.int64)) + t * REPLICA_STRIDE)
    in_map = (logical >= 0) & (logical < rows)
    ell = logical.clamp(0, rows - 1)
    count = logical_count.to(torch.int64)[ell].clamp_min(1)       # count 0 is rejected by the op
    d = torch.remainder(base[:, None], count)
    phys = to_physical_map.to(torch.int64)[ell, d.clamp_max(cols - 1)]
    return torch.where(in_map & (d < cols), phys, torch.zeros_like(phys))


def _tp_renumber(v: torch.Tensor, experts_per_rank: int, tp_rank: int, num_tp_ranks: int) -> torch.Tensor:
    """Keep experts of this TP rank and renumber them densely, others -> -1 (§1.2)."""
    p, q = experts_per_rank, num_tp_ranks * experts_per_rank
    keep = (v >= 0) & (torch.div(v, p, rounding_mode="floor") % num_tp_ranks == tp_rank)
    shifted = v - tp_rank * p
    renumbered = shifted - torch.div(shifted, q, rounding_mode="floor") * (q - p)
    return torch.where(keep & (renumbered >= 0), renumbered, torch.full_like(v, -1))


def mask_indices_by_tp(indices: torch.Tensor, n: int, num_ep_ranks: int, tp_rank: int,
                       num_tp_ranks: int) -> torch.Tensor:
    """EP/TP masking of expert indices, same dtype as the input (§2.12)."""
    return _tp_renumber(indices, n // num_ep_ranks, tp_rank, num_tp_ranks)


# ----------------------------------------------------------------------------------------------------
# Gates (§2.2, §2.13, §2.14) and weight normalisation (§2.4)
# ----------------------------------------------------------------------------------------------------

def _row_flags(flags: torch.Tensor | None, rows: int, default: bool, device) -> torch.Tensor:
    """A (T,) bool vector from an optional flag tensor of numel T."""
    if flags is None:
        return torch.full((rows,), default, dtype=torch.bool, device=device)
    return flags.reshape(rows)


def _select_routed(ranking: torch.Tensor, num_topk: int, fix_routing_mask: torch.Tensor | None,
                   unmapped_topk_idx: torch.Tensor | None) -> torch.Tensor:
    """Routed logical indices (T, K): stable top-k of ``ranking``, or the given ones for fixed tokens."""
    routed = stable_topk(ranking, num_topk)
    if fix_routing_mask is not None:
        routed = torch.where(fix_routing_mask.reshape(-1, 1), unmapped_topk_idx, routed)
    return routed


def _append_shared(routed: torch.Tensor, weights: torch.Tensor, num_routed: int, num_shared: int):
    """Append S shared slots with logical ids E_r + s and weight 1.0 (§2.2 step 8)."""
    rows = routed.size(0)
    shared = torch.arange(num_routed, num_routed + num_shared, device=routed.device).expand(rows, num_shared)
    ones = torch.ones(rows, num_shared, dtype=weights.dtype, device=weights.device)
    return torch.cat([routed, shared], dim=1), torch.cat([weights, ones], dim=1)


def _write_outputs(idx, weights, out):
    """Copy into the caller's ``out=(topk_idx, topk_weights)`` if given, else return the new tensors."""
    if out is None:
        return idx, weights
    out[0].copy_(idx)
    out[1].copy_(weights)
    return out[0], out[1]


def top2_sum_gate(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
                  routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask=None,
                  fix_routing_mask=None, to_physical_map=None, logical_count=None, unmapped_topk_idx=None):
    """v1 routing gate (§2.2): scores, bias, group-limited top-k, weights, shared slots, replicas, EP/TP mask.

    Returns ``(topk_idx int64 (T, K+S), topk_weights (T, K+S))``; writes ``unmapped_topk_idx`` if given.
    Weight denominator and softmax sum follow the kernel's order (§2.2 steps 2 and 6).
    """
    scoring = scoring_name(scoring_func)
    rows, num_routed = logits.shape
    num_shared = num_shared_experts if use_shared_as_routed else 0
    active = _row_flags(mask, rows, True, logits.device)

    scores = _scores(logits, scoring)
    ranking = (logits if scoring == "softmax" else scores) + bias
    if num_groups != num_topk_groups:
        per_group = num_routed // num_groups
        kept = topk_sum_and_topk_group_idx(ranking.view(rows, num_groups, per_group), 2, num_topk_groups)
        keep = torch.zeros(rows, num_groups, dtype=torch.bool, device=logits.device).scatter_(1, kept, True)
        ranking = ranking.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    routed = _select_routed(ranking, num_topk, fix_routing_mask, unmapped_topk_idx)

    chosen = scores.gather(1, routed.clamp(0, num_routed - 1))
    rho = torch.tensor(routed_scaling_factor, dtype=scores.dtype, device=scores.device)
    weights = (chosen / sequential_sum_from_eps(chosen)[:, None]) * rho
    idx, weights = _append_shared(routed, weights, num_routed, num_shared)

    idx = to_physical(idx, ep_rank, to_physical_map, logical_count)
    num_extra = 0 if to_physical_map is None else to_physical_map.size(1) - 1
    idx = _tp_renumber(idx, (num_routed + num_extra) // num_ep_ranks, tp_rank, num_tp_ranks)

    idx = torch.where(active[:, None], idx, torch.full_like(idx, -1))
    weights = torch.where(active[:, None], weights, torch.zeros_like(weights))
    if unmapped_topk_idx is not None:
        unmapped_topk_idx.copy_(torch.where(active[:, None], routed, torch.full_like(routed, -1)))
    return idx, weights


def normalize_weight(topk_weights: torch.Tensor):
    """v1 normalisation (§2.4): denominator ``(((1e-20 + w0) + w1) + ...)`` in fp32, weights / denominator."""
    denominator = sequential_sum_from_eps(topk_weights)
    return denominator, topk_weights / denominator[:, None]


# --- random routing (§2.13 step 2): cuRAND Philox4x32-10, reproduced bit for bit ---------------------

_MASK32 = 0xFFFFFFFF
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo32(a: int, b: torch.Tensor):
    """High and low 32-bit words of ``a * b`` (uint32 values held in int64), without int64 overflow."""
    p_lo, p_hi = a * (b & 0xFFFF), a * (b >> 16)
    mid = p_lo + ((p_hi & 0xFFFF) << 16)
    return ((p_hi >> 16) + (mid >> 32)) & _MASK32, mid & _MASK32


def philox4x32_10(counter, key):
    """The Philox4x32-10 block function (Salmon et al. 2011; cuRAND's ``curand_Philox4x32_10``).

    ``counter`` is four and ``key`` two uint32 words, each an int64 tensor (or int) of one shape.
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + _PHILOX_W0) & _MASK32, (k1 + _PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo32(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def random_routing(num_tokens: int, width: int, num_physical: torch.Tensor, ep_rank: int, device):
    """Random routes of every token (§2.13 step 2): ``width`` distinct ids in [0, num_physical) and
    uniform weights in (0, 1], as upstream's cuRAND draw.

    Lane l of token t uses ``curand_init(seed=ep_rank, subsequence=32t+l, offset=0)``: its first
    Philox block (counter (0, 0, lo, hi) of 32t+l, key = the two words of the seed) gives
    ``u = x * 2^-32 + 2^-33`` (fp32) and ``r = y``; ``num_physical`` is a 0-dim int64 tensor (no sync); ``c_l = r mod (num_physical - l)`` (unsigned), then
    ``width`` rounds of the minimum-lane de-duplication.
    """
    lane = torch.arange(32, dtype=torch.int64, device=device)
    subsequence = torch.arange(num_tokens, dtype=torch.int64, device=device)[:, None] * 32 + lane
    seed = ep_rank % 2**64
    zero = torch.zeros_like(subsequence)
    x, y, _, _ = philox4x32_10((zero, zero, subsequence & _MASK32, subsequence >> 32),
                               (seed & _MASK32, seed >> 32))
    uniform = x.to(torch.float32) * 2.0**-32 + 2.0**-33
    in_use = lane < width
    c = torch.where(in_use, torch.remainder(y, (num_physical - lane).clamp_min(1)), _SENTINEL)
    idx = torch.full_like(c, -1)
    resolved = torch.zeros_like(in_use).expand_as(c).clone()
    for _ in range(width):
        m = c.min(dim=1, keepdim=True).values
        first = torch.where(c == m, lane, 32).min(dim=1, keepdim=True).values
        c = c + (in_use & ~resolved & (c >= m) & (lane > first)).to(c.dtype)
        here = lane == first
        idx = torch.where(here, m, idx)
        resolved = resolved | here
        c = torch.where(here, _SENTINEL, c)
    return idx[:, :width], uniform[:, :width]


def moe_topk_gate_forward(logits, num_topk, use_shared_as_routed, num_shared_experts, routed_scaling_factor,
                          ep_rank, scoring_func="sqrtsoftplus", mask=None, bias=None, image_bias=None,
                          image_token_mask=None, fix_routing_mask=None, to_physical_map=None, logical_count=None,
                          unmapped_topk_idx=None, out=None, *, force_random=None, scores=None):
    """v2.1 gate (§2.13): sqrt-softplus scores, optional (image) bias, top-k or fixed routes, butterfly
    weight denominator, shared slots, replica choice, random routing; no EP/TP masking.

    Returns ``(topk_idx int64 (T, K+S), topk_weights (T, K+S))`` (into ``out`` if given); writes
    ``unmapped_topk_idx`` and ``scores`` if given. Computes in ``logits.dtype`` (fp32 for the op; fp64
    works for autograd checks).
    """
    if scoring_func != "sqrtsoftplus":
        raise ValueError(f"moe_topk_gate_forward: scoring_func must be 'sqrtsoftplus', got {scoring_func!r}")
    rows, num_routed = logits.shape
    num_shared = num_shared_experts if use_shared_as_routed else 0
    device = logits.device
    active = _row_flags(mask, rows, True, device)
    rand = _row_flags(force_random, rows, False, device) & active
    routed_row = active & ~rand

    u = sqrt_softplus(logits)
    b = torch.zeros((), dtype=logits.dtype, device=device) if bias is None else bias
    if image_token_mask is not None:
        b = torch.where(image_token_mask.reshape(-1, 1), image_bias, b)
    routed = _select_routed(u + b, num_topk, fix_routing_mask, unmapped_topk_idx)

    chosen = u.gather(1, routed.clamp(0, num_routed - 1))
    eps = torch.tensor(EPS, dtype=u.dtype, device=device)
    rho = torch.tensor(routed_scaling_factor, dtype=u.dtype, device=device)
    weights = (chosen / (butterfly_sum32(chosen) + eps)[:, None]) * rho
    idx, weights = _append_shared(routed, weights, num_routed, num_shared)
    idx = to_physical(idx, ep_rank, to_physical_map, logical_count)

    if force_random is not None:
        num_physical = (torch.tensor(num_routed + num_shared, device=device) if logical_count is None
                        else logical_count.to(torch.int64).sum())
        rand_idx, rand_w = random_routing(rows, num_topk + num_shared, num_physical, ep_rank, device)
        idx = torch.where(rand[:, None], rand_idx, idx)
        weights = torch.where(rand[:, None], rand_w.to(weights.dtype), weights)

    idx = torch.where(active[:, None], idx, torch.full_like(idx, -1))
    weights = torch.where(active[:, None], weights, torch.zeros_like(weights))
    if unmapped_topk_idx is not None:
        unmapped_topk_idx.copy_(torch.where(routed_row[:, None], routed, torch.full_like(routed, -1)))
    if scores is not None:
        scores.copy_(torch.where(routed_row[:, None], u, torch.zeros_like(u)))
    return _write_outputs(idx, weights, out)


def sqrt_softplus_grad(u: torch.Tensor) -> torch.Tensor:
    """d sqrt(softplus(x))/dx expressed through u = sqrt(softplus(x)): ``-expm1(-u^2)/(2u)``, 0 at u = 0."""
    positive = u > 0
    safe = torch.where(positive, u, torch.ones_like(u))
    return torch.where(positive, -torch.expm1(-safe * safe) / (2 * safe), torch.zeros_like(u))


def moe_topk_gate_backward(scores, topk_idx, topk_weights, grad_topk_weights, routed_scaling_factor,
                           scoring_func="sqrtsoftplus", mask=None, grad_scores_sum=None, out=None):
    """Gradient of the v2.1 gate w.r.t. the logits (§2.14), computed in fp64 and returned as fp32.

    Routing term per valid slot ``(rho*g_k - sum_i g_i w_i) / (sum_k u_k + 1e-20)`` accumulated on its
    expert; optional auxiliary term ``(h_e - sum_i h_i u_i / Su) / Su`` for mask-true tokens; both times
    the sqrt-softplus derivative.
    """
    if scoring_func != "sqrtsoftplus":
        raise ValueError(f"moe_topk_gate_backward: scoring_func must be 'sqrtsoftplus', got {scoring_func!r}")
    u = scores.to(torch.float64)
    rows, num_routed = u.shape
    valid = topk_idx >= 0
    idx = topk_idx.clamp(0, num_routed - 1)
    u_k = torch.where(valid, u.gather(1, idx), 0.0)
    g = torch.where(valid, grad_topk_weights.to(torch.float64), 0.0)
    dot = (g * topk_weights.to(torch.float64)).sum(1, keepdim=True)
    per_slot = (routed_scaling_factor * g - dot) / (u_k.sum(1, keepdim=True) + EPS)
    grad = torch.zeros_like(u).scatter_add_(1, idx, torch.where(valid, per_slot, 0.0))
    if grad_scores_sum is not None:
        num_seqs = grad_scores_sum.size(0)
        seq = torch.arange(rows, device=u.device) // max(rows // num_seqs, 1)
        h = grad_scores_sum.to(torch.float64)[seq]
        su = u.sum(1, keepdim=True)
        inv = torch.where(mask.reshape(-1, 1), 1.0 / su, 0.0)
        grad = grad + (h - (h * u).sum(1, keepdim=True) * inv) * inv
    result = (sqrt_softplus_grad(u) * grad).to(torch.float32)
    if out is None:
        return result
    return out.copy_(result)


# ----------------------------------------------------------------------------------------------------
# Fused (expert-major) layout (§1.5, §2.5-§2.8)
# ----------------------------------------------------------------------------------------------------

def _order_workers(num_slots: int, num_experts: int, num_sms: int | None, device):
    """Worker of each flat slot under upstream's order model (§1.5), or all 0 for token order."""
    flat = torch.arange(num_slots, dtype=torch.int64, device=device)
    if num_sms is None or num_slots == 0:
        return torch.zeros_like(flat), 1
    threads = next(h for h in (256, 512, 1024) if h >= num_experts)
    workers = num_sms * threads // 32
    per_worker = formats.align(formats.cdiv(num_slots, workers), 32)
    return flat // per_worker, workers


def get_fused_mapping(topk_idx: torch.Tensor, num_experts: int, num_expanded_tokens: int, alignment: int,
                      force_no_sync: bool = False, *, num_sms: int | None = None):
    """The fused layout of §1.5 / §2.5 as an 8-tuple (pos_to_expert, pos_to_token, pos_to_token_topk,
    token_topk_to_pos, expert_start, expert_end, num_tokens_per_expert (aligned), list).

    Rows inside a segment are in token order (ascending flat index) by default; with ``num_sms`` they
    follow upstream's worker order (ascending worker, descending flat index inside a worker). With
    ``num_expanded_tokens == 0`` and not ``force_no_sync`` the size is trimmed to the aligned total
    (a host sync) and the list holds the aligned counts; otherwise the list is empty.
    """
    rows, k = topk_idx.shape
    device = topk_idx.device
    value = topk_idx.reshape(-1)
    num_slots = value.numel()
    routed = (value >= 0) & (value < num_experts)
    expert = torch.where(routed, value, num_experts)                   # unrouted slots sort last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(
        0, expert, torch.ones_like(expert))[:num_experts]
    aligned = (counts + alignment - 1) // alignment * alignment
    expert_end = aligned.cumsum(0)
    expert_start = expert_end - aligned

    worker, num_workers = _order_workers(num_slots, num_experts, num_sms, device)
    flat = torch.arange(num_slots, dtype=torch.int64, device=device)
    inner = flat if num_sms is None else num_slots - 1 - flat
    key = (expert * num_workers + worker) * max(num_slots, 1) + inner
    order = torch.sort(key, stable=True).indices                      # flat slots in layout order
    rank = torch.empty_like(order)
    rank[order] = flat                                                 # position of each slot in that order
    raw_start = counts.cumsum(0) - counts

    if num_expanded_tokens == 0 and not force_no_sync:
        _check.has_data("get_fused_mapping", "topk_idx", topk_idx,
                        "with num_expanded_tokens == 0 and not force_no_sync the output size is read from its counts")
        sizes = aligned.tolist()
        size = sum(sizes)
    else:
        sizes, size = [], num_expanded_tokens
    e = expert.clamp_max(num_experts - 1)
    pos = torch.where(routed, expert_start[e] + rank - raw_start[e], size)   # size = a dump slot

    def scatter(values):
        buf = torch.full((size + 1,), -1, dtype=torch.int32, device=device)
        buf[pos] = values.to(torch.int32)
        return buf[:size]

    pos_to_expert = scatter(value)
    pos_to_token = scatter(flat // max(k, 1))
    pos_to_token_topk = scatter(flat)
    token_topk_to_pos = torch.where(routed, pos, -1).to(torch.int32).view(rows, k)
    as32 = lambda t: t.to(torch.int32)  # noqa: E731
    return (pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos,
            as32(expert_start), as32(expert_end), as32(aligned), sizes)


def expand_to_fused(x: torch.Tensor, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor) -> torch.Tensor:
    """Copy row t of x to every fused position ``token_topk_to_pos[t, k] >= 0``; other rows zero (§2.6).

    Pure byte copies, so any element type works.
    """
    rows, hidden = x.shape
    size = pos_to_expert.numel()
    if hidden == 0:                                                     # no bytes to view back as x's dtype
        return x.new_zeros((size, 0))
    raw = x.contiguous().view(torch.uint8)                              # (T, H * itemsize)
    out = torch.zeros(size + 1, raw.size(1), dtype=torch.uint8, device=x.device)
    pos = token_topk_to_pos.to(torch.int64)
    target = torch.where(pos >= 0, pos, size).reshape(-1)              # skipped slots go to a dump row
    source = torch.arange(rows, device=x.device).repeat_interleave(pos.size(1))
    out[target] = raw[source]
    return out[:size].view(x.dtype).view(size, hidden)


def expand_to_fused_with_sf(x, num_per_channels: int, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor,
                            use_tma_aligned_col_major_sf: bool = False):
    """expand_to_fused of ``(data, sf)``: the per-token sf rows travel with the data rows (§2.7).

    The sf rows (fp32, or int32 packed UE8M0) are decoded with ``formats.load_sf``, expanded (padding
    and untargeted rows zero) and stored back in the requested quant.md §1.5 layout with
    ``formats.store_sf``: row-major ``(N, H_sf)`` or TMA-aligned column-major (storage
    ``(H_sf, align(N, 4))``, zero pad). The UE8M0 round trip is exact; unused high bytes of the last
    packed word come out zero.
    """
    data, sf = x
    packed = sf.dtype == torch.int32
    num_blocks = formats.cdiv(data.size(1), num_per_channels) if packed else sf.size(1)
    out = expand_to_fused(data, token_topk_to_pos, pos_to_expert)
    sf_rows = expand_to_fused(formats.load_sf(sf, num_blocks), token_topk_to_pos, pos_to_expert)
    return out, formats.store_sf(sf_rows, use_tma_aligned_col_major_sf, packed)


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add ``a*b + c`` with one rounding (round-to-nearest-even).

    ``a*b`` is exact in fp64; the fp64 sum is turned into round-to-odd (Knuth's TwoSum error moves an
    inexact even result one ulp toward the exact value), after which rounding to fp32 is correct.
    """
    p = a.to(torch.float64) * b.to(torch.float64)
    c = c.to(torch.float64)
    s = p + c
    bv = s - p
    err = (p - (s - bv)) + (c - bv)
    even = (s.view(torch.int64) & 1) == 0
    fix = (err != 0) & torch.isfinite(s) & even
    toward = torch.where(err > 0, float("inf"), float("-inf")).to(torch.float64)
    return torch.where(fix, torch.nextafter(s, toward), s).to(torch.float32)


def reduce_fused(x, topk_weights, token_topk_to_pos, fp8_format: str = "", sf=None, *, out=None):
    """Combine fused rows back to tokens (§2.8): ``out[t] = sf * sum_k fma-chain(x[p_k], w_k * x_sf[p_k])``.

    Per element: acc = +0; for each slot k with p >= 0: acc = fma(float(x[p]), s_k, acc); then times
    ``sf[0]``; converted with RNE to x's dtype, or to e4m3 with saturation.
    """
    x, x_sf = x if isinstance(x, (tuple, list)) else (x, None)
    rows, num_topk = token_topk_to_pos.shape
    acc = torch.zeros(rows, x.size(1), dtype=torch.float32, device=x.device)
    pos = token_topk_to_pos.to(torch.int64)
    for k in range(num_topk if x.size(0) else 0):                       # N = 0: every slot is -1
        p = pos[:, k]
        taken = p >= 0
        p = p.clamp_min(0)
        scale = torch.ones(rows, dtype=torch.float32, device=x.device)
        if topk_weights is not None:
            scale = topk_weights[:, k].to(torch.float32)
        if x_sf is not None:
            scale = scale * x_sf[p]
        acc = torch.where(taken[:, None], fma_f32(x[p].to(torch.float32), scale[:, None], acc), acc)
    if sf is not None:
        acc = acc * sf.reshape(-1)[0]
    result = formats.e4m3_encode(acc) if fp8_format == "e4m3" else acc.to(x.dtype)
    if out is None:
        return result
    return out.copy_(result)


# ----------------------------------------------------------------------------------------------------
# Counting utilities (§2.9-§2.11)
# ----------------------------------------------------------------------------------------------------

def _count(values: torch.Tensor, num_bins: int) -> torch.Tensor:
    """int64 count of each value in [0, num_bins) over the whole tensor; other values are ignored."""
    flat = values.reshape(-1)
    inside = (flat >= 0) & (flat < num_bins)
    return torch.zeros(num_bins + 1, dtype=torch.int64, device=values.device).scatter_add_(
        0, torch.where(inside, flat, num_bins), torch.ones_like(flat))[:num_bins]


def aux_fi(topk_idx: torch.Tensor, num_experts: int, num_aux_topk: int) -> torch.Tensor:
    """Load fraction ``f_e = c_e * E / (T * num_aux_topk)`` in fp32; zeros for T = 0 (§2.9)."""
    rows = topk_idx.size(0)
    counts = _count(topk_idx, num_experts).to(torch.float32)
    if rows == 0:
        return counts
    # explicit fp32 tensors: a plain IEEE multiply and division (no reciprocal-of-scalar shortcut)
    scale = lambda v: torch.full_like(counts, float(v))  # noqa: E731
    return counts * scale(num_experts) / scale(rows * num_aux_topk)


def group_count(group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Number of entries equal to each g in [0, num_groups), int32 (§2.10)."""
    return _count(group_idx, num_groups).to(torch.int32)


def inplace_unique_group_indices(group_indices: torch.Tensor, num_groups: int) -> None:
    """Per row, overwrite repeated non-negative values with -1, keeping the first occurrence (§2.11).

    Negative values are never changed (the kernel's behaviour; upstream's reference also de-duplicates
    repeated values below -1).
    """
    if group_indices.numel() == 0:
        return None
    values, order = torch.sort(group_indices, dim=1, stable=True)
    repeat = torch.zeros_like(values, dtype=torch.bool)
    repeat[:, 1:] = (values[:, 1:] == values[:, :-1]) & (values[:, 1:] >= 0)
    duplicate = torch.zeros_like(repeat).scatter_(1, order, repeat)
    group_indices.masked_fill_(duplicate, -1)
    return None
