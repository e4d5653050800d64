"""Reading a request body under the server's limits, JSON parsing, server-sent events and
OpenAI-shaped error responses."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from nanoserve.serve.protocol import APIError, check_json_value, short

log = logging.getLogger("nanoserve.serve")

CLOSE = {"connection": "close"}  # for errors sent before the body was read


class ClientGone(Exception):
    """The client disconnected before its request was read."""


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The body, refused before it is parsed when it is not JSON (415), too big (413, by its
    Content-Length or as it arrives) or too slow to arrive (408). Raises ClientGone when the
    client leaves while sending it."""
    mime, *options = request.headers.get("content-type", "").split(";")
    charset = dict(o.strip().lower().partition("=")[::2] for o in options).get("charset")
    if mime.strip().lower() != "application/json" or \
            charset not in (None, "utf-8", "utf8", '"utf-8"'):
        raise APIError(415, "the request body must be JSON: Content-Type: application/json",
                       code="unsupported_media_type", headers=CLOSE)  # its body is not read
    too_big = APIError(413, f"request body exceeds {max_bytes} bytes", code="request_too_large",
                       headers=CLOSE)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise too_big
    buf = bytearray()

    async def receive_all() -> None:
        async for chunk in request.stream():
            buf.extend(chunk)
            if len(buf) > max_bytes:
                raise too_big

    try:
        await asyncio.wait_for(receive_all(), timeout_s)
    except asyncio.TimeoutError as e:
        raise APIError(408, f"request body not received within {timeout_s:g} s",
                       code="request_timeout", headers=CLOSE) from e
    except ClientDisconnect as e:
        client = request.client
        log.info("client %s disconnected while sending the request body (%d of %s bytes)",
                 f"{client.host}:{client.port}" if client else "?", len(buf),
                 length or "chunked")
        raise ClientGone from e
    return bytes(buf)


def parse_json(raw: bytes) -> Any:
    """The body as JSON, with what nothing downstream should see refused (400)."""
    try:
        body = json.loads(raw)
    except RecursionError as e:
        raise APIError(400, "invalid JSON body: nested too deeply") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, huge integers
        raise APIError(400, f"invalid JSON body: {short(str(e))}") from e
    check_json_value(body)
    return body


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
