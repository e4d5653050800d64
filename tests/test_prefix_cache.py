"""Prefix caching on the CPU: reused pages give the tokens of a cache-less engine, full pages
only, least recently used evicted first and never a page in use, one load per shared page."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import random_prompts
from helpers import corrupt_host_kv, make_llm

from nanoserve import SamplingParams
from nanoserve.engine.scheduler import Batch
from nanoserve.engine.step_inputs import StepInputBuilder
from nanoserve.kv.pages import PageAllocator
from nanoserve.kv.prefix_cache import PrefixCache, chain_hashes

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
DOC = random_prompts(1, [40], seed=30)[0]  # 10 full pages of 4 tokens
QUESTIONS = random_prompts(4, [5, 3, 7, 6], seed=31)



def tokens(outs):
    return [o.token_ids for o in outs]


def cacheless(path, **kw):
    """The reference: the same engine with prefix caching off."""
    return make_llm(path, enable_prefix_caching=False, **kw)


def test_a_shared_prefix_is_reused_and_the_tokens_equal_no_cache(qwen3_dir):
    prompts = [DOC + q for q in QUESTIONS]
    ref = tokens(cacheless(qwen3_dir).generate(prompts, GREEDY))
    llm = make_llm(qwen3_dir, enable_prefix_caching=True)
    first = llm.generate(prompts[0], GREEDY)[0]
    assert first.num_cached_tokens == 0 and first.token_ids == ref[0]
    rest = llm.generate(prompts[1:], GREEDY)
    assert tokens(rest) == ref[1:]
    assert [o.num_cached_tokens for o in rest] == [40, 40, 40]  # the document's 10 pages
    kv = llm.engine.kv
    assert kv.num_free == kv.capacity and kv.pages.num_evictable > 0  # cached, not held


def test_at_least_the_last_prompt_token_is_computed(qwen3_dir):
    llm = make_llm(qwen3_dir, enable_prefix_caching=True)
    for n, cached in ((41, 40), (40, 36)):  # a whole-page prompt recomputes its last page
        prompt = DOC[:n] if n <= 40 else DOC + QUESTIONS[0][:1]
        ref = cacheless(qwen3_dir).generate(prompt, GREEDY)[0].token_ids
        llm.generate(prompt, GREEDY)
        again = llm.generate(prompt, GREEDY)[0]
        assert again.num_cached_tokens == cached and again.token_ids == ref


def test_requests_arriving_together_compute_a_shared_prefix_once(qwen3_dir):
    """Four requests on one document in one batch, and n=3 completions of one prompt: the
    first computes the document's pages, the others reuse them."""
    llm = make_llm(qwen3_dir, enable_prefix_caching=True)
    cache = llm.engine.kv.cache
    prompts = [DOC + q for q in QUESTIONS]
    outs = llm.generate(prompts, GREEDY)
    assert tokens(outs) == tokens(cacheless(qwen3_dir).generate(prompts, GREEDY))
    assert [o.num_cached_tokens for o in outs] == [0, 40, 40, 40]
    hits = cache.hit_tokens
    # 50 tokens: 12 full pages, of which DOC + QUESTIONS[2] cached 11 above
    prompt = DOC + QUESTIONS[2] + [9, 9, 9]
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6))[0]
    assert len(out.outputs) == 3 and out.num_cached_tokens == 44
    assert cache.hit_tokens - hits == 44 + 2 * 48  # the siblings reuse all 12 of its pages


def test_unused_cached_pages_are_evicted_least_recently_used_first():
    cache = PrefixCache()
    alloc = PageAllocator(7, cache=cache)  # 6 usable pages
    keys = chain_hashes(list(range(24)), 4)  # 6 pages' keys
    a, b = alloc.allocate(2), alloc.allocate(2)
    for key, page in zip(keys[:4], a + b, strict=True):
        cache.add(key, page)
    held = alloc.allocate(2)  # in use throughout
    alloc.free(a)  # a: unused first (oldest), then b
    alloc.free(b)
    assert alloc.num_free == 4 and alloc.num_evictable == 4
    assert cache.lookup(keys[:4]) == a + b
    got = alloc.allocate(3)
    assert got == a + b[:1]  # least recently used first
    assert cache.lookup(keys[:4]) == []  # the chain breaks at a's first page
    assert b[1] in cache and all(alloc.refs(p) == 1 for p in held)
    alloc.share([b[1]])  # reused: in use again, no longer evictable
    assert alloc.num_evictable == 0 and alloc.num_free == 0
    with pytest.raises(RuntimeError):
        alloc.allocate(1)  # pages in use are never evicted


def test_eviction_under_a_tight_budget_keeps_the_tokens_right(qwen3_dir):
    """20 pages for prompts of ~12 pages each, three documents: the cache fills, evicts and
    reuses; every answer equals the cache-less engine's."""
    docs = random_prompts(3, [40], seed=32)
    order = [0, 0, 1, 1, 2, 2, 0, 1, 2, 2]  # reused at once, or after two other documents
    prompts = [docs[d] + QUESTIONS[i % 4] for i, d in enumerate(order)]
    ref = tokens(cacheless(qwen3_dir).generate(prompts, GREEDY))
    page_bytes = 2 * 3 * 4 * 2 * 16 * 4
    llm = make_llm(qwen3_dir, enable_prefix_caching=True, max_num_seqs=1,
                   gpu_kv_budget_gib=21 * page_bytes / 2**30)
    assert llm.engine.kv.capacity == 20
    outs = [llm.generate(p, GREEDY)[0] for p in prompts]
    assert tokens(outs) == ref
    assert any(o.num_cached_tokens for o in outs) and not all(o.num_cached_tokens for o in outs)


def test_preempted_sequences_reuse_their_own_cached_pages(qwen3_dir):
    prompts = [DOC + q for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = tokens(cacheless(qwen3_dir).generate(prompts, params))
    page_bytes = 2 * 3 * 4 * 2 * 16 * 4
    llm = make_llm(qwen3_dir, enable_prefix_caching=True,
                   gpu_kv_budget_gib=41 * page_bytes / 2**30)
    assert tokens(llm.generate(prompts, params)) == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.num_free == llm.engine.kv.capacity


def test_offloaded_prefix_is_reused_from_the_host_store(six_layer_dir):
    prompts = [DOC + q for q in QUESTIONS]
    ref = tokens(cacheless(six_layer_dir).generate(prompts, GREEDY))
    llm = make_llm(six_layer_dir, enable_prefix_caching=True, enable_offload=True,
                   resident_layers=2, host_kv_budget_gib=0.01)
    assert llm.engine.kv.plan.streamed_layers == 4
    outs = llm.generate(prompts, GREEDY)
    assert tokens(outs) == ref and [o.num_cached_tokens for o in outs] == [0, 40, 40, 40]
    assert llm.engine.kv.tail_rows_in_use == 0


def test_corrupting_a_shared_page_changes_every_sharers_output(qwen3_dir):
    """Teeth: the document's cached KV is what every sharer's attention reads."""
    prompts = [DOC + q for q in QUESTIONS[:3]]
    llm = make_llm(qwen3_dir, enable_prefix_caching=True)
    ref = tokens(llm.generate(prompts, GREEDY))
    pages = llm.engine.kv.cache.lookup(chain_hashes(DOC, 4))
    assert len(pages) == 10
    pool = llm.engine.kv.resident
    pool[:, :, pages[:3]] = torch.randn_like(pool[:, :, pages[:3]])
    outs = llm.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens >= 40 for o in outs)
    assert all(o.token_ids != r for o, r in zip(outs, ref, strict=True))


def test_ten_thousand_mixed_requests_leak_no_page_on_either_tier(qwen3_dir):
    """Shared documents, unique prompts, n > 1, stop tokens and lengths, with offload, a tight
    budget (preemption and eviction): afterwards every page is free or cached-and-unused, no
    tail row is held, and a sample of answers equals the cache-less engine's."""
    g = torch.Generator().manual_seed(33)
    docs = random_prompts(6, [12, 20, 28, 9, 40, 16], seed=34)
    prompts, params = [], []
    for i in range(10_000):
        tail = torch.randint(0, 320, (int(torch.randint(1, 9, (1,), generator=g)),),
                             generator=g).tolist()
        prompts.append((docs[i % 6] if i % 5 else []) + tail)
        params.append(SamplingParams(temperature=0.0, n=1 + (i % 7 == 0),
                                     max_tokens=1 + i % 4, stop_token_ids=[i % 320]))
    page_bytes = 2 * 3 * 4 * 2 * 16 * 4
    llm = make_llm(qwen3_dir, enable_prefix_caching=True, enable_offload=True,
                   resident_layers=1, max_num_seqs=32, host_kv_budget_gib=0.01,
                   gpu_kv_budget_gib=80 * page_bytes / 2**30)
    outs = llm.generate(prompts, params)
    kv = llm.engine.kv
    assert all(o.error is None for o in outs) and kv.tail_rows_in_use == 0
    assert kv.num_free == kv.capacity and kv.pages.num_evictable == len(kv.cache)
    assert all(kv.pages.refs(p) == 0 for p in range(1, kv.pages.num_pages))
    assert llm.engine.scheduler.num_preemptions > 0 and kv.cache.hit_tokens > 10_000
    sample = list(range(0, 10_000, 97))
    ref = cacheless(qwen3_dir).generate([prompts[i] for i in sample],
                                       [params[i] for i in sample])
    assert [[c.token_ids for c in outs[i].outputs] for i in sample] == \
        [[c.token_ids for c in r.outputs] for r in ref]


def test_a_page_shared_by_a_decode_batch_is_loaded_once():
    """Step inputs with offload: the load list is the set of pages, not every sequence's."""
    builder = StepInputBuilder(4, torch.device("cpu"), tail_row=lambda s: s.seq_id)
    shared = [1, 2, 3, 4, 5]
    seqs = [SimpleNamespace(seq_id=i, token_ids=list(range(23)), pages=shared + [6 + i])
            for i in range(3)]
    for s in seqs:
        s.num_tokens, s.num_pending = len(s.token_ids), 0
    plan = builder.build(Batch(False, seqs, [1, 1, 1])).offload
    assert plan.load_runs == [(1, 6)]  # pages 1..5 once, not three times


def test_eviction_takes_a_cached_prefix_from_its_end_so_the_rest_stays_reusable(qwen3_dir):
    """20 pages: a document's request, then an unrelated one that needs some of its pages.
    Its last pages go first, so the document's first pages are still found."""
    page_bytes = 2 * 3 * 4 * 2 * 16 * 4
    llm = make_llm(qwen3_dir, enable_prefix_caching=True, max_num_seqs=1,
                   gpu_kv_budget_gib=21 * page_bytes / 2**30)
    llm.generate(DOC + [1, 2, 3], GREEDY)
    llm.generate(random_prompts(1, [44], seed=35)[0], GREEDY)
    again = llm.generate(DOC + [1, 2, 3], GREEDY)[0]
    assert 0 < again.num_cached_tokens < 40
    assert again.token_ids == cacheless(qwen3_dir).generate(DOC + [1, 2, 3], GREEDY)[0].token_ids


def test_corrupting_a_shared_page_in_the_host_store_changes_every_sharer(six_layer_dir):
    """Teeth with offload: streamed layers' shared pages are read back from the host store."""
    prompts = [DOC + q for q in QUESTIONS[:3]]
    ref = tokens(cacheless(six_layer_dir).generate(prompts, GREEDY))
    llm = make_llm(six_layer_dir, enable_prefix_caching=True, enable_offload=True,
                   resident_layers=2, host_kv_budget_gib=0.01)
    assert llm.generate(prompts[0], GREEDY)[0].token_ids == ref[0]
    pages = llm.engine.kv.cache.lookup(chain_hashes(DOC, 4))
    for layer in range(4):
        corrupt_host_kv(llm.engine, layer, pages[:3])
    outs = llm.generate(prompts[1:], GREEDY)
    assert all(o.num_cached_tokens >= 40 for o in outs)
    assert all(o.token_ids != r for o, r in zip(outs, ref[1:], strict=True))
