"""Host->device copy bandwidth alone and while the GPU's memory is busy, as offloaded decode
has it: a layer's KV arrives over PCIe while the previous layers' weight GEMVs read device
memory at full rate. Usage (GPU):
    python tools/bench_h2d_contention.py [--copy-mb 8,256] [--gemv 4096x12288]

Rows: pinned host -> device copies of each size back to back on a copy stream, (a) alone,
(b) while another stream runs one-row matmuls (decode's GEMVs) back to back, (c) while another
stream copies device memory to device memory. Bandwidth is bytes over the copies' own time.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from nanoserve.cuda_timing import median_ms


def copies_gbs(host: torch.Tensor, dev: torch.Tensor, reps: int, stream: torch.cuda.Stream,
               background=None, background_reps: int = 0) -> float:
    """GB/s of `reps` back-to-back copies host -> dev on `stream`, with `background_reps`
    calls of `background()` queued first on another stream (enough to outlast the copies)."""
    side = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    done = torch.cuda.Event()
    torch.cuda.synchronize()
    if background is not None:
        with torch.cuda.stream(side):
            for _ in range(background_reps):
                background()
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(reps):
            dev.copy_(host, non_blocking=True)
        end.record()
        done.record()
    done.synchronize()
    ms = start.elapsed_time(end)
    torch.cuda.synchronize()
    return reps * host.numel() / ms / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copy-mb", default="8,256")
    ap.add_argument("--gemv", default="4096x12288", help="the background one-row matmul's "
                    "weight, NxK (default: Qwen3-8B's down projection)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_h2d_contention.py measures a GPU: it needs CUDA")
    n, k = (int(v) for v in args.gemv.split("x"))
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    big2 = torch.empty_like(big)
    stream = torch.cuda.Stream()
    backgrounds = {"alone": None, "beside GEMVs": lambda: F.linear(x, w),
                   "beside device copies": lambda: big2.copy_(big)}
    for mb in (int(v) for v in args.copy_mb.split(",")):
        host = torch.empty(mb << 20, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(mb << 20, dtype=torch.uint8, device="cuda")
        reps = max(8, 2048 // mb)
        copies_gbs(host, dev, 2, stream)  # warm-up
        alone = sorted(copies_gbs(host, dev, reps, stream) for _ in range(3))[1]
        copies_ms = reps * host.numel() / alone / 1e6
        row = {"alone": alone}
        for name, bg in backgrounds.items():
            if bg is not None:
                bg_reps = int(2 * copies_ms / median_ms(bg)) + 1  # twice the copies' time
                row[name] = sorted(copies_gbs(host, dev, reps, stream, bg, bg_reps)
                                   for _ in range(3))[1]
        print(f"{mb:4d} MB copies: " + ", ".join(
            f"{name} {gbs:.1f} GB/s ({gbs / alone:.3f}x)" for name, gbs in row.items()),
            flush=True)


if __name__ == "__main__":
    main()
