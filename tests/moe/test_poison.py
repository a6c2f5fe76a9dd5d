"""The MoE tests' output poisoning (tests/moe/poison.py) fills the very buffers the launchers allocate, at any
size: the CPU part checks the helper and that it reaches a launcher's small outputs; the GPU part shows that an
element a kernel does not write stays poisoned, where freeing a poisoned block (the old way) cannot reach it."""
import pytest
import torch

from tilefuse import _jit
from tilefuse.moe import _count_kernel, _shuffle_kernel
from tests.moe.poison import fill_poison_, is_poison, poison_outputs

SIZES = [(), (0,), (1,), (3, 5), ((1 << 20) + 3,), (2, 1 << 19)]      # scalar to past the 1 MiB small-block pool
DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.int32, torch.uint8]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SIZES, ids=str)
def test_every_element_of_any_size_is_poisoned(shape, dtype):
    t = fill_poison_(torch.zeros(shape, dtype=dtype))
    assert is_poison(t).all() and is_poison(t).shape == t.shape
    want = 0xFF if dtype.is_floating_point else 0x5A
    assert (t.reshape(-1).view(torch.uint8) == want).all()
    if dtype.is_floating_point and t.numel():
        assert t.isnan().all()                                     # NaN: no comparison with a result passes
    if dtype in (torch.int64, torch.int32) and t.numel():
        assert (t > 2 ** 30).all()                                 # never an index, a count or -1


def test_strided_tensors_are_poisoned_element_by_element():
    base = torch.zeros(6, 8, dtype=torch.int32)
    view = base[:, ::2]
    fill_poison_(view)
    assert is_poison(view).all() and not is_poison(base[:, 1::2]).any()


def test_launcher_allocations_start_poisoned_and_the_rest_is_torch(monkeypatch):
    """On CPU, with a stand-in kernel that writes nothing: group_count's int32 (E,) output (a few bytes, served
    from the caching allocator's small pool on a GPU) reaches the kernel poisoned; torch.zeros stays zeros."""
    seen = []
    monkeypatch.setattr(_jit, "get", lambda name, cfg: lambda *args: seen.append((name, args)))
    poison_outputs(monkeypatch)
    assert _count_kernel.torch.zeros(3).eq(0).all() and _count_kernel.torch.int32 is torch.int32
    x = torch.randint(-1, 8, (5, 4))
    out = _count_kernel.group_count_cuda(x, 8)
    assert out.shape == (8,) and out.dtype == torch.int32 and is_poison(out).all()
    assert [name for name, _ in seen] == ["moe_count_partial", "moe_count_finish"] and seen[1][1][1] is out
    assert is_poison(seen[0][1][1]).all()                          # the partial buffer too
    monkeypatch.undo()
    assert _count_kernel.torch is torch and _shuffle_kernel.torch is torch


@pytest.mark.gpu
def test_an_unwritten_element_of_a_small_output_stays_poisoned(monkeypatch):
    """A 32-byte output: poisoned before the launch. A kernel that skips an element leaves the poison there, so the
    comparison fails; the real kernel overwrites it. (The conftest poisons every MoE GPU test this way.)"""
    x = torch.randint(-1, 8, (9, 4), device="cuda")
    real = _count_kernel.group_count_cuda(x, 8)
    assert not is_poison(real).any()
    launch = _jit.get

    def skipping(name, cfg):
        fn = launch(name, cfg)
        if name != "moe_count_finish":
            return fn
        return lambda part, out: fn(part[:, :7].contiguous(), out[:7])   # the finish pass writes 7 of 8 counts

    monkeypatch.setattr(_jit, "get", skipping)
    got = _count_kernel.group_count_cuda(x, 8)
    assert torch.equal(got[:7], real[:7]) and is_poison(got[7])
