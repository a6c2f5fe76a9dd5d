"""TileLang kernel for the per-token casts (quant.md 3.1-3.3; formats 1.1-1.6).

One factory covers ``per_token_cast``, ``per_token_cast_with_sf_only`` and
``per_token_cast_with_precomputed_sf``: bf16/fp32 inputs or pre-quantized ``(data, sf)`` pairs (e4m3 or
packed e2m1 data, fp32 or packed-UE8M0 sf in any strides), e4m3 or e2m1 outputs, ``round_sf``, and the
row-major / TMA-aligned column-major / column-major packed-UE8M0 sf layouts. The token count and the
input row stride are symbolic; everything else is part of the static config.

Tiling: a CTA owns ``BM`` rows x ``G`` groups of ``npc`` channels (about 32 elements per thread, each
thread reading 16-byte vectors). Group maxima are register reductions plus warp shuffles; no shared memory,
no atomics, and the tiling never depends on the token count, so results are deterministic and
batch-invariant. Arithmetic is the spec's, in binary32 with IEEE division (fast-math off):
``sf = a / M`` and ``sf_inv = M / a``, or the power-of-two rule of 1.4 built from the exponent bits;
pre-quantized inputs use order A: ``narrow(data * (sf_in * sf_inv))``.
"""


import math

import torch

from tilefuse import _jit

_MAX = {"e4m3": 448.0, "e2m1": 6.0}
_CLAMP = {"e4m3": 1e-4, "e2m1": 6.0 * 2.0 ** -126}
_TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float8_e4m3fn: "float8_e4m3fn",
             torch.int8: "e2m1"}
_ELEMS_PER_THREAD = 32
_TARGET_ELEMS = 8192


def _tiling(hidden: int, npc: int) -> tuple[int, int, int]:
    """(BM rows, G groups, threads) per CTA: ~8192 elements, 32 per thread, groups never split across CTAs."""
    ng = -(-hidden // npc)
    cands = [ng] if hidden % npc else [g for g in range(1, ng + 1) if ng % g == 0]
    best = None
    for g in cands:
        for bm in (1, 2, 4, 8, 16, 32, 64):
            elems = bm * g * npc
            if elems % (32 * _ELEMS_PER_THREAD) or not 64 <= elems // _ELEMS_PER_THREAD <= 512:
                continue
            score = (abs(math.log2(elems / _TARGET_ELEMS)), bm)
            if best is None or score < best[0]:
                best = (score, (bm, g, elems // _ELEMS_PER_THREAD))
    if best is not None:
        return best[1]
    g = max(c for c in cands if c * npc <= max(npc, _TARGET_ELEMS))
    return 1, g, 128


def _vec(hidden_phys: int, elem_bytes: int) -> int:
    """Largest power-of-two vector (<= 16 bytes) that divides the physical row length."""
    v = 16 // elem_bytes
    while hidden_phys % v:
        v //= 2
    return v


def per_token_cast_kernel(x_dtype: str, fmt: str, hidden: int, npc: int, round_sf: bool, sf_layout: str,
                          mode: str, ibm: int = 0, ibk: int = 0, sf_in_packed: bool = False):
    """Factory for one static config.

    x_dtype: "bfloat16" | "float32" (plain) | "float8_e4m3fn" | "e2m1" (pre-quantized, needs ibm, ibk).
    fmt: "e4m3" | "e2m1". sf_layout: "row" | "col" | "col_packed". mode: "cast" | "sf_only" | "precomputed".
    """
    import tilelang.language as T

    M = _MAX[fmt]
    clamp = _CLAMP[fmt]
    prequant = x_dtype in ("float8_e4m3fn", "e2m1")
    BM, G, threads = _tiling(hidden, npc)
    ng = -(-hidden // npc)
    NT = ng // G
    partial = hidden % npc != 0
    x_phys = hidden // 2 if x_dtype == "e2m1" else hidden
    x_store = "int8" if x_dtype == "e2m1" else x_dtype
    x_bytes = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "int8": 1}[x_store]
    vec = _vec(x_phys, x_bytes)
    y_shape_h = hidden // 2 if fmt == "e2m1" else hidden
    y_dtype = "int8" if fmt == "e2m1" else "float8_e4m3fn"

    Tn, S, P, NBMI, SI0, SI1 = T.dynamic("num_tokens, x_row_stride, sf_pad, in_sf_rows, in_sf_s0, in_sf_s1")
    nbki = (-(-hidden // ibk)) if prequant else 1
    sfi_cols = -(-nbki // 4) if sf_in_packed else nbki
    W = -(-ng // 4)

    # -- expression helpers (evaluated while the prim_func is built) --
    def col_of(by, g, k):
        return (by * G + g) * npc + k

    def load_raw(X, row, col):
        """float32 of the stored element (decoded FP4 nibble for e2m1 data)."""
        if x_dtype == "e2m1":
            byte = T.cast(X[row, col // 2], "int32")
            nib = T.shift_right(byte, (col % 2) * 4) & 15
            c = nib & 7
            e = T.shift_right(c, 1)
            m = T.cast(c & 1, "float32")
            mag = T.if_then_else(e == 0, m * T.float32(0.5),
                                 (T.float32(2.0) + m) * T.cast(T.shift_left(1, e), "float32") * T.float32(0.25))
            return T.if_then_else(nib >= 8, -mag, mag)
        return T.cast(X[row, col], "float32")

    def sf_in_at(SFI, row, col):
        bi = row // ibm
        bk = col // ibk
        if sf_in_packed:
            word = SFI[bi, bk // 4]
            byte = T.shift_right(word, (bk % 4) * 8) & 255
            return T.reinterpret(T.shift_left(byte, 23), "float32")
        return SFI[bi, bk]

    def e2m1_code(v):
        """Nibble of quant.md 1.2: magnitude rounded to the nearest code, ties to even; sign bit copied."""
        m = T.abs(v)
        code = (T.cast(m > T.float32(0.25), "int32") + T.cast(m >= T.float32(0.75), "int32")
                + T.cast(m > T.float32(1.25), "int32") + T.cast(m >= T.float32(1.75), "int32")
                + T.cast(m > T.float32(2.5), "int32") + T.cast(m >= T.float32(3.5), "int32")
                + T.cast(m > T.float32(5.0), "int32"))
        sign = T.shift_right(T.reinterpret(v, "int32"), 31) & 1
        return code | T.shift_left(sign, 3)

    x_param = T.StridedTensor((Tn, x_phys), (S, 1), x_store)
    sfi_param = T.StridedTensor((NBMI, sfi_cols), (SI0, SI1), "int32" if sf_in_packed else "float32")
    y_param = T.Tensor((Tn, y_shape_h), y_dtype)
    if mode == "precomputed" or sf_layout == "row":
        sf_param = T.Tensor((Tn, ng), "float32")
    elif sf_layout == "col":
        sf_param = T.Tensor((ng, P), "float32")
    else:
        sf_param = T.Tensor((W, P, 4), "uint8")

    @T.macro
    def body(X, SFI, Y, SF):
        with T.Kernel(T.ceildiv(Tn, BM), NT, threads=threads) as (bx, by):
            xf = T.alloc_fragment((BM, G, npc), "float32")
            inv = T.alloc_fragment((BM, G), "float32")
            for i, g, k in T.Parallel(BM, G, npc):
                row = bx * BM + i
                col = col_of(by, g, k)
                ok = row < Tn
                if partial:
                    ok = T.And(ok, col < hidden)
                xf[i, g, k] = T.if_then_else(ok, load_raw(X, row, col), T.float32(0.0))
            if mode == "precomputed":
                for i, g in T.Parallel(BM, G):
                    row = bx * BM + i
                    inv[i, g] = T.if_then_else(row < Tn, T.float32(1.0) / SF[row, by * G + g], T.float32(1.0))
            else:
                am = T.alloc_fragment((BM, G), "float32")
                if prequant:
                    vf = T.alloc_fragment((BM, G, npc), "float32")
                    for i, g, k in T.Parallel(BM, G, npc):
                        row = bx * BM + i
                        col = col_of(by, g, k)
                        ok = row < Tn
                        if partial:
                            ok = T.And(ok, col < hidden)
                        vf[i, g, k] = T.if_then_else(ok, xf[i, g, k] * sf_in_at(SFI, row, col), T.float32(0.0))
                    T.reduce_absmax(vf, am, dim=2)
                else:
                    T.reduce_absmax(xf, am, dim=2)
                for i, g in T.Parallel(BM, G):
                    row = bx * BM + i
                    gi = by * G + g
                    a = T.max(am[i, g], T.float32(clamp))
                    if round_sf:
                        bits = T.reinterpret(a / T.float32(M), "int32")
                        eb = T.shift_right(bits - 1, 23) + 1  # biased exponent of 2^ceil(log2(a/M))
                        sf = T.reinterpret(T.shift_left(eb, 23), "float32")
                        inv[i, g] = T.reinterpret(T.shift_left(254 - eb, 23), "float32")
                    else:
                        sf = a / T.float32(M)
                        inv[i, g] = T.float32(M) / a
                    if row < Tn:
                        if sf_layout == "row":
                            SF[row, gi] = sf
                        elif sf_layout == "col":
                            SF[gi, row] = sf
                        else:
                            SF[gi // 4, row, gi % 4] = T.cast(eb, "uint8")
            if mode != "sf_only":
                if fmt == "e4m3":
                    for i, g, k in T.Parallel(BM, G, npc):
                        row = bx * BM + i
                        col = col_of(by, g, k)
                        ok = row < Tn
                        if partial:
                            ok = T.And(ok, col < hidden)
                        if ok:
                            if prequant:
                                scaled = xf[i, g, k] * (sf_in_at(SFI, row, col) * inv[i, g])
                            else:
                                scaled = xf[i, g, k] * inv[i, g]
                            Y[row, col] = T.cast(scaled, "float8_e4m3fn")
                else:
                    # e2m1: nibble codes go through shared memory, then two codes make one byte.
                    qs = T.alloc_shared((BM, G, npc), "uint8")
                    for i, g, k in T.Parallel(BM, G, npc):
                        row = bx * BM + i
                        col = col_of(by, g, k)
                        if prequant:
                            scaled = xf[i, g, k] * (sf_in_at(SFI, row, col) * inv[i, g])
                        else:
                            scaled = xf[i, g, k] * inv[i, g]
                        qs[i, g, k] = T.cast(e2m1_code(scaled), "uint8")
                    for i, g, k in T.Parallel(BM, G, npc // 2):
                        row = bx * BM + i
                        col = col_of(by, g, 2 * k)
                        ok = row < Tn
                        if partial:
                            ok = T.And(ok, col < hidden)
                        if ok:
                            byte = T.cast(qs[i, g, 2 * k], "int32") | T.shift_left(T.cast(qs[i, g, 2 * k + 1], "int32"), 4)
                            Y[row, col // 2] = T.cast(byte, "int8")

    if prequant:
        @T.prim_func
        def per_token_cast(X: x_param, SFI: sfi_param, Y: y_param, SF: sf_param):
            T.assume(S % vec == 0)
            body(X, SFI, Y, SF)
    elif mode == "sf_only":
        @T.prim_func
        def per_token_cast(X: x_param, SF: sf_param):
            T.assume(S % vec == 0)
            body(X, None, None, SF)
    else:
        @T.prim_func
        def per_token_cast(X: x_param, Y: y_param, SF: sf_param):
            T.assume(S % vec == 0)
            body(X, None, Y, SF)
    return per_token_cast


HIDDEN_SIZES = (576, 2048, 2560, 3072, 4096, 6144, 7168)  # quant.md 7.1


def _configs() -> list[tuple]:
    """Static configs built by ``precompile`` and the compile tier: exactly those the GPU tests and the bench use."""
    cfgs = [("bfloat16", "e4m3", h, 128, True, "col_packed", "cast") for h in HIDDEN_SIZES]
    for h in (576, 7168):
        for x_dtype in ("bfloat16", "float32"):
            for fmt in ("e4m3", "e2m1"):
                for round_sf, layout in ((True, "row"), (True, "col_packed"), (False, "col")):
                    cfg = (x_dtype, fmt, h, 128, round_sf, layout, "cast")
                    if cfg not in cfgs:
                        cfgs.append(cfg)
    cfgs += [("bfloat16", "e4m3", 2048, npc, False, "row", "cast") for npc in (16, 32, 64, 2048)]
    cfgs += [("bfloat16", fmt, 2048, 128, True, "row", "sf_only") for fmt in ("e4m3", "e2m1")]
    cfgs += [("bfloat16", fmt, 2048, 128, False, "row", "precomputed") for fmt in ("e4m3", "e2m1")]
    cfgs += [(xd, fmt, 2048, 128, True, "col_packed", "cast", 128, 128, True)
             for xd in ("float8_e4m3fn", "e2m1") for fmt in ("e4m3", "e2m1")]
    cfgs += [("float8_e4m3fn", "e4m3", 2048, 32, False, "row", "cast", 32, 32, False)]
    return cfgs


_jit.register("per_token_cast", per_token_cast_kernel, _configs)


def _aligned_rows(x: torch.Tensor, vec: int) -> torch.Tensor:
    """``x`` itself when its rows start on ``vec``-element boundaries (pointer and stride); else a contiguous copy."""
    es = x.element_size()
    if x.stride(-1) != 1 or x.data_ptr() % (vec * es) or (x.size(0) > 1 and x.stride(0) % vec):
        return x.contiguous()
    return x


def per_token_cast_launch(x: torch.Tensor, x_sf: torch.Tensor | None, fmt: str, num_per_channels: int,
                          x_block_size=None, use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                          use_packed_ue8m0: bool = False, mode: str = "cast", sf: torch.Tensor | None = None):
    """Allocate the outputs and launch (quant.md 3.1-3.3). Validates nothing: the public op does.

    ``x`` is the bf16/fp32 input, or the data of a pre-quantized pair with ``x_sf`` and ``x_block_size``.
    mode "cast" returns ``(out, out_sf)``, "sf_only" returns ``out_sf``, "precomputed" (with row-major fp32
    ``sf``) returns ``out``.
    """
    t = x.size(0)
    hidden = x.size(1) * (2 if x.dtype == torch.int8 else 1)
    npc = num_per_channels
    ng = -(-hidden // npc)
    dev = x.device
    out = None
    if mode != "sf_only":
        out = (torch.empty((t, hidden // 2), dtype=torch.int8, device=dev) if fmt == "e2m1"
               else torch.empty((t, hidden), dtype=torch.float8_e4m3fn, device=dev))
    layout = "row"
    out_sf = sf_arg = None
    if mode == "precomputed":
        sf_arg = sf.contiguous()
    else:
        pad = -(-t // 4) * 4
        if use_tma_aligned_col_major_sf and use_packed_ue8m0:
            layout = "col_packed"
            store = torch.empty((-(-ng // 4), pad), dtype=torch.int32, device=dev)
            out_sf, sf_arg = store[:, :t].t(), store.view(torch.uint8).view(store.size(0), pad, 4)
        elif use_tma_aligned_col_major_sf:
            layout = "col"
            store = torch.empty((ng, pad), dtype=torch.float32, device=dev)
            out_sf, sf_arg = store[:, :t].t(), store
        else:
            out_sf = sf_arg = torch.empty((t, ng), dtype=torch.float32, device=dev)
    if t > 0:
        x_dtype = _TL_DTYPE[x.dtype]
        phys = x.size(1)
        x = _aligned_rows(x, _vec(phys, x.element_size()))
        if x_sf is not None:
            ibm, ibk = x_block_size
            cfg = (x_dtype, fmt, hidden, npc, round_sf, layout, mode, ibm, ibk, x_sf.dtype == torch.int32)
            args = (x, x_sf, out, sf_arg)
        else:
            cfg = (x_dtype, fmt, hidden, npc, round_sf, layout, mode)
            args = (x, sf_arg) if mode == "sf_only" else (x, out, sf_arg)
        _jit.get("per_token_cast", cfg)(*args)
    if mode == "cast":
        return out, out_sf
    return out_sf if mode == "sf_only" else out


# ---- torch.library registration (torch.compile / fake tensors) ----

def _fake_sf(x: torch.Tensor, hidden: int, npc: int, col: bool, packed: bool) -> torch.Tensor:
    t = x.size(0)
    ng = -(-hidden // npc)
    pad = (t + 3) // 4 * 4
    if col and packed:
        return x.new_empty_strided((t, -(-ng // 4)), (1, pad), dtype=torch.int32)
    if col:
        return x.new_empty_strided((t, ng), (1, pad), dtype=torch.float32)
    return x.new_empty((t, ng), dtype=torch.float32)


def _fake_out(x: torch.Tensor, hidden: int, fmt: str) -> torch.Tensor:
    if fmt == "e2m1":
        return x.new_empty((x.size(0), hidden // 2), dtype=torch.int8)
    return x.new_empty((x.size(0), hidden), dtype=torch.float8_e4m3fn)


def _hidden(x: torch.Tensor) -> int:
    return x.size(1) * (2 if x.dtype == torch.int8 else 1)


@torch.library.custom_op("tilefuse::per_token_cast", mutates_args=(), device_types="cuda")
def _per_token_cast_op(x: torch.Tensor, x_sf: torch.Tensor | None, fmt: str, num_per_channels: int,
                       x_block_size: list[int] | None, use_tma_aligned_col_major_sf: bool, round_sf: bool,
                       use_packed_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, out_sf = per_token_cast_launch(x, x_sf, fmt, num_per_channels, x_block_size,
                                        use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    return out, out_sf


@_per_token_cast_op.register_fake
def _(x, x_sf, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0):
    h = _hidden(x)
    return _fake_out(x, h, fmt), _fake_sf(x, h, num_per_channels, use_tma_aligned_col_major_sf, use_packed_ue8m0)


@torch.library.custom_op("tilefuse::per_token_cast_with_sf_only", mutates_args=(), device_types="cuda")
def _sf_only_op(x: torch.Tensor, fmt: str, num_per_channels: int, use_tma_aligned_col_major_sf: bool,
                round_sf: bool, use_packed_ue8m0: bool) -> torch.Tensor:
    return per_token_cast_launch(x, None, fmt, num_per_channels, None, use_tma_aligned_col_major_sf, round_sf,
                                 use_packed_ue8m0, mode="sf_only")


@_sf_only_op.register_fake
def _(x, fmt, num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0):
    return _fake_sf(x, _hidden(x), num_per_channels, use_tma_aligned_col_major_sf, use_packed_ue8m0)


@torch.library.custom_op("tilefuse::per_token_cast_with_precomputed_sf", mutates_args=(), device_types="cuda")
def _precomputed_op(x: torch.Tensor, fmt: str, num_per_channels: int, sf: torch.Tensor) -> torch.Tensor:
    return per_token_cast_launch(x, None, fmt, num_per_channels, mode="precomputed", sf=sf)


@_precomputed_op.register_fake
def _(x, fmt, num_per_channels, sf):
    return _fake_out(x, _hidden(x), fmt)


def per_token_cast_cuda(x, fmt, num_per_channels, x_block_size=None, use_tma_aligned_col_major_sf=False,
                        round_sf=False, use_packed_ue8m0=False):
    """CUDA entry for the public ``per_token_cast`` (x a tensor or a ``(data, sf)`` pair): a direct launch in
    eager mode (cheapest), the custom op under ``torch.compile``."""
    data, x_sf = (x if isinstance(x, (tuple, list)) else (x, None))
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.per_token_cast(data, x_sf, fmt, num_per_channels,
                                                 None if x_block_size is None else list(x_block_size),
                                                 use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    return per_token_cast_launch(data, x_sf, fmt, num_per_channels, x_block_size,
                                 use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)


def per_token_cast_with_sf_only_cuda(x, fmt, num_per_channels, use_tma_aligned_col_major_sf=False,
                                     round_sf=False, use_packed_ue8m0=False):
    """CUDA entry for ``per_token_cast_with_sf_only`` (plain input)."""
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.per_token_cast_with_sf_only(x, fmt, num_per_channels,
                                                              use_tma_aligned_col_major_sf, round_sf,
                                                              use_packed_ue8m0)
    return per_token_cast_launch(x, None, fmt, num_per_channels, None, use_tma_aligned_col_major_sf, round_sf,
                                 use_packed_ue8m0, mode="sf_only")


def per_token_cast_with_precomputed_sf_cuda(x, fmt, num_per_channels, sf):
    """CUDA entry for ``per_token_cast_with_precomputed_sf`` (plain input, row-major fp32 ``sf``)."""
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.per_token_cast_with_precomputed_sf(x, fmt, num_per_channels, sf)
    return per_token_cast_launch(x, None, fmt, num_per_channels, mode="precomputed", sf=sf)
