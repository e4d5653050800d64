// Decode attention on the CPU over one layer of paged KV in host memory (the offload tier's
// layout: [2 (K, V), page, page row]; a row holds [page_size, kv_heads, head_dim] values, then,
// for FP8, one float32 scale per token and kv head). Each sequence attends the tokens
// [start, end) of its context, so a layer's tokens can be split between the CPU and the GPU and
// the two partial results merged by their log-sum-exp. Returns the normalized output and the
// natural-log LSE per query head; an empty range gives zeros and -inf.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

enum Kind { BF16 = 0, F16 = 1, F32 = 2, FP8 = 3 };

// one token's K (or V) of one kv head, as float32
inline void load_row(const uint8_t* p, int kind, int d, float scale, float* out) {
  switch (kind) {
    case BF16: {
      const uint16_t* x = reinterpret_cast<const uint16_t*>(p);
      for (int i = 0; i < d; ++i) {
        uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
        std::memcpy(&out[i], &bits, 4);
      }
      break;
    }
    case F16: {
      const c10::Half* x = reinterpret_cast<const c10::Half*>(p);
      for (int i = 0; i < d; ++i) out[i] = static_cast<float>(x[i]);
      break;
    }
    case F32:
      std::memcpy(out, p, d * sizeof(float));
      break;
    default: {
      // e4m3 bits s.eeee.mmm placed in a float32's sign, low exponent and high mantissa bits
      // give the value times 2^-120 (subnormals too: bias 7 against 127), so one multiply by
      // scale * 2^120 finishes it; integer ops and a multiply, vectorized (a table lookup is
      // a gather per element)
      const float mul = scale * 0x1p120f;
      for (int i = 0; i < d; ++i) {
        const uint32_t x = p[i];
        const uint32_t bits = ((x & 0x80u) << 24) | ((x & 0x7fu) << 20);
        float f;
        std::memcpy(&f, &bits, 4);
        out[i] = f * mul;
      }
    }
  }
}

}  // namespace

std::vector<torch::Tensor> decode(torch::Tensor q, torch::Tensor kv, torch::Tensor page_table,
                                  torch::Tensor starts, torch::Tensor ends, int64_t kind,
                                  int64_t page_size, int64_t num_kv_heads,
                                  int64_t scales_offset, double sm_scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.is_contiguous() && q.dim() == 3,
              "q: contiguous float32 [batch, q_heads, head_dim]");
  TORCH_CHECK(kv.is_contiguous() && kv.dim() == 3, "kv: contiguous [2, pages, row]");
  TORCH_CHECK(page_table.dtype() == torch::kInt32 && page_table.is_contiguous(),
              "page_table: contiguous int32");
  TORCH_CHECK(starts.dtype() == torch::kInt32 && ends.dtype() == torch::kInt32,
              "starts, ends: int32");
  const int64_t batch = q.size(0), q_heads = q.size(1), d = q.size(2);
  TORCH_CHECK(q_heads % num_kv_heads == 0, "q heads must be a multiple of kv heads");
  const int64_t group = q_heads / num_kv_heads;
  const int64_t num_pages = kv.size(1);
  const int64_t row_bytes = kv.size(2) * kv.element_size();
  const int64_t elem = kind == BF16 || kind == F16 ? 2 : (kind == F32 ? 4 : 1);
  const uint8_t* base = reinterpret_cast<const uint8_t*>(kv.data_ptr());
  const uint8_t* k_base = base;
  const uint8_t* v_base = base + num_pages * row_bytes;
  const int32_t* table = page_table.data_ptr<int32_t>();
  const int64_t width = page_table.size(1);
  const int32_t* lo = starts.data_ptr<int32_t>();
  const int32_t* hi = ends.data_ptr<int32_t>();
  const float* qp = q.data_ptr<float>();
  auto out = torch::zeros_like(q);
  auto lse = torch::full({batch, q_heads}, -std::numeric_limits<float>::infinity(),
                         q.options());
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float scale = static_cast<float>(sm_scale);

  // Tokens go in blocks of one page's share: the block's K and V are converted once into
  // float32 buffers, then every query head of the group takes its scores, one max and one
  // rescale per block (online softmax), and the exp-weighted sum of V; the inner loops run
  // over head_dim, contiguous, so the compiler vectorizes them.
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> kb(page_size * d), vb(page_size * d), p(page_size), acc(group * d),
        m(group), l(group);
    for (int64_t job = first; job < last; ++job) {
      const int64_t b = job / num_kv_heads, h = job % num_kv_heads;
      if (hi[b] <= lo[b]) continue;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const float* qh = qp + (b * q_heads + h * group) * d;
      for (int64_t t0 = lo[b]; t0 < hi[b];) {
        const int64_t page = table[b * width + t0 / page_size], r0 = t0 % page_size;
        const int64_t n = std::min<int64_t>(page_size - r0, hi[b] - t0);
        const uint8_t* k_row = k_base + page * row_bytes;
        const uint8_t* v_row = v_base + page * row_bytes;
        for (int64_t j = 0; j < n; ++j) {
          const int64_t r = r0 + j, at = (r * num_kv_heads + h) * d * elem;
          float k_scale = 1.f, v_scale = 1.f;
          if (kind == FP8) {
            const int64_t so = scales_offset + (r * num_kv_heads + h) * 4;
            std::memcpy(&k_scale, k_row + so, 4);
            std::memcpy(&v_scale, v_row + so, 4);
          }
          load_row(k_row + at, kind, d, k_scale, kb.data() + j * d);
          load_row(v_row + at, kind, d, v_scale, vb.data() + j * d);
        }
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qh + g * d;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < n; ++j) {
            const float* kj = kb.data() + j * d;
            float s = 0.f;
            for (int64_t i = 0; i < d; ++i) s += qg[i] * kj[i];
            p[j] = s * scale;
            block_max = std::max(block_max, p[j]);
          }
          const float m_new = std::max(m[g], block_max);
          const float c = std::exp(m[g] - m_new);  // 0 on the first block (m = -inf)
          float sum = 0.f;
          for (int64_t j = 0; j < n; ++j) {
            p[j] = std::exp(p[j] - m_new);
            sum += p[j];
          }
          float* a = acc.data() + g * d;
          for (int64_t i = 0; i < d; ++i) a[i] *= c;
          for (int64_t j = 0; j < n; ++j) {
            const float* vj = vb.data() + j * d;
            const float pj = p[j];
            for (int64_t i = 0; i < d; ++i) a[i] += pj * vj[i];
          }
          l[g] = l[g] * c + sum;
          m[g] = m_new;
        }
        t0 += n;
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = b * q_heads + h * group + g;
        for (int64_t i = 0; i < d; ++i) op[row * d + i] = acc[g * d + i] / l[g];
        lp[row] = m[g] + std::log(l[g]);
      }
    }
  });
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode, "paged decode attention over host KV, a token range per sequence");
}
