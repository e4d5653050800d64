"""/v1/completions and /v1/chat/completions. A request is parsed and every one of its prompts
tokenized and checked before anything is submitted; its prompts go to the engine together (all
or none), and the answer comes whole or as server-sent events. Choice i * n + j is prompt i's
completion j, as OpenAI numbers them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.chat import template_messages
from nanoserve.errors import InvalidParameter
from nanoserve.serve.answer import AnswerReader, answer_starts_in
from nanoserve.serve.async_engine import (
    SHUTDOWN_MESSAGE,
    BatchStream,
    PromptRefused,
    ServerOverloaded,
)
from nanoserve.serve.chat_template import chat_prompt
from nanoserve.serve.choice import FINISH_REASONS, Choice, EchoedPrompt
from nanoserve.serve.detokenizer import text_with_offsets
from nanoserve.serve.http_io import ClientGone, parse_json, read_body, sse, wait_for_disconnect
from nanoserve.serve.protocol import (
    APIError,
    ParsedRequest,
    chat_logprobs,
    chunk_body,
    completion_body,
    completion_logprobs,
    echoed_logprobs,
    joined_logprobs,
    new_id,
    parse_request,
    usage,
)
from nanoserve.serve.state import ServerState
from nanoserve.serve.tools import forced_call, parse_tools

log = logging.getLogger("nanoserve.serve")


@dataclass
class Prepared:
    """A request checked and tokenized, ready to submit."""

    req: ParsedRequest
    prompts: list[list[int]]  # token ids, one list per prompt
    echoes: list[EchoedPrompt] | None  # with echo: one per prompt

    def where(self, i: int) -> str:
        """How an error names prompt i: by its index when the request has several."""
        return f"prompt[{i}]" if len(self.prompts) > 1 else "prompt"


def add_completion_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(state, request, chat=True)


async def handle(state: ServerState, request: Request, chat: bool) -> Response:
    try:
        raw = await read_body(request, state.max_body_bytes, state.body_timeout_s)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    prep = await run_in_threadpool(prepare, state, raw, chat)
    batch = await submit(state, prep)
    req_id = new_id(chat)
    if prep.req.stream:
        return StreamingResponse(events(state, prep, req_id, batch),
                                 media_type="text/event-stream")
    return await collect_or_abort(state, request, prep, req_id, batch)


# --- before submission: parse, tokenize, check (on a worker thread: big prompts take a while) --

def prepare(state: ServerState, raw: bytes, chat: bool) -> Prepared:
    body = parse_json(raw)
    req = parse_request(body, chat, state.model_name)
    if not chat and len(req.prompts) > state.max_in_flight:
        raise APIError(400, f"{len(req.prompts)} prompts exceed what this server runs at once "
                            f"({state.max_in_flight} sequences)", "prompt")
    tools = None
    if chat:
        req.tools = parse_tools(body)
        tools = use_tools(state, req)
        build_grammar(state, req)
    texts = [chat_prompt(state.tokenizer, template_messages(req.messages), tools=tools,
                         template_kwargs=req.template_kwargs)] if chat else req.prompts
    if chat:
        req.reasoning_start = answer_starts_in(texts[0])
    prep = Prepared(req, [tokenize_prompt(state, req, p, i, len(texts) > 1)
                          for i, p in enumerate(texts)], None)
    room = check_lengths(state, prep)
    engine_max_tokens = 1 if req.scoring_only else \
        req.max_tokens or min(room, state.default_max_tokens)
    req.params = req.params.replace(max_tokens=engine_max_tokens)
    if req.echo:
        prep.echoes = [echoed(state, req, p, ids) for p, ids in zip(req.prompts, prep.prompts,
                                                                     strict=True)]
    return prep


def use_tools(state: ServerState, req: ParsedRequest) -> list[dict[str, Any]] | None:
    """The tools the chat template gets (none with tool_choice "none"); for "required" or a
    named function, the request's grammar becomes a call of one."""
    if req.tools is None or not req.tools.active:
        return None
    if state.tool_parser is None:
        raise APIError(400, "this model has no tool-call parser; start the server with "
                            "--tool-call-parser", "tools")
    forced = forced_call(req.tools, state.tool_parser)
    if forced is not None:
        if req.params.structured_outputs is not None:
            raise APIError(400, "'tool_choice' that forces a call cannot go with a "
                                "'response_format' schema", "tool_choice")
        req.params = req.params.replace(structured_outputs=forced)
    return req.tools.tools


def build_grammar(state: ServerState, req: ParsedRequest) -> None:
    """The request's grammar compiled and its first matcher built here, on the request's
    worker thread (a large schema takes a good part of a second): the engine's thread finds
    them cached. A 400 names the field the grammar came from."""
    spec = req.params.structured_outputs
    if spec is None:
        return
    try:
        state.engine.grammars.prototype(spec)
    except InvalidParameter as e:
        forced = req.tools is not None and req.tools.forces_call
        raise APIError(400, str(e), "tools" if forced else req.param_name(e.param),
                       e.code) from e


def tokenize_prompt(state: ServerState, req: ParsedRequest, prompt: str | list[int], i: int,
                    batched: bool) -> list[int]:
    try:
        return state.engine.tokenize(prompt)
    except InvalidParameter as e:
        where = f"prompt[{i}]: " if batched else ""
        raise APIError(400, where + str(e), req.param_name(e.param), e.code) from e


def check_lengths(state: ServerState, prep: Prepared) -> int:
    """Room left for output by the longest prompt; 400 for a prompt that leaves none, or less
    than max_tokens."""
    req, max_len = prep.req, state.engine.max_model_len
    for i, ids in enumerate(prep.prompts):
        if len(ids) >= max_len:
            raise APIError(400, f"{prep.where(i)} has {len(ids)} tokens; the maximum context "
                                f"length is {max_len} tokens, prompt and output together",
                           req.prompt_param, "context_length_exceeded")
        if req.max_tokens is not None and req.max_tokens > max_len - len(ids):
            raise APIError(400, f"{req.max_tokens_param} {req.max_tokens} + {prep.where(i)} "
                                f"{len(ids)} tokens exceeds the maximum context length "
                                f"{max_len}", req.max_tokens_param, "context_length_exceeded")
    return max_len - max(len(ids) for ids in prep.prompts)


def echoed(state: ServerState, req: ParsedRequest, prompt: str | list[int], ids: list[int]
           ) -> EchoedPrompt:
    """A string prompt is echoed as sent; token ids as they decode, special tokens included.
    Token offsets (for logprobs) come from decoding the ids."""
    if req.params.logprobs is None:
        text = prompt if isinstance(prompt, str) else \
            state.tokenizer.decode(ids, skip_special_tokens=False) if state.tokenizer else ""
        return EchoedPrompt(text, ids, None)
    decoded, starts = text_with_offsets(state.tokenizer, ids)
    return EchoedPrompt(prompt if isinstance(prompt, str) else decoded, ids, starts)


async def submit(state: ServerState, prep: Prepared) -> BatchStream:
    req, n, count = prep.req, prep.req.params.n, prep.req.params.n * len(prep.prompts)
    if n > state.max_in_flight:
        raise APIError(400, f"n={n} exceeds what this server runs at once "
                            f"({state.max_in_flight} sequences)", "n")
    if count > state.max_in_flight:
        raise APIError(400, f"{len(prep.prompts)} prompts x n={n} = {count} sequences exceed "
                            f"what this server runs at once ({state.max_in_flight})", "prompt")
    try:
        return await state.ae.submit_batch(prep.prompts, req.params, state.max_in_flight)
    except PromptRefused as e:  # the engine refused it alone
        where = f"prompt[{e.index}]: " if len(prep.prompts) > 1 else ""
        param, code = getattr(e.cause, "param", "prompt"), getattr(e.cause, "code", None)
        raise APIError(400, where + str(e.cause), req.param_name(param), code) from e
    except ServerOverloaded as e:
        raise APIError(503, str(e), code="server_overloaded", type_="server_error",
                       headers={"retry-after": "1"}) from e
    except RuntimeError as e:
        raise APIError(503, str(e), type_="server_error") from e


# --- after submission ----------------------------------------------------------------------

def new_choices(state: ServerState, prep: Prepared, batch: BatchStream, incremental: bool
                ) -> list[Choice]:
    n, want = prep.req.params.n, prep.req.params.logprobs is not None
    return [Choice(i, state.tokenizer, want, incremental,
                   echo=prep.echoes[i // n] if prep.echoes else None,
                   keep_output=not prep.req.scoring_only) for i in range(batch.n)]


def failure(choice: Choice) -> APIError:
    if choice.finish_reason == "error":
        return APIError(500, choice.error or "the request failed", type_="server_error")
    return APIError(503, choice.error or "request aborted", type_="server_error",
                    code="server_shutting_down" if choice.error == SHUTDOWN_MESSAGE else None)


def completion_tokens(choices: list[Choice]) -> int:
    return sum(len(c.ids) for c in choices)


def echo_logprobs(state: ServerState, c: Choice) -> dict[str, Any]:
    return echoed_logprobs(c.echo.ids, c.prompt_logprobs or [], c.echo.starts,
                           state.token_text)


async def collect_or_abort(state: ServerState, request: Request, prep: Prepared, req_id: str,
                           batch: BatchStream) -> Response:
    """A non-streaming request runs until it finishes or its client goes away, whichever
    comes first: a watcher on the connection aborts it at once then."""
    work = asyncio.ensure_future(collect(state, prep, req_id, batch))
    watch = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        state.ae.abort(batch)
        raise
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        state.ae.abort(batch)
        log.info("client went away: request %s aborted", req_id)
        return Response(status_code=499)
    return work.result()


async def collect(state: ServerState, prep: Prepared, req_id: str, batch: BatchStream
                  ) -> JSONResponse:
    req = prep.req
    # text offsets only matter for logprobs
    choices = new_choices(state, prep, batch, incremental=req.params.logprobs is not None)
    left = batch.n
    while left:
        c = choices[(delta := await batch.queue.get()).index]
        c.add(delta)
        if c.done:
            left -= 1
            if c.failed:
                state.ae.abort(batch)  # the others, if any, are of no use now
                raise failure(c)
    return JSONResponse(completion_body(req_id, state.model_name, req.chat,
                                        [choice_body(state, req, c) for c in choices],
                                        batch.num_prompt_tokens, completion_tokens(choices),
                                        batch.num_cached_tokens))


def choice_body(state: ServerState, req: ParsedRequest, c: Choice) -> dict[str, Any]:
    text = c.stop_text
    if text is None:
        text = state.tokenizer.decode(c.ids, skip_special_tokens=True) \
            if state.tokenizer else ""
    logprobs = None
    if c.logprobs is not None:
        logprobs = (chat_logprobs(c.logprobs, state.token_text) if req.chat else
                    completion_logprobs(c.logprobs, c.starts(0, len(c.logprobs)),
                                        state.token_text))
    if c.echo is not None:
        text = c.echo.text + text
        if logprobs is not None:
            logprobs = joined_logprobs(echo_logprobs(state, c), logprobs)
    body = {"index": c.index, "text": text, "logprobs": logprobs,
            "finish_reason": FINISH_REASONS[c.finish_reason]}
    if req.chat:
        body.update(answer_reader(state, req).read(text, body["finish_reason"]))
    return body


def answer_reader(state: ServerState, req: ParsedRequest) -> AnswerReader:
    """A chat answer's parsers: the server's reasoning parser, and its tool-call parser when
    the request's answer may hold calls."""
    tools = req.tools is not None and req.tools.active
    return AnswerReader(state.reasoning_parser, state.tool_parser if tools else None,
                        req.reasoning_start, req.tools is None or req.tools.parallel)


async def events(state: ServerState, prep: Prepared, req_id: str, batch: BatchStream
                 ) -> AsyncIterator[str]:
    req, model = prep.req, state.model_name
    choices = new_choices(state, prep, batch, incremental=True)
    # text that could still become the start of a stop string is held back
    holdback = max((len(s) for s in req.params.stop), default=1) - 1
    left = batch.n
    done = False

    def usage_now() -> dict[str, Any]:
        return usage(batch.num_prompt_tokens, completion_tokens(choices),
                     batch.num_cached_tokens)

    readers = [answer_reader(state, req) for _ in choices] if req.chat else None

    def event(c: Choice, text: str | None, finish: str | None, logprobs=None,
              role: bool = False, reasoning: str | None = None,
              tool_calls: list[dict[str, Any]] | None = None) -> str:
        return sse(chunk_body(req_id, model, req.chat, text, finish, role=role, index=c.index,
                              logprobs=logprobs,
                              usage_so_far=usage_now() if req.continuous_usage else None,
                              reasoning=reasoning, tool_calls=tool_calls))

    def chunk(c: Choice, safe: int | None) -> str | None:
        text, lo, hi = c.take(safe)
        finish = FINISH_REASONS[c.finish_reason] if safe is None else None
        reasoning, calls = "", []
        if readers is not None:
            reader = readers[c.index]
            reasoning, text, calls = reader.feed(text, final=safe is None)
            if finish == "stop" and reader.calls:
                finish = "tool_calls"
        if not text and not reasoning and not calls and hi == lo and finish is None:
            return None
        logprobs = None
        if c.logprobs is not None:
            items = c.logprobs[lo:hi]
            logprobs = (chat_logprobs(items, state.token_text) if req.chat else
                        completion_logprobs(items, c.starts(lo, hi), state.token_text))
        return event(c, text, finish, logprobs, reasoning=reasoning, tool_calls=calls)

    def echo_chunk(c: Choice) -> str:
        c.echo_sent = True
        return event(c, c.echo.text, None,
                     echo_logprobs(state, c) if c.logprobs is not None else None)

    try:
        if req.chat:
            for c in choices:
                yield event(c, None, None, role=True)
        while left:
            c = choices[(delta := await batch.queue.get()).index]
            c.add(delta)
            if c.echo is not None and not c.echo_sent and not c.failed:
                yield echo_chunk(c)  # prompt logprobs come with the choice's first delta
            if not c.done:
                piece = chunk(c, len(c.detok.text) - holdback)
                if piece:
                    yield piece
                continue
            left -= 1
            if c.failed:
                state.ae.abort(batch)
                done = True
                yield sse(failure(c).body())
                break
            yield chunk(c, None)
        else:
            done = True
            if req.include_usage:
                yield sse({"id": req_id, "object": "chat.completion.chunk" if req.chat
                           else "text_completion", "created": int(time.time()),
                           "model": model, "choices": [], "usage": usage_now()})
        yield "data: [DONE]\n\n"
    finally:
        if not done:  # the client went away: free the request's pages now
            state.ae.abort(batch)
