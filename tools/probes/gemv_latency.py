"""Where a one-row quantized GEMV's time goes (issue 36): each kernel's device time under
torch.profiler (eager, weights cycled past L2), for the engine's FP8 and AWQ paths at Qwen3-8B's
o and qkv shapes, beside a plain read of the same bytes at the same grid and a CUDA-core FP8
GEMV whose program reads its whole share of K in few, wide steps. Usage (GPU):
    python tools/probes/gemv_latency.py
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from nanoserve.quant import triton_gemm as tg

sys.path.insert(0, str(Path(__file__).parents[1]))  # tools/: bench_quant's weights and rate


@triton.jit
def _read_kernel(W, Out, N, K, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    # reads the bytes a GEMV program reads (as int8), keeps a sum so they are not elided
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * (K // SPLIT_K)
    at = W + offs_n[:, None].to(tl.int64) * K + k_start + tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.int32)
    for _ in range(0, K // SPLIT_K, BLOCK_K):
        acc += tl.load(at).to(tl.int32)
        at += BLOCK_K
    tl.atomic_add(Out + offs_n, tl.sum(acc, axis=1), sem="relaxed")


@triton.jit
def _fp8_fma_kernel(X, W, Scales, Y, N, K, stride_s, SPLIT_K: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # one row; 128 x 128 scale blocks; CUDA cores: acc[n, k] += w * x, scaled per block
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * (K // SPLIT_K)
    offs_k = tl.arange(0, BLOCK_K)
    at = W + offs_n[:, None].to(tl.int64) * K + k_start + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K // 128], tl.float32)
    for k0 in range(k_start, k_start + K // SPLIT_K, BLOCK_K):
        w = tl.load(at).to(tl.float32)
        x = tl.load(X + k0 + offs_k).to(tl.float32)
        part = tl.sum(tl.reshape(w * x[None, :], [BLOCK_N, BLOCK_K // 128, 128]), axis=2)
        s = tl.load(Scales + (offs_n // 128)[:, None] * stride_s + k0 // 128 +
                    tl.arange(0, BLOCK_K // 128)[None, :])
        acc += part * s
        at += BLOCK_K
    tl.atomic_add(Y + offs_n, tl.sum(acc, axis=1), sem="relaxed")


def profile(name: str, calls: list, reps: int = 20) -> None:
    for c in calls[:3]:
        c()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for c in calls:
                c()
        torch.cuda.synchronize()
    times = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:60]].append(e.device_time)
    parts = "; ".join(f"{k} {sum(v) / len(v):.1f} us x{len(v) // (reps * len(calls))}"
                      for k, v in times.items())
    print(f"{name}: {parts}", flush=True)


def main() -> None:
    from bench_quant import copy_rate_gbs
    rate = copy_rate_gbs()
    print(f"{torch.cuda.get_device_name()}: copy rate {rate:.0f} GB/s", flush=True)
    for name, (n, k) in (("o", (4096, 4096)), ("qkv", (6144, 4096)), ("down", (4096, 12288))):
        print(f"--- {name} {n} x {k}: FP8 floor {n * k / rate / 1e3:.1f} us", flush=True)
        probe_shape(n, k)


def probe_shape(n: int, k: int) -> None:
    from bench_quant import weights
    copies = [weights("fp8", n, k)[0] for _ in range(20)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    profile("engine FP8 (its default at one row)", [lambda a=a: tg.quant_gemm(x, n=n, **a)
                                                  for a in copies])
    out = torch.zeros(n, dtype=torch.int32, device="cuda")
    for split, bn, bk in ((4, 32, 128), (4, 64, 128), (8, 32, 128), (1, 32, 512),
                          (4, 32, 512), (8, 32, 512), (4, 16, 1024), (8, 16, 512)):
        if (k // split) % bk:
            continue
        profile(f"read {split=} {bn=} {bk=}", [
            lambda a=a, s=split, bn=bn, bk=bk: _read_kernel[(n // bn, s)](
                a["w"].view(torch.int8), out, n, k, SPLIT_K=s, BLOCK_N=bn, BLOCK_K=bk)
            for a in copies])
    y = torch.zeros(n, dtype=torch.float32, device="cuda")
    for split, bn, bk, warps in ((4, 32, 128, 4), (4, 32, 512, 4), (8, 32, 512, 4),
                                 (4, 16, 1024, 4), (8, 16, 512, 4), (4, 64, 256, 8),
                                 (2, 32, 1024, 8)):
        if (k // split) % bk:
            continue
        profile(f"fma {split=} {bn=} {bk=} {warps=}", [
            lambda a=a, s=split, bn=bn, bk=bk, nw=warps: _fp8_fma_kernel[(n // bn, s)](
                x, a["w"], a["scales"], y, n, k, a["scales"].stride(0), SPLIT_K=s,
                BLOCK_N=bn, BLOCK_K=bk, num_warps=nw) for a in copies])
    y.zero_()
    a = copies[0]
    _fp8_fma_kernel[(n // 32, 4)](x, a["w"], a["scales"], y, n, k, a["scales"].stride(0),
                                  SPLIT_K=4, BLOCK_N=32, BLOCK_K=512)
    ref = tg.quant_gemm(x, n=n, **a).float()[0]
    print(f"fma vs engine: {((y - ref).abs().max() / ref.abs().max()).item():.2e}")
    awq = [weights("awq", n, k)[0] for _ in range(20)]
    profile("engine AWQ GEMV (split 8)", [lambda a=a: tg.quant_gemm(x, n=n, **a)
                                          for a in awq])


if __name__ == "__main__":
    main()
