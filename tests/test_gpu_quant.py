"""Quantized weights on the GPU: the Triton GEMM that dequantizes inside its tiles
(quant/triton_gemm.py) and the one-row CUDA kernels (quant/cuda_gemv.py) against the
reference dequantization, every format, bf16 rows from 1 to 300; and a quantized model's
greedy tokens on the GPU equal its dequantized twin's."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_model, random_prompts
from helpers import make_gpu_llm
from quant_checkpoints import quantize_checkpoint

from nanoserve import SamplingParams
from nanoserve.quant import QuantizedLinear

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FORMATS = {"fp8 block 128": ("fp8_block", {}),
           "fp8 block 16x32": ("fp8_block", {"block": (16, 32)}),
           "fp8 channel": ("fp8_channel", {}), "fp8 tensor": ("fp8_tensor", {}),
           "awq": ("awq", {"group": 32}),
           # act-order in groups of 32 runs as AWQ, its inputs sorted (QuantizedLinear.
           # input_order); in groups of 16 it stays GPTQ, the element-by-element act-order GEMM
           "gptq act-order": ("gptq", {"group": 32, "act_order": True}),
           "gptq act-order group 16": ("gptq", {"group": 16, "act_order": True}),
           "gptq_v2": ("gptq", {"group": 16, "v2": True})}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-gpu-quant")
    make_hf_model("qwen3", path, seed=3, hidden_size=256, intermediate_size=512,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=512)
    return path


@pytest.mark.parametrize("name", list(FORMATS))
@torch.inference_mode()
def test_the_quantized_gemm_equals_the_reference_dequantization(source, tmp_path, name):
    """Bound: the kernels' bf16 result within 1% (relative to the largest output) of float64's
    product with the dequantized weight, at rows 1 (the 4-bit GEMV), 7, 16, 64 (decode's
    tiles) and 300 (prefill's); FP8's from WIDE_ROWS rows of x as the FP8 kernels quantize it
    (fp8_activations_reference), below them of x itself. And the FP8 kernels' x is quantized
    from WIDE_ROWS rows and not below: their mean error from their reference is under a
    quarter of their mean error from the other one. Act-order GPTQ run as AWQ at one row: x
    gathered in the CUDA GEMV equals the GEMV of x gathered before it, bit for bit."""
    from nanoserve.quant import triton_gemm
    method, options = FORMATS[name]
    quantize_checkpoint(source, tmp_path, method, **options)
    llm = make_gpu_llm(tmp_path, dtype="bfloat16", max_model_len=1024)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers
    assert all((m.input_order is not None) == (name == "gptq act-order") for m in layers)
    for layer in layers:
        w = layer.dequantized(torch.float64)
        args = layer._kernel_args()
        for rows in (1, 7, 16, 64, 300):
            x = torch.randn(rows, layer.in_features, device="cuda", dtype=torch.bfloat16)
            got = layer.kernel_forward(x).double()
            ref = x.double() @ w.T
            if method.startswith("fp8"):
                group = triton_gemm.activation_group(layer.in_features, args["scale_cols"])
                quantized = triton_gemm.fp8_activations_reference(x, group).double() @ w.T
                ref, other = (quantized, ref) if rows >= triton_gemm.WIDE_ROWS else \
                    (ref, quantized)
                assert (got - ref).abs().mean() < 0.25 * (got - other).abs().mean(), (name, rows)
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, (name, rows, err)
        if layer.input_order is not None:  # one row: x gathered inside the CUDA GEMV
            from nanoserve.quant import cuda_gemv
            x = torch.randn(1, layer.in_features, device="cuda", dtype=torch.bfloat16)
            awq = dict(w=args["w"], zeros=args["zeros"], scales=args["scales"],
                       group=args["group"])
            assert cuda_gemv.awq_shape_ok(x, **awq, x_order=layer.input_order)
            gathered = cuda_gemv.awq_gemv(x.index_select(1, layer.input_order), **awq)
            assert torch.equal(layer.kernel_forward(x), gathered)
            assert torch.equal(cuda_gemv.awq_gemv(x, **awq, x_order=layer.input_order),
                               gathered)


@pytest.mark.parametrize("name", ["fp8 block 128", "awq"])
def test_a_quantized_model_on_the_gpu_gives_its_cpu_tokens(source, tmp_path, name):
    """The same quantized checkpoint in float32 on the GPU and on the CPU: the same greedy
    tokens (the dequantized weights are the same; only the GEMMs' rounding differs)."""
    from helpers import make_llm
    method, options = FORMATS[name]
    quantize_checkpoint(source, tmp_path, method, **options)
    prompts = random_prompts(3, [40, 9, 77], vocab=512, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    gpu = make_gpu_llm(tmp_path, dtype="float32", max_model_len=1024).generate(prompts, params)
    cpu = make_llm(tmp_path).generate(prompts, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


@pytest.mark.parametrize("rows", [65, 66, 300])
@pytest.mark.parametrize("k", [512, 768, 1024])
@torch.inference_mode()
def test_fp8_128_blocks_through_cublas_equal_the_triton_kernel_and_the_reference(rows, k):
    """128 x 128 block-scaled FP8 from CUBLAS_ROWS (65) rows runs cuBLAS's block-scaled GEMM
    (rows padded to a multiple of 16) where K is a multiple of 512 (cuBLAS reads the scales
    with a leading dimension rounded up to 4 blocks: at K = 256 or 768 its results are wrong,
    and the Triton kernel takes them): within 1% of float64's product of the quantized x and
    the dequantized weight, as the Triton kernel is, for a weight of 640 outputs."""
    from nanoserve.quant import triton_gemm
    gen = torch.Generator(device="cuda").manual_seed(k + rows)
    n = 640
    w = (torch.randn(n, k, device="cuda", generator=gen) * 64).clamp(-448, 448).to(
        torch.float8_e4m3fn)
    scales = torch.rand(n // 128, k // 128, device="cuda", generator=gen) * 1e-3 + 1e-4
    row = (torch.arange(n, device="cuda") // 128).to(torch.int32)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    dense = w.double() * scales.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    ref = triton_gemm.fp8_activations_reference(x, 128).double() @ dense.T
    assert triton_gemm.CUBLAS_ROWS == 65
    if torch.cuda.get_device_capability()[0] == 9:  # where cuBLAS's path is measured
        assert triton_gemm.cublas_block_scaled(x.device, k) == (k % 512 == 0)
    for cublas in (True, False):
        got = triton_gemm.quant_gemm(x, triton_gemm.FP8, w, scales, n, scale_row=row,
                                     scale_cols=128, cublas_blocks=cublas)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, (cublas, rows, k, err)


@pytest.mark.parametrize("fmt", ["fp8", "fp8 x quantized", "awq", "gptq"])
@torch.inference_mode()
def test_split_k_parts_are_summed_in_order_by_the_last_program_and_replay_in_graphs(fmt):
    """Decode's K split over programs (_store_split): the split result equals the unsplit
    kernel's within float32 reordering (one bf16 step, or 1e-3 of the largest output), is the same
    bit for bit on every run (the parts are summed in order, whichever finishes last), leaves
    the per-tile counters at zero, and a CUDA graph of it replayed on new rows gives what an
    eager call gives on them. A weight of 4096 x 2048, rows 1 and 5 (FP8, AWQ: its GEMV and
    its tensor-core kernel), 1 (GPTQ's GEMV)."""
    from nanoserve.quant import triton_gemm as tg
    gen = torch.Generator(device="cuda").manual_seed(7)
    n, k = 4096, 2048
    if fmt.startswith("fp8"):
        args = dict(fmt=tg.FP8, w=(torch.randn(n, k, device="cuda", generator=gen) * 64).clamp(
            -448, 448).to(torch.float8_e4m3fn), scales=torch.rand(
            n // 128, k // 128, device="cuda", generator=gen) * 1e-3 + 1e-4,
            scale_row=(torch.arange(n, device="cuda") // 128).to(torch.int32), scale_cols=128)
        quantize = fmt.endswith("quantized")

        def call(x, split):
            return tg._fp8_gemm(x, args["w"], args["scales"], args["scale_row"], 128, n, False,
                                tg.QuantTiles(16, 32, 128, 4, 3, split), quantize)
    else:
        fmt_id = tg.AWQ if fmt == "awq" else tg.GPTQ
        shape = (k, n // 8) if fmt == "awq" else (k // 8, n)
        args = dict(w=torch.randint(-2**31, 2**31 - 1, shape, device="cuda", generator=gen,
                                    dtype=torch.int32),
                    zeros=torch.randint(-2**31, 2**31 - 1, (k // 128, n // 8), device="cuda",
                                        generator=gen, dtype=torch.int32),
                    scales=torch.rand(k // 128, n, device="cuda", generator=gen).half() * 1e-2)

        def call(x, split):  # one row: the GEMV; AWQ's 5: _awq_mma_kernel
            return tg.quant_gemm(x, fmt_id, n=n, group=128, tiles=tg.QuantTiles(
                1 if x.shape[0] == 1 else 16, 64, 64, 4, 3, split), **args)
    for rows in (1,) if fmt == "gptq" else (1, 5):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        whole = call(x, 1).float()
        split = call(x, 8)
        assert torch.equal(split, call(x, 8))
        # the same float32 terms summed in another order: at most one bf16 step apart
        torch.testing.assert_close(split.float(), whole, rtol=2**-7,
                                   atol=1e-3 * whole.abs().max().item())
        assert not tg._COUNTERS[x.device].any()
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(static, 8)
        for _ in range(2):
            static.copy_(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen))
            graph.replay()
            assert torch.equal(out, call(static, 8)), (fmt, rows)
        assert not tg._COUNTERS[x.device].any()


@pytest.fixture(params=[False, True], ids=["plain", "pdl"])
def one_row_cuda(request, monkeypatch):
    """The one-row CUDA kernels switched on (the default), built afresh; launched plainly and
    with programmatic dependent launch (NANOSERVE_PDL=1; sm_90 and later, plain below)."""
    from nanoserve.extensions import ONE_ROW_SWITCH, PDL_SWITCH
    from nanoserve.quant import cuda_gemv
    monkeypatch.setenv(ONE_ROW_SWITCH, "1")
    monkeypatch.setenv(PDL_SWITCH, "1" if request.param else "0")
    cuda_gemv._extension.cache_clear()
    yield
    cuda_gemv._extension.cache_clear()


def _one_row_cases(call, x, ref, monkeypatch, label):
    """call(x) through the CUDA one-row kernel at 1 to 16 K splits (num_splits' choices), and
    at 20 and 32 asked for (call(x, splits), held to the units there are): within 2^-8 of
    ref's largest output, the same bit for bit on a second run, the split counters back at
    zero; a
    CUDA graph of it replayed on new rows gives what an eager call gives, its x written by the
    kernel ahead of it and two calls back to back (with programmatic dependent launch the GEMV
    starts before that kernel ends and waits for it; the second call may start while the first
    runs, on the same split counters)."""
    from nanoserve.quant import cuda_gemv
    from nanoserve.quant import triton_gemm as tg
    # how many SMs the split aims at (even and uneven runs), then splits asked for beyond
    # SPLITS_CAP: AWQ's last CTA adds 16 parts a batch, so 20 and 32 take a second batch
    cases = [(sms, None) for sms in (1, 5, 8, 10, 132)] + [(132, 20), (132, 32)]
    for sms, splits in cases:
        monkeypatch.setattr(cuda_gemv, "_num_sms", lambda index, sms=sms: sms)
        got = call(x, splits)
        assert got.dtype == x.dtype and got.shape == ref.shape
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 2**-8, (label, sms, splits, err)
        assert torch.equal(got, call(x, splits)), (label, sms, splits)
        if tg._COUNTERS:
            assert not tg._COUNTERS[x.device].any()
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        doubled = static * 2
        out, again = call(doubled), call(doubled)
    for _ in range(2):
        static.copy_(torch.randn_like(x))
        graph.replay()
        expect = call(static * 2)
        assert torch.equal(out, expect) and torch.equal(again, expect), label
        if tg._COUNTERS:
            assert not tg._COUNTERS[x.device].any()


@pytest.mark.parametrize("x_dtype, scale_dtype", [(torch.bfloat16, torch.float16),
                                                   (torch.float16, torch.float16),
                                                   (torch.bfloat16, torch.bfloat16)])
@torch.inference_mode()
def test_awq_cuda_gemv_equals_the_dequantized_weight_splits_and_graphs(x_dtype, scale_dtype,
                                                                        monkeypatch, one_row_cuda):
    """AWQ's one row through the CUDA GEMV (quant/cuda_gemv.py) against float64's product with
    formats.dequantize's weight (_one_row_cases' bounds), for groups 32, 64 and 128, output
    counts that fill 256-output slices and that do not (288: a slice of 32), and 86 groups
    (K 11,008: splits that do not divide them); x with entries at 1e6 (3e4 in fp16) and x at
    1e-4 of its size within the same bound."""
    from nanoserve.quant import QuantConfig, cuda_gemv
    from nanoserve.quant.formats import dequantize
    from nanoserve.quant.triton_gemm import AWQ
    gen = torch.Generator(device="cuda").manual_seed(11)
    for n, k, group in [(288, 512, 32), (4096, 4096, 128), (6144, 1024, 64),
                        (256, 12288, 128), (512, 11008, 128)]:
        t = dict(qweight=torch.randint(-2**31, 2**31 - 1, (k, n // 8), device="cuda",
                                       generator=gen, dtype=torch.int32),
                 qzeros=torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), device="cuda",
                                      generator=gen, dtype=torch.int32),
                 scales=(torch.rand(k // group, n, device="cuda", generator=gen) * 1e-2 + 1e-3
                         ).to(scale_dtype))
        w = dequantize(QuantConfig("awq", group_size=group), t, n, k, torch.float64)
        args = dict(w=t["qweight"], zeros=t["qzeros"], scales=t["scales"], group=group)
        x = torch.randn(1, k, device="cuda", generator=gen).to(x_dtype)
        assert cuda_gemv.one_row(x, dict(fmt=AWQ, **args)) is not None, (n, k, group)
        _one_row_cases(lambda x, splits=None, args=args: cuda_gemv.awq_gemv(x, **args,
                                                                            splits=splits), x,
                       x.double() @ w.T, monkeypatch, (n, k, group))
        # the kernel's products are fp16 of x times a power of two per thread and group:
        # entries at 3e4 (fp16's range) or 1e6 (bf16's) do not overflow its sums, and an x
        # 1e-4 as large loses nothing to fp16's subnormals
        spiky, tiny = x.clone(), (x.float() * 1e-4).to(x_dtype)
        spiky[0, ::997] = 1e6 if x_dtype == torch.bfloat16 else 3e4
        for xs in (spiky, tiny):
            got = cuda_gemv.awq_gemv(xs, **args).double()
            ref = xs.double() @ w.T
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            assert err < 2**-8, (n, k, group, xs.abs().max().item(), err)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
@torch.inference_mode()
def test_fp8_cuda_gemv_equals_the_scaled_weight_splits_and_graphs(x_dtype, monkeypatch,
                                                                   one_row_cuda):
    """FP8's one row through the CUDA GEMV (quant/cuda_gemv.py) against float64's product with
    the e4m3 weight times its scales (_one_row_cases' bounds): 128 x 128 blocks (N 4096, and
    N 300 with K 1,152: nine steps, splits that do not divide them, a partial block of
    outputs), 128 x 256 blocks, per channel and per tensor (two shards) scales; and the shapes
    it leaves to Triton (blocks of 32 inputs, K not a multiple of 128, float32 x)."""
    from nanoserve.quant import cuda_gemv
    from nanoserve.quant.triton_gemm import FP8
    gen = torch.Generator(device="cuda").manual_seed(12)
    for n, k, kind in [(4096, 4096, "block"), (300, 1152, "block"), (512, 2048, "block 256"),
                       (1024, 2048, "channel"), (512, 1024, "tensor")]:
        w = (torch.randn(n, k, device="cuda", generator=gen) * 64).clamp(-448, 448).to(
            torch.float8_e4m3fn)
        if kind.startswith("block"):
            cols = 256 if kind.endswith("256") else 128
            scales = torch.rand(-(-n // 128), k // cols, device="cuda", generator=gen) * 1e-3
            rows = torch.arange(n, device="cuda") // 128
            full = scales[rows].repeat_interleave(cols, 1)
        elif kind == "channel":
            scales = torch.rand(n, 1, device="cuda", generator=gen) * 1e-3
            rows, cols, full = torch.arange(n, device="cuda"), 1 << 30, scales
        else:
            scales = torch.rand(2, 1, device="cuda", generator=gen) * 1e-3
            rows, cols = torch.arange(n, device="cuda") * 2 // n, 1 << 30
            full = scales[rows]
        args = dict(w=w, scales=scales, scale_row=rows.to(torch.int32), scale_cols=cols)
        x = torch.randn(1, k, device="cuda", generator=gen).to(x_dtype)
        assert cuda_gemv.one_row(x, dict(fmt=FP8, **args)) is not None, (n, k, kind)
        ref = x.double() @ (w.double() * full.double()).T
        _one_row_cases(lambda x, splits=None, args=args: cuda_gemv.fp8_gemv(x, **args,
                                                                            splits=splits), x, ref,
                       monkeypatch, (n, k, kind))
    w = torch.zeros(256, 1024, device="cuda").to(torch.float8_e4m3fn)
    x = torch.zeros(1, 1024, device="cuda", dtype=torch.bfloat16)
    rows = torch.zeros(256, dtype=torch.int32, device="cuda")
    one = dict(fmt=FP8, w=w, scales=torch.ones(8, 32, device="cuda"), scale_row=rows)
    assert cuda_gemv.one_row(x, dict(one, scale_cols=32)) is None
    assert cuda_gemv.one_row(x.float(), dict(one, scale_cols=128)) is None
    assert cuda_gemv.one_row(x[:, :1000], dict(one, w=w[:, :1000], scale_cols=128)) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.inference_mode()
def test_half_cuda_gemv_equals_float64_splits_graphs_and_runs_linears_one_row(dtype,
                                                                             monkeypatch,
                                                                             one_row_cuda):
    """16-bit weights through the plain one-row CUDA GEMV (cuda_gemv.half_gemv) against
    float64's product (_one_row_cases' bounds, splits and graphs): Qwen3-30B-A3B's qkv, o and
    router, N 300 with K 1,152 (nine steps, a partial block of outputs) and a row stride past K;
    layers.Linear runs it at one row (not with a bias, not at two rows) and gives its result;
    shapes it leaves (K not a multiple of 128, float32, weights of another dtype)."""
    from nanoserve.models.layers import Linear
    from nanoserve.quant import cuda_gemv
    gen = torch.Generator(device="cuda").manual_seed(13)
    for n, k, stride in [(5120, 2048, 2048), (2048, 4096, 4096), (128, 2048, 2048),
                         (300, 1152, 1152), (256, 1024, 1536)]:
        w = (torch.randn(n, stride, device="cuda", generator=gen) * 0.02).to(dtype)[:, :k]
        x = torch.randn(1, k, device="cuda", generator=gen).to(dtype)
        assert cuda_gemv.half_gemv_ok(x, w), (n, k, stride)
        ref = x.double() @ w.double().T
        _one_row_cases(lambda x, splits=None, w=w: cuda_gemv.half_gemv(x, w, splits=splits), x,
                       ref, monkeypatch, (n, k, stride))
    linear = Linear(2048, 640, bias=False, device="cuda", dtype=dtype)
    x = torch.randn(1, 2048, device="cuda", generator=gen).to(dtype)
    assert linear.one_row_cuda(x) and not linear.one_row_cuda(x.repeat(2, 1))
    assert torch.equal(linear(x), cuda_gemv.half_gemv(x, linear.weight))
    assert not Linear(2048, 640, device="cuda", dtype=dtype).one_row_cuda(x)  # a bias
    w = torch.zeros(256, 1000, device="cuda", dtype=dtype)
    assert not cuda_gemv.half_gemv_ok(torch.zeros(1, 1000, device="cuda", dtype=dtype), w)
    assert not cuda_gemv.half_gemv_ok(x.float(), linear.weight.float())
    assert not cuda_gemv.half_gemv_ok(x, linear.weight.to(
        torch.float16 if dtype == torch.bfloat16 else torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.inference_mode()
def test_awq_on_tensor_cores_equals_the_dequantized_weight_in_bf16_and_fp16(dtype):
    """AWQ at 2-64 rows (_awq_mma_kernel: nibbles made into 16-bit floats by their bit
    pattern, bf16's 128 + q or fp16's 1024 + q, the offset taken off with the zero point):
    within 1% of float64's product with the dequantized weight (formats.dequantize), at rows
    2, 16, 33 and 64, a weight of 1024 x 2048 in groups of 128 (and the GEMV at one row)."""
    from nanoserve.quant import QuantConfig
    from nanoserve.quant import triton_gemm as tg
    from nanoserve.quant.formats import dequantize
    gen = torch.Generator(device="cuda").manual_seed(3)
    n, k, group = 1024, 2048, 128
    t = dict(qweight=torch.randint(-2**31, 2**31 - 1, (k, n // 8), device="cuda",
                                   generator=gen, dtype=torch.int32),
             qzeros=torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), device="cuda",
                                  generator=gen, dtype=torch.int32),
             scales=(torch.rand(k // group, n, device="cuda", generator=gen) * 1e-2).to(dtype))
    w = dequantize(QuantConfig("awq", group_size=group), t, n, k, torch.float64)
    for rows in (1, 2, 16, 33, 64):
        x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
        got = tg.quant_gemm(x, tg.AWQ, t["qweight"], t["scales"], n, zeros=t["qzeros"],
                            group=group)
        ref = x.double() @ w.T
        assert got.dtype == dtype
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, (dtype, rows, err)


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens", [1, 5, 64])
@torch.inference_mode()
def test_fp8_experts_through_the_fused_kernels_equal_the_loop_on_their_dequantized_weights(
        dtype, bound, tokens):
    """FP8 block-wise experts (128 x 128 scales), dequantized inside the fused MoE kernels'
    tiles: within `bound` (relative to the largest output) of the loop reference on the
    dequantized stacks in float32 (8 experts, top 2)."""
    from nanoserve.models import fused_moe, moe
    from nanoserve.quant import QuantConfig
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    e, h, i = 8, 256, 128
    quant = QuantConfig("fp8_block")
    stacks = [(torch.randn(e, 2 * i, h, device="cuda", generator=gen) * 64).clamp(-448, 448),
              (torch.randn(e, h, i, device="cuda", generator=gen) * 64).clamp(-448, 448)]
    stacks = [s.to(torch.float8_e4m3fn) for s in stacks]
    scales = [torch.rand(e, 2 * i // 128, h // 128, device="cuda", generator=gen) * 1e-3,
              torch.rand(e, h // 128, i // 128, device="cuda", generator=gen) * 1e-3]
    x = torch.randn(tokens, h, device="cuda", generator=gen)
    router = torch.randn(e, h, device="cuda", generator=gen)
    weights, ids = moe.route(x, router, 2, True)
    dense = [moe.dequantize_stack(quant, w, s, torch.float32)
             for w, s in zip(stacks, scales, strict=True)]
    ref = moe.experts_loop(x, weights, ids, *dense)
    got = fused_moe.experts_fused(x.to(dtype), weights.to(dtype), ids, *stacks,
                                  scales=tuple(scales), block=(128, 128)).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < bound, (dtype, tokens, err)


def test_an_fp8_moe_model_on_the_gpu_gives_its_cpu_tokens(tmp_path):
    """A tiny Qwen3-MoE in FP8 block-wise (16 x 32 blocks), float32: the GPU's fused path
    (experts dequantized in the tiles) gives the CPU's greedy tokens (the loop over the
    dequantized experts)."""
    from helpers import make_llm
    make_hf_model("qwen3_moe", tmp_path / "src", seed=4)
    quantize_checkpoint(tmp_path / "src", tmp_path / "fp8", "fp8_block", block=(16, 32))
    prompts = random_prompts(3, [40, 9, 77], vocab=256, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    gpu = make_gpu_llm(tmp_path / "fp8", dtype="float32", max_model_len=1024)
    cpu = make_llm(tmp_path / "fp8")
    assert [o.token_ids for o in gpu.generate(prompts, params)] == \
        [o.token_ids for o in cpu.generate(prompts, params)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [16, 64, 300])
@pytest.mark.parametrize("inter", [1536, 12288])
@torch.inference_mode()
def test_silu_mul_quantized_in_the_activation_pass_equals_quantizing_its_result(dtype, rows,
                                                                                inter):
    """quantize_activations(..., silu=True) on rows [gate | up] against quantize_activations of
    silu_and_mul's result: the intermediate rounds to x's dtype as torch rounds it, so the e4m3
    bytes and scales agree but where Triton's exp moves it by a step of x's dtype (at most 1 in
    1,000 bytes; each within one e4m3 step, scales within 2^-7), and rows past M (the cuBLAS
    path's padding) are zeros with scale 1e-12 / 448 (to 1e-6). Widths of 12 groups and
    Qwen3-8B's 96 (QUANT_GROUPS a program: 2 and 12 programs a row)."""
    from nanoserve.models.layers import silu_and_mul
    from nanoserve.quant import triton_gemm as tg
    gen = torch.Generator(device="cuda").manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * inter, device="cuda", generator=gen) * 3).to(dtype)
    padded = -(-rows // 16) * 16 + 16
    got_q, got_s = tg.quantize_activations(gate_up, 128, rows=padded, silu=True)
    ref_q, ref_s = tg.quantize_activations(silu_and_mul(gate_up), 128, rows=padded)
    assert got_q.shape == (padded, inter) and got_s.shape == (padded, inter // 128)
    _assert_same_quantization(got_q, got_s, ref_q, ref_s, rows)


def _assert_same_quantization(got_q, got_s, ref_q, ref_s, rows):
    """Two quantizations of rows x of the same values but for a step of x's dtype here and
    there: scales within 2^-7, every value within one e4m3 step, at most 1 byte in 1,000
    different; rows from `rows` on (padding) zeros with scale 1e-12 / 448 (to 1e-6)."""
    assert ((got_s - ref_s).abs() <= 2**-7 * ref_s).all()
    got = got_q.float() * got_s.repeat_interleave(128, 1)
    ref = ref_q.float() * ref_s.repeat_interleave(128, 1)
    step = 2**-3 * ref.abs() + 2**-9 * ref_s.repeat_interleave(128, 1)
    assert ((got - ref).abs() <= step).all()
    assert (got_q.view(torch.uint8) != ref_q.view(torch.uint8)).float().mean() <= 1e-3
    assert (got_q[rows:].float() == 0).all()
    # (Triton's float32 division is within 2 ulp, not IEEE-rounded)
    assert ((got_s[rows:] / (1e-12 / 448.0) - 1).abs() <= 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [16, 64, 300])
@pytest.mark.parametrize("width", [1536, 4096])
@pytest.mark.parametrize("with_delta", [True, False])
@torch.inference_mode()
def test_the_norm_made_quantized_equals_the_norm_then_the_quantization_pass(dtype, rows, width,
                                                                           with_delta):
    """norm_quantize_activations(x, delta, weight) against add_rms_norm's eager reference (or
    rms_norm's, without delta) followed by quantize_activations: x + delta bit-equal, the
    quantization the same but for a step of x's dtype here and there
    (_assert_same_quantization), padding rows zero. Widths of 12 groups and Qwen3-8B's 32."""
    from nanoserve.models.layers import add_rms_norm, rms_norm
    from nanoserve.quant import triton_gemm as tg
    gen = torch.Generator(device="cuda").manual_seed(rows + width)
    x = (torch.randn(rows, width, device="cuda", generator=gen) * 3).to(dtype)
    delta = (torch.randn(rows, width, device="cuda", generator=gen) * 3).to(dtype) \
        if with_delta else None
    weight = (torch.rand(width, device="cuda", generator=gen) + 0.5).to(dtype)
    padded = -(-rows // 16) * 16 + 16
    total, got_q, got_s = tg.norm_quantize_activations(x, delta, weight, 1e-6, 128, padded)
    if with_delta:
        ref_total, normed = add_rms_norm.eager(x, delta, weight, 1e-6)
        assert torch.equal(total, ref_total)
    else:
        normed = rms_norm.eager(x, weight, 1e-6)
        assert total is None
    ref_q, ref_s = tg.quantize_activations(normed, 128, rows=padded)
    assert got_q.shape == (padded, width) and got_s.shape == (padded, width // 128)
    _assert_same_quantization(got_q, got_s, ref_q, ref_s, rows)


@pytest.mark.parametrize("rows", [8, 16, 64, 300])
@torch.inference_mode()
def test_an_fp8_layers_norms_hand_its_projections_quantized_rows(source, tmp_path, rows,
                                                                  monkeypatch):
    """An FP8 block-wise model's decoder norms (RMSNorm.add_forward / forward with `into`):
    from WIDE_ROWS rows (16, 64; 300: Triton's kernel, the tiny model's K too small for
    cuBLAS's) they hand qkv_proj and gate_up_proj QuantizedRows, x + delta bit-equal to the
    plain norm's; the projection then runs no quantization pass, and its output is within 1e-3
    (relative norm) of the projection of the plain norm. At 8 rows (x not quantized), and with
    fusion off, the norm is a tensor as before."""
    from nanoserve import fused
    from nanoserve.quant import triton_gemm as tg
    from nanoserve.quant.linear import QuantizedRows
    quantize_checkpoint(source, tmp_path, "fp8_block")
    llm = make_gpu_llm(tmp_path, dtype="bfloat16", max_model_len=1024)
    layer = llm.engine.runner.model.model.layers[0]
    passes = []
    real_pass = tg.quantize_activations
    monkeypatch.setattr(tg, "quantize_activations", lambda *a, **k: (
        passes.append(a[0].shape), real_pass(*a, **k))[1])
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x, delta = (torch.randn(2, rows, 256, device="cuda", generator=gen) * 3).bfloat16()
    for norm, into in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                       (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
        ref_total, ref_h = norm.add_forward(x, delta)
        total, h = norm.add_forward(x, delta, into=into)
        assert torch.equal(total, ref_total)
        for got_h, plain in ((h, ref_h), (norm(x, into=into), norm(x))):
            assert isinstance(got_h, QuantizedRows) == (rows >= 16)
            passes.clear()
            got = into(got_h).float()
            assert passes == []
            ref = into(plain).float()
            assert passes == ([plain.shape] if rows >= 16 else [])
            assert ((got - ref).norm() / ref.norm()).item() < 1e-3, (rows, into)
        was = fused.is_enabled()
        fused.set_enabled(False)
        try:
            assert isinstance(norm.add_forward(x, delta, into=into)[1], torch.Tensor)
        finally:
            fused.set_enabled(was)


@pytest.mark.parametrize("rows", [65, 300])
@pytest.mark.parametrize("width", [4096, 5120])
@torch.inference_mode()
def test_the_norms_quantized_rows_run_cublas_as_quant_gemm_does(rows, width):
    """From CUBLAS_ROWS rows on Hopper, the norm's quantized rows (padded to a multiple of 16:
    quantized_rows) through fp8_quantized_gemm's cuBLAS block-scaled path give y [rows, N]
    within 1e-3 (relative norm) of quant_gemm on the plain norm's output. Widths of 32 groups
    and 40 (the norm pass at 8 warps)."""
    from nanoserve.models.layers import add_rms_norm
    from nanoserve.quant import triton_gemm as tg
    device = torch.device("cuda")
    if not tg.cublas_block_scaled(device, width):
        pytest.skip("cuBLAS's block-scaled FP8 GEMM runs here on Hopper only")
    gen = torch.Generator(device="cuda").manual_seed(rows + width)
    x, delta = (torch.randn(2, rows, width, device="cuda", generator=gen) * 3).bfloat16()
    weight = (torch.rand(width, device="cuda", generator=gen) + 0.5).bfloat16()
    n = 768
    w = (torch.randn(n, width, device="cuda", generator=gen) * 64).clamp(-448, 448).to(
        torch.float8_e4m3fn)
    fp8 = dict(w=w, scales=torch.rand(n // 128, width // 128, device="cuda", generator=gen) * 1e-3,
               scale_row=(torch.arange(n, device="cuda") // 128).to(torch.int32), scale_cols=128)
    padded = tg.quantized_rows(rows, width, True, device)
    assert padded == -(-rows // 16) * 16
    _, xq, xs = tg.norm_quantize_activations(x, delta, weight, 1e-6, 128, padded)
    got = tg.fp8_quantized_gemm(xq, xs, rows, **fp8, n=n, cublas_blocks=True,
                                dtype=torch.bfloat16).float()
    ref = tg.quant_gemm(add_rms_norm.eager(x, delta, weight, 1e-6)[1], tg.FP8, **fp8, n=n,
                        cublas_blocks=True).float()
    assert got.shape == ref.shape == (rows, n)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.parametrize("silu", [False, True])
@torch.inference_mode()
def test_the_quantization_pass_gives_the_same_bytes_for_any_groups_a_program(silu):
    """quantize_activations with 1-32 groups a program (the last chunk of a row cut short: 96
    groups, and 12) and by default (QUANT_GROUPS) equals the whole row a program, bit for bit,
    padding rows included."""
    from nanoserve.quant import triton_gemm as tg
    gen = torch.Generator(device="cuda").manual_seed(int(silu))
    for width in (12288, 1536):
        x = torch.randn(37, width * (2 if silu else 1), device="cuda", generator=gen).bfloat16()
        whole = 1 << (width // 128 - 1).bit_length()
        ref_q, ref_s = tg.quantize_activations(x, 128, rows=48, silu=silu,
                                               groups_per_program=whole)
        for per in (1, 2, 8, 32, None):
            got_q, got_s = tg.quantize_activations(x, 128, rows=48, silu=silu,
                                                   groups_per_program=per)
            assert torch.equal(got_q.view(torch.uint8), ref_q.view(torch.uint8)), (width, per)
            assert torch.equal(got_s, ref_s), (width, per)


@pytest.mark.parametrize("rows", [8, 16, 64, 300])
@torch.inference_mode()
def test_an_fp8_mlp_runs_silu_inside_down_projections_quantization(source, tmp_path, rows,
                                                                    monkeypatch):
    """silu_mul_linear on an FP8 block-wise down projection: from WIDE_ROWS rows (16 and 64:
    Triton's kernel; 300: cuBLAS's where it runs) no SiLU kernel runs (silu_and_mul is not
    called, and x's quantization pass is the one that computes silu) and the output is within
    1e-3 (relative norm) of down(silu_and_mul(gate_up)); at 8 rows (x not quantized)
    silu_kernel_forward declines and silu_and_mul runs."""
    from nanoserve.models import layers
    from nanoserve.quant import triton_gemm as tg
    quantize_checkpoint(source, tmp_path, "fp8_block")
    llm = make_gpu_llm(tmp_path, dtype="bfloat16", max_model_len=1024)
    down = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert isinstance(down, QuantizedLinear)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    gate_up = torch.randn(rows, 2 * down.in_features, device="cuda", generator=gen).bfloat16()
    ref = down(layers.silu_and_mul(gate_up)).float()
    called, passes = [], []
    real = layers.silu_and_mul
    monkeypatch.setattr(layers, "silu_and_mul", lambda x: called.append(x.shape) or real(x))
    real_pass = tg.quantize_activations
    monkeypatch.setattr(tg, "quantize_activations", lambda *a, silu=False, **k: (
        passes.append(silu), real_pass(*a, silu=silu, **k))[1])
    got = layers.silu_mul_linear(down, gate_up).float()
    assert bool(called) == (rows < 16)
    assert passes == ([] if rows < 16 else [True])
    assert (down.silu_kernel_forward(gate_up) is None) == (rows < 16)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-3
