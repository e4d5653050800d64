"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step (sm_90 and later,
unless NANOSERVE_PDL=0; extensions.pdl_wanted). A kernel launched with it may start while the kernel
ahead of it in the stream is still running; `start` at the top of the kernel waits for that
kernel to finish (its writes visible), then lets the next kernel start in turn. Nothing is read
or written before the wait, so any kernel may take it: it overlaps a launch and a kernel's
prologue with the end of the kernel ahead, not any work. The one-row CUDA GEMVs do the same
(csrc/one_row.cuh), their weights fetched before the wait. A kernel launched without PDL after
one launched with it simply waits for it, as without PDL."""

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
