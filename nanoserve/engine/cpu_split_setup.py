"""Start-up of CPU attention beside the link (attention/cpu_share.py): the share's buffers and
kernel, and the split (offload/cpu_split.py), fixed by the user or from rates measured on this
host: the CPU kernel over one streamed layer's host pages, the link loading the same pages,
each alone and both at once (they read the same host memory), and what the CPU's share waits
on per layer besides its own work."""

from __future__ import annotations

import logging
import os
import statistics
import time

import torch

from nanoserve.attention.cpu_decode import cpu_decode_kernel
from nanoserve.attention.cpu_share import CpuShare
from nanoserve.distributed.parallel_state import tp_size
from nanoserve.kv.manager import KVManager
from offload import CpuSplit

log = logging.getLogger("nanoserve")

PROBE_TOKENS = 32768  # host KV the rates are measured over (fewer where the store is smaller)


def build_cpu_share(setting: str, fixed: float | None, kv: KVManager, num_heads: int,
                    head_dim: int, scale: float, max_rows: int, can_merge: bool = True
                    ) -> tuple[CpuShare | None, CpuSplit | None]:
    """The share and split for the `cpu_attention` setting (off, auto, a fraction); None,
    None when it is off or nothing streams, and for `auto` where a share cannot help: on a
    CPU device (no link to beside) or with a backend that cannot merge one (can_merge)."""
    if setting == "off" or kv.streamer is None:
        return None, None
    if setting == "auto" and (kv.device.type != "cuda" or not can_merge):
        return None, None
    device = kv.device
    if device.type == "cuda" and tp_size() > 1:  # the ranks share this host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // tp_size()))
    _, kernel = cpu_decode_kernel("auto")
    share = CpuShare(kv.streamer.host.data, kv.spec.layout, kernel, max_rows, num_heads,
                     head_dim, scale, device)
    if device.type == "cuda":  # the rates, also for a fixed fraction: reported beside it
        measured = measure_split(share, kv)
        share.threads = torch.get_num_threads()  # the probe's choice
        if not share.start_worker():
            log.warning("CPU attention: the engine's thread runs the CPU's share (no C++ "
                        "kernel here): slower than a thread of its own")
        if fixed is None:
            return share, measured
    return share, CpuSplit(fixed=fixed)


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_split(share: CpuShare, kv: KVManager) -> CpuSplit:
    """Rates on this host, over the first pages of the first streamed layer (zeroed first:
    uninitialized pinned memory may hold denormals, which slow the CPU)."""
    streamer, layout = kv.streamer, kv.spec.layout
    pages = max(1, min(streamer.host.num_pages, PROBE_TOKENS // layout.page_size))
    host = streamer.host.data[0]
    host[:, :pages].zero_()
    nbytes = 2 * pages * layout.row_bytes
    table = torch.arange(pages, dtype=torch.int32)[None]
    zero = torch.zeros(1, dtype=torch.int32)
    rows = share.q[:1], share.o[:1], share.lse[:1]

    def cpu(num_pages: int = pages) -> None:
        share.kernel(rows[0], host, layout, table, zero,
                     torch.tensor([num_pages * layout.page_size], dtype=torch.int32),
                     share.scale, out=rows[1:])

    slot = streamer.slots[0]

    def link_async(times: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        with streamer.on_copy_stream():
            start.record()
            for _ in range(times):
                streamer.host.load(0, [(0, pages)], slot)
            end.record()
        return start, end

    cpu()  # warm: threads, page faults
    # torch's thread count is the physical cores; the kernel waits on memory, where the
    # logical cores' second threads may help; one fewer leaves a core to the host thread's
    # other work and the CUDA driver's. The fastest is kept
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1
    physical = torch.get_num_threads()
    counts = sorted({physical, max(1, physical - 1), max(1, logical // max(1, tp_size()))})
    by_threads = {}
    for n in counts:
        torch.set_num_threads(n)
        cpu()
        by_threads[n] = nbytes / _median_time(cpu, 5)
    threads = max(by_threads, key=by_threads.get)
    if os.environ.get("NANOSERVE_CPU_ATTENTION_THREADS"):  # the user's choice over the probe's
        threads = int(os.environ["NANOSERVE_CPU_ATTENTION_THREADS"])
        torch.set_num_threads(threads)
        by_threads[threads] = nbytes / _median_time(cpu, 5)
    torch.set_num_threads(threads)
    cpu_alone = by_threads[threads]
    start, end = link_async(5)
    end.synchronize()
    link_alone = 5 * nbytes / (start.elapsed_time(end) / 1e3)
    # both at once: the link busy for about 10 CPU calls' time, the CPU calling until it is done
    copies = max(2, round(10 * link_alone / cpu_alone))
    start, end = link_async(copies)
    calls, t0 = 0, time.perf_counter()
    while not end.query() or calls == 0:
        cpu()
        calls += 1
    cpu_both = calls * nbytes / (time.perf_counter() - t0)
    end.synchronize()
    link_both = copies * nbytes / (start.elapsed_time(end) / 1e3)
    # per layer besides the CPU's work: the host's wait on an event and a one-page call
    event = torch.cuda.Event()

    def round_trip() -> None:
        event.record()
        event.synchronize()
        cpu(1)
    overhead = _median_time(round_trip, 21)
    # the probe's calls wrote row 0's partial: an inactive step uploads these buffers as
    # they are, so they go back to nothing (zeros, LSE -inf) before any step
    share.q.zero_()
    share.o.zero_()
    share.lse.fill_(-torch.inf)
    share.cleared = True
    # classified by the link's rate beside the CPU, planned at the rate steps reach
    split = CpuSplit(cpu_rate=cpu_both, link_rate=link_both, link_alone=link_alone,
                     overhead=overhead)
    share.probe = {"pages": pages, "threads": threads,
                   "threads_tried_GBps": {n: r / 1e9 for n, r in by_threads.items()},
                   "cpu_alone_GBps": cpu_alone / 1e9, "cpu_both_GBps": cpu_both / 1e9,
                   "link_alone_GBps": link_alone / 1e9, "link_both_GBps": link_both / 1e9,
                   "overhead_us": overhead * 1e6}
    log.info("CPU attention probe over %d pages: CPU %.1f GB/s alone (%d threads; %s), %.1f "
             "with the link busy; link %.1f GB/s alone, %.1f with the CPU busy; %.0f us per "
             "layer besides", pages, cpu_alone / 1e9, threads,
             ", ".join(f"{n}: {r / 1e9:.1f}" for n, r in by_threads.items()),
             cpu_both / 1e9, link_alone / 1e9, link_both / 1e9, overhead * 1e6)
    return split
