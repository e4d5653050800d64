// torch binding of one token's MoE experts (moe_gemv.cu). Python (models/cuda_moe.py) checks the
// tensors' dtypes, shapes, alignment and devices; this takes their pointers. Errors come back as
// strings, never as C++ exceptions. The stream is the caller's current one (a graph's capture
// stream while capturing), passed as an integer; pdl: launched with programmatic dependent launch
// (the caller checks for sm_90).
#include <torch/extension.h>

#include <string>

#include "moe_gemv.h"

namespace {

std::string experts(torch::Tensor x, torch::Tensor gate_up, torch::Tensor down,
                    torch::Tensor ids, torch::Tensor weights, torch::Tensor act, torch::Tensor y,
                    int64_t pdl, int64_t stream) {
  MoeGemvParams p{};
  p.x = x.data_ptr();
  p.gate_up = gate_up.data_ptr();
  p.down = down.data_ptr();
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
        "one token's k experts: gate_up with SiLU-multiply, down weighted and summed, into y; "
        "\"\" or why nothing ran");
}
