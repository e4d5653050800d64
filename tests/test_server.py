"""`nanoserve serve` with the real openai client, on the CPU with the embedded model."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.models.config import ModelConfig  # noqa: E402
from nanoserve.models.loader import resolve_model_dir  # noqa: E402
from nanoserve.serve.app import build_app  # noqa: E402
from nanoserve.serve.async_engine import AsyncEngine  # noqa: E402
from nanoserve.serve.detokenizer import IncrementalDetokenizer  # noqa: E402

NAME = "tiny-qwen3"
_MC = ModelConfig.from_dir(resolve_model_dir(""))
KV_TOKENS = 5120  # fewer than max_model_len: some prompts fit max_model_len but not the KV
ENGINE = dict(device="cpu", dtype="float32", page_size=16, max_model_len=8192, max_num_seqs=16,
              gpu_kv_budget_gib=KV_TOKENS * _MC.num_layers * 2 * _MC.num_kv_heads
              * _MC.head_dim * 4 / 2**30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    def __init__(self, app) -> None:
        port = free_port()
        cfg = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server():
    llm = LLM(progress=False, **ENGINE)
    ae = AsyncEngine(llm.engine)
    srv = ServerThread(build_app(ae, NAME))
    srv.engine = llm.engine
    yield srv
    srv.stop()
    assert not ae.alive


@pytest.fixture(scope="module")
def ref_llm():
    return LLM(progress=False, **ENGINE)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def greedy(ref_llm, prompt, max_tokens, **kw):
    return ref_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                   **kw))[0]


def chat_ids(ref_llm, content: str) -> list[int]:
    tok = ref_llm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                   add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def metrics(server) -> dict[str, float]:
    """/metrics as {sample name with its labels but the model's: value}."""
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            key = re.sub(r',?model="[^"]*"', "", key).replace("{,", "{").replace("{}", "")
            out[key] = float(value)
    return out


def wait_idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Waits until no sequence runs or waits and no KV page is used; returns the metrics."""
    srv = type("S", (), {"url": url})
    deadline = time.time() + timeout
    while True:
        m = metrics(srv)
        if (m["nanoserve_requests_running"], m["nanoserve_requests_waiting"],
                m['nanoserve_kv_pages_used{device="cpu",tier="device"}'],
                m['nanoserve_kv_pages_used{device="cpu",tier="host"}']) == (0, 0, 0, 0):
            return m
        assert time.time() < deadline, m
        time.sleep(0.05)


def sse_events(lines) -> list:
    """The JSON payloads of server-sent events, and "[DONE]"."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


PROMPT = "The grass is green and the sky"


def test_completion_equals_llm_generate(server, client, ref_llm):
    ref = greedy(ref_llm, PROMPT, 40)
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=40, temperature=0)
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=40,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 5  # token by token


def test_chat_completion_equals_llm_generate(server, client, ref_llm):
    question = "What is the secret number in the text above?"
    ref = greedy(ref_llm, chat_ids(ref_llm, question), 48)
    messages = [{"role": "user", "content": question}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=48,
                                       temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=48,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_response_format_json_schema_through_the_openai_client(server, client):
    """The embedded model knows no JSON: a strict json_schema response_format makes every
    sampled answer, plain and streamed, parse and validate; a schema that does not compile is
    a 400 naming response_format, and the server goes on serving."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
              "properties": {"city": {"type": "string", "maxLength": 10},
                             "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": schema,
                                                  "strict": True}}
    messages = [{"role": "user", "content": "Plan a trip as JSON."}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=60, n=8,
                                       temperature=1.0, seed=5, response_format=fmt)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=60,
                                            temperature=1.0, seed=6, response_format=fmt,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=4,
                                       response_format=bad)
    assert e.value.param == "response_format" and "nonsense" in e.value.message
    assert client.chat.completions.create(model=NAME, messages=messages,
                                          max_tokens=2).choices[0].finish_reason == "length"


def test_stop_strings_cut_streamed_and_plain_text_alike(server, client, ref_llm):
    ref = greedy(ref_llm, PROMPT, 40).text
    stop = ref[10:13]
    assert stop and stop in ref
    plain = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=40, temperature=0,
                                      stop=[stop]).choices[0]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop, stream=True))
    assert plain.text == streamed == ref[:ref.find(stop)]
    assert plain.finish_reason == "stop"


def test_streaming_splits_no_multibyte_character():
    """A model scripted to emit the bytes of non-ASCII text one token at a time: multi-byte
    characters arrive split across tokens, and the stream must still carry whole characters."""
    text = "héllo wörld ✓ 日本語 🙂 end"
    llm = LLM(progress=False, **ENGINE, async_scheduling=False)  # every step through run()
    script = llm.tokenizer.encode(text, add_special_tokens=False)
    assert len(script) == len(text.encode())
    real_run = llm.engine.runner.run

    def scripted(batch):
        return [None if t is None else script[seq.num_output_tokens % len(script)]
                for seq, t in zip(batch.seqs, real_run(batch), strict=True)]

    llm.engine.runner.run = scripted
    srv = ServerThread(build_app(AsyncEngine(llm.engine), NAME))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        kw = dict(model=NAME, prompt="Say it:", max_tokens=len(script), temperature=0)
        pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kw)]
        assert "".join(pieces) == text == client.completions.create(**kw).choices[0].text
        assert not any("\ufffd" in p for p in pieces)
        assert len([p for p in pieces if p]) >= 15  # streamed piece by piece, not at the end
    finally:
        srv.stop()


def test_incremental_detokenizer_never_splits_a_character(ref_llm):
    tok = ref_llm.tokenizer
    text = "héllo wörld ✓ 日本語 🙂 end"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())  # byte-level: multi-byte characters span tokens
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_usage_reports_prompt_tokens_served_by_the_prefix_cache(server, client):
    """A 70-token prompt sent three times: the 2nd and 3rd (streamed) reuse its 4 full pages
    (64 tokens), report them as cached_tokens, and /metrics counts the hits."""
    prompt = torch.randint(0, 250, (70,), generator=torch.Generator().manual_seed(77)).tolist()
    before = metrics(server)
    kw = dict(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
    first, second = (client.completions.create(**kw) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 64
    assert second.choices[0].text == first.choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 64
    m = metrics(server)
    hits = "nanoserve_prefix_cache_hits_total"
    assert m[hits] - before.get(hits, 0) == 128
    assert m["nanoserve_prefix_cache_pages"] >= 4 and 0 < m["nanoserve_prefix_cache_hit_rate"]


def test_incremental_detokenizer_windows_stay_short_over_invalid_bytes(ref_llm):
    """200 tokens of lone continuation bytes (never a character): each call decodes a short
    window, and the text equals decoding everything at once."""
    tok = ref_llm.tokenizer
    bad = tok.encode("\u00e9", add_special_tokens=False)[-1]  # the continuation byte 0xA9
    ids = tok.encode("ok ", add_special_tokens=False) + [bad] * 200 + \
        tok.encode(" end \u65e5", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    widths = []
    real = detok._decode
    detok._decode = lambda window: (widths.append(len(window)), real(window))[1]
    text = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert max(widths) <= 4 + 4 + 1  # context + pending + the new token


def test_sixteen_concurrent_streams(server, ref_llm):
    prompts = [" ".join(["grass"] * (3 + 5 * i)) for i in range(16)]
    max_tokens = [8 + 7 * i for i in range(16)]
    refs = ref_llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m)
                                      for m in max_tokens])

    async def one(client, prompt, m):
        text = ""
        async for c in await client.completions.create(model=NAME, prompt=prompt, max_tokens=m,
                                                       temperature=0, stream=True):
            text += c.choices[0].text
        return text

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*(one(client, p, m)
                                      for p, m in zip(prompts, max_tokens, strict=True)))

    texts = asyncio.run(main())
    assert texts == [r.text for r in refs]


BAD = [  # (body or raw bytes, status, error param, error code): exact
    (b'{"model": "tiny-qwen3", "prompt": ', 400, None, None),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
    ({"prompt": "grass " * 1500, "max_tokens": 4}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", None),
    ({"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens", "context_length_exceeded"),
    ({"prompt": "hi", "max_tokens": 8191}, 400, "max_tokens", "context_length_exceeded"),
    ({"prompt": "hi", "temperature": 3.5}, 400, "temperature", None),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ({"prompt": [1, 2, 99999]}, 400, "prompt", None),
    ({"prompt": ""}, 400, "prompt", None),
    ({"prompt": "hi", "n": 0}, 400, "n", None),
    ({"prompt": "grass " * 1000, "max_tokens": 4}, 400, "prompt", "kv_capacity_exceeded"),
]


def test_bad_requests_get_openai_errors_while_a_good_one_runs(server, client, ref_llm):
    ref = greedy(ref_llm, PROMPT, 100, ignore_eos=True)
    result = {}

    def good():
        chunks = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=100,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        result["text"] = "".join(c.choices[0].text for c in chunks)

    t = threading.Thread(target=good)
    t.start()
    url = server.url + "/v1/completions"
    for body, status, param, code in BAD:
        if isinstance(body, bytes):
            r = httpx.post(url, content=body, headers={"content-type": "application/json"})
        else:
            r = httpx.post(url, json={"model": NAME, **body} if "model" not in body else body)
        what = body if isinstance(body, bytes) else str(body)[:80]
        assert r.status_code == status, (what, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error", (what, err)
        assert (err["param"], err["code"]) == (param, code), (what, err)
    chat = httpx.post(server.url + "/v1/chat/completions",
                      json={"model": NAME, "messages": "hello"})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    t.join(120)
    assert result["text"] == ref.text  # the good request was not disturbed


def test_disconnect_mid_stream_frees_the_request(server):
    before = metrics(server)
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 3000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert metrics(server)["nanoserve_requests_running"] == 1
        assert metrics(server)['nanoserve_kv_pages_used{device="cpu",tier="device"}'] > 0
    m = wait_idle(server.url)
    aborted = 'nanoserve_requests_finished_total{reason="abort"}'
    assert m[aborted] == before.get(aborted, 0) + 1
    assert m["nanoserve_generation_tokens_total"] < before["nanoserve_generation_tokens_total"] \
        + 3000


def test_models_health_metrics(server, client):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [NAME]
    card = client.models.retrieve(NAME)
    assert (card.id, card.object, card.owned_by) == (NAME, "model", "nanoserve")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body == {"message": "The model 'gpt-4' does not exist", "param": "model",
                            "code": "model_not_found", "type": "invalid_request_error"}
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    before = metrics(server)
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6
    m = metrics(server)
    pages = server.engine.kv.capacity
    assert m["nanoserve_kv_pages_total"] == pages == KV_TOKENS // 16 - 1  # page 0: dummy
    assert m["nanoserve_requests_waiting"] == 0
    assert m["nanoserve_generation_tokens_total"] == \
        before["nanoserve_generation_tokens_total"] + 6
    assert m["nanoserve_prompt_tokens_total"] == \
        before["nanoserve_prompt_tokens_total"] + r.usage.prompt_tokens
    stop = 'nanoserve_requests_finished_total{reason="length"}'
    assert m[stop] == before.get(stop, 0) + 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        key = f"nanoserve_{name}_count"
        assert m[key] == before.get(key, 0) + 1, name
        assert m[f'nanoserve_{name}_bucket{{le="+Inf"}}'] == m[key]
    key = "nanoserve_time_per_output_token_seconds_count"
    assert m[key] == before.get(key, 0) + 5  # one per token after the first
    text = httpx.get(server.url + "/metrics")
    assert text.headers["content-type"].startswith("text/plain")
    assert f'nanoserve_requests_running{{model="{NAME}"}}' in text.text


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_serve_command_shuts_down_cleanly_on_sigterm():
    """`nanoserve serve` with an API key from the environment: /v1 needs it, /health does not;
    SIGTERM during a stream ends the stream with an error event and [DONE], not a cut
    connection, and the process exits 0."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanoserve", "serve", "--device", "cpu", "--port", str(port),
         "--max-model-len", "1024"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "NANOSERVE_API_KEY": "sk-test"})
    auth = {"authorization": "Bearer sk-test"}
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline
            time.sleep(0.2)
        short = {"prompt": "The sky", "max_tokens": 5, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=short)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(url + "/v1/completions", json=short, headers=auth)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        body = {"prompt": "The sky", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60,
                          headers=auth) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = sse_events([first, *lines])
        assert rest[-1] == "[DONE]"
        assert rest[-2]["error"]["type"] == "server_error", rest[-2]
        assert rest[-2]["error"]["code"] == "server_shutting_down", rest[-2]
        assert all("choices" in e for e in rest[:-2])
        assert proc.wait(30) == 0
        out = proc.stdout.read().decode()
        assert "Finished server process" in out or "Shutting down" in out, out
    finally:
        proc.kill()


def test_the_engine_thread_builds_its_per_thread_state_first():
    """cuDNN's plans are cached per thread: the loop's own thread builds them before its first
    step (LLMEngine.prepare_thread), then serves."""
    llm = LLM(progress=False, **ENGINE)
    ref = greedy(llm, PROMPT, 8, ignore_eos=True).text
    built = []
    llm.engine.runner.build_prefill_plans = \
        lambda progress=False: built.append(threading.current_thread().name)
    srv = ServerThread(build_app(AsyncEngine(llm.engine), NAME))
    try:
        r = httpx.post(srv.url + "/v1/completions",
                       json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
        assert built == ["nanoserve-engine"]
    finally:
        srv.stop()


def test_engine_failure_fails_requests_and_reports_unhealthy():
    """A device failure kills the engine loop: requests fail with 500, /health turns 503, new
    requests get 503."""
    llm = LLM(progress=False, **ENGINE)
    ae = AsyncEngine(llm.engine)

    def broken(batch):
        raise RuntimeError("CUDA error: device lost")

    llm.engine.runner.run = broken
    srv = ServerThread(build_app(ae, NAME))
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "server_error"
        assert httpx.get(srv.url + "/health").status_code == 503
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    finally:
        srv.stop()


def test_a_failed_step_fails_only_its_own_request():
    """The runner raises (not a device failure) whenever a batch holds the marked request: that
    request gets an error in OpenAI's shape, streaming or not; a concurrent good request
    returns exactly the reference text, /health stays 200 and nothing leaks."""
    llm = LLM(progress=False, **ENGINE)
    ref = greedy(llm, PROMPT, 24, ignore_eos=True).text
    mark = 255
    real_run = llm.engine.runner.run

    def run(batch):
        if any(seq.token_ids[0] == mark for seq in batch.seqs):
            raise ValueError("boom: marked request")
        return real_run(batch)

    llm.engine.runner.run = run
    srv = ServerThread(build_app(AsyncEngine(llm.engine), NAME))
    url = srv.url + "/v1/completions"
    try:
        async def main():
            async with httpx.AsyncClient(timeout=60) as http:
                async def good():
                    r = await http.post(url, json={"prompt": PROMPT, "max_tokens": 24,
                                                   "temperature": 0, "ignore_eos": True})
                    return r.json()["choices"][0]["text"]

                async def bad_plain():
                    return await http.post(url, json={"prompt": [mark, 1, 2], "max_tokens": 8})

                async def bad_stream():
                    async with http.stream("POST", url, json={
                            "prompt": [mark, 3], "max_tokens": 8, "stream": True}) as r:
                        return r.status_code, sse_events([x async for x in r.aiter_lines()])

                return await asyncio.gather(good(), bad_plain(), bad_stream(), good())

        text, plain, (status, events), text2 = asyncio.run(main())
        assert text == text2 == ref
        assert plain.status_code == 500
        assert plain.json()["error"] == {"message": "ValueError: boom: marked request",
                                         "type": "server_error", "param": None, "code": None}
        assert status == 200 and len(events) == 2 and events[1] == "[DONE]"
        assert events[0]["error"]["message"] == "ValueError: boom: marked request"
        assert events[0]["error"]["type"] == "server_error"
        assert httpx.get(srv.url + "/health").status_code == 200
        m = wait_idle(srv.url)
        assert m['nanoserve_requests_finished_total{reason="error"}'] == 2
        assert m['nanoserve_requests_finished_total{reason="length"}'] == 2
    finally:
        srv.stop()


@pytest.mark.gpu
def test_64_concurrent_requests_with_offload_match_offload_off():
    """64 streaming needle requests (512 to 4,040 tokens) through a server whose engine streams
    half of the layers: every answer finds its secret and equals a resident engine's answer;
    prints throughput and TTFT percentiles. (Needle answers are confident, so bf16 batches of
    different composition give the same greedy tokens; free-running text would not.)"""
    import random

    from nanoserve.needle import NeedleBuilder

    common = dict(progress=False, max_model_len=4200, max_num_seqs=64)
    off = LLM(**common)
    builder, rng = NeedleBuilder(off.tokenizer), random.Random(0)
    needles = [builder.build(512 + 56 * i, (i % 11) / 10, rng) for i in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    refs = [o.text for o in off.generate([n.token_ids for n in needles], params)]
    assert all(n.secret in r for n, r in zip(needles, refs, strict=True))
    del off
    torch.cuda.empty_cache()
    llm = LLM(enable_offload=True, resident_layers=2, **common)
    assert llm.engine.kv.plan.streamed_layers == 2
    srv = ServerThread(build_app(AsyncEngine(llm.engine), NAME))

    async def one(client, ids):
        t0 = time.perf_counter()
        ttft, text, n_out = None, "", 0
        async for c in await client.completions.create(
                model=NAME, prompt=ids, max_tokens=48, temperature=0, stream=True,
                stream_options={"include_usage": True}):
            if ttft is None and c.choices and c.choices[0].text:
                ttft = time.perf_counter() - t0
            text += c.choices[0].text if c.choices else ""
            if c.usage is not None:
                n_out = c.usage.completion_tokens
        return text, ttft, n_out

    async def main():
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*(one(client, n.token_ids) for n in needles))

    try:
        t0 = time.perf_counter()
        results = asyncio.run(main())
        wall = time.perf_counter() - t0
    finally:
        srv.stop()
    assert [t for t, _, _ in results] == refs
    ttfts = sorted(t for _, t, _ in results)
    out_tokens = sum(n for _, _, n in results)
    prompt_tokens = sum(len(n.token_ids) for n in needles)
    print(json.dumps({"requests": 64, "prompt_tokens": prompt_tokens,
                      "output_tokens": out_tokens, "wall_s": round(wall, 3),
                      "output_tokens_per_s": round(out_tokens / wall, 1),
                      "total_tokens_per_s": round((prompt_tokens + out_tokens) / wall, 1),
                      "ttft_p50_ms": round(ttfts[31] * 1e3, 1),
                      "ttft_p99_ms": round(ttfts[63] * 1e3, 1)}))
