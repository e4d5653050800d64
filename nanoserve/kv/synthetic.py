"""KV written instead of computed: a waiting prompt's full pages given KV as if a prefix cache
had served them, so only the rest of the prompt (less than a page and its last token) is
prefilled. The bench's `--synthetic-prefill` fills them with random values, for decode's speed
and memory at contexts whose prefill takes longer than a run can wait (1M tokens on an 80 GB
GPU, 2M on an H200); its test fills them with another engine's computed KV."""

from __future__ import annotations

import torch

from nanoserve.kv.fp8 import quantize
from nanoserve.kv.manager import KVManager
from nanoserve.kv.pages import OutOfPages

CHUNK_PAGES = 1024  # pages written at once (bounds the temporary copy)
PATTERN_PAGES = 64  # distinct random pages, repeated over the prompt


def tier_rows(kv: KVManager, layer: int) -> torch.Tensor:
    """Layer `layer`'s storage [2, pages, row], in the tier that holds it (the GPU's resident
    pool or the pinned host store)."""
    resident = kv.plan.resident_layers
    if layer < resident:
        return kv.resident[layer]
    return kv.streamer.host.data[layer - resident]


def claim_prompt_pages(kv: KVManager, seq) -> list[int]:
    """Gives a waiting `seq` the pages of its prompt's full pages but the one holding its last
    token, and marks their tokens computed (seq.num_cached): the pages its KV is to be written
    to. Empty for a prompt shorter than a page and a token. The pages count as already in the
    prefix cache (seq.num_pages_cached), so they never enter it: their KV is not its tokens'."""
    if seq.pages or seq.num_cached:
        raise ValueError("only a sequence that holds no pages yet can be given its prompt's")
    if seq.scores_prompt:
        raise ValueError("a prompt whose logprobs are asked for is computed whole")
    ps = kv.spec.page_size
    n = (seq.num_tokens - 1) // ps * ps
    if n and not kv.grow(seq, n):
        raise OutOfPages(f"{n // ps} pages for the prompt's KV; {kv.num_free} free")
    seq.num_cached = n
    seq.num_pages_cached = len(seq.pages)
    return list(seq.pages)


def random_pages(kv: KVManager, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """[2, num_pages, row] of random KV in the cache's format: normal values (FP8: quantized,
    with their scales), on the CPU."""
    spec = kv.spec
    rows = spec.empty(1, num_pages, torch.device("cpu"))[0]
    k, v, k_scale, v_scale = spec.views(rows)
    for values, scales in ((k, k_scale), (v, v_scale)):
        x = torch.randn(values.shape, generator=gen)
        if scales is None:
            values.copy_(x.to(values.dtype))
        else:
            q, s = quantize(x)
            values.view(torch.uint8).copy_(q.view(torch.uint8))
            scales.copy_(s)
    return rows


def fill_random(kv: KVManager, seq, seed: int = 0) -> int:
    """Random KV for a waiting `seq`'s prompt pages (claim_prompt_pages), every layer, in
    either tier; a pattern of PATTERN_PAGES pages repeats. Returns the tokens filled."""
    pages = claim_prompt_pages(kv, seq)
    if not pages:
        return 0
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor(pages, dtype=torch.long)
    for layer in range(kv.spec.num_layers):
        rows = tier_rows(kv, layer)
        pattern = random_pages(kv, min(PATTERN_PAGES, len(pages)), gen).to(rows.device)
        for lo in range(0, len(pages), CHUNK_PAGES):
            part = ids[lo:lo + CHUNK_PAGES]
            which = torch.arange(lo, lo + len(part)) % pattern.shape[1]
            rows[:, part.to(rows.device)] = pattern[:, which.to(rows.device)]
    return seq.num_cached
