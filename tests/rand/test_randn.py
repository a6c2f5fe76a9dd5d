"""tilefuse.rand (rand.md): the bits of ``torch.randn``, generator state included.

Reference tier (CPU, and CUDA where present): argument parsing (rand.md 2.1), equality with torch.randn and
the generator state afterwards (6.1-6.3), randn_like (3), set_seed (4), statistics (11), and every error of
rand.md 10 leaves the generator untouched. GPU tier: the properties rand.md derives from PyTorch's CUDA kernel
(6.4-6.7; they document torch, not our code), graph capture and torch.compile."""
import numpy as np
import pytest
import torch

from tilefuse import rand

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
S_MAX_H200 = 270_336  # rand.md 5.2: 256 threads x min(blocks, 132 SMs x 8)
SHAPES = [(), (0,), (0, 5), (1,), (7,), (3, 5, 7), (4001, 7)]


def _torch_draws(seed, device, *calls):
    """What torch gives for ``calls`` (each a (shape, dtype)) from ``manual_seed(seed)``, plus one more fp32 draw
    that shows where the generator ended."""
    torch.manual_seed(seed)
    out = [torch.randn(shape, dtype=dtype, device=device) for shape, dtype in calls]
    return out, torch.randn(16, device=device)


def _assert_bits(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
    assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8) if b.numel() else b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_equals_torch_randn_and_its_generator_state(device, shape, dtype):
    (want,), after = _torch_draws(11, device, (shape, dtype))
    for form in (shape, torch.Size(shape), list(shape)):
        rand.set_seed(11)
        got = rand.randn(form, dtype=dtype, device=device)
        _assert_bits(got, want)
        assert got.is_contiguous() and not got.requires_grad
        _assert_bits(torch.randn(16, device=device), after)
    rand.set_seed(11)
    _assert_bits(rand.randn(*shape, dtype=dtype, device=device), want)


@pytest.mark.parametrize("device", DEVICES)
def test_complex(device):
    (want,), after = _torch_draws(5, device, ((4, 3), torch.complex64))
    rand.set_seed(5)
    got = rand.randn(4, 3, dtype=torch.complex64, device=device)
    assert got.dtype == torch.complex64 and torch.equal(got, want)
    assert torch.equal(torch.randn(16, device=device), after)


@pytest.mark.parametrize("device", DEVICES)
def test_interleaves_with_other_torch_rng_calls(device):
    """rand.md 6.2: our calls and torch's share one generator, in program order."""
    rand.set_seed(7)
    ours = [rand.randn(5, device=device), torch.rand(3, device=device), rand.randn(2, 4, device=device),
            torch.randn(6, device=device)]
    torch.manual_seed(7)
    theirs = [torch.randn(5, device=device), torch.rand(3, device=device), torch.randn(2, 4, device=device),
              torch.randn(6, device=device)]
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_seed_reproduces_and_distinguishes(device):
    rand.set_seed(123)
    a = rand.randn(64, device=device)
    rand.set_seed(123)
    b = rand.randn(64, device=device)
    rand.set_seed(124)
    c = rand.randn(64, device=device)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert rand.ops.last_seed == 124


@pytest.mark.parametrize("device", DEVICES)
def test_only_numel_matters(device):
    """rand.md 6.3."""
    rand.set_seed(9)
    a = rand.randn(6, 35, device=device)
    rand.set_seed(9)
    assert torch.equal(a, rand.randn(210, device=device).view(6, 35))


@pytest.mark.parametrize("device", DEVICES)
def test_randn_like(device):
    base = torch.zeros(6, 10, dtype=torch.bfloat16, device=device)
    for x in (base, base.t(), base[:, ::2]):
        rand.set_seed(3)
        got = rand.randn_like(x)
        rand.set_seed(3)
        want = rand.randn(x.shape, dtype=x.dtype, device=x.device)
        assert got.is_contiguous() and got.shape == x.shape and got.dtype == x.dtype and got.device == x.device
        assert torch.equal(got, want)
    rand.set_seed(3)
    assert not rand.randn_like(torch.ones(3, device=device, requires_grad=True)).requires_grad


def test_numpy_integers_and_default_device():
    rand.set_seed(np.int64(4))
    a = rand.randn(np.int32(3), np.uint8(2))
    torch.manual_seed(4)
    want_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert a.device.type == want_device and torch.equal(a, torch.randn(3, 2, device=want_device))
    assert a.dtype == torch.get_default_dtype()


def test_seed_range_edges():
    for seed in (-(1 << 63), (1 << 64) - 1, 0):
        rand.set_seed(seed)
        a = rand.randn(4, device="cpu")
        torch.manual_seed(seed)
        assert torch.equal(a, torch.randn(4))


def test_statistics():
    """rand.md 11: n = 2^20 fp32 on CPU (the GPU tier repeats it on CUDA)."""
    _check_statistics(rand.randn(1 << 20, device="cpu"))


def _check_statistics(z):
    n = z.numel()
    z = z.double()
    assert torch.isfinite(z).all()
    assert abs(z.mean().item()) < 5 / n ** 0.5
    assert abs(z.var().item() - 1) < 5 * (2 / n) ** 0.5
    assert z.abs().max().item() < 6.8


BAD = [
    (lambda: rand.randn(2.0, 3), TypeError, "size"),
    (lambda: rand.randn(True, 3), TypeError, "size"),
    (lambda: rand.randn((2, 3), 4), TypeError, "size"),
    (lambda: rand.randn("3"), TypeError, "size"),
    (lambda: rand.randn(2, -1), ValueError, "size"),
    (lambda: rand.randn((2, -3)), ValueError, "size"),
    (lambda: rand.randn(2, dtype="float32"), TypeError, "dtype"),
    (lambda: rand.randn(2, dtype=torch.int32), TypeError, "dtype"),
    (lambda: rand.randn(2, dtype=torch.bool), TypeError, "dtype"),
    (lambda: rand.randn(2, dtype=torch.float8_e4m3fn), TypeError, "dtype"),
    (lambda: rand.randn(2, device="tpu"), ValueError, "device"),
    (lambda: rand.randn(2, device=-1), ValueError, "device"),
    (lambda: rand.randn(2, device=1.5), ValueError, "device"),
    (lambda: rand.randn_like([1.0, 2.0]), TypeError, "input"),
    (lambda: rand.randn_like(torch.zeros(3, dtype=torch.int64)), TypeError, "dtype"),
    (lambda: rand.set_seed(True), TypeError, "seed"),
    (lambda: rand.set_seed(1.0), TypeError, "seed"),
    (lambda: rand.set_seed("1"), TypeError, "seed"),
    (lambda: rand.set_seed(1 << 64), ValueError, "seed"),
    (lambda: rand.set_seed(-(1 << 63) - 1), ValueError, "seed"),
]


@pytest.mark.parametrize("call,exc,arg", BAD, ids=range(len(BAD)))
def test_errors_leave_the_generator_untouched(call, exc, arg):
    torch.manual_seed(21)
    state = torch.get_rng_state()
    with pytest.raises(exc, match=arg):
        call()
    assert torch.equal(torch.get_rng_state(), state)


# ---- GPU tier: the CUDA properties rand.md 6 derives from PyTorch's kernel (documenting torch) ----

@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, S_MAX_H200 - 1, S_MAX_H200, S_MAX_H200 + 1, 4 * S_MAX_H200 + 3])
def test_cuda_prefix_consistent(n):
    """rand.md 6.4: from one state, randn(n)[:k] == randn(k)."""
    rand.set_seed(17)
    full = rand.randn(n, device="cuda")
    for k in sorted({1, n // 2 + 1, n}):
        rand.set_seed(17)
        assert torch.equal(rand.randn(k, device="cuda"), full[:k])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_dtype_consistent(dtype):
    """rand.md 6.5: the half-precision draws are the fp32 draws rounded."""
    rand.set_seed(2)
    low = rand.randn(100_003, dtype=dtype, device="cuda")
    rand.set_seed(2)
    assert torch.equal(low, rand.randn(100_003, device="cuda").to(dtype))


@pytest.mark.gpu
def test_cuda_range_and_statistics():
    """rand.md 6.7 and 11: |z| < 6.764 and no -0 (z * 1 + 0 turns it into +0); mean and variance."""
    rand.set_seed(1)
    z = rand.randn(8192, 7168, device="cuda")
    assert z.abs().max().item() < 6.764
    assert not (torch.signbit(z) & (z == 0)).any()
    _check_statistics(rand.randn(1 << 20, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda", torch.device("cuda", 0), 0])
def test_cuda_device_forms(device):
    rand.set_seed(8)
    a = rand.randn(5, device=device)
    torch.manual_seed(8)
    assert a.device == torch.device("cuda", 0) and torch.equal(a, torch.randn(5, device="cuda:0"))


@pytest.mark.gpu
def test_cuda_graph_replays_draw_fresh_values():
    """rand.md 11: two replays of a captured randn give different finite values, and the generator ends where
    the same number of eager calls leaves it."""
    rand.set_seed(30)
    rand.randn(8, device="cuda")  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rand.randn(1000, device="cuda")
    rand.set_seed(30)
    rand.randn(8, device="cuda")
    graph.replay()
    first = out.clone()
    graph.replay()
    second = out.clone()
    assert torch.isfinite(first).all() and torch.isfinite(second).all() and not torch.equal(first, second)
    after_graph = torch.randn(16, device="cuda")
    rand.set_seed(30)
    rand.randn(8, device="cuda")
    e1, e2 = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    assert torch.equal(first, e1) and torch.equal(second, e2)
    assert torch.equal(after_graph, torch.randn(16, device="cuda"))


@pytest.mark.gpu
def test_torch_compile_runs():
    """rand.md 2.2: under torch.compile Inductor may use its own generator, so only shape and finiteness count."""
    fn = torch.compile(lambda x: x + rand.randn(x.shape, device=x.device), fullgraph=True)
    y = fn(torch.zeros(4, 8, device="cuda"))
    assert y.shape == (4, 8) and torch.isfinite(y).all()


# ---- the emulator of rand.md 8 (its Philox is the MoE reference's, whose known answers tests/moe checks) ----

def test_offset_advance_examples():
    """rand.md 5.7's worked figures on the H200."""
    from tests.rand._philox import offset_advance

    assert offset_advance(1, S_MAX_H200) == 4 and offset_advance(4 * S_MAX_H200, S_MAX_H200) == 4
    assert offset_advance(4 * S_MAX_H200 + 1, S_MAX_H200) == 8
    assert offset_advance(8192 * 7168, S_MAX_H200) == 220


@pytest.mark.gpu
def test_cuda_matches_the_emulator():
    """rand.md 8: sampled elements (below and beyond S_max) within 2e-5 of the emulator, and the generator's offset
    advanced by A(n). The CUDA generator state is read as the 64-bit seed followed by the 64-bit offset."""
    from tests.rand._philox import offset_advance, randn_f32

    props = torch.cuda.get_device_properties(0)
    s_max = props.multi_processor_count * (props.max_threads_per_multi_processor // 256) * 256
    rand.set_seed(0x1234_5678_9ABC)
    rand.randn(1000, device="cuda")  # a non-zero offset
    state = torch.cuda.get_rng_state().view(torch.int64)
    seed, offset = int(state[0]) & (2 ** 64 - 1), int(state[1])
    n = 4 * s_max + 3
    z = rand.randn(n, device="cuda").cpu().double().numpy()
    idx = np.unique(np.concatenate([np.arange(64), np.random.default_rng(0).integers(0, n, 4096), [n - 1]]))
    want = randn_f32(idx, seed, offset, s_max)
    assert np.abs(z[idx] - want).max() <= 2e-5
    assert int(torch.cuda.get_rng_state().view(torch.int64)[1]) == offset + offset_advance(n, s_max)
