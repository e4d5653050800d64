"""A candidate for the AWQ one-row GEMV's arithmetic (issue 36; docs/perf-notes.md session 29:
the engine's kernel, quant/csrc/awq_gemv.cu, waits on its unpacking, about 3.9 instructions an
element in its PTX, 2.9 in the inner loop and 1 at the group ends): the same loads, grid, split
and split ending, but the products in packed half precision, as AWQ's own GEMV and vLLM's do. A
pair of nibbles becomes two fp16 1024 + q in one LOP3, one HSUB2 takes 1024 + z off (exact:
small integers), one HFMA2 adds x (q - z) for two outputs; a pair's 8 rows of a group summed in
fp16 (one HFMA2 a row), then widened and scaled into float32 once a group: about 2.4
instructions an element. x is converted to fp16 times 2^-XSHIFT (exact in fp16's range; the
shift keeps x's largest values and a pair's sums of 8 products of up to 15 |x| from overflowing:
XSHIFT 8 takes |x| up to about 1.4e5, at 2^-16 absolute steps of x below 2^-6).

Per Qwen3-8B layer: the engine's kernel and the candidate at XSHIFT 0 and 8, in CUDA graphs over
copies of the weight past L2 (us), and each one's largest difference from float64's product with
formats.dequantize's weight, over that product's largest output, for x ~ N(0, 1) and for x with
a few entries at 3e4 (activations as large as some models' MLP inputs). Usage (GPU):
    python tools/probes/awq_half2.py [--shapes qkv,o,gate_up,down]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tools/: bench_quant's shapes and timing
from bench_quant import SHAPES, SPAN, graph_time_us, weights  # noqa: E402
from gemv_build import build  # noqa: E402  (tools/probes/)

from nanoserve.quant import QuantConfig, cuda_gemv  # noqa: E402
from nanoserve.quant.formats import dequantize  # noqa: E402
from nanoserve.quant.triton_gemm import split_buffers  # noqa: E402

CUDA = r"""
namespace {

using one_row::load_stream;
using one_row::to_float;

__device__ __forceinline__ uint32_t two_nibbles(uint32_t w, uint32_t magic) {
  uint32_t d;
  asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;" : "=r"(d) : "r"(w), "r"(magic));
  return d;
}

__device__ __forceinline__ __half2 as_half2(uint32_t v) {
  __half2 h;
  *reinterpret_cast<uint32_t*>(&h) = v;
  return h;
}

// group 128, fp16 scales; a CTA 256 outputs, a quarter warp a 128-byte row segment a step, a
// thread's 8 rows of a group loaded a group ahead (awq_gemv.cu's loads)
template <typename XT, int XSHIFT>
__global__ void __launch_bounds__(128, 3) awq_half2_gemv(const uint32_t* qweight,
                                                        const uint32_t* qzeros,
                                                        const __half* scales, const XT* xin,
                                                        int n, int k, XT* y, float* partials,
                                                        int32_t* counters) {
  constexpr int STEPS = 8, ROW_SLOTS = 16, GROUP = 128, OUTS = 256, WARPS = 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slot = warp * 4 + (lane >> 3), col = lane & 7;
  const int words = n / 8, word0 = blockIdx.x * (OUTS / 8) + col * 4;
  const bool live = word0 < words;
  const int groups = k / GROUP;
  const int g_begin = blockIdx.y * groups / gridDim.y;
  const int rows = ((blockIdx.y + 1) * groups / gridDim.y - g_begin) * GROUP;
  const int k_begin = g_begin * GROUP;
  const XT* x = xin + k_begin + slot;
  const uint32_t* w = qweight + static_cast<size_t>(k_begin + slot) * words + word0;
  const uint32_t magic = 0x64006400u;  // two fp16 1024
  const float unscale = static_cast<float>(1 << XSHIFT);
  float out[32];
#pragma unroll
  for (int o = 0; o < 32; ++o) out[o] = 0.f;
  uint4 next[STEPS], next_z = make_uint4(0, 0, 0, 0);
  __half x_next[STEPS];
  const auto load_group = [&](int g0) {
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      const size_t row = static_cast<size_t>(g0 + s * ROW_SLOTS);
      next[s] = live ? load_stream(w + row * words) : make_uint4(0, 0, 0, 0);
      x_next[s] = __float2half_rn(to_float(x[row]) / unscale);
    }
    if (live)
      next_z = *reinterpret_cast<const uint4*>(
          qzeros + static_cast<size_t>((k_begin + g0) / GROUP) * words + word0);
  };
  load_group(0);
  for (int g0 = 0; g0 < rows; g0 += GROUP) {
    uint4 q[STEPS];
    __half2 x2[STEPS];
#pragma unroll
    for (int s = 0; s < STEPS; ++s) q[s] = next[s], x2[s] = __half2half2(x_next[s]);
    const uint32_t zs[4] = {next_z.x, next_z.y, next_z.z, next_z.w};
    uint4 sv[4];  // the 32 scales, two a word
    if (live) {
      const uint4* sp = reinterpret_cast<const uint4*>(
          scales + static_cast<size_t>((k_begin + g0) / GROUP) * n + word0 * 8);
#pragma unroll
      for (int j = 0; j < 4; ++j) sv[j] = sp[j];
    }
    if (g0 + GROUP < rows) load_group(g0 + GROUP);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t sw[4] = {sv[j].x, sv[j].y, sv[j].z, sv[j].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // outputs 8 j + 2 i and 8 j + 2 i + 1
        const __half2 z = as_half2(two_nibbles(zs[j] >> (4 * i), magic));
        __half2 acc = __float2half2_rn(0.f);
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
          const uint32_t ws[4] = {q[s].x, q[s].y, q[s].z, q[s].w};
          acc = __hfma2(x2[s], __hsub2(as_half2(two_nibbles(ws[j] >> (4 * i), magic)), z), acc);
        }
        const float2 a = __half22float2(acc);
        // output c = 8 j + 2 i + h's scale: half h of word c / 2 of the 16
        const float2 s = __half22float2(as_half2(sw[i]));
        out[8 * j + 2 * i] = fmaf(s.x * unscale, a.x, out[8 * j + 2 * i]);
        out[8 * j + 2 * i + 1] = fmaf(s.y * unscale, a.y, out[8 * j + 2 * i + 1]);
      }
    }
  }
#pragma unroll
  for (int o = 0; o < 32; ++o) {
    out[o] += __shfl_xor_sync(0xffffffffu, out[o], 8);
    out[o] += __shfl_xor_sync(0xffffffffu, out[o], 16);
  }
  __shared__ float by_warp[WARPS][OUTS];
  if (lane < 8) {
#pragma unroll
    for (int o = 0; o < 32; ++o) by_warp[warp][o * 8 + col] = out[o];
  }
  __syncthreads();
  __shared__ float sums[OUTS];
  for (int m = threadIdx.x; m < OUTS; m += blockDim.x) {
    const int at = (m & 31) * 8 + (m >> 5);
    float t = 0.f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) t += by_warp[v][at];
    sums[m] = t;
  }
  __syncthreads();
  gemv::finish<OUTS / 128, 16>(sums, OUTS, blockIdx.x * OUTS, n, y, partials, counters);
}

}  // namespace

void awq_half2_launch(torch::Tensor qweight, torch::Tensor qzeros, torch::Tensor scales,
                      torch::Tensor x, torch::Tensor y, torch::Tensor partials,
                      torch::Tensor counters, int64_t splits, int64_t xshift) {
  const int n = static_cast<int>(scales.size(1)), k = static_cast<int>(qweight.size(0));
  const dim3 grid((n + 255) / 256, splits);
  const auto stream = at::cuda::getCurrentCUDAStream();
  using B = __nv_bfloat16;
  auto* kernel = xshift ? awq_half2_gemv<B, 8> : awq_half2_gemv<B, 0>;
  kernel<<<grid, 128, 0, stream>>>(
      static_cast<const uint32_t*>(qweight.data_ptr()),
      static_cast<const uint32_t*>(qzeros.data_ptr()),
      static_cast<const __half*>(scales.data_ptr()), static_cast<const B*>(x.data_ptr()), n, k,
      static_cast<B*>(y.data_ptr()), static_cast<float*>(partials.data_ptr()),
      static_cast<int32_t*>(counters.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""
CPP = """
void awq_half2_launch(torch::Tensor qweight, torch::Tensor qzeros, torch::Tensor scales,
                      torch::Tensor x, torch::Tensor y, torch::Tensor partials,
                      torch::Tensor counters, int64_t splits, int64_t xshift);
"""


def error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def layer(ext, name: str) -> str:
    """One layer's line: each kernel's time (us) and errors (plain x, x with outliers)."""
    n, k = SHAPES[name]
    one, nbytes = weights("awq", n, k)
    copies = [one] + [weights("awq", n, k)[0] for _ in range(max(0, SPAN // nbytes - 1))]
    t = dict(qweight=one["w"], qzeros=one["zeros"], scales=one["scales"])
    dense = dequantize(QuantConfig("awq", group_size=128), t, n, k, torch.float64)
    slices = -(-n // cuda_gemv.AWQ_OUTS)
    split = cuda_gemv.num_splits(slices, k // 128, cuda_gemv.AWQ_CTAS_PER_SM *
                                 torch.cuda.get_device_properties(0).multi_processor_count)
    y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    partials, counters = split_buffers(y, split, (slices, 1, split))  # made before any capture
    plain = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    spiky = plain.clone()
    spiky[0, ::997] = 3e4

    def half2(x, a, shift):
        ext.awq_half2_launch(a["w"], a["zeros"], a["scales"], x, y, partials, counters, split,
                             shift)
        return y

    kernels = {"engine": lambda x, a: cuda_gemv.one_row(x, a),
               "half2 >>0": lambda x, a: half2(x, a, 0),
               "half2 >>8": lambda x, a: half2(x, a, 8)}
    cells = []
    for label, call in kernels.items():
        us = graph_time_us([lambda a=a, call=call: call(plain, a) for a in copies])
        errs = [error(call(x, one).clone(), x.double() @ dense.T) for x in (plain, spiky)]
        cells.append(f"{label} {us:6.1f} us, err {errs[0]:.1e} / {errs[1]:.1e}")
    return f"{name:8s} {nbytes / 1e6:6.1f} MB {slices}x{split}: " + " | ".join(cells)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    torch.manual_seed(0)
    if not cuda_gemv.load():
        sys.exit("the one-row CUDA kernels did not build here")
    ext = build("nanoserve_probe_awq_half2", CPP, CUDA, ["awq_half2_launch"])
    print(f"{torch.cuda.get_device_name()}: x bf16, scales fp16, group 128; errors against "
          "float64 over its largest output, x ~ N(0, 1) / with entries at 3e4")
    for name in args.shapes.split(","):
        print(layer(ext, name), flush=True)


if __name__ == "__main__":
    main()
