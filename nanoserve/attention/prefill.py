"""Prefill attention through flash-class kernels, for every chunk.

A chunk of T new tokens after P cached ones attends to the prefix (every key visible) and to
itself (causal). One kernel call over prefix + chunk needs a bottom-right causal mask, which on
an H200 only FA2 and the memory-efficient kernel take (~330 TFLOP/s). So the two halves run
apart, each through cuDNN's Hopper kernel with its log-sum-exp (~590 TFLOP/s, GQA native), and
are merged by their log-sum-exps. Measured by tools/probes/bench_attention.py; docs/perf-notes.md.

cuDNN builds an execution plan for each new shape (45-85 ms on an H200, once per process), so a
small chunk with a prefix, whose attention takes less than a plan build, goes through torch's
SDPA with the bottom-right causal mask instead (FA2 or the memory-efficient kernel, no plans):
a short question after a long cached document, say. A fresh prompt's causal attention goes to
cuDNN either way (SDPA picks it too). Its queries are padded to one of four lengths per octave
(`padded_rows`), so that prompts of every length share a few dozen plans rather than building
one each, and the engine builds those at start (`build_causal_plans`). torch keys a plan by
shapes and strides (cuDNN gets contiguous q, k, v, as at start) and caches it per thread: the
thread that runs the engine's steps builds them (LLMEngine.prepare_thread).

A step of many short fresh prompts (no prefix) goes through one FA2 varlen call instead of a
call per prompt: 2.3x faster at 16 x 512 tokens, where each per-prompt call fills few SMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from tqdm import tqdm

from nanoserve.context import ForwardContext
from nanoserve.fused import fused
from nanoserve.kv.fp8 import dequantize

aten = torch.ops.aten

# a chunk with a prefix splits in two (cuDNN) when T * (P + T) is at least this: 8192-token chunks
# always do; a 1024-token chunk from a 64K prefix on
SPLIT_MIN_WORK = 1 << 26
# fresh prompts at most this long, two or more in a step, share one varlen call
VARLEN_MAX_LEN = 1024


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, d] -> [1, heads, tokens, d], a view."""
    return x.transpose(0, 1).unsqueeze(0)


def padded_rows(t: int) -> int:
    """t rounded up to a multiple of a quarter of its octave (at least 32): 1000 -> 1024, 3000
    -> 3072, 5000 -> 5120; 8192 stays. From 128 tokens on at most 25% more rows (a causal
    attention's work grows by up to 1.56x: 4097 -> 5120), four plan shapes per octave."""
    step = 1 << max(5, t.bit_length() - 3)
    return -(-t // step) * step


def pad_queries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero rows after the T real queries, up to padded_rows(T), and as many after the keys when
    causal (T == S). A real query i sees exactly what it saw: causal from the top left, keys 0
    to i are all real; without a mask, the keys are untouched. The padding rows' outputs are
    dropped. All three come back contiguous (v is a view into the qkv projection)."""
    extra = padded_rows(q.shape[0]) - q.shape[0]
    if extra == 0:
        return q.contiguous(), k.contiguous(), v.contiguous()
    pad = (0, 0, 0, 0, 0, extra)
    if causal:
        k, v = F.pad(k, pad), F.pad(v, pad)
    return F.pad(q, pad), k, v


def causal_plan_lengths(max_tokens: int) -> list[int]:
    """Every padded length a fresh prompt's chunk of 1..max_tokens tokens takes."""
    lengths, t = [], 1
    while t <= max_tokens:
        lengths.append(padded_rows(t))
        t = lengths[-1] + 1
    return lengths


def build_causal_plans(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device, max_tokens: int, progress: bool = True) -> None:
    """Builds, on this thread, cuDNN's plan for every padded length a fresh prompt's chunk of
    up to max_tokens can take (28 lengths up to 8192 tokens, 45-85 ms each on an H200), so
    that no fresh chunk run on this thread pays one. Nothing to build where attention_with_lse
    does not use cuDNN."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return
    lengths = causal_plan_lengths(max_tokens)
    q = torch.zeros(lengths[-1], num_heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(lengths[-1], num_kv_heads, head_dim, dtype=dtype, device=device)
    for t in tqdm(lengths, desc="Building prefill attention plans", disable=not progress):
        attention_with_lse(q[:t], kv[:t], kv[:t], True, 1.0)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [T, H, d] over k, v [S, Hkv, d], causal (top-left, T == S) or not, and
    its natural log-sum-exp per head and query, float32 [H, T]."""
    t, h = q.shape[0], q.shape[1]
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        q, k, v = pad_queries(q, k, v, causal)  # a plan per padded shape, not per length
        out = aten._scaled_dot_product_cudnn_attention(_bhsd(q), _bhsd(k), _bhsd(v), None, True,
                                                       0.0, causal, False, scale=scale)
        o, lse = out[0], out[1]
    else:
        rep = h // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if q.is_cuda:
            o, lse = aten._scaled_dot_product_efficient_attention(
                _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, causal, scale=scale)[:2]
        else:
            o, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale)
    # lse is [1, H, T], [1, H, T, 1] or padded to [1, H, T'] with T' >= T, by kernel
    return o[0].transpose(0, 1)[:t], lse.reshape(h, -1)[:, :t]


@fused
def merge_partials(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                   lse2: torch.Tensor) -> torch.Tensor:
    """Two attentions of the same queries over disjoint keys ([T, H, d], LSE [T, H]) as one."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_prefix: torch.Tensor,
                    v_prefix: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk's queries over its prefix's keys (all visible) and its own (causal)."""
    t, p = q.shape[0], k_prefix.shape[0]
    if 0 < p and t * (p + t) < SPLIT_MIN_WORK:
        return _one_kernel(q, torch.cat([k_prefix, k]), torch.cat([v_prefix, v]), scale)
    o, lse = attention_with_lse(q, k, v, True, scale)
    if p == 0:
        return o
    op, lsep = attention_with_lse(q, k_prefix, v_prefix, False, scale)
    # contiguous [T, H], the layout the merge was compiled for at start (a strided one would
    # compile it again inside a request)
    return merge_partials(op, lsep.t().contiguous(), o, lse.t().contiguous())


def _one_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, d] over k, v [P + T, Hkv, d], causal from the bottom-right corner, in one SDPA
    call (heads expanded: the masked kernels take no GQA)."""
    t, rep = q.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v), scale=scale,
                                       attn_mask=causal_lower_right(t, k.shape[0]))
    return o[0].transpose(0, 1)


def gather_kv(cache: torch.Tensor, pages: torch.Tensor, length: int,
              scales: torch.Tensor | None = None, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """A sequence's first `length` tokens from the paged cache, as [length, kv_heads, d] in
    `dtype` (default: the cache's); an FP8 cache with its `scales` is dequantized."""
    n = (length + cache.shape[1] - 1) // cache.shape[1]
    if scales is None:
        kv = cache.index_select(0, pages[:n]).flatten(0, 1)[:length]
        return kv if dtype is None else kv.to(dtype)
    values = cache.view(torch.uint8).index_select(0, pages[:n]).view(cache.dtype)
    return dequantize(values.flatten(0, 1)[:length],
                      scales.index_select(0, pages[:n]).flatten(0, 1)[:length], dtype)


def read_kv(layer, slot_mapping: torch.Tensor, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [tokens, kv_heads, d] of the step's new tokens as `layer`'s cache holds them,
    dequantized, in `dtype`."""
    page_size = layer.k_cache.shape[1]
    page, offset = slot_mapping // page_size, slot_mapping % page_size

    def read(cache: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        if scales is None:
            return cache[page, offset].to(dtype)
        values = cache.view(torch.uint8)[page, offset].view(cache.dtype)
        return dequantize(values, scales[page, offset], dtype)

    return read(layer.k_cache, layer.k_scale), read(layer.v_cache, layer.v_scale)


def paged_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer,
                  ctx: ForwardContext) -> torch.Tensor:
    """Each sequence's chunk over its prefix in `layer`'s paged cache and over itself. Prefill
    is compute-bound: the loop over sequences costs nothing measurable."""
    out = torch.empty_like(q)
    start = 0
    for i, (qlen, plen) in enumerate(zip(ctx.query_lens, ctx.prefix_lens, strict=True)):
        end = start + qlen
        pages = ctx.page_tables[i]
        kp = gather_kv(layer.k_cache, pages, plen, layer.k_scale, q.dtype)
        vp = gather_kv(layer.v_cache, pages, plen, layer.v_scale, q.dtype)
        out[start:end] = chunk_attention(q[start:end], k[start:end], v[start:end], kp, vp,
                                         layer.scale)
        start = end
    return out


def use_varlen(ctx: ForwardContext) -> bool:
    """Whether a CUDA prefill step is many short fresh prompts (see varlen_prefill)."""
    return (len(ctx.query_lens) > 1 and not any(ctx.prefix_lens)
            and max(ctx.query_lens) <= VARLEN_MAX_LEN)


def varlen_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                   max_len: int, scale: float) -> torch.Tensor:
    """Fresh prompts packed back to back (offsets `cu_seqlens`, int32 on the device), each
    causal over itself, in one FA2 varlen call (CUDA, half precision)."""
    return aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0,
                                         True, False, scale=scale)[0]
