"""CUDA dispatch of every MoE op (gpu tier): outputs live on the input's device and equal the CPU results.

CUDA tensors run the kernels, CPU tensors the reference, so the comparison is exact except where CUDA's
elementwise math (exp, softplus, sigmoid) may differ by an ulp from the CPU's: there, indices must
agree and values are compared with a few-ulp tolerance.
"""
import pytest
import torch

from tilefuse import moe

pytestmark = pytest.mark.gpu
ULPS = 4 * 2.0 ** -23      # relative: a few fp32 ulps of transcendental-function differences


def on_cuda(*args):
    return [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]


def same(cpu, gpu, exact=True):
    if isinstance(cpu, (tuple, list)):
        for c, g in zip(cpu, gpu):
            same(c, g, exact)
        return
    if not isinstance(cpu, torch.Tensor):
        assert cpu == gpu
        return
    assert gpu.is_cuda and gpu.dtype == cpu.dtype and gpu.shape == cpu.shape
    if exact or not cpu.is_floating_point():
        assert torch.equal(gpu.cpu().view(torch.uint8) if cpu.dtype == torch.float8_e4m3fn else gpu.cpu(),
                           cpu.view(torch.uint8) if cpu.dtype == torch.float8_e4m3fn else cpu)
    else:
        assert torch.allclose(gpu.cpu(), cpu, rtol=ULPS, atol=0)


def test_cuda_routing_utilities():
    idx = torch.randint(-1, 9, (50, 6))
    for op, args in [(moe.aux_fi, (idx, 9, 6)), (moe.group_count, (idx, 9)), (moe.mask_indices_by_tp, (idx, 9, 3, 1, 3)),
                     (moe.topk_gate, (torch.randn(50, 72), 6)), (moe.normalize_weight, (torch.rand(50, 6),)),
                     (moe.topk_sum_and_topk_group_idx, (torch.randn(50, 8, 32), 2, 4)),
                     (moe.get_fused_mapping, (idx, 9, 0, 16)), (moe.get_fused_mapping, (idx, 9, 1000, 16, True))]:
        same(op(*args), op(*on_cuda(*args)))
    g = idx.clone()
    g_cuda = g.cuda()
    moe.inplace_unique_group_indices(g, 9)
    moe.inplace_unique_group_indices(g_cuda, 9)
    same(g, g_cuda)


def test_cuda_expand_and_reduce():
    idx = torch.randint(-1, 9, (50, 6))
    pte, _, _, ttp, *_ = moe.get_fused_mapping(idx, 9, 0, 16)
    x = torch.randn(50, 512).to(torch.bfloat16)
    sf = torch.randint(0, 2**30, (50, 1), dtype=torch.int32)
    same(moe.expand_to_fused(x, ttp, pte), moe.expand_to_fused(*on_cuda(x, ttp, pte)))
    same(moe.expand_to_fused_with_sf((x, sf), 128, ttp, pte, True),
         moe.expand_to_fused_with_sf(tuple(on_cuda(x, sf)), 128, *on_cuda(ttp, pte), True))
    y, w, x_sf, scale = torch.randn(pte.numel(), 512), torch.rand(50, 6), torch.randn(pte.numel()), torch.randn(1)
    same(moe.reduce_fused((y, x_sf), w, ttp, "e4m3", scale), moe.reduce_fused(tuple(on_cuda(y, x_sf)), *on_cuda(w, ttp),
                                                                               "e4m3", scale.cuda()))


def test_cuda_gates():
    logits, bias = torch.randn(40, 32), torch.randn(32)
    mask, fix = torch.rand(40) > 0.2, torch.rand(40) > 0.7
    pmap, count = torch.randint(0, 40, (34, 3), dtype=torch.int32), torch.randint(1, 4, (34,), dtype=torch.int32)
    unmapped = torch.randint(0, 32, (40, 6))
    u_cuda = unmapped.cuda()
    unmapped8 = torch.randint(0, 32, (40, 8))
    for scoring in ("sigmoid", "sqrtsoftplus", "softmax"):
        args = (logits, bias, 8, 2, 4, True, 2, 1.5, 1, 2, 0, 2, scoring, mask, fix, pmap, count)
        same(moe.top2_sum_gate(*args, unmapped8.clone()), moe.top2_sum_gate(*on_cuda(*args), unmapped8.cuda()),
             exact=False)
    rand = torch.rand(40) > 0.5
    kw = dict(mask=mask, bias=bias, fix_routing_mask=fix, to_physical_map=pmap, logical_count=count, force_random=rand)
    cpu = moe.moe_topk_gate_forward(logits, 6, True, 2, 1.5, 3, unmapped_topk_idx=unmapped, **kw)
    gpu = moe.moe_topk_gate_forward(logits.cuda(), 6, True, 2, 1.5, 3, unmapped_topk_idx=u_cuda,
                                    **{k: v.cuda() for k, v in kw.items()})
    same(cpu, gpu, exact=False)
    same(unmapped, u_cuda)
    scores, w, g = torch.rand(40, 32), torch.rand(40, 6), torch.randn(40, 6)
    args = (scores, unmapped, w, g, 1.5, "sqrtsoftplus", mask, torch.randn(4, 32))
    same(moe.moe_topk_gate_backward(*args), moe.moe_topk_gate_backward(*on_cuda(*args)), exact=False)
