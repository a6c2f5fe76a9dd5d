// Reference kernels for tools/lossless_shapes.py (built there with nvcc on the GPU machine): plain CUDA kernels that
// move per_block_cast_lossless's bytes, to bound what a kernel of each shape reaches at the bench size (93 MB).
// Not part of the library. Every launch uses programmatic dependent launch, as the op does.
//
//  * k_stream<NT, M>: a contiguous stream of the op's byte mix. A unit is the op's CTA tile, 20480 bytes read (data +
//    sf of 128 rows x 256 channels) and 32768 written; each NT-thread CTA moves M * NT / 256 units, each thread
//    5 * M 16-byte loads, then 8 * M 16-byte stores.
//  * k_persist: the NT = 256 stream on a persistent grid, the next unit's loads issued before this unit's stores.
//  * k_bulk<S>: persistent; each unit's 20 KB arrives in shared memory by a bulk copy (S stages ahead), threads write
//    the 32 KB output to shared memory and one bulk store sends it.
//  * k_pattern<R, BLOCK_SF, NO_MAX>: the op's own access pattern (fp32 input sf, block 1x32 -> 128x128): each thread
//    one 4-byte word (8 channels) of 8 rows and their sf words, an e4m3 block maximum across the CTA, one 8-byte
//    store per row. R-row CTAs (the op: R = 128). With BLOCK_SF the CTA also reads the sf of the rest of its 128-row
//    block (from L2) and its results equal R = 128's; without it, R < 128 takes the maximum over its own rows only
//    (not the op's result: an upper bound for smaller tiles). NO_MAX drops the block maximum (and the barrier).
//  * k_pattern_wide<RPT, SPLIT>: the op's tile with 16-byte lanes (one input sf block of 32 channels per lane and
//    row); SPLIT places each lane's two 16-byte stores so that each store instruction covers whole lines.
#include <cuda_runtime.h>
#include <stdint.h>

constexpr int kInVec = 1280;   // 16-byte vectors read per unit
constexpr int kOutVec = 2048;  // 16-byte vectors written per unit
constexpr int kH = 7168;       // the op's hidden size

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;"); }

__device__ __forceinline__ uint4 ld16(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ int ld4(const int* p) {
  int r;
  asm volatile("ld.global.nc.L1::no_allocate.b32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}

// output vector k of a unit from the unit's input vectors (r: this thread's, n of them)
__device__ __forceinline__ uint4 out_vec(const uint4* r, int n, int k, uint32_t bump) {
  uint4 v = r[k % n];
  v.x ^= k;
  v.w += bump;
  return v;
}

template <int NT, int M>
__global__ void __launch_bounds__(NT) k_stream(const uint4* __restrict__ in, uint4* __restrict__ out) {
  pdl_wait();
  pdl_trigger();
  const uint4* src = in + (size_t)blockIdx.x * (5 * M * NT);  // M * NT / 256 units per CTA
  uint4* dst = out + (size_t)blockIdx.x * (8 * M * NT);
  uint4 r[5 * M];
#pragma unroll
  for (int i = 0; i < 5 * M; i++) r[i] = ld16(src + threadIdx.x + NT * i);
  // every store depends on every load, so the compiler keeps all loads ahead of the first store
  uint32_t acc = 0;
#pragma unroll
  for (int i = 0; i < 5 * M; i++) acc ^= r[i].y;
  uint32_t bump = acc == 0x12345678u;
#pragma unroll
  for (int k = 0; k < 8 * M; k++) dst[threadIdx.x + NT * k] = out_vec(r, 5 * M, k, bump);
}

__global__ void __launch_bounds__(256) k_persist(const uint4* __restrict__ in, uint4* __restrict__ out, int units) {
  pdl_wait();
  pdl_trigger();
  int u = blockIdx.x;
  if (u >= units) return;
  uint4 r[5], nx[5];
#pragma unroll
  for (int i = 0; i < 5; i++) r[i] = ld16(in + (size_t)u * kInVec + threadIdx.x + 256 * i);
  for (; u < units; u += gridDim.x) {
    int un = u + gridDim.x;
    if (un < units) {
#pragma unroll
      for (int i = 0; i < 5; i++) nx[i] = ld16(in + (size_t)un * kInVec + threadIdx.x + 256 * i);
    }
    uint4* dst = out + (size_t)u * kOutVec;
#pragma unroll
    for (int k = 0; k < 8; k++) dst[threadIdx.x + 256 * k] = out_vec(r, 5, k, 0);
#pragma unroll
    for (int i = 0; i < 5; i++) r[i] = nx[i];
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

template <int S>
__global__ void __launch_bounds__(256) k_bulk(const uint4* __restrict__ in, uint4* __restrict__ out, int units) {
  extern __shared__ __align__(128) uint4 smem[];
  uint4* stage = smem;                 // S input units
  uint4* staged_out = smem + S * kInVec;  // 2 output units
  __shared__ __align__(8) uint64_t full[S];
  pdl_wait();
  pdl_trigger();
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; s++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&full[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto fetch = [&](int u, int s) {  // thread 0: unit u into stage s
    uint32_t bar = smem_addr(&full[s]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(kInVec * 16) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(stage + s * kInVec)), "l"(in + (size_t)u * kInVec), "r"(kInVec * 16), "r"(bar)
                 : "memory");
  };
  if (threadIdx.x == 0)
    for (int s = 0; s < S; s++)
      if (blockIdx.x + s * gridDim.x < units) fetch(blockIdx.x + s * gridDim.x, s);
  int it = 0;
  for (int u = blockIdx.x; u < units; u += gridDim.x, it++) {
    int s = it % S;
    asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}"
                 ::"r"(smem_addr(&full[s])), "r"((it / S) & 1) : "memory");
    int ob = it & 1;
    // the bulk store of two units ago, which read output buffer ob, has finished reading it
    if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    __syncthreads();
    uint4 r[5];
#pragma unroll
    for (int i = 0; i < 5; i++) r[i] = stage[s * kInVec + threadIdx.x + 256 * i];
#pragma unroll
    for (int k = 0; k < 8; k++) staged_out[ob * kOutVec + threadIdx.x + 256 * k] = out_vec(r, 5, k, 0);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();  // the output unit is written and stage s is read: send the one, refill the other
    if (threadIdx.x == 0) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   ::"l"(out + (size_t)u * kOutVec), "r"(smem_addr(staged_out + ob * kOutVec)), "r"(kOutVec * 16)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      if (u + S * gridDim.x < units) fetch(u + S * gridDim.x, s);
    }
  }
  if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// E_B of a lane's output block from each warp's maximum m (of e(b) << 23): through shared memory, one barrier
template <int W>
__device__ __forceinline__ int block_exponent(int m, int (*red)[32], int w, int lane) {
  red[w][lane] = m;
  __syncthreads();
  m = 0;
#pragma unroll
  for (int q = 0; q < W; q++) m = max(m, red[q][lane]);
  return max((m >> 23) - 6, 0);
}

template <int R, bool BLOCK_SF, bool NO_MAX = false>
__global__ void __launch_bounds__(4 * R) k_pattern(const int* __restrict__ d, const int* __restrict__ sf,
                                                 uint2* __restrict__ y, int* __restrict__ out_sf, int T) {
  constexpr int kWarps = R / 8, kWords = kH / 8, kSf = kH / 32;
  __shared__ int red[kWarps][32];
  pdl_wait();
  int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  int row0 = blockIdx.y * R + w * 8;
  int col = blockIdx.x * 32 + lane;     // data word: channels 8 col ... 8 col + 7
  int sf_col = blockIdx.x * 8 + lane / 4;
  int dl[8], el[8];
#pragma unroll
  for (int j = 0; j < 8; j++) {
    bool ok = row0 + j < T;
    dl[j] = ok ? ld4(d + (size_t)(row0 + j) * kWords + col) : 0;
    el[j] = ok ? ld4(sf + (size_t)(row0 + j) * kSf + sf_col) : 0;
  }
  int m = 0;
  // (T == -1 never holds: it keeps the data loads ahead of the barrier, as the op does)
#pragma unroll
  for (int j = 0; j < 8; j++) m = max(m, max(el[j] & 0x7F800000, T == -1 ? dl[j] : 0));
  if (BLOCK_SF && R < 128) {
    int b0 = blockIdx.y * R / 128 * 128;
#pragma unroll
    for (int i = 0; i < 128 / R; i++) {
      int rb = b0 + i * R;
      if (rb == (int)blockIdx.y * R) continue;
#pragma unroll
      for (int j = 0; j < 8; j++)
        if (rb + w * 8 + j < T) m = max(m, ld4(sf + (size_t)(rb + w * 8 + j) * kSf + sf_col) & 0x7F800000);
    }
  }
  int eb = max((m >> 23) - 6, 0);
  if (!NO_MAX) {  // (NO_MAX: the same loads and stores without the block maximum, i.e. without the barrier)
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));  // the 16 lanes of 128 channels
    eb = block_exponent<kWarps>(m, red, w, lane);
  }
  if (w == 0 && lane % 16 == 0 && blockIdx.y * R % 128 == 0)
    out_sf[blockIdx.y * R / 128 * (kH / 128) + blockIdx.x * 2 + lane / 16] = eb << 23;
#pragma unroll
  for (int j = 0; j < 8; j++) {
    if (row0 + j < T) {
      int dd = (el[j] >> 23) - eb;
      y[(size_t)(row0 + j) * kWords + col] = make_uint2(dl[j] ^ dd, dl[j] + dd);
    }
  }
}


// The op's tile and fp32 sf with 16-byte lanes: each lane one input sf block (32 channels, 16 bytes) of RPT rows,
// 8 lanes per row piece (4 rows per warp access), 128 rows per CTA (128 * 8 / RPT threads); two 16-byte stores per
// row. Results equal k_pattern's block sf (the stored words differ: a model, not the op).
template <int RPT, bool SPLIT>
__global__ void __launch_bounds__(1024 / RPT) k_pattern_wide(const uint4* __restrict__ d, const int* __restrict__ sf,
                                                              uint4* __restrict__ y, int* __restrict__ out_sf, int T) {
  constexpr int kThreads = 1024 / RPT, kWarps = kThreads / 32, kVecs = kH / 32, kSf = kH / 32;
  __shared__ int red[kWarps][32];
  pdl_wait();
  int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  int sub = lane % 8;                          // the lane's 32 channels within the CTA's 256
  int row0 = blockIdx.y * 128 + threadIdx.x / 8;  // rows row0 + j * kStride
  constexpr int kStride = kThreads / 8;
  int vcol = blockIdx.x * 8 + sub;             // 16-byte vector of data in its row; also the sf column
  uint4 dl[RPT];
  int el[RPT];
#pragma unroll
  for (int j = 0; j < RPT; j++) {
    int r = row0 + j * kStride;
    bool ok = r < T;
    dl[j] = ok ? ld16(d + (size_t)r * kVecs + vcol) : make_uint4(0, 0, 0, 0);
    el[j] = ok ? ld4(sf + (size_t)r * kSf + vcol) : 0;
  }
  int m = 0;
#pragma unroll
  for (int j = 0; j < RPT; j++) m = max(m, max(el[j] & 0x7F800000, T == -1 ? (int)(dl[j].x ^ dl[j].w) : 0));
  // the 4 lanes of one 128-channel output block, then all rows of the CTA
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 8));
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 16));
  int eb = block_exponent<kWarps>(m, red, w, lane);
  if (threadIdx.x < 8 && sub % 4 == 0)
    out_sf[blockIdx.y * (kH / 128) + blockIdx.x * 2 + sub / 4] = eb << 23;
#pragma unroll
  for (int j = 0; j < RPT; j++) {
    int r = row0 + j * kStride;
    if (r < T) {
      int dd = (el[j] >> 23) - eb;
      uint4 v = dl[j];
      // the lane's 32 bytes (SPLIT: two 16-byte halves, 8 lanes apart, so each store covers 128 whole bytes; the
      // bytes land elsewhere than the op's, a placement model of a lane exchange)
      size_t o0 = SPLIT ? blockIdx.x * 16 + sub : 2 * vcol, o1 = SPLIT ? o0 + 8 : o0 + 1;
      y[(size_t)r * (kH / 16) + o0] = make_uint4(v.x ^ dd, v.y ^ dd, v.z ^ dd, v.w ^ dd);
      y[(size_t)r * (kH / 16) + o1] = make_uint4(v.x + dd, v.y + dd, v.z + dd, v.w + dd);
    }
  }
}

static int launch(const void* f, dim3 grid, int block, size_t smem, void* stream, void** args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return (int)cudaLaunchKernelExC(&cfg, f, args);
}

template <int NT, int M>
static int launch_stream(void* in, void* out, int units, void* stream) {
  void* args[2] = {&in, &out};
  return launch((const void*)k_stream<NT, M>, dim3(units * 256 / (NT * M)), NT, 0, stream, args);
}

template <int S>
static int launch_bulk(void* in, void* out, int units, int grid, void* stream) {
  size_t smem = (size_t)(S * kInVec + 2 * kOutVec) * 16;
  int e = (int)cudaFuncSetAttribute((const void*)k_bulk<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e) return e;
  void* args[3] = {&in, &out, &units};
  return launch((const void*)k_bulk<S>, dim3(grid), 256, smem, stream, args);
}

// kind: "stream NT M" as 0-7 (NT 64/128/256/512 x M 1/2), 8 persist, 9-11 bulk S = 2/3/4; units of 20 KB in
extern "C" int lossless_shapes_stream(int kind, void* in, void* out, int units, int grid, void* stream) {
  switch (kind) {
    case 0: return launch_stream<64, 1>(in, out, units, stream);
    case 1: return launch_stream<64, 2>(in, out, units, stream);
    case 2: return launch_stream<128, 1>(in, out, units, stream);
    case 3: return launch_stream<128, 2>(in, out, units, stream);
    case 4: return launch_stream<256, 1>(in, out, units, stream);
    case 5: return launch_stream<256, 2>(in, out, units, stream);
    case 6: return launch_stream<512, 1>(in, out, units, stream);
    case 7: return launch_stream<512, 2>(in, out, units, stream);
    case 8: {
      void* args[3] = {&in, &out, &units};
      return launch((const void*)k_persist, dim3(grid), 256, 0, stream, args);
    }
    case 9: return launch_bulk<2>(in, out, units, grid, stream);
    case 10: return launch_bulk<3>(in, out, units, grid, stream);
    case 11: return launch_bulk<4>(in, out, units, grid, stream);
  }
  return -1;
}

// kind: 0 R = 128; 1-3 R = 64/32/16 with the block's sf; 4-6 R = 64/32/16 with their own rows' sf only;
// 7-9 16-byte lanes with 8 / 4 / 2 rows per thread; 10-12 the same with whole-line stores (placement model);
// 13-14 R = 128 / 32 without the block maximum
extern "C" int lossless_shapes_pattern(int kind, void* d, void* sf, void* y, void* out_sf, int T, void* stream) {
  void* args[5] = {&d, &sf, &y, &out_sf, &T};
  if (kind >= 7 && kind <= 12) {
    static const void* wide[6] = {(const void*)k_pattern_wide<8, false>, (const void*)k_pattern_wide<4, false>,
                                  (const void*)k_pattern_wide<2, false>, (const void*)k_pattern_wide<8, true>,
                                  (const void*)k_pattern_wide<4, true>, (const void*)k_pattern_wide<2, true>};
    return launch(wide[kind - 7], dim3(kH / 256, (T + 127) / 128), 128 << ((kind - 7) % 3), 0, stream, args);
  }
  static const void* fns[7] = {(const void*)k_pattern<128, true>, (const void*)k_pattern<64, true>,
                               (const void*)k_pattern<32, true>, (const void*)k_pattern<16, true>,
                               (const void*)k_pattern<64, false>, (const void*)k_pattern<32, false>,
                               (const void*)k_pattern<16, false>};
  if (kind == 13 || kind == 14) {
    const void* f = kind == 13 ? (const void*)k_pattern<128, false, true> : (const void*)k_pattern<32, false, true>;
    int r = kind == 13 ? 128 : 32;
    return launch(f, dim3(kH / 256, (T + r - 1) / r), 4 * r, 0, stream, args);
  }
  static const int rows[7] = {128, 64, 32, 16, 64, 32, 16};
  if (kind < 0 || kind > 6) return -1;
  int r = rows[kind];
  return launch(fns[kind], dim3(kH / 256, (T + r - 1) / r), 4 * r, 0, stream, args);
}
