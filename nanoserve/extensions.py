"""The hand-written kernels' builds (attention/csrc/: C++ for the CPU's attention share, CUDA
for FP8 decode; quant/csrc/: CUDA for AWQ's and FP8's one-row products; models/csrc/: CUDA for
one token's MoE experts): compiled at first use through torch's cpp_extension and cached, with a
line saying so when a build is about to take a while."""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path

log = logging.getLogger("nanoserve")

# the one-row CUDA kernels (quant/cuda_gemv.py, models/cuda_moe.py) run where they build; "0"
# (only that value) here leaves Triton's (batch-1 TPOT on an H100, session 27: AWQ 5.08
# against 6.66 ms, MoE 4.00 against 4.36, FP8 even; docs/perf-notes.md); tools/gpu_check.sh
# onerow tests them
ONE_ROW_SWITCH = "NANOSERVE_ONE_ROW_CUDA"


def one_row_cuda_wanted() -> bool:
    return os.environ.get(ONE_ROW_SWITCH) != "0"


# The one-row GEMVs (csrc/one_row.cuh: a GEMV fetches its first weights into L2 while the
# kernel ahead of it finishes), the decode step's Triton kernels (nanoserve/pdl.py) and
# inductor's are launched with programmatic dependent launch on sm_90 and later unless this is
# "0". Session 32, H200, batch-1 TPOT with it and without, alternating: Qwen3-30B-A3B at 4K 2.89
# against 3.04-3.07 ms, Qwen3-8B-FP8 at 32K 4.26 against 4.34-4.35, Qwen3-8B-AWQ 4.01 against
# 4.05 (docs/perf-notes.md)
PDL_SWITCH = "NANOSERVE_PDL"


def pdl_wanted(capability: tuple[int, int]) -> bool:
    """Whether kernels that support it launch with programmatic dependent launch on a device
    of this compute capability: sm_90 and later, unless NANOSERVE_PDL=0."""
    return os.environ.get(PDL_SWITCH) != "0" and capability >= (9, 0)


@cache
def device_capability(index: int) -> tuple[int, int]:
    """CUDA device `index`'s compute capability, asked once (the one-row kernels ask at every
    eager launch)."""
    import torch
    return torch.cuda.get_device_capability(index)


def load_extension(name: str, sources: list[Path], what: str, **kw):
    """torch's cpp_extension.load of `sources` as module `name`; raises what it raises."""
    from torch.utils import cpp_extension

    try:
        built = Path(cpp_extension._get_build_directory(name, False), f"{name}.so").exists()
    except Exception:  # a private helper: if it moves, no line, the same build
        built = True
    if not built:
        log.info("%s: compiling it (first use on this machine, up to a minute; cached after)",
                 what)
    return cpp_extension.load(name, [str(s) for s in sources], verbose=False, **kw)


# shared by the CUDA kernels of several folders (one_row.cuh)
COMMON_CSRC = Path(__file__).parent / "csrc"


def cuda_module(name: str, sources: list[Path], what: str, capability: tuple[int, int],
                fallback: str, **kw):
    """load_extension of CUDA `sources` on a GPU of at least `capability`, or None: no such
    GPU, or no nvcc, no ninja, a build error (logged once, saying `fallback` runs instead).
    Callers cache it. COMMON_CSRC is on the include path."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < capability:
        return None
    kw["extra_include_paths"] = [*kw.get("extra_include_paths", []), str(COMMON_CSRC)]
    try:
        return load_extension(name, sources, what, **kw)
    except Exception as e:  # the caller's fallback runs
        log.warning("%s could not be built (%s: %s); using %s", what, type(e).__name__,
                    str(e)[:200], fallback)
        return None


def one_row_module(name: str, sources: list[Path], what: str, include: Path):
    """cuda_module for the one-row kernels (sm_80 and later, -O3, Triton's the fallback), or
    None where ONE_ROW_SWITCH turns them off."""
    if not one_row_cuda_wanted():
        return None
    return cuda_module(name, sources, what, (8, 0), "Triton's", extra_cflags=["-O3"],
                       extra_cuda_cflags=["-O3"], extra_include_paths=[str(include)])
