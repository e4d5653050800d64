"""y = x W^T with W held quantized (quant/formats.py), in Triton: the weight's bytes are read in
their quantized size, once per row tile, and never written back dequantized.

- FP8 (block-wise, per channel, per tensor): as the checkpoints declare (`activation_scheme:
  dynamic`) and as vLLM and SGLang run them, from WIDE_ROWS rows x is quantized too, to e4m3
  per row and 128 inputs (its scale: the group's largest magnitude over 448), in one pass
  before the GEMM (`quantize_activations`; `fp8_activations_reference` is its torch twin), or
  by the kernel that makes x (the residual add and RMSNorm ahead of qkv and gate_up:
  `norm_quantize_activations`; SiLU-and-mul ahead of down: `quantize_activations`' silu), and
  the product runs on FP8 tensor cores (`fp8_quantized_gemm`). Below WIDE_ROWS (batch-1
  decode) the weight is widened to x's dtype in the tile instead: one kernel, no quantization
  pass. `_fp8_gemm_kernel`:
  acc += dot(xq, w) * x_scale[m] * w_scale[n] per step, a step never crossing a weight scale
  block, `scale_row` naming each output's row of the weight scales' grid (block-wise: its
  shard's block row, per channel: its own, per tensor: its shard's); decode's rows split K
  over programs. 128 x 128 blocks from CUBLAS_ROWS rows:
  cuBLAS's block-scaled GEMM (`cublas_block_scaled` says where it is right). float32 x keeps
  its precision: w widened, no activation quantization.
- AWQ (a word holds eight outputs, nibble order 0 2 4 6 1 3 5 7) and GPTQ (a word holds eight
  inputs), `_int4_gemm_kernel`: acc += (dot(x, q) - sum_k(x) z[n]) * s[n] per step of one
  group (4-bit integers are exact in bf16 and fp16); GPTQ with act-order (g_idx not k //
  group): each input's own group, dequantized element by element before the dot (slower).
  One row (batch-1 decode), `_int4_gemv_kernel`: no tensor cores, the nibbles widened through
  float32's bit pattern (2^23 + q) instead of integer conversions, which run at a quarter of
  the FMA rate and would bound a 4-bit GEMV at several times its memory floor. AWQ at 2-64
  rows, `_awq_mma_kernel`: two nibbles become two bf16 / fp16 values in one step (MAGIC), on
  tensor cores.

Decode's few rows run as models/triton_linear.py's skinny matmul does (a program owns BLOCK_N
outputs over its share of K, the weight's tiles in flight through `num_stages` copies; a K split
over programs is summed by `_store_split`), prefill's many as a tiled GEMM.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanoserve.extensions import device_capability
from nanoserve.quant.formats import gpu_reads_e4m3

FP8, AWQ, GPTQ, GPTQ_ACT_ORDER = 0, 1, 2, 3
SKINNY_ROWS = 64  # up to this many rows: one row tile, the skinny matmul's schedule
FP8_GROUP = 128  # inputs an activation scale covers (the checkpoints' weight blocks' width)
# groups of FP8_GROUP inputs a program of the quantization pass takes (fewer if a row has
# fewer). A whole row a program held it in registers: 254 a thread at 12,288 inputs, spilling
# with silu folded in. Us on an H100 (tools/probes/quantize_pass.py, session 38), a whole row
# against 8 groups: 64 rows x 12,288 with silu 4.8 / 2.9, without 3.3 / 2.8; 64 x 4,096 2.7 /
# 2.8; 8,192 x 12,288 with silu 174.3 / 173.7, 8,192 x 4,096 37.4 / 37.6
QUANT_GROUPS = 8
INT4_MAX_ROWS = 1024  # more rows: dequantized once, then cuBLAS (the 4-bit GEMM's tiles run at
# a fifth of cuBLAS's bf16 rate; tools/bench_quant.py at 4096 rows)
WIDE_ROWS = 16  # FP8 below this many rows: x not quantized, the weight widened to x's dtype
# in the kernel (the quantization pass cost as much as it saved; tools/bench_quant.py --tune)
CUBLAS_ROWS = SKINNY_ROWS + 1  # FP8 128 x 128 blocks from this many rows: cuBLAS (at 16-64
# rows the Triton kernel was as fast or faster; tools/bench_quant.py --tune)
# (A kernel with the weight as the dot's left operand, widened and scaled in registers for
# Hopper's wgmma, was at best 3-5% faster at 16-32 rows and slowed Qwen3-8B-FP8's 64 x 512 TPOT
# from 6.20 to 8.13 ms on an H200: session 33, removed.)


# a 16-bit float whose low mantissa bits a nibble fills (twice, in a word), and its value
# with the nibble 0
_MAGIC = {torch.bfloat16: dict(MAGIC=0x43004300, MAGIC_F=128.0),
          torch.float16: dict(MAGIC=0x64006400, MAGIC_F=1024.0)}


class QuantTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # decode: programs a column tile's K is split over (_store_split)


def tiles_for(m: int, n: int, fmt: int = FP8, fp8_x: bool = True, k: int = 4096,
              dtype: torch.dtype = torch.bfloat16) -> QuantTiles:
    """Tiles by rows, format and x's dtype: one row of a 4-bit weight (the GEMV), decode's few
    rows (a row tile of 16-64; FP8 with the weight widened: 32 outputs a program, K split to
    about 512 programs; AWQ in bf16 / fp16: _awq_mma_kernel's) and prefill's many. block_k is
    the largest the format allows up to this. On an H100, Qwen3-8B's shapes
    (tools/bench_quant.py --tune)."""
    if m == 1 and fmt in (AWQ, GPTQ):
        return QuantTiles(1, 64, 64, 4, 3, 8) if n <= 8192 else QuantTiles(1, 64, 128, 4, 3)
    if m <= SKINNY_ROWS:
        block_m = max(16, triton.next_power_of_2(m))
        if fmt == FP8 and not fp8_x:
            return QuantTiles(block_m, 32, 128, 4, 3, max(1, min(4, 512 // triton.cdiv(n, 32))))
        if fmt == FP8:
            if n <= 4096:
                return QuantTiles(block_m, 64, 128, 4, 3, 4)
            return QuantTiles(block_m, 32, 128, 4, 3, 2) if n <= 8192 else \
                QuantTiles(block_m, 64, 128, 4, 4)
        if fmt == AWQ and m <= 16 and dtype in _MAGIC:  # _awq_mma_kernel
            return QuantTiles(16, 128, 128, 4, 3, 8) if n <= 8192 else \
                QuantTiles(16, 128, 64, 4, 4, 2)
        if fmt == AWQ and dtype in _MAGIC:
            return QuantTiles(block_m, 64 if n <= 4096 else 128, 128, 4, 3, 8 if k > 8192 else 4)
        return QuantTiles(block_m, 32 if n <= 8192 else 64, 128, 4, 6)
    return QuantTiles(64, 128, 128, 4, 4) if fmt == FP8 else QuantTiles(128, 128, 128, 8, 3)


@triton.jit
def _store_split(acc, offs, mask, Y, Partials, Counters, tile, size, SPLIT_K: tl.constexpr):
    # Program pid_k's part of output tile `tile` (offsets `offs` into Y [M, N], contiguous),
    # its K split over SPLIT_K programs. SPLIT_K 1: stored. Else each part goes to
    # Partials[pid_k] and the tile's last program to finish sums them in order (the result
    # does not depend on which finished last) into Y, then puts the tile's counter back to 0:
    # the counters are zero between launches, so no kernel zeroes Y or converts it after.
    if SPLIT_K == 1:
        tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=mask)
    else:
        tl.store(Partials + tl.program_id(2).to(tl.int64) * size + offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's part stored before the count says so (release)
        if tl.atomic_add(Counters + tile, 1, sem="acq_rel") == SPLIT_K - 1:
            at = Partials + offs
            total = tl.load(at, mask=mask, other=0.0, cache_modifier=".cg")
            for _ in tl.static_range(1, SPLIT_K):
                at += size
                total += tl.load(at, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(Y + offs, total.to(Y.dtype.element_ty), mask=mask)
            tl.atomic_xchg(Counters + tile, 0, sem="relaxed")


@triton.jit
def _fp8_gemm_kernel(X, XScale, W, Scales, ScaleRow, Y, Partials, Counters, M, N, K,
                     stride_xm, stride_xs, stride_w, stride_s, scale_cols, FP8_X: tl.constexpr,
                     SCALE_ONCE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # W e4m3 [N, K]; Scales [rows, ceil(K / scale_cols)], ScaleRow [N] each output's row. x
    # e4m3 with XScale [K / BLOCK_K, M] (quantize_activations; FP8_X), or as it is, w widened
    # to its dtype. Program (m, n, s) takes the s-th of SPLIT_K parts of K (_store_split)
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # the split's start a multiple of BLOCK_K (the launch's condition), said to the compiler:
    # without it the tiles' copies lost their 16-byte alignment at a K split (sm_90, 64 rows,
    # split 4: 96 cp.async of 4 bytes against 24 of 16, 245 registers against 165; session 38)
    k_start = tl.multiple_of(pid_k * (K // SPLIT_K), BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_at = X + offs_m[:, None].to(tl.int64) * stride_xm + k_start + offs_k[None, :]
    w_at = W + offs_n[:, None].to(tl.int64) * stride_w + k_start + offs_k[None, :]
    row = tl.load(ScaleRow + offs_n, mask=n_ok, other=0).to(tl.int64) * stride_s
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # (K / SPLIT_K) % BLOCK_K == 0 and scale_cols % BLOCK_K == 0
    for k0 in range(k_start, k_start + K // SPLIT_K, BLOCK_K):
        x = tl.load(x_at, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_at, mask=n_ok[:, None], other=0.0)
        if FP8_X:
            x_scale = tl.load(XScale + (k0 // BLOCK_K) * stride_xs + offs_m, mask=m_ok, other=0.0)
            part = tl.dot(x, tl.trans(w)) * x_scale[:, None]
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)),
                          input_precision="ieee" if x.dtype == tl.float32 else None)
        if SCALE_ONCE:
            acc += part
        else:
            acc += part * tl.load(Scales + row + k0 // scale_cols, mask=n_ok, other=0.0)[None, :]
        x_at += BLOCK_K
        w_at += BLOCK_K
    if SCALE_ONCE:
        acc *= tl.load(Scales + row, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    _store_split(acc, offs_m[:, None].to(tl.int64) * N + offs_n[None, :],
                 m_ok[:, None] & n_ok[None, :], Y, Partials, Counters,
                 pid_m * tl.num_programs(1) + pid_n, M * N, SPLIT_K)


@triton.jit
def _quantize_rows_kernel(X, XQ, XScale, M, K, stride_xm, stride_qm, stride_sg,
                          GROUP: tl.constexpr, GROUPS: tl.constexpr, SILU: tl.constexpr,
                          Delta=None, NormW=None, XSum=None, eps=0.0, NORM: tl.constexpr = False,
                          HAS_DELTA: tl.constexpr = False):
    # program (m, c): row m's groups c * GROUPS .. (c + 1) * GROUPS - 1 (GROUPS a power of
    # two), e4m3 values and a scale per GROUP inputs, the scales stored group-major (XScale
    # [K / GROUP, rows], as cuBLAS takes them); rows from M on (padding) are zeros. SILU: the
    # row is [gate | up] (2K inputs) and x is silu(gate) * up, each rounded to x's dtype as
    # torch's silu and product round them. NORM (a whole row a program): x is RMSNorm(x +
    # delta) with weight NormW, rounded as layers.add_rms_norm rounds it, x + delta (HAS_DELTA,
    # rows stride_xm apart as x's) stored to XSum
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = offs < K
    x = tl.load(X + m * stride_xm + offs, mask=ok & (m < M), other=0.0)
    if SILU:
        up = tl.load(X + m * stride_xm + K + offs, mask=ok & (m < M), other=0.0)
        gate = x.to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(x.dtype)
        x = (silu.to(tl.float32) * up.to(tl.float32)).to(x.dtype)
    if NORM:
        if HAS_DELTA:
            delta = tl.load(Delta + m * stride_xm + offs, mask=ok & (m < M), other=0.0)
            x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)
            tl.store(XSum + m * stride_xm + offs, x, mask=ok & (m < M))
        h = x.to(tl.float32)
        rms = tl.math.rsqrt(tl.sum(tl.sum(h * h, axis=1), axis=0) / K + eps)
        h = (h * rms).to(x.dtype)
        w = tl.load(NormW + offs, mask=ok, other=0.0)
        x = (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype)
    x = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
    xq = tl.clamp(x / scale[:, None], -448.0, 448.0)
    tl.store(XQ + m * stride_qm + offs, xq.to(XQ.dtype.element_ty), mask=ok)
    tl.store(XScale + g * stride_sg + m, scale, mask=g * GROUP < K)


@triton.jit
def _int4_gemm_kernel(X, W, Scales, Zeros, GIdx, Y, M, N, K, stride_xm, stride_ym, stride_w,
                      stride_s, stride_z, group, zero_offset, FORMAT: tl.constexpr,
                      PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_at = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if FORMAT == 1:  # W int32 [K, N / 8]: a row of words holds the outputs
        words = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        w_at = W + offs_k[:, None].to(tl.int64) * stride_w + words[None, :]
        j = tl.arange(0, 8)
        shifts = (j % 2) * 16 + (j // 2) * 4
    else:  # W int32 [K / 8, N]: a column of words holds the inputs
        w_at = W + (tl.arange(0, BLOCK_K // 8)[:, None]).to(tl.int64) * stride_w + offs_n[None, :]
        shifts = tl.arange(0, 8) * 4
        z_shift = (offs_n % 8) * 4
    for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0; a step within a group (not act-order)
        x = tl.load(x_at, mask=m_ok[:, None], other=0.0)
        if FORMAT == 1:
            word = tl.load(w_at, mask=(words < N // 8)[None, :], other=0)
            q = tl.reshape((word[:, :, None] >> shifts[None, None, :]) & 0xF, [BLOCK_K, BLOCK_N])
            w_at += BLOCK_K * stride_w
        else:
            word = tl.load(w_at, mask=n_ok[None, :], other=0)
            q = tl.reshape((word[:, None, :] >> shifts[None, :, None]) & 0xF, [BLOCK_K, BLOCK_N])
            w_at += (BLOCK_K // 8) * stride_w
        if FORMAT == 3:  # act-order: each input its own group
            g = tl.load(GIdx + k0 + offs_k)[:, None]
            zw = tl.load(Zeros + g * stride_z + offs_n[None, :] // 8, mask=n_ok[None, :], other=0)
            z = ((zw >> z_shift[None, :]) & 0xF) + zero_offset
            s = tl.load(Scales + g * stride_s + offs_n[None, :], mask=n_ok[None, :], other=0.0)
            w = ((q - z).to(tl.float32) * s.to(tl.float32)).to(x.dtype)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        else:
            g = k0 // group
            if FORMAT == 1:
                zw = tl.load(Zeros + g * stride_z + words, mask=words < N // 8, other=0)
                z = tl.reshape((zw[:, None] >> shifts[None, :]) & 0xF, [BLOCK_N])
            else:
                zw = tl.load(Zeros + g * stride_z + offs_n // 8, mask=n_ok, other=0)
                z = ((zw >> z_shift) & 0xF) + zero_offset
            s = tl.load(Scales + g * stride_s + offs_n, mask=n_ok, other=0.0)
            part = tl.dot(x, q.to(x.dtype), input_precision=PRECISION)
            x_sum = tl.sum(x.to(tl.float32), axis=1)
            acc += (part - x_sum[:, None] * z.to(tl.float32)[None, :]) * \
                s.to(tl.float32)[None, :]
        x_at += BLOCK_K
    tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
             acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _int4_gemv_kernel(X, W, Scales, Zeros, Y, Partials, Counters, N, K, stride_w, stride_s,
                      stride_z, group, zero_offset, FORMAT: tl.constexpr, SPLIT_K: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # one row x [K]. Program (n, 0, s) owns BLOCK_N outputs over the s-th of SPLIT_K parts of
    # K (_store_split). Products accumulate element by element and are summed over K once, at
    # the end; a step (BLOCK_K inputs) lies within one group
    pid_n, pid_k = tl.program_id(0), tl.program_id(2)
    j = tl.arange(0, 8)
    MAGIC: tl.constexpr = 0x4B000000  # float32 2^23: its bit pattern plus q is 2^23 + q
    k_start = tl.multiple_of(pid_k * (K // SPLIT_K), BLOCK_K)
    if FORMAT == 1:  # W int32 [K, N / 8]; [w, c]: output 8 w + c, at nibble shift shifts[c]
        words = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        w_ok = words < N // 8
        shifts = (j % 2) * 16 + (j // 2) * 4
        cols = words[:, None] * 8 + j[None, :]
        offs_k = tl.arange(0, BLOCK_K)
        w_at = W + (k_start + offs_k[:, None]).to(tl.int64) * stride_w + words[None, :]
        acc = tl.zeros([BLOCK_K, BLOCK_N // 8, 8], tl.float32)
    else:  # W int32 [K / 8, N]: word row r holds inputs 8 r .. 8 r + 7 at shifts 4 j
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        rows = tl.arange(0, BLOCK_K // 8)
        w_at = W + (k_start // 8 + rows[:, None]).to(tl.int64) * stride_w + offs_n[None, :]
        acc = tl.zeros([BLOCK_K // 8, 8, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_start + K // SPLIT_K, BLOCK_K):
        g = k0 // group
        if FORMAT == 1:
            x = tl.load(X + k0 + offs_k).to(tl.float32)
            word = tl.load(w_at, mask=w_ok[None, :], other=0)
            zw = tl.load(Zeros + g * stride_z + words, mask=w_ok, other=0)
            z = ((zw[:, None] >> shifts[None, :]) & 0xF).to(tl.float32) + 8388608.0
            s = tl.load(Scales + g * stride_s + cols, mask=w_ok[:, None], other=0.0)
            q = (((word[:, :, None] >> shifts[None, None, :]) & 0xF) | MAGIC).to(
                tl.float32, bitcast=True)
            acc += x[:, None, None] * ((q - z[None, :, :]) * s.to(tl.float32)[None, :, :])
            w_at += BLOCK_K * stride_w
        else:
            x = tl.load(X + k0 + rows[:, None] * 8 + j[None, :]).to(tl.float32)
            word = tl.load(w_at, mask=n_ok[None, :], other=0)
            zw = tl.load(Zeros + g * stride_z + offs_n // 8, mask=n_ok, other=0)
            z = (((zw >> (offs_n % 8) * 4) & 0xF) + zero_offset).to(tl.float32) + 8388608.0
            s = tl.load(Scales + g * stride_s + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            q = (((word[:, None, :] >> (j * 4)[None, :, None]) & 0xF) | MAGIC).to(
                tl.float32, bitcast=True)
            acc += x[:, :, None] * ((q - z[None, None, :]) * s[None, None, :])
            w_at += (BLOCK_K // 8) * stride_w
    if FORMAT == 1:
        _store_split(tl.sum(acc, axis=0), cols, w_ok[:, None], Y, Partials, Counters, pid_n, N,
                     SPLIT_K)
    else:
        _store_split(tl.sum(tl.sum(acc, axis=0), axis=0), offs_n, n_ok, Y, Partials, Counters,
                     pid_n, N, SPLIT_K)


@triton.jit
def _awq_mma_kernel(X, W, Scales, Zeros, Y, Partials, Counters, M, N, K, stride_xm, stride_w,
                    stride_s, stride_z, group, MAGIC: tl.constexpr, MAGIC_F: tl.constexpr,
                    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr):
    # AWQ, bf16 / fp16 x, decode's rows on tensor cores. Nibbles i and i + 4 of a word (AWQ's
    # order puts outputs 2 i and 2 i + 1 there) become two 16-bit floats in one step:
    # (word >> 4 i) & 0x000F000F | MAGIC holds MAGIC_F + q in each half (bf16 0x4300: 128 + q,
    # fp16 0x6400: 1024 + q; exact, no integer conversion), and the offset comes off with the
    # zero point once a group: acc += (dot(x, MAGIC_F + q) - sum(x) (MAGIC_F + z)) s. Program
    # (m, n, s): the s-th of SPLIT_K parts of K (_store_split). EVEN_N (N a multiple of
    # BLOCK_N): the weight's words load unmasked, so in 16-byte copies (a mask along them split
    # the copies into 4-byte ones: sm_90 PTX, session 38)
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_start = tl.multiple_of(pid_k * (K // SPLIT_K), BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    words = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    m_ok, n_ok, w_ok = offs_m < M, offs_n < N, words < N // 8
    i4 = tl.arange(0, 4)
    x_at = X + offs_m[:, None].to(tl.int64) * stride_xm + k_start + offs_k[None, :]
    w_at = W + (k_start + offs_k[:, None]).to(tl.int64) * stride_w + words[None, :]
    z_shift = (offs_n % 2) * 16 + ((offs_n % 8) // 2) * 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_start + K // SPLIT_K, BLOCK_K):  # a step within one group
        g = k0 // group
        x = tl.load(x_at, mask=m_ok[:, None], other=0.0)
        if EVEN_N:
            word = tl.load(w_at)
        else:
            word = tl.load(w_at, mask=w_ok[None, :], other=0)
        v = tl.reshape((word[:, :, None] >> (4 * i4)[None, None, :]) & 0x000F000F | MAGIC,
                       [BLOCK_K, BLOCK_N // 2])
        lo = v.to(tl.int16).to(x.dtype, bitcast=True)
        hi = (v >> 16).to(tl.int16).to(x.dtype, bitcast=True)
        part = tl.dot(x, tl.reshape(tl.join(lo, hi), [BLOCK_K, BLOCK_N]))
        s = tl.load(Scales + g * stride_s + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        zw = tl.load(Zeros + g * stride_z + offs_n // 8, mask=n_ok, other=0)
        z = ((zw >> z_shift) & 0xF).to(tl.float32) + MAGIC_F
        x_sum = tl.sum(x.to(tl.float32), axis=1)
        acc += (part - x_sum[:, None] * z[None, :]) * s[None, :]
        x_at += BLOCK_K
        w_at += BLOCK_K * stride_w
    _store_split(acc, offs_m[:, None].to(tl.int64) * N + offs_n[None, :],
                 m_ok[:, None] & n_ok[None, :], Y, Partials, Counters,
                 pid_m * tl.num_programs(1) + pid_n, M * N, SPLIT_K)


def step_limit(fmt: int, scale_cols: int, group: int) -> int:
    """The longest K step a format allows: within one scale block and one activation group
    (FP8), one group (4-bit)."""
    if fmt == FP8:
        return min(scale_cols, FP8_GROUP)
    return 1 << 30 if fmt == GPTQ_ACT_ORDER else group


def block_k_for(k: int, limit: int, want: int, least: int = 16) -> int | None:
    """The K step: the largest power of two up to `want` dividing both k and the format's
    limit, at least `least` (a dot's least: 16, 32 for e4m3 operands); None where none does."""
    step = want
    while step >= least:
        if k % step == 0 and (limit % step == 0 or limit >= 1 << 30):
            return step
        step //= 2
    return None


def supports(x: torch.Tensor, fmt: int, k: int, scale_cols: int, group: int) -> bool:
    """Whether the kernels take rows x against a weight of k inputs in this format: the 4-bit
    formats up to INT4_MAX_ROWS rows, FP8 where Triton reads e4m3 (sm89 and later)."""
    if not (x.is_cuda and x.dim() == 2 and x.shape[1] == k and
            x.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return False
    if fmt == FP8:
        return gpu_reads_e4m3(x.device) and activation_group(k, scale_cols) is not None
    return x.shape[0] <= INT4_MAX_ROWS and \
        block_k_for(k, step_limit(fmt, scale_cols, group), 16) is not None


def quantizes_x(x: torch.Tensor) -> bool:
    """Whether FP8's product of rows x quantizes them first (from WIDE_ROWS rows, bf16 / fp16;
    below, the weight is widened to x's dtype): there quant_gemm's `silu` runs inside the
    quantization pass, no kernel of its own."""
    return x.dtype != torch.float32 and x.shape[0] >= WIDE_ROWS


def cublas_block_scaled(device: torch.device, k: int) -> bool:
    """Whether cuBLAS's block-scaled FP8 GEMM (torch._scaled_mm, x 1 x 128, w 128 x 128) runs
    here, right: Hopper (where it is measured), and K / 128 a multiple of 4: cuBLAS reads the
    weight's scales with a leading dimension rounded up to 4, so other K are silently wrong
    (PyTorch PR 166752; K = 256 gave errors of 1e5 here)."""
    return device_capability(device.index or 0)[0] == 9 and k % 512 == 0


def activation_group(k: int, scale_cols: int) -> int | None:
    """FP8's K step, and the inputs an activation scale covers: FP8_GROUP, or the largest
    power of two below it dividing k and the weight's scale blocks (at least 32)."""
    return block_k_for(k, step_limit(FP8, scale_cols, 0), FP8_GROUP, least=32)


def quantize_activations(x: torch.Tensor, group: int, rows: int | None = None,
                         silu: bool = False, groups_per_program: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [rows, K], float32 scales [rows, K / group] stored group-major): each
    row's groups of `group` inputs over their largest magnitude / 448
    (fp8_activations_reference is its torch twin); rows past M (`rows`, default M) zeros.
    `silu`: x is [M, 2K], rows [gate | up], and silu(gate) * up is quantized (as torch rounds
    it to x's dtype), never written out. `groups_per_program` (a power of two): the groups a
    program takes, by default QUANT_GROUPS (tools/probes/quantize_pass.py times other counts).
    The result does not depend on it."""
    m, k = x.shape
    if silu:
        assert k % 2 == 0, "rows [gate | up] of an odd width"
        k //= 2
    rows = rows or m
    xq = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(k // group, rows, dtype=torch.float32, device=x.device)
    groups = groups_per_program or min(QUANT_GROUPS, triton.next_power_of_2(k // group))
    assert groups & (groups - 1) == 0, groups
    grid = (rows, triton.cdiv(k // group, groups))
    _quantize_rows_kernel[grid](x, xq, scales, m, k, x.stride(0), xq.stride(0),
                                scales.stride(0), GROUP=group, GROUPS=groups, SILU=silu,
                                num_warps=8 if groups > 32 else 4)
    return xq, scales.t()


def norm_quantize_activations(x: torch.Tensor, delta: torch.Tensor | None,
                              weight: torch.Tensor, eps: float, group: int, rows: int
                              ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """quantize_activations of RMSNorm(x + delta) (layers.add_rms_norm's norm, weight [K] of
    x's dtype; without delta of x) in one pass, the norm never written out: (x + delta, or None
    without delta; e4m3 [rows, K]; scales as quantize_activations'). A program holds a whole
    row, 32 of its values a thread (4 warps up to 4,096 inputs, 8 to 8,192, 16 above)."""
    m, k = x.shape
    assert delta is None or (delta.shape == x.shape and delta.stride() == x.stride())
    xq = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(k // group, rows, dtype=torch.float32, device=x.device)
    total = None if delta is None else torch.empty_like(x)
    groups = triton.next_power_of_2(k // group)
    _quantize_rows_kernel[(rows, 1)](
        x, xq, scales, m, k, x.stride(0), xq.stride(0), scales.stride(0), GROUP=group,
        GROUPS=groups, SILU=False, Delta=delta, NormW=weight, XSum=total, eps=eps, NORM=True,
        HAS_DELTA=delta is not None, num_warps=max(4, min(16, groups // 8)))
    return total, xq, scales.t()


def fp8_activations_reference(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the FP8 kernels see it: each row's groups of `group` inputs quantized to e4m3
    (scale: largest magnitude / 448) and scaled back, in float32."""
    m, k = x.shape
    g = x.float().view(m, k // group, group)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    q = (g / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * scale).view(m, k)


def quant_gemm(x: torch.Tensor, fmt: int, w: torch.Tensor, scales: torch.Tensor, n: int,
               scale_row: torch.Tensor | None = None, scale_cols: int = 1 << 30,
               zeros: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
               group: int = 128, zero_offset: int = 0, cublas_blocks: bool = False,
               tiles: QuantTiles | None = None, silu: bool = False) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32) times one quantized weight of `n` outputs: y [M, n] in x's
    dtype. `silu` (FP8): x is [M, 2K], rows [gate | up], and the product is silu(gate) * up's:
    computed inside x's quantization pass where x is quantized (`quantizes_x`).
    FP8: w e4m3 [n, K]; scales a grid [rows, ceil(K / scale_cols)], scale_row int32 [n]
    each output's row of it; bf16 / fp16 x from WIDE_ROWS rows quantized per
    `activation_group` inputs (below them the weight widened to x's dtype); with
    `cublas_blocks` (scales [n / 128, K / 128], one per 128 x 128 block; K at least 512: at
    256 cuBLAS's results are wrong, tools/probes/scaled_mm_blockwise.py --small) CUBLAS_ROWS
    rows or more run cuBLAS's block-scaled FP8 GEMM. AWQ: w [K, n / 8], zeros [K / group, n / 8],
    scales [K / group, n]. GPTQ: w [K / 8, n], zeros [groups, n / 8] (each plus zero_offset),
    scales [groups, n]; GPTQ_ACT_ORDER: g_idx [K] each input's group. See `supports`."""
    x = x.contiguous()
    if fmt == FP8:
        return _fp8_gemm(x, w, scales, scale_row, scale_cols, n, cublas_blocks, tiles,
                         silu=silu)
    assert not silu, "silu(gate) * up: FP8 only"
    m, k = x.shape
    gemv = m == 1 and fmt in (AWQ, GPTQ) and x.dtype != torch.float32
    tiles = tiles or tiles_for(m if gemv else max(m, 2), n, fmt, k=k, dtype=x.dtype)
    block_k = block_k_for(k, step_limit(fmt, scale_cols, group), tiles.block_k)
    assert block_k is not None, (k, fmt, group)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    zeros = scales if zeros is None else zeros
    launch = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if gemv:
        split = tiles.split_k if k % (tiles.split_k * block_k) == 0 else 1
        grid = (triton.cdiv(n, tiles.block_n), 1, split)
        _int4_gemv_kernel[grid](
            x, w, scales, zeros, y, *split_buffers(y, split, grid), n, k, w.stride(0),
            scales.stride(0), zeros.stride(0), group, zero_offset, FORMAT=fmt, SPLIT_K=split,
            BLOCK_N=tiles.block_n, BLOCK_K=block_k, **launch)
        return y
    if fmt == AWQ and m <= SKINNY_ROWS and x.dtype in _MAGIC:
        split = tiles.split_k if k % (tiles.split_k * block_k) == 0 else 1
        grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), split)
        _awq_mma_kernel[grid](x, w, scales, zeros, y, *split_buffers(y, split, grid), m, n, k,
                              x.stride(0), w.stride(0), scales.stride(0), zeros.stride(0),
                              group, **_MAGIC[x.dtype], SPLIT_K=split, BLOCK_M=tiles.block_m,
                              BLOCK_N=tiles.block_n, BLOCK_K=block_k,
                              EVEN_N=n % tiles.block_n == 0, **launch)
        return y
    g_idx = scales if g_idx is None else g_idx
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    _int4_gemm_kernel[grid](
        x, w, scales, zeros, g_idx, y, m, n, k, x.stride(0), y.stride(0), w.stride(0),
        scales.stride(0), zeros.stride(0), group, zero_offset, FORMAT=fmt,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=block_k, **launch)
    return y


def _fp8_gemm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
              scale_row: torch.Tensor | None, scale_cols: int, n: int, cublas_blocks: bool,
              tiles: QuantTiles | None, quantize_x: bool | None = None,
              silu: bool = False) -> torch.Tensor:
    dtype = x.dtype
    fp8_x = quantizes_x(x) if quantize_x is None else quantize_x
    if silu and not fp8_x:  # nothing reads x before the GEMM: silu(gate) * up first
        gate, up = x.chunk(2, dim=-1)
        x, silu = F.silu(gate) * up, False
    m, k = x.shape
    if silu:
        assert k % 2 == 0, "rows [gate | up] of an odd width"
        k //= 2
    block_k = activation_group(k, scale_cols)
    assert block_k is not None, (k, scale_cols)
    if not fp8_x:  # decode's few rows: x as it is, one kernel (no quantization pass)
        return fp8_gemm_launch(x, None, w, scales, scale_row, scale_cols, n, dtype,
                               tiles or tiles_for(m, n, FP8, False), block_k)
    xq, xs = quantize_activations(x, block_k, rows=quantized_rows(m, k, cublas_blocks, x.device),
                                  silu=silu)
    return fp8_quantized_gemm(xq, xs, m, w, scales, scale_row, scale_cols, n, cublas_blocks,
                              dtype, tiles)


def _cublas_fp8(m: int, k: int, cublas_blocks: bool, device: torch.device) -> bool:
    return cublas_blocks and m >= CUBLAS_ROWS and cublas_block_scaled(device, k)


def quantized_rows(m: int, k: int, cublas_blocks: bool, device: torch.device) -> int:
    """The rows FP8's product of m rows (K = k) quantizes x to, where it quantizes x
    (`quantizes_x`): m, or m padded with zero rows to a multiple of 16 where cuBLAS's
    block-scaled GEMM runs it (quant_gemm's `cublas_blocks`: cuBLAS refuses other row
    counts)."""
    return triton.cdiv(m, 16) * 16 if _cublas_fp8(m, k, cublas_blocks, device) else m


def fp8_quantized_gemm(xq: torch.Tensor, xs: torch.Tensor, m: int, w: torch.Tensor,
                       scales: torch.Tensor, scale_row: torch.Tensor | None, scale_cols: int,
                       n: int, cublas_blocks: bool, dtype: torch.dtype,
                       tiles: QuantTiles | None = None) -> torch.Tensor:
    """The first m rows of x, quantized to `quantized_rows(m, ...)` rows (quantize_activations'
    or norm_quantize_activations' e4m3 values xq and scales xs), times the FP8 weight as
    quant_gemm takes it: y [m, n] in dtype."""
    k = xq.shape[1]
    if _cublas_fp8(m, k, cublas_blocks, xq.device):
        return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scales.t(),
                                out_dtype=dtype)[:m]
    return fp8_gemm_launch(xq[:m], xs[:m], w, scales, scale_row, scale_cols, n, dtype,
                           tiles or tiles_for(m, n, FP8, True), activation_group(k, scale_cols))


def fp8_gemm_launch(x: torch.Tensor, x_scale: torch.Tensor | None, w: torch.Tensor,
                    scales: torch.Tensor, scale_row: torch.Tensor | None, scale_cols: int,
                    n: int, dtype: torch.dtype, tiles: QuantTiles, block_k: int
                    ) -> torch.Tensor:
    """_fp8_gemm_kernel on x [M, K]: e4m3 with x_scale (quantize_activations' result, its
    group block_k), or x_scale None and x as it is (the weight widened); y [M, n] in dtype."""
    m, k = x.shape
    split = tiles.split_k if (k // block_k) % tiles.split_k == 0 else 1
    y = torch.empty(m, n, dtype=dtype, device=x.device)
    scale_row = scales if scale_row is None else scale_row
    fp8_x = x_scale is not None
    x_scale = scales if x_scale is None else x_scale
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), split)
    _fp8_gemm_kernel[grid](
        x, x_scale, w, scales, scale_row, y, *split_buffers(y, split, grid), m, n, k,
        x.stride(0), x_scale.stride(1), w.stride(0), scales.stride(0), scale_cols,
        FP8_X=fp8_x, SCALE_ONCE=scale_cols >= k, SPLIT_K=split, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=block_k, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    return y


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def split_buffers(y: torch.Tensor, split: int, grid: tuple[int, int, int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """_store_split's float32 parts (split x y's size, left unset) and its per-tile counters:
    one zeroed tensor a device, made at the first split launch (the eager warm-up, before any
    graph capture) and kept zero by the kernels. Invariant: kernels sharing it never run
    concurrently (they run on the model's one compute stream)."""
    if split == 1:
        return y, y
    tiles = grid[0] * grid[1]
    counters = _COUNTERS.get(y.device)
    if counters is None or counters.numel() < tiles:
        assert not (y.is_cuda and torch.cuda.is_current_stream_capturing()), "made in a capture"
        if counters is not None:  # graphs captured on it keep its address: never freed
            _OUTGROWN.append(counters)
        counters = _COUNTERS[y.device] = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32,
                                                     device=y.device)
    return torch.empty(split, *y.shape, dtype=torch.float32, device=y.device), counters
