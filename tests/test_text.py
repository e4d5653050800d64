"""Counts and sizes in messages: "1 page", never "1 pages"."""

from __future__ import annotations

import torch

from nanoserve.kv.manager import KVBudget, KVManager
from nanoserve.kv.spec import KVSpec
from nanoserve.text import format_bytes, plural


def test_plural_says_one_page_and_two_pages():
    assert [plural(n, "page") for n in (0, 1, 2, 1024)] == \
        ["0 pages", "1 page", "2 pages", "1,024 pages"]


def test_format_bytes_picks_the_decimal_unit():
    assert [format_bytes(n) for n in (1, 512, 1000, 25_952_256, 2.57e9)] == \
        ["1 byte", "512 bytes", "1.00 kB", "25.95 MB", "2.57 GB"]


def test_a_one_page_one_layer_kv_cache_is_described_in_the_singular():
    spec = KVSpec(1, 1, 1, 8, torch.float32)  # 1 layer, 1-token pages
    # two pages: the dummy page and one usable page
    budget = KVBudget(2 * spec.page_bytes(), 0, False, 1, 1, 2)
    kv = KVManager(spec, budget, torch.device("cpu"))
    assert kv.describe() == ("KV cache (float32, 64 bytes per token): 1 page of 1 token = "
                             "1 token; all 1 layer resident: KV fits the device, nothing "
                             "streams")


def test_the_kv_cache_says_when_one_max_length_sequence_cannot_fit():
    """9 pages of 4 tokens (8 usable) hold 31 tokens of a prompt and its next token: 31 fits
    and 32 does not, with the fix for each kind of budget."""
    spec = KVSpec(2, 4, 1, 8, torch.float32)
    resident = KVManager(spec, KVBudget(9 * spec.page_bytes(), 0, False, 1, 8, 2),
                         torch.device("cpu"))
    assert resident.shortfall(31) is None
    assert resident.shortfall(32) == (
        "the KV cache holds 31 tokens, fewer than max_model_len (32): the GPU KV budget "
        f"({9 * spec.page_bytes() / 2**30:.4g} GiB) bound it; longer prompts will be refused "
        "(raise --gpu-memory-utilization, or --enable-offload to keep KV in host memory)")
    offloaded = KVManager(spec, KVBudget(2**30, 9 * spec.page_bytes(), True, 1, 100, 2, 0),
                          torch.device("cpu"))
    assert offloaded.capacity == 8  # every layer streamed: the host holds 9 pages (1 dummy)
    assert offloaded.shortfall(100).endswith(
        "longer prompts will be refused (raise --host-kv-budget or --gpu-memory-utilization)")
