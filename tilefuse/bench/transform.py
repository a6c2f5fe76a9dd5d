"""The bench cases of ``tilefuse.transform.apply_rotary`` (transform.md 9): the ``--quick`` rows, the grid rows and the
one-token host-overhead calls.

Rows (bf16 unless stated): LLaMA-3-8B prefill, decode (128 tokens, int64 positions) and batched prefill (4 x 2048,
offset 1024) with NeoX pairs; DeepSeek-V3 prefill and decode on the rotary tails (q ``(T, 128, 192)[..., 128:]``,
k ``(T, 576)[:, 512:].unsqueeze(1)``, interleaved pairs, R = 32768); fp32 at T = 4001 with int32 positions and
``conjugate``. The grid adds the prefills at 4096 tokens and the one-token decodes of both models.

Bytes (section 9, not the harness's generic rule): ``query`` and ``key`` read and written, ``positions`` read once,
and one cache row of ``D`` fp32 per distinct row used: ``S`` without positions, else the distinct
``positions + offset`` values, counted on the host from the Python draw (``Case.nbytes``; ``Case.describe``
declares tensors of the same bytes: q and k as inputs and outputs, the positions, and a ``(rows, D)`` cache).
Positions are drawn in plain Python (seeded), so the cases also build on fake tensors.

The op rotates its inputs in place: the rows are ``Case.in_place`` (restored before each timed call and before
the peers run, so every implementation sees the same data; agreement is checked on fresh clones). Peers:
TileKernels 2.1.0 ``transform.apply_rotary`` (the same call; bitwise, section 7) on every row; Liger-Kernel's
``liger_rotary_pos_emb`` on the NeoX rows, through its ``(B, H, S, D)`` view of our ``(B, S, H, D)`` buffers with
full-width ``cos``/``sin`` rows gathered when the inputs are built (a tolerance check: its own rounding).
"""
from __future__ import annotations

import random

import torch

from tilefuse.bench.core import Case, _dim

OPS = ("apply_rotary",)
LLAMA = dict(h=32, hk=8, d=128, rows=8192)
DEEPSEEK = dict(h=128, d=64, rows=32768)


def _cache(rows: int, d: int, device) -> torch.Tensor:
    """``[cos theta, sin theta]``, ``theta[p, j] = p * 10000^(-2j/D)`` in float64, rounded to fp32 (8.1)."""
    p = torch.arange(rows, dtype=torch.float64, device=device)[:, None]
    j = torch.arange(d // 2, dtype=torch.float64, device=device)[None, :]
    theta = p * 10000.0 ** (-2.0 * j / d)
    return torch.cat((theta.cos(), theta.sin()), dim=1).to(torch.float32)


def _positions(n: int, rows: int, seed: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + n)
    return [rng.randrange(rows) for _ in range(n)]


def _randn(shape, dtype, device) -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype)


def _liger_cos_sin(cache: torch.Tensor, rows) -> tuple:
    """Liger's full-width ``(1, S, D)`` cos and sin (NeoX: each half repeated) of the cache rows ``rows`` (an index
    tensor, or ``(start, count)``)."""
    half = cache.shape[1] // 2
    sel = cache.index_select(0, rows) if isinstance(rows, torch.Tensor) else cache.narrow(0, *rows)
    c, s = sel.narrow(1, 0, half), sel.narrow(1, half, half)
    return torch.cat((c, c), -1).unsqueeze(0), torch.cat((s, s), -1).unsqueeze(0)


class _Row:
    """One row family: ``label(T)``, ``make(T, device) -> inputs`` with inputs ``(q, cache, k, positions[, cos, sin])``;
    the call's flags and offset; the positions' seed (None: no positions) and which peers have the layout."""

    def __init__(self, label, make, specs, interleaved=False, conjugate=False, offset=0, seed=None, liger=False):
        self.label, self.make, self.specs, self.seed, self.liger = label, make, specs, seed, liger
        self.flags = (interleaved, conjugate, offset)

    def rows_used(self, t: int, cache_rows: int) -> int:
        """Distinct cache rows the call reads (section 9): ``t`` without positions."""
        offset = self.flags[2]
        return t if self.seed is None else len({p + offset for p in _positions(t, cache_rows, self.seed)})

    def case(self, t: int):
        from tilefuse import transform as ours
        from tilefuse.reference import rotary_embedding_ref

        interleaved, conjugate, offset = self.flags
        seed = self.seed

        def make(device, scale, t=t):
            tt = _dim(t, scale)
            return self.label(tt), self.make(tt, device)

        def run(q, cache, k, pos, *_):
            ours.apply_rotary(q, cache, k, pos, interleaved, conjugate, offset)
            return q, k  # rotated in place: counted as the outputs

        def ref(q, cache, k, pos, *_):
            half = cache.shape[1] // 2
            return tuple(rotary_embedding_ref(x, cache[:, :half], cache[:, half:], pos, offset, interleaved, conjugate)
                         for x in (q, k))

        def nbytes(inputs, outputs) -> int:
            q, cache, k, pos = inputs[:4]
            rows = self.rows_used(q.shape[-3] if pos is None else pos.shape[-1], cache.shape[0])
            data = 2 * (q.numel() + k.numel()) * q.element_size()
            return data + (0 if pos is None else pos.numel() * pos.element_size()) + rows * cache.shape[1] * 4

        def describe(t=t):
            """q and k (read, then written), the positions and the cache rows used: the section 9 bytes."""
            q, k, pos, (cache_rows, d) = self.specs(t)
            cache = ((self.rows_used(t, cache_rows), d), torch.float32)
            inputs = [q, k, *([pos] if pos else []), cache]
            return self.label(t), inputs, [q, k]

        peers = {"tk2": lambda tk, q, cache, k, pos, *_: tk.transform.apply_rotary(q, cache, k, pos, interleaved,
                                                                                     conjugate, offset) or (q, k)}
        check = {}
        if self.liger:
            peers["liger"] = _liger_call
            check["liger"] = _liger_agree
        return Case("apply_rotary", make, run, ref, peers, True, f"apply_rotary|{self.label(0)}", t, check or None,
                    True, describe, nbytes)


def _liger_call(lg, q, cache, k, pos, cos, sin):
    """Liger's rope on the ``(B, H, S, D)`` transposed views of our buffers (its kernel writes them in place)."""
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    q4, k4 = (q, k) if q.dim() == 4 else (q.unsqueeze(0), k.unsqueeze(0))
    liger_rotary_pos_emb(q4.transpose(1, 2), k4.transpose(1, 2), cos, sin)
    return q, k


def _liger_agree(ours, theirs) -> tuple[bool, str]:
    """transform.md 8.3's global form for bf16: ``|a - b| <= 2^-7 |a| + 2^-20 max|a|``."""
    worst = 0.0
    for a, b in zip(ours, theirs):
        a, b = a.float(), b.float()
        bound = 2.0 ** -7 * a.abs() + 2.0 ** -20 * a.abs().max()
        excess = ((a - b).abs() - bound).max().item()
        worst = max(worst, excess)
    if worst <= 0:
        return True, "within 2^-7 rel + 2^-20 max|x|"
    return False, f"exceeds the bound by {worst:.3g}"


def _rows() -> list[_Row]:
    ll, ds = LLAMA, DEEPSEEK

    def llama(t, device, seed=None, batch=0, offset=0):
        lead = (batch, t) if batch else (t,)
        q = _randn((*lead, ll["h"], ll["d"]), torch.bfloat16, device)
        k = _randn((*lead, ll["hk"], ll["d"]), torch.bfloat16, device)
        cache = _cache(ll["rows"], ll["d"], device)
        if seed is None:
            pos, rows = None, (offset, t)
        else:
            rows = _positions(t, ll["rows"], seed)
            pos = torch.tensor(rows, dtype=torch.int64, device=device)
            rows = pos
        cos, sin = _liger_cos_sin(cache, rows)
        return q, cache, k, pos, cos, sin

    def deepseek(t, device, seed=None):
        q = _randn((t, ds["h"], 192), torch.bfloat16, device).narrow(2, 128, 64)
        k = _randn((t, 576), torch.bfloat16, device)[:, 512:].unsqueeze(1)
        cache = _cache(ds["rows"], ds["d"], device)
        pos = None if seed is None else torch.tensor(_positions(t, ds["rows"], seed), dtype=torch.int64,
                                                     device=device)
        return q, cache, k, pos

    def fp32(t, device):
        q = _randn((t, 16, 64), torch.float32, device)
        k = _randn((t, 2, 64), torch.float32, device)
        pos = torch.tensor(_positions(t, 8192, 3), dtype=torch.int32, device=device)
        return q, _cache(8192, 64, device), k, pos

    bf16, f32, i64, i32 = torch.bfloat16, torch.float32, torch.int64, torch.int32

    def specs(q, k, pos, cache):
        """``describe``'s declaration of a row at ``t`` tokens: q, k, positions (or None) and the cache's shape."""
        return lambda t: (q(t), k(t), pos(t) if pos else None, cache)

    llama_qk = (lambda t: ((t, ll["h"], ll["d"]), bf16), lambda t: ((t, ll["hk"], ll["d"]), bf16))
    llama_batched = (lambda t: ((4, t, ll["h"], ll["d"]), bf16), lambda t: ((4, t, ll["hk"], ll["d"]), bf16))
    deepseek_qk = (lambda t: ((t, ds["h"], ds["d"]), bf16), lambda t: ((t, 1, ds["d"]), bf16))
    return [
        _Row(lambda t: f"LLaMA-3-8B prefill bf16 q {t}x32x128 k {t}x8x128 NeoX",
             lambda t, d: llama(t, d), specs(*llama_qk, None, (ll["rows"], ll["d"])), liger=True),
        _Row(lambda t: f"LLaMA-3-8B decode bf16 q {t}x32x128 k {t}x8x128 NeoX int64 positions",
             lambda t, d: llama(t, d, seed=1), specs(*llama_qk, lambda t: ((t,), i64), (ll["rows"], ll["d"])),
             seed=1, liger=True),
        _Row(lambda t: f"LLaMA-3-8B batched prefill bf16 4 x q {t}x32x128 k {t}x8x128 NeoX offset 1024",
             lambda t, d: llama(t, d, batch=4, offset=1024), specs(*llama_batched, None, (ll["rows"], ll["d"])),
             offset=1024, liger=True),
        _Row(lambda t: f"DeepSeek-V3 prefill bf16 q {t}x128x192[..., 128:] k {t}x576[:, 512:] interleaved",
             lambda t, d: deepseek(t, d), specs(*deepseek_qk, None, (ds["rows"], ds["d"])), interleaved=True),
        _Row(lambda t: f"DeepSeek-V3 decode bf16 q {t}x128x192[..., 128:] k {t}x576[:, 512:] interleaved int64 "
                       f"positions", lambda t, d: deepseek(t, d, seed=2),
             specs(*deepseek_qk, lambda t: ((t,), i64), (ds["rows"], ds["d"])), interleaved=True, seed=2),
        _Row(lambda t: f"fp32 q {t}x16x64 k {t}x2x64 int32 positions conjugate", lambda t, d: fp32(t, d),
             specs(lambda t: ((t, 16, 64), f32), lambda t: ((t, 2, 64), f32), lambda t: ((t,), i32), (8192, 64)),
             conjugate=True, seed=3),
    ]


QUICK_TOKENS = (8192, 128, 2048, 8192, 128, 4001)  # per row of _rows(): transform.md 9's shapes


def quick_cases() -> list:
    """The ``--quick`` rows: transform.md 9's six shapes."""
    return [row.case(t) for row, t in zip(_rows(), QUICK_TOKENS)]


# per row of _rows(): the grid's token counts (prefill also at 4096, decode also at one token)
GRID_TOKENS = ((4096, 8192), (1, 128), (2048,), (4096, 8192), (1, 128), (4001,))
TOKENS = tuple(sorted({t for tokens in GRID_TOKENS for t in tokens}))


def grid_cases() -> list:
    """The grid rows: the six shapes, the prefills also at 4096 tokens and the decodes at one token."""
    return [row.case(t) for row, tokens in zip(_rows(), GRID_TOKENS) for t in tokens]


def host_calls() -> list:
    """The one-token decode call (T = 1, int64 position; LLaMA-3-8B heads) of the host target (<= 1.5x a bare
    TileLang call of the same kernel): the bare JITKernel call, the raw TVM-FFI call and the public op."""
    from tilefuse import _jit, transform
    from tilefuse.transform import _rotary_kernel as K

    q = _randn((1, 32, 128), torch.bfloat16, "cuda")
    k = _randn((1, 8, 128), torch.bfloat16, "cuda")
    cache = _cache(8192, 128, "cuda")
    pos = torch.tensor([4321], dtype=torch.int64, device="cuda")
    cfg = ("bf16", 128, 8, 4, False, "int64", 3)
    jk = _jit.get_jit_kernel("apply_rotary", cfg)
    raw = _jit.get("apply_rotary", cfg)
    c = 128 // 16
    args = (q, k, cache, pos, 0, 1.0, *K._split(1, 1, 32, c), *K._split(1, 1, 8, c))
    group = "apply_rotary, LLaMA-3-8B decode, 1 token"
    return [
        (group, "bare TileLang kernel call (JITKernel, preallocated outputs)", lambda: jk(*args)),
        (group, "raw TVM-FFI call", lambda: raw(*args)),
        (group, "tilefuse.transform.apply_rotary (public op)", lambda: transform.apply_rotary(q, cache, k, pos)),
    ]
