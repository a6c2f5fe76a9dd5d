"""TileLang kernel for ``batched_transpose_weight_sf`` (quant.md 5.13).

Both outputs are one operation on a strided view of the fp32 sf ``e`` ``(G, R, C)``: the packed storage
``out[g, c, r] = bytes(e[g, r // bs, 4c + u] for u < 4)`` of shape ``(G, cdiv(C, 4), R * bs)`` (byte ``u``
= biased exponent, 0 past ``C``). ``sf0`` is it on ``e`` itself (R = n/bs, C = k/bs); ``sf1`` on the
transposed view (R = k/bs, C = n/bs), read through its strides. A thread builds 4 consecutive words of one
storage row (the same source row block, since ``bs >= 32``) and writes them with one 16-byte store, for
``_U`` consecutive storage rows ``c`` (their 16 sf values share one source row: one base address), all sf
a CTA writes 16 KB. All sizes
and input strides are symbolic, so one build per block size serves every weight.
"""

import torch

from tilefuse import _jit

_THREADS = 256
_W = 4  # words per 16-byte store
_NOT_EXPONENT = -0x7F800001  # int32 pattern 0x807FFFFF: sign and mantissa bits
_U = 4  # words of the storage (output rows c) per thread: 4 16-byte stores, one sf row's loads


def weight_sf_kernel(block_size: int):
    """Factory: ``E`` fp32 ``(G, R, C)`` (any strides) -> ``Y`` int32 ``(G, W, NR)`` (row stride NR, group
    stride YG), ``W = cdiv(C, 4)``, ``NR = R * block_size``."""
    import tilelang.language as T

    G, R, C, W, NR = T.dynamic("groups, rows, cols, words, out_rows")
    SG, SR, SC, YG = T.dynamic("stride_g, stride_r, stride_c, out_stride_g")
    e_param = T.StridedTensor((G, R, C), (SG, SR, SC), "float32")
    y_param = T.StridedTensor((G, W, NR), (YG, NR, 1), "int32")

    @T.prim_func
    def weight_sf(E: e_param, Y: y_param):
        T.assume(NR % (_W * 32) == 0)
        T.assume(YG % _W == 0)
        with T.Kernel(T.ceildiv(NR, _THREADS * _W), T.ceildiv(W, _U), G, threads=_THREADS) as (bx, cy, g):
            tx = T.get_thread_binding()
            r0 = (bx * _THREADS + tx) * _W
            if r0 < NR:
                bad = T.alloc_var("int32")
                bad = 0
                rb = r0 // block_size
                for k in T.unroll(_U):
                    word = T.alloc_var("int32")
                    word = 0
                    if (cy + 1) * (_U * 4) <= C:  # all 16 sf values exist: plain loads off one base address
                        for u in T.unroll(4):
                            bits = T.alloc_var("int32")
                            bits = T.reinterpret(E[g, rb, (cy * _U + k) * 4 + u], "int32")
                            bad = bad | (bits & T.int32(_NOT_EXPONENT))
                            word = word | T.shift_left(T.shift_right(bits, 23) & 255, 8 * u)
                    else:  # the last column block: bytes past C are 0
                        for u in T.unroll(4):
                            j = (cy * _U + k) * 4 + u
                            if j < C:
                                bits = T.alloc_var("int32")
                                bits = T.reinterpret(E[g, rb, j], "int32")
                                bad = bad | (bits & T.int32(_NOT_EXPONENT))
                                word = word | T.shift_left(T.shift_right(bits, 23) & 255, 8 * u)
                    if cy * _U + k < W:
                        # one 16-byte store: nvcc splits a plain int4 store of this broadcast word into four
                        # 4-byte ones (partial sectors); streaming (evict-first): outputs are written once
                        T.call_extern("void", "__stcs",
                                      T.call_extern("handle", "(int4*)", T.address_of(Y[g, cy * _U + k, r0])),
                                      T.call_extern("handle", "make_int4", word, word, word, word))
                # quant.md 5.13: sign and mantissa bits must be 0 (every sf element is read by some thread)
                T.call_extern("void", "device_assert", bad == 0)

    return weight_sf


def _configs() -> list[tuple]:
    """Every config: the block sizes of quant.md 5.13 (sizes and strides are symbolic)."""
    return [(32,), (128,)]


_jit.register("batched_transpose_weight_sf", weight_sf_kernel, _configs)


def _storage_shapes(s: torch.Tensor, bs: int):
    """((G, W0, n), (G, W1, k)) packed storage shapes of the two outputs of one weight."""
    g = s.size(0) if s.dim() == 3 else 1
    nsn, nsk = s.shape[-2:]
    return (g, -(-nsk // 4), nsn * bs), (g, -(-nsn // 4), nsk * bs)


def _views(storage: torch.Tensor, batched: bool, transpose_sf1: bool, which: int):
    """The returned logical view of a ``(G, W, N)`` storage block (quant.md 5.13 strides)."""
    view = storage if (which == 1 and transpose_sf1) else storage.transpose(1, 2)
    return view if batched else view[0]


def _as_storage(out: torch.Tensor, shape: tuple, batched: bool, transposed: bool) -> torch.Tensor:
    """The ``(G, W, N)`` storage of a caller's output tensor (validated by the public op)."""
    t = out if batched else out.unsqueeze(0)
    t = t if transposed else t.transpose(1, 2)
    return t.as_strided(shape, (shape[1] * shape[2], shape[2], 1))


def batched_transpose_weight_sf_launch(sf: list, block_size: int, transpose_sf1s: list, outs: list | None):
    """``[(sf0, sf1)]`` per weight (quant.md 5.13). Validates shapes nothing: the public op does; the value
    rule (sign and mantissa bits 0) is a device-side assertion in the kernel (the reference uses
    ``torch._assert_async``: four more launches per weight)."""
    if not sf:
        return []
    fn = _jit.get("batched_transpose_weight_sf", (block_size,))
    outs = list(outs) if outs is not None else [None] * len(sf)
    shapes = [_storage_shapes(s, block_size) for s in sf]
    sizes = [(-(-a[0] * a[1] * a[2] // 8) * 8, -(-b[0] * b[1] * b[2] // 8) * 8) for a, b in shapes]  # 32-byte aligned
    need = sum(a + b for (a, b), o in zip(sizes, outs) if o is None)
    pool = torch.empty((need,), dtype=torch.int32, device=sf[0].device) if need else None
    result, off = [], 0
    for s, t1, o, (sh0, sh1), (n0, n1) in zip(sf, transpose_sf1s, outs, shapes, sizes):
        batched = s.dim() == 3
        if o is None:
            st0 = pool[off:off + sh0[0] * sh0[1] * sh0[2]].view(sh0)
            st1 = pool[off + n0:off + n0 + sh1[0] * sh1[1] * sh1[2]].view(sh1)
            off += n0 + n1
            pair = (_views(st0, batched, t1, 0), _views(st1, batched, t1, 1))
        else:
            st0 = _as_storage(o[0], sh0, batched, False)
            st1 = _as_storage(o[1], sh1, batched, t1)
            pair = (o[0], o[1])
        e = s if batched else s.unsqueeze(0)
        if e.numel():  # the value rule is checked by the kernel itself (device_assert: no extra launches)
            fn(e, st0)
            fn(e.transpose(1, 2), st1)
        result.append(pair)
    return result


@torch.library.custom_op("tilefuse::batched_transpose_weight_sf", mutates_args=(), device_types="cuda")
def _weight_sf_op(sf: list[torch.Tensor], block_size: int, transpose_sf1s: list[bool]) -> list[torch.Tensor]:
    out = batched_transpose_weight_sf_launch(sf, block_size, transpose_sf1s, None)
    return [t.clone() for pair in out for t in pair]  # custom ops may not return views of one another


@_weight_sf_op.register_fake
def _(sf, block_size, transpose_sf1s):
    res = []
    for s, t1 in zip(sf, transpose_sf1s):
        sh0, sh1 = _storage_shapes(s, block_size)
        batched = s.dim() == 3
        res.append(_views(s.new_empty(sh0, dtype=torch.int32), batched, t1, 0))
        res.append(_views(s.new_empty(sh1, dtype=torch.int32), batched, t1, 1))
    return res


def batched_transpose_weight_sf_cuda(sf, block_size, transpose_sf1s, outs=None):
    """CUDA entry for the public ``batched_transpose_weight_sf``. Under ``torch.compile`` without ``outs`` it
    goes through the custom op (outputs are then separate allocations, not views of one pool)."""
    if torch.compiler.is_compiling() and (outs is None or all(o is None for o in outs)):
        flat = torch.ops.tilefuse.batched_transpose_weight_sf(list(sf), block_size, list(transpose_sf1s))
        return [(flat[2 * i], flat[2 * i + 1]) for i in range(len(sf))]
    return batched_transpose_weight_sf_launch(sf, block_size, transpose_sf1s, outs)
