"""y = x W^T with W held quantized, dequantized inside the GEMM tile by tile (Triton): the weight's
bytes are read once, in their quantized size, and never written back dequantized. One kernel for
every format (quant/formats.py), chosen by FORMAT:

- FP8 (block-wise, per channel, per tensor): an e4m3 tile times each element's scale, from a
  grid of scale rows by blocks of `scale_cols` inputs; `scale_row` names each output's row of
  it (block-wise: its shard's block row, per channel: its own, per tensor: its shard's);
- AWQ: a word of eight outputs, read once per output column (the eight reads of a word hit the
  same cache line), shifted by the column's nibble (order 0 2 4 6 1 3 5 7);
- GPTQ: a word of eight inputs, shifted by each input's nibble; zero points and scales of each
  input's group (g_idx).

Status: equal to the reference dequantization in Triton's interpreter on the CPU for every
format; not yet run on a GPU (tests/test_gpu_quant.py), so QuantizedLinear's forward still
multiplies through the reference path and only `kernel_forward` takes this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8, AWQ, GPTQ = 0, 1, 2


@triton.jit
def _quant_gemm_kernel(X, W, Scales, ScaleRow, Zeros, GIdx, Y, M, N, K, stride_xm, stride_ym,
                       stride_w, stride_s, stride_z, scale_cols, group, zero_offset,
                       FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        ok = k_ok[:, None] & n_ok[None, :]
        if FORMAT == 0:  # W e4m3 [N, K]
            w = tl.load(W + offs_n[None, :].to(tl.int64) * stride_w + ks[:, None], mask=ok,
                        other=0.0).to(tl.float32)
            row = tl.load(ScaleRow + offs_n, mask=n_ok, other=0)
            s = tl.load(Scales + row[None, :] * stride_s + ks[:, None] // scale_cols, mask=ok,
                        other=0.0)
            w = w * s
        elif FORMAT == 1:  # W int32 [K, N / 8], outputs packed
            word = tl.load(W + ks[:, None].to(tl.int64) * stride_w + offs_n[None, :] // 8,
                           mask=ok, other=0)
            col = offs_n % 8
            shift = (col % 2) * 16 + (col // 2) * 4
            g = ks[:, None] // group
            zword = tl.load(Zeros + g * stride_z + offs_n[None, :] // 8, mask=ok, other=0)
            q = (word >> shift[None, :]) & 0xF
            z = (zword >> shift[None, :]) & 0xF
            s = tl.load(Scales + g * stride_s + offs_n[None, :], mask=ok, other=0.0)
            w = (q - z).to(tl.float32) * s.to(tl.float32)
        else:  # W int32 [K / 8, N], inputs packed
            word = tl.load(W + (ks[:, None] // 8).to(tl.int64) * stride_w + offs_n[None, :],
                           mask=ok, other=0)
            q = (word >> ((ks[:, None] % 8) * 4)) & 0xF
            g = tl.load(GIdx + ks, mask=k_ok, other=0)[:, None]
            zword = tl.load(Zeros + g * stride_z + offs_n[None, :] // 8, mask=ok, other=0)
            z = ((zword >> ((offs_n[None, :] % 8) * 4)) & 0xF) + zero_offset
            s = tl.load(Scales + g * stride_s + offs_n[None, :], mask=ok, other=0.0)
            w = (q - z).to(tl.float32) * s.to(tl.float32)
        acc = tl.dot(x, w.to(x.dtype), acc)
    tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
             acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def quant_gemm(x: torch.Tensor, fmt: int, w: torch.Tensor, scales: torch.Tensor, n: int,
               scale_row: torch.Tensor | None = None, scale_cols: int = 1 << 30,
               zeros: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
               group: int = 128, zero_offset: int = 0, block: tuple[int, int, int] = (16, 64, 64),
               num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32) times one quantized weight of `n` outputs: y [M, n] in x's
    dtype. FP8: w e4m3 [n, K]; scales a float32 grid [rows, ceil(K / scale_cols)], scale_row
    int32 [n] each output's row of it. AWQ: w [K, n / 8], zeros [K / group, n / 8], scales
    [K / group, n]. GPTQ: w [K / 8, n], zeros [groups, n / 8] (each plus zero_offset), scales
    [groups, n], g_idx [K]."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk = block
    zeros = scales if zeros is None else zeros
    g_idx = scales if g_idx is None else g_idx
    scale_row = scales if scale_row is None else scale_row
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _quant_gemm_kernel[grid](
        x, w, scales, scale_row, zeros, g_idx, y, m, n, k, x.stride(0), y.stride(0),
        w.stride(0), scales.stride(0), zeros.stride(0), scale_cols, group, zero_offset,
        FORMAT=fmt, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=num_warps,
        num_stages=num_stages)
    return y
