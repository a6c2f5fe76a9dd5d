"""Shared helpers of the engram tests: exact rounding of rationals to fp32, independent of torch."""
from fractions import Fraction

import numpy as np
import pytest


def _round_f32(q: Fraction) -> float:
    """Round an exact rational to the nearest fp32 (ties to even), via numpy and exact comparisons."""
    f = np.float32(float(q))  # within one fp32 ulp of the answer
    candidates = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    best = min(candidates, key=lambda c: (abs(Fraction(float(c)) - q), int(np.array(c).view(np.int32)) & 1))
    return float(best)


@pytest.fixture
def round_f32():
    """``round_f32(q: Fraction) -> float``: the correctly rounded fp32 value of ``q``."""
    return _round_f32
