"""Per-step metadata that reaches the attention layers without being threaded through forward().

The model runner enters one ForwardContext around a forward pass (`with forward_context(ctx):`).
Graph capture enters a context whose tensors are the graph's fixed-address inputs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

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
    attn_meta: AttentionMetadata | None = None  # set by the attention backend's prepare
    # a mixed step (prefill with decode rows riding along): its decode rows (the first tokens
    # and page-table rows) and its prompt chunks, each a context of its own kind
    parts: tuple[ForwardContext, ForwardContext] | None = None
    # decode with a CPU share of the streamed layers' attention: an attention/cpu_share.py
    # CpuShare (not imported: the context sits below the attention package)
    cpu_share: Any = None

    def prepared_parts(self) -> tuple[ForwardContext, ...]:
        """The contexts an attention backend prepares metadata for: the parts of a mixed step,
        else this one."""
        return self.parts or (self,)


class AttentionMetadata:
    """Base of each attention backend's own per-step metadata (a dataclass per backend)."""


_local = threading.local()  # per thread: two engines on two threads never see each other's


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """The context of one forward pass (or one graph capture), for this thread only. Forward
    passes do not nest: entering a second context is a bug, reported at once."""
    if getattr(_local, "ctx", None) is not None:
        raise RuntimeError("a forward context is already active on this thread")
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = None


def get_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    assert ctx is not None, "no forward context: call through the model runner"
    return ctx
