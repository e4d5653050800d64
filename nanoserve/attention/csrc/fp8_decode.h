// The FP8 decode kernel's arguments (fp8_decode.cu), shared with its torch binding.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

constexpr int FP8_DECODE_TILE = 32;  // tokens per warp iteration
constexpr int FP8_DECODE_HEAD_DIM = 128;

struct Fp8DecodeParams {
  const void* q;
  const uint8_t* k;
  const uint8_t* v;
  const float* k_scale;
  const float* v_scale;
  const int32_t* page_table;
  const int32_t* context_lens;
  const int32_t* starts;  // nullptr: every row from 0
  float* mid_o;
  float* mid_lse;
  int64_t stride_qb, stride_qh;               // elements
  int64_t stride_kp, stride_kt, stride_kh;    // bytes
  int64_t stride_vp, stride_vt, stride_vh;    // bytes
  int64_t stride_sp, stride_st, stride_sh;    // floats (K's and V's scales share them)
  int64_t stride_pt;
  int64_t stride_mob, stride_moh, stride_mos;
  int64_t stride_mlb, stride_mlh;
  int group, page_shift, num_splits;
  int cached_pages;  // page numbers a block keeps in shared memory (set by the launch)
  float scale_log2;  // softmax scale x log2(e)
  bool q_bf16;
};

// Launches stage 1 on `stream` with `stages` tiles in shared memory per warp (2 to 4): "" or
// why it was refused (no exceptions cross the module)
const char* fp8_decode_launch(const Fp8DecodeParams& p, int batch, int kv_heads, int stages,
                              cudaStream_t stream);
