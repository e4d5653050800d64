"""OpenAI API request parsing and response shapes (completions and chat completions).

Requests are validated by hand so that every problem becomes a 4xx in OpenAI's error shape:
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from nanoserve.sampling_params import SamplingParams

MAX_STOP_STRINGS = 16


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type_)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass
class ParsedRequest:
    chat: bool
    prompt: str | list[int] | None  # completions
    messages: list[dict[str, str]] | None  # chat
    max_tokens: int | None  # None: fill up to the model's length (capped by the server)
    params: SamplingParams  # max_tokens set once the prompt length is known
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise APIError(400, f"'{name}' must be {kind} in [{lo}, {hi}], got {value!r}", name)
    return value


def parse_request(body: Any, chat: bool, served_model: str) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise APIError(404, f"model {model!r} does not exist; this server serves "
                            f"{served_model!r}", "model", "model_not_found")
    if body.get("n", 1) != 1:
        raise APIError(400, "only n=1 is supported", "n")
    for name in ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "tools"):
        value = body.get(name)
        if value not in (None, False) and not (name == "best_of" and value == 1):
            raise APIError(400, f"'{name}' is not supported", name)
    prompt = messages = None
    if chat:
        messages = parse_messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool)
                                     for t in prompt):
                raise APIError(400, "'prompt' must be a string, or a list of token ids",
                               "prompt")
        elif not isinstance(prompt, str) or not prompt:
            raise APIError(400, "'prompt' must be a non-empty string", "prompt")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None and not chat:
        max_tokens = 16  # OpenAI's default for completions
    if max_tokens is not None:
        max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", None, 1, 2**31 - 1, True)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or \
            not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"'stop' must be a non-empty string or a list of at most "
                            f"{MAX_STOP_STRINGS} of them", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise APIError(400, "'seed' must be an integer", "seed")
    top_p = float(_number(body, "top_p", 1.0, 0.0, 1.0))
    if top_p == 0.0:
        raise APIError(400, "'top_p' must be > 0", "top_p")
    params = SamplingParams(
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)), top_p=top_p,
        top_k=int(_number(body, "top_k", -1, -1, 2**31 - 1, True)),
        max_tokens=1, seed=seed, stop=stop, ignore_eos=bool(body.get("ignore_eos", False)))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options")
    return ParsedRequest(chat, prompt, messages, max_tokens, params, stream,
                         bool(options.get("include_usage", False)))


def parse_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, "each message needs a 'role' and 'content'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and
                       isinstance(p.get("text"), str) for p in content):
                raise APIError(400, "only text content parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, "message 'content' must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(req_id: str, model: str, chat: bool, text: str, finish_reason: str,
                    prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": req_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk_body(req_id: str, model: str, chat: bool, text: str | None,
               finish_reason: str | None, role: bool = False) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if chat:
        delta: dict[str, str] = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": req_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}
