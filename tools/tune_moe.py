"""Tunes the fused MoE kernels' tiles per batch band on this GPU and writes them where the engine
reads them (nanoserve/models/moe_configs/<device name>.json, vLLM's practice). Each band's
candidates run the whole expert path (sort, gate_up, down, sum) over --layers layers of distinct
weights in one CUDA graph (nothing served from L2), the median of repeats kept; the best is
printed beside the default tiles' time and the HBM floor of the experts the batch routes to.
Usage (GPU): python tools/tune_moe.py [--model NAME] [--tp N] [--tokens 1,2,...] [--layers 8]
[--write DIR]
(--model: a shipped config, a local model directory or a hub id, Qwen3-30B-A3B by default; --tp:
the tensor-parallel size it will run at, which divides each GPU's intermediate size; --write DIR:
the config file, merged with the shipped one, into DIR; by default the shipped one's own
directory)
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from nanoserve.cuda_timing import graph_median_ms, median_ms
from nanoserve.models import fused_moe, moe_tiles
from nanoserve.models.config import ModelConfig
from nanoserve.models.loader import resolve_model_dir
from nanoserve.models.moe import route


def candidates(pairs: int) -> list[moe_tiles.MoETiles]:
    if pairs <= 512:  # decode: few rows per expert, the weights' bytes set the time
        grid = itertools.product([16], [32, 64, 128], [64, 128, 256], [4], [3, 4, 5])
    elif pairs <= 4096:
        grid = itertools.product([16, 32, 64], [64, 128], [64, 128], [4, 8], [3, 4])
    else:  # prefill: the tensor cores set the time; the weights through TMA or not, and
        # with them the intermediate in sorted order (down's rows through TMA) or not
        grid = (c + t for c in itertools.product([64, 128], [64, 128], [32, 64], [4, 8], [3, 4])
                for t in ((False, False), (True, False), (True, True)))
    return [moe_tiles.MoETiles(*c) for c in grid]


def layers(n: int, shape: dict) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    out = []
    for i in range(n):
        g = torch.Generator("cuda").manual_seed(i)
        e, h, m = shape["experts"], shape["hidden"], shape["inter"]
        out.append(tuple(torch.randn(s, device="cuda", generator=g).mul_(0.02).bfloat16()
                         for s in ((e, h), (e, 2 * m, h), (e, h, m))))
    return out


def time_tiles(ws, xs, tiles, k: int) -> float:
    routed = [route(x, router, k, True) for x, (router, _, _) in zip(xs, ws, strict=True)]

    def run():
        for x, (w, ids), (_, gate_up, down) in zip(xs, routed, ws, strict=True):
            fused_moe.experts_fused(x, w, ids, gate_up, down, tiles)

    return graph_median_ms(run, reps=15) * 1e3 / len(xs)


def hbm_GBps() -> float:
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    return 2 * big.numel() / median_ms(big.clone, reps=10) / 1e6


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Qwen3-30B-A3B",
                    help="the MoE model whose shape to tune (a shipped config, a local model "
                    "directory or a hub id)")
    ap.add_argument("--tp", type=int, default=1, help="the tensor-parallel size it runs at")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,512,2048,8192")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--write", nargs="?", const=str(moe_tiles.CONFIG_DIR), default=None,
                    help="write the config file (into this directory)")
    args = ap.parse_args()
    try:
        shape = moe_tiles.model_shape(
            ModelConfig.from_dir(resolve_model_dir(args.model, dummy_weights=True)), args.tp)
    except ValueError as e:
        raise SystemExit(f"{args.model}: {e}") from None
    bw = hbm_GBps()
    ws = layers(args.layers, shape)
    expert_bytes = 3 * shape["hidden"] * shape["inter"] * 2
    name = torch.cuda.get_device_name()
    print(f"{name}, device memory {bw:.0f} GB/s; {args.model} at tp {args.tp}: {shape}")
    print(f"{'tokens':>7}{'experts':>9}{'floor us':>10}{'default us':>12}{'best us':>9}  best")
    bands = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        xs = [torch.randn(tokens, shape["hidden"], device="cuda").bfloat16() for _ in ws]
        distinct = sum(route(x, r, shape["top_k"], True)[1].unique().numel()
                       for x, (r, _, _) in zip(xs, ws, strict=True)) / len(ws)
        floor = distinct * expert_bytes / bw / 1e3
        pairs = tokens * shape["top_k"]
        default = time_tiles(ws, xs, moe_tiles.default_tiles(pairs), shape["top_k"])
        timed = []
        for tiles in candidates(pairs):
            try:
                timed.append((time_tiles(ws, xs, tiles, shape["top_k"]), tiles))
            except Exception as e:  # noqa: BLE001 (a config that does not compile or fit)
                print(f"  {tiles}: {type(e).__name__}")
        best_us, best = min(timed)
        print(f"{tokens:>7}{distinct:>9.1f}{floor:>10.1f}{default:>12.1f}{best_us:>9.1f}  "
              f"{tuple(best)}")
        bands[str(pairs)] = best._asdict()
    if args.write:
        file = moe_tiles.config_file(name)
        shipped = moe_tiles.CONFIG_DIR / file
        old = json.loads(shipped.read_text()) if shipped.exists() else {}
        path = Path(args.write) / file
        path.parent.mkdir(parents=True, exist_ok=True)
        key = moe_tiles.config_key(shape["experts"], shape["hidden"], shape["inter"])
        path.write_text(json.dumps({**old, key: bands}, indent=1) + "\n")
        print("wrote", path)


if __name__ == "__main__":
    main()
