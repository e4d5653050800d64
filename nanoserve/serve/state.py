"""What every route of the server reads: the engine, the name it is served under, and the limits
on what one client can make it hold."""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.serve.async_engine import AsyncEngine
from nanoserve.serve.detokenizer import TokenText


@dataclass
class ServerState:
    ae: AsyncEngine
    model_name: str
    default_max_tokens: int  # output cap for requests that give none (chat)
    max_body_bytes: int
    body_timeout_s: float
    max_in_flight: int  # sequences submitted and not finished, all requests together
    token_text: TokenText
    tool_parser: str | None = None  # how answers are read for tool calls (tool_parsers.py)
    reasoning_parser: str | None = None  # how thinking is split off (reasoning.py)

    @property
    def engine(self):
        return self.ae.engine

    @property
    def tokenizer(self):
        return self.ae.engine.tokenizer
