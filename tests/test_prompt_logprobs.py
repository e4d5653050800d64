"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob given the tokens
before it, computed in the engine's own prefill, equal transformers' log_softmax on the same
weights, however the prompt is prefilled (chunks, a prefix-cache hit, streamed layers,
preemption, beside other requests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import random_prompts
from helpers import make_llm

import nanoserve
from nanoserve import SamplingParams
from nanoserve.errors import InvalidParameter
from nanoserve.kv.spec import KVSpec

EMBEDDED = Path(nanoserve.__file__).parent / "assets" / "tiny-qwen3"
SCORE = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf_embedded():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(EMBEDDED), dtype=torch.float32).eval()


def reference(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax over every position: row p predicts token p + 1."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def assert_matches(out, ids: list[int], ref: torch.Tensor, k: int = 3) -> None:
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(ids) and lps[0] is None
    for p in range(1, len(ids)):
        entry = lps[p]
        assert entry.token_id == ids[p]
        assert abs(entry.logprob - ref[p - 1, ids[p]].item()) < TOLERANCE, p
        top_vals, top_ids = ref[p - 1].topk(k) if k else (torch.empty(0), torch.empty(0))
        assert len(entry.top) == k
        assert [v for _, v in entry.top] == pytest.approx(top_vals.tolist(), abs=TOLERANCE)
        assert [i for i, _ in entry.top] == top_ids.tolist()


@pytest.mark.parametrize("k", [0, 1, 3])  # 1: a max over the vocabulary, 3: a top-k
def test_prompt_logprobs_equal_transformers_log_softmax(hf_embedded, k):
    llm = make_llm(None)
    ids = random_prompts(1, [45], vocab=llm.engine.model_config.vocab_size, seed=3)[0]
    (out,) = llm.generate(ids, SCORE.replace(prompt_logprobs=k))
    assert_matches(out, ids, reference(hf_embedded, ids), k=k)


def test_chunked_prefill_scores_every_chunk(hf_embedded):
    llm = make_llm(None, max_num_batched_tokens=7)  # 45 tokens: 7 chunks, ends mid-chunk
    ids = random_prompts(1, [45], vocab=llm.engine.model_config.vocab_size, seed=4)[0]
    (out,) = llm.generate(ids, SCORE)
    assert_matches(out, ids, reference(hf_embedded, ids))


def test_a_cached_prefix_is_recomputed_for_scoring_and_its_pages_serve_others(hf_embedded):
    llm = make_llm(None, enable_prefix_caching=True)
    vocab = llm.engine.model_config.vocab_size
    ids = random_prompts(1, [40], vocab=vocab, seed=5)[0]
    llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=1))  # caches its pages
    (scored,) = llm.generate(ids, SCORE)
    assert scored.num_cached_tokens == 0  # recomputed: the cache keeps no hidden states
    assert_matches(scored, ids, reference(hf_embedded, ids))
    (plain,) = llm.generate(ids + [1, 2], SamplingParams(temperature=0.0, max_tokens=1))
    assert plain.num_cached_tokens == 40  # 10 full 4-token pages, from the cache


def test_streamed_layers_score_as_resident_ones(hf_embedded):
    llm = make_llm(None, enable_offload=True, resident_layers=1, host_kv_budget_gib=0.01,
                   max_num_batched_tokens=16)
    assert llm.engine.kv.plan.streamed_layers > 0
    ids = random_prompts(1, [37], vocab=llm.engine.model_config.vocab_size, seed=6)[0]
    (out,) = llm.generate(ids, SCORE)
    assert_matches(out, ids, reference(hf_embedded, ids))


def test_scoring_beside_other_requests_and_after_preemption(hf_embedded):
    """Tiny KV: long outputs preempt the scored request (the newest), which is recomputed; its
    prompt is scored once, and the other requests' tokens are those they get alone."""
    page_bytes = KVSpec(4, 4, 4, 32, torch.float32).page_bytes()  # the embedded model's
    llm = make_llm(None, gpu_kv_budget_gib=20 * page_bytes / 2**30, max_num_batched_tokens=8)
    vocab = llm.engine.model_config.vocab_size
    prompts = random_prompts(3, [9, 14, 21], vocab=vocab, seed=7)
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    alone = [llm.generate(p, long)[0].token_ids for p in prompts[:2]]
    preempted = []
    preempt = llm.engine.scheduler._preempt
    llm.engine.scheduler._preempt = lambda seq: (preempted.append(seq.params), preempt(seq))
    outs = llm.generate(prompts, [long, long, long.replace(prompt_logprobs=2)])
    assert any(p.prompt_logprobs == 2 for p in preempted)
    assert [o.token_ids for o in outs[:2]] == alone
    assert_matches(outs[2], prompts[2], reference(hf_embedded, prompts[2]), k=2)
    assert outs[0].prompt_logprobs is None


def test_a_one_token_prompt_has_only_the_null_entry():
    llm = make_llm(None)
    (out,) = llm.generate([7], SCORE)
    assert out.prompt_logprobs == [None]


def test_prompt_logprobs_is_validated():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(InvalidParameter) as e:
            SamplingParams(prompt_logprobs=bad)
        assert e.value.param == "prompt_logprobs"


def test_n_completions_score_the_prompt_once():
    """Completion 0 scores it for the request; the others take their prefix as usual."""
    llm = make_llm(None)
    ids = random_prompts(1, [20], vocab=llm.engine.model_config.vocab_size, seed=8)[0]
    params = SCORE.replace(n=3, temperature=1.0, seed=1)
    seqs = llm.engine.add_request(ids, params)
    try:
        assert [s.prompt_logprobs is not None for s in seqs] == [True, False, False]
        assert [s.index for s in seqs] == [0, 1, 2]
    finally:
        for s in seqs:
            llm.engine.abort(s)
    (out,) = llm.generate(ids, params)
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == 20
    (alone,) = llm.generate(ids, SCORE)
    assert out.prompt_logprobs == alone.prompt_logprobs


def test_scores_stay_on_the_device_until_a_step_reads_its_tokens(hf_embedded):
    """Chunks before the prompt's last leave their scores unread (no synchronization); the last
    chunk's step reads them all, in order, before the first token is appended."""
    llm = make_llm(None, max_num_batched_tokens=16)
    ids = random_prompts(1, [45], vocab=llm.engine.model_config.vocab_size, seed=9)[0]
    (seq,) = llm.engine.add_request(ids, SCORE)
    llm.engine.step()
    llm.engine.step()
    assert seq.prompt_logprobs == [None] and [len(u) for u in seq.unread_scores] == [16, 16]
    assert seq.num_prompt_scored == 33 and seq.num_output_tokens == 0
    while seq.num_output_tokens == 0:
        llm.engine.step()
    assert seq.unread_scores == [] and len(seq.prompt_logprobs) == 45
    out = type("Out", (), {"prompt_logprobs": seq.prompt_logprobs})
    assert_matches(out, ids, reference(hf_embedded, ids))
    while llm.engine.has_unfinished():
        llm.engine.step()
