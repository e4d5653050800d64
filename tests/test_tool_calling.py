"""Tool calling and reasoning on /v1/chat/completions, with the real openai client, on the CPU:
the embedded model (which knows no tools) forced by tool_choice to call one, and models
scripted to write given answers, read back into tool_calls and reasoning_content, whole and
streamed; the conversation with tool results rendered as the chat template renders it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from test_server import ENGINE, NAME, ServerThread  # noqa: E402

from nanoserve import LLM  # noqa: E402
from nanoserve.chat import template_messages  # noqa: E402
from nanoserve.serve.app import build_app  # noqa: E402
from nanoserve.serve.async_engine import AsyncEngine  # noqa: E402
from nanoserve.serve.chat_template import chat_prompt  # noqa: E402
from nanoserve.serve.protocol import parse_messages  # noqa: E402

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["c", "f"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "maxLength": 8}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def serve(llm, **kw) -> ServerThread:
    return ServerThread(build_app(AsyncEngine(llm.engine), NAME, **kw))


@pytest.fixture(scope="module")
def server():
    srv = serve(LLM(progress=False, **ENGINE))
    yield srv
    srv.stop()


def client_of(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def assert_valid_call(call, names=SCHEMAS):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_makes_every_sampled_answer_a_valid_call(server):
    r = client_of(server).chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", n=20,
        temperature=1.0, seed=4, max_tokens=200)
    names = set()
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        assert_valid_call(choice.message.tool_calls[0])
        names.add(choice.message.tool_calls[0].function.name)
    assert names == set(SCHEMAS)  # sampled: both tools come up


def test_a_named_tool_choice_calls_that_tool_and_streams_as_openai_does(server):
    client = client_of(server)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, n=8,
                                       tool_choice=named, temperature=1.0, seed=2,
                                       max_tokens=200)
    for choice in r.choices:
        assert_valid_call(choice.message.tool_calls[0], {"get_time"})
    chunks = list(client.chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, tool_choice=named, temperature=1.0, seed=2,
        max_tokens=200, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].index == 0 and deltas[0].function.name == "get_time" and deltas[0].id
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), TIME)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_leaves_a_model_that_writes_no_call_with_its_text(server):
    r = client_of(server).chat.completions.create(model=NAME, messages=ASK, tools=TOOLS,
                                                  temperature=0, max_tokens=12)
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert choice.message.content


def scripted_server(text: str, **kw) -> tuple[ServerThread, int]:
    """A server whose model writes `text` (then the end-of-sequence token), whatever it is
    asked."""
    llm = LLM(progress=False, **ENGINE, async_scheduling=False)
    script = llm.tokenizer.encode(text, add_special_tokens=False) + [llm.tokenizer.eos_token_id]
    real_run = llm.engine.runner.run

    def scripted(batch):
        return [None if t is None else script[min(seq.num_output_tokens, len(script) - 1)]
                for seq, t in zip(batch.seqs, real_run(batch), strict=True)]

    llm.engine.runner.run = scripted
    return serve(llm, **kw), len(script)


TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
             '"Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
             '"arguments": {"zone": "CET"}}\n</tool_call>')


def test_two_calls_in_one_answer_whole_and_streamed():
    srv, n = scripted_server(TWO_CALLS)
    try:
        client = client_of(srv)
        kw = dict(model=NAME, messages=ASK, tools=TOOLS, max_tokens=n + 4, temperature=0)
        choice = client.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in choice.message.tool_calls]
        assert calls == [("get_weather", {"city": "Paris", "unit": "c"}),
                         ("get_time", {"zone": "CET"})]
        chunks = list(client.chat.completions.create(stream=True, **kw))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content == "Let me check."
        streamed: dict[int, list] = {}
        for c in chunks:
            for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                streamed.setdefault(d.index, []).append(d)
        assert [(ds[0].function.name, json.loads("".join(d.function.arguments or ""
                                                          for d in ds)))
                for _, ds in sorted(streamed.items())] == calls
        whole = [c.function.arguments for c in choice.message.tool_calls]
        for ds, arguments in zip(streamed.values(), whole, strict=True):
            # the name first, then the arguments in pieces, as the model wrote them
            assert ds[0].id.startswith("call_") and ds[0].type == "function"
            assert all(d.id is None and d.type is None and d.function.name is None
                       and d.function.arguments for d in ds[1:])
            assert len(ds) > 3 and "".join(d.function.arguments for d in ds) == arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        srv.stop()


def test_parallel_tool_calls_false_keeps_the_first_call():
    srv, n = scripted_server(TWO_CALLS)
    try:
        client = client_of(srv)
        kw = dict(model=NAME, messages=ASK, tools=TOOLS, max_tokens=n + 4, temperature=0,
                  parallel_tool_calls=False)
        calls = client.chat.completions.create(**kw).choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["get_weather"]
        chunks = list(client.chat.completions.create(stream=True, **kw))
        assert {d.index for c in chunks if c.choices
                for d in c.choices[0].delta.tool_calls or []} == {0}
    finally:
        srv.stop()


def test_the_answer_starts_where_the_rendered_prompt_left_the_thinking():
    from nanoserve.serve.answer import AnswerReader, answer_starts_in

    assert answer_starts_in("<|im_start|>assistant\n<think>\n") == "reasoning"
    assert answer_starts_in("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "content"
    assert answer_starts_in("<|im_start|>assistant\n") == "auto"
    # thinking closed by the template: the answer streams at once, not at its end
    assert AnswerReader("qwen3", None, "content").feed("Hello", final=False) == \
        ("", "Hello", [])
    assert AnswerReader("qwen3", None, "reasoning").feed("Hmm", final=False) == \
        ("Hmm", "", [])


def whole_and_streamed(text: str):
    """A server scripted to write `text`, asked with tools: its whole answer's choice, checked
    to be that text as content, and its streamed answer's chunks."""
    srv, n = scripted_server(text)
    try:
        kw = dict(model=NAME, messages=ASK, tools=TOOLS, max_tokens=n + 4, temperature=0)
        choice = client_of(srv).chat.completions.create(**kw).choices[0]
        assert choice.message.tool_calls is None and choice.finish_reason == "stop"
        assert choice.message.content == text
        return choice, list(client_of(srv).chat.completions.create(stream=True, **kw))
    finally:
        srv.stop()


def test_a_malformed_call_stays_text():
    text = '<tool_call>\n{"name": get_weather, "arguments": {"city": "Paris"}}\n</tool_call>'
    _, chunks = whole_and_streamed(text)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)


def test_a_call_that_breaks_after_it_began_to_stream_stays_a_streamed_call():
    """Whole, it is text; streamed, its name and first pieces went out before it broke, and a
    stream cannot take them back: it stays a call, none of it content."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    _, chunks = whole_and_streamed(text)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments for d in deltas) == '{"city": }'
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_answer_reader_streams_openai_call_deltas_name_first_then_pieces():
    from nanoserve.serve.answer import AnswerReader

    pieces = ['Sure.<tool_call>{"name": "f", "arguments": {"a"', ": 1", "}}</tool_call>",
              '<tool_call>{"name": "g", "arguments": {', '"b": 2}}</tool_call>']
    for parallel in (True, False):
        reader = AnswerReader(None, "hermes", parallel=parallel)
        out = [reader.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert [content for _, content, _ in out] == ["Sure.", "", "", "", ""]
        calls = [calls for _, _, calls in out]
        first = calls[0][0]
        assert first["id"].startswith("call_") and first == {
            "index": 0, "id": first["id"], "type": "function",
            "function": {"name": "f", "arguments": '{"a"'}}
        assert calls[1:3] == [[{"index": 0, "function": {"arguments": ": 1"}}],
                              [{"index": 0, "function": {"arguments": "}"}}]]
        if parallel:
            assert calls[3][0]["function"] == {"name": "g", "arguments": "{"}
            assert calls[4] == [{"index": 1, "function": {"arguments": '"b": 2}'}}]
        else:  # the second call, first delta and pieces, is dropped
            assert calls[3:] == [[], []]
        assert reader.calls == (2 if parallel else 1)


def test_reasoning_parser_splits_the_thinking_off_whole_and_streamed():
    text = "<think>\nThe user wants weather.\n</think>\n\nIt is sunny."
    srv, n = scripted_server(text, reasoning_parser="qwen3")
    try:
        kw = dict(model=NAME, messages=ASK, max_tokens=n + 4, temperature=0)
        message = client_of(srv).chat.completions.create(**kw).choices[0].message
        assert message.content == "It is sunny."
        assert message.model_extra["reasoning_content"] == "The user wants weather."
        chunks = list(client_of(srv).chat.completions.create(stream=True, **kw))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == "It is sunny."
        assert "".join((d.model_extra or {}).get("reasoning_content") or ""
                       for d in deltas) == "The user wants weather."
    finally:
        srv.stop()


def test_a_tool_conversation_renders_as_the_templates_own(server):
    """A second turn with the call and its result: the prompt is transformers'
    apply_chat_template with the same tools (arguments as objects, as templates take them)."""
    turn = [{"role": "system", "content": "Be brief."}, *ASK,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather",
                              "arguments": '{"city": "Paris", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    tok = server_tokenizer()
    rendered = chat_prompt(tok, template_messages(parse_messages(turn)), tools=TOOLS)
    as_objects = [*turn[:2], {**turn[2], "tool_calls": [{**turn[2]["tool_calls"][0], "function":
                  {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
                  turn[3]]
    want = tok.apply_chat_template(as_objects, tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    assert rendered == want and '<tool_response>\n{"temp": 21}' in want
    r = client_of(server).chat.completions.create(model=NAME, messages=turn, tools=TOOLS,
                                                  max_tokens=2)
    assert r.usage.prompt_tokens == len(tok.encode(want, add_special_tokens=False))


def server_tokenizer():
    from transformers import AutoTokenizer

    from nanoserve.models.loader import resolve_model_dir
    return AutoTokenizer.from_pretrained(str(resolve_model_dir("")))


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
    # a required call's grammar is built from the tools: a bad schema there names tools
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "nonsense"}}}], "tool_choice": "required"}, "tools"),
    # a client's template would run in the server; arguments must be plain values
    ({"chat_template_kwargs": {"chat_template": "{{ 'x' * 10 }}"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": [1]}}, "chat_template_kwargs"),
])
def test_bad_tools_are_400s_naming_the_field_and_the_server_goes_on(server, extra, param):
    client = client_of(server)
    known = {k: v for k, v in extra.items() if k != "chat_template_kwargs"}
    body = {k: v for k, v in extra.items() if k == "chat_template_kwargs"}  # vLLM's extension
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": NAME, "messages": ASK, "max_tokens": 2,
                                          **known}, extra_body=body or None)
    assert e.value.param == param
    assert client.chat.completions.create(model=NAME, messages=ASK,
                                          max_tokens=2).choices[0].finish_reason == "length"


def test_the_embedded_template_without_tools_is_plain_chatml_even_under_strict_jinja():
    """Tools or not: without them the template writes what it always wrote, and renders with
    StrictUndefined (lm-eval's remote tokenizer) though no `tools` is given."""
    import jinja2

    tok = server_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    want = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == want
    strict = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(tok.chat_template)
    assert strict.render(messages=messages, add_generation_prompt=True) == want
