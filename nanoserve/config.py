"""Engine settings: one frozen dataclass, validated at construction."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                 "float": "float32"}
ATTENTION_BACKENDS = ("auto", "flash", "triton", "torch")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    device: str = "auto"
    page_size: int = 256  # tokens per KV page; flash-attn's paged kernels need a multiple of 256
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192  # prefill chunk budget per step
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.90
    gpu_kv_budget_gib: float | None = None  # overrides the free-memory estimate
    enforce_eager: bool = False
    max_graph_batch_size: int = 64
    attention_backend: str = "auto"
    dummy_weights: bool = False
    seed: int = 0
    # offload (the offload/ package); the engine only reads these
    enable_offload: bool = False
    host_kv_budget_gib: float | None = None
    num_kv_buffers: int = 2
    resident_layers: int | None = None  # force the offload split (default: as many as fit)

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        check(self.page_size > 0 and self.page_size & (self.page_size - 1) == 0,
              f"page_size must be a power of two, got {self.page_size}")
        check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")
        check(_finite(self.gpu_memory_utilization) and 0.0 < self.gpu_memory_utilization <= 1.0,
              "gpu_memory_utilization must be in (0, 1]")
        check(self.gpu_kv_budget_gib is None or _finite(self.gpu_kv_budget_gib) and
              self.gpu_kv_budget_gib >= 0,
              f"gpu_kv_budget_gib must be a finite number >= 0, got {self.gpu_kv_budget_gib}")
        check(self.host_kv_budget_gib is None or _finite(self.host_kv_budget_gib) and
              self.host_kv_budget_gib > 0,
              f"host_kv_budget_gib must be a finite number > 0, got {self.host_kv_budget_gib}")
        check(self.num_kv_buffers >= 2, "num_kv_buffers must be >= 2 (one loading, one computing)")
        check(self.resident_layers is None or self.resident_layers >= 0,
              "resident_layers must be >= 0")
        check(self.max_graph_batch_size >= 1, "max_graph_batch_size must be >= 1")
        check(self.attention_backend in ATTENTION_BACKENDS,
              f"attention_backend must be one of {ATTENTION_BACKENDS}")
        dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        check(dtype == "auto" or dtype in DTYPES, f"unknown dtype {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        check(isinstance(self.device, str) and self.device in ("auto", "cpu", "cuda") or
              isinstance(self.device, str) and re.fullmatch(r"cuda:\d+", self.device) is not None,
              f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.device.startswith("cuda"):
            check(torch.cuda.is_available(),
                  f"device {self.device!r}: this torch build has no usable CUDA "
                  f"(torch {torch.__version__}); use --device cpu")
            index = int(self.device.partition(":")[2] or 0)
            check(index < torch.cuda.device_count(),
                  f"device {self.device!r}: only {torch.cuda.device_count()} CUDA devices")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
