// Split-KV decode attention over a paged FP8 (e4m3, one float32 scale per token and kv head)
// cache on tensor cores, for head_dim 128 and GQA groups of up to 16: stage 1 of
// attention/triton_decode.py (same partial outputs and log-sum-exps, merged by its stage 2),
// written by hand because the Triton kernel stays at 1.5-1.7x its memory floor at every tile
// setting (docs/perf-notes.md, session 18).
//
// Block (sequence b, kv head h, split s): 4 warps, each taking every fourth 32-token tile of
// the split; the warps' partials merge in shared memory at the end. A warp copies its tiles
// (cp.async, STAGES tiles deep: the next tiles' loads are in flight while this one computes)
// as whole 128-byte token rows, 8 lanes a row, into rows of swizzled 16-byte chunks (Stage,
// swizzle), and each lane reads back the chunks of its m16n8k16 MMA fragments with no bank
// conflict: no layout shuffles, and only a warp sync between the loads and the MMAs. The
// copies' lanes must not scatter: a quarter warp's 16-byte pieces from 4 rows (each lane
// copying the bytes its own fragments need) read at 3.2 TB/s on an H200, from one row at 4.4
// (tools/probes/copy_forms.py). The scales: lane i copies token i's.
// The dots are transposed, the group on the MMA's N side (8 heads; 16 take two N tiles):
// - scores S^T = K.Q^T [16 tokens, 8 heads] per MMA, K the A operand: lane (g = lane / 4,
//   j = lane % 4) holds rows g and g + 8 (tokens) and four values of the MMA's k (head_dim)
//   slice. A dot is a sum over head_dim in any order, so k-step t's values for lane j are
//   taken as head_dim 16j + 4t + [0, 4) for t < 4 and 64 + 16j + 4(t - 4) + [0, 4) after: a
//   lane reads two 16-byte chunks (j, 4 + j) of each of its tokens (8n + g). Q's B fragment
//   takes the same order.
// - the output O^T += V^T.P^T [16 of head_dim, 8 heads], V^T the A operand: lane (g, j)
//   holds tokens 2j, 2j + 1, 2j + 8, 2j + 9 of a 16-token k-step at rows g, g + 8, so row
//   g (g + 8) of MMA i is taken as head_dim 16g + i (16g + 8 + i): a lane reads chunk g of
//   each of its 4 tokens and pairs their bytes with byte permutes.
// - the scores' accumulator gives a lane tokens g, g + 8 of heads 2j, 2j + 1; P^T's B
//   fragment wants tokens 2j.. of head g: each 8 x 8 quarter is one movmatrix transpose.
//   Softmax statistics are per head (a column): a lane's running max is the warp's (reduced
//   over g), its running sum its own tokens' (reduced at the end).
// e4m3 converts to float16 exactly, two values an instruction (cvt.rn.f16x2.e4m3x2, sm_89+).
// K's scale multiplies the score; V's multiplies the probability relative to the largest V
// scale seen so far (the output is kept in units of it), so p x scale stays in float16's
// range. The output is rescaled only in a tile where a head's maximum or that V scale grew.
// The block's page numbers are read into shared memory once, before any copy: a page read
// in the loop waits behind the copies in flight (several microseconds under a full memory
// system) and held up the next copy.
//
// Measured on an H200 (tools/probes/fp8_decode_once.py under ncu): loading straight into
// registers read at 2.0x the floor; the first pipelined form executed 1,880 instructions a
// warp per tile (per-token address arithmetic and branches, 16 scale copies a lane, the
// output rescaled every tile) and stalled on fixed-latency dependencies at 8 warps an SM;
// with the group on M (twice the MMAs, 168 registers) it executed 29.7M instructions at
// 1 x 128K against the transposed form's 24.0M (111.6 against 106.5 us). Widening e4m3 costs
// nothing measurable (tools/probes/fp8_convert_rate.py): with lane-private copies the
// kernel's copies alone took 92 of its 97 us at 1 x 128K.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "fp8_decode.h"

namespace {

constexpr int WARPS = 4;
constexpr int TILE = FP8_DECODE_TILE;
constexpr int D = FP8_DECODE_HEAD_DIM;
constexpr unsigned ALL = 0xffffffffu;

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {
  uint32_t out;
  const uint16_t in = static_cast<uint16_t>(two);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(in));
  return out;
}

__device__ __forceinline__ uint32_t permute(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t out;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(selector));
  return out;
}

// an 8 x 8 matrix of 16-bit values, each lane holding row lane / 4's elements 2 (lane % 4) and
// 2 (lane % 4) + 1, returned as the same fragment of its transpose
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t out;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(out) : "r"(x));
  return out;
}

__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// asynchronous copies to shared memory; bytes 0 fills the slot with zeros and reads nothing
__device__ __forceinline__ void copy16(void* dst, const void* src, bool real) {
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(at), "l"(src),
               "r"(real ? 16 : 0));
}

__device__ __forceinline__ void copy4(void* dst, const void* src, bool real) {
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(at), "l"(src),
               "r"(real ? 4 : 0));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void wait_until_pending() {
  // "memory": no shared memory read moves above the wait
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// a lane's 16-byte slot as one 128-bit shared load (a uint4 copy may become four 32-bit
// loads, each a 4-way bank conflict across the warp)
__device__ __forceinline__ uint4 load_slot(const uint4& slot) {
  uint4 v;
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(&slot));
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(at) : "memory");
  return v;
}

// One tile's bytes for one warp: K's 32 token rows of 128 bytes, then V's, each row's 16-byte
// chunk c kept at chunk c ^ swizzle(row). k_scale, v_scale: token i's, copied by lane i
struct alignas(16) Stage {
  uint4 k[TILE][8];
  uint4 v[TILE][8];
  float k_scale[TILE];
  float v_scale[TILE];
};

// A 16-byte access is served 8 lanes at a time: a quarter warp copies one row's 8 chunks (any
// permutation of them meets 8 bank groups), and reading fragments it meets 8 distinct chunks
// of 2 (K) or 4 (V) rows: K's lanes 4g + j read rows g, g + 1 (g even) at chunks j (or 4 + j),
// and the row's parity flips bit 2; V's read rows 2j + e at chunks g, g + 1, and the rows'
// bits 1 and 2 vary with j. Only a row's low 3 bits count
__device__ __forceinline__ int swizzle(int row) {
  return (((row >> 1) & 3) << 1) ^ ((row & 1) << 2);
}

// the block's page numbers in shared memory, after the stages: a split of up to this many
// pages (128K tokens at 256-token pages) reads none of them in its loop. Fewer where the
// device's shared memory a block ends sooner (sm_86 / sm_89 / sm_120: 99 KB, the 3 stages'
// 99 KB leave none): the launch says how many (Fp8DecodeParams::cached_pages), and a longer
// split reads its pages from the table
constexpr int CACHED_PAGES = 512;

// Where one warp's copies of a tile go from: the tile's tokens [t0, t0 + 32) and which of
// them are real, [start, ctx) (the others are zeros, never the NaN bytes past a context)
struct TileSource {
  const Fp8DecodeParams& p;
  const int32_t* table;
  const int* pages;  // the split's pages from first_page on, or nullptr: read from the table
  int first_page;
  const uint8_t* k_head;  // the kv head's bytes at token 0 of page 0, plus the lane's chunk
  const uint8_t* v_head;  // likewise for V
  const float* ks_head;
  const float* vs_head;
  int start, ctx, lane;
  // copy m takes row 4m + lane / 8, chunk lane % 8: its place in Stage::k (or v), in 16-byte
  // chunks, is into[m % 2] + 64 (m / 2); the lane's scale, in floats
  int into[2], s_row;

  __device__ TileSource(const Fp8DecodeParams& p_, const int32_t* table_, const int* pages_,
                        int first_page_, const uint8_t* k_, const uint8_t* v_, const float* ks_,
                        const float* vs_, int start_, int ctx_, int lane_)
      : p(p_), table(table_), pages(pages_), first_page(first_page_), k_head(k_), v_head(v_),
        ks_head(ks_), vs_head(vs_), start(start_), ctx(ctx_), lane(lane_) {
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const int row = 4 * m + lane / 8;
      into[m] = 8 * row + ((lane % 8) ^ swizzle(row));
    }
    s_row = lane * static_cast<int>(p.stride_st);
  }

  __device__ __forceinline__ bool real(int tok) const { return tok >= start && tok < ctx; }

  // a tile lies in one page when pages hold 32 tokens or more
  __device__ __forceinline__ bool one_page() const { return p.page_shift >= 5; }

  __device__ __forceinline__ void copy(Stage& st, int t0) const {
    uint4* k_to = &st.k[0][0];
    uint4* v_to = &st.v[0][0];
    const bool full = t0 >= start && t0 + TILE <= ctx;
    if (one_page()) {  // offsets from the tile's page
      const int at_page = t0 >> p.page_shift;
      const int64_t page = pages != nullptr ? pages[at_page - first_page] : table[at_page];
      const int first = t0 & ((1 << p.page_shift) - 1);
      const uint8_t* k = k_head + page * p.stride_kp + first * static_cast<int>(p.stride_kt);
      const uint8_t* v = v_head + page * p.stride_vp + first * static_cast<int>(p.stride_vt);
      const int64_t s = page * p.stride_sp + first * static_cast<int>(p.stride_st) + s_row;
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const int row = 4 * m + lane / 8;
        const bool in = full || real(t0 + row);
        copy16(k_to + into[m % 2] + 64 * (m / 2), k + row * static_cast<int>(p.stride_kt), in);
        copy16(v_to + into[m % 2] + 64 * (m / 2), v + row * static_cast<int>(p.stride_vt), in);
      }
      const bool in = full || real(t0 + lane);
      copy4(&st.k_scale[lane], ks_head + s, in);
      copy4(&st.v_scale[lane], vs_head + s, in);
      return;
    }
    // pages of fewer than 32 tokens: a table read per token (real tokens only: the table's
    // entries past a sequence's pages are not read)
    const int mask = (1 << p.page_shift) - 1;
    auto from = [&](const uint8_t* head, int64_t page_stride, int64_t token_stride,
                    int tok) -> const uint8_t* {
      return real(tok) ? head + table[tok >> p.page_shift] * page_stride + (tok & mask) *
                                                                              token_stride
                       : head;
    };
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const int tok = t0 + 4 * m + lane / 8;
      copy16(k_to + into[m % 2] + 64 * (m / 2), from(k_head, p.stride_kp, p.stride_kt, tok),
             real(tok));
      copy16(v_to + into[m % 2] + 64 * (m / 2), from(v_head, p.stride_vp, p.stride_vt, tok),
             real(tok));
    }
    const int tok = t0 + lane;
    const int64_t s = real(tok) ? table[tok >> p.page_shift] * p.stride_sp +
                                      (tok & mask) * p.stride_st : 0;
    copy4(&st.k_scale[lane], ks_head + s, real(tok));
    copy4(&st.v_scale[lane], vs_head + s, real(tok));
  }
};

__device__ __forceinline__ float q_value(const Fp8DecodeParams& p, int64_t at) {
  if (p.q_bf16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p.q)[at]);
  return __half2float(static_cast<const __half*>(p.q)[at]);
}

// UPPER: the group has more than 8 heads, a second N tile. STAGES: tiles a warp has in shared
// memory, the one it computes and STAGES - 1 in flight
template <bool UPPER, int STAGES>
__global__ void __launch_bounds__(WARPS * 32)
fp8_decode_split_kernel(const Fp8DecodeParams p) {
  constexpr int NT = UPPER ? 2 : 1;  // N tiles of 8 heads
  extern __shared__ Stage stages[];  // [warp][STAGES], then p.cached_pages page numbers
  const int b = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, j = lane % 4;
  const int ctx = p.context_lens[b];
  const int start = p.starts != nullptr ? p.starts[b] : 0;
  const int num_tiles = (ctx + TILE - 1) / TILE;
  const int first_tile = start / TILE;
  const int per_split = (num_tiles - first_tile + p.num_splits - 1) / p.num_splits;
  const int tile_lo = first_tile + s * per_split;
  const int tile_hi = min(tile_lo + per_split, num_tiles);
  Stage* mine = stages + warp * STAGES;
  const int32_t* table = p.page_table + b * p.stride_pt;
  // Q^T's B fragments' values: column g of N tile u is head 8u + g; k-step t's values for lane
  // j are head_dim 16j + 4t + [0, 4) (t < 4) and 64 + 16j + 4(t - 4) + [0, 4), as K's chunks
  // hold them. Their loads go out first, beside the page numbers'
  float q[NT][8][4];
#pragma unroll
  for (int u = 0; u < NT; ++u) {
    const int head = 8 * u + g;
    const bool real = head < p.group;
    const int64_t at = b * p.stride_qb + (kvh * p.group + head) * p.stride_qh + 16 * j;
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        q[u][t][e] = real ? q_value(p, at + 4 * (t % 4) + 64 * (t / 4) + e) : 0.f;
  }
  // the split's pages, once (every page of [tile_lo, tile_hi) is the sequence's)
  int* cached = reinterpret_cast<int*>(stages + WARPS * STAGES);
  const int first_page = (tile_lo * TILE) >> p.page_shift;
  const int num_pages =
      tile_lo < tile_hi ? ((tile_hi * TILE - 1) >> p.page_shift) - first_page + 1 : 0;
  const bool use_cache = p.page_shift >= 5 && num_pages <= p.cached_pages;
  if (use_cache)
    for (int i = threadIdx.x; i < num_pages; i += WARPS * 32) cached[i] = table[first_page + i];
  __syncthreads();
  const TileSource source{p, table, use_cache ? cached : nullptr, first_page,
                          p.k + kvh * p.stride_kh + 16 * (lane % 8),
                          p.v + kvh * p.stride_vh + 16 * (lane % 8),
                          p.k_scale + kvh * p.stride_sh, p.v_scale + kvh * p.stride_sh,
                          start, ctx, lane};
  // the warp's tiles are tile_lo + warp + WARPS x i; the first STAGES - 1 go in flight now.
  // Every step commits a group, empty or not, so "all but the newest STAGES - 1 groups
  // done" always means "this step's tile is here"
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    const int tile = tile_lo + warp + WARPS * i;
    if (tile < tile_hi) source.copy(mine[i], tile * TILE);
    commit();
  }

  // Q^T's B fragments, packed from q (read at the start, beside the page numbers)
  uint32_t qb[NT][8][2];
#pragma unroll
  for (int u = 0; u < NT; ++u)
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      qb[u][t][0] = pack_f16(q[u][t][0], q[u][t][1]);
      qb[u][t][1] = pack_f16(q[u][t][2], q[u][t][3]);
    }

  // o[u][i]: head_dim 16g + i (elements 0, 1) and 16g + 8 + i (2, 3) of heads 8u + 2j, + 1
  float o[NT][8][4];
#pragma unroll
  for (int u = 0; u < NT; ++u)
#pragma unroll
    for (int i = 0; i < 8; ++i) o[u][i][0] = o[u][i][1] = o[u][i][2] = o[u][i][3] = 0.f;
  float m[NT][2], l[NT][2];
#pragma unroll
  for (int u = 0; u < NT; ++u) m[u][0] = m[u][1] = -INFINITY, l[u][0] = l[u][1] = 0.f;
  float v_ref = 1e-30f;  // the output is kept in units of this V scale, the largest seen

  // the lane's chunks in the swizzled rows: K's row 16h (+ 8) + g holds its bytes 16j.. at
  // k_lo and 64 + 16j.. at k_hi; V's rows 16h + 2j (+ 8) and 16h + 2j + 1 (+ 8) its head_dim
  // 16g.. at v_even and v_odd
  const int k_lo = j ^ swizzle(g), k_hi = (4 + j) ^ swizzle(g);
  const int v_even = g ^ swizzle(2 * j), v_odd = g ^ swizzle(2 * j + 1);
  int slot = 0;
  for (int tile = tile_lo + warp; tile < tile_hi; tile += WARPS) {
    {  // the tile STAGES - 1 ahead goes into the slot the previous step read
      const int ahead = tile + WARPS * (STAGES - 1);
      if (ahead < tile_hi) source.copy(mine[slot == 0 ? STAGES - 1 : slot - 1], ahead * TILE);
      commit();
    }
    wait_until_pending<STAGES - 1>();
    __syncwarp();  // the scales other lanes copied
    const Stage& st = mine[slot];
    slot = slot == STAGES - 1 ? 0 : slot + 1;
    const int t0 = tile * TILE;
    const bool full = t0 >= start && t0 + TILE <= ctx;

    // scores in log2 units: sc[u][h] holds tokens 16h + g (elements 0, 1) and 16h + 8 + g
    // (2, 3) of heads 8u + 2j, + 1
    float sc[NT][2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int u = 0; u < NT; ++u) sc[u][h][0] = sc[u][h][1] = sc[u][h][2] = sc[u][h][3] = 0.f;
      const uint4 r0a = load_slot(st.k[16 * h + g][k_lo]), r0b = load_slot(st.k[16 * h + g][k_hi]);
      const uint4 r1a = load_slot(st.k[16 * h + 8 + g][k_lo]),
                  r1b = load_slot(st.k[16 * h + 8 + g][k_hi]);
      const uint32_t w0[8] = {r0a.x, r0a.y, r0a.z, r0a.w, r0b.x, r0b.y, r0b.z, r0b.w};
      const uint32_t w1[8] = {r1a.x, r1a.y, r1a.z, r1a.w, r1b.x, r1b.y, r1b.z, r1b.w};
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        const uint32_t a[4] = {e4m3x2_to_f16x2(w0[t] & 0xFFFF), e4m3x2_to_f16x2(w1[t] & 0xFFFF),
                               e4m3x2_to_f16x2(w0[t] >> 16), e4m3x2_to_f16x2(w1[t] >> 16)};
#pragma unroll
        for (int u = 0; u < NT; ++u) mma(sc[u][h], a, qb[u][t][0], qb[u][t][1]);
      }
    }
    float k_scale[2][2], v_scale[2][2];  // [h][r]: token 16h + 8r + g's
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        k_scale[h][r] = st.k_scale[16 * h + 8 * r + g] * p.scale_log2;
        v_scale[h][r] = st.v_scale[16 * h + 8 * r + g];
      }
#pragma unroll
    for (int u = 0; u < NT; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const bool in = full || source.real(t0 + 16 * h + 8 * r + g);
#pragma unroll
          for (int e = 0; e < 2; ++e)
            sc[u][h][2 * r + e] = in ? sc[u][h][2 * r + e] * k_scale[h][r] : -INFINITY;
        }
    // online softmax per head (a column): its 32 tokens lie in the 8 lanes of its j
    float alpha[NT][2];
#pragma unroll
    for (int u = 0; u < NT; ++u)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float mx = fmaxf(fmaxf(sc[u][0][e], sc[u][0][2 + e]), fmaxf(sc[u][1][e], sc[u][1][2 + e]));
        mx = fmaxf(mx, __shfl_xor_sync(ALL, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(ALL, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(ALL, mx, 16));
        alpha[u][e] = 1.f;
        if (mx > m[u][e]) {
          alpha[u][e] = exp2f(m[u][e] - mx);
          m[u][e] = mx;
        }
        const float base = m[u][e] == -INFINITY ? 0.f : m[u][e];
        float sum = 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            sc[u][h][2 * r + e] = exp2f(sc[u][h][2 * r + e] - base);
            sum += sc[u][h][2 * r + e];
          }
        l[u][e] = l[u][e] * alpha[u][e] + sum;
      }
    // scales are >= 0: their bits order as the values do, and one reduction takes their max
    const float v_max =
        __uint_as_float(__reduce_max_sync(ALL, __float_as_uint(st.v_scale[lane])));
    const float unit = v_max > v_ref ? v_ref / v_max : 1.f;  // (warp-uniform)
    v_ref = fmaxf(v_ref, v_max);
    bool grew = unit != 1.f;
#pragma unroll
    for (int u = 0; u < NT; ++u) grew = grew || alpha[u][0] != 1.f || alpha[u][1] != 1.f;
    if (__any_sync(ALL, grew)) {
#pragma unroll
      for (int u = 0; u < NT; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          o[u][i][0] *= alpha[u][0] * unit;
          o[u][i][1] *= alpha[u][1] * unit;
          o[u][i][2] *= alpha[u][0] * unit;
          o[u][i][3] *= alpha[u][1] * unit;
        }
    }
    const float inv = 1.f / v_ref;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the PV k-step over tokens 16h .. 16h + 15
      // P^T's B fragments: tokens 16h + 2j, + 1 (first) and 16h + 8 + 2j, + 1 of head 8u + g
      uint32_t pb[NT][2];
#pragma unroll
      for (int u = 0; u < NT; ++u)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float rel = v_scale[h][r] * inv;
          pb[u][r] = transpose8x8(pack_f16(sc[u][h][2 * r] * rel, sc[u][h][2 * r + 1] * rel));
        }
      const uint4 va = load_slot(st.v[16 * h + 2 * j][v_even]);
      const uint4 vb = load_slot(st.v[16 * h + 2 * j + 1][v_odd]);
      const uint4 vc = load_slot(st.v[16 * h + 2 * j + 8][v_even]);
      const uint4 vd = load_slot(st.v[16 * h + 2 * j + 9][v_odd]);
      const uint32_t a[4] = {va.x, va.y, va.z, va.w};
      const uint32_t bb[4] = {vb.x, vb.y, vb.z, vb.w};
      const uint32_t c[4] = {vc.x, vc.y, vc.z, vc.w};
      const uint32_t d[4] = {vd.x, vd.y, vd.z, vd.w};
      // byte x of the lane's 16 (head_dim 16g + x) of tokens (2j, 2j + 1) and (2j + 8, 2j + 9)
      uint32_t lo[16], hi[16];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const uint32_t x01 = permute(a[w], bb[w], 0x5140), y01 = permute(a[w], bb[w], 0x7362);
        const uint32_t x89 = permute(c[w], d[w], 0x5140), y89 = permute(c[w], d[w], 0x7362);
        lo[4 * w] = x01 & 0xFFFF, lo[4 * w + 1] = x01 >> 16;
        lo[4 * w + 2] = y01 & 0xFFFF, lo[4 * w + 3] = y01 >> 16;
        hi[4 * w] = x89 & 0xFFFF, hi[4 * w + 1] = x89 >> 16;
        hi[4 * w + 2] = y89 & 0xFFFF, hi[4 * w + 3] = y89 >> 16;
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t va4[4] = {e4m3x2_to_f16x2(lo[i]), e4m3x2_to_f16x2(lo[8 + i]),
                                 e4m3x2_to_f16x2(hi[i]), e4m3x2_to_f16x2(hi[8 + i])};
#pragma unroll
        for (int u = 0; u < NT; ++u) mma(o[u][i], va4, pb[u][0], pb[u][1]);
      }
    }
  }

  // the warps' partials, merged: each head's sum over its lanes, the output in true units,
  // o_s[w][head][dim] (pitch 129: a store's lanes meet at most four to a bank, the merge's
  // reads none). They reuse the stages' memory, once every copy has landed and every warp has
  // read its last
  constexpr int PITCH = D + 1;
  wait_until_pending<0>();
  __syncthreads();
  auto& o_s = *reinterpret_cast<float(*)[WARPS][16][PITCH]>(stages);
  auto& m_s = *reinterpret_cast<float(*)[WARPS][16]>(&o_s[WARPS][0][0]);
  auto& l_s = *reinterpret_cast<float(*)[WARPS][16]>(&m_s[WARPS][0]);
#pragma unroll
  for (int u = 0; u < NT; ++u)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float sum = l[u][e];
      sum += __shfl_xor_sync(ALL, sum, 4);
      sum += __shfl_xor_sync(ALL, sum, 8);
      sum += __shfl_xor_sync(ALL, sum, 16);
      if (g == 0) {
        m_s[warp][8 * u + 2 * j + e] = m[u][e];
        l_s[warp][8 * u + 2 * j + e] = sum;
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        o_s[warp][8 * u + 2 * j + e][16 * g + i] = o[u][i][e] * v_ref;
        o_s[warp][8 * u + 2 * j + e][16 * g + 8 + i] = o[u][i][2 + e] * v_ref;
      }
    }
  __syncthreads();
  const int rows = UPPER ? p.group : min(p.group, 8);
  for (int idx = threadIdx.x; idx < rows * D; idx += WARPS * 32) {
    const int r = idx / D, col = idx % D;
    float top = -INFINITY;
    for (int w = 0; w < WARPS; ++w) top = fmaxf(top, m_s[w][r]);
    float sum = 0.f, acc = 0.f;
    if (top != -INFINITY)
      for (int w = 0; w < WARPS; ++w) {
        const float f = exp2f(m_s[w][r] - top);
        sum += l_s[w][r] * f;
        acc += o_s[w][r][col] * f;
      }
    const int head = kvh * p.group + r;
    const bool any = top != -INFINITY && sum > 0.f;
    p.mid_o[b * p.stride_mob + head * p.stride_moh + s * p.stride_mos + col] =
        any ? acc / sum : 0.f;
    if (col == 0)
      p.mid_lse[b * p.stride_mlb + head * p.stride_mlh + s] =
          any ? (top + log2f(sum)) * 0.69314718055994530942f : -INFINITY;
  }
}

constexpr int MERGE_BYTES = (WARPS * 16 * (D + 1) + 2 * WARPS * 16) * sizeof(float);

// The current device's shared memory a block may opt into, asked of the driver once per device
// (a launch of an eager step would ask again otherwise); nullptr or why it could not be asked
const char* shared_memory_limit(int* most) {
  constexpr int DEVICES = 64;
  static int known[DEVICES] = {};  // 0: not asked yet
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  if (device < DEVICES && known[device] > 0) {
    *most = known[device];
    return nullptr;
  }
  err = cudaDeviceGetAttribute(most, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  if (device < DEVICES) known[device] = *most;
  return nullptr;
}

template <bool UPPER, int STAGES>
const char* launch(const Fp8DecodeParams& p, dim3 grid, cudaStream_t stream) {
  constexpr int stage_bytes = WARPS * STAGES * sizeof(Stage);
  static_assert(stage_bytes >= MERGE_BYTES, "the merge reuses the stages' shared memory");
  // the page numbers take what the device has past the stages, up to CACHED_PAGES
  int most = 0;
  if (const char* failed = shared_memory_limit(&most)) return failed;
  if (most < stage_bytes) return "fp8_decode: the stages do not fit this GPU's shared memory";
  Fp8DecodeParams args = p;
  args.cached_pages = min(CACHED_PAGES, static_cast<int>((most - stage_bytes) / sizeof(int)));
  const int bytes = stage_bytes + args.cached_pages * static_cast<int>(sizeof(int));
  // past 48 KiB a kernel asks for its shared memory, on the current device (not a stream
  // operation: allowed while a graph captures, as flash-attn's launches do)
  const cudaError_t asked = cudaFuncSetAttribute(
      fp8_decode_split_kernel<UPPER, STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (asked != cudaSuccess) return cudaGetErrorString(asked);
  fp8_decode_split_kernel<UPPER, STAGES><<<grid, WARPS * 32, bytes, stream>>>(args);
  return nullptr;
}

template <bool UPPER>
const char* launch_stages(const Fp8DecodeParams& p, dim3 grid, int stages, cudaStream_t stream) {
  switch (stages) {
    case 2: return launch<UPPER, 2>(p, grid, stream);
    case 3: return launch<UPPER, 3>(p, grid, stream);
    case 4: return launch<UPPER, 4>(p, grid, stream);
    default: return "fp8_decode: 2 to 4 stages";
  }
}

}  // namespace

const char* fp8_decode_launch(const Fp8DecodeParams& p, int batch, int kv_heads, int stages,
                              cudaStream_t stream) {
  if (p.group < 1 || p.group > 16) return "fp8_decode: GQA groups of 1 to 16 heads";
  const dim3 grid(batch, kv_heads, p.num_splits);
  const char* refused = p.group > 8 ? launch_stages<true>(p, grid, stages, stream)
                                    : launch_stages<false>(p, grid, stages, stream);
  if (refused != nullptr) return refused;
  const cudaError_t err = cudaPeekAtLastError();  // (an earlier kernel's error would show too)
  return err == cudaSuccess ? "" : cudaGetErrorString(err);
}
