// One token's MoE experts in CUDA (moe_gemv.cu), launched by moe_gemv_binding.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

struct MoeGemvParams {
  const void* x;        // [hidden], bf16 or f16
  const void* gate_up;  // [experts, 2 inter, hidden], x's dtype or e4m3 (fp8), contiguous,
                        // 16-byte aligned
  const void* down;     // [experts, hidden, inter], likewise
  // fp8: each stack's float32 scales, [experts, rows / scale_rows, columns / scale_cols]
  // (rounded up) with these strides (elements; the last is 1); else unread
  const float* gate_up_scales;
  const float* down_scales;
  int64_t gate_up_scales_stride[2];
  int64_t down_scales_stride[2];
  int scale_rows, scale_cols;  // fp8: a scale's block (scale_cols a multiple of 16)
  const int64_t* ids;   // [top_k] the experts the router chose
  const void* weights;  // [top_k] their routing weights, x's dtype
  void* act;            // [top_k, inter] scratch: silu(gate) * up
  void* y;              // [hidden]
  int hidden, inter, top_k;
  bool bf16;
  bool fp8;             // weights e4m3 with block scales
  bool pdl;             // launched with programmatic dependent launch (sm_90 and later)
};

// "" on success, else why nothing was launched
const char* moe_gemv_launch(const MoeGemvParams& p, cudaStream_t stream);
