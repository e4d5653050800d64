"""What one tensor-parallel rank runs in tests/test_tp_model.py (and what TP=1 runs in the test
process): build and fill a model, prefill prompts over a paged KV cache, return the logits.
Imports nanoserve only, so that a spawned rank starts quickly."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch

from nanoserve.attention import select_backend
from nanoserve.context import forward_context
from nanoserve.distributed.parallel_state import destroy_tp, init_tp
from nanoserve.engine.scheduler import Batch
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.step_inputs import StepInputBuilder
from nanoserve.kv.manager import bind_kv
from nanoserve.kv.pages import pages_needed
from nanoserve.kv.spec import KVSpec
from nanoserve.models.config import ModelConfig
from nanoserve.models.loader import load_model
from nanoserve.sampling_params import SamplingParams

PAGE_SIZE = 4
MAX_LEN = 64
CPU = torch.device("cpu")


@torch.inference_mode()
def prefill_logits(model_dir: Path, prompts: list[list[int]], dummy_weights: bool = False,
                   moe_backend: str = "auto") -> dict:
    """Logits of every position of `prompts`, prefilled in one batch (fp32, CPU, the torch
    attention backend over paged KV of this rank's KV heads), and the rank's parameter count."""
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, MAX_LEN, torch.float32, CPU, dummy_weights=dummy_weights,
                       progress=False)
    model.set_moe_backend(moe_backend)
    spec = KVSpec(cfg.num_layers, PAGE_SIZE, cfg.local_kv_heads(), cfg.head_dim, torch.float32)
    seqs, next_page = [], 1  # page 0 stays unused, as in the engine's profiling prefill
    for ids in prompts:
        seq = Sequence(ids, SamplingParams(max_tokens=1))
        n = pages_needed(len(ids), PAGE_SIZE)
        seq.pages, next_page = list(range(next_page, next_page + n)), next_page + n
        seqs.append(seq)
    kv = spec.empty(cfg.num_layers, next_page, CPU)
    bind_kv(model.attention_layers, spec, kv)
    backend = select_backend("torch", CPU)
    for attn in model.attention_layers:
        attn.backend = backend
    inputs = StepInputBuilder(PAGE_SIZE, CPU).build(Batch(True, seqs, [len(p) for p in prompts]))
    ctx = inputs.context()
    backend.prepare(ctx)
    with forward_context(ctx):
        logits = model.head(model(inputs.input_ids, inputs.positions))
    return {"logits": logits, "params": sum(p.numel() for p in model.parameters())}


def run_rank(rank: int, size: int, init_method: str, jobs: list[tuple], out_dir: Path) -> None:
    """One rank: joins the TP group, runs every job (name, model_dir, prompts, dummy_weights,
    moe_backend)
    and writes `{name}.{rank}.pt`, or `{name}.{rank}.err` with the ValueError or KeyError
    raised (a refusal); anything else ends the rank with `{rank}.crash`."""
    torch.set_num_threads(1)
    try:
        init_tp(rank, size, init_method, CPU)
        for name, model_dir, *args in jobs:
            try:
                result = prefill_logits(model_dir, *args)
            except (ValueError, KeyError) as e:
                (out_dir / f"{name}.{rank}.err").write_text(str(e))
                continue
            torch.save(result, out_dir / f"{name}.{rank}.pt")
        destroy_tp()
    except BaseException:
        (out_dir / f"{rank}.crash").write_text(traceback.format_exc())
        raise
