"""Engine settings: one frozen dataclass, validated at construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from nanoserve.distributed.parallel_state import tp_rank, tp_size
from nanoserve.errors import is_finite_number
from nanoserve.models.moe import MOE_BACKENDS
from nanoserve.text import plural

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                 "float": "float32"}
ATTENTION_BACKENDS = ("auto", "flash", "triton", "torch")
KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}  # and auto


def _field(default, help: str, **cli):
    """A setting: its default, its help, and hints for its command-line option (`min`, `max`,
    `min_open`: a range; `choices`; `name`: the option's name where it is not the field's)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, with its default and help: `nanoserve`'s engine options are made
    from these fields (nanoserve/cli.py), bench_offload.py reads its defaults from them."""

    model: str = _field("", "Local model dir, Hugging Face hub id, or a shipped config name "
                        "with dummy weights (nanoserve/model_configs: Qwen3-8B, Qwen3-8B-YaRN, "
                        "Qwen3-30B-A3B(-YaRN), Mistral-Nemo-12B, ...). "
                        "Default: the embedded tiny model.")
    dtype: str = _field("auto", "Weights, activations and KV cache; auto: bf16 on CUDA, fp32 on "
                        "CPU.", choices=("auto", *DTYPES, *DTYPE_ALIASES))
    kv_cache_dtype: str = _field("auto", "KV cache of every tier (GPU pool, host store, ring "
                                 "slots): auto is the model's dtype; fp8 is e4m3 with a float32 "
                                 "scale per token and kv head (half the bytes, twice the "
                                 "context).", choices=("auto", *KV_CACHE_DTYPES))
    device: str = _field("auto", "auto (cuda when available), cpu, cuda or cuda:N.")
    page_size: int = _field(256, "Tokens per KV page (a power of two; flash-attn's paged "
                            "kernels need a multiple of 256).", min=1)
    max_num_seqs: int = _field(64, "Most sequences in one batch.", min=1)
    max_num_batched_tokens: int = _field(8192, "Prefill tokens per step (the chunk size of "
                                         "chunked prefill); running sequences' decode tokens "
                                         "ride along on top.", min=1)
    max_model_len: int | None = _field(None, "Longest prompt + output, in tokens. Default: the "
                                       "model's maximum.", min=2)
    gpu_memory_utilization: float = _field(0.90, "Share of the device's memory the engine "
                                           "may take, KV cache included.", min=0, max=1,
                                           min_open=True)
    gpu_kv_budget_gib: float | None = _field(
        None, "GiB of device memory for the KV cache (emulates a smaller GPU; on a CPU, the "
        "RAM of the KV the engine computes from, host KV being the offload tier; fractions "
        "such as 0.03 are fine). Default: on CUDA, what the gpu memory utilization leaves after "
        "a warm-up; on a CPU, 1 GiB.", min=0, name="gpu-kv-budget")
    tensor_parallel_size: int = _field(1, "GPUs the model is split over, one process each "
                                       "(tensor parallelism: each GPU holds its share of the "
                                       "weights and of the KV heads, and streams its share of "
                                       "offloaded KV over its own link).", min=1,
                                       name="tensor-parallel-size")
    enforce_eager: bool = _field(False, "Turn CUDA graphs off.")
    enable_fusion: bool = _field(True, "On CUDA, fuse the elementwise work between the GEMMs "
                                 "(norms, RoPE, SiLU, residual adds) into one kernel each with "
                                 "torch.compile; compiled once per process at start.")
    async_scheduling: bool = _field(True, "While the device runs a decode step, the host "
                                    "schedules and launches the next one (tokens read back a "
                                    "step late; with offload, the next step's KV loads queue "
                                    "behind this one's). Used for plain decode steps without "
                                    "logprobs or penalties.")
    max_graph_batch_size: int = _field(64, "Largest decode batch captured as a CUDA graph "
                                       "(larger batches run eagerly).", min=1)
    attention_backend: str = _field("auto", "auto: triton on CUDA, torch on CPU; flash (by "
                                    "name only) is untested.", choices=ATTENTION_BACKENDS)
    moe_backend: str = _field("auto", "How mixture-of-experts layers run their experts: "
                              "fused (Triton: sorted by expert, grouped GEMMs with SiLU and "
                              "the routing weights fused), grouped (torch's grouped GEMM), "
                              "gather (gathered weights, batched GEMV), loop (one expert at a "
                              "time); auto: fused on CUDA, loop on CPU.",
                              choices=MOE_BACKENDS)
    dummy_weights: bool = _field(False, "Random weights built on the device from the config "
                                 "alone.")
    seed: int = _field(0, "Seed of dummy weights, synthetic prompts and requests that bring no "
                       "seed.")
    enable_prefix_caching: bool = _field(True, "Reuse the KV of full pages whose tokens (and "
                                         "every token before them) a new request shares with "
                                         "an earlier one; unused cached pages are evicted "
                                         "least recently used first.")
    # offload (the offload/ package); the engine only reads these
    enable_offload: bool = _field(False, "Keep KV of layers that do not fit the GPU budget in "
                                  "pinned host memory and stream it through GPU ring buffers.")
    host_kv_budget_gib: float | None = _field(
        None, "GiB of pinned host memory for offloaded KV. Default: from free RAM.", min=0,
        min_open=True, name="host-kv-budget")
    num_kv_buffers: int = _field(2, "GPU ring-buffer slots for streamed layers (prefetch depth "
                                 "+ 1).", min=2)
    resident_layers: int | None = _field(None, "With offload: force this many layers resident "
                                         "(the rest stream) instead of as many as the GPU "
                                         "budget holds.", min=0)
    cpu_attention: str = _field("auto", "With offload, in decode: the CPU attends a share of "
                                "each streamed layer's host KV straight from host memory while "
                                "the rest crosses the link, exactly (the two merge by "
                                "log-sum-exp). auto: the share from this host's CPU and link "
                                "rates, measured at start (off on a CPU device and with the "
                                "flash backend); off; or a fraction in [0, 1].")

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        check(self.page_size > 0 and self.page_size & (self.page_size - 1) == 0,
              f"page_size must be a power of two, got {self.page_size}")
        check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")
        check(is_finite_number(self.gpu_memory_utilization) and
              0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]")
        check(self.gpu_kv_budget_gib is None or is_finite_number(self.gpu_kv_budget_gib) and
              self.gpu_kv_budget_gib >= 0,
              f"gpu_kv_budget_gib must be a finite number >= 0, got {self.gpu_kv_budget_gib}")
        check(self.host_kv_budget_gib is None or is_finite_number(self.host_kv_budget_gib) and
              self.host_kv_budget_gib > 0,
              f"host_kv_budget_gib must be a finite number > 0, got {self.host_kv_budget_gib}")
        check(self.num_kv_buffers >= 2, "num_kv_buffers must be >= 2 (one loading, one computing)")
        check(self.resident_layers is None or self.resident_layers >= 0,
              "resident_layers must be >= 0")
        check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
              "tensor_parallel_size must be an integer >= 1")
        check(self.max_graph_batch_size >= 1, "max_graph_batch_size must be >= 1")
        check(self.attention_backend in ATTENTION_BACKENDS,
              f"attention_backend must be one of {ATTENTION_BACKENDS}")
        check(self.kv_cache_dtype == "auto" or self.kv_cache_dtype in KV_CACHE_DTYPES,
              f"kv_cache_dtype must be auto, bfloat16 or fp8, got {self.kv_cache_dtype!r}")
        check(self.kv_cache_dtype != "fp8" or self.attention_backend != "flash",
              "kv_cache_dtype fp8: the flash attention backend reads no FP8 KV; use "
              "attention_backend triton or auto")
        check(self.cpu_attention in ("off", "auto") or _fraction(self.cpu_attention) is not None,
              f"cpu_attention must be off, auto or a fraction in [0, 1], got "
              f"{self.cpu_attention!r}")
        check(self.cpu_attention in ("off", "auto") or self.attention_backend != "flash",
              "cpu_attention: the flash attention backend cannot merge a CPU share; use "
              "attention_backend triton or auto")
        check(self.moe_backend in MOE_BACKENDS, f"moe_backend must be one of {MOE_BACKENDS}")
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
                  f"device {self.device!r}: only "
                  f"{plural(torch.cuda.device_count(), 'CUDA device')}")
        if self.tensor_parallel_size > 1:
            check(self.device in ("auto", "cpu", "cuda"),
                  f"tensor_parallel_size {self.tensor_parallel_size} runs on devices 0.."
                  f"{self.tensor_parallel_size - 1}; device {self.device!r} names one: pick the "
                  f"GPUs with CUDA_VISIBLE_DEVICES instead")
            if self.torch_device.type == "cuda":
                check(self.tensor_parallel_size <= torch.cuda.device_count(),
                      f"tensor_parallel_size {self.tensor_parallel_size} exceeds the "
                      f"{plural(torch.cuda.device_count(), 'visible CUDA device')}")

    @property
    def torch_device(self) -> torch.device:
        """This process's device: under tensor parallelism, rank r runs on cuda:r."""
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and tp_size() > 1:
            return torch.device("cuda", tp_rank())
        return torch.device(device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    @property
    def cpu_attention_fraction(self) -> float | None:
        """cpu_attention as a fixed fraction; None for off and auto."""
        return _fraction(self.cpu_attention)

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        """The stored KV values' dtype."""
        if self.kv_cache_dtype == "auto":
            return self.torch_dtype
        return KV_CACHE_DTYPES[self.kv_cache_dtype]


def _fraction(text: str) -> float | None:
    """A fraction in [0, 1] written as text, or None."""
    try:
        x = float(text)
    except (TypeError, ValueError):
        return None
    return x if 0.0 <= x <= 1.0 else None


def config_default(name: str):
    """The default of setting `name` (KeyError for an unknown one): scripts with options of
    their own for engine settings take the defaults from here."""
    return EngineConfig.__dataclass_fields__[name].default
