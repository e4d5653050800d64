"""Rotary embedding frequencies: default, Llama 3 and YaRN scaling, computed as transformers'
modeling_rope_utils computes them (same formulas, same float32 operations, so the tables are
bitwise equal). Scaling lives here only: the rotation kernels take the cos/sin table."""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "llama3", "yarn")


def inv_freq_and_attention_factor(head_dim: int, theta: float, scaling: dict | None,
                                  device: torch.device | str = "cpu"
                                  ) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] in float32, factor applied to cos and sin)."""
    kind = "default" if scaling is None else scaling["rope_type"]
    if kind == "yarn":
        return yarn(head_dim, theta, scaling, device)
    inv_freq = default_inv_freq(head_dim, theta, device)
    if kind == "llama3":
        return llama3(inv_freq, scaling), 1.0
    if kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: {ROPE_TYPES})")
    return inv_freq, 1.0


def default_inv_freq(dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    exps = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float()
    return 1.0 / (theta ** (exps / dim))


def llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn_attention_factor(scaling: dict) -> float:
    """YaRN's cos/sin scale: given, or 0.1 ln(factor) + 1 (with mscale / mscale_all_dim, the
    ratio of two such terms: DeepSeek's form)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def yarn(dim: int, theta: float, scaling: dict, device: torch.device | str = "cpu"
         ) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that rotate fewer than beta_slow times over the original context are
    interpolated (divided by factor), those that rotate more than beta_fast times are kept,
    a linear ramp between; `scaling` holds factor and original_max_position_embeddings (config.py
    fills both as transformers does)."""
    factor = scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = (1 - ramp).to(device)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + \
        (1.0 / pos_freqs) * extrapolation
    return inv_freq, yarn_attention_factor(scaling)
