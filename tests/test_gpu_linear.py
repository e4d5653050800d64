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
    assert not supports(x.float(), w.float())


@needs_cuda
def test_linear_leaves_the_skinny_matmul_weights_too_narrow_to_fill_the_sms():
    """layers.Linear at one row: the skinny matmul from SKINNY_MIN_COLUMNS outputs on, not
    below (the plain one-row CUDA GEMV takes those)."""
    from nanoserve.models.layers import SKINNY_MIN_COLUMNS, Linear
    x = torch.zeros(1, 256, device="cuda", dtype=torch.bfloat16)
    for n in (SKINNY_MIN_COLUMNS, 2 * SKINNY_MIN_COLUMNS):
        assert Linear(256, n, bias=False, device="cuda", dtype=torch.bfloat16).skinny(x)
    for n in (128, SKINNY_MIN_COLUMNS - 32):
        assert not Linear(256, n, bias=False, device="cuda", dtype=torch.bfloat16).skinny(x)


@needs_cuda
@pytest.mark.parametrize("n, i", [(4096, 12288), (4096, 1024)])
def test_silu_mul_in_the_skinny_matmul_matches_float64(n, i):
    """SiLU-multiply in the matmul's loop rounds as layers.silu_and_mul does: the product is
    within 2^-8 of the largest output of float64's product of silu_and_mul's result."""
    from nanoserve.models.layers import silu_and_mul
    from nanoserve.models.triton_linear import skinny_silu_linear, supports

    g = torch.Generator(device="cuda").manual_seed(n + i)
    gate_up = (torch.randn(1, 2 * i, device="cuda", generator=g) * 2).bfloat16()
    w = (torch.randn(n, i, device="cuda", generator=g) * i**-0.5).bfloat16()
    assert supports(gate_up, w, silu=True) and not supports(gate_up, w)
    y = skinny_silu_linear(gate_up, w)
    ref = silu_and_mul.eager(gate_up).double() @ w.double().T
    assert (y.double() - ref).abs().max().item() <= 2**-8 * ref.abs().max().item()


@needs_cuda
@pytest.mark.parametrize("rows", [16, 32, 64, 65])
def test_down_at_32_to_64_rows_goes_through_a_zero_bias(rows):
    """The MLP's down at 32-64 rows takes the zero-bias route (torch's cuBLASLt path), within
    one bf16 step of float64; other row counts, and other layers, keep plain F.linear."""
    from nanoserve.models.layers import DOWN_LT_ROWS, Linear

    g = torch.Generator(device="cuda").manual_seed(rows)
    down = Linear(12288, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    down.lt_rows = DOWN_LT_ROWS
    other = Linear(12288, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    for layer in (down, other):
        layer.weight.data = (torch.randn(layer.weight.shape, device="cuda", generator=g)
                             * layer.in_features**-0.5).bfloat16()
        x = torch.randn(rows, layer.in_features, device="cuda", generator=g).bfloat16()
        y = layer(x)
        ref = x.double() @ layer.weight.double().T
        assert (y.double() - ref).abs().max().item() <= 2**-8 * ref.abs().max().item()
    assert (down._zero_bias is not None) == (32 <= rows <= 64)
    assert other._zero_bias is None
