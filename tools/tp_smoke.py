"""Tensor parallelism, stage by stage, with timings: TP=N engines on the embedded model (eager,
then with decode graphs, then offloaded) against TP=1's greedy tokens. A stage that hangs
prints rank 0's Python stack after --hang-s seconds (faulthandler) and the process exits.
Usage (GPUs): python tools/tp_smoke.py [--tp 2] [--hang-s 120]
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time

from nanoserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(300 + 50 * i)] for i in range(4)]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--hang-s", type=float, default=120)
    ap.add_argument("--stages", default="eager,graphs,offload", help="which TP engines to run")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.hang_s, exit=True)
    # each worker prints its own stacks shortly before rank 0 gives up (workers.worker_main)
    os.environ["NANOSERVE_TP_HANG_DUMP_S"] = str(max(1.0, args.hang_s - 15))
    with LLM(progress=False, max_model_len=2048, max_num_seqs=4) as llm:
        ref = tokens(llm)
    print("TP=1 done", flush=True)
    stages = {"eager": dict(enforce_eager=True), "graphs": {},
              "offload": dict(enable_offload=True, resident_layers=1),
              "offload-eager": dict(enable_offload=True, resident_layers=1, enforce_eager=True)}
    for name in args.stages.split(","):
        kw = stages[name]
        faulthandler.dump_traceback_later(args.hang_s, exit=True)
        t0 = time.perf_counter()
        with LLM(progress=False, max_model_len=2048, max_num_seqs=4,
                 tensor_parallel_size=args.tp, **kw) as llm:
            built = time.perf_counter() - t0
            out = tokens(llm)
        same = sum(a == b for a, b in zip(out, ref, strict=True))
        total = time.perf_counter() - t0
        print(f"TP={args.tp} {name}: built in {built:.1f} s, total {total:.1f} s,"
              f" {same}/{len(ref)} greedy answers equal TP=1's", flush=True)
    faulthandler.cancel_dump_traceback_later()
    sys.exit(0)


if __name__ == "__main__":
    main()
