// e4m3 weights times a few rows of e4m3 activations (batched decode: 16 to 64 rows) on tensor
// cores, mma.sync m16n8k32 (sm_89 and later).
//
//   y[m, n] = sum over 128-input steps s of xs[s, m] ws(n, s) sum_{k in s} xq[m, k] w[n, k]
//
// ws(n, s) = scales[scale_row[n], s * 128 / scale_cols] (block-wise, per channel or per shard;
// with scale_cols at least K one scale a row, applied once at the end).
//
// Why not Triton's tiled kernel at these rows (quant/triton_gemm.py): on an H100, Qwen3-8B's o
// at 64 rows took 14.7 us against bf16 cuBLAS's 15.4 for twice the bytes (session 38,
// tools/probes/fp8_rows.py), its 251 registers a thread leaving 8 warps an SM and 31% of the
// device's memory rate (Nsight Compute). Here the weight goes from memory straight into the
// MMA's registers (no shared memory), a step ahead of its use; x's tile of each step is staged
// once in shared memory for the CTA's four warps.
//
// A CTA owns 4 x 8 x WT outputs, a warp WT tiles of 8. Per 128-input step a lane loads 32
// contiguous bytes of its tile row (row g = lane / 4 of each tile, bytes 32 t.. of the step, t
// = lane % 4): four k32 MMAs take words (2q, 2q + 1) as b0, b1. The MMA's k order is the
// lane's (t, word) order, so x's fragments are read in the same permutation: a0 / a2 row g's
// words 2q / 2q + 1 of its bytes 32 t.., a1 / a3 row g + 8's. Each step's products (float32,
// exact sums of e4m3 products within the step) are scaled by x's and the weight's scales and
// added to the accumulators, as the Triton kernel does. K split over gridDim.y CTAs, each a
// run of whole steps, summed in split order by the slice's last CTA.
#include <cuda_fp16.h>

#include "fp8_rows.h"
#include "one_row.cuh"

namespace {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int STEP = 128;          // inputs a step; scale blocks are whole steps
constexpr int X_STAGES = 4;        // x's steps staged ahead in shared memory
constexpr int PITCH = STEP + 16;   // a staged row's bytes: 16 more, no bank conflicts on reads

using one_row::load_stream;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(at), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// d += a (16 x 32, rows) b (32 x 8, columns), e4m3 in, float32 sums
__device__ __forceinline__ void mma_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ void store2(__half* p, float a, float b) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}
__device__ __forceinline__ void store2(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

// a lane's 32 bytes of a row: two 16-byte loads as 8 words
__device__ __forceinline__ void load_words(uint32_t (&w)[8], const uint8_t* at) {
  const uint4 lo = load_stream(at), hi = load_stream(at + 16);
  w[0] = lo.x, w[1] = lo.y, w[2] = lo.z, w[3] = lo.w;
  w[4] = hi.x, w[5] = hi.y, w[6] = hi.z, w[7] = hi.w;
}
__device__ __forceinline__ void shared_words(uint32_t (&w)[8], const uint8_t* at) {
  const uint4 lo = *reinterpret_cast<const uint4*>(at);
  const uint4 hi = *reinterpret_cast<const uint4*>(at + 16);
  w[0] = lo.x, w[1] = lo.y, w[2] = lo.z, w[3] = lo.w;
  w[4] = hi.x, w[5] = hi.y, w[6] = hi.z, w[7] = hi.w;
}

template <typename YT, int M_TILES, int WT, bool ONCE>
__global__ void __launch_bounds__(THREADS) fp8_rows_kernel(Fp8RowsParams p) {
  constexpr int ROWS = 16 * M_TILES;
  constexpr int OUTS = WARPS * 8 * WT;
  __shared__ __align__(16) uint8_t x_tile[X_STAGES][ROWS * PITCH];
  __shared__ __align__(16) float x_scale[X_STAGES][ROWS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int steps = p.k / STEP;  // this CTA's steps: [s_begin, s_begin + run)
  const int s_begin = blockIdx.y * steps / gridDim.y;
  const int run = (blockIdx.y + 1) * steps / gridDim.y - s_begin;
  const int n_warp = blockIdx.x * OUTS + warp * 8 * WT;
  const uint8_t* w_at[WT];  // this lane's row of each tile, at its bytes of the first step
  bool live[WT];            // N a multiple of 8: a tile is whole or past N
  int srow[WT][2];          // the scales of the lane's two outputs of each tile
#pragma unroll
  for (int j = 0; j < WT; ++j) {
    live[j] = n_warp + j * 8 < p.n;
    const int n = live[j] ? n_warp + j * 8 : 0;
    w_at[j] = p.w + static_cast<size_t>(n + g) * p.stride_w + s_begin * STEP + 32 * t;
    srow[j][0] = live[j] ? p.scale_row[n + 2 * t] * p.stride_s : 0;
    srow[j][1] = live[j] ? p.scale_row[n + 2 * t + 1] * p.stride_s : 0;
  }
  uint32_t w_now[WT][8], w_next[WT][8];
#pragma unroll
  for (int j = 0; j < WT; ++j)  // weights only before the wait: no kernel writes them
    if (live[j]) load_words(w_now[j], w_at[j]);
  one_row::pdl_wait();

  auto stage_x = [&](int i) {  // step i's rows of x and their scales into stage i % X_STAGES
    const int st = i % X_STAGES, k0 = (s_begin + i) * STEP;
    for (int c = threadIdx.x; c < ROWS * (STEP / 16); c += THREADS) {
      const int r = c / (STEP / 16), q = c % (STEP / 16);
      cp_async16(&x_tile[st][r * PITCH + q * 16],
                 p.xq + static_cast<size_t>(r) * p.stride_x + k0 + q * 16);
    }
    if (threadIdx.x < ROWS / 4)
      cp_async16(&x_scale[st][threadIdx.x * 4],
                 p.xs + static_cast<size_t>(s_begin + i) * p.stride_xs + threadIdx.x * 4);
  };
#pragma unroll
  for (int i = 0; i < X_STAGES - 1; ++i) {
    if (i < run) stage_x(i);
    cp_async_commit();  // one group a step, empty past the run: the wait counts steps
  }

  float acc[M_TILES][WT][4];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int j = 0; j < WT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mt][j][c] = 0.f;

  for (int i = 0; i < run; ++i) {
    cp_async_wait<X_STAGES - 2>();  // step i's group landed (this thread's copies)
    __syncthreads();                // everyone's; and stage (i - 1) % X_STAGES is read
    if (i + X_STAGES - 1 < run) stage_x(i + X_STAGES - 1);
    cp_async_commit();
    if (i + 1 < run) {
#pragma unroll
      for (int j = 0; j < WT; ++j)
        if (live[j]) load_words(w_next[j], w_at[j] + (i + 1) * STEP);
    }
    float ws[WT][2];
#pragma unroll
    for (int j = 0; j < WT; ++j) {
      const int col = ONCE ? 0 : (s_begin + i) * STEP / p.scale_cols;
      ws[j][0] = ONCE ? 1.f : __ldg(p.scales + srow[j][0] + col);
      ws[j][1] = ONCE ? 1.f : __ldg(p.scales + srow[j][1] + col);
    }
    const int st = i % X_STAGES;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      uint32_t xa[8], xb[8];  // rows g and g + 8 of the row tile, the lane's 32 bytes
      const uint8_t* at = &x_tile[st][(mt * 16 + g) * PITCH + 32 * t];
      shared_words(xa, at);
      shared_words(xb, at + 8 * PITCH);
      float part[WT][4];
#pragma unroll
      for (int j = 0; j < WT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) part[j][c] = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint32_t a[4] = {xa[2 * q], xb[2 * q], xa[2 * q + 1], xb[2 * q + 1]};
#pragma unroll
        for (int j = 0; j < WT; ++j) mma_e4m3(part[j], a, w_now[j][2 * q], w_now[j][2 * q + 1]);
      }
      const float sa = x_scale[st][mt * 16 + g], sb = x_scale[st][mt * 16 + g + 8];
#pragma unroll
      for (int j = 0; j < WT; ++j) {
        acc[mt][j][0] += part[j][0] * sa * ws[j][0];
        acc[mt][j][1] += part[j][1] * sa * ws[j][1];
        acc[mt][j][2] += part[j][2] * sb * ws[j][0];
        acc[mt][j][3] += part[j][3] * sb * ws[j][1];
      }
    }
#pragma unroll
    for (int j = 0; j < WT; ++j)
#pragma unroll
      for (int c = 0; c < 8; ++c) w_now[j][c] = w_next[j][c];
  }
  cp_async_wait<0>();
  one_row::pdl_trigger();

  if (ONCE) {
#pragma unroll
    for (int j = 0; j < WT; ++j) {
      const float s0 = live[j] ? p.scales[srow[j][0]] : 0.f;
      const float s1 = live[j] ? p.scales[srow[j][1]] : 0.f;
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        acc[mt][j][0] *= s0, acc[mt][j][1] *= s1, acc[mt][j][2] *= s0, acc[mt][j][3] *= s1;
      }
    }
  }
  YT* y = static_cast<YT*>(p.y);
  // the lane's outputs: rows mt * 16 + g (+ 8), columns n_warp + 8 j + 2 t (+ 1)
  if (gridDim.y == 1) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int j = 0; j < WT; ++j) {
        const int row = mt * 16 + g, n = n_warp + 8 * j + 2 * t;
        if (!live[j]) continue;
        if (row < p.m) store2(y + static_cast<size_t>(row) * p.n + n, acc[mt][j][0], acc[mt][j][1]);
        if (row + 8 < p.m)
          store2(y + static_cast<size_t>(row + 8) * p.n + n, acc[mt][j][2], acc[mt][j][3]);
      }
    return;
  }
  const size_t size = static_cast<size_t>(p.m) * p.n;
  float* part = p.partials + blockIdx.y * size;
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int j = 0; j < WT; ++j) {
      const int row = mt * 16 + g, n = n_warp + 8 * j + 2 * t;
      if (!live[j]) continue;
      if (row < p.m)
        *reinterpret_cast<float2*>(part + static_cast<size_t>(row) * p.n + n) =
            make_float2(acc[mt][j][0], acc[mt][j][1]);
      if (row + 8 < p.m)
        *reinterpret_cast<float2*>(part + static_cast<size_t>(row + 8) * p.n + n) =
            make_float2(acc[mt][j][2], acc[mt][j][3]);
    }
  __threadfence();  // this CTA's part visible before the count says so
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) last = atomicAdd(p.counters + blockIdx.x, 1) == gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();  // the other CTAs' parts, counted, are visible to this one
  const int first = blockIdx.x * OUTS;
  for (int e = threadIdx.x; e < p.m * (OUTS / 2); e += THREADS) {
    const int row = e / (OUTS / 2), n = first + 2 * (e % (OUTS / 2));
    if (n >= p.n) continue;
    const float* at = p.partials + static_cast<size_t>(row) * p.n + n;
    float2 sum = make_float2(0.f, 0.f);
#pragma unroll 4
    for (int s = 0; s < static_cast<int>(gridDim.y); ++s) {  // in split order
      const float2 v = __ldcg(reinterpret_cast<const float2*>(at + s * size));
      sum.x += v.x, sum.y += v.y;
    }
    store2(y + static_cast<size_t>(row) * p.n + n, sum.x, sum.y);
  }
  if (threadIdx.x == 0) p.counters[blockIdx.x] = 0;
}

template <typename YT, int M_TILES, int WT>
void launch_tiles(const Fp8RowsParams& p, dim3 grid, cudaStream_t stream) {
  const dim3 block(THREADS);
  if (p.scale_cols >= p.k)
    one_row::launch(fp8_rows_kernel<YT, M_TILES, WT, true>, grid, block, stream, p.pdl, p);
  else
    one_row::launch(fp8_rows_kernel<YT, M_TILES, WT, false>, grid, block, stream, p.pdl, p);
}

// 4 tiles a warp only at 16 rows: at 32 and 64 their accumulators and two steps of weights
// spill (255 registers, sm_90)
template <typename YT>
void launch(const Fp8RowsParams& p, dim3 grid, cudaStream_t stream) {
  if (p.x_rows == 16 && p.warp_tiles == 4)
    launch_tiles<YT, 1, 4>(p, grid, stream);
  else if (p.x_rows == 16)
    launch_tiles<YT, 1, 2>(p, grid, stream);
  else if (p.x_rows == 32)
    launch_tiles<YT, 2, 2>(p, grid, stream);
  else
    launch_tiles<YT, 4, 2>(p, grid, stream);
}

}  // namespace

const char* fp8_rows_launch(const Fp8RowsParams& p, cudaStream_t stream) {
  if (p.x_rows != 16 && p.x_rows != 32 && p.x_rows != 64)
    return "FP8 rows kernel: x padded to 16, 32 or 64 rows";
  if (p.m < 1 || p.m > p.x_rows || p.n % 8 || (p.warp_tiles != 2 && p.warp_tiles != 4) ||
      (p.warp_tiles == 4 && p.x_rows != 16))
    return "FP8 rows kernel: 1 to x_rows rows, N a multiple of 8, 2 tiles a warp (4 at 16 rows)";
  if (p.k % STEP || p.splits < 1 || p.splits > p.k / STEP)
    return "FP8 rows kernel: K a multiple of 128, split into 1 to K / 128 runs";
  if (p.scale_cols < 1 || (p.scale_cols < p.k && p.scale_cols % STEP))
    return "FP8 rows kernel: scale blocks of whole 128-input steps";
  const int outs = fp8_rows_outs(p.warp_tiles);
  const dim3 grid((p.n + outs - 1) / outs, p.splits);
  if (p.y_bf16)
    launch<__nv_bfloat16>(p, grid, stream);
  else
    launch<__half>(p, grid, stream);
  return "";
}
