"""FP8 (e4m3) KV: each token's K (and V) values of one kv head share one float32 scale,
scale = max(|x|) / 448, so the largest value of every (token, head) maps to e4m3's largest.

Why per token and kv head, not per page and head: a page fills one token per decode step, so a
page scale would be unknown until the page is full (or its earlier tokens would need
re-quantizing as it grows); a token's scale is final when the token is stored, by the same
kernel that stores it. It is also the more accurate of the two: on the embedded model's K/V
(tools/fp8_accuracy.py; README, "FP8 KV cache") the attention output's error against float32
K/V is 2.9-6.7% per layer with a scale per token, 3.5-7.8% with one per page of 256 tokens
(bf16 K/V: 0.2-0.5%), since one outlier token sets a whole page's resolution. The cost is
4 bytes per 128 values (3%).

`quantize` and `store` are the reference; the CUDA store kernel (attention/triton_kv_store.py,
chosen by attention/backend.store_fp8_kv) gives the same bytes: both divide in IEEE float32 and
round to nearest even. The format's constants are in kv/fp8_format.py, which both sides import.
"""

from __future__ import annotations

import torch

from nanoserve.fused import fused
from nanoserve.kv.fp8_format import FP8, FP8_MAX, MIN_SCALE


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> e4m3 values [..., head_dim] and float32 scales [...]."""
    x = x.float()
    scale = (x.abs().amax(-1) / FP8_MAX).clamp(min=MIN_SCALE)
    values = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scale


@fused
def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 values [..., head_dim] times their scales [...], in float32, rounded once to
    `dtype` (on CUDA one fused kernel, no float32 copy of a gathered prefix)."""
    return (values.float() * scales.unsqueeze(-1)).to(dtype)


def store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantizes the new tokens' K, V [tokens, kv_heads, head_dim] into their slots of the
    caches (values [pages, page_size, kv_heads, head_dim], scales [pages, page_size,
    kv_heads]): the reference, on any device, of the fused CUDA store kernel."""
    page, offset = slot_mapping // k_cache.shape[1], slot_mapping % k_cache.shape[1]
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        values, scale = quantize(x)
        cache.view(torch.uint8)[page, offset] = values.view(torch.uint8)
        scales[page, offset] = scale
