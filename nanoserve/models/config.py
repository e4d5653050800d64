"""The model hyper-parameters nanoserve needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # qwen3 | qwen2 | llama
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs}; nanoserve runs {sorted(SUPPORTED)}")
        # transformers >= 5 writes rope_parameters; older configs have rope_theta + rope_scaling
        rope = dict(raw.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = raw.get("rope_scaling") or (rope or None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                raise ValueError(f"unsupported rope scaling {kind!r} (supported: llama3)")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        heads = raw["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        with open(Path(path) / "config.json") as f:
            return cls.from_dict(json.load(f))
