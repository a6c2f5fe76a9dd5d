"""TileLang kernels of the v2.1 gate: ``moe_topk_gate_forward`` (moe.md §2.13) and ``moe_topk_gate_backward``
(§2.14).

One warp per token, 4 tokens per 128-thread CTA, the token count symbolic. Lane ``l`` holds the experts
``c * 128 + 4 l + j`` (chunk ``c``, ``j < 4``: one 16-byte load per chunk), so a row of up to 384 experts
lives in at most 12 registers per lane and every per-token reduction is a warp shuffle.

Forward, per token (warp-uniform branches): masked -> -1 / 0 rows; force-random -> the cuRAND Philox4x32-10
draw of §2.13 step 2 (the counter-based generator evaluated in-kernel) and its minimum-lane de-duplication;
otherwise sqrt-softplus scores ``sqrtf(x > 20 ? x : log1pf(expf(x)))`` (PyTorch's ``F.softplus(x).sqrt()``
on CUDA, IEEE operations), the ranking ``u + bias`` (image bias per token), top-k by K rounds of a warp
arg-max over 64-bit keys (ordered float bits, then the smaller index: a stable descending sort; two
``redux.sync`` reductions, the high word then the low), or the
caller's fixed routes; weights ``u / (butterfly32(u) + 1e-20) * rho`` with the reference's XOR-butterfly
order; S shared slots of weight 1; replica choice ``map[l, (ep_rank + 23333 t) mod count[l]]`` with the
int32 wrap of the reference. Every floating-point step is an explicit round-to-nearest intrinsic, so
nvcc's FMA contraction cannot change a result: bit-identical to ``tilefuse.reference.moe``.

Data rules (moe.md §2.13 step 11, §2.14) are device assertions on values the kernels load anyway: finite
logits of every routed token (neither masked nor random), fixed routes in [0, E_r), topk_idx of the
backward in [-1, E_r) (on the int64 value); one warp of CTA 0 checks ``logical_count >= 1`` (which implies
random routing's ``sum(logical_count) >= K + S``, as K <= E_r). Rows wider than ``_MAX_EXPERTS`` run the reference instead (the
launcher asserts the same rules with ``torch._assert_async``). Launchers pass 16-byte aligned row tensors
(an odd storage offset goes through a copy).

Backward, per token: fp64 throughout (the reference's precision) but for the sqrt-softplus derivative, which is
fp32 (``tfg_ssp_grad32``, within 2^-22 relative of the exact one: an fp64 expm1 and division for every expert would
be most of the arithmetic with the auxiliary term on), widened exactly and multiplied in fp64, one rounding to fp32
at the end, in the kernel's own fixed order (``tests/moe/models.py`` reproduces it bit for bit with element-wise
torch ops): the K-slot sums ``sum g_k w_k`` and ``sum u_k`` are XOR butterflies over the 32 lanes (slot k on lane k,
lanes >= K hold +0); duplicated slots accumulate onto their expert in slot order from +0 (on each slot's lane; the
expert's lowest slot writes the result after the row's stores); the auxiliary term's ``sum_e u_e`` and
``sum_e h_e u_e`` add each lane's experts ``c * 128 + 4 l + j`` (c, then j) from +0, then the butterfly. The order
depends on nothing but (E_r, K): deterministic and batch-invariant. The derivative of the last step is finite and
>= +0, so an expert whose gradient is +-0 keeps it; without the auxiliary term only the slots' experts have
another, and their derivative is taken once, on the slot's lane. The reference (fp64 torch ops: ``sum``,
``scatter_add_``) rounds in torch's internal order instead, which is no contract (moe.md §2.14 calls upstream's
backward a numerical recipe); both fp64 sums carry errors ~1e-16 relative to the row's magnitudes, so the fp32
outputs agree to one fp32 ulp plus that plus the fp32 derivative's 2^-22 (the tests derive the bound per element).
"""

import torch

from tilefuse import _jit, _native, _ops, formats
from tilefuse._launch import aligned, placeholder
from tilefuse.moe import _checks as checks
from tilefuse.reference import moe as ref

_WARPS = 4                       # tokens per CTA (one warp each)
_MAX_EXPERTS = 1024             # wider rows (registers: E / 32 per lane) run the reference (no host sync)
BWD_MIN_BLOCKS = 8               # backward, rows <= 256: __launch_bounds__(128, n), 512 / n registers (0: none)
_FLAGS = ("bias", "fix", "image", "map", "mask", "random", "scores", "unmapped")   # forward's optional inputs

_HELPERS = r"""
#define TFG_FULL 0xffffffffu
__device__ __forceinline__ float tfg_ssp(float x) {            // sqrt(softplus(x)), threshold 20, IEEE
  float s = x > 20.0f ? x : log1pf(expf(x));
  return __fsqrt_rn(s);
}
__device__ __forceinline__ long long tfg_key(float r, int e) {  // larger key: larger r, then smaller e
  int b = __float_as_int(r);
  b = b >= 0 ? b : (b ^ 0x7fffffff);
  return (long long)b * 4294967296ll + (long long)(0xffff - e);
}
__device__ __forceinline__ int tfg_key_index(long long k) { return 0xffff - (int)(k & 0xffff); }
__device__ __forceinline__ long long tfg_warp_max64(long long v) {   // two redux.sync: high word, then low
  const int hi = (int)(v >> 32), top = __reduce_max_sync(TFG_FULL, hi);
  const unsigned lo = __reduce_max_sync(TFG_FULL, hi == top ? (unsigned)v : 0u);
  return (long long)(((unsigned long long)(unsigned)top << 32) | lo);
}
__device__ __forceinline__ long long tfg_warp_sum64(long long v) {   // integer: any order
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(TFG_FULL, v, o);
  return v;
}
__device__ __forceinline__ float tfg_butterfly32(float v) {     // lane l adds lane l ^ o, o = 16 .. 1
  for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(TFG_FULL, v, o));
  return v;
}
__device__ __forceinline__ int tfg_nonfinite(float x) {     // 1 for nan / inf
  return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}
__device__ __forceinline__ float tfg_shfl_f32(float v, int src) { return __shfl_sync(TFG_FULL, v, src); }
__device__ __forceinline__ int tfg_shfl_i32(int v, int src) { return __shfl_sync(TFG_FULL, v, src); }
__device__ __forceinline__ double tfg_shfl_f64(double v, int src) { return __shfl_sync(TFG_FULL, v, src); }
__device__ __forceinline__ double tfg_butterfly32_f64(double v) {   // lane l adds lane l ^ o, o = 16 .. 1
  for (int o = 16; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(TFG_FULL, v, o));
  return v;
}
__device__ __forceinline__ long long tfg_none() { return (long long)(1ull << 63); }   // below every key
__device__ __forceinline__ int tfg_replica(int seed_lo, int t, int count) {   // floor mod of the int32 wrap
  int base = (int)((unsigned)seed_lo + (unsigned)t * REPLICA_STRIDEu);
  int c = count > 0 ? count : 1;
  int d = base % c;
  return d < 0 ? d + c : d;
}
// Philox4x32-10 (Salmon et al. 2011) of counter (0, 0, c2, c3) and key (k0, k1): words 0 and 1 of the block.
__device__ __forceinline__ unsigned long long tfg_philox01(unsigned c2, unsigned c3, unsigned k0, unsigned k1) {
  unsigned c0 = 0u, c1 = 0u;
  #pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
    unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    unsigned n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
  }
  return ((unsigned long long)c1 << 32) | c0;
}
// Random route of lane `lane` of token t (moe.md §2.13 step 2): (float bits of the uniform << 32) | physical id
// for lanes < width (every lane of the warp must call it).
__device__ __forceinline__ unsigned long long tfg_random(int t, int lane, int width, long long nphys,
                                                       int seed_lo, int seed_hi) {
  unsigned long long sub = (unsigned long long)t * 32ull + (unsigned long long)lane;
  unsigned long long xy = tfg_philox01((unsigned)sub, (unsigned)(sub >> 32), (unsigned)seed_lo, (unsigned)seed_hi);
  unsigned x = (unsigned)xy, y = (unsigned)(xy >> 32);
  float u = __fadd_rn(__fmul_rn(__uint2float_rn(x), 2.3283064365386963e-10f), 1.1641532182693481e-10f);
  long long div = nphys - lane;
  long long c = lane < width ? (long long)((unsigned long long)y % (unsigned long long)(div > 0 ? div : 1))
                             : 0x7fffffffll;
  bool resolved = false;
  long long idx = -1;
  for (int r = 0; r < width; ++r) {
    long long m = c;
    for (int o = 16; o > 0; o >>= 1) { long long w = __shfl_xor_sync(TFG_FULL, m, o); m = w < m ? w : m; }
    int first = __ffs(__ballot_sync(TFG_FULL, c == m)) - 1;
    if (lane < width && !resolved && c >= m && lane > first) c += 1;
    if (lane == first) { idx = m; resolved = true; c = 0x7fffffffll; }
  }
  return ((unsigned long long)__float_as_uint(u) << 32) | (unsigned)idx;
}
__device__ __forceinline__ int tfg_lo32(unsigned long long v) { return (int)(unsigned)v; }
__device__ __forceinline__ float tfg_hi_f32(unsigned long long v) { return __uint_as_float((unsigned)(v >> 32)); }
// sqrt-softplus derivative through u in fp32: -expm1f(-u^2) / (2u); u / 2 below 2^-60 (u^2 would be subnormal,
// and expm1 is the identity there to 2^-120 relative); 0 at u <= 0 and for NaN (the reference's rule).
__device__ __forceinline__ float tfg_ssp_grad32(float u) {
  if (!(u > 0.0f)) return 0.0f;
  if (u < 8.673617379884035e-19f) return __fmul_rn(u, 0.5f);
  return __fdiv_rn(-expm1f(-__fmul_rn(u, u)), __fmul_rn(2.0f, u));
}
// The same value with IEEE division's fast path inline (the reciprocal, one Newton step and one
// remainder correction: the instructions nvcc emits for __fdiv_rn ahead of its range check) and no branch, for
// 2^-40 <= u <= 2^40, where every intermediate is a normal number and __fdiv_rn takes that path too;
// tfg_ssp_fast_ok(u) says where it holds (also for u <= 0 and NaN, whose derivative is 0 either way).
__device__ __forceinline__ float tfg_ssp_grad32_fast(float u) {
  const float d = __fmul_rn(2.0f, u), n = -expm1f(-__fmul_rn(u, u));
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  r = __fmaf_rn(r, __fmaf_rn(-d, r, 1.0f), r);
  const float q = __fmaf_rn(n, r, 0.0f);
  return u > 0.0f ? __fmaf_rn(r, __fmaf_rn(-d, q, n), q) : 0.0f;
}
__device__ __forceinline__ int tfg_ssp_fast_ok(float u) {
  return !(u > 0.0f) || (u >= 9.094947017729282e-13f && u <= 1099511627776.0f);
}
""".replace("REPLICA_STRIDE", str(ref.REPLICA_STRIDE))   # the reference's constant, written once


# ----------------------------------------------------------------------------------------------------
# Forward (§2.13)
# ----------------------------------------------------------------------------------------------------

def gate_forward_kernel(num_experts: int, num_topk: int, num_shared: int, flags: str):
    """Factory: the forward for ``E_r = num_experts`` (``% 4 == 0``, at most ``_MAX_EXPERTS``), ``K = num_topk``,
    ``S = num_shared``; ``flags`` is a comma-separated subset of ``_FLAGS`` (the optional tensors present).
    Absent tensors are bound to 1-element dummies that the code never reads."""
    import tilelang.language as T

    E, K, S = num_experts, num_topk, num_shared
    W = K + S
    fl = set(filter(None, flags.split(",")))
    assert fl <= set(_FLAGS) and E % 4 == 0 and E <= _MAX_EXPERTS and 1 <= K <= min(E, 32) and W <= 32
    NC = formats.cdiv(E, 128)
    NV = NC * 4
    ragged = E % 128 != 0                                 # the last chunk does not cover every lane
    NL = E + S                                            # rows of the physical map / count
    # the token count and the lengths of the optional tensors (1-element dummies when absent)
    (Tn, bias_len, image_bias_len, image_mask_len, mask_len, fix_len, random_len, map_rows, map_cols, count_len,
     unmapped_rows, unmapped_stride, scores_rows) = T.dynamic(
        "num_tokens, bias_len, image_bias_len, image_mask_len, mask_len, fix_len, random_len, map_rows, map_cols, "
        "count_len, unmapped_rows, unmapped_stride, scores_rows")
    idx_s0, idx_s1, w_s0, w_s1 = T.dynamic("idx_s0, idx_s1, w_s0, w_s1")   # the outputs' strides (any out=)

    @T.macro
    def clear_extras(Unm, Sc, t, lane):
        """A masked or random token's unmapped row (-1) and scores row (0), where the call gives them."""
        if "unmapped" in fl:
            if lane < K:
                Unm[t, lane] = T.int64(-1)
        if "scores" in fl:
            for c in T.unroll(NC):
                if (not ragged) or c * 128 + lane * 4 < E:
                    for j in T.vectorized(4):
                        Sc[t, c * 128 + lane * 4 + j] = T.float32(0.0)

    @T.prim_func
    def gate_forward(L: T.Tensor((Tn, E), "float32"), Bias: T.Tensor((bias_len,), "float32"),
                     ImgBias: T.Tensor((image_bias_len,), "float32"), ImgMask: T.Tensor((image_mask_len,), "uint8"),
                     Mask: T.Tensor((mask_len,), "uint8"), Fix: T.Tensor((fix_len,), "uint8"),
                     Rand: T.Tensor((random_len,), "uint8"),
                     Map: T.Tensor((map_rows, map_cols), "int32"), Count: T.Tensor((count_len,), "int32"),
                     Unm: T.StridedTensor((unmapped_rows, K), (unmapped_stride, 1), "int64"),
                     Idx: T.StridedTensor((Tn, W), (idx_s0, idx_s1), "int64"),
                     Wt: T.StridedTensor((Tn, W), (w_s0, w_s1), "float32"),
                     Sc: T.Tensor((scores_rows, E), "float32"),
                     rho: T.float32, seed_lo: T.int32, seed_hi: T.int32):
        with T.Kernel(T.ceildiv(Tn, _WARPS), threads=_WARPS * 32) as bx:
            T.import_source(_HELPERS)
            tx = T.get_thread_binding()
            lane = tx % 32
            t = bx * _WARPS + tx // 32
            u = T.alloc_local((NV,), "float32")
            keys = T.alloc_local((NV,), "int64")
            best = T.alloc_var("int64")
            lbest = T.alloc_var("int64")
            sel = T.alloc_var("int32")
            usel = T.alloc_var("float32")
            rnd = T.alloc_var("uint64")
            nphys = T.alloc_var("int64")
            phys = T.alloc_var("int64")
            logical = T.alloc_var("int32")
            weight = T.alloc_var("float32")
            den = T.alloc_var("float32")
            live = T.alloc_var("int32")
            rand = T.alloc_var("int32")
            fixed = T.alloc_var("int32")
            image = T.alloc_var("int32")
            bad = T.alloc_var("int32")
            fixed_idx = T.alloc_var("int64")
            if "map" in fl:
                # moe.md §2.13 step 9: every replica count >= 1 (one warp of CTA 0 checks the (E_r + S,)
                # vector); random routing's sum(count) >= K + S follows, as E_r + S >= K + S
                if T.And(bx == 0, tx < 32):
                    bad = 0
                    for i in T.unroll(-(-NL // 32)):
                        if lane + i * 32 < NL:
                            bad = bad | T.Cast("int32", Count[lane + i * 32] < 1)
                    T.call_extern("void", "device_assert", bad == 0)
            if t < Tn:
                live = 1
                rand = 0
                if "mask" in fl:
                    live = T.Cast("int32", Mask[t] != 0)
                if "random" in fl:
                    rand = T.Cast("int32", Rand[t] != 0)
                if live == 0:
                    # masked (§2.13 step 1): -1 / 0, unmapped -1, scores 0
                    if lane < W:
                        Idx[t, lane] = T.int64(-1)
                        Wt[t, lane] = T.float32(0.0)
                    clear_extras(Unm, Sc, t, lane)
                elif rand != 0:
                    # random routing (§2.13 step 2): distinct physical ids, raw uniform weights
                    nphys = T.int64(NL)
                    if "map" in fl:
                        nphys = T.int64(0)
                        for i in T.unroll(-(-NL // 32)):
                            if lane + i * 32 < NL:
                                nphys = nphys + T.Cast("int64", Count[lane + i * 32])
                        nphys = T.call_extern("int64", "tfg_warp_sum64", nphys)
                    rnd = T.call_extern("uint64", "tfg_random", t, lane, W, nphys, seed_lo, seed_hi)
                    if lane < W:
                        Idx[t, lane] = T.Cast("int64", T.call_extern("int32", "tfg_lo32", rnd))
                        Wt[t, lane] = T.call_extern("float32", "tfg_hi_f32", rnd)
                    clear_extras(Unm, Sc, t, lane)
                else:
                    # scores (§2.13 step 3), written unbiased; the logits of a routed token must be finite
                    bad = 0
                    for c in T.unroll(NC):
                        for j in T.unroll(4):
                            u[c * 4 + j] = T.float32(0.0)
                        if (not ragged) or c * 128 + lane * 4 < E:
                            for j in T.vectorized(4):
                                u[c * 4 + j] = L[t, c * 128 + lane * 4 + j]
                            for j in T.unroll(4):
                                bad = bad | T.call_extern("int32", "tfg_nonfinite", u[c * 4 + j])
                                u[c * 4 + j] = T.call_extern("float32", "tfg_ssp", u[c * 4 + j])
                            if "scores" in fl:
                                for j in T.vectorized(4):
                                    Sc[t, c * 128 + lane * 4 + j] = u[c * 4 + j]
                    T.call_extern("void", "device_assert", bad == 0)
                    fixed = 0
                    if "fix" in fl:
                        fixed = T.Cast("int32", Fix[t] != 0)
                    sel = 0
                    if fixed != 0:
                        # fixed routes (§2.13 step 5): the caller's indices, in order
                        if lane < K:
                            fixed_idx = Unm[t, lane]
                            T.call_extern("void", "device_assert",
                                          T.And(fixed_idx >= T.int64(0), fixed_idx < T.int64(E)))
                            sel = T.Cast("int32", T.max(T.min(fixed_idx, T.int64(E - 1)), T.int64(0)))
                    else:
                        # ranking keys u + b (§2.13 step 4); unused register slots never win
                        image = 0
                        if "image" in fl:
                            image = T.Cast("int32", ImgMask[t] != 0)
                        for c in T.unroll(NC):
                            for j in T.unroll(4):
                                e = c * 128 + lane * 4 + j
                                keys[c * 4 + j] = T.call_extern("int64", "tfg_none")
                                if (not ragged) or c * 128 + lane * 4 < E:
                                    if "image" in fl and "bias" in fl:
                                        keys[c * 4 + j] = T.call_extern(
                                            "int64", "tfg_key",
                                            T.call_extern("float32", "__fadd_rn", u[c * 4 + j],
                                                          T.if_then_else(image != 0, ImgBias[e], Bias[e])), e)
                                    elif "image" in fl:
                                        keys[c * 4 + j] = T.call_extern(
                                            "int64", "tfg_key",
                                            T.call_extern("float32", "__fadd_rn", u[c * 4 + j],
                                                          T.if_then_else(image != 0, ImgBias[e], T.float32(0.0))),
                                            e)
                                    elif "bias" in fl:
                                        keys[c * 4 + j] = T.call_extern(
                                            "int64", "tfg_key",
                                            T.call_extern("float32", "__fadd_rn", u[c * 4 + j], Bias[e]), e)
                                    else:
                                        keys[c * 4 + j] = T.call_extern("int64", "tfg_key", u[c * 4 + j], e)
                        # top-k (§2.13 step 5): K rounds of a warp arg-max over the lanes' best keys; lane k
                        # keeps the k-th winner; only the winner's lane (keys are unique) rescans its keys
                        lbest = T.call_extern("int64", "tfg_none")
                        for i in T.unroll(NV):
                            lbest = T.max(lbest, keys[i])
                        for k in T.serial(K):
                            best = T.call_extern("int64", "tfg_warp_max64", lbest)
                            if lane == k:
                                sel = T.call_extern("int32", "tfg_key_index", best)
                            if lbest == best:
                                lbest = T.call_extern("int64", "tfg_none")
                                for i in T.unroll(NV):
                                    if keys[i] == best:
                                        keys[i] = T.call_extern("int64", "tfg_none")
                                    lbest = T.max(lbest, keys[i])
                    # u of each lane's expert: one shuffle per register slot from the owning lane
                    usel = T.float32(0.0)
                    for i in T.unroll(NV):
                        got = T.call_extern("float32", "tfg_shfl_f32", u[i], (sel % 128) // 4)
                        if (sel // 128) * 4 + sel % 4 == i:
                            usel = got
                    if lane >= K:
                        usel = T.float32(0.0)
                    # weights (§2.13 step 6): butterfly sum, + 1e-20, u / den * rho; shared slots weight 1
                    den = T.call_extern("float32", "__fadd_rn", T.call_extern("float32", "tfg_butterfly32", usel),
                                        T.float32(ref.EPS))
                    weight = T.call_extern("float32", "__fmul_rn",
                                           T.call_extern("float32", "__fdiv_rn", usel, den), rho)
                    logical = sel
                    if lane >= K:
                        logical = E + lane - K
                        weight = T.float32(1.0)
                    if "unmapped" in fl:
                        if lane < K:
                            Unm[t, lane] = T.Cast("int64", sel)
                    if lane < W:
                        phys = T.Cast("int64", logical)
                        if "map" in fl:
                            # replica choice (§2.13 step 9); a column past the map gives 0
                            sel = T.call_extern("int32", "tfg_replica", seed_lo, t,
                                                Count[T.min(T.max(logical, 0), NL - 1)])
                            phys = T.int64(0)
                            if T.And(T.And(logical >= 0, logical < NL), sel < map_cols):
                                phys = T.Cast("int64", Map[logical, sel])
                        Idx[t, lane] = phys
                        Wt[t, lane] = weight

    return gate_forward


# Static configs: those the bench launches (``precompile``); any other (the tests' own, tests/moe/configs.py)
# compiles on first use.
BENCH_ISSUE_GATES = tuple((e, 8) for e in (256, 72, 384))  # (E_r, K): tilefuse.bench.moe.GATE_EXPERTS at top-8
BENCH_OFF_GATES = tuple((e, k) for e in (64, 128, 160) for k in (6, 8))  # tilefuse.bench.moe.OFF_GATES


def _forward_configs() -> list[tuple]:
    """(E_r, K, S, flags) of the bench's forward launches: every gate with a bias, with and without the scores
    output (the training call, and the inputs of the backward rows)."""
    return [(e, k, 0, flags) for e, k in BENCH_ISSUE_GATES + BENCH_OFF_GATES for flags in ("bias", "bias,scores")]


_jit.register("moe_topk_gate_forward", gate_forward_kernel, _forward_configs)


# ----------------------------------------------------------------------------------------------------
# Backward (§2.14)
# ----------------------------------------------------------------------------------------------------

def gate_backward_kernel(num_experts: int, num_topk: int, aux: bool):
    """Factory: the backward for ``E_r = num_experts`` (at most ``_MAX_EXPERTS``; any multiple of 4 uses 16-byte
    row accesses), ``K = num_topk`` (1 .. 32; the launcher maps K = 0 to one -1 slot) and, with
    ``aux``, the auxiliary term (``mask`` and ``grad_scores_sum`` given). The order of every sum is the one
    of the module docstring (``tests/moe/models.py`` reproduces it)."""
    import tilelang.language as T

    E, K = num_experts, num_topk
    assert 1 <= K <= min(E, 32) and E <= _MAX_EXPERTS
    NC = formats.cdiv(E, 128)
    NV = NC * 4
    ragged = E % 128 != 0
    vec = E % 4 == 0                                      # 16-byte row accesses; else element by element
    min_blocks = BWD_MIN_BLOCKS if NC <= 2 else 0       # wider rows would spill under the cap
    Tn, mask_len, seq_rows = T.dynamic("num_tokens, mask_len, seq_rows")   # seq_rows: grad_scores_sum's rows

    def f64(name, *args):
        return T.call_extern("float64", name, *args)

    def phi(u):   # the fp32 derivative of an fp32 score, widened exactly
        return T.Cast("float64", T.call_extern("float32", "tfg_ssp_grad32", u))

    def aux_term(h, ai, inv):   # (h_e - Ah inv) inv, with ai = Ah inv
        return f64("__dmul_rn", f64("__dsub_rn", T.Cast("float64", h), ai), inv)

    @T.macro
    def load_chunk(dst, src, raw, r, c, lane):
        """Chunk c of row r of src into dst[4c .. 4c + 3] (this lane's experts c * 128 + 4 lane + j; dst keeps
        its +0 past E)."""
        if vec:
            if (not ragged) or c * 128 + lane * 4 < E:
                for j in T.vectorized(4):
                    raw[j] = src[r, c * 128 + lane * 4 + j]
                for j in T.unroll(4):
                    dst[c * 4 + j] = raw[j]
        else:
            for j in T.unroll(4):
                if c * 128 + lane * 4 + j < E:
                    dst[c * 4 + j] = src[r, c * 128 + lane * 4 + j]

    @T.macro
    def store_chunk(dst, raw, r, c, lane):
        """raw[0 .. 3] into chunk c of row r of dst (the experts that exist)."""
        if vec:
            if (not ragged) or c * 128 + lane * 4 < E:
                for j in T.vectorized(4):
                    dst[r, c * 128 + lane * 4 + j] = raw[j]
        else:
            for j in T.unroll(4):
                if c * 128 + lane * 4 + j < E:
                    dst[r, c * 128 + lane * 4 + j] = raw[j]

    @T.prim_func
    def gate_backward(Sc: T.Tensor((Tn, E), "float32"), TopIdx: T.Tensor((Tn, K), "int64"),
                      Wt: T.Tensor((Tn, K), "float32"), G: T.Tensor((Tn, K), "float32"),
                      Mask: T.Tensor((mask_len,), "uint8"), H: T.Tensor((seq_rows, E), "float32"),
                      Out: T.Tensor((Tn, E), "float32"), rho: T.float64, rows_per_seq: T.int32):
        with T.Kernel(T.ceildiv(Tn, _WARPS), threads=_WARPS * 32) as bx:
            if min_blocks:
                T.annotate_min_blocks_per_sm(min_blocks)
            T.import_source(_HELPERS)
            tx = T.get_thread_binding()
            lane = tx % 32
            t = bx * _WARPS + tx // 32
            u = T.alloc_local((NV,), "float32")
            hv = T.alloc_local((NV,), "float32")
            ph = T.alloc_local((NV,), "float32")
            raw = T.alloc_local((4,), "float32")
            fast_ok = T.alloc_var("int32")
            idx64 = T.alloc_var("int64")
            idx = T.alloc_var("int32")
            uk = T.alloc_var("float64")
            gk = T.alloc_var("float64")
            a = T.alloc_var("float64")
            dot = T.alloc_var("float64")
            usum = T.alloc_var("float64")
            per_slot = T.alloc_var("float64")
            total = T.alloc_var("float64")
            first = T.alloc_var("int32")
            idk = T.alloc_var("int32")
            su = T.alloc_var("float64")
            ah = T.alloc_var("float64")
            inv = T.alloc_var("float64")
            ai = T.alloc_var("float64")
            seq = T.alloc_var("int32")
            if t < Tn:
                # slot k on lane k: u_k, g_k (both 0 for a -1 slot), g_k * w_k; lanes >= K hold +0
                idx = -1
                uk = T.float64(0.0)
                gk = T.float64(0.0)
                a = T.float64(0.0)
                if lane < K:
                    idx64 = TopIdx[t, lane]
                    # moe.md §2.14: topk_idx is -1 or a routed expert (checked on the int64 value)
                    T.call_extern("void", "device_assert", T.And(idx64 >= T.int64(-1), idx64 < T.int64(E)))
                    idx = T.Cast("int32", T.max(T.min(idx64, T.int64(E - 1)), T.int64(-1)))
                    if idx >= 0:
                        uk = T.Cast("float64", Sc[t, idx])
                        gk = T.Cast("float64", G[t, lane])
                    a = f64("__dmul_rn", gk, T.Cast("float64", Wt[t, lane]))
                dot = f64("tfg_butterfly32_f64", a)
                usum = f64("tfg_butterfly32_f64", uk)
                per_slot = T.float64(0.0)
                if idx >= 0:
                    per_slot = f64("__ddiv_rn", f64("__dsub_rn", f64("__dmul_rn", rho, gk), dot),
                                   f64("__dadd_rn", usum, T.float64(ref.EPS)))
                # routing term of this lane's expert: its slots' terms in slot order from +0 (duplicates
                # accumulate); the expert's lowest slot writes its result
                total = T.float64(0.0)
                first = 1
                for k in T.serial(K):
                    idk = T.call_extern("int32", "tfg_shfl_i32", idx, k)
                    a = T.call_extern("float64", "tfg_shfl_f64", per_slot, k)
                    if idk == idx:
                        total = f64("__dadd_rn", total, a)
                        if k < lane:
                            first = 0
                if aux:
                    # auxiliary term (h_e - Ah inv) inv, inv = mask ? 1 / Su : 0; Su = sum u, Ah = sum h u:
                    # each lane sums its register slots in order from +0, then the XOR butterfly. Every expert
                    # is written with a zero routing term here; the slots' experts again below
                    seq = t // T.max(rows_per_seq, 1)
                    su = T.float64(0.0)
                    ah = T.float64(0.0)
                    for c in T.unroll(NC):
                        for j in T.unroll(4):
                            u[c * 4 + j] = T.float32(0.0)
                            hv[c * 4 + j] = T.float32(0.0)
                        load_chunk(u, Sc, raw, t, c, lane)
                        load_chunk(hv, H, raw, seq, c, lane)
                        for j in T.unroll(4):
                            su = f64("__dadd_rn", su, T.Cast("float64", u[c * 4 + j]))
                            ah = f64("__dadd_rn", ah, f64("__dmul_rn", T.Cast("float64", hv[c * 4 + j]),
                                                          T.Cast("float64", u[c * 4 + j])))
                    su = f64("tfg_butterfly32_f64", su)
                    ah = f64("tfg_butterfly32_f64", ah)
                    inv = T.float64(0.0)
                    if Mask[t] != 0:
                        inv = f64("__ddiv_rn", T.float64(1.0), su)
                    ai = f64("__dmul_rn", ah, inv)
                    # the row's derivatives by the inline fast path, or all by tfg_ssp_grad32 where a score of
                    # the lane lies outside its range (one branch a lane, not one an element)
                    fast_ok = 1
                    for i in T.unroll(NV):
                        ph[i] = T.call_extern("float32", "tfg_ssp_grad32_fast", u[i])
                        fast_ok = fast_ok & T.call_extern("int32", "tfg_ssp_fast_ok", u[i])
                    if fast_ok == 0:
                        for i in T.unroll(NV):
                            ph[i] = T.call_extern("float32", "tfg_ssp_grad32", u[i])
                    for c in T.unroll(NC):
                        for j in T.unroll(4):
                            raw[j] = T.call_extern("float32", "__double2float_rn", f64(
                                "__dmul_rn", T.Cast("float64", ph[c * 4 + j]),
                                f64("__dadd_rn", T.float64(0.0), aux_term(hv[c * 4 + j], ai, inv))))
                        store_chunk(Out, raw, t, c, lane)
                else:
                    # a zero routing term is a +0 gradient (the derivative is finite and >= +0)
                    for j in T.unroll(4):
                        raw[j] = T.float32(0.0)
                    for c in T.unroll(NC):
                        store_chunk(Out, raw, t, c, lane)
                T.call_extern("void", "__syncwarp")             # the row's stores before the slots' ones
                if idx >= 0 and first != 0:
                    if aux:
                        total = f64("__dadd_rn", total, aux_term(H[seq, idx], ai, inv))
                    Out[t, idx] = T.call_extern("float32", "__double2float_rn",
                                                f64("__dmul_rn", phi(T.Cast("float32", uk)), total))

    return gate_backward


def _backward_configs() -> list[tuple]:
    """(E_r, K, aux) of the bench's backward launches: the issue's gates with and without the sequence-level term,
    the off-grid ones without it."""
    return ([(e, k, aux) for e, k in BENCH_ISSUE_GATES for aux in (False, True)]
            + [(e, k, False) for e, k in BENCH_OFF_GATES])


_jit.register("moe_topk_gate_backward", gate_backward_kernel, _backward_configs)


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------

def _bytes(flags: torch.Tensor) -> torch.Tensor:
    """A bool row mask as the kernel's flat contiguous uint8 vector."""
    flags = flags.reshape(-1)
    if not flags.is_contiguous():
        flags = flags.contiguous()
    return flags.view(torch.uint8)


def _seed_words(ep_rank: int) -> tuple[int, int]:
    """The Philox key of random routing (§2.13 step 2) as the kernel's two int32 scalars: the low and high words of
    ``ep_rank mod 2^64``, each as a signed 32-bit value."""
    seed = int(ep_rank) % 2 ** 64
    lo, hi = seed & 0xFFFFFFFF, seed >> 32
    return lo - (lo >> 31 << 32), hi - (hi >> 31 << 32)


def _forward_launch(logits, num_topk: int, num_shared: int, routed_scaling_factor: float, ep_rank: int,
                    mask, bias, image_bias, image_token_mask, fix_routing_mask, to_physical_map, logical_count,
                    unmapped_topk_idx, force_random, topk_idx, topk_weights, scores) -> None:
    """Launch the forward into ``topk_idx`` / ``topk_weights`` (and ``unmapped_topk_idx`` / ``scores`` if
    given); the arguments are the validated ones of the public op."""
    rows, experts = logits.shape
    dev = logits.device
    f32, u8, i32, i64 = torch.float32, torch.uint8, torch.int32, torch.int64
    present = {"bias": bias is not None, "fix": fix_routing_mask is not None, "image": image_bias is not None,
               "map": to_physical_map is not None, "mask": mask is not None, "random": force_random is not None,
               "scores": scores is not None, "unmapped": unmapped_topk_idx is not None}
    flags = ",".join(f for f in _FLAGS if present[f])
    fn = _jit.get("moe_topk_gate_forward", (experts, num_topk, num_shared, flags))
    scores_k = None if scores is None else aligned(scores)        # a copy is written, then copied back
    fn(aligned(logits),
       bias if bias is not None else placeholder(dev, f32),
       image_bias if image_bias is not None else placeholder(dev, f32),
       _bytes(image_token_mask) if image_token_mask is not None else placeholder(dev, u8),
       _bytes(mask) if mask is not None else placeholder(dev, u8),
       _bytes(fix_routing_mask) if fix_routing_mask is not None else placeholder(dev, u8),
       _bytes(force_random) if force_random is not None else placeholder(dev, u8),
       to_physical_map if to_physical_map is not None else placeholder(dev, i32, (1, 1)),
       logical_count if logical_count is not None else placeholder(dev, i32),
       unmapped_topk_idx if unmapped_topk_idx is not None else placeholder(dev, i64, (1, num_topk)),
       topk_idx, topk_weights,
       scores_k if scores is not None else placeholder(dev, f32, (1, experts)),
       float(routed_scaling_factor), *_seed_words(ep_rank))
    if scores_k is not scores:
        scores.copy_(scores_k)


# One-token gate calls are host-bound. An eager call with logits and at most a bias (no other optional input, no
# out) whose facts passed the public op's checks before launches through a native plan (tilefuse._native: both
# outputs allocated and the kernel called in one C++ call), keyed by those facts; the token count is free.
_FAST: dict[tuple, object] = {}
_is_compiling = torch.compiler.is_compiling


def _fast_key(logits, num_topk, use_shared_as_routed, num_shared_experts, routed_scaling_factor, ep_rank,
              scoring_func, bias):
    facts = (logits.dtype, logits.shape[1], logits.stride(), logits.device, type(num_topk), num_topk,
             type(use_shared_as_routed), use_shared_as_routed, type(num_shared_experts), num_shared_experts,
             type(routed_scaling_factor), routed_scaling_factor, type(ep_rank), ep_rank, scoring_func)
    if bias is None:
        return facts
    return facts + (bias.dtype, bias.shape, bias.stride(), bias.device)


def gate_forward_fast(logits, num_topk, use_shared_as_routed, num_shared_experts, routed_scaling_factor, ep_rank,
                      scoring_func, bias):
    """``(topk_idx, topk_weights)`` of an eager CUDA call with at most a bias whose facts passed the public op's
    checks before (:func:`remember_fast`); None for every other call."""
    if type(logits) is torch.Tensor and logits.is_cuda and len(logits.shape) == 2 and not _is_compiling():
        if bias is None or type(bias) is torch.Tensor:
            plan = _FAST.get(_fast_key(logits, num_topk, use_shared_as_routed, num_shared_experts,
                                       routed_scaling_factor, ep_rank, scoring_func, bias))
            if plan is not None:
                return plan(logits, bias, logits.shape[0])
    return None


def remember_fast(logits, num_topk, use_shared_as_routed, num_shared_experts, routed_scaling_factor, ep_rank,
                  scoring_func, bias) -> None:
    """Record the native plan of a validated eager call with at most a bias (the public op calls this after
    its checks); nothing where the extension is unavailable or the row is wider than a kernel takes."""
    if type(logits) is not torch.Tensor or _is_compiling() or logits.size(1) > _MAX_EXPERTS:
        return
    if bias is not None and type(bias) is not torch.Tensor:
        return
    experts = logits.size(1)
    num_shared = num_shared_experts if use_shared_as_routed else 0
    width = num_topk + num_shared
    fn = _jit.get("moe_topk_gate_forward", (experts, num_topk, num_shared, "bias" if bias is not None else ""))
    dev = logits.device
    f32, u8, i32, i64 = torch.float32, torch.uint8, torch.int32, torch.int64
    held = [placeholder(dev, f32), placeholder(dev, f32), placeholder(dev, u8), placeholder(dev, i32, (1, 1)),
            placeholder(dev, i32), placeholder(dev, i64, (1, num_topk)), placeholder(dev, f32, (1, experts))]
    seed_lo, seed_hi = _seed_words(ep_rank)
    I, H, O = _native.INPUT, _native.HELD, _native.OUTPUT
    # the kernel's parameters in order (_forward_launch): logits, bias, image bias, image mask, mask, fix,
    # random, map, count, unmapped, topk_idx, topk_weights, scores, rho, seed_lo, seed_hi
    slots = [(I, 0), (I, 1) if bias is not None else (H, 0), (H, 1), (H, 2), (H, 2), (H, 2), (H, 2), (H, 3),
             (H, 4), (H, 5), (O, 0), (O, 1), (H, 6), (_native.FLOAT, 0),
             (_native.INT, seed_lo), (_native.INT, seed_hi)]
    plan = _native.arg_plan(fn, slots, held, [(width, i64), (width, f32)], [float(routed_scaling_factor)], 16)
    if plan is not None:
        _FAST[_fast_key(logits, num_topk, use_shared_as_routed, num_shared_experts, routed_scaling_factor, ep_rank,
                        scoring_func, bias)] = plan


@_ops.kernel_op("tilefuse::moe_topk_gate_forward",
                mutates_args=("topk_idx", "topk_weights", "unmapped_topk_idx", "scores"), device_types="cuda")
def _forward_op(logits: torch.Tensor, num_topk: int, num_shared: int, routed_scaling_factor: float, ep_rank: int,
                mask: torch.Tensor | None, bias: torch.Tensor | None, image_bias: torch.Tensor | None,
                image_token_mask: torch.Tensor | None, fix_routing_mask: torch.Tensor | None,
                to_physical_map: torch.Tensor | None, logical_count: torch.Tensor | None,
                unmapped_topk_idx: torch.Tensor | None, force_random: torch.Tensor | None, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor, scores: torch.Tensor | None) -> None:
    _forward_launch(logits, num_topk, num_shared, routed_scaling_factor, ep_rank, mask, bias, image_bias,
                    image_token_mask, fix_routing_mask, to_physical_map, logical_count, unmapped_topk_idx,
                    force_random, topk_idx, topk_weights, scores)



def moe_topk_gate_forward_cuda(logits, num_topk, use_shared_as_routed, num_shared_experts, routed_scaling_factor,
                               ep_rank, scoring_func="sqrtsoftplus", mask=None, bias=None, image_bias=None,
                               image_token_mask=None, fix_routing_mask=None, to_physical_map=None, logical_count=None,
                               unmapped_topk_idx=None, out=None, *, force_random=None, scores=None):
    """CUDA ``moe_topk_gate_forward`` (the reference's argument list; validated by the public op). Returns
    ``(topk_idx, topk_weights)``, the ``out`` pair itself when given."""
    rows, _ = logits.shape
    num_shared = num_shared_experts if use_shared_as_routed else 0
    width = num_topk + num_shared
    if out is not None:
        topk_idx, topk_weights = out[0], out[1]
    else:
        topk_idx = torch.empty(rows, width, dtype=torch.int64, device=logits.device)
        topk_weights = torch.empty(rows, width, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return topk_idx, topk_weights
    if logits.size(1) > _MAX_EXPERTS:
        checks.check_gate_forward_data(logits, width, mask, fix_routing_mask, unmapped_topk_idx, logical_count,
                                    force_random)
        return ref.moe_topk_gate_forward(logits, num_topk, use_shared_as_routed, num_shared_experts,
                                         routed_scaling_factor, ep_rank, scoring_func, mask, bias, image_bias,
                                         image_token_mask, fix_routing_mask, to_physical_map, logical_count,
                                         unmapped_topk_idx, (topk_idx, topk_weights), force_random=force_random,
                                         scores=scores)
    args = (logits, num_topk, num_shared, float(routed_scaling_factor), int(ep_rank), mask, bias, image_bias,
            image_token_mask, fix_routing_mask, to_physical_map, logical_count, unmapped_topk_idx, force_random,
            topk_idx, topk_weights, scores)
    if torch.compiler.is_compiling():
        torch.ops.tilefuse.moe_topk_gate_forward(*args)
    else:
        _forward_launch(*args)
    return topk_idx, topk_weights


def _backward_launch(scores, topk_idx, topk_weights, grad_topk_weights, routed_scaling_factor: float,
                     mask, grad_scores_sum, out) -> None:
    rows, experts = scores.shape
    dev = scores.device
    aux = grad_scores_sum is not None
    fn = _jit.get("moe_topk_gate_backward", (experts, topk_idx.size(1), aux))
    per_seq = max(rows // grad_scores_sum.size(0), 1) if aux else 1
    out_k = aligned(out)                                           # a copy is written, then copied back
    fn(aligned(scores), topk_idx, topk_weights, grad_topk_weights,
       _bytes(mask) if aux else placeholder(dev, torch.uint8),
       aligned(grad_scores_sum) if aux else placeholder(dev, torch.float32, (1, experts)),
       out_k, float(routed_scaling_factor), per_seq)
    if out_k is not out:
        out.copy_(out_k)


@_ops.kernel_op("tilefuse::moe_topk_gate_backward", mutates_args=("out",), device_types="cuda")
def _backward_op(scores: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 grad_topk_weights: torch.Tensor, routed_scaling_factor: float, mask: torch.Tensor | None,
                 grad_scores_sum: torch.Tensor | None, out: torch.Tensor) -> None:
    _backward_launch(scores, topk_idx, topk_weights, grad_topk_weights, routed_scaling_factor, mask,
                     grad_scores_sum, out)



def moe_topk_gate_backward_cuda(scores, topk_idx, topk_weights, grad_topk_weights, routed_scaling_factor,
                                scoring_func="sqrtsoftplus", mask=None, grad_scores_sum=None, out=None):
    """CUDA ``moe_topk_gate_backward`` (the reference's argument list; validated by the public op): the fp32
    ``(T, E_r)`` gradient, into ``out`` when given."""
    if out is None:
        out = torch.empty(scores.shape, dtype=torch.float32, device=scores.device)
    rows, experts = scores.shape
    if rows == 0 or experts == 0:
        return out
    if experts > _MAX_EXPERTS:
        checks.check_gate_backward_data(topk_idx, experts)
        return ref.moe_topk_gate_backward(scores, topk_idx, topk_weights, grad_topk_weights, routed_scaling_factor,
                                          scoring_func, mask, grad_scores_sum, out)
    if topk_idx.size(1) == 0:                          # no routed slot: one -1 slot contributes nothing
        topk_idx = torch.full((rows, 1), -1, dtype=torch.int64, device=scores.device)
        topk_weights = grad_topk_weights = torch.zeros((rows, 1), dtype=torch.float32, device=scores.device)
    args = (scores, topk_idx, topk_weights, grad_topk_weights, float(routed_scaling_factor), mask, grad_scores_sum,
            out)
    if torch.compiler.is_compiling():
        torch.ops.tilefuse.moe_topk_gate_backward(*args)
    else:
        _backward_launch(*args)
    return out
