"""The one-row CUDA kernels (nanoserve/quant/cuda_gemv.py, csrc/) on the CPU: the AWQ kernel's
arithmetic, emulated with torch's integer ops, against formats.dequantize; which shapes each
takes; how K is split. The kernels themselves run in tests/test_gpu_quant.py."""

from __future__ import annotations

import pytest
import torch

from nanoserve.quant import QuantConfig, cuda_gemv
from nanoserve.quant.formats import dequantize


def plus_128(words: torch.Tensor) -> torch.Tensor:
    """The kernel's unpacking of int32 words [..., W] into floats [..., 8 W]: for nibbles i and
    i + 4 of a word, (w >> 4 i) & 0x000F000F | 0x43004300 holds two bf16 128 + q; its low half
    moved up (v << 16) and its high half kept (v & 0xFFFF0000), read as float32 bits, are
    outputs 2 i and 2 i + 1."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(*words.shape, 8, dtype=torch.float64)
    for i in range(4):
        v = ((w >> (4 * i)) & 0x000F000F) | 0x43004300
        for c, bits in ((2 * i, (v << 16) & 0xFFFFFFFF), (2 * i + 1, v & 0xFFFF0000)):
            # the sign bit is clear: the bits fit an int32 as they are
            out[..., c] = bits.to(torch.int32).view(torch.float32).double()
    return out.flatten(-2)


def test_the_kernels_arithmetic_gives_the_dequantized_product():
    """Per group, s (sum_k x (128 + q) - (128 + z) sum_k x), with q and z unpacked as the kernel
    unpacks them, equals x times formats.dequantize's weight (float64, to 1e-12 of the largest
    output: the sums' order apart), and each unpacked value is 128 plus a nibble, exactly."""
    k, n, group = 256, 64, 32
    gen = torch.Generator().manual_seed(0)
    qweight = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, generator=gen)
    qzeros = torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), dtype=torch.int32,
                           generator=gen)
    # multiples of 2^-10: dequantize's float32 products (q - z) s are exact
    scales = torch.randint(1, 64, (k // group, n), generator=gen).double() / 1024
    x = torch.randn(k, generator=gen, dtype=torch.float64)
    q, z = plus_128(qweight), plus_128(qzeros)  # [k, n], [groups, n]
    assert set(q.unique().tolist()) <= {128.0 + i for i in range(16)}
    xg = x.view(-1, group)
    acc = torch.einsum("gk,gkn->gn", xg, q.view(-1, group, n))
    y = (scales * (acc - z * xg.sum(1, keepdim=True))).sum(0)
    w = dequantize(QuantConfig("awq", group_size=group),
                   dict(qweight=qweight, qzeros=qzeros, scales=scales), n, k, torch.float64)
    torch.testing.assert_close(y, w @ x, rtol=0, atol=1e-12 * (w @ x).abs().max().item())


def awq_tensors(n: int, k: int, group: int, x_dtype=torch.bfloat16, scale_dtype=torch.float16):
    return (torch.zeros(1, k, dtype=x_dtype),
            dict(w=torch.zeros(k, n // 8, dtype=torch.int32),
                 zeros=torch.zeros(k // group, n // 8, dtype=torch.int32),
                 scales=torch.zeros(k // group, n, dtype=scale_dtype), group=group))


def shape_ok(x: torch.Tensor, args: dict) -> bool:
    return cuda_gemv.awq_shape_ok(x, **args)


def test_the_shapes_each_kernel_takes():
    """AWQ: one half-precision row, groups 32 / 64 / 128, N a multiple of 32, contiguous
    tensors. FP8: one half-precision row, e4m3 rows with K a multiple of 128, scale blocks of
    whole 128-input steps or one scale a row. Anything else goes to Triton's kernels; on the
    CPU one_row() takes nothing."""
    x, args = awq_tensors(4096, 4096, 128)
    assert shape_ok(x, args)
    assert shape_ok(*awq_tensors(288, 512, 32, torch.float16, torch.bfloat16))
    assert cuda_gemv.one_row(x, args) is None  # not on a GPU: whatever the format
    assert not shape_ok(x.float(), args)
    assert not shape_ok(torch.zeros(2, 4096, dtype=torch.bfloat16), args)
    assert not shape_ok(*awq_tensors(4096, 4096, 16))  # a group it is not built for
    assert not shape_ok(*awq_tensors(4112, 4096, 128))  # N = 16 mod 32
    x, args = awq_tensors(4096, 4096, 128)
    args["scales"] = torch.zeros(4096, 32, dtype=torch.float16).t()  # not contiguous
    assert not shape_ok(x, args)

    def fp8(n, k, cols, x_dtype=torch.bfloat16):
        w = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
        return (torch.zeros(1, k, dtype=x_dtype),
                dict(w=w, scales=torch.zeros(-(-n // 128), -(-k // max(1, min(cols, k)))),
                     scale_row=torch.zeros(n, dtype=torch.int32), scale_cols=cols))
    for case in (fp8(4096, 4096, 128), fp8(300, 1152, 256), fp8(512, 1024, 1 << 30),
                 fp8(512, 1024, 128, torch.float16)):
        assert cuda_gemv.fp8_shape_ok(case[0], **case[1])
    x, args = fp8(4096, 4096, 128)
    assert cuda_gemv.one_row(x, args) is None  # not on a GPU
    for x, args in (fp8(4096, 4096, 64), fp8(4096, 4000, 1 << 30),
                    fp8(4096, 4096, 128, torch.float32), fp8(4096, 4096, 0)):
        assert not cuda_gemv.fp8_shape_ok(x, **args)


@pytest.mark.parametrize("sms", [1, 78, 114, 132, 142])
def test_the_split_keeps_every_cta_resident(sms):
    """num_splits: at most a unit (a group, a step) a CTA, SPLITS_CAP, and the CTAs that stay
    resident over all slices, at least one, the most of those; Qwen3-8B's AWQ and FP8 layers
    on 132 SMs as the docstring says."""
    for slices, units, per_sm in ((16, 32, 4), (24, 32, 4), (96, 32, 4), (16, 96, 4),
                                  (2, 16, 4), (1, 1, 4), (300, 8, 4), (256, 32, 8),
                                  (1, 224, 8), (16, 86, 4)):
        resident = per_sm * sms
        d = cuda_gemv.num_splits(slices, units, resident)
        assert 1 <= d <= min(units, cuda_gemv.SPLITS_CAP)
        assert d == 1 or slices * d <= resident
        assert d == min(units, cuda_gemv.SPLITS_CAP) or slices * (d + 1) > resident
    if sms == 132:
        assert [cuda_gemv.num_splits(s, g, cuda_gemv.AWQ_CTAS_PER_SM * 132) for s, g in
                ((16, 32), (24, 32), (96, 32), (16, 96))] == [16, 16, 4, 16]
        fp8 = cuda_gemv.FP8_CTAS_PER_SM * 132  # 32 outputs a CTA: qkv, o, gate_up, down
        assert [cuda_gemv.num_splits(n // cuda_gemv.FP8_OUTS, k // cuda_gemv.FP8_STEP, fp8)
                for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))] == \
            [4, 6, 1, 6]


def test_a_split_asked_for_is_held_to_a_unit_a_cta_and_max_splits(monkeypatch):
    """_split: num_splits' choice unless a split is asked for (tools/bench_quant.py --splits),
    which is held to 1..min(units, MAX_SPLITS)."""
    monkeypatch.setattr(cuda_gemv, "_num_sms", lambda index: 132)
    x = torch.zeros(1, 8)
    assert cuda_gemv._split(None, 24, 32, 4, x) == cuda_gemv.SPLITS_CAP == 16
    assert cuda_gemv._split(None, 96, 32, 4, x) == 5
    assert cuda_gemv._split(8, 24, 32, 4, x) == 8
    assert cuda_gemv._split(64, 24, 96, 4, x) == cuda_gemv.MAX_SPLITS
    assert cuda_gemv._split(16, 24, 5, 4, x) == 5
    assert cuda_gemv._split(0, 24, 32, 4, x) == 1
