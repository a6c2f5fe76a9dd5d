"""TileLang kernel for the E5M6 per-token cast (quant.md 3.4, 2.3, 1.3); the E5M6 cast-back shares the
cast-back factory (``_cast_back_kernel``, data format "e5m6").

One scale per row (``num_per_channels == H``): ``a = max(amax, 1e-4)``, ``M = 65024``; plain ``sf = a / M``,
``sf_inv = M / a`` (IEEE divisions, fast-math off), or with ``round_sf`` ``sf = 2^E`` from the exponent bits
of ``a / M`` and ``sf_inv`` the binary32 with biased exponent ``max(127 - E, 0)`` (2.3). Each value
``x * sf_inv`` is encoded exactly as 1.3 says: the binary16 pattern rounded toward zero (subnormals
truncated, ``>= 2^16`` to inf, NaN payload kept), its top 12 bits, plus one when ``(t & 1) + low17 > 0x10000``.
NaN products are first made the positive canonical NaN, as the reference does. Eight codes become three
words ``W0 W1 W2`` (big-endian bit string) stored as little-endian uint32.

Tiling (SIMT): ``L`` threads (a power of two >= 32, at most ``MAX_LANES`` where 8 groups each fit) per row, each
holding about four groups of eight values in registers; the row maximum is a warp-shuffle reduction, then one
shared-memory step across the row's warps (max is exact in any order). Nothing depends on the token count:
deterministic and batch-invariant.
"""
import torch

from tilefuse import _jit, _native, _ops
from tilefuse import formats as F
from tilefuse.quant import _cast_back_kernel as CB

_M = F.FMT_MAX["e5m6"]
_CLAMP = F.CLAMP_MIN["e5m6"]
_TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_MAX_PER_THREAD = 64
# Knob (read when the factory runs; TILEFUSE_KNOBS overrides it for benchmark sweeps, results identical):
# MIN_BLOCKS > 0: __launch_bounds__(threads, MIN_BLOCKS), a register cap of 65536 / (threads * MIN_BLOCKS) (0: none;
# 256 lanes hold 50 registers: 4 CTAs = 56 KB of loads per SM; 5 fit at <= 48).
MIN_BLOCKS = 0
# MAX_LANES: the most threads per row (a power of two) while a thread's groups fit (at most 8; rows wider than
# MAX_LANES * 64 take up to 1024 lanes); wider rows give each thread more groups.
# 512: two CTAs per SM at 18432 channels instead of one 1024-thread CTA (H200, bf16 16384 x 18432: 511 -> 280 us)
MAX_LANES = 512

_PACKED_HELPERS = """
template <typename B> __device__ __forceinline__ unsigned tf_bf16x2_bits(B lo, B hi) {
  return (unsigned)(*reinterpret_cast<unsigned short*>(&lo)) | ((unsigned)(*reinterpret_cast<unsigned short*>(&hi)) << 16); }
__device__ __forceinline__ unsigned tf_bf16x2_absmax(unsigned acc, unsigned w) {
  unsigned a; asm("abs.bf16x2 %0, %1;" : "=r"(a) : "r"(w));
  unsigned d; asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(acc), "r"(a)); return d; }
__device__ __forceinline__ unsigned tf_bf16x2_fma0(unsigned acc, unsigned w) {
  unsigned d; asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(w), "r"(0u), "r"(acc)); return d; }
__device__ __forceinline__ float tf_bf16x2_max_f32(unsigned w) {
  return fmaxf(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u)); }
__device__ __forceinline__ float tf_bf16x2_sum_f32(unsigned w) {
  return __uint_as_float(w << 16) + __uint_as_float(w & 0xffff0000u); }
"""


def _tiling(hidden: int) -> tuple[int, int, int] | None:
    """(L threads per row, NG groups of 8 per thread, R rows per CTA), or None for widths beyond 65536.

    L is a power of two >= 32 giving each thread about four groups (32 values), so a row is a whole number
    of warps; small rows share a CTA (R * L >= 128 threads).
    """
    g8 = hidden // 8
    lanes = 32
    while lanes < 1024 and (lanes * 4 < g8 if lanes < MAX_LANES else -(-g8 // lanes) > 8):
        lanes *= 2
    ng = -(-g8 // lanes)
    if ng > 8:
        return None
    return lanes, ng, max(1, 128 // lanes)


def _e5m6_code(v):
    """The 12-bit E5M6 code (uint32) of binary32 ``v``, bit-exactly quant.md 1.3."""
    import tilelang.language as T

    b = T.if_then_else(v != v, T.uint32(0x7FC00000), T.reinterpret(v, "uint32"))  # NaN -> +canonical NaN
    e = T.cast(T.shift_right(b, 23) & 0xFF, "int32")
    m = b & T.uint32(0x7FFFFF)
    # binary16 magnitude rounded toward zero
    normal = T.shift_left(T.cast(e - 112, "uint32"), 10) | T.shift_right(m, 13)
    shift = 126 - e  # >= 14 whenever the value is below the binary16 normal range
    shift_u = T.cast(T.max(T.min(shift, 31), 0), "uint32")
    sub = T.if_then_else(shift < 24, T.shift_right(m | T.uint32(0x800000), shift_u), T.uint32(0))
    payload = T.shift_right(m, 13)
    special = T.if_then_else(m == 0, T.uint32(0x7C00),
                             T.uint32(0x7C00) | T.if_then_else(payload == 0, T.uint32(0x200), payload))
    mag = T.if_then_else(e == 255, special,
                         T.if_then_else(e - 112 >= 31, T.uint32(0x7C00),
                                        T.if_then_else(e - 112 >= 1, normal, sub)))
    t = T.shift_right(T.shift_left(T.shift_right(b, 31), 15) | mag, 4)
    r = b & T.uint32(0x1FFFF)
    return T.if_then_else((t & 1) + r > T.uint32(0x10000), t + 1, t) & T.uint32(0xFFF)


def _e5m6_code_fast(v):
    """The 12-bit E5M6 code (uint32) of binary32 ``v`` for ``v`` not NaN and ``|v| < 2^16`` (all the cast
    produces from finite inputs), bit-exactly quant.md 1.3: ``h`` is the hardware round-toward-zero binary16
    conversion (subnormals truncated, exactly step 1 in that range); ``z = t << 17 | r`` puts ``t = h >> 4``
    over the low 17 bits ``r`` of ``v``, and ``(z + 0xFFFF + (t & 1)) >> 17`` is ``t`` plus one exactly when
    ``(t & 1) + r > 0x10000`` (``r + (t & 1) <= 0x20000``, so the carry into bit 17 is that test). ``t``
    is at most 0xFBF there, so the result needs no 12-bit mask."""
    import tilelang.language as T

    h = T.cast(T.call_extern("uint16", "__half_as_ushort", T.call_extern("float16", "__float2half_rz", v)),
               "uint32")
    return _e5m6_code_of_rz_half(v, h)


def _e5m6_code_of_rz_half(v, h):
    """:func:`_e5m6_code_fast` given ``h`` (uint32), the round-toward-zero binary16 pattern of ``v``."""
    import tilelang.language as T

    t = T.shift_right(h, 4)
    z = T.shift_left(t, 17) | (T.reinterpret(v, "uint32") & T.uint32(0x1FFFF))
    return T.shift_right(z + T.uint32(0xFFFF) + (t & T.uint32(1)), 17)


def _e5m6_words(c):
    """Words ``W0, W1, W2`` (uint32) of the eight codes ``c`` (uint32 expressions), quant.md 1.3 packing."""
    import tilelang.language as T

    return (T.shift_left(c[0], 20) | T.shift_left(c[1], 8) | T.shift_right(c[2], 4),
            T.shift_left(c[2] & 0xF, 28) | T.shift_left(c[3], 16) | T.shift_left(c[4], 4) | T.shift_right(c[5], 8),
            T.shift_left(c[5] & 0xFF, 24) | T.shift_left(c[6], 12) | c[7])


def e5m6_cast_kernel(x_dtype: str, hidden: int, round_sf: bool, sf_layout: str):
    """Factory for one static config: ``x_dtype`` "bfloat16" | "float32", ``hidden`` (% 8 == 0), ``round_sf``,
    ``sf_layout`` "row" | "col" | "col_packed". Token count and input row stride are symbolic.

    Thread ``lane`` of a row owns the groups ``lane + j * L`` (8 values each, 16-byte loads): loads are
    coalesced across lanes, every value stays in registers until its code is packed.
    """
    import tilelang.language as T

    L, NG, R = _tiling(hidden)
    g8 = hidden // 8
    vec = 16 // (2 if x_dtype == "bfloat16" else 4)
    words = g8 * 3
    yvec = 4 if words % 4 == 0 else 1  # 16-byte stores when rows are whole vectors (H % 32 == 0)
    qpr = words // yvec  # store vectors per row
    n_copy = -(-(R * qpr) // (R * L))
    nwarps = L // 32
    # bfloat16 input: the row maximum and the NaN/infinity test on the loaded bf16 pairs (abs + max and x * 0 + s
    # in bf16x2: one instruction per two values; max ignores NaN like fmaxf, and bf16 -> fp32 is exact, so the
    # maximum and the test are those of the fp32 values); float32 input: per-value fp32 FMNMX / FFMA.
    packed = x_dtype == "bfloat16"
    Tn, S, P = T.dynamic("num_tokens, x_row_stride, sf_pad")
    if sf_layout == "row":
        sf_param = T.Tensor((Tn, 1), "float32")
    elif sf_layout == "col":
        sf_param = T.Tensor((1, P), "float32")
    else:
        sf_param = T.Tensor((1, P, 4), "uint8")  # the int32 storage seen as bytes; byte 0 holds the exponent

    x_param = T.StridedTensor((Tn, hidden), (S, 1), x_dtype)
    y_param = T.Tensor((Tn, words), "uint32")

    @T.prim_func
    def e5m6_cast(X: x_param, Y: y_param, SF: sf_param):
        T.assume(S % vec == 0)
        with T.Kernel(T.ceildiv(Tn, R), threads=R * L) as bx:
            if MIN_BLOCKS:
                T.annotate_min_blocks_per_sm(MIN_BLOCKS)
            tx = T.get_thread_binding()
            lane = tx % L
            row = bx * R + tx // L
            raw = T.alloc_local((NG * 8,), x_dtype)
            xv = T.alloc_local((NG * 8,), "float32")
            amax = T.alloc_local((1,), "float32")
            special = T.alloc_local((1,), "float32")
            inv = T.alloc_local((1,), "float32")
            code = T.alloc_local((8,), "uint32")
            red = T.alloc_shared((R * nwarps,), "float32")
            ys = T.alloc_shared((R * words,), "uint32")  # the CTA's packed rows, stored coalesced at the end
            for j in T.unroll(NG):
                for v in T.unroll(8):
                    raw[j * 8 + v] = T.cast(0, x_dtype)  # groups past the row or the last token read as 0
                if T.And(row < Tn, lane + j * L < g8):
                    for p in T.unroll(8 // vec):
                        for v in T.vectorized(vec):
                            raw[j * 8 + p * vec + v] = X[row, (lane + j * L) * 8 + p * vec + v]
            if packed:
                T.import_source(_PACKED_HELPERS)
                acc = T.alloc_local((2,), "uint32")  # |x| maximum and x * 0 sum, bf16x2 lanes
                acc[0] = T.uint32(0)
                acc[1] = T.uint32(0)
                for j in T.unroll(NG):
                    for p in T.unroll(4):
                        w = T.call_extern("uint32", "tf_bf16x2_bits", raw[j * 8 + 2 * p], raw[j * 8 + 2 * p + 1])
                        acc[0] = T.call_extern("uint32", "tf_bf16x2_absmax", acc[0], w)
                        acc[1] = T.call_extern("uint32", "tf_bf16x2_fma0", acc[1], w)
                    for v in T.unroll(8):
                        xv[j * 8 + v] = T.cast(raw[j * 8 + v], "float32")
                amax[0] = T.call_extern("float32", "tf_bf16x2_max_f32", acc[0])
                special[0] = T.call_extern("float32", "tf_bf16x2_sum_f32", acc[1])
            else:
                amax[0] = T.float32(0.0)
                special[0] = T.float32(0.0)
                for j in T.unroll(NG):
                    for v in T.unroll(8):
                        xv[j * 8 + v] = T.cast(raw[j * 8 + v], "float32")
                        amax[0] = T.max(amax[0], T.abs(xv[j * 8 + v]))
                        # NaN exactly when one of this thread's values is NaN or infinite (an extern FMA: the
                        # TIR simplifier would fold a plain x * 0 to 0)
                        special[0] = T.call_extern("float32", "__fmaf_rn", xv[j * 8 + v], T.float32(0.0),
                                                   special[0])
            for off in (16, 8, 4, 2, 1):  # a Python tuple: unrolled while building
                amax[0] = T.max(amax[0], T.shfl_xor(amax[0], off))
            if nwarps > 1:
                if tx % 32 == 0:
                    red[tx // 32] = amax[0]
                T.sync_threads()
                for w in T.unroll(nwarps):
                    amax[0] = T.max(amax[0], red[(tx // L) * nwarps + w])
            a = T.max(amax[0], T.float32(_CLAMP))
            if round_sf:
                eb = T.shift_right(T.reinterpret(a / T.float32(_M), "int32") - 1, 23) + 1  # biased E + 127
                sf = T.reinterpret(T.shift_left(eb, 23), "float32")
                inv[0] = T.reinterpret(T.shift_left(T.max(254 - eb, 0), 23), "float32")
            else:
                sf = a / T.float32(_M)
                inv[0] = T.float32(_M) / a
            if T.And(lane == 0, row < Tn):
                if sf_layout == "row":
                    SF[row, 0] = sf
                elif sf_layout == "col":
                    SF[0, row] = sf
                else:
                    SF[0, row, 0] = T.cast(eb, "uint8")
            # Finite inputs give finite products below 2^16 (|x| <= amax, so |x * sf_inv| <= ~65024.01):
            # the short encoder. A thread holding a NaN or infinity takes the full one (quant.md 1.7 cases).
            if T.call_extern("int32", "isnan", special[0]) == 0:  # (TIR folds a plain s == s to true)
                for j in T.unroll(NG):
                    g = lane + j * L
                    if T.And(row < Tn, g < g8):
                        for v in T.unroll(8):
                            code[v] = _e5m6_code_fast(xv[j * 8 + v] * inv[0])
                        w0, w1, w2 = _e5m6_words([code[v] for v in range(8)])
                        ys[(tx // L) * words + g * 3] = w0  # lanes 3 words apart: no bank conflicts
                        ys[(tx // L) * words + g * 3 + 1] = w1
                        ys[(tx // L) * words + g * 3 + 2] = w2
            else:
                for j in T.unroll(NG):
                    g = lane + j * L
                    if T.And(row < Tn, g < g8):
                        for v in T.unroll(8):
                            code[v] = _e5m6_code(xv[j * 8 + v] * inv[0])
                        w0, w1, w2 = _e5m6_words([code[v] for v in range(8)])
                        ys[(tx // L) * words + g * 3] = w0  # lanes 3 words apart: no bank conflicts
                        ys[(tx // L) * words + g * 3 + 1] = w1
                        ys[(tx // L) * words + g * 3 + 2] = w2

            T.sync_threads()
            for i in T.unroll(n_copy):  # 16-byte stores, consecutive threads on consecutive vectors
                q = i * (R * L) + tx
                if q < R * qpr:
                    if bx * R + q // qpr < Tn:
                        for v in T.vectorized(yvec):
                            Y[bx * R + q // qpr, (q % qpr) * yvec + v] = ys[q * yvec + v]

    return e5m6_cast


BENCH_HIDDEN = (1536, 2048, 4096, 7168, 18432)  # tilefuse.bench.quant.HIDDEN


def _bench_configs() -> list[tuple]:
    """The casts the bench launches (tilefuse.bench.quant): bf16 and fp32 inputs at every grid hidden size with
    the flag sets (col, round, packed) FFF, FTF and TTT, as (x dtype, hidden, round_sf, sf layout). Other configs
    compile on first use."""
    return [(xd, h, r, lay) for xd in ("bfloat16", "float32") for h in BENCH_HIDDEN
            for r, lay in ((False, "row"), (True, "row"), (True, "col_packed"))]


_jit.register("per_token_cast_to_e5m6", e5m6_cast_kernel, _bench_configs)


# ---- launcher ----

def _aligned_rows(x: torch.Tensor, vec: int) -> torch.Tensor:
    """``x`` when its rows start on ``vec``-element (16-byte) boundaries (pointer and stride), else a copy."""
    if x.stride(-1) != 1 or x.data_ptr() % 16 or (x.size(0) > 1 and x.stride(0) % vec):
        return x.clone(memory_format=torch.contiguous_format)  # aligned even where x is contiguous
    return x


_PLANS: dict[tuple, object] = {}


def native_launcher(x_dtype: torch.dtype, hidden: int, col: bool, round_sf: bool, packed: bool):
    """The native launch plan ``plan(x, t)`` of one config (``tilefuse._native``: the outputs and kernel views
    of the Python path below, allocated and launched in one C++ call), built once; None where the extension
    is unavailable or no CTA tiling fits the width."""
    key = (x_dtype, hidden, col, round_sf, packed)
    plan = _PLANS.get(key)
    if plan is None:
        plan = None
        if _tiling(hidden) is not None:
            N = _native
            layout = ("col_packed" if packed else "col") if col else "row"
            sf = {"row": (1, torch.float32, N.ROW, 1, N.SAME, torch.float32),
                  "col": (1, torch.float32, N.COL_STORAGE, 1, N.STORAGE, torch.float32),
                  "col_packed": (1, torch.int32, N.COL_STORAGE, 1, N.STORAGE_BYTES, torch.int32)}[layout]
            outs = [(hidden * 3 // 2, torch.uint8, N.ROW, 1, N.WORDS, torch.uint32), sf]
            fn = _jit.get("per_token_cast_to_e5m6", (_TL_DTYPE[x_dtype], hidden, round_sf, layout))
            plan = N.plan(fn, x_dtype, 16, 16 // x_dtype.itemsize, outs)
        _PLANS[key] = plan = plan if plan is not None else False
    return plan or None


def e5m6_cast_launch(x: torch.Tensor, num_per_channels: int, use_tma_aligned_col_major_sf: bool = False,
                     round_sf: bool = False, use_packed_ue8m0: bool = False):
    """Allocate ``(uint8 (T, 3H/2), sf)`` and launch (quant.md 3.4). Validates nothing: the public op does
    (``num_per_channels == H``, ``H % 8 == 0``, packed only with col and round_sf)."""
    t, hidden = x.shape
    dev = x.device
    if t > 0:  # (empty inputs: nothing is compiled, loaded or launched)
        plan = native_launcher(x.dtype, hidden, bool(use_tma_aligned_col_major_sf), bool(round_sf),
                               bool(use_packed_ue8m0))
        if plan is not None:
            return plan(x, t)
    if _tiling(hidden) is None:  # a width no CTA tiling fits (far beyond the spec's sizes): the reference
        from tilefuse.reference.quant import cast_to_e5m6
        return cast_to_e5m6(x, num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    out = torch.empty(t, hidden * 3 // 2, dtype=torch.uint8, device=dev)
    pad = F.align(t, 4)
    if use_tma_aligned_col_major_sf and use_packed_ue8m0:
        layout = "col_packed"
        store = torch.empty(1, pad, dtype=torch.int32, device=dev)
        out_sf, sf_arg = store.narrow(1, 0, t).t(), store.view(torch.uint8).view(1, pad, 4)
    elif use_tma_aligned_col_major_sf:
        layout = "col"
        store = torch.empty(1, pad, dtype=torch.float32, device=dev)
        out_sf, sf_arg = store.narrow(1, 0, t).t(), store
    else:
        layout = "row"
        out_sf = sf_arg = torch.empty(t, 1, dtype=torch.float32, device=dev)
    if t > 0:
        vec = 16 // x.element_size()
        cfg = (_TL_DTYPE[x.dtype], hidden, round_sf, layout)
        _jit.get("per_token_cast_to_e5m6", cfg)(_aligned_rows(x, vec), out.view(torch.uint32), sf_arg)
    return out, out_sf


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::per_token_cast_to_e5m6", mutates_args=(), device_types="cuda")
def _e5m6_op(x: torch.Tensor, num_per_channels: int, use_tma_aligned_col_major_sf: bool, round_sf: bool,
             use_packed_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, sf = e5m6_cast_launch(x, num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    return out, sf


@_e5m6_op.register_fake
def _(x, num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0):
    t, hidden = x.shape
    out = x.new_empty((t, hidden * 3 // 2), dtype=torch.uint8)
    pad = (t + 3) // 4 * 4
    if use_tma_aligned_col_major_sf:
        dtype = torch.int32 if use_packed_ue8m0 else torch.float32
        return out, x.new_empty_strided((t, 1), (1, pad), dtype=dtype)
    return out, x.new_empty((t, 1), dtype=torch.float32)


def per_token_cast_to_e5m6_cuda(x: torch.Tensor, num_per_channels: int, use_tma_aligned_col_major_sf: bool = False,
                                round_sf: bool = False, use_packed_ue8m0: bool = False):
    """CUDA entry for ``per_token_cast_to_e5m6`` (and ``per_token_cast(x, 'e5m6', ...)``)."""
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.per_token_cast_to_e5m6(x, num_per_channels, use_tma_aligned_col_major_sf,
                                                          round_sf, use_packed_ue8m0)
    return e5m6_cast_launch(x, num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)


def cast_back_e5m6_cuda(x, fmt: str, x_block_size) -> torch.Tensor:
    """CUDA entry for ``cast_back_e5m6`` (and ``cast_back(..., x_special_fmt='e5m6')``): the cast-back kernel
    with E5M6 decoding."""
    return CB.cast_back_cuda(x, fmt, x_block_size, "e5m6")
