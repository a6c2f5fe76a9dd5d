"""Public Engram ops (engram.md §2): n-gram hash, fused gate forward/backward, weight-gradient reduction,
and the v2.1 Sinkhorn helpers.

Each op validates its arguments (metadata only, no host sync); CUDA tensors then take the op's TileLang kernel
(``_<family>_kernel``) where it takes the shape, and CPU tensors (and the shapes no kernel takes, named in each
docstring) the math of ``tilefuse.reference.engram``.

Partial buffers (gate backward, Sinkhorn step) have a row count set by ``S_m``: :data:`DEFAULT_NUM_SMS` on
every device, or the ``num_sms=`` keyword. Upstream takes the device's SM count; a fixed count makes the
partials, and so the reduced weight gradient and column statistics, the same bits on every GPU (and equal to
upstream's on a 132-SM H100/H200).
"""
from __future__ import annotations

import torch

from tilefuse import _check
from tilefuse._registry import public
from tilefuse.engram import _gate_bwd_kernel, _gate_fwd_kernel, _hash_kernel, _sinkhorn_kernel
from tilefuse.reference import engram as _ref

__all__ = [
    "engram_gate_bwd",
    "engram_gate_fwd",
    "engram_hash",
    "engram_sinkhorn_finalize",
    "engram_sinkhorn_momentum_update",
    "engram_sinkhorn_step",
    "engram_sinkhorn_step_reduce",
    "fused_weight",
    "grad_w_reduce",
]

DEFAULT_NUM_SMS = 132
"""``S_m`` on every device, whatever its SM count (an H100/H200's, so partial layouts match upstream's there)."""

BF16, FP32 = torch.bfloat16, torch.float32


# ----------------------------------------------------------------------------------------------------
# Validation helpers
# ----------------------------------------------------------------------------------------------------


def _num_sms(op: str, num_sms: int | None) -> int:
    """``S_m``: the explicit ``num_sms``, else ``DEFAULT_NUM_SMS`` (never the device's SM count)."""
    if num_sms is not None:
        return _check.integer(op, "num_sms", num_sms, min=1)
    return DEFAULT_NUM_SMS


def _hidden(op: str, name: str, t: torch.Tensor, multiple: int, minimum: int = 0) -> None:
    """Check the last dimension of ``t`` is a multiple of ``multiple`` and at least ``minimum``."""
    h = t.shape[-1]
    if not (h % multiple == 0 and h >= minimum):
        _check.fail(op, f"{name} must have hidden % {multiple} == 0" + (f" and hidden >= {minimum}" if minimum else "")
                    + f", got shape {tuple(t.shape)}")


def _gate_operands(op: str, hidden_states, k, v, weight_fused):
    """Shared checks of the gate's ``x (T,M,H)``, ``k (T,M,H)``, ``v (T,H)``, ``w (M,H)`` (§2.4.1)."""
    _check.tensor(op, "hidden_states", hidden_states, dtype=BF16, ndim=3, contiguous=True)
    t, m, h = hidden_states.shape
    _check.tensor(op, "k", k, dtype=BF16, shape=(t, m, h), inner_contiguous=True)
    _check.tensor(op, "v", v, dtype=BF16, shape=(t, h), inner_contiguous=True)
    _check.tensor(op, "weight_fused", weight_fused, dtype=FP32, shape=(m, h), contiguous=True)
    return t, m, h


def _sinkhorn_operands(op: str, matrix, row_scale, col_scale):
    """Checks of ``matrix (R,D)``, ``row_scale (R,)``, ``col_scale (D,)`` fp32, ``D % 256 == 0`` (§2.9.2)."""
    _check.tensor(op, "matrix", matrix, dtype=FP32, ndim=2, contiguous=True)
    r, d = matrix.shape
    _hidden(op, "matrix", matrix, 256)
    _check.tensor(op, "row_scale", row_scale, dtype=FP32, shape=(r,), contiguous=True)
    _check.tensor(op, "col_scale", col_scale, dtype=FP32, shape=(d,), contiguous=True)
    return r, d


# ----------------------------------------------------------------------------------------------------
# Hash and weights
# ----------------------------------------------------------------------------------------------------

@public("engram", path="kernel")
def engram_hash(ngram_token_ids: torch.Tensor, multipliers: torch.Tensor, vocab_sizes: torch.Tensor,
                offsets: torch.Tensor) -> torch.Tensor:
    """Row indices ``(L, T, (N-1)·K)`` int32 of every n-gram table (§2.2, v1). Exact integer arithmetic.

    Table sizes must be positive (``V = 0`` is undefined; not checked, it would need a host sync).
    CUDA tensors with ``N >= 2`` and ``K >= 1`` take the TileLang kernel (bit for bit the reference); others (an
    empty index row) keep the reference.
    """
    op = "engram_hash"
    _check.tensor(op, "ngram_token_ids", ngram_token_ids, dtype=torch.int32, ndim=2, contiguous=True)
    n = ngram_token_ids.shape[1]
    if not (n >= 1):
        _check.fail(op, f"ngram_token_ids must have at least 1 column, got shape {tuple(ngram_token_ids.shape)}")
    _check.tensor(op, "multipliers", multipliers, dtype=torch.int64, shape=(None, n), contiguous=True)
    layers = multipliers.shape[0]
    _check.tensor(op, "vocab_sizes", vocab_sizes, dtype=torch.int32, shape=(layers, n - 1, None), contiguous=True)
    cols = (n - 1) * vocab_sizes.shape[2]
    _check.tensor(op, "offsets", offsets, dtype=torch.int32, shape=(layers, cols), contiguous=True)
    _check.same_device(op, ngram_token_ids=ngram_token_ids, multipliers=multipliers, vocab_sizes=vocab_sizes,
                       offsets=offsets)
    if _hash_kernel.takes(ngram_token_ids, vocab_sizes):
        return _hash_kernel.hash_cuda(ngram_token_ids, multipliers, vocab_sizes, offsets)
    return _ref.engram_hash_ref(ngram_token_ids, multipliers, vocab_sizes, offsets)


@public("engram", path="kernel")
def fused_weight(weight_hidden: torch.Tensor, weight_embed: torch.Tensor) -> torch.Tensor:
    """``fp32(w_h) · fp32(w_e)`` as a new ``(M, H)`` fp32 tensor, exact (§2.3). ``H % 256 == 0``.

    CUDA tensors take the TileLang kernel (``_gate_fwd_kernel``), others the reference product; the same bits.
    """
    op = "fused_weight"
    _check.tensor(op, "weight_hidden", weight_hidden, dtype=BF16, ndim=2, contiguous=True)
    _hidden(op, "weight_hidden", weight_hidden, 256)
    _check.tensor(op, "weight_embed", weight_embed, dtype=BF16, shape=tuple(weight_hidden.shape), contiguous=True)
    _check.same_device(op, weight_hidden=weight_hidden, weight_embed=weight_embed)
    if weight_hidden.is_cuda:
        return _gate_fwd_kernel.fused_weight_cuda(weight_hidden, weight_embed)
    return weight_hidden.float() * weight_embed.float()


# ----------------------------------------------------------------------------------------------------
# Gate forward / backward
# ----------------------------------------------------------------------------------------------------

@public("engram", path="kernel")
def engram_gate_fwd(hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight_fused: torch.Tensor,
                    eps: float, clamp_value: float, save_for_backward: bool = True):
    """Gated residual ``out = x + σ(u)·v`` per token and branch (§2.4, v1).

    Returns ``(output, dot, gate_score, rstd_x, rstd_k)``; the statistics (``(T, M)`` fp32, ``dot`` the
    raw ``Σ x·w·k``) are ``None`` unless ``save_for_backward``. ``H % 256 == 0`` and ``H >= 512``;
    ``k``, ``v`` may have any strides but a unit last stride.

    CUDA tensors take the TileLang kernel (``_gate_fwd_kernel``: upstream's summation order, the sign bit of
    ``s`` for ``u``) for ``H <= 12288``; larger ``H`` and CPU tensors take the reference formulation
    (``reference.engram._gate_fwd``), which follows the same sign convention.
    """
    op = "engram_gate_fwd"
    _gate_operands(op, hidden_states, k, v, weight_fused)
    _hidden(op, "hidden_states", hidden_states, 256, 512)
    eps = _check.real(op, "eps", eps)
    clamp_value = _check.real(op, "clamp_value", clamp_value, positive=True)
    _check.flag(op, "save_for_backward", save_for_backward)
    _check.same_device(op, hidden_states=hidden_states, k=k, v=v, weight_fused=weight_fused)
    if _gate_fwd_kernel.takes(hidden_states):
        return _gate_fwd_kernel.gate_fwd_cuda(hidden_states, k, v, weight_fused, eps, clamp_value, save_for_backward)
    out, dot, g, rx, rk = _ref._gate_fwd(hidden_states, k, v, weight_fused, eps, clamp_value)
    if not save_for_backward:
        return out, None, None, None, None
    return out, dot, g, rx, rk


@public("engram", path="kernel")
def engram_gate_bwd(grad_out: torch.Tensor, hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    weight_fused: torch.Tensor, dot: torch.Tensor, gate_score: torch.Tensor, rstd_x: torch.Tensor,
                    rstd_k: torch.Tensor, clamp_value: float, *, num_sms: int | None = None):
    """Gradients of the gate from the forward's statistics (§2.5, v1).

    Returns ``(grad_hidden_states, grad_k, grad_v, grad_w_partial)``: bf16 gradients (contiguous) and the
    ``(S_m, M, H)`` fp32 partial weight gradient ``Σ_t β·x·k`` over ``S_m`` consecutive token chunks
    (§2.5.4), to be reduced by :func:`grad_w_reduce`. ``M == 4``, ``H % 512 == 0``, ``H >= 1024``.

    CUDA tensors with ``H <= 8192`` take the TileLang kernel (``_gate_bwd_kernel``; bitwise deterministic and
    batch-invariant, ``grad_w_partial`` summed in ascending tokens); larger ``H`` and CPU tensors take the reference.
    """
    op = "engram_gate_bwd"
    t, m, h = _gate_operands(op, hidden_states, k, v, weight_fused)
    _check.tensor(op, "grad_out", grad_out, dtype=BF16, shape=(t, m, h), contiguous=True)
    if m != 4:
        _check.fail(op, f"hidden_states must have M == 4 branches, got shape {tuple(hidden_states.shape)}")
    _hidden(op, "hidden_states", hidden_states, 512, 1024)
    for name, stat in (("dot", dot), ("gate_score", gate_score), ("rstd_x", rstd_x), ("rstd_k", rstd_k)):
        _check.tensor(op, name, stat, dtype=FP32, shape=(t, m), contiguous=True)
    clamp_value = _check.real(op, "clamp_value", clamp_value, positive=True)
    _check.same_device(op, grad_out=grad_out, hidden_states=hidden_states, k=k, v=v,
                                weight_fused=weight_fused, dot=dot, gate_score=gate_score, rstd_x=rstd_x,
                                rstd_k=rstd_k)
    partials = _num_sms(op, num_sms)
    if _gate_bwd_kernel.takes(hidden_states):
        return _gate_bwd_kernel.gate_bwd_cuda(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x,
                                              rstd_k, clamp_value, partials)
    return _ref._gate_bwd(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k,
                          clamp_value, partials)


@public("engram", path="kernel")
def grad_w_reduce(grad_w_partial: torch.Tensor, weight_hidden: torch.Tensor, weight_embed: torch.Tensor,
                  grad_weight_hidden: torch.Tensor, grad_weight_embed: torch.Tensor) -> None:
    """Reduce the partial weight gradient into the two fp32 accumulators in place (§2.6, v1).

    ``S = Σ_p partial[p]`` in ascending ``p``; ``grad_weight_hidden ← fma(S, w_e, grad_weight_hidden)`` and
    ``grad_weight_embed ← fma(S, w_h, grad_weight_embed)``. ``H % 512 == 0`` and ``P % 4 == 0``.

    CUDA tensors take the TileLang kernel (``_gate_bwd_kernel``), the reference's bits; CPU tensors the reference.
    """
    op = "grad_w_reduce"
    _check.tensor(op, "grad_w_partial", grad_w_partial, dtype=FP32, ndim=3, contiguous=True)
    p, m, h = grad_w_partial.shape
    _hidden(op, "grad_w_partial", grad_w_partial, 512)
    if p % 4 != 0:
        _check.fail(op, f"grad_w_partial must have P % 4 == 0 rows, got shape {tuple(grad_w_partial.shape)}")
    for name, w in (("weight_hidden", weight_hidden), ("weight_embed", weight_embed)):
        _check.tensor(op, name, w, dtype=BF16, shape=(m, h), contiguous=True)
    for name, acc in (("grad_weight_hidden", grad_weight_hidden), ("grad_weight_embed", grad_weight_embed)):
        _check.tensor(op, name, acc, dtype=FP32, shape=(m, h), contiguous=True)
    _check.same_device(op, grad_w_partial=grad_w_partial, weight_hidden=weight_hidden, weight_embed=weight_embed,
                       grad_weight_hidden=grad_weight_hidden, grad_weight_embed=grad_weight_embed)
    if _gate_bwd_kernel.takes_reduce(grad_w_partial):
        _gate_bwd_kernel.grad_w_reduce_cuda(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden,
                                            grad_weight_embed)
        return
    _ref._grad_w_reduce(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)


# ----------------------------------------------------------------------------------------------------
# Sinkhorn helpers (v2.1)
# ----------------------------------------------------------------------------------------------------

@public("engram", path="kernel")
def engram_sinkhorn_momentum_update(grad: torch.Tensor, momentum_buffer: torch.Tensor, beta1: float,
                                    nesterov: bool = True) -> torch.Tensor:
    """Momentum step (§2.9.1): ``momentum_buffer ← fma(m, β, RN(β'·g))`` in place (rounded to its dtype);
    returns a new fp32 tensor shaped like the buffer: ``fma(g, β', RN(β·m'))`` (nesterov) or ``m'``.

    ``grad`` and ``momentum_buffer``: bf16 or fp32, contiguous, equal element count, a multiple of 256.
    CUDA tensors take the TileLang kernel (bit for bit this formulation).
    """
    op = "engram_sinkhorn_momentum_update"
    _check.tensor(op, "grad", grad, dtype=(BF16, FP32), contiguous=True)
    _check.tensor(op, "momentum_buffer", momentum_buffer, dtype=(BF16, FP32), contiguous=True)
    n = momentum_buffer.numel()
    if grad.numel() != n:
        _check.fail(op, f"grad must have as many elements as momentum_buffer ({n}), got shape {tuple(grad.shape)}")
    if n % 256 != 0:
        _check.fail(op, f"momentum_buffer must have numel % 256 == 0, got shape {tuple(momentum_buffer.shape)}")
    beta1 = _check.real(op, "beta1", beta1)
    _check.flag(op, "nesterov", nesterov)
    _check.same_device(op, grad=grad, momentum_buffer=momentum_buffer)
    if momentum_buffer.is_cuda:
        return _sinkhorn_kernel.momentum_cuda(grad, momentum_buffer, beta1, nesterov)
    return _ref._sinkhorn_momentum_update(grad, momentum_buffer, beta1, nesterov)


@public("engram", path="kernel")
def engram_sinkhorn_step(matrix: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, eps: float,
                         *, num_sms: int | None = None):
    """One row normalisation of ``diag(r)·B·diag(c)`` (§2.9.2); ``row_scale`` is updated in place.

    Returns ``(row_norm (R,), col_sumsq_partial (3·S_m, D))``: the row norms before the update and the
    column sums of squares of the normalised iterate over ``3·S_m`` consecutive row chunks.
    CUDA tensors with ``0 < D <= 16384`` take the TileLang kernel (its row sums in a fixed blocked order: the
    reference's within the spec's tolerance; the chunk sums in the reference's order); others keep the reference.
    """
    op = "engram_sinkhorn_step"
    _sinkhorn_operands(op, matrix, row_scale, col_scale)
    eps = _check.real(op, "eps", eps)
    _check.same_device(op, matrix=matrix, row_scale=row_scale, col_scale=col_scale)
    partials = 3 * _num_sms(op, num_sms)
    if _sinkhorn_kernel.takes_rows(matrix):
        return _sinkhorn_kernel.step_cuda(matrix, row_scale, col_scale, eps, partials)
    return _ref._sinkhorn_step(matrix, row_scale, col_scale, eps, partials)


@public("engram", path="kernel")
def engram_sinkhorn_step_reduce(col_sumsq_partial: torch.Tensor, col_sumsq: torch.Tensor) -> None:
    """``col_sumsq[j] = Σ_p col_sumsq_partial[p, j]`` in ascending ``p`` (overwritten; §2.9.3). CUDA tensors take
    the TileLang kernel (the same order, bit for bit)."""
    op = "engram_sinkhorn_step_reduce"
    _check.tensor(op, "col_sumsq_partial", col_sumsq_partial, dtype=FP32, ndim=2, contiguous=True)
    _hidden(op, "col_sumsq_partial", col_sumsq_partial, 256)
    _check.tensor(op, "col_sumsq", col_sumsq, dtype=FP32, shape=(col_sumsq_partial.shape[1],), contiguous=True)
    _check.same_device(op, col_sumsq_partial=col_sumsq_partial, col_sumsq=col_sumsq)
    if col_sumsq.is_cuda:
        _sinkhorn_kernel.step_reduce_cuda(col_sumsq_partial, col_sumsq)
        return
    col_sumsq.copy_(_ref._sequential_sum(col_sumsq_partial))


@public("engram", path="kernel")
def engram_sinkhorn_finalize(matrix: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, eps: float,
                             alpha: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = y·(alpha/(n + eps))`` with ``y = (r·B)·c`` and its row norms ``n`` (§2.9.4); ``row_scale`` is
    only read. Returns ``out`` (new when ``None``). CUDA tensors with ``0 < D <= 16384`` take the TileLang kernel
    (row norms in a fixed blocked order); others keep the reference."""
    op = "engram_sinkhorn_finalize"
    _sinkhorn_operands(op, matrix, row_scale, col_scale)
    eps = _check.real(op, "eps", eps)
    alpha = _check.real(op, "alpha", alpha)
    _check.optional(op, "out", out, dtype=FP32, shape=tuple(matrix.shape), contiguous=True)
    _check.same_device(op, matrix=matrix, row_scale=row_scale, col_scale=col_scale, out=out)
    if _sinkhorn_kernel.takes_rows(matrix):
        return _sinkhorn_kernel.finalize_cuda(matrix, row_scale, col_scale, eps, alpha, out)
    return _ref._sinkhorn_finalize(matrix, row_scale, col_scale, eps, alpha, out)
