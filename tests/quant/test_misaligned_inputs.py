"""GPU tier: inputs whose data pointer is not 16-byte aligned -- contiguous views at an odd element offset,
one row or many -- give the same bits as an aligned copy of the same values (the launchers copy them to
aligned memory; ``Tensor.contiguous()`` alone returns such a view itself, and the kernels' vector loads
would fault on it)."""
import pytest
import torch

import tilefuse.quant as q
import tilefuse.transpose as tr


def _misaligned(shape, dtype=torch.bfloat16, scale=3.0):
    n = 1
    for s in shape:
        n *= s
    flat = (torch.randn(n + 1, device="cuda") * scale).to(dtype)
    x = flat[1:].view(*shape)
    assert x.is_contiguous() and x.data_ptr() % 16
    return x


def _same(a, b):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            _same(u, v)
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point and a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.dtype.is_floating_point and b.element_size() == 1 else b)
    else:
        assert a == b


H = 7168
OPS = {  # name -> (op, row counts); registered static configs only (the GPU tier's cache has them)
    "per_token_cast e4m3": (lambda x: q.per_token_cast(x, "e4m3", 128), (1, 7, 256)),
    "per_token_cast e2m1 col packed": (lambda x: q.per_token_cast(x, "e2m1", 128, None, True, True, True),
                                       (1, 7, 256)),
    "per_token_cast_with_sf_only": (lambda x: q.per_token_cast_with_sf_only(x, "e4m3", 128), (1, 7, 256)),
    "per_token_cast_to_e5m6": (lambda x: q.per_token_cast_to_e5m6(x, H, round_sf=True), (1, 7, 256)),
    "norm_forward": (lambda x: q.norm_forward(x, torch.linspace(0.5, 1.5, H, device="cuda").to(x.dtype), 1e-6),
                     (1, 7, 256)),
    "per_block_cast": (lambda x: q.per_block_cast(x, "e4m3", (128, 128), True, True, True), (1, 7, 256)),
    "per_channel_cast": (lambda x: q.per_channel_cast(x, "e4m3", 128), (128, 256)),
    "per_channel_cast_and_transpose": (lambda x: q.per_channel_cast_and_transpose(x, "e4m3", 128), (128,)),
    "norm_backward": (lambda x: q.norm_backward(x, x, torch.linspace(0.5, 1.5, H, device="cuda").to(x.dtype),
                                                torch.full((x.shape[0],), 0.5, device="cuda")), (1, 7, 256)),
    "transpose": (lambda x: tr.transpose(x), (64, 128)),
    "batched_transpose": (lambda x: tr.batched_transpose(x.view(1, *x.shape)), (64,)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("op,t", [(op, t) for op in sorted(OPS) for t in OPS[op][1]], ids=str)
def test_misaligned_input_equals_aligned_copy(op, t):
    fn = OPS[op][0]
    x = _misaligned((t, H))
    got = fn(x)
    torch.cuda.synchronize()
    _same(got, fn(x.clone()))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7])
def test_per_token_cast_and_cast_back_misaligned_in_place(t):
    x = _misaligned((t, H))
    y = x.clone()
    q.per_token_cast_and_cast_back(x, "e4m3", 128, round_sf=True)
    q.per_token_cast_and_cast_back(y, "e4m3", 128, round_sf=True)
    torch.cuda.synchronize()
    assert torch.equal(x, y)


def _misaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """The same values at a data pointer 1 byte past a 16-byte boundary (a contiguous view)."""
    flat = torch.empty(t.numel() * t.element_size() + 1, dtype=torch.uint8, device=t.device)
    out = flat[1:].view(t.dtype).view(t.shape) if t.element_size() == 1 else None
    if out is None:  # wider elements: an element-sized offset
        flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        out = flat[1:].view(t.shape)
    out.copy_(t)
    assert out.is_contiguous() and out.data_ptr() % 16
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 256])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_per_token_cast_back_misaligned_data(fmt, t):
    x = (torch.randn(t, H, device="cuda") * 3).to(torch.bfloat16)
    data, sf = q.per_token_cast(x, fmt, 128)
    got = q.per_token_cast_back((_misaligned_copy(data), sf), "bf16", 128)
    torch.cuda.synchronize()
    _same(got, q.per_token_cast_back((data, sf), "bf16", 128))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("offset", [1, 4, 8])
@pytest.mark.parametrize("out_block", [(128, 128), (1, 128)], ids=str)
def test_per_block_cast_lossless_misaligned_data(out_block, offset, t):
    """Packed e2m1 data 1, 4 or 8 bytes past a 16-byte boundary (the kernel loads 4-byte words: the launcher
    copies only the first): the same bits as the aligned data."""
    x = (torch.randn(t, H, device="cuda") * 3).to(torch.bfloat16)
    data, sf = q.per_token_cast(x, "e2m1", 32, None, False, True, False)
    flat = torch.empty(data.numel() + offset, dtype=torch.int8, device="cuda")
    moved = flat[offset:].view(data.shape)
    moved.copy_(data)
    assert moved.is_contiguous() and moved.data_ptr() % 16 == offset
    got = q.per_block_cast_lossless((moved, sf), "e4m3", (1, 32), out_block, True, True, True)
    torch.cuda.synchronize()
    _same(got, q.per_block_cast_lossless((data, sf), "e4m3", (1, 32), out_block, True, True, True))
