"""A constrained decode step's host time in the engine, by function: the bench's --json-schema
run (batch 64 x 512, half the rows under BENCH_SCHEMA) with cProfile on only for the decode
steps (every running sequence has a token). Usage (GPU machine):
python3 tools/probes/grammar_steps.py [bench args]"""

import cProfile
import pstats
import sys

import bench_offload
from nanoserve.engine.engine import LLMEngine

profile = cProfile.Profile()
step = LLMEngine.step


def profiled_step(self):
    decoding = bool(self.scheduler.running) and \
        all(s.num_output_tokens > 0 for s in self.scheduler.running)
    if not decoding:
        return step(self)
    return profile.runcall(step, self)


LLMEngine.step = profiled_step
sys.argv = ["bench_offload.py", *(sys.argv[1:] or [
    "--model", "Qwen3-8B", "--input-len", "512", "--batch-size", "64", "--output-len", "64",
    "--resident-graph", "--json-schema"])]
bench_offload.main()
stats = pstats.Stats(profile)
stats.sort_stats("tottime").print_stats(20)
stats.sort_stats("cumulative").print_stats(30)
