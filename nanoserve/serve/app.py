"""The HTTP API: OpenAI-compatible completions and chat completions (streaming or not), models,
health and Prometheus metrics, over an AsyncEngine."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from nanoserve.serve.async_engine import AsyncEngine, Delta, RequestStream
from nanoserve.serve.detokenizer import IncrementalDetokenizer
from nanoserve.serve.metrics import render_metrics
from nanoserve.serve.protocol import (
    APIError,
    ParsedRequest,
    chunk_body,
    completion_body,
    new_id,
    parse_request,
    usage,
)

FINISH_REASONS = {"stop": "stop", "length": "length"}


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def build_app(ae: AsyncEngine, model_name: str, default_max_tokens: int = 256) -> FastAPI:
    engine = ae.engine
    tokenizer = engine.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not ae.alive:
            ae.start()
        yield
        await run_in_threadpool(ae.shutdown)

    app = FastAPI(title="nanoserve", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(404)
    async def not_found(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(APIError(404, f"no route {request.url.path}").body(), 404)

    @app.exception_handler(405)
    async def bad_method(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(APIError(405, f"{request.method} not allowed on "
                                          f"{request.url.path}").body(), 405)

    def tokenize(req: ParsedRequest) -> list[int]:
        if req.chat:
            if tokenizer is None or not getattr(tokenizer, "chat_template", None):
                raise APIError(400, "this model has no chat template; use /v1/completions")
            text = tokenizer.apply_chat_template(req.messages, tokenize=False,
                                                 add_generation_prompt=True)
            return tokenizer.encode(text, add_special_tokens=False)
        try:
            return engine.tokenize(req.prompt)
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from e

    async def prepare(request: Request, chat: bool) -> tuple[ParsedRequest, list[int]]:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"invalid JSON body: {e}") from e
        req = parse_request(body, chat, model_name)
        ids = await run_in_threadpool(tokenize, req)
        room = engine.max_model_len - len(ids)
        if room < 1:
            raise APIError(400, f"prompt has {len(ids)} tokens; the maximum context length is "
                                f"{engine.max_model_len} tokens, prompt and output together",
                           "messages" if chat else "prompt", "context_length_exceeded")
        if req.max_tokens is not None and req.max_tokens > room:
            raise APIError(400, f"max_tokens {req.max_tokens} + prompt {len(ids)} tokens exceeds "
                                f"the maximum context length {engine.max_model_len}",
                           "max_tokens", "context_length_exceeded")
        req.params.max_tokens = req.max_tokens or min(room, default_max_tokens)
        return req, ids

    async def submit(req: ParsedRequest, ids: list[int]) -> RequestStream:
        try:
            return await ae.submit(ids, req.params)
        except ValueError as e:  # the engine refused it: cannot fit the KV budgets
            raise APIError(400, str(e), "messages" if req.chat else "prompt",
                           "kv_capacity_exceeded") from e
        except RuntimeError as e:
            raise APIError(503, str(e), type_="server_error") from e

    async def handle(request: Request, chat: bool):
        req, ids = await prepare(request, chat)
        stream = await submit(req, ids)
        req_id = new_id(chat)
        if req.stream:
            return StreamingResponse(events(req, req_id, stream),
                                     media_type="text/event-stream")
        return await collect(request, req, req_id, stream)

    async def collect(request: Request, req: ParsedRequest, req_id: str,
                      stream: RequestStream) -> JSONResponse:
        out: list[int] = []
        while True:
            try:
                delta: Delta = await asyncio.wait_for(stream.queue.get(), timeout=1.0)
            except TimeoutError:
                if await request.is_disconnected():
                    ae.abort(stream)
                    return JSONResponse({}, status_code=499)
                continue
            except asyncio.CancelledError:
                ae.abort(stream)
                raise
            out += delta.token_ids
            if delta.finish_reason is not None:
                break
        if delta.finish_reason not in FINISH_REASONS:
            status = 500 if delta.finish_reason == "error" else 503
            raise APIError(status, delta.error or "request aborted: server shutting down",
                           type_="server_error")
        text = delta.stop_text
        if text is None:
            text = tokenizer.decode(out, skip_special_tokens=True) if tokenizer else ""
        return JSONResponse(completion_body(req_id, model_name, req.chat, text,
                                            FINISH_REASONS[delta.finish_reason],
                                            stream.num_prompt_tokens, len(out)))

    async def events(req: ParsedRequest, req_id: str,
                     stream: RequestStream) -> AsyncIterator[str]:
        detok = IncrementalDetokenizer(tokenizer)
        # text that could still become the start of a stop string is held back
        holdback = max((len(s) for s in req.params.stop), default=1) - 1
        sent = num_tokens = 0
        done = False
        try:
            if req.chat:
                yield sse(chunk_body(req_id, model_name, True, None, None, role=True))
            while True:
                delta = await stream.queue.get()
                num_tokens += len(delta.token_ids)
                detok.add(delta.token_ids)
                if delta.finish_reason is None:
                    safe = len(detok.text) - holdback
                    if safe > sent:
                        yield sse(chunk_body(req_id, model_name, req.chat,
                                             detok.text[sent:safe], None))
                        sent = safe
                    continue
                done = True
                if delta.finish_reason not in FINISH_REASONS:
                    yield sse(APIError(500, delta.error or "request aborted",
                                       type_="server_error").body())
                    break
                detok.flush()
                final = delta.stop_text if delta.stop_text is not None else detok.text
                yield sse(chunk_body(req_id, model_name, req.chat, final[sent:],
                                     FINISH_REASONS[delta.finish_reason]))
                if req.include_usage:
                    yield sse({"id": req_id, "object": "chat.completion.chunk" if req.chat
                               else "text_completion", "created": int(time.time()),
                               "model": model_name, "choices": [],
                               "usage": usage(stream.num_prompt_tokens, num_tokens)})
                break
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

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()),
            "owned_by": "nanoserve", "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        if ae.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error", "error": ae.error or "engine stopped"}, 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(ae, model_name),
                                 media_type="text/plain; version=0.0.4")

    return app
