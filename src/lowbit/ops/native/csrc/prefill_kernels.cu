// lowbit's native prefill GEMMs for Hopper (sm_90a), built with CUTLASS 3.x (warp-specialized TMA + WGMMA
// kernels, persistent tile scheduler), bf16 output [M, N] row-major:
//   lb_fp8_rowwise_gemm    e4m3 A [M, K] x e4m3 B [N, K] (both K-major), one float32 scale per row of A (sa [M])
//                          and per row of B (sb [N])
//   lb_fp8_blockwise_gemm  the same operands with a scale per 1x128 group of A (sa, M-major: sa_t[kb * ld_sa + m])
//                          and per 128x128 block of B (sb [ceil(N/128), K/128], K-major: lowbit's "fp8 block128")
// Kept out of decode_kernels.cu: CUTLASS's headers and instantiations take about two minutes to compile.
//
// Rounding order (what the float64 reference and its tolerance are derived from):
//   The fp8 tensor core sums each 32-wide k step's exact products into its accumulator with reduced precision
//   (lowbit's "fp8_fast" accumulator model: 13 fraction bits kept per step).
//   Row-wise, precise configs: the tensor-core sum of every 128 products (4 k steps) starts from zero and is then
//          added to a float32 accumulator (CUTLASS's GmmaFP8Accumulation, promotion interval 4), as
//          torch._scaled_mm(use_fast_accum=False) and lowbit's Triton fp8 GEMM (precise=True) do.
//   Row-wise, fast-accumulation configs: the tensor-core accumulator runs over the whole K.
//   Epilogue (row-wise): out = bf16_rn(((acc * sa[m]) * sb[n]) + bias[n]): two float32 multiplies, each rounded
//          (__fmul_rn: never contracted into an FMA), then one float32 addition (__fadd_rn), then one rounding
//          to bf16. Without a bias the addition is of +0.0f, which changes no value (a -0.0 output becomes +0.0).
//   Block-wise: per 128-wide k block, the tensor-core sum of its 128 products starts from zero; s = sa[m, kb] *
//          sb[n/128, kb] is rounded to float32, then acc += sum * s (CUTLASS's promotion; nvcc may contract it into
//          one FMA: one or two float32 roundings). Epilogue: out = bf16_rn(acc + bias[n]) (float32 addition, +0.0f
//          without a bias).
// The k blocks are summed in increasing k within a CTA's tile; no split-K (each output has one CTA).
//
// Constraints the C side refuses (lowbit.ops.native.prefill checks them first, with the fix): M, N, K > 0;
// K % 16 == 0 (row-wise: 16-byte TMA rows of A and B), K % 128 == 0 (block-wise: whole scale groups);
// N % 16 == 0 (16-byte bf16 output rows, 16-byte sb / bias vectors); ld_sa >= M and ld_sa % 4 == 0 (the scale
// rows of A are read with TMA, whose strides are multiples of 16 bytes). Every pointer is 16-byte aligned.
//
// Configurations (the `config` argument; lowbit.ops.native.prefill.ROWWISE_CONFIGS / BLOCKWISE_CONFIGS describe
// them): a few tile shapes for M >= 1024, for a GPU sweep to time. Each is one CUTLASS instantiation (the six
// build in about two minutes on 2 CPU cores; CI compiles them all).
#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cute/tensor.hpp"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace lowbit_prefill {

using namespace cute;
namespace ep = cutlass::epilogue;
namespace fu = cutlass::epilogue::fusion;

// ---- epilogue arithmetic in the documented order: explicit round-to-nearest operations that nvcc never
// contracts into an FMA (a contraction would drop a rounding the tolerance counts on) ------------------------
struct MulRnOp {
  CUTLASS_DEVICE static float apply(float a, float b) { return __fmul_rn(a, b); }
};
struct AddRnOp {
  CUTLASS_DEVICE static float apply(float a, float b) { return __fadd_rn(a, b); }
};
template <class Op, class T>
struct Elementwise {   // CUTLASS's Sm90Compute applies its ComputeFn to whole fragments (Array<float, N>)
  CUTLASS_DEVICE T operator()(T a, T b) const { return Op::apply(a, b); }
};
template <class Op, int N>
struct Elementwise<Op, cutlass::Array<float, N>> {
  CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& a,
                                                     cutlass::Array<float, N> const& b) const {
    cutlass::Array<float, N> r;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) r[i] = Op::apply(a[i], b[i]);
    return r;
  }
};
template <class T>
using MulRn = Elementwise<MulRnOp, T>;
template <class T>
using AddRn = Elementwise<AddRnOp, T>;

using E4M3 = cutlass::float_e4m3_t;
using BF16 = cutlass::bfloat16_t;
constexpr int kAlignAB = 16;   // e4m3 elements per 16-byte access
constexpr int kAlignD = 8;     // bf16 elements per 16-byte access
constexpr auto kRN = cutlass::FloatRoundStyle::round_to_nearest;

template <class Tile>
using RowVec = fu::Sm90RowBroadcast<0, Tile, float, float, Stride<_0, _1, int64_t>, 4>;   // v[n]; nullptr reads 0
template <class Tile>
using ColVec = fu::Sm90ColBroadcast<0, Tile, float, float, Stride<_1, _0, int64_t>, 1>;   // v[m], any M
using Mul = fu::Sm90Compute<MulRn, float, float, kRN>;
using AddToBF16 = fu::Sm90Compute<AddRn, BF16, float, kRN>;

// bf16_rn(((acc * sa[m]) * sb[n]) + bias[n])
template <class Tile>
using RowwiseEpilogue =
    fu::Sm90EVT<AddToBF16, fu::Sm90EVT<Mul, fu::Sm90EVT<Mul, fu::Sm90AccFetch, ColVec<Tile>>, RowVec<Tile>>, RowVec<Tile>>;
// bf16_rn(acc + bias[n])
template <class Tile>
using BiasEpilogue = fu::Sm90EVT<AddToBF16, fu::Sm90AccFetch, RowVec<Tile>>;

template <class Tile, class Cluster, class EpiSchedule, class Fusion>
using Epilogue = typename ep::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster, ep::collective::EpilogueTileAuto, float, float,
    void, cutlass::layout::RowMajor, kAlignD, BF16, cutlass::layout::RowMajor, kAlignD, EpiSchedule,
    Fusion>::CollectiveOp;

template <class Tile, class Cluster, class KernelSchedule, class EpiSchedule, class LayoutA, class LayoutB, class Fusion>
struct GemmOf {
  using CollectiveEpilogue = Epilogue<Tile, Cluster, EpiSchedule, Fusion>;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, E4M3, LayoutA, kAlignAB, E4M3, LayoutB, kAlignAB, float, Tile,
      Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

namespace sched = cutlass::gemm;
using Coop = ep::TmaWarpSpecializedCooperative;
using Ping = ep::TmaWarpSpecialized;

template <class Tile, class Cluster, class KernelSchedule, class EpiSchedule>
using Rowwise = GemmOf<Tile, Cluster, KernelSchedule, EpiSchedule, cutlass::layout::RowMajor,
                       cutlass::layout::ColumnMajor, RowwiseEpilogue<Tile>>;

// Scales per 1 x 128 of A (M-major) and per 128 x 128 of B (K-major: lowbit's layout, as CUTLASS's example 67).
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, GMMA::Major::MN, GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

template <class Tile, class Cluster, class KernelSchedule, class EpiSchedule>
using Blockwise = GemmOf<Tile, Cluster, KernelSchedule, EpiSchedule, cute::tuple<cutlass::layout::RowMajor, LayoutSFA>,
                         cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>, BiasEpilogue<Tile>>;

// The configurations (keep lowbit.ops.native.prefill's tables in step).
using T128 = Shape<_128, _128, _128>;
using T256 = Shape<_128, _256, _128>;
using C11 = Shape<_1, _1, _1>;
using C21 = Shape<_2, _1, _1>;
using C12 = Shape<_1, _2, _1>;
using Row0 = Rowwise<T128, C11, sched::KernelTmaWarpSpecializedCooperative, Coop>;             // precise
using Row1 = Rowwise<T128, C21, sched::KernelTmaWarpSpecializedCooperative, Coop>;             // precise
using Row2 = Rowwise<T256, C21, sched::KernelTmaWarpSpecializedCooperativeFP8FastAccum, Coop>; // fast accumulation
using Row3 = Rowwise<T128, C21, sched::KernelTmaWarpSpecializedPingpongFP8FastAccum, Ping>;    // fast accumulation
using Block0 = Blockwise<T128, C11, sched::KernelTmaWarpSpecializedCooperativeFP8Blockwise, Coop>;
using Block1 = Blockwise<T128, C12, sched::KernelTmaWarpSpecializedCooperativeFP8Blockwise, Coop>;
constexpr int kRowConfigs = 4, kBlockConfigs = 2;

enum Refusal : int {
  kBadShape = -1,        // M, N or K not positive
  kBadAlignment = -2,    // K or N not a multiple the kernels need (header comment)
  kBadConfig = -3,       // config outside the table
  kBadScaleStride = -4,  // ld_sa < M or not a multiple of 4
  kCannotImplement = -5, // CUTLASS's can_implement refused the problem
  kNeedsWorkspace = -6,  // the kernel asks for a workspace (none is passed)
  kLaunchFailed = -7,    // CUTLASS's initialize / run failed without a CUDA error
};

template <class G>
int launch(typename G::Gemm::Arguments const& args, cudaStream_t st) {
  typename G::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return kCannotImplement;
  if (G::Gemm::get_workspace_size(args) != 0) return kNeedsWorkspace;
  cutlass::Status s = gemm(args, nullptr, st);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return int(err);
  return s == cutlass::Status::kSuccess ? 0 : kLaunchFailed;
}

template <class G>
int rowwise(const void* a, const void* b, const float* sa, const float* sb, const float* bias, void* out, int M, int N,
            int K, cudaStream_t st) {
  using Gemm = typename G::Gemm;
  auto sA = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideA{}, make_shape(M, K, 1));
  auto sB = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideB{}, make_shape(N, K, 1));
  auto sD = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideD{}, make_shape(M, N, 1));
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {M, N, K, 1},
                                {static_cast<const E4M3*>(a), sA, static_cast<const E4M3*>(b), sB},
                                {{}, nullptr, sD, static_cast<BF16*>(out), sD}};
  // EVT arguments nest as the tree: {children..., node}
  args.epilogue.thread = {{{{}, {sa}, {}}, {sb}, {}}, {bias}, {}};
  return launch<G>(args, st);
}

template <class G>
int blockwise(const void* a, const void* b, const float* sa_t, int ld_sa, const float* sb, const float* bias, void* out,
              int M, int N, int K, cudaStream_t st) {
  using Gemm = typename G::Gemm;
  auto sA = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideA{}, make_shape(M, K, 1));
  auto sB = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideB{}, make_shape(N, K, 1));
  auto sD = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideD{}, make_shape(M, N, 1));
  // The A scales' layout over ld_sa rows (rows M..ld_sa-1 are padding, only ever read for rows past M);
  // the B scales' over N.
  LayoutSFA lsa = ScaleConfig::tile_atom_to_shape_SFA(make_shape(ld_sa, N, K, 1));
  LayoutSFB lsb = ScaleConfig::tile_atom_to_shape_SFB(make_shape(M, N, K, 1));
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {M, N, K, 1},
                                {static_cast<const E4M3*>(a), sA, static_cast<const E4M3*>(b), sB, sa_t, lsa, sb, lsb},
                                {{}, nullptr, sD, static_cast<BF16*>(out), sD}};
  args.epilogue.thread = {{}, {bias}, {}};
  return launch<G>(args, st);
}

}  // namespace lowbit_prefill

using namespace lowbit_prefill;

// The return value is a cudaError_t (0: launched) or one of the negative Refusal codes.
extern "C" {

int lb_prefill_abi_version() { return 1; }

// The number of configurations of the row-wise (blockwise = 0) or block-wise (1) kernel.
int lb_prefill_configs(int blockwise) { return blockwise ? kBlockConfigs : kRowConfigs; }

int lb_fp8_rowwise_gemm(const void* a, const void* b, const float* sa, const float* sb, const float* bias, void* out,
                        int M, int N, int K, int config, cudaStream_t st) {
  if (M < 1 || N < 1 || K < 1) return kBadShape;
  if (K % 16 || N % 16) return kBadAlignment;
  switch (config) {
    case 0: return rowwise<Row0>(a, b, sa, sb, bias, out, M, N, K, st);
    case 1: return rowwise<Row1>(a, b, sa, sb, bias, out, M, N, K, st);
    case 2: return rowwise<Row2>(a, b, sa, sb, bias, out, M, N, K, st);
    case 3: return rowwise<Row3>(a, b, sa, sb, bias, out, M, N, K, st);
    default: return kBadConfig;
  }
}

int lb_fp8_blockwise_gemm(const void* a, const void* b, const float* sa_t, int ld_sa, const float* sb, const float* bias,
                          void* out, int M, int N, int K, int config, cudaStream_t st) {
  if (M < 1 || N < 1 || K < 1) return kBadShape;
  if (K % 128 || N % 16) return kBadAlignment;
  if (ld_sa < M || ld_sa % 4) return kBadScaleStride;
  switch (config) {
    case 0: return blockwise<Block0>(a, b, sa_t, ld_sa, sb, bias, out, M, N, K, st);
    case 1: return blockwise<Block1>(a, b, sa_t, ld_sa, sb, bias, out, M, N, K, st);
    default: return kBadConfig;
  }
}

}  // extern "C"
