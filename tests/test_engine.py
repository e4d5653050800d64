"""Scheduler and engine behaviour on the CPU: batching, chunking, preemption, pages, bad input."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import random_prompts
from helpers import make_llm

from nanoserve import LLM, SamplingParams
from nanoserve.kv.pages import OutOfPages, PageAllocator
from nanoserve.kv.spec import KVSpec

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def tokens(outputs):
    return [o.token_ids for o in outputs]


def test_batch_of_mixed_lengths_equals_each_prompt_alone(qwen3_dir):
    llm = make_llm(qwen3_dir)
    prompts = random_prompts(5, [3, 17, 40, 8, 29], seed=2)
    together = tokens(llm.generate(prompts, GREEDY))
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in prompts]
    assert together == alone
    assert all(len(t) == 24 for t in together)


def test_chunked_prefill_equals_unchunked(qwen3_dir):
    prompts = random_prompts(3, [50, 23, 37], seed=3)
    whole = tokens(make_llm(qwen3_dir, max_num_batched_tokens=4096).generate(prompts, GREEDY))
    # 7-token chunks: chunks end mid-page, and several prompts share one step
    chunked_llm = make_llm(qwen3_dir, max_num_batched_tokens=7)
    chunked = tokens(chunked_llm.generate(prompts, GREEDY))
    assert chunked == whole


def test_no_page_leaks_after_all_requests_finish(qwen3_dir):
    llm = make_llm(qwen3_dir)
    alloc = llm.engine.kv
    free_before = alloc.num_free
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 9, 30)]
    llm.generate(random_prompts(3, [5, 12, 33]), params)
    assert alloc.num_free == free_before == alloc.capacity
    assert not llm.engine.sequences


def test_the_warm_up_prompts_run_and_leave_nothing_behind(qwen3_dir):
    """The start-up warm-up (run on CUDA engines) runs one prompt step per warm-up length (one
    token first, a chunk that samples nothing), capped by the chunk budget, then one that fills
    the step, returns every page, and changes no later request's tokens."""
    prompts = random_prompts(2, [13, 30], seed=5)
    cold = make_llm(qwen3_dir, max_num_batched_tokens=256)
    expected = tokens(cold.generate(prompts, GREEDY))
    llm = make_llm(qwen3_dir, max_num_batched_tokens=256)
    runner = llm.engine.runner
    steps = []
    run = runner.run
    outs = []
    runner.run = lambda batch: steps.append(batch.num_new_tokens) or \
        outs.append(run(batch)) or outs[-1]
    runner.warm_up_prompts()
    assert steps == [[1], [90], [131], [160], [256]]  # the last fills the step
    # the one-token step is a chunk of a longer prompt (no row sampled); the others sample
    assert outs[0] == [None] and all(o[0] is not None for o in outs[1:])
    assert llm.engine.kv.num_free == llm.engine.kv.capacity
    assert tokens(llm.generate(prompts, GREEDY)) == expected


def test_the_warm_up_lengths_cap_at_the_step_and_end_with_a_full_one():
    from nanoserve.engine.model_runner import warm_up_lengths

    assert warm_up_lengths(8192) == [1, 90, 131, 160, 8192]
    assert warm_up_lengths(128) == [1, 90, 128, 128]  # 131 and 160 capped: a full step already
    assert warm_up_lengths(160) == [1, 90, 131, 160]
    assert warm_up_lengths(50) == [1, 50, 50, 50]


def test_preemption_and_recompute_give_the_same_tokens(qwen3_dir):
    prompts = random_prompts(4, [20, 25, 30, 18], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = tokens(make_llm(qwen3_dir).generate(prompts, params))
    # 4-token pages: 4 sequences of ~65 tokens need ~68 pages; give them 40
    page_bytes = KVSpec(3, 4, 2, 16, torch.float32).page_bytes()
    tight = make_llm(qwen3_dir, gpu_kv_budget_gib=41 * page_bytes / 2**30)
    assert tight.engine.kv.capacity == 40
    out = tokens(tight.generate(prompts, params))
    assert tight.engine.scheduler.num_preemptions > 0
    assert out == roomy
    assert tight.engine.kv.num_free == 40


def test_seeded_sampling_is_reproducible_and_seed_dependent(qwen3_dir):
    llm = make_llm(qwen3_dir)
    prompt = random_prompts(1, [10])[0]

    def run(seed):
        p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=seed, max_tokens=30,
                           ignore_eos=True)
        return llm.generate(prompt, p)[0].token_ids

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_top_k_one_is_greedy(qwen3_dir):
    llm = make_llm(qwen3_dir)
    prompt = random_prompts(1, [10])[0]
    k1 = SamplingParams(temperature=0.8, top_k=1, max_tokens=16, ignore_eos=True, seed=3)
    g = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert llm.generate(prompt, k1)[0].token_ids == llm.generate(prompt, g)[0].token_ids


def test_stop_token_and_max_tokens(qwen3_dir):
    llm = make_llm(qwen3_dir)
    prompt = random_prompts(1, [10])[0]
    free = llm.generate(prompt, GREEDY)[0].token_ids
    stop_at = free[5]
    first = free.index(stop_at)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                              stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free[:first + 1]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_stop_string_truncates_text():
    llm = LLM(None, progress=False, device="cpu", dtype="float32", page_size=4)
    prompt = "the quick brown fox"
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                               ignore_eos=True))[0].text
    stop = free[3:5]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, stop=[stop],
                                              ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == free[:free.index(stop)]


def test_stop_strings_cost_a_window_per_step_not_the_whole_output():
    """A stop string that never matches, over 300 tokens: each step decodes a bounded window
    (4 x the longest stop string + 8 tokens), and the cut equals the full-text rule when one
    matches late."""
    llm = make_llm(None, page_size=16)
    sched = llm.engine.scheduler
    real, longest = sched.detokenize, []

    def counting(ids):
        longest.append(len(ids))
        return real(ids)

    sched.detokenize = counting
    prompt = "the quick brown fox"
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=300,
                                               ignore_eos=True))[0].text
    longest.clear()
    stops = ["\u2603 never", "zz"]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=300, stop=stops,
                                              ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.text == free
    assert len(longest) == 300 and max(longest) == 4 * len(stops[0]) + 8
    late = free[250:253]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=300,
                                              stop=["\u2603 never", late], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.text == free[:free.index(late)]


def test_max_model_len_ends_generation(qwen3_dir):
    llm = make_llm(qwen3_dir, max_model_len=32)
    out = llm.generate(random_prompts(1, [28])[0], GREEDY)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
])
def test_bad_sampling_parameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_requests_get_errors_and_others_keep_running(qwen3_dir):
    llm = make_llm(qwen3_dir, max_model_len=64)
    good = random_prompts(2, [10, 12], seed=5)
    prompts = [good[0], [], list(range(64)), [1, 2, 99999], good[1]]
    outs = llm.generate(prompts, GREEDY)
    assert outs[1].error == "empty prompt"
    assert "max_model_len" in outs[2].error
    assert "token ids" in outs[3].error
    assert [o.error for o in (outs[0], outs[4])] == [None, None]
    assert tokens([outs[0], outs[4]]) == tokens(llm.generate(good, GREEDY))


def test_prompt_larger_than_the_kv_budget_is_refused(qwen3_dir, caplog):
    page_bytes = KVSpec(3, 4, 2, 16, torch.float32).page_bytes()
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        llm = make_llm(qwen3_dir, gpu_kv_budget_gib=9 * page_bytes / 2**30,  # 8 usable pages
                       max_model_len=64)
    # said at start: 8 pages of 4 tokens hold 31 tokens of a prompt and its next token
    assert ("the KV cache holds 31 tokens, fewer than max_model_len (64): the GPU KV budget"
            in caplog.text)
    outs = llm.generate(random_prompts(2, [40, 10]), GREEDY)
    assert "GPU KV budget" in outs[0].error and "holds 8" in outs[0].error
    # the other request runs until its context fills all 32 slots, then ends with "length"
    assert outs[1].error is None and outs[1].finish_reason == "length"
    assert len(outs[1].token_ids) == 32 - 10 + 1


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope" / "model.bin"), progress=False, device="cpu")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(tmp_path), progress=False, device="cpu")


def test_checkpoint_missing_a_tensor_is_refused(tmp_path):
    from conftest import make_hf_model
    from safetensors.torch import load_file, save_file

    make_hf_model("qwen3", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="lacks 1 tensors"):
        LLM(str(tmp_path), progress=False, device="cpu")


def test_page_allocator_never_hands_out_a_page_twice():
    alloc = PageAllocator(10)
    a = alloc.allocate(4)
    b = alloc.allocate(5)
    assert 0 not in a + b and len(set(a + b)) == 9
    with pytest.raises(OutOfPages):
        alloc.allocate(1)
    alloc.free(a)
    assert sorted(alloc.allocate(4)) == sorted(a)


def test_shipped_configs_build_with_dummy_weights():
    from nanoserve.models.config import ModelConfig
    from nanoserve.models.loader import resolve_model_dir

    expected = {"Qwen/Qwen3-8B": (36, 8, 128), "Qwen/Qwen3-4B": (36, 8, 128),
                "meta-llama/Llama-3.1-8B": (32, 8, 128), "Qwen/Qwen2.5-7B": (28, 4, 128)}
    for name, (layers, kv_heads, head_dim) in expected.items():
        cfg = ModelConfig.from_dir(resolve_model_dir(name, dummy_weights=True))
        assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (layers, kv_heads, head_dim)
    assert ModelConfig.from_dir(resolve_model_dir("Qwen/Qwen3-4B", True)).tie_word_embeddings


def test_uploaded_step_arrays_start_on_16_byte_boundaries():
    """Triton specializes kernels on 16-byte aligned pointers (a graph's own buffers are):
    every uploaded array must start on one, whatever the sizes before it, with its values."""
    import numpy as np

    from nanoserve.engine.step_inputs import upload

    arrays = {"a": np.arange(3, dtype=np.int32), "b": np.arange(5, dtype=np.int64),
              "c": np.arange(7, dtype=np.int32).reshape(7, 1), "d": np.zeros(0, np.int32),
              "e": np.arange(1, dtype=np.int32)}
    out = upload(arrays, torch.device("cpu"), pin=False)
    base = out["a"].data_ptr()
    for name, a in arrays.items():
        assert (out[name].data_ptr() - base) % 16 == 0, name
        assert out[name].shape == a.shape and out[name].tolist() == a.tolist(), name
