// FP8 (e4m3) weights times one row (batch-1 decode) on CUDA cores, sm_89 and later.
//
//   y[n] = sum_k x[k] w[n, k] scale(n, k),  scale(n, k) = scales[scale_row[n], k / scale_cols]
//
// w e4m3 [N, K] (rows 16-byte aligned); scales float32, one per block (block-wise), per output
// row (per channel) or per shard (per tensor), each output's row of them named by scale_row.
// scale_cols is a multiple of 128 (a 128-input step never crosses a block) or at least K (one
// scale a row, applied once at the end).
//
// A CTA owns 16 outputs: each quarter warp one output's row, whose 128-byte steps of K its 8
// lanes read 16 bytes each (whole contiguous rows a quarter warp: the copy form that reads at
// the device's rate, docs/perf-notes.md, session 25). STEPS steps are loaded together, then
// used: two e4m3 become two halves in one cvt, then floats, one FMA an input, the step's sum
// scaled once. K split over gridDim.y CTAs, each a run of whole steps: gemv_split.cuh. Launched
// with programmatic dependent launch (p.pdl), a CTA fetches its rows' first steps into L2 before
// it waits for the kernel ahead of it (x is that kernel's output).
#include <cuda_fp8.h>

#include "fp8_gemv.h"
#include "gemv_split.cuh"

namespace {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int OUTS = WARPS * 4;  // outputs a CTA owns: one a quarter warp
constexpr int STEP = 128;        // inputs a quarter warp reads a step
constexpr int STEPS = 8;         // steps loaded together

using one_row::load_stream;
using one_row::pair;

// the dot of 16 e4m3 weights (a uint4) with 16 inputs (two uint4 of XT)
template <typename XT>
__device__ __forceinline__ float dot16(uint4 wq, uint4 xa, uint4 xb) {
  const uint32_t ws[4] = {wq.x, wq.y, wq.z, wq.w};
  const uint32_t xs[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // weights 2 i and 2 i + 1: half i of the words
    const auto two = static_cast<__nv_fp8x2_storage_t>(ws[i / 2] >> (16 * (i % 2)));
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3);
    const float2 wf = __half22float2(__half2(h));
    const float2 xf = pair(xs[i], XT{});
    sum = fmaf(wf.x, xf.x, sum);
    sum = fmaf(wf.y, xf.y, sum);
  }
  return sum;
}

// SCALE_ONCE: one scale a row (scale_cols >= k); UNIT_BLOCKS: a scale a 128-input step
// (scale_cols == 128: its index steps with the step, no division)
template <typename XT, bool SCALE_ONCE, bool UNIT_BLOCKS>
__global__ void __launch_bounds__(THREADS, 8) fp8_gemv_kernel(Fp8GemvParams p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slot = warp * 4 + (lane >> 3);  // this thread's output within the CTA
  const int col = lane & 7;                 // its 16 bytes of each 128-byte step
  const int n = blockIdx.x * OUTS + slot;
  const bool live = n < p.n;
  const int steps = p.k / STEP;  // this CTA's 128-input steps: [s_begin, s_end)
  const int s_begin = blockIdx.y * steps / gridDim.y;
  const int rows = ((blockIdx.y + 1) * steps / gridDim.y - s_begin) * STEP;
  const int k_begin = s_begin * STEP;
  const uint8_t* w = p.w + static_cast<size_t>(live ? n : 0) * p.stride_w + k_begin + col * 16;
  const XT* x = static_cast<const XT*>(p.x) + k_begin + col * 16;
  const float* scales = p.scales + static_cast<size_t>(live ? p.scale_row[n] : 0) * p.stride_s;
  float acc = 0.f;
  // lane col of a quarter warp: step col of its row (the line its 8 lanes read together)
  if (live && col * STEP < rows) one_row::prefetch_l2(w - col * 16 + col * STEP);
  one_row::pdl_wait();
  for (int k0 = 0; k0 < rows; k0 += STEPS * STEP) {
    uint4 wq[STEPS];
#pragma unroll
    for (int s = 0; s < STEPS; ++s)
      wq[s] = live && k0 + s * STEP < rows ? load_stream(w + k0 + s * STEP)
                                             : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      if (k0 + s * STEP >= rows) break;
      // coherent loads: under PDL x is the kernel ahead's output (one_row.cuh)
      const uint4* xp = reinterpret_cast<const uint4*>(x + k0 + s * STEP);
      const float part = dot16<XT>(wq[s], xp[0], xp[1]);
      if (SCALE_ONCE) {
        acc += part;
      } else {
        const int block = UNIT_BLOCKS ? s_begin + (k0 / STEP) + s
                                      : (k_begin + k0 + s * STEP) / p.scale_cols;
        acc = fmaf(scales[block], part, acc);
      }
    }
  }
  one_row::pdl_trigger();
  if (SCALE_ONCE && live) acc *= scales[0];
  // the 8 lanes of a quarter warp hold one output's parts
  acc += __shfl_xor_sync(0xffffffffu, acc, 4);
  acc += __shfl_xor_sync(0xffffffffu, acc, 2);
  acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  __shared__ float sums[OUTS];
  if (col == 0) sums[slot] = acc;
  __syncthreads();
  static_assert(OUTS <= THREADS, "finish: an output a thread");
  // 4 splits a batch: 8 or 16 spilled at 64 registers (nvcc 13); FP8's splits are few (4 for
  // Qwen3-8B's o and down on an H100)
  gemv::finish<1, 4>(sums, OUTS, blockIdx.x * OUTS, p.n, static_cast<XT*>(p.y), p.partials,
                     p.counters);
}

template <typename XT>
void launch(const Fp8GemvParams& p, dim3 grid, cudaStream_t stream) {
  if (p.scale_cols >= p.k)
    one_row::launch(fp8_gemv_kernel<XT, true, false>, grid, dim3(THREADS), stream, p.pdl, p);
  else if (p.scale_cols == STEP)
    one_row::launch(fp8_gemv_kernel<XT, false, true>, grid, dim3(THREADS), stream, p.pdl, p);
  else
    one_row::launch(fp8_gemv_kernel<XT, false, false>, grid, dim3(THREADS), stream, p.pdl, p);
}

}  // namespace

const char* fp8_gemv_launch(const Fp8GemvParams& p, cudaStream_t stream) {
  if (p.k % STEP || p.splits < 1 || p.splits > p.k / STEP)
    return "FP8 GEMV: K a multiple of 128, split into 1 to K / 128 runs";
  if (p.scale_cols < 1 || (p.scale_cols < p.k && p.scale_cols % STEP))
    return "FP8 GEMV: scale blocks of whole 128-input steps";
  const dim3 grid((p.n + OUTS - 1) / OUTS, p.splits);
  if (p.x_bf16)
    launch<__nv_bfloat16>(p, grid, stream);
  else
    launch<__half>(p, grid, stream);
  return "";
}
