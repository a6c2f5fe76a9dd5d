"""Reference casts: cast, cast_back, E5M6, per-channel fused cast (quant.md sections 1-3).

Plain PyTorch, binary32 throughout, in the spec's order of operations. Formats, the scale rule and the sf
layouts come from ``tilefuse.formats``. Choices where the spec leaves room (all documented in quant.md):

* pre-quantized pairs use the *kernel* multiplication order (section 1.6): order A
  ``data * (sf_in * sf_inv)`` for blocks with ``bk != 1``, order B ``(data * sf_in) * sf_inv`` for
  per-channel blocks (``bk == 1``);
* block maxima follow the kernels' IEEE ``fmax`` (section 1.7/9.2): NaN elements are ignored, a +-inf
  element gives ``sf = inf, sf_inv = 0``; NaNs produced by quantization encode as positive NaN / +6;
* packed UE8M0 without col gives the (v2) row-major packed int32 layout.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .. import _check
from .. import formats as F

__all__ = ["cast", "cast_back", "cast_to_e5m6", "cast_back_from_e5m6", "per_channel_cast_fused"]


# ---------------------------------------------------------------------------------------------------------
# Block helpers
# ---------------------------------------------------------------------------------------------------------

def block_amax(v: torch.Tensor, bm: int, bk: int) -> torch.Tensor:
    """fp32 ``[T, W]`` -> ``[cdiv(T,bm), cdiv(W,bk)]`` maxima of ``|v|`` over each block's real elements.

    Padding counts as -1 (never the max); NaN elements are ignored like the kernels' ``fmax``.
    """
    T, W = v.shape
    a = v.abs()
    a = torch.where(torch.isnan(a), torch.full_like(a, -1.0), a)
    nbm, nbk = F.cdiv(T, bm), F.cdiv(W, bk)
    a = torch.nn.functional.pad(a, (0, nbk * bk - W, 0, nbm * bm - T), value=-1.0)
    return a.view(nbm, bm, nbk, bk).amax(dim=(1, 3))


def expand_blocks(sf: torch.Tensor, bm: int, bk: int, T: int, W: int) -> torch.Tensor:
    """Repeat a per-block grid ``[nbm, nbk]`` over its blocks and crop to ``[T, W]``."""
    return sf.repeat_interleave(bm, dim=0).repeat_interleave(bk, dim=1)[:T, :W]


def _pair_parts(x, x_block_size: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor | None, str | None]:
    """Split a cast input into (binary32 data values, expanded sf_in or None, data format or None)."""
    if isinstance(x, torch.Tensor):
        if x_block_size is not None:
            raise ValueError("cast: x_block_size is only for a (data, sf) pair")
        return x.float(), None, None
    if not (isinstance(x, (tuple, list)) and len(x) == 2):
        raise TypeError(f"cast: x must be a tensor or a (data, sf) pair, got {type(x).__name__}")
    if x_block_size is None:
        raise ValueError("cast: a (data, sf) pair x requires x_block_size")
    return _decode_pair(x, x_block_size, "cast")


def _decode_pair(x, block_size: Sequence[int], op: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(data, sf)`` with e4m3 or packed e2m1 data -> (binary32 data values, sf expanded over its blocks,
    data format)."""
    data, sf = x
    fmt = F.fmt_of(data)
    if fmt not in ("e4m3", "e2m1"):
        raise TypeError(f"{op}: data must be float8_e4m3fn or int8 (packed e2m1), got {data.dtype}")
    vals = F.dequantize(data, fmt)
    T, W = vals.shape
    bm, bk = block_size
    return vals, expand_blocks(F.load_sf(sf, F.cdiv(W, bk)), bm, bk, T, W), fmt


def _empty_sf(nbk: int, col: bool, packed: bool, device) -> torch.Tensor:
    return F.store_sf(torch.empty(0, nbk, dtype=torch.float32, device=device), col, packed)


# ---------------------------------------------------------------------------------------------------------
# cast / cast_back (section 2.1, 2.2)
# ---------------------------------------------------------------------------------------------------------

def cast(
    x,
    fmt: str,
    block_size: Sequence[int] = (32, 32),
    sf: torch.Tensor | None = None,
    x_block_size: Sequence[int] | None = None,
    round_sf: bool = False,
    use_tma_aligned_col_major_sf: bool = False,
    use_packed_ue8m0: bool = False,
    *,
    clamp_min: float | None = None,
):
    """Block quantization of a bf16/fp32 ``(T, W)`` tensor or a pre-quantized ``(data, sf_in)`` pair
    (section 2.1). Returns ``(data, sf)``, or only ``data`` when ``sf`` is given (precomputed mode).

    ``data`` is float8_e4m3fn ``(T, W)`` or packed int8 e2m1 ``(T, W/2)``; the sf is stored in the layout of
    the flags (``formats.store_sf``). ``clamp_min`` overrides the format's default amax clamp.
    """
    if fmt not in ("e4m3", "e2m1"):
        raise ValueError(f"cast: fmt must be 'e4m3' or 'e2m1', got {fmt!r}")
    v, sf_in, _ = _pair_parts(x, x_block_size)
    T, W = v.shape
    if fmt == "e2m1" and W % 2:
        raise ValueError(f"cast: e2m1 needs an even width, got {W}")
    bm, bk = block_size
    nbm, nbk = F.cdiv(T, bm), F.cdiv(W, bk)
    deq = v if sf_in is None else v * sf_in  # the values every amax sees (section 1.6)

    if sf is not None:
        if use_tma_aligned_col_major_sf or use_packed_ue8m0:
            raise ValueError("cast: a given sf cannot be combined with col or packed output flags")
        if sf.dim() != 2 or tuple(sf.shape) != (nbm, nbk):
            raise ValueError(f"cast: sf must have shape {(nbm, nbk)}, got {tuple(sf.shape)}")
        sf_vals = sf.float()
        sf_inv = torch.reciprocal(sf_vals)
        sf_inv = torch.where(sf_vals == 0, torch.zeros_like(sf_inv), sf_inv)
    else:
        sf_vals, sf_inv = F.scale_from_amax(block_amax(deq, bm, bk), fmt, round_sf, clamp_min)

    sf_inv_e = expand_blocks(sf_inv, bm, bk, T, W)
    if sf_in is None:
        data = F.quantize(v, sf_inv_e, fmt)
    elif bk == 1:
        data = F.quantize(deq, sf_inv_e, fmt)  # order B
    else:
        data = F.quantize(v, sf_in * sf_inv_e, fmt)  # order A
    if sf is not None:
        return data
    return data, F.store_sf(sf_vals, use_tma_aligned_col_major_sf, use_packed_ue8m0)


def _round_out(v: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "fp32":
        return v
    if fmt == "bf16":
        return v.to(torch.bfloat16)
    raise ValueError(f"cast_back: fmt must be 'bf16' or 'fp32', got {fmt!r}")


def cast_back(x, fmt: str, block_size: Sequence[int] = (32, 32)) -> torch.Tensor:
    """Dequantize ``(data, sf)`` (section 2.2): ``round_fmt(decode(data) * sf_expanded)``.

    data is float8_e4m3fn ``(T, W)`` or packed int8 e2m1 ``(T, W/2)``; sf in any section 1.5 layout.
    """
    vals, sf, _ = _decode_pair(x, block_size, "cast_back")
    return _round_out(vals * sf, fmt)


# ---------------------------------------------------------------------------------------------------------
# E5M6 (section 2.3)
# ---------------------------------------------------------------------------------------------------------

def cast_to_e5m6(
    x: torch.Tensor,
    num_per_channels: int,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
):
    """Per-token E5M6 quantization with groups ``(1, num_per_channels)`` (section 2.3).

    Returns ``(uint8 (T, 3H/2) packed codes, sf in the flags' layout)``; M = 65024, clamp 1e-4.
    """
    T, H = x.shape
    if H % num_per_channels or H % 8:
        raise ValueError(f"cast_to_e5m6: x must have hidden % num_per_channels == 0 and % 8 == 0, got shape {(T, H)}")
    v = x.float()
    sf, sf_inv = F.scale_from_amax(block_amax(v, 1, num_per_channels), "e5m6", round_sf)
    data = F.quantize(v, expand_blocks(sf_inv, 1, num_per_channels, T, H), "e5m6")
    return data, F.store_sf(sf, use_tma_aligned_col_major_sf, use_packed_ue8m0)


def cast_back_from_e5m6(x, fmt: str, x_block_size: Sequence[int]) -> torch.Tensor:
    """Dequantize ``(uint8 packed E5M6 (T, 3H/2), sf)``: decode, times the expanded sf, rounded to fmt."""
    data, sf = x
    vals = F.dequantize(data, "e5m6")
    T, H = vals.shape
    bm, bk = x_block_size
    sf_vals = F.load_sf(sf, F.cdiv(H, bk))
    return _round_out(vals * expand_blocks(sf_vals, bm, bk, T, H), fmt)


# ---------------------------------------------------------------------------------------------------------
# Per-channel fused cast (section 3.10)
# ---------------------------------------------------------------------------------------------------------

def per_channel_cast_fused(
    x,
    num_per_tokens: int,
    num_per_channels: int | None = None,
    round_sf: bool = False,
    pos_to_token: torch.Tensor | None = None,
):
    """Optional row gather (negative ``pos_to_token`` entries are zero rows, with sf 0 for pairs), then
    the e4m3 cast with block ``(num_per_tokens, 1)``; pairs carry per-token sf ``(1, num_per_channels)``.

    Returns e4m3 ``(T_out, H)`` and row-major fp32 ``(cdiv(T_out, num_per_tokens), H)``.
    """
    is_pair = not isinstance(x, torch.Tensor)
    if pos_to_token is not None:
        src = x[0] if is_pair else x
        T = src.size(0)
        idx = pos_to_token.long()
        valid = (idx >= 0) & (T > 0)
        idx = idx.clamp(0, max(T - 1, 0))

        def gather(t: torch.Tensor) -> torch.Tensor:
            g = t.float()[idx] if T > 0 else t.float().new_zeros(idx.numel(), t.size(1))
            return torch.where(valid[:, None], g, torch.zeros_like(g)).to(t.dtype)

        x = (gather(x[0]), gather(x[1])) if is_pair else gather(x)
    x_block_size = (1, num_per_channels) if is_pair else None
    return cast(x, "e4m3", (num_per_tokens, 1), x_block_size=x_block_size, round_sf=round_sf)


# ---------------------------------------------------------------------------------------------------------
# Helpers of public ops that have no entry in the reference table
# ---------------------------------------------------------------------------------------------------------

def per_block_cast_lossless(x, x_block_size: Sequence[int], out_block_size: Sequence[int],
                            use_tma_aligned_col_major_sf: bool = False, use_packed_ue8m0: bool = False):
    """Exact FP4 (power-of-two sf) -> E4M3 re-encoding with coarser power-of-two sf (section 3.7).

    ``E_B = max(0, max_b e(b) - 6)`` per output block; ``out = e4m3(fp4 * 2^(e(b) - E_B))``;
    ``out_sf = 2^(E_B - 127)``. Raises ValueError where the kernel's device assertion
    ``e(b) + 5 >= E_B`` would fail.
    """
    data, sf_in = x
    vals = F.dequantize(data, "e2m1")
    T, W = vals.shape
    ibm, ibk = x_block_size
    obm, obk = out_block_size
    e_in = F.ue8m0_encode(F.load_sf(sf_in, F.cdiv(W, ibk))).to(torch.int32)  # biased exponent per input block
    e_elem = expand_blocks(e_in, ibm, ibk, T, W)
    # The max over input blocks of an output block = the max over its (real) elements' input blocks.
    nbm, nbk = F.cdiv(T, obm), F.cdiv(W, obk)
    padded = torch.nn.functional.pad(e_elem, (0, nbk * obk - W, 0, nbm * obm - T), value=-1)
    e_out = (padded.view(nbm, obm, nbk, obk).amax(dim=(1, 3)) - 6).clamp_min(0)
    shift = e_elem - expand_blocks(e_out, obm, obk, T, W)
    if T > 0:
        _check.has_data("per_block_cast_lossless", "x", data, "its exactness rule (e(b) + 5 >= E_B) is read on the host")
    if T > 0 and bool((shift < -5).any()):
        raise ValueError("per_block_cast_lossless: an input block exponent is more than 11 below the largest "
                         "exponent of its output block (e(b) + 5 < E_B); the re-encoding would not be exact")
    out = F.e4m3_encode(vals * torch.exp2(shift.float()))
    sf = F.ue8m0_decode(e_out.to(torch.uint8))
    return out, F.store_sf(sf, use_tma_aligned_col_major_sf, use_packed_ue8m0)


def per_token_cast_and_cast_back_values(x: torch.Tensor, fmt: str, num_per_channels: int,
                                        round_sf: bool = False, use_e4m3_sf: bool = False) -> torch.Tensor:
    """Section 5.8: ``round_{x.dtype}(decode(narrow(x * sf_inv)) * sf)`` with groups ``(1, npc)``."""
    T, H = x.shape
    v = x.float()
    sf, sf_inv = F.scale_from_amax(block_amax(v, 1, num_per_channels), fmt, round_sf, use_e4m3_sf=use_e4m3_sf)
    q = F.quantize(v, expand_blocks(sf_inv, 1, num_per_channels, T, H), fmt)
    return (F.dequantize(q, fmt) * expand_blocks(sf, 1, num_per_channels, T, H)).to(x.dtype)
