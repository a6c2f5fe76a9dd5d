"""EngramGateFn / engram_gate (engram.md §2.7.1): autograd through the fused gate ops, main_grad accumulation.

gradcheck does not apply here: the public ops take only bf16 activations/weights (the spec's dtypes), so
float64 inputs are rejected. The backward formulas themselves are gradchecked in float64 in
tests/engram/test_engram_gate.py; here the gradients are compared with autograd through engram_gate_ref.
"""
import pytest
import torch

from tilefuse.engram import engram_gate_fwd, fused_weight
from tilefuse.modeling.engram import EngramGateFn, engram_gate
from tilefuse.reference import engram_gate_ref
from tilefuse.testing import assert_equal, calc_diff

EPS, CLAMP = 1e-20, 1e-6
# engram.md §3.2 bound for the backward. The spec notes that with the op's own forward statistics the
# gradient is ill-conditioned for |s| just above the clamp; random data at these small sizes has no such
# token, so the bound applies.
BWD_DIFF = 1e-8
M, H = 4, 1024


def bf16(*shape):
    return torch.randn(*shape).bfloat16()


def leaves(lead=(2, 3)):
    return [bf16(*lead, M, H).requires_grad_(), bf16(*lead, M, H).requires_grad_(), bf16(*lead, H).requires_grad_(),
            bf16(M, H).requires_grad_(), bf16(M, H).requires_grad_()]


def ref_grads(args, grad_out, fp32_weights=False):
    """Gradients of engram_gate_ref for fresh copies of ``args`` (weights as fp32 leaves if asked)."""
    copies = [a.detach().clone() for a in args]
    if fp32_weights:
        copies[3:] = [w.float() for w in copies[3:]]
    for c in copies:
        c.requires_grad_()
    engram_gate_ref(*copies, CLAMP, EPS).backward(grad_out)
    return [c.grad for c in copies]


def test_forward_matches_op_and_keeps_shape():
    args = leaves()
    out = engram_gate(*args, CLAMP, EPS)
    assert out.shape == (2, 3, M, H) and out.dtype == torch.bfloat16
    x, k, v, w_h, w_e = (a.detach() for a in args)
    expected = engram_gate_fwd(x.view(-1, M, H), k.view(-1, M, H), v.view(-1, H), fused_weight(w_h, w_e), EPS, CLAMP)[0]
    assert_equal(out.detach(), expected.view(2, 3, M, H))
    assert out.grad_fn is not None and type(out.grad_fn).__name__.startswith("EngramGateFn")


def test_backward_matches_reference_autograd():
    args = leaves()
    grad_out = bf16(2, 3, M, H)
    engram_gate(*args, CLAMP, EPS).backward(grad_out)
    expected = ref_grads(args, grad_out)
    for a, ref in zip(args, expected):
        assert a.grad is not None and a.grad.shape == a.shape and a.grad.dtype == torch.bfloat16  # engine casts fp32
        assert calc_diff(a.grad, ref) < BWD_DIFF


def test_backward_with_expanded_grad_output():
    """out.sum() hands the backward a stride-0 gradient; it must be handled like a dense one."""
    args = leaves(lead=(5,))
    engram_gate(*args, CLAMP, EPS).float().sum().backward()
    expected = ref_grads(args, torch.ones(5, M, H, dtype=torch.bfloat16))
    for a, ref in zip(args, expected):
        assert calc_diff(a.grad, ref) < BWD_DIFF


def test_main_grad_accumulates():
    """A weight with ``main_grad`` gets ``main_grad += grad`` (fp32) and no ``.grad``; a weight without one
    gets its ``.grad``. Two backward passes add twice."""
    args = leaves()
    w_h, w_e = args[3], args[4]
    start = torch.randn(M, H) * 10
    w_h.main_grad = start.clone()
    grad_out = bf16(2, 3, M, H)
    expected = ref_grads(args, grad_out, fp32_weights=True)
    engram_gate(*args, CLAMP, EPS).backward(grad_out)
    assert w_h.grad is None
    assert w_e.grad.dtype == torch.bfloat16 and calc_diff(w_e.grad, expected[4].bfloat16()) < BWD_DIFF
    first = w_h.main_grad.clone()
    assert first.dtype == torch.float32
    assert calc_diff(first - start, expected[3]) < BWD_DIFF
    assert calc_diff(first, expected[3]) > 0.5  # the old content was kept, not overwritten
    engram_gate(*args, CLAMP, EPS).backward(grad_out)
    assert w_h.grad is None
    assert calc_diff(w_h.main_grad - first, expected[3]) < BWD_DIFF


def test_main_grad_none_falls_back_to_grad():
    args = leaves(lead=(3,))
    args[3].main_grad = None
    grad_out = bf16(3, M, H)
    engram_gate(*args, CLAMP, EPS).backward(grad_out)
    assert calc_diff(args[3].grad, ref_grads(args, grad_out)[3]) < BWD_DIFF


def test_zero_tokens():
    args = leaves(lead=(0,))
    args[4].main_grad = torch.randn(M, H)
    before = args[4].main_grad.clone()
    out = engram_gate(*args, CLAMP, EPS)
    assert out.shape == (0, M, H)
    out.float().sum().backward()
    assert args[0].grad.shape == (0, M, H) and args[2].grad.shape == (0, H)
    assert bool((args[3].grad == 0).all())
    assert_equal(args[4].main_grad, before)


def test_errors_come_from_the_ops():
    args = leaves(lead=(2,))
    with pytest.raises(TypeError, match="hidden_states"):
        engram_gate(args[0].float(), *args[1:], CLAMP, EPS)
    with pytest.raises(ValueError, match="weight_hidden"):
        EngramGateFn.apply(*args[:3], bf16(M, 100), args[4], CLAMP, EPS)
