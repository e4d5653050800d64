"""GPU time of a piece of work, for the benchmarks and tools: CUDA events around each repeat,
after a warm-up, and the median (the GPU machines are shared and noisy)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], reps: int = 10, warmup: int = 1) -> float:
    """Median milliseconds of `fn()` on the current stream over `reps` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_median_ms(fn: Callable[[], object], reps: int = 10) -> float:
    """median_ms of one replay of a CUDA graph of `fn()`, run once eagerly first (compilation
    and workspaces outside the capture)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, reps=reps)


def held_rate(fn: Callable[[], object], seconds: float = 3.0) -> float:
    """Calls of `fn` a second, back to back, over the last two thirds of `seconds`: the rate
    the GPU holds once its power limit sets the clock, where median_ms times a burst at the
    boost clock (an H100's bf16 matmul: 786 TFLOP/s in a burst, 660 held at 1,320 MHz and
    690 W; tools/probes/sustained_rate.py)."""
    def run_for(s: float) -> tuple[int, float]:
        torch.cuda.synchronize()
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < s:
            for _ in range(4):
                fn()
            n += 4
            torch.cuda.synchronize()
        return n, time.perf_counter() - t0

    run_for(seconds / 3)
    n, elapsed = run_for(2 * seconds / 3)
    return n / elapsed
