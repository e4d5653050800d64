// What the one-row CUDA kernels share (quant/csrc/awq_gemv.cu, plain_gemv.cu; models/csrc/
// moe_gemv.cu): a streaming 16-byte load, conversions between 16-bit floats and float, dots of
// a lane's 16 bytes of weights, and programmatic dependent launch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace one_row {

// 16 bytes of weights, read once: not kept in L1. The non-coherent path: only for what no kernel
// writes while this one runs (never a previous kernel's output under PDL, below: ptxas may hoist
// such loads above pdl_wait(), as it did the AWQ GEMV's weight loads in session 31's SASS)
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// the 128-byte line holding p fetched into L2, nothing waited for
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
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

// sum plus the dot of 8 weights (a uint4 of T) with 8 inputs
template <typename T>
__device__ __forceinline__ float dot8(uint4 w, const float* x, float sum) {
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = pair(ws[i], T{});
    sum = fmaf(a.x, x[2 * i], sum);
    sum = fmaf(a.y, x[2 * i + 1], sum);
  }
  return sum;
}

// the dot of 16 e4m3 weights (a uint4) with 16 inputs: two e4m3 become two halves in one cvt
// (sm_89 and later; emulated below), then floats
__device__ __forceinline__ float dot16_e4m3(uint4 w, const float* x) {
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // weights 2 i and 2 i + 1: half i of the words
    const auto two = static_cast<__nv_fp8x2_storage_t>(ws[i / 2] >> (16 * (i % 2)));
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3);
    const float2 wf = __half22float2(__half2(h));
    sum = fmaf(wf.x, x[2 * i], sum);
    sum = fmaf(wf.y, x[2 * i + 1], sum);
  }
  return sum;
}

__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// Programmatic dependent launch (sm_90 and later; no-ops below, and in a kernel launched
// without it). A kernel launched with it may start before the kernel ahead of it in the stream
// has finished: before pdl_wait() it may read only what no kernel on the stream writes (weights,
// their scales, scale rows), and it writes nothing; after it, what the kernel ahead wrote is
// read with coherent loads (not load_stream or __ldg). pdl_trigger(): the next kernel launched
// with it may start its own such prologue now.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// whether `kernel`'s code was compiled for sm_90 or later, so that its pdl_wait() is in it: an
// extension built from an older architecture's PTX and compiled for a Hopper at load time has
// none, and must not be launched with PDL
inline bool has_pdl_wait(const void* kernel) {
  static std::mutex mutex;
  static std::unordered_map<const void*, bool> known;
  const std::lock_guard<std::mutex> hold(mutex);
  const auto it = known.find(kernel);
  if (it != known.end()) return it->second;
  cudaFuncAttributes a{};
  const bool has = cudaFuncGetAttributes(&a, kernel) == cudaSuccess && a.ptxVersion >= 90;
  return known[kernel] = has;
}

// kernel<<<grid, block, 0, stream>>>(p), launched with programmatic dependent launch when pdl
// and the kernel holds its wait (the caller checks the device: sm_90 and later)
template <typename Params>
inline void launch(void (*kernel)(Params), dim3 grid, dim3 block, cudaStream_t stream, bool pdl,
                   const Params& p) {
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = pdl && has_pdl_wait(reinterpret_cast<const void*>(kernel)) ? 1 : 0;
  cudaLaunchKernelEx(&config, kernel, p);
}

// v rounded to T and back
template <typename T>
__device__ __forceinline__ float rounded(float v) {
  T t;
  store(&t, v);
  return to_float(t);
}

}  // namespace one_row
