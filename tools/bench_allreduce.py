"""NCCL all-reduce between this host's GPUs, as tensor parallelism uses it: the transport NCCL
picks (run with NCCL_DEBUG=INFO and look for its "via" lines) and the time of one all-reduce
by size, eagerly and replayed from a CUDA graph. Usage (2 or more GPUs):
    NCCL_DEBUG=INFO python tools/bench_allreduce.py [--tp 2,4] [--sizes 8K,64K,512K,64M]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

UNITS = {"K": 1 << 10, "M": 1 << 20}


def parse_size(text: str) -> int:
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def timed(fn, reps: int) -> float:
    """Microseconds per call of fn (which runs `reps` all-reduces)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def worker(rank: int, size: int, port: int, sizes: list[int]) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, device_id=dev)
    for nbytes in sizes:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
        for _ in range(5):
            dist.all_reduce(x)
        eager = timed(lambda x=x: [dist.all_reduce(x) for _ in range(50)], 50)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                dist.all_reduce(x)
        graphed = timed(lambda g=graph: [g.replay() for _ in range(5)], 100)
        if rank == 0:
            bus = 2 * (size - 1) / size * nbytes / (graphed * 1e-6) / 1e9
            print(f"TP={size} {nbytes:>10,d} B: eager {eager:8.1f} us, in a graph {graphed:8.1f} "
                  f"us ({bus:6.1f} GB/s bus)", flush=True)
        del graph  # a captured collective outliving the group hangs its teardown
        torch.cuda.synchronize()
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", default="2,4")
    ap.add_argument("--sizes", default="8K,64K,512K,64M")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    for size in (int(t) for t in args.tp.split(",")):
        if size > torch.cuda.device_count():
            print(f"TP={size}: only {torch.cuda.device_count()} GPUs")
            continue
        port = 29500 + size
        mp.spawn(worker, args=(size, port, sizes), nprocs=size, join=True)


if __name__ == "__main__":
    main()
