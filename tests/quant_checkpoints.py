"""Quantized checkpoints made in the tests: a tiny random model's linear weights quantized into
the exact on-disk formats the published models use (tensor names, dtypes, packing, scale
layouts, quantization_config), written from the formats' descriptions, independently of
nanoserve's reader; and the dequantized weights, for the twin every comparison is made against.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_PACK_ORDER[i]


def _blocks(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """Each element's block's absolute maximum, [n, k]."""
    n, k = w.shape
    pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=w.dtype)
    pad[:n, :k] = w.abs()
    amax = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).amax(dim=(1, 3))
    return amax


def fp8_block(w: torch.Tensor, bn: int, bk: int) -> tuple[dict, torch.Tensor]:
    amax = _blocks(w, bn, bk).clamp(min=1e-12)
    scale = amax / 448.0
    full = scale.repeat_interleave(bn, 0)[:w.shape[0]].repeat_interleave(bk, 1)[:, :w.shape[1]]
    q = (w / full).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale.float()}, q.float() * full


def fp8_channel(w: torch.Tensor, dtype: torch.dtype) -> tuple[dict, torch.Tensor]:
    """compressed-tensors' per-channel FP8: scales [n, 1] in the model's dtype."""
    scale = (w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0).to(dtype).float()
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale.to(dtype)}, q.float() * scale


def fp8_tensor(w: torch.Tensor, dtype: torch.dtype) -> tuple[dict, torch.Tensor]:
    """compressed-tensors' per-tensor FP8: one scale, shape [1], in the model's dtype; a
    static activation scale beside it (static schemes write one; the reader passes it by)."""
    scale = (w.abs().amax().clamp(min=1e-12) / 448.0).to(dtype).float()
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale.reshape(1).to(dtype),
            "input_scale": torch.ones(1, dtype=dtype)}, q.float() * scale


def _int4(wt: torch.Tensor, groups: torch.Tensor, num_groups: int, min_zero: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization of wt [k, n] by the group of each input row: (q [k, n],
    zeros [num_groups, n], scales [num_groups, n] float16, dequantized [k, n]). min_zero 1:
    GPTQ's v1 format stores zero - 1 in four bits, so a zero of 0 cannot be written."""
    lo = torch.stack([wt[groups == g].amin(0) for g in range(num_groups)]).clamp(max=0)
    hi = torch.stack([wt[groups == g].amax(0) for g in range(num_groups)]).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-6).half()
    zeros = (-lo / scales.float()).round().clamp(min_zero, 15).int()
    q = (wt / scales.float()[groups]).round().int() + zeros[groups]
    q = q.clamp(0, 15)
    return q, zeros, scales, (q - zeros[groups]).float() * scales.float()[groups]


def _pack(values: torch.Tensor, dim: int, order: tuple[int, ...]) -> torch.Tensor:
    """Eight 4-bit values a little-endian int32 word along `dim`, nibble i holding the value
    at position order[i] of each eight."""
    v = values.movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8).long()
    word = sum(v[..., order[i]] << (4 * i) for i in range(8))
    word = torch.where(word >= 2**31, word - 2**32, word).int()
    return word.movedim(-1, dim)


def awq(w: torch.Tensor, group: int) -> tuple[dict, torch.Tensor]:
    k = w.shape[1]
    q, zeros, scales, deq = _int4(w.t(), torch.arange(k) // group, k // group)
    return {"qweight": _pack(q, 1, AWQ_PACK_ORDER), "qzeros": _pack(zeros, 1, AWQ_PACK_ORDER),
            "scales": scales}, deq.t()


def gptq(w: torch.Tensor, group: int, act_order: bool, v2: bool, seed: int
         ) -> tuple[dict, torch.Tensor]:
    k = w.shape[1]
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order \
        else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).int()  # the inputs in quantization order
    num_groups = -(-k // group)
    q, zeros, scales, deq = _int4(w.t(), g_idx, num_groups, min_zero=0 if v2 else 1)
    stored = zeros if v2 else zeros - 1
    seq = tuple(range(8))
    return {"qweight": _pack(q, 0, seq), "qzeros": _pack(stored & 0xF, 1, seq),
            "scales": scales, "g_idx": g_idx}, deq.t()


QUANT_CONFIGS = {
    "fp8_block": lambda o: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": list(o.get("block", (128, 128)))},
    "fp8_channel": lambda o: _compressed("channel"),
    "fp8_tensor": lambda o: _compressed("tensor"),
    "awq": lambda o: {"quant_method": "awq", "bits": 4, "group_size": o["group"],
                      "zero_point": True, "version": "gemm", "modules_to_not_convert": None},
    "gptq": lambda o: {"quant_method": "gptq", "bits": 4, "group_size": o["group"],
                       "desc_act": o.get("act_order", False), "sym": False,
                       "checkpoint_format": "gptq_v2" if o.get("v2") else "gptq"},
}


def _compressed(strategy: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": {"num_bits": 8, "type": "float",
                                                             "strategy": "token", "dynamic": True},
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                            "symmetric": True, "dynamic": False}}},
            "ignore": ["lm_head"]}


def quantize_checkpoint(src: Path, dst: Path, method: str, **options) -> dict[str, torch.Tensor]:
    """Writes src's model into dst with every decoder linear quantized by `method`; returns the
    state dict with those weights dequantized (float32), src's names."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    out, dequantized = {}, dict(state)
    for name, w in sorted(state.items()):
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.split(".")[-1] in LINEARS):
            out[name] = w
            continue
        dtype, w = w.dtype, w.float()
        if method == "fp8_block":
            tensors, deq = fp8_block(w, *options.get("block", (128, 128)))
        elif method == "fp8_channel":
            tensors, deq = fp8_channel(w, dtype)
        elif method == "fp8_tensor":
            tensors, deq = fp8_tensor(w, dtype)
        elif method == "awq":
            tensors, deq = awq(w, options["group"])
        else:
            tensors, deq = gptq(w, options["group"], options.get("act_order", False),
                                options.get("v2", False), seed=0)  # one order: q, k, v alike
        for t, value in tensors.items():
            out[f"{module}.{t}"] = value.contiguous()
        dequantized[name] = deq
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = QUANT_CONFIGS[method](options)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequantized
