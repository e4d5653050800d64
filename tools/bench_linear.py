"""Decode's linear layers at few rows: torch's F.linear (cuBLAS) against the Triton skinny
matmul (nanoserve/models/triton_linear.py) and its tile settings, per weight shape, in CUDA
graphs, as time and fraction of the device-memory floor (the weight's bytes). Usage (GPU):
    python tools/bench_linear.py [--rows 1,4,16] [--hbm-gbs 4229] [--silu]
Shapes are Qwen3-8B's: qkv, o, gate_up, down, lm_head (and Qwen3-30B-A3B's by name: moe_qkv,
moe_o, moe_router, moe_lm_head). --silu times, at one row, down with the
SiLU-multiply in its kernel against inductor's SiLU-multiply kernel followed by the matmul.
cuBLAS is also timed with a (zero) bias, which torch sends to cuBLASLt's bias epilogue, and
with cuBLASLt as torch's preferred BLAS library. At one row the plain one-row CUDA GEMV
(quant/cuda_gemv.half_gemv) is timed at its split and at --splits.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton

from nanoserve.models.layers import silu_and_mul
from nanoserve.models.triton_linear import (
    LinearTiles,
    skinny_linear,
    skinny_silu_linear,
)
from nanoserve.quant import cuda_gemv

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288), "lm_head": (151936, 4096)}
# Qwen3-30B-A3B's dense layers (--shapes moe_qkv,moe_o,moe_router: the batch-1 step outside its
# experts runs about 34 us a layer against about 10 of bytes; docs/perf-notes.md session 30)
MOE_SHAPES = {"moe_qkv": (5120, 2048), "moe_o": (2048, 4096), "moe_router": (128, 2048),
              "moe_lm_head": (151936, 2048)}


def timed(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=30)


def silu_prologue(hbm_gbs: float, dev: torch.device) -> None:
    """One row: down with SiLU-multiply in its kernel against inductor's kernel + the matmul."""
    n, k = SHAPES["down"]
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
    gate_up = torch.randn(1, 2 * k, device=dev, dtype=torch.bfloat16)
    floor = n * k * 2 / hbm_gbs / 1e3
    apart = timed(lambda: skinny_linear(silu_and_mul(gate_up), w))
    fused = timed(lambda: skinny_silu_linear(gate_up, w))
    print(f"down with SiLU-multiply: floor {floor:.1f} us | apart {apart:.1f} us | fused "
          f"{fused:.1f} us ({floor / fused:.0%}); x36 layers: {36 * (apart - fused) / 1e3:+.3f} "
          f"ms a step", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--hbm-gbs", type=float, default=4229.0)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--splits", default="1,2,4,8,16,32",
                    help="one row: the CUDA GEMV's K splits timed beside its own choice")
    ap.add_argument("--silu", action="store_true",
                    help="only down with SiLU-multiply in its kernel against apart, one row")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    if args.silu:
        silu_prologue(args.hbm_gbs, dev)
        return
    candidates = [LinearTiles(*t) for t in itertools.product((16, 32, 64, 128), (128, 256), (4, 8),
                                                              (3, 4))]
    per_layer = {}
    for rows in map(int, args.rows.split(",")):
        for name in args.shapes.split(","):
            n, k = {**SHAPES, **MOE_SHAPES}[name]
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            floor = n * k * 2 / args.hbm_gbs / 1e3
            ref = x.double() @ w.double().T
            cublas = timed(lambda: F.linear(x, w))  # noqa: B023
            zero = torch.zeros(n, device=dev, dtype=torch.bfloat16)
            with_bias = timed(lambda: F.linear(x, w, zero))  # noqa: B023  # cuBLASLt's epilogue
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                lt = timed(lambda: F.linear(x, w))  # noqa: B023
            finally:
                torch.backends.cuda.preferred_blas_library("default")
            err_cublas = (F.linear(x, w).double() - ref).abs().max().item()
            results = []
            for tiles in candidates:
                try:
                    us = timed(lambda: skinny_linear(x, w, tiles=tiles))  # noqa: B023
                except Exception as e:  # a setting the compiler refuses (shared memory)
                    print(f"  {tiles}: {type(e).__name__}")
                    continue
                results.append((us, tiles))
            results.sort(key=lambda r: r[0])
            us, best = results[0]
            err = (skinny_linear(x, w, tiles=best).double() - ref).abs().max().item()
            print(f"rows {rows:2d} {name:11s} floor {floor:7.1f} us | cuBLAS {cublas:7.1f} us "
                  f"({floor / cublas:.0%}), with a bias {with_bias:7.1f}, cuBLASLt {lt:7.1f} | "
                  f"skinny {us:7.1f} us ({floor / us:.0%}) {best} | "
                  f"max err {err:.2e} (cuBLAS {err_cublas:.2e})", flush=True)
            for us2, tiles in results[1:4]:
                print(f"{'':24s} next {tiles} {us2:7.1f} us ({floor / us2:.0%})")
            if rows == 1 and cuda_gemv.half_gemv_ok(x, w):
                own = timed(lambda: cuda_gemv.half_gemv(x, w))  # noqa: B023
                err = (cuda_gemv.half_gemv(x, w).double() - ref).abs().max().item()
                swept = "  ".join(
                    f"{sp}: {timed(lambda sp=sp: cuda_gemv.half_gemv(x, w, splits=sp)):.1f}"  # noqa: B023
                    for sp in map(int, args.splits.split(",")))
                print(f"{'':24s} CUDA GEMV {own:7.1f} us ({floor / own:.0%}), max err {err:.2e}"
                      f" | us at splits {swept}", flush=True)
            if name in SHAPES and name != "lm_head":  # Qwen3-8B's 36 layers
                per_layer.setdefault(rows, [0.0, 0.0])
                per_layer[rows][0] += cublas
                per_layer[rows][1] += us
    for rows, (c, s) in per_layer.items():
        print(f"rows {rows}: a layer's linears (best settings) cuBLAS {c:.1f} us, skinny {s:.1f}"
              f" us; x36 layers: {36 * (c - s) / 1e3:+.3f} ms a step")


if __name__ == "__main__":
    main()
