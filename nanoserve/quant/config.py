"""A checkpoint's `quantization_config`, read and checked before anything is loaded: the methods
nanoserve runs, and a clear refusal (naming the method and the supported ones) for the rest.

Supported, as model makers publish them:
- `fp8`: block-wise e4m3 weights with float32 inverse scales per `weight_block_size` block
  (`weight_scale_inv`), Qwen3-FP8's and DeepSeek's format;
- `compressed-tensors` with 8-bit float weights, per channel or per tensor (`weight_scale`);
- `awq`: 4-bit, GEMM layout (`qweight` packed along the outputs), zero points, groups along the
  inputs;
- `gptq`: 4-bit, groups along the inputs, with or without act-order (`g_idx`), symmetric or not,
  zero points stored less one (`checkpoint_format` gptq) or as they are (gptq_v2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SUPPORTED = ("fp8 (block-wise)", "compressed-tensors (fp8 weights)", "awq (4-bit, gemm)",
             "gptq (4-bit)")


class UnsupportedQuantization(ValueError):
    pass


def _refuse(what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"{what}; nanoserve runs these quantized checkpoints: "
                                   f"{', '.join(SUPPORTED)}")


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8_block", "fp8_channel", "fp8_tensor", "awq", "gptq"
    block: tuple[int, int] = (128, 128)  # fp8_block: (rows, columns) a scale covers
    group_size: int = 128  # awq, gptq: inputs a scale and zero point cover
    act_order: bool = False  # gptq: g_idx permutes the groups
    zeros_less_one: bool = True  # gptq: stored zero points are the true ones minus one
    skip: tuple[str, ...] = ()  # module names (or their ends) left unquantized

    @property
    def bits(self) -> int:
        return 4 if self.method in ("awq", "gptq") else 8

    def quantizes(self, module_name: str) -> bool:
        """Whether the checkpoint holds this linear module (a Hugging Face name, as
        model.layers.0.self_attn.q_proj) quantized. `skip` entries match as their tools match
        them: compressed-tensors' `re:` entries as regular expressions from the name's start,
        its other entries as whole names or name ends, AWQ's and GPTQ's
        modules_to_not_convert as parts of the name (transformers' and vLLM's rule)."""
        for entry in self.skip:
            if entry.startswith("re:"):
                if re.match(entry[3:], module_name):
                    return False
            elif self.method.startswith("fp8_") and self.method != "fp8_block":
                if module_name == entry or module_name.endswith("." + entry):
                    return False
            elif entry in module_name:
                return False
        return True

    @classmethod
    def from_dict(cls, raw: dict | None) -> QuantConfig | None:
        if not raw:
            return None
        method = str(raw.get("quant_method", "")).lower()
        if method == "fp8":
            return _fp8(raw)
        if method == "compressed-tensors":
            return _compressed_tensors(raw)
        if method in ("awq", "gptq"):
            return _int4(method, raw)
        raise _refuse(f"quantization method {method or '(none given)'!r} is not supported")


def _fp8(raw: dict) -> QuantConfig:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(f"fp8 format {fmt!r} is not supported (e4m3 is)")
    block = raw.get("weight_block_size")
    if not block or len(block) != 2:
        raise _refuse("fp8 checkpoints without weight_block_size (per-tensor fp8 in this "
                      "format) are not supported")
    return QuantConfig("fp8_block", block=(int(block[0]), int(block[1])),
                       skip=tuple(raw.get("modules_to_not_convert") or ()))


def _compressed_tensors(raw: dict) -> QuantConfig:
    groups = raw.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(f"compressed-tensors with {len(groups)} config groups is not supported "
                      f"(one is)")
    weights = (next(iter(groups.values())) or {}).get("weights") or {}
    kind, bits = weights.get("type"), weights.get("num_bits")
    strategy = weights.get("strategy")
    if kind != "float" or bits != 8 or strategy not in ("channel", "tensor"):
        raise _refuse(f"compressed-tensors weights of type {kind!r}, {bits} bits, strategy "
                      f"{strategy!r} are not supported (8-bit float, per channel or tensor, "
                      f"are)")
    fmt = raw.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise _refuse(f"compressed-tensors format {fmt!r} is not supported")
    targets = (next(iter(groups.values())) or {}).get("targets") or ["Linear"]
    if targets != ["Linear"]:
        raise _refuse(f"compressed-tensors targets {targets} are not supported (every Linear, "
                      f"less `ignore`, is)")
    return QuantConfig("fp8_" + strategy, skip=tuple(raw.get("ignore") or ()))


def _int4(method: str, raw: dict) -> QuantConfig:
    bits = raw.get("bits", raw.get("w_bit"))
    if bits != 4:
        raise _refuse(f"{method} with {bits} bits is not supported (4 is)")
    group = raw.get("group_size", raw.get("q_group_size", 128))
    if not isinstance(group, int) or group <= 0 or group % 8:
        raise _refuse(f"{method} group_size {group!r} is not supported (a positive multiple "
                      f"of 8 is; -1, one group for all inputs, is not)")
    skip = tuple(raw.get("modules_to_not_convert") or ())
    if method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse(f"awq version {version!r} is not supported (gemm is)")
        if raw.get("zero_point", True) is not True:
            raise _refuse("awq without zero points is not supported")
        return QuantConfig("awq", group_size=group, skip=skip)
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"gptq checkpoint_format {fmt!r} is not supported (gptq, gptq_v2 are)")
    return QuantConfig("gptq", group_size=group, act_order=bool(raw.get("desc_act", False)),
                       zeros_less_one=fmt == "gptq", skip=skip)
