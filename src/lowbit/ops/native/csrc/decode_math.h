// The per-element and per-lane arithmetic of lowbit's native decode kernels (decode_kernels.cu),
// written once for both compilers: nvcc builds the kernels from it, g++ builds the CPU twin
// (host_twin.cpp) that runs the same warp program lane by lane, so CI tests the kernels' logic
// without a GPU. Everything here is exact (integers, bit moves) or has one stated rounding.
//
// Tile geometry (the weight is the mma's A operand, the activations its B operand: out^T = W x^T):
//   a warp tile is 16 weight rows x KT codes; each lane loads its 16 bytes of it with one 128-bit
//   load (KT = 64 for 4-bit codes, 32 for 8-bit ones), and a warp's 32 loads are 512 contiguous
//   bytes (lowbit.ops.native.layout arranges the weight so). Lane l = 4g + t (g = l / 4, t = l % 4).
//   mma.m16n8k16 (bf16): A regs r = 0..3 hold rows g + 8(r & 1); the mma's k index kappa maps to the
//   physical k of step j as kappa = 2t + h -> 16j + 4t + h, kappa = 2t + 8 + h -> 16j + 4t + 2 + h,
//   so each lane's activations of a step are 4 consecutive values (one 8-byte load).
//   mma.m16n8k32 (s8 / e4m3): A regs r hold rows g + 8(r & 1), bytes b = 0..3 at
//   kappa = 4t + b (r < 2) -> 8t + b and kappa = 16 + 4t + b (r >= 2) -> 8t + 4 + b.
#pragma once
#include <stdint.h>

#include <cmath>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#define LB_HD __host__ __device__ __forceinline__
#define LB_UNROLL _Pragma("unroll")
#else
#define LB_HD inline
#define LB_UNROLL
#endif

namespace lowbit_native {

constexpr int kWarps = 8;         // warps per CTA: each takes every 8th k-block of the CTA's K range
constexpr int kTileN = 16;        // weight rows per warp tile
constexpr int kTileK4 = 64;       // 4-bit codes per tile row (one 16-byte load per lane)
constexpr int kTileK8 = 32;       // 8-bit codes per tile row

LB_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u; std::memcpy(&u, &f, 4); return u;
#endif
}

LB_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f; std::memcpy(&f, &u, 4); return f;
#endif
}

// CUDA's __byte_perm(x, y, s): result byte i = byte (s >> 4i) & 7 of the 8-byte value y:x.
LB_HD uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, y, s);
#else
  uint64_t v = (uint64_t(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
#endif
}

// float -> bf16 bits, round to nearest even (NaN stays a quiet NaN).
LB_HD uint16_t bf16_rn(float f) {
#if defined(__CUDA_ARCH__)
  __nv_bfloat16 h = __float2bfloat16_rn(f);
  return *reinterpret_cast<uint16_t*>(&h);
#else
  uint32_t u = f32_bits(f);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu)) return uint16_t((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
#endif
}

LB_HD float bf16_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }

// ---- 4-bit weights -> bf16 ------------------------------------------------------------------
// Register r of a k16 step is (nibble r, nibble r + 4) of the lane's word for that step; offset
// binary u = code + 8. OR-ing u into the mantissa of bf16 128.0 (0x4300: mantissa step 1) gives
// 128 + u exactly: one shift and one LOP3 per pair.
LB_HD uint32_t w4_pair_biased(uint32_t word, int r) { return ((word >> (4 * r)) & 0x000F000Fu) | 0x43004300u; }

// The bf16x2 constant subtracted from a biased pair of a row with zero point z (0 when
// symmetric): 128 + 8 + z, an integer in 128..143, exact in bf16.
LB_HD uint32_t w4_offset(int z) {
  uint32_t h = f32_bits(float(136 + z)) >> 16;
  return h | (h << 16);
}

// a - b for bf16x2 a, b whose difference is exactly representable (the integers code - z, |.| <= 15):
// no rounding happens, so the device's HSUB2 and the host's float subtraction agree bit for bit.
LB_HD uint32_t bf16x2_sub_exact(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
#else
  float lo = bf16_f32(uint16_t(a)) - bf16_f32(uint16_t(b));
  float hi = bf16_f32(uint16_t(a >> 16)) - bf16_f32(uint16_t(b >> 16));
  return (f32_bits(lo) >> 16) | (f32_bits(hi) & 0xFFFF0000u);
#endif
}

// The four A registers (bf16x2, exact code - z) of one k16 step from the lane's word:
// regs 0, 2 are row g (offset og), regs 1, 3 row g + 8 (offset og8).
LB_HD void w4_step_regs(uint32_t word, uint32_t og, uint32_t og8, uint32_t a[4]) {
  a[0] = bf16x2_sub_exact(w4_pair_biased(word, 0), og);
  a[1] = bf16x2_sub_exact(w4_pair_biased(word, 1), og8);
  a[2] = bf16x2_sub_exact(w4_pair_biased(word, 2), og);
  a[3] = bf16x2_sub_exact(w4_pair_biased(word, 3), og8);
}

// ---- 8-bit weights -> bf16 (W8A16) ------------------------------------------------------------
// Byte i of a word (int8 c) as float32 exactly: PRMT puts c + 128 (the XOR with 0x80) under the
// exponent of 2^23, one FADD removes 2^23 + 128. An integer |c| <= 128 has <= 8 significant bits,
// so its float32's upper half is its bf16: one more PRMT packs two of them.
LB_HD float w8_value(uint32_t word, int i) {
  return bits_f32(byte_perm(word ^ 0x80808080u, 0x4B000000u, 0x7440u + uint32_t(i))) - 8388736.0f;
}

LB_HD uint32_t w8_pair_bf16(uint32_t word, int i) {
  return byte_perm(f32_bits(w8_value(word, i)), f32_bits(w8_value(word, i + 1)), 0x7632u);
}

// Step s (0, 1) of a k32 tile as bf16 A registers: the lane's words q[0..3] are (row g, k 8t..8t+3),
// (row g+8, same k), (row g, k 8t+4..8t+7), (row g+8, same); step s reads words 2s, 2s + 1.
LB_HD void w8_step_regs(const uint32_t q[4], int s, uint32_t a[4]) {
  a[0] = w8_pair_bf16(q[2 * s], 0);
  a[1] = w8_pair_bf16(q[2 * s + 1], 0);
  a[2] = w8_pair_bf16(q[2 * s], 2);
  a[3] = w8_pair_bf16(q[2 * s + 1], 2);
}

// ---- activation quantization (per token), lowbit.quantize's arithmetic ------------------------
// int8: s = amax / 127 (IEEE division; 1.0 where it is 0), q = clamp(round_half_even(x / s), -127, 127).
LB_HD float act_scale(float amax, float qmax) {
#if defined(__CUDA_ARCH__)
  float s = __fdiv_rn(amax, qmax);
#else
  float s = amax / qmax;
#endif
  return s == 0.0f ? 1.0f : s;
}

LB_HD int8_t act_code_int8(float x, float s) {
#if defined(__CUDA_ARCH__)
  int q = __float2int_rn(__fdiv_rn(x, s));
#else
  int q = int(std::nearbyint(x / s));   // the default rounding mode: to nearest, ties to even
#endif
  return int8_t(q > 127 ? 127 : (q < -127 ? -127 : q));
}

// fp8 e4m3fn: s = amax / 448, code = e4m3(x / s) rounded to nearest even, saturated to +-448.
LB_HD uint8_t e4m3_satfinite(float v) {
#if defined(__CUDA_ARCH__)
  return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
#else
  uint32_t u = f32_bits(v);
  uint8_t sign = uint8_t((u >> 24) & 0x80);
  float a = std::fabs(v);
  if (std::isnan(a)) return uint8_t(sign | 0x7F);
  if (a >= 464.0f) return uint8_t(sign | 0x7E);          // past the midpoint of 448 and 480: saturate
  // the grid step where a lies: 2^(e - 3) for normals (e >= -6), 2^-9 for subnormals
  int e; std::frexp(a, &e);                               // a = m 2^e, m in [0.5, 1)
  int ex = e - 1 < -6 ? -6 : e - 1;
  float step = std::ldexp(1.0f, ex - 3);
  float q = std::nearbyint(a / step) * step;              // a / step exact (power of two), ties to even
  if (q == 0.0f) return sign;
  if (q >= 448.0f) return uint8_t(sign | 0x7E);
  int qe; std::frexp(q, &qe);
  int be = qe - 1 + 7;                                    // biased exponent
  if (be <= 0) return uint8_t(sign | uint8_t(std::lrint(q / std::ldexp(1.0f, -9))));
  int man = int(std::lrint((q / std::ldexp(1.0f, qe - 1) - 1.0f) * 8.0f));
  return uint8_t(sign | (be << 3) | man);
#endif
}

LB_HD uint8_t act_code_fp8(float x, float s) {
#if defined(__CUDA_ARCH__)
  return e4m3_satfinite(__fdiv_rn(x, s));
#else
  return e4m3_satfinite(x / s);
#endif
}

// ---- epilogues (each product rounded once; never contracted into an FMA) ----------------------
LB_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;      // host twin is built with -ffp-contract=off
#endif
}

LB_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// W4A16: a group's float32 dot (exact weights code - z) times its scale, added to the running sum
// in one rounding: acc = fma(partial, scale, acc).
LB_HD float w4_fold(float acc, float partial, float scale) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(partial, scale, acc);
#else
  return std::fma(partial, scale, acc);
#endif
}

// A layer's optional bias [N], added to the scaled float32 sum in one float32 addition just before the
// bf16 rounding (a separate rounding from the scale products: never contracted into an FMA). kind:
// kBiasNone, kBiasF32 (float32 values) or kBiasBF16 (bfloat16 values, exact in float32).
constexpr int kBiasNone = 0, kBiasF32 = 1, kBiasBF16 = 2;

struct Bias {
  const void* p;
  int kind;
  LB_HD float add(float y, int n) const {
    if (kind == kBiasNone) return y;
    const float b = kind == kBiasF32 ? static_cast<const float*>(p)[n] : bf16_f32(static_cast<const uint16_t*>(p)[n]);
    return add_rn(y, b);
  }
};

// The C entry points refuse a bias kind they do not know, or a kind without values.
LB_HD bool bias_ok(const void* p, int kind) { return kind == kBiasNone || ((kind == kBiasF32 || kind == kBiasBF16) && p); }

// W4A16: bf16(acc [+ bias[n]]).  W8A16: bf16(acc * sw[n] [+ bias[n]]).  W8A8: bf16((float(acc) * sa[m]) *
// sw[n] [+ bias[n]]) (int32 acc: float(acc) is exact while |acc| <= 2^24, else one rounding; fp8: acc is
// already float32).
LB_HD uint16_t out_w4a16(float acc, const Bias& b, int n) { return bf16_rn(b.add(acc, n)); }
LB_HD uint16_t out_w8a16(float acc, float sw, const Bias& b, int n) { return bf16_rn(b.add(mul_rn(acc, sw), n)); }
LB_HD uint16_t out_w8a8(float acc, float sa, float sw, const Bias& b, int n) {
  return bf16_rn(b.add(mul_rn(mul_rn(acc, sa), sw), n));
}

// ---- dequantized weights (the large-M path: a float GEMM on them) -------------------------------
// out = dtype(value * scale): one float32 product, then one rounding to the output dtype (none for float32).
constexpr int kOutF32 = 0, kOutBF16 = 1, kOutF16 = 2;

// float -> fp16 bits, round to nearest even (overflow to inf; NaN stays a quiet NaN).
LB_HD uint16_t f16_rn(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  const uint32_t x = f32_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return uint16_t(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u : 0u));
  if (ax >= 0x477FF000u) return uint16_t(sign | 0x7C00u);           // >= 65520: past the midpoint above 65504
  if (ax < 0x38800000u)                                              // below 2^-14: a subnormal step of 2^-24
    return uint16_t(sign | uint32_t(std::nearbyint(bits_f32(ax) * 16777216.0f)));   // exact scaling, RNE
  const uint32_t r = ax + 0xFFFu + ((ax >> 13) & 1u) - 0x38000000u;  // RNE on 13 bits, exponent 127 -> 15
  return uint16_t(sign | (r >> 13));
#endif
}

LB_HD void store_out(void* out, size_t i, float v, int kind) {
  if (kind == kOutF32) static_cast<float*>(out)[i] = v;
  else static_cast<uint16_t*>(out)[i] = kind == kOutBF16 ? bf16_rn(v) : f16_rn(v);
}

LB_HD bool out_kind_ok(int kind) { return kind == kOutF32 || kind == kOutBF16 || kind == kOutF16; }

// ---- work split ---------------------------------------------------------------------------------
// The K range is cut into k-blocks (max(tile k, group)); split s of S takes k-blocks
// [s * per, min((s + 1) * per, kblocks)), per = ceil(kblocks / S); warp w of the CTA takes that range's
// k-blocks w, w + 8, ... in increasing order.
LB_HD int split_begin(int kblocks, int splits, int s) {
  int per = (kblocks + splits - 1) / splits;
  int b = s * per;
  return b < kblocks ? b : kblocks;
}

// Where the fp32 / int32 accumulator element q (0..3) of mma column block b sits in the output tile:
// row n (0..15) of the weight tile and activation row m (0..15).
LB_HD int acc_n(int lane, int q) { return (lane >> 2) + 8 * (q >> 1); }
LB_HD int acc_m(int lane, int b, int q) { return 8 * b + 2 * (lane & 3) + (q & 1); }

}  // namespace lowbit_native
