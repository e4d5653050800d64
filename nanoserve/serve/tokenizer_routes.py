"""vLLM's tokenizer routes: POST /tokenize, POST /detokenize, GET /tokenizer_info (what
lm-eval's remote tokenizer reads). /tokenize gives the ids the engine runs for the same prompt,
so ids round-trip: /detokenize of them is the prompt again."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from nanoserve.serve.chat_template import chat_prompt
from nanoserve.serve.http_io import ClientGone, parse_json, read_body
from nanoserve.serve.protocol import (
    APIError,
    parse_detokenize_request,
    parse_tokenize_request,
)
from nanoserve.serve.state import ServerState

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def tokenizer_of(state: ServerState):
    if state.tokenizer is None:
        raise APIError(404, f"model {state.model_name!r} has no tokenizer",
                       code="tokenizer_not_found")
    return state.tokenizer


def tokenize(state: ServerState, raw: bytes) -> dict[str, Any]:
    req = parse_tokenize_request(parse_json(raw), state.model_name)
    tokenizer = tokenizer_of(state)
    text = req.text if req.messages is None else \
        chat_prompt(tokenizer, req.messages, req.add_generation_prompt)
    ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens) if text else []
    return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs
            else None}


def detokenize(state: ServerState, raw: bytes) -> dict[str, Any]:
    ids = parse_detokenize_request(parse_json(raw), state.model_name,
                                   state.engine.model_config.vocab_size)
    return {"prompt": tokenizer_of(state).decode(ids, skip_special_tokens=False)}


def tokenizer_info(state: ServerState) -> dict[str, Any]:
    """tokenizer_config.json's fields that a client needs to tokenize as the server does:
    special tokens as text, the chat template, and the longest context."""
    tokenizer = tokenizer_of(state)
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for name in SPECIAL_TOKENS:
        value = getattr(tokenizer, name, None)
        info[name] = str(value) if value is not None else None
    template = getattr(tokenizer, "chat_template", None)
    info["chat_template"] = template if isinstance(template, str) else None
    info["model_max_length"] = state.engine.max_model_len
    return info


def add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    async def answer(request: Request, work) -> Response:
        try:
            raw = await read_body(request, state.max_body_bytes, state.body_timeout_s)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        return JSONResponse(await run_in_threadpool(work, state, raw))

    @app.post("/tokenize")
    async def tokenize_(request: Request) -> Response:
        return await answer(request, tokenize)

    @app.post("/detokenize")
    async def detokenize_(request: Request) -> Response:
        return await answer(request, detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info_() -> dict[str, Any]:
        return tokenizer_info(state)
