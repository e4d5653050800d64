"""The CUDA FP8 decode kernel built three ways (csrc/fp8_decode.cu's FP8_DECODE_DEQUANT): e4m3
widened by the conversion instruction (0, the default), by bit moves (1), or not at all (2:
wrong values, the same data flow, what the widening costs). Each is timed in CUDA graphs at the
Qwen3-8B shape, 1 x 128K and 1 x 1M, beside the HBM floor; forms 0 and 1 are compared with
each other. Usage (GPU): python tools/probes/fp8_dequant_forms.py [--hbm-gbs 4229]"""

from __future__ import annotations

import argparse

import torch
import triton

import tools.tune_decode as td
from nanoserve.attention import cuda_fp8_decode as cfd
from nanoserve.attention.extensions import load_extension
from nanoserve.attention.triton_decode import TILES, num_splits_for, paged_decode_attention
from nanoserve.kv.fp8_format import FP8


def build(form: int):
    return load_extension(
        f"nanoserve_fp8_decode_form{form}",
        [cfd.CSRC / "fp8_decode_binding.cpp", cfd.CSRC / "fp8_decode.cu"], f"form {form}",
        extra_cflags=["-O3"], extra_include_paths=[str(cfd.CSRC)],
        extra_cuda_cflags=["-O3", "--use_fast_math", f"-DFP8_DECODE_DEQUANT={form}"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="131072,1048576")
    ap.add_argument("--hbm-gbs", type=float, default=4229.0)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    forms = {f: build(f) for f in (0, 1, 2)}
    for ctx in map(int, args.ctx.split(",")):
        q, k, v, ks, vs, table, lens, nbytes = td.case(1, ctx, FP8, dev)
        splits = num_splits_for(1, td.KV_HEADS, ctx, sms)
        floor_us = nbytes / args.hbm_gbs / 1e3
        outs = {}
        for form, mod in forms.items():
            cfd._extension = lambda mod=mod: mod  # decode_partials looks it up at each call

            def attend():
                return paged_decode_attention(q, k, v, table, lens, td.D**-0.5, splits,  # noqa: B023
                                              k_scale=ks, v_scale=vs, tiles=TILES["fp8"])  # noqa: B023

            outs[form] = attend().float()
            torch.cuda.synchronize()
            us = 1e3 * triton.testing.do_bench_cudagraph(attend, rep=50)
            print(f"{ctx:8d} tokens, form {form}: {us:7.1f} us ({us / floor_us:.2f}x the floor "
                  f"{floor_us:.1f} us), {nbytes / us / 1e3:.0f} GB/s", flush=True)
        diff = (outs[1] - outs[0]).abs().max().item()
        print(f"{ctx:8d} tokens: forms 0 and 1 differ by {diff:.3g} at most "
              f"(outputs up to {outs[0].abs().max().item():.3g})", flush=True)
        del q, k, v, ks, vs, table
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
