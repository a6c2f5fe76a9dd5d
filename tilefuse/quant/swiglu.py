"""Public fused SwiGLU + cast ops (quant.md 3.11-3.14, v1 signatures)."""
from __future__ import annotations

import torch

from tilefuse import _check
from tilefuse import formats as F
from tilefuse._registry import public
from tilefuse.reference import quant as _quant_ref
from tilefuse.quant import _swiglu_kernel as _K
from tilefuse.reference import swiglu as _ref

__all__ = [
    "swiglu_forward_and_per_token_cast",
    "swiglu_backward_and_per_token_cast",
    "swiglu_forward_and_per_channel_cast_and_transpose",
]


def _check_x(op: str, x, dtypes, hidden_multiple: int) -> int:
    """``x`` contiguous 2-D ``(T, 2H)``; returns ``H``."""
    _check.tensor(op, "x", x, dtype=dtypes, ndim=2, contiguous=True)
    if not (x.size(1) % 2 == 0 and (x.size(1) // 2) % hidden_multiple == 0 and x.size(1) > 0):
        _check.fail(op, f"x must have shape (T, 2H) with H % {hidden_multiple} == 0, got shape {tuple(x.shape)}")
    return x.size(1) // 2


def _check_clamp(op: str, value, name: str = "swiglu_clamp_value") -> None:
    if not (value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))):
        _check.fail(op, f"{name} must be None or a float, got {type(value).__name__}", TypeError)


@public("quant", path="kernel")
def swiglu_forward_and_per_token_cast(
    x: torch.Tensor, fmt: str, num_per_channels: int, pos_to_token_topk: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None, pos_to_expert: torch.Tensor | None = None,
    use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False, use_packed_ue8m0: bool = False,
    swiglu_clamp_value: float | None = None, clamped_count: torch.Tensor | None = None,
    sf_clamp_min: float | None = None,
):
    """SwiGLU of ``x`` ``(T_e, 2H)`` (times the routing weight) quantized per token to e4m3 with groups of
    ``num_per_channels``: ``(out (T_e, H), out_sf)`` in the chosen sf layout (quant.md 3.12).

    Rows with ``pos_to_expert < 0`` are skipped: their output is unspecified (computed with weight 0 here)
    and they do not count in ``clamped_count`` (int64 ``(3,)``, added in place). ``sf_clamp_min`` overrides
    the amax clamp (default 1e-4).
    """
    op = "swiglu_forward_and_per_token_cast"
    h = _check_x(op, x, (torch.bfloat16, torch.float32), 128)
    t_e = x.size(0)
    _check.choice(op, "fmt", fmt, ("e4m3",))
    _check.integer(op, "num_per_channels", num_per_channels)
    if num_per_channels not in (128, h):
        _check.fail(op, f"num_per_channels must be 128 or H ({h}), got {num_per_channels}")
    col, packed = use_tma_aligned_col_major_sf, use_packed_ue8m0
    _check.expect(not col or num_per_channels == 128, op,
                  "use_tma_aligned_col_major_sf requires num_per_channels == 128")
    _check.expect(not packed or (col and round_sf), op,
                  "use_packed_ue8m0 requires use_tma_aligned_col_major_sf and round_sf")
    _check.optional(op, "pos_to_token_topk", pos_to_token_topk, dtype=torch.int32, shape=(t_e,), contiguous=True,
                    device=x.device)
    _check.optional(op, "topk_weights", topk_weights, dtype=torch.float32, ndim=2, contiguous=True,
                    device=x.device)
    _check.expect((pos_to_token_topk is None) == (topk_weights is None), op,
                  "topk_weights and pos_to_token_topk must be given together")
    _check.optional(op, "pos_to_expert", pos_to_expert, dtype=torch.int32, shape=(t_e,), contiguous=True,
                    device=x.device)
    _check_clamp(op, swiglu_clamp_value)
    _check.optional(op, "clamped_count", clamped_count, dtype=torch.int64, shape=(3,), contiguous=True,
                    device=x.device)
    _check.expect(clamped_count is None or swiglu_clamp_value is not None, op,
                  "clamped_count requires swiglu_clamp_value")
    if not (sf_clamp_min is None or (isinstance(sf_clamp_min, (int, float)) and not isinstance(sf_clamp_min, bool)
                                     and sf_clamp_min >= F.FMT_MAX["e4m3"] * 2.0 ** -126)):
        _check.fail(op, f"sf_clamp_min must be None or a float >= 448 * 2^-126, got {sf_clamp_min!r}")
    args = (x, fmt, num_per_channels, pos_to_token_topk, topk_weights, pos_to_expert, col, round_sf, packed,
            swiglu_clamp_value, clamped_count, sf_clamp_min)
    if x.is_cuda:
        return _K.swiglu_forward_and_per_token_cast_cuda(*args)
    return swiglu_forward_and_per_token_cast_reference(*args)


def swiglu_forward_and_per_token_cast_reference(x, fmt, num_per_channels, pos_to_token_topk=None, topk_weights=None,
                                                pos_to_expert=None, use_tma_aligned_col_major_sf=False,
                                                round_sf=False, use_packed_ue8m0=False, swiglu_clamp_value=None,
                                                clamped_count=None, sf_clamp_min=None):
    """What ``swiglu_forward_and_per_token_cast`` returns (and adds to ``clamped_count``), computed by the
    reference on any device (no validation)."""
    act = _ref.swiglu_forward(x, pos_to_token_topk, topk_weights, swiglu_clamp_value)
    if clamped_count is not None:
        rows = None if pos_to_expert is None else pos_to_expert >= 0
        clamped_count += _ref.clamp_counts(x, swiglu_clamp_value, rows)
    return _quant_ref.cast(act, fmt, (1, num_per_channels), round_sf=round_sf,
                           use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
                           use_packed_ue8m0=use_packed_ue8m0, clamp_min=sf_clamp_min)


@public("quant", path="kernel")
def swiglu_backward_and_per_token_cast(
    x, grad_out: torch.Tensor, weight: torch.Tensor, pos_to_token_topk: torch.Tensor,
    token_topk_to_pos: torch.Tensor, num_per_channels: int, round_sf: bool = False,
    swiglu_clamp_value: float | None = None,
):
    """SwiGLU backward from a per-token e4m3 pair (quant.md 3.13).

    Returns ``(out, (x_grad_fp8, x_grad_fp8_sf), x_grad, weight_grad)``: the recomputed weighted
    activation (bf16 ``(T_e, H)``), the per-token ``(1, npc)`` e4m3 cast (row-major fp32 sf) of the binary32
    gradient ``[dx, dy]``, that gradient in bf16 ``(T_e, 2H)``, and fp32 ``weight_grad`` of ``weight``'s shape.
    """
    op = "swiglu_backward_and_per_token_cast"
    if not (isinstance(x, (tuple, list)) and len(x) == 2):
        _check.fail(op, f"x must be a (data, sf) pair, got {type(x).__name__}", TypeError)
    data, sf = x
    _check.tensor(op, "x[0]", data, dtype=torch.float8_e4m3fn, ndim=(2, 3), contiguous=True)
    width = data.size(-1)
    t_e = data.numel() // width if width else 0
    _check.integer(op, "num_per_channels", num_per_channels)
    _check.choice(op, "num_per_channels", num_per_channels, (32, 128))
    if not (width > 0 and width % (2 * num_per_channels) == 0):
        _check.fail(op, f"x[0] must have a last dim 2H with 2H % (2 * num_per_channels) == 0, got shape "
                        f"{tuple(data.shape)}")
    h = width // 2
    _check.tensor(op, "x[1]", sf, dtype=torch.float32, shape=(t_e, width // num_per_channels), contiguous=True,
                  device=data.device)
    _check.tensor(op, "grad_out", grad_out, dtype=torch.bfloat16, device=data.device)
    if not (grad_out.dim() >= 1 and grad_out.size(-1) == h and grad_out.numel() == t_e * h):
        _check.fail(op, f"grad_out must be viewable as ({t_e}, {h}), got shape {tuple(grad_out.shape)}")
    _check.tensor(op, "weight", weight, dtype=torch.float32, ndim=2, contiguous=True, device=data.device)
    _check.tensor(op, "pos_to_token_topk", pos_to_token_topk, dtype=torch.int32, shape=(t_e,), contiguous=True,
                  device=data.device)
    _check.tensor(op, "token_topk_to_pos", token_topk_to_pos, dtype=torch.int32, shape=tuple(weight.shape),
                  contiguous=True, device=data.device)
    _check_clamp(op, swiglu_clamp_value)
    if data.is_cuda:
        return _K.swiglu_backward_and_per_token_cast_cuda(x, grad_out, weight, pos_to_token_topk, token_topk_to_pos,
                                                          num_per_channels, round_sf, swiglu_clamp_value)

    out, x_grad, weight_grad = _ref.swiglu_backward((data.reshape(t_e, width), sf), grad_out.reshape(t_e, h),
                                                    weight, pos_to_token_topk, token_topk_to_pos, num_per_channels,
                                                    swiglu_clamp_value)
    fp8 = _quant_ref.cast(x_grad, "e4m3", (1, num_per_channels), round_sf=round_sf)
    return out.to(torch.bfloat16), fp8, x_grad.to(torch.bfloat16), weight_grad


@public("quant", path="kernel")
def swiglu_forward_and_per_channel_cast_and_transpose(
    x: torch.Tensor, fmt: str, num_per_tokens: int, round_sf: bool = False, without_transpose: bool = False,
    swiglu_clamp_value: float | None = None,
):
    """SwiGLU of bf16 ``x`` ``(T, 2H)`` rounded to bf16, quantized per channel with blocks ``(npt, 1)``
    (quant.md 3.14): ``(out, out_sf)`` with e4m3 ``out`` ``(H, T)`` (``(T, H)`` if ``without_transpose``)
    and row-major fp32 ``out_sf`` ``(T / npt, H)``."""
    op = "swiglu_forward_and_per_channel_cast_and_transpose"
    _check_x(op, x, torch.bfloat16, 64)
    _check.choice(op, "fmt", fmt, ("e4m3",))
    _check.integer(op, "num_per_tokens", num_per_tokens)
    _check.choice(op, "num_per_tokens", num_per_tokens, (32, 128))
    if x.size(0) % 128 != 0:
        _check.fail(op, f"x must have T % 128 == 0, got shape {tuple(x.shape)}")
    _check_clamp(op, swiglu_clamp_value)
    if x.is_cuda:
        return _K.swiglu_forward_and_per_channel_cast_and_transpose_cuda(x, fmt, num_per_tokens, round_sf,
                                                                         without_transpose, swiglu_clamp_value)
    act = _ref.swiglu_forward(x, swiglu_clamp_value=swiglu_clamp_value).to(torch.bfloat16)
    data, sf = _quant_ref.cast(act, "e4m3", (num_per_tokens, 1), round_sf=round_sf)
    return (data if without_transpose else data.T.contiguous()), sf
