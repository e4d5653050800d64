"""Per-step metadata that reaches the attention layers without being threaded through forward().

The model runner sets one ForwardContext before a forward pass and clears it after. Graph capture
sets a context whose tensors are the graph's fixed-address inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardContext:
    is_prefill: bool
    slot_mapping: torch.Tensor  # on device, [num_tokens]: flat KV slot of each new token
    page_tables: torch.Tensor  # on device, [batch, max_pages]: KV pages of each sequence
    # prefill only
    query_lens: list[int] = field(default_factory=list)  # on cpu: new tokens per sequence
    prefix_lens: list[int] = field(default_factory=list)  # on cpu: tokens cached before this step
    # decode only
    context_lens: torch.Tensor | None = None  # on device, [batch]: tokens incl. the new one
    attn_meta: object = None  # owned by the attention backend


_CONTEXT: ForwardContext | None = None


def set_context(ctx: ForwardContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> ForwardContext:
    assert _CONTEXT is not None, "no forward context set: call through the model runner"
    return _CONTEXT
