"""Errors a request can get. Each names the parameter at fault and, where OpenAI has one, the
error code, so the server can answer in OpenAI's shape without guessing."""

from __future__ import annotations

import math
from typing import Any


class InvalidParameter(ValueError):
    """A request that cannot run, refused alone: nothing else is affected."""

    def __init__(self, param: str | None, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def is_finite_number(x: Any) -> bool:
    """An int or float (not a bool), finite: what numeric settings and parameters accept."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float's range: 10**400
        return False
