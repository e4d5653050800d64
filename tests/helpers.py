"""The tests' shared helpers: LLM factories (CPU and GPU), all-position logits, host-KV
corruption."""

from __future__ import annotations

import gc
import random
from itertools import pairwise

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.context import forward_context
from nanoserve.engine.scheduler import Batch
from nanoserve.engine.sequence import Sequence


def make_llm(path, **kw) -> LLM:
    """The tests' LLM: a local model (None: the embedded one), no progress bars, 4-token pages
    (many page boundaries in short prompts), on the CPU in float32 unless the test asks for
    another device; offload through the link alone unless the test names a CPU attention
    setting (auto, the default, splits on a GPU: its tests name it)."""
    kw.setdefault("page_size", 4)
    kw.setdefault("cpu_attention", "off")
    kw.setdefault("device", "cpu")
    if kw["device"] == "cpu":
        kw.setdefault("dtype", "float32")
    return LLM(None if path is None else str(path), progress=False, **kw)


def make_gpu_llm(path, **kw) -> LLM:
    """The GPU tests' engine: 16-token pages, 8 sequences, 4096 tokens, 512-token chunks."""
    return make_llm(path, **{"device": "cuda", "page_size": 16, "max_num_seqs": 8,
                             "max_model_len": 4096, "max_num_batched_tokens": 512, **kw})


@torch.inference_mode()
def engine_prefill_logits(llm, token_ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Logits of every position of one prompt, prefilled in steps of `chunk` tokens (default:
    one step), every layer resident: the engine's KV pages, step inputs and attention backend,
    every row's logits."""
    engine, runner = llm.engine, llm.engine.runner
    seq = Sequence(token_ids, SamplingParams(max_tokens=1))
    assert engine.kv.grow(seq, len(token_ids))
    chunk = chunk or len(token_ids)
    out = []
    try:
        for start in range(0, len(token_ids), chunk):
            seq.num_cached = start
            n = min(chunk, len(token_ids) - start)
            inputs = runner.inputs.build(Batch(True, [seq], [n]))
            ctx = inputs.context()
            runner.backend.prepare(ctx)
            with forward_context(ctx):
                out.append(runner.model.head(runner.model(inputs.input_ids,
                                                          inputs.positions)).cpu())
        return torch.cat(out)
    finally:
        engine.kv.free(seq)


def random_layer_rows(spec, num_pages: int, generator: torch.Generator,
                      std: float = 1.0) -> torch.Tensor:
    """One layer's rows [2, pages, row] in `spec`'s layout on the CPU, K and V random normal
    times `std` (FP8: quantized, a scale per token and kv head)."""
    from nanoserve.kv.fp8 import quantize

    rows = spec.empty(1, num_pages, torch.device("cpu"))[0]
    k, v, k_scale, v_scale = spec.views(rows)
    for values, scales in ((k, k_scale), (v, v_scale)):
        x = torch.randn(values.shape, generator=generator) * std
        if scales is None:
            values.copy_(x.to(values.dtype))
        else:
            q8, s = quantize(x)
            values.copy_(q8)
            scales.copy_(s)
    return rows


def host_kv_views(engine, layer: int) -> tuple[torch.Tensor, ...]:
    """Streamed layer `layer`'s K and V values and scales (None unless FP8) in the host store."""
    return engine.kv.spec.views(engine.kv.streamer.host.data[layer])


def corrupt_host_kv(engine, layer: int, pages: list[int], value: float | None = None) -> None:
    """Overwrites streamed layer `layer`'s K and V values of `pages` in the host store: random
    values, or `value` (an FP8 cache keeps its scales). Tests use it to prove that tokens really
    depend on what went through it."""
    for values in host_kv_views(engine, layer)[:2]:
        shape = values[pages].shape
        new = torch.randn(shape) if value is None else torch.full(shape, value)
        values[pages] = new.to(values.dtype)


def corrupt_host_scales(engine, layer: int, pages: list[int], value: float) -> None:
    """Sets the FP8 scales of streamed layer `layer`'s K and V of `pages` in the host store to
    `value`, their values untouched."""
    for scales in host_kv_views(engine, layer)[2:]:
        scales[pages] = value


def offloaded_and_resident_32k(gpu_kv_budget_gib: float, params: SamplingParams, **kw):
    """GPU: the Qwen3-8B shape with dummy weights; a 32K prompt's completion under `params`
    through a GPU KV budget too small for its KV (some layers streamed), and the resident
    engine's (the link alone unless kw names a CPU attention setting): (offloaded, resident)
    RequestOutputs."""
    from conftest import random_prompts

    prompt = random_prompts(1, [32768], vocab=151936, seed=11)[0]
    common = dict(dummy_weights=True, max_model_len=32768 + 16, max_num_seqs=1, progress=False,
                  **{"cpu_attention": "off", **kw})
    resident = LLM("Qwen3-8B", **common).generate(prompt, params)[0]
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM("Qwen3-8B", enable_offload=True, gpu_kv_budget_gib=gpu_kv_budget_gib, **common)
    plan = llm.engine.kv.plan
    assert plan.streamed_layers > 0 and plan.num_pages * 256 >= 32768 + 8
    out = llm.generate(prompt, params)[0]
    assert out.error is None, out.error
    return out, resident


def assert_32k_offload_equals_resident(gpu_kv_budget_gib: float, **kw) -> None:
    """offloaded_and_resident_32k's 8 greedy tokens equal: the streamed layers run the
    resident path's kernels on the same values."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out, resident = offloaded_and_resident_32k(gpu_kv_budget_gib, params, **kw)
    assert out.token_ids == resident.token_ids, (out.token_ids, resident.token_ids)


def cuttings(text: str) -> list[list[str]]:
    """Ways a streamed text arrives: whole, one character a delta, cut in two at every point,
    and cut at random points (seeded)."""
    cuts = [[text], list(text)]
    cuts += [[text[:i], text[i:]] for i in range(1, len(text))]
    for seed in range(20):
        rng = random.Random(seed)
        points = sorted(rng.sample(range(1, len(text)), rng.randint(0, max(0, len(text) - 1) // 3)))
        cuts.append([text[a:b] for a, b in pairwise([0, *points, len(text)])])
    return cuts
