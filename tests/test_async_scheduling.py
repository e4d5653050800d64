"""Async scheduling: a plain decode step launches before the previous one's tokens are read.
Every output equals the synchronous engine's: stop tokens, stop strings, max_tokens, seeded
sampling, preemption; nothing is emitted after a stop and no page is leaked."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from helpers import make_llm

from nanoserve import SamplingParams
from nanoserve.kv.spec import KVSpec


def outputs(llm, prompts, params):
    return [(o.token_ids, o.finish_reason, o.text) for o in llm.generate(prompts, params)]


def count_launches(llm) -> list[str]:
    """Records, in order, each step the runner launches ahead, each one whose sampling is
    queued after its launch ("sample": a grammar's step) and each one it reads back."""
    runner, calls = llm.engine.runner, []
    launch, sample_launched, collect = runner.launch, runner.sample_launched, runner.collect

    def spy_launch(batch, in_flight, sample=True):
        calls.append("launch")
        step = launch(batch, in_flight, False)
        if sample:  # launch's own sampling: not recorded
            sample_launched(step)
        return step

    def spy_sample(step):
        calls.append("sample")
        return sample_launched(step)

    def spy_collect(step):
        calls.append("collect")
        return collect(step)

    runner.launch, runner.collect = spy_launch, spy_collect
    runner.sample_launched = spy_sample
    return calls


def both(path, **kw):
    return make_llm(path, async_scheduling=False, **kw), make_llm(path, **kw)


# resident KV, and every layer streamed through fewer ring slots than layers (offload/)
KV_MODES = pytest.mark.parametrize("kv", [
    {}, {"enable_offload": True, "resident_layers": 0, "num_kv_buffers": 2,
         "host_kv_budget_gib": 0.01}], ids=["resident", "offload"])


@KV_MODES
def test_async_decode_launches_the_next_step_before_reading_the_last(qwen3_dir, kv):
    sync, async_ = both(qwen3_dir, **kv)
    streamer = async_.engine.kv.streamer
    if kv:  # every layer streams, through fewer slots than layers
        assert streamer is not None and streamer.num_streamed > streamer.num_slots
    calls = count_launches(async_)
    prompts = random_prompts(3, [7, 12, 5], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    assert outputs(async_, prompts, params) == outputs(sync, prompts, params)
    # 19 decode steps: each launched before the previous one is read
    assert calls[:3] == ["launch", "launch", "collect"]
    assert calls.count("launch") == 19 and calls.count("collect") == 19
    assert async_.engine.kv.num_free == async_.engine.kv.capacity


@KV_MODES
def test_stops_end_a_sequence_where_the_synchronous_engine_does(qwen3_dir, kv):
    sync, async_ = both(qwen3_dir, **kv)
    prompts = random_prompts(4, [10, 6, 15, 9], seed=9)
    free = outputs(sync, prompts, SamplingParams(temperature=0.0, max_tokens=30,
                                                 ignore_eos=True))
    # each prompt stops at a different decode step, on a token it emits there first; the last
    # one has a stop token it never emits and runs to max_tokens
    firsts = [[t[k] for k in range(1, 30) if t[k] not in t[:k]] for t, _, _ in free[:3]]
    stops = [new[min(i, len(new) - 1)] for i, new in enumerate(firsts)]
    stops.append(next(x for x in range(320) if x not in free[3][0]))
    params = [SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[x]) for x in stops]
    calls = count_launches(async_)
    got = outputs(async_, prompts, params)
    assert got == outputs(sync, prompts, params)
    for (ids, reason, _), (full, _, _), x in zip(got, free, stops, strict=True):
        end = full.index(x) + 1 if x in full else 30
        assert ids == full[:end]  # nothing after the stop token
        assert reason == ("stop" if x in full else "length")
    assert all(len(ids) > 1 for ids, _, _ in got)  # every stop came in a decode step
    assert calls.count("launch") > 10
    kv = async_.engine.kv
    assert kv.num_free == kv.capacity and not async_.engine.has_unfinished()


def test_stop_strings_and_seeded_sampling_match_the_synchronous_engine():
    sync, async_ = both(None)
    prompt = "the quick brown fox"
    free = sync.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16,
                                                ignore_eos=True))[0].text
    params = [SamplingParams(temperature=0.0, max_tokens=16, stop=[free[6:9]], ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=5,
                             ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=20, max_tokens=12, seed=6, n=2,
                             ignore_eos=True)]
    calls = count_launches(async_)
    for p in params:
        assert outputs(async_, prompt, p) == outputs(sync, prompt, p)
    assert calls.count("launch") > 20


@KV_MODES
def test_preemption_under_async_scheduling_gives_the_same_tokens(qwen3_dir, kv):
    prompts = random_prompts(4, [20, 25, 30, 18], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    page_bytes = KVSpec(3, 4, 2, 16, torch.float32).page_bytes()
    # 41 pages where the pages live: the GPU, or with every layer streamed the host
    budget = 41 * page_bytes / 2**30
    kv = dict(kv, host_kv_budget_gib=budget, gpu_kv_budget_gib=0.01) if kv else \
        {"gpu_kv_budget_gib": budget}
    tight = [make_llm(qwen3_dir, async_scheduling=a, **kv) for a in (False, True)]
    calls = count_launches(tight[1])
    ref, got = (outputs(llm, prompts, params) for llm in tight)
    assert got == ref
    assert tight[1].engine.scheduler.num_preemptions > 0
    assert calls.count("launch") > 10
    assert tight[1].engine.kv.num_free == 40


@KV_MODES
def test_an_abort_while_a_step_is_in_flight_frees_everything(qwen3_dir, kv):
    llm = make_llm(qwen3_dir, **kv)
    engine = llm.engine
    seqs = [s for p in random_prompts(2, [6, 9], seed=2)
            for s in engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=50))]
    for _ in range(4):
        engine.step()
    assert engine._launched is not None  # a decode step is in flight
    engine.abort(seqs[0])
    for _ in range(3):
        engine.step()
    # 7 steps: the prefill token, 5 decode tokens read back, the 6th decode step in flight
    assert seqs[0].finish_reason == "abort" and seqs[1].num_output_tokens == 6
    engine.abort(seqs[1])
    assert not engine.has_unfinished() and engine.kv.num_free == engine.kv.capacity


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3, ignore_eos=True),
])
def test_logprobs_and_penalties_run_synchronously(qwen3_dir, params):
    sync, async_ = both(qwen3_dir)
    calls = count_launches(async_)
    prompt = random_prompts(1, [9], seed=3)[0]
    a, b = async_.generate(prompt, params)[0], sync.generate(prompt, params)[0]
    assert a.token_ids == b.token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs
    assert calls == []  # both read the host's view of the tokens: no step launches ahead


def test_grammar_rows_launch_ahead_and_sample_after_the_previous_step_is_read():
    """A constrained step's forward launches before the step in flight is read; its sampling is
    queued after, from masks of grammars that took the tokens read. Mixed with free rows,
    sampled and greedy, every output equals the synchronous engine's, each constrained one
    valid, and nothing is left behind."""
    import json

    from nanoserve.structured_outputs import StructuredOutputs
    schema = {"type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}}}
    spec = StructuredOutputs(json=schema)
    sync, async_ = both(None)
    prompts = ["a number as JSON:", "hello there", "the grass", "another one:"]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=30, seed=4, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=40, seed=9, n=3,
                             structured_outputs=spec)]
    calls = count_launches(async_)

    def every(llm, prompts, params):
        return [(c.token_ids, c.finish_reason, c.text)
                for o in llm.generate(prompts, params) for c in o.outputs]

    one_by_one = [every(async_, [p], q) for p, q in zip(prompts, params, strict=True)]
    assert one_by_one == [every(sync, [p], q) for p, q in zip(prompts, params, strict=True)]
    batched = every(async_, prompts, params)
    assert batched == [r for rows in one_by_one for r in rows]
    for _, reason, text in [batched[0]] + batched[3:]:
        assert reason == "stop" and 0 <= json.loads(text)["n"] <= 999
    # each constrained step: launched, the step before read, then its sampling queued
    assert "launch" in calls and calls.count("sample") > 5
    for i, c in enumerate(calls):
        if c == "sample":
            assert calls[i - 2:i] == ["launch", "collect"] or calls[i - 1] == "launch"
    assert async_.engine.kv.num_free == async_.engine.kv.capacity
