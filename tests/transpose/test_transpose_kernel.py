"""Kernel tiers for transpose / batched_transpose (quant.md 3.15): compile (sm_90) and gpu (bitwise vs torch)."""
import pytest
import torch

from tilefuse import _jit
from tilefuse.transpose import _kernel as K
from tilefuse.testing import assert_equal

HIDDEN = (576, 2048, 2560, 3072, 4096, 6144, 7168)
DTYPES = (torch.float8_e4m3fn, torch.bfloat16, torch.float32)


@pytest.mark.compile
@pytest.mark.parametrize("cfg", K._configs(), ids=str)
def test_builds_for_sm90(cfg):
    src = _jit.compile_kernel("batched_transpose", cfg, "sm_90").get_kernel_source()
    assert "__global__" in src


def _rand(shape, dtype):
    x = torch.randn(shape, device="cuda") * 4
    return x.to(dtype)


def _poison_run(fn, *args):
    free = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    free.fill_(0xFF)
    del free
    out = fn(*args)
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", (0, 64, 4032, 8064))
@pytest.mark.parametrize("n", HIDDEN)
def test_transpose_strided_rows(dtype, m, n):
    big = _rand((m, 2 * n), dtype)
    x = big[:, :n]
    got = _poison_run(K.transpose_launch, x)
    assert_equal(got, x.t().contiguous())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b", (1, 8))
@pytest.mark.parametrize("m,n", ((4032, 576), (64, 7168), (8064, 2048)))
def test_batched_transpose(dtype, b, m, n):
    x = _rand((b, m, n), dtype)
    got = _poison_run(K.batched_transpose_launch, x)
    assert_equal(got, x.transpose(1, 2).contiguous())


@pytest.mark.gpu
def test_unaligned_view_falls_back_correctly():
    big = _rand((128, 1024 + 4), torch.bfloat16)
    x = big[:, 4:4 + 512]  # 8-byte offset pointer: not 16-byte aligned
    assert_equal(_poison_run(K.transpose_launch, x), x.t().contiguous())


@pytest.mark.gpu
def test_deterministic_graph_and_compile():
    x = _rand((8, 1024, 2048), torch.bfloat16)
    eager = K.batched_transpose_launch(x)
    assert_equal(K.batched_transpose_launch(x), eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = K.batched_transpose_launch(x)
    captured.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert_equal(captured, eager)
    compiled = torch.compile(lambda t: K.batched_transpose_cuda(t) , fullgraph=True)
    assert_equal(compiled(x), eager)
    compiled2 = torch.compile(lambda t: K.transpose_cuda(t), fullgraph=True)
    assert_equal(compiled2(x[0]), eager[0])


@pytest.mark.gpu
def test_no_allocation_beyond_output():
    x = _rand((8, 1024, 2048), torch.bfloat16)
    K.batched_transpose_launch(x)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = K.batched_transpose_launch(x)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= -(-out.untyped_storage().nbytes() // (2 << 20)) * (2 << 20)
