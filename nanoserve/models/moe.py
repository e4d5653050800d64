"""Qwen3-MoE's sparse MLP: a router picks the top k of E SwiGLU experts for each token, and
the token's output is their outputs weighted by the router's probabilities.

The experts are stacked at load time, in transformers' own in-memory layout: gate_up_proj
[E, 2I, H] (an expert's gate rows, then its up rows) and down_proj [E, H, I].

Four ways to run the experts (`backend`; results equal up to rounding):
- fused: Triton kernels (fused_moe.py): the pairs sorted by expert into whole tiles on the
  device, a grouped GEMM for gate_up with SiLU-multiply in its epilogue, one for down with the
  routing weights in its epilogue. The CUDA default; its tile layout has a torch twin
  (fused_moe.experts_tiled_reference) tested on the CPU in float64.
- loop: each expert that has tokens runs them through its MLP, index_add into the output
  (transformers' eager path, the reference). It syncs with the host (which experts have
  tokens), so it cannot be captured: the CPU runs it.
- grouped: the (token, expert) pairs sorted by expert, then two grouped GEMMs
  (torch's grouped_mm) over the stacked weights. Static shapes, no host sync, no copy of the
  weights: each expert with tokens is read once (k experts a layer at batch 1). The CUDA
  path before the fused one, where torch's fast grouped GEMM exists (bf16 on Hopper /
  Blackwell); kept as a reference.
- gather: each (token, slot) pair gathers its expert's weights and runs a batched GEMV.
  Static shapes, no host sync, but the gather copies the weights (read, write, read again:
  ~3x the bytes of grouped at batch 1, and T*k experts' worth of scratch): the capturable
  fallback for decode-sized batches where Triton is missing.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.distributed.parallel_state import all_reduce
from nanoserve.extensions import device_capability
from nanoserve.models.layers import Linear, silu_and_mul
from nanoserve.quant.config import QuantConfig, UnsupportedQuantization
from nanoserve.quant.formats import dequantize, fill_dummy, gpu_reads_e4m3

MOE_BACKENDS = ("auto", "fused", "loop", "grouped", "gather")
GATHER_MAX_TOKENS = 64  # auto without the fast grouped GEMM: gather up to here, loop beyond


class Experts(nn.Module):
    """E SwiGLU experts' weights, stacked; the loader copies checkpoint expert e's gate_proj,
    up_proj and down_proj into their rows of expert e. With an FP8 block-wise checkpoint
    (`quant`) the stacks hold its e4m3 weights and each projection's `weight_scale_inv` sits
    beside them (`gate_up_proj_scale_inv` [E, 2I / bn, H / bk], `down_proj_scale_inv`
    [E, H / bn, I / bk]): the fused path reads them as they are, the others dequantize."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.num_experts, self.quant = num_experts, quant
        self.shard_sizes = [intermediate_size, intermediate_size]  # gate_up_proj rows: gate, up
        dtype = None
        if quant is not None:
            bn, bk = quant.block
            if quant.method != "fp8_block" or intermediate_size % bn or hidden_size % bn:
                raise UnsupportedQuantization(
                    f"quantized experts: only FP8 block-wise checkpoints whose blocks tile the "
                    f"experts' rows are supported, not {quant.method} with block {quant.block} "
                    f"(hidden {hidden_size}, intermediate {intermediate_size})")
            dtype = torch.float8_e4m3fn
            self.gate_up_proj_scale_inv = nn.Parameter(torch.empty(
                num_experts, 2 * intermediate_size // bn, -(-hidden_size // bk),
                dtype=torch.float32), requires_grad=False)
            self.down_proj_scale_inv = nn.Parameter(torch.empty(
                num_experts, hidden_size // bn, -(-intermediate_size // bk), dtype=torch.float32),
                requires_grad=False)
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
            requires_grad=quant is None)
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype),
            requires_grad=quant is None)

    def shard_slice(self, shard: int, scales: bool = False) -> slice:
        """gate_up_proj's rows of shard 0 (gate) or 1 (up); `scales`: its scales' rows."""
        size = self.shard_sizes[0] // (self.quant.block[0] if scales else 1)
        return slice(shard * size, (shard + 1) * size)

    def stacks(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) in `dtype`: dequantized (computed in float32)
        where the experts are FP8."""
        if self.quant is None:
            return self.gate_up_proj, self.down_proj
        return tuple(dequantize_stack(self.quant, w, s, dtype) for w, s in (
            (self.gate_up_proj, self.gate_up_proj_scale_inv),
            (self.down_proj, self.down_proj_scale_inv)))

    @torch.no_grad()
    def fill_dummy(self, generator: torch.Generator) -> None:
        """Random FP8 experts dequantizing to about N(0, 0.02), as quant.formats.fill_dummy."""
        for w, s in ((self.gate_up_proj, self.gate_up_proj_scale_inv),
                     (self.down_proj, self.down_proj_scale_inv)):
            for e in range(self.num_experts):
                fill_dummy(self.quant, {"weight": w[e], "weight_scale_inv": s[e]}, generator)


def dequantize_stack(q: QuantConfig, w: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """Stacked e4m3 weights [E, n, k] with their block scales, in `dtype`."""
    e, n, k = w.shape
    return torch.stack([dequantize(q, {"weight_scale_inv": scales[i], "weight": w[i]}, n, k,
                                   dtype) for i in range(e)])


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool, quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        # the router: at one row on CUDA its logits come from the plain one-row GEMV
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, quant)
        self.backend = "auto"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = choose_path(self.backend, x)
        logits = self.gate(x)
        if path == "fused":  # the pick in one kernel: 59.9 -> 45.8 us a layer at batch 1 (H100)
            from nanoserve.models import fused_moe
            weights, ids = fused_moe.pick(logits, self.top_k, self.norm_topk_prob)
        else:
            weights, ids = pick(logits, self.top_k, self.norm_topk_prob)
        experts = self.experts
        if path == "fused" and experts.quant is not None and gpu_reads_e4m3(x.device):
            from nanoserve.models import fused_moe
            return all_reduce(fused_moe.experts_fused(
                x, weights, ids, experts.gate_up_proj, experts.down_proj,
                scales=(experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv),
                block=experts.quant.block))
        # under TP each expert's intermediate rows are split: the ranks' outputs are partial sums
        return all_reduce(EXPERT_PATHS[path](x, weights, ids, *experts.stacks(x.dtype)))


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in x's dtype, expert ids [T, k]): softmax over the experts in fp32, the
    top k, renormalized to sum 1 when norm_topk_prob, rounded to x's dtype (transformers)."""
    return pick(F.linear(x, router), top_k, norm_topk_prob)


def pick(logits: torch.Tensor, top_k: int, norm_topk_prob: bool
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """route's weights and ids from the router's logits [T, E]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def choose_path(backend: str, x: torch.Tensor) -> str:
    """The path `backend` runs for the tokens x (see the module's docstring)."""
    if backend != "auto":
        return backend
    if not x.is_cuda:
        return "loop"
    if _has_triton():
        return "fused"
    if fast_grouped_mm(x.device, x.dtype):
        return "grouped"
    if x.shape[0] <= GATHER_MAX_TOKENS or torch.cuda.is_current_stream_capturing():
        return "gather"
    return "loop"


def fast_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs on `device` in `dtype` from device-side offsets (its
    CUTLASS kernels: bf16 on sm90 / sm100). Elsewhere on CUDA it loops over the groups on the
    host, which a CUDA graph cannot capture."""
    return device.type == "cuda" and dtype == torch.bfloat16 and \
        _grouped_mm_fn() is not None and device_capability(device.index or 0)[0] in (9, 10)


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _grouped_mm_fn():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _combine(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's k expert outputs (rows in token, slot order) weighted and summed: one
    batched GEMM, accumulated in fp32 and rounded once."""
    t, k = weights.shape
    return torch.bmm(weights.view(t, 1, k), out.view(t, k, -1)).view(t, -1)


def experts_loop(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    hits = F.one_hot(ids, gate_up.shape[0]).permute(2, 1, 0)  # [E, k, T]
    for e in hits.sum(dim=(1, 2)).nonzero().flatten().tolist():  # host sync
        slot, token = torch.where(hits[e])
        h = F.linear(silu_and_mul(F.linear(x[token], gate_up[e])), down[e])
        out.index_add_(0, token, (h * weights[token, slot, None]).to(out.dtype))
    return out


def experts_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    k = ids.shape[1]
    expert_of_row, order = torch.sort(ids.flatten(), stable=True)
    # ends[e]: rows of experts 0..e, the grouped GEMM's offsets (device-side: no host sync)
    experts = torch.arange(gate_up.shape[0], device=x.device)
    ends = torch.searchsorted(expert_of_row, experts, right=True).to(torch.int32)
    grouped_mm = _grouped_mm_fn()
    h = grouped_mm(x[order // k], gate_up.transpose(1, 2), offs=ends)
    h = grouped_mm(silu_and_mul(h), down.transpose(1, 2), offs=ends)
    unsorted = torch.empty_like(h).index_copy_(0, order, h)  # a permutation: deterministic
    return _combine(unsorted, weights)


def experts_gather(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    flat = ids.flatten()
    rows = x.repeat_interleave(ids.shape[1], dim=0)  # token, slot order
    h = torch.bmm(gate_up[flat], rows.unsqueeze(-1)).squeeze(-1)
    h = torch.bmm(down[flat], silu_and_mul(h).unsqueeze(-1)).squeeze(-1)
    return _combine(h, weights)


def experts_fused(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    from nanoserve.models import fused_moe  # Triton: CUDA installs only
    return fused_moe.experts_fused(x, weights, ids, gate_up, down)


EXPERT_PATHS = {"fused": experts_fused, "loop": experts_loop, "grouped": experts_grouped,
                "gather": experts_gather}
