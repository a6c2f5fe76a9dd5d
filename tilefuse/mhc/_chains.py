"""The per-element fp32 chains of the mHC forwards that several kernels compute: one definition, so kernels that
must agree bit for bit (the multi-layer recompute against the apply-mix and post kernels, mhc.md §2.9) build the
same expression. Each operation is an explicitly rounded intrinsic (``tilefuse._rn``), so nvcc can neither contract
nor reorder it. No TileLang at import; a kernel module that uses these names this module and ``tilefuse._rn`` in its
``KERNEL_HELPERS`` (their source is part of its cache key)."""
from tilefuse._rn import fma, mul


def fma_chain(first, terms):
    """``fma(a_k, b_k, ... fma(a_1, b_1, first))`` for ``terms = [(a_1, b_1), ..., (a_k, b_k)]`` (built in Python,
    so the chain is one unrolled expression)."""
    acc = first
    for a, b in terms:
        acc = fma(a, b, acc)
    return acc


def apply_mix(mix, x):
    """§2.5 forward of one element, before its bf16 rounding: ``RN(mix_0 x_0)``, then ``fma(mix_i, x_i, .)`` for
    i = 1..n-1. ``mix``, ``x``: the n streams' fp32 weights and (widened) values."""
    return fma_chain(mul(mix[0], x[0]), list(zip(mix[1:], x[1:])))


def post(post_o, y, comb_col, r):
    """§2.6 forward of one element of output stream o, before its bf16 rounding: ``fma(post_o, y, RN(comb[0, o]
    R_0))``, then ``fma(comb[i, o], R_i, .)`` for i = 1..n-1. ``comb_col[i] = comb[i, o]``; ``y``, ``r``: the
    layer output's and the n residual streams' widened values."""
    return fma_chain(fma(post_o, y, mul(comb_col[0], r[0])), list(zip(comb_col[1:], r[1:])))
