"""The attention backend interface, and the pieces every backend shares."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from nanoserve.attention.prefill import build_causal_plans, read_kv
from nanoserve.context import ForwardContext, get_context
from nanoserve.kv import fp8


class AttentionBackend(ABC):
    """Computes attention for one layer over its paged KV source (`layer.k_cache/v_cache`).

    Graph hooks: `prepare_capture` runs while capturing a decode graph of batch size `bs` and
    must leave all per-step state at fixed addresses; `prepare_replay` refreshes that state
    from the step's context before each replay.
    """

    name: str
    supports_graphs: bool = False
    merges_cpu_share: bool = True  # decode_partial and merge_decode exist (CPU attention)

    def configure(self, num_kv_heads: int, max_len: int) -> None:
        """Model facts the backend sizes its metadata by; called once by the model runner."""
        return None

    def prepare(self, ctx: ForwardContext) -> None:
        """Backend metadata for an eager step (stored in ctx.attn_meta); a mixed step's parts
        are prepared one by one (ForwardContext.prepared_parts)."""
        return None

    def build_prefill_plans(self, num_heads: int, num_kv_heads: int, head_dim: int,
                            dtype: torch.dtype, device: torch.device, max_tokens: int,
                            progress: bool) -> None:
        """Whatever prefill builds per shape, built at start for chunks of up to max_tokens:
        cuDNN's plans of the shared prefill path (attention/prefill.py)."""
        build_causal_plans(num_heads, num_kv_heads, head_dim, dtype, device, max_tokens,
                           progress)

    def build_decode_kernels(self, num_heads: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype, kv_dtype: torch.dtype,
                             device: torch.device) -> None:
        """Whatever decode builds or loads at first use (a compiled extension), built and
        run once at start: not inside a request, and not while a CUDA graph captures."""
        return None

    def prepare_capture(self, ctx: ForwardContext, bs: int) -> None:
        self.prepare(ctx)

    def prepare_replay(self, ctx: ForwardContext, bs: int) -> None:
        """Default: backends whose metadata is only the context's own fixed tensors."""
        return None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, layer) -> torch.Tensor:
        """q: [tokens, heads, d]; k, v: [tokens, kv_heads, d], q and k before the rotary
        embedding. Rotates q, k and writes k, v into the cache first.

        A cache that stores K/V in another dtype (FP8, or bf16 under an fp32 model) is lossy:
        a prefill chunk then attends to its own K/V as stored, as decode does, so a token's
        attention never depends on which chunk (or which request, for a reused prefix)
        computed the keys it sees. (vLLM lets a chunk see its own K/V unquantized instead.)"""
        ctx = get_context()
        q, k = self.rotate_and_store(positions, q, k, v, layer, ctx.slot_mapping)
        if ctx.is_prefill and layer.k_cache.dtype != k.dtype:
            k, v = read_kv(layer, ctx.slot_mapping, k.dtype)
        if ctx.parts is not None:
            return self.mixed(q, k, v, layer, *ctx.parts)
        if ctx.is_prefill:
            return self.prefill(q, k, v, layer, ctx)
        if ctx.cpu_share is not None and layer.host_layer is not None:
            return self.split_decode(q, layer, ctx)
        return self.decode(q, layer, ctx)

    def mixed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer,
              decode: ForwardContext, prefill: ForwardContext) -> torch.Tensor:
        """A mixed step: its decode rows (the first ones) and its prefill chunks, each written
        into its rows of one output, not concatenated after (26 ms of copies in
        Qwen3-30B-A3B's 32 x 4,096 prefill on an H200, session 35)."""
        n = decode.slot_mapping.shape[0]
        out = torch.empty_like(q)
        self.decode(q[:n], layer, decode, out=out[:n])
        self.prefill(q[n:], k[n:], v[n:], layer, prefill, out=out[n:])
        return out

    def split_decode(self, q, layer, ctx: ForwardContext) -> torch.Tensor:
        """Decode of a streamed layer whose rows' leading tokens the CPU attends from the host
        store (attention/cpu_share.py): q to the host, the GPU's share enqueued, the CPU's
        share, then the merge by log-sum-exp."""
        share = ctx.cpu_share
        share.send_q(q, layer.host_layer)
        partial = self.decode_partial(q, layer, ctx, share.starts[:q.shape[0]])
        o, lse = share.attend(layer.host_layer, q.shape[0])
        return self.merge_decode(partial, o, lse, q)

    def decode_partial(self, q, layer, ctx: ForwardContext, starts: torch.Tensor):
        """Decode over each row's tokens [starts, context_lens), left for merge_decode."""
        raise NotImplementedError(f"the {self.name} attention backend has no CPU attention "
                                  f"split; use triton or torch")

    def merge_decode(self, partial, o: torch.Tensor, lse: torch.Tensor,
                     q: torch.Tensor) -> torch.Tensor:
        """decode_partial's result merged with another share's output and LSE ([rows, heads,
        d], [rows, heads], float32): the layer's attention output, in q's dtype."""
        raise NotImplementedError

    def rotate_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, layer, slot_mapping: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k rotated (layer.rotate); k, v stored in their slots. Backends may fuse it."""
        q, k = layer.rotate(positions, q, k)
        store_kv(k, v, layer, slot_mapping)
        return q, k

    @abstractmethod
    def prefill(self, q, k, v, layer, ctx: ForwardContext,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The step's chunks' attention, into `out` where given (and returned)."""

    @abstractmethod
    def decode(self, q, layer, ctx: ForwardContext,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The step's rows' attention, into `out` where given (and returned)."""


def into(out: torch.Tensor | None, o: torch.Tensor) -> torch.Tensor:
    """o, copied into `out` where the caller gave one (a kernel that writes only its own
    output, under a backend's `out` interface)."""
    return o if out is None else out.copy_(o)


def store_kv(k: torch.Tensor, v: torch.Tensor, layer, slot_mapping: torch.Tensor) -> None:
    """The new tokens' K, V [tokens, kv_heads, d] into their slots of `layer`'s cache:
    quantized with their scales (store_fp8_kv) or cast to the cache's dtype."""
    if layer.k_scale is not None:
        store_fp8_kv(k, v, layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale,
                     slot_mapping)
        return
    h, d = layer.k_cache.shape[-2:]
    layer.k_cache.view(-1, h, d).index_copy_(0, slot_mapping, k.to(layer.k_cache.dtype))
    layer.v_cache.view(-1, h, d).index_copy_(0, slot_mapping, v.to(layer.v_cache.dtype))


def store_fp8_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Quantizes the new tokens' K, V [tokens, kv_heads, head_dim] into their slots of the FP8
    caches (values [pages, page_size, kv_heads, head_dim], scales [pages, page_size,
    kv_heads]). CUDA: one fused Triton kernel (amax, scale, cast, scatter of K and V;
    attention/triton_kv_store.py); elsewhere kv/fp8.py's reference, whose bytes it equals."""
    if k.is_cuda:
        from nanoserve.attention.triton_kv_store import store_fp8  # triton: CUDA installs only

        store_fp8(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    else:
        fp8.store(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
