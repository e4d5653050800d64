"""Where each checkpoint tensor goes in nanoserve's model. The names are Hugging Face's, shared
by every family: q/k/v and gate/up projections go into shards of the fused `qkv_proj` and
`gate_up_proj`, and expert e's projections (`mlp.experts.{e}.gate_proj.weight`) into expert e
of the stacked `mlp.experts.gate_up_proj` / `down_proj` (checkpoints that already hold them
stacked, as transformers keeps them in memory, load as they are)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.models.layers import MergedLinear
from nanoserve.models.moe import Experts
from nanoserve.quant.linear import QuantizedLinear

# checkpoint name part -> (fused module name, shard index)
FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


@dataclass(frozen=True)
class Target:
    """A checkpoint tensor's place: parameter `param`, its expert (stacked experts) and its
    shard (fused projections); None where the tensor spans that dimension."""

    param: str
    expert: int | None = None
    shard: int | None = None

    @property
    def key(self) -> str:
        return f"{self.param}#{self.expert}.{self.shard}"


def checkpoint_target(name: str) -> Target:
    parts = name.split(".")
    expert, suffix = None, ""
    if "experts" in parts:
        i = parts.index("experts") + 1
        if i < len(parts) and parts[i].isdigit():
            expert = int(parts.pop(i))
            # stacked experts are parameters, not Linear modules: an FP8 expert's block
            # scales go beside its weights (moe.Experts)
            if parts[-1] in ("weight", "weight_scale_inv"):
                suffix = "_scale_inv" if parts.pop() == "weight_scale_inv" else ""
    shard = None
    for i, part in enumerate(parts):
        if part in FUSED_SHARDS:
            parts[i], shard = FUSED_SHARDS[part]
            break
    return Target(".".join(parts) + suffix, expert, shard)


def destination(params: dict[str, nn.Parameter], modules: dict[str, nn.Module],
                target: Target) -> torch.Tensor:
    """The view of the model's parameter that `target` fills."""
    module_name, attr = target.param.rsplit(".", 1)
    if isinstance(modules[module_name], QuantizedLinear):  # each tensor its own layout
        return modules[module_name].shard_view(attr, target.shard or 0)
    dst = params[target.param]
    if target.expert is not None:
        dst = dst[target.expert]
    if target.shard is not None:
        module = modules[module_name]
        dst = dst[module.shard_slice(target.shard, scales=True) if attr.endswith("_scale_inv")
                  else module.shard_slice(target.shard)]
    return dst


def pieces(name: str, module: nn.Module) -> list[Target]:
    """Every piece of parameter `name` a checkpoint must fill (one per expert and shard)."""
    stacked = isinstance(module, Experts)
    sharded = isinstance(module, MergedLinear) or \
        (stacked and name.endswith(("gate_up_proj", "gate_up_proj_scale_inv"))) \
        or (isinstance(module, QuantizedLinear) and len(module.shard_sizes) > 1)
    experts = range(module.num_experts) if stacked else [None]
    shards = range(len(module.shard_sizes)) if sharded else [None]
    return [Target(name, e, s) for e in experts for s in shards]


def covered(target: Target, module: nn.Module) -> set[str]:
    """Keys of the pieces a checkpoint tensor at `target` fills."""
    return {p.key for p in pieces(target.param, module)
            if target.expert in (None, p.expert) and target.shard in (None, p.shard)}
