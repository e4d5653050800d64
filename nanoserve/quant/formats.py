"""The on-disk tensors of each quantized format, for one weight of `n` output rows and `k` inputs,
and their dequantization: the reference every fast path is tested against.

A fused projection (qkv, gate_up) holds its shards' tensors side by side along each tensor's
output dimension, every shard's blocks, groups and packed words its own (a shard's rows need
not fill whole blocks), so each shard dequantizes alone.

- fp8_block: weight e4m3 [n, k]; weight_scale_inv float32 [ceil(n / bn), ceil(k / bk)],
  W = weight * the scale of its block.
- fp8_channel / fp8_tensor: weight e4m3 [n, k]; weight_scale float32 [n, 1] / one per shard.
- awq: qweight int32 [k, n / 8], eight 4-bit outputs a word in the order 0 2 4 6 1 3 5 7;
  qzeros int32 [k / g, n / 8] packed alike; scales [k / g, n]; W[k, n] = (q - z) * s of k's group.
- gptq: qweight int32 [k / 8, n], eight 4-bit inputs a word in order; qzeros int32 [k / g, n / 8],
  outputs in order, stored less one (checkpoint_format gptq); scales [k / g, n]; g_idx int32 [k],
  each input's group (act-order permutes them), one per shard. Groups in order are the same
  weights as AWQ's with other packing, and act-order's too with its inputs sorted by group:
  `gptq_as_awq` repacks them at load time, so that AWQ's kernels run them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from nanoserve.quant.config import QuantConfig

FP8 = torch.float8_e4m3fn
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column each nibble of a word holds, by nibble


@dataclass(frozen=True)
class TensorSpec:
    """A checkpoint tensor of one shard: its shape and dtype, which dimension runs along the
    outputs (None: one per shard, stacked along a new first dimension) and which along the
    inputs (None: none; tensor parallelism splits a row-parallel layer's tensors there)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    out_dim: int | None
    in_dim: int | None = None


@functools.cache
def gpu_reads_e4m3(device: torch.device) -> bool:
    """Whether Triton's kernels read e4m3 on this GPU (casts and dots: sm89 and later); older
    GPUs run FP8 checkpoints through the dequantizing reference."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tensor_specs(q: QuantConfig, n: int, k: int, scale_dtype: torch.dtype
                 ) -> dict[str, TensorSpec]:
    """The tensors of a quantized weight of n outputs and k inputs. scale_dtype: the 4-bit
    formats' scales (the checkpoint's float16, or the model's dtype)."""
    if q.method == "fp8_block":
        bn, bk = q.block
        return {"weight": TensorSpec((n, k), FP8, 0, 1),
                "weight_scale_inv": TensorSpec((_cdiv(n, bn), _cdiv(k, bk)), torch.float32, 0,
                                               1)}
    if q.method == "fp8_channel":
        return {"weight": TensorSpec((n, k), FP8, 0, 1),
                "weight_scale": TensorSpec((n, 1), torch.float32, 0)}
    if q.method == "fp8_tensor":
        return {"weight": TensorSpec((n, k), FP8, 0, 1),
                "weight_scale": TensorSpec((), torch.float32, None)}
    g = q.group_size
    _check_divides(q, n, k)
    if q.method == "awq":
        return {"qweight": TensorSpec((k, n // 8), torch.int32, 1, 0),
                "qzeros": TensorSpec((k // g, n // 8), torch.int32, 1, 0),
                "scales": TensorSpec((k // g, n), scale_dtype, 1, 0)}
    return {"qweight": TensorSpec((k // 8, n), torch.int32, 1, 0),
            "qzeros": TensorSpec((_cdiv(k, g), n // 8), torch.int32, 1, 0),
            "scales": TensorSpec((_cdiv(k, g), n), scale_dtype, 1, 0),
            "g_idx": TensorSpec((k,), torch.int32, None, 0)}


def _check_divides(q: QuantConfig, n: int, k: int) -> None:
    if n % 8 or k % 8 or (q.method == "awq" and k % q.group_size):
        raise ValueError(f"a {q.method} weight of {n} outputs and {k} inputs: the outputs and "
                         f"inputs must be multiples of 8 (and, for awq, the inputs of the "
                         f"group size {q.group_size})")


def _unpack(words: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))
            ) -> torch.Tensor:
    """int32 words holding eight 4-bit values each -> int values, unpacked along `dim` (the
    nibble holding position i of each eight is order.index(i))."""
    shifts = torch.tensor([4 * order.index(i) for i in range(8)], dtype=torch.int32,
                          device=words.device)
    w = words.unsqueeze(dim + 1 if dim >= 0 else dim)
    shape = [1] * w.dim()
    shape[dim + 1 if dim >= 0 else dim] = 8
    nibbles = (w >> shifts.view(shape)) & 0xF
    out = list(words.shape)
    out[dim] *= 8
    return nibbles.reshape(out)


@functools.cache
def _e4m3_values(device: torch.device) -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8).view(FP8).float().to(device)


def _fp8_to_float(w: torch.Tensor) -> torch.Tensor:
    """e4m3 -> float32, exactly: on the CPU through a table of the 256 values (the CPU's
    conversion runs about eight times slower)."""
    if w.device.type != "cpu":
        return w.float()
    return _e4m3_values(w.device)[w.view(torch.uint8).int()]


def dequantize(q: QuantConfig, t: dict[str, torch.Tensor], n: int, k: int,
               dtype: torch.dtype) -> torch.Tensor:
    """One shard's weight [n, k] in `dtype` (computed in float32) from its tensors `t`."""
    if q.method == "fp8_block":
        bn, bk = q.block
        scale = t["weight_scale_inv"].float()
        scale = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return (_fp8_to_float(t["weight"]) * scale).to(dtype)
    if q.method in ("fp8_channel", "fp8_tensor"):
        return (_fp8_to_float(t["weight"]) * t["weight_scale"].float()).to(dtype)
    g = q.group_size
    if q.method == "awq":
        ints = _unpack(t["qweight"], 1, AWQ_ORDER)  # [k, n]
        zeros = _unpack(t["qzeros"], 1, AWQ_ORDER).repeat_interleave(g, 0)
        scales = t["scales"].float().repeat_interleave(g, 0)
        return ((ints - zeros).float() * scales).t().to(dtype)
    ints = _unpack(t["qweight"], 0)  # [k, n]
    group = t["g_idx"].long()  # numbered from this rank's first group (QuantizedLinear)
    # v1 stores zero - 1 in four bits: a true zero of 0 (stored -1, read 15) cannot be written
    # and reads as 16 here, as in the kernels of other engines that add the one back
    zeros = _unpack(t["qzeros"], 1)[group] + (1 if q.zeros_less_one else 0)
    scales = t["scales"].float()[group]
    return ((ints - zeros).float() * scales).t().to(dtype)


def _pack(ints: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))
          ) -> torch.Tensor:
    """_unpack's inverse: 4-bit values [..., 8 m, ...] along `dim` -> int32 words [..., m, ...]
    (position i of each eight in nibble order.index(i); the top nibble's shift wraps into the
    sign bit, as the format's words do)."""
    dim %= ints.dim()
    shape = list(ints.shape)
    shape[dim:dim + 1] = [shape[dim] // 8, 8]
    grouped = ints.reshape(shape).to(torch.int32)
    words = grouped.select(dim + 1, order[0])  # nibble 0's position: no shift
    for nibble in range(1, 8):
        words = words | (grouped.select(dim + 1, order[nibble]) << (4 * nibble))
    return words


GPTQ_REPACK_BYTES = 1 << 26  # a chunk of gptq_as_awq's unpacked values (int32; about 3x that held)


@torch.no_grad()
def gptq_as_awq(q: QuantConfig, qweight: torch.Tensor, qzeros: torch.Tensor,
                order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A GPTQ weight whose groups run in order (g_idx = input // group, checked by the caller)
    as AWQ's (qweight [k, n / 8], qzeros [k / g, n / 8]; the scales are the same tensor): the
    same weights, dequantize's values equal, where AWQ's kernels read them. `order` (act-order:
    the inputs sorted by group, g_idx[order] = input // group): AWQ's row i is GPTQ's input
    order[i], so the layer's x is read in that order too. None where AWQ's layout cannot hold
    it (a v1 zero point stored as 15 reads as 16: see dequantize) or its group size is not one
    of AWQ's usual 32, 64 and 128. Works in chunks of GPTQ_REPACK_BYTES of unpacked values
    (through k in order, through n by act-order)."""
    zeros = _unpack(qzeros, 1) + (1 if q.zeros_less_one else 0)  # [groups, n]
    if q.group_size not in (32, 64, 128) or zeros.max().item() > 15:
        return None  # (other groups: AWQ's GPU kernels are not tested there)
    words, n = qweight.shape
    awq = torch.empty(8 * words, n // 8, dtype=torch.int32, device=qweight.device)
    if order is None:
        rows = max(1, GPTQ_REPACK_BYTES // (32 * n))  # of qweight's words, 8 inputs each
        for r in range(0, words, rows):
            awq[8 * r:8 * (r + rows)] = _pack(_unpack(qweight[r:r + rows], 0), 1, AWQ_ORDER)
    else:  # every input of a column at once: chunks of whole words of AWQ's outputs
        cols = max(8, GPTQ_REPACK_BYTES // (32 * words) // 8 * 8)
        for c in range(0, n, cols):
            awq[:, c // 8:(c + cols) // 8] = _pack(_unpack(qweight[:, c:c + cols], 0)[order],
                                                   1, AWQ_ORDER)
    return awq, _pack(zeros, 1, AWQ_ORDER)


def _packed(value: int) -> int:
    """The int32 holding `value` in each of its eight nibbles."""
    word = sum(value << (4 * i) for i in range(8))
    return word - (1 << 32) if word >= 1 << 31 else word


@torch.no_grad()
def fill_dummy(q: QuantConfig, t: dict[str, torch.Tensor], generator: torch.Generator) -> None:
    """Random quantized tensors whose weights dequantize to about N(0, 0.02) (uniform 4-bit
    values about 8 scaled by 0.0043; e4m3 values of about 64 scaled by 0.02 / 64)."""
    if q.method.startswith("fp8"):
        w = torch.empty(t["weight"].shape, dtype=torch.float32, device=t["weight"].device)
        t["weight"].copy_(w.normal_(0.0, 64.0, generator=generator).clamp_(-448, 448))
        scale = "weight_scale_inv" if q.method == "fp8_block" else "weight_scale"
        t[scale].fill_(0.02 / 64)
        return
    t["qweight"].random_(-2**31, 2**31, generator=generator)  # eight uniform nibbles a word
    t["qzeros"].fill_(_packed(7 if q.method == "gptq" and q.zeros_less_one else 8))
    t["scales"].fill_(0.0043)
    if "g_idx" in t:  # act-order: the groups over a random order of the inputs, as GPTQ's
        k, device = t["g_idx"].shape[-1], t["g_idx"].device
        groups = torch.arange(k, device=device) // q.group_size
        if q.act_order:
            order = torch.randperm(k, generator=generator, device=device)
            groups = torch.empty_like(groups).scatter_(0, order, groups)
        t["g_idx"].copy_(groups)
