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

A long prefix is read and attended in pieces of PREFIX_PIECE tokens, merged by log-sum-exp:
its gather (FP8 dequantized to the model's dtype) takes bounded memory at any context, where a
2M-token prefix read whole took 13 GB of temporaries a layer, and a long prompt's chunks share
plans: every full piece has one shape, and the last piece's length (the prefix modulo the
piece, a multiple of the chunk) takes PREFIX_PIECE / chunk values over a whole prompt, where
the prefix read whole took a new length, and a plan build, at every chunk. A piece is one
cuDNN call: calls over 64K keys (a kv head's K and V in L2) ran 10% faster in a burst
(tools/probes/prefix_attention_rate.py), but not at the power cap a long prefill runs at
(H200, 256K tokens: TTFT 36.8 s either way; tools/probes/sustained_rate.py).

A step of many short fresh prompts (no prefix) goes through one FA2 varlen call instead of a
call per prompt: 2.3x faster at 16 x 512 tokens, where each per-prompt call fills few SMs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

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
# a prefix is read and attended this many tokens at a time (module docstring): a piece's
# gather takes at most 0.8 GB (FP8 cache, 8 KV heads of 128), its partials are merged in float32
PREFIX_PIECE = 1 << 17

# reads a prefix's tokens [lo, hi) as K and V [hi - lo, kv_heads, d] in the model's dtype
PrefixReader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


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
                       scale: float, planless: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [T, H, d] over k, v [S, Hkv, d], causal (top-left, T == S) or not, and
    its natural log-sum-exp per head and query, float32 [H, T]. `planless`: not through cuDNN
    (a new shape's plan costs more than the call's work), heads expanded."""
    t, h = q.shape[0], q.shape[1]
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and not planless:
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


@fused
def merge_with_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """merge_partials kept in float32, with the merged log-sum-exp: for more than two parts."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return o1 * w1 + o2.float() * w2, lse


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_prefix: torch.Tensor,
                    v_prefix: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk's queries over its prefix's keys (all visible) and its own (causal)."""
    return attend_after_prefix(q, k, v, k_prefix.shape[0],
                               lambda lo, hi: (k_prefix[lo:hi], v_prefix[lo:hi]), scale)


def attend_after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                        read_prefix: PrefixReader, scale: float) -> torch.Tensor:
    """A chunk's queries [T, H, d] over its prefix of `prefix_len` tokens (all visible, read in
    pieces of PREFIX_PIECE) and over its own keys [T, Hkv, d] (causal)."""
    t, p = q.shape[0], prefix_len
    small = t * (p + t) < SPLIT_MIN_WORK  # less work than a cuDNN plan build
    if 0 < p <= PREFIX_PIECE and small:
        k_prefix, v_prefix = read_prefix(0, p)
        return _one_kernel(q, torch.cat([k_prefix, k]), torch.cat([v_prefix, v]), scale)
    o, lse = attention_with_lse(q, k, v, True, scale)
    if p == 0:
        return o
    # contiguous [T, H], the layout the merges were compiled for at start (a strided one would
    # compile them again inside a request)
    lse = lse.t().contiguous()
    parts = None
    for op, lsep in _over_prefix(q, p, read_prefix, scale):
        parts = (op, lsep) if parts is None else merge_with_lse(*parts, op, lsep)
    return merge_partials(o, lse, *parts)


def _over_prefix(q: torch.Tensor, prefix_len: int, read_prefix: PrefixReader, scale: float
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """q's attention over each PREFIX_PIECE of its prefix (all visible) and its log-sum-exp,
    contiguous [T, H]."""
    t = q.shape[0]
    for lo in range(0, prefix_len, PREFIX_PIECE):
        hi = min(prefix_len, lo + PREFIX_PIECE)
        k_prefix, v_prefix = read_prefix(lo, hi)
        # a full piece's shape recurs (its plan is built once); a short last one's may not
        op, lsep = attention_with_lse(q, k_prefix, v_prefix, False, scale,
                                      planless=hi - lo < PREFIX_PIECE and
                                      t * (hi - lo) < SPLIT_MIN_WORK)
        yield op, lsep.t().contiguous()


def _one_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, d] over k, v [P + T, Hkv, d], causal from the bottom-right corner, in one SDPA
    call (heads expanded: the masked kernels take no GQA)."""
    t, rep = q.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v), scale=scale,
                                       attn_mask=causal_lower_right(t, k.shape[0]))
    return o[0].transpose(0, 1)


def gather_kv(cache: torch.Tensor, pages: torch.Tensor, length: int,
              scales: torch.Tensor | None = None, dtype: torch.dtype | None = None,
              start: int = 0) -> torch.Tensor:
    """A sequence's tokens [start, length) from the paged cache, as [length - start, kv_heads,
    d] in `dtype` (default: the cache's); an FP8 cache with its `scales` is dequantized."""
    size = cache.shape[1]
    first, n = start // size, (length + size - 1) // size
    tokens = slice(start - first * size, length - first * size)
    if scales is None:
        kv = cache.index_select(0, pages[first:n]).flatten(0, 1)[tokens]
        return kv if dtype is None else kv.to(dtype)
    values = cache.view(torch.uint8).index_select(0, pages[first:n]).view(cache.dtype)
    return dequantize(values.flatten(0, 1)[tokens],
                      scales.index_select(0, pages[first:n]).flatten(0, 1)[tokens], dtype)


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
                  ctx: ForwardContext, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each sequence's chunk over its prefix in `layer`'s paged cache and over itself, into
    `out` where given (a mixed step's rows after its decode rows). Prefill is compute-bound:
    the loop over sequences costs nothing measurable. One sequence and no `out`: its attention
    is returned as computed, not copied into another tensor (a 0.5 GB round trip a layer at
    32K tokens of 32 heads)."""
    if out is None and len(ctx.query_lens) == 1:
        return _sequence_prefill(q, k, v, layer, ctx, 0)
    out = torch.empty_like(q) if out is None else out
    start = 0
    for i, (qlen, _) in enumerate(zip(ctx.query_lens, ctx.prefix_lens, strict=True)):
        end = start + qlen
        out[start:end] = _sequence_prefill(q[start:end], k[start:end], v[start:end], layer,
                                           ctx, i)
        start = end
    return out


def _sequence_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer,
                      ctx: ForwardContext, i: int) -> torch.Tensor:
    """Sequence i's chunk q, k, v over its prefix in `layer`'s paged cache and over itself."""
    pages = ctx.page_tables[i]

    def read(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (gather_kv(layer.k_cache, pages, hi, layer.k_scale, q.dtype, lo),
                gather_kv(layer.v_cache, pages, hi, layer.v_scale, q.dtype, lo))

    return attend_after_prefix(q, k, v, ctx.prefix_lens[i], read, layer.scale)


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
