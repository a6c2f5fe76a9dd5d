"""aux_fi, group_count, inplace_unique_group_indices and mask_indices_by_tp (moe.md §1.2, §2.9-§2.12)."""
from collections import Counter

import pytest
import torch

from tilefuse import moe
from tilefuse.reference import moe as ref


def receive_side_topk_idx(rows: int, k: int, local: int, ranks: int) -> torch.Tensor:
    """EP receive-side indices as moe.md §4.1: top-k over all experts, non-local ones -1, all-(-1) rows dropped."""
    idx = torch.rand(rows * ranks, local * ranks).topk(k, dim=1, sorted=False).indices
    idx = torch.where(idx < local, idx, -1)
    return idx[(idx >= 0).any(1)].contiguous()


# ------------------------------------------------------------------------------------------------- aux_fi

def test_aux_fi_hand():
    idx = torch.tensor([[0, 1], [1, -1]])
    assert moe.aux_fi(idx, 3, 2).tolist() == [0.75, 1.5, 0.0]             # c * 3 / (2 rows * 2)
    assert moe.aux_fi(idx, 3, 1).tolist() == [1.5, 3.0, 0.0]


def test_aux_fi_matches_counts_and_zero_tokens():
    idx = receive_side_topk_idx(50, 6, 9, 8)
    rows = idx.size(0)
    got = moe.aux_fi(idx, 9, 6)
    counts = Counter(v for v in idx.flatten().tolist() if v >= 0)
    for e in range(9):
        want = torch.tensor(counts[e], dtype=torch.float32) * 9 / torch.tensor(rows * 6, dtype=torch.float32)
        assert got[e].item() == want.item()
    assert torch.equal(got, ref.aux_fi(idx, 9, 6))
    assert got.sum().item() == pytest.approx(9 * (idx >= 0).sum().item() / (rows * 6), rel=1e-6)
    empty = moe.aux_fi(torch.empty(0, 6, dtype=torch.int64), 9, 6)
    assert empty.dtype == torch.float32 and empty.tolist() == [0.0] * 9


def test_aux_fi_errors():
    with pytest.raises(TypeError, match="topk_idx"):
        moe.aux_fi(torch.zeros(2, 2, dtype=torch.int32), 4, 2)
    with pytest.raises(ValueError, match="num_aux_topk"):
        moe.aux_fi(torch.zeros(2, 2, dtype=torch.int64), 4, 0)
    with pytest.raises(RuntimeError, match="topk_idx"):
        moe.aux_fi(torch.tensor([[0, 4]]), 4, 2)                         # data: index out of range
    with pytest.raises(RuntimeError, match="topk_idx"):
        moe.aux_fi(torch.tensor([[0, -2]]), 4, 2)


# --------------------------------------------------------------------------------------------- group_count

def test_group_count_hand_and_loop():
    assert moe.group_count(torch.tensor([[2, 2, -1], [0, 2, -1]]), 4).tolist() == [1, 0, 3, 0]
    idx = receive_side_topk_idx(40, 8, 32, 8)
    got = moe.group_count(idx, 32)
    counts = Counter(idx.flatten().tolist())
    assert got.dtype == torch.int32 and got.tolist() == [counts[g] for g in range(32)]
    assert torch.equal(got, ref.group_count(idx, 32))
    assert moe.group_count(torch.empty(0, 8, dtype=torch.int64), 5).tolist() == [0] * 5


def test_group_count_errors():
    with pytest.raises(ValueError, match="group_idx"):
        moe.group_count(torch.zeros(4, dtype=torch.int64), 4)
    with pytest.raises(RuntimeError, match="group_idx"):
        moe.group_count(torch.tensor([[1, 4]]), 4)


# ----------------------------------------------------------------------------- inplace_unique_group_indices

def unique_loop(row: list[int]) -> list[int]:
    seen, out = set(), []
    for v in row:
        out.append(-1 if v >= 0 and v in seen else v)
        if v >= 0:
            seen.add(v)
    return out


def test_unique_spec_example_keeps_negative_values():
    g = torch.tensor([[3, 3, -1, -1, -2, -2, 70, 70]])
    assert moe.inplace_unique_group_indices(g, 72) is None
    assert g.tolist() == [[3, -1, -1, -1, -2, -2, 70, -1]]               # the kernel's result (moe.md §3.2)


@pytest.mark.parametrize("num_groups", [8, 16, 72])
def test_unique_matches_loop(num_groups):
    idx = receive_side_topk_idx(40, 8, 32, 8)                             # 256 experts -> groups of 256 / G
    g = torch.div(idx, 256 // num_groups, rounding_mode="floor").contiguous()
    expected = [unique_loop(r) for r in g.tolist()]
    original = g.clone()
    moe.inplace_unique_group_indices(g, num_groups)
    assert g.tolist() == expected
    assert not torch.equal(g, original)                                  # the data does have duplicates
    in_range = torch.tensor([[64, 64, 127, 5, 127]])                     # [num_groups, align(., 64)) de-duplicated too
    moe.inplace_unique_group_indices(in_range, 72)
    assert in_range.tolist() == [[64, -1, 127, 5, -1]]


def test_unique_zero_tokens_and_errors():
    empty = torch.empty(0, 4, dtype=torch.int64)
    moe.inplace_unique_group_indices(empty, 8)
    with pytest.raises(ValueError, match="num_groups"):
        moe.inplace_unique_group_indices(torch.zeros(2, 2, dtype=torch.int64), 129)
    g = torch.tensor([[1, 1, 64]])
    with pytest.raises(RuntimeError, match="group_indices"):
        moe.inplace_unique_group_indices(g, 8)                            # 64 >= align(8, 64)
    assert g.tolist() == [[1, 1, 64]]                                     # untouched on error


# -------------------------------------------------------------------------------------- mask_indices_by_tp

def test_mask_indices_by_tp_hand():
    # n = 8 experts over 4 EP ranks (P = 2) and 2 TP ranks; TP rank 1 owns EP ranks 1 and 3 (and 5 for v >= n).
    v = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, -1, 9, 11, -5]])
    got = moe.mask_indices_by_tp(v, 8, 4, 1, 2)
    assert got.tolist() == [[-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 5, -1]]
    assert moe.mask_indices_by_tp(v, 8, 4, 0, 2).tolist() == [[0, 1, -1, -1, 2, 3, -1, -1, -1, 5, -1, -1]]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("num_tp_ranks", [1, 2, 4, 8])
def test_mask_indices_by_tp_equivalent_formula(dtype, num_tp_ranks):
    n, ranks = 256, 8
    p = n // ranks
    v = torch.randint(-1, n + 40, (30, 6), dtype=dtype)
    for tp_rank in range(num_tp_ranks):
        got = moe.mask_indices_by_tp(v, n, ranks, tp_rank, num_tp_ranks)
        assert got.dtype == dtype
        expected = [[(x // p // num_tp_ranks) * p + x % p if x >= 0 and (x // p) % num_tp_ranks == tp_rank else -1
                     for x in row] for row in v.tolist()]                  # §2.12's second formulation
        assert got.tolist() == expected
        assert torch.equal(got, ref.mask_indices_by_tp(v, n, ranks, tp_rank, num_tp_ranks))
    assert moe.mask_indices_by_tp(torch.empty(0, 6, dtype=dtype), n, ranks, 0, num_tp_ranks).shape == (0, 6)


def test_mask_indices_by_tp_errors():
    v = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="tp_rank"):
        moe.mask_indices_by_tp(v, 8, 4, 2, 2)
    with pytest.raises(TypeError, match="indices"):
        moe.mask_indices_by_tp(v.float(), 8, 4, 0, 2)
    with pytest.raises(ValueError, match="n"):
        moe.mask_indices_by_tp(v, 2, 4, 0, 2)
