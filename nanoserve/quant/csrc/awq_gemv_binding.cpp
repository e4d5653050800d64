// torch binding of AWQ's one-row product (awq_gemv.cu). Python (quant/cuda_awq.py) checks the
// tensors' dtypes, shapes, alignment and devices; this takes their pointers. Errors come back as
// strings, never as C++ exceptions. The stream is the caller's current one (a graph's capture
// stream while capturing), passed as an integer.
#include <torch/extension.h>

#include <string>

#include "awq_gemv.h"

namespace {

std::string awq_gemv(torch::Tensor x, torch::Tensor qweight, torch::Tensor qzeros,
                     torch::Tensor scales, torch::Tensor y, torch::Tensor partials,
                     torch::Tensor counters, int64_t group, int64_t rows, int64_t stream) {
  AwqGemvParams p{};
  p.x = x.data_ptr();
  p.qweight = static_cast<const uint32_t*>(qweight.data_ptr());
  p.qzeros = static_cast<const uint32_t*>(qzeros.data_ptr());
  p.scales = scales.data_ptr();
  p.y = y.data_ptr();
  // one split: the kernel reads neither (the caller may pass any tensor)
  p.partials = static_cast<float*>(partials.data_ptr());
  p.counters = static_cast<int32_t*>(counters.data_ptr());
  p.n = static_cast<int>(scales.size(1));
  p.k = static_cast<int>(qweight.size(0));
  p.group = static_cast<int>(group);
  p.rows = static_cast<int>(rows);
  p.x_bf16 = x.scalar_type() == torch::kBFloat16;
  p.scales_bf16 = scales.scalar_type() == torch::kBFloat16;
  const char* refused = awq_gemv_launch(p, reinterpret_cast<cudaStream_t>(stream));
  if (*refused) return refused;
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? "" : cudaGetErrorString(err);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("awq_gemv", &awq_gemv,
        "AWQ 4-bit weights times one row, written to y; \"\" or why nothing ran");
}
