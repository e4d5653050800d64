"""Programmatic dependent launch (on by default on sm_90; NANOSERVE_PDL=0 turns it off; the tests
set it either way): a kernel launched with it may start while the kernel ahead of it runs, and
must wait for that kernel's output before it reads it. The
one-row GEMVs (csrc/one_row.cuh): ahead of them here runs a kernel that lets them start at once,
spins, and only then writes x: a GEMV that read x before its wait would read zeros. The whole
batch-1 decode step (nanoserve/pdl.py: the Triton kernels, the MoE and plain GEMVs) against the
same step launched without it."""

from __future__ import annotations

import pytest
import torch
from conftest import GPU_SHAPE, make_hf_model, random_prompts

from nanoserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or
                                 torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a CUDA GPU of sm_90 or later (PDL)")]

EARLY_WRITER = r"""
#include <torch/extension.h>
#include <cuda_fp16.h>

// lets the next kernel start at once, spins `cycles`, then writes x[i] = v ((i % 13) - 6) / 8
__global__ void early_writer_kernel(__half* x, int k, float v, long long cycles) {
  asm volatile("griddepcontrol.launch_dependents;");
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
  for (int i = threadIdx.x; i < k; i += blockDim.x)
    x[i] = __float2half(v * static_cast<float>((i % 13) - 6) / 8.f);
}

void early_writer(torch::Tensor x, double v, int64_t cycles, int64_t stream) {
  early_writer_kernel<<<1, 256, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      static_cast<__half*>(x.data_ptr()), static_cast<int>(x.numel()), static_cast<float>(v),
      cycles);
}

// the same, into two rows of a KV cache at once (K's and V's of one token)
__global__ void early_kv_writer_kernel(__half* k, __half* v, int n, float value,
                                       long long cycles) {
  asm volatile("griddepcontrol.launch_dependents;");
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    k[i] = __float2half(value * static_cast<float>((i % 13) - 6) / 8.f);
    v[i] = __float2half(value * static_cast<float>((i % 7) - 3) / 4.f);
  }
}

void early_kv_writer(torch::Tensor k, torch::Tensor v, double value, int64_t cycles,
                     int64_t stream) {
  early_kv_writer_kernel<<<1, 256, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      static_cast<__half*>(k.data_ptr()), static_cast<__half*>(v.data_ptr()),
      static_cast<int>(k.numel()), static_cast<float>(value), cycles);
}
"""
CYCLES = 200_000  # about 100 us at 2 GHz: far longer than a GEMV's launch


@pytest.fixture(scope="module")
def writer():
    from torch.utils.cpp_extension import load_inline
    return load_inline(
        "nanoserve_test_early_writer",
        cpp_sources="void early_writer(torch::Tensor x, double v, int64_t cycles, "
                    "int64_t stream); void early_kv_writer(torch::Tensor k, torch::Tensor v, "
                    "double value, int64_t cycles, int64_t stream);",
        cuda_sources=EARLY_WRITER, functions=["early_writer", "early_kv_writer"],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"])


@torch.inference_mode()
def test_a_pdl_gemv_waits_for_the_kernel_ahead_that_lets_it_start_early(writer, monkeypatch):
    """AWQ (K = N = 4,096, groups of 128) and FP8 (per-channel scales) GEMVs, twice back to
    back after the early writer, x zeroed before each run: eager 50 times and in a CUDA graph
    replayed 20 times, both calls equal what the GEMV gives on x written before it starts,
    and the split counters are back at zero."""
    from nanoserve.extensions import ONE_ROW_SWITCH, PDL_SWITCH
    from nanoserve.quant import cuda_gemv
    from nanoserve.quant import triton_gemm as tg
    monkeypatch.setenv(ONE_ROW_SWITCH, "1")
    cuda_gemv._extension.cache_clear()
    dev = torch.device("cuda")
    k = n = 4096
    gen = torch.Generator(device=dev).manual_seed(0)
    qweight = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device=dev,
                            generator=gen)
    qzeros = torch.randint(-2**31, 2**31 - 1, (k // 128, n // 8), dtype=torch.int32,
                           device=dev, generator=gen)
    scales = (torch.rand(k // 128, n, device=dev, generator=gen) * 0.01).half()
    w8 = (torch.randn(n, k, device=dev, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    s8 = torch.rand(n, 1, device=dev, generator=gen) + 0.5
    rows8 = torch.arange(n, dtype=torch.int32, device=dev)
    gemvs = {"awq": lambda x: cuda_gemv.awq_gemv(x, qweight, qzeros, scales, 128),
             "fp8": lambda x: cuda_gemv.fp8_gemv(x, w8, s8, rows8, k)}
    x = torch.zeros(1, k, dtype=torch.half, device=dev)

    def stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    try:
        for name, gemv in gemvs.items():
            monkeypatch.setenv(PDL_SWITCH, "0")
            expected = {}
            for v in (1.0, 2.0, 3.0):
                writer.early_writer(x, v, 0, stream())
                torch.cuda.synchronize()
                expected[v] = gemv(x).clone()
            assert expected[1.0].abs().max() > 0, name
            monkeypatch.setenv(PDL_SWITCH, "1")
            runs = []
            for i in range(50):
                v = (1.0, 2.0, 3.0)[i % 3]
                x.zero_()
                writer.early_writer(x, v, CYCLES, stream())
                runs.append((v, gemv(x), gemv(x)))
            torch.cuda.synchronize()
            for v, first, second in runs:
                assert torch.equal(first, expected[v]) and torch.equal(second, expected[v]), name
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                writer.early_writer(x, 3.0, CYCLES, stream())
                first, second = gemv(x), gemv(x)
            for _ in range(20):
                x.zero_()
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(first, expected[3.0]), name
                assert torch.equal(second, expected[3.0]), name
            assert not tg._COUNTERS[x.device].any(), name
    finally:
        cuda_gemv._extension.cache_clear()


@pytest.mark.parametrize("length, splits", [(200, 4), (1000, 2), (64, 1)])
@torch.inference_mode()
def test_pdl_decode_attention_reads_the_newest_token_after_its_wait(writer, monkeypatch,
                                                                   length, splits):
    """The kernel ahead of decode attention (rope and the KV store) writes the newest token's
    K and V: here a kernel ahead lets the split kernel start at once, spins, and only then
    writes that row. Eager 20 times and in a graph replayed 10 times, the output equals the
    one with the row written before: with the newest token the first tile of its split (200
    tokens in 4 splits, 64 in one, written directly), and past it (1,000 in 2). (Session 36
    read the rest of the first tile before the wait; TPOT went up, so nothing is read before
    it.)"""
    from nanoserve.attention.triton_decode import TILES, paged_decode_attention
    from nanoserve.extensions import PDL_SWITCH
    dev, page, kv_heads, d = torch.device("cuda"), 256, 8, 128
    gen = torch.Generator(device=dev).manual_seed(length)
    pages = -(-length // page)
    k_cache = torch.randn(pages + 1, page, kv_heads, d, device=dev, dtype=torch.half,
                          generator=gen)
    v_cache = torch.randn_like(k_cache)
    table = torch.arange(1, pages + 1, dtype=torch.int32, device=dev)[None]
    lens = torch.tensor([length], dtype=torch.int32, device=dev)
    q = torch.randn(1, 32, d, device=dev, dtype=torch.half, generator=gen)
    slot = (pages, (length - 1) % page)
    k_row, v_row = k_cache[slot], v_cache[slot]

    def stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def attend():
        return paged_decode_attention(q, k_cache, v_cache, table, lens, d**-0.5, splits,
                                      tiles=TILES["default"])

    monkeypatch.setenv(PDL_SWITCH, "0")
    writer.early_kv_writer(k_row, v_row, 2.0, 0, stream())
    expected = attend().clone()
    k_row.zero_()
    v_row.zero_()
    assert not torch.equal(attend(), expected)  # the row counts
    monkeypatch.setenv(PDL_SWITCH, "1")
    runs = []
    for _ in range(20):
        k_row.zero_()
        v_row.zero_()
        writer.early_kv_writer(k_row, v_row, 2.0, CYCLES, stream())
        runs.append(attend())
    torch.cuda.synchronize()
    assert all(torch.equal(r, expected) for r in runs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        writer.early_kv_writer(k_row, v_row, 2.0, CYCLES, stream())
        out = attend()
    for _ in range(10):
        k_row.zero_()
        v_row.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


OFFLOADED = dict(enable_offload=True, resident_layers=1, host_kv_budget_gib=1, cpu_attention="off")


@pytest.mark.parametrize("arch, layout", [
    ("qwen3", {}), ("qwen3_moe", {}), ("qwen3", OFFLOADED),
    ("qwen3", dict(OFFLOADED, cpu_attention="0.5"))],
    ids=["qwen3", "qwen3_moe", "qwen3-offloaded", "qwen3-offloaded-cpu-share"])
@torch.inference_mode()
def test_batch_one_decode_with_every_kernel_launched_with_pdl_equals_it_without(
        arch, layout, tmp_path, monkeypatch):
    """A tiny Qwen3 and Qwen3-MoE (every linear layer through the plain one-row GEMV, the
    router's pick and rope, attention and its merge in Triton, the experts in CUDA, the norms
    through inductor, compiled afresh each time), three prompts one at a time in CUDA graphs,
    resident, and offloaded (a layer on the GPU, the rest streamed; with half the streamed
    tokens attended on the CPU too, merged on the GPU): with NANOSERVE_PDL=1 every step's
    logits equal those launched without it, bit for bit, and an eager engine under it decodes
    the same tokens."""
    from nanoserve import fused, pdl
    from nanoserve.extensions import PDL_SWITCH
    shape = dict(GPU_SHAPE, num_experts=16, num_experts_per_tok=4) if arch == "qwen3_moe" \
        else GPU_SHAPE
    make_hf_model(arch, tmp_path, **shape)
    prompts = random_prompts(3, [300, 17, 1000], vocab=2048, seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    launched = []  # the Triton kernels' choices: PDL really engaged under the flag
    wanted = pdl.wanted
    monkeypatch.setattr(pdl, "wanted", lambda t: launched.append(wanted(t)) or launched[-1])

    def decode(flag: str, **kw):
        monkeypatch.setenv(PDL_SWITCH, flag)
        launched.clear()
        fused.forget_compiled()  # inductor's kernels compiled under this flag
        llm = LLM(str(tmp_path), progress=False, page_size=16, max_graph_batch_size=4,
                  **layout, **kw)
        runner, logits = llm.engine.runner, []
        forward = runner.forward
        runner.forward = lambda inputs: logits.append(forward(inputs).clone()) or logits[-1]
        tokens = [llm.generate([p], greedy)[0].token_ids for p in prompts]
        assert launched and all(launched) == (flag == "1") and any(launched) == (flag == "1")
        return tokens, logits

    try:
        pdl_tokens, pdl = decode("1")
        tokens, plain = decode("0")
        assert pdl_tokens == tokens and len(pdl) == len(plain) >= 3 * 12
        for a, b in zip(pdl, plain, strict=True):
            assert torch.equal(a, b)
        assert decode("1", enforce_eager=True)[0] == tokens
    finally:
        fused.forget_compiled()  # later tests compile under their own flag
