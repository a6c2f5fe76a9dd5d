"""Public RMSNorm ops (quant.md 5.11): norm_forward, norm_forward_and_per_token_cast, norm_backward.

The CUDA shape rules of the spec (``0 < H <= 8192``, ``H % 16``, row strides in multiples of 16 elements)
are checked on every device, so code that runs on the CPU path also runs on the kernels.
"""
from __future__ import annotations

import math

import torch

from tilefuse import _check
from tilefuse import formats as F
from tilefuse._registry import public
from tilefuse.quant import _norm_kernel as _K
from tilefuse.reference import norm as _ref
from tilefuse.reference import quant as _quant_ref

__all__ = ["norm_forward", "norm_forward_and_per_token_cast", "norm_backward"]

_DTYPES = (torch.bfloat16, torch.float32)
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def _check_rows(op: str, name: str, t: torch.Tensor) -> None:
    """Unit last stride and every other stride (of dims longer than 1) a multiple of 16 elements."""
    _check.tensor(op, name, t, inner_contiguous=True)
    if not all(s % 16 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):  # (messages built on failure only)
        _check.fail(op, f"{name} must have strides that are multiples of 16 elements except the last, got {t.stride()}")


def _check_like(op: str, name: str, t, x: torch.Tensor, dtype=None) -> None:
    """An optional tensor with x's shape (and ``dtype``, default x's) on x's device, rows as ``_check_rows``."""
    if t is None:
        return
    _check.tensor(op, name, t, dtype=dtype or x.dtype, shape=tuple(x.shape), device=x.device)
    _check_rows(op, name, t)


def _check_hidden(op: str, x: torch.Tensor, multiple: int) -> int:
    h = x.size(-1)
    if not (0 < h <= 8192 and h % multiple == 0):
        _check.fail(op, f"x must have 0 < hidden <= 8192 and hidden % {multiple} == 0, got shape {tuple(x.shape)}")
    return h


def _check_scalar(op: str, name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        _check.fail(op, f"{name} must be a float, got {type(value).__name__}", TypeError)


def _eps_ok(eps) -> bool:
    """eps is a real number, finite and >= 0 (a negative one gives NaN rows where S / H < -eps)."""
    return isinstance(eps, (int, float)) and 0 <= eps < math.inf


def _check_forward(op: str, x, weight, eps, residual, out_scale, residual_out) -> None:
    """Checks shared by both forward ops (quant.md 5.11 inputs)."""
    _check.tensor(op, "x", x, dtype=_DTYPES, ndim=(2, 3))
    h = _check_hidden(op, x, 16)
    _check_rows(op, "x", x)
    _check.optional(op, "weight", weight, dtype=x.dtype, shape=(h,), contiguous=True, device=x.device)
    _check_scalar(op, "eps", eps)
    if not _eps_ok(eps):
        _check.fail(op, f"eps must be finite and >= 0, got {eps}")
    _check_scalar(op, "out_scale", out_scale)
    _check_like(op, "residual", residual, x)
    _check_like(op, "residual_out", residual_out, x)
    _check.expect(residual_out is None or residual is not None, op, "residual_out requires residual")


# Eager CUDA calls with a 2-D x and no residual (forward: no caller buffers) skip the checks once the same facts
# passed them (as the casts' _VALIDATED in cast.py): the key holds everything the checks read -- x's dtype,
# strides and hidden size and whether it has more than one row (row strides and a 1-D tensor's contiguity are
# checked only then), the weight's dtype, shape, strides and device (x's device beside it), the scalars' types,
# the flags and, for the backward, the same facts of out_grad, rstd and weight_grad (whether their shapes match
# x's) and whether eps is in range (its value is free). The token count is otherwise free.
_VALIDATED: set[tuple] = set()
_is_compiling = torch.compiler.is_compiling


def _eager_cuda(x: torch.Tensor) -> bool:
    """A CUDA tensor outside torch.compile's tracing (the CPU tests replace it to drive the fast paths)."""
    return x.is_cuda and not _is_compiling()


def _fast_key(op: str, x, weight, eps, out_scale, flags: tuple) -> tuple | None:
    """The ``_VALIDATED`` key of an eager CUDA call with a 2-D x, or None where the fast path does not apply."""
    if type(x) is not torch.Tensor or not _eager_cuda(x):
        return None
    shape = x.shape
    if len(shape) != 2:
        return None
    if weight is None:
        w = None
    elif type(weight) is torch.Tensor:
        w = (weight.dtype, weight.shape, weight.stride(), weight.device)
    else:
        return None
    return (op, x.dtype, x.device, x.stride(), shape[1], shape[0] > 1, w, type(eps), eps is None or _eps_ok(eps),
            type(out_scale), flags)


def _finish(x, h, rstd, residual, residual_out, with_rstd):
    """(rstd or None, norm_input): norm_input is residual_out (filled) with a residual, else x itself."""
    if residual is None:
        norm_input = x
    elif residual_out is None:
        norm_input = h
    else:
        norm_input = residual_out.copy_(h)
    return (rstd if with_rstd else None), norm_input


@public("quant", path="kernel")
def norm_forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None,
                 out_scale: float = 1.0, out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                 with_rstd: bool = False):
    """RMSNorm of ``x`` ``(T, H)`` or ``(B, T, H)`` in ``x.dtype``: ``(out, rstd, norm_input)`` (quant.md 5.11).

    ``rstd`` (fp32, ``x.shape[:-1]``) is returned only ``with_rstd`` (else None); ``norm_input`` is
    ``residual_out = round(x + residual)`` with a residual, otherwise ``x`` itself.
    """
    op, key = "norm_forward", None
    if residual is None and out is None and residual_out is None:
        key = _fast_key(op, x, weight, eps, out_scale, (bool(with_rstd),))
        if key in _VALIDATED:
            return _K.norm_forward_cuda(x, weight, eps, None, out_scale, None, None, with_rstd)
    _check_forward(op, x, weight, eps, residual, out_scale, residual_out)
    _check_like(op, "out", out, x)
    if key is not None:  # a cacheable eager call that passed the checks
        _VALIDATED.add(key)
    if x.is_cuda:
        return _K.norm_forward_cuda(x, weight, eps, residual, out_scale, out, residual_out, with_rstd)
    return norm_forward_reference(x, weight, eps, residual, out_scale, out, residual_out, with_rstd)


def norm_forward_reference(x, weight, eps, residual=None, out_scale=1.0, out=None, residual_out=None,
                           with_rstd=False):
    """What ``norm_forward`` returns, computed by the reference on any device (no validation)."""
    o, rstd, h = _ref.norm_forward_ref(x, weight, eps, residual, out_scale)
    if out is not None:
        o = out.copy_(o)
    return (o, *_finish(x, h, rstd, residual, residual_out, with_rstd))


def _mega_moe_rows(t: torch.Tensor, block_m: int) -> torch.Tensor:
    """quant.md 5.11 mega-MoE row of token ``t``: ``(t div Bm) * align(Bm, 128) + (i div 128) * 128 +
    (i mod 32) * 4 + (i mod 128) div 32`` with ``i = t mod Bm``."""
    i = t % block_m
    return (t // block_m) * F.align(block_m, 128) + (i // 128) * 128 + (i % 32) * 4 + (i % 128) // 32


def _write_mega_moe_sf(mega_moe_sf: torch.Tensor, exponents: torch.Tensor, block_m: int) -> None:
    """Scatter UE8M0 bytes ``[T, H/32]`` into the mega-MoE layout: byte ``g mod 4`` of storage word
    ``(g div 4) * L + row(t)``. Other bytes are untouched."""
    t_count, groups = exponents.shape
    rows_total = F.cdiv(t_count, block_m) * F.align(block_m, 128)
    words = mega_moe_sf.as_strided((groups // 4, rows_total), (mega_moe_sf.stride(1), 1))
    byte_view = words.view(torch.uint8)  # [c, 4*row + u] = byte u of word (row, c) (little-endian)
    t = torch.arange(t_count, device=exponents.device)
    g = torch.arange(groups, device=exponents.device)
    rows = _mega_moe_rows(t, block_m)
    byte_view[(g // 4)[None, :], (4 * rows[:, None] + (g % 4)[None, :])] = exponents


def _per_token_sf(o: torch.Tensor, npc: int, col: bool, round_sf: bool, packed: bool):
    """``per_token_cast(o, 'e4m3', npc, col, round_sf, packed)`` for 2-D or 3-D ``o``.

    For 3-D col, batch ``b``'s sf is a column-major ``(T, nbk')`` matrix with leading dimension
    ``align(T, 4)``, and batches are consecutive blocks of ``nbk' * align(T, 4)`` elements.
    """
    if o.dim() == 2:
        return _quant_ref.cast(o, "e4m3", (1, npc), round_sf=round_sf, use_tma_aligned_col_major_sf=col,
                               use_packed_ue8m0=packed)
    b, t, h = o.shape
    data, sf = _quant_ref.cast(o.reshape(-1, h), "e4m3", (1, npc), round_sf=round_sf, use_packed_ue8m0=packed)
    data, sf = data.view(b, t, h), sf.view(b, t, -1)
    if col:
        storage = torch.zeros((b, sf.size(-1), F.align(t, 4)), dtype=sf.dtype, device=sf.device)
        storage[:, :, :t] = sf.transpose(1, 2)
        sf = storage[:, :, :t].transpose(1, 2)
    return data, sf


@public("quant", path="kernel")
def norm_forward_and_per_token_cast(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, fmt: str, num_per_channels: int | None,
    residual: torch.Tensor | None = None, out_scale: float = 1.0, use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False, use_packed_ue8m0: bool = False, with_out_bf16: bool = False, out=None,
    out_bf16: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
    mega_moe_sf: torch.Tensor | None = None, mega_moe_block_m: int = 0, with_rstd: bool = False,
):
    """RMSNorm then per-token e4m3 cast: ``((out, out_sf), out_bf16, rstd, norm_input)`` (quant.md 5.11).

    ``(out, out_sf)`` is exactly ``per_token_cast(o, 'e4m3', 32, col, round_sf, packed)`` of the rounded
    norm output ``o``. With ``fmt`` equal to ``x``'s dtype name (``'bf16'``/``'fp32'``) and
    ``num_per_channels=None`` it returns ``(o, None, rstd, norm_input)``. ``mega_moe_sf`` (int32
    ``(T, H/128)``, ``stride(0) == 1``) additionally receives the UE8M0 exponent of every 32-channel group.
    """
    op, key = "norm_forward_and_per_token_cast", None
    if (type(fmt) is str and fmt == "e4m3" and type(num_per_channels) is int and residual is None and out is None
            and out_bf16 is None and residual_out is None and mega_moe_sf is None):
        key = _fast_key(op, x, weight, eps, out_scale, (num_per_channels, bool(use_tma_aligned_col_major_sf),
                                                        bool(round_sf), bool(use_packed_ue8m0), bool(with_out_bf16),
                                                        bool(with_rstd)))
        if key in _VALIDATED:
            return _K.norm_forward_and_per_token_cast_cuda(
                x, weight, eps, fmt, num_per_channels, None, out_scale, use_tma_aligned_col_major_sf, round_sf,
                use_packed_ue8m0, with_out_bf16, None, None, None, None, mega_moe_block_m, with_rstd)
    _check_forward(op, x, weight, eps, residual, out_scale, residual_out)
    quantized = fmt == "e4m3"
    if not (quantized or fmt == _DTYPE_NAMES[x.dtype]):
        _check.fail(op, f"fmt must be 'e4m3' or the name of x's dtype ({_DTYPE_NAMES[x.dtype]!r}), got {fmt!r}")
    col, packed = use_tma_aligned_col_major_sf, use_packed_ue8m0
    h = x.size(-1)
    lead = tuple(x.shape[:-1])
    out_x = out_sf = None
    if quantized:
        if num_per_channels != 32:
            _check.fail(op, f"num_per_channels must be 32 for fmt 'e4m3', got {num_per_channels!r}")
        _check_hidden(op, x, 32)
        _check.expect(not packed or round_sf, op, "use_packed_ue8m0 requires round_sf")
        if out is not None:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                _check.fail(op, f"out must be a pair (out, out_sf), got {type(out).__name__}", TypeError)
            out_x, out_sf = out
            _check.expect(not col, op, "out cannot be combined with use_tma_aligned_col_major_sf "
                                       "(a given out_sf must be row-major)")
            _check_like(op, "out[0]", out_x, x, dtype=torch.float8_e4m3fn)
            nbk = F.cdiv(h, 32)
            sf_shape = (*lead, F.cdiv(nbk, 4) if packed else nbk)
            _check.tensor(op, "out[1]", out_sf, dtype=torch.int32 if packed else torch.float32, shape=sf_shape,
                          contiguous=True, device=x.device)
        _check.expect(out_bf16 is None or with_out_bf16, op, "out_bf16 requires with_out_bf16")
        _check_like(op, "out_bf16", out_bf16, x, dtype=torch.bfloat16)
        if mega_moe_sf is not None:
            if not (x.dim() == 2 and round_sf and h % 128 == 0):
                _check.fail(op, f"mega_moe_sf requires 2-D x, round_sf and hidden % 128 == 0, got shape "
                                f"{tuple(x.shape)}, round_sf={round_sf}")
            _check.integer(op, "mega_moe_block_m", mega_moe_block_m, min=1)
            _check.tensor(op, "mega_moe_sf", mega_moe_sf, dtype=torch.int32, shape=(x.size(0), h // 128),
                          device=x.device)
            rows_total = F.cdiv(x.size(0), mega_moe_block_m) * F.align(mega_moe_block_m, 128)
            ld = mega_moe_sf.stride(1)
            if not (mega_moe_sf.stride(0) == 1 and ld >= rows_total):
                _check.fail(op, f"mega_moe_sf must have stride(0) == 1 and stride(1) >= {rows_total}, got strides "
                                f"{mega_moe_sf.stride()}")
            end = mega_moe_sf.storage_offset() + (h // 128 - 1) * ld + rows_total
            if not (end * 4 <= mega_moe_sf.untyped_storage().nbytes()):
                _check.fail(op, f"mega_moe_sf storage must hold {end} int32 words from its start, got "
                                f"{mega_moe_sf.untyped_storage().nbytes() // 4}")
    else:
        if num_per_channels is not None:
            _check.fail(op, f"num_per_channels must be None for fmt {fmt!r}, got {num_per_channels!r}")
        if with_out_bf16 or out_bf16 is not None or mega_moe_sf is not None:
            _check.fail(op, f"with_out_bf16, out_bf16 and mega_moe_sf need fmt 'e4m3', got fmt {fmt!r}")
        if out is not None:
            if not (isinstance(out, (tuple, list)) and len(out) == 2 and out[1] is None):
                _check.fail(op, f"out must be a pair (tensor, None) for fmt {fmt!r}", TypeError)
            out_x = out[0]
            _check_like(op, "out[0]", out_x, x)
    if key is not None:  # a cacheable eager call that passed the checks
        _VALIDATED.add(key)
    if x.is_cuda:
        return _K.norm_forward_and_per_token_cast_cuda(x, weight, eps, fmt, num_per_channels, residual, out_scale,
                                                       col, round_sf, packed, with_out_bf16, out, out_bf16,
                                                       residual_out, mega_moe_sf, mega_moe_block_m, with_rstd)
    return norm_forward_and_per_token_cast_reference(x, weight, eps, fmt, num_per_channels, residual, out_scale, col,
                                                     round_sf, packed, with_out_bf16, out, out_bf16, residual_out,
                                                     mega_moe_sf, mega_moe_block_m, with_rstd)


def norm_forward_and_per_token_cast_reference(x, weight, eps, fmt, num_per_channels, residual=None, out_scale=1.0,
                                              use_tma_aligned_col_major_sf=False, round_sf=False,
                                              use_packed_ue8m0=False, with_out_bf16=False, out=None, out_bf16=None,
                                              residual_out=None, mega_moe_sf=None, mega_moe_block_m=0,
                                              with_rstd=False):
    """What ``norm_forward_and_per_token_cast`` returns, computed by the reference on any device (no validation)."""
    quantized = fmt == "e4m3"
    col, packed = use_tma_aligned_col_major_sf, use_packed_ue8m0
    h = x.size(-1)
    out_x, out_sf = (None, None) if out is None else out
    o, rstd, hsum = _ref.norm_forward_ref(x, weight, eps, residual, out_scale)
    rstd, norm_input = _finish(x, hsum, rstd, residual, residual_out, with_rstd)
    if not quantized:
        return (o if out_x is None else out_x.copy_(o)), None, rstd, norm_input
    data, sf = _per_token_sf(o, 32, col, round_sf, packed)
    if mega_moe_sf is not None and x.size(0) > 0:
        exponents = F.ue8m0_encode(F.load_sf(sf, F.cdiv(h, 32)))
        _write_mega_moe_sf(mega_moe_sf, exponents, mega_moe_block_m)
    if out_x is not None:
        data, sf = out_x.copy_(data), out_sf.copy_(sf)
    bf16 = None
    if with_out_bf16:
        bf16 = o.to(torch.bfloat16) if out_bf16 is None else out_bf16.copy_(o)
    return (data, sf), bf16, rstd, norm_input


@public("quant", path="kernel")
def norm_backward(out_grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                  residual_out_grad: torch.Tensor | None = None, out_scale: float = 1.0,
                  weight_grad: torch.Tensor | None = None):
    """RMSNorm backward: ``(x_grad, weight_grad)`` (quant.md 5.11).

    ``x`` is the saved ``norm_input`` ``(T, H)``. ``weight_grad`` (when given, contiguous ``(H,)`` bf16/fp32)
    is accumulated into, ``float(existing) + sum_rows(xh * g)``, and returned as the same object; a new one
    has ``weight.dtype``. The row reduction has a fixed order (deterministic). None without a weight.
    """
    op, key = "norm_backward", None
    if (residual_out_grad is None and type(x) is torch.Tensor and _eager_cuda(x) and type(out_grad) is torch.Tensor
            and type(rstd) is torch.Tensor and (weight_grad is None or type(weight_grad) is torch.Tensor)):
        g = None if weight_grad is None else (weight_grad.dtype, weight_grad.shape, weight_grad.stride(),
                                              weight_grad.device)
        key = _fast_key(op, x, weight, None, out_scale, (
            out_grad.dtype, out_grad.shape == x.shape, out_grad.stride(), out_grad.device,
            rstd.dtype, rstd.shape == x.shape[:1], rstd.stride(), rstd.device, g))
        if key in _VALIDATED:
            return _K.norm_backward_cuda(out_grad, x, weight, rstd, None, out_scale, weight_grad)
    _check.tensor(op, "x", x, dtype=_DTYPES, ndim=2)
    h = _check_hidden(op, x, 32)
    _check_rows(op, "x", x)
    _check_like(op, "out_grad", out_grad, x)
    _check.tensor(op, "rstd", rstd, dtype=torch.float32, shape=(x.size(0),), contiguous=True, device=x.device)
    _check_like(op, "residual_out_grad", residual_out_grad, x)
    _check.optional(op, "weight", weight, dtype=x.dtype, shape=(h,), contiguous=True, device=x.device)
    _check_scalar(op, "out_scale", out_scale)
    _check.optional(op, "weight_grad", weight_grad, dtype=_DTYPES, shape=(h,), contiguous=True, device=x.device)
    _check.expect(weight_grad is None or weight is not None, op, "weight_grad requires weight")
    if key is not None:  # a cacheable eager call that passed the checks
        _VALIDATED.add(key)
    if x.is_cuda:
        return _K.norm_backward_cuda(out_grad, x, weight, rstd, residual_out_grad, out_scale, weight_grad)
    return norm_backward_reference(out_grad, x, weight, rstd, residual_out_grad, out_scale, weight_grad)


def norm_backward_reference(out_grad, x, weight, rstd, residual_out_grad=None, out_scale=1.0, weight_grad=None):
    """What ``norm_backward`` returns, computed by the reference on any device (no validation)."""
    x_grad, wg = _ref.norm_backward_ref(out_grad, x, weight, rstd, residual_out_grad, out_scale)
    if weight is None:
        return x_grad, None
    if weight_grad is None:
        return x_grad, wg.to(weight.dtype)
    return x_grad, weight_grad.copy_(weight_grad.float() + wg)
