// The job of cpu_decode.cpp on Intel's matrix unit (AMX-BF16: Sapphire Rapids and later),
// included inside its anonymous namespace after the AVX-512 job. The vector job spends ~100
// cycles per (token, kv head) on its float32 multiply-adds; here the tiles do them, in three
// passes over a job's run of tokens (at most MATRIX_JOB_TOKENS, so its buffers stay in L2):
//   1. per block of 16 tokens, every kv head: scores S[token][q] = K[token][d] . Q^T[d][q]
//      (K tiles of 16 tokens x 32 d: bf16 KV read in place, FP8 converted to bf16 first), four
//      heads' accumulators in flight; V converted, its tokens interleaved in pairs (the
//      layout of the unit's second operand);
//   2. per q head: the run's exact max, the probabilities, their sum: no rescaling after;
//   3. per kv head: O[q][d] += P[q][token] . V[token][d] over every block, four output tiles
//      of 16 d in flight.
// The unit's products take several times their issue interval to finish, so each pass keeps
// independent accumulators going: a first version that waited on one (zero, product, store
// per block) ran no faster than the vector job.
// Exact to float32's rounding as the vector job is: K and V are bf16 values already (FP8
// e4m3 fits bf16 exactly), and q and the probabilities go in as a bf16 sum of two parts (high
// and low: q's as two column blocks of Q, P's as two row blocks of P), so their products lose
// nothing the float32 sums keep.
//
// Tile operations come from Amx (the instructions) or AmxEmulated (the same operations in
// plain C++): the emulated twin runs on every AVX-512 machine, so the layouts are tested
// where the hardware is missing.
#pragma once

namespace amx {

constexpr int64_t MATRIX_JOB_TOKENS = 256;
constexpr int MAX_GROUP = 8;  // q's high and low parts side by side fill a tile's 16 columns
constexpr int HEADS_IN_FLIGHT = 4, OUT_IN_FLIGHT = 4;

// pass 1's tiles: two K and two Q (loads alternate), four score accumulators
enum ScoreTile : int { K0 = 0, Q0 = 2, S0 = 4 };
// pass 3's: the probabilities, two V (loads alternate), four output accumulators
enum OutputTile : int { P = 0, V0 = 1, O0 = 3 };

struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// float32 -> bf16 bits, rounded to nearest even; finite inputs
inline uint16_t bf16_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return static_cast<uint16_t>((b + 0x7fff + (b >> 16 & 1)) >> 16);
}

inline float bf16_value(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline Config score_config(int64_t G) {
  Config c;
  for (int i = 0; i < 2; ++i) {
    c.rows[K0 + i] = 16, c.colsb[K0 + i] = 64;                            // 16 tokens x 32 d
    c.rows[Q0 + i] = 16, c.colsb[Q0 + i] = static_cast<uint16_t>(8 * G);  // 16 d pairs x 2G
  }
  for (int i = 0; i < HEADS_IN_FLIGHT; ++i)
    c.rows[S0 + i] = 16, c.colsb[S0 + i] = static_cast<uint16_t>(8 * G);  // float32
  return c;
}

inline Config output_config(int64_t G) {
  Config c;
  c.rows[P] = static_cast<uint8_t>(2 * G), c.colsb[P] = 32;  // 2G (high, low) x 16 tokens
  for (int i = 0; i < 2; ++i) c.rows[V0 + i] = 8, c.colsb[V0 + i] = 64;  // 8 token pairs x 16 d
  for (int i = 0; i < OUT_IN_FLIGHT; ++i)
    c.rows[O0 + i] = static_cast<uint8_t>(2 * G), c.colsb[O0 + i] = 64;  // 2G x 16 d, float32
  return c;
}

#if defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 11
#define NS_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
// (GCC's tile macros paste their tile number into the instruction's text: literals only)
#define NS_EACH_TILE(op, ...)                                            \
  if constexpr (T == 0) op(0, __VA_ARGS__);                              \
  else if constexpr (T == 1) op(1, __VA_ARGS__);                         \
  else if constexpr (T == 2) op(2, __VA_ARGS__);                         \
  else if constexpr (T == 3) op(3, __VA_ARGS__);                         \
  else if constexpr (T == 4) op(4, __VA_ARGS__);                         \
  else if constexpr (T == 5) op(5, __VA_ARGS__);                         \
  else if constexpr (T == 6) op(6, __VA_ARGS__);                         \
  else op(7, __VA_ARGS__)
#define NS_TILE_ZERO(t, unused) _tile_zero(t)
struct Amx {
  NS_AMX_TARGET static void begin(const Config& c) { _tile_loadconfig(&c); }
  NS_AMX_TARGET static void end() { _tile_release(); }
  template <int T>
  NS_AMX_TARGET static void load(const void* p, int64_t stride) {
    NS_EACH_TILE(_tile_loadd, p, stride);
  }
  template <int T>
  NS_AMX_TARGET static void store(void* p, int64_t stride) {
    NS_EACH_TILE(_tile_stored, p, stride);
  }
  template <int T>
  NS_AMX_TARGET static void zero() { NS_EACH_TILE(NS_TILE_ZERO, 0); }
  template <int C, int A, int B>
  NS_AMX_TARGET static void dot() {
    static_assert((C >= S0 && A == K0 + (C - S0) % 2 && B == Q0 + (C - S0) % 2) ||
                  (C >= O0 && C < O0 + OUT_IN_FLIGHT && A == P && B == V0 + (C - O0) % 2),
                  "the job's products only");
    if constexpr (C == 4 && A == 0 && B == 2) _tile_dpbf16ps(4, 0, 2);  // scores, output
    else if constexpr (C == 5 && A == 1 && B == 3) _tile_dpbf16ps(5, 1, 3);  // scores
    else if constexpr (C == 6 && A == 0 && B == 2) _tile_dpbf16ps(6, 0, 2);  // scores, output
    else if constexpr (C == 7 && A == 1 && B == 3) _tile_dpbf16ps(7, 1, 3);  // scores
    else if constexpr (C == 3 && A == 0 && B == 1) _tile_dpbf16ps(3, 0, 1);  // output
    else _tile_dpbf16ps(5, 0, 1);  // output
  }
};
#define NS_AMX 1
#endif

// The tile operations in plain C++, on thread-local tiles of the configured shapes.
struct AmxEmulated {
  struct State {
    Config c;
    alignas(64) uint8_t data[8][1024];
  };
  static State& state() {
    static thread_local State s;
    return s;
  }
  static void begin(const Config& c) { state().c = c; }
  static void end() {}
  template <int T>
  static void load(const void* p, int64_t stride) {
    State& s = state();
    for (int r = 0; r < s.c.rows[T]; ++r)
      std::memcpy(s.data[T] + r * 64, static_cast<const uint8_t*>(p) + r * stride, s.c.colsb[T]);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    State& s = state();
    for (int r = 0; r < s.c.rows[T]; ++r)
      std::memcpy(static_cast<uint8_t*>(p) + r * stride, s.data[T] + r * 64, s.c.colsb[T]);
  }
  template <int T>
  static void zero() { std::memset(state().data[T], 0, 1024); }
  static float bf16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return bf16_value(h);
  }
  // C[m][n] += sum over pairs k of A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1]
  template <int C, int A, int B>
  static void dot() {
    State& s = state();
    const int M = s.c.rows[A], pairs = s.c.colsb[A] / 4, N = s.c.colsb[B] / 4;
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) {
        float* c = reinterpret_cast<float*>(s.data[C] + m * 64) + n;
        for (int k = 0; k < pairs; ++k) {
          const uint8_t* a = s.data[A] + m * 64 + 4 * k;
          const uint8_t* b = s.data[B] + k * 64 + 4 * n;
          *c += bf16(a) * bf16(b) + bf16(a + 2) * bf16(b + 2);
        }
      }
  }
};

// Whether this CPU has AMX-BF16 and Linux lets this process use its tile state (asked for
// once; a kernel older than 5.16 or a hypervisor hiding it says no).
inline bool available() {
#ifdef NS_AMX
  static const bool ok = [] {
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const bool cpu = (d >> 22 & 1) && (d >> 24 & 1);  // AMX-BF16, AMX-TILE
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// the same, 16 at a time
inline __m256i to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

inline __m512 from_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// e4m3 bytes as bf16 through two 128-entry byte tables (the bf16's low and high bytes of each
// magnitude; the sign bit is the e4m3's own), exact
struct Fp8Tables {
  __m512i lo0, lo1, hi0, hi1, pair0, pair1;
  Fp8Tables() {
    alignas(64) uint8_t lo[128], hi[128], p0[64], p1[64];
    for (int m = 0; m < 128; ++m) {
      const int e = m >> 3, f = m & 7;
      float v = e == 0 ? std::ldexp(static_cast<float>(f), -9)
                       : std::ldexp(1.f + f / 8.f, e - 7);
      if (m == 127) v = std::numeric_limits<float>::quiet_NaN();
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      lo[m] = static_cast<uint8_t>(bits >> 16);
      hi[m] = static_cast<uint8_t>(bits >> 24);
    }
    for (int i = 0; i < 32; ++i) {  // word i of the output: low byte i, high byte i (64 + i)
      p0[2 * i] = static_cast<uint8_t>(i);
      p0[2 * i + 1] = static_cast<uint8_t>(64 + i);
      p1[2 * i] = static_cast<uint8_t>(32 + i);
      p1[2 * i + 1] = static_cast<uint8_t>(96 + i);
    }
    lo0 = _mm512_load_si512(lo);
    lo1 = _mm512_load_si512(lo + 64);
    hi0 = _mm512_load_si512(hi);
    hi1 = _mm512_load_si512(hi + 64);
    pair0 = _mm512_load_si512(p0);
    pair1 = _mm512_load_si512(p1);
  }
  // 64 e4m3 bytes -> 64 bf16 in order (out0: the first 32)
  inline void convert(__m512i x, __m512i& out0, __m512i& out1) const {
    const __m512i lo = _mm512_permutex2var_epi8(lo0, x, lo1);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, x, hi1), x,
                                                 _mm512_set1_epi8(static_cast<char>(0x80)),
                                                 0xf8);  // hi | (x & 0x80)
    out0 = _mm512_permutex2var_epi8(lo, pair0, hi);
    out1 = _mm512_permutex2var_epi8(lo, pair1, hi);
  }
};

inline const Fp8Tables& fp8_tables() {
  static const Fp8Tables t;
  return t;
}

// the byte (or word) interleave of two tokens' rows: (a0, b0, a1, b1, ...), first half
inline __m512i interleave_index(bool words, int half) {
  alignas(64) uint8_t b[64];
  alignas(64) uint16_t w[32];
  if (words) {
    for (int i = 0; i < 16; ++i) {
      w[2 * i] = static_cast<uint16_t>(16 * half + i);
      w[2 * i + 1] = static_cast<uint16_t>(32 + 16 * half + i);
    }
    return _mm512_load_si512(w);
  }
  for (int i = 0; i < 32; ++i) {
    b[2 * i] = static_cast<uint8_t>(32 * half + i);
    b[2 * i + 1] = static_cast<uint8_t>(64 + 32 * half + i);
  }
  return _mm512_load_si512(b);
}

// Scratch of one thread's jobs, grown as needed
struct Scratch {
  std::vector<uint16_t> q2, k, v, p;
  std::vector<float> s, kscale, vscale, row;
  std::vector<int64_t> block_tokens;
};

inline Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

// Calls f(std::integral_constant<int, j>{}) for j < n (n <= N): tile numbers known at
// compile time
template <int J, int N, class F>
inline void for_each_const_from(int n, F& f) {
  if constexpr (J < N) {
    if (J < n) {
      f(std::integral_constant<int, J>{});
      for_each_const_from<J + 1, N>(n, f);
    }
  }
}

template <int N, class F>
inline void for_each_const(int n, F&& f) {
  for_each_const_from<0, N>(n, f);
}

// The job (see cpu_decode.cpp's run_job_avx512 for the partial it leaves) for KIND bf16 or
// FP8 KV, head_dim D (a multiple of 64), group size up to MAX_GROUP, at most
// MATRIX_JOB_TOKENS tokens.
template <int KIND, int D, class T>
void run_job(const Geometry& g, const float* q, const int32_t* table, int64_t lo, int64_t hi,
             Partial& part) {
  static_assert(KIND == BF16 || KIND == FP8, "the matrix job takes bf16 or FP8 KV");
  constexpr int CK = D / 32;  // K tiles per head_dim
  constexpr int CV = D / 16;  // output tiles per head_dim
  constexpr int64_t E = KIND == BF16 ? 2 : 1;
  const int64_t G = g.group, H = g.kv_heads, G2 = 2 * G;
  Scratch& w = scratch();
  // the blocks: runs of up to 16 tokens inside one page
  w.block_tokens.clear();
  for (int64_t t0 = lo; t0 < hi;) {
    const int64_t n = std::min<int64_t>({BLOCK, g.page_size - t0 % g.page_size, hi - t0});
    w.block_tokens.push_back(t0);
    t0 += n;
  }
  const int64_t NB = static_cast<int64_t>(w.block_tokens.size());
  auto block_n = [&](int64_t b) {
    return (b + 1 < NB ? w.block_tokens[b + 1] : hi) - w.block_tokens[b];
  };
  // q as Q tiles, [kv head][chunk][d pair][high parts of the G q heads, then low][2]: a
  // chunk's 32 values of one q head are 16 dwords (pairs of d), scattered a row apart
  w.q2.resize(H * CK * 16 * G2 * 2);
  alignas(64) int32_t rows_at[16];
  for (int r = 0; r < 16; ++r) rows_at[r] = static_cast<int32_t>(r * G2);
  const __m512i row_index = _mm512_load_si512(rows_at);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t gi = 0; gi < G; ++gi)
      for (int c = 0; c < CK; ++c) {
        const float* x = q + (h * G + gi) * D + c * 32;
        const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        const __m256i h0 = to_bf16(x0), h1 = to_bf16(x1);
        const __m256i l0 = to_bf16(_mm512_sub_ps(x0, from_bf16(h0)));
        const __m256i l1 = to_bf16(_mm512_sub_ps(x1, from_bf16(h1)));
        int32_t* at = reinterpret_cast<int32_t*>(w.q2.data()) + (h * CK + c) * 16 * G2 + gi;
        _mm512_i32scatter_epi32(at, row_index,
                                _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1), 4);
        _mm512_i32scatter_epi32(at + G, row_index,
                                _mm512_inserti64x4(_mm512_castsi256_si512(l0), l1, 1), 4);
      }
  w.k.resize(HEADS_IN_FLIGHT * 16 * D);
  w.v.resize(H * NB * CV * 8 * 32);    // V as its tiles: [kv head][block][d tile][pair][32]
  w.s.resize(H * NB * 16 * G2);        // raw scores: [kv head][block][token][2G]
  w.kscale.resize(H * NB * 16);
  w.vscale.resize(H * NB * 16);
  w.p.resize(H * NB * G2 * 16);        // [kv head][block][2G][16 tokens]
  w.row.resize(NB * 16);
  const Fp8Tables& fp8 = fp8_tables();
  const __m512i il8_0 = interleave_index(false, 0), il8_1 = interleave_index(false, 1);
  const __m512i il16_0 = interleave_index(true, 0), il16_1 = interleave_index(true, 1);
  const __m512i zero = _mm512_setzero_si512();

  // pass 1: scores and V's tiles, block by block, every kv head
  T::begin(score_config(G));
  for (int64_t b = 0; b < NB; ++b) {
    const int64_t t0 = w.block_tokens[b], n = block_n(b);
    const int64_t page = table[t0 / g.page_size], r0 = t0 % g.page_size;
    const uint8_t* k_row = g.k_base + page * g.row_bytes;
    const uint8_t* v_row = g.v_base + page * g.row_bytes;
    for (int64_t h0 = 0; h0 < H; h0 += HEADS_IN_FLIGHT) {
      const int hn = static_cast<int>(std::min<int64_t>(HEADS_IN_FLIGHT, H - h0));
      const uint8_t* k_tile[HEADS_IN_FLIGHT];
      int64_t k_stride[HEADS_IN_FLIGHT];
      for (int j = 0; j < hn; ++j) {
        const int64_t h = h0 + j;
        auto at = [&](int64_t t) { return k_row + ((r0 + t) * H + h) * D * E; };
        k_tile[j] = at(0);
        k_stride[j] = H * D * E;
        if (KIND == FP8 || n < 16) {  // a full bf16 block is read in place
          uint16_t* kb = w.k.data() + j * 16 * D;
          for (int64_t t = 0; t < 16; ++t)
            for (int c = 0; c < D; c += 64 / E) {
              __m512i w0 = zero, w1 = zero;
              if (t < n) {
                const __m512i x = _mm512_loadu_si512(at(t) + c * E);
                if constexpr (KIND == FP8) fp8.convert(x, w0, w1);
                else w0 = x;
              }
              _mm512_storeu_si512(kb + t * D + c, w0);
              if constexpr (KIND == FP8) _mm512_storeu_si512(kb + t * D + c + 32, w1);
            }
          k_tile[j] = reinterpret_cast<const uint8_t*>(kb);
          k_stride[j] = D * 2;
        }
      }
      for_each_const<HEADS_IN_FLIGHT>(hn, [&](auto j) {
        T::template zero<S0 + decltype(j)::value>();
      });
      for (int c = 0; c < CK; ++c)
        for_each_const<HEADS_IN_FLIGHT>(hn, [&](auto j) {
          constexpr int J = decltype(j)::value, k = K0 + J % 2, qt = Q0 + J % 2;
          T::template load<k>(k_tile[J] + c * 64, k_stride[J]);
          T::template load<qt>(w.q2.data() + ((h0 + J) * CK + c) * 16 * G2 * 2, 4 * G2);
          T::template dot<S0 + J, k, qt>();
        });
      for_each_const<HEADS_IN_FLIGHT>(hn, [&](auto j) {
        constexpr int J = decltype(j)::value;
        T::template store<S0 + J>(w.s.data() + ((h0 + J) * NB + b) * 16 * G2, 4 * G2);
      });
    }
    for (int64_t h = 0; h < H; ++h) {
      auto at = [&](int64_t t) { return v_row + ((r0 + t) * H + h) * D * E; };
      uint16_t* vb = w.v.data() + (h * NB + b) * CV * 8 * 32;
      for (int64_t r = 0; r < 8; ++r)
        for (int c = 0; c < D; c += 64 / E) {
          const __m512i x = 2 * r < n ? _mm512_loadu_si512(at(2 * r) + c * E) : zero;
          const __m512i y = 2 * r + 1 < n ? _mm512_loadu_si512(at(2 * r + 1) + c * E) : zero;
          __m512i out[4];  // 16 d of both tokens a vector
          if constexpr (KIND == FP8) {
            fp8.convert(_mm512_permutex2var_epi8(x, il8_0, y), out[0], out[1]);
            fp8.convert(_mm512_permutex2var_epi8(x, il8_1, y), out[2], out[3]);
          } else {
            out[0] = _mm512_permutex2var_epi16(x, il16_0, y);
            out[1] = _mm512_permutex2var_epi16(x, il16_1, y);
          }
          for (int u = 0; u < (KIND == FP8 ? 4 : 2); ++u)
            _mm512_storeu_si512(vb + ((c / 16 + u) * 8 + r) * 32, out[u]);
        }
      const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
      __m512 ks = _mm512_maskz_mov_ps(live, _mm512_set1_ps(g.sm_scale));
      __m512 vs = _mm512_maskz_mov_ps(live, _mm512_set1_ps(1.f));
      if constexpr (KIND == FP8) {  // a float32 scale per token and kv head, H apart
        const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                               6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(static_cast<int>(H)));
        auto scales = [&](const uint8_t* row) {
          const float* first = reinterpret_cast<const float*>(row + g.scales_offset) + r0 * H + h;
          return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, first, 4);
        };
        ks = _mm512_mul_ps(ks, scales(k_row));
        vs = scales(v_row);
      }
      _mm512_storeu_ps(&w.kscale[(h * NB + b) * 16], ks);
      _mm512_storeu_ps(&w.vscale[(h * NB + b) * 16], vs);
    }
  }
  T::end();

  // pass 2: per q head, the run's max, probabilities (times V's scale) as bf16 high and low
  alignas(64) int32_t cols[16];
  for (int t = 0; t < 16; ++t) cols[t] = static_cast<int32_t>(t * G2);
  const __m512i col_index = _mm512_load_si512(cols);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t gi = 0; gi < G; ++gi) {
      float m = NEG_INF;
      for (int64_t b = 0; b < NB; ++b) {
        const __mmask16 live = static_cast<__mmask16>((1u << block_n(b)) - 1);
        const float* s = w.s.data() + (h * NB + b) * 16 * G2 + gi;
        const __m512 raw = _mm512_add_ps(_mm512_i32gather_ps(col_index, s, 4),
                                         _mm512_i32gather_ps(col_index, s + G, 4));
        const __m512 sv = _mm512_mask_mul_ps(_mm512_set1_ps(NEG_INF), live, raw,
                                             _mm512_loadu_ps(&w.kscale[(h * NB + b) * 16]));
        _mm512_storeu_ps(&w.row[b * 16], sv);
        m = std::max(m, _mm512_reduce_max_ps(sv));
      }
      __m512 l = _mm512_setzero_ps();
      for (int64_t b = 0; b < NB; ++b) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(&w.row[b * 16]), _mm512_set1_ps(m)));
        l = _mm512_add_ps(l, p);
        const __m512 pv = _mm512_mul_ps(p, _mm512_loadu_ps(&w.vscale[(h * NB + b) * 16]));
        const __m256i ph = to_bf16(pv);
        uint16_t* pt = w.p.data() + (h * NB + b) * G2 * 16;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pt + gi * 16), ph);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pt + (G + gi) * 16),
                            to_bf16(_mm512_sub_ps(pv, from_bf16(ph))));
      }
      part.m[h * G + gi] = m;
      part.l[h * G + gi] = _mm512_reduce_add_ps(l);
    }

  // pass 3: acc = P . V, OUT_IN_FLIGHT tiles of 16 d at a time over every block
  alignas(64) float obuf[OUT_IN_FLIGHT][2 * MAX_GROUP * 16];
  T::begin(output_config(G));
  for (int64_t h = 0; h < H; ++h)
    for (int c0 = 0; c0 < CV; c0 += OUT_IN_FLIGHT) {
      const int cn = std::min(OUT_IN_FLIGHT, CV - c0);
      for_each_const<OUT_IN_FLIGHT>(cn, [&](auto u) {
        T::template zero<O0 + decltype(u)::value>();
      });
      for (int64_t b = 0; b < NB; ++b) {
        T::template load<P>(w.p.data() + (h * NB + b) * G2 * 16, 32);
        const uint16_t* vb = w.v.data() + (h * NB + b) * CV * 8 * 32;
        for_each_const<OUT_IN_FLIGHT>(cn, [&](auto u) {
          constexpr int U = decltype(u)::value, vt = V0 + U % 2;
          T::template load<vt>(vb + (c0 + U) * 8 * 32, 64);
          T::template dot<O0 + U, P, vt>();
        });
      }
      for_each_const<OUT_IN_FLIGHT>(cn, [&](auto u) {
        constexpr int U = decltype(u)::value;
        T::template store<O0 + U>(obuf[U], 64);
      });
      for (int u = 0; u < cn; ++u)
        for (int64_t gi = 0; gi < G; ++gi)
          _mm512_storeu_ps(part.acc.data() + (h * G + gi) * D + (c0 + u) * 16,
                           _mm512_add_ps(_mm512_load_ps(obuf[u] + gi * 16),
                                         _mm512_load_ps(obuf[u] + (G + gi) * 16)));
    }
  T::end();
}

}  // namespace amx
