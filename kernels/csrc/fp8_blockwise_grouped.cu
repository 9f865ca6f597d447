// Block-scaled FP8 grouped GEMM for the expert projections on Hopper, from CUTLASS's sm90 ptr-array kernels with
// blockwise scaling (the FP32 promotion every 128 of K that the HF FineGrainedFP8 / DeepSeek-V3 format needs).
//
//   out[r] = (a[r] * sa[r]) (w[e] * sw[e])^T   for the rows r in [offsets[e-1], offsets[e]) of each expert e
//   a: [rows, K] e4m3, sa: [rows, K/128] fp32 (1 x 128 groups), w: [E, N, K] e4m3,
//   sw: [E, K/128, N/128] fp32 (the checkpoint's 128 x 128 scale_inv [E, N/128, K/128], transposed: CUTLASS's sm90
//   blockwise mainloop reads scales M/N-major), out: [rows, N] bf16; rows at or past offsets[E-1] are left untouched.
//
// That mainloop also takes each group's scales as a packed [K/128, m] block (it rebuilds their layout from the
// problem shape, ignoring layout_SFA), so the activation scales are first regrouped into the workspace. The per-expert
// problem shapes, pointers and strides are written on the device too: no host synchronisation, and the launch is
// CUDA-graph capturable. A plain C interface, loaded with ctypes (kernels/cutlass_fp8.py): no dependence on the
// PyTorch C++ ABI.
#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

using namespace cute;

namespace moecompile_fp8 {

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using ElementAB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
constexpr int kAlignAB = 16;
constexpr int kAlignD = 8;

template <class TileShape, class ClusterShape, class MainloopSchedule, class EpilogueSchedule>
struct GroupedGemm {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor *, kAlignD,
      ElementD, cutlass::layout::RowMajor *, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB,
      cute::tuple<cutlass::layout::RowMajor *, LayoutSFA *>, kAlignAB, ElementAB,
      cute::tuple<cutlass::layout::ColumnMajor *, LayoutSFB *>, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// 128 x 128 x 128 tiles, two consumer warpgroups on each, clusters of 2 along N (CUTLASS's example 68): ping-pong
// 64 x 128 tiles and clusters of 2 along M were slower at the Mixtral, DeepSeek-V3 and Qwen3-MoE shapes (bar a tie).
using Cooperative = GroupedGemm<Shape<_128, _128, _128>, Shape<_1, _2, _1>,
                                cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                                cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

// The per-expert argument arrays, carved out of the caller's workspace.
template <class G>
struct Arrays {
  typename ProblemShape::UnderlyingProblemShape *shapes;
  const ElementAB **a;
  const ElementAB **w;
  ElementD **out;
  const float **sa;
  const float **sw;
  typename G::StrideA *stride_a;
  typename G::StrideB *stride_w;
  typename G::StrideD *stride_out;
  LayoutSFA *layout_sa;
  LayoutSFB *layout_sw;
  float *sa_grouped;  // rows x K/128
};

size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

template <class T>
void take_array(T *&field, char *base, size_t &used, int count) {
  if (base != nullptr) field = reinterpret_cast<T *>(base + used);
  used += align_up(sizeof(T) * count);
}

template <class G>
size_t carve(Arrays<G> *arrays, char *base, int experts, int rows, int kb) {
  size_t used = 0;
  auto take = [&](auto *&field) { take_array(field, base, used, experts); };
  take(arrays->shapes);
  take(arrays->a);
  take(arrays->w);
  take(arrays->out);
  take(arrays->sa);
  take(arrays->sw);
  take(arrays->stride_a);
  take(arrays->stride_w);
  take(arrays->stride_out);
  take(arrays->layout_sa);
  take(arrays->layout_sw);
  take_array(arrays->sa_grouped, base, used, rows * kb);
  return used;
}

// Activation scales [rows, kb] -> per expert group a packed M-major block [kb, m] at begin * kb. Dropped rows (at or
// past the last group's end) are skipped.
__global__ void regroup_row_scales(const float *sa, float *out, const int32_t *offsets, int experts, int rows,
                                   int kb) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  int lo = 0, hi = experts;  // the group of row r: the first e with offsets[e] > r
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (offsets[mid] > r) hi = mid;
    else lo = mid + 1;
  }
  if (lo == experts) return;
  int begin = lo == 0 ? 0 : offsets[lo - 1];
  int m = offsets[lo] - begin;
  for (int j = 0; j < kb; ++j) out[int64_t(begin) * kb + int64_t(j) * m + (r - begin)] = sa[int64_t(r) * kb + j];
}

template <class G>
__global__ void fill_arguments(Arrays<G> arrays, const int32_t *offsets, int experts, int n, int k,
                               const ElementAB *a, const ElementAB *w, ElementD *out, const float *sw) {
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= experts) return;
  int begin = e == 0 ? 0 : offsets[e - 1];
  int m = offsets[e] - begin;
  int kb = k / 128, nb = n / 128;
  arrays.shapes[e] = make_shape(m, n, k);
  arrays.a[e] = m ? a + int64_t(begin) * k : nullptr;  // empty groups: null, as CUTLASS's own example does
  arrays.w[e] = w + int64_t(e) * n * k;
  arrays.out[e] = m ? out + int64_t(begin) * n : nullptr;
  arrays.sa[e] = m ? arrays.sa_grouped + int64_t(begin) * kb : nullptr;
  arrays.sw[e] = sw + int64_t(e) * kb * nb;
  typename G::StrideA stride_a{};
  get<0>(stride_a) = k;
  arrays.stride_a[e] = stride_a;
  typename G::StrideB stride_w{};
  get<0>(stride_w) = k;
  arrays.stride_w[e] = stride_w;
  typename G::StrideD stride_out{};
  get<0>(stride_out) = n;
  arrays.stride_out[e] = stride_out;
  arrays.layout_sa[e] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
  arrays.layout_sw[e] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
}

template <class G>
typename G::Gemm::Arguments arguments(const Arrays<G> &arrays, int experts, int sm_count) {
  cutlass::KernelHardwareInfo hw;
  hw.sm_count = sm_count;
  typename G::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {experts, arrays.shapes, nullptr},  // shapes only on the device: the scheduler reads them there
      {arrays.a, arrays.stride_a, arrays.w, arrays.stride_w, arrays.sa, arrays.layout_sa, arrays.sw,
       arrays.layout_sw},
      {{}, nullptr, nullptr, arrays.out, arrays.stride_out},
      hw};
  auto &fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {_0{}, _0{}, 0};
  fusion.dBeta = {_0{}, _0{}, 0};
  return args;
}

template <class G>
int run(int experts, int n, int k, int rows, int sm_count, const void *a, const void *sa, const void *w,
        const void *sw, const int32_t *offsets, void *out, void *workspace, size_t workspace_bytes,
        cudaStream_t stream, size_t *needed) {
  Arrays<G> arrays{};
  int kb = k / 128;
  size_t own = carve(&arrays, nullptr, experts, rows, kb);
  size_t total = own + align_up(G::Gemm::get_workspace_size(arguments(arrays, experts, sm_count)));
  if (needed != nullptr) *needed = total;
  if (workspace == nullptr) return 0;
  if (workspace_bytes < total) return 1;
  char *base = static_cast<char *>(workspace);
  carve(&arrays, base, experts, rows, kb);
  regroup_row_scales<<<(rows + 255) / 256, 256, 0, stream>>>(static_cast<const float *>(sa), arrays.sa_grouped,
                                                              offsets, experts, rows, kb);
  fill_arguments<G><<<(experts + 127) / 128, 128, 0, stream>>>(
      arrays, offsets, experts, n, k, static_cast<const ElementAB *>(a), static_cast<const ElementAB *>(w),
      static_cast<ElementD *>(out), static_cast<const float *>(sw));
  if (cudaGetLastError() != cudaSuccess) return 2;
  typename G::Gemm gemm;
  auto args = arguments(arrays, experts, sm_count);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 3;
  if (gemm.initialize(args, base + own, stream) != cutlass::Status::kSuccess) return 4;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 5;
  return cudaGetLastError() == cudaSuccess ? 0 : 6;
}

}  // namespace moecompile_fp8

using namespace moecompile_fp8;

// Returns 0 on success; with workspace == nullptr only writes the workspace size it needs to *needed.
// Errors: 1 workspace too small, 2 argument kernels, 3 shape not supported, 4 initialise, 5 launch, 6 CUDA error.
extern "C" int moecompile_fp8_blockwise_grouped(int experts, int n, int k, int rows, int sm_count, const void *a,
                                                const void *sa, const void *w, const void *sw, const int32_t *offsets,
                                                void *out, void *workspace, size_t workspace_bytes, void *stream,
                                                size_t *needed) {
  return run<Cooperative>(experts, n, k, rows, sm_count, a, sa, w, sw, offsets, out, workspace, workspace_bytes,
                          static_cast<cudaStream_t>(stream), needed);
}
