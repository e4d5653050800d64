"""What a client can do to the server: malformed and hostile bodies, unknown and unsupported
parameters, wrong keys, huge or slow bodies, too many requests, clients that leave. Real HTTP on
127.0.0.1, every answer checked exactly (status, error type, param, code), and after each group
a good request must still return the reference text with nothing left running or held."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_server import ENGINE, NAME, PROMPT, ServerThread, metrics, wait_idle  # noqa: E402

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.serve.app import build_app, default_max_body_bytes  # noqa: E402
from nanoserve.serve.async_engine import AsyncEngine  # noqa: E402

KEY = "sk-test-abuse"
AUTH = {"authorization": f"Bearer {KEY}"}
BODY_TIMEOUT_S = 1.5
MAX_BODY = default_max_body_bytes(ENGINE["max_model_len"])
MAX_NUM_SEQS = ENGINE["max_num_seqs"]


@pytest.fixture(scope="module")
def server():
    llm = LLM(progress=False, **ENGINE)
    # the reference, from the same engine before the server owns it
    ref = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8))[0].text
    ae = AsyncEngine(llm.engine)
    srv = ServerThread(build_app(ae, NAME, api_key=KEY, body_timeout_s=BODY_TIMEOUT_S,
                                 max_waiting_requests=0))
    srv.ref, srv.host, srv.port = ref, "127.0.0.1", int(srv.url.rsplit(":", 1)[1])
    yield srv
    srv.stop()
    assert not ae.alive


def post(server, path: str, body=None, raw: bytes | None = None, headers=None,
         auth: bool = True) -> httpx.Response:
    h = {**(AUTH if auth else {}), **(headers or {})}
    if raw is not None:
        h.setdefault("content-type", "application/json")
        return httpx.post(server.url + path, content=raw, headers=h, timeout=60)
    return httpx.post(server.url + path, json=body, headers=h, timeout=60)


def assert_error(r: httpx.Response, status: int, param, code, type_="invalid_request_error"):
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == (type_, param, code), err
    assert isinstance(err["message"], str) and 0 < len(err["message"]) <= 400, err
    return err


def assert_healthy(server) -> None:
    """A good request returns the reference text, and nothing is left running or held."""
    r = post(server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 8,
                                         "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == server.ref
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    wait_idle(server.url)


def raw_http(server, head: str, body: bytes = b"", *, close_after: float | None = None,
             timeout: float = 15) -> tuple[int, dict[str, str], bytes]:
    """Sends `head` (request line and headers, without the blank line) and `body` on a raw
    socket and reads the response; `close_after`: close after that many seconds instead of
    reading (returns status 0)."""
    s = socket.create_connection((server.host, server.port), timeout=timeout)
    try:
        s.sendall(head.encode() + b"\r\n\r\n" + body)
        if close_after is not None:
            time.sleep(close_after)
            return 0, {}, b""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
        header, rest = data.split(b"\r\n\r\n", 1)
        lines = header.decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        headers = {k.lower(): v for k, v in headers.items()}
        length = int(headers.get("content-length", 0))
        while len(rest) < length:
            chunk = s.recv(65536)
            assert chunk
            rest += chunk
        return int(lines[0].split()[1]), headers, rest
    finally:
        s.close()


def head(path: str, extra: str = "", length: int | None = None) -> str:
    lines = [f"POST {path} HTTP/1.1", "host: 127.0.0.1", f"authorization: Bearer {KEY}",
             "content-type: application/json"]
    if length is not None:
        lines.append(f"content-length: {length}")
    if extra:
        lines.append(extra)
    return "\r\n".join(lines)


# --- item 3: bodies that parse badly ------------------------------------------------------------

DEEP = 100_000
BAD_BODIES = [  # (raw JSON, endpoint, param): 400, invalid_request_error, code None
    ("[" * DEEP + "]" * DEEP, "completions", None),
    ('{"prompt": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}", "completions", None),
    ('{"prompt": "hi", "metadata": ' + "[" * 100 + "]" * 100 + "}", "completions", "metadata"),
    ('{"prompt": "hi \\ud800 there"}', "completions", "prompt"),
    ('{"prompt": "\\udfff"}', "completions", "prompt"),
    ('{"prompt": "hi", "stop": ["ok", "\\ud800"]}', "completions", "stop"),
    ('{"prompt": "hi", "user": "\\udfff"}', "completions", "user"),
    ('{"model": "\\ud800", "prompt": "hi"}', "completions", "model"),
    ('{"messages": [{"role": "user", "content": "a \\udfff b"}]}', "chat/completions",
     "messages"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "chat/completions", "messages"),
    ('{"prompt": "hi", "seed": 1' + "9" * 5000 + "}", "completions", None),
    ('{"prompt": "hi", "temperature": NaN}', "completions", "temperature"),
    ('{"prompt": "hi", "temperature": Infinity}', "completions", "temperature"),
    ("[1, 2]", "completions", None),
    ('"just a string"', "chat/completions", None),
    ("", "completions", None),
]


@pytest.mark.parametrize("raw,endpoint,param", BAD_BODIES,
                         ids=[f"bad-body-{i}" for i in range(len(BAD_BODIES))])
def test_bodies_that_parse_badly_get_400(server, raw, endpoint, param):
    r = post(server, f"/v1/{endpoint}", raw=raw.encode())
    assert_error(r, 400, param, None)


def test_invalid_utf8_and_the_server_still_serves(server):
    assert_error(post(server, "/v1/completions", raw=b'{"prompt": "\xff\xfe"}'), 400, None, None)
    # a surrogate pair is one character, not a lone surrogate
    r = post(server, "/v1/completions",
             raw=b'{"prompt": "smile \\ud83d\\ude42", "max_tokens": 2}')
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(b"smile ") + 4
    assert_healthy(server)


# --- item 4: chat roles and message fields ----------------------------------------------------

BAD_MESSAGES = [
    [{"role": "god", "content": "hi"}],
    [{"role": "USER", "content": "hi"}],
    [{"content": "hi"}],
    [{"role": 5, "content": "hi"}],
    [{"role": "user", "content": "hi", "tool_calls": []}],
    [{"role": "user", "content": 5}],
    [{"role": "user"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": "hi", "name": 7}],
    ["hi"],
    [],
]


def test_chat_roles_and_messages_are_checked(server):
    url = "/v1/chat/completions"
    for messages in BAD_MESSAGES:
        r = post(server, url, {"messages": messages, "max_tokens": 2})
        assert_error(r, 400, "messages", None)
    r = post(server, url, {"messages": [{"role": "god", "content": "hi"}]})
    assert "god" in r.json()["error"]["message"]

    def prompt_tokens(messages) -> int:
        r = post(server, url, {"messages": messages, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    system = prompt_tokens([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "hi", "name": "ann"}])
    developer = prompt_tokens([{"role": "developer", "content": "Be brief."},
                               {"role": "user", "content": "hi"}])
    assert developer == system  # a developer message is a system message
    prompt_tokens([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                   {"role": "tool", "content": "42", "tool_call_id": "c1"},
                   {"role": "user", "content": [{"type": "text", "text": "and?"}]}])
    assert_healthy(server)


# --- item 5: non-streaming clients that leave ---------------------------------------------------

def test_non_streaming_clients_that_leave_are_aborted_at_once(server):
    """8 non-streaming requests that would run for minutes; their clients close after ~1.5 s
    while tokens keep coming. Each is aborted and its pages freed within seconds."""
    before = metrics(server)
    n, max_tokens = 8, 8000
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    socks = []
    for _ in range(n):
        s = socket.create_connection((server.host, server.port), timeout=10)
        s.sendall(head("/v1/completions", length=len(body)).encode() + b"\r\n\r\n" + body)
        socks.append(s)
    deadline = time.time() + 30
    while metrics(server)["nanoserve_requests_running"] < n:
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(1.0)
    for s in socks:
        s.close()
    t0 = time.time()
    m = wait_idle(server.url, timeout=5)
    assert time.time() - t0 < 5
    aborted = 'nanoserve_requests_finished_total{reason="abort"}'
    assert m[aborted] == before.get(aborted, 0) + n
    grew = m["nanoserve_generation_tokens_total"] - before["nanoserve_generation_tokens_total"]
    assert 0 < grew < n * max_tokens / 10
    assert_healthy(server)


# --- item 6: each error names its own parameter and code ------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
LABELS = [  # (endpoint, body, param, code)
    (C, {"prompt": "hi", "seed": 99999999999999999999999}, "seed", None),
    (C, {"prompt": "hi", "temperature": 10**400}, "temperature", None),
    (C, {"prompt": "hi", "logit_bias": {"5": -10**400}}, "logit_bias", None),
    (C, {"prompt": "hi", "seed": -(2**63) - 1}, "seed", None),
    (C, {"prompt": "hi", "seed": "7"}, "seed", None),
    (C, {"prompt": "hi", "seed": 1.5}, "seed", None),
    (C, {"prompt": "hi", "logit_bias": {"99999": 5}}, "logit_bias", None),
    (C, {"prompt": "hi", "logit_bias": {"abc": 5}}, "logit_bias", None),
    (C, {"prompt": "hi", "logit_bias": {"-3": 5}}, "logit_bias", None),
    (C, {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", None),
    (C, {"prompt": "hi", "logit_bias": {"5": "x"}}, "logit_bias", None),
    (C, {"prompt": "hi", "logit_bias": [5]}, "logit_bias", None),
    (C, {"prompt": "hi", "stop_token_ids": [99999]}, "stop_token_ids", None),
    (C, {"prompt": "hi", "stop_token_ids": "x"}, "stop_token_ids", None),
    (C, {"prompt": "hi", "top_k": "a"}, "top_k", None),
    (C, {"prompt": "hi", "top_k": -2}, "top_k", None),
    (C, {"prompt": "hi", "min_p": 2}, "min_p", None),
    (C, {"prompt": "hi", "presence_penalty": 3}, "presence_penalty", None),
    (C, {"prompt": "hi", "frequency_penalty": -2.5}, "frequency_penalty", None),
    (C, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", None),
    (C, {"prompt": "hi", "temperature": "hot"}, "temperature", None),
    (C, {"prompt": "hi", "top_p": 1.5}, "top_p", None),
    (C, {"prompt": "hi", "n": 129}, "n", None),
    (C, {"prompt": "hi", "n": MAX_NUM_SEQS + 1}, "n", None),  # more than the server runs
    (C, {"prompt": "hi", "n": True}, "n", None),
    (C, {"prompt": "hi", "logprobs": 21}, "logprobs", None),
    (C, {"prompt": "hi", "logprobs": True}, "logprobs", None),
    (C, {"prompt": "hi", "stop": ["s"] * 17}, "stop", None),
    (C, {"prompt": "hi", "stop": ["s" * 2000]}, "stop", None),
    (C, {"prompt": "hi", "stop": [""]}, "stop", None),
    (C, {"prompt": "hi", "stop": 5}, "stop", None),
    (C, {"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos", None),
    (C, {"prompt": "hi", "stream": "yes"}, "stream", None),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", None),
    (C, {"prompt": "hi", "stream": True, "stream_options": {"bogus": 1}}, "stream_options",
     None),
    (C, {"prompt": "hi", "max_tokens": 0}, "max_tokens", None),
    (C, {"prompt": "hi", "max_tokens": "5"}, "max_tokens", None),
    (C, {"prompt": []}, "prompt", None),
    (C, {"prompt": [[]]}, "prompt", None),
    (C, {"prompt": ["a", ""]}, "prompt", None),
    (C, {"prompt": ["a", 5]}, "prompt", None),
    (C, {"prompt": [[1, 2], [3, "x"]]}, "prompt", None),
    (C, {"prompt": [-1]}, "prompt", None),
    (C, {"prompt": [[1, 2], [-1]]}, "prompt", None),
    (C, {"prompt": ["hi"] * (MAX_NUM_SEQS + 1)}, "prompt", None),  # more than the server runs
    (C, {"prompt": ["hi", "ho"], "n": MAX_NUM_SEQS // 2 + 1}, "prompt", None),
    (C, {"prompt": ["hi", "grass " * 1400]}, "prompt", "context_length_exceeded"),
    (C, {"prompt": ["hi", "grass " * 1000], "max_tokens": 4}, "prompt", "kv_capacity_exceeded"),
    (C, {"prompt": "hi", "echo": "yes"}, "echo", None),
    (C, {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "stream_options", None),
    (C, {}, "prompt", None),
    (C, {"prompt": "grass " * 1400}, "prompt", "context_length_exceeded"),
    (C, {"prompt": "grass " * 1000, "max_tokens": 4}, "prompt", "kv_capacity_exceeded"),
    (CHAT, {"messages": MSG, "top_logprobs": 21, "logprobs": True}, "top_logprobs", None),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, "top_logprobs", None),
    (CHAT, {"messages": MSG, "logprobs": 3}, "logprobs", None),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens", None),
    (CHAT, {"messages": MSG, "max_completion_tokens": 9000}, "max_completion_tokens",
     "context_length_exceeded"),
    (CHAT, {"messages": MSG, "max_tokens": 9000}, "max_tokens", "context_length_exceeded"),
    (CHAT, {"messages": [{"role": "user", "content": "grass " * 1400}]}, "messages",
     "context_length_exceeded"),
    (CHAT, {"messages": [{"role": "user", "content": "grass " * 1000}], "max_tokens": 4},
     "messages", "kv_capacity_exceeded"),
    (CHAT, {}, "messages", None),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, "response_format", None),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format", None),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", None),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(unclosed"}}}},
     "response_format", None),
]


@pytest.mark.parametrize("endpoint,body,param,code", LABELS,
                         ids=[f"{p}-{i}" for i, (_, _, p, _) in enumerate(LABELS)])
def test_each_error_names_its_parameter_and_code(server, endpoint, body, param, code):
    assert_error(post(server, endpoint, {"model": NAME, **body}), 400, param, code)


def test_valid_edge_values_run(server):
    for body in ({"seed": 2**64 - 1}, {"seed": -(2**63)}, {"logit_bias": {"5": -100}},
                 {"stop_token_ids": [258]}, {"top_k": 0}, {"min_p": 1}, {"n": MAX_NUM_SEQS}):
        r = post(server, C, {"prompt": "hi", "max_tokens": 2, **body})
        assert r.status_code == 200, (body, r.text)
    assert_healthy(server)


# --- item 7: parameters that are not implemented are refused by name ----------------------------

UNSUPPORTED = [  # (endpoint, extra fields, param)
    (CHAT, {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    (CHAT, {"reasoning_effort": "high"}, "reasoning_effort"),
    (C, {"suffix": "the end"}, "suffix"),
    (C, {"best_of": 2}, "best_of"),
    (C, {"best_of": 2, "n": 3}, "best_of"),
]
ACCEPTED = [
    (CHAT, {"response_format": {"type": "text"}}),
    (CHAT, {"response_format": {"type": "json_object"}}),
    (CHAT, {"tool_choice": "none"}),
    (CHAT, {"tool_choice": "auto"}),
    (CHAT, {"tools": []}),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}],
            "parallel_tool_calls": True}),
    (CHAT, {"modalities": ["text"]}),
    (CHAT, {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}),
    (C, {"echo": False, "suffix": None, "best_of": 1}),
    (C, {"best_of": 2, "n": 2}),
    (C, {"user": "u1", "stream": True, "stream_options": {"include_usage": True}}),
]


def test_unsupported_unknown_and_harmless_parameters(server):
    for endpoint, extra, param in UNSUPPORTED:
        base = {"messages": MSG} if endpoint == CHAT else {"prompt": "hi"}
        r = post(server, endpoint, {**base, "max_tokens": 2, **extra})
        err = assert_error(r, 400, param, "unsupported_parameter")
        assert param in err["message"]
    for endpoint in (C, CHAT):
        base = {"messages": MSG} if endpoint == CHAT else {"prompt": "hi"}
        r = post(server, endpoint, {**base, "max_tokens": 2, "foo": 1})
        err = assert_error(r, 400, "foo", "unknown_parameter")
        assert err["message"] == "Unrecognized request argument supplied: 'foo'"
        r = post(server, endpoint, {**base, "max_tokens": 2, "z" * 200_000: 1})
        err = assert_error(r, 400, "z" * 100, "unknown_parameter")
    # a chat-only field on completions is unknown there, and the other way round
    assert_error(post(server, C, {"prompt": "hi", "top_logprobs": 2}), 400, "top_logprobs",
                 "unknown_parameter")
    assert_error(post(server, CHAT, {"messages": MSG, "echo": True}), 400, "echo",
                 "unknown_parameter")
    for endpoint, extra in ACCEPTED:
        base = {"messages": MSG} if endpoint == CHAT else {"prompt": "hi"}
        r = post(server, endpoint, {**base, "max_tokens": 2, **extra})
        assert r.status_code == 200, (extra, r.text)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MSG, max_tokens=2,
                                       functions=[{"name": "f", "parameters": {}}])
    assert (e.value.param, e.value.code) == ("functions", "unsupported_parameter")
    assert_healthy(server)


# --- item 11: API key -----------------------------------------------------------------------------

def test_api_key_guards_every_route_but_health_and_metrics(server):
    expected = {"type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"},
                    {"authorization": KEY}, {"authorization": f"Bearer {KEY}x"}):
        for r in (httpx.post(server.url + C, json=body, headers=headers),
                  httpx.post(server.url + CHAT, json={"messages": MSG}, headers=headers),
                  httpx.get(server.url + "/v1/models", headers=headers),
                  httpx.get(server.url + f"/v1/models/{NAME}", headers=headers),
                  httpx.get(server.url + "/v1/nothing", headers=headers),
                  httpx.post(server.url + "/tokenize", json={"prompt": "hi"}, headers=headers),
                  httpx.post(server.url + "/detokenize", json={"tokens": [1]}, headers=headers),
                  httpx.get(server.url + "/tokenizer_info", headers=headers),
                  httpx.get(server.url + "/nothing", headers=headers)):
            assert r.status_code == 401, (headers, r.request.url, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            err = r.json()["error"]
            assert {k: err[k] for k in expected} == expected
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/v1/models", headers={"authorization": f"bearer {KEY}"}
                     ).status_code == 200
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert e.value.code == "invalid_api_key"
    right = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    r = right.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text == server.ref
    assert right.models.retrieve(NAME).id == NAME
    assert post(server, "/tokenize", {"prompt": "hi"}).json()["count"] == 2
    lm_utils = pytest.importorskip("lm_eval.utils")  # its remote tokenizer sends the key
    assert lm_utils.check_remote_tokenizer_support(server.url + C, auth_token=KEY)
    assert not lm_utils.check_remote_tokenizer_support(server.url + C, max_retries=1)
    assert_healthy(server)


# --- item 12: limits on what a client can make the server hold --------------------------------

def test_only_json_bodies_are_read(server):
    raw = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                  "application/json; charset=latin-1", "application/jsonx", ""):
        r = httpx.post(server.url + C, content=raw, headers={**AUTH, "content-type": ctype})
        assert_error(r, 415, None, "unsupported_media_type")
    for ctype in ("application/json; charset=utf-8", "Application/JSON", "application/json;"):
        r = httpx.post(server.url + C, content=raw, headers={**AUTH, "content-type": ctype})
        assert r.status_code == 200, (ctype, r.text)
    assert_healthy(server)


def test_bodies_too_big_are_refused_before_they_are_read(server):
    # by Content-Length: answered at once, with only a sliver of the body sent
    t0 = time.time()
    status, headers, body = raw_http(server, head(C, length=50_000_000), b'{"prompt": "')
    assert status == 413 and headers["connection"] == "close"
    err = json.loads(body)["error"]
    assert (err["type"], err["param"], err["code"]) == (
        "invalid_request_error", None, "request_too_large")
    assert str(MAX_BODY) in err["message"]
    assert time.time() - t0 < 5
    # chunked, no Content-Length: counted as it arrives
    piece = b"x" * 65536
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece)
                      for _ in range(MAX_BODY // len(piece) + 1))
    status, headers, body = raw_http(server, head(C, "transfer-encoding: chunked"),
                                     b'9\r\n{"prompt"\r\n' + chunks)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    # just under the limit is read (and refused for what it says, not its size)
    big = {"prompt": "hi", "user": "u" * (MAX_BODY - 100)}
    r = post(server, C, big)
    assert r.status_code == 200, r.text[:200]
    assert_healthy(server)


def test_slow_bodies_time_out(server):
    t0 = time.time()
    status, headers, body = raw_http(server, head(C, length=100), b'{"prompt": ')
    took = time.time() - t0
    assert status == 408 and headers["connection"] == "close"
    err = json.loads(body)["error"]
    assert (err["type"], err["param"], err["code"]) == (
        "invalid_request_error", None, "request_timeout")
    assert BODY_TIMEOUT_S - 0.1 <= took < BODY_TIMEOUT_S + 5
    assert_healthy(server)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_dropping_mid_body_is_one_log_line(server):
    handler = Records()
    loggers = [logging.getLogger(n) for n in ("nanoserve.serve", "uvicorn.error", "uvicorn")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
    logging.getLogger("nanoserve.serve").setLevel(logging.INFO)
    try:
        raw_http(server, head(C, length=1000), b'{"prompt": "hel', close_after=0.2)
        deadline = time.time() + 5
        while not handler.records:
            assert time.time() < deadline, "nothing logged"
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
    assert len(handler.records) == 1, [r.getMessage() for r in handler.records]
    record = handler.records[0]
    assert record.name == "nanoserve.serve" and record.exc_info is None
    assert "disconnected while sending the request body" in record.getMessage()
    assert "\n" not in record.getMessage()
    assert_healthy(server)


def test_error_messages_quote_short_prefixes(server):
    huge = "q" * 500_000
    cases = [
        (C, {"model": huge, "prompt": "hi"}, 404, "model", "model_not_found"),
        (C, {"prompt": "hi", "temperature": huge}, 400, "temperature", None),
        (C, {"prompt": "hi", "stop": [huge]}, 400, "stop", None),
        (C, {"prompt": "hi", "logit_bias": {huge: 1}}, 400, "logit_bias", None),
        (C, {"prompt": "hi", "seed": huge}, 400, "seed", None),
        (C, {"prompt": "hi", "max_tokens": huge}, 400, "max_tokens", None),
        (CHAT, {"messages": [{"role": huge, "content": "hi"}]}, 400, "messages", None),
        (CHAT, {"messages": [{"role": "user", "content": "hi", huge: 1}]}, 400, "messages",
         None),
    ]
    for endpoint, body, status, param, code in cases:
        r = post(server, endpoint, body)
        err = assert_error(r, status, param, code)
        assert len(err["message"]) < 300, (param, len(err["message"]))
    r = httpx.get(server.url + "/v1/models/" + "m" * 5000, headers=AUTH)
    err = assert_error(r, 404, "model", "model_not_found")
    assert len(err["message"]) < 300
    assert_healthy(server)


def test_too_many_sequences_in_flight_get_503_with_retry_after(server):
    """max_waiting_requests=0: at most max_num_seqs sequences in flight. One request of n=16
    fills them; the next request is refused until they finish."""
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 4000, "n": MAX_NUM_SEQS,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + C, json=body, headers=AUTH, timeout=60) as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        for endpoint, base in ((C, {"prompt": "hi"}), (CHAT, {"messages": MSG})):
            r = post(server, endpoint, {**base, "max_tokens": 2})
            err = assert_error(r, 503, None, "server_overloaded", "server_error")
            assert r.headers["retry-after"] == "1"
            assert "overloaded" in err["message"]
    wait_idle(server.url)
    assert_healthy(server)
