"""GPU: prompt logprobs in bf16 against transformers' float32 log_softmax on the same weights,
and bitwise equal with every layer streamed (offload on vs off)."""

from __future__ import annotations

import pytest
import torch
from conftest import GPU_SHAPE, make_hf_model, random_prompts
from helpers import make_gpu_llm

from nanoserve import SamplingParams

pytestmark = pytest.mark.gpu

SCORE = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
LENGTHS = [1300, 37, 700]  # 512-token chunks: prompts that span chunks and share a step


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu-prompt-logprobs")
    hf = make_hf_model("qwen3", path, **GPU_SHAPE)
    return path, hf


def scored(llm, prompts) -> list[list[float]]:
    outs = llm.generate(prompts, SCORE)
    return [[e.logprob for e in o.prompt_logprobs[1:]] for o in outs]


def test_bf16_prompt_logprobs_as_close_to_fp32_as_transformers_bf16(model):
    """Bound: our bf16 prompt logprobs' error against transformers' fp32 ones is within 1.5x of
    transformers' own bf16 error (same weights), chunked over three prefill steps."""
    from transformers import AutoModelForCausalLM

    path, _ = model
    prompts = random_prompts(3, LENGTHS, vocab=2048, seed=5)
    got = scored(make_gpu_llm(path, dtype="bfloat16"), prompts)
    refs = [AutoModelForCausalLM.from_pretrained(path, dtype=dt).to("cuda")
            for dt in (torch.float32, torch.bfloat16)]
    for ids, lps in zip(prompts, got, strict=True):
        x = torch.tensor([ids], device="cuda")
        nxt = torch.tensor(ids[1:], device="cuda")
        with torch.no_grad():
            ref32, hf16 = (m(x).logits[0, :-1].float().log_softmax(-1)
                           .gather(1, nxt[:, None]).squeeze(1).cpu() for m in refs)
        ours = torch.tensor(lps)
        assert ours.shape == ref32.shape
        err, hf_err = ((a - ref32).norm() / ref32.norm() for a in (ours, hf16))
        assert err < 1.5 * hf_err + 1e-3, (err, hf_err)


def test_streamed_layers_score_bitwise_as_resident(model):
    path, _ = model
    prompts = random_prompts(3, LENGTHS, vocab=2048, seed=6)
    resident = scored(make_gpu_llm(path, dtype="bfloat16"), prompts)
    llm = make_gpu_llm(path, dtype="bfloat16", enable_offload=True, resident_layers=0,
                       host_kv_budget_gib=1)
    assert llm.engine.kv.plan.streamed_layers == GPU_SHAPE["num_hidden_layers"]
    assert scored(llm, prompts) == resident
