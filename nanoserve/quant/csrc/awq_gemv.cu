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
// whole rows at 4.4), a warp 4 rows, the CTA 4 AWQ_WARPS consecutive rows (16 with the 4 warps
// built by default). A thread's rows of a group, their x and the group's zeros are loaded a
// group ahead, its scales as the group starts, so that one group's sums run while the next
// one's loads are in flight (4 warps: 168 registers, 3 CTAs an SM; H200, session 29, Qwen3-8B's
// layers against loading each group as it starts: qkv 11.6 / 11.2 us, o 9.5 / 9.5, gate_up
// 25.9 / 27.3, down 16.8 / 18.1).
//
// The products run in packed half precision, as AWQ's own GEMV does: nibbles i and i + 4 of a
// word (outputs 2 i and 2 i + 1) become two fp16 1024 + q in one LOP3 ((w >> 4 i) & 0x000F000F
// | 0x64006400), one HSUB2 takes the pair's 1024 + z off (exact: small integers), one HFMA2
// adds x (q - z) for both. A thread sums a pair's rows of a group in fp16 (at most 8 products),
// then widens the sums and scales them into float32 once a group: about 2.4 instructions an
// element against 3.9 with float products (H100, session 30, Qwen3-8B's layers: qkv 10.6 / 12.7
// us, o 9.3 / 10.2, gate_up 22.9 / 28.8, down 15.2 / 17.4; errors against float64 equal).
// x enters fp16 scaled by a power of two per thread and group: the largest |x| of the thread's
// rows of the group is brought into [256, 512), so its fp16 sum of up to 8 products of at most
// 15 |x| stays under 61,440 (fp16 holds 65,504) and an x down to 2^-22 of that largest keeps
// fp16's 11 bits; the float32 scaling after the sums takes the power back off. A fixed 2^-8
// (session 30's first form) overflowed past |x| = 1.4e5 and lost precision under |x| = 2^-6.
//
// With x_order (act-order GPTQ run as AWQ: quant/formats.gptq_as_awq) a thread reads its x
// through the order, gathered here rather than by a kernel of its own ahead of this one (one a
// layer: about 0.9 ms of Qwen3-8B's 4.97 ms batch-1 step at 32K on an H200, session 32). The
// order is a template argument: as a runtime branch in every load it cost plain AWQ 0.18 ms of
// that step (4.19-4.20 ms against 4.02, alternating on an H200, session 35).
//
// K is split over gridDim.y CTAs, each a run of whole groups (uneven where the splits do not
// divide the groups), summed as gemv_split.cuh says. Launched with programmatic dependent
// launch (p.pdl), a CTA fetches its first group's weight rows into L2 before it waits for the
// kernel ahead of it (x is that kernel's output).
#include "awq_gemv.h"
#include "gemv_split.cuh"

namespace {

// warps a CTA and the CTAs an SM its registers are held to: macros so that
// tools/probes/awq_variants.py can build and time other shapes of the same kernel
#ifndef AWQ_WARPS
#define AWQ_WARPS 4
#endif
#ifndef AWQ_CTAS_PER_SM
#define AWQ_CTAS_PER_SM 3
#endif
constexpr int WARPS = AWQ_WARPS;
constexpr int THREADS = WARPS * 32;
constexpr int OUTS = 256;             // outputs a CTA owns
constexpr int ROW_SLOTS = WARPS * 4;  // rows the CTA reads a step, one a quarter warp
static_assert(32 % ROW_SLOTS == 0, "every group size a whole number of steps");

using one_row::load_stream;
using one_row::to_float;

// the two 16-bit scales of a word (low half first) as floats
__device__ __forceinline__ float2 two_scales(uint32_t word, __half) {
  return __half22float2(*reinterpret_cast<const __half2*>(&word));
}
__device__ __forceinline__ float2 two_scales(uint32_t word, __nv_bfloat16) {
  return make_float2(__uint_as_float(word << 16), __uint_as_float(word & 0xFFFF0000u));
}

__device__ __forceinline__ __half2 as_half2(uint32_t v) {
  return *reinterpret_cast<const __half2*>(&v);
}

// (w & 0x000F000F) | magic in one LOP3 (nvcc makes two of it when magic is an immediate too)
__device__ __forceinline__ uint32_t two_nibbles(uint32_t w, uint32_t magic) {
  uint32_t d;
  asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;" : "=r"(d) : "r"(w), "r"(magic));
  return d;
}

template <typename XT, typename ST, int STEPS, bool ORDERED>
__global__ void __launch_bounds__(THREADS, AWQ_CTAS_PER_SM) awq_gemv_kernel(AwqGemvParams p) {
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
  const uint32_t magic = 0x64006400u;  // two fp16 1024
  const XT* x = static_cast<const XT*>(p.x) + k_begin + slot;
  const int32_t* order = ORDERED ? p.x_order + k_begin + slot : nullptr;  // x's k: order[row]
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

  // a group's weights, x and zeros are loaded a group ahead, its scales as it starts: the sums
  // of one group run while the next one's loads are in flight
  uint4 next[STEPS], next_z = make_uint4(0, 0, 0, 0);
  XT x_next[STEPS];  // as loaded: converted when its group starts, the loads long landed
  const auto load_group = [&](int g0) {
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      const size_t row = static_cast<size_t>(g0 + s * ROW_SLOTS);
      next[s] = live ? load_stream(w + row * words) : make_uint4(0, 0, 0, 0);
      if constexpr (ORDERED)
        x_next[s] = static_cast<const XT*>(p.x)[order[row]];
      else
        x_next[s] = x[row];
    }
    if (live)
      next_z = *reinterpret_cast<const uint4*>(
          p.qzeros + static_cast<size_t>((k_begin + g0) / GROUP) * words + word0);
  };
  load_group(0);
  for (int g0 = 0; g0 < rows; g0 += GROUP) {
    uint4 q[STEPS];
    XT xs[STEPS];
#pragma unroll
    for (int s = 0; s < STEPS; ++s) q[s] = next[s], xs[s] = x_next[s];
    const uint32_t zs[4] = {next_z.x, next_z.y, next_z.z, next_z.w};
    uint4 sv[4] = {};  // the 32 scales, two a word
    if (live) {
      const size_t at = static_cast<size_t>((k_begin + g0) / GROUP) * p.n + word0 * 8;
      const uint4* sp = reinterpret_cast<const uint4*>(static_cast<const ST*>(p.scales) + at);
#pragma unroll
      for (int j = 0; j < 4; ++j) sv[j] = sp[j];
    }
    if (g0 + GROUP < rows) load_group(g0 + GROUP);
    // x into fp16 times 2^e, e putting the largest |x| of the thread's rows in [256, 512): its
    // biased exponent b, 2^(135 - b); b at least 9 keeps both powers normal floats (an x under
    // 2^-118 is taken as 0; an infinite one stays so)
    float largest = 0.f;
#pragma unroll
    for (int s = 0; s < STEPS; ++s) largest = fmaxf(largest, fabsf(to_float(xs[s])));
    const uint32_t b = max(__float_as_uint(largest) >> 23, 9u);
    const float scale = __uint_as_float((262u - b) << 23);
    const float unscale = __uint_as_float((b - 8u) << 23);
    __half2 x2[STEPS];
#pragma unroll
    for (int s = 0; s < STEPS; ++s) x2[s] = __half2half2(__float2half_rn(to_float(xs[s]) * scale));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t sw[4] = {sv[j].x, sv[j].y, sv[j].z, sv[j].w};  // outputs 8 j to 8 j + 7
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // outputs 8 j + 2 i and 8 j + 2 i + 1
        const __half2 z = as_half2(two_nibbles(zs[j] >> (4 * i), magic));
        __half2 acc = __float2half2_rn(0.f);
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
          const uint32_t ws[4] = {q[s].x, q[s].y, q[s].z, q[s].w};
          acc = __hfma2(x2[s], __hsub2(as_half2(two_nibbles(ws[j] >> (4 * i), magic)), z), acc);
        }
        const float2 a = __half22float2(acc), sc = two_scales(sw[i], ST{});
        out[8 * j + 2 * i] = fmaf(sc.x * unscale, a.x, out[8 * j + 2 * i]);
        out[8 * j + 2 * i + 1] = fmaf(sc.y * unscale, a.y, out[8 * j + 2 * i + 1]);
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

template <typename XT, typename ST, bool ORDERED>
const char* launch_group(const AwqGemvParams& p, dim3 grid, cudaStream_t stream) {
  void (*kernel)(AwqGemvParams) = nullptr;
  switch (p.group) {
    case 32: kernel = awq_gemv_kernel<XT, ST, 32 / ROW_SLOTS, ORDERED>; break;
    case 64: kernel = awq_gemv_kernel<XT, ST, 64 / ROW_SLOTS, ORDERED>; break;
    case 128: kernel = awq_gemv_kernel<XT, ST, 128 / ROW_SLOTS, ORDERED>; break;
    default: return "AWQ GEMV: group size must be 32, 64 or 128";
  }
  one_row::launch(kernel, grid, dim3(THREADS), stream, p.pdl, p);
  return "";
}

template <typename XT>
const char* launch_scales(const AwqGemvParams& p, dim3 grid, cudaStream_t stream) {
  if (p.x_order)
    return p.scales_bf16 ? launch_group<XT, __nv_bfloat16, true>(p, grid, stream)
                         : launch_group<XT, __half, true>(p, grid, stream);
  return p.scales_bf16 ? launch_group<XT, __nv_bfloat16, false>(p, grid, stream)
                       : launch_group<XT, __half, false>(p, grid, stream);
}

}  // namespace

const char* awq_gemv_launch(const AwqGemvParams& p, cudaStream_t stream) {
  if (p.group < 1 || p.k % p.group || p.splits < 1 || p.splits > p.k / p.group)
    return "AWQ GEMV: K whole groups, split into 1 to K / group runs";
  const dim3 grid((p.n + OUTS - 1) / OUTS, p.splits);
  return p.x_bf16 ? launch_scales<__nv_bfloat16>(p, grid, stream)
                  : launch_scales<__half>(p, grid, stream);
}
