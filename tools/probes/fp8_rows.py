"""Where FP8's product of a few rows (batched decode: 16-64 rows) spends its time, on Qwen3-8B's
shapes: the activation quantization pass alone, the GEMM kernel alone on x already quantized
(the default tiles; at 64 rows a few others, below 64 the default with a 64-row tile: wgmma
in e4m3 rather than mma.sync in f16), the whole quant_gemm, and bf16 cuBLAS on the same
product; each against the floor of the weight's bytes at a device copy's rate measured here.
Where the default splits K over S programs, also the same programs and weight bytes without the
split: the default tile, split 1, on a weight of S n outputs and k / S inputs (no float32
partials written, no last program summing them; x's bytes 1 / S).
CUDA graphs cycling over enough weight copies that none stays in L2. `--ncu`: instead, each
shape's default GEMM launched twice (for Nsight Compute: `-k regex:_fp8_gemm_kernel`).
Usage (GPU):
    python tools/probes/fp8_rows.py [--rows 16,32,64] [--shapes qkv,o,gate_up,down] [--ncu]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_quant import SHAPES, SPAN, copy_rate_gbs, graph_time_us, weights  # noqa: E402

from nanoserve.quant import triton_gemm as tg  # noqa: E402

OTHER_TILES = [tg.QuantTiles(64, bn, 128, w, s, split) for bn, w, s, split in (
    (32, 4, 3, 1), (64, 4, 3, 1), (128, 4, 3, 1), (64, 4, 6, 2), (64, 4, 8, 4), (32, 4, 8, 4),
    (128, 8, 4, 4), (64, 4, 3, 8))]


def gemm(xq, xs, a, n, tiles):
    return tg.fp8_gemm_launch(xq, xs, a["w"], a["scales"], a["scale_row"], a["scale_cols"], n,
                              torch.bfloat16, tiles, tg.FP8_GROUP)


def one_shape(name: str, n: int, k: int, rows: int, copies: list[dict],
              bf16: list[torch.Tensor], floor: float, unsplit: list[dict]) -> None:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = tg.quantize_activations(x, tg.FP8_GROUP)
    quant = graph_time_us([lambda: tg.quantize_activations(x, tg.FP8_GROUP)] * 8)
    whole = graph_time_us([lambda a=a: tg.quant_gemm(x, n=n, **a) for a in copies])
    cublas = graph_time_us([lambda b=b: F.linear(x, b) for b in bf16])
    default = tg.tiles_for(rows, n)
    alone = graph_time_us([lambda a=a: gemm(xq, xs, a, n, default) for a in copies])
    print(f"{name:8s} rows {rows:3d} floor {floor:6.1f} us | quant_gemm {whole:6.1f} "
          f"({whole / floor:.2f}x) = pass {quant:5.1f} + GEMM {alone:6.1f} "
          f"({alone / floor:.2f}x, {tuple(default)}) | bf16 cuBLAS {cublas:6.1f} "
          f"({cublas / floor / 2:.2f}x its floor)", flush=True)
    s = default.split_k
    if s > 1 and unsplit and unsplit[0]["w"].shape == (n * s, k // s):
        uq, uq_scales = tg.quantize_activations(x[:, :k // s].contiguous(), tg.FP8_GROUP)
        us = graph_time_us([lambda a=a: gemm(uq, uq_scales, a, n * s,
                                             default._replace(split_k=1)) for a in unsplit])
        print(f"    the same programs unsplit ([{n * s}, {k // s}], split 1): {us:6.1f} us "
              f"({us / floor:.2f}x)", flush=True)
    if rows < 64:  # the default's tile at 64 rows: wgmma in e4m3, not mma.sync in f16
        wide = default._replace(block_m=64)
        us = graph_time_us([lambda a=a: gemm(xq, xs, a, n, wide) for a in copies])
        print(f"    GEMM {tuple(wide)}: {us:6.1f} us ({us / floor:.2f}x)", flush=True)
        return
    for t in OTHER_TILES:
        try:
            us = graph_time_us([lambda a=a, t=t: gemm(xq, xs, a, n, t) for a in copies])
        except Exception as e:  # shared memory the compiler refuses
            print(f"    {tuple(t)}: {type(e).__name__}")
            continue
        print(f"    GEMM {tuple(t)}: {us:6.1f} us ({us / floor:.2f}x)", flush=True)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ncu", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.ncu:
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            a, _ = weights("fp8", n, k)
            rows = int(args.rows.split(",")[-1])
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = tg.quantize_activations(x, tg.FP8_GROUP)
            for _ in range(2):
                gemm(xq, xs, a, n, tg.tiles_for(rows, n))
            torch.cuda.synchronize()
            print(f"ncu: {name} rows {rows} tiles {tuple(tg.tiles_for(rows, n))}", flush=True)
        return
    rate = copy_rate_gbs()
    print(f"{torch.cuda.get_device_name()}: copy rate {rate:.0f} GB/s", flush=True)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        one, nbytes = weights("fp8", n, k)
        copies = [one] + [weights("fp8", n, k)[0] for _ in range(max(0, SPAN // nbytes - 1))]
        bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                for _ in range(max(1, SPAN // (2 * n * k)))]
        floor = nbytes / rate / 1e3
        s = tg.tiles_for(64, n).split_k
        unsplit = [weights("fp8", n * s, k // s)[0] for _ in copies] if s > 1 else []
        for rows in map(int, args.rows.split(",")):
            one_shape(name, n, k, rows, copies, bf16, floor, unsplit)


if __name__ == "__main__":
    main()
