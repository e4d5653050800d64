"""KV written instead of computed (kv/synthetic.py, the bench's --synthetic-prefill): a
prompt's pages given another engine's computed KV, in both tiers (resident and streamed
layers), decode exactly as that engine did; random KV there changes the tokens, so decode read
what was written; only the rest of the prompt is prefilled."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from helpers import make_llm

from nanoserve import SamplingParams
from nanoserve.kv.synthetic import claim_prompt_pages, fill_random, tier_rows

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def engine(path, kv_cache_dtype):
    return make_llm(path, enable_offload=True, resident_layers=2, host_kv_budget_gib=0.01,
                    kv_cache_dtype=kv_cache_dtype).engine


def finish(eng, seq) -> list[int]:
    while eng.has_unfinished():
        eng.step()
    return seq.output_token_ids


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_written_prompt_kv_decodes_like_computed(six_layer_dir, kv_cache_dtype):
    prompt = random_prompts(1, [4 * 10 + 3], seed=5)[0]  # 10 full pages and 3 tokens
    a = engine(six_layer_dir, kv_cache_dtype)
    assert 0 < a.kv.plan.resident_layers < a.kv.spec.num_layers  # both tiers
    seq_a = a.add_request(prompt, GREEDY)[0]
    while seq_a.num_output_tokens == 0:
        a.step()
    pages_a = seq_a.pages[:10]
    computed = [tier_rows(a.kv, layer)[:, pages_a].clone() for layer in range(6)]
    want = finish(a, seq_a)

    b = engine(six_layer_dir, kv_cache_dtype)
    seq_b = b.add_request(prompt, GREEDY)[0]
    pages_b = claim_prompt_pages(b.kv, seq_b)
    assert len(pages_b) == 10 and seq_b.num_cached == 40
    for layer in range(6):
        tier_rows(b.kv, layer)[:, pages_b] = computed[layer]
    assert finish(b, seq_b) == want
    assert seq_b.num_cached_tokens == 40  # the prefill computed the last 3 tokens only

    c = engine(six_layer_dir, kv_cache_dtype)
    seq_c = c.add_request(prompt, GREEDY)[0]
    assert fill_random(c.kv, seq_c, seed=1) == 40
    k, v, k_scale, _ = c.kv.spec.views(tier_rows(c.kv, 5))  # a streamed layer
    pages_c = seq_c.pages[:10]
    assert torch.isfinite(k[pages_c].float()).all() and k[pages_c].float().std() > 0.1
    if k_scale is not None:
        assert (k_scale[pages_c] > 0).all()
    assert finish(c, seq_c) != want
    # the random pages never entered the prefix cache: the same prompt again computes its KV
    # and decodes as the first engine did
    again = c.add_request(prompt, GREEDY)[0]
    assert finish(c, again) == want and again.num_cached_tokens == 0


def test_only_a_fresh_sequence_is_given_pages(six_layer_dir):
    eng = engine(six_layer_dir, "auto")
    short = eng.add_request([1, 2, 3, 4], GREEDY)[0]  # less than a page and a token
    assert claim_prompt_pages(eng.kv, short) == [] and short.num_cached == 0
    seq = eng.add_request(random_prompts(1, [30])[0], GREEDY)[0]
    claim_prompt_pages(eng.kv, seq)
    with pytest.raises(ValueError, match="holds no pages"):
        claim_prompt_pages(eng.kv, seq)
    scored = eng.add_request(random_prompts(1, [30])[0],
                             SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    with pytest.raises(ValueError, match="computed whole"):
        claim_prompt_pages(eng.kv, scored)
