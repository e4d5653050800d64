"""Skinny matmul for decode's few rows, in Triton: y = x @ w.T (+ bias) for x [rows <= 64, k]
and a weight w [n, k], the weight streamed once.

At batch 1 a decode step's linear layers are reads of their weights; cuBLAS's kernels for a
single row reach 75-79% of the device bandwidth on qkv, o and down (an H200, Qwen3-8B's
shapes) and some add split-K reductions. Here each program owns `block_n` output
columns over all of k (no split, no reduction kernel), and the weight tiles arrive through
`num_stages` asynchronous copies, so enough bytes are in flight to keep the memory busy.
tools/bench_linear.py measures it against torch's F.linear per shape.

The row-wise work before a projection can ride in the same kernel: the residual add and RMSNorm
before qkv, gate_up and the head, SiLU-and-multiply before down. Each program redoes it for
the few rows it reads (kilobytes, from L2), which saves a kernel launch per norm.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_ROWS = 64  # rows run as one tile of 16, 32 or 64
MIN_COLUMNS = 4096  # fewer output columns leave SMs idle (a program per 32 or 64 of them)


class LinearTiles(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tiles_for(n: int) -> LinearTiles:
    """Measured at one row on an H200 (tools/bench_linear.py, Qwen3-8B's shapes): 32 columns
    by 256 for qkv, o and down (n <= 6144; 81-88% of the bandwidth, cuBLAS 75-79%), 64 by 128
    for gate_up and lm_head (100-108%, cuBLAS 100-103%: L2 hits push past the floor)."""
    return LinearTiles(32, 256, 4, 4) if n <= 8192 else LinearTiles(64, 128, 4, 4)


@triton.jit
def _residual(X, Delta, at, mask, HAS_DELTA: tl.constexpr):
    """x + delta, rounded to x's dtype as a separate add would round it."""
    x = tl.load(X + at, mask=mask, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(Delta + at, mask=mask, other=0.0).to(tl.float32)
             ).to(x.dtype)
    return x


@triton.jit
def _skinny_linear_kernel(X, Delta, NormW, Resid, W, Bias, Y, M, N, K, eps,
                          stride_xm, stride_wn, stride_ym,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, NORM: tl.constexpr, SILU_MUL: tl.constexpr,
                          HAS_DELTA: tl.constexpr, ROW_K: tl.constexpr):
    """Plain: y = x @ w.T. NORM (one row): y = rms_norm(x + delta) @ w.T, each program
    computing the row's statistic itself and program 0 storing x + delta in Resid. SILU_MUL:
    x holds [gate | up] (2K columns), y = (silu(gate) * up) @ w.T. Both prologues round where
    layers.add_rms_norm and layers.silu_and_mul round."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m[:, None] < M
    rows = offs_m[:, None] * stride_xm
    if NORM:  # one row (the caller checks), read whole at once: one round trip, not K / BLOCK_K
        offs_row = tl.arange(0, ROW_K)
        row_mask = offs_row < K
        row = _residual(X, Delta, offs_row, row_mask, HAS_DELTA)
        if HAS_DELTA:
            tl.store(Resid + offs_row, row, mask=row_mask & (pid == 0))
        row = row.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(row * row, 0) / K + eps)
    w_at = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (the caller checks)
        at = rows + k0 + offs_k[None, :]
        if NORM:
            h = _residual(X, Delta, at, m_mask, HAS_DELTA)
            g = tl.load(NormW + k0 + offs_k).to(tl.float32)
            x = (g[None, :] * (h.to(tl.float32) * inv_rms).to(h.dtype).to(tl.float32)
                 ).to(h.dtype)
        elif SILU_MUL:
            gate = tl.load(X + at, mask=m_mask, other=0.0)
            up = tl.load(X + at + K, mask=m_mask, other=0.0).to(tl.float32)
            g = gate.to(tl.float32)
            x = ((g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32) * up).to(gate.dtype)
        else:
            x = tl.load(X + at, mask=m_mask, other=0.0)
        w = tl.load(w_at + k0, mask=n_mask[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_mask & n_mask[None, :])


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the skinny kernels take this product: CUDA, half precision, at most MAX_ROWS
    rows, at least MIN_COLUMNS outputs, contiguous rows, k a multiple of the tile."""
    n, k = weight.shape
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and \
        weight.dtype == x.dtype and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and \
        n >= MIN_COLUMNS and x.stride(1) == 1 and weight.stride(1) == 1 and \
        k % tiles_for(n).block_k == 0


def _launch(x: torch.Tensor, k: int, weight: torch.Tensor, bias: torch.Tensor | None,
            tiles: LinearTiles | None, prologue: str = "", delta: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, resid: torch.Tensor | None = None,
            eps: float = 0.0) -> torch.Tensor:
    m, n = x.shape[0], weight.shape[0]
    tiles = tiles or tiles_for(n)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_linear_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, delta if delta is not None else x, norm_weight if norm_weight is not None else x,
        resid if resid is not None else x, weight, bias if bias is not None else weight, y,
        m, n, k, eps, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, HAS_BIAS=bias is not None, NORM=prologue == "norm",
        SILU_MUL=prologue == "silu_mul",
        HAS_DELTA=delta is not None, ROW_K=triton.next_power_of_2(k) if prologue == "norm" else 1,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return y


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tiles: LinearTiles | None = None) -> torch.Tensor:
    """x [rows, k] @ weight [n, k].T + bias [n]: [rows, n] in x's dtype (see `supports`)."""
    return _launch(x, x.shape[1], weight, bias, tiles)


def skinny_norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                       eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta) @ weight.T + bias) in one kernel; delta None: (x,
    rms_norm(x) @ weight.T + bias). x, delta [1, k] contiguous (see `supports`)."""
    assert x.shape[0] == 1 and x.is_contiguous() and (delta is None or delta.is_contiguous())
    resid = torch.empty_like(x) if delta is not None else x
    y = _launch(x, x.shape[1], weight, bias, None, "norm", delta, norm_weight, resid, eps)
    return resid, y


def skinny_silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T + bias for gate_up = [gate | up] [rows, 2k]."""
    return _launch(gate_up, gate_up.shape[1] // 2, weight, bias, None, "silu_mul")
