"""Per-request sampling and stopping parameters: immutable, and fully validated (types included)
when built, so that nothing a request carries can reach the engine unchecked."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from nanoserve.errors import InvalidParameter, is_finite_number
from nanoserve.structured_outputs import StructuredOutputs

__all__ = ["InvalidParameter", "SamplingParams"]

# Below this a temperature samples as greedy: dividing logits by it would overflow them.
GREEDY_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 2.0  # OpenAI's range, one rule for the API, the CLI and the server
MAX_LOGPROBS = 20
MAX_N = 128
MAX_LOGIT_BIAS_ENTRIES = 1024
SEED_RANGE = (-(2**63), 2**64)  # any 64-bit seed, signed or not


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_number(name: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    if not is_finite_number(value) or value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise InvalidParameter(name, f"{name} must be a number in {bracket}{lo}, {hi}], "
                                     f"got {_short(value)}")
    return float(value)


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        upper = f"{hi}]" if hi is not None else "inf)"
        raise InvalidParameter(name, f"{name} must be an integer in [{lo}, {upper}, "
                                     f"got {_short(value)}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions of the prompt
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) is greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    presence_penalty: float = 0.0  # OpenAI: minus this for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this x the token's count in the output
    repetition_penalty: float = 1.0  # as transformers and vLLM: over prompt and output tokens
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit
    logprobs: int | None = None  # None: none; k: the chosen token's and the top k alternatives'
    # None: none; k: each prompt token's logprob (given the tokens before it) and the top k
    # alternatives at its position, computed in the prefill (vLLM's name)
    prompt_logprobs: int | None = None
    max_tokens: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    # the output must match this (a JSON schema, a regex, ...): constrained decoding
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalized values are written once, here
        _check_int("n", self.n, 1, MAX_N)
        set_(self, "temperature", _check_number("temperature", self.temperature, 0.0,
                                                MAX_TEMPERATURE))
        set_(self, "top_p", _check_number("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        _check_int("top_k", self.top_k, -1)
        set_(self, "min_p", _check_number("min_p", self.min_p, 0.0, 1.0))
        set_(self, "presence_penalty", _check_number("presence_penalty", self.presence_penalty,
                                                     -2.0, 2.0))
        set_(self, "frequency_penalty", _check_number("frequency_penalty",
                                                      self.frequency_penalty, -2.0, 2.0))
        set_(self, "repetition_penalty", _check_number("repetition_penalty",
                                                       self.repetition_penalty, 0.0, 10.0,
                                                       lo_open=True))
        set_(self, "logit_bias", _check_logit_bias(self.logit_bias))
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        _check_int("max_tokens", self.max_tokens, 1)
        if self.seed is not None:
            _check_int("seed", self.seed, SEED_RANGE[0], SEED_RANGE[1] - 1)
        set_(self, "stop", _check_stop(self.stop))
        set_(self, "stop_token_ids", _check_stop_token_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParameter("ignore_eos", f"ignore_eos must be a boolean, got "
                                                 f"{_short(self.ignore_eos)}")
        if not isinstance(self.structured_outputs, (StructuredOutputs, type(None))):
            raise InvalidParameter("structured_outputs", f"structured_outputs must be a "
                                   f"StructuredOutputs, got {_short(self.structured_outputs)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or
                self.repetition_penalty != 1.0)

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed, validated again."""
        return replace(self, **changes)


def _check_logit_bias(bias: Any) -> Mapping[int, float] | None:
    if bias is None or (isinstance(bias, Mapping) and not bias):
        return None
    if not isinstance(bias, Mapping) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidParameter("logit_bias", f"logit_bias must map token ids to numbers, at "
                                             f"most {MAX_LOGIT_BIAS_ENTRIES} entries")
    out = {}
    for token, value in bias.items():
        if not _is_int(token) or token < 0:
            raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids "
                                                 f"(integers >= 0), got {_short(token)}")
        out[token] = _check_number("logit_bias", value, -100.0, 100.0)
    return MappingProxyType(out)


def _check_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if isinstance(stop, (bytes, Mapping)) or not isinstance(stop, (list, tuple)) or \
            not all(isinstance(s, str) and s for s in stop):
        raise InvalidParameter("stop", f"stop must be a non-empty string or a list of them, "
                                       f"got {_short(stop)}")
    return tuple(stop)


def _check_stop_token_ids(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
        raise InvalidParameter("stop_token_ids", f"stop_token_ids must be a list of token ids "
                                                 f"(integers >= 0), got {_short(ids)}")
    return tuple(ids)
