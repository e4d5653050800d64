// Plain weights (one value an element: e4m3 with scales, or 16-bit floats) times one row in
// CUDA (plain_gemv.cu), launched by the quant binding.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

struct PlainGemvParams {
  const void* x;             // [K], bf16 or f16, 16-byte aligned
  const uint8_t* w;          // [N, K] e4m3, or x's dtype (w_half); rows stride_w bytes apart,
                             // 16-byte aligned
  const float* scales;       // e4m3: [rows of scales, stride_s]; 16-bit weights: unread
  const int32_t* scale_row;  // e4m3: [N], each output's row of scales; 16-bit weights: unread
  void* y;                   // [N], x's dtype
  float* partials;           // [splits, N] when the K split is over several CTAs
  int32_t* counters;         // one per 32 outputs, zero between launches
  int n, k, stride_w, stride_s;
  int scale_cols;            // inputs a scale covers: a multiple of 128, or at least k
  int splits;                // CTAs K is split over (1 to k / 128), each whole 128-input steps
  bool x_bf16;
  bool w_half;               // weights in x's dtype, no scales
  bool pdl;                  // launched with programmatic dependent launch (sm_90 and later)
};

// "" on success, else why nothing was launched
const char* plain_gemv_launch(const PlainGemvParams& p, cudaStream_t stream);
