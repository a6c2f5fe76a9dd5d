"""TileLang kernels for dequantization: ``cast_back`` / ``per_token_cast_back`` (quant.md 3.5, 2.2) and
``unpack_from_e2m1fn_x2`` (1.2); the E5M6 cast-back (2.3) uses the same factory (``_e5m6_kernel``).

``out[i, j] = round_fmt(decode(data[i, j]) * sf[i // bm, j // bk])``: one binary32 product, then RNE to
bf16 or nothing for fp32. Decoding is exact integer bit assembly (no tables, no fp8 intrinsics):

* e4m3: the byte goes through the hardware e4m3 -> fp32 conversion (exact);
* e2m1 (1.2): nibble ``s e1 e0 m``; ``e > 0``: bits ``s<<31 | (e + 126)<<23 | m<<22``; ``e == 0``: ``m * 0.5``
  (so 0x8 is -0.0);
* e5m6 (1.3): the binary16 pattern ``c << 4`` widened by hand: normal exponents rebias by 112, subnormals
  are ``mantissa * 2^-24`` (exact), exponent 31 keeps the payload shifted up 13 bits (as the reference).

Scale factors are read through symbolic strides, so row-major, TMA-aligned column-major and any other
unit-stride view work with one binary; int32 sf are packed UE8M0 words (block ``4w + u`` in byte ``u``,
decoded as ``byte << 23``).

Tiling: a chunk is ``V`` consecutive elements of one row written as one 16-byte store (one 2-8 byte data load
for e4m3 and e2m1, three 4-byte words of 8 codes for e5m6); a CTA covers ``TY`` rows by ``TX * unroll`` chunks
and a thread keeps ``unroll`` chunks of its row, ``TX`` apart, in flight (``cast_back_kernel``). No shared
memory, no reductions: deterministic and batch-invariant.
"""

import torch

from tilefuse import _jit, _native, _ops

# ---- tuning knobs (TILEFUSE_KNOBS; read when a kernel is built, defaults = the measured baseline) ----
# Row tile: chunks are one 16-byte store each, consecutive threads take consecutive chunks (so every warp store
# covers 512 contiguous bytes) and a thread keeps UNROLL chunks, TX apart, in flight.
# PDL: programmatic dependent launch. Each kernel's first statement waits for the stream's previous grid
# (griddepcontrol.wait: it has completed and its writes are visible before any global access here), and TileLang
# then launches the kernel with programmatic stream serialization, so its launch and CTA setup overlap the previous
# kernel's tail: a fixed cost per call saved (about 1.3 us on the H200 for per_channel_cast). Results unchanged.
PDL = True
THREADS = 128
UNROLL = 8
# elements per chunk of e4m3 / e2m1 data: one 16-byte store (8 bf16 / 4 fp32) by default; a multiple of the
# store width makes a chunk one wider data load written as several 16-byte stores (e5m6 keeps 8 codes)
CHUNK_BF16 = 8
CHUNK_FP32 = 4
ROW_LANES = 0  # lanes per row, TX (whole warps); 0: the widest of 128 / 64 / 32 that divides the row's chunks
# MIN_BLOCKS > 0: __launch_bounds__(threads, MIN_BLOCKS), a register cap of
# 65536 / (threads * MIN_BLOCKS) (0: none). E4M3_* / E2M1_* / E5M6_*: one data format's own THREADS / UNROLL /
# MIN_BLOCKS (None: the shared knob), so one sweep line can time different shapes per format
MIN_BLOCKS = 0
E4M3_THREADS = None
E4M3_UNROLL = None
E4M3_MIN_BLOCKS = None
# E2M1 / E5M6: 2 chunks per thread (two 16-byte stores), CTAs of 4 KB of output. Write-heavy rows run
# faster with short CTAs (H200, bench shapes): e2m1 -> fp32 89.3-90.1% with 7 chunks, 92.1-92.3% with
# 2 (85.7% with 1; a CTA walking 4-8 rows with the next row's loads in flight: 80-86%); e5m6 93.1 -> 94.6%
E2M1_THREADS = None
E2M1_UNROLL = 2
E2M1_MIN_BLOCKS = None
E5M6_THREADS = None
E5M6_UNROLL = 2
E5M6_MIN_BLOCKS = None
E4M3_STORE_HINT = None
E2M1_STORE_HINT = None
E5M6_STORE_HINT = None


def _knob(dfmt: str, name: str):
    """Knob ``name`` of the cast-back for data format ``dfmt``: its per-format override, else the shared one."""
    v = globals()[f"{dfmt.upper()}_{name}"]
    return globals()[name] if v is None else v


# unpack_from_e2m1fn_x2: a chunk is one 16-byte store's worth of data bytes, UNPACK_UNROLL chunks per thread,
# UNPACK_THREADS apart (2 chunks: CTAs of 8 KB of fp32 output; 8 chunks read 89.5-90.7%, 2 read 92.1-93.1%, and
# 4, 1: 90.9, 92.7% at the bench shape on the H200)
UNPACK_THREADS = 256
UNPACK_UNROLL = 2
UNPACK_MIN_BLOCKS = 0  # > 0: __launch_bounds__(UNPACK_THREADS, UNPACK_MIN_BLOCKS) (0: none)

# ROW_WALK: where the elements of a chunk have different sf (bk < V, e.g. the (128, 1) blocks of a per-channel
# cast), a thread takes one chunk column of up to ROW_WALK consecutive rows of one sf row block, loads its V sf once
# and keeps the rows' data loads in flight (0: the row tile, which loads V sf per chunk: L1-bound, 4 bytes of sf
# per element per row; 4, 8 and 16 rows are within 2% of each other, 4 the fastest for fp32). Results unchanged.
ROW_WALK = 4

# SF_HOIST: load every sf a thread needs into registers before its data loads (configs with one sf per chunk).
# By default each chunk's sf load sits between the previous chunk's store and its own multiply, and nvcc keeps it
# there (Y may alias SF): a chain of `unroll` dependent L2 round trips per thread. Results unchanged.
SF_HOIST = True
# Output stores of cast_back (STORE_HINT) and unpack (UNPACK_STORE_HINT), one 16-byte store each:
# (per data format: <FMT>_STORE_HINT, None = STORE_HINT) 0 plain st.global; 1: st.global.cs (__stcs: streaming, STG.E.EF); 2: st.global.L1::no_allocate with an L2
# evict-first cache policy (createpolicy + .L2::cache_hint, STG.E.NA). Outputs are written once, never re-read here.
STORE_HINT = 0
UNPACK_STORE_HINT = 2
_STORE_FN = {1: "tf_cb_st_cs", 2: "tf_cb_st_ef"}
_STORE_HELPERS = r"""
__device__ __forceinline__ void tf_cb_st_cs(void* p, const void* v) {
  __stcs(reinterpret_cast<float4*>(p), *reinterpret_cast<const float4*>(v)); }
__device__ __forceinline__ void tf_cb_st_ef(void* p, const void* v) {
  const uint4 w = *reinterpret_cast<const uint4*>(v);
  unsigned long long pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  asm volatile("st.global.L1::no_allocate.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;"
               :: "l"(p), "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w), "l"(pol)); }
"""


def _chunk(dfmt: str, out: str, hidden: int) -> int:
    """Elements per chunk: 8 e5m6 codes (three 4-byte words), CHUNK_BF16 / CHUNK_FP32 e4m3 / e2m1 values (a
    knob's chunk that does not divide the row falls back to the default, one 16-byte store)."""
    if dfmt == "e5m6":
        return 8
    v = {"bf16": CHUNK_BF16, "fp32": CHUNK_FP32}[out]
    return v if hidden % v == 0 else {"bf16": 8, "fp32": 4}[out]


_OUT_TL = {"bf16": "bfloat16", "fp32": "float32"}
_OUT_TORCH = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _decode_e2m1(nib):
    """fp32 of an E2M1 nibble (int32 0..15), quant.md 1.2, by assembling its binary32 bits."""
    import tilelang.language as T

    e = T.shift_right(nib, 1) & 3
    m = nib & 1
    mag = T.if_then_else(e == 0, m * T.int32(0x3F000000),  # exponent 0: m * 0.5
                         T.shift_left(e + 126, 23) | T.shift_left(m, 22))
    sign = T.shift_left(T.cast(T.shift_right(nib, 3), "uint32"), 31)
    return T.reinterpret(sign | T.cast(mag, "uint32"), "float32")


def _decode_e2m1_x4(x):
    """fp32 of the four E2M1 nibbles of ``x`` (uint32, nibbles in bits 0..15, zero above), low nibble
    first, quant.md 1.2. Each nibble ``s e1 e0 m`` becomes the binary16 ``s<<15 | (e1 e0 m)<<9``, whose value
    is exactly ``2^-14`` times the E2M1 value (``e > 0``: ``2^(e-15) (1 + m/2)``; ``e == 0``: the subnormal
    ``m * 2^-15``), two per 32-bit word (one per 16-bit half), then widened and multiplied by ``2^14``
    (both exact). About 1.75 logic and 1.25 IMAD instructions per value instead of ~6; checked on all 65536
    inputs against :func:`_decode_e2m1` (``test_e2m1_x4_decoder_is_exact``)."""
    import tilelang.language as T

    even = x & T.uint32(0x0F0F)  # nibbles 0, 2 in bits 0..3, 8..11
    odd = x & T.uint32(0xF0F0)  # nibbles 1, 3 in bits 4..7, 12..15
    t01 = even + odd * T.uint32(4096)  # n0 bits 0..3, n2 8..11, n1 16..19, n3 24..27 (no overlap)
    vals = []
    for t in (t01, T.shift_right(t01, 8)):  # lanes (n0, n1), then (n2, n3)
        p = (T.shift_left(t, 9) & T.uint32(0x0E000E00)) | T.shift_left(t & T.uint32(0x00080008), 12)
        for half in (p & T.uint32(0xFFFF), T.shift_right(p, 16)):
            h = T.reinterpret(T.cast(half, "uint16"), "float16")
            vals.append(T.cast(h, "float32") * T.float32(16384.0))
    return vals


def _decode_e5m6(code):
    """fp32 of a 12-bit E5M6 code (int32), quant.md 1.3: the binary16 ``code << 4`` widened exactly."""
    import tilelang.language as T

    neg = (T.shift_right(code, 11) & 1) != 0
    e = T.shift_right(code, 6) & 31
    m = code & 63
    mag = T.if_then_else(e == 31, T.int32(0x7F800000) | T.shift_left(m, 17),  # inf / NaN, payload kept
                         T.shift_left(e + 112, 23) | T.shift_left(m, 17))
    normal = T.reinterpret(T.if_then_else(neg, T.uint32(0x80000000), T.uint32(0)) | T.cast(mag, "uint32"),
                           "float32")
    sub = T.cast(T.shift_left(m, 4), "float32") * T.float32(2.0 ** -24)  # exact: 10-bit integer * 2^-24
    return T.if_then_else(e == 0, T.if_then_else(neg, -sub, sub), normal)


def _f32_of_half_lane(word, hi: bool):
    """binary32 of the binary16 in the low (or high) half of uint32 ``word`` (exact; one HADD2.F32)."""
    import tilelang.language as T

    half = T.shift_right(word, 16) if hi else word & T.uint32(0xFFFF)
    return T.cast(T.reinterpret(T.cast(half, "uint16"), "float16"), "float32")


def _e5m6_values(w0, w1, w2):
    """The 8 values of one group (three words, uint32) by the hardware binary16 -> binary32 widening: each
    code ``c`` is placed as ``c << 4`` in a 16-bit lane, two per word, with funnel shifts and masks (~1.7
    logic instructions per value). Exact and equal to :func:`_decode_e5m6` for every non-NaN code; a NaN
    code gives a NaN (its payload may differ: the cast-back multiplies it by the sf, which returns the
    canonical NaN either way). Checked on all codes and packings (``test_e5m6_values_are_exact``)."""
    import tilelang.language as T

    hi_mask, lo_mask = T.uint32(0xFFF00000), T.uint32(0x0000FFF0)
    p01 = (w0 & hi_mask) | (T.shift_right(w0, 4) & lo_mask)  # c0 high, c1 low
    p25 = (((T.shift_left(w0, 8) | T.shift_right(w1, 24)) & lo_mask)  # c2 low
           | ((T.shift_left(w1, 28) | T.shift_right(w2, 4)) & hi_mask))  # c5 high
    p34 = (T.shift_left(w1, 4) & hi_mask) | (w1 & lo_mask)  # c3 high, c4 low
    p67 = (T.shift_left(w2, 8) & hi_mask) | (T.shift_left(w2, 4) & lo_mask)  # c6 high, c7 low
    lanes = ((p01, True), (p01, False), (p25, False), (p34, True), (p34, False), (p25, True), (p67, True),
             (p67, False))
    return [_f32_of_half_lane(w, hi) for w, hi in lanes]


def _e5m6_codes(w0, w1, w2):
    """The 8 codes of one group from its three words (quant.md 1.3 packing), as int32 expressions."""
    import tilelang.language as T

    def srl(w, n):  # logical shift right of an int32 word
        return T.shift_right(w, n) & ((1 << (32 - n)) - 1)

    return (srl(w0, 20), T.shift_right(w0, 8) & 0xFFF, T.shift_left(w0 & 0xFF, 4) | srl(w1, 28),
            T.shift_right(w1, 16) & 0xFFF, T.shift_right(w1, 4) & 0xFFF,
            T.shift_left(w1 & 0xF, 8) | srl(w2, 24), T.shift_right(w2, 12) & 0xFFF, w2 & 0xFFF)


def cast_back_kernel(dfmt: str, out: str, hidden: int, bm: int, bk: int, sf_packed: bool):
    """Factory for one static config: data format ``dfmt`` ("e4m3" | "e2m1" | "e5m6"), ``out`` ("bf16" |
    "fp32"), logical ``hidden`` (a multiple of the chunk, ``_chunk``), block ``(bm, bk)``, and whether the
    sf are packed UE8M0 int32 (else fp32). Token count, data row stride and sf strides are symbolic."""
    import tilelang.language as T

    V = _chunk(dfmt, out, hidden)
    assert hidden % V == 0, (dfmt, hidden)
    cpr = hidden // V  # chunks per row
    if dfmt == "e4m3":
        d_dtype, d_width, d_per_chunk = "float8_e4m3fn", hidden, V
    elif dfmt == "e2m1":
        d_dtype, d_width, d_per_chunk = "uint8", hidden // 2, V // 2
    else:  # three int32 words per chunk of 8 codes
        d_dtype, d_width, d_per_chunk = "int32", hidden * 3 // 8, 3
    py_range_v = tuple(range(V))
    o_dtype = _OUT_TL[out]
    o_vec = 8 if out == "bf16" else 4  # elements per 16-byte store
    nbk = -(-hidden // bk)
    sf_w = -(-nbk // 4) if sf_packed else nbk
    per_chunk_sf = bk % V == 0  # every element of a chunk shares one sf
    # rows a thread walks when the elements of a chunk have different sf: the largest power of two up to ROW_WALK
    # that divides bm (0: the row tile below, an sf load per element)
    rows_per_thread = 0 if per_chunk_sf or not ROW_WALK else max(
        r for r in (1, 2, 4, 8, 16, 32) if r <= ROW_WALK and bm % r == 0)
    # CTA tile: TY rows by TX * unroll chunks. Thread (ty, tx) does chunks tx, tx + TX, ... of one row: TX is
    # whole warps (every warp store covers 512 contiguous bytes), the row address and sf row are computed
    # once and every chunk's data, sf and output address is a constant offset from them (no per-chunk
    # division or 64-bit multiply). unroll: a divisor of the row's TX-wide columns near 8 (no masking), or
    # up to 8 with masked chunks past the row.
    threads, unroll_knob, min_blocks = (_knob(dfmt, k) for k in ("THREADS", "UNROLL", "MIN_BLOCKS"))
    TX = ROW_LANES or next((w for w in (128, 64, 32) if cpr % w == 0 and w <= threads), 32)
    assert TX % 32 == 0 and threads % TX == 0, (TX, threads)
    TY = threads // TX
    n_tx = -(-cpr // TX)
    target = max(1, unroll_knob * o_vec // V)  # unroll_knob 16-byte stores per thread
    unroll = max(d for d in range(1, min(target, n_tx) + 1) if n_tx % d == 0)
    if unroll < 4:
        unroll = min(target, n_tx)
    need_mask = cpr % (TX * unroll) != 0
    kb_step = TX * V // bk if (TX * V) % bk == 0 else None  # sf column step between a thread's chunks
    hoist = bool(SF_HOIST) and per_chunk_sf
    store_hint = _knob(dfmt, "STORE_HINT")
    store_fn = _STORE_FN[store_hint] if store_hint else None
    hinted = store_fn is not None
    n_sf = 1 if kb_step == 0 else unroll  # sf values a thread holds (one when every chunk shares it)

    Tn, S, NBM, SF0, SF1 = T.dynamic("num_tokens, data_row_stride, sf_rows, sf_stride0, sf_stride1")

    def sf_of(SF, rb, kb):
        if sf_packed:
            word = SF[rb, kb // 4]
            return T.reinterpret(T.shift_left(T.shift_right(word, (kb % 4) * 8) & 255, 23), "float32")
        return SF[rb, kb]

    def in_row(cc):
        return cc < cpr if need_mask else T.bool(True)

    def chunk_kb(cc0, u):
        if kb_step is not None:
            return (cc0 * V) // bk + u * kb_step
        return ((cc0 + u * TX) * V) // bk

    x_param = T.StridedTensor((Tn, d_width), (S, 1), d_dtype)
    sf_param = T.StridedTensor((NBM, sf_w), (SF0, SF1), "int32" if sf_packed else "float32")
    y_param = T.Tensor((Tn, hidden), o_dtype)

    def chunk_values(raw, base):
        """The V binary32 values of the chunk whose data starts at ``raw[base]`` (expressions, exact)."""
        if dfmt == "e4m3":
            return [T.cast(raw[base + v], "float32") for v in range(V)]
        if dfmt == "e2m1":
            vals = []
            for q in range(V // 4):  # two bytes -> four values
                x16 = (T.cast(raw[base + 2 * q], "uint32") | T.shift_left(T.cast(raw[base + 2 * q + 1], "uint32"), 8))
                vals += _decode_e2m1_x4(x16)
            return vals
        return _e5m6_values(*(T.cast(raw[base + w], "uint32") for w in range(3)))

    if rows_per_thread:  # per-element sf (bk < V): a thread walks R rows of one chunk column, sf loaded once
        R = rows_per_thread

        @T.prim_func
        def cast_back_rows(X: x_param, SF: sf_param, Y: y_param):
            if dfmt != "e5m6":
                T.assume(S % 16 == 0)
            with T.Kernel(T.ceildiv(cpr, TX), T.ceildiv(Tn, TY * R), threads=threads) as (bx, by):
                if min_blocks:
                    T.annotate_min_blocks_per_sm(min_blocks)
                if PDL:
                    T.pdl_sync()
                tid = T.get_thread_binding()
                cc = bx * TX + tid % TX  # the thread's chunk column
                row0 = (by * TY + tid // TX) * R  # its first row; the R rows share one sf row (R divides bm)
                raw = T.alloc_local((R * d_per_chunk,), d_dtype)
                sfv = T.alloc_local((V,), "float32")
                val = T.alloc_local((V,), "float32")
                res = T.alloc_local((V,), o_dtype)
                if hinted:
                    T.import_source(_STORE_HELPERS)
                if in_row(cc) and row0 < Tn:
                    for r in T.unroll(R):
                        if row0 + r < Tn:
                            for v in T.vectorized(d_per_chunk):
                                raw[r * d_per_chunk + v] = X[row0 + r, cc * d_per_chunk + v]
                    for v in T.unroll(V):
                        sfv[v] = sf_of(SF, row0 // bm, (cc * V + v) // bk)
                    for r in T.unroll(R):
                        if row0 + r < Tn:
                            vals = chunk_values(raw, r * d_per_chunk)
                            for v in py_range_v:
                                val[v] = vals[v]
                            for v in T.unroll(V):
                                res[v] = T.cast(val[v] * sfv[v], o_dtype)
                            for p in T.unroll(V // o_vec):
                                if hinted:
                                    T.call_extern("handle", store_fn, T.address_of(Y[row0 + r, cc * V + p * o_vec]),
                                                  T.address_of(res[p * o_vec]))
                                else:
                                    for v in T.vectorized(o_vec):
                                        Y[row0 + r, cc * V + p * o_vec + v] = res[p * o_vec + v]

        return cast_back_rows

    @T.prim_func
    def cast_back(X: x_param, SF: sf_param, Y: y_param):
        if dfmt != "e5m6":  # the launcher guarantees 16-byte aligned rows for the chunk's vector load
            T.assume(S % 16 == 0)
        with T.Kernel(T.ceildiv(cpr, TX * unroll), T.ceildiv(Tn, TY), threads=threads) as (bx, by):
            if min_blocks:
                T.annotate_min_blocks_per_sm(min_blocks)
            if PDL:
                T.pdl_sync()
            tid = T.get_thread_binding()
            tx = tid % TX
            row = by * TY + tid // TX
            cc0 = bx * (TX * unroll) + tx  # the thread's first chunk column
            raw = T.alloc_local((unroll * d_per_chunk,), d_dtype)
            val = T.alloc_local((unroll * V,), "float32")
            res = T.alloc_local((unroll * V,), o_dtype)
            s = T.alloc_local((1,), "float32")
            if hoist:
                sfv = T.alloc_local((n_sf,), "float32")
            if hinted:
                T.import_source(_STORE_HELPERS)
            if row < Tn:
                if hoist:
                    for u in T.unroll(n_sf):
                        if in_row(cc0 + u * TX):
                            sfv[u] = sf_of(SF, row // bm, chunk_kb(cc0, u))
                for u in T.unroll(unroll):
                    if in_row(cc0 + u * TX):
                        for v in T.vectorized(d_per_chunk):
                            raw[u * d_per_chunk + v] = X[row, (cc0 + u * TX) * d_per_chunk + v]
                for u in T.unroll(unroll):
                    col0 = (cc0 + u * TX) * V
                    if in_row(cc0 + u * TX):
                        vals = chunk_values(raw, u * d_per_chunk)
                        for v in py_range_v:  # a Python tuple: expanded while building
                            val[u * V + v] = vals[v]
                        if hoist:
                            for v in T.unroll(V):
                                res[u * V + v] = T.cast(val[u * V + v] * sfv[u if n_sf > 1 else 0], o_dtype)
                        elif per_chunk_sf:
                            s[0] = sf_of(SF, row // bm, chunk_kb(cc0, u))
                            for v in T.unroll(V):
                                res[u * V + v] = T.cast(val[u * V + v] * s[0], o_dtype)
                        else:
                            for v in T.unroll(V):
                                res[u * V + v] = T.cast(val[u * V + v] * sf_of(SF, row // bm, (col0 + v) // bk),
                                                        o_dtype)
                        for p in T.unroll(V // o_vec):
                            if hinted:
                                T.call_extern("handle", store_fn, T.address_of(Y[row, col0 + p * o_vec]),
                                              T.address_of(res[u * V + p * o_vec]))
                            else:
                                for v in T.vectorized(o_vec):
                                    Y[row, col0 + p * o_vec + v] = res[u * V + p * o_vec + v]

    return cast_back


def unpack_e2m1_kernel(out_dtype: str):
    """Factory: a flat packed-FP4 byte buffer of symbolic length ``N`` -> ``2N`` values of ``out_dtype``
    (quant.md 1.2: byte ``k`` gives elements ``2k`` (low nibble) and ``2k + 1``). A chunk is one 16-byte
    store (``B`` = 2 bytes in for fp32, 4 for 16-bit outputs); consecutive threads take consecutive chunks, so
    loads and stores are coalesced across a warp, and a thread keeps ``UNPACK_UNROLL`` chunks (``UNPACK_THREADS`` apart)
    in flight. A chunk past the last whole one is done element by element."""
    import tilelang.language as T

    o_vec = 16 // {"float32": 4, "bfloat16": 2, "float16": 2}[out_dtype]
    B = o_vec // 2  # bytes per chunk: one B-byte load, one 16-byte store
    U = UNPACK_UNROLL
    NT = UNPACK_THREADS
    N = T.dynamic("num_bytes")
    store_fn = _STORE_FN[UNPACK_STORE_HINT] if UNPACK_STORE_HINT else None
    hinted = store_fn is not None

    x_param = T.Tensor((N,), "uint8")
    y_param = T.Tensor((2 * N,), out_dtype)

    @T.prim_func
    def unpack_e2m1(X: x_param, Y: y_param):
        with T.Kernel(T.ceildiv(N, NT * B * U), threads=NT) as bx:
            if UNPACK_MIN_BLOCKS:
                T.annotate_min_blocks_per_sm(UNPACK_MIN_BLOCKS)
            if PDL:
                T.pdl_sync()
            tx = T.get_thread_binding()
            if hinted:
                T.import_source(_STORE_HELPERS)
            raw = T.alloc_local((U * B,), "uint8")
            res = T.alloc_local((2 * B,), out_dtype)
            if (bx + 1) * (U * NT * B) <= N:  # every CTA but the last: no bounds checks
                for u in T.unroll(U):
                    for v in T.vectorized(B):
                        raw[u * B + v] = X[((bx * U + u) * NT + tx) * B + v]
                for u in T.unroll(U):
                    b0 = ((bx * U + u) * NT + tx) * B
                    for q in range(B // 2):  # two bytes -> four values
                        x16 = (T.cast(raw[u * B + 2 * q], "uint32")
                               | T.shift_left(T.cast(raw[u * B + 2 * q + 1], "uint32"), 8))
                        for v, e in enumerate(_decode_e2m1_x4(x16)):
                            res[4 * q + v] = T.cast(e, out_dtype)
                    if hinted:
                        T.call_extern("handle", store_fn, T.address_of(Y[2 * b0]),
                                      T.address_of(res[0]))
                    else:
                        for v in T.vectorized(o_vec):
                            Y[2 * b0 + v] = res[v]
            else:
                for u in T.unroll(U):
                    b0 = ((bx * U + u) * NT + tx) * B
                    if b0 + B <= N:
                        for v in T.vectorized(B):
                            raw[u * B + v] = X[b0 + v]
                for u in T.unroll(U):
                    b0 = ((bx * U + u) * NT + tx) * B
                    if b0 + B <= N:
                        for q in range(B // 2):  # two bytes -> four values
                            x16 = (T.cast(raw[u * B + 2 * q], "uint32")
                                   | T.shift_left(T.cast(raw[u * B + 2 * q + 1], "uint32"), 8))
                            for v, e in enumerate(_decode_e2m1_x4(x16)):
                                res[4 * q + v] = T.cast(e, out_dtype)
                        for v in T.vectorized(o_vec):
                            Y[2 * b0 + v] = res[v]
                    elif b0 < N:
                        for v in T.serial(2 * B):
                            if b0 + v // 2 < N:
                                byte = T.cast(X[b0 + v // 2], "int32")
                                Y[2 * b0 + v] = T.cast(_decode_e2m1(T.shift_right(byte, (v % 2) * 4) & 15), out_dtype)

    return unpack_e2m1


BENCH_HIDDEN = (1536, 2048, 4096, 7168, 18432)  # tilefuse.bench.quant.HIDDEN


def _bench_configs() -> list[tuple]:
    """The cast-backs the bench launches (tilefuse.bench.quant), as (data format, out, hidden, block rows, block
    columns, packed sf), at every grid hidden size and both outputs: e4m3 and e2m1 with 1 x 128 blocks (fp32 or
    packed sf), e4m3 with 128 x 128 and 128 x 1 blocks, and e5m6 (one block per row). Other configs compile on
    first use."""
    cfgs = [(dfmt, out, h, 1, 128, packed) for dfmt in ("e4m3", "e2m1") for out in ("bf16", "fp32")
            for h in BENCH_HIDDEN for packed in (False, True)]
    cfgs += [("e4m3", out, h, bm, bk, False) for out in ("bf16", "fp32") for h in BENCH_HIDDEN
             for bm, bk in ((128, 128), (128, 1))]
    cfgs += [("e5m6", out, h, 1, h, False) for out in ("bf16", "fp32") for h in BENCH_HIDDEN]
    return cfgs


_jit.register("cast_back", cast_back_kernel, _bench_configs)
_jit.register("unpack_from_e2m1fn_x2", unpack_e2m1_kernel, lambda: [("float32",), ("bfloat16",)])  # the bench's outputs


# ---- launchers ----

def _dfmt(data: torch.Tensor, special: str | None) -> str:
    if special == "e5m6":
        return "e5m6"
    return "e4m3" if data.dtype == torch.float8_e4m3fn else "e2m1"


def _hidden(data: torch.Tensor, dfmt: str) -> int:
    w = data.size(1)
    return {"e4m3": w, "e2m1": 2 * w, "e5m6": w * 2 // 3}[dfmt]


def _kernel_data(data: torch.Tensor, dfmt: str) -> torch.Tensor:
    """The data as the kernel reads it (fp8 / uint8 bytes / int32 words), with 16-byte aligned rows (pointer
    and row stride; 4-byte for e5m6 words), else a contiguous copy."""
    if dfmt == "e2m1":
        data = data.view(torch.uint8)
    align = 16 if dfmt != "e5m6" else 4
    if (data.stride(1) != 1 or data.data_ptr() % align
            or (data.size(0) > 1 and data.stride(0) % align)):
        data = data.contiguous()
        if data.data_ptr() % align:
            data = data.clone()
    return data.view(torch.int32) if dfmt == "e5m6" else data


_PLANS: dict[tuple, object] = {}


def native_launcher(data_dtype: torch.dtype, dfmt: str, fmt: str, hidden: int, bm: int, bk: int, packed_sf: bool):
    """``(plan, max_rows)``: the native launch plan ``plan(data, t, sf)`` of one config (``tilefuse._native``:
    the output allocated and the kernel launched on ``_kernel_data``'s view of the data in one C++ call) and
    the most rows one launch takes (the kernel numbers chunks in int32); ``(None, 0)`` where the extension is
    unavailable. Built once."""
    key = (data_dtype, dfmt, fmt, hidden, bm, bk, packed_sf)
    entry = _PLANS.get(key)
    if entry is None:
        N = _native
        x_k = {"e4m3": data_dtype, "e2m1": torch.uint8, "e5m6": torch.int32}[dfmt]
        align = 16 if dfmt != "e5m6" else 4
        out = (hidden, _OUT_TORCH[fmt], N.ROW, 1, N.SAME, _OUT_TORCH[fmt])
        fn = _jit.get("cast_back", (dfmt, fmt, hidden, bm, bk, packed_sf))
        plan = N.plan(fn, data_dtype, align, align, [out], x_k) if hidden else None
        step = max(bm, (2 ** 31 - 1) // (hidden // _chunk(dfmt, fmt, hidden)) // bm * bm) if hidden else 0
        _PLANS[key] = entry = (plan, step) if plan is not None else (None, 0)
    return entry


def cast_back_launch(data: torch.Tensor, sf: torch.Tensor, fmt: str, x_block_size, special: str | None = None):
    """Allocate ``(T, H)`` bf16/fp32 and launch (quant.md 3.5). Validates nothing: the public op does (data
    with a unit inner stride)."""
    dfmt = _dfmt(data, special)
    t, hidden = data.size(0), _hidden(data, dfmt)
    bm, bk = (int(b) for b in x_block_size)
    if t > 0 and hidden > 0:  # (empty inputs: nothing is compiled, loaded or launched)
        plan, max_rows = native_launcher(data.dtype, dfmt, fmt, hidden, bm, bk, sf.dtype == torch.int32)
        if plan is not None and t <= max_rows:
            return plan(data, t, sf)
    out = torch.empty((t, hidden), dtype=_OUT_TORCH[fmt], device=data.device)
    if t == 0 or hidden == 0:
        return out
    fn = _jit.get("cast_back", (dfmt, fmt, hidden, bm, bk, sf.dtype == torch.int32))
    data = _kernel_data(data, dfmt)
    # the kernel numbers chunks in int32: inputs beyond 2^31 chunks go in row slices (whole sf row blocks)
    step = max(bm, (2 ** 31 - 1) // (hidden // _chunk(dfmt, fmt, hidden)) // bm * bm)
    for r0 in range(0, t, step):
        fn(data[r0:r0 + step], sf[r0 // bm:], out[r0:r0 + step])
    return out


_UNPACK_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def unpack_e2m1_launch(x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., K]`` int8/uint8 -> ``[..., 2K]`` (quant.md 1.2). fp32/bf16/fp16 come straight from the kernel
    (every E2M1 value is exact in them); any other dtype is the fp32 result converted with ``.to``,
    exactly what the reference does."""
    k_dtype = out_dtype if out_dtype in _UNPACK_DTYPES else torch.float32
    shape = (*x.shape[:-1], 2 * x.size(-1))
    out = torch.empty(shape, dtype=k_dtype, device=x.device)
    if x.numel() > 0:
        flat = x.contiguous().view(torch.uint8).view(-1)
        if flat.data_ptr() % 4:  # the kernel's B-byte loads (B = 2 or 4)
            flat = flat.clone()
        fn = _jit.get("unpack_from_e2m1fn_x2", (_UNPACK_DTYPES[k_dtype],))
        flat_out = out.view(-1)
        step = 2 ** 29  # bytes per launch: 2N outputs stay below 2^31 (int32 indexing)
        for b0 in range(0, flat.numel(), step):
            fn(flat[b0:b0 + step], flat_out[2 * b0:2 * (b0 + step)])
    return out if k_dtype == out_dtype else out.to(out_dtype)


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::cast_back", mutates_args=(), device_types="cuda")
def _cast_back_op(data: torch.Tensor, sf: torch.Tensor, fmt: str, x_block_size: list[int],
                  x_special_fmt: str | None) -> torch.Tensor:
    return cast_back_launch(data, sf, fmt, x_block_size, x_special_fmt)


@_cast_back_op.register_fake
def _(data, sf, fmt, x_block_size, x_special_fmt):
    return data.new_empty((data.size(0), _hidden(data, _dfmt(data, x_special_fmt))), dtype=_OUT_TORCH[fmt])


@_ops.kernel_op("tilefuse::unpack_from_e2m1fn_x2", mutates_args=(), device_types="cuda")
def _unpack_op(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return unpack_e2m1_launch(x, out_dtype)


@_unpack_op.register_fake
def _(x, out_dtype):
    return x.new_empty((*x.shape[:-1], 2 * x.size(-1)), dtype=out_dtype)


def cast_back_cuda(x, fmt: str, x_block_size, x_special_fmt: str | None = None) -> torch.Tensor:
    """CUDA entry for the public ``cast_back`` (``x = (data, sf)``): a direct launch in eager mode, the custom
    op under ``torch.compile``."""
    data, sf = x
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.cast_back(data, sf, fmt, [int(b) for b in x_block_size], x_special_fmt)
    return cast_back_launch(data, sf, fmt, x_block_size, x_special_fmt)


def per_token_cast_back_cuda(x, fmt: str, num_per_channels: int, x_special_fmt: str | None = None) -> torch.Tensor:
    """CUDA entry for ``per_token_cast_back``: ``cast_back`` with block ``(1, num_per_channels)``."""
    return cast_back_cuda(x, fmt, (1, num_per_channels), x_special_fmt)


def unpack_from_e2m1fn_x2_cuda(x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """CUDA entry for ``unpack_from_e2m1fn_x2``."""
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.unpack_from_e2m1fn_x2(x, out_dtype)
    return unpack_e2m1_launch(x, out_dtype)
