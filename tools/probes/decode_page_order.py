"""The decode kernel's KV read rate against the order of a sequence's pages: scattered (a random
permutation, as tools/tune_decode.py times it) or ascending (as a fresh engine's free list hands
them out). FP8 (the CUDA kernel) and bf16 (Triton's), the Qwen3-8B shape, CUDA graphs. Asks
whether address translation, not the kernel, holds FP8 decode below the HBM rate: an FP8 page
holds half a bf16 page's bytes, so a scattered FP8 read changes 2 MB regions twice as often
per byte. Usage (GPU): python tools/probes/decode_page_order.py [--ctx 131072,1048576]"""

from __future__ import annotations

import argparse

import torch

import tools.tune_decode as td
from nanoserve.attention.triton_decode import num_splits_for, paged_decode_attention
from nanoserve.kv.fp8_format import FP8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="131072,1048576")
    ap.add_argument("--bf16-ctx", default="131072")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cases = [(c, FP8) for c in map(int, args.ctx.split(","))] + \
        [(c, torch.bfloat16) for c in map(int, args.bf16_ctx.split(",")) if c]
    for ctx, dtype in cases:
        q, k, v, ks, vs, scattered, lens, nbytes = td.case(1, ctx, dtype, dev)
        ascending = torch.arange(1, scattered.numel() + 1, dtype=torch.int32,
                                 device=dev).view_as(scattered)
        splits = num_splits_for(1, td.KV_HEADS, ctx, sms)
        for name, table in (("scattered", scattered), ("ascending", ascending)):
            def attend(table=table, q=q, k=k, v=v, ks=ks, vs=vs):
                return paged_decode_attention(q, k, v, table, lens, td.D**-0.5, splits,  # noqa: B023
                                              k_scale=ks, v_scale=vs)

            us = td.graph_us(attend)
            print(f"{str(dtype):22s} {ctx:8d} tokens, pages {name}: {us:7.1f} us, "
                  f"{nbytes / us / 1e3:.0f} GB/s", flush=True)
        del q, k, v, ks, vs, scattered, ascending
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
