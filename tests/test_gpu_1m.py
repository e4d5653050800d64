"""GPU: one million tokens (issue 34) without a nine-minute prefill: the Llama-3-8B-1048k shape
with dummy weights, FP8 KV, a 1M prompt whose pages get the same random KV in every engine
(kv/synthetic.py), the rest prefilled. Greedy tokens with the KV split between the GPU and
pinned host memory, the CPU attending part of the host's share, equal those with every layer
resident. Needs a GPU that holds the 1M KV resident (an H200): run on its own
(GPU_TESTS=tests/test_gpu_1m.py), about two minutes."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import random_prompts

from nanoserve import LLM, SamplingParams
from nanoserve.kv.synthetic import fill_random

pytestmark = pytest.mark.gpu

CONTEXT = 1 << 20


def tokens_after_written_kv(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = llm.engine
    seq = engine.add_request(prompt, params)[0]
    assert fill_random(engine.kv, seq, seed=3) == (len(prompt) - 1) // 256 * 256
    while engine.has_unfinished():
        engine.step()
    assert seq.num_output_tokens == params.max_tokens
    return seq.output_token_ids


def test_1m_split_between_gpu_and_host_equals_resident():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_properties(0).total_memory < 120 * 2**30:
        pytest.skip("needs a GPU that holds 1M tokens of FP8 KV beside the weights (H200)")
    prompt = random_prompts(1, [CONTEXT - 8], vocab=128256, seed=17)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    common = dict(dummy_weights=True, kv_cache_dtype="fp8", max_model_len=CONTEXT,
                  max_num_seqs=1, progress=False)
    resident = LLM("Llama-3-8B-1048k", **common)
    assert resident.engine.kv.streamer is None
    want = tokens_after_written_kv(resident, prompt, params)
    del resident
    gc.collect()
    torch.cuda.empty_cache()
    split = LLM("Llama-3-8B-1048k", enable_offload=True, resident_layers=16,
                cpu_attention="auto", **common)
    runner = split.engine.runner
    assert split.engine.kv.plan.streamed_layers == 16 and runner.cpu_split is not None
    assert tokens_after_written_kv(split, prompt, params) == want
    assert runner.cpu_share.history  # the CPU attended its share in those steps
