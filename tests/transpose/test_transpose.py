"""transpose / batched_transpose (quant.md 3.15): bitwise copies with the upstream shape rules."""
import pytest
import torch

from tilefuse.transpose import batched_transpose, transpose

DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8]


def _rand(shape, dtype):
    x = torch.randn(shape) * 10
    return x.to(torch.int8) if dtype == torch.int8 else x.to(dtype)


def _bits(t):
    """Raw bytes, so -0.0 and NaN payloads are compared too."""
    return t.contiguous().view(torch.uint8)


def test_transpose_hand_loop():
    x = torch.arange(64 * 128, dtype=torch.float32).reshape(64, 128)
    out = transpose(x)
    assert out.shape == (128, 64) and out.is_contiguous()
    for i in range(0, 64, 7):
        for j in range(0, 128, 11):
            assert out[j, i].item() == i * 128 + j


@pytest.mark.parametrize("dtype", DTYPES)
def test_transpose_bitwise(dtype):
    x = _rand((128, 64), dtype)
    out = transpose(x)
    assert out.dtype == dtype and out.shape == (64, 128) and out.is_contiguous()
    assert out.data_ptr() != x.data_ptr()
    assert torch.equal(_bits(out), _bits(x.T))


def test_transpose_keeps_signed_zero_and_nan():
    x = torch.randn(64, 64)
    x[0, 1], x[2, 3] = -0.0, float("nan")
    out = transpose(x)
    assert torch.equal(_bits(out), _bits(x.T))
    assert torch.signbit(out[1, 0]) and torch.isnan(out[3, 2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_transpose_row_strided_view(dtype):
    big = _rand((64, 256), dtype)
    view = big[:, :128]  # stride(0) = 2N
    assert view.stride() == (256, 1)
    assert torch.equal(_bits(transpose(view)), _bits(transpose(view.contiguous())))
    assert torch.equal(_bits(transpose(view)), _bits(view.T))


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_transpose_bitwise(dtype):
    x = _rand((3, 64, 192), dtype)
    out = batched_transpose(x)
    assert out.shape == (3, 192, 64) and out.is_contiguous() and out.dtype == dtype
    for b in range(3):
        assert torch.equal(_bits(out[b]), _bits(x[b].T))


@pytest.mark.parametrize("shape", [(0, 64, 64), (2, 0, 64), (2, 64, 0)])
def test_batched_transpose_empty(shape):
    out = batched_transpose(torch.empty(shape, dtype=torch.bfloat16))
    assert out.shape == (shape[0], shape[2], shape[1]) and out.dtype == torch.bfloat16


def test_transpose_zero_rows():
    out = transpose(torch.empty(0, 128))
    assert out.shape == (128, 0)


def test_transpose_errors():
    with pytest.raises(ValueError, match="x must be 2-D"):
        transpose(torch.randn(1, 64, 64))
    with pytest.raises(ValueError, match="x must have both matrix dims divisible by 64"):
        transpose(torch.randn(64, 100))
    with pytest.raises(ValueError, match="x must have a unit stride"):
        transpose(torch.randn(128, 64).T)
    with pytest.raises(ValueError, match="x must have a row stride divisible by 4"):
        transpose(torch.randn(64, 66)[:, :64])
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        transpose([[1.0]])


def test_batched_transpose_errors():
    with pytest.raises(ValueError, match="x must be 3-D"):
        batched_transpose(torch.randn(64, 64))
    with pytest.raises(ValueError, match="divisible by 64"):
        batched_transpose(torch.randn(2, 32, 64))


@pytest.mark.parametrize("fn,shape", [(batched_transpose, (2, 64, 128)), (transpose, (128, 64))])
def test_traces_under_torch_compile_fullgraph(fn, shape):
    """Validation and dispatch trace without graph breaks (the GPU tier runs the custom-op path)."""
    torch._dynamo.reset()
    x = _rand(shape, torch.bfloat16)
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    assert torch.equal(_bits(compiled(x)), _bits(fn(x)))
