"""GPU time of a piece of work, for the benchmarks and tools: CUDA events around each repeat,
after a warm-up, and the median (the GPU machines are shared and noisy)."""

from __future__ import annotations

import statistics
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
