// Decode attention on the CPU over one layer of paged KV in host memory (the offload tier's
// layout: [2 (K, V), page, page row]; a row holds [page_size, kv_heads, head_dim] values, then,
// for FP8, one float32 scale per token and kv head). Each sequence attends the tokens
// [start, end) of its context, so a layer's tokens can be split between the CPU and the GPU and
// the two partial results merged by their log-sum-exp. Writes the normalized output and the
// natural-log LSE per query head; an empty range gives zeros and -inf.
//
// The work is memory-bound (a 32K layer of an 8-kv-head, d=128 model is 134 MB of bf16 KV
// against ~0.5 GFLOP), so it is laid out for the memory system: each job takes a run of one
// sequence's tokens and reads them in the order they lie (a block of up to 16 tokens of a page,
// every kv head of it), converting in registers; jobs' partial results merge by their LSE at the
// end. With AVX-512 the loops are written with intrinsics (FP8 e4m3 goes through float16 by bit
// placement, exact, and the hardware's float16 conversion); elsewhere plain loops.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define NS_AVX512 1
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <condition_variable>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace {

enum Kind { BF16 = 0, F16 = 1, F32 = 2, FP8 = 3 };
constexpr int BLOCK = 16;  // tokens per block: one vector of scores
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Geometry {
  int64_t q_heads, kv_heads, group, d, page_size, row_bytes, elem, scales_offset;
  const uint8_t* k_base;
  const uint8_t* v_base;
  int kind;
  float sm_scale, value_mul;  // value_mul: FP8's values come out 2^-8 too small (below)
};

// A job's running state per query head: unnormalized output, max score, sum of exps.
struct Partial {
  std::vector<float> acc, m, l;
  Partial(int64_t q_heads, int64_t d) : acc(q_heads * d, 0.f), m(q_heads, NEG_INF),
                                        l(q_heads, 0.f) {}
};

inline float token_scale(const Geometry& g, const uint8_t* row, int64_t r, int64_t h) {
  if (g.kind != FP8) return 1.f;
  float s;
  std::memcpy(&s, row + g.scales_offset + (r * g.kv_heads + h) * 4, 4);
  return s * g.value_mul;
}

// Online-softmax update of one query head with a block's scores s[0, n): rescales acc by
// exp(m - m_new) and turns s into the block's probabilities.
inline void softmax_block(float* s, int64_t n, float& m, float& l, float* acc, int64_t d) {
  float block_max = NEG_INF;
  for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, s[j]);
  const float m_new = std::max(m, block_max);
  const float c = std::exp(m - m_new);  // 0 on the first block (m = -inf)
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m_new);
    sum += s[j];
  }
  for (int64_t i = 0; i < d; ++i) acc[i] *= c;
  l = l * c + sum;
  m = m_new;
}

// One token's K (or V) of one kv head as float32, times mul: loops without branches, which the
// compiler vectorizes for the machine at hand (AVX2 and others)
template <int KIND>
inline void convert_row(const uint8_t* p, int64_t d, float mul, float* out) {
  if constexpr (KIND == BF16) {
    const uint16_t* x = reinterpret_cast<const uint16_t*>(p);
    for (int64_t i = 0; i < d; ++i) {
      const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      out[i] = f * mul;
    }
  } else if constexpr (KIND == F32) {
    const float* x = reinterpret_cast<const float*>(p);
    for (int64_t i = 0; i < d; ++i) out[i] = x[i] * mul;
  } else if constexpr (KIND == F16) {
    const c10::Half* x = reinterpret_cast<const c10::Half*>(p);
    for (int64_t i = 0; i < d; ++i) out[i] = static_cast<float>(x[i]) * mul;
  } else {
    // e4m3 s.eeee.mmm placed in a float32's sign, low exponent and high mantissa bits is the
    // value times 2^-120, subnormals included (bias 7 against 127): exact. mul holds the
    // 2^8 of the float16 route (Geometry.value_mul), fix the rest
    const float fix = 0x1p112f;
    for (int64_t i = 0; i < d; ++i) {
      const uint32_t x = p[i];
      const uint32_t bits = ((x & 0x80u) << 24) | ((x & 0x7fu) << 20);
      float f;
      std::memcpy(&f, &bits, 4);
      out[i] = f * (mul * fix);
    }
  }
}

// The portable job: a block's K and V of one kv head converted once into float32 buffers (the
// group's q heads share them), then plain loops over them.
template <int KIND>
void run_job_generic(const Geometry& g, const float* q, const int32_t* table, int64_t lo,
                     int64_t hi, Partial& part) {
  const int64_t d = g.d;
  std::vector<float> kb(BLOCK * d), vb(BLOCK * d), s(BLOCK);
  for (int64_t t0 = lo; t0 < hi;) {
    const int64_t page = table[t0 / g.page_size], r0 = t0 % g.page_size;
    const int64_t n = std::min<int64_t>({BLOCK, g.page_size - r0, hi - t0});
    const uint8_t* k_row = g.k_base + page * g.row_bytes;
    const uint8_t* v_row = g.v_base + page * g.row_bytes;
    for (int64_t h = 0; h < g.kv_heads; ++h) {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t r = r0 + j, at = (r * g.kv_heads + h) * d * g.elem;
        convert_row<KIND>(k_row + at, d, token_scale(g, k_row, r, h) * g.sm_scale,
                          kb.data() + j * d);
        convert_row<KIND>(v_row + at, d, token_scale(g, v_row, r, h), vb.data() + j * d);
      }
      for (int64_t qh = h * g.group; qh < (h + 1) * g.group; ++qh) {
        const float* qv = q + qh * d;
        for (int64_t j = 0; j < n; ++j) {
          const float* kj = kb.data() + j * d;
          float dot = 0.f;
          for (int64_t i = 0; i < d; ++i) dot += qv[i] * kj[i];
          s[j] = dot;
        }
        float* acc = part.acc.data() + qh * d;
        softmax_block(s.data(), n, part.m[qh], part.l[qh], acc, d);
        for (int64_t j = 0; j < n; ++j) {
          const float* vj = vb.data() + j * d;
          const float p = s[j];
          for (int64_t i = 0; i < d; ++i) acc[i] += p * vj[i];
        }
      }
    }
    t0 += n;
  }
}

using JobFn = void (*)(const Geometry&, const float*, const int32_t*, int64_t, int64_t,
                       Partial&);

#ifdef NS_AVX512
// 16 values of K or V at p (element i0 on), as float32
template <int KIND>
inline __m512 load16(const uint8_t* p) {
  if constexpr (KIND == BF16) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
  } else if constexpr (KIND == F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else if constexpr (KIND == F32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  } else {  // e4m3 s.eeee.mmm placed in a float16's sign, low exponent and high mantissa
    // bits is the value times 2^-8, subnormals included (bias 7 against 15), exactly; the
    // byte goes in the high half, shifted right one arithmetically (the sign lands in bits 15
    // and 14), bit 14 cleared, and the hardware converts the float16 to float32
    const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 1);
    return _mm512_cvtph_ps(_mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0xbfff))));
  }
}

// 32 values of K or V at p, as two float32 vectors; e4m3 converts 32 at a time (fewer
// instructions per value than load16)
template <int KIND>
inline void load32(const uint8_t* p, __m512& lo, __m512& hi) {
  if constexpr (KIND == FP8) {
    const __m512i x =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i h = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(x, 8), 1),
                                       _mm512_set1_epi16(static_cast<short>(0xbfff)));
    lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  } else {
    constexpr int E = KIND == F32 ? 4 : 2;
    lo = load16<KIND>(p);
    hi = load16<KIND>(p + 16 * E);
  }
}

// The sums of 16 vectors' elements, as one vector: element i is the sum of v[i]'s (a
// transposing tree of adds, 45 instructions against ~10 per vector for one reduction each).
inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                         _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // per lane: the lane's sums of v[4k .. 4k+3]
    b[k] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * k], a[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(a[2 * k], a[2 * k + 1], 0xee));
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44),
                                  _mm512_shuffle_f32x4(b[0], b[1], 0xee));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44),
                                  _mm512_shuffle_f32x4(b[2], b[3], 0xee));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xdd));
}

// Scores of a block's n tokens for the G q heads of kv head h, 16 / G tokens at a time: their
// K converted once, every (token, q head) dot in its own register, then one hsum16.
template <int KIND, int D, int G>
inline void block_scores(const Geometry& g, const float* qh, const uint8_t* k_row, int64_t r0,
                         int64_t n, int64_t h, float (*s)[BLOCK]) {
  constexpr int C = D / 16, TOK = 16 / G;
  alignas(64) float out[16];
  for (int64_t j0 = 0; j0 < n; j0 += TOK) {
    const int64_t tn = std::min<int64_t>(TOK, n - j0);
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int c = 0; c < C; c += 2) {
      for (int t = 0; t < TOK; ++t) {
        if (t >= tn) break;
        __m512 k0, k1;
        load32<KIND>(k_row + ((r0 + j0 + t) * g.kv_heads + h) * D * g.elem + c * 16 * g.elem,
                     k0, k1);
        for (int gi = 0; gi < G; ++gi) {
          __m512& a = acc[t * G + gi];
          a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + gi * D + c * 16), k0, a);
          a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + gi * D + c * 16 + 16), k1, a);
        }
      }
    }
    _mm512_store_ps(out, hsum16(acc));
    for (int t = 0; t < tn; ++t) {
      const float ks = token_scale(g, k_row, r0 + j0 + t, h) * g.sm_scale;
      for (int gi = 0; gi < G; ++gi) s[gi][j0 + t] = out[t * G + gi] * ks;
    }
  }
}

// exp(x) for x <= 0 (scores minus their running max), relative error ~2e-7; -inf and anything
// below -87 give 0
inline __m512 exp16(__m512 x) {
  const __m512 zero_below = _mm512_set1_ps(-87.f);
  const __mmask16 live = _mm512_cmp_ps_mask(x, zero_below, _CMP_GE_OQ);
  x = _mm512_max_ps(x, zero_below);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(y, n));
}

// The vectorized job for head_dim D and group size up to 8 (the q heads of one kv head keep
// their partial dots in registers); FIXED_G > 0: the group size, known at compile time.
template <int KIND, int D, int FIXED_G>
void run_job_avx512(const Geometry& g, const float* q, const int32_t* table, int64_t lo,
                    int64_t hi, Partial& part) {
  constexpr int C = D / 16;  // vectors per head_dim
  const int64_t G = FIXED_G > 0 ? FIXED_G : g.group;
  alignas(64) float s[8][BLOCK];
  alignas(64) float vscale[BLOCK];
  for (int64_t t0 = lo; t0 < hi;) {
    const int64_t page = table[t0 / g.page_size], r0 = t0 % g.page_size;
    const int64_t n = std::min<int64_t>({BLOCK, g.page_size - r0, hi - t0});
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    const uint8_t* k_row = g.k_base + page * g.row_bytes;
    const uint8_t* v_row = g.v_base + page * g.row_bytes;
    for (int64_t h = 0; h < g.kv_heads; ++h) {
      const float* qh = q + h * G * D;
      if constexpr (FIXED_G > 0) {
        block_scores<KIND, D, FIXED_G>(g, qh, k_row, r0, n, h, s);
      } else {
      // scores: each token's K converted once, dotted with every q head of the group
      for (int64_t j = 0; j < n; ++j) {
        const uint8_t* k = k_row + ((r0 + j) * g.kv_heads + h) * D * g.elem;
        __m512 dot[8];
        for (int64_t gi = 0; gi < G; ++gi) dot[gi] = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c) {
          const __m512 kc = load16<KIND>(k + c * 16 * g.elem);
          for (int64_t gi = 0; gi < G; ++gi)
            dot[gi] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + gi * D + c * 16), kc, dot[gi]);
        }
        const float ks = token_scale(g, k_row, r0 + j, h) * g.sm_scale;
        for (int64_t gi = 0; gi < G; ++gi) s[gi][j] = _mm512_reduce_add_ps(dot[gi]) * ks;
      }
      }
      for (int64_t j = 0; j < n; ++j) vscale[j] = token_scale(g, v_row, r0 + j, h);
      const __m512 vs = _mm512_maskz_loadu_ps(valid, vscale);
      // online softmax per q head, vectorized over the block's tokens
      for (int64_t gi = 0; gi < G; ++gi) {
        const int64_t qi = h * G + gi;
        const __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(NEG_INF), valid, s[gi]);
        const float m_new = std::max(part.m[qi], _mm512_reduce_max_ps(sv));
        const __m512 p = exp16(_mm512_sub_ps(sv, _mm512_set1_ps(m_new)));
        const float c = std::exp(part.m[qi] - m_new);
        part.l[qi] = part.l[qi] * c + _mm512_reduce_add_ps(p);
        part.m[qi] = m_new;
        _mm512_store_ps(s[gi], _mm512_mul_ps(p, vs));  // V's scale folded into p
        float* acc = part.acc.data() + qi * D;
        const __m512 cv = _mm512_set1_ps(c);
        for (int i = 0; i < C; ++i)
          _mm512_storeu_ps(acc + i * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + i * 16), cv));
      }
      // acc += p . V, a vector of head_dim at a time, every q head of the group at once
      // acc += p . V, CV vectors of head_dim per pass: each token's p broadcast once per pass
      // for every q head of the group, G x CV accumulators in registers
      constexpr int CV = FIXED_G > 0 ? std::min(C, 16 / FIXED_G) : 2;
      for (int c = 0; c < C; c += CV) {
        __m512 a[16];
        float* acc = part.acc.data() + h * G * D + c * 16;
        for (int64_t gi = 0; gi < G; ++gi)
          for (int u = 0; u < CV; ++u) a[gi * CV + u] = _mm512_loadu_ps(acc + gi * D + u * 16);
        for (int64_t j = 0; j < n; ++j) {
          const uint8_t* vp = v_row + ((r0 + j) * g.kv_heads + h) * D * g.elem + c * 16 * g.elem;
          __m512 vv[CV];
          for (int u = 0; u < CV; u += 2) load32<KIND>(vp + u * 16 * g.elem, vv[u], vv[u + 1]);
          for (int64_t gi = 0; gi < G; ++gi) {
            const __m512 p = _mm512_set1_ps(s[gi][j]);
            for (int u = 0; u < CV; ++u)
              a[gi * CV + u] = _mm512_fmadd_ps(p, vv[u], a[gi * CV + u]);
          }
        }
        for (int64_t gi = 0; gi < G; ++gi)
          for (int u = 0; u < CV; ++u) _mm512_storeu_ps(acc + gi * D + u * 16, a[gi * CV + u]);
      }
    }
    t0 += n;
  }
}

template <int KIND, int G>
JobFn pick_d(int64_t d) {
  switch (d) {
    case 64: return run_job_avx512<KIND, 64, G>;
    case 128: return run_job_avx512<KIND, 128, G>;
    case 256: return run_job_avx512<KIND, 256, G>;
    default: return nullptr;
  }
}

// the common group sizes (Llama 3 8B, Qwen3 8B, Mistral Nemo: 4; Qwen3-30B-A3B: 8) get their
// dots laid out at compile time; other sizes up to 8 the runtime loops
template <int KIND>
JobFn pick_g(int64_t d, int64_t group) {
  switch (group) {
    case 4: return pick_d<KIND, 4>(d);
    case 8: return pick_d<KIND, 8>(d);
    default: return pick_d<KIND, 0>(d);
  }
}

JobFn pick_avx512(int kind, int64_t d, int64_t group) {
  if (group > 8) return nullptr;
  switch (kind) {
    case BF16: return pick_g<BF16>(d, group);
    case F16: return pick_g<F16>(d, group);
    case F32: return pick_g<F32>(d, group);
    default: return pick_g<FP8>(d, group);
  }
}
#endif

}  // namespace

// Refusals come back as their message ("" once the call ran), built without C++ streams: on
// the GPU machines (torch 2.11, g++ 13) this module's first use of a stream (TORCH_CHECK's and
// c10::str's messages) kills the process, for a reason not found (an ABI mismatch, likely).
// Nothing in this file may build a message through a stream: no TORCH_CHECK, c10::str,
// TORCH_WARN.
inline void append(std::string& s, const char* x) { s += x; }
inline void append(std::string& s, int64_t x) { s += std::to_string(x); }

template <class... A>
std::string message(const A&... parts) {
  std::string s;
  (append(s, parts), ...);
  return s;
}

Geometry geometry(const torch::Tensor& kv, int64_t kind, int64_t page_size, int64_t kv_heads,
                  int64_t q_heads, int64_t d, int64_t scales_offset, double sm_scale) {
  Geometry g;
  g.q_heads = q_heads;
  g.kv_heads = kv_heads;
  g.group = q_heads / kv_heads;
  g.d = d;
  g.page_size = page_size;
  g.row_bytes = kv.size(2) * kv.element_size();
  g.elem = kind == BF16 || kind == F16 ? 2 : (kind == F32 ? 4 : 1);
  g.scales_offset = scales_offset;
  g.kind = static_cast<int>(kind);
  g.sm_scale = static_cast<float>(sm_scale);
  g.value_mul = kind == FP8 ? 256.f : 1.f;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(kv.data_ptr());
  g.k_base = base;
  g.v_base = base + kv.size(1) * g.row_bytes;
  return g;
}

// A job: a run of one sequence's tokens. About two per thread over the whole batch (each
// leaves a partial of q_heads x d floats that the merge reads: with eight a thread, that cost
// more than the finer balance gained).
struct Job { int64_t b, lo, hi; };
struct Jobs {
  std::vector<Job> jobs;
  std::vector<int64_t> first_job;  // each sequence's first, then the count
};

Jobs split_jobs(const int32_t* lo, const int32_t* hi, int64_t batch, int64_t threads) {
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) total += std::max<int64_t>(0, hi[b] - lo[b]);
  const int64_t want = 2 * threads;
  int64_t chunk = std::max<int64_t>(64, (total + want - 1) / want);
  chunk = (chunk + BLOCK - 1) / BLOCK * BLOCK;
  Jobs out;
  out.first_job.resize(batch + 1);
  for (int64_t b = 0; b < batch; ++b) {
    out.first_job[b] = static_cast<int64_t>(out.jobs.size());
    for (int64_t t = lo[b]; t < hi[b]; t += chunk)
      out.jobs.push_back({b, t, std::min<int64_t>(t + chunk, hi[b])});
  }
  out.first_job[batch] = static_cast<int64_t>(out.jobs.size());
  return out;
}

constexpr int64_t WARM_BYTES = 1 << 20;  // per thread: about half a core's L2

// Pulls the jobs' KV (and FP8 scales) toward the caches, thread t taking jobs t, t + threads,
// ..., each from its start, until `arrived()` says the kernel's queries are there or the
// thread has pulled WARM_BYTES (more would evict what it pulled first). Between two layers'
// kernels the host's memory only serves the link; in the kernel it serves both.
template <typename Arrived>
void warm(const Geometry& g, const int32_t* table, int64_t width, const Jobs& plan,
          int64_t threads, Arrived arrived) {
  const int64_t token_bytes = g.kv_heads * g.d * g.elem;
  const int64_t n_jobs = static_cast<int64_t>(plan.jobs.size());
  at::parallel_for(0, threads, 1, [&](int64_t a, int64_t z) {
    int64_t budget = WARM_BYTES;
    auto pull = [&](const uint8_t* p, int64_t bytes) {  // false once done
      for (int64_t i = 0; i < bytes; i += 64) {
        if ((i & 4095) == 0 && (arrived() || budget <= i)) return false;
        __builtin_prefetch(p + i, 0, 2);
      }
      budget -= bytes;
      return true;
    };
    for (int64_t t = a; t < z; ++t)
      for (int64_t i = t; i < n_jobs; i += threads) {
        const Job& job = plan.jobs[i];
        for (int64_t t0 = job.lo; t0 < job.hi;) {
          const int64_t page = table[job.b * width + t0 / g.page_size];
          const int64_t r0 = t0 % g.page_size;
          const int64_t n = std::min<int64_t>(g.page_size - r0, job.hi - t0);
          for (const uint8_t* base : {g.k_base, g.v_base}) {
            const uint8_t* row = base + page * g.row_bytes;
            if (!pull(row + r0 * token_bytes, n * token_bytes)) return;
            if (g.kind == FP8 &&
                !pull(row + g.scales_offset + r0 * g.kv_heads * 4, n * g.kv_heads * 4))
              return;
          }
          t0 += n;
        }
      }
  });
}

#define NS_REFUSE_UNLESS(cond, ...)           \
  do {                                        \
    if (!(cond)) return message(__VA_ARGS__); \
  } while (0)

std::string decode(torch::Tensor q, torch::Tensor kv, torch::Tensor page_table,
                   torch::Tensor starts, torch::Tensor ends, int64_t kind, int64_t page_size,
                   int64_t num_kv_heads, int64_t scales_offset, double sm_scale,
                   torch::Tensor out, torch::Tensor lse) {
  NS_REFUSE_UNLESS(q.dtype() == torch::kFloat32 && q.is_contiguous() && q.dim() == 3,
                   "q: contiguous float32 [batch, q_heads, head_dim]");
  NS_REFUSE_UNLESS(kv.is_contiguous() && kv.dim() == 3, "kv: contiguous [2, pages, row]");
  NS_REFUSE_UNLESS(page_table.dtype() == torch::kInt32 && page_table.is_contiguous(),
                   "page_table: contiguous int32");
  NS_REFUSE_UNLESS(starts.dtype() == torch::kInt32 && ends.dtype() == torch::kInt32,
                   "starts, ends: int32");
  NS_REFUSE_UNLESS(out.dtype() == torch::kFloat32 && out.is_contiguous() &&
                   out.sizes() == q.sizes(), "out: contiguous float32 like q");
  NS_REFUSE_UNLESS(lse.dtype() == torch::kFloat32 && lse.is_contiguous() && lse.dim() == 2 &&
                   lse.size(0) == q.size(0) && lse.size(1) == q.size(1),
                   "lse: contiguous float32 [batch, q_heads]");
  const int64_t batch = q.size(0), q_heads = q.size(1), d = q.size(2);
  NS_REFUSE_UNLESS(q_heads % num_kv_heads == 0, "q heads must be a multiple of kv heads");
  NS_REFUSE_UNLESS(starts.numel() >= batch && ends.numel() >= batch, "starts, ends: one per row");
  const Geometry g = geometry(kv, kind, page_size, num_kv_heads, q_heads, d, scales_offset,
                              sm_scale);
  const int32_t* table = page_table.data_ptr<int32_t>();
  const int64_t width = page_table.size(1);
  const int32_t* lo = starts.data_ptr<int32_t>();
  const int32_t* hi = ends.data_ptr<int32_t>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();

  for (int64_t b = 0; b < batch; ++b)
    NS_REFUSE_UNLESS(hi[b] <= lo[b] || (b < page_table.size(0) && (hi[b] - 1) / page_size < width),
                     "row ", b, " attends tokens past its page table");
  const int64_t threads = at::get_num_threads();
  const Jobs plan = split_jobs(lo, hi, batch, threads);
  const std::vector<Job>& jobs = plan.jobs;
  const std::vector<int64_t>& first_job = plan.first_job;

  JobFn fn = kind == BF16 ? run_job_generic<BF16> : kind == F16 ? run_job_generic<F16>
              : kind == F32 ? run_job_generic<F32> : run_job_generic<FP8>;
#ifdef NS_AVX512
  if (JobFn f = pick_avx512(g.kind, d, g.group)) fn = f;
#endif
  // Threads take jobs from a shared counter rather than fixed ranges: on a busy host (a
  // virtual machine's cores, the CUDA driver's threads) one descheduled thread then delays
  // one job, not its whole range. Each job's partial is allocated by the thread that runs it.
  const int64_t n_jobs = static_cast<int64_t>(jobs.size());
  std::vector<std::optional<Partial>> parts(n_jobs);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, n_jobs), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n_jobs; i = next.fetch_add(1)) {
      const Job& job = jobs[i];
      parts[i].emplace(q_heads, d);
      fn(g, qp + job.b * q_heads * d, table + job.b * width, job.lo, job.hi, *parts[i]);
    }
  });

  // merge each sequence's jobs by their LSE
  at::parallel_for(0, batch * q_heads, 1, [&](int64_t a, int64_t z) {
    for (int64_t bh = a; bh < z; ++bh) {
      const int64_t b = bh / q_heads, h = bh % q_heads;
      float* o = op + (b * q_heads + h) * d;
      float m = NEG_INF;
      for (int64_t i = first_job[b]; i < first_job[b + 1]; ++i) m = std::max(m, parts[i]->m[h]);
      std::fill(o, o + d, 0.f);
      if (m == NEG_INF) {
        lp[b * q_heads + h] = NEG_INF;
        continue;
      }
      float l = 0.f;
      for (int64_t i = first_job[b]; i < first_job[b + 1]; ++i) {
        const float w = std::exp(parts[i]->m[h] - m);
        l += parts[i]->l[h] * w;
        const float* acc = parts[i]->acc.data() + h * d;
        for (int64_t k = 0; k < d; ++k) o[k] += acc[k] * w;
      }
      for (int64_t k = 0; k < d; ++k) o[k] /= l;
      lp[b * q_heads + h] = m + std::log(l);
    }
  });
  return "";
}

// The host side of CPU attention beside the link, as a thread of its own (attention/
// cpu_share.py): the GPU copies a streamed layer's queries to the pinned q buffer, then the
// step's number into q_flags[layer]; this thread, which spins on that flag, runs the kernel
// over the layer's host KV into the pinned o and lse buffers and then writes the step's number
// into done_flags[layer], on which a GPU kernel spins before it uploads them. Steps are
// submitted by number with their rows' ranges and page tables before the GPU runs them; the
// thread serves whichever submitted step the GPU reaches (one that does not use the share,
// such as a step mixing prefill and decode, is dropped when a later one is served).
class ShareWorker {
 public:
  ShareWorker(torch::Tensor q, torch::Tensor o, torch::Tensor lse, torch::Tensor host_kv,
              torch::Tensor q_flags, torch::Tensor done_flags, int64_t kind, int64_t page_size,
              int64_t num_kv_heads, int64_t scales_offset, double sm_scale, int64_t threads,
              bool warm)
      : q_(q), o_(o), lse_(lse), host_kv_(host_kv), kind_(kind), page_size_(page_size),
        kv_heads_(num_kv_heads), scales_offset_(scales_offset), sm_scale_(sm_scale),
        threads_(threads), warm_(warm) {
    if (!(q_flags.dtype() == torch::kInt32 && done_flags.dtype() == torch::kInt32 &&
          q_flags.numel() >= host_kv.size(0) && done_flags.numel() >= host_kv.size(0)))
      throw std::invalid_argument("flags: int32, one per streamed layer");  // not TORCH_CHECK
    q_flags_ = q_flags.data_ptr<int32_t>();  // written by the GPU's copies: atomic loads
    done_flags_ = done_flags.data_ptr<int32_t>();
    flag_owners_ = {q_flags, done_flags};
    thread_ = std::thread([this] { loop(); });
  }

  ~ShareWorker() { close(); }

  void submit(int64_t step, torch::Tensor ends, torch::Tensor table) {
    std::lock_guard<std::mutex> lock(mutex_);
    steps_[static_cast<int32_t>(step)] = {ends.to(torch::kInt32).contiguous().clone(),
                                          table.to(torch::kInt32).contiguous().clone()};
    wake_.notify_one();
  }

  // the served steps' (gap, work) per layer in seconds, tokens per layer, and the time from
  // the last served step's last kernel to this one's first (NaN for the first)
  std::vector<std::tuple<double, double, int64_t, double>> drain() {
    std::lock_guard<std::mutex> lock(mutex_);
    auto out = std::move(stats_);
    stats_.clear();
    return out;
  }

  std::string error() {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

  void close() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_) return;
      stop_ = true;
    }
    closing_.store(true, std::memory_order_relaxed);  // ends a prefetch early
    wake_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct Step { torch::Tensor ends, table; };
  using Clock = std::chrono::steady_clock;

  static double seconds(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }

  int32_t q_flag(int64_t layer) const {
    return __atomic_load_n(q_flags_ + layer, __ATOMIC_ACQUIRE);
  }

  enum class Wait { READY, ABANDONED, STOPPED };

  // Spins until layer's q flag holds step `want` (yielding after a while). ABANDONED: layer
  // 0's flag moved on to a later step, so the GPU will never send this one's (the engine's
  // thread raised mid-step, or the GPU gave up on it).
  Wait await(int64_t layer, int32_t want) {
    const auto start = Clock::now();
    for (int64_t i = 0; q_flag(layer) != want; ++i) {
      if ((i & 1023) == 0) {
        if (stopped()) return Wait::STOPPED;
        if (q_flag(0) != want) return Wait::ABANDONED;
        if (seconds(start, Clock::now()) > 1e-3)
          std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
#ifdef NS_AVX512
      _mm_pause();
#endif
    }
    return Wait::READY;
  }

  bool stopped() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stop_;
  }

  // the next step the GPU has reached: the oldest submitted one whose layer-0 flag is set
  bool next_step(int32_t& number, Step& step) {
    const auto start = Clock::now();
    for (int64_t i = 0;; ++i) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [this] { return stop_ || !steps_.empty(); });
        if (stop_) return false;
        const int32_t seen = q_flag(0);
        auto it = steps_.find(seen);
        if (it != steps_.end()) {
          number = seen;
          step = it->second;
          steps_.erase(steps_.begin(), std::next(it));  // it and any step the GPU skipped
          return true;
        }
      }
      if (seconds(start, Clock::now()) > 1e-3)
        std::this_thread::sleep_for(std::chrono::microseconds(20));
#ifdef NS_AVX512
      else
        _mm_pause();
#endif
    }
  }

  void loop() {
#ifdef _OPENMP
    // ATen sets a thread's OpenMP count from torch's on its first parallel call: that first,
    // then this thread's own
    at::get_num_threads();
    if (threads_ > 0) omp_set_num_threads(static_cast<int>(threads_));
#endif
    const int64_t layers = host_kv_.size(0);
    std::optional<Clock::time_point> last_end;
    int32_t number = 0;
    Step step;
    while (next_step(number, step)) {
      const int64_t rows = step.ends.numel();
      const int64_t tokens = step.ends.sum().item<int64_t>();
      torch::Tensor starts = torch::zeros({rows}, torch::kInt32);
      const int32_t* ends = step.ends.data_ptr<int32_t>();
      const int64_t width = step.table.size(1);
      bool in_table = rows <= step.table.size(0);  // else the kernel refuses each layer
      for (int64_t r = 0; r < rows && in_table; ++r)
        in_table = ends[r] <= 0 || (ends[r] - 1) / page_size_ < width;
      const Jobs plan = split_jobs(starts.data_ptr<int32_t>(), ends, in_table ? rows : 0,
                                   at::get_num_threads());
      double worked = 0, between = 0, step_gap = 0;
      int64_t layer = 0;
      for (; layer < layers; ++layer) {
        if (layer > 0) {
          const Wait w = await(layer, number);
          if (w == Wait::STOPPED) return;
          if (w == Wait::ABANDONED) break;
        }
        const auto t0 = Clock::now();
        if (last_end) (layer == 0 ? step_gap : between) += seconds(*last_end, t0);
        else if (layer == 0) step_gap = std::numeric_limits<double>::quiet_NaN();
        std::string refused;
        try {  // (no exception is expected; one escaping this thread would end the process)
          refused = decode(q_.narrow(0, 0, rows), host_kv_[layer], step.table, starts,
                           step.ends, kind_, page_size_, kv_heads_, scales_offset_, sm_scale_,
                           o_.narrow(0, 0, rows), lse_.narrow(0, 0, rows));
        } catch (const std::exception& e) {
          refused = e.what();
        }
        if (!refused.empty()) {  // the GPU must not wait forever: zeros, then said
          o_.narrow(0, 0, rows).zero_();
          lse_.narrow(0, 0, rows).fill_(-std::numeric_limits<float>::infinity());
          std::lock_guard<std::mutex> lock(mutex_);
          if (error_.empty()) error_ = refused;
        }
        last_end = Clock::now();
        worked += seconds(t0, *last_end);
        __atomic_store_n(done_flags_ + layer, number, __ATOMIC_RELEASE);
        const int64_t next = layer + 1;
        // (not when the next queries are already there: a parallel region for nothing)
        if (warm_ && next < layers && !plan.jobs.empty() && q_flag(next) != number) {
          try {
            const Geometry g = geometry(host_kv_[next], kind_, page_size_, kv_heads_,
                                        q_.size(1), q_.size(2), scales_offset_, sm_scale_);
            warm(g, step.table.data_ptr<int32_t>(), width, plan, at::get_num_threads(), [&] {
              return q_flag(next) == number || q_flag(0) != number ||
                     closing_.load(std::memory_order_relaxed);
            });
          } catch (const std::exception&) {  // a prefetch is only ever a hint
          }
        }
      }
      std::lock_guard<std::mutex> lock(mutex_);
      if (tokens > 0 && layer == layers)
        stats_.emplace_back(between / std::max<int64_t>(1, layers - 1), worked / layers,
                            tokens, step_gap);
    }
  }

  torch::Tensor q_, o_, lse_, host_kv_;
  std::vector<torch::Tensor> flag_owners_;
  int32_t* q_flags_;
  int32_t* done_flags_;
  int64_t kind_, page_size_, kv_heads_, scales_offset_;
  double sm_scale_;
  int64_t threads_;
  bool warm_;  // pull the next layer's share toward the caches while waiting for its queries
  std::atomic<bool> closing_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
  std::map<int32_t, Step> steps_;
  std::vector<std::tuple<double, double, int64_t, double>> stats_;
  std::string error_;
  bool stop_ = false;
  std::thread thread_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode,
        "paged decode attention over host KV, a token range per sequence; the refusal or \"\"",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  // module_local: the build without AVX-512 (tests) loads beside this one in one process
  pybind11::class_<ShareWorker>(m, "ShareWorker", pybind11::module_local())
      .def(pybind11::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                          torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, int64_t,
                          double, int64_t, bool>())
      .def("submit", &ShareWorker::submit)
      .def("drain", &ShareWorker::drain)
      .def("error", &ShareWorker::error)
      .def("close", &ShareWorker::close, pybind11::call_guard<pybind11::gil_scoped_release>());
}
