"""batched_transpose_weight_sf (quant.md 5.13): packed UE8M0 weight-sf layouts, checked against a Python loop."""
import math

import pytest
import torch

from tilefuse.quant import batched_transpose_weight_sf
from tilefuse.reference import batched_transpose_weight_sf as ref_bt


def _pow2_sf(shape, zero_frac=0.1):
    """Random non-negative powers of two (2^-127..2^127 range kept moderate) with some zeros."""
    e = torch.randint(-40, 40, shape)
    sf = torch.pow(2.0, e.double()).float()
    return torch.where(torch.rand(shape) < zero_frac, torch.zeros_like(sf), sf)


def _byte(v: float) -> int:
    """Biased exponent of a power of two (0 for zero), from math.frexp: v = 0.5 * 2^e -> E = e - 1."""
    return 0 if v == 0 else math.frexp(v)[1] - 1 + 127


def _word(bytes_):
    w = sum(b << (8 * u) for u, b in enumerate(bytes_))
    return w - (1 << 32) if w >= 1 << 31 else w


def _expected(sf2d, bs):
    """(sf0, sf1) as nested Python lists from the 5.13 definition (one group)."""
    nsn, nsk = sf2d.shape
    e = [[_byte(sf2d[i, j].item()) for j in range(nsk)] for i in range(nsn)]
    get = lambda i, j: e[i][j] if i < nsn and j < nsk else 0  # noqa: E731
    sf0 = [[_word([get(r // bs, 4 * c + u) for u in range(4)]) for c in range(-(-nsk // 4))]
           for r in range(nsn * bs)]
    sf1 = [[_word([get(4 * c + u, col // bs) for u in range(4)]) for c in range(-(-nsn // 4))]
           for col in range(nsk * bs)]
    return torch.tensor(sf0, dtype=torch.int32), torch.tensor(sf1, dtype=torch.int32)


@pytest.mark.parametrize("transpose_sf1", [False, True])
def test_against_python_loop_3d(transpose_sf1):
    bs, g, nsn, nsk = 128, 2, 6, 10  # nsn, nsk not multiples of 4: padding bytes in both layouts
    sf = _pow2_sf((g, nsn, nsk))
    ((sf0, sf1),) = batched_transpose_weight_sf([sf], bs, [transpose_sf1])
    n, k, w0, w1 = nsn * bs, nsk * bs, 3, 2
    assert sf0.dtype == torch.int32 and sf0.shape == (g, n, w0) and sf0.stride() == (w0 * n, 1, n)
    if transpose_sf1:
        assert sf1.shape == (g, w1, k) and sf1.stride() == (w1 * k, k, 1)
        sf1 = sf1.transpose(1, 2)
    else:
        assert sf1.shape == (g, k, w1) and sf1.stride() == (w1 * k, 1, k)
    for i in range(g):
        exp0, exp1 = _expected(sf[i], bs)
        assert torch.equal(sf0[i], exp0)
        assert torch.equal(sf1[i], exp1)


def test_against_python_loop_2d_bs32():
    sf = _pow2_sf((4, 8))
    ((sf0, sf1),) = batched_transpose_weight_sf([sf], 32, [False])
    assert sf0.shape == (128, 2) and sf0.stride() == (1, 128)
    assert sf1.shape == (256, 1) and sf1.stride() == (1, 256)
    exp0, exp1 = _expected(sf, 32)
    assert torch.equal(sf0, exp0) and torch.equal(sf1, exp1)


def test_hand_values():
    """sf = [[1, 2^-3], [0, 4]] with bs=128: bytes 127, 124 / 0, 129."""
    sf = torch.tensor([[1.0, 0.125], [0.0, 4.0]])
    ((sf0, sf1),) = batched_transpose_weight_sf([sf], 128, [False])
    assert sf0[0, 0].item() == 127 | (124 << 8) and sf0[127, 0].item() == 127 | (124 << 8)
    assert sf0[128, 0].item() == 0 | (129 << 8) and sf0[255, 0].item() == 129 << 8
    assert sf1[0, 0].item() == 127 and sf1[128, 0].item() == 124 | (129 << 8)


def test_cpu_dispatch_equals_reference_and_pool():
    sfs = [_pow2_sf((3, 2, 5)), _pow2_sf((4, 3))]
    flags = [True, False]
    out = batched_transpose_weight_sf(sfs, 128, flags)
    ref = ref_bt(sfs, 128, flags)
    ptrs = set()
    for (a0, a1), (r0, r1) in zip(out, ref):
        for a, r in ((a0, r0), (a1, r1)):
            assert a.shape == r.shape and a.stride() == r.stride() and torch.equal(a, r)
            assert a.data_ptr() % 32 == 0
            ptrs.add(a.untyped_storage().data_ptr())
    assert len(ptrs) == 1  # one shared pool


def test_outs_written_in_place():
    sf = _pow2_sf((2, 2, 3))
    ((e0, e1),) = ref_bt([sf], 128, [True])
    o0 = torch.full((2, 1, 256), -1, dtype=torch.int32).transpose(1, 2)  # (2, 256, 1) strides (256, 1, 256)
    o1 = torch.full((2, 1, 384), -1, dtype=torch.int32)
    # A 2-D mixed case next to it gets a fresh pool entry.
    res = batched_transpose_weight_sf([sf, sf[0]], 128, [True, False], outs=[(o0, o1), None])
    assert res[0][0] is o0 and res[0][1] is o1
    assert torch.equal(o0, e0) and torch.equal(o1, e1)
    assert (o0.flatten() != -1).all()  # padding bytes written (as zero), no leftovers


def test_empty_list():
    assert batched_transpose_weight_sf([], 128, []) == []


def test_invalid_values_assert():
    sf = _pow2_sf((2, 2))
    sf[0, 1] = 3.0
    with pytest.raises(RuntimeError, match="powers of two"):
        batched_transpose_weight_sf([sf], 128, [False])
    sf[0, 1] = -2.0
    with pytest.raises(RuntimeError, match="powers of two"):
        batched_transpose_weight_sf([sf], 128, [False])


def test_errors():
    sf = _pow2_sf((2, 8))
    with pytest.raises(ValueError, match="block_size"):
        batched_transpose_weight_sf([sf], 64, [False])
    with pytest.raises(TypeError, match=r"sf\[0\] must have dtype float32"):
        batched_transpose_weight_sf([sf.double()], 128, [False])
    with pytest.raises(ValueError, match=r"sf\[0\] must be contiguous"):
        batched_transpose_weight_sf([_pow2_sf((4, 4)).T], 32, [False])
    with pytest.raises(ValueError, match=r"sf\[0\] must describe n and k"):
        batched_transpose_weight_sf([_pow2_sf((2, 3))], 32, [False])
    with pytest.raises(ValueError, match=r"sf\[0\] must have G > 0"):
        batched_transpose_weight_sf([_pow2_sf((0, 2, 4))], 128, [False])
    with pytest.raises(ValueError, match="transpose_sf1s"):
        batched_transpose_weight_sf([sf], 128, [])
    good0 = torch.zeros((2, 256), dtype=torch.int32).T  # (256, 2) strides (1, 256)
    with pytest.raises(ValueError, match=r"outs\[0\]\[0\] must have strides"):
        batched_transpose_weight_sf([sf], 128, [False], outs=[(good0.contiguous(), torch.zeros(1024, 1))])
    with pytest.raises(TypeError, match=r"outs\[0\]\[1\] must have dtype int32"):
        batched_transpose_weight_sf([sf], 128, [False], outs=[(good0, torch.zeros((1, 1024)).T)])
