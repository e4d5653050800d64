"""The HTTP API: OpenAI-compatible completions and chat completions (streaming or not), models,
health and Prometheus metrics, over an AsyncEngine.

What a client can make the server hold is bounded: the request body (size, and time to send
it), the sequences in flight, and a client that goes away (mid-body, mid-stream or while a
non-streaming request runs) has its request aborted and its KV pages freed at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from nanoserve.errors import InvalidParameter
from nanoserve.serve.async_engine import (
    SHUTDOWN_MESSAGE,
    AsyncEngine,
    Delta,
    RequestStream,
    ServerOverloaded,
)
from nanoserve.serve.detokenizer import IncrementalDetokenizer, TokenText
from nanoserve.serve.metrics import CONTENT_TYPE, Metrics
from nanoserve.serve.protocol import (
    APIError,
    ParsedRequest,
    chat_logprobs,
    check_json_value,
    chunk_body,
    completion_body,
    completion_logprobs,
    new_id,
    parse_request,
    short,
    usage,
)

log = logging.getLogger("nanoserve.serve")

FINISH_REASONS = {"stop": "stop", "length": "length"}
DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
MIN_MAX_BODY_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 64  # a token-id list or escaped text seldom needs more per token


def default_max_body_bytes(max_model_len: int) -> int:
    """Room for a prompt of max_model_len tokens in any JSON spelling, and at least 1 MiB."""
    return max(MIN_MAX_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every /v1 route (pure ASGI: streams pass untouched);
    /health and /metrics stay open."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
            given = b""
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    scheme, _, token = value.partition(b" ")
                    if scheme.lower() == b"bearer":
                        given = token.strip()
            if not hmac.compare_digest(given, self.key):
                e = APIError(401, "Incorrect API key provided: pass it as 'Authorization: "
                                  "Bearer <key>'", code="invalid_api_key",
                             headers={"www-authenticate": "Bearer",
                                      "connection": "close"})  # its body is not read
                await error_response(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Choice:
    """One completion's output as it arrives: tokens, text released so far (whole characters),
    which characters each token ended at (for logprobs sent with their own text), and what
    was sent of both."""

    def __init__(self, index: int, tokenizer, want_logprobs: bool,
                 incremental: bool = True) -> None:
        self.index = index
        self.incremental = incremental  # False: only the token ids are kept
        self.detok = IncrementalDetokenizer(tokenizer)
        self.ids: list[int] = []
        self.logprobs: list | None = [] if want_logprobs else None
        self.ends: list[int] = []  # character end of each released token in detok.text
        self.sent_chars = 0
        self.sent_logprobs = 0
        self.finish_reason: str | None = None
        self.stop_text: str | None = None
        self.error: str | None = None

    def add(self, delta: Delta) -> None:
        if self.incremental:
            for t in delta.token_ids:  # one at a time: each token's end offset is known
                self.ids.append(t)
                self.detok.add([t])
                self._resolve()
        else:
            self.ids += delta.token_ids
        if self.logprobs is not None and delta.logprobs:
            self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_text, self.error = (
                delta.finish_reason, delta.stop_text, delta.error)
            if self.incremental:
                self.detok.flush()
                self._resolve()

    def _resolve(self) -> None:
        while len(self.ends) < self.detok.read_offset:
            self.ends.append(len(self.detok.text))

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def starts(self, lo: int, hi: int) -> list[int]:
        return [self.ends[i - 1] if i else 0 for i in range(lo, hi)]

    def take(self, safe_chars: int | None) -> tuple[str, int, int]:
        """Text up to `safe_chars` (None: all of it, finished) not sent yet, and the range of
        tokens whose logprobs go with it."""
        if safe_chars is None:
            final = self.stop_text if self.stop_text is not None else self.detok.text
            text = final[self.sent_chars:]
            self.sent_chars = max(self.sent_chars, len(final))
            hi = len(self.logprobs) if self.logprobs is not None else 0
        else:
            safe_chars = max(safe_chars, self.sent_chars)
            text = self.detok.text[self.sent_chars:safe_chars]
            self.sent_chars = safe_chars
            hi = self.sent_logprobs
            if self.logprobs is not None:
                while hi < min(len(self.ends), len(self.logprobs)) and \
                        self.ends[hi] <= safe_chars:
                    hi += 1
        lo, self.sent_logprobs = self.sent_logprobs, max(self.sent_logprobs, hi)
        return text, lo, hi


def build_app(ae: AsyncEngine, model_name: str, default_max_tokens: int = 256, *,
              api_key: str | None = None, max_body_bytes: int | None = None,
              max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
              body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> FastAPI:
    """`api_key`: required as a Bearer token on /v1 routes (None: open). `max_body_bytes`:
    request bodies beyond it get 413 (None: default_max_body_bytes(max_model_len)).
    `max_waiting_requests`: sequences that may wait beyond the engine's max_num_seqs; more get
    503 with Retry-After. `body_timeout_s`: time to send a request body, else 408."""
    if max_body_bytes is not None and max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if max_waiting_requests < 0:
        raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
    if not body_timeout_s > 0:
        raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s}")
    engine = ae.engine
    tokenizer = engine.tokenizer
    token_text = TokenText(tokenizer)
    max_body = max_body_bytes if max_body_bytes is not None else \
        default_max_body_bytes(engine.max_model_len)
    max_in_flight = engine.scheduler.max_num_seqs + max_waiting_requests
    metrics = Metrics(ae, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not ae.alive:
            ae.start()
        yield
        await run_in_threadpool(ae.shutdown)

    app = FastAPI(title="nanoserve", lifespan=lifespan)
    app.state.async_engine = ae  # run_server aborts in-flight requests through it at shutdown
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(404)
    async def not_found(request: Request, e: Exception) -> JSONResponse:
        return error_response(APIError(404, f"no route {short(request.url.path)}"))

    @app.exception_handler(405)
    async def bad_method(request: Request, e: Exception) -> JSONResponse:
        return error_response(APIError(405, f"{request.method} not allowed on "
                                            f"{short(request.url.path)}"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        # a bug: answered in OpenAI's shape; Starlette still logs the traceback
        return error_response(APIError(500, f"internal error: {type(e).__name__}",
                                       type_="server_error"))

    async def read_body(request: Request) -> bytes:
        """The body, refused before it is parsed when it is not JSON (415), too big (413, by
        its Content-Length or as it arrives) or too slow to arrive (408)."""
        mime, *options = request.headers.get("content-type", "").split(";")
        charset = dict(o.strip().lower().partition("=")[::2] for o in options).get("charset")
        if mime.strip().lower() != "application/json" or \
                charset not in (None, "utf-8", "utf8", '"utf-8"'):
            raise APIError(415, "the request body must be JSON: Content-Type: "
                                "application/json", code="unsupported_media_type")
        close = {"connection": "close"}  # the rest of the body is not read
        too_big = APIError(413, f"request body exceeds {max_body} bytes", code="request_too_large",
                           headers=close)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body:
            raise too_big
        buf = bytearray()

        async def receive_all() -> None:
            async for chunk in request.stream():
                buf.extend(chunk)
                if len(buf) > max_body:
                    raise too_big

        try:
            await asyncio.wait_for(receive_all(), body_timeout_s)
        except asyncio.TimeoutError as e:
            raise APIError(408, f"request body not received within {body_timeout_s:g} s",
                           code="request_timeout", headers=close) from e
        except ClientDisconnect as e:
            client = request.client
            log.info("client %s disconnected while sending the request body (%d of %s bytes)",
                     f"{client.host}:{client.port}" if client else "?", len(buf),
                     length or "chunked")
            raise ClientGone from e
        return bytes(buf)

    def prepare(raw: bytes, chat: bool) -> tuple[ParsedRequest, list[int]]:
        """Parse, check and tokenize (on a worker thread: big prompts take a while)."""
        try:
            body = json.loads(raw)
        except RecursionError as e:
            raise APIError(400, "invalid JSON body: nested too deeply") from e
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, huge integers
            raise APIError(400, f"invalid JSON body: {short(str(e))}") from e
        check_json_value(body)
        req = parse_request(body, chat, model_name)
        try:
            ids = tokenize(req)
        except InvalidParameter as e:
            raise APIError(400, str(e), req.param_name(e.param), e.code) from e
        room = engine.max_model_len - len(ids)
        if room < 1:
            raise APIError(400, f"prompt has {len(ids)} tokens; the maximum context length is "
                                f"{engine.max_model_len} tokens, prompt and output together",
                           req.prompt_param, "context_length_exceeded")
        if req.max_tokens is not None and req.max_tokens > room:
            raise APIError(400, f"{req.max_tokens_param} {req.max_tokens} + prompt {len(ids)} "
                                f"tokens exceeds the maximum context length "
                                f"{engine.max_model_len}",
                           req.max_tokens_param, "context_length_exceeded")
        req.params = req.params.replace(max_tokens=req.max_tokens or
                                        min(room, default_max_tokens))
        return req, ids

    def tokenize(req: ParsedRequest) -> list[int]:
        if not req.chat:
            return engine.tokenize(req.prompt)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions",
                           "messages")
        try:
            text = tokenizer.apply_chat_template(req.messages, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as e:  # the template refused the conversation
            raise APIError(400, f"the chat template refused these messages: "
                                f"{short(str(e), 300)}", "messages") from e
        return engine.tokenize(text)

    async def submit(req: ParsedRequest, ids: list[int]) -> RequestStream:
        if req.params.n > max_in_flight:
            raise APIError(400, f"n={req.params.n} exceeds what this server runs at once "
                                f"({max_in_flight} sequences)", "n")
        try:
            return await ae.submit(ids, req.params, max_in_flight)
        except InvalidParameter as e:  # the engine refused it alone
            raise APIError(400, str(e), req.param_name(e.param), e.code) from e
        except ServerOverloaded as e:
            raise APIError(503, str(e), code="server_overloaded", type_="server_error",
                           headers={"retry-after": "1"}) from e
        except RuntimeError as e:
            raise APIError(503, str(e), type_="server_error") from e

    async def handle(request: Request, chat: bool):
        try:
            raw = await read_body(request)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        req, ids = await run_in_threadpool(prepare, raw, chat)
        stream = await submit(req, ids)
        req_id = new_id(chat)
        if req.stream:
            return StreamingResponse(events(req, req_id, stream),
                                     media_type="text/event-stream")
        return await collect_or_abort(request, req, req_id, stream)

    def failure(choice: Choice) -> APIError:
        if choice.finish_reason == "error":
            return APIError(500, choice.error or "the request failed", type_="server_error")
        return APIError(503, choice.error or "request aborted", type_="server_error",
                        code="server_shutting_down" if choice.error == SHUTDOWN_MESSAGE
                        else None)

    async def collect_or_abort(request: Request, req: ParsedRequest, req_id: str,
                               stream: RequestStream) -> Response:
        """A non-streaming request runs until it finishes or its client goes away, whichever
        comes first: a watcher on the connection aborts it at once then."""
        work = asyncio.ensure_future(collect(req, req_id, stream))
        watch = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            ae.abort(stream)
            raise
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
        if not work.done() or work.cancelled():
            ae.abort(stream)
            log.info("client went away: request %s aborted", req_id)
            return Response(status_code=499)
        return work.result()

    async def collect(req: ParsedRequest, req_id: str, stream: RequestStream) -> JSONResponse:
        want = req.params.logprobs is not None  # text offsets only matter for logprobs
        choices = [Choice(i, tokenizer, want, incremental=want) for i in range(stream.n)]
        left = stream.n
        while left:
            delta: Delta = await stream.queue.get()
            choice = choices[delta.index]
            choice.add(delta)
            if choice.done:
                left -= 1
                if choice.finish_reason not in FINISH_REASONS:
                    ae.abort(stream)  # the others, if any, are of no use now
                    raise failure(choice)
        out = []
        for c in choices:
            text = c.stop_text
            if text is None:
                text = tokenizer.decode(c.ids, skip_special_tokens=True) if tokenizer else ""
            logprobs = None
            if c.logprobs is not None:
                logprobs = (chat_logprobs(c.logprobs, token_text) if req.chat else
                            completion_logprobs(c.logprobs, c.starts(0, len(c.logprobs)),
                                                token_text))
            out.append({"index": c.index, "text": text, "logprobs": logprobs,
                        "finish_reason": FINISH_REASONS[c.finish_reason]})
        return JSONResponse(completion_body(req_id, model_name, req.chat, out,
                                            stream.num_prompt_tokens,
                                            sum(len(c.ids) for c in choices),
                                            stream.num_cached_tokens))

    async def events(req: ParsedRequest, req_id: str,
                     stream: RequestStream) -> AsyncIterator[str]:
        choices = [Choice(i, tokenizer, req.params.logprobs is not None)
                   for i in range(stream.n)]
        # text that could still become the start of a stop string is held back
        holdback = max((len(s) for s in req.params.stop), default=1) - 1
        left = stream.n
        done = False

        def chunk(c: Choice, safe: int | None) -> str | None:
            text, lo, hi = c.take(safe)
            finish = FINISH_REASONS[c.finish_reason] if safe is None else None
            if not text and hi == lo and finish is None:
                return None
            logprobs = None
            if c.logprobs is not None:
                items = c.logprobs[lo:hi]
                logprobs = (chat_logprobs(items, token_text) if req.chat else
                            completion_logprobs(items, c.starts(lo, hi), token_text))
            return sse(chunk_body(req_id, model_name, req.chat, text, finish, index=c.index,
                                  logprobs=logprobs))

        try:
            if req.chat:
                for c in choices:
                    yield sse(chunk_body(req_id, model_name, True, None, None, role=True,
                                         index=c.index))
            while left:
                delta = await stream.queue.get()
                c = choices[delta.index]
                c.add(delta)
                if not c.done:
                    piece = chunk(c, len(c.detok.text) - holdback)
                    if piece:
                        yield piece
                    continue
                left -= 1
                if c.finish_reason not in FINISH_REASONS:
                    ae.abort(stream)
                    done = True
                    yield sse(failure(c).body())
                    break
                yield chunk(c, None)
            else:
                done = True
                if req.include_usage:
                    yield sse({"id": req_id, "object": "chat.completion.chunk" if req.chat
                               else "text_completion", "created": int(time.time()),
                               "model": model_name, "choices": [],
                               "usage": usage(stream.num_prompt_tokens,
                                              sum(len(c.ids) for c in choices),
                                              stream.num_cached_tokens)})
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away: free the request's pages now
                ae.abort(stream)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": int(time.time()),
                "owned_by": "nanoserve", "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(404, f"The model {short(model_id)} does not exist", "model",
                           "model_not_found")
        return model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        if ae.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error", "error": ae.error or "engine stopped"}, 503)

    @app.get("/metrics")
    async def metrics_() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


class ClientGone(Exception):
    """The client disconnected before its request was read."""


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
