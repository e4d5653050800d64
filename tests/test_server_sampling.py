"""Sampling through the API with the real openai client: logit_bias, penalties, min_p,
stop_token_ids, seeds, n completions and logprobs, streaming and not, each equal to what
`LLM.generate` gives for the same SamplingParams."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_server import ENGINE, NAME, PROMPT, ServerThread, chat_ids, wait_idle  # noqa: E402

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.serve.app import build_app  # noqa: E402
from nanoserve.serve.async_engine import AsyncEngine  # noqa: E402

UNSURE = "Once upon"  # a prompt the embedded model is unsure how to continue


@pytest.fixture(scope="module")
def server():
    llm = LLM(progress=False, **ENGINE)
    srv = ServerThread(build_app(AsyncEngine(llm.engine), NAME))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ref_llm():
    return LLM(progress=False, **ENGINE)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def ref(ref_llm, prompt, **kw):
    kw.setdefault("temperature", 0.0)
    return ref_llm.generate(prompt, SamplingParams(**kw))[0]


def token_str(ref_llm, token_id: int) -> str:
    return ref_llm.tokenizer.decode([token_id])


def streamed_completions(client, **kw) -> tuple[dict[int, str], dict[int, str], list]:
    """Texts and finish reasons by choice index, and the chunks."""
    chunks = list(client.completions.create(stream=True, **kw))
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason is not None:
                assert ch.index not in finish  # one finish chunk per choice
                finish[ch.index] = ch.finish_reason
    return texts, finish, chunks


# --- logit_bias ---------------------------------------------------------------------------------

def test_logit_bias_forces_its_token_greedy_and_sampled(server, client, ref_llm):
    q = ref_llm.tokenizer.encode("Q", add_special_tokens=False)
    assert len(q) == 1
    for temperature, seed in ((0.0, None), (1.0, 5), (2.0, 9)):
        r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6,
                                      temperature=temperature, seed=seed,
                                      logit_bias={str(q[0]): 100})
        assert r.choices[0].text == "Q" * 6
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user",
                                                                  "content": "hi"}],
                                           max_tokens=6, temperature=temperature, seed=seed,
                                           logit_bias={str(q[0]): 100})
        assert r.choices[0].message.content == "Q" * 6
    # -100 on the greedy choice: the engine's own answer with the same bias
    plain = ref(ref_llm, PROMPT, max_tokens=12)
    first = plain.token_ids[0]
    expected = ref(ref_llm, PROMPT, max_tokens=12, logit_bias={first: -100.0})
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                  logit_bias={str(first): -100})
    assert r.choices[0].text == expected.text != plain.text


# --- penalties, min_p, stop_token_ids, seeds -------------------------------------------------

PENALTIES = [  # (SamplingParams fields, API fields, extension fields)
    ({"presence_penalty": 1.5}, {"presence_penalty": 1.5}, {}),
    ({"frequency_penalty": 1.0}, {"frequency_penalty": 1.0}, {}),
    ({"repetition_penalty": 1.3}, {}, {"repetition_penalty": 1.3}),
    ({"presence_penalty": -0.5, "frequency_penalty": 0.5, "repetition_penalty": 0.9},
     {"presence_penalty": -0.5, "frequency_penalty": 0.5}, {"repetition_penalty": 0.9}),
]


@pytest.mark.parametrize("fields,api,ext", PENALTIES,
                         ids=["presence", "frequency", "repetition", "mixed"])
def test_penalties_change_greedy_output_as_the_engine_does(server, client, ref_llm, fields,
                                                           api, ext):
    plain = ref(ref_llm, PROMPT, max_tokens=30, ignore_eos=True).text
    expected = ref(ref_llm, PROMPT, max_tokens=30, ignore_eos=True, **fields).text
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=30, temperature=0,
                                  extra_body={"ignore_eos": True, **ext}, **api)
    assert r.choices[0].text == expected
    if fields != PENALTIES[3][0]:
        assert expected != plain  # the penalty had an effect
    texts, _, _ = streamed_completions(client, model=NAME, prompt=PROMPT, max_tokens=30,
                                       temperature=0, extra_body={"ignore_eos": True, **ext},
                                       **api)
    assert texts == {0: expected}


def test_min_p_seed_and_stop_token_ids_as_the_engine_does(server, client, ref_llm):
    for kw in ({"temperature": 1.0, "seed": 3, "min_p": 0.3}, {"temperature": 1.5, "seed": 11},
               {"temperature": 0.8, "seed": 2**64 - 1, "top_k": 5, "top_p": 0.9}):
        expected = ref(ref_llm, UNSURE, max_tokens=12, **kw).text
        ext = {k: kw[k] for k in ("min_p", "top_k") if k in kw}
        api = {k: v for k, v in kw.items() if k not in ext}
        for _ in range(2):  # seeded: the same again
            r = client.completions.create(model=NAME, prompt=UNSURE, max_tokens=12,
                                          extra_body=ext, **api)
            assert r.choices[0].text == expected, kw
    plain = ref(ref_llm, PROMPT, max_tokens=20)
    stop_id = plain.token_ids[5]
    expected = ref(ref_llm, PROMPT, max_tokens=20, stop_token_ids=[stop_id])
    assert expected.finish_reason == "stop"
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id]})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected.text, "stop")
    assert r.usage.completion_tokens == len(expected.token_ids)


# --- n completions ------------------------------------------------------------------------------

def test_n_completions_plain_and_streamed(server, client, ref_llm):
    n, kw = 3, dict(max_tokens=10, temperature=1.0, seed=7)
    expected = ref(ref_llm, UNSURE, n=n, **kw)
    want = {c.index: c.text for c in expected.outputs}
    assert len(set(want.values())) == n  # three different completions
    r = client.completions.create(model=NAME, prompt=UNSURE, n=n, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert {c.index: c.text for c in r.choices} == want
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)  # counted once
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in expected.outputs)
    texts, finish, chunks = streamed_completions(client, model=NAME, prompt=UNSURE, n=n,
                                                 stream_options={"include_usage": True}, **kw)
    assert texts == want
    assert finish == {i: "length" for i in range(n)}
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # chat: a role chunk, content and a finish chunk per choice
    messages = [{"role": "user", "content": "Tell me"}]
    expected = ref(ref_llm, chat_ids(ref_llm, "Tell me"), n=2, **kw)
    want = {c.index: c.text for c in expected.outputs}
    reasons = {c.index: c.finish_reason for c in expected.outputs}
    r = client.chat.completions.create(model=NAME, messages=messages, n=2, **kw)
    assert {c.index: c.message.content for c in r.choices} == want
    assert {c.index: c.finish_reason for c in r.choices} == reasons
    roles, texts, finish = {}, {}, {}
    for c in client.chat.completions.create(model=NAME, messages=messages, n=2, stream=True,
                                            **kw):
        for ch in c.choices:
            if ch.delta.role:
                roles[ch.index] = ch.delta.role
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert texts == want and finish == reasons
    wait_idle(server.url)


def test_n_completions_stop_independently(server, client, ref_llm):
    """Each completion finishes on its own; a stop string cuts each where it occurs."""
    kw = dict(max_tokens=12, temperature=1.5, seed=21, n=4, stop=["e"])
    expected = ref(ref_llm, UNSURE, **kw)
    r = client.completions.create(model=NAME, prompt=UNSURE, **kw)
    assert [(c.text, c.finish_reason) for c in r.choices] == [
        (o.text, "stop" if o.finish_reason == "stop" else "length") for o in expected.outputs]
    texts, finish, _ = streamed_completions(client, model=NAME, prompt=UNSURE, **kw)
    assert texts == {c.index: c.text for c in r.choices}
    assert finish == {c.index: c.finish_reason for c in r.choices}


# --- logprobs -----------------------------------------------------------------------------------

def check_completion_logprobs(lp, expected, ref_llm, k: int) -> None:
    """OpenAI's completions shape, equal to the engine's logprobs."""
    items = expected.outputs[0].logprobs
    assert lp.tokens == [token_str(ref_llm, t.token_id) for t in items]
    assert lp.token_logprobs == pytest.approx([t.logprob for t in items], abs=1e-6)
    assert len(lp.top_logprobs) == len(items)
    for top, t in zip(lp.top_logprobs, items, strict=True):
        assert top == pytest.approx({token_str(ref_llm, i): v for i, v in t.top}, abs=1e-6)
        values = list(top.values())
        assert len(values) == k and values == sorted(values, reverse=True)
        assert not values or values[0] >= t.logprob - 1e-6
    starts = [0]
    for token in lp.tokens[:-1]:
        starts.append(starts[-1] + len(token))
    assert lp.text_offset == starts  # ASCII output: one character per token


def test_completion_logprobs_plain_and_streamed(server, client, ref_llm):
    for k in (0, 1, 5):
        expected = ref(ref_llm, PROMPT, max_tokens=10, logprobs=k)
        r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                      logprobs=k)
        assert r.choices[0].text == expected.text
        check_completion_logprobs(r.choices[0].logprobs, expected, ref_llm, k)
        chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10,
                                                temperature=0, logprobs=k, stream=True))
        tokens, logprobs, tops, offsets = [], [], [], []
        for c in chunks:
            lp = c.choices[0].logprobs
            if lp is None:
                assert c.choices[0].text == ""
                continue
            assert "".join(lp.tokens) == c.choices[0].text  # sent with their own text
            tokens += lp.tokens
            logprobs += lp.token_logprobs
            tops += lp.top_logprobs
            offsets += lp.text_offset
        whole = r.choices[0].logprobs
        assert (tokens, logprobs, tops, offsets) == (
            whole.tokens, whole.token_logprobs, whole.top_logprobs, whole.text_offset)
    # sampled, with n=2: each completion its own logprobs
    expected = ref(ref_llm, UNSURE, max_tokens=6, temperature=1.0, seed=4, n=2, logprobs=2)
    r = client.completions.create(model=NAME, prompt=UNSURE, max_tokens=6, temperature=1.0,
                                  seed=4, n=2, logprobs=2)
    for choice, out in zip(r.choices, expected.outputs, strict=True):
        assert choice.logprobs.token_logprobs == pytest.approx(
            [t.logprob for t in out.logprobs], abs=1e-6)
        assert choice.logprobs.tokens == [token_str(ref_llm, t) for t in out.token_ids]


def test_streamed_logprobs_travel_with_their_text_through_a_stop_string(server, client,
                                                                        ref_llm):
    """Held-back text (it could start a stop string) holds back its tokens' logprobs too;
    every token's logprobs arrive by the end, the stop string's included."""
    plain = ref(ref_llm, PROMPT, max_tokens=30).text
    stop = plain[12:16]
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=30,
                                            temperature=0, logprobs=2, stop=[stop],
                                            stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain[:plain.find(stop)]
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == chunks[-1].usage.completion_tokens
    assert "".join(tokens).startswith(text + stop)
    for c in chunks[:-2]:  # before the finish chunk: each piece's logprobs with its text
        if c.choices and c.choices[0].logprobs:
            assert "".join(c.choices[0].logprobs.tokens) == c.choices[0].text


def test_chat_logprobs_plain_and_streamed(server, client, ref_llm):
    question = "What is the secret number in the text above?"
    messages = [{"role": "user", "content": question}]
    for top_k in (None, 3, 20):
        expected = ref(ref_llm, chat_ids(ref_llm, question), max_tokens=10,
                       logprobs=top_k or 0)
        items = expected.outputs[0].logprobs
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                           temperature=0, logprobs=True, top_logprobs=top_k)
        assert r.choices[0].message.content == expected.text
        content = r.choices[0].logprobs.content
        assert [c.token for c in content] == [token_str(ref_llm, t.token_id) for t in items]
        assert [c.logprob for c in content] == pytest.approx([t.logprob for t in items],
                                                             abs=1e-6)
        for c, t in zip(content, items, strict=True):
            assert c.bytes == list(c.token.encode())  # ASCII tokens: their own bytes
            assert [(x.token, x.bytes) for x in c.top_logprobs] == [
                (token_str(ref_llm, i), list(token_str(ref_llm, i).encode())) for i, _ in t.top]
            values = [x.logprob for x in c.top_logprobs]
            assert values == pytest.approx([v for _, v in t.top], abs=1e-6)
            assert len(values) == (top_k or 0) and values == sorted(values, reverse=True)
            if values:
                assert values[0] >= c.logprob - 1e-6
        streamed = []
        for chunk in client.chat.completions.create(model=NAME, messages=messages,
                                                    max_tokens=10, temperature=0,
                                                    logprobs=True, top_logprobs=top_k,
                                                    stream=True):
            lp = chunk.choices[0].logprobs
            if lp is not None and lp.content:
                assert "".join(x.token for x in lp.content) == \
                    (chunk.choices[0].delta.content or "")
                streamed += lp.content
        assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4,
                                       temperature=0)
    assert r.choices[0].logprobs is None


def test_logprob_bytes_of_partial_characters_are_the_tokens_own(server, ref_llm):
    """A byte-level token holding part of a multi-byte character: its `bytes` are that part
    (its text alone is U+FFFD)."""
    tok = ref_llm.tokenizer
    ids = tok.encode("é", add_special_tokens=False)
    assert len(ids) == 2
    from nanoserve.serve.detokenizer import TokenText

    text = TokenText(tok)
    assert [text(i)[1] for i in ids] == [[0xC3], [0xA9]]
    assert text(ids[0])[0] == "\ufffd"
    assert text(tok.encode("a", add_special_tokens=False)[0]) == ("a", [97])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert text(end) == ("<|im_end|>", list(b"<|im_end|>"))
    # through the server: logit_bias forces the first byte of "é"
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0,
        "logprobs": True, "logit_bias": {str(ids[0]): 100}})
    entry = r.json()["choices"][0]["logprobs"]["content"][0]
    assert (entry["token"], entry["bytes"]) == ("\ufffd", [0xC3])
