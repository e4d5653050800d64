"""What the GPU's tensor cores sustain over minutes, not a burst (issue 34's 1M TTFT).

bench_offload.py's bf16 ceiling times a few matmuls on a cool GPU at its boost clock. A 1M
prompt's prefill runs nine minutes of matmuls and attention, long enough for the board's power
cap to set the clock. This runs each kernel back to back for --seconds and prints, per window,
its TFLOP/s beside the SM clock, board power and the clock-event reasons NVML reports
(0x4: the software power cap).
Usage (GPU): python tools/probes/sustained_rate.py [--seconds 40]
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch

from nanoserve.cuda_timing import held_rate, median_ms

aten = torch.ops.aten


def gpu_state() -> str:
    q = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
    return subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()


def sustain(name: str, fn, flops: float, seconds: float, window: float = 6.0
            ) -> tuple[float, list[float]]:
    """fn's burst TFLOP/s (median_ms of a few calls on the idle GPU, as the bench's ceiling),
    then fn back to back for `seconds`: each window's TFLOP/s (the last two thirds of each,
    held_rate's), printed and returned."""
    time.sleep(5)  # the clock back up after the last kernel
    burst = flops / median_ms(fn) / 1e9
    print(f"{name:<34} {burst:6.0f} TFLOP/s burst  {gpu_state()}", flush=True)
    rates, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        rate = held_rate(fn, window) * flops / 1e12
        rates.append(rate)
        print(f"{name:<34} {rate:6.0f} TFLOP/s  {gpu_state()}", flush=True)
    return burst, rates
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=40.0)
    args = ap.parse_args()
    dev, bf = "cuda", torch.bfloat16
    n = 8192
    a, b = torch.randn(n, n, device=dev, dtype=bf), torch.randn(n, n, device=dev, dtype=bf)
    matmul = sustain("bf16 matmul 8192^3", lambda: a @ b, 2 * n**3, args.seconds)
    h, hkv, d, t, s = 32, 8, 128, 8192, 131072  # the 1M Llama shape, a chunk over a piece
    q = torch.randn(t, h, d, device=dev, dtype=bf).transpose(0, 1).unsqueeze(0)
    k = torch.randn(s, hkv, d, device=dev, dtype=bf).transpose(0, 1).unsqueeze(0)
    v = torch.randn(s, hkv, d, device=dev, dtype=bf).transpose(0, 1).unsqueeze(0)

    def attend():
        aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False,
                                                 scale=d**-0.5)
    attn = sustain("cudnn prefix attention T=8K S=128K", attend, 4 * h * d * t * s,
                   args.seconds)
    for name, (burst, r) in (("matmul", matmul), ("attention", attn)):
        print(f"{name}: burst {burst:.0f}, held: first window {r[0]:.0f}, last {r[-1]:.0f}, "
              f"median {sorted(r)[len(r) // 2]:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
