"""Seeded input generators for kernel tests (testing.md 2.7, adapted for small CPU shapes).

Every generator takes ``seed``: an int draws from a private ``torch.Generator`` (reproducible, leaves the
global RNG alone, identical on every device because values are drawn on the CPU and then moved), ``None``
draws from torch's global RNG (which the test suite seeds per test).
"""
from __future__ import annotations

from typing import Iterator

import torch

__all__ = [
    "make_generator",
    "rand_bf16_with_outliers",
    "rand_wide_range",
    "random_topk_idx",
    "random_topk_weights",
    "e5m6_special_inputs",
    "quant_adversarial",
    "every_bf16_in_groups",
    "poison_",
]

QUANT_FILLS = ("zero_blocks", "subnormal", "huge", "nan", "inf", "mixed")

# E5M6 landmarks (quant.md 1.3): min subnormal, max subnormal, min normal, max normal.
E5M6_MIN_SUBNORMAL = 2.0 ** -20
E5M6_MAX_SUBNORMAL = 2.0 ** -14 * 63 / 64
E5M6_MIN_NORMAL = 2.0 ** -14
E5M6_MAX = 65024.0
_FLT_MAX = torch.finfo(torch.float32).max


def make_generator(seed: int | None) -> torch.Generator | None:
    """A CPU generator seeded with ``seed``, or None (use the global RNG) when ``seed`` is None."""
    if seed is None:
        return None
    return torch.Generator().manual_seed(seed)


def rand_bf16_with_outliers(num_tokens: int, hidden: int, *, outlier_fraction: float = 1 / 64,
                            outlier_scale: float = 64.0, dtype: torch.dtype = torch.bfloat16,
                            seed: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Activations ``(num_tokens, hidden)``: N(0, 1) values, each independently an outlier (multiplied by
    ``outlier_scale``) with probability ``outlier_fraction``, the way LLM activations have a few large
    channels. Rounded to ``dtype`` (bf16 by default)."""
    g = make_generator(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    outliers = torch.rand(num_tokens, hidden, generator=g) < outlier_fraction
    x = torch.where(outliers, x * outlier_scale, x)
    return x.to(dtype).to(device)


def rand_wide_range(shape, *, min_exp: int = -110, max_exp: int = 126, dtype: torch.dtype = torch.float32,
                    seed: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Finite floats spanning many binades: ``randn * 2**e`` with an integer ``e`` uniform in
    ``[min_exp, max_exp]`` per element, clamped to ``+-FLT_MAX/8`` (never NaN or inf). Narrow the exponent
    range to bound the dynamic range inside a tensor (e.g. ``max_exp - min_exp <= 9`` for lossless
    FP4 -> FP8 tests)."""
    if min_exp > max_exp:
        raise ValueError(f"rand_wide_range: min_exp must be <= max_exp, got {min_exp} > {max_exp}")
    g = make_generator(seed)
    mantissa = torch.randn(shape, generator=g, dtype=torch.float64)
    exponent = torch.randint(min_exp, max_exp + 1, tuple(mantissa.shape), generator=g, dtype=torch.float64)
    x = (mantissa * torch.exp2(exponent)).clamp(-_FLT_MAX / 8, _FLT_MAX / 8)
    return x.to(dtype).to(device)


def random_topk_idx(num_tokens: int, num_experts: int, num_topk: int, *, masked_fraction: float = 0.25,
                    seed: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Routing decisions ``(num_tokens, num_topk)`` int64 as one EP rank receives them (moe.md 1.6).

    Each row holds ``num_topk`` distinct experts in ``[0, num_experts)`` in random order; each slot is
    then replaced by -1 ("not on this rank") with probability ``masked_fraction``, except that every row
    keeps at least one real expert.
    """
    if not 1 <= num_topk <= num_experts:
        raise ValueError(f"random_topk_idx: num_topk must be in [1, num_experts={num_experts}], got {num_topk}")
    g = make_generator(seed)
    idx = torch.rand(num_tokens, num_experts, generator=g).argsort(dim=1)[:, :num_topk]
    masked = torch.rand(num_tokens, num_topk, generator=g) < masked_fraction
    keep = torch.randint(0, num_topk, (num_tokens,), generator=g)
    masked[torch.arange(num_tokens), keep] = False
    return idx.masked_fill(masked, -1).to(device)


def random_topk_weights(num_tokens: int, num_topk: int, *, seed: int | None = None,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """Routing weights ``(num_tokens, num_topk)`` fp32, uniform in ``[0, 1)``."""
    return torch.rand(num_tokens, num_topk, generator=make_generator(seed)).to(device)


def e5m6_special_inputs(num_tokens: int, hidden: int, *, dtype: torch.dtype = torch.float32,
                        seed: int | None = None,
                        device: torch.device | str = "cpu") -> Iterator[tuple[torch.Tensor, bool]]:
    """Inputs for E5M6 casts as ``(tensor, is_special)`` pairs: one N(0, 1) tensor, then three constant
    tensors at the E5M6 min subnormal, max subnormal and min normal, each with its last column set to the
    E5M6 maximum 65024 (so the per-row scale is exactly 1)."""
    yield torch.randn(num_tokens, hidden, generator=make_generator(seed)).to(dtype).to(device), False
    for value in (E5M6_MIN_SUBNORMAL, E5M6_MAX_SUBNORMAL, E5M6_MIN_NORMAL):
        x = torch.full((num_tokens, hidden), value, dtype=dtype)
        x[:, -1] = E5M6_MAX
        yield x.to(device), True


def quant_adversarial(num_tokens: int, hidden: int, kind: str, *, dtype: torch.dtype = torch.bfloat16,
                      group: int = 128, seed: int | None = 0, device="cpu") -> torch.Tensor:
    """A ``(num_tokens, hidden)`` quantization input of one adversarial kind (quant.md 6.2's edge cases):

    - ``zero_blocks``: every third ``group``-column block all zero (the amax clamp decides the sf);
    - ``subnormal``: magnitudes around a quarter of the dtype's smallest normal;
    - ``huge``: magnitudes up to about half the dtype's maximum (sf far above 1, no overflow);
    - ``nan`` / ``inf``: a normal fill with about 1 element in 97 NaN (negative and positive) or +-inf;
    - ``mixed``: rows cycling through zeros, subnormals, e4m3/e2m1 maxima and their ties, and normal values.
    """
    g = make_generator(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    fin = torch.finfo(dtype)
    if kind == "zero_blocks":
        x[:, : hidden - hidden % group].view(num_tokens, -1, group)[:, ::3] = 0
    elif kind == "subnormal":
        x = x * (fin.tiny * 0.25)
    elif kind == "huge":
        x = x.clamp(-4, 4) * (fin.max / 8)
    elif kind in ("nan", "inf"):
        hit = torch.rand(num_tokens, hidden, generator=g) < 1 / 97
        sign = torch.where(torch.rand(num_tokens, hidden, generator=g) < 0.5, -1.0, 1.0)
        x = torch.where(hit, sign * (float("nan") if kind == "nan" else float("inf")), x)
    elif kind == "mixed":
        specials = torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 6.0, -6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25,
                                 fin.tiny, -fin.tiny * 0.5, 1e-30, 7.0, 480.0])
        idx = torch.randint(0, len(specials), (num_tokens, hidden), generator=g)
        x = torch.where(torch.arange(num_tokens)[:, None] % 3 == 0, specials[idx], x)
    else:
        raise ValueError(f"quant_adversarial: kind must be one of {QUANT_FILLS}, got {kind!r}")
    return x.to(dtype).to(device)


def every_bf16_in_groups(group: int = 128, device="cpu") -> torch.Tensor:
    """Every finite bf16 bit pattern of magnitude <= 6 (once each, in pattern order), in rows of ``group``
    whose first element is 6.0: per-token e2m1 casts of these rows have amax 6, sf exactly 1 (rounded or
    not) and so encode each pattern itself, through every tie of the E2M1 grid."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    vals = bits[bits.abs() <= 6.0]
    per_row = group - 1
    rows = -(-vals.numel() // per_row)
    body = torch.zeros(rows * per_row)
    body[: vals.numel()] = vals
    x = torch.cat((torch.full((rows, 1), 6.0), body.view(rows, per_row)), dim=1)
    return x.to(torch.bfloat16).to(device)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with 0xFF bytes (NaN for floats, -1 for signed ints) so that elements a kernel
    fails to write stand out; returns ``t``."""
    if t.is_contiguous():
        t.reshape(-1).view(torch.uint8).fill_(0xFF)
    else:
        t.copy_(poison_(torch.empty(t.shape, dtype=t.dtype, device=t.device)))
    return t
