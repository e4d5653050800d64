"""Skinny matmul for decode's few rows, in Triton: y = x @ w.T (+ bias) for x [rows <= 64, k]
and a weight w [n, k], the weight streamed once.

At batch 1 a decode step's linear layers are reads of their weights; cuBLAS's kernels for a
single row reach 73-80% of the device bandwidth on qkv, o and down (an H200, Qwen3-8B's
shapes) and some add split-K reductions. Here each program owns `block_n` output
columns over all of k (no split, no reduction kernel), and the weight tiles arrive through
`num_stages` asynchronous copies, so enough bytes are in flight to keep the memory busy.
tools/bench_linear.py measures it against torch's F.linear per shape: ahead at one row (o 89%
against 73%, down 86% against 78%), even at 16, behind at 64; layers.Linear uses it for one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanoserve import pdl

MAX_ROWS = 64  # rows run as one tile of 16, 32 or 64


class LinearTiles(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tiles_for(n: int) -> LinearTiles:
    """Measured at one row on an H200 (tools/bench_linear.py, Qwen3-8B's shapes): 32 columns
    by 256 for the narrower weights (qkv, o, down: 79-89% of the bandwidth, cuBLAS 73-80%), 64
    by 128 for the wider (gate_up 99%, lm_head 106%: L2 hits push past the floor)."""
    return LinearTiles(32, 256, 4, 4) if n <= 8192 else LinearTiles(64, 128, 4, 4)


@triton.jit
def _skinny_linear_kernel(X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                          BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                          PDL: tl.constexpr):
    # BLOCK_R: the rows x is read and worked on in (1 for one row with SiLU-multiply: its work
    # skips the dot's padding rows), BLOCK_M: the dot's (at least 16)
    pdl.wait(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    r_mask = offs_r[:, None] < M
    x_at = X + offs_r[:, None] * stride_xm + offs_k[None, :]
    w_at = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (the caller checks)
        x = tl.load(x_at, mask=r_mask, other=0.0)
        if SILU:  # x rows are [gate | up]: silu(gate) * up, rounded where torch rounds
            up = tl.load(x_at + K, mask=r_mask, other=0.0)
            gate = x.to(tl.float32)
            x = (gate / (1.0 + tl.exp(-gate))).to(x.dtype)
            x = (x.to(tl.float32) * up.to(tl.float32)).to(x.dtype)
        if BLOCK_R < BLOCK_M:  # one row: the dot's padding rows are zeros
            x = tl.where(offs_m[:, None] == 0, x, tl.zeros([BLOCK_M, BLOCK_K], x.dtype))
        w = tl.load(w_at, mask=n_mask[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_at += BLOCK_K
        w_at += BLOCK_K
    pdl.let_next_start(PDL)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def supports(x: torch.Tensor, weight: torch.Tensor, silu: bool = False) -> bool:
    """Whether the skinny kernels take this product: CUDA, half precision, at most MAX_ROWS
    rows, contiguous rows, k a multiple of the tile (layers.Linear also asks for
    SKINNY_MIN_COLUMNS outputs: fewer leave SMs idle). With `silu`
    x's rows are [gate | up], twice the weight's k."""
    n, k = weight.shape
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and \
        weight.dtype == x.dtype and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and \
        x.stride(1) == 1 and weight.stride(1) == 1 and \
        x.shape[1] == (2 * k if silu else k) and k % tiles_for(n).block_k == 0


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            tiles: LinearTiles | None, silu: bool = False) -> torch.Tensor:
    m = x.shape[0]
    n, k = weight.shape
    tiles = tiles or tiles_for(n)
    assert 0 < m <= MAX_ROWS and k % tiles.block_k == 0, (m, k, tiles)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(m))
    pdl_args = pdl.launch_args(x)
    _skinny_linear_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_R=1 if silu and m == 1 else block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, HAS_BIAS=bias is not None, SILU=silu,
        **pdl_args, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    return y


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tiles: LinearTiles | None = None) -> torch.Tensor:
    """x [rows, k] @ weight [n, k].T + bias [n]: [rows, n] in x's dtype (see `supports`)."""
    return _launch(x, weight, bias, tiles)


def skinny_silu_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None,
                       tiles: LinearTiles | None = None) -> torch.Tensor:
    """silu(gate) * up @ weight.T + bias for rows [gate | up], in one kernel, rounded as
    layers.silu_and_mul rounds (silu to x's dtype, then the product). At one row on an H200
    (down, Qwen3-8B): 28.1 us against 29.3 for the separate kernels (tools/bench_linear.py)."""
    return _launch(gate_up, weight, bias, tiles, silu=True)
