"""Programmatic dependent launch (PDL; Hopper and later) for the hand-written Triton kernels and
inductor's fused ones.

A kernel launched with PDL may be scheduled while the kernel before it on its stream is still
running: its launch and its programs' placement overlap the predecessor's last wave instead of
following its end, and inside CUDA graphs the dependency is captured as a programmatic edge. At
decode, where a layer is ten kernels of a few microseconds each, that gap is a large part of a
step.

The invariant every PDL kernel keeps: `gdc_wait` (which returns once the predecessor has
finished and its writes are visible) comes before its first load or store of memory that
another kernel writes or reads. A kernel that skipped it could finish before its predecessor,
and the kernel after it would then overtake both. Ours wait first thing and then let their
own dependents launch (triton_pdl.wait_then_release); inductor places its own waits
(`triton.enable_pdl`).

NANOSERVE_PDL=0 turns it off (the A/B in tools/gpu_check.sh's decode step).
"""

from __future__ import annotations

import functools
import os

import torch

_from_env = os.environ.get("NANOSERVE_PDL", "1") != "0"
_forced: bool | None = None  # tools/check_kernels.py compiles both variants without a GPU


def force(value: bool | None) -> None:
    global _forced
    _forced = value


@functools.cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL."""
    if _forced is not None:
        return _forced
    if device.type != "cuda" or not _from_env:
        return False
    return _hopper_or_later(device.index if device.index is not None
                            else torch.cuda.current_device())


def inductor_options(device: torch.device) -> dict[str, bool]:
    """torch.compile options for inductor's kernels on `device` (none where this torch's
    inductor has no PDL switch)."""
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config.triton, "enable_pdl"):
        return {}
    return {"triton.enable_pdl": enabled(device)}

