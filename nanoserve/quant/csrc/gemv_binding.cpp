// torch binding of the one-row products (awq_gemv.cu, plain_gemv.cu). Python (quant/cuda_gemv.py)
// checks the tensors' dtypes, shapes, alignment and devices; this takes their pointers. Errors
// come back as strings, never as C++ exceptions. The stream is the caller's current one (a
// graph's capture stream while capturing), passed as an integer; pdl: launched with programmatic
// dependent launch (the caller checks for sm_90). With one split the kernels read neither
// partials nor counters (the caller may pass any tensor for them), nor the AWQ kernel x_order
// unless `ordered`.
#include <torch/extension.h>

#include <string>

#include "awq_gemv.h"
#include "plain_gemv.h"

namespace {

std::string launched(const char* refused) {
  if (*refused) return refused;
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? "" : cudaGetErrorString(err);
}

std::string awq_gemv(torch::Tensor x, torch::Tensor x_order, torch::Tensor qweight,
                     torch::Tensor qzeros, torch::Tensor scales, torch::Tensor y,
                     torch::Tensor partials, torch::Tensor counters, int64_t group,
                     int64_t ordered, int64_t splits, int64_t pdl, int64_t stream) {
  AwqGemvParams p{};
  p.x = x.data_ptr();
  p.x_order = ordered ? static_cast<const int32_t*>(x_order.data_ptr()) : nullptr;
  p.qweight = static_cast<const uint32_t*>(qweight.data_ptr());
  p.qzeros = static_cast<const uint32_t*>(qzeros.data_ptr());
  p.scales = scales.data_ptr();
  p.y = y.data_ptr();
  p.partials = static_cast<float*>(partials.data_ptr());
  p.counters = static_cast<int32_t*>(counters.data_ptr());
  p.n = static_cast<int>(scales.size(1));
  p.k = static_cast<int>(qweight.size(0));
  p.group = static_cast<int>(group);
  p.splits = static_cast<int>(splits);
  p.x_bf16 = x.scalar_type() == torch::kBFloat16;
  p.scales_bf16 = scales.scalar_type() == torch::kBFloat16;
  p.pdl = pdl != 0;
  return launched(awq_gemv_launch(p, reinterpret_cast<cudaStream_t>(stream)));
}

std::string fp8_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor scales,
                     torch::Tensor scale_row, torch::Tensor y, torch::Tensor partials,
                     torch::Tensor counters, int64_t scale_cols, int64_t splits, int64_t pdl,
                     int64_t stream) {
  PlainGemvParams p{};
  p.x = x.data_ptr();
  p.w = static_cast<const uint8_t*>(w.data_ptr());
  p.scales = static_cast<const float*>(scales.data_ptr());
  p.scale_row = static_cast<const int32_t*>(scale_row.data_ptr());
  p.y = y.data_ptr();
  p.partials = static_cast<float*>(partials.data_ptr());
  p.counters = static_cast<int32_t*>(counters.data_ptr());
  p.n = static_cast<int>(w.size(0));
  p.k = static_cast<int>(w.size(1));
  p.stride_w = static_cast<int>(w.stride(0));
  p.stride_s = static_cast<int>(scales.stride(0));
  p.scale_cols = static_cast<int>(std::min<int64_t>(scale_cols, 1 << 30));
  p.splits = static_cast<int>(splits);
  p.x_bf16 = x.scalar_type() == torch::kBFloat16;
  p.pdl = pdl != 0;
  return launched(plain_gemv_launch(p, reinterpret_cast<cudaStream_t>(stream)));
}

std::string half_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor y, torch::Tensor partials,
                      torch::Tensor counters, int64_t splits, int64_t pdl, int64_t stream) {
  PlainGemvParams p{};
  p.x = x.data_ptr();
  p.w = static_cast<const uint8_t*>(w.data_ptr());
  p.y = y.data_ptr();
  p.partials = static_cast<float*>(partials.data_ptr());
  p.counters = static_cast<int32_t*>(counters.data_ptr());
  p.n = static_cast<int>(w.size(0));
  p.k = static_cast<int>(w.size(1));
  p.stride_w = static_cast<int>(w.stride(0) * w.element_size());
  p.splits = static_cast<int>(splits);
  p.x_bf16 = x.scalar_type() == torch::kBFloat16;
  p.w_half = true;
  p.pdl = pdl != 0;
  return launched(plain_gemv_launch(p, reinterpret_cast<cudaStream_t>(stream)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("awq_gemv", &awq_gemv,
        "AWQ 4-bit weights times one row, written to y; \"\" or why nothing ran");
  m.def("fp8_gemv", &fp8_gemv, "e4m3 weights times one row, written to y; \"\" or why nothing ran");
  m.def("half_gemv", &half_gemv,
        "16-bit weights (x's dtype) times one row, written to y; \"\" or why nothing ran");
}
