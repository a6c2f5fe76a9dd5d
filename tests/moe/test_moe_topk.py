"""topk_gate, topk_sum_and_topk_group_idx, normalize_weight and the fixed-order sums (moe.md §2.1, §2.3, §2.4)."""
import pytest
import torch

from tilefuse import moe
from tilefuse.reference import moe as ref

FP32 = torch.float32
F32_EPS = 1e-20  # the spec's epsilon, rounded to fp32 wherever it is used below


def f32(v) -> torch.Tensor:
    return torch.tensor(v, dtype=FP32)


def repeat_max_topk(row: list[float], k: int) -> list[int]:
    """§2.1's algorithm-level definition: k times take the max, output its smallest index, overwrite with -inf."""
    row = list(row)
    picked = []
    for _ in range(k):
        best = max(row)
        i = row.index(best)
        picked.append(i)
        row[i] = float("-inf")
    return picked


# ---------------------------------------------------------------------------------------------------- topk_gate

def test_topk_gate_hand_ties_and_signed_zero():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, -0.0, 5.0, 5.0]])
    assert moe.topk_gate(scores, 3).tolist() == [[1, 2, 3], [2, 3, 0]]
    assert moe.topk_gate(scores, 4).tolist() == [[1, 2, 3, 0], [2, 3, 0, 1]]


@pytest.mark.parametrize("experts,k,with_inf", [(72, 6, True), (33, 8, True), (16, 16, False)])
def test_topk_gate_matches_repeat_max_with_heavy_ties(experts, k, with_inf):
    scores = torch.randint(-3, 4, (40, experts)).to(FP32)
    if with_inf:   # -inf in every third column; at least k finite values remain (the definitions agree there)
        scores[:, ::3] = float("-inf")
    got = moe.topk_gate(scores, k)
    assert got.dtype == torch.int64 and got.is_contiguous() and got.shape == (40, k)
    assert got.tolist() == [repeat_max_topk(r, k) for r in scores.tolist()]


def test_topk_gate_cpu_dispatch_and_zero_tokens():
    scores = torch.randn(9, 32)
    assert torch.equal(moe.topk_gate(scores, 5), ref.stable_topk(scores, 5))
    assert moe.topk_gate(torch.empty(0, 32), 5).shape == (0, 5)


def test_topk_gate_errors():
    with pytest.raises(ValueError, match="num_topk"):
        moe.topk_gate(torch.randn(4, 8), 9)
    with pytest.raises(TypeError, match="scores"):
        moe.topk_gate(torch.randn(4, 8, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="scores"):
        moe.topk_gate(torch.randn(8, 4).t(), 2)


# ------------------------------------------------------------------------------ topk_sum_and_topk_group_idx

def test_group_idx_hand():
    scores = torch.tensor([[[1.0, 5.0, 2.0], [4.0, 4.0, 0.0], [6.0, 0.0, 0.0]]])
    assert moe.topk_sum_and_topk_group_idx(scores, 2, 2).tolist() == [[1, 0]]   # sums 7, 8, 6
    assert moe.topk_sum_and_topk_group_idx(scores, 1, 2).tolist() == [[2, 0]]   # maxima 5, 4, 6
    tied = torch.tensor([[[1.0, 1.0], [2.0, 0.0], [0.0, 1.0]]])                  # sums 2, 2, 1
    assert moe.topk_sum_and_topk_group_idx(tied, 2, 3).tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("groups,per_group,n_sum,n_groups", [(8, 32, 2, 4), (12, 6, 1, 4), (32, 2, 2, 5), (3, 32, 2, 2)])
def test_group_idx_matches_loop_with_ties(groups, per_group, n_sum, n_groups):
    scores = torch.randint(-4, 5, (30, groups, per_group)).to(FP32)
    got = moe.topk_sum_and_topk_group_idx(scores, n_sum, n_groups)
    expected = []
    for token in scores.tolist():
        sums = [sum(sorted(g, reverse=True)[:n_sum]) for g in token]            # integer-valued: exact
        expected.append(repeat_max_topk(sums, n_groups))
    assert got.tolist() == expected
    assert torch.equal(got, ref.topk_sum_and_topk_group_idx(scores, n_sum, n_groups))


def test_group_idx_zero_tokens_and_errors():
    assert moe.topk_sum_and_topk_group_idx(torch.empty(0, 4, 8), 2, 2).shape == (0, 2)
    with pytest.raises(ValueError, match="num_topk_sum"):
        moe.topk_sum_and_topk_group_idx(torch.randn(2, 4, 8), 3, 2)
    with pytest.raises(ValueError, match="num_topk_groups"):
        moe.topk_sum_and_topk_group_idx(torch.randn(2, 4, 8), 2, 5)
    with pytest.raises(ValueError, match="groups"):
        moe.topk_sum_and_topk_group_idx(torch.randn(2, 33, 2), 2, 2)


# ---------------------------------------------------------------------------------------- normalize_weight

def test_normalize_weight_hand():
    w = torch.tensor([[1.0, 2.0, 1.0], [0.0, 0.0, 0.0]])
    den, norm = moe.normalize_weight(w)
    assert den[0].item() == 4.0
    assert den[1].item() == f32(F32_EPS).item()                       # all-zero row: the epsilon alone
    assert norm.tolist() == [[0.25, 0.5, 0.25], [0.0, 0.0, 0.0]]


@pytest.mark.parametrize("k", [1, 2, 6, 9, 13])
def test_normalize_weight_sequential_order_bitwise(k):
    w = torch.rand(50, k) * torch.logspace(-6, 3, k)                  # magnitudes where the order shows
    den, norm = moe.normalize_weight(w)
    for t in range(w.size(0)):
        acc = f32(F32_EPS)
        for v in w[t]:
            acc = acc + v                                             # ((1e-20 + w0) + w1) + ... in fp32
        assert den[t].item() == acc.item()
        assert torch.equal(norm[t], w[t] / acc)
    assert torch.allclose(norm.sum(1), torch.ones(50), rtol=0, atol=k * 2.0 ** -23)   # rows sum to 1


def test_normalize_weight_cpu_dispatch_zero_tokens_errors():
    w = torch.rand(7, 6)
    for a, b in zip(moe.normalize_weight(w), ref.normalize_weight(w)):
        assert torch.equal(a, b)
    den, norm = moe.normalize_weight(torch.empty(0, 6))
    assert den.shape == (0,) and norm.shape == (0, 6)
    with pytest.raises(ValueError, match="topk_weights"):
        moe.normalize_weight(torch.rand(6))
    with pytest.raises(TypeError, match="topk_weights"):
        moe.normalize_weight(torch.rand(2, 6, dtype=torch.float64))


# --------------------------------------------------------------------------------------- fixed-order sums

def test_butterfly_sum32_order_k6():
    """§2.4 example: K = 6 sums as ((w0 + w4) + w2) + ((w1 + w5) + w3)."""
    w = torch.tensor([[1.0, 2.0 ** -24, 2.0 ** -24, 3.0 * 2.0 ** -25, -1.0, 2.0 ** -23]])
    w0, w1, w2, w3, w4, w5 = [f32(v) for v in w[0].tolist()]
    expected = ((w0 + w4) + w2) + ((w1 + w5) + w3)
    assert ref.butterfly_sum32(w)[0].item() == expected.item()
    assert expected.item() != ((((w0 + w1) + w2) + w3) + w4 + w5).item()   # the data does detect the order


def test_softmax_lane_order_matches_lane_loop():
    x = torch.randn(3, 264) * 4                                       # 3 chunks of 128, the last partial
    p = ref.softmax_lane_order(x)
    z = torch.exp(x - x.max(1, keepdim=True).values)
    for t in range(3):
        lanes = []
        for lane in range(32):
            acc = f32(0.0)
            for c in range(3):
                for j in range(4):
                    e = c * 128 + 4 * lane + j
                    if e < 264:
                        acc = acc + z[t, e]
            lanes.append(acc)
        for o in (16, 8, 4, 2, 1):
            lanes = [lanes[i] + lanes[i ^ o] for i in range(32)]
        assert torch.equal(p[t], z[t] / lanes[0])
    assert torch.allclose(p, torch.softmax(x, 1), rtol=1e-6, atol=0)
