"""Kernels written and tested off the GPU (Triton's interpreter on the CPU, compiled for sm_90 by
tools/check_kernels.py) but not yet measured on one: the MoE router's fused softmax and top-k
(models/fused_moe.py). They stay off unless NANOSERVE_NEW_KERNELS=1, which tools/gpu_check.sh
sets to measure them against the paths they would replace; each turns on by default once its
GPU tests and figures are in."""

from __future__ import annotations

import os

ENABLED = os.environ.get("NANOSERVE_NEW_KERNELS", "0") == "1"
