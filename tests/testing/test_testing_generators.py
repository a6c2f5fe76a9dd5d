"""tilefuse.testing generators, poison_ and time_ms."""
import pytest
import torch

from tilefuse.testing import (e5m6_special_inputs, poison_, rand_bf16_with_outliers, rand_wide_range,
                              random_topk_idx, random_topk_weights, time_ms)

# With p = 0.25 masking over 4096 slots, the masked fraction has sd ~0.007 (minus the forced keeps).
MASK_FRACTION_TOL = 0.05


def test_rand_bf16_with_outliers_shape_seed_and_outliers():
    x = rand_bf16_with_outliers(64, 256, outlier_fraction=0.05, outlier_scale=100.0, seed=3)
    assert x.shape == (64, 256) and x.dtype == torch.bfloat16
    assert torch.equal(x, rand_bf16_with_outliers(64, 256, outlier_fraction=0.05, outlier_scale=100.0, seed=3))
    assert not torch.equal(x, rand_bf16_with_outliers(64, 256, outlier_fraction=0.05, outlier_scale=100.0, seed=4))
    big = (x.float().abs() > 8).float().mean().item()  # N(0,1) alone exceeds 8 with probability ~1e-15
    assert 0.02 < big < 0.08
    none = rand_bf16_with_outliers(64, 256, outlier_fraction=0.0, seed=3)
    assert none.float().abs().max() < 8
    assert rand_bf16_with_outliers(0, 16).shape == (0, 16)
    assert rand_bf16_with_outliers(2, 8, dtype=torch.float32).dtype == torch.float32


def test_generators_use_the_global_rng_without_seed():
    torch.manual_seed(7)
    a = rand_bf16_with_outliers(4, 32)
    torch.manual_seed(7)
    assert torch.equal(a, rand_bf16_with_outliers(4, 32))
    state = torch.get_rng_state()
    rand_bf16_with_outliers(4, 32, seed=1)
    assert torch.equal(state, torch.get_rng_state())  # a seeded call leaves the global RNG alone


def test_rand_wide_range_spans_binades_and_is_finite():
    x = rand_wide_range((128, 128), seed=0)
    assert x.dtype == torch.float32 and torch.isfinite(x).all()
    e = torch.log2(x[x != 0].abs())
    assert e.min() < -90 and e.max() > 110
    assert x.abs().max() <= torch.finfo(torch.float32).max / 8
    narrow = rand_wide_range((64, 64), min_exp=3, max_exp=3, seed=0)
    assert torch.equal(narrow, (torch.randn(64, 64, generator=torch.Generator().manual_seed(0),
                                            dtype=torch.float64) * 8).float())
    with pytest.raises(ValueError, match="min_exp"):
        rand_wide_range((2,), min_exp=2, max_exp=1)


def test_random_topk_idx_structure():
    idx = random_topk_idx(512, 16, 8, masked_fraction=0.25, seed=11)
    assert idx.shape == (512, 8) and idx.dtype == torch.int64
    assert ((idx >= -1) & (idx < 16)).all()
    assert (idx >= 0).any(dim=1).all()  # no row is entirely -1
    for row in idx.tolist():
        real = [v for v in row if v >= 0]
        assert len(real) == len(set(real))  # distinct experts per row
    assert abs((idx == -1).float().mean().item() - 0.25) < MASK_FRACTION_TOL
    full = random_topk_idx(64, 8, 8, masked_fraction=0.0, seed=1)
    assert torch.equal(full.sort(dim=1).values, torch.arange(8).expand(64, 8))
    assert torch.equal(idx, random_topk_idx(512, 16, 8, masked_fraction=0.25, seed=11))
    assert random_topk_idx(0, 8, 2).shape == (0, 2)
    all_masked = random_topk_idx(32, 8, 3, masked_fraction=1.0, seed=2)
    assert ((all_masked >= 0).sum(dim=1) == 1).all()


def test_random_topk_idx_rejects_bad_topk():
    with pytest.raises(ValueError, match="num_topk"):
        random_topk_idx(4, 4, 5)
    with pytest.raises(ValueError, match="num_topk"):
        random_topk_idx(4, 4, 0)


def test_random_topk_weights():
    w = random_topk_weights(100, 6, seed=5)
    assert w.shape == (100, 6) and w.dtype == torch.float32
    assert ((w >= 0) & (w < 1)).all() and w.std() > 0.2
    assert torch.equal(w, random_topk_weights(100, 6, seed=5))


def test_e5m6_special_inputs():
    cases = list(e5m6_special_inputs(4, 16, seed=0))
    assert [special for _, special in cases] == [False, True, True, True]
    assert cases[0][0].std() > 0.5
    for (x, _), value in zip(cases[1:], (2.0 ** -20, 2.0 ** -14 * 63 / 64, 2.0 ** -14)):
        assert (x[:, :-1] == value).all() and (x[:, -1] == 65024.0).all()
    assert next(e5m6_special_inputs(2, 8, dtype=torch.bfloat16))[0].dtype == torch.bfloat16


def test_poison_fills_every_byte():
    f = poison_(torch.zeros(3, 5))
    assert torch.isnan(f).all()
    i = poison_(torch.zeros(4, dtype=torch.int32))
    assert (i == -1).all()
    b = poison_(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert torch.isnan(b.float()).all()


def test_poison_writes_only_the_view():
    storage = torch.zeros(2, 8)
    view = storage.t()[:5]  # a TMA-style column-major view over the first 5 of 8 columns
    poison_(view)
    assert torch.isnan(storage[:, :5]).all()
    assert (storage[:, 5:] == 0).all()


def test_time_ms_calls_warmup_plus_iters():
    calls = []
    ms = time_ms(lambda: calls.append(1), warmup=2, iters=5)
    assert len(calls) == 7 and ms >= 0.0
    with pytest.raises(ValueError, match="iters"):
        time_ms(lambda: None, iters=0)
