"""The CPU kernel under the conditions of the offloaded run, one at a time: calls back to back
against calls with the GPU's per-layer gap between them, alone against beside a link busy with
host-to-device copies, for a range of thread counts. Says whether the kernel's slower rate in
the run comes from the gaps (threads waking) or from the link's traffic in the host's memory.

    python tools/probes/cpu_share_conditions.py [--tokens 10240] [--gap-us 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch
from cpu_attention_rate import layer  # noqa: E402  (run from tools/probes or with it on the path)

from nanoserve.attention.cpu_decode import decode_cpp
from nanoserve.kv.fp8_format import FP8


class BusyLink:
    """Host-to-device copies of a pinned buffer, back to back, on a thread of their own."""

    def __init__(self, nbytes: int = 1 << 30) -> None:
        self.src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.stop = threading.Event()
        self.moved = 0
        self.seconds = 0.0

    def run(self) -> None:
        t = time.perf_counter()
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                self.dst.copy_(self.src, non_blocking=True)
                self.stream.synchronize()
                self.moved += self.src.numel()
        self.seconds = time.perf_counter() - t

    def __enter__(self) -> BusyLink:
        self.thread = threading.Thread(target=self.run)
        self.thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def timed_calls(call, gap_s: float, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < gap_s:
            pass
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times[n // 5:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=10240, help="tokens per call (per layer)")
    ap.add_argument("--gap-us", type=float, default=200.0)
    ap.add_argument("--threads", default="")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--layers", type=int, default=8,
                    help="distinct layers read in turn (8: beyond the last-level cache)")
    ap.add_argument("--no-link", action="store_true", help="no copies beside the kernel")
    args = ap.parse_args()
    logical = os.cpu_count() or 1
    threads = ([int(t) for t in args.threads.split(",")] if args.threads
               else sorted({t for t in (logical, logical - 1, logical - 2, logical // 2) if t > 0}))
    q = torch.randn(1, 32, 128)
    o, lse = torch.empty(1, 32, 128), torch.empty(1, 32)
    table = torch.arange(args.tokens // 256, dtype=torch.int32)[None]
    st, en = torch.zeros(1, dtype=torch.int32), torch.tensor([args.tokens], dtype=torch.int32)
    cuda = torch.cuda.is_available() and not args.no_link
    for dtype in (torch.bfloat16, FP8):
        layers = [layer(dtype, args.tokens) for _ in range(args.layers)]
        nbytes = layers[0][1].numel() * layers[0][1].element_size()
        for n in threads:
            torch.set_num_threads(n)
            turn = iter(range(1 << 30))

            def call(turn=turn, layers=layers) -> None:
                spec, rows = layers[next(turn) % len(layers)]
                decode_cpp(q, rows, spec.layout, table, st, en, 0.088, out=(o, lse))

            row = []
            for busy in ((False, True) if cuda else (False,)):
                for gap in (0.0, args.gap_us * 1e-6):
                    if busy:
                        with BusyLink() as link:
                            t = timed_calls(call, gap, args.calls)
                        extra = f" link {link.moved / link.seconds / 1e9:.1f} GB/s"
                    else:
                        t, extra = timed_calls(call, gap, args.calls), ""
                    row.append(f"{'link' if busy else 'alone'} gap {gap * 1e6:.0f}us: "
                               f"{t * 1e6:.0f} us {nbytes / t / 1e9:.1f} GB/s{extra}")
            print(f"{str(dtype):>20} {nbytes / 1e6:.1f} MB threads {n:>2} | " + " | ".join(row),
                  flush=True)


if __name__ == "__main__":
    main()
