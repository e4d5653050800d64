"""The Triton decode kernel's tile settings, measured: for bf16 and FP8 KV, each candidate
(tokens per tile, warps, stages, splits x1 / x2) at several batch shapes,
as achieved KV read bandwidth (values and scales) and its ratio to the HBM floor. Usage (GPU):
    python tools/tune_decode.py [--shapes 1x32768,4x32768,64x512,1x131072] [--hbm-gbs 4229]
Prints the best setting per (dtype, shape) and the current default's time beside it. With
--f16-dot, FP8 also tries float16 dots (Tiles.f16_dot); with --transposed, every candidate is
also tried with its dots transposed (Tiles.transposed). FP8's default at the Qwen3-8B shape,
both ways:
    python tools/tune_decode.py --dtypes fp8 --block-n 128 --warps 4 --stages 2 --f16-dot \
        --transposed
`--f16-dot only` / `--transposed only` try those forms alone; `--cuda` adds FP8's CUDA kernel.
`--max-len` sets the split count as the engine's max_len does (by default each shape's own
context).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from nanoserve.attention import cuda_fp8_decode
from nanoserve.attention.triton_decode import (
    TILES,
    Tiles,
    default_tiles,
    num_splits_for,
    paged_decode_attention,
)
from nanoserve.kv.fp8_format import FP8
from nanoserve.kv.spec import KVSpec

HEADS, KV_HEADS, D, PAGE = 32, 8, 128, 256  # the Qwen3-8B shape


def case(batch: int, ctx: int, dtype: torch.dtype, dev: torch.device, heads: int = HEADS,
         kv_heads: int = KV_HEADS):
    spec = KVSpec(1, PAGE, kv_heads, D, dtype)
    pages_per_seq = -(-ctx // PAGE)
    kv = spec.empty(1, batch * pages_per_seq + 1, dev)[0]
    k, v, ks, vs = spec.views(kv)
    for values in (k, v):
        values.copy_(torch.randn(values.shape, device=dev).to(dtype))
    if ks is not None:
        ks.uniform_(0.001, 0.01)
        vs.uniform_(0.001, 0.01)
    perm = torch.randperm(batch * pages_per_seq, device=dev) + 1  # scattered pages
    table = perm.view(batch, pages_per_seq).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, heads, D, dtype=torch.bfloat16, device=dev)
    kv_bytes = batch * ctx * spec.layer_token_bytes
    # triton's do_bench_cudagraph runs on a stream of its own, which does not wait for this
    # one: unsynchronized, a first call read a page table not yet written (an illegal address
    # after an earlier shape's memory was reused)
    torch.cuda.synchronize(dev)
    return q, k, v, ks, vs, table, lens, kv_bytes


def graph_us(fn, rep: int = 50) -> float:
    """fn's time in us, run once first (compiles, builds) and then timed in CUDA graphs."""
    fn()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=rep)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x32768,4x32768,64x512,1x131072")
    ap.add_argument("--hbm-gbs", type=float, default=4229.0)
    ap.add_argument("--heads", default=f"{HEADS}x{KV_HEADS}",
                    help="query x KV heads (Qwen3-30B-A3B: 32x4)")
    ap.add_argument("--dtypes", default="bf16,fp8", help="KV dtypes to tune: bf16, fp8")
    ap.add_argument("--block-n", default="32,64,128", help="KV tokens per tile to try")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--mults", default="0.25,0.5,1,2", help="multiples of the default split count, "
                    "rounded (0: one split, which writes the output itself with no merge)")
    ap.add_argument("--f16-dot", nargs="?", const="also", choices=["also", "only"],
                    help="FP8: also (or only) try float16 dots")
    ap.add_argument("--tma", action="store_true",
                    help="also try K/V tiles through TMA descriptors (Tiles.tma)")
    ap.add_argument("--transposed", nargs="?", const="also", choices=["also", "only"],
                    help="also (or only) try the dots transposed: scores [tokens, group] "
                    "(Tiles.transposed)")
    ap.add_argument("--cuda-stages", default="2,3,4",
                    help="with --cuda: tiles a warp holds in shared memory (2 to 4)")
    ap.add_argument("--max-len", type=int, default=0,
                    help="the split count's max_len (the engine's: the model's context)")
    ap.add_argument("--cuda", action="store_true",
                    help="FP8: also time the CUDA kernel (Tiles.cuda; its tile is fixed, the "
                    "split multiples apply)")
    args = ap.parse_args()
    heads, kv_heads = map(int, args.heads.split("x"))
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    floats = lambda text: [float(x) for x in text.split(",")]  # noqa: E731
    base = [Tiles(n, w, s) for n, w, s in itertools.product(ints(args.block_n), ints(args.warps),
                                                             ints(args.stages))]
    if args.tma:  # PAGE (256) is a multiple of every block_n tried
        base += [t._replace(tma=True) for t in base]
    if args.transposed:
        base = [t._replace(transposed=True) for t in base] + \
            (base if args.transposed == "also" else [])
    f16 = [t._replace(f16_dot=True) for t in base if t.block_n >= 64 and args.f16_dot]
    dtypes = {"bf16": (torch.bfloat16, "default", base),
              "fp8": (FP8, "fp8", f16 + (base if args.f16_dot != "only" else []) +
                      ([TILES["fp8"]._replace(split_factor=1, cuda=True, num_stages=n)
                        for n in ints(args.cuda_stages)] if args.cuda else []))}
    for key in args.dtypes.split(","):
        dtype, name, candidates = dtypes[key]
        for shape in args.shapes.split(","):
            batch, ctx = map(int, shape.split("x"))
            q, k, v, ks, vs, table, lens, nbytes = case(batch, ctx, dtype, dev, heads, kv_heads)
            base = num_splits_for(batch, kv_heads, args.max_len or ctx, sms)
            floor_us = nbytes / args.hbm_gbs / 1e3
            results = []
            for tiles, mult in itertools.product(candidates, floats(args.mults)):
                # the multiplier is `mult` here; the CUDA kernel's rounded as the engine
                # rounds it (16.5 to 16: one block an SM, where 17 would put two on a few)
                splits = cuda_fp8_decode.num_splits(base, mult) if tiles.cuda else \
                    max(1, min(round(base * mult), triton.cdiv(args.max_len or ctx,
                                                               tiles.block_n)))
                tiles = tiles._replace(split_factor=1, cuda_split_factor=1)
                try:
                    def attend(tiles=tiles, splits=splits):
                        paged_decode_attention(q, k, v, table, lens, D**-0.5, splits,  # noqa: B023
                                               k_scale=ks, v_scale=vs, tiles=tiles)  # noqa: B023

                    # in a CUDA graph, as decode runs it: no launch overhead in the figure
                    us = 1e3 * triton.testing.do_bench_cudagraph(attend, rep=30)
                except Exception as e:  # a setting the compiler refuses (shared memory)
                    print(f"  {tiles} x{mult}: {type(e).__name__}")
                    continue
                results.append((us, tiles, mult))
            results.sort(key=lambda r: r[0])
            current = default_tiles(key == "fp8", batch, PAGE, D)
            factor = current.cuda_split_factor if current.cuda else current.split_factor
            default = next((r for r in results if r[1] == current._replace(
                split_factor=1, cuda_split_factor=1) and r[2] == factor), None)
            now = f"{default[1]} {default[0]:7.1f} us ({default[0] / floor_us:.2f}x)" \
                if default else "not among the candidates"
            best = results[0]
            print(f"{name:7s} {shape:>9s} floor {floor_us:7.1f} us | default {now} | best "
                  f"{best[1]} splits x{best[2]} {best[0]:7.1f} us ({best[0] / floor_us:.2f}x)")
            for us, tiles, mult in results[1:6]:
                print(f"{'':18s} next {tiles} x{mult} {us:7.1f} us ({us / floor_us:.2f}x)")


if __name__ == "__main__":
    main()
