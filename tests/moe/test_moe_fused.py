"""get_fused_mapping, expand_to_fused(_with_sf) and reduce_fused (moe.md §1.5, §2.5-§2.8)."""
from fractions import Fraction

import pytest
import torch

from tilefuse import formats, moe
from tilefuse.reference import moe as ref

FP32 = torch.float32


def receive_side_topk_idx(rows: int, k: int, local: int, ranks: int) -> torch.Tensor:
    """EP receive-side indices as moe.md §4.1: top-k over all experts, non-local ones -1, all-(-1) rows dropped."""
    idx = torch.rand(rows * ranks, local * ranks).topk(k, dim=1, sorted=False).indices
    idx = torch.where(idx < local, idx, -1)
    return idx[(idx >= 0).any(1)].contiguous()


def check_layout(topk_idx, num_experts, alignment, maps, size):
    """The structural contract of moe.md §3.1 (plus: every routed slot exactly once)."""
    pte, ptt, pttk, ttp, start, end, per_expert, _ = maps
    rows, k = topk_idx.shape
    for t in (pte, ptt, pttk, ttp, start, end, per_expert):
        assert t.dtype == torch.int32
    assert pte.shape == ptt.shape == pttk.shape == (size,) and ttp.shape == (rows, k)
    values = topk_idx.flatten().tolist()
    running = 0
    for e in range(num_experts):
        count = values.count(e)
        aligned = -(-count // alignment) * alignment
        assert (start[e].item(), end[e].item(), per_expert[e].item()) == (running, running + aligned, aligned)
        assert start[e].item() % alignment == 0
        segment = pte[running:running + aligned].tolist()
        assert segment == [e] * count + [-1] * (aligned - count)        # real rows first, then padding
        running += aligned
    assert (pte[running:] == -1).all()
    assert torch.equal(pte < 0, ptt < 0) and torch.equal(pte < 0, pttk < 0)
    seen = []
    for p in range(size):
        i = pttk[p].item()
        if i < 0:
            continue
        seen.append(i)
        assert ttp[i // k, i % k].item() == p and values[i] == pte[p].item() and ptt[p].item() == i // k
    assert sorted(seen) == [i for i, v in enumerate(values) if v >= 0]     # each routed slot exactly once
    assert all((ttp.flatten()[i].item() < 0) == (v < 0) for i, v in enumerate(values))


# -------------------------------------------------------------------------------------- get_fused_mapping

def test_fused_mapping_hand():
    topk_idx = torch.tensor([[0, 1], [1, -1], [0, 0]])
    pte, ptt, pttk, ttp, start, end, per_expert, sizes = moe.get_fused_mapping(topk_idx, 3, 0, 2)
    # expert 0 holds flat slots 0, 4, 5 (+1 padding row), expert 1 flat slots 1, 2, expert 2 nothing
    assert pte.tolist() == [0, 0, 0, -1, 1, 1]
    assert ptt.tolist() == [0, 2, 2, -1, 0, 1]
    assert pttk.tolist() == [0, 4, 5, -1, 1, 2]
    assert ttp.tolist() == [[0, 4], [5, -1], [1, 2]]
    assert (start.tolist(), end.tolist(), per_expert.tolist(), sizes) == ([0, 4, 6], [4, 6, 6], [4, 2, 0], [4, 2, 0])


def test_fused_mapping_given_size_and_force_no_sync():
    topk_idx = torch.tensor([[0, 1], [1, -1], [0, 0]])
    pte, ptt, pttk, ttp, *_, sizes = moe.get_fused_mapping(topk_idx, 3, 10, 2)
    assert pte.tolist() == [0, 0, 0, -1, 1, 1, -1, -1, -1, -1] and sizes == []
    assert ptt[6:].tolist() == [-1] * 4 and pttk[6:].tolist() == [-1] * 4
    maps = moe.get_fused_mapping(topk_idx, 3, 6, 2, True)
    assert maps[0].tolist() == [0, 0, 0, -1, 1, 1] and maps[7] == []
    unrouted = torch.full((3, 2), -1)
    maps = moe.get_fused_mapping(unrouted, 3, 0, 4, True)
    assert maps[0].shape == (0,) and maps[3].tolist() == [[-1, -1]] * 3 and maps[6].tolist() == [0, 0, 0]
    with pytest.raises(RuntimeError, match="num_expanded_tokens"):
        moe.get_fused_mapping(topk_idx, 3, 0, 2, True)                    # N = 0 but slots are routed
    with pytest.raises(RuntimeError, match="num_expanded_tokens"):
        moe.get_fused_mapping(topk_idx, 3, 5, 2)                          # 6 rows needed


@pytest.mark.parametrize("local,ranks,k", [(9, 8, 6), (32, 8, 8), (4, 64, 2), (1, 8, 2)])
@pytest.mark.parametrize("alignment", [1, 16, 64])
def test_fused_mapping_structure(local, ranks, k, alignment):
    topk_idx = receive_side_topk_idx(12, k, local, ranks)
    maps = moe.get_fused_mapping(topk_idx, local, 0, alignment)
    assert maps[7] == maps[6].tolist()
    check_layout(topk_idx, local, alignment, maps, sum(maps[7]))


@pytest.mark.parametrize("num_sms", [1, 7, 132])
def test_fused_mapping_upstream_order(num_sms):
    """With num_sms the positions follow moe.md §1.5's order model, written here as its counting formula."""
    topk_idx = receive_side_topk_idx(10, 6, 32, 8)
    experts, (rows, k) = 32, topk_idx.shape
    maps = moe.get_fused_mapping(topk_idx, experts, 0, 16, num_sms=num_sms)
    check_layout(topk_idx, experts, 16, maps, sum(maps[7]))
    workers = num_sms * 256 // 32
    per_worker = formats.align(formats.cdiv(rows * k, workers), 32)      # L = align(ceil(T*K / W), 32)
    values = topk_idx.flatten().tolist()
    worker = [i // per_worker for i in range(rows * k)]
    for i, e in enumerate(values):
        if e < 0:
            continue
        same = [j for j, v in enumerate(values) if v == e]
        want = maps[4][e].item() + sum(worker[j] < worker[i] for j in same) + \
            sum(worker[j] == worker[i] and j > i for j in same)
        assert maps[3].flatten()[i].item() == want
    assert num_sms == 132 or not torch.equal(maps[3], moe.get_fused_mapping(topk_idx, experts, 0, 16)[3])


def test_fused_mapping_zero_tokens_and_errors():
    pte, ptt, pttk, ttp, start, end, per_expert, sizes = moe.get_fused_mapping(torch.empty(0, 6, dtype=torch.int64),
                                                                               4, 0, 16)
    assert pte.shape == (0,) and ttp.shape == (0, 6) and sizes == [0] * 4
    assert start.tolist() == end.tolist() == per_expert.tolist() == [0] * 4
    with pytest.raises(TypeError, match="topk_idx"):
        moe.get_fused_mapping(torch.zeros(2, 2, dtype=torch.int32), 4, 0, 16)
    with pytest.raises(ValueError, match="num_experts"):
        moe.get_fused_mapping(torch.zeros(2, 2, dtype=torch.int64), 1025, 0, 16)
    with pytest.raises(ValueError, match="alignment"):
        moe.get_fused_mapping(torch.zeros(2, 2, dtype=torch.int64), 4, 0, 0)
    with pytest.raises(RuntimeError, match="topk_idx"):
        moe.get_fused_mapping(torch.tensor([[0, 4]]), 4, 0, 16)


# ---------------------------------------------------------------------------------------- expand_to_fused

def test_expand_hand():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    pte, _, _, ttp, *_ = moe.get_fused_mapping(torch.tensor([[0, 1], [1, -1], [0, 0]]), 3, 0, 2)
    out = moe.expand_to_fused(x, ttp, pte)
    assert out.tolist() == [[1, 2], [5, 6], [5, 6], [0, 0], [1, 2], [3, 4]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int32])
def test_expand_byte_copies_any_dtype(dtype):
    topk_idx = receive_side_topk_idx(8, 6, 9, 8)
    rows = topk_idx.size(0)
    x = torch.randint(-2**20, 2**20, (rows, 64), dtype=torch.int32).view(dtype)    # arbitrary bit patterns
    pte, _, _, ttp, *_ = moe.get_fused_mapping(topk_idx, 9, 0, 16)
    out = moe.expand_to_fused(x, ttp, pte)
    assert out.dtype == dtype and out.shape == (pte.numel(), x.size(1))
    raw_out, raw_x = out.view(torch.uint8), x.view(torch.uint8)
    for p, t in enumerate(ref.get_fused_mapping(topk_idx, 9, 0, 16)[1].tolist()):
        assert torch.equal(raw_out[p], raw_x[t] if t >= 0 else torch.zeros_like(raw_x[0]))
    assert torch.equal(raw_out, ref.expand_to_fused(x, ttp, pte).view(torch.uint8))


def test_expand_zero_tokens_and_errors():
    out = moe.expand_to_fused(torch.empty(0, 8), torch.empty(0, 2, dtype=torch.int32), torch.empty(0, dtype=torch.int32))
    assert out.shape == (0, 8)
    x, ttp, pte = torch.randn(2, 8), torch.tensor([[0, 1], [2, -1]], dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    with pytest.raises(TypeError, match="token_topk_to_pos"):
        moe.expand_to_fused(x, ttp.long(), pte)
    with pytest.raises(ValueError, match="token_topk_to_pos"):
        moe.expand_to_fused(x, ttp[:1], pte)
    with pytest.raises(RuntimeError, match="token_topk_to_pos"):
        moe.expand_to_fused(x, ttp, pte[:2])                              # position 2 beyond N = 2


# ------------------------------------------------------------------------------------ expand_to_fused_with_sf

@pytest.mark.parametrize("num_per_channels", [32, 128])
@pytest.mark.parametrize("col,packed", [(False, False), (True, False), (True, True)])
def test_expand_with_sf(num_per_channels, col, packed):
    topk_idx = torch.tensor([[0, 1], [1, -1], [0, 0]])
    hidden = 1024
    data = torch.randn(3, hidden).clamp(-448, 448).to(torch.float8_e4m3fn)
    blocks = hidden // num_per_channels
    if packed:
        sf = torch.randint(-2**31, 2**31 - 1, (3, blocks // 4), dtype=torch.int32)   # every byte used: 4 | blocks
    else:
        sf = torch.rand(3, blocks) + 0.5
    pte, _, _, ttp, *_ = moe.get_fused_mapping(topk_idx, 3, 0, 2)
    out, out_sf = moe.expand_to_fused_with_sf((data, sf), num_per_channels, ttp, pte, col)
    rows_of = [0, 2, 2, -1, 0, 1]                                        # the hand layout of test_fused_mapping_hand
    assert out_sf.dtype == sf.dtype and out_sf.shape == (6, sf.size(1))
    assert out_sf.stride() == ((1, 8) if col else (sf.size(1), 1))      # TMA-aligned: align(6, 4) = 8
    for p, t in enumerate(rows_of):
        assert torch.equal(out_sf[p], sf[t] if t >= 0 else torch.zeros_like(sf[0]))
        assert torch.equal(out[p].view(torch.uint8), data[t].view(torch.uint8) if t >= 0 else
                           torch.zeros(hidden, dtype=torch.uint8))


def test_expand_with_sf_errors():
    data, ttp, pte = torch.randn(2, 256), torch.tensor([[0], [1]], dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="x\\[1\\]"):
        moe.expand_to_fused_with_sf((data, torch.rand(2, 3)), 128, ttp, pte)        # H_sf must be 2
    with pytest.raises(ValueError, match="use_tma_aligned_col_major_sf"):
        moe.expand_to_fused_with_sf((data, torch.zeros(2, 1, dtype=torch.int32)), 128, ttp, pte)
    with pytest.raises(ValueError, match="num_per_channels"):
        moe.expand_to_fused_with_sf((data, torch.rand(2, 4)), 64, ttp, pte)
    out, out_sf = moe.expand_to_fused_with_sf((torch.empty(0, 256), torch.empty(0, 2)), 128,
                                              torch.empty(0, 1, dtype=torch.int32), torch.empty(0, dtype=torch.int32))
    assert out.shape == (0, 256) and out_sf.shape == (0, 2)


# ------------------------------------------------------------------------------------------- reduce_fused

def round_to_f32(value: Fraction) -> float:
    """Correct round-to-nearest-even of an exact rational to binary32 (normal range)."""
    guess = torch.tensor(float(value), dtype=FP32)
    candidates = {guess, torch.nextafter(guess, torch.tensor(float("inf"))), torch.nextafter(guess, torch.tensor(float("-inf")))}
    best = min(candidates, key=lambda c: (abs(Fraction(c.item()) - value), c.view(torch.int32).item() & 1))
    return best.item()


def test_fma_f32_single_rounding():
    # exact a*b + c = 1 + 2^-24 + 2^-70: just above the midpoint of 1 and 1 + 2^-23, so the fp32 FMA gives
    # 1 + 2^-23, while rounding a*b first (or the sum to fp64 first) lands on the tie and gives 1.0.
    a = torch.tensor([2.0 ** -12 * (1 + 2.0 ** -23)])
    b = torch.tensor([-(2.0 ** -12) * (1 - 2.0 ** -23)])
    c = torch.tensor([1 + 2.0 ** -23])
    assert ref.fma_f32(a, b, c).item() == 1 + 2.0 ** -23
    assert (a * b + c).item() == 1.0
    x = torch.randn(3, 300) * torch.logspace(-3, 3, 300)
    got = ref.fma_f32(x[0], x[1], x[2])
    for i in range(300):
        exact = Fraction(x[0, i].item()) * Fraction(x[1, i].item()) + Fraction(x[2, i].item())
        assert got[i].item() == round_to_f32(exact)


def test_reduce_fused_hand_fma_chain():
    hidden = 256
    x = torch.zeros(3, hidden)
    x[0, 0], x[1, 0], x[2, 0] = 1 + 2.0 ** -23, 2.0 ** -12 * (1 + 2.0 ** -23), 7.0
    w = torch.tensor([[1.0, -(2.0 ** -12) * (1 - 2.0 ** -23)], [0.5, 0.25]])
    ttp = torch.tensor([[0, 1], [2, 2]], dtype=torch.int32)               # token 1 uses position 2 twice
    out = moe.reduce_fused(x, w, ttp)
    assert out[0, 0].item() == 1 + 2.0 ** -23                            # fused: one rounding per slot
    assert out[1, 0].item() == 7.0 * 0.75 and (out[:, 1:] == 0).all()
    x_sf = torch.tensor([2.0, 4.0, 0.5])
    out = moe.reduce_fused((x, x_sf), None, torch.tensor([[2, -1], [-1, -1]], dtype=torch.int32))
    assert out[0, 0].item() == 3.5 and out[1].eq(0).all() and not out[1].signbit().any()   # all-(-1) row: +0


def test_expand_then_reduce_returns_input():
    topk_idx = receive_side_topk_idx(10, 4, 16, 2)
    rows = topk_idx.size(0)
    pte, _, _, ttp, *_ = moe.get_fused_mapping(topk_idx, 16, 0, 16)
    x = torch.randn(rows, 256)
    # unit weight on the first routed slot only: the single FMA is exact
    first = torch.zeros_like(topk_idx, dtype=torch.bool).scatter_(1, (topk_idx >= 0).int().argmax(1, keepdim=True), True)
    ttp_first = torch.where(first, ttp, -1)
    assert torch.equal(moe.reduce_fused(moe.expand_to_fused(x, ttp, pte), torch.ones(rows, 4), ttp_first), x)
    # every slot routed, weight 1/K: bf16 rows summed in fp32 stay exact
    full = torch.stack([torch.randperm(16)[:4] for _ in range(rows)])
    pte, _, _, ttp, *_ = moe.get_fused_mapping(full, 16, 0, 1)
    xb = torch.randn(rows, 256).to(torch.bfloat16)
    back = moe.reduce_fused(moe.expand_to_fused(xb, ttp, pte), torch.full((rows, 4), 0.25), ttp)
    assert back.dtype == torch.bfloat16 and torch.equal(back, xb)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("e4m3,with_sf,with_weights", [(False, False, True), (True, True, True), (True, False, False),
                                                       (False, True, False)])
def test_reduce_fused_matches_slot_loop(in_dtype, e4m3, with_sf, with_weights):
    topk_idx = receive_side_topk_idx(6, 6, 9, 8)
    rows = topk_idx.size(0)
    _, _, _, ttp, *_ = moe.get_fused_mapping(topk_idx, 9, 0, 1)
    size = rows * 6
    x = torch.randn(size, 256).to(in_dtype)
    x_sf = torch.randn(size) if with_sf else None
    w = torch.rand(rows, 6) if with_weights else None
    sf = torch.randn(1) if e4m3 else None
    got = moe.reduce_fused((x, x_sf) if with_sf else x, w, ttp, "e4m3" if e4m3 else "", sf)
    assert got.dtype == (torch.float8_e4m3fn if e4m3 else in_dtype)
    for t in range(rows):
        acc = torch.zeros(256)
        for k in range(6):
            p = ttp[t, k].item()
            if p < 0:
                continue
            s = (w[t, k] if with_weights else torch.tensor(1.0)) * (x_sf[p] if with_sf else 1.0)
            acc = ref.fma_f32(x[p].float(), s.expand(256), acc)
        if e4m3:
            acc = formats.e4m3_encode(acc * sf[0])
        assert torch.equal(got[t].view(torch.uint8), acc.to(got.dtype).view(torch.uint8))


def test_reduce_fused_e4m3_saturates_and_out():
    x = torch.zeros(2, 256)
    x[0, :3] = torch.tensor([1300.0, -1000.0, 3.0])
    ttp = torch.tensor([[0], [1]], dtype=torch.int32)
    out = torch.full((2, 256), float("nan")).to(torch.float8_e4m3fn)
    got = moe.reduce_fused(x, None, ttp, "e4m3", out=out)
    assert got is out and out[0, :3].float().tolist() == [448.0, -448.0, 3.0] and (out[1].float() == 0).all()


def test_reduce_fused_cpu_dispatch_zero_tokens_errors():
    x, ttp, w = torch.randn(4, 256), torch.tensor([[0, 3], [2, -1]], dtype=torch.int32), torch.rand(2, 2)
    assert torch.equal(moe.reduce_fused(x, w, ttp), ref.reduce_fused(x, w, ttp))
    assert moe.reduce_fused(torch.empty(0, 256), None, torch.empty(0, 2, dtype=torch.int32)).shape == (0, 256)
    with pytest.raises(ValueError, match="hidden % 256"):
        moe.reduce_fused(torch.randn(4, 128), w, ttp)
    with pytest.raises(ValueError, match="sf"):
        moe.reduce_fused(x, w, ttp, "", torch.ones(1))
    with pytest.raises(ValueError, match="fp8_format"):
        moe.reduce_fused(x, w, ttp, "e5m2")
    with pytest.raises(TypeError, match="out"):
        moe.reduce_fused(x, w, ttp, "e4m3", out=torch.empty(2, 256))
    with pytest.raises(ValueError, match="topk_weights"):
        moe.reduce_fused(x, torch.rand(2, 3), ttp)
    with pytest.raises(RuntimeError, match="token_topk_to_pos"):
        moe.reduce_fused(x, w, ttp + 2)
