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

import functools
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
    split_k: int = 0  # programs per column block, each over a share of k; 0: chosen per device


def tiles_for(n: int, rows: int = 1) -> LinearTiles:
    """Measured on an H200 (tools/bench_linear.py, Qwen3-8B's shapes). One row: 32 columns by
    256 for the narrower weights (qkv, o, down: 79-89% of the bandwidth, cuBLAS 73-80%), 64 by
    128 for the wider (gate_up 99%, lm_head 106%: L2 hits push past the floor), all of k per
    program. More rows: split k where the column blocks alone leave SMs idle."""
    if rows == 1:
        return LinearTiles(32, 256, 4, 4, 1) if n <= 8192 else LinearTiles(64, 128, 4, 4, 1)
    return LinearTiles(64, 128, 4, 3)


def split_for(n_blocks: int, k_tiles: int, sms: int) -> int:
    """The split of k that fills the SMs' last wave best (ties: fewer splits), each split
    keeping at least 4 k tiles to pipeline."""
    def fill(s: int) -> float:
        programs = n_blocks * s
        return programs / (triton.cdiv(programs, sms) * sms)
    return max(range(1, min(8, k_tiles // 4) + 1), key=lambda s: (round(fill(s), 2), -s),
               default=1)


@triton.jit
def _skinny_linear_kernel(X, W, Bias, Y, Partials, Counters, M, N, K, stride_xm, stride_wn,
                          stride_ym, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    # BLOCK_R: the rows x is read and worked on in (1 for one row with SiLU-multiply: its work
    # skips the dot's padding rows), BLOCK_M: the dot's (at least 16). Program (n, s) owns
    # BLOCK_N columns over split s of k's tiles.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    n_mask = offs_n < N
    m_mask = offs_m < M
    r_mask = offs_r[:, None] < M
    k_tiles = K // BLOCK_K  # K % BLOCK_K == 0 (the caller checks)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_lo = pid_k * per_split * BLOCK_K
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    x_at = X + offs_r[:, None] * stride_xm + offs_k[None, :]
    w_at = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(pid_k * per_split, tl.minimum((pid_k + 1) * per_split, k_tiles)):
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
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        _store_output(acc, Y, Bias, offs_m, offs_n, n_mask, out_mask, stride_ym, HAS_BIAS)
    else:
        # each split leaves its float32 partial; the last of a column block's splits to arrive
        # (its counter) sums them in split order (deterministic) and resets the counter, so
        # the next launch or graph replay finds it at zero
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(Partials + pid_k * M * N + tile, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        arrived = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(SPLIT_K):  # through L2 (.cg): other SMs wrote them
                acc += tl.load(Partials + s * M * N + tile, mask=out_mask, other=0.0,
                               cache_modifier=".cg")
            _store_output(acc, Y, Bias, offs_m, offs_n, n_mask, out_mask, stride_ym, HAS_BIAS)
            tl.store(Counters + pid_n, 0)


@triton.jit
def _store_output(acc, Y, Bias, offs_m, offs_n, n_mask, out_mask, stride_ym,
                  HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=out_mask)


def supports(x: torch.Tensor, weight: torch.Tensor, silu: bool = False) -> bool:
    """Whether the skinny kernels take this product: CUDA, half precision, at most MAX_ROWS
    rows, at least MIN_COLUMNS outputs, contiguous rows, k a multiple of the tile. With `silu`
    x's rows are [gate | up], twice the weight's k, and there is one row (with more, every
    program would redo the SiLU of its share of k for all rows)."""
    n, k = weight.shape
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and \
        weight.dtype == x.dtype and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and \
        n >= MIN_COLUMNS and x.stride(1) == 1 and weight.stride(1) == 1 and \
        x.shape[1] == (2 * k if silu else k) and (not silu or x.shape[0] == 1) and \
        k % tiles_for(n, x.shape[0]).block_k == 0


_COUNTERS: dict[torch.device, torch.Tensor] = {}  # split-k arrival counters, zero between kernels


def _counters(device: torch.device, n: int) -> torch.Tensor:
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < n:
        # zeroed by a kernel that a graph being captured would record, not run
        assert not torch.cuda.is_current_stream_capturing(), \
            "the first split-k product on a device must run before graph capture (warm-up)"
        counters = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32,
                                                   device=device)
    return counters


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            tiles: LinearTiles | None, silu: bool = False) -> torch.Tensor:
    m = x.shape[0]
    n, k = weight.shape
    tiles = tiles or tiles_for(n, m)
    assert 0 < m <= MAX_ROWS and k % tiles.block_k == 0, (m, k, tiles)
    n_blocks = triton.cdiv(n, tiles.block_n)
    split = tiles.split_k or split_for(n_blocks, k // tiles.block_k,
                                       _sm_count(x.device))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if split > 1:
        partials = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        counters = _counters(x.device, n_blocks)
    else:  # never read
        partials = counters = y
    block_m = max(16, triton.next_power_of_2(m))
    _skinny_linear_kernel[(n_blocks, split)](
        x, weight, bias if bias is not None else weight, y, partials, counters, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_R=1 if silu and m == 1 else block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SPLIT_K=split,
        HAS_BIAS=bias is not None, SILU=silu,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return y


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


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
