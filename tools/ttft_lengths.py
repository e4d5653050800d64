"""Time to first token of prompts of many lengths in a fresh engine, as a server meets them:
each length once, then each again. The first pass pays whatever is built per new shape (cuDNN
builds an execution plan per prefill attention shape); the second shows the steady state.

    python tools/ttft_lengths.py [--model Qwen3-8B] [--count 24] [--min-len 500] [--max-len 4000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from nanoserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Qwen3-8B")
    ap.add_argument("--count", type=int, default=24, help="distinct prompt lengths")
    ap.add_argument("--min-len", type=int, default=500)
    ap.add_argument("--max-len", type=int, default=4000)
    args = ap.parse_args()
    rng = random.Random(0)
    lengths = rng.sample(range(args.min_len, args.max_len + 1), args.count)
    start = time.perf_counter()
    llm = LLM(args.model, dummy_weights=True, progress=False,
              max_model_len=args.max_len + 8)
    print(f"engine built in {time.perf_counter() - start:.1f} s")
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1)
    passes = []
    for _ in range(2):
        times = []
        for n in lengths:
            prompt = [rng.randrange(vocab) for _ in range(n)]
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        passes.append(times)
    print(f"{args.count} prompts of {args.min_len}-{args.max_len} tokens, each length twice")
    print(f"{'tokens':>7} {'first s':>8} {'again s':>8}")
    for n, a, b in zip(lengths, *passes, strict=True):
        print(f"{n:>7} {a:>8.3f} {b:>8.3f}")
    first, again = passes
    print(f"TTFT median: first {statistics.median(first):.3f} s, again "
          f"{statistics.median(again):.3f} s; total: first {sum(first):.2f} s, again "
          f"{sum(again):.2f} s")


if __name__ == "__main__":
    main()
