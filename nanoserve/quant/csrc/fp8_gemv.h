// FP8 weights times one row in CUDA (fp8_gemv.cu), launched by the quant binding.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

struct Fp8GemvParams {
  const void* x;             // [K], bf16 or f16, 16-byte aligned
  const uint8_t* w;          // e4m3 [N, K], rows stride_w bytes apart, 16-byte aligned
  const float* scales;       // [rows of scales, stride_s]
  const int32_t* scale_row;  // [N]: each output's row of scales
  void* y;                   // [N], x's dtype
  float* partials;           // [splits, N] when the K split is over several CTAs
  int32_t* counters;         // one per 32 outputs, zero between launches
  int n, k, stride_w, stride_s;
  int scale_cols;            // inputs a scale covers: a multiple of 128, or at least k
  int splits;                // CTAs K is split over (1 to k / 128), each whole 128-input steps
  bool x_bf16;
  bool pdl;                  // launched with programmatic dependent launch (sm_90 and later)
};

// "" on success, else why nothing was launched
const char* fp8_gemv_launch(const Fp8GemvParams& p, cudaStream_t stream);
