"""What lm-eval and guidellm need from the server besides echo: several prompts in one
completions request, usage on every streamed chunk, vLLM's tokenizer routes (and lm-eval's
remote tokenizer over them), and the model card's root. Real HTTP on the embedded model."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_server import ENGINE, NAME, PROMPT, ServerThread, chat_ids, sse_events  # noqa: E402

from nanoserve import LLM  # noqa: E402
from nanoserve.serve.app import build_app  # noqa: E402
from nanoserve.serve.async_engine import AsyncEngine  # noqa: E402

C = "/v1/completions"
PROMPTS = [PROMPT, "Once upon a time there was", "A needle in a haystack is hard"]


@pytest.fixture(scope="module")
def server():
    llm = LLM(progress=False, **ENGINE)
    ae = AsyncEngine(llm.engine)
    srv = ServerThread(build_app(ae, NAME))
    srv.engine, srv.ae = llm.engine, ae
    srv.tok = srv.tokenizer = llm.engine.tokenizer  # (chat_ids reads .tokenizer)
    yield srv
    srv.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def complete(server, prompt, **kw) -> dict:
    r = post(server, C, {"model": NAME, "prompt": prompt, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, path: str, body: dict) -> list:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        return sse_events(r.iter_lines())


def assert_logprobs_close(got: dict, want: dict, tol: float = 1e-4) -> None:
    """Same tokens and offsets; logprobs equal within `tol` (a batch of other shapes rounds
    differently)."""
    assert (got["tokens"], got["text_offset"]) == (want["tokens"], want["text_offset"])
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=tol)
    for g, w in zip(got["top_logprobs"], want["top_logprobs"], strict=True):
        assert g.keys() == w.keys() and list(g.values()) == pytest.approx(list(w.values()),
                                                                          abs=tol)


def wait_engine_idle(server) -> None:
    import time

    deadline = time.time() + 10
    while server.engine.has_unfinished():
        assert time.time() < deadline
        time.sleep(0.02)


# --- several prompts in one request -----------------------------------------------------------

@pytest.mark.parametrize("as_ids", [False, True], ids=["strings", "token-id-lists"])
def test_batched_prompts_equal_each_prompt_sent_alone(server, as_ids):
    kw = dict(max_tokens=8, n=2, logprobs=2)
    prompts = [server.engine.tokenize(p) for p in PROMPTS] if as_ids else PROMPTS
    alone = [complete(server, p, **kw) for p in prompts]
    both = complete(server, prompts, **kw)
    assert [c["index"] for c in both["choices"]] == list(range(6))
    for i, one in enumerate(alone):
        for j in range(2):
            got, want = both["choices"][i * 2 + j], one["choices"][j]
            assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"])
            assert_logprobs_close(got["logprobs"], want["logprobs"])
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert both["usage"][key] == sum(a["usage"][key] for a in alone)
    assert both["usage"]["prompt_tokens"] == sum(len(server.engine.tokenize(p))
                                                 for p in PROMPTS)


def test_a_list_of_ints_is_one_prompt_and_a_list_of_one_string_too(server):
    ids = server.engine.tokenize(PROMPT)
    one = complete(server, PROMPT, max_tokens=6)
    for prompt in (ids, [PROMPT], [ids]):
        got = complete(server, prompt, max_tokens=6)
        assert [c["text"] for c in got["choices"]] == [one["choices"][0]["text"]]
        assert got["usage"] == one["usage"]


def test_batched_prompts_stream_each_choice_under_its_index(server):
    body = {"model": NAME, "prompt": PROMPTS, "n": 2, "max_tokens": 8, "temperature": 0,
            "stream_options": {"include_usage": True}}
    plain = complete(server, PROMPTS, n=2, max_tokens=8)
    events = stream(server, C, body)
    assert events[-1] == "[DONE]"
    texts, finishes = [""] * 6, [None] * 6
    for e in events[:-2]:
        (choice,) = e["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == [c["text"] for c in plain["choices"]]
    assert finishes == [c["finish_reason"] for c in plain["choices"]]
    assert events[-2]["choices"] == [] and events[-2]["usage"] == plain["usage"]


def test_a_bad_prompt_refuses_the_request_by_its_index_and_runs_nothing(server):
    before = server.ae.stats.prompt_tokens_total
    cases = [  # (prompt list, the index named, code)
        (["hi", "grass " * 1400], 1, "context_length_exceeded"),  # refused before submission
        (["hi", "ho", "grass " * 1000], 2, "kv_capacity_exceeded"),  # refused by the engine
        ([[1, 2], [3, 10**6]], 1, None),  # an id beyond the vocabulary
    ]
    for prompts, index, code in cases:
        r = post(server, C, {"model": NAME, "prompt": prompts, "max_tokens": 4})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("prompt", code)
        assert err["message"].startswith(f"prompt[{index}]")
    wait_engine_idle(server)
    assert server.ae.stats.prompt_tokens_total == before  # not one prompt was admitted
    assert server.ae._in_flight == 0


# --- usage on every chunk (vLLM's continuous_usage_stats) ---------------------------------------

def test_continuous_usage_stats_puts_usage_so_far_on_every_chunk(server):
    plain = complete(server, PROMPT, max_tokens=12)
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "stream_options": {"continuous_usage_stats": True}}
    events = stream(server, C, body)[:-1]
    assert all(e["choices"] for e in events)  # no usage-only chunk without include_usage
    done = [e["usage"]["completion_tokens"] for e in events]
    assert done == sorted(done) and done[0] >= 1 and done[-1] == 12
    assert len(set(done)) > 5  # it grows chunk by chunk
    for e in events:
        u = e["usage"]
        assert u["prompt_tokens"] == plain["usage"]["prompt_tokens"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    body["stream_options"]["include_usage"] = True
    events = stream(server, C, body)[:-1]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]
    assert all("usage" in e for e in events)
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": False}
    events = stream(server, C, body)[:-1]  # guidellm sends false
    assert ["usage" in e for e in events] == [False] * (len(events) - 1) + [True]


def test_continuous_usage_stats_on_chat_counts_from_the_role_chunk(server):
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi there"}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream_options": {"continuous_usage_stats": True}}
    events = stream(server, "/v1/chat/completions", body)[:-1]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[0]["usage"]["completion_tokens"] == 0
    assert events[-1]["usage"]["completion_tokens"] == 6
    prompt = len(chat_ids(server, "Hi there"))
    assert {e["usage"]["prompt_tokens"] for e in events} == {prompt}


@pytest.mark.parametrize("path", [C, "/v1/chat/completions"])
def test_guidellms_streaming_request_as_it_sends_it(server, path):
    """Its body for a fixed output length, on either endpoint (chat content as text parts)."""
    body = {"model": NAME, "stream": True, "stop": None, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if path == C:
        body |= {"prompt": PROMPT, "max_tokens": 7}
    else:
        body |= {"messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
                 "max_completion_tokens": 7}
    events = stream(server, path, body)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 7
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert all("usage" in e for e in events[:-1])


# --- tokenizer routes -------------------------------------------------------------------------

def test_tokenize_gives_the_ids_completions_run_and_detokenize_inverts_it(server):
    r = post(server, "/tokenize", {"model": NAME, "prompt": PROMPT})
    assert r.status_code == 200, r.text
    ids = server.engine.tokenize(PROMPT)
    assert r.json() == {"count": len(ids), "max_model_len": ENGINE["max_model_len"],
                        "tokens": ids, "token_strs": None}
    assert complete(server, PROMPT, max_tokens=1)["usage"]["prompt_tokens"] == len(ids)
    r = post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert r.json()["token_strs"] == server.tok.convert_ids_to_tokens(ids)
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": PROMPT}
    text = "héllo <|im_end|> 日本語"  # multi-byte characters and a special token round-trip
    ids = post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    assert 258 in ids
    assert post(server, "/detokenize", {"model": NAME, "tokens": ids}).json()["prompt"] == text
    assert post(server, "/tokenize", {"prompt": ""}).json()["tokens"] == []
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_tokenize_messages_as_chat_completions_do(server):
    messages = [{"role": "user", "content": "Hi there"}]
    r = post(server, "/tokenize", {"messages": messages})
    assert r.json()["tokens"] == chat_ids(server, "Hi there")
    r = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    text = server.tok.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=False)
    assert r.json()["tokens"] == server.tok.encode(text, add_special_tokens=False)
    assert r.json()["tokens"] != chat_ids(server, "Hi there")


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"prompt": "hi", "bogus": 1}, 400, "bogus"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": "hi"}, 400, "messages"),
    ("/tokenize", {"prompt": "hi", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"model": "other", "prompt": "hi"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 259]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_tokenizer_routes_refuse_bad_requests_in_openai_shape(server, path, body, status,
                                                              param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_tokenizer_info_and_lm_evals_remote_tokenizer(server):
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info == {"tokenizer_class": type(server.tok).__name__, "bos_token": None,
                    "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
                    "chat_template": server.tok.chat_template,
                    "model_max_length": ENGINE["max_model_len"]}
    lm_utils = pytest.importorskip("lm_eval.utils")
    base = server.url + "/v1/completions"
    assert lm_utils.check_remote_tokenizer_support(base)
    remote = lm_utils.RemoteTokenizer(base)
    assert remote.encode(PROMPT) == server.engine.tokenize(PROMPT)
    assert remote.decode(remote.encode(PROMPT)) == PROMPT
    assert remote.eos_token_id == 258 and remote.bos_token_id is None
    messages = [{"role": "user", "content": "Hi there"}]
    assert remote.apply_chat_template(messages) == server.tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_the_model_card_names_the_model_directory(server):
    from transformers import AutoTokenizer

    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["root"] == str(server.engine.model_dir)
    assert httpx.get(server.url + f"/v1/models/{NAME}").json()["root"] == card["root"]
    tok = AutoTokenizer.from_pretrained(card["root"])
    assert tok.encode(PROMPT, add_special_tokens=False) == server.engine.tokenize(PROMPT)
