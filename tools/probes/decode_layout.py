"""The decode kernel's KV read rate against the cache's layout, in CUDA graphs: the Qwen3-8B
shape (8 kv heads: a head's 128 or 256 bytes every 1 or 2 KB of a token row) beside 1 and 2 kv
heads carrying the same bytes (a head's rows contiguous), FP8 and bf16, at split multiples
0.5, 1 and 2. Session 24 asked whether FP8's kernel was held by its strided reads: 1 kv head
read no faster. Usage (GPU): python tools/probes/decode_layout.py"""

from __future__ import annotations

import torch
import triton

import tools.tune_decode as td
from nanoserve.attention.triton_decode import TILES, num_splits_for, paged_decode_attention
from nanoserve.kv.fp8_format import FP8

SHAPES = [(8, 32, 131072, FP8), (1, 4, 1048576, FP8), (2, 8, 524288, FP8),
          (8, 32, 1048576, FP8), (1, 4, 8388608, FP8),
          (8, 32, 131072, torch.bfloat16), (1, 4, 1048576, torch.bfloat16)]


def main() -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for kv_heads, heads, ctx, dtype in SHAPES:
        td.KV_HEADS, td.HEADS = kv_heads, heads  # case() reads them
        q, k, v, ks, vs, table, lens, nbytes = td.case(1, ctx, dtype, dev)
        tiles = TILES["fp8" if dtype == FP8 else "default"]._replace(
            split_factor=1, cuda_split_factor=1)
        for mult in (0.5, 1, 2):
            splits = max(1, round(num_splits_for(1, kv_heads, ctx, sms) * mult))

            def attend(q=q, k=k, v=v, ks=ks, vs=vs, table=table, lens=lens, splits=splits,
                       tiles=tiles):
                paged_decode_attention(q, k, v, table, lens, 128**-0.5, splits, k_scale=ks,
                                       v_scale=vs, tiles=tiles)

            us = 1e3 * triton.testing.do_bench_cudagraph(attend, rep=30)
            print(f"kv heads {kv_heads}, heads {heads}, {ctx} tokens, {dtype}, splits x{mult} "
                  f"({splits}): {us:.1f} us, {nbytes / us / 1e3:.0f} GB/s", flush=True)
        del q, k, v, ks, vs, table
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
