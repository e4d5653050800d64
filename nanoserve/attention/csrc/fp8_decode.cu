// Split-KV decode attention over a paged FP8 (e4m3, one float32 scale per token and kv head)
// cache on tensor cores, for head_dim 128 and GQA groups of up to 16: stage 1 of
// attention/triton_decode.py (same partial outputs and log-sum-exps, merged by its stage 2),
// written by hand because the Triton kernel stays at 1.5-1.7x its memory floor at every tile
// setting (docs/perf-notes.md, session 18).
//
// Block (sequence b, kv head h, split s): 4 warps, each taking every fourth 32-token tile of
// the split; the warps' partials merge in shared memory at the end. Each lane copies the
// bytes its own MMA fragments need (cp.async, STAGES tiles deep, so the next tiles' loads are
// in flight while this one computes) into lane-private shared memory slots, [chunk][lane],
// and reads them back in the layout of an m16n8k16 MMA fragment: no layout shuffles and no
// barriers sit between the loads and the MMAs (a lane reads only what it copied). Loading
// straight into registers, one tile at a time, read at 2.0x the memory floor (session 19):
// - scores S = Q.K^T [16 (the group, padded), 8 tokens] per MMA: K is the B operand, whose
//   fragment gives lane (g = lane / 4, j = lane % 4) token g of the 8 and four values of the
//   MMA's k (head_dim) slice. A dot is a sum over head_dim in any order, so k-step t's
//   values for lane j are taken as head_dim 16j + 4t + [0, 4) for t < 4 and 64 + 16j +
//   4(t - 4) + [0, 4) after: a lane reads two 16-byte pieces of its token, and each of the two
//   copies of a warp reads whole 64-byte halves of 8 tokens (an earlier order, 32 contiguous
//   bytes a lane, left every 32-byte sector half read by each copy). Q's A fragment uses the
//   same order (loaded once).
// - the accumulator of two such MMAs (16 tokens) is, element for element, the A fragment of
//   O += P.V [16, 8 columns of head_dim] (FlashAttention-2's register reuse); V is its B
//   operand: lane (g, j) holds tokens 2j, 2j+1, 2j+8, 2j+9 at one column, so output column n
//   of MMA i is taken as head_dim 16n + i: a lane reads 16 contiguous bytes of each of its 4
//   tokens and pairs their bytes with byte permutes.
// e4m3 converts to float16 exactly, two values an instruction (cvt.rn.f16x2.e4m3x2, sm_89+).
// K's scale multiplies the score; V's multiplies the probability, relative to the tile's
// largest V scale (the output is kept in units of it), so p x scale stays in float16's range.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "fp8_decode.h"

namespace {

constexpr int WARPS = 4;
constexpr int TILE = FP8_DECODE_TILE;
constexpr int D = FP8_DECODE_HEAD_DIM;

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {
  uint32_t out;
  const uint16_t in = static_cast<uint16_t>(two);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(in));
  return out;
}

// e4m3 bytes 1 and 3 of x as float16 x 2^-8, exactly (normal and subnormal alike: the sign
// stays, exponent and mantissa move right one bit, and float16's exponent bias, 8 more than
// e4m3's, scales the value by 2^-8), in two integer instructions
__device__ __forceinline__ uint32_t e4m3_odd_bytes_to_f16x2(uint32_t x) {
  return (x & 0x80008000u) | ((x >> 1) & 0x3F803F80u);
}

// bytes 0 and 2, likewise
__device__ __forceinline__ uint32_t e4m3_even_bytes_to_f16x2(uint32_t x) {
  return e4m3_odd_bytes_to_f16x2(x << 8);
}

__device__ __forceinline__ uint32_t permute(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t out;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(selector));
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

// a lane's 16-byte slot as one 128-bit shared load (the compiler split a uint4 copy into four
// 32-bit loads, each a 4-way bank conflict across the warp)
__device__ __forceinline__ uint4 load_slot(const uint4& slot) {
  uint4 v;
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(&slot));
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(at) : "memory");
  return v;
}

// One tile's bytes for one warp, [chunk][lane]: 16 chunks of 16 bytes a lane (K: token
// 8n + g's bytes 16j.. and 64 + 16j.. as chunks 2n and 2n + 1; V: chunk 8 + 4ks + i holds token
// 16ks + 2j + (i & 1) + 8 (i >> 1), its 16 bytes at head_dim 16g) and 16 scales: K's of the
// lane's tokens 8n + 2j + e at 2n + e, V's of the same tokens at 8 + 2n + e (which is
// 8 + 4ks + i for V chunk (ks, i): the same token)
struct alignas(16) Stage {
  uint4 data[16][32];
  float scale[16][32];
};


__device__ __forceinline__ float q_value(const Fp8DecodeParams& p, int64_t at) {
  if (p.q_bf16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p.q)[at]);
  return __half2float(static_cast<const __half*>(p.q)[at]);
}

// the lane's copies of one tile into `st`: K and V bytes, their scales; tokens outside
// [start, ctx) are zeros (never the NaN bytes past the context)
__device__ __forceinline__ void copy_tile(const Fp8DecodeParams& p, Stage& st, int t0,
                                          int start, int ctx, const int32_t* table,
                                          const uint8_t* k_head, const uint8_t* v_head,
                                          const float* ks_head, const float* vs_head, int lane) {
  const int g = lane / 4, j = lane % 4;
  const int page_mask = (1 << p.page_shift) - 1;
  // a tile lies in one page when pages hold 32 tokens or more: one table read
  const bool one_page = p.page_shift >= 5;
  const int64_t tile_page = one_page ? table[t0 >> p.page_shift] : 0;
  auto page_of = [&](int tok) -> int64_t {
    return one_page ? tile_page : static_cast<int64_t>(table[tok >> p.page_shift]);
  };
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int tok = t0 + 8 * n + g;
    const bool real = tok >= start && tok < ctx;
    const uint8_t* at = real ? k_head + page_of(tok) * p.stride_kp + (tok & page_mask) * p.stride_kt
                             : k_head;
    copy16(&st.data[2 * n][lane], at, real);
    copy16(&st.data[2 * n + 1][lane], at + 64, real);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int t = t0 + 8 * n + 2 * j + e;
      const bool in = t >= start && t < ctx;
      const int64_t off = in ? page_of(t) * p.stride_sp + (t & page_mask) * p.stride_st : 0;
      copy4(&st.scale[2 * n + e][lane], ks_head + off, in);
      copy4(&st.scale[8 + 2 * n + e][lane], vs_head + off, in);
    }
  }
#pragma unroll
  for (int ks = 0; ks < 2; ++ks)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tok = t0 + 16 * ks + 2 * j + (i & 1) + 8 * (i >> 1);
      const bool real = tok >= start && tok < ctx;
      const uint8_t* at = real ? v_head + page_of(tok) * p.stride_vp + (tok & page_mask) * p.stride_vt
                               : v_head;
      copy16(&st.data[8 + 4 * ks + i][lane], at, real);
    }
}

// UPPER: the group has more than 8 heads, so the MMA rows g + 8 are heads too. STAGES: tiles
// a warp has in shared memory, the one it computes and STAGES - 1 in flight. BITS: e4m3 goes
// to float16 by integer instructions (x 2^-8, undone in the scales) instead of cvt; K's
// fragment then pairs a word's bytes (0, 2) and (1, 3), so Q's takes head_dim in that order
template <bool UPPER, int STAGES, bool BITS>
__global__ void __launch_bounds__(WARPS * 32)
fp8_decode_split_kernel(const Fp8DecodeParams p) {
  extern __shared__ Stage stages[];  // [warp][STAGES]
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
  const int32_t* table = p.page_table + b * p.stride_pt;
  Stage* mine = stages + warp * STAGES;

  const uint8_t* k_head = p.k + kvh * p.stride_kh + 16 * j;
  const uint8_t* v_head = p.v + kvh * p.stride_vh + 16 * g;
  const float* ks_head = p.k_scale + kvh * p.stride_sh;
  const float* vs_head = p.v_scale + kvh * p.stride_sh;
  // the warp's tiles are tile_lo + warp + WARPS x i; the first STAGES - 1 go in flight now.
  // Every step commits a group, empty or not, so "all but the newest STAGES - 1 groups
  // done" always means "this step's tile is here"
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    const int tile = tile_lo + warp + WARPS * i;
    if (tile < tile_hi)
      copy_tile(p, mine[i], tile * TILE, start, ctx, table, k_head, v_head, ks_head, vs_head,
                lane);
    commit();
  }

  // Q's A fragments: rows g (and g + 8), head_dim in the order described above
  uint32_t qa[8][4];
  {
    float row[2][32];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int head = g + 8 * r;
      const bool real = head < p.group && (r == 0 || UPPER);
      const int64_t at = b * p.stride_qb + (kvh * p.group + head) * p.stride_qh + 16 * j;
#pragma unroll
      for (int i = 0; i < 32; ++i) row[r][i] = real ? q_value(p, at + i + (i < 16 ? 0 : 48)) : 0.f;
    }
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      constexpr int second = BITS ? 2 : 1, third = BITS ? 1 : 2;
      qa[t][0] = pack_f16(row[0][4 * t], row[0][4 * t + second]);
      qa[t][1] = pack_f16(row[1][4 * t], row[1][4 * t + second]);
      qa[t][2] = pack_f16(row[0][4 * t + third], row[0][4 * t + 3]);
      qa[t][3] = pack_f16(row[1][4 * t + third], row[1][4 * t + 3]);
    }
  }

  float o[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float v_ref = 1.f;  // the output is kept in units of this V scale

  int slot = 0;
  for (int tile = tile_lo + warp; tile < tile_hi; tile += WARPS) {
    {  // the tile STAGES - 1 ahead goes into the slot the previous step read
      const int ahead = tile + WARPS * (STAGES - 1);
      const int into = slot == 0 ? STAGES - 1 : slot - 1;
      if (ahead < tile_hi)
        copy_tile(p, mine[into], ahead * TILE, start, ctx, table, k_head, v_head, ks_head,
                  vs_head, lane);
      commit();
    }
    wait_until_pending<STAGES - 1>();
    const Stage& st = mine[slot];
    slot = slot == STAGES - 1 ? 0 : slot + 1;
    const int t0 = tile * TILE;

    // scores, in log2 units
    float sc[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
      const uint4 k0 = load_slot(st.data[2 * n][lane]), k1 = load_slot(st.data[2 * n + 1][lane]);
      const uint32_t w[8] = {k0.x, k0.y, k0.z, k0.w, k1.x, k1.y, k1.z, k1.w};
#pragma unroll
      for (int t = 0; t < 8; ++t)
        if (BITS)
          mma(sc[n], qa[t], e4m3_even_bytes_to_f16x2(w[t]), e4m3_odd_bytes_to_f16x2(w[t]));
        else
          mma(sc[n], qa[t], e4m3x2_to_f16x2(w[t] & 0xFFFF), e4m3x2_to_f16x2(w[t] >> 16));
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tok = t0 + 8 * n + 2 * j + e;
        const bool valid = tok >= start && tok < ctx;
        const float mul = st.scale[2 * n + e][lane] * (BITS ? 256.f * p.scale_log2 : p.scale_log2);
        sc[n][e] = valid ? sc[n][e] * mul : -INFINITY;
        sc[n][2 + e] = valid ? sc[n][2 + e] * mul : -INFINITY;
      }
    }
    // online softmax per row (a query head); a row's 8 tokens lie in the 4 lanes of its g
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (r == 1 && !UPPER) {
        alpha[1] = 1.f;
        continue;
      }
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 4; ++n) mx = fmaxf(mx, fmaxf(sc[n][2 * r], sc[n][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      const float m_new = fmaxf(m[r], mx);
      const float base = m_new == -INFINITY ? 0.f : m_new;
      alpha[r] = exp2f(m[r] - base);
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        sc[n][2 * r] = exp2f(sc[n][2 * r] - base);
        sc[n][2 * r + 1] = exp2f(sc[n][2 * r + 1] - base);
        sum += sc[n][2 * r] + sc[n][2 * r + 1];
      }
      l[r] = l[r] * alpha[r] + sum;
      m[r] = m_new;
    }
    // the tile's largest V scale: the probabilities go relative to it
    float v_scale[8];
    float v_max = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v_scale[i] = st.scale[8 + i][lane];
      v_max = fmaxf(v_max, v_scale[i]);
    }
#pragma unroll
    for (int off = 1; off < 32; off *= 2) v_max = fmaxf(v_max, __shfl_xor_sync(0xffffffff, v_max, off));
    // a tile of zero V (scales at their floor, 2^-126): the unit stays, their p x scale is 0
    if (v_max < 1e-30f) v_max = v_ref;
    const float unit = v_ref / v_max;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      o[n][0] *= alpha[0] * unit;
      o[n][1] *= alpha[0] * unit;
      o[n][2] *= alpha[1] * unit;
      o[n][3] *= alpha[1] * unit;
    }
    v_ref = v_max;
    const float inv = 1.f / v_max;
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      float rel[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) rel[i] = v_scale[4 * ks + i] * inv;
      const float(&lo)[4] = sc[2 * ks];
      const float(&hi)[4] = sc[2 * ks + 1];
      const uint32_t pa[4] = {
          pack_f16(lo[0] * rel[0], lo[1] * rel[1]),
          UPPER ? pack_f16(lo[2] * rel[0], lo[3] * rel[1]) : 0u,
          pack_f16(hi[0] * rel[2], hi[1] * rel[3]),
          UPPER ? pack_f16(hi[2] * rel[2], hi[3] * rel[3]) : 0u};
      const uint4 va = load_slot(st.data[8 + 4 * ks][lane]);
      const uint4 vb = load_slot(st.data[9 + 4 * ks][lane]);
      const uint4 vc = load_slot(st.data[10 + 4 * ks][lane]);
      const uint4 vd = load_slot(st.data[11 + 4 * ks][lane]);
      const uint32_t a[4] = {va.x, va.y, va.z, va.w};
      const uint32_t bb[4] = {vb.x, vb.y, vb.z, vb.w};
      const uint32_t c[4] = {vc.x, vc.y, vc.z, vc.w};
      const uint32_t d[4] = {vd.x, vd.y, vd.z, vd.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        // tokens (2j, 2j+1) and (2j+8, 2j+9), their bytes paired: columns 4w .. 4w+3
        if (BITS) {  // bytes [a1 a0 b1 b0] and [a3 a2 b3 b2]: pairs (a0, b0) odd, (a1, b1) even
          const uint32_t x01 = permute(a[w], bb[w], 0x4501), y01 = permute(a[w], bb[w], 0x6723);
          const uint32_t x89 = permute(c[w], d[w], 0x4501), y89 = permute(c[w], d[w], 0x6723);
          mma(o[4 * w + 0], pa, e4m3_odd_bytes_to_f16x2(x01), e4m3_odd_bytes_to_f16x2(x89));
          mma(o[4 * w + 1], pa, e4m3_even_bytes_to_f16x2(x01), e4m3_even_bytes_to_f16x2(x89));
          mma(o[4 * w + 2], pa, e4m3_odd_bytes_to_f16x2(y01), e4m3_odd_bytes_to_f16x2(y89));
          mma(o[4 * w + 3], pa, e4m3_even_bytes_to_f16x2(y01), e4m3_even_bytes_to_f16x2(y89));
        } else {
          const uint32_t x01 = permute(a[w], bb[w], 0x5140), y01 = permute(a[w], bb[w], 0x7362);
          const uint32_t x89 = permute(c[w], d[w], 0x5140), y89 = permute(c[w], d[w], 0x7362);
          mma(o[4 * w + 0], pa, e4m3x2_to_f16x2(x01 & 0xFFFF), e4m3x2_to_f16x2(x89 & 0xFFFF));
          mma(o[4 * w + 1], pa, e4m3x2_to_f16x2(x01 >> 16), e4m3x2_to_f16x2(x89 >> 16));
          mma(o[4 * w + 2], pa, e4m3x2_to_f16x2(y01 & 0xFFFF), e4m3x2_to_f16x2(y89 & 0xFFFF));
          mma(o[4 * w + 3], pa, e4m3x2_to_f16x2(y01 >> 16), e4m3x2_to_f16x2(y89 >> 16));
        }
      }
    }
  }

  // the warps' partials, merged: each row's sum over its 4 lanes, the output in true units.
  // o_s[w][n][8 r + c] holds row r's column 16 c + n of MMA n's output (c = 2j + e): a lane's
  // stores and the merge's reads meet at most two to a bank (row-major [r][d] made 32). They
  // reuse the stages' memory, once every copy has landed and every warp has read its last
  constexpr int PITCH = 16 * 8 + 1;
  wait_until_pending<0>();
  __syncthreads();
  auto& o_s = *reinterpret_cast<float(*)[WARPS][16][PITCH]>(stages);
  auto& m_s = *reinterpret_cast<float(*)[WARPS][16]>(&o_s[WARPS][0][0]);
  auto& l_s = *reinterpret_cast<float(*)[WARPS][16]>(&m_s[WARPS][0]);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffff, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffff, l[r], 2);
    if (j == 0) {
      m_s[warp][g + 8 * r] = m[r];
      l_s[warp][g + 8 * r] = l[r];
    }
  }
#pragma unroll
  for (int n = 0; n < 16; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float unit = BITS ? 256.f * v_ref : v_ref;
      o_s[warp][n][8 * g + 2 * j + e] = o[n][e] * unit;
      o_s[warp][n][8 * (g + 8) + 2 * j + e] = o[n][2 + e] * unit;
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
        acc += o_s[w][col % 16][8 * r + col / 16] * f;
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

constexpr int MERGE_BYTES = (WARPS * 16 * (16 * 8 + 1) + 2 * WARPS * 16) * sizeof(float);

template <bool UPPER, int STAGES, bool BITS>
const char* launch(const Fp8DecodeParams& p, dim3 grid, cudaStream_t stream) {
  constexpr int bytes = WARPS * STAGES * sizeof(Stage);
  static_assert(bytes >= MERGE_BYTES, "the merge reuses the stages' shared memory");
  // past 48 KiB a kernel asks for its shared memory, on the current device (not a stream
  // operation: allowed while a graph captures, as flash-attn's launches do)
  const cudaError_t asked = cudaFuncSetAttribute(fp8_decode_split_kernel<UPPER, STAGES, BITS>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 bytes);
  if (asked != cudaSuccess) return cudaGetErrorString(asked);
  fp8_decode_split_kernel<UPPER, STAGES, BITS><<<grid, WARPS * 32, bytes, stream>>>(p);
  return nullptr;
}

template <bool UPPER, bool BITS>
const char* launch_stages(const Fp8DecodeParams& p, dim3 grid, int stages, cudaStream_t stream) {
  switch (stages) {
    case 2: return launch<UPPER, 2, BITS>(p, grid, stream);
    case 3: return launch<UPPER, 3, BITS>(p, grid, stream);
    case 4: return launch<UPPER, 4, BITS>(p, grid, stream);
    default: return "fp8_decode: 2 to 4 stages";
  }
}

template <bool UPPER>
const char* launch_bits(const Fp8DecodeParams& p, dim3 grid, int stages, bool bits,
                        cudaStream_t stream) {
  return bits ? launch_stages<UPPER, true>(p, grid, stages, stream)
              : launch_stages<UPPER, false>(p, grid, stages, stream);
}

}  // namespace

const char* fp8_decode_launch(const Fp8DecodeParams& p, int batch, int kv_heads, int stages,
                              bool bits, cudaStream_t stream) {
  if (p.group < 1 || p.group > 16) return "fp8_decode: GQA groups of 1 to 16 heads";
  const dim3 grid(batch, kv_heads, p.num_splits);
  const char* refused = p.group > 8 ? launch_bits<true>(p, grid, stages, bits, stream)
                                    : launch_bits<false>(p, grid, stages, bits, stream);
  if (refused != nullptr) return refused;
  const cudaError_t err = cudaPeekAtLastError();  // (an earlier kernel's error would show too)
  return err == cudaSuccess ? "" : cudaGetErrorString(err);
}
