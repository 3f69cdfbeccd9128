// lowbit's native decode kernels for Hopper (sm_90a), M = 1..16 activation rows, bf16 output:
//   lb_w4a16   int4 weights in groups of 32/64/128/256, symmetric or with int8 zero points, bf16 x
//   lb_w8a16   int8 weights, one float32 scale per row, bf16 x
//   lb_w8a8    int8 or fp8 e4m3 weights and per-token activation codes (lb_act_quant), per-row scales
//   lb_w4_dequant / lb_w8_dequant   the weight in bf16 / fp16 / fp32 from the same layout (the large-M path)
// Design for the bandwidth limit: the weight is the mma's A operand (out^T = W x^T, so one m16n8k16 /
// m16n8k32 covers 16 weight rows for up to 8 activation rows, two for up to 16); weights pre-arranged
// (lowbit.ops.native.layout) so each lane streams 16 bytes per tile with one 128-bit load that skips L1,
// 4 tiles (2 KB per warp) in flight; 4-bit codes become exact bf16 (code - z) with a shift, a LOP3 and an
// HSUB2 per pair (decode_math.h); a CTA of 8 warps splits its K range between the warps, and `splits` CTAs
// split K further (grid: N/16 x splits; a second kernel adds the splits) so even N = 4096 fills the SMs.
//
// Rounding order (what the float64 reference and the tolerance are derived from):
//   W4A16: within a group, float32 sums of exact products x * (code - z) (the mma instructions of the
//          group's k16 steps, chained through the accumulator); then acc = fma(group sum, scale, acc)
//          over the warp's groups in increasing k; warps, then splits, added in order (decode_warp.h);
//          out = bf16_rn(acc), or with a bias bf16_rn(acc + bias[n]): one float32 addition first.
//   W8A16: float32 sums of exact products x * code, chained through the mma accumulator over the warp's
//          k range; warps, then splits, added in order; out = bf16_rn(acc * sw[n]), or with a bias
//          bf16_rn((acc * sw[n]) + bias[n]): the product and the sum each rounded to float32 (no FMA).
//   W8A8 int8: exact int32 sums (|acc| < 2^31 while K * 127 * 127 < 2^31); out =
//          bf16_rn((float(acc) * sa[m]) * sw[n]), two float32 roundings then one to bf16; with a bias,
//          bf16_rn(((float(acc) * sa[m]) * sw[n]) + bias[n]): a third float32 rounding before the bf16 one.
//   W8A8 fp8: each k32 tile's 32 exact products summed by one mma into a zero float32 accumulator, added
//          to the warp's float32 sum (a promotion every 32 products); warps, then splits, in order; out as int8.
//   The bias (float32, or bfloat16 read exactly into float32) is always the last float32 operation, after
//   the splits' sum (decode_math.h's Bias), so the reference's tolerance counts one more float32 rounding.
//   Activation codes (lb_act_quant): lowbit.quantize's per-token scheme, bit for bit: s = amax / qmax
//          (1.0 where 0), code = int8 clamp(round_half_even(x / s), -127, 127) or e4m3 satfinite(x / s).
//   Dequantization (lb_w4_dequant / lb_w8_dequant): out = dtype(float32(code - z) * scale), the product rounded
//          once to float32 (code - z is exact), then once to bf16 / fp16 (round to nearest even; none for float32).
// Inside one mma instruction the order of the float32 additions is the tensor core's.
#include <cuda_runtime.h>

#include "decode_warp.h"

using namespace lowbit_native;

namespace {

struct DeviceLanes {
  static constexpr int kLanes = 1;
  __device__ __forceinline__ static int lane(int) { return threadIdx.x & 31; }
  // weights: read once, streamed past L1
  __device__ __forceinline__ static void loadw16(const void* p, uint32_t q[4]) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(q[0]), "=r"(q[1]), "=r"(q[2]), "=r"(q[3]) : "l"(p));
  }
  // activations: shared by every CTA, kept in L1 / L2
  __device__ __forceinline__ static void load16(const void* p, uint32_t q[4]) {
    uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    q[0] = v.x; q[1] = v.y; q[2] = v.z; q[3] = v.w;
  }
  __device__ __forceinline__ static void load8(const void* p, uint32_t q[2]) {
    uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    q[0] = v.x; q[1] = v.y;
  }
  __device__ __forceinline__ static float loadf(const float* p) { return __ldg(p); }

  __device__ __forceinline__ static void mma_bf16(const uint32_t (&a)[1][4], const uint32_t (&b)[1][2], float (&c)[1][4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3])
                 : "r"(a[0][0]), "r"(a[0][1]), "r"(a[0][2]), "r"(a[0][3]), "r"(b[0][0]), "r"(b[0][1]));
  }
  __device__ __forceinline__ static void mma_s8(const uint32_t (&a)[1][4], const uint32_t (&b)[1][2], int32_t (&c)[1][4]) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+r"(c[0][0]), "+r"(c[0][1]), "+r"(c[0][2]), "+r"(c[0][3])
                 : "r"(a[0][0]), "r"(a[0][1]), "r"(a[0][2]), "r"(a[0][3]), "r"(b[0][0]), "r"(b[0][1]));
  }
  __device__ __forceinline__ static void mma_e4m3(const uint32_t (&a)[1][4], const uint32_t (&b)[1][2], float (&c)[1][4]) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3])
                 : "r"(a[0][0]), "r"(a[0][1]), "r"(a[0][2]), "r"(a[0][3]), "r"(b[0][0]), "r"(b[0][1]));
  }
};

using DL = DeviceLanes;
constexpr int kThreads = kWarps * 32;

// The CTA's warp sums of its NT row tiles; thread i = 16 m + n finishes element (m, n) of each tile: the
// bf16 output (one split), or the split's partial sum ws[s][m][n]. With splits > 1 and `counters` (one int
// per CTA column, zero between launches), the last CTA of a column to finish then adds the S partials in
// split order and writes the output itself (the order split_reduce_kernel uses, so the same bits), and
// resets its counter: no second launch. Epi maps (sum, m, n) to the output's bits.
template <class T, int MB, int NT, class Epi>
__device__ __forceinline__ void finish_cta(T (&red)[NT][kWarps * 256], const T (&acc)[NT][MB][1][4], int M, int N,
                                           int splits, T* ws, int* counters, uint16_t* out, Epi epi) {
  LB_UNROLL for (int i = 0; i < NT; ++i) cta_stash<T, MB, 1>(red[i], threadIdx.x >> 5, acc[i], 0, threadIdx.x & 31);
  __syncthreads();
  const int m = threadIdx.x >> 4;
  const size_t mn = size_t(M) * N;
  LB_UNROLL for (int i = 0; i < NT; ++i) {
    const int n = (blockIdx.x * NT + i) * 16 + (threadIdx.x & 15);
    if (m >= M || n >= N) continue;
    const T v = cta_sum(red[i], threadIdx.x);
    if (splits == 1) out[size_t(m) * N + n] = epi(v, m, n);
    else ws[blockIdx.y * mn + size_t(m) * N + n] = v;
  }
  if (splits == 1 || counters == nullptr) return;
  __shared__ int ticket;
  __threadfence();                       // this CTA's partials are visible before its ticket is taken
  __syncthreads();
  if (threadIdx.x == 0) ticket = atomicAdd(counters + blockIdx.x, 1);
  __syncthreads();
  if (ticket != splits - 1) return;
  __threadfence();
  LB_UNROLL for (int i = 0; i < NT; ++i) {
    const int n = (blockIdx.x * NT + i) * 16 + (threadIdx.x & 15);
    if (m < M && n < N)
      out[size_t(m) * N + n] = epi(split_sum(ws + size_t(m) * N + n, splits, mn, [](const T* p) { return __ldcg(p); }), m, n);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;
}

template <int G, int MB, int NT, bool PF>
__global__ void __launch_bounds__(kThreads) w4a16_kernel(W4Args a, Bias bias, uint16_t* out, float* ws, int* counters, int N,
                                                          int kblocks, int splits) {
  __shared__ float red[NT][kWarps * 256];
  float acc[NT][MB][1][4] = {};
  w4_warp<DL, G, MB, NT, PF>(a, blockIdx.x * NT, split_begin(kblocks, splits, blockIdx.y),
                             split_begin(kblocks, splits, blockIdx.y + 1), threadIdx.x >> 5, acc);
  finish_cta<float, MB, NT>(red, acc, a.M, N, splits, ws, counters, out,
                            [bias](float v, int, int n) { return out_w4a16(v, bias, n); });
}

template <int MB, int NT, bool PF>
__global__ void __launch_bounds__(kThreads) w8a16_kernel(W8Args a, const float* sw, Bias bias, uint16_t* out, float* ws,
                                                          int* counters, int N, int kblocks, int splits) {
  __shared__ float red[NT][kWarps * 256];
  float acc[NT][MB][1][4] = {};
  w8a16_warp<DL, MB, NT, PF>(a, blockIdx.x * NT, split_begin(kblocks, splits, blockIdx.y),
                             split_begin(kblocks, splits, blockIdx.y + 1), threadIdx.x >> 5, acc);
  finish_cta<float, MB, NT>(red, acc, a.M, N, splits, ws, counters, out,
                            [sw, bias](float v, int, int n) { return out_w8a16(v, __ldg(sw + n), bias, n); });
}

template <bool FP8, int MB, int NT, bool PF>
__global__ void __launch_bounds__(kThreads) w8a8_kernel(W8Args a, const float* sa, const float* sw, Bias bias, uint16_t* out,
                                                         void* ws, int* counters, int N, int kblocks, int splits) {
  const int b0 = split_begin(kblocks, splits, blockIdx.y), b1 = split_begin(kblocks, splits, blockIdx.y + 1);
  float accf[NT][MB][1][4] = {};
  int32_t acci[NT][MB][1][4] = {};
  w8a8_warp<DL, FP8, MB, NT, PF>(a, blockIdx.x * NT, b0, b1, threadIdx.x >> 5, accf, acci);
  __shared__ uint32_t red[NT][kWarps * 256];   // float or int32 sums: one buffer (two would not fit at NT = 4)
  if (FP8) {
    finish_cta<float, MB, NT>(*reinterpret_cast<float(*)[NT][kWarps * 256]>(&red), accf, a.M, N, splits,
                              static_cast<float*>(ws), counters, out,
                              [sa, sw, bias](float v, int m, int n) { return out_w8a8(v, __ldg(sa + m), __ldg(sw + n), bias, n); });
  } else {
    finish_cta<int32_t, MB, NT>(*reinterpret_cast<int32_t(*)[NT][kWarps * 256]>(&red), acci, a.M, N, splits,
                                static_cast<int32_t*>(ws), counters, out,
                                [sa, sw, bias](int32_t v, int m, int n) {
                                  return out_w8a8(float(v), __ldg(sa + m), __ldg(sw + n), bias, n);
                                });
  }
}

// out[m][n] = epilogue(sum over splits of ws[s][m][n], in split order). KIND: 0 W4A16, 1 W8A16, 2 W8A8.
template <class T, int KIND>
__global__ void split_reduce_kernel(const T* ws, int splits, int M, int N, const float* sa, const float* sw, Bias bias,
                                    uint16_t* out) {
  const size_t mn = size_t(M) * N;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < mn; i += size_t(gridDim.x) * blockDim.x) {
    const T v = split_sum(ws + i, splits, mn);
    const int m = int(i / N), n = int(i % N);
    if (KIND == 0) out[i] = out_w4a16(float(v), bias, n);
    else if (KIND == 1) out[i] = out_w8a16(float(v), sw[n], bias, n);
    else out[i] = out_w8a8(float(v), sa[m], sw[n], bias, n);
  }
}

// Dequantization (the large-M path): one warp per weight tile, every lane its 16 bytes (decode_warp.h). The
// lanes' values land in a per-warp shared tile first (a lane's own values are scattered over 8 rows), then
// the warp writes the tile out row by row, consecutive lanes at consecutive columns: whole sectors per store.
template <int TK>
__device__ __forceinline__ void write_tile(const float (&tile)[kTileN * TK], int N, int K, int nt, int kt, void* out,
                                           int ldo, int kind) {
  __syncwarp();
  const int lane = threadIdx.x & 31;
  LB_UNROLL for (int e = lane; e < kTileN * TK; e += 32) {
    const int n = nt * kTileN + e / TK, k = kt * TK + e % TK;
    if (n < N && k < K) store_out(out, size_t(n) * ldo + k, tile[e], kind);
  }
}

__global__ void __launch_bounds__(kThreads) w4_dequant_kernel(W4Args a, const float* scale, int N, int G, void* out,
                                                              int ldo, int kind) {
  __shared__ float stage[kWarps][kTileN * kTileK4];
  const int warp = threadIdx.x >> 5, tile = blockIdx.x * kWarps + warp;
  if (tile >= a.n16 * a.KT) return;
  const int nt = tile / a.KT, kt = tile % a.KT;
  w4_dequant_tile<DL>(a, scale, N, nt, kt, 0, G, [&](int r, int k, float v) { stage[warp][r * kTileK4 + k] = v; });
  write_tile<kTileK4>(stage[warp], N, a.K, nt, kt, out, ldo, kind);
}

__global__ void __launch_bounds__(kThreads) w8_dequant_kernel(W8Args a, const float* scale, int N, void* out, int ldo,
                                                              int kind) {
  __shared__ float stage[kWarps][kTileN * kTileK8];
  const int warp = threadIdx.x >> 5, tile = blockIdx.x * kWarps + warp;
  if (tile >= a.n16 * a.KT) return;
  const int nt = tile / a.KT, kt = tile % a.KT;
  w8_dequant_tile<DL>(a, scale, N, nt, kt, 0, [&](int r, int k, float v) { stage[warp][r * kTileK8 + k] = v; });
  write_tile<kTileK8>(stage[warp], N, a.K, nt, kt, out, ldo, kind);
}

// One CTA per activation row: the row's amax (exact in any order), then its codes.
__global__ void __launch_bounds__(256) act_quant_kernel(const uint16_t* x, int K, int ldx, int fp8, uint8_t* codes,
                                                         float* scales) {
  __shared__ float wmax[8];
  const uint16_t* row = x + size_t(blockIdx.x) * ldx;
  float amax = 0.0f;
  for (int k = threadIdx.x; k < K; k += blockDim.x) amax = fmaxf(amax, fabsf(bf16_f32(row[k])));
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if ((threadIdx.x & 31) == 0) wmax[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = wmax[0];
  for (int w = 1; w < 8; ++w) amax = fmaxf(amax, wmax[w]);
  const float s = act_scale(amax, fp8 ? 448.0f : 127.0f);
  if (threadIdx.x == 0) scales[blockIdx.x] = s;
  uint8_t* crow = codes + size_t(blockIdx.x) * ldx;
  for (int k = threadIdx.x; k < K; k += blockDim.x)
    crow[k] = fp8 ? act_code_fp8(bf16_f32(row[k]), s) : uint8_t(act_code_int8(bf16_f32(row[k]), s));
}

int reduce_splits_launch(int kind, const void* ws, int splits, int M, int N, const float* sa, const float* sw, Bias bias,
                         uint16_t* out, cudaStream_t st) {
  const int blocks = int((size_t(M) * N + 255) / 256);
  const float* f = static_cast<const float*>(ws);
  if (kind == 0) split_reduce_kernel<float, 0><<<blocks, 256, 0, st>>>(f, splits, M, N, sa, sw, bias, out);
  else if (kind == 1) split_reduce_kernel<float, 1><<<blocks, 256, 0, st>>>(f, splits, M, N, sa, sw, bias, out);
  else if (kind == 2)
    split_reduce_kernel<int32_t, 2><<<blocks, 256, 0, st>>>(static_cast<const int32_t*>(ws), splits, M, N, sa, sw, bias, out);
  else split_reduce_kernel<float, 2><<<blocks, 256, 0, st>>>(f, splits, M, N, sa, sw, bias, out);
  return int(cudaGetLastError());
}

// The checks every GEMV entry point makes: -1 M outside 1..16, -3 splits < 1, -4 a bias_kind other than 0, 1, 2
// (or one without a bias pointer); 0 when the arguments pass.
int check_args(int M, int splits, const void* bias, int bias_kind) {
  if (M < 1 || M > 16) return -1;
  if (splits < 1) return -3;
  if (!bias_ok(bias, bias_kind)) return -4;
  return 0;
}

// After the GEMV launch: the second (reduce) launch where the splits are not added in the GEMV.
int after_gemv(int kind, const void* ws, const int* counters, int splits, int M, int N, const float* sa, const float* sw,
               Bias b, uint16_t* out, cudaStream_t st) {
  int err = int(cudaGetLastError());
  if (err || splits == 1 || counters) return err;
  return reduce_splits_launch(kind, ws, splits, M, N, sa, sw, b, out, st);
}

dim3 gemv_grid(int N, int nt, int splits) { return dim3((N + 16 * nt - 1) / (16 * nt), splits); }

}  // namespace

// The C ABI (lowbit.ops.native.kernels checks every argument before calling). Pointers are device
// pointers; `ws` is a float32 / int32 workspace of splits * M * N elements when splits > 1 (else unused);
// `bias` is nullptr or N float32 (bias_kind 1) / bfloat16 (bias_kind 2) values, added last (decode_math.h);
// `nt` row tiles of 16 per CTA (1, 2, 4), `prefetch` 0 / 1 (with_variant); `counters`: nullptr (splits > 1
// adds the partials in a second kernel) or ceil(N / (16 nt)) ints, zero, that the launch leaves zero (the
// last CTA of each column adds them: finish_cta). Launches sharing a counters array must not overlap in time.
// The return value is a cudaError_t (0: launched) or one of the negative codes below.
extern "C" {

int lb_native_abi_version() { return 4; }


// -2: unsupported group size, -5: nt not 1, 2, 4 or prefetch not 0, 1
int lb_w4a16(const void* w, const float* scale, const int8_t* zero, const void* x, void* out, float* ws, int* counters,
             const void* bias, int M, int N, int K, int ldx, int KT, int groups, int G, int splits, int nt, int prefetch,
             int bias_kind, cudaStream_t st) {
  if (int bad = check_args(M, splits, bias, bias_kind)) return bad;
  if (G != 32 && G != 64 && G != 128 && G != 256) return -2;
  const Bias b{bias, bias_kind};
  W4Args a{static_cast<const uint8_t*>(w), scale, zero, static_cast<const uint16_t*>(x), M, K, ldx, KT, groups, (N + 15) / 16};
  const int kblocks = (KT + kTilesPerBlock - 1) / kTilesPerBlock;
  const dim3 grid = gemv_grid(N, nt, splits);
  uint16_t* o = static_cast<uint16_t*>(out);
  const bool built = with_variant(M, nt, prefetch, [&](auto mb, auto ntc, auto pf) {
    constexpr int MB = decltype(mb)::value, NT = decltype(ntc)::value;
    constexpr bool PF = decltype(pf)::value;
    switch (G) {
      case 32: w4a16_kernel<32, MB, NT, PF><<<grid, kThreads, 0, st>>>(a, b, o, ws, counters, N, kblocks, splits); break;
      case 64: w4a16_kernel<64, MB, NT, PF><<<grid, kThreads, 0, st>>>(a, b, o, ws, counters, N, kblocks, splits); break;
      case 128: w4a16_kernel<128, MB, NT, PF><<<grid, kThreads, 0, st>>>(a, b, o, ws, counters, N, kblocks, splits); break;
      default: w4a16_kernel<256, MB, NT, PF><<<grid, kThreads, 0, st>>>(a, b, o, ws, counters, N, kblocks, splits); break;
    }
  });
  if (!built) return -5;
  return after_gemv(0, ws, counters, splits, M, N, nullptr, nullptr, b, o, st);
}

int lb_w8a16(const void* w, const float* sw, const void* x, void* out, float* ws, int* counters, const void* bias, int M,
             int N, int K, int ldx, int KT, int splits, int nt, int prefetch, int bias_kind, cudaStream_t st) {
  if (int bad = check_args(M, splits, bias, bias_kind)) return bad;
  const Bias b{bias, bias_kind};
  W8Args a{static_cast<const uint8_t*>(w), nullptr, static_cast<const uint16_t*>(x), M, K, ldx, KT, (N + 15) / 16};
  const int kblocks = (KT + kTilesPerBlock - 1) / kTilesPerBlock;
  const dim3 grid = gemv_grid(N, nt, splits);
  uint16_t* o = static_cast<uint16_t*>(out);
  const bool built = with_variant(M, nt, prefetch, [&](auto mb, auto ntc, auto pf) {
    w8a16_kernel<decltype(mb)::value, decltype(ntc)::value, bool(decltype(pf)::value)>
        <<<grid, kThreads, 0, st>>>(a, sw, b, o, ws, counters, N, kblocks, splits);
  });
  if (!built) return -5;
  return after_gemv(1, ws, counters, splits, M, N, nullptr, sw, b, o, st);
}

int lb_w8a8(const void* w, const float* sw, const void* xq, const float* sa, void* out, void* ws, int* counters,
            const void* bias, int M, int N, int K, int ldx, int KT, int splits, int nt, int prefetch, int fp8, int bias_kind,
            cudaStream_t st) {
  if (int bad = check_args(M, splits, bias, bias_kind)) return bad;
  const Bias b{bias, bias_kind};
  W8Args a{static_cast<const uint8_t*>(w), static_cast<const uint8_t*>(xq), nullptr, M, K, ldx, KT, (N + 15) / 16};
  const int kblocks = (KT + kTilesPerBlock - 1) / kTilesPerBlock;
  const dim3 grid = gemv_grid(N, nt, splits);
  uint16_t* o = static_cast<uint16_t*>(out);
  const bool built = with_variant(M, nt, prefetch, [&](auto mb, auto ntc, auto pf) {
    constexpr int MB = decltype(mb)::value, NT = decltype(ntc)::value;
    constexpr bool PF = decltype(pf)::value;
    if (fp8) w8a8_kernel<true, MB, NT, PF><<<grid, kThreads, 0, st>>>(a, sa, sw, b, o, ws, counters, N, kblocks, splits);
    else w8a8_kernel<false, MB, NT, PF><<<grid, kThreads, 0, st>>>(a, sa, sw, b, o, ws, counters, N, kblocks, splits);
  });
  if (!built) return -5;
  return after_gemv(fp8 ? 3 : 2, ws, counters, splits, M, N, sa, sw, b, o, st);
}

// The weight in dtype out_kind (decode_math.h kOut*) into out [N][ldo]: -2 unsupported group size, -6 an out_kind
// other than 0, 1, 2.
int lb_w4_dequant(const void* w, const float* scale, const int8_t* zero, void* out, int N, int K, int KT, int groups,
                  int G, int ldo, int out_kind, cudaStream_t st) {
  if (G != 32 && G != 64 && G != 128 && G != 256) return -2;
  if (!out_kind_ok(out_kind)) return -6;
  W4Args a{static_cast<const uint8_t*>(w), scale, zero, nullptr, 0, K, 0, KT, groups, (N + 15) / 16};
  const int tiles = a.n16 * KT;
  w4_dequant_kernel<<<(tiles + kWarps - 1) / kWarps, kThreads, 0, st>>>(a, scale, N, G, out, ldo, out_kind);
  return int(cudaGetLastError());
}

int lb_w8_dequant(const void* w, const float* scale, void* out, int N, int K, int KT, int ldo, int out_kind,
                  cudaStream_t st) {
  if (!out_kind_ok(out_kind)) return -6;
  W8Args a{static_cast<const uint8_t*>(w), nullptr, nullptr, 0, K, 0, KT, (N + 15) / 16};
  const int tiles = a.n16 * KT;
  w8_dequant_kernel<<<(tiles + kWarps - 1) / kWarps, kThreads, 0, st>>>(a, scale, N, out, ldo, out_kind);
  return int(cudaGetLastError());
}

int lb_act_quant(const void* x, int M, int K, int ldx, int fp8, void* codes, float* scales, cudaStream_t st) {
  act_quant_kernel<<<M, 256, 0, st>>>(static_cast<const uint16_t*>(x), K, ldx, fp8, static_cast<uint8_t*>(codes), scales);
  return int(cudaGetLastError());
}

}  // extern "C"
