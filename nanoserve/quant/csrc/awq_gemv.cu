// AWQ 4-bit weights times one row (batch-1 decode) on CUDA cores, sm_80 and later.
//
//   y[n] = sum_k x[k] (q[k, n] - z[k / G, n]) s[k / G, n]
//
// qweight int32 [K, N / 8]: word (k, w) holds outputs 8 w + c, c's nibble at bit
// (c % 2) * 16 + (c / 2) * 4 (AWQ's order 0 2 4 6 1 3 5 7); qzeros int32 [K / G, N / 8] packed
// alike; scales [K / G, N].
//
// A CTA owns 256 outputs (32 words of a row: 8 lanes x 16 bytes) over `rows` inputs. Each
// quarter warp reads one contiguous 128-byte row segment a step, the form of copy that reads at
// the device's rate (docs/perf-notes.md, session 25: lanes scattered over rows read at 3.2 TB/s,
// whole rows at 4.4), a warp 4 rows, the CTA 16 consecutive rows. A thread's rows of a group
// and their x are loaded a group ahead, its zeros and scales as the group starts, so that one
// group's sums run while the next one's loads are in flight (168 registers, 3 CTAs an SM; H200,
// session 29, Qwen3-8B's layers against loading each group as it starts: qkv 11.6 / 11.2 us, o
// 9.5 / 9.5, gate_up 25.9 / 27.3, down 16.8 / 18.1).
//
// Nibbles i and i + 4 of a word (outputs 2 i and 2 i + 1) become two floats in two bit
// operations: (w >> 4 i) & 0x000F000F | 0x43004300 holds two bf16 128 + q, and a bf16's bits in
// a float's high half are the same value, exactly. A thread sums x (128 + q) over its rows of a
// group for its 32 outputs, then adds s (acc - (128 + z) sum x) once a group: no integer
// conversion, one FMA an element.
//
// K is split over gridDim.y CTAs, each a run of whole groups (uneven where the splits do not
// divide the groups), summed as gemv_split.cuh says. Launched with programmatic dependent
// launch (p.pdl), a CTA fetches its first group's weight rows into L2 before it waits for the
// kernel ahead of it (x is that kernel's output).
#include "awq_gemv.h"
#include "gemv_split.cuh"

namespace {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int OUTS = 256;             // outputs a CTA owns
constexpr int ROW_SLOTS = WARPS * 4;  // rows the CTA reads a step, one a quarter warp

using one_row::load_stream;
using one_row::to_float;

// 16-bit value e of the words' halves (low half first), as a float
__device__ __forceinline__ float half_at(const uint32_t* words, int e, __half) {
  const uint32_t bits = words[e / 2] >> (16 * (e % 2));
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}
__device__ __forceinline__ float half_at(const uint32_t* words, int e, __nv_bfloat16) {
  return __uint_as_float(e % 2 ? words[e / 2] & 0xFFFF0000u : words[e / 2] << 16);
}

// (w & 0x000F000F) | magic in one LOP3 (nvcc makes two of it when magic is an immediate too)
__device__ __forceinline__ uint32_t two_nibbles(uint32_t w, uint32_t magic) {
  uint32_t d;
  asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;" : "=r"(d) : "r"(w), "r"(magic));
  return d;
}

// 128 + the nibble at `shift` of w, as a float (see the file's comment)
__device__ __forceinline__ float nibble_plus_128(uint32_t w, int shift) {
  return __uint_as_float((((w >> shift) & 0xFu) | 0x4300u) << 16);
}

template <typename XT, typename ST, int STEPS>
__global__ void __launch_bounds__(THREADS, 3) awq_gemv_kernel(AwqGemvParams p) {
  constexpr int GROUP = STEPS * ROW_SLOTS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slot = warp * 4 + (lane >> 3);  // this thread's row within a step
  const int col = lane & 7;                 // its 16 bytes of the slice's 128 a row
  const int words = p.n / 8;
  const int word0 = blockIdx.x * (OUTS / 8) + col * 4;
  const bool live = word0 < words;  // n % 32 == 0: a live thread's 4 words all exist
  const int groups = p.k / GROUP;  // this CTA's: [g_begin, g_end)
  const int g_begin = blockIdx.y * groups / gridDim.y;
  const int rows = ((blockIdx.y + 1) * groups / gridDim.y - g_begin) * GROUP;
  const int k_begin = g_begin * GROUP;
  const uint32_t magic = 0x43004300u;
  const XT* x = static_cast<const XT*>(p.x) + k_begin + slot;
  const uint32_t* w = p.qweight + static_cast<size_t>(k_begin + slot) * words + word0;
  float out[32];
#pragma unroll
  for (int o = 0; o < 32; ++o) out[o] = 0.f;
  // lane col of a quarter warp: its row's 128-byte slice in step col of the first group (two
  // lines where the slice straddles them: rows are n / 2 bytes apart)
  if (live && col < STEPS) {
    const uint32_t* slice = w - col * 4 + static_cast<size_t>(col * ROW_SLOTS) * words;
    one_row::prefetch_l2(slice);
    one_row::prefetch_l2(slice + 31);
  }
  one_row::pdl_wait();

  // a group's weights and x are loaded a group ahead, its zeros and scales as it starts: the
  // sums of one group run while the next one's loads are in flight
  uint4 next[STEPS];
  float x_next[STEPS];
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    const size_t row = static_cast<size_t>(s * ROW_SLOTS);
    next[s] = live ? load_stream(w + row * words) : make_uint4(0, 0, 0, 0);
    x_next[s] = to_float(x[row]);
  }
  for (int g0 = 0; g0 < rows; g0 += GROUP) {
    uint4 q[STEPS];
    float xv[STEPS];
#pragma unroll
    for (int s = 0; s < STEPS; ++s) q[s] = next[s], xv[s] = x_next[s];
    const int g = (k_begin + g0) / GROUP;
    uint4 zq = make_uint4(0, 0, 0, 0), sv[4];
    if (live) {
      zq = *reinterpret_cast<const uint4*>(p.qzeros + static_cast<size_t>(g) * words + word0);
      const uint4* sp = reinterpret_cast<const uint4*>(static_cast<const ST*>(p.scales) +
                                                       static_cast<size_t>(g) * p.n + word0 * 8);
#pragma unroll
      for (int j = 0; j < 4; ++j) sv[j] = sp[j];
    }
    if (g0 + GROUP < rows) {
#pragma unroll
      for (int s = 0; s < STEPS; ++s) {
        const size_t row = static_cast<size_t>(g0 + GROUP + s * ROW_SLOTS);
        next[s] = live ? load_stream(w + row * words) : make_uint4(0, 0, 0, 0);
        x_next[s] = to_float(x[row]);
      }
    }
    float acc[32];
#pragma unroll
    for (int o = 0; o < 32; ++o) acc[o] = 0.f;
    float x_sum = 0.f;
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      x_sum += xv[s];
      const uint32_t ws[4] = {q[s].x, q[s].y, q[s].z, q[s].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t v = two_nibbles(ws[j] >> (4 * i), magic);
          acc[8 * j + 2 * i] = fmaf(xv[s], __uint_as_float(v << 16), acc[8 * j + 2 * i]);
          acc[8 * j + 2 * i + 1] =
              fmaf(xv[s], __uint_as_float(v & 0xFFFF0000u), acc[8 * j + 2 * i + 1]);
        }
      }
    }
    if (live) {
      uint32_t sw[16];  // the 32 scales, two a word
#pragma unroll
      for (int j = 0; j < 4; ++j)
        sw[4 * j] = sv[j].x, sw[4 * j + 1] = sv[j].y, sw[4 * j + 2] = sv[j].z,
        sw[4 * j + 3] = sv[j].w;
      const uint32_t zs[4] = {zq.x, zq.y, zq.z, zq.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const float z = nibble_plus_128(zs[j], (c & 1) * 16 + (c >> 1) * 4);
          const float s = half_at(sw, 8 * j + c, ST{});
          out[8 * j + c] = fmaf(s, fmaf(-z, x_sum, acc[8 * j + c]), out[8 * j + c]);
        }
      }
    }
  }

  one_row::pdl_trigger();
  // lanes col, col + 8, col + 16 and col + 24 of a warp hold the same outputs
#pragma unroll
  for (int o = 0; o < 32; ++o) {
    out[o] += __shfl_xor_sync(0xffffffffu, out[o], 8);
    out[o] += __shfl_xor_sync(0xffffffffu, out[o], 16);
  }
  // output col * 32 + o of the slice at [o * 8 + col]: lanes 0-7 write 8 consecutive floats
  __shared__ float by_warp[WARPS][OUTS];
  if (lane < 8) {
#pragma unroll
    for (int o = 0; o < 32; ++o) by_warp[warp][o * 8 + col] = out[o];
  }
  __syncthreads();
  __shared__ float sums[OUTS];
  for (int m = threadIdx.x; m < OUTS; m += THREADS) {  // m = col * 32 + o
    const int at = (m & 31) * 8 + (m >> 5);
    float t = 0.f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) t += by_warp[v][at];
    sums[m] = t;
  }
  __syncthreads();
  static_assert(OUTS % THREADS == 0, "finish: OUTS / THREADS outputs a thread");
  gemv::finish<OUTS / THREADS, 16>(sums, OUTS, blockIdx.x * OUTS, p.n,
                                   static_cast<XT*>(p.y), p.partials, p.counters);
}

template <typename XT, typename ST>
const char* launch_group(const AwqGemvParams& p, dim3 grid, cudaStream_t stream) {
  void (*kernel)(AwqGemvParams) = nullptr;
  switch (p.group) {
    case 32: kernel = awq_gemv_kernel<XT, ST, 2>; break;
    case 64: kernel = awq_gemv_kernel<XT, ST, 4>; break;
    case 128: kernel = awq_gemv_kernel<XT, ST, 8>; break;
    default: return "AWQ GEMV: group size must be 32, 64 or 128";
  }
  one_row::launch(kernel, grid, dim3(THREADS), stream, p.pdl, p);
  return "";
}

template <typename XT>
const char* launch_scales(const AwqGemvParams& p, dim3 grid, cudaStream_t stream) {
  return p.scales_bf16 ? launch_group<XT, __nv_bfloat16>(p, grid, stream)
                       : launch_group<XT, __half>(p, grid, stream);
}

}  // namespace

const char* awq_gemv_launch(const AwqGemvParams& p, cudaStream_t stream) {
  if (p.group < 1 || p.k % p.group || p.splits < 1 || p.splits > p.k / p.group)
    return "AWQ GEMV: K whole groups, split into 1 to K / group runs";
  const dim3 grid((p.n + OUTS - 1) / OUTS, p.splits);
  return p.x_bf16 ? launch_scales<__nv_bfloat16>(p, grid, stream)
                  : launch_scales<__half>(p, grid, stream);
}
