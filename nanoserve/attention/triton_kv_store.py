"""The FP8 KV store in one Triton kernel: per new token, for K and V, each kv head's amax, its
scale, the e4m3 cast and the scatter into the token's page slot, values and scale.

Bitwise equal to the reference (kv/fp8.quantize): the division is IEEE float32 (div_rn, not
Triton's default approximate one) and the cast rounds to nearest even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kv.fp8_format import FP8_MAX, MIN_SCALE


@triton.jit
def fp8_scale(amax, BLOCK_H: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Each row's scale from its amax [BLOCK_H]: amax / 448 (IEEE), never below MIN_SCALE."""
    return tl.maximum(tl.div_rn(amax, tl.full([BLOCK_H], FP8_MAX, tl.float32)), MIN_SCALE)


@triton.jit
def fp8_values(x, scale, FP8_MAX: tl.constexpr):
    """float32 rows [BLOCK_H, N] over their scales [BLOCK_H] (IEEE), clamped to e4m3's range;
    the caller casts with round to nearest even."""
    q = tl.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    return tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)


@triton.jit
def _quantize_store(X, Cache, Scales, t, page, offset, stride_xt, stride_xh,
                    stride_cp, stride_ct, stride_ch, stride_sp, stride_st, stride_sh,
                    KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < KV_HEADS
    mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(X + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    scale = fp8_scale(tl.max(tl.abs(x), 1), BLOCK_H, FP8_MAX, MIN_SCALE)
    q = fp8_values(x, scale, FP8_MAX)
    tl.store(Cache + page * stride_cp + offset * stride_ct + offs_h[:, None] * stride_ch
             + offs_d[None, :], q.to(Cache.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=mask)
    tl.store(Scales + page * stride_sp + offset * stride_st + offs_h * stride_sh, scale,
             mask=h_mask)


@triton.jit
def _store_fp8_kernel(
    K, V, KCache, VCache, KScale, VScale, Slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cp, stride_ct, stride_ch, stride_sp, stride_st, stride_sh,
    PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    _quantize_store(K, KCache, KScale, t, page, offset, stride_kt, stride_kh,
                    stride_cp, stride_ct, stride_ch, stride_sp, stride_st, stride_sh,
                    KV_HEADS, BLOCK_H, HEAD_DIM, BLOCK_D, FP8_MAX, MIN_SCALE)
    _quantize_store(V, VCache, VScale, t, page, offset, stride_vt, stride_vh,
                    stride_cp, stride_ct, stride_ch, stride_sp, stride_st, stride_sh,
                    KV_HEADS, BLOCK_H, HEAD_DIM, BLOCK_D, FP8_MAX, MIN_SCALE)


def store_fp8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [tokens, kv_heads, head_dim] -> their slots of the FP8 caches [pages, page_size,
    kv_heads, head_dim] and scales [pages, page_size, kv_heads]. K and V caches (and their
    scales) are views of one layer's rows: they share strides."""
    tokens, kv_heads, d = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_scale.stride() == v_scale.stride()
    if tokens == 0:
        return
    _store_fp8_kernel[(tokens,)](
        k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        PAGE_SIZE=k_cache.shape[1], KV_HEADS=kv_heads,
        BLOCK_H=triton.next_power_of_2(kv_heads), HEAD_DIM=d,
        BLOCK_D=triton.next_power_of_2(d), FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, num_warps=4,
    )
