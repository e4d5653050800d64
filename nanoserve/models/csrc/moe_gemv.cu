// One token's mixture-of-experts MLP (batch-1 decode) on CUDA cores: its k experts' gate_up
// with SiLU-multiply, then their down projections weighted and summed, in two kernels. No sort
// and no separate sum: each CTA reads its rows of the experts the router chose (ids on the
// device, so a CUDA graph replays it for whatever the router picks).
//
// Each quarter warp reads one weight row in whole contiguous 128-byte steps, 16 bytes (8 values)
// a lane, STEPS steps in flight (the copy form that reads at the device's rate,
// docs/perf-notes.md, session 25); a row's parts are summed over the quarter's lanes.
//   gate_up [E, 2I, H]: a CTA takes 8 intermediate outputs of one expert slot, its 16 quarter
//     warps their gate and up rows, and writes act[slot, i] = silu(gate) * up;
//   down [E, H, I]: a CTA takes 16 / k outputs, its quarter warps each output's row of each of
//     the k experts, and writes y[n] = sum over slots of weight[slot] * (down row . act[slot]).
// Rounding follows the Triton fused path (models/fused_moe.py): gate, up, silu (its exp and
// division as Triton compiles them) and their product rounded to the activation dtype, each
// slot's weighted output rounded, their sum in float32 rounded once. The dots' order differs.
#include "moe_gemv.h"
#include "one_row.cuh"

namespace {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int QUARTERS = WARPS * 4;  // rows a CTA reads at once
constexpr int STEP = 64;             // values a quarter warp reads a step (128 bytes)
constexpr int STEPS = 4;             // steps loaded together

using one_row::load_stream;
using one_row::pair;
using one_row::rounded;
using one_row::store;
using one_row::to_float;

// the dot of 8 weights with 8 inputs, a uint4 of T each
template <typename T>
__device__ __forceinline__ float dot8(uint4 w, uint4 x, float sum) {
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
  const uint32_t xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = pair(ws[i], T{}), b = pair(xs[i], T{});
    sum = fmaf(a.x, b.x, sum);
    sum = fmaf(a.y, b.y, sum);
  }
  return sum;
}

// row (length len, a multiple of STEP, 16-byte aligned) . v, summed over the quarter warp's 8
// lanes (lane & 7 = col), which together cover the row. The next STEPS steps' weights are loaded
// before this group's sums, so a group's loads are in flight while the last one is summed
// (loaded and used in one loop, ptxas kept half of them waiting on the first FMA).
template <typename T>
__device__ __forceinline__ float row_dot(const T* row, const T* v, int len, int col) {
  row += col * 8;
  v += col * 8;
  const int steps = len / STEP;
  uint4 next[STEPS];
#pragma unroll
  for (int s = 0; s < STEPS; ++s)
    next[s] = s < steps ? load_stream(row + s * STEP) : make_uint4(0, 0, 0, 0);
  float sum = 0.f;
  for (int g = 0; g < steps; g += STEPS) {
    uint4 w[STEPS], x[STEPS];
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      w[s] = next[s];
      x[s] = g + s < steps ? __ldg(reinterpret_cast<const uint4*>(v + (g + s) * STEP))
                           : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int s = 0; s < STEPS; ++s)
      next[s] = g + STEPS + s < steps ? load_stream(row + (g + STEPS + s) * STEP)
                                      : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int s = 0; s < STEPS; ++s) sum = dot8<T>(w[s], x[s], sum);  // zeros past the row add 0
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 4);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  return sum;
}

// fp32 division as Triton's `/` compiles (div.full: a reciprocal and a multiply, about 2 ulp)
__device__ __forceinline__ float div_full(float a, float b) {
  float q;
  asm("div.full.f32 %0, %1, %2;" : "=f"(q) : "f"(a), "f"(b));
  return q;
}

template <typename T>
__global__ void __launch_bounds__(THREADS) moe_gate_up_kernel(MoeGemvParams p) {
  const int lane = threadIdx.x & 31, quarter = (threadIdx.x >> 5) * 4 + (lane >> 3);
  const int slot = blockIdx.y;
  // this quarter's output (a CTA past the last one reads the last: the shuffles take every lane)
  const int i = min(static_cast<int>(blockIdx.x) * (QUARTERS / 2) + (quarter >> 1), p.inter - 1);
  const int64_t expert = p.ids[slot];
  const T* gate_up = static_cast<const T*>(p.gate_up);
  const int row = (quarter & 1) ? p.inter + i : i;  // gate rows, then up rows
  const float dot = row_dot(gate_up + (expert * 2 * p.inter + row) * p.hidden,
                            static_cast<const T*>(p.x), p.hidden, lane & 7);
  __shared__ float dots[QUARTERS];
  if ((lane & 7) == 0) dots[quarter] = dot;
  __syncthreads();
  const int out = blockIdx.x * (QUARTERS / 2) + threadIdx.x;
  if (threadIdx.x < QUARTERS / 2 && out < p.inter) {
    const float gate = rounded<T>(dots[2 * threadIdx.x]);
    const float silu = rounded<T>(div_full(gate, 1.f + __expf(-gate)));
    const float up = rounded<T>(dots[2 * threadIdx.x + 1]);
    store(static_cast<T*>(p.act) + slot * p.inter + out, silu * up);
  }
}

template <typename T>
__global__ void __launch_bounds__(THREADS) moe_down_kernel(MoeGemvParams p) {
  const int lane = threadIdx.x & 31, quarter = (threadIdx.x >> 5) * 4 + (lane >> 3);
  const int outs = QUARTERS / p.top_k;  // outputs a CTA takes
  // (past the last output: the last one's row, as in the gate_up kernel)
  const int n = min(static_cast<int>(blockIdx.x) * outs + quarter / p.top_k, p.hidden - 1);
  const int slot = quarter % p.top_k;
  const T* down = static_cast<const T*>(p.down);
  const float dot = row_dot(down + (p.ids[slot] * p.hidden + n) * p.inter,
                            static_cast<const T*>(p.act) + slot * p.inter, p.inter, lane & 7);
  __shared__ float dots[QUARTERS];
  if ((lane & 7) == 0) dots[quarter] = dot;
  __syncthreads();
  const int out = blockIdx.x * outs + threadIdx.x;
  if (threadIdx.x < outs && out < p.hidden) {
    const T* weights = static_cast<const T*>(p.weights);
    float total = 0.f;
    for (int j = 0; j < p.top_k; ++j)  // slots in order (torch's sum over k may reorder them:
                                       // a float32 sum of k rounded values, rarely apart)
      total += rounded<T>(dots[threadIdx.x * p.top_k + j] * to_float(weights[j]));
    store(static_cast<T*>(p.y) + out, total);
  }
}

template <typename T>
void launch(const MoeGemvParams& p, cudaStream_t stream) {
  const dim3 gate_up_grid((p.inter + QUARTERS / 2 - 1) / (QUARTERS / 2), p.top_k);
  moe_gate_up_kernel<T><<<gate_up_grid, THREADS, 0, stream>>>(p);
  const int outs = QUARTERS / p.top_k;
  moe_down_kernel<T><<<(p.hidden + outs - 1) / outs, THREADS, 0, stream>>>(p);
}

}  // namespace

const char* moe_gemv_launch(const MoeGemvParams& p, cudaStream_t stream) {
  if (p.top_k < 1 || QUARTERS % p.top_k) return "MoE GEMV: top k must divide 16";
  if (p.hidden % STEP || p.inter % STEP) return "MoE GEMV: sizes must be multiples of 64";
  if (p.bf16)
    launch<__nv_bfloat16>(p, stream);
  else
    launch<__half>(p, stream);
  return "";
}
