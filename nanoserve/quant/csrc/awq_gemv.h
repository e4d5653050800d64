// AWQ's one-row product in CUDA (awq_gemv.cu), launched by gemv_binding.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

struct AwqGemvParams {
  const void* x;              // [K], bf16 or f16
  const int32_t* x_order;     // [K] or null: input k is x[x_order[k]] (act-order GPTQ run as
                              // AWQ, its inputs sorted by group as it loaded)
  const uint32_t* qweight;    // [K, N / 8], contiguous, 16-byte aligned
  const uint32_t* qzeros;     // [K / group, N / 8], contiguous, 16-byte aligned
  const void* scales;         // [K / group, N], bf16 or f16, contiguous, 16-byte aligned
  void* y;                    // [N], x's dtype
  float* partials;            // [splits, N] when the K split is over several CTAs
  int32_t* counters;          // one per slice of outputs, zero between launches
  int n, k, group;
  int splits;                 // CTAs K is split over (1 to k / group), each whole groups
  bool x_bf16, scales_bf16;
  bool pdl;                   // launched with programmatic dependent launch (sm_90 and later)
};

// "" on success, else why nothing was launched (an unsupported group size)
const char* awq_gemv_launch(const AwqGemvParams& p, cudaStream_t stream);
