"""Where the CUDA FP8 decode kernel's time goes, by taking its loop apart: built with
FP8_DECODE_PROBE=1 it only copies each tile into shared memory (the same copies, pipeline and
grid), with 2 the scores' MMAs run too, with 3 only the values are copied (not the scales), with 0 everything (the kernel as shipped). Beside them,
Triton's bf16 kernel over the same bytes (half the tokens). If the copies alone run near the
full kernel's time, the reads are the limit, not the loop's work. Qwen3-8B shape, CUDA graphs.
Usage (GPU): python tools/probes/fp8_decode_parts.py [--ctx 131072,1048576]"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import torch
import triton

import tools.tune_decode as td
from nanoserve.attention import cuda_fp8_decode as cfd
from nanoserve.attention.extensions import load_extension
from nanoserve.attention.triton_decode import TILES, num_splits_for, paged_decode_attention
from nanoserve.kv.fp8_format import FP8

PARTS = {0: "everything", 1: "copies alone", 2: "copies + scores", 3: "values' copies"}


def build(part: int):
    return load_extension(
        f"nanoserve_fp8_decode_part{part}",
        [cfd.CSRC / "fp8_decode_binding.cpp", cfd.CSRC / "fp8_decode.cu"], f"part {part}",
        extra_cflags=["-O3"], extra_include_paths=[str(cfd.CSRC)],
        extra_cuda_cflags=["-O3", "--use_fast_math", f"-DFP8_DECODE_PROBE={part}"])


def timed(q, k, v, ks, vs, table, lens, splits, tiles) -> float:
    def attend():
        paged_decode_attention(q, k, v, table, lens, td.D**-0.5, splits, k_scale=ks,
                               v_scale=vs, tiles=tiles)

    attend()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench_cudagraph(attend, rep=50)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="131072,1048576")
    ap.add_argument("--stages", default="2,3,4")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    with ThreadPoolExecutor(len(PARTS)) as pool:  # three nvcc builds at once
        builds = dict(zip(PARTS, pool.map(build, PARTS), strict=True))
    for ctx in map(int, args.ctx.split(",")):
        q, k, v, ks, vs, table, lens, nbytes = td.case(1, ctx, FP8, dev)
        splits = num_splits_for(1, td.KV_HEADS, ctx, sms)
        for part, mod in builds.items():
            cfd._extension = lambda mod=mod: mod  # decode_partials looks it up at each call
            for stages in map(int, args.stages.split(",")):
                tiles = TILES["fp8"]._replace(num_stages=stages)
                us = timed(q, k, v, ks, vs, table, lens, splits, tiles)
                print(f"FP8 {ctx:8d} tokens, {PARTS[part]:16s} {stages} stages: {us:7.1f} us, "
                      f"{nbytes / us / 1e3:.0f} GB/s", flush=True)
        del q, k, v, ks, vs, table
        torch.cuda.empty_cache()
        q, k, v, _, _, table, lens, nbytes = td.case(1, ctx // 2, torch.bfloat16, dev)
        splits = num_splits_for(1, td.KV_HEADS, ctx // 2, sms)
        us = timed(q, k, v, None, None, table, lens, splits, None)
        print(f"bf16 {ctx // 2:8d} tokens (Triton, the same bytes): {us:7.1f} us, "
              f"{nbytes / us / 1e3:.0f} GB/s", flush=True)
        del q, k, v, table
        x = torch.randn(nbytes // 4, device=dev)
        us = 1e3 * triton.testing.do_bench_cudagraph(lambda x=x: x.sum(), rep=50)
        print(f"torch.sum over the same bytes (float32, contiguous): {us:7.1f} us, "
              f"{nbytes / us / 1e3:.0f} GB/s", flush=True)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
