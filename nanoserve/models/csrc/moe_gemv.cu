// One token's mixture-of-experts MLP (batch-1 decode) on CUDA cores: its k experts' gate_up
// with SiLU-multiply, then their down projections weighted and summed, in two kernels. No sort
// and no separate sum: each CTA reads its rows of the experts the router chose (ids on the
// device, so a CUDA graph replays it for whatever the router picks).
//
// A warp reads 4 weight rows together, 16 bytes (8 values) a lane of each, each load of a warp
// 512 contiguous bytes of one row, with the lane's 8 inputs loaded once for the 4 rows (session
// 29: the FP8 one-row GEMV, which loaded its inputs for each row, spent a third of its time on
// them; quant/csrc/plain_gemv.cu);
//   gate_up [E, 2I, H]: a CTA takes 8 intermediate outputs of one expert slot, a warp two of
//     them, their gate and up rows, and writes act[slot, i] = silu(gate) * up;
//   down [E, H, I]: a CTA takes 4 outputs, a warp the 4 outputs' rows of every fourth expert
//     slot, and writes y[n] = sum over slots of weight[slot] * (down row . act[slot]).
// Rounding follows the Triton fused path (models/fused_moe.py): gate, up, silu (its exp and
// division as Triton compiles them) and their product rounded to the activation dtype, each
// slot's weighted output rounded, their sum in float32 rounded once. The dots' order differs.
// Launched with programmatic dependent launch (p.pdl), each kernel waits for the kernel ahead
// of it before it reads anything (the expert ids are that kernel's output) and lets the next
// start once its dots are done.
#include "moe_gemv.h"
#include "one_row.cuh"

namespace {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int MAX_SLOTS = 16;    // top k divides it (cuda_moe.py checks): down's dots a CTA
constexpr int STEP = 64;         // hidden and intermediate sizes are multiples of it
constexpr int ROWS = 4;          // rows a warp reads together
constexpr int CHUNK = 32 * 8;    // values a warp reads a load: 8 a lane
constexpr int UNROLL = 2;        // chunks a loop step: ROWS * UNROLL loads in flight a lane
constexpr int GATE_UP_OUTS = WARPS * 2;  // intermediate outputs a gate_up CTA takes

using one_row::dot8;
using one_row::load_stream;
using one_row::pair;
using one_row::rounded;
using one_row::store;
using one_row::to_float;

// lane's UNROLL chunks from k on: each row's 16 bytes and v's, zeros past len
template <typename T>
__device__ __forceinline__ void load_chunks(const T* const (&rows)[ROWS], const T* v, int len,
                                            int k, uint4 (&w)[UNROLL][ROWS],
                                            uint4 (&x)[UNROLL]) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int at = k + u * CHUNK;
    // coherent: under PDL v is the kernel ahead's output (one_row.cuh)
    x[u] = at < len ? *reinterpret_cast<const uint4*>(v + at) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      w[u][r] = at < len ? load_stream(rows[r] + at) : make_uint4(0, 0, 0, 0);
  }
}

// rows[r] . v for the warp's ROWS rows (len values each, a multiple of 8, 16-byte aligned),
// summed over the warp: every lane gets them. The next UNROLL chunks are loaded before this
// step's sums, so that loads are in flight while they run (loaded and used in one loop, ptxas
// kept half of them waiting on the first FMA).
template <typename T>
__device__ __forceinline__ void rows_dot(const T* const (&rows)[ROWS], const T* v, int len,
                                         int lane, float (&dots)[ROWS]) {
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
  uint4 next_w[UNROLL][ROWS], next_x[UNROLL];
  load_chunks<T>(rows, v, len, lane * 8, next_w, next_x);
  for (int k0 = lane * 8; k0 < len; k0 += UNROLL * CHUNK) {
    uint4 w[UNROLL][ROWS], xv[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      xv[u] = next_x[u];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) w[u][r] = next_w[u][r];
    }
    load_chunks<T>(rows, v, len, k0 + UNROLL * CHUNK, next_w, next_x);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const uint32_t xs[4] = {xv[u].x, xv[u].y, xv[u].z, xv[u].w};
      float xf[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 b = pair(xs[i], T{});
        xf[2 * i] = b.x, xf[2 * i + 1] = b.y;
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) acc[r] = dot8<T>(w[u][r], xf, acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int d = 16; d > 0; d /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], d);
    dots[r] = acc[r];
  }
}

// fp32 division as Triton's `/` compiles (div.full: a reciprocal and a multiply, about 2 ulp)
__device__ __forceinline__ float div_full(float a, float b) {
  float q;
  asm("div.full.f32 %0, %1, %2;" : "=f"(q) : "f"(a), "f"(b));
  return q;
}

template <typename T>
__global__ void __launch_bounds__(THREADS) moe_gate_up_kernel(MoeGemvParams p) {
  one_row::pdl_wait();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slot = blockIdx.y;
  const T* gate_up = static_cast<const T*>(p.gate_up) + p.ids[slot] * 2 * p.inter * p.hidden;
  const int i0 = blockIdx.x * GATE_UP_OUTS + warp * 2;  // this warp's outputs i0, i0 + 1
  const T* rows[ROWS];  // gate i0, gate i0 + 1, up i0, up i0 + 1 (past the last: the last's)
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int i = min(i0 + (r & 1), p.inter - 1);
    rows[r] = gate_up + static_cast<int64_t>(r < 2 ? i : p.inter + i) * p.hidden;
  }
  float dots[ROWS];
  rows_dot<T>(rows, static_cast<const T*>(p.x), p.hidden, lane, dots);
  one_row::pdl_trigger();
  const int out = i0 + lane;
  if (lane < 2 && out < p.inter) {
    const float gate = rounded<T>(lane ? dots[1] : dots[0]);
    const float silu = rounded<T>(div_full(gate, 1.f + __expf(-gate)));
    const float up = rounded<T>(lane ? dots[3] : dots[2]);
    store(static_cast<T*>(p.act) + slot * p.inter + out, silu * up);
  }
}

template <typename T>
__global__ void __launch_bounds__(THREADS) moe_down_kernel(MoeGemvParams p) {
  one_row::pdl_wait();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = blockIdx.x * ROWS;  // this CTA's outputs n0 .. n0 + ROWS - 1
  __shared__ float dots[MAX_SLOTS][ROWS];  // [slot][output]
  for (int slot = warp; slot < p.top_k; slot += WARPS) {
    const T* down = static_cast<const T*>(p.down) + p.ids[slot] * p.hidden * p.inter;
    const T* rows[ROWS];  // (past the last output: the last's row)
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      rows[r] = down + static_cast<int64_t>(min(n0 + r, p.hidden - 1)) * p.inter;
    float d[ROWS];
    rows_dot<T>(rows, static_cast<const T*>(p.act) + slot * p.inter, p.inter, lane, d);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) dots[slot][r] = d[r];
    }
  }
  one_row::pdl_trigger();
  __syncthreads();
  const int out = n0 + threadIdx.x;
  if (threadIdx.x < ROWS && out < p.hidden) {
    const T* weights = static_cast<const T*>(p.weights);
    float total = 0.f;
    for (int j = 0; j < p.top_k; ++j)  // slots in order (torch's sum over k may reorder them:
                                       // a float32 sum of k rounded values, rarely apart)
      total += rounded<T>(dots[j][threadIdx.x] * to_float(weights[j]));
    store(static_cast<T*>(p.y) + out, total);
  }
}

template <typename T>
void launch(const MoeGemvParams& p, cudaStream_t stream) {
  const dim3 gate_up_grid((p.inter + GATE_UP_OUTS - 1) / GATE_UP_OUTS, p.top_k);
  one_row::launch(moe_gate_up_kernel<T>, gate_up_grid, dim3(THREADS), stream, p.pdl, p);
  one_row::launch(moe_down_kernel<T>, dim3((p.hidden + ROWS - 1) / ROWS), dim3(THREADS), stream,
                  p.pdl, p);
}

}  // namespace

const char* moe_gemv_launch(const MoeGemvParams& p, cudaStream_t stream) {
  if (p.top_k < 1 || MAX_SLOTS % p.top_k) return "MoE GEMV: top k must divide 16";
  if (p.hidden % STEP || p.inter % STEP) return "MoE GEMV: sizes must be multiples of 64";
  if (p.bf16)
    launch<__nv_bfloat16>(p, stream);
  else
    launch<__half>(p, stream);
  return "";
}
