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
// Rounding follows the Triton fused path (models/fused_moe.py): gate, up, silu and their product
// rounded to the activation dtype, each slot's weighted output rounded, their sum in float32
// rounded once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "moe_gemv.h"

namespace {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int QUARTERS = WARPS * 4;  // rows a CTA reads at once
constexpr int STEP = 64;             // values a quarter warp reads a step (128 bytes)
constexpr int STEPS = 4;             // steps loaded together

__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float rounded(float v, __half) { return __half2float(__float2half_rn(v)); }
__device__ __forceinline__ float rounded(float v, __nv_bfloat16) {
  return __bfloat162float(__float2bfloat16_rn(v));
}
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// two 16-bit floats of a word (low half first) as floats
__device__ __forceinline__ float2 pair(uint32_t w, __nv_bfloat16) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
}
__device__ __forceinline__ float2 pair(uint32_t w, __half) {
  __half2 h;
  *reinterpret_cast<uint32_t*>(&h) = w;
  return __half22float2(h);
}

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

// row (length len, a multiple of STEP, 16-byte aligned) . v, this lane's part; the quarter
// warp's 8 lanes (lane & 7 = col) together cover the row
template <typename T>
__device__ __forceinline__ float row_dot(const T* row, const T* v, int len, int col) {
  float sum = 0.f;
  for (int k0 = 0; k0 < len; k0 += STEPS * STEP) {
    uint4 w[STEPS];
#pragma unroll
    for (int s = 0; s < STEPS; ++s)
      w[s] = k0 + s * STEP < len ? load_stream(row + k0 + s * STEP + col * 8)
                                 : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      if (k0 + s * STEP >= len) break;
      sum = dot8<T>(w[s], __ldg(reinterpret_cast<const uint4*>(v + k0 + s * STEP + col * 8)),
                    sum);
    }
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 4);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  return sum;
}

template <typename T>
__global__ void __launch_bounds__(THREADS) moe_gate_up_kernel(MoeGemvParams p) {
  const int lane = threadIdx.x & 31, quarter = (threadIdx.x >> 5) * 4 + (lane >> 3);
  const int slot = blockIdx.y;
  const int i = blockIdx.x * (QUARTERS / 2) + (quarter >> 1);  // this quarter's output
  const int64_t expert = p.ids[slot];
  const T* gate_up = static_cast<const T*>(p.gate_up);
  float dot = 0.f;
  if (i < p.inter) {
    const int row = (quarter & 1) ? p.inter + i : i;  // gate rows, then up rows
    dot = row_dot(gate_up + (expert * 2 * p.inter + row) * p.hidden, static_cast<const T*>(p.x),
                  p.hidden, lane & 7);
  }
  __shared__ float dots[QUARTERS];
  if ((lane & 7) == 0) dots[quarter] = dot;
  __syncthreads();
  const int out = blockIdx.x * (QUARTERS / 2) + threadIdx.x;
  if (threadIdx.x < QUARTERS / 2 && out < p.inter) {
    const float gate = rounded(dots[2 * threadIdx.x], T{});
    const float silu = rounded(gate / (1.f + __expf(-gate)), T{});
    const float up = rounded(dots[2 * threadIdx.x + 1], T{});
    static_cast<T*>(p.act)[slot * p.inter + out] = from_float<T>(silu * up);
  }
}

template <typename T>
__global__ void __launch_bounds__(THREADS) moe_down_kernel(MoeGemvParams p) {
  const int lane = threadIdx.x & 31, quarter = (threadIdx.x >> 5) * 4 + (lane >> 3);
  const int outs = QUARTERS / p.top_k;  // outputs a CTA takes
  const int n = blockIdx.x * outs + quarter / p.top_k, slot = quarter % p.top_k;
  const T* down = static_cast<const T*>(p.down);
  float dot = 0.f;
  if (n < p.hidden)
    dot = row_dot(down + (p.ids[slot] * p.hidden + n) * p.inter,
                  static_cast<const T*>(p.act) + slot * p.inter, p.inter, lane & 7);
  __shared__ float dots[QUARTERS];
  if ((lane & 7) == 0) dots[quarter] = dot;
  __syncthreads();
  const int out = blockIdx.x * outs + threadIdx.x;
  if (threadIdx.x < outs && out < p.hidden) {
    const T* weights = static_cast<const T*>(p.weights);
    float total = 0.f;
    for (int j = 0; j < p.top_k; ++j)  // slots in order, as the fused path's sum over k
      total += rounded(dots[threadIdx.x * p.top_k + j] * to_float(weights[j]), T{});
    static_cast<T*>(p.y)[out] = from_float<T>(total);
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
