"""Parameter counts of the model nanoserve builds for a config: the whole model (memory), what
one token reads (prefill FLOPs) and what one decode step of a batch reads (its HBM floor)."""

from __future__ import annotations

from nanoserve.models.config import ModelConfig


def expert_params(cfg: ModelConfig) -> int:
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def num_model_params(cfg: ModelConfig, tp: int = 1) -> int:
    """Parameters of the model nanoserve builds for `cfg` (biases and q/k norms included); with
    `tp`, those one rank holds under tensor parallelism of `tp` ranks (models/parallel.py: the
    norms and the MoE router replicated, the rest split)."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    moe = len(cfg.moe_layers)
    split = (cfg.num_layers * (h * qkv_out + (qkv_out if cfg.qkv_bias else 0)  # qkv_proj
                               + cfg.num_heads * d * h)  # o_proj
             + (cfg.num_layers - moe) * 3 * h * i + moe * cfg.num_experts * expert_params(cfg)
             + cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2))  # embeddings
    replicated = (cfg.num_layers * ((2 * d if cfg.qk_norm else 0)  # q_norm, k_norm
                                    + 2 * h)  # input and post-attention norms
                  + moe * cfg.num_experts * h  # the routers
                  + h)  # the final norm
    return split // tp + replicated


def expected_distinct_experts(cfg: ModelConfig, batch: int) -> float:
    """Experts a sparse layer reads in one decode step of `batch` tokens, expected when each
    token's k distinct experts are uniformly random: E (1 - (1 - k/E)^batch). Exactly k at
    batch 1; at most min(E, batch k). Skewed (real) routing reads fewer."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch) if e else 0.0


def unread_expert_params(cfg: ModelConfig, batch: int) -> float:
    """Expert parameters a decode step of `batch` tokens does not read (expected)."""
    idle = cfg.num_experts - expected_distinct_experts(cfg, batch)
    return len(cfg.moe_layers) * idle * expert_params(cfg)


def num_active_params(cfg: ModelConfig) -> int:
    """Parameters one token's forward multiplies with: every weight, but only k experts of a
    sparse layer (Qwen3-30B-A3B: ~3.3B of 30.5B)."""
    idle = cfg.num_experts - cfg.num_experts_per_tok
    return num_model_params(cfg) - len(cfg.moe_layers) * idle * expert_params(cfg)
