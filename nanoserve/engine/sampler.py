"""Greedy, temperature, top-k and top-p sampling, with per-request seeds."""

from __future__ import annotations

import torch

from nanoserve.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [vocab] fp32. Masks out what top-k / top-p exclude (with -inf)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits: [batch, vocab] fp32 on any device. Returns one token id per row (one host sync)."""
    greedy = logits.argmax(-1)
    if all(p.greedy for p in params):
        return greedy.tolist()
    out = greedy.cpu()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = apply_top_k_top_p(logits[i].float() / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1).cpu()
        out[i] = torch.multinomial(probs, 1, generator=generators[i]).item()
    return out.tolist()
