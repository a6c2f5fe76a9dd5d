"""engram_hash and make_offsets (engram.md §2.1, §2.2): exact integer arithmetic, checked against Python ints."""
import pytest
import torch

from tilefuse.engram import engram_hash
from tilefuse.reference import engram_hash_ref, make_offsets
from tilefuse.testing import assert_equal


def wrap(value: int, bits: int) -> int:
    """Two's-complement wrap of a Python int to ``bits`` bits."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def py_offsets(sizes: list[list[list[int]]]) -> list[list[int]]:
    """§2.1 with Python ints: exclusive prefix sums of each layer's flattened sizes, wrapped to int32."""
    out = []
    for layer in sizes:
        flat = [s for row in layer for s in row]
        out.append([wrap(sum(flat[:i]), 32) for i in range(len(flat))])
    return out


def py_hash(ids, mults, sizes, offsets) -> list:
    """§2.2.2 with Python ints: wrapping int64 products, XOR chain, floor-mod, wrapping int32 add."""
    out = []
    for l, layer_sizes in enumerate(sizes):
        rows = []
        for row in ids:
            h, cols = 0, []
            for j, a in enumerate(row):
                p = wrap(a * mults[l][j], 64)
                h = p if j == 0 else h ^ p
                if j >= 1:
                    for e, vsize in enumerate(layer_sizes[j - 1]):
                        col = (j - 1) * len(layer_sizes[j - 1]) + e
                        cols.append(wrap(h % vsize + offsets[l][col], 32))
            rows.append(cols)
        out.append(rows)
    return out


def as_tensors(ids, mults, sizes):
    return (torch.tensor(ids, dtype=torch.int32), torch.tensor(mults, dtype=torch.int64),
            torch.tensor(sizes, dtype=torch.int32))


def test_make_offsets_hand():
    sizes = torch.tensor([[[10, 4], [7, 1]], [[3, 3], [5, 2]]], dtype=torch.int32)
    assert make_offsets(sizes).tolist() == [[0, 10, 14, 21], [0, 3, 6, 11]]
    assert make_offsets(sizes).dtype == torch.int32


def test_make_offsets_wraps_int32():
    big = 2**31 - 1
    sizes = torch.tensor([[[big, 5], [9, 1]]], dtype=torch.int32)
    # big + 5 wraps to -2**31 + 4; adding 9 gives -2**31 + 13
    assert make_offsets(sizes).tolist() == [[0, big, -(2**31) + 4, -(2**31) + 13]]


def test_hash_hand_computed():
    # ids (3, 5), multipliers (7, 11): h0 = 21, h1 = 21 ^ 55 = 0b010101 ^ 0b110111 = 0b100010 = 34.
    # sizes (10, 4), offsets (0, 10): 34 % 10 = 4 -> 4; 34 % 4 = 2 -> 12.
    # ids (-1, 2), multipliers (5, 3): h0 = -5, h1 = -5 ^ 6 = -3; -3 mod 10 = 7 -> 7; -3 mod 4 = 1 -> 11.
    ids = torch.tensor([[3, 5]], dtype=torch.int32)
    mults = torch.tensor([[7, 11]], dtype=torch.int64)
    sizes = torch.tensor([[[10, 4]]], dtype=torch.int32)
    offsets = make_offsets(sizes)
    assert offsets.tolist() == [[0, 10]]
    assert engram_hash(ids, mults, sizes, offsets).tolist() == [[[4, 12]]]
    ids = torch.tensor([[-1, 2]], dtype=torch.int32)
    mults = torch.tensor([[5, 3]], dtype=torch.int64)
    assert engram_hash(ids, mults, sizes, offsets).tolist() == [[[7, 11]]]


def test_hash_int64_wraparound():
    # 4 * 2**62 = 2**64 wraps to 0; 3 * (2**62 + 1) = 2**63 + 2**62 + 3 wraps to -2**62 + 3.
    ids, mults, sizes = as_tensors([[4, 3]], [[2**62, 2**62 + 1]], [[[1000003, 97]]])
    offsets = make_offsets(sizes)
    h1 = -(2**62) + 3
    expected = [[[h1 % 1000003, h1 % 97 + 1000003]]]
    assert engram_hash(ids, mults, sizes, offsets).tolist() == expected


def test_hash_offset_add_wraps_int32():
    ids, mults, sizes = as_tensors([[1, 2]], [[1, 1]], [[[2**31 - 1, 100]]])
    offsets = make_offsets(sizes)  # (0, 2**31 - 1)
    # h1 = 1 ^ 2 = 3: column 0 -> 3; column 1 -> 3 + 2**31 - 1 wraps to -2**31 + 2
    assert engram_hash(ids, mults, sizes, offsets).tolist() == [[[3, -(2**31) + 2]]]


@pytest.mark.parametrize("n,layers,k", [(2, 1, 4), (3, 2, 1), (3, 2, 8), (4, 3, 2)])
def test_hash_matches_python_ints(n, layers, k):
    t = 37
    ids = torch.randint(-5, 100_000, (t, n), dtype=torch.int32)
    ids[0] = -1  # a sentinel id before the sequence start is hashed arithmetically (§2.2.5)
    mults = torch.randint(-(2**62), 2**62, (layers, n), dtype=torch.int64)
    sizes = torch.randint(1, 1_000_000, (layers, n - 1, k), dtype=torch.int32)
    offsets = make_offsets(sizes)
    out = engram_hash(ids, mults, sizes, offsets)
    assert out.shape == (layers, t, (n - 1) * k) and out.dtype == torch.int32 and out.is_contiguous()
    assert offsets.tolist() == py_offsets(sizes.tolist())
    assert out.tolist() == py_hash(ids.tolist(), mults.tolist(), sizes.tolist(), offsets.tolist())
    # the local index lies in [0, V) even for negative running hashes
    local = (out.long() - offsets[:, None, :].long())
    assert bool((local >= 0).all()) and bool((local < sizes.reshape(layers, 1, -1)).all())


def test_hash_cpu_dispatch_equals_reference():
    ids = torch.randint(0, 100_000, (64, 3), dtype=torch.int32)
    mults = torch.randint(0, 100_000, (2, 3), dtype=torch.int64)
    sizes = torch.randint(100_000, 1_000_000, (2, 2, 8), dtype=torch.int32)
    offsets = make_offsets(sizes)
    assert_equal(engram_hash(ids, mults, sizes, offsets), engram_hash_ref(ids, mults, sizes, offsets))


def test_hash_zero_tokens():
    ids = torch.empty(0, 3, dtype=torch.int32)
    mults = torch.randint(0, 100, (2, 3), dtype=torch.int64)
    sizes = torch.randint(1, 100, (2, 2, 8), dtype=torch.int32)
    out = engram_hash(ids, mults, sizes, make_offsets(sizes))
    assert out.shape == (2, 0, 16) and out.dtype == torch.int32


def _valid():
    ids = torch.randint(0, 100, (4, 3), dtype=torch.int32)
    mults = torch.randint(0, 100, (2, 3), dtype=torch.int64)
    sizes = torch.randint(1, 100, (2, 2, 8), dtype=torch.int32)
    return dict(ngram_token_ids=ids, multipliers=mults, vocab_sizes=sizes, offsets=make_offsets(sizes))


@pytest.mark.parametrize("name,bad,exc", [
    ("ngram_token_ids", lambda a: a["ngram_token_ids"].long(), TypeError),
    ("ngram_token_ids", lambda a: a["ngram_token_ids"].t(), ValueError),
    ("multipliers", lambda a: a["multipliers"].int(), TypeError),
    ("multipliers", lambda a: a["multipliers"][:, :2].contiguous(), ValueError),
    ("vocab_sizes", lambda a: a["vocab_sizes"][:, :1].contiguous(), ValueError),
    ("vocab_sizes", lambda a: a["vocab_sizes"].long(), TypeError),
    ("offsets", lambda a: a["offsets"][:, :15].contiguous(), ValueError),
    ("offsets", lambda a: [0] * 16, TypeError),
])
def test_hash_errors(name, bad, exc):
    args = _valid()
    args[name] = bad(args)
    with pytest.raises(exc, match=name):
        engram_hash(**args)
