"""Stage 1 of FP8 decode attention in CUDA (csrc/fp8_decode.cu): tensor-core MMAs fed from
lane-private shared memory slots (asynchronous copies, a few tiles deep), for head_dim 128 and
GQA groups of 1-16 on GPUs with e4m3 conversion (compute capability 8.9 and later). Built at
first use through torch's cpp_extension (nvcc); where it cannot be built, or for other shapes,
attention/triton_decode.py's kernel runs (`available` says which)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from nanoserve.extensions import cuda_module

CSRC = Path(__file__).parent / "csrc"
HEAD_DIM, MAX_GROUP = 128, 16


@cache
def _extension():
    """The compiled module, or None where it cannot be built or run."""
    return cuda_module(
        "nanoserve_fp8_decode", [CSRC / "fp8_decode_binding.cpp", CSRC / "fp8_decode.cu"],
        "FP8 decode's CUDA kernel", (8, 9), "Triton's", extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "--use_fast_math"], extra_include_paths=[str(CSRC)])


def num_splits(caller_splits: int, factor: float) -> int:
    """The kernel's split count for a caller's (num_splits_for's: about 4 waves of blocks over
    the SMs): `factor` of it rounded down, so that a quarter of 4 waves is at most one block an
    SM (rounded up, 16.5 became 17 and put two blocks on 4 of 132 SMs: the engine's TPOT at 128K
    went from 7.10 to 7.85 ms), and at least 2 (one split is Triton's direct path)."""
    return max(2, int(caller_splits * factor))


def available(q: torch.Tensor, k_cache: torch.Tensor, page_size: int) -> bool:
    """Whether the CUDA kernel takes this call: an FP8 cache [pages, page_size, kv_heads, 128]
    on a GPU where it builds, 16-byte aligned, a bf16 or f16 query, a power-of-two page
    size."""
    group = q.shape[1] // k_cache.shape[2]
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] == HEAD_DIM and 1 <= group <= MAX_GROUP
            and page_size & (page_size - 1) == 0 and k_cache.element_size() == 1
            and _aligned(k_cache) and _extension() is not None)


def _aligned(cache: torch.Tensor) -> bool:
    """The kernel reads 16-byte vectors of a token's head."""
    return cache.data_ptr() % 16 == 0 and all(x % 16 == 0 for x in cache.stride()[:3])


def decode_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    k_scale: torch.Tensor, v_scale: torch.Tensor, page_tables: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, starts: torch.Tensor | None,
                    mid_o: torch.Tensor, mid_lse: torch.Tensor, stages: int = 2) -> None:
    """Writes each split's output [batch, heads, splits, 128] and natural-log LSE [batch,
    heads, splits] (float32) over each row's tokens [starts, context_lens), as Triton's stage
    1 does; the split count is mid_o's. `stages`: 32-token tiles each warp holds in shared
    memory (2 to 4), the one it computes and the rest in flight."""
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_scale.stride() == v_scale.stride() and mid_o.stride(-1) == 1
    assert mid_lse.stride(-1) == 1
    assert page_tables.dtype == context_lens.dtype == torch.int32
    assert _aligned(k_cache) and _aligned(v_cache)
    page_size = k_cache.shape[1]
    with torch.cuda.device(q.device):
        stream = torch.cuda.current_stream().cuda_stream  # a graph's, while capturing
        refused = _extension().decode_partials(
            q, k_cache, v_cache, k_scale, v_scale, page_tables, context_lens, starts, mid_o,
            mid_lse, scale, page_size.bit_length() - 1, stages, stream)
    if refused:
        raise RuntimeError(refused)
