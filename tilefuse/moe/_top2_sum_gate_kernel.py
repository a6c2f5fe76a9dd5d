"""TileLang kernel for the v1 routing gate ``top2_sum_gate`` (moe.md §2.2).

One warp per token, one pass. Lane ``l`` holds the experts ``c*128 + 4l + j`` (chunk ``c``, ``j < 4``: one
16-byte load per chunk), the softmax summation order of §2.2 step 2, so every per-token value lives in
registers: logits, unbiased scores ``s``, ranking scores ``r``. Per token:

1. scores (sigmoid / sqrt-softplus elementwise; softmax: warp max, lane sums in chunk order, XOR butterfly);
2. group restriction: per group the multiset top-2 of ``r`` by a max/min butterfly (groups of 4, 8, 16 or 32
   experts are aligned runs of lanes inside one chunk: a butterfly inside the run; other sizes: one over the
   warp per group), lane ``g`` ranks group ``g`` against all groups (ties -> smaller group), a ballot gives
   the kept groups, others get ``r = -inf``; the top-2 of a multiset and its sum do not depend on the order;
3. top-k by ``K`` rounds of warp arg-max (value descending, index ascending: two ``redux.sync`` reductions;
   chosen entries leave through a per-lane bit mask), which is the stable descending sort of the reference;
   fixed tokens read their routes;
4. lane ``k < K`` recomputes ``s`` of its route from the logit (same fp32 expression, same bits), every lane
   sums the ``K`` of them in slot order from ``1e-20`` (broadcast shuffles), ``w = (s / D) * rho``; lanes
   ``K .. K+S-1`` are the shared slots (weight 1);
5. lane ``k < K+S`` maps its slot through the physical map, applies the EP/TP renumbering and writes.

The fp32 operations are the reference's, in its order (IEEE division and sqrt, CUDA ``expf`` / ``log1pf``),
so indices and weights are bit-identical. Where the reference rounds a value to memory between two of
its kernels and nvcc could fuse the kernel's product into the next addition (softmax: ``expf`` ends in a
multiply, the reference adds stored exp values), the addition is ``__fadd_rn``. The data rules of §2.2
step 13 are device assertions: finite logits of unmasked tokens, fixed routes in ``[0, E_r)``, replica
counts >= 1 (the count vector spread over the grid's threads); the reference fallback checks them with
``_checks.check_top2_sum_gate_data``. Static config: ``(E, K, G, TG, S, scoring, mask, fix, unmapped,
map)``; the token count and the optional tensors' sizes are symbolic, the scaling factor and ranks are
kernel scalars. Absent optional tensors are passed as a cached one-element dummy and never read.
"""

import torch

from tilefuse import _jit, _ops, formats
from tilefuse._launch import aligned, placeholder
from tilefuse.moe import _checks as checks
from tilefuse.reference import moe as ref

WARPS = 4                 # tokens (warps) per CTA
MAX_EXPERTS = 1024        # lanes hold up to 32 experts each; larger E falls back to the reference
_SENTINEL = 2**30         # "no expert" index during the arg-max rounds (larger than every real index)

# Warp arg-max of a top-k round: the largest value (an order-preserving int key: -0.0 equals +0.0), then the
# smallest index among the lanes that hold it; two redux.sync reductions. Values are never NaN (finite logits,
# -inf for excluded experts), and on such values this is the order of the float comparisons it replaced.
_CUDA = """
__device__ __forceinline__ int tf2_warp_best(float v, int i) {
  int b = __float_as_int(v);
  if (b == (int)0x80000000) b = 0;
  const int key = b < 0 ? (b ^ 0x7fffffff) : b;
  const int top = __reduce_max_sync(0xffffffffu, key);
  return __reduce_min_sync(0xffffffffu, key == top ? i : 0x7fffffff);
}
"""


def top2_sum_gate_kernel(E: int, K: int, G: int, TG: int, S: int, scoring: str, has_mask: bool, has_fix: bool,
                         has_unmapped: bool, has_map: bool):
    """Factory. ``G == TG == 0`` means no group restriction (the launcher maps ``G == TG`` to it)."""
    import tilelang.language as T

    assert E % 4 == 0 and E <= MAX_EXPERTS and 1 <= K <= 32 and K + S <= 32 and S in (0, 1, 2)
    assert scoring in ("sigmoid", "sqrtsoftplus", "softmax")
    assert not has_fix or has_unmapped
    grouped = G != TG
    per_group = E // G if grouped else 0
    if grouped:
        assert 2 <= per_group <= 32 and G <= 32 and E % G == 0 and 1 <= TG < G
    # groups of 4, 8, 16 or 32 experts: each is an aligned run of per_group / 4 lanes inside one chunk
    segmented = grouped and per_group % 4 == 0 and 128 % per_group == 0
    seg_lanes = per_group // 4 if segmented else 1
    seg_steps = seg_lanes.bit_length() - 1
    NC = formats.cdiv(E, 128)          # chunks of 128 experts
    V = 4 * NC                  # expert slots per lane
    W = K + S                   # output width
    full_chunks = E % 128 == 0  # every lane owns 4 experts of every chunk

    Tn, ML, FL, UR, US, MR, MD = T.dynamic(
        "num_tokens, mask_len, fix_len, unmapped_rows, unmapped_stride, map_rows, map_cols")
    neg_inf = T.float32(float("-inf"))

    def expf(v):
        return T.call_extern("float32", "expf", v)

    def add_rn(a, b):
        """a + b that nvcc never contracts with a product feeding it (expf ends in a multiply)."""
        return T.call_extern("float32", "__fadd_rn", a, b)

    def nonfinite(v):
        """1 if v is NaN or +-inf (exponent bits all ones)."""
        bits = T.reinterpret(v, "uint32")
        return T.Cast("int32", T.bitwise_and(bits, T.uint32(0x7F800000)) == T.uint32(0x7F800000))

    def elementwise_score(x):
        """s = sigmoid(x) or sqrt(softplus(x)) (moe.md §2.0), PyTorch's CUDA expressions verbatim:
        ``1 / (1 + expf(-x))`` (one lambda in torch too: nvcc fuses expf's final scaling into the ``1 +``
        in both, exact either way since that scaling is by a power of two) and ``sqrtf`` of a stored
        ``x > 20 ? x : log1pf(expf(x))`` (torch's ``x * beta`` and ``/ beta`` with beta = 1 are exact)."""
        if scoring == "sigmoid":
            return T.float32(1.0) / (T.float32(1.0) + expf(-x))
        sp = T.if_then_else(x > T.float32(20.0), x, T.call_extern("float32", "log1pf", expf(x)))
        return T.call_extern("float32", "sqrtf", sp)

    def expert_of(lane, v):
        return (v // 4) * 128 + lane * 4 + v % 4

    def owns(lane, v):
        """Slot v of this lane is a real expert."""
        return (v // 4) * 128 + lane * 4 < E

    @T.prim_func
    def top2_sum_gate(X: T.Tensor((Tn, E), "float32"), Bias: T.Tensor((E,), "float32"),
                      Mask: T.Tensor((ML,), "uint8"), Fix: T.Tensor((FL,), "uint8"),
                      U: T.StridedTensor((UR, K), (US, 1), "int64"),
                      Map: T.Tensor((MR, MD), "int32"), Count: T.Tensor((MR,), "int32"),
                      Idx: T.Tensor((Tn, W), "int64"), Wgt: T.Tensor((Tn, W), "float32"),
                      rho: T.float32, ep_rank: T.int32, ranks_p: T.int32, tp_rank: T.int32, num_tp: T.int32):
        with T.Kernel(T.ceildiv(Tn, WARPS), threads=32 * WARPS) as bx:
            T.import_source(_CUDA)
            tx = T.get_thread_binding()
            lane = tx % 32
            t = bx * WARPS + tx // 32
            if has_map:
                # §2.2 step 9: every replica count >= 1, the vector spread over all threads of the grid
                # (one load each from 9 CTAs on: no thread waits on a serial walk of E_r + S counts)
                stride = T.cast(T.ceildiv(Tn, WARPS), "int64") * (32 * WARPS)
                gid = T.cast(bx, "int64") * (32 * WARPS) + tx
                low = T.alloc_var("int32")
                low = 0
                for i in T.serial(T.ceildiv(T.cast(MR, "int64") - gid, stride)):
                    low = T.bitwise_or(low, T.Cast("int32", Count[gid + i * stride] < 1))
                T.call_extern("void", "device_assert", low == 0)
            if t < Tn:  # warp-uniform
                active = T.alloc_var("int32")
                active = 1
                if has_mask:
                    active = T.cast(Mask[t] != T.uint8(0), "int32")
                if active == 0:  # masked token (§2.2 step 1)
                    if lane < W:
                        Idx[t, lane] = T.int64(-1)
                        Wgt[t, lane] = T.float32(0.0)
                    if has_unmapped:
                        if lane < K:
                            U[t, lane] = T.int64(-1)
                else:
                    x = T.alloc_local((V,), "float32")
                    r = T.alloc_local((V,), "float32")
                    for c in T.unroll(NC):
                        if owns(lane, c * 4):
                            for j in T.vectorized(4):
                                x[c * 4 + j] = X[t, c * 128 + lane * 4 + j]
                            for j in T.vectorized(4):
                                r[c * 4 + j] = Bias[c * 128 + lane * 4 + j]
                        else:
                            for j in T.unroll(4):
                                x[c * 4 + j] = T.float32(0.0)
                                r[c * 4 + j] = T.float32(0.0)
                    # §2.2 step 13: every logit of an unmasked token is finite (each is loaded by one lane)
                    bad = T.alloc_var("int32")
                    bad = 0
                    for v in T.unroll(V):
                        bad = T.bitwise_or(bad, nonfinite(x[v]))
                    T.call_extern("void", "device_assert", bad == 0)

                    # 1. scores; softmax's max and normaliser (uniform over the warp)
                    mx = T.alloc_var("float32")
                    den = T.alloc_var("float32")
                    mx = neg_inf
                    den = T.float32(0.0)
                    if scoring == "softmax":
                        for v in T.unroll(V):
                            if owns(lane, v):
                                mx = T.max(mx, x[v])
                        for o in T.unroll(5):
                            mx = T.max(mx, T.shfl_xor(mx, T.shift_right(16, o)))
                        for v in T.unroll(V):  # lane sum: chunk ascending, then j (§2.2 step 2)
                            if owns(lane, v):  # the reference adds stored exp values: no fused multiply-add
                                den = add_rn(den, expf(x[v] - mx))
                        for o in T.unroll(5):
                            den = den + T.shfl_xor(den, T.shift_right(16, o))
                        for v in T.unroll(V):  # ranking: raw logit + bias
                            r[v] = T.if_then_else(owns(lane, v), x[v] + r[v], neg_inf)
                    else:
                        for v in T.unroll(V):
                            r[v] = T.if_then_else(owns(lane, v), elementwise_score(x[v]) + r[v], neg_inf)

                    route = T.alloc_var("int64")  # lane k < K: logical expert of slot k
                    route = T.int64(0)
                    fixed = T.alloc_var("int32")
                    fixed = 0
                    if has_fix:
                        fixed = T.cast(Fix[t] != T.uint8(0), "int32")
                    if fixed != 0:  # §2.2 step 5: the given routes, in order
                        if lane < K:
                            route = U[t, lane]
                            # §2.2 step 5 / 13: fixed routes lie in [0, E_r)
                            T.call_extern("void", "device_assert", T.And(route >= T.int64(0), route < T.int64(E)))
                    else:
                        if grouped:
                            # 2. multiset top-2 of each group, its sum; lane g keeps gs_g
                            mine = T.alloc_var("float32")
                            mine = neg_inf
                            if segmented:
                                # a group is an aligned run of n / 4 lanes of one chunk: each lane's top-2 of
                                # its 4 slots, a butterfly inside the run, lane g fetches its group's sum
                                for c in T.unroll(NC):
                                    a1 = T.alloc_var("float32")
                                    a2 = T.alloc_var("float32")
                                    a1 = neg_inf
                                    a2 = neg_inf
                                    for j in T.unroll(4):
                                        a2 = T.max(a2, T.min(a1, r[c * 4 + j]))
                                        a1 = T.max(a1, r[c * 4 + j])
                                    for o in range(seg_steps):  # offsets n/8 .. 1: inside the run
                                        b1 = T.shfl_xor(a1, seg_lanes >> (o + 1))
                                        b2 = T.shfl_xor(a2, seg_lanes >> (o + 1))
                                        a2 = T.max(T.max(a2, b2), T.min(a1, b1))
                                        a1 = T.max(a1, b1)
                                    a1 = a1 + a2
                                    # group `lane` lies in chunk (lane n) / 128 from lane ((lane n) % 128) / 4
                                    a2 = T.shfl_sync(a1, T.truncmod(lane * per_group, 128) // 4)
                                    if T.And(lane < G, (lane * per_group) // 128 == c):
                                        mine = a2
                            else:
                                for g in T.unroll(G):
                                    a1 = T.alloc_var("float32")
                                    a2 = T.alloc_var("float32")
                                    a1 = neg_inf
                                    a2 = neg_inf
                                    for v in T.unroll(V):
                                        e = expert_of(lane, v)
                                        if T.And(e >= g * per_group, e < (g + 1) * per_group):
                                            a2 = T.max(a2, T.min(a1, r[v]))
                                            a1 = T.max(a1, r[v])
                                    for o in T.unroll(5):
                                        b1 = T.shfl_xor(a1, T.shift_right(16, o))
                                        b2 = T.shfl_xor(a2, T.shift_right(16, o))
                                        a2 = T.max(T.max(a2, b2), T.min(a1, b1))
                                        a1 = T.max(a1, b1)
                                    if lane == g:
                                        mine = a1 + a2
                            # rank of group `lane`: groups with a larger sum, or an equal one and a smaller index
                            rank = T.alloc_var("int32")
                            rank = 0
                            for g in T.unroll(G):
                                other = T.shfl_sync(mine, g)
                                if T.Or(other > mine, T.And(other == mine, g < lane)):
                                    rank = rank + 1
                            kept = T.alloc_var("uint32")
                            kept = T.cast(T.ballot_sync(T.And(lane < G, rank < TG)), "uint32")
                            for v in T.unroll(V):
                                grp = expert_of(lane, v) // per_group
                                if T.bitwise_and(T.shift_right(kept, T.cast(T.min(grp, 31), "uint32")),
                                                 T.uint32(1)) == T.uint32(0):
                                    r[v] = neg_inf

                        # 3. K rounds of warp arg-max; `live` bit v: slot v not chosen yet (and a real expert)
                        live = T.alloc_var("uint32")
                        live = T.uint32(0)
                        for v in T.unroll(V):
                            if owns(lane, v):
                                live = T.bitwise_or(live, T.shift_left(T.uint32(1), T.cast(v, "uint32")))
                        for k in T.unroll(K):
                            bv = T.alloc_var("float32")
                            bi = T.alloc_var("int32")
                            bv = neg_inf
                            bi = _SENTINEL
                            for v in T.unroll(V):  # ascending index: an equal later value never wins
                                alive = T.bitwise_and(T.shift_right(live, T.uint32(v)), T.uint32(1)) != T.uint32(0)
                                if T.And(alive, T.Or(r[v] > bv, bi == _SENTINEL)):
                                    bv = r[v]
                                    bi = expert_of(lane, v)
                            bi = T.call_extern("int32", "tf2_warp_best", bv, bi)
                            if lane == k:
                                route = T.cast(bi, "int64")
                            for v in T.unroll(V):
                                if expert_of(lane, v) == bi:
                                    live = T.bitwise_and(live, T.bitwise_not(T.shift_left(T.uint32(1), T.cast(v, "uint32"))))

                    # 4. weights from the unbiased scores of the routes (§2.2 step 6)
                    s = T.alloc_var("float32")
                    s = T.float32(0.0)
                    if lane < K:
                        xs = X[t, T.cast(T.max(T.min(route, T.int64(E - 1)), T.int64(0)), "int32")]
                        if scoring == "softmax":
                            s = expf(xs - mx) / den
                        else:
                            s = elementwise_score(xs)
                    total = T.alloc_var("float32")
                    total = T.float32(ref.EPS)
                    for k in T.unroll(K):
                        total = total + T.shfl_sync(s, k)
                    if lane < W:
                        logical = T.alloc_var("int32")
                        weight = T.alloc_var("float32")
                        if lane < K:
                            logical = T.cast(T.max(T.min(route, T.int64(2**30)), T.int64(-1)), "int32")
                            weight = (s / total) * rho
                        else:  # shared slot
                            logical = E + lane - K
                            weight = T.float32(1.0)
                        # 5. replica (§2.2 step 9), then EP/TP renumbering (§1.2, step 10)
                        v = T.alloc_var("int32")
                        v = logical
                        if has_map:
                            base = T.reinterpret(T.cast(ep_rank, "uint32")
                                                 + T.cast(t, "uint32") * T.uint32(ref.REPLICA_STRIDE), "int32")
                            row = T.max(T.min(logical, MR - 1), 0)
                            count = T.alloc_var("int32")
                            count = T.max(Count[row], 1)
                            d = T.floormod(base, count)
                            v = 0
                            if T.And(T.And(logical >= 0, logical < MR), d < MD):
                                v = Map[row, d]
                        out = T.alloc_var("int32")
                        out = -1
                        if v >= 0:  # every operand below is >= 0 (ranks_p >= 1, num_tp * ranks_p < 2^31)
                            if T.truncmod(T.truncdiv(v, ranks_p), num_tp) == tp_rank:
                                shifted = v - tp_rank * ranks_p
                                span = num_tp * ranks_p
                                out = shifted - T.truncdiv(shifted, span) * (span - ranks_p)
                        Idx[t, lane] = T.cast(out, "int64")
                        Wgt[t, lane] = weight
                    if has_unmapped:
                        if lane < K:
                            U[t, lane] = route

    return top2_sum_gate


# ----------------------------------------------------------------------------------------------------
# Static configs, launcher, torch.library op
# ----------------------------------------------------------------------------------------------------

def gate_config(logits, num_topk, num_topk_groups, num_groups, num_shared, scoring, mask, fix_routing_mask,
                unmapped_topk_idx, to_physical_map):
    """The static config of a call (``G == TG`` -> no group restriction: (0, 0))."""
    E = logits.size(1)
    G, TG = (num_groups, num_topk_groups) if num_groups != num_topk_groups else (0, 0)
    return (E, num_topk, G, TG, num_shared, scoring, mask is not None, fix_routing_mask is not None,
            unmapped_topk_idx is not None, to_physical_map is not None)


def supported(cfg: tuple) -> bool:
    """Configs the kernel covers; wider rows (E > 1024) run the reference. (Group-limited routing needs >= 2
    experts a group: the public op rejects one.)"""
    return cfg[0] <= MAX_EXPERTS


# (E, K, (G, TG), scorings) of the bench's rows (tilefuse.bench.moe): 256 experts in 8 groups, top-4 groups, each
# scoring; 72 and 384 without a group limit, sigmoid (GATE_EXPERTS at top-8); then V1_OFF
BENCH_GATES = ((256, 8, (8, 4), ("sigmoid", "sqrtsoftplus", "softmax")), (72, 8, (0, 0), ("sigmoid",)),
               (384, 8, (0, 0), ("sigmoid",)),
               (64, 6, (0, 0), ("softmax",)), (64, 8, (0, 0), ("softmax",)),
               (128, 6, (8, 4), ("softmax",)), (128, 8, (8, 4), ("softmax",)),
               (160, 6, (8, 4), ("sigmoid", "softmax")), (160, 8, (8, 4), ("sigmoid", "softmax")),
               (96, 6, (8, 4), ("sigmoid",)), (72, 8, (8, 4), ("sigmoid",)))


def _configs() -> list[tuple]:
    """The bench's configs (a bias, no shared expert, none of the optional inputs); the GPU tests' own are listed
    in tests/moe/configs.py and compile on first use."""
    return [(e, k, g, tg, 0, sc, False, False, False, False) for e, k, (g, tg), scorings in BENCH_GATES
            for sc in scorings]


_jit.register("top2_sum_gate", top2_sum_gate_kernel, _configs)

def _unit_inner(u: torch.Tensor) -> torch.Tensor:
    """``unmapped_topk_idx`` with a unit last stride, as the kernel's binding requires: the op accepts any
    last stride when K == 1 (a view of the same elements, so in-place writes still land in the caller's)."""
    if u.stride(1) == 1:
        return u
    return u.as_strided(u.shape, (u.stride(0), 1))


def _wrap_int32(v: int) -> int:
    return (v + 2**31) % 2**32 - 2**31


def top2_sum_gate_launch(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed,
                         num_shared_experts, routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks,
                         scoring_func, mask=None, fix_routing_mask=None, to_physical_map=None, logical_count=None,
                         unmapped_topk_idx=None):
    """Allocate, launch, return ``(topk_idx, topk_weights)``; writes ``unmapped_topk_idx`` in place."""
    scoring = ref.scoring_name(scoring_func)
    rows, E = logits.shape
    S = num_shared_experts if use_shared_as_routed else 0
    W = num_topk + S
    device = logits.device
    num_extra = 0 if to_physical_map is None else to_physical_map.size(1) - 1
    ranks_p = (E + num_extra) // num_ep_ranks
    cfg = gate_config(logits, num_topk, num_topk_groups, num_groups, S, scoring, mask, fix_routing_mask,
                      unmapped_topk_idx, to_physical_map)
    if not supported(cfg) or num_tp_ranks * ranks_p >= 2**31:
        # the kernel checks the data rules itself (device_assert); the reference does not
        checks.check_top2_sum_gate_data(logits, mask, fix_routing_mask, unmapped_topk_idx, logical_count)
        return ref.top2_sum_gate(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed,
                                 num_shared_experts, routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank,
                                 num_tp_ranks, scoring_func, mask, fix_routing_mask, to_physical_map,
                                 logical_count, unmapped_topk_idx)
    idx = torch.empty((rows, W), dtype=torch.int64, device=device)
    weights = torch.empty((rows, W), dtype=torch.float32, device=device)
    if rows == 0:
        return idx, weights
    u8 = torch.uint8
    m = placeholder(device, u8, (1,)) if mask is None else mask.reshape(rows).contiguous().view(u8)  # any shape
    f = placeholder(device, u8, (1,)) if fix_routing_mask is None else fix_routing_mask.view(u8)
    u = placeholder(device, torch.int64, (1, num_topk)) if unmapped_topk_idx is None else _unit_inner(unmapped_topk_idx)
    logits, bias = aligned(logits), aligned(bias)  # the kernel's 16-byte loads
    pm = placeholder(device, torch.int32, (1, 1)) if to_physical_map is None else to_physical_map
    pc = placeholder(device, torch.int32, (1,)) if logical_count is None else logical_count
    _jit.get("top2_sum_gate", cfg)(logits, bias, m, f, u, pm, pc, idx, weights, float(routed_scaling_factor),
                                   _wrap_int32(int(ep_rank)), int(ranks_p), int(tp_rank), int(num_tp_ranks))
    return idx, weights


@_ops.kernel_op("tilefuse::top2_sum_gate", mutates_args=("unmapped_topk_idx",), device_types="cuda")
def _top2_sum_gate_op(logits: torch.Tensor, bias: torch.Tensor, num_topk: int, num_topk_groups: int, num_groups: int,
                      use_shared_as_routed: bool, num_shared_experts: int, routed_scaling_factor: float,
                      ep_rank: int, num_ep_ranks: int, tp_rank: int, num_tp_ranks: int, scoring_func: str,
                      mask: torch.Tensor | None, fix_routing_mask: torch.Tensor | None,
                      to_physical_map: torch.Tensor | None, logical_count: torch.Tensor | None,
                      unmapped_topk_idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return top2_sum_gate_launch(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed,
                                num_shared_experts, routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank,
                                num_tp_ranks, scoring_func, mask, fix_routing_mask, to_physical_map, logical_count,
                                unmapped_topk_idx)


@_top2_sum_gate_op.register_fake
def _(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
      routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask, fix_routing_mask,
      to_physical_map, logical_count, unmapped_topk_idx):
    width = num_topk + (num_shared_experts if use_shared_as_routed else 0)
    rows = logits.size(0)
    return (logits.new_empty((rows, width), dtype=torch.int64), logits.new_empty((rows, width), dtype=torch.float32))


def top2_sum_gate_cuda(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
                       routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask=None,
                       fix_routing_mask=None, to_physical_map=None, logical_count=None, unmapped_topk_idx=None):
    """CUDA entry for the public ``top2_sum_gate`` (arguments validated there); same arguments and results
    as ``tilefuse.reference.moe.top2_sum_gate``."""
    args = (logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
            routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask,
            fix_routing_mask, to_physical_map, logical_count, unmapped_topk_idx)
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.top2_sum_gate(*args[:12], ref.scoring_name(scoring_func), *args[13:])
    return top2_sum_gate_launch(*args)
