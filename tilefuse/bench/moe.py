"""The bench cases of the MoE routing ops (``tilefuse.moe``, moe.md): the ``--quick`` rows and the grid rows.

Shapes are issue #25's: T = 8192 tokens, 256 routed experts, top-8, hidden 7168 (bf16; e4m3 + per-token sf for
``expand_to_fused_with_sf``); the v1 gate (``top2_sum_gate``) with 8 groups / top-4 groups, the v2.1 gate
(``moe_topk_gate_forward``) with sqrt-softplus and a bias. The grid adds T = 1 (one-token gate calls), 4096 and
16384, and for the gates E in {72, 384} (no group limit there: 384 experts in 8 groups would be 48 per group, over
the kernel's 32).

Off those shapes (issue 34 item 9; ``OFF_TOKENS``, ``OFF_GATES``, ``V1_OFF``): at 256 experts the plain gate calls
(``topk_gate``, the sigmoid ``top2_sum_gate``, ``moe_topk_gate_forward`` / ``_backward`` without scores or aux),
``normalize_weight`` (top-8 and top-6) and the one-rank ``get_fused_mapping`` also at T in {300, 777, 3000};
``topk_gate``, ``moe_topk_gate_forward`` / ``_backward`` and ``get_fused_mapping`` (with and without the host sync)
at 64, 128 and 160 experts, top-6 and top-8, and ``top2_sum_gate`` at widths that are not powers of two (8 groups
of 20 at 160 experts, sigmoid and softmax, top-6 and top-8; of 12 at 96, top-6; of 9 at 72, top-8) and with
softmax at 64 (no groups) and 128 (8 groups of 16), top-6 and top-8, at T in {300, 3000}. Every one of these shapes
is within the limits moe.md 2.1-2.4 and 2.13-2.14 state for upstream's ops, so each row keeps the peers of its op.

Routing indices come from a gate-like draw in plain Python (so the cases also build on fake tensors): every row
picks ``top-8`` distinct experts of 256 uniformly. Two index spaces:

- ``ep1``: one rank holds all 256 experts (the gate's own output; no -1);
- ``ep8`` ("EP 1/8 recv"): the receive side of EP rank 0 of 8 (moe.md 1.6): 32 local experts, slots routed
  elsewhere are -1, rows with no local slot are redrawn (a received token has at least one), so the row count
  stays T.

The fused-layout inputs (maps, fused rows) are built once per case by our own public ops, the sizes from the
draw's counts (no host sync). ``reduce_fused`` reads a fused buffer of exactly the routed rows (alignment 1), so
"each input read once" holds for it: with padded segments the padding rows would be counted but never read.

The labels hold the token count as ``{T}x`` (``runner.case_label`` and ``--match`` read it from the key).
Bytes are the harness's rule (each input tensor read once, each output tensor written once). Agreement: bitwise
where moe.md says exact; ``calc_diff`` for the gates' weights and ``aux_fi`` (upstream's weights, atomics and the
backward's fast math are not bit-exact), and for 2.1.0's ``normalize_weight`` (its butterfly denominator);
``get_fused_mapping`` order-free (``peers.fused_mapping_agree``: upstream orders a segment's rows by SM worker).
``inplace_unique_group_indices`` is ``Case.in_place``: the isolated timer restores its input before each call.

Peers: TileKernels 2.1.0 (``tk2``) has ``topk_gate``, ``normalize_weight``, ``moe_topk_gate_forward`` /
``moe_topk_gate`` and ``moe_topk_gate_backward``; TileKernels 1.0.0 (``tk1``, a second process) has the v1 ops.
Every peer call is written once against the module that holds the ops (``tilefuse.moe`` / ``tile_kernels.moe``):
the signatures agree (moe.md 2, 5.2).
"""
from __future__ import annotations

import functools
import random

import torch

from tilefuse.bench import peers as _peers
from tilefuse.bench.core import Case, _dim, _randn

OPS = ("topk_gate", "top2_sum_gate", "topk_sum_and_topk_group_idx", "moe_topk_gate_forward", "moe_topk_gate",
       "moe_topk_gate_backward", "normalize_weight", "get_fused_mapping", "expand_to_fused",
       "expand_to_fused_with_sf", "reduce_fused", "aux_fi", "group_count", "inplace_unique_group_indices",
       "mask_indices_by_tp")
ISSUE_TOKENS = (1, 4096, 8192, 16384)
# Off the issue shapes (issue 34 item 9: speed that holds where the grid had no row). Token counts that are not
# powers of two: 300 is "a few hundred" (a decode step's batch on one rank, where the small gates are launch- and
# tail-bound), 777 is odd (every tile and warp split ends in a partial one), 3000 is "the low thousands" (a
# prefill chunk). The plain calls at the issue shapes run at all three; the off-grid shapes at 300 and 3000.
OFF_TOKENS = (300, 777, 3000)
OFF_SHAPE_TOKENS = (300, 3000)
TOKENS = tuple(sorted(ISSUE_TOKENS + OFF_TOKENS))  # every token count of the grid
# (E, K) of the off-grid gates and mappings: 64, 128 and 160 experts at top-6 and top-8 (the issue's list)
OFF_GATES = tuple((e, k) for e in (64, 128, 160) for k in (6, 8))
# the v1 gate off the grid, (E, K, (groups, top groups), scorings): group widths that are not powers of two (9, 12,
# 20 experts a group; moe.md 2.2 allows any width up to 32 that divides E, E a multiple of 4, and K at most the
# kept groups' experts) and softmax from 64 to 256 experts (256 is an issue shape: its softmax rows are above)
V1_OFF = ((64, 6, (0, 0), ("softmax",)), (64, 8, (0, 0), ("softmax",)),
          (128, 6, (8, 4), ("softmax",)), (128, 8, (8, 4), ("softmax",)),
          (160, 6, (8, 4), ("sigmoid", "softmax")), (160, 8, (8, 4), ("sigmoid", "softmax")),
          (96, 6, (8, 4), ("sigmoid",)), (72, 8, (8, 4), ("sigmoid",)))
QUICK_TOKENS = 8192
EXPERTS = 256
GATE_EXPERTS = (256, 72, 384)
TOPK = 8
HIDDEN = 7168
ALIGN = 128          # the fused layout's segment alignment (upstream's get_fused_mapping benchmark)
RSF = 2.5            # routed_scaling_factor (DeepSeek-V3)
EP_RANKS = 8         # the receive-side cases: EP rank 0 of 8
# peer -> the tile_kernels.moe functions its adapters call (the tests check the adapters against this)
PEER_FUNCTIONS = {
    "tk2": ("topk_gate", "normalize_weight", "moe_topk_gate_forward", "moe_topk_gate", "moe_topk_gate_backward"),
    "tk1": ("topk_gate", "top2_sum_gate", "topk_sum_and_topk_group_idx", "normalize_weight", "get_fused_mapping",
            "expand_to_fused", "expand_to_fused_with_sf", "reduce_fused", "aux_fi", "group_count",
            "inplace_unique_group_indices", "mask_indices_by_tp"),
}


def routing(tokens: int, ranks: int = 1, experts: int = EXPERTS, topk: int = TOPK,
            seed: int = 0) -> tuple[list[list[int]], int]:
    """``(rows, local experts)``: ``tokens`` rows of ``topk`` distinct experts of ``experts`` drawn uniformly; with
    ``ranks > 1`` the receive side of rank 0 (local ids ``< experts // ranks``, others -1, no all -1 row)."""
    rng = random.Random(seed * 1_000_003 + tokens * 31 + ranks)
    local = experts // ranks
    rows = []
    for _ in range(tokens):
        while True:
            row = [e if e < local else -1 for e in rng.sample(range(experts), topk)]
            if ranks == 1 or any(e >= 0 for e in row):
                break
        rows.append(row)
    return rows, local


def _counts(rows: list[list[int]], experts: int) -> list[int]:
    counts = [0] * experts
    for row in rows:
        for e in row:
            if e >= 0:
                counts[e] += 1
    return counts


def _aligned_total(rows, experts: int, align: int) -> int:
    return sum(-(-c // align) * align for c in _counts(rows, experts))


@functools.lru_cache(maxsize=None)
def _expert_counts(tokens: int, ranks: int, experts: int = EXPERTS, topk: int = TOPK) -> tuple[int, ...]:
    """Slots per local expert of the draw ``routing(tokens, ranks, experts, topk)`` (cached: many cases' declared
    shapes read the same draw)."""
    rows, local = routing(tokens, ranks, experts, topk)
    return tuple(_counts(rows, local))


def fused_rows(tokens: int, ranks: int, align: int, experts: int = EXPERTS, topk: int = TOPK) -> int:
    """Rows of the fused buffer of the draw ``routing(tokens, ranks, experts, topk)``: each local expert's slots
    padded to ``align`` (what ``get_fused_mapping`` returns as N with a host sync)."""
    return sum(-(-c // align) * align for c in _expert_counts(tokens, ranks, experts, topk))


_EP = {1: "256 experts", EP_RANKS: f"EP 1/{EP_RANKS} recv: 32 local"}


class _Spec:
    """One MoE case family: ``label(T)``, ``make(T, H, device) -> inputs``, ``call(ns, *inputs)`` for us and the
    peers (``ns`` = ``tilefuse.moe`` or ``tile_kernels.moe``), the torch.compile reference, the peers, agreement."""

    def __init__(self, name, label, make, call, ref, peers=("tk1",), exact=True, check=None, in_place=False,
                 tokens=ISSUE_TOKENS, quick=True, io=None):
        self.name, self.label, self.make, self.call, self.ref = name, label, make, call, ref
        self.peers, self.exact, self.check, self.in_place, self.tokens, self.quick = (
            peers, exact, check, in_place, tokens, quick)
        self.io = io  # io(T) -> (input specs, output specs) at hidden HIDDEN (Case.describe)

    def case(self, t: int):
        from tilefuse import moe as ours

        call = self.call

        def make(device, scale, t=t):
            tt, h = _dim(t, scale), _dim(HIDDEN, scale, 256)
            label = self.label(tt)
            if h != HIDDEN:
                label = label.replace(f"x{HIDDEN}", f"x{h}")
            return label, self.make(tt, h, device)

        peers = {p: (lambda tk, *a: call(tk.moe, *a)) for p in self.peers}
        return Case(self.name, make, lambda *a: call(ours, *a), self.ref, peers, self.exact,
                    f"{self.name}|{self.label(0)}", t, self.check, self.in_place,
                    lambda t=t: (self.label(t), *self.io(t)))


F32, I32, I64, BF16, E4M3 = torch.float32, torch.int32, torch.int64, torch.bfloat16, torch.float8_e4m3fn


def _specs() -> list[_Spec]:
    from tilefuse import moe as M
    from tilefuse import quant as Q
    from tilefuse.reference import moe as R

    specs: list[_Spec] = []
    close = {"tk2": lambda o, t: _peers.agree(o, t, False)}  # v2.1's butterfly denominator vs v1's sequential one

    # declared shapes (Case.describe) of the case families below, at hidden HIDDEN
    def gate_io(t, e, k, scores=False):
        """logits (T, E) and bias (E,) in; topk_idx int64 and weights fp32 (T, K) out (+ the scores (T, E))."""
        return [((t, e), F32), ((e,), F32)], [((t, k), I64), ((t, k), F32)] + ([((t, e), F32)] if scores else [])

    def expand_sf_io(t, n, col):
        sf = (lambda r: ((r, HIDDEN // 512), I32)) if col else (lambda r: ((r, HIDDEN // 128), F32))
        return ([((t, HIDDEN), E4M3), sf(t), ((t, TOPK), I32), ((n,), I32)], [((n, HIDDEN), E4M3), sf(n)])

    def reduce_io(t, n, fp8):
        x = [((n, HIDDEN), BF16)] + ([((n,), F32)] if fp8 else []) + [((t, TOPK), F32), ((t, TOPK), I32)]
        return x + ([((1,), F32)] if fp8 else []), [((t, HIDDEN), E4M3 if fp8 else BF16)]

    def slots_io(t):
        return [((t, TOPK), I64)], [((t, TOPK), I64)]

    # --- gates (moe.md 2.1-2.4, 2.13-2.14) ---------------------------------------------------------------------
    # one builder per case family, at E experts and top-K; the issue shapes (256, 72, 384 at top-8) and the
    # off-grid ones (OFF_GATES, V1_OFF) are built by the same code
    def topk_spec(e, k, tokens, quick=False):
        return _Spec("topk_gate", lambda t: f"fp32 {t}x{e} top{k}", lambda t, h, d: (_randn((t, e), F32, d),),
                     lambda ns, s: ns.topk_gate(s, k), lambda s: R.stable_topk(s, k), ("tk2", "tk1"), quick=quick,
                     tokens=tokens, io=lambda t: ([((t, e), F32)], [((t, k), I64)]))

    def top2_spec(e, k, groups, scoring, tokens, quick=False):
        """The v1 gate with a bias and rsf; ``groups = (G, TG)``: G groups of E/G experts, the best TG kept
        ((0, 0): no group limit)."""
        g, tg = groups
        tag = f"groups {g}/{tg}" if g else "no groups"
        return _Spec(
            "top2_sum_gate", lambda t: f"fp32 {t}x{e} top{k} {tag} {scoring} +bias rsf{RSF}",
            lambda t, h, d: (_randn((t, e), F32, d), 0.1 * torch.randn(e, device=d)),
            lambda ns, x, b: ns.top2_sum_gate(x, b, k, tg, g, False, 0, RSF, 0, 1, 0, 1, scoring),
            lambda x, b: R.top2_sum_gate(x, b, k, tg, g, False, 0, RSF, 0, 1, 0, 1, scoring),
            exact=False, quick=quick, tokens=tokens, io=lambda t: gate_io(t, e, k))

    def group_idx_spec(e, tokens, quick=False):
        g, n = (12, 32) if e == 384 else (8, e // 8)  # <= 32 groups; the gate's group layout where it has one
        return _Spec(
            "topk_sum_and_topk_group_idx", lambda t: f"fp32 {t}x{g}x{n} top2-sum top4 groups",
            lambda t, h, d: (_randn((t, g, n), F32, d),),
            lambda ns, s: ns.topk_sum_and_topk_group_idx(s, 2, 4), lambda s: R.topk_sum_and_topk_group_idx(s, 2, 4),
            quick=quick, tokens=tokens, io=lambda t: ([((t, g, n), F32)], [((t, 4), I64)]))

    def gate_inputs(e):
        return lambda t, h, d: (_randn((t, e), F32, d), 0.1 * torch.randn(e, device=d))

    def v2_fwd(k):
        def fwd(ns, x, b):
            return ns.moe_topk_gate_forward(x, k, False, 0, RSF, 0, "sqrtsoftplus", bias=b)
        return fwd

    def v2_fwd_train(k):
        def fwd(ns, x, b):
            """The training call: the unbiased scores (the backward's input) as a third output. Without a physical
            map or masks the indices are the logical ones the backward takes: no ``unmapped_topk_idx`` needed."""
            scores = torch.empty_like(x)
            idx, w = ns.moe_topk_gate_forward(x, k, False, 0, RSF, 0, "sqrtsoftplus", bias=b, scores=scores)
            return idx, w, scores
        return fwd

    def forward_spec(e, k, train, tokens, quick=False):
        call = (v2_fwd_train if train else v2_fwd)(k)
        return _Spec("moe_topk_gate_forward",
                     lambda t: f"fp32 {t}x{e} top{k} sqrtsoftplus +bias rsf{RSF}" + (" -> scores" if train else ""),
                     gate_inputs(e), call, lambda x, b: call(R, x, b), ("tk2",), exact=False, quick=quick,
                     tokens=tokens, io=lambda t: gate_io(t, e, k, scores=train))

    def backward_spec(e, k, aux, tokens, quick=False):
        def bwd_inputs(t, h, d):
            """The backward of the training forward above: its scores, (logical) indices and weights, a random
            weight gradient; with ``aux`` the sequence-level term (one sequence, every token in the mask)."""
            x, b = gate_inputs(e)(t, h, d)
            scores = torch.empty_like(x)
            idx, w = M.moe_topk_gate_forward(x, k, False, 0, RSF, 0, "sqrtsoftplus", bias=b, scores=scores)
            extra = (torch.ones(t, dtype=torch.bool, device=d), torch.randn(1, e, device=d)) if aux else ()
            return (scores, idx.contiguous(), w.contiguous(), torch.randn(t, k, device=d), *extra)

        return _Spec(
            "moe_topk_gate_backward",
            lambda t: f"fp32 {t}x{e} top{k} sqrtsoftplus rsf{RSF} grad" + (" + aux (1 seq)" if aux else ""),
            bwd_inputs, lambda ns, *a: ns.moe_topk_gate_backward(*a[:4], RSF, "sqrtsoftplus", *a[4:]),
            lambda *a: R.moe_topk_gate_backward(*a[:4], RSF, "sqrtsoftplus", *a[4:]), ("tk2",), exact=False,
            quick=quick, tokens=tokens, io=lambda t: (
                [((t, e), F32), ((t, k), I64), ((t, k), F32), ((t, k), F32)]
                + ([((t,), torch.bool), ((1, e), F32)] if aux else []), [((t, e), F32)]))

    def normalize_spec(k, tokens, quick=False):
        return _Spec(
            "normalize_weight", lambda t: f"fp32 {t}x{k}", lambda t, h, d: (torch.rand(t, k, device=d),),
            lambda ns, w: ns.normalize_weight(w), R.normalize_weight, ("tk2", "tk1"), check=close, quick=quick,
            tokens=tokens, io=lambda t: ([((t, k), F32)], [((t,), F32), ((t, k), F32)]))

    # the issue shapes: every gate at T in ISSUE_TOKENS; the plain calls at 256 experts also at OFF_TOKENS
    for e in GATE_EXPERTS:
        quick = e == EXPERTS
        plain = TOKENS if quick else ISSUE_TOKENS
        specs.append(topk_spec(e, TOPK, plain, quick))
        # v1 gate: 256 experts in 8 groups, top-4 groups (DeepSeek-V3); 72 and 384 without a group limit
        for scoring in (("sigmoid", "sqrtsoftplus", "softmax") if quick else ("sigmoid",)):
            specs.append(top2_spec(e, TOPK, (8, 4) if quick else (0, 0), scoring,
                                   plain if scoring == "sigmoid" else ISSUE_TOKENS, quick))
        specs.append(group_idx_spec(e, ISSUE_TOKENS, quick))
        specs.append(forward_spec(e, TOPK, False, plain, quick))
        specs.append(forward_spec(e, TOPK, True, ISSUE_TOKENS, quick))
        if quick:
            alias = v2_fwd(TOPK)
            specs.append(_Spec("moe_topk_gate", lambda t, e=e: f"fp32 {t}x{e} top{TOPK} sqrtsoftplus +bias rsf{RSF} "
                                                               "(alias)", gate_inputs(e),
                               lambda ns, x, b: ns.moe_topk_gate(x, TOPK, False, 0, RSF, 0, "sqrtsoftplus", bias=b),
                               lambda x, b: alias(R, x, b), ("tk2",), exact=False, tokens=(), quick=True,
                               io=lambda t, e=e: gate_io(t, e, TOPK)))
        for aux in (False, True):
            specs.append(backward_spec(e, TOPK, aux, plain if not aux else ISSUE_TOKENS, quick))
    specs.append(normalize_spec(TOPK, TOKENS, quick=True))

    # off the issue shapes (issue 34 item 9): 64, 128 and 160 experts at top-6 and top-8 at OFF_SHAPE_TOKENS;
    # the v1 gate at group widths that are not powers of two and with softmax from 64 to 256 experts; top-6 weights
    for e, k in OFF_GATES:
        specs += [topk_spec(e, k, OFF_SHAPE_TOKENS), forward_spec(e, k, False, OFF_SHAPE_TOKENS),
                  backward_spec(e, k, False, OFF_SHAPE_TOKENS)]
    for e, k, groups, scorings in V1_OFF:
        specs += [top2_spec(e, k, groups, s, OFF_SHAPE_TOKENS) for s in scorings]
    specs.append(normalize_spec(6, OFF_TOKENS))

    # --- fused layout (moe.md 1.5, 2.5-2.8) ---------------------------------------------------------------------
    def idx_of(t, ranks, d, experts=EXPERTS, topk=TOPK):
        rows, local = routing(t, ranks, experts, topk)
        return rows, local, torch.tensor(rows, dtype=torch.int64, device=d).view(t, topk)

    def fused_maps(t, ranks, d, align):
        """topk_idx, its fused maps (our get_fused_mapping; the size from the draw's counts, no host sync)."""
        rows, local, idx = idx_of(t, ranks, d)
        maps = M.get_fused_mapping(idx, local, _aligned_total(rows, local, align), align, True)
        return rows, local, idx, maps

    fused_check = {p: _peers.fused_mapping_agree for p in ("tk1", "compile")}

    def mapping_spec(ranks, sync, tokens, experts=EXPERTS, topk=TOPK, quick=True):
        """get_fused_mapping of the draw ``routing(T, ranks, experts, topk)``: with the host sync (N = 0, the
        maps trimmed to the fused rows) or without it (N = the upper bound a caller that cannot sync passes)."""
        ep = _EP[ranks] if experts == EXPERTS else f"{experts} experts"
        flag = "N=0 (host sync, trimmed)" if sync else "force_no_sync, N = upper bound"
        local = experts // ranks

        def gfm(ns, idx):
            if sync:
                return ns.get_fused_mapping(idx, local, 0, ALIGN)
            bound = (idx.numel() + (ALIGN - 1) * local) // ALIGN * ALIGN  # what a caller that cannot sync passes
            return ns.get_fused_mapping(idx, local, bound, ALIGN, True)

        def gfm_io(t):
            """Seven maps: three of the N fused rows, the (T, K) slot map, three per local expert."""
            bound = (t * topk + (ALIGN - 1) * local) // ALIGN * ALIGN
            n = fused_rows(t, ranks, ALIGN, experts, topk) if sync else bound
            return [((t, topk), I64)], [((n,), I32)] * 3 + [((t, topk), I32)] + [((local,), I32)] * 3

        return _Spec("get_fused_mapping", lambda t: f"int64 {t}x{topk} ({ep}) align{ALIGN} {flag}",
                     lambda t, h, d: (idx_of(t, ranks, d, experts, topk)[2],), gfm, lambda idx: gfm(R, idx),
                     check=fused_check, tokens=tokens, quick=quick, io=gfm_io)

    for ranks in (1, EP_RANKS):
        ep = _EP[ranks]
        specs += [mapping_spec(ranks, sync, TOKENS if ranks == 1 else ISSUE_TOKENS)
                  for sync in (True, False)]

        def etf_make(t, h, d, ranks=ranks):
            _, _, _, maps = fused_maps(t, ranks, d, ALIGN)
            return _randn((t, h), torch.bfloat16, d), maps[3], maps[0]

        specs.append(_Spec(
            "expand_to_fused", lambda t, ep=ep: f"bf16 {t}x{HIDDEN} -> fused rows (top{TOPK}, {ep}, align{ALIGN})",
            etf_make, lambda ns, x, tt2p, p2e: ns.expand_to_fused(x, tt2p, p2e), R.expand_to_fused,
            io=lambda t, ranks=ranks: (lambda n: ([((t, HIDDEN), BF16), ((t, TOPK), I32), ((n,), I32)],
                                                  [((n, HIDDEN), BF16)]))(fused_rows(t, ranks, ALIGN))))

        for col in (False, True):
            layout = "col ue8m0 sf (int32)" if col else "row fp32 sf"

            def etfsf_make(t, h, d, ranks=ranks, col=col):
                """The per-token e4m3 cast (npc 128, round) of a bf16 randn; the sf made row-major contiguous, as
                the op takes it (moe.md 2.7), packed UE8M0 int32 for the column-major output."""
                _, _, _, maps = fused_maps(t, ranks, d, ALIGN)
                data, sf = Q.per_token_cast(_randn((t, h), torch.bfloat16, d), "e4m3", 128, None, col, True, col)
                return (data, sf.contiguous()), maps[3], maps[0]

            specs.append(_Spec(
                "expand_to_fused_with_sf",
                lambda t, ep=ep, layout=layout: f"e4m3 pair {t}x{HIDDEN} npc128 {layout} -> fused rows "
                                                f"(top{TOPK}, {ep}, align{ALIGN})",
                etfsf_make, lambda ns, x, tt2p, p2e, col=col: ns.expand_to_fused_with_sf(x, 128, tt2p, p2e, col),
                lambda x, tt2p, p2e, col=col: R.expand_to_fused_with_sf(x, 128, tt2p, p2e, col),
                io=lambda t, ranks=ranks, col=col: expand_sf_io(t, fused_rows(t, ranks, ALIGN), col)))

        for fp8 in (False, True):
            def rf_make(t, h, d, ranks=ranks, fp8=fp8):
                """Expert outputs in the fused layout of the draw (alignment 1: every fused row is read), the
                routing weights; for the e4m3 output a per-row fp32 x_sf and the scalar output sf."""
                rows, _, _, maps = fused_maps(t, ranks, d, 1)
                n = maps[0].numel()
                x = _randn((n, h), torch.bfloat16, d)
                w = torch.rand(t, TOPK, device=d)
                if not fp8:
                    return x, w, maps[3]
                return (x, torch.rand(n, device=d) + 0.5), w, maps[3], torch.full((1,), 0.5, device=d)

            if fp8:
                call = lambda ns, x, w, tt2p, sf: ns.reduce_fused(x, w, tt2p, "e4m3", sf)  # noqa: E731
                ref = lambda x, w, tt2p, sf: R.reduce_fused(x, w, tt2p, "e4m3", sf)  # noqa: E731
                desc = "bf16 + x_sf, weighted, sf -> e4m3"
            else:
                call = lambda ns, x, w, tt2p: ns.reduce_fused(x, w, tt2p)  # noqa: E731
                ref = lambda x, w, tt2p: R.reduce_fused(x, w, tt2p)  # noqa: E731
                desc = "bf16, weighted -> bf16"
            specs.append(_Spec(
                "reduce_fused", lambda t, ep=ep, desc=desc: f"fused rows -> {t}x{HIDDEN} (top{TOPK}, {ep}, align1) "
                                                            f"{desc}", rf_make, call, ref,
                io=lambda t, ranks=ranks, fp8=fp8: reduce_io(t, fused_rows(t, ranks, 1), fp8)))

        # --- counting utilities and EP/TP masking (moe.md 2.9-2.12) -------------------------------------------------
        def idx_make(t, h, d, ranks=ranks):
            return (idx_of(t, ranks, d)[2],)

        local = EXPERTS // ranks
        specs.append(_Spec(
            "aux_fi", lambda t, ep=ep: f"int64 {t}x{TOPK} ({ep}) num_aux_topk {TOPK}", idx_make,
            lambda ns, idx, local=local: ns.aux_fi(idx, local, TOPK),
            lambda idx, local=local: R.aux_fi(idx, local, TOPK), exact=False,
            io=lambda t, local=local: ([((t, TOPK), I64)], [((local,), F32)])))
        specs.append(_Spec(
            "group_count", lambda t, ep=ep: f"int64 {t}x{TOPK} ({ep})", idx_make,
            lambda ns, idx, local=local: ns.group_count(idx, local),
            lambda idx, local=local: R.group_count(idx, local),
            io=lambda t, local=local: ([((t, TOPK), I64)], [((local,), I32)])))

        def groups_make(t, h, d, ranks=ranks):
            """Group ids of the draw (8 groups of 32 of the 256 experts; the receive side's local ids are group 0,
            -1 stays -1), repeated within a row where a token picked two experts of one group."""
            idx = idx_of(t, ranks, d)[2]
            return (torch.where(idx >= 0, idx // (EXPERTS // 8), idx),)

        def unique(ns, g):
            ns.inplace_unique_group_indices(g, 8)
            return g  # written in place: counted as the output

        specs.append(_Spec(
            "inplace_unique_group_indices", lambda t, ep=ep: f"int64 {t}x{TOPK} group ids ({ep}) 8 groups, in place",
            groups_make, unique, lambda g: unique(R, g), in_place=True, io=slots_io))

    for e, k in OFF_GATES:  # the mapping at the off-grid gates' expert counts (one rank holds them all)
        specs += [mapping_spec(1, sync, OFF_SHAPE_TOKENS, e, k, quick=False) for sync in (True, False)]

    specs.append(_Spec(
        "mask_indices_by_tp", lambda t: f"int64 {t}x{TOPK} ({_EP[1]}) n 256 ep{EP_RANKS} tp 1/2",
        lambda t, h, d: (idx_of(t, 1, d)[2],),
        lambda ns, idx: ns.mask_indices_by_tp(idx, EXPERTS, EP_RANKS, 1, 2),
        lambda idx: R.mask_indices_by_tp(idx, EXPERTS, EP_RANKS, 1, 2), io=slots_io))
    return specs


def quick_cases() -> list[Case]:
    """The ``--quick`` rows: every MoE op and flag set at T = 8192, 256 experts."""
    cases = [s.case(QUICK_TOKENS) for s in _specs() if s.quick]
    return sorted(cases, key=lambda c: OPS.index(c.name))  # stable: one op's rows together


def grid_cases() -> list[Case]:
    """The grid rows: every MoE case at T in ``ISSUE_TOKENS`` (the gates also at 72 and 384 experts), and the
    rows off those shapes (``OFF_TOKENS``, ``OFF_GATES``, ``V1_OFF``)."""
    cases = [s.case(t) for s in _specs() for t in s.tokens]
    return sorted(cases, key=lambda c: OPS.index(c.name))
