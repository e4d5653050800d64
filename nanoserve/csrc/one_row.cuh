// What the one-row CUDA kernels share (quant/csrc/awq_gemv.cu, fp8_gemv.cu; models/csrc/
// moe_gemv.cu): a streaming 16-byte load and conversions between 16-bit floats and float.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace one_row {

// 16 bytes of weights, read once: not kept in L1
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// the two 16-bit floats of a word (low half first) as floats
__device__ __forceinline__ float2 pair(uint32_t w, __nv_bfloat16) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
}
__device__ __forceinline__ float2 pair(uint32_t w, __half) {
  __half2 h;
  *reinterpret_cast<uint32_t*>(&h) = w;
  return __half22float2(h);
}

__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// v rounded to T and back
template <typename T>
__device__ __forceinline__ float rounded(float v) {
  T t;
  store(&t, v);
  return to_float(t);
}

}  // namespace one_row
