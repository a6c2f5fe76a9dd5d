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

Tiling: a thread owns ``U`` chunks of ``V`` consecutive elements of one row (16-byte data loads for e4m3 and
e2m1, three 4-byte words for e5m6), consecutive threads take consecutive chunks of the flattened
``(T, H / V)`` chunk grid. No shared memory, no reductions: deterministic and batch-invariant.
"""

import torch

from tilefuse import _jit

_THREADS = 256
_UNROLL = 2  # chunks per thread, loaded before any is decoded (1 when a chunk is 128 output bytes)
# elements per chunk and the container word each chunk is loaded as
_CHUNK = {"e4m3": 16, "e2m1": 32, "e5m6": 8}
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
    "fp32"), logical ``hidden`` (a multiple of the chunk: 16 / 32 / 8), block ``(bm, bk)``, and whether the
    sf are packed UE8M0 int32 (else fp32). Token count, data row stride and sf strides are symbolic."""
    import tilelang.language as T

    V = _CHUNK[dfmt]
    assert hidden % V == 0, (dfmt, hidden)
    cpr = hidden // V  # chunks per row
    if dfmt == "e4m3":
        d_dtype, d_width, d_per_chunk = "float8_e4m3fn", hidden, V
    elif dfmt == "e2m1":
        d_dtype, d_width, d_per_chunk = "uint8", hidden // 2, V // 2
    else:  # three int32 words per group of 8 codes
        d_dtype, d_width, d_per_chunk = "int32", hidden * 3 // 8, 3
    o_dtype = _OUT_TL[out]
    o_vec = 8 if out == "bf16" else 4  # elements per 16-byte store
    nbk = -(-hidden // bk)
    sf_w = -(-nbk // 4) if sf_packed else nbk
    per_chunk_sf = bk % V == 0  # every element of a chunk shares one sf
    unroll = _UNROLL if V * (2 if out == "bf16" else 4) <= 64 else 1  # keeps e2m1 -> fp32 under ~64 registers
    per_cta = _THREADS * unroll
    py_range_v = tuple(range(V))

    Tn, S, NBM, SF0, SF1 = T.dynamic("num_tokens, data_row_stride, sf_rows, sf_stride0, sf_stride1")

    def sf_at(SF, row, col):
        rb = row // bm
        kb = col // bk
        if sf_packed:
            word = SF[rb, kb // 4]
            return T.reinterpret(T.shift_left(T.shift_right(word, (kb % 4) * 8) & 255, 23), "float32")
        return SF[rb, kb]

    x_param = T.StridedTensor((Tn, d_width), (S, 1), d_dtype)
    sf_param = T.StridedTensor((NBM, sf_w), (SF0, SF1), "int32" if sf_packed else "float32")
    y_param = T.Tensor((Tn, hidden), o_dtype)

    @T.prim_func
    def cast_back(X: x_param, SF: sf_param, Y: y_param):
        if dfmt != "e5m6":  # the launcher guarantees 16-byte aligned rows for vector loads
            T.assume(S % d_per_chunk == 0)
        with T.Kernel(T.ceildiv(Tn * cpr, per_cta), threads=_THREADS) as bx:
            tx = T.get_thread_binding()
            raw = T.alloc_local((unroll * d_per_chunk,), d_dtype)
            val = T.alloc_local((unroll * V,), "float32")
            res = T.alloc_local((unroll * V,), o_dtype)
            s = T.alloc_local((1,), "float32")
            for u in T.unroll(unroll):
                c = bx * per_cta + u * _THREADS + tx
                if c < Tn * cpr:
                    for v in T.vectorized(d_per_chunk):
                        raw[u * d_per_chunk + v] = X[c // cpr, (c % cpr) * d_per_chunk + v]
            for u in T.unroll(unroll):
                c = bx * per_cta + u * _THREADS + tx
                row = c // cpr
                col0 = (c % cpr) * V
                if c < Tn * cpr:
                    for v in T.unroll(V):
                        if dfmt == "e4m3":
                            val[u * V + v] = T.cast(raw[u * d_per_chunk + v], "float32")
                        elif dfmt == "e2m1":
                            byte = T.cast(raw[u * d_per_chunk + v // 2], "int32")
                            val[u * V + v] = _decode_e2m1(T.shift_right(byte, (v % 2) * 4) & 15)
                    if dfmt == "e5m6":
                        codes = _e5m6_codes(raw[u * 3], raw[u * 3 + 1], raw[u * 3 + 2])
                        for v in py_range_v:  # a Python tuple: expanded while building
                            val[u * V + v] = _decode_e5m6(codes[v])
                    if per_chunk_sf:
                        s[0] = sf_at(SF, row, col0)
                        for v in T.unroll(V):
                            res[u * V + v] = T.cast(val[u * V + v] * s[0], o_dtype)
                    else:
                        for v in T.unroll(V):
                            res[u * V + v] = T.cast(val[u * V + v] * sf_at(SF, row, col0 + v), o_dtype)
                    for p in T.unroll(V // o_vec):
                        for v in T.vectorized(o_vec):
                            Y[row, col0 + p * o_vec + v] = res[u * V + p * o_vec + v]

    return cast_back


def unpack_e2m1_kernel(out_dtype: str):
    """Factory: a flat packed-FP4 byte buffer of symbolic length ``N`` -> ``2N`` values of ``out_dtype``
    (quant.md 1.2: byte ``k`` gives elements ``2k`` (low nibble) and ``2k + 1``). A thread owns 8 bytes:
    one 8-byte load, sixteen decoded values, 16-byte stores; the ragged tail is done element by element."""
    import tilelang.language as T

    B = 8
    o_vec = 16 // {"float32": 4, "bfloat16": 2, "float16": 2}[out_dtype]
    N = T.dynamic("num_bytes")

    x_param = T.Tensor((N,), "uint8")
    y_param = T.Tensor((2 * N,), out_dtype)

    @T.prim_func
    def unpack_e2m1(X: x_param, Y: y_param):
        with T.Kernel(T.ceildiv(N, _THREADS * B), threads=_THREADS) as bx:
            tx = T.get_thread_binding()
            raw = T.alloc_local((B,), "uint8")
            res = T.alloc_local((2 * B,), out_dtype)
            b0 = (bx * _THREADS + tx) * B
            if b0 + B <= N:
                for v in T.vectorized(B):
                    raw[v] = X[b0 + v]
                for v in T.unroll(2 * B):
                    byte = T.cast(raw[v // 2], "int32")
                    res[v] = T.cast(_decode_e2m1(T.shift_right(byte, (v % 2) * 4) & 15), out_dtype)
                for p in T.unroll(2 * B // o_vec):
                    for v in T.vectorized(o_vec):
                        Y[2 * b0 + p * o_vec + v] = res[p * o_vec + v]
            else:
                for v in T.serial(2 * B):
                    if b0 + v // 2 < N:
                        byte = T.cast(X[b0 + v // 2], "int32")
                        Y[2 * b0 + v] = T.cast(_decode_e2m1(T.shift_right(byte, (v % 2) * 4) & 15), out_dtype)

    return unpack_e2m1


HIDDEN_SIZES = (576, 2048, 2560, 3072, 4096, 6144, 7168)  # quant.md 7.1 (bench shapes)


def test_configs() -> list[tuple]:
    """The configs the GPU tier uses (and the compile tier builds)."""
    cfgs = []
    for dfmt in ("e4m3", "e2m1"):
        for out in ("bf16", "fp32"):
            cfgs += [(dfmt, out, 576, 1, 128, False), (dfmt, out, 576, 1, 128, True),
                     (dfmt, out, 2048, 1, 2048, False)]
    for out in ("bf16", "fp32"):
        cfgs += [("e4m3", out, 2048, 128, 1, False), ("e4m3", out, 2048, 128, 128, False)]
    cfgs += [("e4m3", "fp32", 2048, 128, 128, True), ("e2m1", "bf16", 2048, 32, 32, False)]
    return cfgs


def _configs() -> list[tuple]:
    """Precompile set: the test configs plus the spec's benchmark grid (quant.md 7.2/7.3)."""
    cfgs = test_configs()
    for h in HIDDEN_SIZES:
        for out in ("bf16", "fp32"):
            for dfmt in ("e4m3", "e2m1"):
                for npc in (128, h):
                    for packed in ((False, True) if npc == 128 else (False,)):
                        cfgs.append((dfmt, out, h, 1, npc, packed))
            if h % 128 == 0:
                cfgs += [("e4m3", out, h, 128, 1, False), ("e4m3", out, h, 128, 128, False)]
    return list(dict.fromkeys(cfgs))


_jit.register("cast_back", cast_back_kernel, _configs)
_jit.register("unpack_from_e2m1fn_x2", unpack_e2m1_kernel, lambda: [("float32",), ("bfloat16",), ("float16",)])


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
    align = 4 if dfmt == "e5m6" else 16
    if (data.stride(1) != 1 or data.data_ptr() % align
            or (data.size(0) > 1 and data.stride(0) % align)):
        data = data.contiguous()
        if data.data_ptr() % align:
            data = data.clone()
    return data.view(torch.int32) if dfmt == "e5m6" else data


def cast_back_launch(data: torch.Tensor, sf: torch.Tensor, fmt: str, x_block_size, special: str | None = None):
    """Allocate ``(T, H)`` bf16/fp32 and launch (quant.md 3.5). Validates nothing: the public op does."""
    dfmt = _dfmt(data, special)
    t, hidden = data.size(0), _hidden(data, dfmt)
    out = torch.empty((t, hidden), dtype=_OUT_TORCH[fmt], device=data.device)
    if t == 0 or hidden == 0:
        return out
    bm, bk = (int(b) for b in x_block_size)
    fn = _jit.get("cast_back", (dfmt, fmt, hidden, bm, bk, sf.dtype == torch.int32))
    data = _kernel_data(data, dfmt)
    # the kernel numbers chunks in int32: inputs beyond 2^31 chunks go in row slices (whole sf row blocks)
    step = max(bm, (2 ** 31 - 1) // (hidden // _CHUNK[dfmt]) // bm * bm)
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
        if flat.data_ptr() % 8:
            flat = flat.clone()
        fn = _jit.get("unpack_from_e2m1fn_x2", (_UNPACK_DTYPES[k_dtype],))
        flat_out = out.view(-1)
        step = 2 ** 29  # bytes per launch: 2N outputs stay below 2^31 (int32 indexing)
        for b0 in range(0, flat.numel(), step):
            fn(flat[b0:b0 + step], flat_out[2 * b0:2 * (b0 + step)])
    return out if k_dtype == out_dtype else out.to(out_dtype)


# ---- torch.library registration (torch.compile / fake tensors) ----

@torch.library.custom_op("tilefuse::cast_back", mutates_args=(), device_types="cuda")
def _cast_back_op(data: torch.Tensor, sf: torch.Tensor, fmt: str, x_block_size: list[int],
                  x_special_fmt: str | None) -> torch.Tensor:
    return cast_back_launch(data, sf, fmt, x_block_size, x_special_fmt)


@_cast_back_op.register_fake
def _(data, sf, fmt, x_block_size, x_special_fmt):
    return data.new_empty((data.size(0), _hidden(data, _dfmt(data, x_special_fmt))), dtype=_OUT_TORCH[fmt])


@torch.library.custom_op("tilefuse::unpack_from_e2m1fn_x2", mutates_args=(), device_types="cuda")
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
