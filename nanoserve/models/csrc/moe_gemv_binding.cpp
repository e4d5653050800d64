// torch binding of one token's MoE experts (moe_gemv.cu). Python (models/cuda_moe.py) checks the
// tensors' dtypes, shapes, alignment and devices; this takes their pointers. e4m3 stacks come
// with their block scales (float32, [experts, rows, columns] of blocks) and the block's shape;
// 16-bit stacks pass any tensors there, unread. Errors come back as
// strings, never as C++ exceptions. The stream is the caller's current one (a graph's capture
// stream while capturing), passed as an integer; pdl: launched with programmatic dependent launch
// (the caller checks for sm_90).
#include <torch/extension.h>

#include <string>

#include "moe_gemv.h"

namespace {

std::string experts(torch::Tensor x, torch::Tensor gate_up, torch::Tensor down,
                    torch::Tensor ids, torch::Tensor weights, torch::Tensor act, torch::Tensor y,
                    torch::Tensor gate_up_scales, torch::Tensor down_scales, int64_t scale_rows,
                    int64_t scale_cols, int64_t pdl, int64_t stream) {
  MoeGemvParams p{};
  p.x = x.data_ptr();
  p.gate_up = gate_up.data_ptr();
  p.down = down.data_ptr();
  p.fp8 = gate_up.scalar_type() == torch::kFloat8_e4m3fn;
  if (p.fp8) {
    if (gate_up_scales.scalar_type() != torch::kFloat || down_scales.scalar_type() != torch::kFloat)
      return "MoE GEMV: FP8 block scales must be float32";
    p.gate_up_scales = gate_up_scales.data_ptr<float>();
    p.down_scales = down_scales.data_ptr<float>();
    for (int d = 0; d < 2; ++d) {
      p.gate_up_scales_stride[d] = gate_up_scales.stride(d);
      p.down_scales_stride[d] = down_scales.stride(d);
    }
    p.scale_rows = static_cast<int>(scale_rows);
    p.scale_cols = static_cast<int>(scale_cols);
  }
  p.ids = ids.data_ptr<int64_t>();
  p.weights = weights.data_ptr();
  p.act = act.data_ptr();
  p.y = y.data_ptr();
  p.hidden = static_cast<int>(down.size(1));
  p.inter = static_cast<int>(down.size(2));
  p.top_k = static_cast<int>(ids.numel());
  p.bf16 = x.scalar_type() == torch::kBFloat16;
  p.pdl = pdl != 0;
  const char* refused = moe_gemv_launch(p, reinterpret_cast<cudaStream_t>(stream));
  if (*refused) return refused;
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? "" : cudaGetErrorString(err);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("experts", &experts,
        "one token's k experts (16-bit, or e4m3 with block scales): gate_up with SiLU-multiply, "
        "down weighted and summed, into y; "
        "\"\" or why nothing ran");
}
