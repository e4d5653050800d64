"""What scoring a prompt (SamplingParams.prompt_logprobs, the server's echo) adds to its prefill:
TTFT of one prompt with and without scoring, in one engine, against the head's FLOP floor
(2 x rows x hidden x vocab at the measured bf16 matmul rate), and where the difference goes:
the head calls on the device (timed with synchronizations, in a separate pass) and the host's
reading of the scores into TokenLogprobs.

    python tools/probes/prompt_scoring.py [--model Qwen3-8B] [--input-len 32768] (GPU)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine import model_runner, step_executor


def ttft_s(llm: LLM, ids: list[int], params: SamplingParams, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        llm.generate(ids, params)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="Qwen3-8B")
    ap.add_argument("--input-len", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, dummy_weights=True, max_model_len=args.input_len + 16,
              enable_prefix_caching=False, progress=False)
    ids = torch.randint(0, llm.engine.model_config.vocab_size, (args.input_len,)).tolist()
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    scored = plain.replace(prompt_logprobs=1)
    llm.generate(ids, scored)  # warm: the scoring path's shapes
    base, score = ttft_s(llm, ids, plain, args.reps), ttft_s(llm, ids, scored, args.reps)
    spent = {"head": 0.0, "read": 0.0}

    def timed(name, fn, sync):
        def wrapper(*a, **k):
            if sync:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*a, **k)
            if sync:
                torch.cuda.synchronize()
            spent[name] += time.perf_counter() - start
            return out
        return wrapper

    model_runner.read_scores = timed("read", model_runner.read_scores, False)
    ttft_s(llm, ids, scored, 1)
    step_executor.score_rows = timed("head", step_executor.score_rows, True)
    ttft_s(llm, ids, scored, 1)
    print(f"per scored prompt: host reading {spent['read'] / 2 * 1e3:.1f} ms, head calls "
          f"{spent['head'] * 1e3:.1f} ms (synchronized)")
    cfg = llm.engine.model_config
    flops = 2 * (args.input_len - 1) * cfg.hidden_size * cfg.vocab_size
    rate = matmul_tflops()
    floor_s = flops / rate / 1e12
    print(f"{args.model} {args.input_len} tokens: TTFT {base:.3f} s, scored {score:.3f} s: "
          f"+{(score - base) * 1e3:.1f} ms; the head over every row: {flops / 1e12:.1f} TFLOP, "
          f"{floor_s * 1e3:.1f} ms at {rate:.0f} TFLOP/s ({(score - base) / floor_s:.2f}x)")


if __name__ == "__main__":
    main()
