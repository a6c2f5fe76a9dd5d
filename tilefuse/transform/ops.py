"""Public ``apply_rotary`` (transform.md): in-place rotary embedding of queries and keys.

Validation follows section 5 on every device and reads metadata only. CUDA tensors take the TileLang kernel
(``_rotary_kernel``), which accepts every layout that passes validation as it is (any strides with a unit last
one, any pointer alignment, any cache row stride): it narrows its vector accesses to what the view allows, down
to single elements, so no layout needs a copy or another path. An eager call launches it directly; under
``torch.compile`` the call goes through the custom op ``tilefuse::apply_rotary``, which mutates ``query`` and
``key``. Other tensors take the reference (``tilefuse.reference.rotary_embedding_ref``), whose results are copied
into ``query`` and ``key``.

Internal overlap is rejected by a sufficient test (``_overlaps``: the dimensions of size > 1 must nest by stride),
so a rare view whose dimensions interleave without sharing memory is rejected too. A CUDA layout that passed the
checks is kept with its launch plan, so a repeated call checks only the offset.
"""
from __future__ import annotations

import torch

from tilefuse import _check
from tilefuse._registry import public
from tilefuse.reference.transform import rotary_embedding_ref
from tilefuse.transform import _rotary_kernel

__all__ = ["apply_rotary"]

_OP = "apply_rotary"
_DTYPES = (torch.bfloat16, torch.float32)
_WIDTHS = (64, 128)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _overlaps(t: torch.Tensor) -> bool:
    """True unless the view's dimensions of size > 1 nest: sorted by stride, each stride exceeds the extent of the
    smaller ones (a sufficient condition for no two indices sharing memory; a stride of 0 always fails it)."""
    extent = 0
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if st <= extent:
            return True
        extent += (n - 1) * st
    return False


def _check_data(name: str, t: torch.Tensor, d: int) -> None:
    """Width, unit last stride and no internal overlap (section 5, rows of ``query`` and ``key``)."""
    if t.shape[-1] != d:
        _check.fail(_OP, f"{name} must have last dimension {d} (cos_sin_cache.shape[1]), got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        _check.fail(_OP, f"{name} must have a unit stride in its last dimension, got strides {t.stride()}")
    if _overlaps(t):
        _check.fail(_OP, f"{name} must not overlap itself (no two indices sharing memory), got shape "
                         f"{tuple(t.shape)} with strides {t.stride()}")


def _flag(name: str, value) -> bool:
    if not isinstance(value, int):
        _check.fail(_OP, f"{name} must be a bool or an int, got {type(value).__name__}", TypeError)
    return bool(value)


def _validate(query, cache, key, positions, interleaved, conjugate) -> None:
    """Every check of section 5 that reads metadata only (not the offset: ``_check_offset``)."""
    if not isinstance(query, torch.Tensor):
        _check.fail(_OP, f"query must be a torch.Tensor, got {type(query).__name__}", TypeError)
    if query.dim() not in (3, 4):
        _check.fail(_OP, f"query must be 3-D (T, H, D) or 4-D (B, S, H, D), got shape {tuple(query.shape)}")
    if query.dtype not in _DTYPES:
        _check.fail(_OP, f"query must have dtype bfloat16 or float32, got {_name(query.dtype)}", TypeError)
    if not isinstance(cache, torch.Tensor):
        _check.fail(_OP, f"cos_sin_cache must be a torch.Tensor, got {type(cache).__name__}", TypeError)
    if cache.dtype != torch.float32:
        _check.fail(_OP, f"cos_sin_cache must have dtype float32, got {_name(cache.dtype)}", TypeError)
    if cache.dim() != 2 or cache.shape[1] not in _WIDTHS or (cache.shape[1] > 1 and cache.stride(1) != 1):
        _check.fail(_OP, f"cos_sin_cache must be 2-D (R, D) with D 64 or 128 and a unit column stride, got shape "
                         f"{tuple(cache.shape)} with strides {cache.stride()}")
    d = cache.shape[1]
    _check_data("query", query, d)
    if key is not None:
        if not isinstance(key, torch.Tensor):
            _check.fail(_OP, f"key must be a torch.Tensor, got {type(key).__name__}", TypeError)
        if key.dtype != query.dtype:
            _check.fail(_OP, f"key must have query's dtype {_name(query.dtype)}, got {_name(key.dtype)}", TypeError)
        if key.dim() != query.dim():
            _check.fail(_OP, f"key must be {query.dim()}-D like query, got shape {tuple(key.shape)}")
        _check_data("key", key, d)
        if positions is not None and key.shape[:-2] != query.shape[:-2]:
            _check.fail(_OP, f"key must have query's leading dimensions {tuple(query.shape[:-2])} when positions "
                             f"are given, got shape {tuple(key.shape)}")
    if positions is not None:
        lead = tuple(query.shape[:-2])
        if not isinstance(positions, torch.Tensor):
            _check.fail(_OP, f"positions must be a torch.Tensor, got {type(positions).__name__}", TypeError)
        if positions.dtype not in (torch.int32, torch.int64):
            _check.fail(_OP, f"positions must have dtype int32 or int64, got {_name(positions.dtype)}", TypeError)
        if tuple(positions.shape) != lead or (positions.shape[-1] > 1 and positions.stride(-1) != 1):
            _check.fail(_OP, f"positions must have shape {lead} (query's leading dimensions) and a unit last stride, "
                             f"got shape {tuple(positions.shape)} with strides {positions.stride()}")
    _flag("interleaved", interleaved)
    _flag("conjugate", conjugate)
    device = query.device
    for name, t in (("cos_sin_cache", cache), ("key", key), ("positions", positions)):
        if t is not None and t.device != device:
            _check.fail(_OP, f"{name} must be on query's device {device}, got {t.device}")


def _check_offset(query, cache, key, positions, seqlen_offset) -> None:
    """``seqlen_offset``: an int in the int32 range; without positions, every tensor's rows within the cache."""
    if isinstance(seqlen_offset, bool) or not isinstance(seqlen_offset, (int, torch.SymInt)):  # (traced: SymInt)
        _check.fail(_OP, f"seqlen_offset must be an int, got {type(seqlen_offset).__name__}", TypeError)
    if not -(2 ** 31) <= seqlen_offset < 2 ** 31:
        _check.fail(_OP, f"seqlen_offset must lie in [-2^31, 2^31), got {seqlen_offset}")
    if positions is None:
        rows = cache.shape[0]
        for name, t in (("query", query), ("key", key)):
            if t is not None:
                s = t.shape[-3]
                if s > 0 and (seqlen_offset < 0 or seqlen_offset + s > rows):
                    _check.fail(_OP, f"seqlen_offset must satisfy 0 <= seqlen_offset and seqlen_offset + S <= R "
                                     f"without positions, got seqlen_offset={seqlen_offset} with {name}'s S={s} "
                                     f"and R={rows}")


# CUDA layouts that passed ``_validate``: ``_rotary_kernel.plan_key`` -> its launch plan. A repeated layout costs one
# lookup and the offset check (section 5 reads nothing else that can change between calls).
_VALIDATED: dict = {}


@public("transform", path="kernel")
def apply_rotary(query: torch.Tensor, cos_sin_cache: torch.Tensor, key: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, interleaved=False, conjugate=False,
                 seqlen_offset: int = 0) -> None:
    """Rotate ``query`` (and ``key``) in place by the cache rows of their tokens (transform.md sections 2-3).

    ``query``: ``(T, H, D)`` or ``(B, S, H, D)`` bf16/fp32 with a unit last stride (pass ``q[..., -64:]`` for a
    rotary tail); ``key``: the same rank and dtype; ``cos_sin_cache``: ``(R, D)`` fp32, cosines then sines, ``D``
    64 or 128; ``positions``: ``(T,)`` or ``(B, S)`` int32/int64, else token ``t`` uses row
    ``t + seqlen_offset``. A token whose row is outside ``[0, R)`` (positions given) is left unchanged. Returns
    ``None``.
    """
    cache = cos_sin_cache
    compiling = torch.compiler.is_compiling()
    pk = None
    if not compiling:
        try:
            pk = _rotary_kernel.plan_key(query, cache, key, positions, interleaved, conjugate)
            plan = _VALIDATED.get(pk, _VALIDATED)
        except (AttributeError, TypeError, RuntimeError):  # not tensors, an unhashable flag, no storage: checks
            pk, plan = None, _VALIDATED
        if plan is not _VALIDATED:
            if (seqlen_offset.__class__ is not int or not -(2 ** 31) <= seqlen_offset < 2 ** 31
                    or positions is None and (plan is None or not 0 <= seqlen_offset <= plan.offset_max)):
                _check_offset(query, cache, key, positions, seqlen_offset)  # raises
            _rotary_kernel.launch(plan, query, cache, key, positions, conjugate, seqlen_offset)
            return None
    _validate(query, cache, key, positions, interleaved, conjugate)
    _check_offset(query, cache, key, positions, seqlen_offset)
    if query.is_cuda:
        if compiling:
            _rotary_kernel.apply_rotary_cuda(query, cache, key, positions, bool(interleaved), bool(conjugate),
                                             seqlen_offset)
            return None
        if pk is None:  # no key to keep the plan under
            plan = _rotary_kernel._plan(query, cache, key, positions, bool(interleaved))
            _rotary_kernel.launch(plan, query, cache, key, positions, conjugate, seqlen_offset)
            return None
        plan = _rotary_kernel.get_plan(pk, query, cache, key, positions, interleaved)
        if len(_VALIDATED) > 4096:  # bounded: views of ever-new shapes start it over
            _VALIDATED.clear()
        _VALIDATED[pk] = plan
        _rotary_kernel.launch(plan, query, cache, key, positions, conjugate, seqlen_offset)
        return None
    half = cache.shape[1] // 2
    for t in (query, key):
        if t is not None and t.numel() > 0:
            t.copy_(rotary_embedding_ref(t, cache[:, :half], cache[:, half:], positions, seqlen_offset,
                                         bool(interleaved), bool(conjugate)))
    return None
