"""CUDA dispatch of the engram ops (skipped without a GPU): CUDA tensors give the CPU results — bitwise where
the math is exact or order-fixed (hash, fused weight, grad_w_reduce, momentum update), else within the
accuracy contract of engram.md §3.2 (the reductions over H may run in a different order)."""
import pytest
import torch

from tilefuse import engram as E
from tilefuse.engram.ops import DEFAULT_NUM_SMS
from tilefuse.modeling.engram import engram_gate
from tilefuse.reference import make_offsets
from tilefuse.testing import assert_equal, calc_diff

pytestmark = pytest.mark.gpu
EPS, CLAMP = 1e-20, 1e-6
FWD_STAT_DIFF, BWD_DIFF = 2e-10, 1e-8


def cuda(*ts):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in ts]


def test_exact_ops_on_cuda():
    ids = torch.randint(-5, 100_000, (4001, 3), dtype=torch.int32)
    mults = torch.randint(-(2**62), 2**62, (2, 3), dtype=torch.int64)
    sizes = torch.randint(100_000, 1_000_000, (2, 2, 8), dtype=torch.int32)
    args = (ids, mults, sizes, make_offsets(sizes))
    assert_equal(E.engram_hash(*cuda(*args)).cpu(), E.engram_hash(*args))
    w_h, w_e = torch.randn(4, 2048).bfloat16(), torch.randn(4, 2048).bfloat16()
    assert_equal(E.fused_weight(*cuda(w_h, w_e)).cpu(), E.fused_weight(w_h, w_e))
    partial, acc_h, acc_e = torch.randn(132, 4, 2048), torch.randn(4, 2048), torch.randn(4, 2048)
    dev = cuda(partial, w_h, w_e, acc_h, acc_e)
    E.grad_w_reduce(partial, w_h, w_e, acc_h, acc_e)
    E.grad_w_reduce(*dev)
    assert_equal(dev[3].cpu(), acc_h)
    assert_equal(dev[4].cpu(), acc_e)
    for dtype in (torch.bfloat16, torch.float32):
        grad, buf = torch.randn(8, 256).to(dtype), torch.randn(8, 256).to(dtype)
        grad_d, buf_d = cuda(grad, buf)
        out = E.engram_sinkhorn_momentum_update(grad, buf, 0.9)
        assert_equal(E.engram_sinkhorn_momentum_update(grad_d, buf_d, 0.9).cpu(), out)
        assert_equal(buf_d.cpu(), buf)


def test_gate_on_cuda():
    t, m, h = 257, 4, 2048
    x, k, v = torch.randn(t, m, h).bfloat16(), torch.randn(t, m, h).bfloat16(), torch.randn(t, h).bfloat16()
    w = E.fused_weight(torch.randn(m, h).bfloat16(), torch.randn(m, h).bfloat16())
    cpu = E.engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    dev = E.engram_gate_fwd(*cuda(x, k, v, w), EPS, CLAMP)
    assert dev[0].device.type == "cuda"
    for a, b in zip(dev[1:], cpu[1:]):
        assert calc_diff(a.cpu(), b) < FWD_STAT_DIFF
    go = torch.randn(t, m, h).bfloat16()
    cpu_b = E.engram_gate_bwd(go, x, k, v, w, *cpu[1:], CLAMP)
    dev_b = E.engram_gate_bwd(*cuda(go, x, k, v, w, *cpu[1:]), CLAMP)
    assert dev_b[3].shape[0] == DEFAULT_NUM_SMS  # fixed, whatever the device's SM count
    for a, b in zip(dev_b[:3], cpu_b[:3]):
        assert calc_diff(a.cpu(), b) < BWD_DIFF
    assert calc_diff(dev_b[3].sum(0).cpu(), cpu_b[3].sum(0)) < BWD_DIFF


def test_sinkhorn_and_autograd_on_cuda():
    matrix, row, col = torch.randn(1000, 512), torch.rand(1000) + 0.5, torch.rand(512) + 0.5
    matrix_d, row_d, col_d = cuda(matrix, row, col)
    norm, partial = E.engram_sinkhorn_step(matrix, row, col, 1e-6, num_sms=132)
    norm_d, partial_d = E.engram_sinkhorn_step(matrix_d, row_d, col_d, 1e-6)
    assert partial_d.shape == (3 * DEFAULT_NUM_SMS, 512)
    assert calc_diff(norm_d.cpu(), norm) < 1e-12 and calc_diff(row_d.cpu(), row) < 1e-12
    sumsq, sumsq_d = torch.empty(512), torch.empty(512, device="cuda")
    E.engram_sinkhorn_step_reduce(partial, sumsq)
    E.engram_sinkhorn_step_reduce(partial_d, sumsq_d)
    assert calc_diff(sumsq_d.cpu(), sumsq) < 1e-12
    out = E.engram_sinkhorn_finalize(matrix, row, col, 1e-6, 0.5)
    assert calc_diff(E.engram_sinkhorn_finalize(matrix_d, row_d, col_d, 1e-6, 0.5).cpu(), out) < 1e-12
    args = [a.cuda().requires_grad_() for a in (torch.randn(3, 5, 4, 1024).bfloat16(), torch.randn(3, 5, 4, 1024).bfloat16(),
                                                torch.randn(3, 5, 1024).bfloat16(), torch.randn(4, 1024).bfloat16(),
                                                torch.randn(4, 1024).bfloat16())]
    args[3].main_grad = torch.zeros(4, 1024, device="cuda")
    engram_gate(*args, CLAMP, EPS).float().square().sum().backward()
    assert args[3].grad is None and bool(args[3].main_grad.abs().sum() > 0)
    assert args[4].grad.device.type == "cuda" and args[0].grad.shape == args[0].shape
