"""Building blocks shared by every decoder: RMSNorm, rotary embedding, fused projections, and
the elementwise work between the GEMMs as `@fused` functions (one inductor kernel each on CUDA;
see nanoserve/fused.py). Their math follows transformers': statistics and rotation in fp32,
results rounded to the activation dtype where transformers rounds them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.fused import fused
from nanoserve.fused import is_enabled as fusion_enabled
from nanoserve.models.rope import inv_freq_and_attention_factor
from nanoserve.quant.linear import QuantizedLinear, QuantizedRows


@fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # statistics in fp32, weight applied in the input dtype: as transformers does
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@fused
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream plus a sublayer's output, and its norm: (x + delta, norm(x + delta))."""
    x = x + delta
    return x, rms_norm.eager(x, weight, eps)


@fused
def rope(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
         positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotation of q [tokens, heads, d] and k by the table rows of `positions`."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


@fused
def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float, cos_sin: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q and k, then the rotation."""
    q, k = rms_norm.eager(q, q_weight, eps), rms_norm.eager(k, k_weight, eps)
    return rope.eager(q, k, cos_sin, positions)


@fused
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, into: nn.Module | None = None
                ) -> torch.Tensor | QuantizedRows:
        """norm(x); with `into` (the layer this norm feeds), in the form its kernel takes
        (`add_forward`)."""
        handed = self._into(into, x, None)
        return rms_norm(x, self.weight, self.eps) if handed is None else handed[1]

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor, into: nn.Module | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | QuantizedRows]:
        """(x + delta, norm(x + delta)) in one pass. With `into`, the layer the norm feeds: where
        that is an FP8 layer whose kernel quantizes its input, the norm comes quantized, made
        in the same pass (QuantizedLinear.norm_input), and only that layer may take it."""
        handed = self._into(into, x, delta)
        return add_rms_norm(x, delta, self.weight, self.eps) if handed is None else handed

    def _into(self, into: nn.Module | None, x: torch.Tensor, delta: torch.Tensor | None
              ) -> tuple[torch.Tensor | None, QuantizedRows] | None:
        if not isinstance(into, QuantizedLinear) or not fusion_enabled():
            return None
        return into.norm_input(x, delta, self.weight, self.eps)


# one row: 0.22 ms a step faster than cuBLAS on an H200 (Qwen3-8B); 16 rows: the same; 64 rows:
# 0.39 ms slower (tools/bench_linear.py)
SKINNY_MAX_ROWS = 1
# the skinny matmul's fewest outputs: fewer leave SMs idle (a program per 32 or 64 of them); the
# plain one-row CUDA GEMV takes the narrower 16-bit weights
SKINNY_MIN_COLUMNS = 4096
# rows at which the MLP's down projection takes cuBLASLt's bias-epilogue kernels, which torch
# uses for a 1-D bias (a zero one where the layer has none): on an H200, Qwen3-8B's down (k
# 12288, n 4096) at 32 / 48 / 64 rows, 27.4 / 27.8 / 28.3 us against cuBLAS's 28.8 / 30.3 /
# 31.8; at 16 rows, and for qkv, o and gate_up, cuBLAS is as fast or faster (bench_linear.py)
DOWN_LT_ROWS = range(32, 65)


class Linear(nn.Linear):
    """nn.Linear whose one-row products (batch-1 decode) on CUDA run the Triton skinny matmul,
    which streams o, down, gate_up and lm_head's weights closer to the device bandwidth than
    cuBLAS's kernels for one row (qkv: the same; models/triton_linear.py), down's SiLU-multiply
    in the same kernel (`silu_mul_linear`); the narrower weights it leaves (under 4,096
    outputs: Qwen3-30B-A3B's o and router) run the plain one-row CUDA GEMV (quant/cuda_gemv.py,
    K split over CTAs). At `lt_rows` rows (the MLP's down: 32-64) a product takes cuBLASLt's
    kernels. `enable_fusion=False` keeps cuBLAS's everywhere.

    One row on an H100 (session 31, tools/bench_linear.py), us, skinny / CUDA GEMV / cuBLAS:
    Qwen3-30B-A3B's o 8.6 / 6.5 / 7.7, router 4.9 / 3.7 / 4.8, qkv 6.5 / 7.0 (at its 2 splits)
    / 6.8. On Qwen3-8B's wider weights the GEMV's gains in that bench (qkv 18.3 against 20.0,
    gate_up 66.0 against 68.7) did not reach the model: batch-1 TPOT at 32K 7.72, 7.72 ms with
    it against 7.69, 7.70 without."""

    lt_rows: range = range(0)
    _zero_bias: torch.Tensor | None = None

    def one_row_cuda(self, x: torch.Tensor) -> bool:
        """Whether this product of x runs the plain one-row CUDA GEMV."""
        if not (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and self.bias is None and
                fusion_enabled()):
            return False
        from nanoserve.quant import cuda_gemv  # builds the kernels at first use
        return cuda_gemv.half_gemv_ok(x, self.weight)

    def skinny(self, x: torch.Tensor, silu: bool = False) -> bool:
        """Whether this product of x runs the skinny kernels."""
        if not (x.is_cuda and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS and
                self.out_features >= SKINNY_MIN_COLUMNS and fusion_enabled()):
            return False
        # imported here: Triton exists only with CUDA
        from nanoserve.models.triton_linear import supports
        return supports(x, self.weight, silu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny(x):
            from nanoserve.models import triton_linear  # a test patches its functions
            return triton_linear.skinny_linear(x, self.weight, self.bias)
        if self.one_row_cuda(x):
            from nanoserve.quant import cuda_gemv
            return cuda_gemv.half_gemv(x, self.weight)
        if self.bias is None and x.is_cuda and x.dim() == 2 and x.shape[0] in self.lt_rows and \
                fusion_enabled():
            return F.linear(x, self.weight, self._lt_bias())
        return F.linear(x, self.weight, self.bias)

    def _lt_bias(self) -> torch.Tensor:
        w = self.weight
        if self._zero_bias is None or self._zero_bias.dtype != w.dtype or \
                self._zero_bias.device != w.device:
            # a graph capture would record the zeroing, not run it: warm-up runs first
            assert not torch.cuda.is_current_stream_capturing()
            self._zero_bias = torch.zeros(self.out_features, dtype=w.dtype, device=w.device)
        return self._zero_bias


def silu_mul_linear(linear: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """linear(silu(gate) * up) for rows [gate | up]: one kernel where the skinny matmul runs;
    an FP8 layer from 16 rows computes it in x's quantization pass
    (QuantizedLinear.silu_kernel_forward); with fusion off, silu_and_mul and then linear."""
    if isinstance(linear, Linear) and linear.skinny(gate_up, silu=True):
        from nanoserve.models import triton_linear
        return triton_linear.skinny_silu_linear(gate_up, linear.weight, linear.bias)
    if isinstance(linear, QuantizedLinear) and fusion_enabled():
        y = linear.silu_kernel_forward(gate_up)
        if y is not None:
            return y
    return linear(silu_and_mul(gate_up))


class MergedLinear(Linear):
    """A linear layer whose output rows are several checkpoint tensors stacked (qkv, gate_up).

    `shard_sizes` gives the rows of each shard, in order; the loader copies shard i into place.
    """

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes

    def shard_slice(self, shard: int) -> slice:
        start = sum(self.shard_sizes[:shard])
        return slice(start, start + self.shard_sizes[shard])


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a cos/sin table computed in fp32 up to max_len."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_len: int) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling, self.max_len = head_dim, theta, scaling, max_len
        self.register_buffer("cos_sin", torch.empty(max_len, head_dim), persistent=False)

    @torch.no_grad()
    def build(self) -> None:
        """Fill the table; called after the module is materialized off the meta device."""
        dev = self.cos_sin.device
        inv_freq, factor = inv_freq_and_attention_factor(self.head_dim, self.theta, self.scaling,
                                                         dev)
        t = torch.arange(self.max_len, device=dev, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        # YaRN's attention factor scales cos and sin, hence q.k by its square (transformers)
        self.cos_sin = cos_sin * factor if factor != 1.0 else cos_sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return rope(q, k, self.cos_sin, positions)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

