"""The Triton skinny matmul (models/triton_linear.py) against a float64 reference: its only
rounding is the output's, so every element is within one bf16 step (2^-8 relative) of the
largest output."""

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("rows", [1, 3, 16, 40, 64])
@pytest.mark.parametrize("n, k", [(4096, 4096), (4100, 512), (6144, 12288), (24576, 4096)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_float64(rows, n, k, bias):
    from nanoserve.models.triton_linear import skinny_linear, supports  # Triton: CUDA only

    g = torch.Generator(device="cuda").manual_seed(rows * n + k)
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16() if bias else None
    assert supports(x, w)
    y = skinny_linear(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    assert (y.double() - ref).abs().max().item() <= 2**-8 * ref.abs().max().item()


@needs_cuda
def test_skinny_linear_refuses_what_it_cannot_take():
    from nanoserve.models.triton_linear import supports

    w = torch.zeros(4096, 256, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros(1, 256, device="cuda", dtype=torch.bfloat16)
    assert supports(x, w)
    assert not supports(torch.zeros(65, 256, device="cuda", dtype=torch.bfloat16), w)
    assert not supports(x[:, :100], w[:, :100])  # k not a multiple of the tile
    assert not supports(x, w[:1024])  # too few columns to fill the SMs
    assert not supports(x.float(), w.float())


@needs_cuda
@pytest.mark.parametrize("delta", [False, True])
@pytest.mark.parametrize("n, k", [(6144, 4096), (24576, 4096), (151936, 4096)])
def test_norm_prologue_matches_add_rms_norm_then_linear(delta, n, k):
    """The residual add is bitwise the unfused one; the product is within 2^-7 of the largest
    output of the unfused path (the norm's rsqrt may round a value one step apart)."""
    from nanoserve.models.layers import add_rms_norm, rms_norm
    from nanoserve.models.triton_linear import skinny_norm_linear

    g = torch.Generator(device="cuda").manual_seed(n + k + delta)
    x = (torch.randn(1, k, device="cuda", generator=g) * 3).bfloat16()
    d = torch.randn(1, k, device="cuda", generator=g).bfloat16() if delta else None
    gamma = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    resid, y = skinny_norm_linear(x, d, gamma, 1e-6, w)
    if delta:
        ref_resid, h = add_rms_norm.eager(x, d, gamma, 1e-6)
        assert torch.equal(resid, ref_resid)
    else:
        ref_resid, h = x, rms_norm.eager(x, gamma, 1e-6)
        assert resid is x
    ref = h.double() @ w.double().T
    assert (y.double() - ref).abs().max().item() <= 2**-7 * ref.abs().max().item()


@needs_cuda
@pytest.mark.parametrize("n, k", [(4096, 12288), (5120, 14336)])
def test_silu_mul_prologue_matches_silu_and_mul_then_linear(n, k):
    from nanoserve.models.layers import silu_and_mul
    from nanoserve.models.triton_linear import skinny_silu_mul_linear

    g = torch.Generator(device="cuda").manual_seed(n + k)
    gate_up = (torch.randn(1, 2 * k, device="cuda", generator=g) * 2).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    y = skinny_silu_mul_linear(gate_up, w)
    ref = silu_and_mul.eager(gate_up).double() @ w.double().T
    assert (y.double() - ref).abs().max().item() <= 2**-7 * ref.abs().max().item()
