// One warp's program of the native decode kernels, written once for the GPU (P = DeviceLanes in
// decode_kernels.cu: one lane per thread, the mma instructions) and for the CPU twin (P = HostLanes in
// host_twin.cpp: all 32 lanes in lock step, the mma emulated from the PTX fragment layouts). So the
// loop order, the loads, the decode and the folds the twin runs are the kernels' own.
//
// Summation order (fixed; the GPU's differs only inside one mma instruction, see each kernel):
//   warp w of CTA (n-tile, split s) runs the k-blocks kb = begin + w, begin + w + 8, ... < end
//   (split_begin) in increasing order; in each, 4 tiles in increasing k, each tile's k16 steps in
//   increasing k. The CTA then adds its 8 warps' sums in warp order, and the S splits' sums are added
//   in split order (split_sum), each a float32 addition (int32 for W8A8 int8: exact). A CTA of NT row
//   tiles and a warp that prefetches (with_variant) keep every output's order, so every variant gives
//   the same bits.
#pragma once
#include <type_traits>

#include "decode_math.h"

namespace lowbit_native {

constexpr int kTilesPerBlock = 4;   // tiles per k-block: 4 loads of 16 bytes in flight per lane

struct W4Args {
  const uint8_t* w;       // [N16][KT][32 lanes][16 bytes], KT = Kp / 64, N16 = n16
  const float* scale;     // [N16][groups][16]
  const int8_t* zero;     // [N16][groups][16] or nullptr (symmetric)
  const uint16_t* x;      // bf16 [M][ldx]
  int M, K, ldx, KT, groups, n16;
};

struct W8Args {
  const uint8_t* w;       // int8 / e4m3 codes [N16][KT][32 lanes][16 bytes], KT = Kp / 32
  const uint8_t* xq;      // W8A8: int8 / e4m3 codes [M][ldx]
  const uint16_t* x;      // W8A16: bf16 [M][ldx]
  int M, K, ldx, KT, n16;
};

// The lanes' 16 bytes of the 4 weight tiles of k-block kb of row tiles nt0 .. nt0 + NT - 1 (zeros past the
// last k tile or row tile), all loads issued before any is used.
template <class P, int NT>
LB_HD void load_block(const uint8_t* w, int KT, int n16, int nt0, int kb,
                      uint32_t (&words)[NT][kTilesPerBlock][P::kLanes][4]) {
  LB_UNROLL for (int i = 0; i < NT; ++i)
    LB_UNROLL for (int tt = 0; tt < kTilesPerBlock; ++tt) {
      const int kt = kb * kTilesPerBlock + tt;
      LB_UNROLL for (int l = 0; l < P::kLanes; ++l) {
        if (kt < KT && nt0 + i < n16) P::loadw16(w + (size_t(nt0 + i) * KT + kt) * 512 + P::lane(l) * 16, words[i][tt][l]);
        else words[i][tt][l][0] = words[i][tt][l][1] = words[i][tt][l][2] = words[i][tt][l][3] = 0;
      }
    }
}

// The weight stream of one warp: k-blocks kb = begin + warp, + kWarps, ... < end, each handed to
// body(kb, words) in increasing order. PF (prefetch): block kb + kWarps's loads are issued before block kb's
// body runs, so up to 8 tiles per lane are in flight; the blocks, their order and the arithmetic are the same.
template <class P, int NT, bool PF, class Body>
LB_HD void stream_blocks(const uint8_t* w, int KT, int n16, int nt0, int kb_begin, int kb_end, int warp, Body body) {
  constexpr int L = P::kLanes;
  uint32_t next[NT][kTilesPerBlock][L][4];
  if (PF && kb_begin + warp < kb_end) load_block<P, NT>(w, KT, n16, nt0, kb_begin + warp, next);
  for (int kb = kb_begin + warp; kb < kb_end; kb += kWarps) {
    uint32_t words[NT][kTilesPerBlock][L][4];
    if (PF) {
      LB_UNROLL for (int i = 0; i < NT; ++i)
        LB_UNROLL for (int tt = 0; tt < kTilesPerBlock; ++tt)
          LB_UNROLL for (int l = 0; l < L; ++l)
            LB_UNROLL for (int r = 0; r < 4; ++r) words[i][tt][l][r] = next[i][tt][l][r];
      if (kb + kWarps < kb_end) load_block<P, NT>(w, KT, n16, nt0, kb + kWarps, next);
    } else {
      load_block<P, NT>(w, KT, n16, nt0, kb, words);
    }
    body(kb, words);
  }
}

// Activation fragments: for each lane (g, t) and mma column block b, W words (16 or 8 bytes) of row
// m = 8b + g from k = k0 + per_t * t on; zeros past M or K (K is a multiple of per_t: the caller checks).
template <class P, int MB, int W, class T>
LB_HD void load_x(const T* x, int ldx, int M, int K, int k0, int per_t, uint32_t (&v)[MB][P::kLanes][W]) {
  LB_UNROLL for (int l = 0; l < P::kLanes; ++l) {
    const int lane = P::lane(l), k = k0 + per_t * (lane & 3);
    LB_UNROLL for (int b = 0; b < MB; ++b) {
      const int m = 8 * b + (lane >> 2);
      if (m < M && k < K) {
        if (W == 4) P::load16(x + size_t(m) * ldx + k, v[b][l]);
        else P::load8(x + size_t(m) * ldx + k, v[b][l]);
      } else {
        LB_UNROLL for (int i = 0; i < W; ++i) v[b][l][i] = 0;
      }
    }
  }
}

// acc[i][b][l][q] += this warp's W4A16 sums of row tile nt0 + i over its k-blocks (see the file comment).
// The NT row tiles share each step's activation fragments; each tile's sums are the NT = 1 program's.
template <class P, int G, int MB, int NT, bool PF>
LB_HD void w4_warp(const W4Args& a, int nt0, int kb_begin, int kb_end, int warp, float (&acc)[NT][MB][P::kLanes][4]) {
  constexpr int L = P::kLanes;
  stream_blocks<P, NT, PF>(a.w, a.KT, a.n16, nt0, kb_begin, kb_end, warp,
                           [&](int kb, const uint32_t (&words)[NT][kTilesPerBlock][L][4]) {
    float part[NT][MB][L][4];       // a group's partial sums (a group never spans two k-blocks: G <= 256)
    uint32_t og[NT][L], og8[NT][L];
    LB_UNROLL for (int tt = 0; tt < kTilesPerBlock; ++tt) {
      LB_UNROLL for (int j = 0; j < 4; ++j) {
        const int k0 = (kb * kTilesPerBlock + tt) * kTileK4 + 16 * j;
        const int grp = k0 / G;
        const bool live = grp < a.groups;   // padding tiles past the last group: x is 0 there
        uint32_t bfr[MB][L][2];
        load_x<P, MB, 2>(a.x, a.ldx, a.M, a.K, k0, 4, bfr);
        LB_UNROLL for (int i = 0; i < NT; ++i) {
          const int nt = nt0 + i;
          const bool row_live = live && nt < a.n16;
          if (k0 % G == 0) {                  // a group starts: its zero points, a fresh partial sum
            LB_UNROLL for (int l = 0; l < L; ++l) {
              const int g = P::lane(l) >> 2;
              const int8_t* z = a.zero + (size_t(nt) * a.groups + grp) * 16;
              og[i][l] = w4_offset(a.zero && row_live ? int(z[g]) : 0);
              og8[i][l] = w4_offset(a.zero && row_live ? int(z[g + 8]) : 0);
              LB_UNROLL for (int b = 0; b < MB; ++b)
                part[i][b][l][0] = part[i][b][l][1] = part[i][b][l][2] = part[i][b][l][3] = 0.0f;
            }
          }
          uint32_t afr[L][4];
          LB_UNROLL for (int l = 0; l < L; ++l) w4_step_regs(words[i][tt][l][j], og[i][l], og8[i][l], afr[l]);
          LB_UNROLL for (int b = 0; b < MB; ++b) P::mma_bf16(afr, bfr[b], part[i][b]);
          if ((k0 + 16) % G == 0 && row_live) {   // the group ends: acc = fma(partial, scale, acc)
            const float* s = a.scale + (size_t(nt) * a.groups + grp) * 16;
            LB_UNROLL for (int l = 0; l < L; ++l)
              LB_UNROLL for (int q = 0; q < 4; ++q) {
                const float sc = P::loadf(s + acc_n(P::lane(l), q));
                LB_UNROLL for (int b = 0; b < MB; ++b) acc[i][b][l][q] = w4_fold(acc[i][b][l][q], part[i][b][l][q], sc);
              }
          }
        }
      }
    }
  });
}

// W8A16: acc += the float32 mma sums of exact bf16 weights (int8 codes) times bf16 activations.
template <class P, int MB, int NT, bool PF>
LB_HD void w8a16_warp(const W8Args& a, int nt0, int kb_begin, int kb_end, int warp, float (&acc)[NT][MB][P::kLanes][4]) {
  constexpr int L = P::kLanes;
  stream_blocks<P, NT, PF>(a.w, a.KT, a.n16, nt0, kb_begin, kb_end, warp,
                           [&](int kb, const uint32_t (&words)[NT][kTilesPerBlock][L][4]) {
    LB_UNROLL for (int tt = 0; tt < kTilesPerBlock; ++tt) {
      const int k0 = (kb * kTilesPerBlock + tt) * kTileK8;
      uint32_t xv[MB][L][4];
      load_x<P, MB, 4>(a.x, a.ldx, a.M, a.K, k0, 8, xv);
      LB_UNROLL for (int s = 0; s < 2; ++s) {          // two k16 steps: k 8t..8t+3, then 8t+4..8t+7
        uint32_t bfr[MB][L][2];
        LB_UNROLL for (int l = 0; l < L; ++l)
          LB_UNROLL for (int b = 0; b < MB; ++b) { bfr[b][l][0] = xv[b][l][2 * s]; bfr[b][l][1] = xv[b][l][2 * s + 1]; }
        LB_UNROLL for (int i = 0; i < NT; ++i) {
          uint32_t afr[L][4];
          LB_UNROLL for (int l = 0; l < L; ++l) w8_step_regs(words[i][tt][l], s, afr[l]);
          LB_UNROLL for (int b = 0; b < MB; ++b) P::mma_bf16(afr, bfr[b], acc[i][b]);
        }
      }
    }
  });
}

// W8A8: int8 codes -> exact int32 sums in the mma's accumulator (FP8 = false, acc holds int32 bits);
// fp8 e4m3 -> each k32 tile's mma into a zero accumulator, then acc += it in float32 (FP8 = true): the
// tensor core's own fp8 accumulation is never trusted past one tile.
template <class P, bool FP8, int MB, int NT, bool PF>
LB_HD void w8a8_warp(const W8Args& a, int nt0, int kb_begin, int kb_end, int warp, float (&accf)[NT][MB][P::kLanes][4],
                     int32_t (&acci)[NT][MB][P::kLanes][4]) {
  constexpr int L = P::kLanes;
  stream_blocks<P, NT, PF>(a.w, a.KT, a.n16, nt0, kb_begin, kb_end, warp,
                           [&](int kb, const uint32_t (&words)[NT][kTilesPerBlock][L][4]) {
    LB_UNROLL for (int tt = 0; tt < kTilesPerBlock; ++tt) {
      const int k0 = (kb * kTilesPerBlock + tt) * kTileK8;
      uint32_t bfr[MB][L][2];
      load_x<P, MB, 2>(a.xq, a.ldx, a.M, a.K, k0, 8, bfr);
      LB_UNROLL for (int i = 0; i < NT; ++i)
        LB_UNROLL for (int b = 0; b < MB; ++b) {
          if (FP8) {
            float d[L][4];
            LB_UNROLL for (int l = 0; l < L; ++l) d[l][0] = d[l][1] = d[l][2] = d[l][3] = 0.0f;
            P::mma_e4m3(words[i][tt], bfr[b], d);
            LB_UNROLL for (int l = 0; l < L; ++l)
              LB_UNROLL for (int q = 0; q < 4; ++q) accf[i][b][l][q] = add_rn(accf[i][b][l][q], d[l][q]);
          } else {
            P::mma_s8(words[i][tt], bfr[b], acci[i][b]);
          }
        }
    }
  });
}

// The values a lane holds of tile (nt, kt) of a W4 weight: for each k16 step j, the four A registers
// w4_step_regs builds (exact code - z, the rows' zero points from `zero`, or 0), each bf16 value handed to
// emit(row in the tile 0..15, k in the tile 0..63, value) at the place the PTX fragment layout and
// decode_math.h's physical-k map give it. The dequantization and the CPU twin's weight check read the weight
// through this, the same registers the mma instructions see.
template <class Emit>
LB_HD void w4_lane_values(const uint32_t (&q)[4], int lane, int nt, int kt, int groups, int G, const int8_t* zero,
                          Emit emit) {
  const int g = lane >> 2, t = lane & 3;
  LB_UNROLL for (int j = 0; j < 4; ++j) {
    const int k0 = kt * kTileK4 + 16 * j, grp = k0 / G;
    const bool live = grp < groups;   // padding tiles past the last group: codes 0, no zero point
    const int8_t* z = zero && live ? zero + (size_t(nt) * groups + grp) * 16 : nullptr;
    uint32_t a[4];
    w4_step_regs(q[j], w4_offset(z ? z[g] : 0), w4_offset(z ? z[g + 8] : 0), a);
    LB_UNROLL for (int r = 0; r < 4; ++r)
      LB_UNROLL for (int h = 0; h < 2; ++h) {
        const int kappa = 2 * t + h + 8 * (r >> 1);
        emit(g + 8 * (r & 1), 16 * j + (kappa < 8 ? 4 * t + h : 4 * t + 2 + h), bf16_f32(uint16_t(a[r] >> (16 * h))));
      }
  }
}

// The same for a W8 tile (W8A16's two bf16 steps of exact int8 codes): k in the tile 0..31.
template <class Emit>
LB_HD void w8_lane_values(const uint32_t (&q)[4], int lane, Emit emit) {
  const int g = lane >> 2, t = lane & 3;
  LB_UNROLL for (int s = 0; s < 2; ++s) {
    uint32_t a[4];
    w8_step_regs(q, s, a);
    LB_UNROLL for (int r = 0; r < 4; ++r)
      LB_UNROLL for (int h = 0; h < 2; ++h) {
        const int kappa = 2 * t + h + 8 * (r >> 1);
        emit(g + 8 * (r & 1), 8 * t + 4 * s + (kappa < 8 ? h : 2 + h), bf16_f32(uint16_t(a[r] >> (16 * h))));
      }
  }
}

// Lane l's share of dequantizing tile (nt, kt): sink(r, k, value * its group's / row's float32 scale) for row r
// (0..15) and column k (0..tile k - 1) of the tile, one product each; elements past N or K are not handed over.
// The twin stores each value at once (store_out); the GPU stages the tile in shared memory and writes it out in
// rows (decode_kernels.cu), the same values.
template <class P, class Sink>
LB_HD void w4_dequant_tile(const W4Args& a, const float* scale, int N, int nt, int kt, int l, int G, Sink sink) {
  uint32_t q[4];
  P::loadw16(a.w + (size_t(nt) * a.KT + kt) * 512 + P::lane(l) * 16, q);
  w4_lane_values(q, P::lane(l), nt, kt, a.groups, G, a.zero, [&](int r, int k, float v) {
    const int n = nt * kTileN + r, kk = kt * kTileK4 + k;
    if (n < N && kk < a.K) sink(r, k, mul_rn(v, P::loadf(scale + (size_t(nt) * a.groups + kk / G) * 16 + r)));
  });
}

template <class P, class Sink>
LB_HD void w8_dequant_tile(const W8Args& a, const float* scale, int N, int nt, int kt, int l, Sink sink) {
  uint32_t q[4];
  P::loadw16(a.w + (size_t(nt) * a.KT + kt) * 512 + P::lane(l) * 16, q);
  w8_lane_values(q, P::lane(l), [&](int r, int k, float v) {
    const int n = nt * kTileN + r, kk = kt * kTileK8 + k;
    if (n < N && kk < a.K) sink(r, k, mul_rn(v, P::loadf(scale + n)));
  });
}

// The CTA's reduction: warp w stashes its accumulators at red[w][m][n] (16 x 16 per warp); element
// i = 16 m + n of the tile is then red[0] + red[1] + ... + red[7] in that order.
template <class T, int MB, int L>
LB_HD void cta_stash(T* red, int warp, const T (&acc)[MB][L][4], int l, int lane) {
  LB_UNROLL for (int b = 0; b < MB; ++b)
    LB_UNROLL for (int q = 0; q < 4; ++q) red[(warp * 16 + acc_m(lane, b, q)) * 16 + acc_n(lane, q)] = acc[b][l][q];
}

template <class T> LB_HD T cta_sum(const T* red, int i) {
  T s = red[i];
  LB_UNROLL for (int w = 1; w < kWarps; ++w) s += red[w * 256 + i];
  return s;
}

// The splits' sums of one output, ws[s * stride] for s = 0..S-1, added in split order; ld reads one
// partial (the device's fixup reads past L1, where other CTAs' writes are not seen).
template <class T, class Load> LB_HD T split_sum(const T* ws, int splits, size_t stride, Load ld) {
  T s = ld(ws);
  for (int k = 1; k < splits; ++k) s += ld(ws + k * stride);
  return s;
}

template <class T> LB_HD T split_sum(const T* ws, int splits, size_t stride) {
  return split_sum(ws, splits, stride, [](const T* p) { return *p; });
}

// Launch variants (the same sums, bit for bit): NT row tiles of 16 per CTA (1, 2 or 4: the tiles share
// each activation fragment, so M > 1 reads x NT times less) and PF (stream_blocks' prefetch). Calls
// f(MB, NT, PF) as std::integral_constant values (MB = 2 mma column blocks for M > 8); false for a
// variant not built.
template <int V> using IntC = std::integral_constant<int, V>;

template <class F> bool with_variant(int M, int nt, int prefetch, F f) {
  if (prefetch != 0 && prefetch != 1) return false;
  auto pf = [&](auto mb, auto ntc) {
    if (prefetch) f(mb, ntc, IntC<1>{});
    else f(mb, ntc, IntC<0>{});
  };
  auto tiles = [&](auto mb) {
    switch (nt) {
      case 1: pf(mb, IntC<1>{}); return true;
      case 2: pf(mb, IntC<2>{}); return true;
      case 4: pf(mb, IntC<4>{}); return true;
    }
    return false;
  };
  return M > 8 ? tiles(IntC<2>{}) : tiles(IntC<1>{});
}

}  // namespace lowbit_native
