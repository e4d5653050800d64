"""The engine computes what Hugging Face transformers computes, on the same weights (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from helpers import engine_prefill_logits, make_llm

from nanoserve import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def llm_of(path, **kw):
    return make_llm(path, **{"page_size": 8, **kw})


def test_prefill_logits_match_transformers(hf_model_dir):
    arch, hf, path = hf_model_dir
    llm = llm_of(path)
    ids = random_prompts(1, [45])[0]
    ours = engine_prefill_logits(llm, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    err = (ours - ref).abs().max().item()
    assert err < 2e-4, f"{arch}: max |logit diff| {err}"


def test_greedy_continuation_matches_transformers_generate(hf_model_dir):
    arch, hf, path = hf_model_dir
    llm = llm_of(path)
    for ids in random_prompts(2, [13, 30], seed=1):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        (out,) = llm.generate(ids, GREEDY)
        assert len(out.token_ids) == 40
        assert out.token_ids == ref, arch


def test_decode_logits_match_prefill_logits(qwen3_dir):
    """Each decode step's KV path (paged cache, pages crossed) equals a full recompute."""
    llm = llm_of(qwen3_dir, page_size=4)
    ids = random_prompts(1, [9])[0]
    (out,) = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    full = engine_prefill_logits(llm, ids + out.token_ids)
    assert full[len(ids) - 1:-1].argmax(-1).tolist() == out.token_ids


@pytest.mark.parametrize("arch", ["qwen3"])
def test_tied_embeddings_share_the_embedding_matrix(arch, tmp_path):
    from conftest import make_hf_model

    hf = make_hf_model(arch, tmp_path, tie_word_embeddings=True)
    llm = llm_of(tmp_path)
    model = llm.engine.runner.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = random_prompts(1, [20])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (engine_prefill_logits(llm, ids) - ref).abs().max().item() < 2e-4
