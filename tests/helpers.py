"""Test-only helpers that reach into the engine to get all-position logits."""

from __future__ import annotations

import torch

from nanoserve.context import forward_context
from nanoserve.kv.pages import pages_needed


@torch.inference_mode()
def engine_prefill_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """Logits of every position of one prompt, prefilled in a single step."""
    runner = llm.engine.runner
    alloc = llm.engine.allocator
    pages = alloc.allocate(pages_needed(len(token_ids), runner.page_size))
    try:
        ctx = runner._prefill_context([pages], [0], [len(token_ids)])
        runner.backend.prepare(ctx)
        dev = runner.device
        with forward_context(ctx):
            hidden = runner.model(torch.tensor(token_ids, device=dev),
                                  torch.arange(len(token_ids), device=dev))
        return runner.model.compute_logits(hidden).cpu()
    finally:
        alloc.free(pages)
