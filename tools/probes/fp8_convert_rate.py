"""How fast an SM widens e4m3 to float16, by instruction form: the hardware conversion
(cvt.rn.f16x2.e4m3x2, as csrc/fp8_decode.cu does it, each 16-bit half taken out of a 32-bit
word first) against integer bit moves (sign kept, the rest shifted into float16's place: the
value times 2^-8, exact). Throughput-bound loops, no memory traffic; reported in elements a
second beside the HBM rate the decode kernel must keep up with (one e4m3 byte an element)."""

from __future__ import annotations

import torch
from torch.utils.cpp_extension import load_inline

SRC = r"""
#include <cstdint>
__device__ __forceinline__ uint32_t cvt2(uint32_t two) {
  uint32_t out;
  const uint16_t in = static_cast<uint16_t>(two);
  asm volatile("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(in));
  return out;
}
// bytes 1 and 3 of w as float16 x 2^-8 (sign to bit 15, the other 7 bits to 7..13)
__device__ __forceinline__ uint32_t bits_odd(uint32_t w) {
  return (w & 0x80008000u) | ((w & 0x7F007F00u) >> 1);
}
template <int FORM>
__global__ void convert(uint32_t* out, int iters, uint32_t seed) {
  uint32_t w[8], acc[8];
  #pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = seed * (threadIdx.x + 17 * i + 1), acc[i] = 0;
  for (int it = 0; it < iters; ++it) {
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t a, b;
      if (FORM == 0) { a = cvt2(w[i] & 0xFFFF); b = cvt2(w[i] >> 16); }
      else { a = bits_odd(w[i]); b = bits_odd(w[i] << 8); }
      acc[i] ^= a + b;  // an add stands in for the MMA's read of both
      w[i] += 0x01010101u;
    }
  }
  uint32_t r = 0;
  #pragma unroll
  for (int i = 0; i < 8; ++i) r ^= acc[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = r;
}
void run(torch::Tensor out, int64_t form, int64_t iters, int64_t blocks) {
  auto p = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  if (form == 0) convert<0><<<blocks, 256>>>(p, iters, 12345u);
  else convert<1><<<blocks, 256>>>(p, iters, 12345u);
}
"""


def main() -> None:
    mod = load_inline("fp8_convert_rate",
                      cpp_sources="void run(torch::Tensor, int64_t, int64_t, int64_t);",
                      cuda_sources="#include <torch/extension.h>\n" + SRC, functions=["run"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks, iters = sms * 8, 4096
    out = torch.empty(blocks * 256, dtype=torch.int32, device="cuda")
    elements = blocks * 256 * iters * 8 * 4  # 8 words of 4 e4m3 values an iteration
    for form, name in ((0, "cvt.rn.f16x2.e4m3x2"), (1, "bit moves (lop3, shift)")):
        mod.run(out, form, iters, blocks)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            mod.run(out, form, iters, blocks)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        t = sorted(times)[2]
        print(f"{name:26s} {elements / t / 1e12:6.2f} T elements/s "
              f"({elements / t / 1e12 / 4.8:.2f}x an H200's 4.8 TB/s of e4m3 bytes), "
              f"{t * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
