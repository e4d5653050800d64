// One token's MoE experts in CUDA (moe_gemv.cu), launched by moe_gemv_binding.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

struct MoeGemvParams {
  const void* x;        // [hidden], bf16 or f16
  const void* gate_up;  // [experts, 2 inter, hidden], x's dtype, contiguous, 16-byte aligned
  const void* down;     // [experts, hidden, inter], likewise
  const int64_t* ids;   // [top_k] the experts the router chose
  const void* weights;  // [top_k] their routing weights, x's dtype
  void* act;            // [top_k, inter] scratch: silu(gate) * up
  void* y;              // [hidden]
  int hidden, inter, top_k;
  bool bf16;
  bool pdl;             // launched with programmatic dependent launch (sm_90 and later)
};

// "" on success, else why nothing was launched
const char* moe_gemv_launch(const MoeGemvParams& p, cudaStream_t stream);
