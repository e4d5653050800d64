"""The one-row CUDA kernels (nanoserve/quant/cuda_gemv.py, csrc/) on the CPU: the AWQ kernel's
arithmetic (its unpacking exactly, its fp16 sums emulated) against formats.dequantize; which
shapes each takes; how K is split. The kernels themselves run in tests/test_gpu_quant.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from nanoserve.quant import QuantConfig, cuda_gemv
from nanoserve.quant.formats import dequantize


def plus_1024(words: torch.Tensor) -> torch.Tensor:
    """The kernel's unpacking of int32 words [..., W] into fp16 [..., 8 W]: for nibbles i and
    i + 4 of a word, (w >> 4 i) & 0x000F000F | 0x64006400 holds two fp16 1024 + q, its low half
    output 2 i and its high half 2 i + 1."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(*words.shape, 8, dtype=torch.float16)
    for i in range(4):
        v = ((w >> (4 * i)) & 0x000F000F) | 0x64006400
        for c, bits in ((2 * i, v & 0xFFFF), (2 * i + 1, v >> 16)):
            out[..., c] = bits.to(torch.int16).view(torch.float16)  # 0x64..: the sign bit clear
    return out.flatten(-2)


def fp16(t: torch.Tensor) -> torch.Tensor:
    """float64 rounded to the nearest fp16 once (numpy's conversion; torch's goes through
    float32, rounding twice), back in float64."""
    return torch.from_numpy(t.numpy().astype(np.float16)).double()


def awq_kernel_emulated(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
                        scales: torch.Tensor, group: int) -> torch.Tensor:
    """The kernel's products (awq_gemv.cu) for x [K] (values a float32 holds): the 16 row slots
    of a group each take their group / 16 rows of x into fp16 times 2^e, e putting the slot's
    largest |x| in [256, 512); each sums x (q - z) in fp16, one rounding an FMA (as HFMA2);
    then s 2^-e times each slot's sum, in float64 here (float32 in the kernel)."""
    q, z = plus_1024(qweight), plus_1024(qzeros)  # [K, N], [groups, N]
    k, n = q.shape
    d = (q.view(-1, group, n) - z[:, None]).double()  # HSUB2: small integers, exact
    d = d.view(-1, group // 16, 16, n)  # [groups, steps, slot, N]
    xs = x.view(-1, group // 16, 16)  # [groups, steps, slot]
    _, e2 = torch.frexp(xs.abs().amax(1))  # largest in [2^(e2 - 1), 2^e2)
    biased = torch.where(xs.abs().amax(1) > 0, e2 + 126, 0).clamp(min=9)
    power = 2.0 ** (135 - biased).double()  # [groups, slot]
    xh = fp16(xs * power[:, None])
    acc = torch.zeros(k // group, 16, n, dtype=torch.float64)
    for step in range(group // 16):  # exact in float64, then one rounding: fp16's FMA
        acc = fp16(xh[:, step, :, None] * d[:, step] + acc)
    return (scales.double()[:, None] / power[..., None] * acc).sum((0, 1))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_kernels_arithmetic_gives_the_dequantized_product(group):
    """The kernel's unpacking gives 1024 plus each nibble exactly, its zeros alike, and its
    fp16 sums (emulated) give x times formats.dequantize's weight to 2^-9 of the largest output
    (float64 reference) whatever x's scale: plain, with entries at 3e4 and at 1e6 (finite: no
    fp16 sum past its range), all of it times 1e-4 (no fp16 subnormals)."""
    k, n = 1024, 64
    gen = torch.Generator().manual_seed(group)
    qweight = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, generator=gen)
    qzeros = torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), dtype=torch.int32,
                           generator=gen)
    scales = (torch.rand(k // group, n, generator=gen) * 1e-2 + 1e-3).half()
    w = dequantize(QuantConfig("awq", group_size=group),
                   dict(qweight=qweight, qzeros=qzeros, scales=scales), n, k, torch.float64)
    nibbles = ((qweight.to(torch.int64) & 0xFFFFFFFF)[..., None] >> (4 * torch.arange(8))) & 15
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # output c's nibble: AWQ's order
    assert torch.equal(plus_1024(qweight).double(), 1024 + nibbles[..., order].flatten(-2))
    x = torch.randn(k, generator=gen).bfloat16().double()
    spiky, huge = x.clone(), x.clone()
    spiky[::97] = 3e4
    huge[::97] = 1e6
    for xs in (x, spiky, huge, (x * 1e-4).float().double()):
        got, ref = awq_kernel_emulated(xs, qweight, qzeros, scales, group), w @ xs
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 2**-9, (group, xs.abs().max().item(), err)


def awq_tensors(n: int, k: int, group: int, x_dtype=torch.bfloat16, scale_dtype=torch.float16):
    return (torch.zeros(1, k, dtype=x_dtype),
            dict(w=torch.zeros(k, n // 8, dtype=torch.int32),
                 zeros=torch.zeros(k // group, n // 8, dtype=torch.int32),
                 scales=torch.zeros(k // group, n, dtype=scale_dtype), group=group))


def shape_ok(x: torch.Tensor, args: dict) -> bool:
    return cuda_gemv.awq_shape_ok(x, **args)


def test_the_shapes_each_kernel_takes():
    """AWQ: one half-precision row, groups 32 / 64 / 128, N a multiple of 32, contiguous
    tensors, an order of x int32 [K]. FP8: one half-precision row, e4m3 rows with K a multiple
    of 128, scale blocks of whole 128-input steps or one scale a row. Anything else goes to
    Triton's kernels; on the CPU one_row() takes nothing."""
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
    x, args = awq_tensors(4096, 4096, 128)  # x read through an order: int32 [K], contiguous
    assert cuda_gemv.awq_shape_ok(x, **args, x_order=torch.zeros(4096, dtype=torch.int32))
    for order in (torch.zeros(4096, dtype=torch.int64), torch.zeros(4095, dtype=torch.int32),
                  torch.zeros(8192, dtype=torch.int32)[::2]):
        assert not cuda_gemv.awq_shape_ok(x, **args, x_order=order)

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
    """num_splits: at least `min_units` units (groups, steps) a CTA, at most SPLITS_CAP, and
    the CTAs that stay resident over all slices, at least one, the most of those; Qwen3-8B's
    AWQ and FP8 layers on 132 SMs as the docstring says."""
    for (slices, units, per_sm), least in itertools.product(
            ((16, 32, 4), (24, 32, 4), (96, 32, 4), (16, 96, 4), (2, 16, 4), (1, 1, 4),
             (300, 8, 4), (256, 32, 8), (1, 224, 8), (16, 86, 4)), (1, 8)):
        resident = per_sm * sms
        d = cuda_gemv.num_splits(slices, units, resident, least)
        most = min(units // least, cuda_gemv.SPLITS_CAP)
        assert 1 <= d <= max(1, most)
        assert d == 1 or slices * d <= resident
        assert d >= most or slices * (d + 1) > resident
    if sms == 132:
        assert [cuda_gemv.num_splits(s, g, cuda_gemv.AWQ_CTAS_PER_SM * 132) for s, g in
                ((16, 32), (24, 32), (96, 32), (16, 96))] == [16, 16, 4, 16]
        fp8 = cuda_gemv.PLAIN_CTAS_PER_SM * 132  # 32 outputs a CTA: qkv, o, gate_up, down
        assert [cuda_gemv.num_splits(n // cuda_gemv.PLAIN_OUTS, k // cuda_gemv.PLAIN_STEP, fp8,
                                     cuda_gemv.FP8_MIN_STEPS)
                for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))] == \
            [4, 4, 1, 6]
        half = [cuda_gemv.num_splits(n // cuda_gemv.PLAIN_OUTS, k // cuda_gemv.PLAIN_STEP, fp8,
                                     cuda_gemv.HALF_MIN_STEPS, 132)
                for n, k in ((5120, 2048), (2048, 4096), (128, 2048), (6144, 4096), (4096, 4096),
                             (24576, 4096), (151936, 4096))]
        assert half == [2, 4, 8, 4, 4, 1, 1]  # 16-bit: Qwen3-30B-A3B's and Qwen3-8B's


@pytest.mark.parametrize("sms", [8, 78, 132])
def test_filling_the_sms_splits_few_outputs_more_never_below_two_units_a_cta(sms):
    """num_splits' `fill`: a launch of fewer CTAs than SMs is split further, up to a CTA an SM
    (rounded up), never below 2 units a CTA nor past SPLITS_CAP; one that fills them is as
    without it."""
    for slices, units in itertools.product((1, 2, 4, 7, 64, 200), (1, 2, 3, 16, 64, 96)):
        plain = cuda_gemv.num_splits(slices, units, 6 * sms, 8)
        d = cuda_gemv.num_splits(slices, units, 6 * sms, 8, sms)
        assert d >= plain
        if slices * plain >= sms:
            assert d == plain
        else:
            assert d == max(plain, 1, min(-(-sms // slices), units // 2, cuda_gemv.SPLITS_CAP))


def test_a_split_asked_for_is_held_to_a_unit_a_cta_and_max_splits(monkeypatch):
    """_split: num_splits' choice unless a split is asked for (tools/bench_quant.py --splits),
    which is held to 1..min(units, MAX_SPLITS)."""
    monkeypatch.setattr(cuda_gemv, "_num_sms", lambda index: 132)
    x = torch.zeros(1, 8)
    assert cuda_gemv._split(None, 24, 32, 4, 1, x) == cuda_gemv.SPLITS_CAP == 16
    assert cuda_gemv._split(None, 96, 32, 4, 1, x) == 5
    assert cuda_gemv._split(8, 24, 32, 4, 1, x) == 8
    assert cuda_gemv._split(64, 24, 96, 4, 1, x) == cuda_gemv.MAX_SPLITS
    assert cuda_gemv._split(16, 24, 5, 4, 1, x) == 5
    assert cuda_gemv._split(0, 24, 32, 4, 1, x) == 1
    assert cuda_gemv._split(None, 128, 32, 6, 8, x) == 4  # 8 units a CTA: FP8's o
