"""Running streams never stall behind a long prompt: with resident KV their tokens ride along
with its prefill chunks in mixed steps; with streamed layers prefill and decode steps alternate.
Either way every request gets exactly the tokens it gets alone."""

from __future__ import annotations

import pytest
from conftest import make_hf_model, random_prompts
from helpers import make_llm

from nanoserve import SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def four_layer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-4l")
    make_hf_model("qwen3", path, num_hidden_layers=4)
    return path


def engine_of(path, **kw):
    return make_llm(path, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=512,
                    **kw).engine


def run_until_first_token(engine, seq) -> list:
    """Steps until `seq` has its first token; each step's batch as the scheduler made it."""
    batches = []
    schedule = engine.scheduler.schedule

    def spy():
        batch, finished = schedule()
        batches.append(batch)
        return batch, finished

    engine.scheduler.schedule = spy
    try:
        while seq.num_output_tokens == 0:
            engine.step()
    finally:
        engine.scheduler.schedule = schedule
    return batches


def test_a_running_stream_gets_a_token_in_every_step_of_a_long_prefill(qwen3_dir):
    engine = engine_of(qwen3_dir)
    short, long_prompt = random_prompts(2, [5, 200], seed=1)
    [stream] = engine.add_request(short, LONG)
    engine.step()
    assert stream.num_output_tokens == 1
    [newcomer] = engine.add_request(long_prompt, SHORT)
    before = stream.num_output_tokens
    batches = run_until_first_token(engine, newcomer)
    # 200 prompt tokens in 16-token chunks, the stream's decode row riding on top of each
    assert len(batches) == 13
    assert stream.num_output_tokens - before == len(batches)
    for b in batches:
        assert b.is_prefill and b.num_decode == 1 and b.seqs == [stream, newcomer]
    assert [b.num_new_tokens for b in batches] == [[1, 16]] * 12 + [[1, 8]]


def test_mixed_steps_give_each_request_the_tokens_it_gets_alone(qwen3_dir):
    prompts = random_prompts(4, [9, 70, 23, 41], seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (40, 15, 30, 20)]
    alone = [make_llm(qwen3_dir).generate(p, sp)[0].token_ids
             for p, sp in zip(prompts, params, strict=True)]
    engine = engine_of(qwen3_dir)
    schedule, batches = engine.scheduler.schedule, []
    engine.scheduler.schedule = lambda: batches.append(out := schedule()) or out
    seqs = []
    for step in range(500):
        if step % 6 == 0 and len(seqs) < len(prompts):  # arrivals while others decode
            seqs += engine.add_request(prompts[len(seqs)], params[len(seqs)])
        if not engine.has_unfinished():
            break
        engine.step()
    assert [s.output_token_ids for s in seqs] == alone
    mixed = [b for b, _ in batches if b is not None and b.num_decode]
    assert len(mixed) >= 10  # the later prompts' chunks all rode with decode rows
    assert all(b.num_new_tokens[:b.num_decode] == [1] * b.num_decode for b in mixed)
    assert engine.kv.num_free == engine.kv.capacity


def test_with_streamed_layers_a_stream_waits_at_most_one_prefill_step(four_layer_dir):
    short, long_prompt = random_prompts(2, [5, 120], seed=2)
    resident = engine_of(four_layer_dir)
    expected = []
    for engine in (resident, engine_of(four_layer_dir, enable_offload=True, resident_layers=1,
                                       host_kv_budget_gib=0.01)):
        [stream] = engine.add_request(short, LONG)
        engine.step()
        [newcomer] = engine.add_request(long_prompt, SHORT)
        tokens_per_step = []
        while newcomer.num_output_tokens == 0:
            before = stream.num_output_tokens
            engine.step()
            tokens_per_step.append(stream.num_output_tokens - before)
        while engine.has_unfinished():
            engine.step()
        expected.append((stream.output_token_ids, newcomer.output_token_ids))
        if engine is resident:
            assert set(tokens_per_step) == {1}
        else:  # prefill and decode steps alternate: never two steps in a row without a token
            assert engine.scheduler.mixed_steps is False
            t = tokens_per_step
            assert all(a or b for a, b in zip(t, t[1:], strict=False))
            assert tokens_per_step.count(1) >= len(tokens_per_step) // 2
    assert expected[0] == expected[1]
