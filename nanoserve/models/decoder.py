"""One decoder for every family in models/registry.py: Qwen3 (q/k RMSNorm), Qwen2/2.5 (qkv
bias), Llama 3 and Mistral, Qwen3-MoE (sparse MLP layers); RoPE scaling (llama3, YaRN) lives in
the rotary table.

Module names follow the Hugging Face checkpoints, except the fused `qkv_proj` and `gate_up_proj`
and the stacked experts (models/moe.py).

Under tensor parallelism (models/parallel.py) the model is built for this process's rank: each
layer holds its share of the heads and MLP rows, and its shapes and counts (`Attention.num_heads`,
`num_kv_heads`) are the local ones. TP is read when the model is built.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from nanoserve.distributed.parallel_state import (
    all_gather,
    all_reduce,
    shard,
    shard_padded,
    tp_size,
)
from nanoserve.models.config import ModelConfig
from nanoserve.models.layers import (
    DOWN_LT_ROWS,
    Linear,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    qk_norm_rope,
    silu_mul_linear,
)
from nanoserve.models.moe import MOE_BACKENDS, SparseMoE
from nanoserve.models.parallel import VocabParallelEmbedding
from nanoserve.quant.config import QuantConfig
from nanoserve.quant.linear import QuantizedLinear, QuantizedRows

log = logging.getLogger("nanoserve")


class Attention(nn.Module):
    """The attention op over the paged KV cache, from q, k before the rotary embedding (and
    Qwen3's q/k norm): the backend rotates them and stores k, v on its way in, in one kernel
    where it can (attention/triton_rope_store.py). Its KV source (`k_cache`, `v_cache` and,
    for FP8 KV, `k_scale`, `v_scale`) is bound by the engine: the resident page pool, or a
    ring slot on the offloaded path."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, qk_norm: tuple[RMSNorm, RMSNorm] | None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        # shared with (and registered in) the enclosing modules: lists keep them unregistered
        self.rotary = [rotary]
        self.qk_norm = list(qk_norm) if qk_norm is not None else None
        self.k_cache = self.v_cache = torch.empty(0)  # [num_pages, page_size, kv_heads, head_dim]
        self.k_scale = self.v_scale = None  # FP8 KV: [num_pages, page_size, kv_heads] float32
        self.host_layer: int | None = None  # streamed: the layer's index in the host store
        self.backend = None

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k normed (Qwen3) and rotated, unfused: the reference of the fused kernel."""
        if self.qk_norm is None:
            return self.rotary[0](positions, q, k)
        q_norm, k_norm = self.qk_norm
        return qk_norm_rope(q, k, q_norm.weight, k_norm.weight, q_norm.eps,
                            self.rotary[0].cos_sin, positions)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        return self.backend.forward(positions, q, k, v, self)


ROW_PARALLEL = ("o_proj", "down_proj")  # tensor parallelism splits their inputs


def experts_quantization(cfg: ModelConfig, at: str) -> QuantConfig | None:
    """The checkpoint's quantization of the experts at `at`, None where they are dense (the
    router stays dense: nanoserve holds it in the model's dtype)."""
    quant = cfg.quantization
    names = [f"{at}.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    quantized = [quant is not None and quant.quantizes(name) for name in names]
    if any(quantized) and not all(quantized):
        raise ValueError(f"the checkpoint quantizes some of {at}'s projections and not the "
                         f"others; nanoserve stacks them")
    return quant if all(quantized) else None


def linear(cfg: ModelConfig, names: list[str], in_features: int, shard_sizes: list[int],
           bias: bool) -> nn.Module:
    """The linear layer over checkpoint modules `names` (their outputs stacked, one shard each):
    held quantized where the checkpoint quantizes them (all or none of a fused layer's)."""
    quant = cfg.quantization
    quantized = [quant is not None and quant.quantizes(name) for name in names]
    if any(quantized):
        if not all(quantized):
            raise ValueError(f"the checkpoint quantizes some of {', '.join(names)} and not the "
                             f"others; nanoserve fuses them into one layer")
        # the 4-bit formats' scales are float16 in their checkpoints
        return QuantizedLinear(in_features, shard_sizes, bias, quant, torch.float16,
                               row_parallel=names[0].endswith(ROW_PARALLEL))
    if len(shard_sizes) > 1:
        return MergedLinear(in_features, shard_sizes, bias)
    return Linear(in_features, shard_sizes[0], bias=bias)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        heads = shard(cfg.num_heads, "num_attention_heads")[1]
        kv_heads = shard(cfg.num_kv_heads, "num_key_value_heads")[1]
        self.q_size, self.kv_size = heads * d, kv_heads * d
        at = f"model.layers.{layer_id}.self_attn."
        self.qkv_proj = linear(cfg, [at + "q_proj", at + "k_proj", at + "v_proj"], h,
                               [self.q_size, self.kv_size, self.kv_size], cfg.qkv_bias)
        self.o_proj = linear(cfg, [at + "o_proj"], self.q_size, [h], bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn = Attention(layer_id, heads, kv_heads, d, rotary,
                              (self.q_norm, self.k_norm) if cfg.qk_norm else None)

    def forward(self, positions: torch.Tensor, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        d = self.attn.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        o = self.attn(positions, q.view(-1, self.attn.num_heads, d),
                      k.view(-1, self.attn.num_kv_heads, d), v.view(-1, self.attn.num_kv_heads, d))
        return all_reduce(self.o_proj(o.reshape(-1, self.q_size)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        i = shard(cfg.intermediate_size, "intermediate_size")[1]
        at = f"model.layers.{layer_id}.mlp."
        self.gate_up_proj = linear(cfg, [at + "gate_proj", at + "up_proj"], cfg.hidden_size,
                                   [i, i], bias=False)
        self.down_proj = linear(cfg, [at + "down_proj"], i, [cfg.hidden_size], bias=False)
        self.down_proj.lt_rows = DOWN_LT_ROWS

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        return all_reduce(silu_mul_linear(self.down_proj, self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer_id) if layer_id not in cfg.moe_layers else SparseMoE(
            cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
            shard(cfg.moe_intermediate_size, "moe_intermediate_size")[1], cfg.norm_topk_prob,
            experts_quantization(cfg, f"model.layers.{layer_id}.mlp.experts"))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, delta: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; delta: the previous layer's MLP output, not yet added (None
        before the first layer). Each residual add runs in the kernel of the norm after it, so
        this returns (x, its MLP output) for the next layer (or the head) to add."""
        qkv = self.self_attn.qkv_proj  # each norm made in the form its projection takes
        if delta is None:
            h = self.input_layernorm(x, into=qkv)
        else:
            x, h = self.input_layernorm.add_forward(x, delta, into=qkv)
        x, h = self.post_attention_layernorm.add_forward(
            x, self.self_attn(positions, h), into=getattr(self.mlp, "gate_up_proj", None))
        return x, self.mlp(h)


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_len)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rotary)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        cfg.check_tensor_parallel(tp_size())
        self.config = cfg
        self.model = DecoderBody(cfg, max_len)
        # this rank's rows of the vocabulary, as the embedding's (a tied head shares them)
        self.lm_head = Linear(cfg.hidden_size, shard_padded(cfg.vocab_size)[1], bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def set_moe_backend(self, backend: str) -> None:
        """How the sparse MLP layers run their experts (models/moe.py); no-op without them."""
        if backend not in MOE_BACKENDS:
            raise ValueError(f"unknown MoE backend {backend!r} (one of {MOE_BACKENDS})")
        sparse = [m for m in self.modules() if isinstance(m, SparseMoE)]
        if backend not in ("auto", "fused") and any(m.experts.quant for m in sparse):
            log.warning("MoE backend %r: FP8 experts are dequantized every step (all of them, "
                        "in the model's dtype); the fused backend reads them as they are",
                        backend)
        for module in sparse:
            module.backend = backend

    # The step executor composes a step from these three: embed, layers (each passing the
    # residual stream and its pending MLP output on), head.
    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def head(self, hidden: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [rows, vocab] of (un-normalized) last-layer hidden states, the whole
        vocabulary on every rank; `delta`: the last layer's MLP output, added here."""
        norm = self.model.norm
        h = norm(hidden) if delta is None else norm.add_forward(hidden, delta)[1]
        logits = all_gather(self.lm_head(h))
        if logits.shape[-1] != self.config.vocab_size:  # TP: the vocabulary's padding
            logits = logits[:, :self.config.vocab_size]
        return logits.float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Last-layer hidden states of every input token, every layer resident (the engine runs
        steps through its step executor; this serves memory profiling and tests)."""
        h, delta = self.embed(input_ids), None
        for layer in self.layers:
            h, delta = layer(positions, h, delta)
        return h + delta
