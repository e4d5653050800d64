// One token's mixture-of-experts MLP (batch-1 decode) on CUDA cores: its k experts' gate_up
// with SiLU-multiply, then their down projections weighted and summed, in two kernels. No sort
// and no separate sum: each CTA reads its rows of the experts the router chose (ids on the
// device, so a CUDA graph replays it for whatever the router picks).
//
// A warp reads 4 weight rows together, 16 bytes a lane of each (8 16-bit values or 16 e4m3),
// each load of a warp 512 contiguous bytes of one row, with the lane's inputs loaded once for the
// 4 rows (session 29: the FP8 one-row GEMV, which loaded its inputs for each row, spent a third
// of its time on them; quant/csrc/plain_gemv.cu);
//   gate_up [E, 2I, H]: a CTA takes 8 intermediate outputs of one expert slot, a warp two of
//     them, their gate and up rows, and writes act[slot, i] = silu(gate) * up;
//   down [E, H, I]: a CTA takes 4 outputs, a warp the 4 outputs' rows of every fourth expert
//     slot, and writes y[n] = sum over slots of weight[slot] * (down row . act[slot]).
// Weights in x's dtype, or e4m3 with a float32 scale per (scale_rows x scale_cols) block of each
// expert (FP8 block-wise checkpoints): a lane's 16 inputs lie within one block (scale_cols a
// multiple of 16), its dot scaled once, as the Triton path scales each K step's dot.
// Rounding follows the Triton fused path (models/fused_moe.py): gate, up, silu (its exp and
// division as Triton compiles them) and their product rounded to the activation dtype, each
// slot's weighted output rounded, their sum in float32 rounded once. The dots' order differs.
// Launched with programmatic dependent launch (p.pdl), each kernel waits for the kernel ahead
// of it before it reads anything (the expert ids are that kernel's output) and lets the next
// start once its dots are done.
#include <type_traits>

#include "moe_gemv.h"
#include "one_row.cuh"

namespace {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int MAX_SLOTS = 16;    // top k divides it (cuda_moe.py checks): down's dots a CTA
constexpr int STEP = 64;         // hidden and intermediate sizes are multiples of it
constexpr int ROWS = 4;          // rows a warp reads together
constexpr int UNROLL = 2;        // chunks a loop step: ROWS * UNROLL loads in flight a lane
constexpr int GATE_UP_OUTS = WARPS * 2;  // intermediate outputs a gate_up CTA takes

using one_row::dot8;
using one_row::load_stream;
using one_row::pair;
using one_row::rounded;
using one_row::store;
using one_row::to_float;

struct E4m3 {};  // the weight formats: e4m3 with block scales, or T itself (16-bit floats)

template <typename T, typename WT>
constexpr int kPerLane = std::is_same_v<WT, E4m3> ? 16 : 8;  // inputs in a lane's 16 bytes

// A warp's ROWS weight rows (byte pointers) and, for e4m3, each row's scales along K (one per
// scale_cols inputs)
struct Rows {
  const uint8_t* row[ROWS];
  const float* scales[ROWS];
  int scale_cols;
};

// lane's UNROLL chunks from k on: each row's 16 bytes (and e4m3's scales for them) and v's
// inputs, zeros past len
template <typename T, typename WT>
__device__ __forceinline__ void load_chunks(const Rows& rows, const T* v, int len, int k,
                                            uint4 (&w)[UNROLL][ROWS],
                                            uint4 (&x)[UNROLL][kPerLane<T, WT> / 8],
                                            float (&s)[UNROLL][ROWS]) {
  constexpr int PER_LANE = kPerLane<T, WT>, CHUNK = 32 * PER_LANE, W_BYTES = 16 / PER_LANE;
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int at = k + u * CHUNK;
    // coherent: under PDL v is the kernel ahead's output (one_row.cuh)
#pragma unroll
    for (int h = 0; h < PER_LANE / 8; ++h)
      x[u][h] = at < len ? *reinterpret_cast<const uint4*>(v + at + 8 * h) : make_uint4(0, 0, 0, 0);
    const int block = std::is_same_v<WT, E4m3> ? at / rows.scale_cols : 0;  // once, not a row
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      w[u][r] = at < len ? load_stream(rows.row[r] + at * W_BYTES) : make_uint4(0, 0, 0, 0);
      if constexpr (std::is_same_v<WT, E4m3>)  // weights' scales: no kernel writes them
        s[u][r] = at < len ? __ldg(rows.scales[r] + block) : 0.f;
    }
  }
}

// rows[r] . v for the warp's ROWS rows (len values each, a multiple of 16, 16-byte aligned),
// summed over the warp: every lane gets them. The next UNROLL chunks are loaded before this
// step's sums, so that loads are in flight while they run (loaded and used in one loop, ptxas
// kept half of them waiting on the first FMA).
template <typename T, typename WT>
__device__ __forceinline__ void rows_dot(const Rows& rows, const T* v, int len, int lane,
                                         float (&dots)[ROWS]) {
  constexpr int PER_LANE = kPerLane<T, WT>, CHUNK = 32 * PER_LANE;
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
  uint4 next_w[UNROLL][ROWS], next_x[UNROLL][PER_LANE / 8];
  float next_s[UNROLL][ROWS];
  load_chunks<T, WT>(rows, v, len, lane * PER_LANE, next_w, next_x, next_s);
  for (int k0 = lane * PER_LANE; k0 < len; k0 += UNROLL * CHUNK) {
    uint4 w[UNROLL][ROWS], xv[UNROLL][PER_LANE / 8];
    float s[UNROLL][ROWS];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
      for (int h = 0; h < PER_LANE / 8; ++h) xv[u][h] = next_x[u][h];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) w[u][r] = next_w[u][r], s[u][r] = next_s[u][r];
    }
    load_chunks<T, WT>(rows, v, len, k0 + UNROLL * CHUNK, next_w, next_x, next_s);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float xf[PER_LANE];
#pragma unroll
      for (int h = 0; h < PER_LANE / 8; ++h) {
        const uint32_t xs[4] = {xv[u][h].x, xv[u][h].y, xv[u][h].z, xv[u][h].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 b = pair(xs[i], T{});
          xf[8 * h + 2 * i] = b.x, xf[8 * h + 2 * i + 1] = b.y;
        }
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if constexpr (std::is_same_v<WT, E4m3>)  // past len: weights and scale 0
          acc[r] = fmaf(s[u][r], one_row::dot16_e4m3(w[u][r], xf), acc[r]);
        else
          acc[r] = dot8<T>(w[u][r], xf, acc[r]);
      }
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

template <typename T, typename WT>
__global__ void __launch_bounds__(THREADS) moe_gate_up_kernel(MoeGemvParams p) {
  constexpr int W_BYTES = 16 / kPerLane<T, WT>;
  one_row::pdl_wait();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slot = blockIdx.y;
  const int64_t expert = p.ids[slot];
  const uint8_t* gate_up =
      static_cast<const uint8_t*>(p.gate_up) + expert * 2 * p.inter * p.hidden * W_BYTES;
  const float* scales = p.gate_up_scales + expert * p.gate_up_scales_stride[0];
  const int i0 = blockIdx.x * GATE_UP_OUTS + warp * 2;  // this warp's outputs i0, i0 + 1
  Rows rows;  // gate i0, gate i0 + 1, up i0, up i0 + 1 (past the last: the last's)
  rows.scale_cols = p.scale_cols;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int i = min(i0 + (r & 1), p.inter - 1);
    const int n = r < 2 ? i : p.inter + i;
    rows.row[r] = gate_up + static_cast<int64_t>(n) * p.hidden * W_BYTES;
    if constexpr (std::is_same_v<WT, E4m3>)
      rows.scales[r] = scales + (n / p.scale_rows) * p.gate_up_scales_stride[1];
  }
  float dots[ROWS];
  rows_dot<T, WT>(rows, static_cast<const T*>(p.x), p.hidden, lane, dots);
  one_row::pdl_trigger();
  const int out = i0 + lane;
  if (lane < 2 && out < p.inter) {
    const float gate = rounded<T>(lane ? dots[1] : dots[0]);
    const float silu = rounded<T>(div_full(gate, 1.f + __expf(-gate)));
    const float up = rounded<T>(lane ? dots[3] : dots[2]);
    store(static_cast<T*>(p.act) + slot * p.inter + out, silu * up);
  }
}

template <typename T, typename WT>
__global__ void __launch_bounds__(THREADS) moe_down_kernel(MoeGemvParams p) {
  constexpr int W_BYTES = 16 / kPerLane<T, WT>;
  one_row::pdl_wait();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = blockIdx.x * ROWS;  // this CTA's outputs n0 .. n0 + ROWS - 1
  __shared__ float dots[MAX_SLOTS][ROWS];  // [slot][output]
  for (int slot = warp; slot < p.top_k; slot += WARPS) {
    const int64_t expert = p.ids[slot];
    const uint8_t* down =
        static_cast<const uint8_t*>(p.down) + expert * p.hidden * p.inter * W_BYTES;
    const float* scales = p.down_scales + expert * p.down_scales_stride[0];
    Rows rows;  // (past the last output: the last's row)
    rows.scale_cols = p.scale_cols;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int n = min(n0 + r, p.hidden - 1);
      rows.row[r] = down + static_cast<int64_t>(n) * p.inter * W_BYTES;
      if constexpr (std::is_same_v<WT, E4m3>)
        rows.scales[r] = scales + (n / p.scale_rows) * p.down_scales_stride[1];
    }
    float d[ROWS];
    rows_dot<T, WT>(rows, static_cast<const T*>(p.act) + slot * p.inter, p.inter, lane, d);
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

template <typename T, typename WT>
void launch(const MoeGemvParams& p, cudaStream_t stream) {
  const dim3 gate_up_grid((p.inter + GATE_UP_OUTS - 1) / GATE_UP_OUTS, p.top_k);
  one_row::launch(moe_gate_up_kernel<T, WT>, gate_up_grid, dim3(THREADS), stream, p.pdl, p);
  one_row::launch(moe_down_kernel<T, WT>, dim3((p.hidden + ROWS - 1) / ROWS), dim3(THREADS),
                  stream, p.pdl, p);
}

template <typename T>
void launch(const MoeGemvParams& p, cudaStream_t stream) {
  if (p.fp8)
    launch<T, E4m3>(p, stream);
  else
    launch<T, T>(p, stream);
}

}  // namespace

const char* moe_gemv_launch(const MoeGemvParams& p, cudaStream_t stream) {
  if (p.top_k < 1 || MAX_SLOTS % p.top_k) return "MoE GEMV: top k must divide 16";
  if (p.hidden % STEP || p.inter % STEP) return "MoE GEMV: sizes must be multiples of 64";
  if (p.fp8 && (p.scale_rows < 1 || p.scale_cols < 16 || p.scale_cols % 16))
    return "MoE GEMV: FP8 scale blocks of whole 16-input runs";
  if (p.bf16)
    launch<__nv_bfloat16>(p, stream);
  else
    launch<__half>(p, stream);
  return "";
}
