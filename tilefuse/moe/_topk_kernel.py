"""TileLang kernels for ``topk_gate`` (moe.md §2.1), ``topk_sum_and_topk_group_idx`` (§2.3) and
``normalize_weight`` (§2.4).

Selection. A row's candidates live in the registers of a segment of ``L`` lanes of one warp (``L`` a power of
two <= 32; ``32 / L`` rows per warp): lane ``l`` holds candidates ``l, l + L, l + 2L, ...`` (so a warp's loads
are coalesced), or, for ``topk_gate`` with a whole warp a row and ``E % 4 == 0``, ``c * 128 + 4 l + j`` (one
16-byte load per chunk ``c``). Each candidate becomes an int32 *key* whose integer order is the stable descending sort's
order: ``-0.0`` equals ``+0.0`` and every NaN is above ``+inf`` (torch.sort puts NaN first). K times: each lane
takes its best key (ties: its smallest index), the segment takes the largest ``(key, -index)`` pair (a whole warp:
two ``redux.sync`` reductions, the largest key, then the smallest index holding it; a narrower segment: an XOR
butterfly on packed 64-bit words), and the winner's key becomes ``INT_MIN``, below every real key. That is the
spec's repeat-max definition with removal instead of ``-inf`` overwrite, which equals ``stable_topk`` for every
input, finite or not. Nothing crosses rows, so results do not depend on the batch.

``topk_sum_and_topk_group_idx``: lane ``g`` of a segment of ``L >= G`` lanes scans group ``g`` (its ``n``
contiguous scores, 16-byte loads when ``n % 4 == 0``) for the largest one or two values in the same key order,
adds them in fp32, and the group scores are selected like ``topk_gate``'s (one candidate per lane).

``normalize_weight``: one thread per row, ``((1e-20 + w0) + w1) + ...`` in fp32 in slot order (the reference's
order), then IEEE divisions.

Launch. Inputs the kernels read with vector loads are copied where their start is not aligned to the vector (a
contiguous view at an odd storage offset). ``topk_gate`` launches through a native plan (``tilefuse._native``:
output allocation and kernel call in one C++ call), and ``topk_gate_fast`` is the public op's eager path that
skips the argument checks for facts that already passed them (one-token calls are host-bound).
"""
import struct

import torch

from tilefuse import _jit, _native, _ops
from tilefuse._launch import aligned
from tilefuse.reference import moe as ref

_THREADS = 128             # threads per CTA of the selection kernels (4 warps)
_NW_THREADS = 64           # threads (rows) per CTA of normalize_weight: 128 CTAs at T = 8192
MAX_GATE_EXPERTS = 1024    # topk_gate keeps E / 32 keys per lane in registers; larger E runs the reference
_UNROLL_TOPK = 32          # selection loops up to this K are unrolled (slot registers), longer ones are serial
_GROUP_CHUNK = 32          # values of a group loaded before they are scanned
_NW_REG_K = 32             # normalize_weight keeps up to this many weights of a row in registers
_INT_MIN = -(2 ** 31)
_EPS_BITS = struct.unpack("<i", struct.pack("<f", ref.EPS))[0]   # fp32 1e-20, as the reference rounds it

_CUDA = """
// Sortable key of a binary32 score: the integer order is the stable descending sort's order (NaN above +inf,
// -0.0 == +0.0). Every key is above INT_MIN (the removed / padding key).
__device__ __forceinline__ int tf_topk_key(float x) {
  int b = __float_as_int(x);
  if ((b & 0x7FFFFFFF) > 0x7F800000) return 0x7FFFFFFF;
  if (b == (int)0x80000000) b = 0;
  return b < 0 ? (b ^ 0x7FFFFFFF) : b;
}
// Index of the best (largest key, then smallest index) candidate of a segment of `width` lanes (a power of
// two, aligned in the warp); every lane of the segment gets it. A whole warp takes two redux.sync reductions:
// the largest key, then the smallest index among the lanes that hold it (an index is never 0xffffffff).
// Narrower segments pack the pair so that unsigned order is that ranking (key + 2^31 above, ~index below)
// and take an XOR butterfly.
__device__ __forceinline__ int tf_topk_seg_best(int key, int idx, int width) {
  if (width == 32) {
    const int top = __reduce_max_sync(0xffffffffu, key);
    return (int)__reduce_min_sync(0xffffffffu, key == top ? (unsigned)idx : 0xffffffffu);
  }
  unsigned long long p = ((unsigned long long)((unsigned)key ^ 0x80000000u) << 32) | (unsigned)(~idx);
  for (int o = width >> 1; o > 0; o >>= 1) {
    unsigned long long q = __shfl_xor_sync(0xffffffffu, p, o);
    p = q > p ? q : p;
  }
  return ~(int)(unsigned)p;
}
"""


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _lanes(candidates: int) -> int:
    """Lanes per row: the candidates, rounded up to a power of two, at most a warp."""
    return min(32, _pow2_at_least(candidates))


def topk_gate_kernel(num_experts: int, num_topk: int):
    """Factory: scores fp32 ``(T, E)`` -> indices int64 ``(T, K)``, T symbolic. ``L`` lanes per row, ``R`` keys
    per lane; padding candidates (``l + L j >= E``) hold ``INT_MIN`` and are never selected (K <= E)."""
    import tilelang.language as T

    E, K = num_experts, num_topk
    assert 1 <= K <= E <= MAX_GATE_EXPERTS
    L = _lanes(E)
    vec4 = _gate_vec4(E)
    R = 4 * -(-E // 128) if vec4 else -(-E // L)
    RPC = _THREADS // L                     # rows per CTA
    unrolled = K <= _UNROLL_TOPK
    KR = -(-K // L)                         # slot registers per lane (unrolled K)
    Tn = T.dynamic("num_tokens")
    s_param = T.Tensor((Tn, E), "float32")
    y_param = T.Tensor((Tn, K), "int64")

    def cand(lane, j):
        """The candidate (expert index) of key register j of a lane."""
        return (j // 4) * 128 + lane * 4 + j % 4 if vec4 else lane + L * j

    @T.prim_func
    def topk_gate(S: s_param, Y: y_param):
        with T.Kernel(T.ceildiv(Tn, RPC), threads=_THREADS) as bx:
            T.import_source(_CUDA)
            tx = T.get_thread_binding()
            lane = tx % L
            row = bx * RPC + tx // L
            key = T.alloc_local((R,), "int32")
            slot = T.alloc_local((KR,), "int32")
            best = T.alloc_var("int32")
            bidx = T.alloc_var("int32")
            win = T.alloc_var("int32")
            # every lane of a warp runs the selection (the shuffles name the whole warp); rows past T hold
            # INT_MIN keys and store nothing
            if vec4:
                raw = T.alloc_local((4,), "float32")
                for c in T.unroll(R // 4):
                    for v in T.unroll(4):
                        key[c * 4 + v] = _INT_MIN
                    if row < Tn and (E % 128 == 0 or c * 128 + lane * 4 < E):
                        for v in T.vectorized(4):
                            raw[v] = S[row, c * 128 + lane * 4 + v]
                        for v in T.unroll(4):
                            key[c * 4 + v] = T.call_extern("int32", "tf_topk_key", raw[v])
            else:
                for j in T.unroll(R):
                    key[j] = _INT_MIN
                    if row < Tn and (E % L == 0 or lane + L * j < E):
                        key[j] = T.call_extern("int32", "tf_topk_key", S[row, lane + L * j])
            for k in (T.unroll(K) if unrolled else T.serial(K)):
                best = key[0]
                bidx = cand(lane, 0)
                for j in T.unroll(1, R):   # ascending candidate index
                    if key[j] > best:   # strict: the lane's smaller index wins ties
                        best = key[j]
                        bidx = cand(lane, j)
                win = T.call_extern("int32", "tf_topk_seg_best", best, bidx, L)
                for j in T.unroll(R):
                    if cand(lane, j) == win:
                        key[j] = _INT_MIN
                if unrolled:
                    if lane == k % L:
                        slot[k // L] = win
                elif row < Tn and lane == k % L:
                    Y[row, k] = T.cast(win, "int64")
            if unrolled:
                for j in T.unroll(KR):
                    if row < Tn and (K % L == 0 or lane + L * j < K):
                        Y[row, lane + L * j] = T.cast(slot[j], "int64")

    return topk_gate


def _gate_vec4(experts: int) -> bool:
    """topk_gate's 16-byte layout applies: a whole warp a row and rows of 16-byte multiples (lane l holds candidates
    c * 128 + 4 l + j, one 16-byte load per chunk c; the launcher copies a start that is not 16-byte aligned)."""
    return _lanes(experts) == 32 and experts % 4 == 0


def topk_group_kernel(num_groups: int, per_group: int, num_topk_sum: int, num_topk_groups: int):
    """Factory: scores fp32 ``(T, G, n)`` -> group indices int64 ``(T, num_topk_groups)``, T symbolic. Lane
    ``g < G`` of an ``L``-lane segment owns group ``g``; lanes ``G .. L-1`` hold ``INT_MIN``."""
    import tilelang.language as T

    G, n, S2, KG = num_groups, per_group, num_topk_sum, num_topk_groups
    assert 1 <= G <= 32 and 1 <= S2 <= min(2, n) and 1 <= KG <= G
    L = _lanes(G)
    RPC = _THREADS // L
    VEC = 4 if n % 4 == 0 else 1
    CH = min(n, _GROUP_CHUNK)
    full, tail = divmod(n, CH)
    KR = -(-KG // L)
    Tn = T.dynamic("num_tokens")

    @T.macro
    def scan(S, row, g, c0, count, vals, tk, tv):
        """Fold ``count`` values of group ``g`` from column ``c0`` into the running best two (keys ``tk``,
        values ``tv``; ``tk[0] >= tk[1]``): a value equal to the best goes second (the multiset's top two)."""
        for i in T.vectorized(count) if VEC == 4 else T.unroll(count):
            vals[i] = S[row, g, c0 + i]
        for i in T.unroll(count):
            kv = T.call_extern("int32", "tf_topk_key", vals[i])
            if kv > tk[0]:
                if S2 == 2:
                    tk[1] = tk[0]
                    tv[1] = tv[0]
                tk[0] = kv
                tv[0] = vals[i]
            elif S2 == 2 and kv > tk[1]:
                tk[1] = kv
                tv[1] = vals[i]

    s_param = T.Tensor((Tn, G, n), "float32")
    y_param = T.Tensor((Tn, KG), "int64")

    @T.prim_func
    def topk_group(S: s_param, Y: y_param):
        with T.Kernel(T.ceildiv(Tn, RPC), threads=_THREADS) as bx:
            T.import_source(_CUDA)
            tx = T.get_thread_binding()
            lane = tx % L
            row = bx * RPC + tx // L
            vals = T.alloc_local((CH,), "float32")
            slot = T.alloc_local((KR,), "int32")
            tk = T.alloc_local((2,), "int32")
            tv = T.alloc_local((2,), "float32")
            key = T.alloc_var("int32")
            win = T.alloc_var("int32")
            # every lane of a warp runs the selection (the shuffles name the whole warp); lanes past G and rows
            # past T hold INT_MIN keys and store nothing
            key = _INT_MIN
            if row < Tn and (G == L or lane < G):
                tk[0] = _INT_MIN
                tk[1] = _INT_MIN
                tv[0] = T.float32(0)
                tv[1] = T.float32(0)
                for c in T.serial(full):
                    scan(S, row, lane, c * CH, CH, vals, tk, tv)
                if tail:
                    scan(S, row, lane, full * CH, tail, vals, tk, tv)
                if S2 == 1:
                    key = T.call_extern("int32", "tf_topk_key", tv[0])
                else:
                    key = T.call_extern("int32", "tf_topk_key", tv[0] + tv[1])
            for k in T.unroll(KG):
                win = T.call_extern("int32", "tf_topk_seg_best", key, lane, L)
                if lane == win:
                    key = _INT_MIN
                if lane == k % L:
                    slot[k // L] = win
            for j in T.unroll(KR):
                if row < Tn and (KG % L == 0 or lane + L * j < KG):
                    Y[row, lane + L * j] = T.cast(slot[j], "int64")

    return topk_group


def _nw_vec(k: int) -> int:
    """Elements per load / store of a normalize_weight row held in registers."""
    return 4 if k % 4 == 0 else (2 if k % 2 == 0 else 1)


def normalize_weight_kernel(num_topk: int):
    """Factory: weights fp32 ``(T, K)`` -> ``(denominator (T,), normalized (T, K))``, T symbolic; one thread per
    row, loads and stores as wide as ``K`` allows (16, 8 or 4 bytes)."""
    import tilelang.language as T

    K = num_topk
    VEC = _nw_vec(K)
    in_regs = K <= _NW_REG_K
    Tn = T.dynamic("num_tokens")

    w_param = T.Tensor((Tn, K), "float32")
    d_param = T.Tensor((Tn,), "float32")
    y_param = T.Tensor((Tn, K), "float32")

    @T.prim_func
    def normalize_weight(W: w_param, D: d_param, Y: y_param):
        with T.Kernel(T.ceildiv(Tn, _NW_THREADS), threads=_NW_THREADS) as bx:
            row = bx * _NW_THREADS + T.get_thread_binding()
            acc = T.alloc_var("float32")
            if row < Tn:
                acc = T.reinterpret(T.int32(_EPS_BITS), "float32")
                if in_regs:
                    w = T.alloc_local((K,), "float32")
                    for c in T.unroll(K // VEC):
                        for v in T.vectorized(VEC):
                            w[c * VEC + v] = W[row, c * VEC + v]
                    for k in T.unroll(K):
                        acc = acc + w[k]
                    for k in T.unroll(K):
                        w[k] = w[k] / acc
                    D[row] = acc
                    for c in T.unroll(K // VEC):
                        for v in T.vectorized(VEC):
                            Y[row, c * VEC + v] = w[c * VEC + v]
                else:
                    for k in T.serial(K):
                        acc = acc + W[row, k]
                    D[row] = acc
                    for k in T.serial(K):
                        Y[row, k] = W[row, k] / acc

    return normalize_weight


# ----------------------------------------------------------------------------------------------------
# Static configs: those the bench launches (``precompile``); any other (the tests' own, tests/moe/configs.py)
# compiles on first use
# ----------------------------------------------------------------------------------------------------

BENCH_GATE_EXPERTS = (256, 72, 384)  # tilefuse.bench.moe.GATE_EXPERTS, at top-8 (TOPK)
BENCH_OFF_GATES = tuple((e, k) for e in (64, 128, 160) for k in (6, 8))  # tilefuse.bench.moe.OFF_GATES


def _gate_configs() -> list[tuple]:
    """(E, K) of the bench's topk_gate rows: the issue's gates at top-8, then the off-grid ones."""
    return [(e, 8) for e in BENCH_GATE_EXPERTS] + list(BENCH_OFF_GATES)


def _group_configs() -> list[tuple]:
    """(G, n, num_topk_sum, num_topk_groups) of the bench's rows: top-2 sums, top-4 groups, at each issue gate's
    expert count (8 groups of E / 8; 384 experts as 12 groups of 32)."""
    return [(12, 32, 2, 4) if e == 384 else (8, e // 8, 2, 4) for e in BENCH_GATE_EXPERTS]


def _normalize_configs() -> list[tuple]:
    """K of the bench's normalize_weight rows: top-8 and top-6."""
    return [(8,), (6,)]


_jit.register("topk_gate", topk_gate_kernel, _gate_configs)
_jit.register("topk_sum_and_topk_group_idx", topk_group_kernel, _group_configs)
_jit.register("normalize_weight", normalize_weight_kernel, _normalize_configs)


# ----------------------------------------------------------------------------------------------------
# Launchers (arguments validated by tilefuse.moe.ops)
# ----------------------------------------------------------------------------------------------------

# One-token gate calls are host-bound: the launch of one (E, K) is a native plan (tilefuse._native: the output
# allocated and the kernel launched in one C++ call) where the extension is available, else the Python path.
_GATE_LAUNCHERS: dict[tuple, object] = {}
# Eager calls that already passed the facts the public op checks, keyed by them (dtype, strides, E, K; the
# token count is free because the strides are the contiguous ones at every token count) -> the launch.
_VALIDATED: dict[tuple, object] = {}
_is_compiling = torch.compiler.is_compiling


def gate_launcher(experts: int, num_topk: int):
    """``launch(scores, t) -> topk_idx (t, K)`` of one ``(E, K)`` (E <= MAX_GATE_EXPERTS; the kernel reads fp32
    scalars, so any fp32 start is aligned, or with the 16-byte layout 16-byte vectors, from an aligned copy where the start
    is not): the native plan, or the Python path (torch.empty + the TVM-FFI call) where the extension is
    unavailable. Cached per config (not for a stand-in ``_jit.get``)."""
    key = (experts, num_topk)
    launch = _GATE_LAUNCHERS.get(key)
    if launch is None:
        fn = _jit.get("topk_gate", key)
        align = 16 if _gate_vec4(experts) else 4   # the 16-byte layout's loads need an aligned start
        launch = _native.plan(fn, torch.float32, align, 1, [(num_topk, torch.int64, False)])
        if launch is None:
            def launch(scores, t, fn=fn, k=num_topk, align=align):
                out = torch.empty(t, k, dtype=torch.int64, device=scores.device)
                if t:
                    fn(scores if align == 4 else aligned(scores, align), out)
                return out
        if _native._is_ffi(fn):
            _GATE_LAUNCHERS[key] = launch
    return launch


def topk_gate_fast(scores, num_topk):
    """The eager fast path of the public ``topk_gate``: the result for a contiguous (row stride E) fp32 CUDA
    ``(T >= 1, E)`` with an int ``1 <= K <= E <= MAX_GATE_EXPERTS``, without the public op's checks once the
    same facts passed them; None for every other call (the public op then validates and takes
    ``topk_gate_cuda``, or raises its error)."""
    if type(scores) is torch.Tensor and type(num_topk) is int and scores.is_cuda and not _is_compiling():
        shape = scores.shape
        if len(shape) == 2:
            key = (scores.dtype, scores.stride(), shape[1], num_topk)
            launch = _VALIDATED.get(key)
            if launch is not None:
                return launch(scores, shape[0])
            experts = shape[1]
            if (shape[0] and scores.dtype == torch.float32 and key[1] == (experts, 1)
                    and 1 <= num_topk <= experts <= MAX_GATE_EXPERTS):
                launch = gate_launcher(experts, num_topk)
                if _GATE_LAUNCHERS.get((experts, num_topk)) is launch:
                    _VALIDATED[key] = launch
                return launch(scores, shape[0])
    return None


def topk_gate_launch(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    rows, experts = scores.shape
    if experts > MAX_GATE_EXPERTS:
        return ref.stable_topk(scores, num_topk)
    if not rows:  # nothing compiled, loaded or launched
        return torch.empty(0, num_topk, dtype=torch.int64, device=scores.device)
    return gate_launcher(experts, num_topk)(scores, rows)


def topk_sum_and_topk_group_idx_launch(scores: torch.Tensor, num_topk_sum: int, num_topk_groups: int) -> torch.Tensor:
    rows, groups, per_group = scores.shape
    out = torch.empty(rows, num_topk_groups, dtype=torch.int64, device=scores.device)
    if rows:
        x = aligned(scores, 16) if per_group % 4 == 0 else scores  # the 16-byte loads of a group's scores
        _jit.get("topk_sum_and_topk_group_idx", (groups, per_group, num_topk_sum, num_topk_groups))(x, out)
    return out


def normalize_weight_launch(topk_weights: torch.Tensor):
    rows, k = topk_weights.shape
    den = torch.empty(rows, dtype=torch.float32, device=topk_weights.device)
    out = torch.empty(rows, k, dtype=torch.float32, device=topk_weights.device)
    if rows and k:
        vec = _nw_vec(k)
        w = aligned(topk_weights, 4 * vec) if vec > 1 and k <= _NW_REG_K else topk_weights
        _jit.get("normalize_weight", (k,))(w, den, out)
    elif rows:
        den.fill_(ref.EPS)
    return den, out


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::topk_gate", mutates_args=(), device_types="cuda")
def _topk_gate_op(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    return topk_gate_launch(scores, num_topk)


@_topk_gate_op.register_fake
def _topk_gate_fake(scores, num_topk):
    return scores.new_empty((scores.size(0), num_topk), dtype=torch.int64)


@_ops.kernel_op("tilefuse::topk_sum_and_topk_group_idx", mutates_args=(), device_types="cuda")
def _topk_group_op(scores: torch.Tensor, num_topk_sum: int, num_topk_groups: int) -> torch.Tensor:
    return topk_sum_and_topk_group_idx_launch(scores, num_topk_sum, num_topk_groups)


@_topk_group_op.register_fake
def _topk_group_fake(scores, num_topk_sum, num_topk_groups):
    return scores.new_empty((scores.size(0), num_topk_groups), dtype=torch.int64)


@_ops.kernel_op("tilefuse::normalize_weight", mutates_args=(), device_types="cuda")
def _normalize_weight_op(topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return normalize_weight_launch(topk_weights)


@_normalize_weight_op.register_fake
def _normalize_weight_fake(topk_weights):
    return (topk_weights.new_empty((topk_weights.size(0),)), topk_weights.new_empty(topk_weights.shape))


def topk_gate_cuda(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    """CUDA entry for ``topk_gate``: a direct launch in eager mode, the custom op under ``torch.compile``."""
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.topk_gate(scores, num_topk)
    return topk_gate_launch(scores, num_topk)


def topk_sum_and_topk_group_idx_cuda(scores: torch.Tensor, num_topk_sum: int, num_topk_groups: int) -> torch.Tensor:
    """CUDA entry for ``topk_sum_and_topk_group_idx``."""
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.topk_sum_and_topk_group_idx(scores, num_topk_sum, num_topk_groups)
    return topk_sum_and_topk_group_idx_launch(scores, num_topk_sum, num_topk_groups)


def normalize_weight_cuda(topk_weights: torch.Tensor):
    """CUDA entry for ``normalize_weight``: ``(denominator (T,), normalized (T, K))``."""
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.normalize_weight(topk_weights)
    return normalize_weight_launch(topk_weights)
