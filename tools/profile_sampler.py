"""Times the batched sampler on the device (CUDA events, median of repeats), per configuration:
python tools/profile_sampler.py --batch-size 64 --vocab 151936"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from nanoserve import SamplingParams
from nanoserve.cuda_timing import median_ms
from nanoserve.engine.sampler import build_sampling_tensors, sample

CONFIGS = {
    "greedy": SamplingParams(temperature=0.0),
    "t0.8 top_p0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "t1.0 top_k50": SamplingParams(temperature=1.0, top_k=50),
    "t1.0": SamplingParams(temperature=1.0),
    "t0.8 min_p0.05": SamplingParams(temperature=0.8, min_p=0.05),
    "t0.8 top_p0.95 logprobs5": SamplingParams(temperature=0.8, top_p=0.95, logprobs=5),
    "t0.8 penalties": SamplingParams(temperature=0.8, presence_penalty=0.5,
                                     frequency_penalty=0.5, repetition_penalty=1.1),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--profile", default="t0.8 top_p0.95",
                    help="configuration whose kernels the torch profiler lists")
    a = ap.parse_args()
    dev = torch.device("cuda")
    logits = (torch.randn(a.batch_size, a.vocab, device=dev) * 4).to(torch.bfloat16).float()
    ids = torch.randint(0, a.vocab, (a.context,)).tolist()
    for name, p in CONFIGS.items():
        seqs = [SimpleNamespace(params=p, seed=i, seq_id=i, token_ids=ids, num_tokens=len(ids),
                                num_prompt_tokens=512) for i in range(a.batch_size)]

        def step(seqs=seqs):  # a bf16 model's logits: sorted as bf16, as the engine does
            sample(logits, build_sampling_tensors(seqs, a.vocab, dev, pin=True),
                   torch.bfloat16)

        step()
        print(f"{name:28s} {median_ms(step, reps=50):7.3f} ms per step (batch {a.batch_size})")
        if name == a.profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    step()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18,
                                            max_name_column_width=60))
    print(f"{'torch.sort alone':28s} "
          f"{median_ms(lambda: torch.sort(logits, dim=-1, descending=True), reps=50):7.3f} ms")
    topk = median_ms(lambda: torch.topk(logits, 50, dim=-1), reps=50)
    print(f"{'torch.topk(50) alone':28s} {topk:7.3f} ms")


if __name__ == "__main__":
    main()
