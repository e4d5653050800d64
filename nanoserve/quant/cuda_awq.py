"""AWQ's one-row product (batch-1 decode) in CUDA (csrc/awq_gemv.cu): each quarter warp reads
whole 128-byte rows of the packed weight, nibbles become floats through bf16's bit pattern (two
bit operations for two), one FMA an element, the zero point and scale applied once a group, K
split over CTAs and summed in order by the last one. Built at first use through torch's
cpp_extension (nvcc); where it cannot be built, or for shapes it does not take, Triton's GEMV
runs (quant/triton_gemm.py; `supports` says which).

Triton's GEMV reached 2.4-4.0x the weights' floor per layer on an H100 (docs/perf-notes.md,
session 21). This kernel's layout follows session 25's finding on FP8 decode, where the same
change to how lanes copied took the read rate from 3.2 to 4.4 TB/s."""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path

import torch

from nanoserve.extensions import load_extension

log = logging.getLogger("nanoserve")

CSRC = Path(__file__).parent / "csrc"
OUTS = 256  # outputs a CTA owns (the kernel's)
GROUPS = (32, 64, 128)  # group sizes the kernel is built for
CTAS_PER_SM = 4  # a K split aims at this many CTAs an SM (128 registers x 128 threads each)


@cache
def _extension():
    """The compiled module, or None (logged once) where it cannot be built or run."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        return None
    try:
        return load_extension(
            "nanoserve_awq_gemv", [CSRC / "awq_gemv_binding.cpp", CSRC / "awq_gemv.cu"],
            "AWQ's CUDA GEMV", extra_cflags=["-O3"], extra_cuda_cflags=["-O3"],
            extra_include_paths=[str(CSRC)])
    except Exception as e:  # no nvcc, no ninja, a build error: Triton's GEMV runs
        log.warning("AWQ: the CUDA GEMV could not be built (%s: %s); using Triton's",
                    type(e).__name__, str(e)[:200])
        return None


@cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def shape_ok(x: torch.Tensor, w: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
             group: int) -> bool:
    """Whether the kernel takes one row x [1, K] against qweight w [K, N / 8], qzeros
    [K / group, N / 8] and scales [K / group, N]: half-precision x and scales, a group it is
    built for, N a multiple of 32, contiguous 16-byte aligned tensors (it reads 16 bytes a
    lane). Checks no device."""
    k, n = w.shape[0], scales.shape[-1]
    return (x.dim() == 2 and x.shape == (1, k) and
            x.dtype in (torch.bfloat16, torch.float16) and
            scales.dtype in (torch.bfloat16, torch.float16) and
            w.dtype == zeros.dtype == torch.int32 and group in GROUPS and k % group == 0 and
            n % 32 == 0 and w.shape[1] * 8 == n and zeros.shape == (k // group, n // 8) and
            scales.shape == (k // group, n) and
            all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (w, zeros, scales)) and
            x.is_contiguous())


def supports(x: torch.Tensor, w: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
             group: int) -> bool:
    """shape_ok, on a GPU where the kernel builds."""
    return x.is_cuda and shape_ok(x, w, zeros, scales, group) and _extension() is not None


def num_splits(slices: int, groups: int, sms: int) -> int:
    """CTAs a slice of outputs' K is split over: the most that divides the groups (a CTA takes
    whole groups) with every CTA resident at once (CTAS_PER_SM an SM), at least one. Qwen3-8B
    on 132 SMs: o (16 slices, 32 groups) 32; qkv (24, 32) 16; gate_up (96, 32) 4; down (16, 96)
    32."""
    most = max(1, CTAS_PER_SM * sms // slices)
    return max(d for d in range(1, groups + 1) if groups % d == 0 and d <= most)


def awq_gemv(x: torch.Tensor, w: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
             group: int) -> torch.Tensor:
    """x [1, K] times the AWQ weight (qweight w [K, N / 8], qzeros, scales): y [1, N] in x's
    dtype. See `supports`."""
    from nanoserve.quant.triton_gemm import split_buffers  # the split-K parts and counters

    k, n = w.shape[0], scales.shape[-1]
    slices = -(-n // OUTS)
    split = num_splits(slices, k // group, _num_sms(x.device.index or 0))
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    partials, counters = split_buffers(y, split, (slices, 1, split))
    with torch.cuda.device(x.device):
        stream = torch.cuda.current_stream().cuda_stream  # a graph's, while capturing
        refused = _extension().awq_gemv(x, w, zeros, scales, y, partials, counters, group,
                                        k // split, stream)
    if refused:
        raise RuntimeError(refused)
    return y
