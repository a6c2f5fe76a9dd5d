"""tilefuse.testing comparators: assert_equal, calc_diff, check_bias, count_bytes, clear_unused_sf."""
import pytest
import torch

from tilefuse.testing import assert_equal, calc_diff, check_bias, clear_unused_sf, count_bytes

# calc_diff against an independent float64 formulation: both are float64 sums of O(1) terms over at
# most 10^4 elements, so they agree to far better than this.
CALC_DIFF_RTOL = 1e-9


# ---- assert_equal ------------------------------------------------------------------------------

def test_assert_equal_passes_on_identical_tensors():
    x = torch.randn(5, 7)
    assert_equal(x, x.clone())
    b = torch.randn(3, 4).to(torch.bfloat16)
    assert_equal(b, b.clone())
    f8 = torch.randn(4, 8).to(torch.float8_e4m3fn)
    assert_equal(f8, f8.clone())
    m = torch.rand(6) < 0.5
    assert_equal(m, m.clone())


def test_assert_equal_is_bitwise_for_nan_and_signed_zero():
    nan = torch.tensor([float("nan"), 1.0])
    assert_equal(nan, nan.clone())  # same NaN bits compare equal
    with pytest.raises(AssertionError, match="differ"):
        assert_equal(torch.tensor([0.0]), torch.tensor([-0.0]))


def test_assert_equal_message_lists_coordinates_and_values():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    y = x.clone()
    y[1, 2] = 100.0
    y[2, 0] = -3.5
    with pytest.raises(AssertionError) as info:
        assert_equal(x, y)
    msg = str(info.value)
    assert "2 of 12 elements differ" in msg
    assert "(1, 2): 6.0 vs 100.0" in msg
    assert "(2, 0): 8.0 vs -3.5" in msg


def test_assert_equal_message_is_bounded_for_many_mismatches():
    x = torch.zeros(100)
    with pytest.raises(AssertionError) as info:
        assert_equal(x, x + 1)
    msg = str(info.value)
    assert "100 of 100 elements differ" in msg
    assert "and 90 more" in msg
    assert msg.count(" vs ") == 10


def test_assert_equal_reports_fp8_values():
    x = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
    y = torch.tensor([1.0, 3.0]).to(torch.float8_e4m3fn)
    with pytest.raises(AssertionError, match=r"\(1,\): 2.0 vs 3.0"):
        assert_equal(x, y)


def test_assert_equal_checks_dtype_optionally():
    x = torch.tensor([1.0, 2.5])
    with pytest.raises(AssertionError, match="dtype"):
        assert_equal(x, x.double())
    assert_equal(x, x.double(), check_dtype=False)
    with pytest.raises(AssertionError, match="differ"):
        assert_equal(x + 1e-3, x.double(), check_dtype=False)


def test_assert_equal_checks_shape_optionally():
    x = torch.randn(2, 6)
    with pytest.raises(AssertionError, match="shape"):
        assert_equal(x, x.reshape(3, 4))
    assert_equal(x, x.reshape(3, 4), check_shape=False, check_stride=False)
    with pytest.raises(AssertionError, match="count"):
        assert_equal(x, x[:, :5], check_shape=False, check_stride=False)


def test_assert_equal_checks_strides_except_when_empty():
    x = torch.randn(4, 3)
    col_major = x.t().contiguous().t()  # same values, strides (1, 4)
    with pytest.raises(AssertionError, match="stride"):
        assert_equal(col_major, x)
    assert_equal(col_major, x, check_stride=False)
    assert_equal(torch.empty(0, 3), torch.empty(3, 0).t())


def test_assert_equal_checks_device_always():
    x = torch.zeros(3)
    with pytest.raises(AssertionError, match="device"):
        assert_equal(x, torch.zeros(3, device="meta"), check_stride=False)


def test_assert_equal_rejects_non_tensors():
    with pytest.raises(TypeError, match="tensors"):
        assert_equal([1.0], torch.tensor([1.0]))


# ---- calc_diff ---------------------------------------------------------------------------------

def test_calc_diff_hand_computed():
    # sum (x-y)^2 = 16, sum x^2 + y^2 = 9 + 16 + 9 + 0 = 34
    assert calc_diff(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0])) == pytest.approx(16 / 34, rel=1e-15)
    assert calc_diff(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == 1.0
    x = torch.randn(50)
    assert calc_diff(x, -x) == pytest.approx(2.0, rel=1e-15)
    assert calc_diff(x, x) == 0.0


def test_calc_diff_matches_the_v1_formula_and_is_symmetric_and_scale_invariant():
    x = torch.randn(64, 32)
    y = x + 0.1 * torch.randn(64, 32)
    xd, yd = x.double(), y.double()
    v1 = float(1 - 2 * (xd * yd).sum() / (xd * xd + yd * yd).sum())
    d = calc_diff(x, y)
    assert 0 < d < 0.05
    assert d == pytest.approx(v1, rel=CALC_DIFF_RTOL)
    assert calc_diff(y, x) == pytest.approx(d, rel=CALC_DIFF_RTOL)
    assert calc_diff(x * 8, y * 8) == pytest.approx(d, rel=CALC_DIFF_RTOL)


def test_calc_diff_all_zero_and_mixed_dtypes():
    assert calc_diff(torch.zeros(10), torch.zeros(10)) == 0.0
    assert calc_diff(torch.zeros(0), torch.zeros(0)) == 0.0
    x = torch.randn(100)
    d = calc_diff(x, x.bfloat16())
    assert 0 < d < 1e-4  # bf16 rounding: relative error <= 2^-9 per element, squared


# ---- check_bias --------------------------------------------------------------------------------

def test_check_bias_accepts_round_to_nearest():
    ref = torch.randn(100_000)
    check_bias(ref.bfloat16(), ref)
    check_bias(torch.empty(0), torch.empty(0))


def test_check_bias_rejects_one_sided_rounding():
    ref = torch.randn(10_000) * 10
    with pytest.raises(AssertionError, match="biased"):
        check_bias(torch.floor(ref), ref)
    with pytest.raises(AssertionError, match="biased"):
        check_bias(torch.ceil(ref), ref)


def test_check_bias_threshold_and_ties():
    # n = 10^4: bound 10/sqrt(n) = 0.1; p = fraction below + half the ties.
    ref = torch.zeros(10_000)
    below = torch.zeros(10_000)
    below[:5999] = -1.0
    below[5999:] = 1.0
    check_bias(below, ref)  # p = 0.5999
    below[5999] = -1.0
    below[6000] = -1.0
    with pytest.raises(AssertionError):
        check_bias(below, ref)  # p = 0.6001
    ties = torch.zeros(10_000)
    ties[:1500] = -1.0  # p = (1500 + 8500/2) / 10^4 = 0.575 only if ties count one half
    check_bias(ties, ref)


# ---- count_bytes -------------------------------------------------------------------------------

def test_count_bytes_recurses_and_skips_none():
    a = torch.empty(3, 4, dtype=torch.bfloat16)  # 24
    b = torch.empty(2)  # 8
    c = torch.empty(5, dtype=torch.float8_e4m3fn)  # 5
    d = torch.empty(1, dtype=torch.int32)  # 4
    assert count_bytes(a) == 24
    assert count_bytes(a, b, None, ((c, [d]),)) == 41
    assert count_bytes() == 0
    assert count_bytes(torch.empty(0, 7)) == 0
    assert count_bytes(a.t()) == 24


def test_count_bytes_rejects_other_types():
    with pytest.raises(TypeError, match="count_bytes"):
        count_bytes(torch.empty(1), 3)


# ---- clear_unused_sf ---------------------------------------------------------------------------

def test_clear_unused_sf_zeroes_padding_bytes_of_packed_sf():
    # hidden 640 / 128 channels per block = 5 blocks -> 2 int32 words, bytes 5..7 are padding
    sf = torch.randint(-2**31, 2**31 - 1, (3, 2), dtype=torch.int32)
    before = sf.clone()
    out = clear_unused_sf(sf, 640, 128)
    raw = sf.view(torch.uint8)  # little-endian: block 4j+u is byte u of word j
    assert out.dtype == torch.uint8 and out.shape == (3, 8)
    assert torch.equal(out[:, :5], raw[:, :5])
    assert torch.equal(out[:, 5:], torch.zeros(3, 3, dtype=torch.uint8))
    assert torch.equal(sf, before)  # the input is not modified


def test_clear_unused_sf_reads_tma_col_major_layout():
    rows, words = 5, 2
    sf = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32)
    storage = torch.zeros(words, 8, dtype=torch.int32)  # (words, align(rows, 4))
    storage[:, :rows] = sf.t()
    col_major = storage.t()[:rows]
    assert col_major.stride() == (1, 8)
    assert torch.equal(clear_unused_sf(col_major, 6 * 32, 32), clear_unused_sf(sf, 6 * 32, 32))


def test_clear_unused_sf_keeps_unpadded_and_fp32_sf():
    packed = torch.randint(-2**31, 2**31 - 1, (4, 2), dtype=torch.int32)
    assert torch.equal(clear_unused_sf(packed, 1024, 128), packed.view(torch.uint8))  # 8 blocks, no padding
    sf = torch.rand(4, 5)
    assert torch.equal(clear_unused_sf(sf, 576, 128), sf.view(torch.uint8))  # 576 / 128 -> 5 blocks
    assert clear_unused_sf(torch.empty(0, 2, dtype=torch.int32), 640, 128).shape == (0, 8)


def test_clear_unused_sf_rejects_wrong_width():
    with pytest.raises(ValueError, match="sf must have 2 columns"):
        clear_unused_sf(torch.zeros(3, 3, dtype=torch.int32), 640, 128)
    with pytest.raises(ValueError, match="sf must be 2-D"):
        clear_unused_sf(torch.zeros(3, dtype=torch.int32), 640, 128)
