"""CPU attention's kernel against the host's memory: GB/s of host KV over one layer of the
Qwen3-8B shape (8 kv heads, 32 q heads, head_dim 128, 256-token pages), bf16 and FP8, for a
range of thread counts, beside the host's read rate (a torch sum of 1 GiB) and torch's own
kernels (the reference kernel; bf16 SDPA over the gathered layer). No GPU needed.

    python tools/probes/cpu_attention_rate.py [--tokens 32768] [--threads 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from nanoserve.attention.cpu_decode import cpu_decode_kernel
from nanoserve.kv.fp8 import quantize
from nanoserve.kv.fp8_format import FP8
from nanoserve.kv.spec import KVSpec


def best(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def layer(dtype: torch.dtype, tokens: int) -> tuple[KVSpec, torch.Tensor]:
    spec = KVSpec(1, 256, 8, 128, dtype)
    rows = spec.empty(1, tokens // 256, torch.device("cpu"))[0]
    k, v, ks, vs = spec.views(rows)
    for values, scales in ((k, ks), (v, vs)):
        x = torch.randn(values.shape)
        if scales is None:
            values.copy_(x.to(dtype))
        else:
            q8, s = quantize(x)
            values.copy_(q8)
            scales.copy_(s)
    return spec, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    logical = os.cpu_count() or 1
    ap.add_argument("--threads", default=",".join(str(t) for t in sorted(
        {t for t in (1, 2, 4, 8, 16, 32) if t <= logical} | {torch.get_num_threads(), logical})),
        help="thread counts (default: powers of two up to the logical cores, torch's count)")
    ap.add_argument("--layers", type=int, default=4, help="distinct layers read in turn")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    x = torch.ones(1 << 28)
    print(f"host reads (torch sum of 1 GiB, {torch.get_num_threads()} threads): "
          f"{x.numel() * 4 / best(x.sum) / 1e9:.1f} GB/s")
    del x
    name, kernel = cpu_decode_kernel("auto")
    q = torch.randn(1, 32, 128).bfloat16().float()  # a bf16 model's queries
    table = torch.arange(args.tokens // 256, dtype=torch.int32)[None]
    starts, ends = torch.zeros(1, dtype=torch.int32), torch.tensor([args.tokens],
                                                                    dtype=torch.int32)
    for dtype in (torch.bfloat16, FP8):
        # several layers, read in turn, so that no layer is in the last-level cache
        layers = [layer(dtype, args.tokens) for _ in range(args.layers)]
        spec, rows = layers[0]
        nbytes = rows.numel() * rows.element_size()
        rates = []
        for n in threads:
            torch.set_num_threads(n)
            turn = iter(range(1 << 30))

            def call(turn=turn, layers=layers) -> None:
                spec, rows = layers[next(turn) % len(layers)]
                kernel(q, rows, spec.layout, table, starts, ends, 0.088)

            rates.append(f"{n}: {nbytes / best(call, repeat=2 * len(layers)) / 1e9:.1f}")
        print(f"{name} kernel, {spec.describe()}, {args.tokens} tokens ({nbytes / 1e6:.0f} MB): "
              f"GB/s by threads {', '.join(rates)}")
        torch.set_num_threads(max(threads))
        if dtype == torch.bfloat16:
            k, v, _, _ = spec.views(rows)
            kv = (k.flatten(0, 1).transpose(0, 1)[None], v.flatten(0, 1).transpose(0, 1)[None])
            qb = q.to(torch.bfloat16)[:, :, None]
            t = best(lambda qb=qb, kv=kv: F.scaled_dot_product_attention(qb, *kv, enable_gqa=True))
            print(f"  torch bf16 SDPA over the layer ({max(threads)} threads): "
                  f"{nbytes / t / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
