"""What the one-row GEMV probes share (gemv_stages.py; session 29's awq_half2.py): a probe's
CUDA source built through torch's load_inline with the engine's one-row headers
(gemv_split.cuh's split ending, one_row.cuh's loads and conversions) and torch's stream and
launch checks included."""

from __future__ import annotations

from pathlib import Path

from torch.utils.cpp_extension import load_inline

from nanoserve.quant import cuda_gemv

QUANT_CSRC = Path(cuda_gemv.__file__).parent / "csrc"  # gemv_split.cuh
ONE_ROW_CSRC = QUANT_CSRC.parents[1] / "csrc"  # one_row.cuh
HEADERS = r"""
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <torch/extension.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "gemv_split.cuh"
"""


def build(name: str, cpp: str, cuda: str, functions: list[str]):
    """load_inline of `cuda` (after HEADERS) declared by `cpp`, -O3, exporting `functions`."""
    return load_inline(name, cpp_sources=cpp, cuda_sources=HEADERS + cuda, functions=functions,
                       extra_cuda_cflags=["-O3"],
                       extra_include_paths=[str(QUANT_CSRC), str(ONE_ROW_CSRC)])
