"""Errors a request can get. Each names the parameter at fault and, where OpenAI has one, the
error code, so the server can answer in OpenAI's shape without guessing."""

from __future__ import annotations


class InvalidParameter(ValueError):
    """A request that cannot run, refused alone: nothing else is affected."""

    def __init__(self, param: str | None, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
