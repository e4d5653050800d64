"""The quantized GEMM (nanoserve/quant/triton_gemm.py; one row also through the CUDA kernels,
quant/cuda_gemv.py) per weight shape, format and row count,
against the device-memory floor of its bytes (decode) and against cuBLAS on the same product in
bf16 (prefill), with tile candidates; in CUDA graphs, cycling over enough copies of the weight
that none stays in L2. Usage (GPU):
    python tools/bench_quant.py [--rows 1,16,64,4096] [--formats fp8,awq,gptq] [--tune]
        [--splits 1,2,4,8,16,32]
Shapes are Qwen3-8B's: qkv, o, gate_up, down; FP8 from CUBLAS_ROWS rows through cuBLAS too. The
device-memory rate is a copy's, measured here.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
import torch.nn.functional as F

from nanoserve.quant import cuda_gemv
from nanoserve.quant import triton_gemm as tg

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288)}
SPAN = 512 << 20  # bytes of weight copies a timing cycles over (several times L2)


def graph_time_us(calls: list, reps: int = 5) -> float:
    """Median over reps of one replay of a graph of `calls`, per call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times)


def copy_rate_gbs(warm_s: float = 0.5) -> float:
    """The device's memory rate: a 1 GiB copy's bytes read and written over its time, after
    warm_s seconds of copies. Timed at once, as the process's first GPU work, it gave 2.4 TB/s
    on an H100 and 2.75 on an H200 where bench_offload.py's ceilings (measured after loading a
    model) gave 2.95 and 4.2 (session 28): the clocks still coming up from idle, presumably."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    end = time.perf_counter() + warm_s
    while time.perf_counter() < end:
        b.copy_(a)
        torch.cuda.synchronize()
    return 2 * a.numel() / graph_time_us([lambda: b.copy_(a)] * 4) / 1e3


def weights(fmt: str, n: int, k: int) -> tuple[dict, int]:
    """One weight's kernel arguments in a format (random values), and its bytes."""
    dev = "cuda"
    if fmt == "fp8":
        w = (torch.randn(n, k, device=dev) * 0.1).to(torch.float8_e4m3fn)
        scales = torch.rand(n // 128, k // 128, device=dev) + 0.5
        rows = (torch.arange(n, device=dev) // 128).to(torch.int32)
        args = dict(fmt=tg.FP8, w=w, scales=scales, scale_row=rows, scale_cols=128)
        return args, w.numel() + scales.numel() * 4
    groups = k // 128
    scales = torch.rand(groups, n, device=dev, dtype=torch.float16) * 0.01
    zeros = torch.randint(-2**31, 2**31 - 1, (groups, n // 8), device=dev, dtype=torch.int32)
    if fmt == "awq":
        w = torch.randint(-2**31, 2**31 - 1, (k, n // 8), device=dev, dtype=torch.int32)
        args = dict(fmt=tg.AWQ, w=w, scales=scales, zeros=zeros, group=128)
    else:
        w = torch.randint(-2**31, 2**31 - 1, (k // 8, n), device=dev, dtype=torch.int32)
        args = dict(fmt=tg.GPTQ, w=w, scales=scales, zeros=zeros, group=128, zero_offset=1)
    return args, w.numel() * 4 + scales.numel() * 2 + zeros.numel() * 4


def candidates(rows: int, fmt: int) -> list[tuple[str, object]]:
    """(label, call(x, args, n)) for each kernel and tiles to try: FP8 with x quantized (its K
    step is fixed: its activation group) and with the weight widened instead (x as it is); the
    4-bit formats through the GEMV (one row) and the GEMM."""
    def gemm(t):
        return lambda x, a, n: tg.quant_gemm(x, n=n, tiles=t, **a)

    def fp8(t, quantize_x):
        return lambda x, a, n: tg._fp8_gemm(x, a["w"], a["scales"], a["scale_row"],
                                            a["scale_cols"], n, False, t, quantize_x)

    out = []
    block_m = max(16, min(64, 1 << (rows - 1).bit_length()))
    if fmt == tg.FP8 and rows <= tg.SKINNY_ROWS:
        # a 64-row tile at fewer rows too: below 64 Triton (3.6, sm_90) runs the dot on mma.sync
        # in f16, the e4m3 widened; at 64 on wgmma in e4m3 (check_kernels' PTX, session 38)
        for quant, bm, split, bn, s, w in itertools.product(
                (True, False), sorted({block_m, 64}), (1, 2, 4, 8), (16, 32, 64, 128),
                (3, 4, 6, 8), (4, 8)):
            if w == 8 and not quant:  # 8 warps only with x in e4m3
                continue
            t = tg.QuantTiles(bm, bn, 128, w, s, split)
            out.append((f"{'xq' if quant else 'wide'} {tuple(t)}", fp8(t, quant)))
        return out
    if rows == 1 and fmt != tg.FP8:
        tiles = [tg.QuantTiles(1, bn, bk, 4, 3, split) for split, bn, bk in
                 itertools.product((1, 2, 4, 8), (32, 64, 128), (32, 64, 128)) if bn * bk <= 8192]
    elif rows <= tg.SKINNY_ROWS and fmt == tg.AWQ:  # _awq_mma_kernel
        tiles = [tg.QuantTiles(block_m, bn, bk, 4, s, split) for bn, bk, s, split in
                 itertools.product((32, 64, 128), (64, 128), (3, 4), (1, 2, 4, 8))]
    elif rows <= tg.SKINNY_ROWS and fmt != tg.FP8:
        tiles = [tg.QuantTiles(block_m, bn, bk, w, s) for bn, bk, w, s in
                 itertools.product((16, 32, 64), (64, 128), (2, 4), (3, 4, 6))]
    else:
        tiles = [tg.QuantTiles(*t) for t in (
            (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3),
            (64, 128, 64, 4, 4), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3))]
    return [(str(tuple(t)), gemm(t)) for t in tiles]


def cuda_row(x: torch.Tensor, copies: list[dict], n: int, ref: torch.Tensor,
             floor: float, splits: list[int]) -> None:
    """One row through the CUDA kernels (quant/cuda_gemv.py, the engine's default where they
    build): their time against the floor and their largest difference from Triton's; then at
    each K split of `splits` (CTAs a slice of outputs) instead of num_splits' choice."""
    if cuda_gemv.one_row(x, copies[0]) is None:
        print("  CUDA GEMV: does not take this shape here")
        return
    err = ((cuda_gemv.one_row(x, copies[0]).float() - ref).abs().max() /
           ref.abs().max()).item()
    us = graph_time_us([lambda a=a: cuda_gemv.one_row(x, a) for a in copies])
    print(f"  CUDA GEMV: {us:7.1f} us ({us / floor:.2f}x the floor), {err:.1e} of Triton's "
          f"largest output apart", flush=True)
    timed = []
    for s in splits:
        split_err = ((cuda_gemv.one_row(x, copies[0], s).float() - ref).abs().max() /
                     ref.abs().max()).item()
        split_us = graph_time_us([lambda a=a, s=s: cuda_gemv.one_row(x, a, s) for a in copies])
        timed.append(f"{s} {split_us:.1f}" + ("" if split_err < 0.05 else
                                               f" (WRONG: {split_err:.1e} apart)"))
    if timed:
        print("  CUDA GEMV by K split (CTAs a slice: us): " + "; ".join(timed), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,4096")
    ap.add_argument("--formats", default="fp8,awq,gptq")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tune", action="store_true", help="time every tile candidate")
    ap.add_argument("--splits", default="",
                    help="one row: the CUDA GEMVs also at these K splits, e.g. 1,2,4,8,16,32")
    args = ap.parse_args()
    torch.manual_seed(0)
    rate = copy_rate_gbs()
    print(f"{torch.cuda.get_device_name()}: copy rate {rate:.0f} GB/s", flush=True)
    for fmt, rows, name in itertools.product(args.formats.split(","),
                                             map(int, args.rows.split(",")),
                                             args.shapes.split(",")):
        n, k = SHAPES[name]
        one, nbytes = weights(fmt, n, k)
        copies = [one] + [weights(fmt, n, k)[0] for _ in range(max(0, SPAN // nbytes - 1))]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        bf16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        floor = nbytes / rate / 1e3
        cublas = graph_time_us([lambda x=x, b=bf16: F.linear(x, b)] * 8)
        tries = [("default", lambda x, a, n: tg.quant_gemm(x, n=n, **a))] + \
            (candidates(rows, one["fmt"]) if args.tune else [])
        if fmt == "fp8" and rows >= tg.CUBLAS_ROWS:
            us = graph_time_us([lambda a=a, x=x, n=n: tg.quant_gemm(x, n=n, cublas_blocks=True,
                                                                   **a) for a in copies])
            print(f"  FP8 through cuBLAS's block-scaled GEMM (x quantized first): {us:.1f} us",
                  flush=True)
        ref = tries[0][1](x, one, n).float()
        default_us = graph_time_us([lambda a=a, x=x, n=n, c=tries[0][1]: c(x, a, n)
                                    for a in copies])
        if fmt in ("awq", "fp8") and rows == 1:
            cuda_row(x, copies, n, ref, floor, [int(s) for s in args.splits.split(",") if s])
        results = [(default_us, "default")]
        for label, call in tries[1:]:
            try:
                err = ((call(x, one, n).float() - ref).abs().max() / ref.abs().max()).item()
                if not err < 0.05:  # the default's x quantized or not, rounding apart
                    print(f"  {label}: WRONG, error {err:.2e} of the default's largest output")
                    continue
                us = graph_time_us([lambda a=a, x=x, n=n, c=call: c(x, a, n) for a in copies])
            except Exception as e:  # a candidate the compiler refuses (shared memory)
                print(f"  {label}: {type(e).__name__}", flush=True)
                continue
            results.append((us, label))
        ranked = sorted(results[1:])
        if args.tune:
            print("  fastest: " + "; ".join(f"{label} {us:.1f}" for us, label in ranked[:4]))
        best_us, best = min(results)
        tflops = 2 * rows * n * k / default_us / 1e6
        print(f"{fmt:5s} rows {rows:5d} {name:8s} floor {floor:7.1f} us | default "
              f"{default_us:7.1f} us ({default_us / floor:.2f}x, {tflops:.0f} TFLOP/s) | "
              f"cuBLAS bf16 {cublas:7.1f} us ({default_us / cublas:.2f}x)"
              + (f" | best {best_us:7.1f} us {best}" if args.tune else ""), flush=True)


if __name__ == "__main__":
    main()
