"""The work between the qkv projection and attention, in one Triton kernel per layer: for each
new token, Qwen3's per-head RMSNorm of q and k (when the model has it), the rotary embedding of
q and k, and the store of k and v into the token's page slot. Unfused, the same work takes up to
eight kernels (inductor's for layers.qk_norm_rope, then one store per cache): at decode each is
a launch of a few microseconds for a few kilobytes.

The math is layers.qk_norm_rope's (statistics and rotation in float32, rounded where it
rounds); tests/test_gpu_rope_store.py holds it to the unfused path. An FP8 cache gets the
rotated k and v quantized as attention/triton_kv_store.py quantizes them (each kv head's amax,
its scale, IEEE division, round to nearest even), bitwise: the unfused FP8 path was five
kernels a layer at decode (inductor's norm and rotary, then the store), about 0.3 ms a step on
Qwen3-8B.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve import pdl
from nanoserve.attention.triton_kv_store import fp8_scale, fp8_values
from nanoserve.kv.fp8_format import FP8_MAX, MIN_SCALE


@triton.jit
def _norm_rope(x1, x2, W, cos, sin, offs_d, d_mask, eps, HAS_NORM: tl.constexpr,
               HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """Rows of heads as their two halves [BLOCK_H, BLOCK_HALF] in the model's dtype -> the same,
    normed (HAS_NORM) and rotated, in the model's dtype."""
    dtype = x1.dtype
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        var = (tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / HEAD_DIM
        r = tl.rsqrt(var + eps)
        w1 = tl.load(W + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        w2 = tl.load(W + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        x1 = (w1[None, :] * (f1 * r[:, None]).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2[None, :] * (f2 * r[:, None]).to(dtype).to(tl.float32)).to(dtype)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    return (f1 * cos[None, :] - f2 * sin[None, :]).to(dtype), \
        (f2 * cos[None, :] + f1 * sin[None, :]).to(dtype)


@triton.jit
def _load_halves(at, mask, HALF: tl.constexpr):
    """Rows of heads at pointers `at` (their first halves) as two [BLOCK_H, BLOCK_HALF]."""
    return tl.load(at, mask=mask, other=0.0), tl.load(at + HALF, mask=mask, other=0.0)


@triton.jit
def _store_halves(x1, x2, at, mask, HALF: tl.constexpr):
    tl.store(at, x1.to(at.dtype.element_ty), mask=mask)
    tl.store(at + HALF, x2.to(at.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_store_halves(x1, x2, at, scale_at, mask, h_mask, HALF: tl.constexpr,
                           BLOCK_H: tl.constexpr, FP8_MAX: tl.constexpr,
                           MIN_SCALE: tl.constexpr):
    """Rows of heads as their two halves -> e4m3 at `at` and a float32 scale a row at
    `scale_at`, as triton_kv_store._quantize_store writes a whole row (masked-out columns are
    zeros: they do not move the amax)."""
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(f1), 1), tl.max(tl.abs(f2), 1))
    scale = fp8_scale(amax, BLOCK_H, FP8_MAX, MIN_SCALE)
    q1, q2 = fp8_values(f1, scale, FP8_MAX), fp8_values(f2, scale, FP8_MAX)
    tl.store(at, q1.to(at.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(at + HALF, q2.to(at.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(scale_at, scale, mask=h_mask)


@triton.jit
def _rope_store_kernel(
    Q, K, V, QOut, KOut, CosSin, Positions, QW, KW, KCache, VCache, KScale, VScale, Slots, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    stride_cp, stride_ct, stride_ch, stride_sp, stride_st, stride_sh,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_NORM: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, PDL: tl.constexpr,
):
    pdl.start(PDL)
    t = tl.program_id(0)
    pos = tl.load(Positions + t)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(CosSin + pos * stride_cs + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(CosSin + pos * stride_cs + HALF + offs_d, mask=d_mask, other=0.0)

    offs_q = tl.arange(0, BLOCK_QH)
    q_mask = (offs_q < HEADS)[:, None] & d_mask[None, :]
    q1, q2 = _load_halves(Q + t * stride_qt + offs_q[:, None] * stride_qh + offs_d[None, :],
                          q_mask, HALF)
    q1, q2 = _norm_rope(q1, q2, QW, cos, sin, offs_d, d_mask, eps, HAS_NORM, HEAD_DIM, HALF)
    _store_halves(q1, q2, QOut + t * stride_qot + offs_q[:, None] * stride_qoh
                  + offs_d[None, :], q_mask, HALF)

    offs_k = tl.arange(0, BLOCK_KH)
    kv_mask = (offs_k < KV_HEADS)[:, None] & d_mask[None, :]
    k1, k2 = _load_halves(K + t * stride_kt + offs_k[:, None] * stride_kh + offs_d[None, :],
                          kv_mask, HALF)
    k1, k2 = _norm_rope(k1, k2, KW, cos, sin, offs_d, d_mask, eps, HAS_NORM, HEAD_DIM, HALF)
    _store_halves(k1, k2, KOut + t * stride_kot + offs_k[:, None] * stride_koh
                  + offs_d[None, :], kv_mask, HALF)

    slot = tl.load(Slots + t).to(tl.int64)
    page, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
    row = page * stride_cp + offset * stride_ct + offs_k[:, None] * stride_ch + offs_d[None, :]
    v1, v2 = _load_halves(V + t * stride_vt + offs_k[:, None] * stride_vh + offs_d[None, :],
                          kv_mask, HALF)
    if FP8:
        h_mask = offs_k < KV_HEADS
        scale_row = page * stride_sp + offset * stride_st + offs_k * stride_sh
        _quantize_store_halves(k1, k2, KCache + row, KScale + scale_row, kv_mask, h_mask, HALF,
                               BLOCK_KH, FP8_MAX, MIN_SCALE)
        _quantize_store_halves(v1, v2, VCache + row, VScale + scale_row, kv_mask, h_mask, HALF,
                               BLOCK_KH, FP8_MAX, MIN_SCALE)
    else:
        _store_halves(k1, k2, KCache + row, kv_mask, HALF)
        _store_halves(v1, v2, VCache + row, kv_mask, HALF)


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                   positions: torch.Tensor, qk_norm: tuple[torch.Tensor, torch.Tensor, float]
                   | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, heads, d], k, v [tokens, kv_heads, d] (views of the qkv projection's output
    are fine: rows may be strided, head_dim contiguous); cos_sin [positions, d] float32;
    qk_norm: (q weight, k weight, eps) or None. Stores k (rotated) and v in their slots of the
    caches [pages, page_size, kv_heads, d] (in q's dtype, or e4m3 with their scales [pages,
    page_size, kv_heads] given) and returns (q, k) rotated, contiguous."""
    tokens, heads, d = q.shape
    kv_heads = k.shape[1]
    fp8 = k_scale is not None
    assert d % 2 == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if fp8:  # e4m3 (the bounds are its 448), float32 scales a token and kv head
        assert k_cache.dtype == v_cache.dtype == torch.float8_e4m3fn
        assert k_scale.dtype == torch.float32 and k_scale.shape == k_cache.shape[:3]
        assert k_scale.stride() == v_scale.stride()
    else:
        assert k_cache.dtype == q.dtype
    q_out = torch.empty(tokens, heads, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, kv_heads, d, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    q_w, k_w, eps = qk_norm if qk_norm is not None else (q, k, 0.0)
    half = d // 2
    if not fp8:  # never read
        k_scale = v_scale = cos_sin
    scale_strides = k_scale.stride()[:3] if fp8 else (0, 0, 0)
    pdl_args = pdl.launch_args(q)
    _rope_store_kernel[(tokens,)](
        q, k, v, q_out, k_out, cos_sin, positions, q_w, k_w, k_cache, v_cache, k_scale, v_scale,
        slot_mapping, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *scale_strides,
        HEADS=heads, KV_HEADS=kv_heads, BLOCK_QH=triton.next_power_of_2(heads),
        BLOCK_KH=triton.next_power_of_2(kv_heads), HEAD_DIM=d, HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half), PAGE_SIZE=k_cache.shape[1],
        HAS_NORM=qk_norm is not None, FP8=fp8, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
        **pdl_args, num_warps=4,
    )
    return q_out, k_out
