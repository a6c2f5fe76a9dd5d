"""Kernel tiers of ``engram_hash`` (engram.md §2.2): compile (sm_90 builds of every config the tests use, the
generated CUDA run on the CPU, the launcher's binding without a GPU) and gpu (the spec's grid against the reference,
poisoned outputs, determinism, batch invariance, CUDA graphs, torch.compile).

Tolerance: none. The hash is integer arithmetic (wrapping int64 products, XOR, floor remainder, wrapping int32 add),
so every output is compared with ``engram_hash_ref`` bit for bit (``assert_equal``: dtype, shape, strides, bytes).
"""
import pytest
import torch

from tilefuse import _jit
from tilefuse import engram as E
from tilefuse.engram import _hash_kernel as K
from tilefuse.reference import engram_hash_ref, make_offsets
from tilefuse.testing import assert_equal
from tests.engram import kernel_emulation as emu
from tests.engram.configs_hash import HASH_NLK, hash_configs
from tests.moe.poison import is_poison, poison_outputs
from tests.quant.kernel_binding import fake_jit

TOKENS = (0, 1, 7, 4001, 8192)
SIZES = ("spec", "small", "wrap")  # table sizes: the spec's [1e5, 1e6); 1..9; near 2^31 (offsets wrap in int32)


def _inputs(t, n, layers, k, sizes="spec", full_range=False):
    """ids in [-5, 1e5) and multipliers in [-2^62, 2^62) (the spec's measured ranges), or every int32 / int64 value
    with ``full_range``; offsets by ``make_offsets``."""
    if full_range:
        ids = torch.randint(-(2**31), 2**31 - 1, (t, n), dtype=torch.int32)
        mults = torch.randint(-(2**63), 2**63 - 1, (layers, n), dtype=torch.int64)
    else:
        ids = torch.randint(-5, 100_000, (t, n), dtype=torch.int32)
        mults = torch.randint(-(2**62), 2**62, (layers, n), dtype=torch.int64)
    low, high = {"spec": (100_000, 1_000_000), "small": (1, 10), "wrap": (2**30, 2**31 - 1)}[sizes]
    vocab = torch.randint(low, high, (layers, n - 1, k), dtype=torch.int32)
    return ids, mults, vocab, make_offsets(vocab)


def _cuda(args):
    return [a.cuda() for a in args]


# ---- compile tier ----

def _all_configs():
    registered = [("engram_hash", cfg) for cfg in _jit._FACTORIES["engram_hash"][1]()]
    return sorted(set(hash_configs()) | set(registered))


@pytest.mark.compile
@pytest.mark.parametrize("name, cfg", _all_configs(), ids=str)
def test_builds_for_sm90(name, cfg):
    """Integer-only code, one runtime 64-bit remainder a thread, uint64 products, no shared memory or atomics."""
    src = _jit.compile_kernel(name, cfg, "sm_90").get_kernel_source()
    assert "__global__" in src and "atomic" not in src and "__shared__" not in src and "float" not in src
    assert "(uint64_t)" in src and src.count("% v[0]") == 1


@pytest.mark.compile
def test_registered_config_is_the_bench_shape():
    assert list(_jit._FACTORIES["engram_hash"][1]()) == [(3, 2, 8)]
    assert (3, 2, 8) in HASH_NLK


@pytest.mark.compile
@pytest.mark.skipif(not emu.HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("nlk", HASH_NLK, ids=str)
def test_generated_source_on_the_cpu(nlk, tmp_path):
    """The kernel's CUDA source run on the CPU: every output written (poisoned first) and equal to the reference bit
    for bit, for the spec's ranges, full-range ids and multipliers, small / wrapping / negative table sizes (the floor
    remainder takes the divisor's sign) and token counts that leave a partial CTA."""
    n, layers, k = nlk
    run = emu.build(_jit.compile_kernel("engram_hash", nlk, "sm_90").get_kernel_source(), "engram_hash_kernel",
                    K.THREADS, tmp_path)
    cases = [(t, sizes, False) for t in (1, 7, 300) for sizes in SIZES] + [(131, "spec", True), (131, "wrap", True)]
    for t, sizes, full in cases:
        ids, mults, vocab, offs = _inputs(t, n, layers, k, sizes, full)
        if sizes == "small":
            vocab[0, 0, 0] = -7  # defined by the formula (the spec calls only V = 0 undefined)
            vocab[-1, -1, -1] = 1
        out = torch.full((layers, t, (n - 1) * k), 0x5A5A5A5A, dtype=torch.int32)
        run(dict(IDS=ids, MULT=mults, SIZES=vocab, OFFS=offs, OUT=out, num_tokens=t),
            (-(-t * (n - 1) * k // K.THREADS), layers))
        assert_equal(out, engram_hash_ref(ids, mults, vocab, offs))


@pytest.mark.compile
def test_launcher_binds_its_arguments(monkeypatch):
    calls = fake_jit(monkeypatch)
    for n, layers, k in HASH_NLK:
        ids, mults, vocab, offs = _inputs(9, n, layers, k)
        K.hash_launch(ids, mults, vocab, offs, K.hash_alloc(ids, vocab))
    assert [(c.name, c.cfg, c.env["num_tokens"]) for c in calls] == [("engram_hash", nlk, 9) for nlk in HASH_NLK]


def test_empty_launches_nothing(monkeypatch):
    calls = fake_jit(monkeypatch)
    ids, mults, vocab, offs = _inputs(0, 3, 2, 8)
    out = K.hash_alloc(ids, vocab)
    K.hash_launch(ids, mults, vocab, offs, out)
    assert calls == [] and out.shape == (2, 0, 16)


def test_kernel_takes_cuda_with_a_nonempty_row():
    ids, _, vocab, _ = _inputs(4, 3, 2, 8)
    assert not K.takes(ids, vocab)  # CPU keeps the reference
    meta_ids, meta_vocab = ids.to("meta"), vocab.to("meta")
    assert not K.takes(meta_ids, meta_vocab)


# ---- gpu tier ----

@pytest.mark.gpu
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("nlk", HASH_NLK, ids=str)
def test_grid_bitwise(nlk, t, sizes, monkeypatch):
    poison_outputs(monkeypatch, K)
    args = _inputs(t, *nlk, sizes)
    got = E.engram_hash(*_cuda(args))
    assert_equal(got.cpu(), engram_hash_ref(*args))
    assert not is_poison(got).any() or t == 0


@pytest.mark.gpu
@pytest.mark.parametrize("nlk", HASH_NLK, ids=str)
def test_full_range_and_one_column_each_n(nlk, monkeypatch):
    """Every int32 id and int64 multiplier (products wrap), and tables of size 1 (index = offset)."""
    poison_outputs(monkeypatch, K)
    args = list(_inputs(4001, *nlk, "spec", full_range=True))
    args[2][:, :, 0] = 1
    args[3] = make_offsets(args[2])
    assert_equal(E.engram_hash(*_cuda(args)).cpu(), engram_hash_ref(*args))


@pytest.mark.gpu
def test_deterministic_and_batch_invariant():
    args = _cuda(_inputs(8192, 3, 2, 8))
    full = E.engram_hash(*args)
    assert_equal(E.engram_hash(*args), full)
    for sl in (slice(0, 1), slice(3, 4004), slice(8191, 8192)):
        assert_equal(E.engram_hash(args[0][sl].contiguous(), *args[1:]), full[:, sl].contiguous())


@pytest.mark.gpu
def test_cuda_graph_replay():
    args = _cuda(_inputs(4001, 3, 2, 8))
    E.engram_hash(*args)  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = E.engram_hash(*args)
    new = _inputs(4001, 3, 2, 8)
    for a, b in zip(args, new):
        a.copy_(b)
    out.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert_equal(out.cpu(), engram_hash_ref(*new))


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    cpu = _inputs(4001, 4, 3, 2)
    compiled = torch.compile(lambda *a: E.engram_hash(*a) + 1, fullgraph=True)
    got = compiled(*_cuda(cpu))
    assert_equal(got.cpu(), engram_hash_ref(*cpu) + 1)


@pytest.mark.gpu
def test_one_column_keeps_the_reference():
    """N = 1 gives an empty index row: no kernel, the reference's empty ``(L, T, 0)`` output."""
    ids = torch.randint(0, 100, (7, 1), dtype=torch.int32)
    mults = torch.randint(0, 100, (2, 1), dtype=torch.int64)
    vocab = torch.randint(1, 10, (2, 0, 8), dtype=torch.int32)
    args = (ids, mults, vocab, torch.zeros((2, 0), dtype=torch.int32))
    assert not K.takes(ids.cuda(), vocab.cuda())
    assert_equal(E.engram_hash(*_cuda(args)).cpu(), engram_hash_ref(*args))
