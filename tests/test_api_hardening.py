"""The Python API under bad input: every bad SamplingParams is refused when built, every bad
prompt is refused alone, a failed step fails only its own requests, and the LLM stays usable."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import random_prompts
from helpers import make_llm

from nanoserve import LLM, InvalidParameter, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

BAD_PARAMS = [  # (keyword arguments, the parameter the error names)
    (dict(stop=[1]), "stop"), (dict(stop=[b"x"]), "stop"), (dict(stop=["ok", 3.5]), "stop"),
    (dict(stop=b"x"), "stop"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids"), (dict(stop_token_ids="12"), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(temperature=math.nan), "temperature"), (dict(temperature=-1.0), "temperature"),
    (dict(temperature=2.5), "temperature"), (dict(temperature=math.inf), "temperature"),
    (dict(temperature="1"), "temperature"), (dict(temperature=True), "temperature"),
    (dict(temperature=10**400), "temperature"), (dict(logit_bias={3: -10**400}), "logit_bias"),
    (dict(top_p=0), "top_p"), (dict(top_p=1e-400), "top_p"), (dict(top_p=math.nan), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(top_k=2.0), "top_k"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.01), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=math.nan), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"), (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias=[(5, 1.0)]), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=True), "logprobs"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=1.0), "max_tokens"),
    (dict(max_tokens=None), "max_tokens"),
    (dict(seed=1.5), "seed"), (dict(seed="42"), "seed"), (dict(seed=True), "seed"),
    (dict(seed=99999999999999999999999), "seed"), (dict(n=0), "n"), (dict(n=1.0), "n"),
    (dict(ignore_eos="no"), "ignore_eos"),
]


@pytest.mark.parametrize("kwargs,param", BAD_PARAMS, ids=[str(k) for k, _ in BAD_PARAMS])
def test_bad_sampling_params_are_refused_when_built_naming_the_field(kwargs, param):
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
    assert len(str(e.value)) < 200  # a short quote of the bad value, never the whole of it


def test_sampling_params_are_immutable_and_replace_revalidates():
    p = SamplingParams(stop="x", stop_token_ids=None, logit_bias={3: 1.0})
    assert p.stop == ("x",) and p.stop_token_ids == ()
    for field, value in (("temperature", math.nan), ("top_p", 0.0), ("temperature", -1.0)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(p, field, value)
    with pytest.raises(TypeError):
        p.logit_bias[4] = 2.0  # a read-only view: not changeable behind validation's back
    with pytest.raises(InvalidParameter):
        p.replace(temperature=-1.0)
    assert p.replace(max_tokens=3).max_tokens == 3


def test_a_huge_seed_within_64_bits_runs(qwen3_dir):
    llm = make_llm(qwen3_dir)
    for seed in (2**64 - 1, -(2**63)):
        out = llm.generate([1, 2, 3], SamplingParams(seed=seed, max_tokens=3))[0]
        assert out.error is None and len(out.token_ids) == 3


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return make_llm(qwen3_dir)


def idle(llm) -> bool:
    eng = llm.engine
    return (not eng.has_unfinished() and not eng.sequences and
            eng.kv.num_free == eng.kv.capacity)


BAD_PROMPTS = [[1.0, 2.0], None, {"a": 1}, 7, b"hello", [1, True], [1, -3], [1, 10**6], "",
               [], ["x"], "\ud800 lone surrogate"]


def test_bad_prompts_in_a_batch_fail_alone_and_good_ones_equal_their_run_alone(llm):
    good = random_prompts(3, [6, 13, 9], seed=11)
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in good]
    prompts = [good[0], *BAD_PROMPTS[:6], good[1], *BAD_PROMPTS[6:], good[2]]
    outs = llm.generate(prompts, GREEDY)
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        if prompt in good:
            assert out.error is None and out.token_ids == alone[good.index(prompt)]
        else:
            assert out.error and out.outputs == [] and out.finish_reason == "error", prompt
    assert idle(llm)


def test_bad_sampling_params_objects_in_a_batch_fail_alone(llm):
    good = random_prompts(2, [5, 8], seed=12)
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in good]
    outs = llm.generate([good[0], good[1], good[0], good[1]],
                        [GREEDY, {"temperature": 0}, None, GREEDY])
    assert outs[0].token_ids == alone[0] and outs[3].token_ids == alone[1]
    assert "expected SamplingParams" in outs[1].error and outs[2].error
    vocab = llm.engine.model_config.vocab_size
    outs = llm.generate(good, [SamplingParams(logit_bias={vocab: 1.0}),
                               SamplingParams(stop_token_ids=[vocab + 5])])
    assert "logit_bias" in outs[0].error and "stop_token_ids" in outs[1].error
    assert idle(llm)


@pytest.mark.parametrize("prompts", [b"hello", {"a": 1}, 7, None])
def test_a_call_of_the_wrong_shape_raises_and_queues_nothing(llm, prompts):
    with pytest.raises(ValueError):
        llm.generate(prompts, GREEDY)
    assert idle(llm)
    assert llm.generate([1, 2, 3], GREEDY)[0].error is None


def test_a_params_list_of_the_wrong_length_raises_and_queues_nothing(llm):
    with pytest.raises(ValueError, match="one SamplingParams per prompt"):
        llm.generate([[1, 2], [3, 4]], [GREEDY])
    assert idle(llm)


def test_an_interrupted_generate_leaves_nothing_queued(llm):
    eng = llm.engine
    real_step = eng.step
    calls = []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    eng.step = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(random_prompts(3, [5, 9, 7], seed=13), GREEDY)
    finally:
        eng.step = real_step
    assert idle(llm)
    ref = llm.generate([4, 5, 6], GREEDY)[0]
    assert ref.error is None and len(ref.token_ids) == 10


def test_a_failing_step_fails_only_the_request_it_belongs_to(llm):
    """The runner fails every step that holds the poisoned request: that request ends with an
    error and its pages freed; the others, batched with it, equal their runs alone."""
    poison = [7, 7, 7, 7, 7, 7, 7]
    good = random_prompts(3, [6, 11, 15], seed=14)
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in good]
    runner = llm.engine.runner
    real_run = runner.run

    def run(batch):
        if any(s.token_ids[:len(poison)] == poison for s in batch.seqs):
            raise RuntimeError("boom in a kernel")
        return real_run(batch)

    runner.run = run
    try:
        outs = llm.generate([good[0], poison, good[1], good[2]], GREEDY)
    finally:
        runner.run = real_run
    assert [outs[i].token_ids for i in (0, 2, 3)] == alone
    assert outs[1].finish_reason == "error"
    assert outs[1].outputs[0].error == "RuntimeError: boom in a kernel"
    assert idle(llm)


def test_a_device_failure_is_raised_not_blamed_on_a_request(llm):
    runner = llm.engine.runner
    real_run = runner.run

    def run(batch):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    runner.run = run
    try:
        with pytest.raises(RuntimeError, match="CUDA error"):
            llm.generate([[1, 2, 3], [4, 5, 6]], GREEDY)
    finally:
        runner.run = real_run
    assert idle(llm)


@pytest.mark.parametrize("kwargs,match", [
    (dict(device="banana"), "device must be"),
    pytest.param(dict(device="cuda"), "no usable CUDA",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is usable")),
    (dict(gpu_kv_budget_gib=math.inf), "gpu_kv_budget_gib"),
    (dict(gpu_kv_budget_gib=10**400), "gpu_kv_budget_gib"),
    (dict(host_kv_budget_gib=math.nan), "host_kv_budget_gib"),
    (dict(gpu_kv_budget_gib=0.0000001), "holds no KV page"),
])
def test_bad_engine_settings_are_clear_value_errors(qwen3_dir, kwargs, match):
    kwargs = {"device": "cpu", **kwargs}
    with pytest.raises(ValueError, match=match):
        LLM(str(qwen3_dir), progress=False, dtype="float32", **kwargs)


def test_a_failure_after_the_step_fails_its_requests_and_the_engine_goes_on(llm):
    """The stop-string check's detokenizer raising (after sampling): the step's requests end
    with an error, nothing is left queued, and the next generate() is unaffected."""
    sched = llm.engine.scheduler
    real = sched.detokenize

    def broken(ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    sched.detokenize = broken
    try:
        outs = llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=4, stop=["x"]))
    finally:
        sched.detokenize = real
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert "UnicodeDecodeError" in outs[0].outputs[0].error
    assert idle(llm)
    assert llm.generate([7, 8, 9], GREEDY)[0].token_ids == \
        make_llm(llm.engine.cfg.model).generate([7, 8, 9], GREEDY)[0].token_ids
