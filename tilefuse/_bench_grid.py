"""The bench grid: every quant and transpose op over the hidden sizes, token counts and flag sets users call, and
the MoE routing ops over theirs (``tilefuse._bench_moe``: T in {1, 4096, 8192, 16384}, 256 experts top-8, the
gates also at 72 and 384 experts).

Hidden sizes come from public model configs (DeepSeek-V3: q_lora_rank 1536, moe_intermediate 2048, hidden 7168,
intermediate 18432; Llama-3-8B: hidden 4096); token counts are 1 (decode), 128, 4096 and 16384 (prefill and
training), where the op accepts them. The flag sets are the ones that change a kernel: sf layout, ``round_sf``,
packed UE8M0, fp32 inputs and e2m1 outputs.

Each case names the peers that have the op with the same meaning (``peers``: name -> ``fn(peer_module,
*inputs)``), and the reference that ``torch.compile`` times (``ref``). Our call and the peers' are written once,
against the module that holds the ops (``tilefuse.quant`` or ``tile_kernels.quant``), where the signatures agree.
"""
from __future__ import annotations

import torch

from tilefuse.bench import _SHORT, _flag_names, _randn

HIDDEN = (1536, 2048, 4096, 7168, 18432)
NORM_HIDDEN = (1536, 2048, 4096, 7168, 8192)  # the RMSNorm ops take hidden <= 8192 (quant.md 5.11); 8192: Llama-3-70B
TOKENS = (1, 128, 4096, 16384)
# (use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0): the flag sets of the spec's level >= 1 grid
FLAGS = ((False, False, False), (False, True, False), (True, True, True))


def _flags(flags) -> str:
    return _flag_names(*flags)


def _on(area: str):
    """``fn(ns, *inputs)`` -> the three callables of a case: ours, a TileKernels peer, and the module getter."""
    def ours(call):
        import importlib

        mod = importlib.import_module(f"tilefuse.{area}")
        return lambda *inputs: call(mod, *inputs)

    def peer(call):
        return lambda tk, *inputs: call(getattr(tk, area), *inputs)

    return ours, peer


def grid_cases(ops: list[str] | None = None) -> list:
    """Every grid case (``tilefuse.bench.Case``), in a stable order."""
    from tilefuse.bench import Case, _area
    from tilefuse import quant as q
    from tilefuse.quant import norm as qn, swiglu as qs
    from tilefuse.reference import quant as R
    from tilefuse.reference import swiglu as RS

    ours_q, peer_q = _on("quant")
    ours_t, peer_t = _on("transpose")
    cases: list = []

    def add(name, label, make, call, ref=None, tk2=True, tk1=False, exact=True, tokens=TOKENS, hidden=HIDDEN,
            area="quant", peer_call=None):
        """One case per (T, H): ``make(T, H, device) -> inputs``; ``call(ns, *inputs)`` for us and the peers
        (``peer_call`` where the peer's signature differs)."""
        if ops and not any(o in (name, _area(name)) for o in ops):
            return
        ours, peer = (ours_q, peer_q) if area == "quant" else (ours_t, peer_t)
        for h in hidden:
            for t in tokens:
                peers = {}
                if tk2:
                    peers["tk2"] = peer(peer_call or call)
                if tk1:
                    peers["tk1"] = peer(peer_call or call)
                mk = (lambda t, h: lambda device, scale: (label(t, h), make(t, h, device)))(t, h)
                cases.append(Case(name, mk, ours(call), ref, peers, exact, f"{name}|{label(0, h)}", t))

    # per-token casts (quant.md 3.1-3.3)
    for xd in (torch.bfloat16, torch.float32):
        for fmt in ("e4m3", "e2m1"):
            for fl in FLAGS:
                add("per_token_cast", lambda t, h, xd=xd, fmt=fmt, fl=fl: f"{_SHORT[xd]} {t}x{h} npc128 {fmt}{_flags(fl)}",
                    lambda t, h, d, xd=xd: (_randn((t, h), xd, d),),
                    lambda ns, x, fmt=fmt, fl=fl: ns.per_token_cast(x, fmt, 128, None, *fl),
                    lambda x, fmt=fmt, fl=fl: R.cast(x, fmt, (1, 128), round_sf=fl[1], use_tma_aligned_col_major_sf=fl[0],
                                                     use_packed_ue8m0=fl[2]))
        for fl in FLAGS:
            add("per_token_cast_with_sf_only", lambda t, h, xd=xd, fl=fl: f"{_SHORT[xd]} {t}x{h} npc128 e4m3{_flags(fl)}",
                lambda t, h, d, xd=xd: (_randn((t, h), xd, d),),
                lambda ns, x, fl=fl: ns.per_token_cast_with_sf_only(
                    x, "e4m3", 128, use_tma_aligned_col_major_sf=fl[0], round_sf=fl[1], use_packed_ue8m0=fl[2]),
                lambda x, fl=fl: R.cast(x, "e4m3", (1, 128), round_sf=fl[1], use_tma_aligned_col_major_sf=fl[0],
                                        use_packed_ue8m0=fl[2])[1])
        for fmt in ("e4m3", "e2m1"):
            add("per_token_cast_with_precomputed_sf",
                lambda t, h, xd=xd, fmt=fmt: f"{_SHORT[xd]} {t}x{h} npc128 {fmt} (sf given)",
                lambda t, h, d, xd=xd, fmt=fmt: (lambda x: (x, q.per_token_cast_with_sf_only(x, fmt, 128)))(
                    _randn((t, h), xd, d)),
                lambda ns, x, sf, fmt=fmt: ns.per_token_cast_with_precomputed_sf(x, fmt, 128, sf),
                lambda x, sf, fmt=fmt: R.cast(x, fmt, (1, 128), sf=sf))

    # per-block casts (quant.md 3.6-3.7)
    for xd in (torch.bfloat16, torch.float32):
        for fmt, blk in (("e4m3", (128, 128)), ("e2m1", (32, 32))):
            for fl in FLAGS:
                add("per_block_cast",
                    lambda t, h, xd=xd, fmt=fmt, blk=blk, fl=fl: f"{_SHORT[xd]} {t}x{h} {fmt} block{blk[0]}x{blk[1]}"
                                                                 f"{_flags(fl)}",
                    lambda t, h, d, xd=xd: (_randn((t, h), xd, d),),
                    lambda ns, x, fmt=fmt, blk=blk, fl=fl: ns.per_block_cast(x, fmt, blk, *fl),
                    lambda x, fmt=fmt, blk=blk, fl=fl: R.cast(x, fmt, blk, round_sf=fl[1],
                                                              use_tma_aligned_col_major_sf=fl[0], use_packed_ue8m0=fl[2]))
        for fl in FLAGS:
            add("per_block_cast_with_sf_only",
                lambda t, h, xd=xd, fl=fl: f"{_SHORT[xd]} {t}x{h} e4m3 block128x128{_flags(fl)}",
                lambda t, h, d, xd=xd: (_randn((t, h), xd, d),),
                lambda ns, x, fl=fl: ns.per_block_cast_with_sf_only(x, "e4m3", (128, 128), *fl),
                lambda x, fl=fl: R.cast(x, "e4m3", (128, 128), round_sf=fl[1], use_tma_aligned_col_major_sf=fl[0],
                                        use_packed_ue8m0=fl[2])[1])
        add("per_block_cast_with_precomputed_sf",
            lambda t, h, xd=xd: f"{_SHORT[xd]} {t}x{h} e4m3 block128x128 (sf given)",
            lambda t, h, d, xd=xd: (lambda x: (x, q.per_block_cast_with_sf_only(x, "e4m3", (128, 128))))(
                _randn((t, h), xd, d)),
            lambda ns, x, sf: ns.per_block_cast_with_precomputed_sf(x, "e4m3", (128, 128), sf),
            lambda x, sf: R.cast(x, "e4m3", (128, 128), sf=sf))
    for fl in FLAGS:
        if not fl[1]:
            continue  # the lossless re-encoding needs power-of-two output sf
        add("per_block_cast_lossless",
            lambda t, h, fl=fl: f"e2m1 {t}x{h} in block1x32 round -> e4m3 block128x128{_flags(fl)}",
            lambda t, h, d: (q.per_token_cast(_randn((t, h), torch.bfloat16, d), "e2m1", 32, None, False, True,
                                              False),),
            lambda ns, x, fl=fl: ns.per_block_cast_lossless(x, "e4m3", (1, 32), (128, 128), *fl),
            lambda x, fl=fl: R.per_block_cast_lossless(x, (1, 32), (128, 128), fl[0], fl[2]))

    # per-channel casts (quant.md 3.8-3.10): T % 128 == 0
    for rnd in (False, True):
        tag = " round" if rnd else ""
        add("per_channel_cast", lambda t, h, tag=tag: f"bf16 {t}x{h} npt128{tag}",
            lambda t, h, d: (_randn((t, h), torch.bfloat16, d),),
            lambda ns, x, rnd=rnd: ns.per_channel_cast(x, "e4m3", 128, rnd),
            lambda x, rnd=rnd: R.cast(x, "e4m3", (128, 1), round_sf=rnd), tokens=TOKENS[1:])
        add("per_channel_cast_and_transpose", lambda t, h, tag=tag: f"bf16 {t}x{h} npt128{tag}",
            lambda t, h, d: (_randn((t, h), torch.bfloat16, d),),
            lambda ns, x, rnd=rnd: ns.per_channel_cast_and_transpose(x, "e4m3", 128, rnd),
            lambda x, rnd=rnd: (lambda o: (o[0].T.contiguous(), o[1]))(R.cast(x, "e4m3", (128, 1), round_sf=rnd)),
            tk2=False, tk1=True, tokens=TOKENS[1:])
        add("per_channel_cast_fused", lambda t, h, tag=tag: f"bf16 {t}x{h} npt128{tag}, no gather",
            lambda t, h, d: (_randn((t, h), torch.bfloat16, d),),
            lambda ns, x, rnd=rnd: ns.per_channel_cast_fused(x, "e4m3", 128, rnd),
            lambda x, rnd=rnd: R.per_channel_cast_fused(x, 128, None, rnd, None), tk2=False, tk1=True,
            tokens=TOKENS[1:])

    # cast-back (quant.md 3.5): the data of our cast of a randn of the output dtype
    for fmt in ("e4m3", "e2m1"):
        for out in ("bf16", "fp32"):
            od = torch.bfloat16 if out == "bf16" else torch.float32
            for fl in FLAGS:
                add("per_token_cast_back", lambda t, h, fmt=fmt, out=out, fl=fl: f"{fmt} {t}x{h} npc128{_flags(fl)} -> {out}",
                    lambda t, h, d, fmt=fmt, od=od, fl=fl: (q.per_token_cast(_randn((t, h), od, d), fmt, 128, None, *fl),),
                    lambda ns, x, out=out: ns.per_token_cast_back(x, out, 128),
                    lambda x, out=out: R.cast_back(x, out, (1, 128)))
    for out in ("bf16", "fp32"):
        od = torch.bfloat16 if out == "bf16" else torch.float32
        for blk in ((128, 128), (128, 1)):
            add("cast_back", lambda t, h, out=out, blk=blk: f"e4m3 {t}x{h} block{blk[0]}x{blk[1]} -> {out}",
                lambda t, h, d, od=od, blk=blk: (R.cast(_randn((t, h), od, d), "e4m3", blk),),
                lambda ns, x, out=out, blk=blk: ns.cast_back(x, out, blk),
                lambda x, out=out, blk=blk: R.cast_back(x, out, blk))
        add("unpack_from_e2m1fn_x2", lambda t, h, out=out: f"e2m1 {t}x{h} (int8 {t}x{h // 2}) -> {out}",
            lambda t, h, d: (torch.randint(-128, 128, (t, h // 2), dtype=torch.int8, device=d),),
            lambda ns, x, od=od: ns.unpack_from_e2m1fn_x2(x, od),
            lambda x, od=od: _unpack_ref(x, od))

    # E5M6 (quant.md 3.4-3.5; TileKernels 1.0.0 only): one scale per row
    for xd in (torch.bfloat16, torch.float32):
        for fl in FLAGS:
            add("per_token_cast_to_e5m6", lambda t, h, xd=xd, fl=fl: f"{_SHORT[xd]} {t}x{h} npc=H{_flags(fl)}",
                lambda t, h, d, xd=xd: (_randn((t, h), xd, d),),
                lambda ns, x, fl=fl: ns.per_token_cast(x, "e5m6", x.size(1), None, *fl),
                lambda x, fl=fl: R.cast_to_e5m6(x, x.size(1), *fl), tk2=False, tk1=True)
    for out in ("bf16", "fp32"):
        od = torch.bfloat16 if out == "bf16" else torch.float32
        add("cast_back_e5m6", lambda t, h, out=out: f"e5m6 {t}x{h} npc=H round -> {out}",
            lambda t, h, d, od=od: (q.per_token_cast_to_e5m6(_randn((t, h), od, d), h, False, True, False),),
            lambda ns, x, out=out: ns.cast_back(x, out, (1, x[0].size(1) * 2 // 3), "e5m6"),
            lambda x, out=out: R.cast_back_from_e5m6(x, out, (1, x[0].size(1) * 2 // 3)), tk2=False, tk1=True)

    # in-place round trip (quant.md 5.8): the case's input is a fresh copy per call site (see bench._in_place)
    for fmt in ("e4m3", "e2m1"):
        for rnd in (False, True):
            add("per_token_cast_and_cast_back", lambda t, h, fmt=fmt, rnd=rnd: f"bf16 {t}x{h} npc128 {fmt}"
                                                                               f"{' round' if rnd else ''}, in place",
                lambda t, h, d: (_randn((t, h), torch.bfloat16, d),),
                lambda ns, x, fmt=fmt, rnd=rnd: (ns.per_token_cast_and_cast_back(x, fmt, 128, rnd), x)[1],
                lambda x, fmt=fmt, rnd=rnd: R.per_token_cast_and_cast_back_values(x, fmt, 128, rnd, False))

    # RMSNorm (quant.md 5.11)
    add("norm_forward", lambda t, h: f"bf16 {t}x{h} weight",
        lambda t, h, d: (_randn((t, h), torch.bfloat16, d), _randn((h,), torch.bfloat16, d)),
        lambda ns, x, w: ns.norm_forward(x, w, 1e-6)[0],
        lambda x, w: qn.norm_forward_reference(x, w, 1e-6)[0], exact=False, hidden=NORM_HIDDEN)
    for fl in FLAGS:
        add("norm_forward_and_per_token_cast", lambda t, h, fl=fl: f"bf16 {t}x{h} weight -> e4m3 npc32{_flags(fl)}",
            lambda t, h, d: (_randn((t, h), torch.bfloat16, d), _randn((h,), torch.bfloat16, d)),
            lambda ns, x, w, fl=fl: ns.norm_forward_and_per_token_cast(x, w, 1e-6, "e4m3", 32, None, 1.0, *fl)[0],
            lambda x, w, fl=fl: qn.norm_forward_and_per_token_cast_reference(x, w, 1e-6, "e4m3", 32, None, 1.0,
                                                                             *fl)[0], exact=False, hidden=NORM_HIDDEN)
    add("norm_backward", lambda t, h: f"bf16 {t}x{h} weight, rstd -> x_grad, weight_grad",
        lambda t, h, d: (_randn((t, h), torch.bfloat16, d), _randn((t, h), torch.bfloat16, d),
                         _randn((h,), torch.bfloat16, d), torch.rand(t, device=d) + 0.5),
        lambda ns, dy, x, w, rstd: ns.norm_backward(dy, x, w, rstd),
        lambda dy, x, w, rstd: qn.norm_backward_reference(dy, x, w, rstd), exact=False, hidden=NORM_HIDDEN)

    # SwiGLU (quant.md 3.12, 3.14; x is (T, 2H)): without routing, 2.1.0's forward computes the same rows
    for fl in FLAGS:
        for clamp in (None, 0.5):
            tag = f"{_flags(fl)}{'' if clamp is None else f' clamp {clamp}'}"
            add("swiglu_forward_and_per_token_cast", lambda t, h, tag=tag: f"bf16 {t}x{2 * h} npc128{tag}",
                lambda t, h, d: (_randn((t, 2 * h), torch.bfloat16, d),),
                lambda ns, x, fl=fl, clamp=clamp: ns.swiglu_forward_and_per_token_cast(
                    x, "e4m3", 128, None, None, None, *fl, clamp),
                lambda x, fl=fl, clamp=clamp: qs.swiglu_forward_and_per_token_cast_reference(
                    x, "e4m3", 128, None, None, None, *fl, clamp),
                peer_call=lambda ns, x, fl=fl, clamp=clamp: _swiglu_fwd_peer(ns, x, fl, clamp))
    for rnd in (False, True):
        add("swiglu_backward_and_per_token_cast",
            lambda t, h, rnd=rnd: f"e4m3 pair {t}x{2 * h} npc128{' round' if rnd else ''}, one slot per token",
            lambda t, h, d: _swiglu_bwd_inputs(t, h, d),
            lambda ns, x, g, w, p2t, tt2p, rnd=rnd: ns.swiglu_backward_and_per_token_cast(x, g, w, p2t, tt2p, 128, rnd),
            lambda x, g, w, p2t, tt2p, rnd=rnd: _swiglu_bwd_ref(x, g, w, p2t, tt2p, rnd), tk2=False, tk1=True,
            exact=False)
        add("swiglu_forward_and_per_channel_cast_and_transpose",
            lambda t, h, rnd=rnd: f"bf16 {t}x{2 * h} npt128{' round' if rnd else ''} transpose",
            lambda t, h, d: (_randn((t, 2 * h), torch.bfloat16, d),),
            lambda ns, x, rnd=rnd: ns.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 128, rnd),
            lambda x, rnd=rnd: (lambda o: (o[0].T.contiguous(), o[1]))(R.cast(
                RS.swiglu_forward(x).to(torch.bfloat16), "e4m3", (128, 1), round_sf=rnd)),
            tk2=False, tk1=True, tokens=TOKENS[1:])

    # transposes (quant.md 3.15; TileKernels 1.0.0 only): both matrix dims % 64 == 0
    for dt, name in ((torch.bfloat16, "bf16"), (torch.float8_e4m3fn, "e4m3")):
        add("transpose", lambda t, h, name=name: f"{name} {t}x{h}",
            lambda t, h, d, dt=dt: (_randn((t, h), dt, d),),
            lambda ns, x: ns.transpose(x), lambda x: x.t().contiguous(), tk2=False, tk1=True, tokens=TOKENS[1:],
            area="transpose")
        add("batched_transpose", lambda t, h, name=name: f"{name} (8, {t}, {h})",
            lambda t, h, d, dt=dt: (_randn((8, t, h), dt, d),),
            lambda ns, x: ns.batched_transpose(x), lambda x: x.transpose(1, 2).contiguous(), tk2=False, tk1=True,
            tokens=TOKENS[1:3], area="transpose")

    # MoE routing (moe.md): their own token counts, expert counts and routing draws (tilefuse._bench_moe)
    from tilefuse import _bench_moe

    cases += _bench_moe.grid_cases(ops)
    from tilefuse import _bench_transform  # rotary embedding (transform.md 9)

    cases += _bench_transform.grid_cases(ops)
    return cases


def _swiglu_fwd_peer(ns, x, fl, clamp):
    """The SwiGLU forward + per-token cast of every row, in the peer's own signature: 2.1.0 names the clamp
    ``clamp_value`` and has no routing arguments in these places; 1.0.0 has ours (its forward fails to build
    under TileLang 0.1.15, see the quick row)."""
    import inspect

    params = inspect.signature(ns.swiglu_forward_and_per_token_cast).parameters
    if "clamp_value" in params:
        return ns.swiglu_forward_and_per_token_cast(x, "e4m3", 128, use_tma_aligned_col_major_sf=fl[0],
                                                    round_sf=fl[1], use_packed_ue8m0=fl[2], clamp_value=clamp)
    return ns.swiglu_forward_and_per_token_cast(x, "e4m3", 128, None, None, None, *fl, clamp)


def _swiglu_bwd_inputs(t: int, h: int, device) -> tuple:
    """SwiGLU backward inputs with one routing slot per token (top-1, row r is token r): the per-token e4m3 cast
    (npc 128, unrounded) of a bf16 randn ``(t, 2h)``, a bf16 randn gradient, fp32 rand weights ``(t, 1)``."""
    from tilefuse import quant as q

    x = q.per_token_cast(_randn((t, 2 * h), torch.bfloat16, device), "e4m3", 128)
    rows = torch.arange(t, dtype=torch.int32, device=device)
    return x, _randn((t, h), torch.bfloat16, device), torch.rand(t, 1, device=device), rows, rows.view(t, 1)


def _swiglu_bwd_ref(x, g, w, p2t, tt2p, round_sf: bool):
    from tilefuse.reference import quant as R
    from tilefuse.reference import swiglu as RS

    out, x_grad, weight_grad = RS.swiglu_backward(x, g, w, p2t, tt2p, 128)
    return (out.to(torch.bfloat16), R.cast(x_grad, "e4m3", (1, 128), round_sf=round_sf), x_grad.to(torch.bfloat16),
            weight_grad)


def _unpack_ref(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from tilefuse import formats as F

    return F.e2m1_decode(F.e2m1_unpack(x)).to(dtype)
