// Plain weights times one row (batch-1 decode) on CUDA cores: e4m3 (sm_89 and later) with
// scales, or 16-bit floats of x's dtype.
//
//   y[n] = sum_k x[k] w[n, k] scale(n, k),  scale(n, k) = scales[scale_row[n], k / scale_cols]
//
// w [N, K] (rows 16-byte aligned). e4m3: scales float32, one per block (block-wise), per output
// row (per channel) or per shard (per tensor), each output's row of them named by scale_row;
// scale_cols is a multiple of 128 (a 128-input step never crosses a block) or at least K (one
// scale a row, applied once at the end). 16-bit weights have no scales.
//
// A CTA owns 32 outputs, a warp 8 of them. A warp reads K in chunks of 16 bytes a lane (512
// e4m3 inputs, 256 16-bit ones): at each chunk a lane loads its inputs of x once, as floats, and
// its 16 bytes of each of the warp's 8 rows (each load of a warp 512 contiguous bytes of one
// row), so that x is read once for 8 rows. Session 29 measured what the form before this one (a
// quarter warp a row, x loaded for each row) paid for x: on an H200 its loads with x took 36.6
// us for Qwen3-8B's FP8 gate_up, without x 25.3, contiguous reads of the same bytes 24.7
// (tools/probes/gemv_stages.py). Two e4m3 become two halves in one cvt, then floats; 16-bit
// weights are widened as x is; one FMA an input, e4m3's sums scaled once per lane and 128-input
// step (blocks are whole steps). K split over gridDim.y CTAs, each a run of whole 128-input
// steps: gemv_split.cuh. Launched with programmatic dependent launch (p.pdl), a warp fetches its
// rows' first chunk into L2 before it waits for the kernel ahead of it (x is that kernel's
// output).
#include <type_traits>

#include "gemv_split.cuh"
#include "plain_gemv.h"

namespace {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int ROWS = 8;             // outputs a warp owns
constexpr int OUTS = WARPS * ROWS;  // outputs a CTA owns
constexpr int STEP = 128;           // the split's unit; scale blocks are whole steps

using one_row::load_stream;
using one_row::pair;

struct E4m3 {};  // the weight formats: e4m3, or XT itself (16-bit floats)

template <typename WT>
constexpr int kPerLane = std::is_same_v<WT, E4m3> ? 16 : 8;  // inputs in a lane's 16 bytes

// the dot of a lane's 16 bytes of weights with its inputs
__device__ __forceinline__ float dot(uint4 wq, const float* xf, E4m3) {
  return one_row::dot16_e4m3(wq, xf);
}
template <typename T>
__device__ __forceinline__ float dot(uint4 wq, const float* xf, T) {
  return one_row::dot8<T>(wq, xf, 0.f);
}

enum class Scales { kNone, kOnce, kSteps, kBlocks };  // none (16-bit), one a row, one a 128-input
                                                      // step, one a scale_cols block

template <typename XT, typename WT, Scales S>
__global__ void __launch_bounds__(THREADS, 6) plain_gemv_kernel(PlainGemvParams p) {
  constexpr int PER_LANE = kPerLane<WT>;
  constexpr int CHUNK = 32 * PER_LANE;  // inputs a warp reads a load
  constexpr int W_BYTES = 16 / PER_LANE;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = blockIdx.x * OUTS + warp * ROWS;  // this warp's first output
  const int steps = p.k / STEP;  // this CTA's 128-input steps: [s_begin, s_end)
  const int s_begin = blockIdx.y * steps / gridDim.y;
  const int run = ((blockIdx.y + 1) * steps / gridDim.y - s_begin) * STEP;
  const int k_begin = s_begin * STEP;
  const int live_rows = min(ROWS, p.n - n0);  // rows past N read nothing
  const uint8_t* w =
      p.w + static_cast<size_t>(n0) * p.stride_w + (k_begin + lane * PER_LANE) * W_BYTES;
  const XT* x = static_cast<const XT*>(p.x) + k_begin + lane * PER_LANE;
  int srow[ROWS];  // each row's scales, as offsets into p.scales
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
    srow[r] = S != Scales::kNone && r < live_rows ? p.scale_row[n0 + r] * p.stride_s : 0;
  // lane l: the line of quarter l % 4 of row l / 4's first chunk
  if (lane / 4 < live_rows && (lane % 4) * 128 < run * W_BYTES)
    one_row::prefetch_l2(w - lane * 16 + static_cast<size_t>(lane / 4) * p.stride_w +
                         (lane % 4) * 128);
  one_row::pdl_wait();
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
  for (int k0 = 0; k0 + lane * PER_LANE < run; k0 += CHUNK) {  // lanes past the run's end stop
    uint4 wq[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      wq[r] = r < live_rows ? load_stream(w + static_cast<size_t>(r) * p.stride_w + k0 * W_BYTES)
                            : make_uint4(0, 0, 0, 0);
    // coherent loads: under PDL x is the kernel ahead's output (one_row.cuh)
    const uint4* xp = reinterpret_cast<const uint4*>(x + k0);
    float xf[PER_LANE];
#pragma unroll
    for (int h = 0; h < PER_LANE / 8; ++h) {
      const uint4 xv = xp[h];
      const uint32_t xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 v = pair(xs[i], XT{});
        xf[8 * h + 2 * i] = v.x, xf[8 * h + 2 * i + 1] = v.y;
      }
    }
    const int block = S == Scales::kSteps ? s_begin + (k0 + lane * PER_LANE) / STEP
                                          : (k_begin + k0 + lane * PER_LANE) / p.scale_cols;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float part = dot(wq[r], xf, std::conditional_t<std::is_same_v<WT, E4m3>, E4m3, XT>{});
      if constexpr (S == Scales::kSteps || S == Scales::kBlocks)
        acc[r] = fmaf(p.scales[srow[r] + block], part, acc[r]);
      else
        acc[r] += part;
    }
  }
  one_row::pdl_trigger();
  __shared__ float sums[OUTS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float t = acc[r];
#pragma unroll
    for (int d = 16; d > 0; d /= 2) t += __shfl_xor_sync(0xffffffffu, t, d);
    if (S == Scales::kOnce) t *= p.scales[srow[r]];
    if (lane == 0) sums[warp * ROWS + r] = t;
  }
  __syncthreads();
  static_assert(OUTS <= THREADS, "finish: an output a thread");
  gemv::finish<1, 8>(sums, OUTS, blockIdx.x * OUTS, p.n, static_cast<XT*>(p.y), p.partials,
                     p.counters);
}

template <typename XT>
void launch(const PlainGemvParams& p, dim3 grid, cudaStream_t stream) {
  const dim3 block(THREADS);
  if (p.w_half)
    one_row::launch(plain_gemv_kernel<XT, XT, Scales::kNone>, grid, block, stream, p.pdl, p);
  else if (p.scale_cols >= p.k)
    one_row::launch(plain_gemv_kernel<XT, E4m3, Scales::kOnce>, grid, block, stream, p.pdl, p);
  else if (p.scale_cols == STEP)
    one_row::launch(plain_gemv_kernel<XT, E4m3, Scales::kSteps>, grid, block, stream, p.pdl, p);
  else
    one_row::launch(plain_gemv_kernel<XT, E4m3, Scales::kBlocks>, grid, block, stream, p.pdl, p);
}

}  // namespace

const char* plain_gemv_launch(const PlainGemvParams& p, cudaStream_t stream) {
  if (p.k % STEP || p.splits < 1 || p.splits > p.k / STEP)
    return "one-row GEMV: K a multiple of 128, split into 1 to K / 128 runs";
  if (!p.w_half && (p.scale_cols < 1 || (p.scale_cols < p.k && p.scale_cols % STEP)))
    return "FP8 GEMV: scale blocks of whole 128-input steps";
  const dim3 grid((p.n + OUTS - 1) / OUTS, p.splits);
  if (p.x_bf16)
    launch<__nv_bfloat16>(p, grid, stream);
  else
    launch<__half>(p, grid, stream);
  return "";
}
