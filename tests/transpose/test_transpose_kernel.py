"""Kernel tiers for transpose / batched_transpose (quant.md 3.15): compile (sm_90) and gpu (bitwise vs torch).

GPU tests go through the public ops, so they also cover the CUDA dispatch, the eager launch, the custom op
under ``torch.compile`` and CUDA-graph capture. Outputs are poisoned (0xFF bytes: NaN in every tested
dtype, never produced by the random inputs) before each run, so an unwritten element fails the comparison.
"""
import re

import pytest
import torch

from tilefuse import _jit
from tilefuse.transpose import _kernel as K
from tilefuse.transpose import batched_transpose, transpose
from tests.quant.kernel_binding import fake_jit

HIDDEN = (576, 2048, 2560, 3072, 4096, 6144, 7168)
DTYPES = (torch.float8_e4m3fn, torch.bfloat16, torch.float32)


@pytest.mark.compile
@pytest.mark.parametrize("cfg", K._configs(), ids=str)
def test_builds_for_sm90_with_16_byte_accesses(cfg):
    src = _jit.compile_kernel("batched_transpose", cfg, "sm_90").get_kernel_source()
    assert "__global__" in src
    # every global and shared access is a 16-byte vector: no scalar X[...] / Y[...] / tile[...] element access
    assert re.search(r"\*\(int4\*\)\(X \+", src) and re.search(r"\*\(int4\*\)\(Y \+", src)
    assert re.search(r"\*\(int4\*\)\(tile \+", src)
    assert not re.search(r"(?<![\w*(])(X|Y|tile)\[(?!\])", src)



@pytest.mark.compile
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,width", [(0, 0), (0, 64), (0, 4), (3, 0), (3, 64), (3, 4)], ids=str)
def test_launcher_binds_kernel_parameters(dtype, b, width, monkeypatch):
    """2-D (``b == 0``) and batched inputs, contiguous or row-strided views (16-byte-multiple strides passed as
    they are, others through a copy): the int32-word views fit the kernel, sizes counted in words."""
    m, n = 64, 192
    calls = fake_jit(monkeypatch)
    x = torch.randn((max(b, 1), m, n + width)).to(dtype)[:, :, :n]
    out = K.batched_transpose_launch(x) if b else K.transpose_launch(x[0])
    assert out.shape == ((b, n, m) if b else (n, m))
    size = x.element_size()
    stride = n + width if (n + width) * size % 16 == 0 else n
    words = lambda k: k * size // 4  # noqa: E731
    assert [(c.name, c.cfg) for c in calls] == [("batched_transpose", (size,))]
    env = calls[0].env
    assert (env["batch"], env["rows_words"], env["cols_words"], env["row_stride_words"]) == (
        max(b, 1), words(m), words(n), words(stride))


def _rand(shape, dtype):
    return (torch.randn(shape, device="cuda") * 4).to(dtype)


def _bits(t):
    return t.flatten().view(torch.uint8)


def _poisoned(fn, *args):
    """Run ``fn`` with the caching allocator's free memory filled with 0xFF, so a fresh output starts poisoned."""
    torch.cuda.synchronize()
    free = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    free.fill_(0xFF)
    del free
    out = fn(*args)
    torch.cuda.synchronize()
    return out


def _assert_bitwise(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", (0, 64, 4032, 8064))
@pytest.mark.parametrize("n", HIDDEN)
def test_transpose_strided_rows(dtype, m, n):
    x = _rand((m, 2 * n), dtype)[:, :n]  # row stride 2N, as in the spec's tests
    _assert_bitwise(_poisoned(transpose, x), x.t().contiguous())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b", (1, 8))
@pytest.mark.parametrize("m,n", ((4032, 576), (64, 7168), (8064, 2048), (192, 64)))
def test_batched_transpose(dtype, b, m, n):
    x = _rand((b, m, n), dtype)
    _assert_bitwise(_poisoned(batched_transpose, x), x.transpose(1, 2).contiguous())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ((0, 64, 64), (3, 0, 128), (3, 128, 0), (0, 0, 0)))
def test_empty_inputs(shape):
    x = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    out = batched_transpose(x)
    assert out.shape == (shape[0], shape[2], shape[1]) and out.is_cuda


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float8_e4m3fn))
def test_batched_row_strided_view(dtype):
    x = _rand((4, 256, 640), dtype)[:, :, :512]  # batch stride M * row stride, as the spec assumes
    _assert_bitwise(_poisoned(batched_transpose, x), x.transpose(1, 2).contiguous())


@pytest.mark.gpu
@pytest.mark.parametrize("make", [
    lambda: _rand((128, 1024 + 4), torch.bfloat16)[:, 4:4 + 512],        # pointer 8 bytes off 16
    lambda: _rand((128, 516), torch.float8_e4m3fn)[:, :512],               # row stride 516 bytes
    lambda: _rand((2, 192, 320), torch.float32).transpose(0, 1)[:, :, :256].transpose(0, 1),  # odd batch stride
], ids=("ptr", "row_stride", "batch_stride"))
def test_unaligned_views_fall_back_correctly(make):
    x = make()
    if x.dim() == 2:
        _assert_bitwise(_poisoned(transpose, x), x.t().contiguous())
    else:
        _assert_bitwise(_poisoned(batched_transpose, x), x.transpose(1, 2).contiguous())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float64, torch.int16, torch.uint8, torch.int32))
def test_other_dtypes(dtype):
    x = (torch.randn(2, 128, 192, device="cuda") * 100).to(dtype)
    _assert_bitwise(batched_transpose(x), x.transpose(1, 2).contiguous())


@pytest.mark.gpu
def test_keeps_signed_zero_and_nan_payloads():
    x = torch.randint(-2**31, 2**31 - 1, (1, 128, 64), dtype=torch.int32, device="cuda").view(torch.float32)
    x[0, 0, :8] = torch.tensor([-0.0, float("nan"), float("-inf"), 0.0, 1e-45, -1e-45, 3.0, -3.0])
    _assert_bitwise(batched_transpose(x), x.transpose(1, 2).contiguous())


@pytest.mark.gpu
def test_matches_cpu_path():
    x = _rand((3, 192, 320), torch.bfloat16)
    _assert_bitwise(batched_transpose(x).cpu(), batched_transpose(x.cpu()))


@pytest.mark.gpu
def test_deterministic():
    x = _rand((8, 1024, 2048), torch.float8_e4m3fn)
    _assert_bitwise(batched_transpose(x), batched_transpose(x))


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager():
    x = _rand((8, 1024, 2048), torch.bfloat16)
    x2d = _rand((4032, 2 * 576), torch.float8_e4m3fn)[:, :576]
    eager, eager2d = batched_transpose(x), transpose(x2d)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, captured2d = batched_transpose(x), transpose(x2d)
    captured.view(torch.uint8).fill_(0xFF)
    captured2d.view(torch.uint8).fill_(0xFF)
    graph.replay()
    torch.cuda.synchronize()
    _assert_bitwise(captured, eager)
    _assert_bitwise(captured2d, eager2d)
    x.copy_(_rand(x.shape, x.dtype))  # replay reads the captured input's current contents
    graph.replay()
    torch.cuda.synchronize()
    _assert_bitwise(captured, x.transpose(1, 2).contiguous())


@pytest.mark.gpu
def test_torch_compile_fullgraph_equals_eager():
    torch._dynamo.reset()
    x = _rand((8, 1024, 2048), torch.bfloat16)
    x2d = _rand((4032, 2 * 576), torch.float8_e4m3fn)[:, :576]
    _assert_bitwise(torch.compile(batched_transpose, fullgraph=True)(x), batched_transpose(x))
    _assert_bitwise(torch.compile(transpose, fullgraph=True)(x2d), transpose(x2d))
    # inside a larger graph, between inductor kernels (exact elementwise ops, so eager must match bitwise)
    fn = torch.compile(lambda t: batched_transpose(-t)[:, ::2].float() * 2, fullgraph=True)
    _assert_bitwise(fn(x), (-x).transpose(1, 2)[:, ::2].float() * 2)


@pytest.mark.gpu
def test_no_allocation_beyond_output():
    x = _rand((8, 1024, 2048), torch.bfloat16)
    batched_transpose(x)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = batched_transpose(x)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base == out.untyped_storage().nbytes()
