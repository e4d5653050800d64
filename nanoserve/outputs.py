"""What a finished request returns: vLLM's shape (a request, its n completions, their
logprobs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class TokenLogprobs(NamedTuple):
    """One generated token: its log-probability under the model's distribution (the raw
    logits, before temperature, penalties or filters) and the `k` most likely tokens there."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # stop | length | abort | error
    logprobs: list[TokenLogprobs] | None = None  # when SamplingParams.logprobs is set
    error: str | None = None  # why finish_reason is "error"


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)  # n of them, by index
    error: str | None = None  # the request was refused: no outputs
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # with SamplingParams.prompt_logprobs: one per prompt token, the first None (nothing
    # precedes it); each the token's logprob given the tokens before it, and the top k there
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None  # mean time per output token after the first

    # the first completion's fields, for the common n=1 case
    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason if self.outputs else "error"
