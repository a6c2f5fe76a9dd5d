"""expand_to_mhc / expand_to_mhc_fwd / expand_to_mhc_bwd (mhc.md §2.1).

Tolerances: none. The forward is a copy and the backward a sum of n <= 8 bf16 values in fp32 rounded
once, so every comparison is bitwise (spec §3: "actually bit-exact").
"""
import pytest
import torch

from tilefuse.mhc import expand_to_mhc, expand_to_mhc_bwd, expand_to_mhc_fwd
from tilefuse.mhc import _functions as F
from tilefuse.reference import expand_to_mhc_ref
from tilefuse.testing import assert_equal
from tests.mhc.mhc_helpers import BF16, F64


def test_hand_forward_copies_every_stream():
    hidden = torch.tensor([[1.0, -2.5, 3.0], [0.5, 0.25, -8.0]], dtype=BF16)
    out = expand_to_mhc(hidden, 4)
    assert out.shape == (2, 4, 3)
    for t in range(2):
        for i in range(4):
            assert out[t, i].tolist() == hidden[t].tolist()


def test_hand_backward_sums_streams_then_rounds_once():
    # 1 + 3 * 2^-8 = 1 + 1.5 bf16 ulps: a tie that rounds to even (1 + 2 ulps = 1.015625). Rounding after
    # every addition would give 1.0 instead (each 1 + 2^-8 is a tie to even at 1).
    g = torch.tensor([[[1.0], [2.0 ** -8], [2.0 ** -8], [2.0 ** -8]]], dtype=BF16)
    x_grad = torch.full((1, 1), float("nan"), dtype=BF16)
    expand_to_mhc_bwd(g, x_grad)
    assert x_grad.item() == 1.015625


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_matches_reference_and_autograd(n):
    hidden = torch.randn(2, 3, 40).to(BF16).requires_grad_()
    out = expand_to_mhc(hidden, n)
    assert_equal(out, expand_to_mhc_ref(hidden.detach(), n))
    g = torch.randn(2, 3, n, 40).to(BF16)
    (d_hidden,) = torch.autograd.grad(out, hidden, g)
    ref_hidden = hidden.detach().clone().requires_grad_()
    (d_ref,) = torch.autograd.grad(expand_to_mhc_ref(ref_hidden, n), ref_hidden, g)
    assert_equal(d_hidden, d_ref)
    # independent formulation: in-order fp32 sum over streams, one rounding
    acc = torch.zeros(2, 3, 40)
    for i in range(n):
        acc = acc + g[:, :, i].float()
    assert_equal(d_hidden, acc.to(BF16))


def test_v21_ops_write_destinations():
    x = torch.randn(5, 24).to(BF16)
    o = torch.full((5, 4, 24), float("nan"), dtype=BF16)
    assert expand_to_mhc_fwd(x, o) is None
    assert_equal(o, expand_to_mhc_ref(x, 4))
    g = torch.randn(5, 4, 24).to(BF16)
    x_grad = torch.full((5, 24), float("nan"), dtype=BF16)
    expand_to_mhc_bwd(g, x_grad)
    assert_equal(x_grad, g.float().sum(1).to(BF16))


def test_out_buffer_is_written_and_returned():
    hidden = torch.randn(3, 16).to(BF16).requires_grad_()
    out = torch.full((3, 4, 16), float("nan"), dtype=BF16)
    result = expand_to_mhc(hidden, 4, out=out)
    assert result is out
    assert_equal(out, expand_to_mhc_ref(hidden.detach(), 4))
    result.float().sum().backward()
    assert_equal(hidden.grad, torch.full((3, 16), 4.0, dtype=BF16))


def test_gradcheck_float64():
    hidden = torch.randn(2, 3, 5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h: F.ExpandToMHCFn.apply(h, 4, None), (hidden,))


def test_zero_tokens():
    hidden = torch.empty(0, 16, dtype=BF16, requires_grad=True)
    out = expand_to_mhc(hidden, 4)
    assert out.shape == (0, 4, 16)
    out.sum().backward()
    assert hidden.grad.shape == (0, 16)
    x_grad = torch.empty(0, 16, dtype=BF16)
    expand_to_mhc_bwd(torch.empty(0, 4, 16, dtype=BF16), x_grad)


def test_errors():
    x = torch.randn(4, 16).to(BF16)
    with pytest.raises(TypeError, match="hidden"):
        expand_to_mhc(x.float(), 4)
    with pytest.raises(ValueError, match="hidden"):
        expand_to_mhc(x.t(), 4)
    with pytest.raises(ValueError, match="mhc_mult"):
        expand_to_mhc(x, 0)
    with pytest.raises(ValueError, match="out"):
        expand_to_mhc(x, 4, out=torch.empty(4, 2, 16, dtype=BF16))
    o_grad = torch.randn(4, 4, 16).to(BF16)
    x_grad = torch.zeros(4, 8, dtype=BF16)
    with pytest.raises(ValueError, match="x_grad"):
        expand_to_mhc_bwd(o_grad, x_grad)
    assert (x_grad == 0).all()
    with pytest.raises(ValueError, match="o"):
        expand_to_mhc_fwd(x, torch.empty(4, 4, 8, dtype=BF16))
