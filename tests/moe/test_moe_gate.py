"""Gates: v1 top2_sum_gate (moe.md §2.2), v2.1 moe_topk_gate_forward / _backward (§2.13, §2.14, §5.3)."""
import pytest
import torch
import torch.nn.functional as F

from tilefuse import moe
from tilefuse.reference import moe as ref

FP32, F64 = torch.float32, torch.float64
EPS = torch.tensor(1e-20, dtype=FP32)
STRIDE = 23333
# moe_topk_gate_backward returns fp32 of an fp64 computation: against fp64 autograd, one fp32 rounding each side.
BACKWARD_ATOL_REL = 2.0 ** -22


def f32(v) -> torch.Tensor:
    return torch.tensor(v, dtype=FP32)


def repeat_max(values: list[float], k: int) -> list[int]:
    values = list(values)
    out = []
    for _ in range(k):
        i = values.index(max(values))
        out.append(i)
        values[i] = float("-inf")
    return out


def replica(t: int, ep_rank: int, logical: int, pmap, count) -> int:
    """§2.13 step 9 with the kernel's int32 wrap of ep_rank + t * 23333, then floor modulo."""
    base = (ep_rank + t * STRIDE + 2**31) % 2**32 - 2**31
    d = base % count[logical]
    return pmap[logical][d] if d < len(pmap[logical]) else 0


def scores_of(logits, scoring):
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return ref.softmax_lane_order(logits)                                 # checked lane by lane in test_moe_topk


# -------------------------------------------------------------------------------------------- v1 oracle

def gate_v1_loop(logits, bias, k, n_topk_groups, n_groups, s_shared, rsf, ep_rank, n_ep, tp_rank, n_tp, scoring,
                 mask=None, fix=None, unmapped=None, pmap=None, count=None):
    """moe.md §2.2 per-token steps written as a scalar loop (fp32 0-dim tensors for every rounding)."""
    rows, experts = logits.shape
    s = scores_of(logits, scoring)
    ranking_src = logits if scoring == "softmax" else s
    n_extra = 0 if pmap is None else pmap.size(1) - 1
    p = (experts + n_extra) // n_ep
    pm, cnt = (None, None) if pmap is None else (pmap.tolist(), count.tolist())
    out_idx, out_w, out_unmapped = [], [], []
    for t in range(rows):
        if mask is not None and not mask[t]:
            out_idx.append([-1] * (k + s_shared)), out_w.append([0.0] * (k + s_shared)), out_unmapped.append([-1] * k)
            continue
        r = [ranking_src[t, e] + bias[e] for e in range(experts)]
        if fix is not None and fix[t]:
            routed = unmapped[t].tolist()
        else:
            allowed = set(range(experts))
            if n_groups != n_topk_groups:
                per = experts // n_groups
                sums = []
                for g in range(n_groups):
                    top = sorted(r[g * per:(g + 1) * per], key=lambda v: v.item(), reverse=True)
                    sums.append((top[0] + top[1]).item())
                kept = repeat_max(sums, n_topk_groups)
                allowed = {g * per + j for g in kept for j in range(per)}
            routed = repeat_max([r[e].item() if e in allowed else float("-inf") for e in range(experts)], k)
        den = EPS
        for j in routed:
            den = den + s[t, j]
        weights = [((s[t, j] / den) * f32(rsf)).item() for j in routed] + [1.0] * s_shared
        ids = []
        for logical in routed + [experts + i for i in range(s_shared)]:
            v = logical if pm is None else replica(t, ep_rank, logical, pm, cnt)
            ids.append((v // p // n_tp) * p + v % p if (v // p) % n_tp == tp_rank else -1)   # §1.2, second form
        out_idx.append(ids), out_w.append(weights), out_unmapped.append(routed)
    return torch.tensor(out_idx), torch.tensor(out_w, dtype=FP32), torch.tensor(out_unmapped)


# ---------------------------------------------------------------------------------------- top2_sum_gate

def test_top2_all_zero_ties_pick_smallest_indices():
    logits, bias = torch.zeros(3, 8), torch.zeros(8)
    mask = torch.tensor([True, False, True])
    idx, w = moe.top2_sum_gate(logits, bias, 4, 0, 0, False, 0, 2.0, 0, 1, 0, 1, "sigmoid", mask)
    assert idx.tolist() == [[0, 1, 2, 3], [-1] * 4, [0, 1, 2, 3]]
    assert w.tolist() == [[0.5] * 4, [0.0] * 4, [0.5] * 4]               # 0.5 / (1e-20 + 4 * 0.5) * 2


def test_top2_hand_shared_replicas_ep_tp():
    # E_r = 4, K = 2, S = 2; 6 physical experts (2 extra) on 2 EP ranks (P = 3) and 2 TP ranks; TP rank 1 keeps
    # physical 3, 4, 5 as 0, 1, 2. Replica d = (0 + t * 23333) mod count: 0 for t = 0, 1 for t = 1 when count = 2.
    pmap = torch.tensor([[0, 3, 0], [1, 0, 0], [2, 5, 0], [3, 0, 0], [4, 0, 0], [5, 1, 0]], dtype=torch.int32)
    count = torch.tensor([2, 1, 2, 1, 1, 2], dtype=torch.int32)
    logits = torch.tensor([[2.0, -1.0, -2.0, 3.0], [0.0, 1.0, 3.0, -3.0]])
    unmapped = torch.full((2, 2), 99)
    idx, w = moe.top2_sum_gate(logits, torch.zeros(4), 2, 0, 0, True, 2, 1.5, 0, 2, 1, 2, "sigmoid",
                               to_physical_map=pmap, logical_count=count, unmapped_topk_idx=unmapped)
    assert unmapped.tolist() == [[3, 0], [2, 1]]
    # token 0: physical [3, 0, 4, 5] -> [0, -1, 1, 2]; token 1: physical [5, 1, 4, 1] -> [2, -1, 1, -1]
    assert idx.tolist() == [[0, -1, 1, 2], [2, -1, 1, -1]]
    s = torch.sigmoid(logits)
    for t, (a, b) in enumerate([(3, 0), (2, 1)]):
        den = (EPS + s[t, a]) + s[t, b]
        assert w[t].tolist() == [((s[t, a] / den) * 1.5).item(), ((s[t, b] / den) * 1.5).item(), 1.0, 1.0]


def test_top2_fixed_routing_keeps_duplicates():
    logits = torch.randn(2, 8)
    fix = torch.tensor([True, False])
    unmapped = torch.tensor([[1, 1, 6], [0, 0, 0]])
    idx, w = moe.top2_sum_gate(logits, torch.zeros(8), 3, 0, 0, False, 0, 1.0, 0, 1, 0, 1, "sqrtsoftplus",
                               fix_routing_mask=fix, unmapped_topk_idx=unmapped)
    assert idx[0].tolist() == [1, 1, 6] and w[0, 0] == w[0, 1]
    s = F.softplus(logits[1]).sqrt()
    assert idx[1].tolist() == repeat_max(s.tolist(), 3) == unmapped[1].tolist()


def test_top2_group_limited_hand():
    # 4 groups of 2, keep 2 groups by top1 + top2 of the biased ranking (raw logits for softmax):
    # group sums 1+0, 5+(-4), 2+2, 3+(-9) = 1, 1, 4, -6 -> groups 2 and 0 (tie 1 vs 1 -> group 0), then top-2.
    logits = torch.tensor([[1.0, 0.0, 5.0, -4.0, 2.0, 2.0, 3.0, -9.0]])
    idx, w = moe.top2_sum_gate(logits, torch.zeros(8), 3, 2, 4, False, 0, 1.0, 0, 1, 0, 1, "softmax")
    assert idx.tolist() == [[4, 5, 0]]                                   # expert 2 (logit 5) is in a dropped group
    e = torch.exp(torch.tensor([2.0, 2.0, 1.0], dtype=F64))
    assert torch.allclose(w[0].double(), e / e.sum(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("scoring", ["sigmoid", "sqrtsoftplus", "softmax"])
@pytest.mark.parametrize("groups", [(0, 0), (4, 4), (4, 2)])
def test_top2_matches_loop(scoring, groups):
    n_groups, n_topk_groups = groups
    rows, experts, k, s_shared = 10, 16, 4, 2
    logits, bias = torch.randn(rows, experts), torch.randn(experts)
    mask = torch.rand(rows) > 0.2
    logits[~mask] = float("nan")                                         # masked tokens are never checked
    fix = torch.rand(rows) > 0.7
    unmapped = torch.randint(0, experts, (rows, k))
    given = unmapped.clone()
    pmap = torch.randint(0, experts + 2, (experts + s_shared, 3), dtype=torch.int32)
    count = torch.randint(1, 4, (experts + s_shared,), dtype=torch.int32)
    args = (k, n_topk_groups, n_groups, True, s_shared, 1.5, 3, 3, 1, 3, scoring)
    idx, w = moe.top2_sum_gate(logits, bias, *args, mask, fix, pmap, count, unmapped)
    want_idx, want_w, want_unmapped = gate_v1_loop(logits, bias, k, n_topk_groups, n_groups, s_shared, 1.5, 3, 3, 1, 3,
                                                   scoring, mask, fix, given, pmap, count)
    assert torch.equal(idx, want_idx) and torch.equal(unmapped, want_unmapped)
    assert torch.equal(w, want_w)                                        # same fp32 operations in the same order
    ref_idx, ref_w = ref.top2_sum_gate(logits, bias, *args, mask, fix, pmap, count, given.clone())
    assert torch.equal(idx, ref_idx) and torch.equal(w, ref_w)           # CPU dispatch


def test_top2_zero_tokens_and_errors():
    idx, w = moe.top2_sum_gate(torch.empty(0, 8), torch.zeros(8), 2, 0, 0, False, 0, 1.0, 0, 1, 0, 1, "sigmoid")
    assert idx.shape == w.shape == (0, 2) and idx.dtype == torch.int64 and w.dtype == FP32
    logits, bias = torch.randn(4, 8), torch.zeros(8)
    base = dict(num_topk=2, num_topk_groups=0, num_groups=0, use_shared_as_routed=False, num_shared_experts=0,
                routed_scaling_factor=1.0, ep_rank=0, num_ep_ranks=1, tp_rank=0, num_tp_ranks=1, scoring_func="sigmoid")
    cases = [(dict(num_topk=9), "num_topk"), (dict(scoring_func="identity"), "scoring_func"),
             (dict(scoring_func="cosine"), "scoring_func"), (dict(num_groups=4), "both be 0 or both > 0"),
             (dict(num_groups=4, num_topk_groups=1, num_topk=3), "num_topk"),
             (dict(num_groups=8, num_topk_groups=4), "2 to 32 experts per group"),   # one expert a group: no top-2
             (dict(use_shared_as_routed=True, num_shared_experts=2), "to_physical_map"),
             (dict(use_shared_as_routed=True, num_shared_experts=3), "num_shared_experts"),
             (dict(tp_rank=1), "tp_rank")]
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            moe.top2_sum_gate(logits, bias, **{**base, **change})
    with pytest.raises(ValueError, match="bias"):
        moe.top2_sum_gate(logits, torch.zeros(7), **base)
    for bad_name in ("cosine", "identity", "Identity"):      # the error lists every valid name and the given one
        with pytest.raises(ValueError) as err:
            moe.top2_sum_gate(logits, bias, **{**base, "scoring_func": bad_name})
        assert str(err.value) == ("top2_sum_gate: scoring_func must be one of 'sigmoid', 'sqrtsoftplus', 'softmax' "
                                  f"(any case), got {bad_name!r}")
    with pytest.raises(TypeError, match="scoring_func must be a str, got int"):
        moe.top2_sum_gate(logits, bias, **{**base, "scoring_func": 1})
    got = moe.top2_sum_gate(logits, bias, **{**base, "scoring_func": "SoftMax"})       # any case, as v1's labels
    want = moe.top2_sum_gate(logits, bias, **{**base, "scoring_func": "softmax"})
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="mask"):
        moe.top2_sum_gate(logits, bias, **base, mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="unmapped_topk_idx"):
        moe.top2_sum_gate(logits, bias, **base, fix_routing_mask=torch.ones(4, dtype=torch.bool))
    bad = logits.clone()
    bad[1, 3] = float("inf")
    with pytest.raises(RuntimeError, match="logits"):
        moe.top2_sum_gate(bad, bias, **base)
    unmapped = torch.tensor([[0, 1], [-1, 2], [0, 1], [0, 1]])
    with pytest.raises(RuntimeError, match="unmapped_topk_idx"):
        moe.top2_sum_gate(logits, bias, **base, fix_routing_mask=torch.ones(4, dtype=torch.bool),
                          unmapped_topk_idx=unmapped)
    assert unmapped[1].tolist() == [-1, 2]                               # untouched when rejected


# -------------------------------------------------------------------------------------------- v2 oracle

def gate_v2_loop(logits, k, s_shared, rsf, ep_rank, mask=None, bias=None, image_bias=None, image_mask=None,
                 fix=None, unmapped=None, pmap=None, count=None):
    """moe.md §2.13 (routed and masked tokens) as a scalar loop with the 32-lane butterfly written out."""
    rows, experts = logits.shape
    u = F.softplus(logits).sqrt()
    pm, cnt = (None, None) if pmap is None else (pmap.tolist(), count.tolist())
    out_idx, out_w = [], []
    for t in range(rows):
        if mask is not None and not mask[t]:
            out_idx.append([-1] * (k + s_shared)), out_w.append([0.0] * (k + s_shared))
            continue
        b = image_bias if image_mask is not None and image_mask[t] else (bias if bias is not None else torch.zeros(experts))
        routed = unmapped[t].tolist() if fix is not None and fix[t] else repeat_max((u[t] + b).tolist(), k)
        lanes = [u[t, j] for j in routed] + [f32(0.0)] * (32 - k)
        for o in (16, 8, 4, 2, 1):
            lanes = [lanes[i] + lanes[i ^ o] for i in range(32)]
        den = lanes[0] + EPS
        out_w.append([((u[t, j] / den) * f32(rsf)).item() for j in routed] + [1.0] * s_shared)
        logical = routed + [experts + i for i in range(s_shared)]
        out_idx.append(logical if pm is None else [replica(t, ep_rank, l, pm, cnt) for l in logical])
    return torch.tensor(out_idx), torch.tensor(out_w, dtype=FP32)


# -------------------------------------------------------------------------------------- moe_topk_gate_forward

def test_forward_hand_bias_image_bias_mask():
    logits = torch.zeros(3, 4)                                           # equal scores: the bias decides
    bias, image_bias = torch.tensor([0.0, 1.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 0.0, 1.0])
    image = torch.tensor([False, True, True])
    mask = torch.tensor([True, True, False])
    scores = torch.full((3, 4), float("nan"))
    unmapped = torch.full((3, 1), 7)
    idx, w = moe.moe_topk_gate_forward(logits, 1, True, 1, 2.0, 0, "sqrtsoftplus", mask, bias, image_bias, image,
                                       unmapped_topk_idx=unmapped, scores=scores)
    assert idx.tolist() == [[1, 4], [3, 4], [-1, -1]] and unmapped.tolist() == [[1], [3], [-1]]
    assert w.tolist() == [[2.0, 1.0], [2.0, 1.0], [0.0, 0.0]]            # u / (u + 1e-20) * 2 = 2 exactly
    u0 = F.softplus(torch.tensor(0.0)).sqrt().item()
    assert scores.tolist() == [[u0] * 4, [u0] * 4, [0.0] * 4]


@pytest.mark.parametrize("k,s_shared", [(1, 0), (6, 2), (8, 1)])
def test_forward_matches_loop(k, s_shared):
    rows, experts = 12, 32
    logits = 2 * torch.randn(rows, experts)
    bias, image_bias = torch.randn(experts) * 0.1, torch.randn(experts) * 0.1
    image, mask, fix = torch.rand(rows) > 0.5, torch.rand(rows) > 0.2, torch.rand(rows) > 0.7
    unmapped = torch.randint(0, experts, (rows, k))
    given = unmapped.clone()
    pmap = torch.randint(0, 50, (experts + s_shared, 3), dtype=torch.int32)
    count = torch.randint(1, 5, (experts + s_shared,), dtype=torch.int32)   # count 4 > 3 columns: guarded to 0
    out = (torch.empty(rows, k + s_shared, dtype=torch.int64), torch.empty(rows, k + s_shared))
    idx, w = moe.moe_topk_gate(logits, k, s_shared > 0, s_shared, 1.5, 3, "sqrtsoftplus", mask, bias, image_bias,
                               image, fix, pmap, count, unmapped, out=out)
    assert idx is out[0] and w is out[1]
    want_idx, want_w = gate_v2_loop(logits, k, s_shared, 1.5, 3, mask, bias, image_bias, image, fix, given, pmap, count)
    assert torch.equal(idx, want_idx) and torch.equal(w, want_w)
    want_unmapped = torch.where(mask[:, None], torch.where(fix[:, None], given, ref.stable_topk(
        F.softplus(logits).sqrt() + torch.where(image[:, None], image_bias, bias), k)), -1)
    assert torch.equal(unmapped, want_unmapped)


def test_replica_choice_wraps_in_int32():
    """§2.13 step 9: ep_rank + t * 23333 wraps in int32; rows t >= 92037 differ from int64 arithmetic (ep_rank 5)."""
    rows = 92040
    pmap = torch.tensor([[10, 11, 12]], dtype=torch.int32)
    got = ref.to_physical(torch.zeros(rows, 1, dtype=torch.int64), 5, pmap, torch.tensor([3], dtype=torch.int32))
    tail = range(rows - 6, rows)
    assert [got[t, 0].item() for t in tail] == [replica(t, 5, 0, [[10, 11, 12]], [3]) for t in tail]
    assert [got[t, 0].item() for t in tail] != [10 + (5 + t * STRIDE) % 3 for t in tail]
    assert got[92036, 0].item() == 10 + (5 + 92036 * STRIDE) % 3


# ------------------------------------------------------------------------------------------ random routing

def test_philox_known_answers():
    """Philox4x32-10 known-answer vectors (Random123 kat_vectors)."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in cases:
        got = ref.philox4x32_10([torch.tensor(c) for c in counter], [torch.tensor(k) for k in key])
        assert tuple(int(g) for g in got) == want


def test_force_random_spec_example():
    """moe.md §3.2: E_r = 64, K = 6, S = 0, ep_rank = 0, token 0."""
    idx, w = moe.moe_topk_gate_forward(torch.randn(1, 64), 6, False, 0, 1.0, 0,
                                       force_random=torch.tensor([True]))
    assert idx.tolist() == [[13, 20, 57, 53, 7, 18]]
    assert torch.allclose(w, torch.tensor([[0.399046, 0.516679, 0.024930, 0.940079, 0.945854, 0.796731]]),
                          rtol=0, atol=1e-6)


def test_force_random_properties():
    rows, experts, k = 300, 16, 6
    logits = torch.randn(rows, experts)
    rand = torch.rand(rows) > 0.3
    logits[rand & (torch.rand(rows) > 0.5)] = float("nan")              # random tokens are not checked
    mask = torch.ones(rows, dtype=torch.bool)
    mask[0] = False
    rand[0] = True                                                       # masked beats random
    pmap = torch.zeros(experts + 2, 3, dtype=torch.int32)
    count = torch.randint(1, 4, (experts + 2,), dtype=torch.int32)
    unmapped, scores = torch.zeros(rows, k, dtype=torch.int64), torch.zeros(rows, experts)
    run = lambda s, ep: moe.moe_topk_gate_forward(logits, k, s > 0, s, 1.0, ep, "sqrtsoftplus", mask,  # noqa: E731
                                                  to_physical_map=pmap[:experts + s], logical_count=count[:experts + s],
                                                  force_random=rand,
                                                  unmapped_topk_idx=unmapped, scores=scores)
    idx, w = run(2, 3)
    assert idx[0].tolist() == [-1] * (k + 2) and w[0].eq(0).all()
    live = rand & mask
    picked = idx[live]
    n_phys = int(count.sum())
    assert ((picked >= 0) & (picked < n_phys)).all()
    assert all(len(set(r)) == k + 2 for r in picked.tolist())           # distinct physical ids
    assert ((w[live] > 0) & (w[live] <= 1)).all() and w[live].std() > 0.2
    assert (unmapped[rand] == -1).all() and (scores[rand] == 0).all() and (scores[~rand] != 0).all()
    idx_again, w_again = run(2, 3)
    assert torch.equal(idx, idx_again) and torch.equal(w, w_again)      # deterministic in (ep_rank, t, lane)
    _, w_no_shared = run(0, 3)
    assert torch.equal(w_no_shared[live][:, :k], w[live][:, :k])        # lane l's uniform does not depend on S
    idx_other, _ = run(2, 4)
    assert not torch.equal(idx_other[live], idx[live])                  # ep_rank seeds the generator


def test_forward_zero_tokens_and_errors():
    idx, w = moe.moe_topk_gate_forward(torch.empty(0, 8), 2, True, 2, 1.0, 0)
    assert idx.shape == w.shape == (0, 4)
    logits = torch.randn(4, 8)
    with pytest.raises(ValueError, match="scoring_func"):
        moe.moe_topk_gate_forward(logits, 2, False, 0, 1.0, 0, "sigmoid")
    with pytest.raises(ValueError, match="image_token_mask"):
        moe.moe_topk_gate_forward(logits, 2, False, 0, 1.0, 0, image_bias=torch.zeros(8))
    with pytest.raises(ValueError, match="out"):
        moe.moe_topk_gate_forward(logits, 2, False, 0, 1.0, 0, out=(torch.empty(4, 3, dtype=torch.int64),
                                                                    torch.empty(4, 3)))
    with pytest.raises(ValueError, match="num_topk"):
        moe.moe_topk_gate_forward(torch.randn(4, 32), 31, True, 2, 1.0, 0)   # K + S = 33 > 32
    with pytest.raises(ValueError, match="logical_count"):
        moe.moe_topk_gate_forward(logits, 2, False, 0, 1.0, 0, to_physical_map=torch.zeros(8, 1, dtype=torch.int32))
    bad = logits.clone()
    bad[2, 0] = float("nan")
    with pytest.raises(RuntimeError, match="logits"):
        moe.moe_topk_gate_forward(bad, 2, False, 0, 1.0, 0)
    moe.moe_topk_gate_forward(bad, 2, False, 0, 1.0, 0, mask=torch.tensor([True, True, False, True]))   # masked: fine


# ------------------------------------------------------------------------------------- moe_topk_gate_backward

def test_backward_equals_fp64_autograd_of_forward():
    rows, experts, k, rho, seqs = 8, 16, 4, 1.5, 2
    logits = (2 * torch.randn(rows, experts, dtype=F64)).requires_grad_()
    mask = torch.tensor([True] * 5 + [False] + [True] * 2)
    fix = torch.zeros(rows, dtype=torch.bool)
    fix[2] = True
    unmapped = torch.randint(0, experts, (rows, k))
    unmapped[2] = torch.tensor([5, 5, 5, 1])                             # duplicates accumulate
    idx, w = ref.moe_topk_gate_forward(logits, k, False, 0, rho, 0, "sqrtsoftplus", mask,
                                       fix_routing_mask=fix, unmapped_topk_idx=unmapped)
    g, h = torch.randn(rows, k, dtype=F64), torch.randn(seqs, experts, dtype=F64)
    u = F.softplus(logits).sqrt()
    per_seq = torch.arange(rows) // (rows // seqs)
    aux = torch.where(mask, (h[per_seq] * u).sum(1) / u.sum(1), 0.0)
    ((g * w).sum() + aux.sum()).backward()
    scores = torch.where(mask[:, None], u, 0.0).detach()
    got = ref.moe_topk_gate_backward(scores, unmapped, w.detach(), g, rho, "sqrtsoftplus", mask, h)
    want = logits.grad.to(FP32)
    assert (got[5] == 0).all() and torch.isfinite(got).all()
    assert torch.allclose(got, want, rtol=0, atol=BACKWARD_ATOL_REL * want.abs().max().item())


def test_backward_invalid_slot_is_skipped_and_cpu_dispatch():
    rows, experts, k = 6, 8, 3
    logits = torch.randn(rows, experts)
    scores = F.softplus(logits).sqrt()
    idx = torch.stack([torch.randperm(experts)[:k] for _ in range(rows)])
    w, g = torch.rand(rows, k), torch.randn(rows, k)
    with_invalid = idx.clone()
    with_invalid[:, 2] = -1
    got = moe.moe_topk_gate_backward(scores, with_invalid, w, g, 1.0)
    assert torch.equal(got, ref.moe_topk_gate_backward(scores, with_invalid, w, g, 1.0))
    w_two = w.clone()
    w_two[:, 2] = 0                                                      # its g is ignored; its w only meets g = 0
    assert torch.allclose(got, moe.moe_topk_gate_backward(scores, idx[:, :2].contiguous(), w_two[:, :2].contiguous(),
                                                          g[:, :2].contiguous(), 1.0), rtol=1e-6, atol=1e-7)
    out = torch.full((rows, experts), float("nan"))
    assert moe.moe_topk_gate_backward(scores, idx, w, g, 1.0, out=out) is out and torch.isfinite(out).all()


def test_backward_zero_tokens_and_errors():
    empty = moe.moe_topk_gate_backward(torch.empty(0, 8), torch.empty(0, 2, dtype=torch.int64), torch.empty(0, 2),
                                       torch.empty(0, 2), 1.0)
    assert empty.shape == (0, 8)
    scores, idx, w = torch.rand(4, 8), torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2)
    with pytest.raises(ValueError, match="grad_scores_sum"):
        moe.moe_topk_gate_backward(scores, idx, w, w, 1.0, mask=torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="grad_scores_sum"):
        moe.moe_topk_gate_backward(scores, idx, w, w, 1.0, "sqrtsoftplus", torch.ones(4, dtype=torch.bool),
                                   torch.zeros(3, 8))                    # 3 sequences do not divide 4 tokens
    with pytest.raises(TypeError, match="topk_idx"):
        moe.moe_topk_gate_backward(scores, idx.int(), w, w, 1.0)
    with pytest.raises(ValueError, match="grad_topk_weights"):
        moe.moe_topk_gate_backward(scores, idx, w, torch.rand(4, 3), 1.0)
    with pytest.raises(RuntimeError, match="topk_idx"):
        moe.moe_topk_gate_backward(scores, idx + 8, w, w, 1.0)
