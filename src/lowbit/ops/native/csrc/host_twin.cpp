// The CPU twin of decode_kernels.cu: every CTA's warps run decode_warp.h's programs with all 32 lanes
// in lock step, and each mma instruction is emulated from the PTX ISA's fragment layouts (written here
// from the ISA tables, independently of decode_math.h's choice of which k each lane holds). Built with
// g++ -O2 -ffp-contract=off (no FMA contraction: the device code rounds each step as written).
// Inside one mma the emulation adds the 16 (32) products in k order in float32; the tensor core's
// internal order is unspecified, so the twin matches the GPU bit for bit on the integer path (W8A8
// int8) and on everything around the mma (layout, decode, scales, folds, reductions) elsewhere.
#include <cstdlib>
#include <vector>

#include "decode_warp.h"

using namespace lowbit_native;

namespace {

float e4m3_value(uint8_t c) {
  int e = (c >> 3) & 15, m = c & 7;
  float v = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
  if (e == 15 && m == 7) v = NAN;
  return (c & 0x80) ? -v : v;
}

struct HostLanes {
  static constexpr int kLanes = 32;
  static int lane(int l) { return l; }
  static void load16(const void* p, uint32_t q[4]) { std::memcpy(q, p, 16); }
  static void loadw16(const void* p, uint32_t q[4]) { std::memcpy(q, p, 16); }
  static void load8(const void* p, uint32_t q[2]) { std::memcpy(q, p, 8); }
  static float loadf(const float* p) { return *p; }

  // One mma.sync m16n8kKD row.col with E elements of 32 / E bits per register, from the PTX ISA's
  // fragment tables: A element y of register r of lane 4g + t is (row g + 8 (r & 1), kappa E t + y +
  // KD/2 (r >> 1)); B element y of register r of lane 4 col + t is kappa E t + y + KD/2 r; C element q of
  // lane 4g + t is (row g + 8 (q >> 1), col 2t + (q & 1)). bf16: KD 16, E 2; s8 / e4m3: KD 32, E 4.
  // D = C + the KD products added in kappa order.
  template <int KD, int E, class T, class Decode>
  static void mma(const uint32_t (&a)[32][4], const uint32_t (&b)[32][2], T (&c)[32][4], Decode dec) {
    constexpr int bits = 32 / E;
    T A[16][KD], B[KD][8];
    for (int l = 0; l < 32; ++l) {
      int g = l >> 2, t = l & 3;
      for (int r = 0; r < 4; ++r)
        for (int y = 0; y < E; ++y) A[g + 8 * (r & 1)][E * t + y + KD / 2 * (r >> 1)] = dec(a[l][r] >> (bits * y));
      for (int r = 0; r < 2; ++r)
        for (int y = 0; y < E; ++y) B[E * t + y + KD / 2 * r][g] = dec(b[l][r] >> (bits * y));
    }
    for (int l = 0; l < 32; ++l)
      for (int q = 0; q < 4; ++q) {
        int row = (l >> 2) + 8 * (q >> 1), col = 2 * (l & 3) + (q & 1);
        T s = c[l][q];
        for (int k = 0; k < KD; ++k) s += A[row][k] * B[k][col];
        c[l][q] = s;
      }
  }
  static void mma_bf16(const uint32_t (&a)[32][4], const uint32_t (&b)[32][2], float (&c)[32][4]) {
    mma<16, 2>(a, b, c, [](uint32_t v) { return bf16_f32(uint16_t(v)); });
  }
  static void mma_s8(const uint32_t (&a)[32][4], const uint32_t (&b)[32][2], int32_t (&c)[32][4]) {
    mma<32, 4>(a, b, c, [](uint32_t v) { return int32_t(int8_t(uint8_t(v))); });
  }
  static void mma_e4m3(const uint32_t (&a)[32][4], const uint32_t (&b)[32][2], float (&c)[32][4]) {
    mma<32, 4>(a, b, c, [](uint32_t v) { return e4m3_value(uint8_t(v)); });
  }
};

using HL = HostLanes;

// One CTA's 8 warps (acc zeroed, program run, stashed), then each tile element's warp sum, per row tile.
template <class T, int MB, int NT, class Run>
void run_cta(Run run, std::vector<T> (&tiles)[NT]) {
  std::vector<T> red[NT];
  for (auto& r : red) r.assign(kWarps * 256, T(0));
  for (int w = 0; w < kWarps; ++w) {
    T acc[NT][MB][32][4] = {};
    run(w, acc);
    for (int i = 0; i < NT; ++i)
      for (int l = 0; l < 32; ++l) cta_stash<T, MB, 32>(red[i].data(), w, acc[i], l, l);
  }
  for (int i = 0; i < NT; ++i) {
    tiles[i].resize(256);
    for (int e = 0; e < 256; ++e) tiles[i][e] = cta_sum(red[i].data(), e);
  }
}

// Runs every CTA (column of NT row tiles, split) and returns the splits' sums ws[s][m][n] for m < M, n < N.
template <class T, int MB, int NT, class Run>
std::vector<T> run_grid(int M, int N, int splits, Run run) {
  const int cols = (N + 16 * NT - 1) / (16 * NT);
  std::vector<T> ws(size_t(splits) * M * N), tiles[NT];
  for (int c = 0; c < cols; ++c)
    for (int s = 0; s < splits; ++s) {
      run_cta<T, MB, NT>([&](int w, T (&acc)[NT][MB][32][4]) { run(c * NT, s, w, acc); }, tiles);
      for (int i = 0; i < NT; ++i)
        for (int m = 0; m < M; ++m)
          for (int n = 0; n < 16 && (c * NT + i) * 16 + n < N; ++n)
            ws[(size_t(s) * M + m) * N + (c * NT + i) * 16 + n] = tiles[i][m * 16 + n];
    }
  return ws;
}

template <int G, int MB, int NT, bool PF>
void twin_w4(const W4Args& a, const Bias& b, uint16_t* out, int N, int splits) {
  const int kblocks = (a.KT + kTilesPerBlock - 1) / kTilesPerBlock;
  auto ws = run_grid<float, MB, NT>(a.M, N, splits, [&](int nt0, int s, int w, float (&acc)[NT][MB][32][4]) {
    w4_warp<HL, G, MB, NT, PF>(a, nt0, split_begin(kblocks, splits, s), split_begin(kblocks, splits, s + 1), w, acc);
  });
  const size_t mn = size_t(a.M) * N;
  for (size_t i = 0; i < mn; ++i) out[i] = out_w4a16(split_sum(ws.data() + i, splits, mn), b, int(i % N));
}

template <int MB, int NT, bool PF>
void twin_w8a16(const W8Args& a, const float* sw, const Bias& b, uint16_t* out, int N, int splits) {
  const int kblocks = (a.KT + kTilesPerBlock - 1) / kTilesPerBlock;
  auto ws = run_grid<float, MB, NT>(a.M, N, splits, [&](int nt0, int s, int w, float (&acc)[NT][MB][32][4]) {
    w8a16_warp<HL, MB, NT, PF>(a, nt0, split_begin(kblocks, splits, s), split_begin(kblocks, splits, s + 1), w, acc);
  });
  const size_t mn = size_t(a.M) * N;
  for (size_t i = 0; i < mn; ++i) out[i] = out_w8a16(split_sum(ws.data() + i, splits, mn), sw[i % N], b, int(i % N));
}

template <bool FP8, int MB, int NT, bool PF>
void twin_w8a8(const W8Args& a, const float* sa, const float* sw, const Bias& b, uint16_t* out, int N, int splits) {
  const int kblocks = (a.KT + kTilesPerBlock - 1) / kTilesPerBlock;
  const size_t mn = size_t(a.M) * N;
  if (FP8) {
    auto ws = run_grid<float, MB, NT>(a.M, N, splits, [&](int nt0, int s, int w, float (&acc)[NT][MB][32][4]) {
      int32_t unused[NT][MB][32][4] = {};
      w8a8_warp<HL, true, MB, NT, PF>(a, nt0, split_begin(kblocks, splits, s), split_begin(kblocks, splits, s + 1), w, acc,
                                      unused);
    });
    for (size_t i = 0; i < mn; ++i) out[i] = out_w8a8(split_sum(ws.data() + i, splits, mn), sa[i / N], sw[i % N], b, int(i % N));
  } else {
    auto ws = run_grid<int32_t, MB, NT>(a.M, N, splits, [&](int nt0, int s, int w, int32_t (&acc)[NT][MB][32][4]) {
      float unused[NT][MB][32][4] = {};
      w8a8_warp<HL, false, MB, NT, PF>(a, nt0, split_begin(kblocks, splits, s), split_begin(kblocks, splits, s + 1), w,
                                       unused, acc);
    });
    for (size_t i = 0; i < mn; ++i)
      out[i] = out_w8a8(float(split_sum(ws.data() + i, splits, mn)), sa[i / N], sw[i % N], b, int(i % N));
  }
}

}  // namespace

extern "C" {

// Return codes: 0 ok, 1 M outside 1..16, 2 unsupported group size, 3 splits < 1, 4 a bias_kind other than
// 0, 1, 2 (or one without a bias pointer), 5 nt not 1, 2, 4 or prefetch not 0, 1. bias, nt, prefetch: as
// decode_kernels.cu's entry points take them (the twin adds the splits as the reduce kernel does).
namespace {
int twin_check(int M, int splits, const void* bias, int bias_kind) {
  if (M < 1 || M > 16) return 1;
  if (splits < 1) return 3;
  if (!bias_ok(bias, bias_kind)) return 4;
  return 0;
}
}  // namespace

int lb_twin_w4a16(const uint8_t* w, const float* scale, const int8_t* zero, const uint16_t* x, uint16_t* out,
                  const void* bias, int M, int N, int K, int ldx, int KT, int groups, int G, int splits, int nt, int prefetch,
                  int bias_kind) {
  if (int bad = twin_check(M, splits, bias, bias_kind)) return bad;
  if (G != 32 && G != 64 && G != 128 && G != 256) return 2;
  W4Args a{w, scale, zero, x, M, K, ldx, KT, groups, (N + 15) / 16};
  const Bias b{bias, bias_kind};
  const bool built = with_variant(M, nt, prefetch, [&](auto mb, auto ntc, auto pf) {
    constexpr int MB = decltype(mb)::value, NT = decltype(ntc)::value;
    constexpr bool PF = decltype(pf)::value;
    switch (G) {
      case 32: twin_w4<32, MB, NT, PF>(a, b, out, N, splits); break;
      case 64: twin_w4<64, MB, NT, PF>(a, b, out, N, splits); break;
      case 128: twin_w4<128, MB, NT, PF>(a, b, out, N, splits); break;
      default: twin_w4<256, MB, NT, PF>(a, b, out, N, splits); break;
    }
  });
  return built ? 0 : 5;
}

int lb_twin_w8a16(const uint8_t* w, const float* sw, const uint16_t* x, uint16_t* out, const void* bias, int M, int N,
                  int K, int ldx, int KT, int splits, int nt, int prefetch, int bias_kind) {
  if (int bad = twin_check(M, splits, bias, bias_kind)) return bad;
  W8Args a{w, nullptr, x, M, K, ldx, KT, (N + 15) / 16};
  const Bias b{bias, bias_kind};
  const bool built = with_variant(M, nt, prefetch, [&](auto mb, auto ntc, auto pf) {
    twin_w8a16<decltype(mb)::value, decltype(ntc)::value, bool(decltype(pf)::value)>(a, sw, b, out, N, splits);
  });
  return built ? 0 : 5;
}

int lb_twin_w8a8(const uint8_t* w, const float* sw, const uint8_t* xq, const float* sa, uint16_t* out, const void* bias,
                 int M, int N, int K, int ldx, int KT, int splits, int nt, int prefetch, int fp8, int bias_kind) {
  if (int bad = twin_check(M, splits, bias, bias_kind)) return bad;
  W8Args a{w, xq, nullptr, M, K, ldx, KT, (N + 15) / 16};
  const Bias b{bias, bias_kind};
  const bool built = with_variant(M, nt, prefetch, [&](auto mb, auto ntc, auto pf) {
    constexpr int MB = decltype(mb)::value, NT = decltype(ntc)::value;
    constexpr bool PF = decltype(pf)::value;
    if (fp8) twin_w8a8<true, MB, NT, PF>(a, sa, sw, b, out, N, splits);
    else twin_w8a8<false, MB, NT, PF>(a, sa, sw, b, out, N, splits);
  });
  return built ? 0 : 5;
}

// Per-token activation quantization (decode_kernels.cu's act_quant): codes [M][K], scales [M].
int lb_twin_act_quant(const uint16_t* x, int M, int K, int ldx, int fp8, uint8_t* codes, float* scales) {
  for (int m = 0; m < M; ++m) {
    float amax = 0.0f;
    for (int k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(bf16_f32(x[size_t(m) * ldx + k])));
    const float s = act_scale(amax, fp8 ? 448.0f : 127.0f);
    scales[m] = s;
    for (int k = 0; k < K; ++k) {
      const float v = bf16_f32(x[size_t(m) * ldx + k]);
      codes[size_t(m) * K + k] = fp8 ? act_code_fp8(v, s) : uint8_t(act_code_int8(v, s));
    }
  }
  return 0;
}

// The weight dequantized through the kernels' own lane program (decode_warp.h w4_dequant_tile / w8_dequant_tile):
// out [N][ldo] in dtype out_kind. Return codes: 2 unsupported group size, 6 an out_kind other than 0, 1, 2.
int lb_twin_w4_dequant(const uint8_t* w, const float* scale, const int8_t* zero, void* out, int N, int K, int KT,
                       int groups, int G, int ldo, int out_kind) {
  if (G != 32 && G != 64 && G != 128 && G != 256) return 2;
  if (!out_kind_ok(out_kind)) return 6;
  const W4Args a{w, scale, zero, nullptr, 0, K, 0, KT, groups, (N + 15) / 16};
  for (int nt = 0; nt < a.n16; ++nt)
    for (int kt = 0; kt < KT; ++kt)
      for (int l = 0; l < 32; ++l)
        w4_dequant_tile<HL>(a, scale, N, nt, kt, l, G, [&](int r, int k, float v) {
          store_out(out, size_t(nt * kTileN + r) * ldo + kt * kTileK4 + k, v, out_kind);
        });
  return 0;
}

int lb_twin_w8_dequant(const uint8_t* w, const float* scale, void* out, int N, int K, int KT, int ldo, int out_kind) {
  if (!out_kind_ok(out_kind)) return 6;
  const W8Args a{w, nullptr, nullptr, 0, K, 0, KT, (N + 15) / 16};
  for (int nt = 0; nt < a.n16; ++nt)
    for (int kt = 0; kt < KT; ++kt)
      for (int l = 0; l < 32; ++l)
        w8_dequant_tile<HL>(a, scale, N, nt, kt, l, [&](int r, int k, float v) {
          store_out(out, size_t(nt * kTileN + r) * ldo + kt * kTileK8 + k, v, out_kind);
        });
  return 0;
}

}  // extern "C"
