"""The FP8 KV format's constants, shared by the reference quantizer (kv/fp8.py) and the CUDA
store kernel (attention/triton_kv_store.py). Imports nothing of nanoserve, so either side can
import it without importing the other."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
MIN_SCALE = 2.0**-126  # float32's smallest normal: an all-zero (token, head) gets a finite scale
