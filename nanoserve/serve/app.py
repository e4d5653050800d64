"""The HTTP API: OpenAI-compatible completions and chat completions (streaming or not), vLLM's
tokenizer routes, models, health and Prometheus metrics, over an AsyncEngine.

What a client can make the server hold is bounded: the request body (size, and time to send
it), the sequences in flight, and a client that goes away (mid-body, mid-stream or while a
non-streaming request runs) has its request aborted and its KV pages freed at once. The
connection itself (header time, open connections) is bounded in server.py.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from nanoserve.serve.async_engine import AsyncEngine
from nanoserve.serve.completions import add_completion_routes
from nanoserve.serve.detokenizer import TokenText
from nanoserve.serve.http_io import error_response
from nanoserve.serve.metrics import CONTENT_TYPE, Metrics
from nanoserve.serve.middleware import AllowedHostsMiddleware, APIKeyMiddleware
from nanoserve.serve.protocol import APIError, short
from nanoserve.serve.reasoning import REASONING_PARSERS
from nanoserve.serve.state import ServerState
from nanoserve.serve.tokenizer_routes import add_tokenizer_routes
from nanoserve.serve.tool_parsers import make_tool_parser, tool_parser_for

DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
MIN_MAX_BODY_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 64  # a token-id list or escaped text seldom needs more per token


def default_max_body_bytes(max_model_len: int) -> int:
    """Room for a prompt of max_model_len tokens in any JSON spelling, and at least 1 MiB."""
    return max(MIN_MAX_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def build_app(ae: AsyncEngine, model_name: str, default_max_tokens: int = 256, *,
              api_key: str | None = None, max_body_bytes: int | None = None,
              max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
              body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
              allowed_hosts: list[str] | None = None, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None) -> FastAPI:
    """`api_key`: required as a Bearer token on every route but /health and /metrics (None:
    open). `max_body_bytes`: request bodies beyond it get 413 (None:
    default_max_body_bytes(max_model_len)). `max_waiting_requests`: sequences that may wait
    beyond the engine's max_num_seqs; more get 503 with Retry-After. `body_timeout_s`: time to
    send a request body, else 408. `allowed_hosts`: the names a request's Host header may give
    (middleware.allowed_hosts_for), else 400; None: any."""
    if max_body_bytes is not None and max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if max_waiting_requests < 0:
        raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
    if not body_timeout_s > 0:
        raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s}")
    engine = ae.engine
    state = ServerState(
        ae, model_name, default_max_tokens,
        max_body_bytes if max_body_bytes is not None else
        default_max_body_bytes(engine.max_model_len),
        body_timeout_s, engine.scheduler.max_num_seqs + max_waiting_requests,
        TokenText(engine.tokenizer),
        tool_call_parser or tool_parser_for(engine.model_config.architecture),
        reasoning_parser)
    if tool_call_parser is not None:
        make_tool_parser(tool_call_parser)  # an unknown name: ValueError now
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: "
                         f"{', '.join(REASONING_PARSERS)}")
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
    if allowed_hosts is not None:  # added last: it runs first
        app.add_middleware(AllowedHostsMiddleware, hosts=allowed_hosts)
    add_error_handlers(app)
    add_completion_routes(app, state)
    add_tokenizer_routes(app, state)

    def model_card() -> dict[str, Any]:
        # root: where the served model's files (its tokenizer among them) are, as vLLM's card
        return {"id": model_name, "object": "model", "created": int(time.time()),
                "owned_by": "nanoserve", "root": str(engine.model_dir), "parent": None,
                "max_model_len": engine.max_model_len}

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


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape, {"error": {"message", "type", "param", "code"}}."""

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
