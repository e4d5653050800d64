"""The FP8 KV format's constants, shared by the reference quantizer (kv/fp8.py) and the CUDA
store kernel (attention/triton_kv_store.py). Imports nothing of nanoserve, so either side can
import it without importing the other."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
MIN_SCALE = 2.0**-126  # float32's smallest normal: an all-zero (token, head) gets a finite scale


def check_device_reads_fp8(device: torch.device) -> None:
    """ValueError where the GPU's kernels cannot read e4m3 (Triton's store and decode kernels
    need compute capability 8.9: Ada, Hopper, Blackwell); the CPU reads it everywhere."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or later "
                         f"(Ada, Hopper, Blackwell), whose kernels read e4m3; "
                         f"{torch.cuda.get_device_name(device)} is {major}.{minor}: use "
                         f"kv_cache_dtype auto (the model's dtype)")
