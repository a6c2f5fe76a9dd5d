"""``python -m tilefuse bench``: kernel time against a copy of the same bytes, side by side with the peers, and
host overhead (DESIGN.md).

The cases: the grid of ``tilefuse._bench_grid`` (every quant and transpose op over hidden sizes, token counts and
flag sets; the MoE routing ops of ``tilefuse._bench_moe``), or with ``--quick`` the showcase rows of ``_cases`` (one
per op and flag set, at the spec's benchmark shapes, quant.md 7.3; MoE at T = 8192, 256 experts, top-8). ``tilefuse._bench_compare`` times them: each call alone after an L2 flush (``isolated``, the
default) or back to back (``stream``, :func:`median_us`), with a device copy of the same bytes and the 2 GiB copy
as ceilings; ``--compare`` adds the peers (``tilefuse._peers``). GB/s counts each input read once and each output
written once (decimal). Every case calls the public op; ``--list`` prints each case's shape and bytes without a
GPU (fake tensors), ``--report`` the tables of saved runs. ``--host-overhead`` times one-row calls on the host:
our eager entry, the custom op, a bare TileLang kernel call with preallocated outputs, and ``torch.empty``.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys
import time
from typing import Callable, NamedTuple

import torch

from tilefuse._peers import tensors as _tensors

_L2_ROTATE_BYTES = 512 << 20
_SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU time queued ahead of each timed batch (doubled while too short)


def median_us(fn: Callable[[int], object], n_sets: int, warmup: int = 5, iters: int = 30,
              calls: int = 10) -> float:
    """Median µs per call: each sample times ``calls`` back-to-back calls between one pair of CUDA events,
    call ``i`` using input set ``i % n_sets``. A device-side sleep is queued before the start event, so the
    host enqueues all the calls while the GPU is still asleep and the events time the kernels back to back:
    host launch, validation and allocation time stay out of the figure. If the GPU reached the start event
    before the host had enqueued the last call (the sleep was shorter than the host's work), the sample is
    discarded and the sleep doubled."""
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    times = []
    k = 0
    sleep = _SLEEP_CYCLES
    while len(times) < iters:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep)
        start.record()
        for _ in range(calls):
            fn(k % n_sets)
            k += 1
        late = start.query()  # the GPU already passed the start: it may have waited for the host
        end.record()
        end.synchronize()
        if late and sleep < 64 * _SLEEP_CYCLES:
            sleep *= 2
            continue
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def copy_ceiling_gbs() -> float:
    """GB/s of a 2 GiB device-to-device copy (read + write counted)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    us = median_us(lambda i: dst.copy_(src), 1, calls=3)
    return 2 * n / us / 1e3


def _nbytes(*objs) -> int:
    """Bytes of the logical elements of every tensor in ``objs`` (strided views count visible elements)."""
    return sum(t.numel() * t.element_size() for t in _tensors(objs))


def counted_bytes(inputs: tuple, outputs) -> int:
    """Bench bytes of one call: each input tensor read once plus each output tensor written once
    (quant.md 7.3; every bench case passes exactly the tensors the spec's table counts as inputs)."""
    return _nbytes(inputs) + _nbytes(outputs)


class Case(NamedTuple):
    """One bench row. ``make(device, scale) -> (shape label, input tensors)`` builds the inputs at the spec's
    benchmark shape times ``scale`` (each dimension kept on its alignment); ``run(*inputs)`` calls the public
    op; ``ref(*inputs)``, where given, is the reference timed under ``torch.compile``; ``peers`` maps a peer
    (``tilefuse._peers``) to ``fn(peer_module, *inputs)``, the same op in the peer's API; ``exact``: the spec makes
    the outputs bit-exact (else peers are compared by ``calc_diff``); ``check`` maps a peer to its own comparison
    ``fn(ours, theirs) -> (ok, text)`` where ``_peers.agree(exact)`` is not the rule (e.g. get_fused_mapping's
    order-free one); ``in_place``: the op writes its inputs, so the isolated timer restores them from a pristine
    copy before each timed call (outside the timed region)."""
    name: str
    make: Callable[[str, float], tuple[str, tuple]]
    run: Callable[..., object]
    ref: Callable[..., object] | None = None
    peers: dict | None = None
    exact: bool = True
    key: str = ""  # cases with one key launch the same kernels (they differ in the token count only)
    tokens: int = 0  # the grid's token count
    check: dict | None = None
    in_place: bool = False
    nbytes: Callable[..., int] | None = None  # ``nbytes(inputs, outputs)`` where the spec counts bytes otherwise


def _dim(n: int, scale: float, align: int = 1) -> int:
    """``n * scale`` rounded to a multiple of ``align``, at least ``align``."""
    return max(align, round(n * scale / align) * align)


_SHORT = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float8_e4m3fn: "e4m3"}


def _flag_names(col: bool, rnd: bool, packed: bool) -> str:
    return "".join(f" {n}" for n, on in (("col", col), ("round", rnd), ("ue8m0", packed)) if on)


def _randn(shape, dtype, device) -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype)


def _moe_routing(scale: float, align: int, tokens: int = 4001, topk: int = 6, experts: int = 256,
                 ranks: int = 8, seed: int = 0) -> tuple[int, int, list[int]]:
    """A quant.md 7.1 MoE case on one of ``ranks`` ranks: ``tokens`` tokens each pick ``topk`` distinct experts
    at random; the rows of each local expert are the ``(t, k)`` slots routed to it, padded with -1 to a multiple
    of ``align``. Returns ``(T, K, rows)``, ``rows[r] = t * K + k`` or -1 (plain Python: also builds under
    fake tensors)."""
    import random

    rng = random.Random(seed)
    t_src = _dim(tokens, scale)
    local = [[] for _ in range(experts // ranks)]
    for t in range(t_src):
        for k, e in enumerate(rng.sample(range(experts), topk)):
            if e < len(local):
                local[e].append(t * topk + k)
    rows = []
    for slots in local:
        rows += slots + [-1] * (-len(slots) % align)
    return t_src, topk, rows


def _cases() -> list[Case]:
    """The bench rows: every op with a TileLang kernel at its spec benchmark shape (quant.md 7.2-7.3), the
    largest of the grid, i.e. the one the >= 64 MB performance rule judges."""
    from tilefuse import quant as q
    from tilefuse import transpose as tr
    from tilefuse.reference.quant import cast as ref_cast

    cases: list[Case] = []

    def row(name, make, call, ref=None, peers: str = "", exact: bool = True, area: str = "quant"):
        """Append one case: ``call(ns, *inputs)`` runs the op from module ``ns`` (ours: ``tilefuse.<area>``; a peer's:
        ``tile_kernels.<area>``); ``peers`` names the peers that have it with this signature."""
        ours = q if area == "quant" else tr
        cases.append(Case(name, make, lambda *a: call(ours, *a), ref,
                          {p: (lambda tk, *a: call(getattr(tk, area), *a)) for p in peers.split()}, exact))

    # per-token casts: the rows kept from the per-token issue (shapes, flags and references unchanged)
    def ptc(x_dtype, fmt, flags):
        col, rnd, packed = flags

        def make(device, scale):
            t, h = _dim(8192, scale, 128), _dim(7168, scale, 128)
            label = f"{str(x_dtype).replace('torch.', '')} {t}x{h} npc128 {fmt}" + _flag_names(*flags)
            return label, (_randn((t, h), x_dtype, device),)

        ref = lambda x: ref_cast(x, fmt, (1, 128), round_sf=rnd, use_tma_aligned_col_major_sf=col,
                                 use_packed_ue8m0=packed)
        row("per_token_cast", make, lambda ns, x: ns.per_token_cast(x, fmt, 128, None, col, rnd, packed), ref, "tk2")

    for x_dtype, fmt, flags in ((torch.bfloat16, "e4m3", (False, True, False)),
                                (torch.bfloat16, "e4m3", (True, True, True)),
                                (torch.bfloat16, "e4m3", (False, False, False)),
                                (torch.float32, "e4m3", (True, True, True)),
                                (torch.bfloat16, "e2m1", (True, True, True))):
        ptc(x_dtype, fmt, flags)

    def plain(t, h, dtype=torch.bfloat16, t_align=1, extra=""):
        """A builder of one randn ``(t, h)`` input; the label names dtype, shape and ``extra``."""
        def make(device, scale):
            tt, hh = _dim(t, scale, t_align), _dim(h, scale, 128)
            return f"{_SHORT[dtype]} {tt}x{hh}{extra}", (_randn((tt, hh), dtype, device),)
        return make

    row("per_token_cast_with_sf_only", plain(8192, 7168, extra=" npc128 e4m3 col round ue8m0"),
        lambda ns, x: ns.per_token_cast_with_sf_only(x, "e4m3", 128, use_tma_aligned_col_major_sf=True, round_sf=True,
                                                     use_packed_ue8m0=True), peers="tk2")

    def with_sf(make_x, sf_of):
        """``make_x``'s input plus its row-major fp32 sf (computed by ``sf_of(x)``, a public op)."""
        def make(device, scale):
            label, (x,) = make_x(device, scale)
            return label, (x, sf_of(x))
        return make

    row("per_token_cast_with_precomputed_sf",
        with_sf(plain(8192, 7168, extra=" npc128 e4m3 (sf given)"), lambda x: q.per_token_cast_with_sf_only(x, "e4m3", 128)),
        lambda ns, x, sf: ns.per_token_cast_with_precomputed_sf(x, "e4m3", 128, sf), peers="tk2")

    # per-block casts (quant.md 3.6-3.7): T x H = 8001 x 7168
    for fmt, block, flags in (("e4m3", (128, 128), (True, True, True)), ("e2m1", (32, 32), (False, True, False))):
        row("per_block_cast", plain(8001, 7168, extra=f" {fmt} block{block[0]}x{block[1]}" + _flag_names(*flags)),
            lambda ns, x, fmt=fmt, block=block, flags=flags: ns.per_block_cast(x, fmt, block, *flags), peers="tk2")
    row("per_block_cast_with_sf_only", plain(8001, 7168, extra=" e4m3 block128x128 col round ue8m0"),
        lambda ns, x: ns.per_block_cast_with_sf_only(x, "e4m3", (128, 128), True, True, True), peers="tk2")
    row("per_block_cast_with_precomputed_sf",
        with_sf(plain(8001, 7168, extra=" e4m3 block128x128 (sf given)"),
                lambda x: q.per_block_cast_with_sf_only(x, "e4m3", (128, 128))),
        lambda ns, x, sf: ns.per_block_cast_with_precomputed_sf(x, "e4m3", (128, 128), sf), peers="tk2")

    def lossless(device, scale):
        """Packed e2m1 data with power-of-two row-major sf, block (1, 32) (the spec's input block)."""
        label, (x,) = plain(8001, 7168)(device, scale)
        pair = q.per_token_cast(x, "e2m1", 32, None, False, True, False)
        return label.replace("bf16", "e2m1") + " in block1x32 -> e4m3 block128x128 col round ue8m0", (pair,)

    row("per_block_cast_lossless", lossless,
        lambda ns, x: ns.per_block_cast_lossless(x, "e4m3", (1, 32), (128, 128), True, True, True), peers="tk2")

    # per-channel casts (quant.md 3.8-3.10): T in {4096, 8064}
    row("per_channel_cast", plain(8064, 7168, t_align=128, extra=" npt128 round"),
        lambda ns, x: ns.per_channel_cast(x, "e4m3", 128, True), peers="tk2")
    row("per_channel_cast_and_transpose", plain(8064, 7168, t_align=128, extra=" npt128 round"),
        lambda ns, x: ns.per_channel_cast_and_transpose(x, "e4m3", 128, True), peers="tk1")
    row("per_channel_cast_fused", plain(4096, 7168, t_align=128, extra=" npt128 round, no gather"),
        lambda ns, x: ns.per_channel_cast_fused(x, "e4m3", 128, True), peers="tk1")

    def fused_gather(pre_quantized: bool):
        """A MoE expansion (topk 6, 256 experts, 8 ranks, rows aligned to 128) of 4001 tokens, optionally
        given as a per-token e4m3 pair (npc 128, unrounded sf)."""
        def make(device, scale):
            t_src, k, rows = _moe_routing(scale, 128)
            h = _dim(7168, scale, 128)
            x = _randn((t_src, h), torch.bfloat16, device)
            if pre_quantized:
                x = q.per_token_cast(x, "e4m3", 128)
            pos = torch.tensor([r // k if r >= 0 else -1 for r in rows], dtype=torch.int32, device=device)
            kind = "e4m3 pair npc128" if pre_quantized else "bf16"
            return f"{kind} {t_src}x{h} -> {len(rows)} rows (topk {k}) npt128 round", (x, pos)
        return make

    for pre in (False, True):
        row("per_channel_cast_fused", fused_gather(pre), peers="tk1",
            call=lambda ns, x, pos, pre=pre: ns.per_channel_cast_fused(x, "e4m3", 128, True, 128 if pre else None,
                                                                       pos))

    # cast-back (quant.md 3.5): data from the cast of a randn of the output dtype
    def quantized(out_dtype, cast, desc: str):
        """``cast`` (a public op) of a randn ``8001 x 7168`` of ``out_dtype``; labelled ``desc``."""
        def make(device, scale):
            t, h = _dim(8001, scale), _dim(7168, scale, 128)
            return f"{desc.split()[0]} {t}x{h} {' '.join(desc.split()[1:])} -> {_SHORT[out_dtype]}", (
                cast(_randn((t, h), out_dtype, device)),)
        return make

    for fmt, out, flags in (("e4m3", "bf16", (True, True, True)), ("e2m1", "fp32", (False, True, False))):
        dtype = torch.bfloat16 if out == "bf16" else torch.float32
        row("per_token_cast_back",
            quantized(dtype, lambda x, fmt=fmt, flags=flags: q.per_token_cast(x, fmt, 128, None, *flags),
                      f"{fmt} npc128{_flag_names(*flags)}"),
            lambda ns, x, out=out: ns.per_token_cast_back(x, out, 128), peers="tk2")
    row("cast_back", quantized(torch.bfloat16, lambda x: q.per_block_cast(x, "e4m3", (128, 128)), "e4m3 block128x128"),
        lambda ns, x: ns.cast_back(x, "bf16", (128, 128)), peers="tk2")

    def e2m1_packed(device, scale):
        t, h = _dim(8001, scale), _dim(7168, scale, 128)
        return f"e2m1 {t}x{h} (int8 {t}x{h // 2}) -> fp32", (
            torch.randint(-128, 128, (t, h // 2), dtype=torch.int8, device=device),)

    row("unpack_from_e2m1fn_x2", e2m1_packed, lambda ns, x: ns.unpack_from_e2m1fn_x2(x, torch.float32), peers="tk2")

    # E5M6 (quant.md 3.4-3.5): one scale per row (npc = H)
    row("per_token_cast_to_e5m6", plain(8001, 7168, extra=" npc=H col round ue8m0"),
        lambda ns, x: ns.per_token_cast(x, "e5m6", x.size(1), None, True, True, True), peers="tk1")
    row("cast_back_e5m6", quantized(torch.bfloat16, lambda x: q.per_token_cast_to_e5m6(
        x, x.size(1), False, True, False), "e5m6 npc=H round"),
        lambda ns, x: ns.cast_back(x, "bf16", (1, x[0].size(1) * 2 // 3), "e5m6"), peers="tk1")

    # SwiGLU (quant.md 3.13-3.14), judged on the bytes of one pass
    def swiglu_bwd(device, scale):
        """MoE rows (topk 6, 256 experts, 8 ranks, aligned to npc 128) of 2H = 14336: x the per-token e4m3 cast
        (unrounded) of a bf16 randn, grad bf16 randn, weights fp32 rand (quant.md 7.2)."""
        t_src, k, rows = _moe_routing(scale, 128)
        h = _dim(7168, scale, 128)
        t_e = len(rows)
        x = q.per_token_cast(_randn((t_e, 2 * h), torch.bfloat16, device), "e4m3", 128)
        grad = _randn((t_e, h), torch.bfloat16, device)
        weight = torch.rand(t_src, k, device=device)
        back = [-1] * (t_src * k)
        for r, slot in enumerate(rows):
            if slot >= 0:
                back[slot] = r
        p2t = torch.tensor(rows, dtype=torch.int32, device=device)
        tt2p = torch.tensor(back, dtype=torch.int32, device=device).view(t_src, k)
        return f"e4m3 pair {t_e}x{2 * h} ({t_src} tokens, topk {k}) npc128 round", (x, grad, weight, p2t, tt2p)

    row("swiglu_backward_and_per_token_cast", swiglu_bwd,
        lambda ns, x, g, w, p2t, tt2p: ns.swiglu_backward_and_per_token_cast(x, g, w, p2t, tt2p, 128, True), peers="tk1",
        exact=False)

    def swiglu_pcc(device, scale):
        t, h = _dim(8064, scale, 128), _dim(7168, scale, 128)
        return f"bf16 {t}x{2 * h} npt128 round transpose", (_randn((t, 2 * h), torch.bfloat16, device),)

    row("swiglu_forward_and_per_channel_cast_and_transpose", swiglu_pcc,
        lambda ns, x: ns.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 128, True), peers="tk1")

    def swiglu_ptc(device, scale):
        """MoE rows (topk 6, 256 experts, 8 ranks, aligned to 16) of 2H = 7168 (H = 3584, the largest of the
        grid) with routing weights, col + round, clamp 0.5 (quant.md 7.2-7.3)."""
        t_src, k, rows = _moe_routing(scale, 16)
        h = _dim(3584, scale, 128)
        x = _randn((len(rows), 2 * h), torch.bfloat16, device)
        p2t = torch.tensor(rows, dtype=torch.int32, device=device)
        weights = torch.rand(t_src, k, device=device)
        return f"bf16 {len(rows)}x{2 * h} ({t_src} tokens, topk {k}, weighted) npc128 col round clamp 0.5", (
            x, p2t, weights)

    row("swiglu_forward_and_per_token_cast", swiglu_ptc, peers="tk1",
        call=lambda ns, x, p2t, w: ns.swiglu_forward_and_per_token_cast(x, "e4m3", 128, p2t, w, None, True, True,
                                                                        False, 0.5))

    # RMSNorm (quant.md 5.11; no upstream benchmark): bf16 8192 x 7168 with a weight
    def norm_input(device, scale):
        t, h = _dim(8192, scale), _dim(7168, scale, 128)
        return f"bf16 {t}x{h} weight", (_randn((t, h), torch.bfloat16, device),
                                        _randn((h,), torch.bfloat16, device))

    row("norm_forward", norm_input, lambda ns, x, w: ns.norm_forward(x, w, 1e-6)[0], peers="tk2", exact=False)
    row("norm_forward_and_per_token_cast",
        lambda device, scale: (lambda label, inputs: (label + " -> e4m3 npc32 col round ue8m0", inputs))(
            *norm_input(device, scale)),
        lambda ns, x, w: ns.norm_forward_and_per_token_cast(x, w, 1e-6, "e4m3", 32, None, 1.0, True, True, True)[0],
        peers="tk2", exact=False)

    def norm_grad(device, scale):
        label, (x, w) = norm_input(device, scale)
        rstd = torch.rand(x.size(0), device=device) + 0.5
        return label + ", rstd -> x_grad, weight_grad", (_randn(tuple(x.shape), torch.bfloat16, device), x, w, rstd)

    row("norm_backward", norm_grad, lambda ns, dy, x, w, rstd: ns.norm_backward(dy, x, w, rstd), peers="tk2", exact=False)

    def cast_in_place(ns, x):
        ns.per_token_cast_and_cast_back(x, "e4m3", 128, True)
        return x  # written in place: counted as the output

    row("per_token_cast_and_cast_back", plain(8192, 7168, extra=" npc128 e4m3 round, in place"), cast_in_place,
        peers="tk2")

    # weight sf (quant.md 5.13): MoE up (n 4096, k 7168) and down (n 7168, k 2048) weights of 256 experts
    def weight_sf(device, scale):
        g = _dim(256, scale)
        dims = [(_dim(4096, scale, 128), _dim(7168, scale, 128)), (_dim(7168, scale, 128), _dim(2048, scale, 128))]
        sf = [torch.exp2(torch.randint(-8, 8, (g, n // 128, k // 128), device=device).float()) for n, k in dims]
        return f"fp32 {g} x ({dims[0][0]}x{dims[0][1]}, {dims[1][0]}x{dims[1][1]}) block128", (sf,)

    row("batched_transpose_weight_sf", weight_sf,
        lambda ns, sf: ns.batched_transpose_weight_sf(sf, 128, [False, True], [None, None]), peers="tk2")

    # transposes (quant.md 3.15)
    def batched(device, scale):
        b, t, h = _dim(8, scale), _dim(8192, scale, 128), _dim(7168, scale, 128)
        return f"bf16 ({b}, {t}, {h})", (_randn((b, t, h), torch.bfloat16, device),)

    def strided(device, scale):
        t, h = _dim(8064, scale, 128), _dim(7168, scale, 128)
        return f"e4m3 {t}x{h} row stride 2H", (_randn((t, 2 * h), torch.float8_e4m3fn, device)[:, :h],)

    row("batched_transpose", batched, lambda ns, x: ns.batched_transpose(x), lambda x: x.transpose(1, 2).contiguous(),
        "tk1", area="transpose")
    row("transpose", strided, lambda ns, x: ns.transpose(x), lambda x: x.t().contiguous(), "tk1", area="transpose")

    # MoE routing (moe.md; issue 25): T = 8192, 256 experts, top-8, hidden 7168 (tilefuse._bench_moe)
    from tilefuse import _bench_moe

    cases += _bench_moe.quick_cases()
    from tilefuse import _bench_transform  # rotary embedding (transform.md 9)

    cases += _bench_transform.quick_cases()
    return cases


def list_cases(scale: float = 1.0, ops: list[str] | None = None, quick: bool = True,
               match: str | None = None) -> list[dict]:
    """Each case's name, shape and bench bytes, without a GPU: inputs and outputs are fake tensors (shapes
    only, nothing computed), the outputs from the public op's CPU reference. A reference that reads data
    (a data-dependent check) runs on real CPU tensors instead."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               FakeTensorMode)

    from tilefuse._bench_compare import select_cases

    rows = []
    for case in select_cases(quick, ops, match=match):
        try:
            with FakeTensorMode():
                shape, inputs = case.make("cpu", scale)
                nbytes = (case.nbytes or counted_bytes)(inputs, case.run(*inputs))
        except (DataDependentOutputException, DynamicOutputShapeException):
            shape, inputs = case.make("cpu", scale)
            nbytes = (case.nbytes or counted_bytes)(inputs, case.run(*inputs))
        rows.append({"op": case.name, "shape": shape, "bytes": nbytes})
    return rows


def bench_configs(ops: list[str] | None = None, grid: bool = True) -> list[tuple[str, tuple]]:
    """The ``(kernel, static config)`` pairs the bench rows and the grid launch, found without a GPU, so ``precompile
    --bench`` can build exactly those (e.g. for a ``TILEFUSE_KNOBS`` variant). The trace runs in a child
    process: launchers cache what ``_jit.get`` returned, and the trace's recorder must not stay behind."""
    import subprocess

    code = ("import sys; from tilefuse import bench; "
            "print(repr(bench._trace_configs(sys.argv[2:] or None, sys.argv[1] == '1')))")
    done = subprocess.run([sys.executable, "-c", code, str(int(grid)), *(ops or [])], capture_output=True, text=True,
                          check=False)
    if done.returncode:
        raise RuntimeError(f"bench_configs: the trace failed:\n{done.stderr[-2000:]}")
    from tilefuse import _jit

    _jit.registered()  # the kernel modules, imported here too: callers look configs up (``_jit._lib_path``)
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def _trace_configs(ops: list[str] | None, grid: bool = True) -> list[tuple[str, tuple]]:
    """``bench_configs`` in this process: each case runs on fake CUDA tensors (shapes only) with ``_jit.get``
    replaced by a recorder."""
    import warnings

    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               FakeTensorMode)

    from tilefuse import _jit, _registry
    from tilefuse._bench_compare import select_cases

    registry = _registry.load_all()
    seen: dict[tuple[str, tuple], None] = {}
    real_get, real_getitem = _jit.get, torch.Tensor.__getitem__

    def getitem(t, index):
        """Basic indexing (ints, unit-step slices, None) as select/narrow/unsqueeze: Python indexing of a fake
        CUDA tensor asks for a CUDA device guard, which a CPU-only torch lacks."""
        if not isinstance(index, tuple):
            index = (index,)
        if not all(i is None or isinstance(i, int) or (isinstance(i, slice) and i.step in (None, 1)) for i in index):
            return real_getitem(t, index)
        dim = 0
        for i in index:
            if i is None:  # a new axis (e.g. a row mask broadcast as mask[:, None])
                t = t.unsqueeze(dim)
                dim += 1
            elif isinstance(i, int):
                t = t.select(dim, i)
            else:
                start, stop, _ = i.indices(t.size(dim))
                t = t.narrow(dim, start, max(0, stop - start))
                dim += 1
        return t

    def record(name, config):
        seen[(name, config)] = None
        return lambda *args: None

    def contiguous(t, memory_format=torch.contiguous_format):
        return t if t.is_contiguous(memory_format=memory_format) else t.clone(memory_format=memory_format)

    # ``~t`` and ``t.contiguous()`` of a fake CUDA tensor ask for the device guard too; these spellings do not
    real = (torch.Tensor.__getitem__, torch.Tensor.__invert__, torch.Tensor.contiguous)
    _jit.get = record
    torch.Tensor.__getitem__, torch.Tensor.__invert__, torch.Tensor.contiguous = (
        getitem, lambda t: torch.bitwise_not(t), contiguous)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # data_ptr() of a fake tensor (the launchers' alignment checks)
            quick = select_cases(True, ops)
            for case in quick + (select_cases(False, ops) if grid else []):
                if registry.get(f"{_area(case.name)}.{case.name}", {}).get("path") == "reference":
                    continue  # no kernel yet: CUDA tensors take the reference, which launches nothing to trace
                try:
                    with FakeTensorMode(allow_non_fake_inputs=True):
                        case.run(*case.make("cuda", 1.0)[1])
                except (DataDependentOutputException, DynamicOutputShapeException):
                    # the op syncs with the host (get_fused_mapping with N = 0 reads the counts back): shapes alone
                    # cannot run it; its kernels are the ones the same op's no-sync case traces
                    continue
                except Exception as exc:  # a launcher step fake CUDA tensors cannot take: say which case
                    if case in quick:  # the grid's cases that make inputs with our ops are compiled on first use
                        raise RuntimeError(f"bench_configs: the {case.name} case failed on fake CUDA tensors: "
                                           f"{type(exc).__name__}: {exc}") from exc
    finally:
        _jit.get = real_get
        torch.Tensor.__getitem__, torch.Tensor.__invert__, torch.Tensor.contiguous = real
    return list(seen)


def _area(name: str) -> str:
    from tilefuse._bench_moe import OPS as MOE_OPS

    if name in MOE_OPS:
        return "moe"
    if name == "apply_rotary":
        return "transform"
    return "transpose" if name in ("transpose", "batched_transpose") else "quant"


def _interleaved_call_us(calls: list, batch: int = 200, rounds: int = 11) -> list[float]:
    """Median wall µs per call of each function in ``calls``: ``rounds`` rounds, each timing a batch of
    ``batch`` calls of every function in turn, so host drift (clock, other processes) hits them alike."""
    for fn in calls:
        for _ in range(50):
            fn()
    torch.cuda.synchronize()
    samples = [[] for _ in calls]
    for _ in range(rounds):
        for k, fn in enumerate(calls):
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            samples[k].append((time.perf_counter() - t0) / batch * 1e6)
            torch.cuda.synchronize()
    return [statistics.median(v) for v in samples]


def _gate_host_calls() -> dict:
    """The one-token gate calls of issue 25's host target (<= 1.5x a bare TileLang call of the same kernel with
    preallocated outputs): topk_gate and moe_topk_gate_forward (sqrtsoftplus + bias), bare and public."""
    from tilefuse import _jit, moe
    from tilefuse._launch import placeholder as ph

    scores = torch.randn(1, 256, device="cuda")
    idx = torch.empty(1, 8, dtype=torch.int64, device="cuda")
    wts = torch.empty(1, 8, dtype=torch.float32, device="cuda")
    bias = torch.randn(256, device="cuda")
    topk = _jit.get_jit_kernel("topk_gate", (256, 8))
    gate = _jit.get_jit_kernel("moe_topk_gate_forward", (256, 8, 0, "bias"))
    d = "cuda"
    u8 = torch.uint8
    gate_args = (scores, bias, ph(d, torch.float32), ph(d, u8), ph(d, u8), ph(d, u8), ph(d, u8),
                 ph(d, torch.int32, (1, 1)), ph(d, torch.int32), ph(d, torch.int64, (1, 8)), idx, wts,
                 ph(d, torch.float32, (1, 256)), 2.5, 0, 0)
    g1, g2 = "topk_gate, 256 experts, top-8", "moe_topk_gate_forward, 256 experts, top-8, bias"
    return [
        (g1, "bare TileLang kernel call (JITKernel, preallocated output)", lambda: topk(scores, idx)),
        (g1, "tilefuse.moe.topk_gate (public op)", lambda: moe.topk_gate(scores, 8)),
        (g2, "bare TileLang kernel call (JITKernel, preallocated outputs)", lambda: gate(*gate_args)),
        (g2, "tilefuse.moe.moe_topk_gate_forward (public op)",
         lambda: moe.moe_topk_gate_forward(scores, 8, False, 0, 2.5, 0, bias=bias)),
    ]


def host_overhead(iters: int = 2000) -> list[dict]:
    """Median wall µs per call at one row (7168 bf16 channels -> e4m3), for two sf layouts, of six other
    public ops at one row (their bench rows' configs; group "other public ops", no baseline) and of the two
    one-token MoE gates beside their bare kernels (``_gate_host_calls``). Each layout group has
    two baselines: the bare TileLang call with preallocated outputs, and TileLang's own allocating call
    (``out_idx``: the kernel returns its outputs), which does what the public op does minus validation; the
    latter exists for the row-major layout only (TileLang allocates plain contiguous outputs). All calls are
    timed interleaved (see ``_interleaved_call_us``)."""
    import tilelang

    from tilefuse import _jit
    from tilefuse import quant
    from tilefuse.quant import _per_token_cast_kernel as Q

    x = torch.randn(1, 7168, device="cuda").to(torch.bfloat16)
    everything = []
    for layout, col in (("col_packed", True), ("row", False)):
        cfg = ("bfloat16", "e4m3", 7168, 128, True, layout, "cast")
        jk = _jit.get_jit_kernel("per_token_cast", cfg)
        out, sf = Q.per_token_cast_launch(x, None, "e4m3", 128, None, col, True, col)
        raw = _jit.get("per_token_cast", cfg)
        group = "col + round + ue8m0" if col else "row-major sf, round"
        calls = {
            "torch.empty(1, 7168)": lambda: torch.empty((1, 7168), dtype=torch.float8_e4m3fn, device="cuda"),
            "x.new_empty((1, 7168), fp8)": lambda: x.new_empty((1, 7168), dtype=torch.float8_e4m3fn),
            "raw TVM-FFI call (preallocated outputs)": lambda raw=raw, out=out, sf=sf: raw(x, out, sf),
            "bare TileLang kernel call (JITKernel, preallocated outputs)": lambda jk=jk, out=out, sf=sf: jk(x, out, sf),
        }
        if not col:
            alloc = tilelang.compile(Q.per_token_cast_kernel(*cfg), out_idx=[1, 2],
                                     target={"kind": "cuda", "arch": _jit.current_arch()},
                                     execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS))
            calls["bare TileLang kernel call allocating its outputs (JITKernel, out_idx)"] = lambda: alloc(x)
        calls["tilefuse launcher (per_token_cast_launch: allocation + launch)"] = (
            lambda col=col: Q.per_token_cast_launch(x, None, "e4m3", 128, None, col, True, col))
        py_plan = Q._plan(x.dtype, 7168, None, "e4m3", 128, None, col, True, col, "cast", native=False)
        calls["its Python launch path (torch.empty_strided x2 + TVM-FFI call; TILEFUSE_NATIVE=0)"] = (
            lambda py_plan=py_plan: py_plan(x, 1))
        calls["tilefuse.quant.per_token_cast (public op: validation + launcher)"] = (
            lambda col=col: quant.per_token_cast(x, "e4m3", 128, None, col, True, col))
        calls["torch.ops.tilefuse.per_token_cast (custom op)"] = (
            lambda col=col: torch.ops.tilefuse.per_token_cast(x, None, "e4m3", 128, None, col, True, col))
        everything += [(group, name, fn) for name, fn in calls.items()]
    # other public ops at one row, at their bench rows' static configs (no target: where the host time goes)
    w = torch.randn(7168, device="cuda").to(torch.bfloat16)
    ptc_pair = quant.per_token_cast(x, "e4m3", 128, None, True, True, True)
    pbc_pair = quant.per_block_cast(x, "e4m3", (128, 128))
    others = {
        "per_block_cast e4m3 128x128 col round ue8m0": lambda: quant.per_block_cast(x, "e4m3", (128, 128), True, True,
                                                                                    True),
        "per_token_cast_back e4m3 npc128 col round ue8m0 -> bf16": lambda: quant.per_token_cast_back(ptc_pair, "bf16",
                                                                                                     128),
        "cast_back e4m3 block128x128 -> bf16": lambda: quant.cast_back(pbc_pair, "bf16", (128, 128)),
        "per_token_cast_to_e5m6 npc=H col round ue8m0": lambda: quant.per_token_cast_to_e5m6(x, 7168, True, True, True),
        "norm_forward (weight)": lambda: quant.norm_forward(x, w, 1e-6),
        "norm_forward_and_per_token_cast e4m3 npc32 col round ue8m0": lambda: quant.norm_forward_and_per_token_cast(
            x, w, 1e-6, "e4m3", 32, None, 1.0, True, True, True),
    }
    everything += [("other public ops", name, fn) for name, fn in others.items()]
    everything += _gate_host_calls()
    from tilefuse import _bench_transform

    everything += _bench_transform.host_calls()
    times = _interleaved_call_us([fn for _, _, fn in everything], batch=max(1, iters // 10))
    return [{"group": group, "call": name, "us": us} for (group, name, _), us in zip(everything, times)]


def host_overhead_table(rows: list[dict]) -> list[str]:
    """The markdown lines of :func:`host_overhead`'s rows, each with its ratio to the group's two baselines."""
    lines = ["| sf layout | call at one row | µs per call | vs bare call | vs allocating bare call |",
             "| --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        same = [o for o in rows if o["group"] == r["group"]]
        bare = next((o["us"] for o in same if o["call"].startswith("bare TileLang kernel call (JIT")), None)
        alloc = next((o["us"] for o in same if "allocating" in o["call"]), None)
        vs_bare = f"{r['us'] / bare:.2f}x" if bare else "-"
        vs_alloc = f"{r['us'] / alloc:.2f}x" if alloc else "-"
        lines.append(f"| {r['group']} | {r['call']} | {r['us']:.2f} | {vs_bare} | {vs_alloc} |")
    return lines


_COLD = """
import time, sys
t0 = time.perf_counter()
import torch
torch.cuda.init(); x = torch.randn(4096, 7168, device="cuda").to(torch.bfloat16); torch.cuda.synchronize()
t1 = time.perf_counter()
import tilefuse.quant as q
t2 = time.perf_counter()
out, sf = q.per_token_cast(x, "e4m3", 128, None, True, True, True); torch.cuda.synchronize()
t3 = time.perf_counter()
ref = q.per_token_cast(x.cpu(), "e4m3", 128, None, True, True, True)
ok = torch.equal(out.cpu().view(torch.uint8), ref[0].view(torch.uint8))
from tilefuse import _native
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {t3 - t2:.3f} {ok} {'tilelang' in sys.modules} {_native.module() is not None}")
"""


def cold_start() -> dict:
    """A second process's first call of an already-compiled kernel (disk cache warm): seconds for
    ``import tilefuse.quant`` and for the first ``per_token_cast`` call (load + launch + sync)."""
    import subprocess
    import sys

    from tilefuse.quant import per_token_cast

    x = torch.randn(8, 7168, device="cuda").to(torch.bfloat16)
    per_token_cast(x, "e4m3", 128, None, True, True, True)  # make sure this config is in the disk cache
    res = subprocess.run([sys.executable, "-c", _COLD], capture_output=True, text=True, timeout=120)
    fields = res.stdout.split()
    if res.returncode or len(fields) != 6:
        return {"error": (res.stdout + res.stderr)[-500:]}
    return {"torch_and_cuda_init_s": float(fields[0]), "import_tilefuse_s": float(fields[1]),
            "first_call_s": float(fields[2]), "equals_reference": fields[3] == "True",
            "imported_tilelang": fields[4] == "True", "native_launcher": fields[5] == "True"}


def _sweep_cases(only: str | None = None) -> list[tuple]:
    """(shape, make_inputs, fmt, col, round, packed, kernel config without the tile) of each per_token_cast case."""
    from tilefuse.quant import _per_token_cast_kernel as Q

    rows = []
    for name, make_case, *_ in _cases():
        if name != "per_token_cast":
            continue
        shape = make_case("meta", 1.0)[0]
        make = lambda make_case=make_case: make_case("cuda", 1.0)[1]
        col, rnd, packed = (" col" in shape, " round" in shape, " ue8m0" in shape)
        fmt = "e2m1" if "e2m1" in shape else "e4m3"
        layout = "col_packed" if packed else ("col" if col else "row")
        x_dtype = torch.float32 if shape.startswith("float32") else torch.bfloat16
        base = (Q._TL_DTYPE[x_dtype], fmt, 7168, 128, rnd, layout, "cast", 0, 0, False)
        if only is None or only in shape:
            rows.append((shape, make, fmt, col, rnd, packed, base))
    return rows


def sweep_work(tiles: list[tuple[int, int]], only: str | None = None) -> list[tuple[str, tuple]]:
    """The ``(kernel, config)`` pairs a tile sweep compiles (for ``_jit.compile_many``)."""
    return [("per_token_cast", base + (tile,)) for *_, base in _sweep_cases(only) for tile in tiles]


def parse_tiles(text: str) -> list[tuple[int, int]]:
    """``"256x4,512x8"`` -> ``[(256, 4), (512, 8)]``."""
    return [tuple(int(v) for v in t.split("x")) for t in text.split(",")]


def tile_sweep(tiles: list[tuple[int, int]], jobs: int = 16, only: str | None = None) -> list[dict]:
    """Time each ``per_token_cast`` bench case at each ``(threads, pairs per thread)`` tile (the tile never
    changes results: each variant's outputs are compared bitwise with the default tile's)."""
    from tilefuse import _jit
    from tilefuse.quant import _per_token_cast_kernel as Q

    plans = [(shape, make()[0], fmt, col, rnd, packed, base) for shape, make, fmt, col, rnd, packed, base in _sweep_cases(only)]
    work = sweep_work(tiles, only)
    arch = _jit.current_arch()
    todo = [w for w in work if not os.path.exists(_jit._lib_path(*w, arch))]  # precompiled ones are skipped
    failures = dict(_jit.compile_many(todo, arch, jobs)) if todo else {}
    rows = []
    for shape, x, fmt, col, rnd, packed, base in plans:
        want = Q.per_token_cast_launch(x, None, fmt, 128, None, col, rnd, packed)
        sets = [x] + [torch.randn_like(x, dtype=torch.float32).to(x.dtype) for _ in range(2)]
        for tile in tiles:
            cfg = base + (tile,)
            if ("per_token_cast", cfg) in failures:
                rows.append({"shape": shape, "tile": tile, "error": failures[("per_token_cast", cfg)][:200]})
                continue
            fn = _jit.get("per_token_cast", cfg)
            got = [torch.full_like(want[0], 0x7F if fmt == "e2m1" else 1.0), torch.empty_like(want[1])]
            fn(x, *got)
            same = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
            us = median_us(lambda i: fn(sets[i % 3], *got), 3)
            nbytes = _nbytes(x, *want)
            rows.append({"shape": shape, "tile": tile, "us": us, "gbs": nbytes / us / 1e3, "bitwise_equal": same})
        del sets
        torch.cuda.empty_cache()
    return rows


def _save(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def main(argv: list[str]) -> int:
    from tilefuse import _bench_compare as C
    from tilefuse import _peers

    parser = argparse.ArgumentParser(prog="python -m tilefuse bench")
    parser.add_argument("--list", action="store_true",
                        help="print the cases (op, shape, bytes) without running them (no GPU needed)")
    parser.add_argument("--ops", nargs="*", default=None, help="op names or areas (quant, transpose, moe)")
    parser.add_argument("--quick", action="store_true",
                        help="only the showcase rows (one per op and flag set) instead of the whole grid")
    parser.add_argument("--match", default=None, metavar="REGEX",
                        help="only the grid cases whose label the regex finds, e.g. 'block128x1 ' or '^e4m3 16384x'")
    parser.add_argument("--compare", action="store_true",
                        help="also run every peer that has the op (--peers), same inputs, same process, same timer")
    parser.add_argument("--peers", default="tk2,tk1,liger,compile",
                        help="peers of --compare, comma-separated: tk2, tk1 (second process), liger, compile")
    parser.add_argument("--timer", default="isolated",
                        help="isolated (each call alone after an L2 flush; speedups use it), stream "
                             "(back-to-back calls), or isolated,stream")
    parser.add_argument("--warm-jobs", type=int, default=0,
                        help="compile every kernel of the run in N processes before timing (0: compile on first use)")
    parser.add_argument("--json", default=None, help="write the results as JSON")
    parser.add_argument("--markdown", default=None, help="write the table and the summary as markdown")
    parser.add_argument("--plot", default=None, help="write a PNG of the speedup over each peer")
    parser.add_argument("--report", nargs="+", default=None, metavar="JSON",
                        help="print (and with --markdown write) the tables of saved runs, merged in order; no GPU")
    parser.add_argument("--side-by-side", action="store_true",
                        help="with --report: one column per saved run (the same cases under other TILEFUSE_KNOBS)")
    parser.add_argument("--child-json", default=None, help=argparse.SUPPRESS)  # the TileKernels 1.0.0 process
    parser.add_argument("--host-overhead", action="store_true", help="also time one-row calls on the host")
    parser.add_argument("--no-compile-ref", action="store_true",
                        help="without --compare: skip torch.compile of the references")
    parser.add_argument("--cold-start", action="store_true",
                        help="also time a second process's first per_token_cast call (warm disk cache)")
    parser.add_argument("--tile-cases", default=None, help="sweep only the per_token_cast cases whose label "
                        "contains this text (e.g. 'e2m1')")
    parser.add_argument("--tiles", default=None,
                        help="per_token_cast tile sweep, e.g. 256x4,512x8 (threads x pairs per thread)")
    args = parser.parse_args(argv)
    if args.report:
        return C.report_main(args.report, args.markdown, args.side_by_side)
    if args.list:
        print("| op | shape | MB |\n| --- | --- | ---: |")
        for r in list_cases(ops=args.ops, quick=args.quick, match=args.match):
            print(f"| {r['op']} | {r['shape']} | {r['bytes'] / 1e6:.1f} |")
        return 0
    timers = tuple(t for t in args.timer.split(",") if t)
    if not timers or any(t not in ("isolated", "stream") for t in timers):
        parser.error(f"--timer must be isolated, stream or isolated,stream, got {args.timer!r}")
    if args.compare:
        peers = [p for p in args.peers.split(",") if p]
        unknown = [p for p in peers if p not in _peers.PEER_NAMES]
        if unknown:
            parser.error(f"--peers: unknown {unknown}; choose from {sorted(_peers.PEER_NAMES)}")
    else:
        peers = [] if args.no_compile_ref else ["compile"]
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU")
        return 1
    done_rows: list = []

    def progress(i, n, r):
        done_rows.append(r)
        if args.json and len(done_rows) % 50 == 0:  # a run cut short keeps what it measured
            _save({"partial": True, "gpu": torch.cuda.get_device_name(),
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": done_rows}, args.json + ".partial")
        if "error" in r:
            print(f"  [{i + 1}/{n}] {r['op']} | {r.get('shape')} | fails: {r['error']}", flush=True)
            return
        us = r.get("us", r.get("stream_us"))
        cells = "".join(f" | {p} " + (f"{e['us']:.1f} us {e['speedup']:.2f}x{'' if e['agree'] else ' DIFFERS'}"
                                      if "speedup" in e else e.get("error", e.get("check", ""))[:60])
                        for p, e in r["peers"].items())
        print(f"  [{i + 1}/{n}] {r['op']} | {r['shape']} | {us:.1f} us{cells}", flush=True)

    child = args.child_json is not None
    result = C.run(args.quick, args.ops, peers, timers, args.warm_jobs, child, progress, args.match)
    if child:
        _save(result, args.child_json)
        return 0
    lines = [f"{result['gpu']}, {result['date']}; timer: {args.timer}; copy ceiling (2 GiB) "
             f"{result['copy_ceiling_gbs']:.0f} GB/s", "", *C.table(result, peers)]
    if "tk2" in peers:
        result["summary_tk2"] = C.summary(result, "tk2")
        lines += ["", *C.summary_lines(result["summary_tk2"])]
    if result.get("tk1_error"):
        lines += ["", f"TileKernels 1.0.0: {result['tk1_error']}"]
    print("\n" + "\n".join(lines))
    _save(result, args.json)
    if args.json and os.path.exists(args.json + ".partial"):  # the whole run is in args.json now
        os.remove(args.json + ".partial")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.plot:
        C.plot(result, peers, args.plot)
    if args.host_overhead:
        from tilefuse import _native

        result["host_overhead"] = host_overhead()
        result["native_launcher"] = _native.module() is not None
        print("\n" + "\n".join(host_overhead_table(result["host_overhead"])))
        print("native launcher:", "on" if result["native_launcher"] else f"off ({_native.error()})")
        _save(result, args.json)
    if args.cold_start:
        result["cold_start"] = cold_start()
        print("\ncold start (second process, warm disk cache):", result["cold_start"])
        _save(result, args.json)
    if args.tiles:
        result["tile_sweep"] = tile_sweep(parse_tiles(args.tiles), only=args.tile_cases)
        print("\n| per_token_cast case | tile | µs | % ceiling | bitwise equal |\n| --- | --- | ---: | ---: | --- |")
        for r in result["tile_sweep"]:
            if "error" in r:
                print(f"| {r['shape']} | {r['tile']} | error: {r['error'][:80]} | | |")
            else:
                print(f"| {r['shape']} | {r['tile']} | {r['us']:.1f} | "
                      f"{100 * r['gbs'] / result['copy_ceiling_gbs']:.1f} | {r['bitwise_equal']} |")
        _save(result, args.json)
    return 0
