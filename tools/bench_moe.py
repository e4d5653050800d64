"""The MoE layer alone at Qwen3-30B-A3B's widths (hidden 2048, 128 experts, top 8, expert
width 768, bf16): each expert path's time per layer at decode batch sizes against its HBM
floor, the bytes of the experts the batch routes to (counted, not estimated) plus the router,
at the device bandwidth measured in the same run. The capturable paths replay as one CUDA
graph over --layers layers (distinct weights, so nothing is served from L2); the loop runs
eagerly (it syncs with the host). "fused" is the engine's path: at batch 1 the CUDA kernels of
models/cuda_moe.py where they build (NANOSERVE_ONE_ROW_CUDA=0: Triton's). Usage (GPU):
    python tools/bench_moe.py [--batch 1,2,4,8,16,32,64] [--layers 8]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from nanoserve.cuda_timing import graph_median_ms, median_ms
from nanoserve.models import moe

H, E, K, INTER = 2048, 128, 8, 768
EXPERT_BYTES = 3 * H * INTER * 2
ROUTER_BYTES = E * H * 2


def hbm_GBps() -> float:
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    big2 = torch.empty_like(big)
    return 2 * big.numel() / median_ms(lambda: big2.copy_(big), reps=20) / 1e6


def blocks(n: int) -> list[moe.SparseMoE]:
    out = []
    for i in range(n):
        torch.manual_seed(i)
        with torch.device("cuda"):
            block = moe.SparseMoE(H, E, K, INTER, norm_topk_prob=True)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
        out.append(block.to(torch.bfloat16).requires_grad_(False))
    return out


def run_layers(layers, xs):
    return [layer(x) for layer, x in zip(layers, xs, strict=True)]


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,2,4,8,16,32,64")
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    bw = hbm_GBps()
    layers = blocks(args.layers)
    paths = ["fused", "grouped", "gather", "loop"]
    if not moe.fast_grouped_mm(torch.device("cuda"), torch.bfloat16):
        paths.remove("grouped")
    probe = torch.zeros(1, H, device="cuda", dtype=torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, device memory "
          f"{bw:.0f} GB/s; auto runs {moe.choose_path('auto', probe)}")
    print(f"{'batch':>5}{'experts/layer':>15}{'floor us':>10}" +
          "".join(f"{p + ' us':>12}{'x':>6}" for p in paths))
    for b in [int(x) for x in args.batch.split(",")]:
        xs = [torch.randn(b, H, device="cuda", dtype=torch.bfloat16) for _ in layers]
        distinct = [moe.route(x, layer.gate.weight, K, True)[1].unique().numel()
                    for layer, x in zip(layers, xs, strict=True)]
        floor_us = sum(d * EXPERT_BYTES + ROUTER_BYTES for d in distinct) / bw / 1e3 / len(xs)
        row = f"{b:>5}{statistics.mean(distinct):>15.1f}{floor_us:>10.1f}"
        for path in paths:
            for layer in layers:
                layer.backend = path
            if path == "gather" and b > moe.GATHER_MAX_TOKENS:
                row += f"{'-':>12}{'':>6}"
                continue
            if path == "loop":
                ms = median_ms(functools.partial(run_layers, layers, xs), reps=20)
            else:
                ms = graph_median_ms(functools.partial(run_layers, layers, xs), reps=20)
            us = ms * 1e3 / len(layers)
            row += f"{us:>12.1f}{us / floor_us:>6.2f}"
        print(row)


if __name__ == "__main__":
    main()
