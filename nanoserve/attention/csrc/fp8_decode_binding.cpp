// torch binding of the FP8 decode kernel (fp8_decode.cu). Python (attention/cuda_fp8_decode.py)
// checks the tensors' dtypes, shapes and devices; this takes their pointers and strides. Errors
// come back as strings, never as C++ exceptions (see cpu_decode.cpp on TORCH_CHECK). The stream
// is the caller's current one (a graph's capture stream while capturing), passed as an integer.
#include <torch/extension.h>

#include <cmath>
#include <string>

#include "fp8_decode.h"

namespace {

std::string decode_partials(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor k_scale, torch::Tensor v_scale,
                            torch::Tensor page_tables, torch::Tensor context_lens,
                            c10::optional<torch::Tensor> starts, torch::Tensor mid_o,
                            torch::Tensor mid_lse, double scale, int64_t page_shift,
                            int64_t stages, int64_t stream) {
  Fp8DecodeParams p{};
  p.q = q.data_ptr();
  p.q_bf16 = q.scalar_type() == torch::kBFloat16;
  p.k = static_cast<const uint8_t*>(k_cache.data_ptr());
  p.v = static_cast<const uint8_t*>(v_cache.data_ptr());
  p.k_scale = k_scale.data_ptr<float>();
  p.v_scale = v_scale.data_ptr<float>();
  p.page_table = page_tables.data_ptr<int32_t>();
  p.context_lens = context_lens.data_ptr<int32_t>();
  p.starts = starts.has_value() ? starts->data_ptr<int32_t>() : nullptr;
  p.mid_o = mid_o.data_ptr<float>();
  p.mid_lse = mid_lse.data_ptr<float>();
  p.stride_qb = q.stride(0);
  p.stride_qh = q.stride(1);
  p.stride_kp = k_cache.stride(0);  // the caches are 1-byte elements: strides in bytes
  p.stride_kt = k_cache.stride(1);
  p.stride_kh = k_cache.stride(2);
  p.stride_vp = v_cache.stride(0);
  p.stride_vt = v_cache.stride(1);
  p.stride_vh = v_cache.stride(2);
  p.stride_sp = k_scale.stride(0);
  p.stride_st = k_scale.stride(1);
  p.stride_sh = k_scale.stride(2);
  p.stride_pt = page_tables.stride(0);
  p.stride_mob = mid_o.stride(0);
  p.stride_moh = mid_o.stride(1);
  p.stride_mos = mid_o.stride(2);
  p.stride_mlb = mid_lse.stride(0);
  p.stride_mlh = mid_lse.stride(1);
  p.group = static_cast<int>(q.size(1) / k_cache.size(2));
  p.page_shift = static_cast<int>(page_shift);
  p.num_splits = static_cast<int>(mid_o.size(2));
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  return fp8_decode_launch(p, static_cast<int>(q.size(0)), static_cast<int>(k_cache.size(2)),
                           static_cast<int>(stages), reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_partials", &decode_partials,
        "split-KV decode over an FP8 paged cache into per-split outputs and LSEs; \"\" or the "
        "refusal");
}
