"""The model hyper-parameters nanoserve needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nanoserve.distributed.parallel_state import tp_size
from nanoserve.models.registry import Family, family_of
from nanoserve.models.rope import ROPE_TYPES
from nanoserve.quant.config import QuantConfig, UnsupportedQuantization


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the family's name (models/registry.py)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # rope_type llama3 or yarn, with every key the tables need
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    sliding_window: int | None = None  # refused beyond it: see check_max_model_len
    # mixture of experts (Qwen3-MoE): the layers in moe_layers have a sparse MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    quantization: QuantConfig | None = None  # the checkpoint's quantized linear layers

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        family = family_of(raw.get("architectures"))
        arch = raw["architectures"]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{arch} config has hidden_act {act!r}; nanoserve's MLPs are SwiGLU "
                             f"(silu)")
        heads = raw["num_attention_heads"]
        max_pos = raw.get("max_position_embeddings", 32768)
        rope_theta, scaling = _rope(raw, max_pos)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        qkv_bias = family.qkv_bias
        if qkv_bias is None:
            qkv_bias = bool(raw.get("attention_bias", False))
        layers = raw["num_hidden_layers"]
        return cls(
            architecture=family.name,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=family.qk_norm,
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            sliding_window=_sliding_window(raw, family),
            **(_moe(raw, layers) if family.moe else {}),
            quantization=_quantization(raw, family),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        with open(Path(path) / "config.json") as f:
            return cls.from_dict(json.load(f))

    def check_max_model_len(self, max_model_len: int) -> None:
        """nanoserve has no sliding-window attention: a windowed model runs only where the
        window never binds (every sequence within it), else a ValueError says so."""
        if self.sliding_window is not None and max_model_len > self.sliding_window:
            raise ValueError(
                f"the {self.architecture} config sets sliding_window={self.sliding_window}, and "
                f"nanoserve has no sliding-window attention: it runs this model only with "
                f"max_model_len <= {self.sliding_window} (where the window never applies), "
                f"not {max_model_len}; pass --max-model-len {self.sliding_window} "
                f"(max_model_len={self.sliding_window})")

    def check_tensor_parallel(self, size: int) -> None:
        """ValueError unless `size` ranks can each hold an equal share of every dimension
        tensor parallelism splits: the heads, the KV heads and the MLP rows (each expert's, for
        MoE). The vocabulary is padded to a multiple of `size`."""
        splits = {"num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads}
        if len(self.moe_layers) < self.num_layers:
            splits["intermediate_size"] = self.intermediate_size
        if self.moe_layers:
            splits["moe_intermediate_size"] = self.moe_intermediate_size
        bad = [f"{name} {n}" for name, n in splits.items() if n % size]
        if bad:
            raise ValueError(f"tensor parallel size {size} does not divide the {self.architecture} "
                             f"config's {', '.join(bad)}: each rank holds an equal share of the "
                             f"attention heads, KV heads and MLP rows")
        reason = self.quantization and size > 1 and _quantized_split_refusal(self, size)
        if reason:
            raise ValueError(f"a quantized checkpoint ({self.quantization.method}) cannot run at "
                             f"tensor parallel size {size}: {reason}")

    def local_kv_heads(self, size: int | None = None) -> int:
        """KV heads one rank holds (and caches) under tensor parallelism of `size` ranks
        (default: this process's TP size); num_kv_heads at TP=1."""
        size = tp_size() if size is None else size
        self.check_tensor_parallel(size)
        return self.num_kv_heads // size

    def local_heads(self, size: int | None = None) -> int:
        """Attention (query) heads one rank computes; as local_kv_heads."""
        size = tp_size() if size is None else size
        self.check_tensor_parallel(size)
        return self.num_heads // size


def _quantized_split_refusal(cfg: ModelConfig, size: int) -> str | None:
    """Why `size` ranks cannot split this quantized checkpoint's layers, or None: each rank's
    outputs of q/k/v and gate/up, and inputs of o and down, must hold whole scale blocks
    (FP8 block-wise), whole words and groups (AWQ, GPTQ)."""
    q = cfg.quantization
    if cfg.moe_layers:
        return "quantized experts run at tensor parallel size 1"
    if q.method == "gptq" and q.act_order:
        return "GPTQ with act-order (desc_act) mixes every group into every rank's inputs"
    outputs = {"q_proj": cfg.num_heads * cfg.head_dim, "k_proj": cfg.num_kv_heads * cfg.head_dim,
               "gate_proj": cfg.intermediate_size}
    inputs = {"o_proj": cfg.num_heads * cfg.head_dim, "down_proj": cfg.intermediate_size}
    if q.method == "fp8_block":
        out_unit, in_unit = q.block
    elif q.method in ("awq", "gptq"):
        out_unit, in_unit = 8, q.group_size
    else:
        return None
    bad = [f"{name}'s {n} outputs" for name, n in outputs.items() if n // size % out_unit] + \
        [f"{name}'s {n} inputs" for name, n in inputs.items() if n // size % in_unit]
    if bad:
        return (f"{size} ranks would split {', '.join(bad)} inside a {q.method} block "
                f"({out_unit} outputs x {in_unit} inputs)")
    return None


def _quantization(raw: dict, family: Family) -> QuantConfig | None:
    # older compressed-tensors releases wrote compression_config
    quant = QuantConfig.from_dict(raw.get("quantization_config") or
                                  raw.get("compression_config"))
    if quant is not None and family.moe and quant.method != "fp8_block":
        raise UnsupportedQuantization(f"quantized mixture-of-experts checkpoints other than FP8 "
                                      f"block-wise ({quant.method}) are not supported yet; "
                                      f"their bf16 and FP8 releases are")
    return quant


def _rope(raw: dict, max_pos: int) -> tuple[float, dict | None]:
    """(rope_theta, scaling or None), following transformers' standardize_rope_params."""
    # transformers >= 5 writes rope_parameters; older configs have rope_theta + rope_scaling
    rope = dict(raw.get("rope_parameters") or {})
    rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = dict(raw.get("rope_scaling") or rope)
    if scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor is not supported: nanoserve rotates every "
                         "dimension of a head")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return rope_theta, None
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: "
                         f"{', '.join(t for t in ROPE_TYPES if t != 'default')})")
    scaling["rope_type"] = kind
    # a top-level original_max_position_embeddings wins over the scaling dict's (Phi-3 style)
    if "original_max_position_embeddings" in raw:
        scaling["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    scaling.setdefault("original_max_position_embeddings", max_pos)
    if kind == "yarn" and scaling.get("factor") is None:
        scaling["factor"] = max_pos / scaling["original_max_position_embeddings"]
    return rope_theta, scaling


def _sliding_window(raw: dict, family: Family) -> int | None:
    if family.sliding_window_switch is not None and not raw.get(family.sliding_window_switch):
        return None
    return raw.get("sliding_window")


def _moe(raw: dict, num_layers: int) -> dict:
    """The MoE fields of a Qwen3-MoE config; which layers are sparse follows transformers'
    Qwen3MoeDecoderLayer (not in mlp_only_layers, and (i + 1) % decoder_sparse_step == 0)."""
    experts = raw.get("num_experts", raw.get("num_local_experts")) or 0
    top_k = raw.get("num_experts_per_tok") or 0
    if experts and not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts ({experts})")
    if raw.get("shared_expert_intermediate_size"):
        raise ValueError("shared experts (shared_expert_intermediate_size) are not supported")
    step = raw.get("decoder_sparse_step") or 1
    dense = set(raw.get("mlp_only_layers") or [])
    layers = tuple(i for i in range(num_layers)
                   if experts > 0 and i not in dense and (i + 1) % step == 0)
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=raw["moe_intermediate_size"],
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)), moe_layers=layers)
