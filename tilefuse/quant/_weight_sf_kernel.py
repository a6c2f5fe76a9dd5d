"""TileLang kernel for ``batched_transpose_weight_sf`` (quant.md 5.13).

Both outputs are one operation on a strided view of the fp32 sf ``e`` ``(G, R, C)``: the packed storage
``out[g, c, r] = bytes(e[g, r // bs, 4c + u] for u < 4)`` of shape ``(G, cdiv(C, 4), R * bs)`` (byte ``u``
= biased exponent, 0 past ``C``). ``sf0`` is it on ``e`` itself (R = n/bs, C = k/bs); ``sf1`` on the
transposed view (R = k/bs, C = n/bs), read through its strides. A thread builds 4 consecutive words of one
storage row (the same source row block, since ``bs >= 32``) and writes them with one 16-byte store, for
``_U`` consecutive storage rows ``c`` (their 16 sf values share one source row: one base address), all sf
a CTA writes 16 KB. All sizes and input strides are symbolic, so one build per block size (and outputs per
launch) serves every weight. One launch converts up to 4 outputs (both of two weights: the bench's call is one
launch instead of four); the launcher groups a call's outputs 4 or 2 at a time (a weight gives 2).
"""

import torch

from tilefuse import _jit, _ops

_THREADS = 256
_W = 4  # words per 16-byte store
_NOT_EXPONENT = -0x7F800001  # int32 pattern 0x807FFFFF: sign and mantissa bits
_U = 4  # words of the storage (output rows c) per thread: 4 16-byte stores, one sf row's loads
# Knob (read when the factory runs; TILEFUSE_KNOBS overrides it for benchmark sweeps, results identical):
MIN_BLOCKS = 0  # > 0: __launch_bounds__(_THREADS, MIN_BLOCKS) (a register cap; 0: none)
# A thread issues all 4 * _U sf loads before its first store (a store may not be moved above a later load, as Y
# could alias E), with sf element offsets in int32 off the tensor's base pointer (one IMAD each, instead of
# TileLang's int64 index products: about 8 instructions per load; the launcher checks that every sf tensor spans
# < 2^31 elements).
_LDG_HELPER = """
template <typename P> __device__ __forceinline__ int tf_wsf_ldg(P p, int off) {
  return __float_as_int(__ldg(reinterpret_cast<const float*>(p) + off)); }
"""


def weight_sf_kernel(block_size: int, jobs: int = 1):
    """Factory: ``jobs`` independent conversions in one launch (``jobs`` in 1, 2, 4), each ``E_j`` fp32
    ``(G, R, C)`` (any strides) -> ``Y_j`` int32 ``(G, W, NR)`` (row stride NR, group stride YG),
    ``W = cdiv(C, 4)``, ``NR = R * block_size``. The 1-D grid is the concatenation of the jobs' CTA ranges
    (job j: ``cdiv(NR, 1024) * cdiv(W, 4) * G`` CTAs, bx fastest): one launch per up to 4 outputs instead
    of one per output (host launch cost and the kernel-boundary drain/ramp are paid once)."""
    import tilelang.language as T

    assert jobs in (1, 2, 4)
    dims, params, strides = [], [], []
    for j in range(jobs):
        d = T.dynamic(f"groups{j} rows{j} cols{j} words{j} out_rows{j} out_stride_g{j}")  # G R C W NR YG
        st = T.dynamic(f"stride_g{j} stride_r{j} stride_c{j}")
        dims.append(d)
        strides.append(st)
        params.append(T.StridedTensor((d[0], d[1], d[2]), st, "float32"))
        params.append(T.StridedTensor((d[0], d[3], d[4]), (d[5], d[4], 1), "int32"))
    nbx = [T.ceildiv(d[4], _THREADS * _W) for d in dims]
    ncy = [T.ceildiv(d[3], _U) for d in dims]
    nblk = [nbx[j] * ncy[j] * dims[j][0] for j in range(jobs)]
    first = [sum(nblk[:j], 0) for j in range(jobs)]   # first CTA of job j
    total = sum(nblk[1:], nblk[0])

    @T.macro
    def job(E, Y, blk, tx, j):
        # the CTA's (bx, cy, g), computed once into registers (two divisions by CTA-uniform values)
        q = T.alloc_var("int32")
        bx = T.alloc_var("int32")
        cy = T.alloc_var("int32")
        g = T.alloc_var("int32")
        r0 = T.alloc_var("int32")
        rb = T.alloc_var("int32")
        q = blk // nbx[j]
        bx = blk - q * nbx[j]
        g = q // ncy[j]
        cy = q - g * ncy[j]
        r0 = (bx * _THREADS + tx) * _W
        rb = r0 // block_size
        if r0 < dims[j][4]:
            bad = T.alloc_var("int32")
            bad = 0
            vals = T.alloc_local((_U * 4,), "int32")
            if j == 0:
                T.import_source(_LDG_HELPER)
            st = strides[j]
            off0 = T.alloc_var("int32")
            off0 = g * st[0] + rb * st[1] + (cy * (_U * 4)) * st[2]
            if (cy + 1) * (_U * 4) <= dims[j][2]:  # all sf values exist
                for i in T.unroll(_U * 4):
                    vals[i] = T.call_extern("int32", "tf_wsf_ldg", T.address_of(E[0, 0, 0]), off0 + i * st[2])
            else:  # the last column block: values past C read as 0 (their bytes are 0)
                for i in T.unroll(_U * 4):
                    vals[i] = 0
                    if cy * (_U * 4) + i < dims[j][2]:
                        vals[i] = T.call_extern("int32", "tf_wsf_ldg", T.address_of(E[0, 0, 0]),
                                                off0 + i * st[2])
            for k in T.unroll(_U):
                word = T.alloc_var("int32")
                word = 0
                for u in T.unroll(4):
                    bad = bad | (vals[k * 4 + u] & T.int32(_NOT_EXPONENT))
                    word = word | T.shift_left(T.shift_right(vals[k * 4 + u], 23) & 255, 8 * u)
                if cy * _U + k < dims[j][3]:
                    # one 16-byte store: nvcc splits a plain int4 store of this broadcast word into four
                    # 4-byte ones (partial sectors); streaming (evict-first): outputs are written once
                    T.call_extern("void", "__stcs",
                                  T.call_extern("handle", "(int4*)", T.address_of(Y[g, cy * _U + k, r0])),
                                  T.call_extern("handle", "make_int4", word, word, word, word))
            # quant.md 5.13: sign and mantissa bits must be 0 (every sf element is read by some thread)
            T.call_extern("void", "device_assert", bad == 0)

    if jobs == 1:
        @T.prim_func
        def weight_sf(E0: params[0], Y0: params[1]):
            T.assume(dims[0][4] % (_W * 32) == 0)
            T.assume(dims[0][5] % _W == 0)
            with T.Kernel(total, threads=_THREADS) as blk:
                if MIN_BLOCKS:
                    T.annotate_min_blocks_per_sm(MIN_BLOCKS)
                tx = T.get_thread_binding()
                job(E0, Y0, blk, tx, 0)
    elif jobs == 2:
        @T.prim_func
        def weight_sf(E0: params[0], Y0: params[1], E1: params[2], Y1: params[3]):
            T.assume(dims[0][4] % (_W * 32) == 0)
            T.assume(dims[0][5] % _W == 0)
            T.assume(dims[1][4] % (_W * 32) == 0)
            T.assume(dims[1][5] % _W == 0)
            with T.Kernel(total, threads=_THREADS) as blk:
                if MIN_BLOCKS:
                    T.annotate_min_blocks_per_sm(MIN_BLOCKS)
                tx = T.get_thread_binding()
                if blk < first[1]:
                    job(E0, Y0, blk, tx, 0)
                else:
                    job(E1, Y1, blk - first[1], tx, 1)
    else:
        @T.prim_func
        def weight_sf(E0: params[0], Y0: params[1], E1: params[2], Y1: params[3], E2: params[4], Y2: params[5],
                      E3: params[6], Y3: params[7]):
            T.assume(dims[0][4] % (_W * 32) == 0)
            T.assume(dims[0][5] % _W == 0)
            T.assume(dims[1][4] % (_W * 32) == 0)
            T.assume(dims[1][5] % _W == 0)
            T.assume(dims[2][4] % (_W * 32) == 0)
            T.assume(dims[2][5] % _W == 0)
            T.assume(dims[3][4] % (_W * 32) == 0)
            T.assume(dims[3][5] % _W == 0)
            with T.Kernel(total, threads=_THREADS) as blk:
                if MIN_BLOCKS:
                    T.annotate_min_blocks_per_sm(MIN_BLOCKS)
                tx = T.get_thread_binding()
                if blk < first[1]:
                    job(E0, Y0, blk, tx, 0)
                elif blk < first[2]:
                    job(E1, Y1, blk - first[1], tx, 1)
                elif blk < first[3]:
                    job(E2, Y2, blk - first[2], tx, 2)
                else:
                    job(E3, Y3, blk - first[3], tx, 3)

    return weight_sf


_JOBS = (4, 2)  # outputs per launch: the launcher takes the largest that fits (a weight gives 2 outputs)


def _configs() -> list[tuple]:
    """Every config: the block sizes of quant.md 5.13 times the outputs per launch (sizes and strides are
    symbolic)."""
    return [(bs, n) for bs in (32, 128) for n in _JOBS]


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


def _pool_views(pool: torch.Tensor, shape: tuple, off: int, batched: bool, transposed: bool):
    """(storage, returned view) of a ``(G, W, N)`` block at word ``off`` of the pool: the same tensors as
    ``pool[off:off + G W N].view(shape)`` and :func:`_views` of it (sf0: ``transposed`` False)."""
    g, w, n = shape
    storage = pool.as_strided(shape, (w * n, n, 1), off)
    if transposed:
        view = storage if batched else pool.as_strided((w, n), (n, 1), off)
    else:
        view = pool.as_strided((g, n, w), (w * n, 1, n), off) if batched else pool.as_strided((n, w), (1, n), off)
    return storage, view


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
    for k, s in enumerate(sf):  # the kernel's sf offsets are int32 (never reached in practice: 8 GB of sf per weight)
        span = sum((d - 1) * st for d, st in zip(s.shape, s.stride()) if d)
        if span >= 2 ** 31:
            raise ValueError(f"batched_transpose_weight_sf: sf[{k}] spans {span + 1} elements; the kernel "
                             "indexes an sf tensor with int32 offsets (< 2^31 elements)")
    outs = list(outs) if outs is not None else [None] * len(sf)
    shapes = [_storage_shapes(s, block_size) for s in sf]
    sizes = [(-(-a[0] * a[1] * a[2] // 8) * 8, -(-b[0] * b[1] * b[2] // 8) * 8) for a, b in shapes]  # 32-byte aligned
    need = sum(a + b for (a, b), o in zip(sizes, outs) if o is None)
    pool = torch.empty(need, dtype=torch.int32, device=sf[0].device) if need else None
    result, off, jobs = [], 0, []
    for s, t1, o, (sh0, sh1), (n0, n1) in zip(sf, transpose_sf1s, outs, shapes, sizes):
        batched = s.dim() == 3
        if o is None:
            # one as_strided per tensor (host time: slicing, view, transpose and indexing cost a few µs each)
            st0, v0 = _pool_views(pool, sh0, off, batched, False)
            st1, v1 = _pool_views(pool, sh1, off + n0, batched, t1)
            off += n0 + n1
            pair = (v0, v1)
        else:
            st0 = _as_storage(o[0], sh0, batched, False)
            st1 = _as_storage(o[1], sh1, batched, t1)
            pair = (o[0], o[1])
        e = s if batched else s.unsqueeze(0)
        if e.numel():  # the value rule is checked by the kernel itself (device_assert: no extra launches)
            jobs += [e, st0, e.transpose(1, 2), st1]
        result.append(pair)
    i = 0
    while i < len(jobs):  # up to 4 outputs per launch (the outputs are disjoint: any grouping is exact)
        n = next(k for k in _JOBS if 2 * k <= len(jobs) - i)
        _jit.get("batched_transpose_weight_sf", (block_size, n))(*jobs[i:i + 2 * n])
        i += 2 * n
    return result


@_ops.kernel_op("tilefuse::batched_transpose_weight_sf", mutates_args=(), device_types="cuda")
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
