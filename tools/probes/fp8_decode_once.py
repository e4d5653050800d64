"""One FP8 decode attention call at a context (default 128K, the Qwen3-8B shape), by the CUDA
kernel or Triton's, for a profiler to look at: ncu -k regex:decode_split python3 <this>."""

from __future__ import annotations

import argparse

import torch

from nanoserve.attention.triton_decode import TILES, num_splits_for, paged_decode_attention
from nanoserve.kv.fp8_format import FP8
from tools.tune_decode import KV_HEADS, D, case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--triton", action="store_true")
    ap.add_argument("--stages", type=int, default=2)
    args = ap.parse_args()
    dev = torch.device("cuda")
    q, k, v, ks, vs, table, lens, _ = case(1, args.ctx, FP8, dev)
    splits = num_splits_for(1, KV_HEADS, args.ctx, torch.cuda.get_device_properties(0)
                            .multi_processor_count)
    tiles = TILES["fp8"]._replace(split_factor=1, cuda_split_factor=1, cuda=not args.triton,
                                  num_stages=args.stages)
    for _ in range(3):
        paged_decode_attention(q, k, v, table, lens, D**-0.5, splits, k_scale=ks, v_scale=vs,
                               tiles=tiles)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
