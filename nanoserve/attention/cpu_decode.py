"""Decode attention on the CPU over one layer of paged host KV (the offload tier's layout), for a
token range of each sequence: the CPU's share of a streamed layer, whose partial result merges
with the GPU's by log-sum-exp (attention/prefill.merge_partials), exactly.

Two kernels, registered by name: `cpp` (csrc/cpu_decode.cpp, built at first use through torch's
cpp_extension: one pass over the KV, converted in registers, bf16 / fp16 / fp32 / FP8 e4m3 with
its scales, a thread per (sequence, kv head)) and `torch` (the reference: gather, dequantize,
float32 matmuls), which `auto` falls back to where no compiler builds the first, saying so.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from nanoserve.extensions import load_extension
from nanoserve.kv.fp8_format import FP8
from offload import PageLayout

log = logging.getLogger("nanoserve")

KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, FP8: 3}
SOURCE = Path(__file__).parent / "csrc" / "cpu_decode.cpp"

# q [B, Hq, D] f32, one layer's rows [2, pages, row], page table int32 [B, W], starts and ends
# int32 [B], the layout, the softmax scale -> (o [B, Hq, D] f32, lse [B, Hq] f32)
Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def decode_torch(q: torch.Tensor, layer_kv: torch.Tensor, layout: PageLayout,
                 page_table: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                 scale: float, out: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: each sequence's tokens gathered, dequantized, attended in float32."""
    b, hq, d = q.shape
    k_all, v_all = layout.values(layer_kv)
    scales = layout.scales(layer_kv)
    o = torch.zeros(b, hq, d)
    lse = torch.full((b, hq), -math.inf)
    for i in range(b):
        lo, hi = int(starts[i]), int(ends[i])
        if hi <= lo:
            continue
        t = torch.arange(lo, hi)
        pages, rows = page_table[i].long()[t // layout.page_size], t % layout.page_size
        k, v = (x[pages, rows].float() for x in (k_all, v_all))  # [T, Hkv, D]
        if scales is not None:
            k = k * scales[0][pages, rows][..., None]
            v = v * scales[1][pages, rows][..., None]
        o[i], lse[i] = attend_with_lse(q[i], k, v, scale)
    if out is not None:
        out[0].copy_(o)
        out[1].copy_(lse)
        return out
    return o, lse


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's queries [Hq, d] over keys and values [T, Hkv, d] (GQA), float32: output
    [Hq, d] and LSE [Hq]."""
    hq, d = q.shape
    hkv = k.shape[1]
    qi = q.view(hkv, hq // hkv, d)
    s = torch.einsum("hgd,thd->hgt", qi, k) * scale
    return (torch.einsum("hgt,thd->hgd", s.softmax(-1), v).reshape(hq, d),
            s.logsumexp(-1).reshape(hq))


def _cpu_features() -> str:
    """A short hash of this CPU's model and feature flags (Linux), or of the machine type."""
    import hashlib
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            info = [line for line in f if line.startswith(("flags", "model name"))][:2]
    except OSError:
        info = [platform.machine(), platform.processor()]
    return hashlib.sha1("".join(info).encode()).hexdigest()[:10]


@cache
def _extension(without_avx512: bool = False):
    """The compiled kernel's module, or None (logged once) where it cannot be built.
    without_avx512: the build a CPU without AVX-512 gets (its portable loops), for tests."""
    try:
        # built for this CPU (-march=native): the name carries its features, so a build cache
        # shared by hosts with different CPUs keeps one build per CPU
        name = f"nanoserve_cpu_decode_{_cpu_features()}" + ("_noavx512" if without_avx512 else "")
        return load_extension(
            name, [SOURCE], "CPU attention's C++ kernel",
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fassociative-math",
                          "-fno-signed-zeros", "-fno-trapping-math"] +
            (["-mno-avx512f"] if without_avx512 else []),
            extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no ninja, a build error: the reference still runs
        log.warning("CPU attention: the C++ kernel could not be built (%s: %s); using torch's "
                    "kernels, several times slower", type(e).__name__, str(e)[:200])
        return None


def decode_cpp(q: torch.Tensor, layer_kv: torch.Tensor, layout: PageLayout,
               page_table: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
               scale: float, out: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """out: (o, lse) to write into (pinned buffers on the offloaded path)."""
    ext = _extension()
    if ext is None:
        raise RuntimeError("the C++ CPU attention kernel is not available on this machine")
    q = q.contiguous()
    o, lse = out if out is not None else (torch.empty_like(q), q.new_empty(q.shape[:2]))
    refused = ext.decode(q, layer_kv.contiguous(), page_table.contiguous(), starts, ends,
                         KINDS[layout.dtype], layout.page_size, layout.num_kv_heads,
                         layout.scales_start, scale, o, lse)
    if refused:
        raise RuntimeError(refused)
    return o, lse


def share_worker(q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, host_kv: torch.Tensor,
                 q_flags: torch.Tensor, done_flags: torch.Tensor, layout: PageLayout,
                 scale: float, threads: int, warm: bool | None = None):
    """The C++ thread that runs the CPU's share of each streamed layer when the GPU flags
    its queries (attention/cpu_share.py), over pinned q, o, lse and the host store's layers
    [layers, 2, pages, row]; None where the C++ kernel could not be built. warm: between
    two layers' kernels, pull the next layer's share toward the caches (default on;
    NANOSERVE_CPU_WARM=0 turns it off, to measure it)."""
    ext = _extension()
    if ext is None:
        return None
    if warm is None:
        warm = os.environ.get("NANOSERVE_CPU_WARM", "1") != "0"
    return ext.ShareWorker(q, o, lse, host_kv, q_flags, done_flags, KINDS[layout.dtype],
                           layout.page_size, layout.num_kv_heads, layout.scales_start, scale,
                           threads, warm)


KERNELS: dict[str, Kernel] = {"cpp": decode_cpp, "torch": decode_torch}


def cpu_decode_kernel(name: str = "auto") -> tuple[str, Kernel]:
    """The kernel called `name`; `auto`: cpp where it builds, else torch."""
    if name == "auto":
        name = "cpp" if _extension() is not None else "torch"
    if name not in KERNELS:
        raise ValueError(f"unknown CPU attention kernel {name!r}; choose from "
                         f"{', '.join(['auto', *KERNELS])}")
    return name, KERNELS[name]
