"""`echo` on /v1/completions: the prompt before each completion's text, and with `logprobs` the
prompt tokens' logprobs first (the first token's null), as lm-eval's loglikelihood requests read
them; `max_tokens: 0` scores the prompt alone. Logprobs equal transformers' log_softmax on the
embedded model's weights (float32) within 1e-4, plain and streamed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
transformers = pytest.importorskip("transformers")

from test_server import ENGINE, NAME, PROMPT, ServerThread, sse_events  # noqa: E402

import nanoserve  # noqa: E402
from nanoserve import LLM  # noqa: E402
from nanoserve.serve.app import build_app  # noqa: E402
from nanoserve.serve.async_engine import AsyncEngine  # noqa: E402

EMBEDDED = Path(nanoserve.__file__).parent / "assets" / "tiny-qwen3"
C = "/v1/completions"
TOL = 1e-4
K = 3


@pytest.fixture(scope="module")
def server():
    llm = LLM(progress=False, **ENGINE)
    srv = ServerThread(build_app(AsyncEngine(llm.engine), NAME))
    srv.engine, srv.tok = llm.engine, llm.engine.tokenizer
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(EMBEDDED), dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """Row i: the distribution of token i + 1 given tokens 0..i."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def complete(server, prompt, **kw) -> dict:
    body = {"model": NAME, "prompt": prompt, "temperature": 0, **kw}
    r = httpx.post(server.url + C, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(server, prompt, **kw) -> list[dict]:
    body = {"model": NAME, "prompt": prompt, "temperature": 0, "stream": True, **kw}
    with httpx.stream("POST", server.url + C, json=body, timeout=120) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    return [e for e in events[:-1] if e["choices"]]


def assert_prompt_logprobs(server, hf, lp: dict, ids: list[int], text: str, k: int) -> None:
    """The first len(ids) entries of a completions logprobs object are the prompt's, against
    transformers: token strings, offsets into `text`, logprobs and the top k."""
    rows = hf_logprobs(hf, ids)
    n = len(ids)
    assert lp["tokens"][:n] == [server.tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = torch.tensor(lp["token_logprobs"][1:n])
    want = rows[torch.arange(n - 1), torch.tensor(ids[1:])]
    assert torch.allclose(got, want, atol=TOL), (got - want).abs().max()
    for i in range(1, n):
        top = lp["top_logprobs"][i]
        values, top_ids = rows[i - 1].topk(k)
        assert list(top) == [server.tok.decode([t]) for t in top_ids.tolist()]
        assert list(top.values()) == pytest.approx(values.tolist(), abs=TOL)
    offsets = (lp["text_offset"] + [len(text)])[:n + 1]
    pieces = [text[offsets[i]:offsets[i + 1]] for i in range(n)]
    assert pieces == lp["tokens"][:n]  # each token's text starts at its offset


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, hf):
    ids = server.engine.tokenize(PROMPT)
    r = complete(server, PROMPT, echo=True, max_tokens=0, logprobs=K)
    (choice,) = r["choices"]
    assert (choice["text"], choice["finish_reason"]) == (PROMPT, "length")
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert_prompt_logprobs(server, hf, choice["logprobs"], ids, PROMPT, K)
    assert r["usage"]["prompt_tokens"] == len(ids)
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["total_tokens"] == len(ids)
    plain = complete(server, PROMPT, echo=True, max_tokens=0)["choices"][0]
    assert (plain["text"], plain["logprobs"]) == (PROMPT, None)


def test_echo_puts_the_prompt_before_the_generated_text_and_its_logprobs(server, hf):
    ids = server.engine.tokenize(PROMPT)
    alone = complete(server, PROMPT, max_tokens=6, logprobs=K)["choices"][0]
    r = complete(server, PROMPT, echo=True, max_tokens=6, logprobs=K)
    (choice,) = r["choices"]
    assert choice["text"] == PROMPT + alone["text"]
    assert choice["finish_reason"] == alone["finish_reason"]
    lp, n = choice["logprobs"], len(ids)
    assert_prompt_logprobs(server, hf, lp, ids, choice["text"], K)
    assert lp["tokens"][n:] == alone["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(alone["logprobs"]["token_logprobs"],
                                                     abs=TOL)
    assert lp["text_offset"][n:] == [len(PROMPT) + o for o in alone["logprobs"]["text_offset"]]
    assert r["usage"]["completion_tokens"] == 6
    plain = complete(server, PROMPT, echo=True, max_tokens=6)["choices"][0]
    assert (plain["text"], plain["logprobs"]) == (PROMPT + alone["text"], None)


def test_lm_evals_loglikelihood_request(server, hf):
    """Its payload as it sends it: token-id prompts in a batch, max_tokens 1, logprobs 1; it
    reads token_logprobs[ctxlen:-1], the last entry being the generated token's."""
    prompts = [server.engine.tokenize(p) for p in
               (PROMPT, "The secret number is 4821. The secret number is 4821")]
    r = complete(server, prompts, max_tokens=1, logprobs=1, seed=1234, echo=True)
    assert [c["index"] for c in r["choices"]] == [0, 1]
    for ids, choice in zip(prompts, r["choices"], strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1
        assert_prompt_logprobs(server, hf, lp, ids, choice["text"], 1)
        rows = hf_logprobs(hf, ids)
        generated = rows[-1].argmax().item()  # greedy
        assert lp["tokens"][-1] == server.tok.decode([generated])
        assert lp["token_logprobs"][-1] == pytest.approx(rows[-1, generated].item(), abs=TOL)
        assert choice["text"] == server.tok.decode(ids + [generated])
    assert r["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert r["usage"]["completion_tokens"] == 2


def test_echo_of_a_prompt_the_prefix_cache_holds_is_still_scored(server, hf):
    prompt = "A prompt long enough to fill several pages of the prefix cache, " * 3
    ids = server.engine.tokenize(prompt)
    complete(server, prompt, max_tokens=2)  # its pages are cached now
    r = complete(server, prompt, echo=True, max_tokens=0, logprobs=K)
    assert_prompt_logprobs(server, hf, r["choices"][0]["logprobs"], ids, prompt, K)


def test_echo_with_n_and_batched_prompts_echoes_each_choices_own_prompt(server):
    prompts = [PROMPT, "Once upon a time"]
    r = complete(server, prompts, echo=True, n=2, max_tokens=3, logprobs=0)
    for i, prompt in enumerate(prompts):
        alone = complete(server, prompt, max_tokens=3)["choices"][0]["text"]
        n = len(server.engine.tokenize(prompt))
        for j in range(2):
            choice = r["choices"][i * 2 + j]
            assert choice["text"] == prompt + alone
            assert len(choice["logprobs"]["tokens"]) == n + 3
            assert choice["logprobs"]["top_logprobs"][1] == {}  # logprobs 0: no alternatives


def test_token_id_prompts_echo_as_they_decode_special_tokens_included(server):
    ids = server.engine.tokenize("Hi <|im_end|> there")
    assert 258 in ids
    r = complete(server, ids, echo=True, max_tokens=0)
    assert r["choices"][0]["text"] == "Hi <|im_end|> there"


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_streamed_echo_sends_the_prompt_first_and_equals_the_plain_answer(server, hf,
                                                                          max_tokens):
    prompts = [PROMPT, "Once upon a time"]
    kw = dict(echo=True, max_tokens=max_tokens, logprobs=K, n=2)
    plain = complete(server, prompts, **kw)
    chunks = streamed(server, prompts, **kw)
    texts = [""] * 4
    logprobs: list[dict | None] = [None] * 4
    for c in chunks:
        (choice,) = c["choices"]
        i = choice["index"]
        if logprobs[i] is None:  # the choice's first chunk: its prompt and its logprobs
            prompt = prompts[i // 2]
            assert choice["text"] == prompt
            assert_prompt_logprobs(server, hf, choice["logprobs"],
                                   server.engine.tokenize(prompt), prompt, K)
            logprobs[i] = {key: [] for key in choice["logprobs"]}
        texts[i] += choice["text"]
        for key, values in (choice["logprobs"] or {}).items():
            logprobs[i][key] += values
        if choice["finish_reason"] is not None:
            assert choice["finish_reason"] == plain["choices"][i]["finish_reason"]
    for i, want in enumerate(plain["choices"]):
        assert texts[i] == want["text"]
        got, exp = logprobs[i], want["logprobs"]
        assert (got["tokens"], got["text_offset"]) == (exp["tokens"], exp["text_offset"])
        assert got["token_logprobs"][1:] == pytest.approx(exp["token_logprobs"][1:], abs=TOL)


def test_max_tokens_0_needs_echo(server):
    r = httpx.post(server.url + C, json={"prompt": "hi", "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
