"""Host->device copy bandwidth alone and while the GPU's memory is busy, as offloaded decode
has it: a layer's KV arrives over PCIe while the previous layers' weight GEMVs read device
memory at full rate. Usage (GPU):
    python tools/bench_h2d_contention.py [--copy-mb 8,256] [--gemv 4096x12288]

Rows: pinned host -> device copies of each size back to back on a copy stream, (a) alone,
(b) while another stream runs one-row matmuls (decode's GEMVs) back to back, (c) while another
stream copies device memory to device memory. Bandwidth is bytes over the copies' own time.

--layer-loads: offloaded decode's own pattern, a store of 36 layers' K and V (4K tokens of an
8-kv-head, d=128, bf16 layer: 8 MiB each) loaded layer after layer into two ring slots, as one
copy per K and V or one per layer, from pinned memory (cudaHostAlloc) or from transparent huge
pages registered with CUDA, against the same layer over and over.
"""

from __future__ import annotations

import argparse
import mmap

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


def huge_page_pinned(nbytes: int) -> torch.Tensor:
    """nbytes of host memory on transparent huge pages (where the kernel grants them), pinned by
    cudaHostRegister."""
    m = mmap.mmap(-1, nbytes + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    off = -t.data_ptr() % (2 << 20)
    t = t[off:off + nbytes]
    t.fill_(0)
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    assert int(err) == 0, f"cudaHostRegister failed: {err}"
    return t  # holds the mapping (torch.frombuffer keeps its buffer alive)


def layer_loads(layers: int = 36, mb: int = 8, reps: int = 3) -> None:
    stream = torch.cuda.Stream()
    nbytes = layers * 2 * (mb << 20)
    slots = torch.empty(2, 2 * (mb << 20), dtype=torch.uint8, device="cuda")
    def huge_kib() -> str:
        with open("/proc/meminfo") as f:
            return next(line.split()[1] for line in f if line.startswith("AnonHugePages"))

    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        print(f"AnonHugePages before: {huge_kib()} kB; THP {f.read().strip()}")
    stores = {"pinned": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
              "huge pages": huge_page_pinned(nbytes)}
    print(f"AnonHugePages after: {huge_kib()} kB")
    for name, store in stores.items():
        view = store.view(layers, 2, mb << 20)
        for pattern in ("K, V copies", "one copy", "K, V copies, layer 0 only"):
            def cycle(view=view, pattern=pattern):
                for j in range(layers):
                    src = view[0 if "only" in pattern else j]
                    dst = slots[j % 2]
                    if pattern == "one copy":
                        dst.copy_(src.view(-1), non_blocking=True)
                    else:
                        dst[: mb << 20].copy_(src[0], non_blocking=True)
                        dst[mb << 20:].copy_(src[1], non_blocking=True)
            with torch.cuda.stream(stream):  # median_ms times on the current stream
                ms = median_ms(cycle, reps=reps)
            print(f"  {name:<10} {pattern:<26}: {nbytes / ms / 1e6:.1f} GB/s "
                  f"({ms / layers * 1e3:.0f} us a layer)", flush=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(stores["huge pages"].data_ptr())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copy-mb", default="8,256")
    ap.add_argument("--gemv", default="4096x12288", help="the background one-row matmul's "
                    "weight, NxK (default: Qwen3-8B's down projection)")
    ap.add_argument("--layer-loads", action="store_true",
                    help="only offloaded decode's load pattern (see the module's docstring)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_h2d_contention.py measures a GPU: it needs CUDA")
    if args.layer_loads:
        layer_loads()
        return
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
