"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step (sm_90 and later,
unless NANOSERVE_PDL=0; extensions.pdl_wanted). A kernel launched with it may start while the kernel
ahead of it in the stream is still running; it waits at its top for that kernel to finish (its
writes visible), and lets the next kernel start in turn. Nothing is read or written before the
wait, so any kernel may take it: it overlaps a launch and a kernel's prologue with the end of the
kernel ahead, not any work. A short kernel opens with `start` (wait, then let the next start). A
kernel that streams (the skinny matmul, decode attention's splits) opens with `wait` and calls
`let_next_start` after its main loop, as the one-row CUDA GEMVs do (csrc/one_row.cuh, their
weights fetched before the wait): let go first thing, the next kernel's programs are placed,
waiting, beside its running ones and slow it (Qwen3-8B bf16 batch 1 @ 32K on an H200, session
41: 6.70 ms early, 5.71 late, 5.72 without PDL). A kernel launched without PDL after one launched
with it simply waits for it, as without PDL."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.extensions import device_capability, pdl_wanted

try:  # Triton 3.4 and later: the device functions and the launch option (triton PR 6394)
    import dataclasses

    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    AVAILABLE = "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}
except ImportError:  # never traced: `start` is compiled with PDL false
    gdc_launch_dependents = gdc_wait = None
    AVAILABLE = False


def wanted(t: torch.Tensor) -> bool:
    """Whether kernels working on t launch with PDL: t is on a CUDA device of sm_90 or later and
    the switch is not off."""
    return AVAILABLE and t.is_cuda and pdl_wanted(device_capability(t.device.index or 0))


def launch_args(t: torch.Tensor) -> dict:
    """The launch arguments of a kernel that opens with `start` and works on t: PDL, and
    Triton's launch_pdl only where it is on (Triton before 3.4 refuses the option)."""
    return {"PDL": True, "launch_pdl": True} if wanted(t) else {"PDL": False}


@triton.jit
def start(PDL: tl.constexpr):
    """The first statement of a kernel launched with `launch_pdl=PDL`."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """The first statement of a kernel that calls `let_next_start` after its main loop."""
    if PDL:
        gdc_wait()


@triton.jit
def let_next_start(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
