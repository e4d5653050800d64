"""GPU: each `@fused` function, compiled by inductor, against its eager reference, and fused
into at most the stated number of kernels (eager runs 6 to 25 per function)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from nanoserve.models.layers import add_rms_norm, qk_norm_rope, rms_norm, rope, silu_and_mul

pytestmark = pytest.mark.gpu

H, HEADS, KV_HEADS, D, MAX_LEN = 4096, 32, 8, 128, 40000


def cases(n: int):
    g = torch.Generator(device="cuda").manual_seed(n)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", generator=g).mul(scale).bfloat16()

    t = torch.arange(MAX_LEN, device="cuda").float()[:, None] * \
        (1e-4 ** (torch.arange(0, D, 2, device="cuda") / D))
    cos_sin = torch.cat([t.cos(), t.sin()], -1)
    pos = torch.randint(0, MAX_LEN, (n,), device="cuda", generator=g)
    qkv = r(n, (HEADS + 2 * KV_HEADS) * D)  # q and k as the strided views the layer passes
    q = qkv[:, :HEADS * D].view(n, HEADS, D)
    k = qkv[:, HEADS * D:(HEADS + KV_HEADS) * D].view(n, KV_HEADS, D)
    w, wq, wk = r(H, scale=0.1) + 1, r(D, scale=0.1) + 1, r(D, scale=0.1) + 1
    return [  # (function, args, most kernels)
        (rms_norm, (r(n, H), w, 1e-6), 1),
        (add_rms_norm, (r(n, H), r(n, H), w, 1e-6), 1),
        (rope, (q, k, cos_sin, pos), 2),
        (qk_norm_rope, (q, k, wq, wk, 1e-6, cos_sin, pos), 6),  # eager: about 25
        (silu_and_mul, (r(n, 2 * 12288),), 1),
    ]


def _outputs(x):
    return x if isinstance(x, tuple) else (x,)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 8192])
def test_fused_functions_match_eager(n):
    for fn, args, _ in cases(n):
        for got, want in zip(_outputs(fn(*args)), _outputs(fn.eager(*args)), strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            diff = (got.float() - want.float()).abs()
            # Where the fp32 math differs by ulps (rsqrt, exp), each of the two bf16 roundings
            # (the normed value, then its product with the weight) may land one step (at most
            # 2^-7 relative) apart: at most two steps, and rarely.
            # (RoPE's outputs near zero come from cancellation: their steps are those of the
            # inputs, so the bound adds two steps at the tensor's mean magnitude)
            scale = want.float().abs()
            worst = (diff / (scale + scale.mean())).max().item()
            assert (diff <= (scale + scale.mean()) * 2**-6).all(), (fn.__name__, n, worst)
            assert (diff > 0).float().mean() < 0.01, (fn.__name__, n)


def test_fused_functions_are_one_kernel_each():
    for fn, args, most in cases(64):
        fn(*args)  # compile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(*args)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        assert 1 <= len(kernels) <= most, (fn.__name__, kernels)
