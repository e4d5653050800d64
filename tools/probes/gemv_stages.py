"""What bounds a one-row GEMV (issue 36), by leaving its arithmetic out: for each of Qwen3-8B's
layers, the engine's CUDA GEMV (quant/cuda_gemv.py, AWQ and FP8) beside kernels that only load
what it loads, with the same grid, K split and per-thread loads (weights, x, AWQ's zeros and
scales, FP8's block scales) and its split ending (gemv_split.cuh), but no sums; and beside a
kernel that reads the weight with the same grid, each CTA's share as one contiguous run (the
pattern a repacked weight would allow; no x, no ending). The GEMV far above its own loads: its
arithmetic is not hidden behind them (the loads kernel, at fewer registers, may keep more loads
in flight than the GEMV: a part of the gap). Its loads far above the contiguous run: the
pattern costs. In CUDA graphs, cycling over enough copies of the weight that none stays in L2.
Usage (GPU):
    python tools/probes/gemv_stages.py [--formats awq,fp8] [--shapes qkv,o,gate_up,down]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tools/: bench_quant's shapes and timing
from bench_quant import SHAPES, SPAN, copy_rate_gbs, graph_time_us, weights  # noqa: E402
from gemv_build import build  # noqa: E402  (tools/probes/)

from nanoserve.quant import cuda_gemv  # noqa: E402
from nanoserve.quant.triton_gemm import split_buffers  # noqa: E402

CUDA = r"""
namespace {

using one_row::load_stream;

__device__ __forceinline__ uint32_t fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// awq_gemv.cu's loads with no arithmetic (group 128): a CTA 256 outputs (128 bytes a row), 16
// rows a step, a group's 8 steps and their x loaded together, then its zeros (16 bytes) and
// scales (64 bytes) a thread; its split ending as the GEMV's (gemv_split.cuh), of sums that are
// zero unless the loads' bits happen to fold to a constant (which keeps the loads). MODE's bits:
// 1 x loaded, 2 zeros and scales loaded (3: all the GEMV loads)
template <int MODE>
__global__ void __launch_bounds__(128, 4) awq_read(const uint32_t* qweight, const uint32_t* qzeros,
                                                   const uint16_t* scales, const uint16_t* x,
                                                   int n, int k, __nv_bfloat16* y,
                                                   float* partials, int32_t* counters) {
  constexpr int GROUP = 128, STEPS = 8, SLOTS = 16, OUTS = 256;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slot = warp * 4 + (lane >> 3), col = lane & 7;
  const int words = n / 8, word0 = blockIdx.x * 32 + col * 4;
  const bool live = word0 < words;
  const int groups = k / GROUP;
  const int g_begin = blockIdx.y * groups / gridDim.y;
  const int g_end = (blockIdx.y + 1) * groups / gridDim.y;
  uint32_t acc = 0;
  for (int g = g_begin; live && g < g_end; ++g) {
    uint4 q[STEPS];
    uint32_t xv[STEPS];
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      const int row = g * GROUP + s * SLOTS + slot;
      q[s] = load_stream(qweight + static_cast<size_t>(row) * words + word0);
      xv[s] = MODE & 1 ? x[row] : 0;
    }
#pragma unroll
    for (int s = 0; s < STEPS; ++s) acc ^= fold(q[s]) ^ xv[s];
    if (!(MODE & 2)) continue;
    acc ^= fold(*reinterpret_cast<const uint4*>(qzeros + static_cast<size_t>(g) * words + word0));
    const uint4* sp = reinterpret_cast<const uint4*>(scales + static_cast<size_t>(g) * n +
                                                     word0 * 8);
#pragma unroll
    for (int j = 0; j < 4; ++j) acc ^= fold(sp[j]);
  }
  __shared__ float sums[OUTS];
  for (int m = threadIdx.x; m < OUTS; m += blockDim.x) sums[m] = 0.f;
  __syncthreads();
  if (acc == 0x9E3779B9u) sums[threadIdx.x] = 1.f;
  __syncthreads();
  gemv::finish<OUTS / 128, 16>(sums, OUTS, blockIdx.x * OUTS, n, y, partials, counters);
}

// plain_gemv.cu's loads with no arithmetic (128 x 128 scale blocks): a CTA 32 outputs, a warp 8
// rows; at each 512-input chunk a lane loads its 16 bytes of each row, its 16 inputs of x (32
// bytes) and each row's block scale; its split ending as the GEMV's. MODE's bits: 1 x loaded, 2
// scales loaded (3: all the GEMV loads)
template <int MODE>
__global__ void __launch_bounds__(128, 6) fp8_read(const uint8_t* w, const float* scales,
                                                   int stride_s, const uint16_t* x, int n, int k,
                                                   __nv_bfloat16* y, float* partials,
                                                   int32_t* counters) {
  constexpr int STEP = 128, ROWS = 8, OUTS = 32, CHUNK = 512;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = blockIdx.x * OUTS + warp * ROWS;
  const int steps = k / STEP;
  const int s_begin = blockIdx.y * steps / gridDim.y;
  const int run = ((blockIdx.y + 1) * steps / gridDim.y - s_begin) * STEP;
  const int k_begin = s_begin * STEP;
  const int live_rows = min(ROWS, n - n0);
  const uint8_t* at = w + static_cast<size_t>(n0) * k + k_begin + lane * 16;
  const uint16_t* xa = x + k_begin + lane * 16;
  uint32_t acc = 0;
  for (int k0 = 0; k0 + lane * 16 < run; k0 += CHUNK) {
    uint4 q[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      q[r] = r < live_rows ? load_stream(at + static_cast<size_t>(r) * k + k0)
                           : make_uint4(0, 0, 0, 0);
    if (MODE & 1) {
      const uint4* xp = reinterpret_cast<const uint4*>(xa + k0);
      acc ^= fold(xp[0]) ^ fold(xp[1]);
    }
    const int block = s_begin + (k0 + lane * 16) / STEP;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      acc ^= fold(q[r]);
      if (MODE & 2 && r < live_rows)
        acc ^= __float_as_uint(scales[static_cast<size_t>((n0 + r) / 128) * stride_s + block]);
    }
  }
  __shared__ float sums[OUTS];
  for (int m = threadIdx.x; m < OUTS; m += blockDim.x) sums[m] = 0.f;
  __syncthreads();
  if (acc == 0x9E3779B9u) sums[threadIdx.x % OUTS] = 1.f;
  __syncthreads();
  gemv::finish<1, 8>(sums, OUTS, blockIdx.x * OUTS, n, y, partials, counters);
}

// each CTA of a grid reads `per_cta` bytes (a multiple of 2 KB) as one contiguous run, 8 loads
// of 16 bytes a thread in flight at once; no ending
template <int CTAS_PER_SM>
__global__ void __launch_bounds__(128, CTAS_PER_SM) contiguous_read(const uint8_t* base,
                                                                   int64_t per_cta,
                                                                   uint32_t* sink) {
  const size_t cta = static_cast<size_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  const uint8_t* at = base + cta * per_cta + threadIdx.x * 16;
  uint32_t acc = 0;
  for (int64_t off = 0; off < per_cta; off += 8 * 2048) {
    uint4 q[8];
#pragma unroll
    for (int s = 0; s < 8; ++s)
      q[s] = off + s * 2048 < per_cta ? load_stream(at + off + s * 2048) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int s = 0; s < 8; ++s) acc ^= fold(q[s]);
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;
}

}  // namespace

// the split's parts and counters are the engine's (quant/triton_gemm.split_buffers)
void awq_read_launch(torch::Tensor qweight, torch::Tensor qzeros, torch::Tensor scales,
                     torch::Tensor x, torch::Tensor y, torch::Tensor partials,
                     torch::Tensor counters, int64_t splits, int64_t mode) {
  const int n = static_cast<int>(scales.size(1)), k = static_cast<int>(qweight.size(0));
  auto* kernel = mode == 0 ? awq_read<0> : mode == 1 ? awq_read<1> : mode == 2 ? awq_read<2>
                                                                                : awq_read<3>;
  kernel<<<dim3((n + 255) / 256, splits), 128, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint32_t*>(qweight.data_ptr()),
      static_cast<const uint32_t*>(qzeros.data_ptr()),
      static_cast<const uint16_t*>(scales.data_ptr()),
      static_cast<const uint16_t*>(x.data_ptr()), n, k,
      static_cast<__nv_bfloat16*>(y.data_ptr()), static_cast<float*>(partials.data_ptr()),
      static_cast<int32_t*>(counters.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void fp8_read_launch(torch::Tensor w, torch::Tensor scales, torch::Tensor x, torch::Tensor y,
                     torch::Tensor partials, torch::Tensor counters, int64_t splits,
                     int64_t mode) {
  const int n = static_cast<int>(w.size(0)), k = static_cast<int>(w.size(1));
  auto* kernel = mode == 0 ? fp8_read<0> : mode == 1 ? fp8_read<1> : mode == 2 ? fp8_read<2>
                                                                              : fp8_read<3>;
  kernel<<<dim3((n + 31) / 32, splits), 128, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint8_t*>(w.data_ptr()), static_cast<const float*>(scales.data_ptr()),
      static_cast<int>(scales.stride(0)), static_cast<const uint16_t*>(x.data_ptr()), n, k,
      static_cast<__nv_bfloat16*>(y.data_ptr()), static_cast<float*>(partials.data_ptr()),
      static_cast<int32_t*>(counters.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void contiguous_read_launch(torch::Tensor base, int64_t ctas_x, int64_t ctas_y, int64_t per_cta,
                            int64_t ctas_per_sm, torch::Tensor sink) {
  TORCH_CHECK(ctas_x * ctas_y * per_cta <= base.numel() * base.element_size(), "past the end");
  const dim3 grid(ctas_x, ctas_y);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto* p = static_cast<const uint8_t*>(base.data_ptr());
  auto* s = static_cast<uint32_t*>(sink.data_ptr());
  if (ctas_per_sm >= 6)
    contiguous_read<6><<<grid, 128, 0, stream>>>(p, per_cta, s);
  else
    contiguous_read<4><<<grid, 128, 0, stream>>>(p, per_cta, s);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""
CPP = """
void awq_read_launch(torch::Tensor qweight, torch::Tensor qzeros, torch::Tensor scales,
                     torch::Tensor x, torch::Tensor y, torch::Tensor partials,
                     torch::Tensor counters, int64_t splits, int64_t mode);
void fp8_read_launch(torch::Tensor w, torch::Tensor scales, torch::Tensor x, torch::Tensor y,
                     torch::Tensor partials, torch::Tensor counters, int64_t splits,
                     int64_t mode);
void contiguous_read_launch(torch::Tensor base, int64_t ctas_x, int64_t ctas_y, int64_t per_cta,
                            int64_t ctas_per_sm, torch::Tensor sink);
"""


def splits_of(fmt: str, n: int, k: int) -> tuple[int, int, int]:
    """The engine's grid for this weight: (slices, K splits, CTAs an SM aimed at)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if fmt == "awq":
        slices, units, per_sm = -(-n // cuda_gemv.AWQ_OUTS), k // 128, cuda_gemv.AWQ_CTAS_PER_SM
        least = 1
    else:
        slices, units, per_sm = -(-n // cuda_gemv.PLAIN_OUTS), k // cuda_gemv.PLAIN_STEP, \
            cuda_gemv.PLAIN_CTAS_PER_SM
        least = cuda_gemv.FP8_MIN_STEPS
    return slices, cuda_gemv.num_splits(slices, units, per_sm * sms, least), per_sm


def time_layer(ext, fmt: str, name: str, rate: float, sink: torch.Tensor) -> str:
    """One layer's line: its floor, the GEMV, its reads alone (all, the weight's only, the
    weight's and x's), the contiguous reads (us)."""
    n, k = SHAPES[name]
    one, nbytes = weights(fmt, n, k)
    copies = [one] + [weights(fmt, n, k)[0] for _ in range(max(0, SPAN // nbytes - 1))]
    slices, split, per_sm = splits_of(fmt, n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    if cuda_gemv.one_row(x, one) is None:
        return f"{fmt} {name}: not taken by the CUDA kernels"
    gemv = graph_time_us([partial(cuda_gemv.one_row, x, a) for a in copies])
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    partials, counters = split_buffers(y, split, (slices, 1, split))  # made before any capture
    def reads(mode: int) -> float:
        if fmt == "awq":
            return graph_time_us([partial(ext.awq_read_launch, a["w"], a["zeros"], a["scales"],
                                          x, y, partials, counters, split, mode)
                                  for a in copies])
        return graph_time_us([partial(ext.fp8_read_launch, a["w"], a["scales"], x, y, partials,
                                      counters, split, mode) for a in copies])
    own = [reads(mode) for mode in (0, 1, 3)]
    wbytes = one["w"].numel() * one["w"].element_size()
    per_cta = wbytes // (slices * split) // 2048 * 2048
    contiguous = graph_time_us([partial(ext.contiguous_read_launch, a["w"], slices, split,
                                        per_cta, per_sm, sink) for a in copies])
    floor = nbytes / rate / 1e3
    return (f"{fmt:6s} {name:8s} {nbytes / 1e6:7.1f} {slices:5d}x{split:<3d} {floor:9.1f} "
            f"{gemv:9.1f} {own[2]:11.1f} {own[0]:8.1f} {own[1]:8.1f} {contiguous:12.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="awq,fp8")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    torch.manual_seed(0)
    if not cuda_gemv.load():
        sys.exit("the one-row CUDA kernels did not build here")
    ext = build("nanoserve_probe_gemv_stages", CPP, CUDA,
                ["awq_read_launch", "fp8_read_launch", "contiguous_read_launch"])
    rate = copy_rate_gbs()
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"{torch.cuda.get_device_name()}: copy rate {rate:.0f} GB/s (warmed)")
    print("format layer         MB  grid        floor us   GEMV us   its reads   w only      +x"
          "   contiguous")
    for fmt in args.formats.split(","):
        for name in args.shapes.split(","):
            print(time_layer(ext, fmt, name, rate, sink), flush=True)


if __name__ == "__main__":
    main()
