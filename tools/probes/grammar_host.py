"""A constrained decode step's host work, part by part, at the bench's --json-schema shape:
`rows` sequences under BENCH_SCHEMA over byte_vocabulary at Qwen3's 151,936 tokens. Each step:
the allowed-token masks (one parallel call), their upload, and each grammar taking a token the
mask allows. Usage: python3 tools/probes/grammar_host.py [rows] [steps]"""

import random
import statistics
import sys
import time

import torch

from bench_offload import BENCH_SCHEMA
from nanoserve.engine.grammar import Grammars, allowed_token_masks, byte_vocabulary
from nanoserve.structured_outputs import StructuredOutputs

rows, steps = (int(a) for a in (sys.argv[1:] + ["32", "40"][len(sys.argv) - 1:])[:2])
V = 151936
grammars = Grammars(None, V, (V - 1,), ll_tokenizer=byte_vocabulary(V, V - 1))
seqs = [grammars.start(StructuredOutputs(json=BENCH_SCHEMA)) for _ in range(rows)]
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
rng = random.Random(0)
times: dict[str, list[float]] = {"masks": [], "upload": [], "accept": []}
for _ in range(steps):
    t0 = time.perf_counter()
    masks = allowed_token_masks(seqs, V)
    t1 = time.perf_counter()
    host = masks.pin_memory() if device.type == "cuda" else masks
    on_device = host.to(device, non_blocking=True)
    t2 = time.perf_counter()
    # a token each mask allows, among the first 300 ids (bytes and two-byte pieces)
    low = masks[:, :10].numpy()
    picks = [[k for k in range(300) if (int(low[i, k // 32]) >> (k % 32)) & 1]
             for i in range(rows)]
    t3 = time.perf_counter()
    for seq, ok in zip(seqs, picks, strict=True):
        if not seq.done:
            seq.accept(rng.choice([k for k in ok if k != 34] or ok) if ok else V - 1)
    t4 = time.perf_counter()
    times["masks"].append(t1 - t0)
    times["upload"].append(t2 - t1)
    times["accept"].append(t4 - t3)
del on_device
print(f"{rows} rows, {steps} steps, {torch.get_num_threads()} torch threads")
for k, v in times.items():
    print(f"  {k:7s} median {statistics.median(v) * 1e3:7.3f} ms   max {max(v) * 1e3:7.3f} ms")
