"""Structured outputs (constrained decoding through llguidance) on the embedded model, which
knows no JSON: a schema, a regex and a choice hold for every sampled completion, and the
constraint changes nothing for the rows that have none."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_llm

from nanoserve import SamplingParams
from nanoserve.engine.sampler import apply_allowed
from nanoserve.errors import InvalidParameter
from nanoserve.structured_outputs import StructuredOutputs

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 3}}}
PROMPT = "Describe a person as JSON:"


@pytest.fixture(scope="module")
def llm():
    return make_llm(None, max_num_seqs=16)


def valid(text: str, schema: dict) -> bool:
    """Whether text is JSON that validates against schema; a test using it skips where
    jsonschema (a test dependency, pyproject's dev extra) is not installed."""
    jsonschema = pytest.importorskip("jsonschema")
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_fifty_sampled_completions_all_match_the_schema_and_without_it_none_do(llm):
    params = SamplingParams(n=50, temperature=1.0, max_tokens=120, seed=7,
                            structured_outputs=StructuredOutputs(json=PERSON))
    outs = llm.generate([PROMPT], params)[0].outputs
    assert len(outs) == 50
    assert all(o.finish_reason == "stop" for o in outs)  # the grammar ended each one
    assert [o.text for o in outs if not valid(o.text, PERSON)] == []
    assert len({o.text for o in outs}) > 40  # sampled, not one forced answer
    free = llm.generate([PROMPT], params.replace(structured_outputs=None))[0].outputs
    assert sum(valid(o.text, PERSON) for o in free) == 0


def test_json_object_regex_and_choice_hold(llm):
    def texts(spec, n=20):
        p = SamplingParams(n=n, temperature=1.0, max_tokens=40, seed=3, structured_outputs=spec)
        return [o.text for o in llm.generate([PROMPT], p)[0].outputs
                if o.finish_reason == "stop"]  # any object: a string key may run to the end

    objects = texts(StructuredOutputs(json_object=True))
    assert len(objects) >= 15 and all(isinstance(json.loads(t), dict) for t in objects)
    import re
    matched = texts(StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}"))
    assert len(matched) == 20 and all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) for t in matched)
    picked = texts(StructuredOutputs(choice=["red", "green", "blue"]))
    assert len(picked) == 20 and set(picked) <= {"red", "green", "blue"} and len(set(picked)) > 1


def test_greedy_constrained_rows_and_free_rows_in_one_batch_equal_each_run_alone(llm):
    """Rows without a grammar pay nothing and see nothing of their neighbours' masks; a
    constrained greedy row is the same alone or batched."""
    spec = StructuredOutputs(json=PERSON)
    free = SamplingParams(temperature=0.0, max_tokens=24)
    tied = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=spec)
    seeded = SamplingParams(temperature=0.9, max_tokens=60, seed=11, structured_outputs=spec)
    prompts = ["hello there", PROMPT, "Another person:", "the grass"]
    params = [free, tied, seeded, free]
    together = llm.generate(prompts, params)
    alone = [llm.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    assert [o.outputs[0].token_ids for o in together] == \
        [o.outputs[0].token_ids for o in alone]
    assert valid(together[1].outputs[0].text, PERSON)
    assert valid(together[2].outputs[0].text, PERSON)


def test_a_schema_that_does_not_compile_fails_its_request_alone(llm):
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(
        json={"type": "string", "pattern": "(unclosed"}))
    good = SamplingParams(temperature=0.0, max_tokens=4)
    outs = llm.generate(["a", "b"], [bad, good])
    assert "structured_outputs" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4
    with pytest.raises(InvalidParameter, match="does not compile|nonsense"):
        llm.engine.check_params(SamplingParams(structured_outputs=StructuredOutputs(
            json={"type": "nonsense"})))


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"), ({"json": PERSON, "regex": "a"}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"), ({"json": [1]}, "schema object"),
    ({"regex": ""}, "non-empty string"), ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 1]}, "non-empty list")])
def test_the_spec_is_checked_for_shape(kwargs, message):
    with pytest.raises(InvalidParameter, match=message):
        StructuredOutputs(**kwargs)
    with pytest.raises(InvalidParameter, match="StructuredOutputs"):
        SamplingParams(structured_outputs={"json": PERSON})


def test_the_spec_keeps_a_schema_as_canonical_json_text():
    a = StructuredOutputs(json={"b": 1, "a": {"type": "string"}})
    b = StructuredOutputs(json='{"a": {"type": "string"}, "b": 1}')
    assert a == b and hash(a) == hash(b) and a.json == '{"a": {"type": "string"}, "b": 1}'


def test_apply_allowed_masks_exactly_the_bits_of_the_constrained_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 70, generator=g, dtype=torch.float64)
    bits = torch.rand(2, 70, generator=g) < 0.3
    words = torch.zeros(2, 3, dtype=torch.int64)
    for r in range(2):
        for t in range(70):
            if bits[r, t]:
                words[r, t // 32] |= 1 << (t % 32)
    masks = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # as int32 bits
    out = apply_allowed(logits, (torch.tensor([3, 1]), masks))
    want = logits.clone()
    want[3][~bits[0]] = float("-inf")
    want[1][~bits[1]] = float("-inf")
    assert torch.equal(out, want)


def test_llm_chat_renders_the_conversation_with_its_tools(llm):
    """LLM.chat: the chat template's own rendering with the tools, an assistant's call
    arguments (JSON text, as OpenAI sends them) given to the template as objects."""
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
    turn = [{"role": "user", "content": "time?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    out = llm.chat(turn, SamplingParams(temperature=0.0, max_tokens=3), tools=tools)
    tok = llm.tokenizer
    objects = [turn[0], {**turn[1], "tool_calls": [{**call, "function": {
        "name": "get_time", "arguments": {"zone": "CET"}}}]}, turn[2]]
    want = tok.apply_chat_template(objects, tools=tools, tokenize=False,
                                   add_generation_prompt=True)
    assert '{"name": "get_time", "arguments": {"zone": "CET"}}' in want
    assert out.prompt_token_ids == tok.encode(want, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 3
    for reserved in ({"chat_template": "{{ 'x' }}"}, {"add_generation_prompt": False},
                     {"tools": []}, {"enable_thinking": {"a": 1}}):
        with pytest.raises(ValueError, match="chat_template_kwargs"):
            llm.chat(turn, tools=tools, chat_template_kwargs=reserved)


def test_a_made_up_byte_vocabulary_constrains_a_model_without_a_tokenizer(llm):
    """The bench's path for dummy weights of a shipped shape (no tokenizer): token ids stand
    for bytes, and every sampled completion's bytes are JSON that validates."""
    from nanoserve.engine.grammar import Grammars, byte_vocabulary

    vocab = llm.engine.model_config.vocab_size
    real = llm.engine.grammars
    llm.engine.grammars = Grammars(None, vocab, (vocab - 1,), byte_vocabulary(vocab, vocab - 1))
    try:
        params = SamplingParams(n=10, temperature=1.0, max_tokens=120, seed=9,
                                structured_outputs=StructuredOutputs(json=PERSON))
        outs = llm.generate([PROMPT], params)[0].outputs
    finally:
        llm.engine.grammars = real
    for o in outs:
        assert o.finish_reason == "stop" and max(o.token_ids) < 256
        assert valid(bytes(o.token_ids).decode(), PERSON)


def test_mask_buffers_take_turns_and_grow():
    """A step's masks never share memory with the step before's (its upload may still read
    them); the step after reuses the buffer of two steps back, grown when it holds too few."""
    from nanoserve.engine.grammar import MaskBuffers
    buffers = MaskBuffers(100)
    a, b, c = buffers.take(3), buffers.take(3), buffers.take(2)
    assert a.shape == (3, 4) and c.shape == (2, 4)
    assert a.data_ptr() != b.data_ptr() and c.data_ptr() == a.data_ptr()
    d = buffers.take(5)  # b's turn, too small: a new one
    assert d.shape == (5, 4) and d.data_ptr() not in (a.data_ptr(), b.data_ptr())
