"""GPU: offload on vs off, bitwise; a context larger than the GPU KV budget; teeth."""

from __future__ import annotations

import pytest
import torch
from conftest import GPU_SHAPE, make_hf_model, random_prompts
from helpers import assert_32k_offload_equals_resident, corrupt_host_kv, make_gpu_llm

from nanoserve import SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SHAPE = dict(GPU_SHAPE, num_hidden_layers=6, max_position_embeddings=8192)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu-offload")
    make_hf_model("qwen3", path, **SHAPE)
    return path


llm_for = make_gpu_llm


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("resident", [0, 3])
@pytest.mark.parametrize("batch", [1, 4])
def test_offload_tokens_equal_resident(model_dir, resident, batch, eager):
    prompts = random_prompts(batch, [1500, 37, 800, 260], vocab=2048, seed=batch)
    ref_llm = llm_for(model_dir, enforce_eager=True)
    ref = [o.token_ids for o in ref_llm.generate(prompts, GREEDY)]
    graphs = [o.token_ids for o in llm_for(model_dir).generate(prompts, GREEDY)]
    off = llm_for(model_dir, enable_offload=True, resident_layers=resident, enforce_eager=eager,
                  host_kv_budget_gib=1)
    assert off.engine.kv.plan.streamed_layers == 6 - resident
    assert (off.engine.runner.graphs is None) == eager
    assert [o.token_ids for o in off.generate(prompts, GREEDY)] == ref == graphs
    assert off.engine.kv.num_free == off.engine.kv.capacity


@pytest.mark.parametrize("eager", [True, False])
def test_async_offload_stops_where_synchronous_offload_does(model_dir, eager):
    """Every layer streamed, async scheduling on the GPU's streams: sequences that stop in
    decode steps (each on a token it emits there first) give the synchronous engine's tokens,
    nothing after their stop, and every page comes back."""
    prompts = random_prompts(4, [700, 37, 260, 1500], vocab=2048, seed=11)
    engines = [llm_for(model_dir, enable_offload=True, resident_layers=0, host_kv_budget_gib=1,
                       enforce_eager=eager, async_scheduling=a) for a in (False, True)]
    free = [o.token_ids for o in engines[0].generate(prompts, GREEDY)]
    # prompt i stops on the i-th token its free run emits for the first time in a decode step
    # (its last such token if it has fewer; one it never emits if none: it runs to the end)
    firsts = [[t[k] for k in range(1, 40) if t[k] not in t[:k]] for t in free]
    stops = [new[min(i, len(new) - 1)] if new else next(x for x in range(2048) if x not in t)
             for i, (new, t) in enumerate(zip(firsts, free, strict=True))]
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[x], ignore_eos=True)
              for x in stops]
    sync, got = ([o.token_ids for o in llm.generate(prompts, params)] for llm in engines)
    assert got == sync
    for ids, full, x in zip(got, free, stops, strict=True):
        assert ids == (full[:full.index(x) + 1] if x in full else full)
    kv = engines[1].engine.kv
    assert kv.plan.streamed_layers == 6 and kv.num_free == kv.capacity


@pytest.mark.parametrize("eager", [True, False])
def test_offload_decode_logits_are_bitwise_equal_to_resident(model_dir, eager):
    """Same kernels read the same numbers: the decode step's logits match exactly, eager
    against eager, and per-layer graphs against the whole-model graph."""
    prompts = random_prompts(3, [700, 129, 33], vocab=2048, seed=7)
    logits = []
    for kw in (dict(), dict(enable_offload=True, resident_layers=2, host_kv_budget_gib=1)):
        llm = llm_for(model_dir, enforce_eager=eager, **kw)
        runner = llm.engine.runner
        captured = []
        original = runner.forward

        def recording(inputs, f=original, out=captured):
            logits = f(inputs)
            if not inputs.is_prefill:
                out.append(logits.clone())
            return logits

        runner.forward = recording
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        logits.append(torch.stack(captured))
    assert torch.equal(logits[0], logits[1])


def test_corrupted_streamed_kv_changes_the_tokens(model_dir):
    prompt = random_prompts(1, [1000], vocab=2048, seed=3)[0]
    ref = llm_for(model_dir, enforce_eager=True).generate(prompt, GREEDY)[0].token_ids
    llm = llm_for(model_dir, enable_offload=True, resident_layers=3, enforce_eager=True,
                  host_kv_budget_gib=1)
    engine = llm.engine
    (seq,) = engine.add_request(prompt, GREEDY)
    while seq.num_output_tokens == 0:
        engine.step()
    torch.cuda.synchronize()
    corrupt_host_kv(engine, 2, seq.pages[:seq.num_cached // 16])
    while not seq.is_finished:
        engine.step()
    assert seq.output_token_ids[0] == ref[0]
    assert seq.output_token_ids != ref


def test_32k_context_larger_than_a_1gib_gpu_kv_budget_completes():
    """Qwen3-8B shape, dummy weights: 32K tokens of KV (4.5 GiB) through a 1 GiB GPU budget
    gives the tokens the resident engine gives."""
    assert_32k_offload_equals_resident(1.0)
