// e4m3 weights times a few rows of e4m3 activations (batched decode: 16 to 64 rows) on tensor
// cores (fp8_rows.cu), launched by the quant binding.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

struct Fp8RowsParams {
  const uint8_t* xq;         // [x_rows, K] e4m3 (quant/triton_gemm.quantize_activations), rows
                             // from m on zeros; rows stride_x bytes apart, 16-byte aligned
  const float* xs;           // [K / 128, stride_xs]: x's scale for each row and 128 inputs
  const uint8_t* w;          // [N, K] e4m3, rows stride_w bytes apart, 16-byte aligned
  const float* scales;       // [rows of scales, stride_s]
  const int32_t* scale_row;  // [N], each output's row of scales
  void* y;                   // [m, N], bf16 or f16
  float* partials;           // [splits, m, N] when the K split is over several CTAs
  int32_t* counters;         // one per slice of outputs, zero between launches
  int m, x_rows, n, k, stride_x, stride_xs, stride_w, stride_s;
  int scale_cols;            // inputs a weight scale covers: a multiple of 128, or at least k
  int splits;                // CTAs K is split over (1 to k / 128), each whole 128-input steps
  int warp_tiles;            // 8-output tiles a warp owns: 2, or 4 at 16 rows
  bool y_bf16;
  bool pdl;                  // launched with programmatic dependent launch (sm_90 and later)
};

// outputs a CTA owns for warp_tiles
constexpr int fp8_rows_outs(int warp_tiles) { return 4 * 8 * warp_tiles; }

// "" on success, else why nothing was launched
const char* fp8_rows_launch(const Fp8RowsParams& p, cudaStream_t stream);
