"""OpenAI API request parsing and response shapes (completions and chat completions).

Requests are checked field by field so that every problem becomes a 4xx in OpenAI's error shape,
{"error": {"message", "type", "param", "code"}}, naming the field at fault: the numeric rules
are SamplingParams' own (one rule for the Python API and the server), the request's shape is
checked here. Every field is either honoured or refused; none is silently ignored, except the
few that only describe the request (`user`, `metadata`, `store`, ...).
"""

from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from nanoserve.errors import InvalidParameter
from nanoserve.outputs import TokenLogprobs
from nanoserve.sampling_params import MAX_LOGPROBS, SamplingParams
from nanoserve.structured_outputs import StructuredOutputs

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1024  # characters per stop string
MAX_NESTING = 64  # JSON nesting the API ever needs is a handful of levels
MAX_QUOTE = 100  # characters of a client's value quoted back in an error message
MAX_MESSAGE = 1000  # characters of any error message
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
LOGPROB_FLOOR = -9999.0  # JSON has no -inf

# fields honoured by both endpoints; extensions marked
_COMMON = {"model", "stream", "stream_options", "max_tokens", "n", "temperature", "top_p",
           "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
           "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids"}  # extensions
# fields that only describe the request: accepted, type-checked, no effect on the output
_DESCRIPTIVE = {"user": str, "metadata": dict, "store": bool, "service_tier": str,
                "prompt_cache_key": str, "safety_identifier": str}
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs",
                          "response_format", "functions", "function_call", "tools",
                          "tool_choice", "parallel_tool_calls", "audio", "modalities",
                          "prediction", "reasoning_effort", "web_search_options", "verbosity",
                          "chat_template_kwargs"}  # extension (vLLM's)
_STREAM_OPTIONS = {"include_usage", "include_obfuscation",
                   "continuous_usage_stats"}  # vLLM's: usage on every chunk
_MESSAGE_FIELDS = {"role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content"}


def short(value: Any, limit: int = MAX_QUOTE) -> str:
    """A client's value as quoted in an error message: at most `limit` characters."""
    text = value if isinstance(value, str) else repr(value)
    return repr(text[:limit]) + "..." if len(text) > limit else repr(text)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        if len(message) > MAX_MESSAGE:
            message = message[:MAX_MESSAGE] + "..."
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type_)
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def unsupported(name: str, why: str = "is not supported by this server") -> APIError:
    return APIError(400, f"'{name}' {why}", name, "unsupported_parameter")


@dataclass
class ParsedRequest:
    chat: bool
    prompts: list[str | list[int]] | None  # completions: one or more prompts
    messages: list[dict[str, str]] | None  # chat
    max_tokens: int | None  # None: fill up to the model's length (capped by the server)
    max_tokens_param: str  # the field the client set it with
    params: SamplingParams  # max_tokens set once the prompt length is known
    stream: bool
    include_usage: bool  # a last chunk with the request's usage
    continuous_usage: bool = False  # usage so far on every chunk
    echo: bool = False  # completions: the prompt before each completion's text
    tools: Any = None  # chat: tools.ToolRequest, or None without tools
    template_kwargs: dict[str, Any] | None = None  # chat: chat_template_kwargs
    reasoning_start: str = "auto"  # chat: where the answer starts (answer.answer_starts_in)

    @property
    def scoring_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) alone, nothing generated."""
        return self.echo and self.max_tokens == 0

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"

    def param_name(self, field: str | None) -> str | None:
        """The API's name of a SamplingParams field or engine parameter."""
        if field == "prompt":
            return self.prompt_param
        if field == "max_tokens":
            return self.max_tokens_param
        if field == "logprobs" and self.chat:
            return "top_logprobs"
        if field == "prompt_logprobs":  # set from logprobs, for echo
            return "logprobs"
        if field == "structured_outputs" and self.chat:
            return "response_format"
        return field


def check_json_value(body: Any) -> None:
    """What json.loads lets through but nothing downstream should see: lone surrogates (they
    cannot be encoded, so no tokenizer or response could carry them) and deep nesting."""
    stack: list[tuple[Any, str | None, int]] = [(body, None, 0)]
    while stack:
        value, top, depth = stack.pop()
        if depth > MAX_NESTING:
            raise invalid(top, f"JSON nested deeper than {MAX_NESTING} levels")
        if isinstance(value, str):
            _check_text(value, top)
        elif isinstance(value, dict):
            for k, v in value.items():
                key_top = top if top is not None else k
                _check_text(k, key_top if depth else None)
                stack.append((v, key_top, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, top, depth + 1) for v in value)


def _check_text(text: str, param: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid(param, f"invalid Unicode in {param or 'a key'}: a lone surrogate "
                             f"(U+{ord(text[e.start]):04X}) at position {e.start}") from e


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _optional(body: dict, name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or
                              (kind is not bool and isinstance(value, bool))):
        raise invalid(name, f"'{name}' must be {what}, got {short(value)}")
    return value


def parse_request(body: Any, chat: bool, served_model: str) -> ParsedRequest:
    if not isinstance(body, dict):
        raise invalid(None, "request body must be a JSON object")
    allowed = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    for key in body:
        if key not in allowed and key not in _DESCRIPTIVE:
            raise invalid(key[:MAX_QUOTE], f"Unrecognized request argument supplied: "
                                           f"{short(key)}", "unknown_parameter")
    for key, kind in _DESCRIPTIVE.items():
        _optional(body, key, kind, "a " + {str: "string", dict: "object",
                                            bool: "boolean"}[kind])
    model = body.get("model")
    if model is not None and model != served_model:
        raise APIError(404, f"The model {short(model)} does not exist; this server serves "
                            f"{served_model!r}", "model", "model_not_found")
    _refuse_unsupported(body, chat)

    prompts = messages = None
    if chat:
        messages = parse_messages(body.get("messages"))
    else:
        prompts = parse_prompts(body.get("prompt"))
    echo = not chat and bool(_optional(body, "echo", bool, "a boolean"))

    max_param = "max_tokens"
    max_tokens = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        max_param, max_tokens = "max_completion_tokens", body["max_completion_tokens"]
    if max_tokens is None and not chat:
        max_tokens = 16  # OpenAI's default for completions
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < (0 if echo else 1)):
        raise invalid(max_param, f"'{max_param}' must be an integer >= 1 (0 only with 'echo'), "
                                 f"got {short(max_tokens)}")

    stream = _optional(body, "stream", bool, "a boolean") or False
    options = _optional(body, "stream_options", dict, "an object")
    if options is not None:
        if not stream:
            raise invalid("stream_options", "'stream_options' is only allowed when 'stream' "
                                            "is true")
        for key, value in options.items():
            if key not in _STREAM_OPTIONS:
                raise invalid("stream_options", f"unknown stream option {short(key)}")
            if value is not None and not isinstance(value, bool):
                raise invalid("stream_options", f"stream option {short(key)} must be a "
                                                f"boolean, got {short(value)}")
    include_usage = bool(options and options.get("include_usage"))
    continuous_usage = bool(options and options.get("continuous_usage_stats"))

    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise invalid("stop", f"'stop' takes at most {MAX_STOP_STRINGS} strings")
    if isinstance(stop, (str, list)) and any(
            isinstance(s, str) and len(s) > MAX_STOP_LENGTH
            for s in ([stop] if isinstance(stop, str) else stop)):
        raise invalid("stop", f"stop strings are at most {MAX_STOP_LENGTH} characters")

    kwargs: dict[str, Any] = {"max_tokens": 1}
    for name in ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
                 "ignore_eos"):
        if body.get(name) is not None:
            kwargs[name] = body[name]
    if body.get("logit_bias") is not None:
        kwargs["logit_bias"] = parse_logit_bias(body["logit_bias"])
    kwargs["logprobs"] = parse_logprobs(body, chat)
    template_kwargs = None
    if chat:
        kwargs["structured_outputs"] = parse_response_format(body.get("response_format"))
        template_kwargs = _optional(body, "chat_template_kwargs", dict, "an object")
    if echo:  # the echoed prompt's logprobs, as many alternatives as the output's
        kwargs["prompt_logprobs"] = kwargs["logprobs"]
    req = ParsedRequest(chat, prompts, messages, max_tokens, max_param,
                        SamplingParams(), stream, include_usage, continuous_usage, echo,
                        template_kwargs=template_kwargs)
    try:
        req.params = SamplingParams(**kwargs)
    except InvalidParameter as e:
        raise invalid(req.param_name(e.param), str(e), e.code) from e
    n = req.params.n
    best_of = body.get("best_of")
    if not chat and best_of is not None and best_of != n:
        raise unsupported("best_of", f"must equal n ({n}) if given: completions are not "
                                     "ranked")
    return req


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """OpenAI fields this server does not implement: refused unless their value asks for
    nothing beyond plain text generation."""
    def given(name: str) -> Any:
        return body.get(name)

    if chat:
        if given("functions") not in (None, []):
            raise unsupported("functions", "is not supported: use 'tools'")
        if given("function_call") not in (None, "none"):
            raise unsupported("function_call", "is not supported: use 'tool_choice'")
        for name in ("audio", "prediction", "reasoning_effort", "web_search_options",
                     "verbosity"):
            if given(name) is not None:
                raise unsupported(name)
        if given("modalities") not in (None, ["text"]):
            raise unsupported("modalities", "supports only [\"text\"]")
    else:
        if given("suffix") not in (None, ""):
            raise unsupported("suffix")
        best_of = given("best_of")
        if best_of is not None and not _is_int(best_of):
            raise invalid("best_of", f"'best_of' must be an integer, got {short(best_of)}")


def parse_response_format(fmt: Any) -> StructuredOutputs | None:
    """OpenAI's response_format: text (nothing to enforce), json_object, or json_schema with
    its schema (`strict` or not, the schema is enforced by constrained decoding)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise invalid("response_format", "'response_format.json_schema' must be an object "
                                             "with a 'name' and a 'schema'")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise invalid("response_format", f"'response_format.json_schema.schema' must be "
                                             f"a JSON schema object, got {short(schema)}")
        if not isinstance(spec.get("strict", False), (bool, type(None))):
            raise invalid("response_format", "'response_format.json_schema.strict' must be a "
                                             "boolean")
        return StructuredOutputs(json=schema)
    raise invalid("response_format", f"'response_format.type' must be 'text', 'json_object' "
                                     f"or 'json_schema', got {short(kind)}")


def parse_prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's four shapes: a string or a list of token ids (one prompt), a list of strings or
    a list of token-id lists (a prompt each)."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        items, batched = [prompt], False
    elif isinstance(prompt, list) and prompt:
        items, batched = prompt, True
    else:
        raise invalid("prompt", "'prompt' must be a non-empty string, a list of token ids, or "
                                "a list of either (several prompts)")
    for i, item in enumerate(items):
        if not (isinstance(item, str) and item) and not _is_token_ids(item):
            where = f"prompt[{i}]" if batched else "'prompt'"
            raise invalid("prompt", f"{where} must be a non-empty string or a non-empty list "
                                    f"of token ids, got {short(item)}")
    return items


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(_is_int(t) for t in x)


@dataclass
class TokenizeRequest:
    """POST /tokenize, vLLM's shape: a completions prompt or a chat conversation."""

    text: str | None  # the prompt
    messages: list[dict[str, str]] | None  # or the conversation, through the chat template
    add_generation_prompt: bool
    add_special_tokens: bool
    return_token_strs: bool


_TOKENIZE_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_TOKENIZE_CHAT_FIELDS = {"model", "messages", "add_generation_prompt", "add_special_tokens",
                         "return_token_strs"}


def _check_fields(body: Any, allowed: set[str], served_model: str) -> dict:
    if not isinstance(body, dict):
        raise invalid(None, "request body must be a JSON object")
    for key in body:
        if key not in allowed:
            raise invalid(key[:MAX_QUOTE], f"Unrecognized request argument supplied: "
                                           f"{short(key)}", "unknown_parameter")
    model = body.get("model")
    if model is not None and model != served_model:
        raise APIError(404, f"The model {short(model)} does not exist; this server serves "
                            f"{served_model!r}", "model", "model_not_found")
    return body


def parse_tokenize_request(body: Any, served_model: str) -> TokenizeRequest:
    """add_special_tokens defaults to false: the ids /v1/completions runs for the same prompt
    (the engine tokenizes prompts without special tokens; vLLM's completions add them, and so
    its /tokenize defaults to true)."""
    chat = isinstance(body, dict) and "messages" in body
    body = _check_fields(body, _TOKENIZE_CHAT_FIELDS if chat else _TOKENIZE_FIELDS,
                         served_model)
    flags = {name: _optional(body, name, bool, "a boolean") for name in
             ("add_generation_prompt", "add_special_tokens", "return_token_strs")}
    text = messages = None
    if chat:
        messages = parse_messages(body["messages"])
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise invalid("prompt", f"'prompt' must be a string, got {short(text)}")
    return TokenizeRequest(text, messages, flags["add_generation_prompt"] is not False,
                           bool(flags["add_special_tokens"]), bool(flags["return_token_strs"]))


def parse_detokenize_request(body: Any, served_model: str, vocab_size: int) -> list[int]:
    """POST /detokenize: {"tokens": [ids]} -> the ids."""
    body = _check_fields(body, {"model", "tokens"}, served_model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < vocab_size
                                               for t in tokens):
        raise invalid("tokens", f"'tokens' must be a list of token ids (integers in [0, "
                                f"{vocab_size})), got {short(tokens)}")
    return tokens


def parse_logit_bias(bias: Any) -> dict[int, Any]:
    """OpenAI sends token ids as JSON object keys, so strings."""
    if not isinstance(bias, dict):
        raise invalid("logit_bias", f"'logit_bias' must be an object mapping token ids to "
                                    f"numbers, got {short(bias)}")
    out = {}
    for key, value in bias.items():
        if not isinstance(key, str) or not re.fullmatch(r"[0-9]{1,18}", key.strip()):
            raise invalid("logit_bias", f"'logit_bias' keys must be token ids (non-negative "
                                        f"integers), got {short(key)}")
        out[int(key)] = value
    return out


def parse_logprobs(body: dict, chat: bool) -> int | None:
    """SamplingParams.logprobs: the number of top alternatives per token, None for none.
    Completions: `logprobs` is that number. Chat: `logprobs` (boolean) turns them on and
    `top_logprobs` is the number."""
    if not chat:
        value = body.get("logprobs")
        if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
            raise invalid("logprobs", f"'logprobs' must be an integer in [0, {MAX_LOGPROBS}], "
                                      f"got {short(value)}")
        return value
    on = _optional(body, "logprobs", bool, "a boolean")
    top = body.get("top_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_LOGPROBS):
        raise invalid("top_logprobs", f"'top_logprobs' must be an integer in [0, "
                                      f"{MAX_LOGPROBS}], got {short(top)}")
    if top is not None and not on:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return (top or 0) if on else None


def parse_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid("messages", f"messages[{i}] must be an object")
        for key in m:
            if key not in _MESSAGE_FIELDS:
                raise invalid("messages", f"messages[{i}]: field {short(key)} is not supported")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise invalid("messages", f"messages[{i}].role must be one of "
                                      f"{', '.join(CHAT_ROLES)}; got {short(role)}")
        content = m.get("content")
        calls = m.get("tool_calls")
        if calls is not None and (role != "assistant" or not _are_tool_calls(calls)):
            raise invalid("messages", f"messages[{i}].tool_calls must be an assistant's list "
                                      f"of {{\"id\", \"type\": \"function\", \"function\": "
                                      f"{{\"name\", \"arguments\"}}}}")
        if content is None and calls:
            content = ""
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and
                       isinstance(p.get("text"), str) and set(p) <= {"type", "text"}
                       for p in content):
                raise invalid("messages", f"messages[{i}]: only text content parts are "
                                          "supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise invalid("messages", f"messages[{i}].content must be a string or a list of "
                                      "text parts")
        for key in ("name", "tool_call_id", "reasoning_content"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise invalid("messages", f"messages[{i}].{key} must be a string")
        # developer messages are system messages for models without that role
        message = {"role": "system" if role == "developer" else role, "content": content}
        message.update({k: m[k] for k in ("name", "tool_call_id", "tool_calls",
                                          "reasoning_content") if m.get(k) is not None})
        out.append(message)
    return out


def _are_tool_calls(calls: Any) -> bool:
    return isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", "{}"), (str, dict)) for c in calls)


# --- responses ------------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
          ) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _lp(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def completion_logprobs(items: list[TokenLogprobs], starts: list[int], token_text
                        ) -> dict[str, Any]:
    """OpenAI's completions shape; `starts`: each token's character offset in the text."""
    return {"tokens": [token_text(t.token_id)[0] for t in items],
            "token_logprobs": [_lp(t.logprob) for t in items],
            "top_logprobs": [_top(t, token_text) for t in items],
            "text_offset": starts}


def echoed_logprobs(ids: list[int], items: list[TokenLogprobs | None], starts: list[int],
                    token_text) -> dict[str, Any]:
    """An echoed prompt's tokens in the completions shape: a token without a logprob (the
    first: nothing comes before it) has null for its logprob and its top_logprobs, as OpenAI
    and vLLM send. `items`: one per prompt token (the engine scores every one before the first
    output token)."""
    if len(items) != len(ids):
        raise RuntimeError(f"{len(items)} prompt logprobs for {len(ids)} prompt tokens")
    return {"tokens": [token_text(t)[0] for t in ids],
            "token_logprobs": [None if t is None else _lp(t.logprob) for t in items],
            "top_logprobs": [None if t is None else _top(t, token_text) for t in items],
            "text_offset": starts}


def joined_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + then[key] for key in first}


def _top(t: TokenLogprobs, token_text) -> dict[str, float]:
    return {token_text(i)[0]: _lp(v) for i, v in t.top}


def chat_logprobs(items: list[TokenLogprobs], token_text) -> dict[str, Any]:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs}], ...}."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = token_text(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": raw}

    return {"content": [{**entry(t.token_id, t.logprob),
                         "top_logprobs": [entry(i, v) for i, v in t.top]} for t in items],
            "refusal": None}


def completion_body(req_id: str, model: str, chat: bool, choices: list[dict[str, Any]],
                    prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int = 0) -> dict[str, Any]:
    """`choices`: {index, text, finish_reason, logprobs}, in index order."""
    out = []
    for c in choices:
        choice: dict[str, Any] = {"index": c["index"], "logprobs": c.get("logprobs"),
                                  "finish_reason": c["finish_reason"]}
        if chat:
            choice["message"] = {"role": "assistant", "content": c["text"]}
            for key in ("reasoning_content", "tool_calls"):
                if c.get(key):
                    choice["message"][key] = c[key]
        else:
            choice["text"] = c["text"]
        out.append(choice)
    return {"id": req_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": out,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def chunk_body(req_id: str, model: str, chat: bool, text: str | None,
               finish_reason: str | None, role: bool = False, index: int = 0,
               logprobs: dict[str, Any] | None = None,
               usage_so_far: dict[str, Any] | None = None, reasoning: str | None = None,
               tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "logprobs": logprobs,
                              "finish_reason": finish_reason}
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    body = {"id": req_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}
    if usage_so_far is not None:
        body["usage"] = usage_so_far
    return body
