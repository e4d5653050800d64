"""GPU: the fused q/k norm + rotary + KV store kernel (attention/triton_rope_store.py) against
the unfused path it replaces (layers.qk_norm_rope / rope eagerly, then the store): q and k
within one bfloat16 rounding of the reference, and the cache holding exactly the kernel's own k
and the input v in the written slots, and nothing anywhere else."""

from __future__ import annotations

import pytest
import torch

from nanoserve.models.layers import qk_norm_rope, rope

pytestmark = pytest.mark.gpu

D, MAX_LEN, PAGE = 128, 40000, 16


def within_one_rounding(a: torch.Tensor, ref: torch.Tensor) -> None:
    """The bound test_gpu_fused.py holds inductor's kernels to: where the float32 math differs
    by ulps (rsqrt, summation order), each bf16 rounding may land one step apart (two steps at
    most, 2^-6 relative; RoPE's outputs near zero come from cancellation, so the bound adds the
    tensor's mean magnitude), and rarely."""
    diff, scale = (a.float() - ref.float()).abs(), ref.float().abs()
    assert (diff <= (scale + scale.mean()) * 2**-6).all(), (diff / (scale + scale.mean())).max()
    assert (diff > 0).float().mean().item() < 0.01


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (28, 4), (8, 8), (14, 2)])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "rope_only"])
def test_rope_and_store_matches_the_unfused_path(tokens, heads, kv_heads, norm):
    from nanoserve.attention.triton_rope_store import rope_and_store  # Triton: CUDA only

    g = torch.Generator(device="cuda").manual_seed(tokens * 100 + heads)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", generator=g).mul(scale).bfloat16()

    t = torch.arange(MAX_LEN, device="cuda").float()[:, None] * \
        (1e-4 ** (torch.arange(0, D, 2, device="cuda") / D))
    cos_sin = torch.cat([t.cos(), t.sin()], -1)
    positions = torch.randint(0, MAX_LEN, (tokens,), device="cuda", generator=g)
    qkv = r(tokens, (heads + 2 * kv_heads) * D, scale=3.0)  # strided views, as the layer's
    q = qkv[:, :heads * D].view(tokens, heads, D)
    k = qkv[:, heads * D:(heads + kv_heads) * D].view(tokens, kv_heads, D)
    v = qkv[:, (heads + kv_heads) * D:].view(tokens, kv_heads, D)
    weights = (r(D, scale=0.1) + 1, r(D, scale=0.1) + 1, 1e-6) if norm else None

    pages = tokens // PAGE + 4
    k_cache = torch.zeros(pages, PAGE, kv_heads, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(pages * PAGE, device="cuda", generator=g)[:tokens]

    q_out, k_out = rope_and_store(q, k, v, cos_sin, positions, weights, k_cache, v_cache, slots)
    q_ref, k_ref = qk_norm_rope.eager(q, k, *weights, cos_sin, positions) if norm else \
        rope.eager(q, k, cos_sin, positions)
    within_one_rounding(q_out, q_ref)
    within_one_rounding(k_out, k_ref)

    page, offset = slots // PAGE, slots % PAGE
    assert torch.equal(k_cache[page, offset], k_out)
    assert torch.equal(v_cache[page, offset], v)
    untouched = torch.ones(pages * PAGE, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    for cache in (k_cache, v_cache):
        assert (cache.view(-1, kv_heads, D)[untouched] == 0).all()


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (28, 4), (12, 3), (4, 1)])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "rope_only"])
def test_rope_and_fp8_store_writes_the_fp8_stores_bytes(tokens, heads, kv_heads, norm):
    """An FP8 cache (values and scales in the engine's page rows): the fused kernel writes,
    byte for byte, what the FP8 store kernel writes for the kernel's own rotated k and v, and
    nothing else; q and k as the bf16 cache's call returns them. Head counts below a power of
    two leave padded heads in the kernel; the first token's last k and v heads are zeros (the
    smallest scale)."""
    from nanoserve.attention.backend import store_fp8_kv
    from nanoserve.attention.triton_rope_store import rope_and_store
    from nanoserve.kv.fp8_format import FP8
    from nanoserve.kv.spec import KVSpec

    g = torch.Generator(device="cuda").manual_seed(tokens * 100 + heads + 1)
    t = torch.arange(MAX_LEN, device="cuda").float()[:, None] * \
        (1e-4 ** (torch.arange(0, D, 2, device="cuda") / D))
    cos_sin = torch.cat([t.cos(), t.sin()], -1)
    positions = torch.randint(0, MAX_LEN, (tokens,), device="cuda", generator=g)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * D, device="cuda", generator=g) \
        .mul(3.0).bfloat16()
    q = qkv[:, :heads * D].view(tokens, heads, D)
    k = qkv[:, heads * D:(heads + kv_heads) * D].view(tokens, kv_heads, D)
    v = qkv[:, (heads + kv_heads) * D:].view(tokens, kv_heads, D)
    k[0, -1] = 0
    v[0, -1] = 0
    w = torch.randn(2, D, device="cuda", generator=g).mul(0.1).add(1).bfloat16()
    weights = (w[0], w[1], 1e-6) if norm else None
    pages = tokens // PAGE + 4
    spec = KVSpec(1, PAGE, kv_heads, D, FP8)
    rows, ref_rows = spec.empty(1, pages, "cuda")[0], spec.empty(1, pages, "cuda")[0]
    slots = torch.randperm(pages * PAGE, device="cuda", generator=g)[:tokens]

    q_out, k_out = rope_and_store(q, k, v, cos_sin, positions, weights,
                                  *spec.views(rows)[:2], slots, *spec.views(rows)[2:])
    store_fp8_kv(k_out, v, *spec.views(ref_rows), slots)
    assert torch.equal(rows, ref_rows)
    assert (rows != 0).any()
    bf16 = torch.zeros(2, pages, PAGE, kv_heads, D, device="cuda", dtype=torch.bfloat16)
    q_bf16, k_bf16 = rope_and_store(q, k, v, cos_sin, positions, weights, bf16[0], bf16[1],
                                    slots)
    assert torch.equal(q_out, q_bf16) and torch.equal(k_out, k_bf16)
