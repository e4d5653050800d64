"""Issue 14's targets in one process (one model load): a 32K document with every layer streamed;
TTFT of a first and a second question on it, and TPOT of one request vs 16 on the document.
python tools/probes/prefix_targets.py [--model Qwen3-8B] [--doc-len 32768] [--batch 16]"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nanoserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen3-8B")
    ap.add_argument("--doc-len", type=int, default=32768)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args()
    llm = LLM(a.model, dummy_weights=True, progress=False, enable_offload=True,
              resident_layers=0, max_num_seqs=a.batch,
              max_model_len=a.doc_len + a.question_len + a.output_len)
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    doc = torch.randint(0, vocab, (a.doc_len,), generator=g).tolist()
    questions = [torch.randint(0, vocab, (a.question_len,), generator=g).tolist()
                 for _ in range(a.batch + 2)]
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    streamer = llm.engine.kv.streamer

    def run(qs: list[list[int]]) -> dict:
        t0 = time.perf_counter()
        outs = llm.generate([doc + q for q in qs], params)
        wall = time.perf_counter() - t0
        return {"requests": len(qs), "ttft_s": max(o.ttft_s for o in outs),
                "tpot_ms": statistics.mean(o.tpot_s for o in outs) * 1e3,
                "cached_tokens": [o.num_cached_tokens for o in outs][:3],
                "h2d_GB_last_step": streamer.bytes_loaded / 1e9, "wall_s": wall}

    warm = torch.randint(0, vocab, (512,), generator=g).tolist()
    llm.generate(warm, SamplingParams(max_tokens=2))  # warm-up (kernels), none of doc's pages
    first, second = run(questions[:1]), run(questions[1:2])
    many = run(questions[2:2 + a.batch])
    print(json.dumps({"first": first, "second": second, "batch": many,
                      "ttft_second_vs_first": second["ttft_s"] / first["ttft_s"],
                      "tpot_batch_vs_one": many["tpot_ms"] / first["tpot_ms"]}, indent=1))


if __name__ == "__main__":
    main()
