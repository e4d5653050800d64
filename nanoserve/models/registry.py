"""The model families nanoserve runs, keyed by the Hugging Face `architectures` name.

Config parsing (config.py) reads a family's entry and turns it into the ModelConfig flags the
decoder builds from (decoder.py); the loader's checkpoint names (checkpoint.py) are shared by
every family. Adding a family that reuses the existing layer kinds is one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE
    # q/k/v projection bias: True always (Qwen2), False never, None as the config's
    # attention_bias says
    qkv_bias: bool | None = False
    moe: bool = False  # sparse mixture-of-experts MLP on the layers the config names
    # the config key that switches a `sliding_window` on (Qwen: use_sliding_window); None: a
    # non-null sliding_window is a window
    sliding_window_switch: str | None = None


FAMILIES: dict[str, Family] = {
    "Qwen3ForCausalLM": Family("qwen3", qk_norm=True, qkv_bias=None,
                               sliding_window_switch="use_sliding_window"),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", qk_norm=True, qkv_bias=None, moe=True,
                                  sliding_window_switch="use_sliding_window"),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True, sliding_window_switch="use_sliding_window"),
    "LlamaForCausalLM": Family("llama", qkv_bias=None),
    "MistralForCausalLM": Family("mistral"),
}


def family_of(architectures: list[str] | None) -> Family:
    """The family of the first supported name in a config's `architectures`; a ValueError that
    lists the supported names otherwise."""
    for arch in architectures or []:
        if arch in FAMILIES:
            return FAMILIES[arch]
    raise ValueError(f"unsupported architecture {architectures or []}; nanoserve runs "
                     f"{', '.join(sorted(FAMILIES))}")
