"""The Python API: LLM(model, ...).generate(prompts, SamplingParams)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence as SequenceABC

from tqdm import tqdm

from nanoserve.chat import check_template_kwargs, template_messages
from nanoserve.config import EngineConfig
from nanoserve.engine.engine import LLMEngine
from nanoserve.engine.prefill_progress import PrefillProgress, prefill_counts
from nanoserve.engine.sequence import Sequence
from nanoserve.errors import InvalidParameter
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """An engine in this process (and, with tensor_parallel_size > 1, its worker processes,
    stopped by `shutdown()`, at the end of a `with` block, when the LLM is collected, or at
    exit)."""

    def __init__(self, model: str | None = None, progress: bool = True, **kwargs) -> None:
        """progress: bars on long work (loading, building plans, prefills of more than a few
        seconds)."""
        self._start(LLMEngine(EngineConfig(model=model or "", **kwargs), progress), progress)

    @classmethod
    def from_config(cls, cfg: EngineConfig, progress: bool = True) -> LLM:
        llm = cls.__new__(cls)
        llm._start(LLMEngine(cfg, progress), progress)
        return llm

    def _start(self, engine: LLMEngine, progress: bool) -> None:
        self.engine, self.progress = engine, progress
        self._finalizer = weakref.finalize(self, engine.shutdown)

    def shutdown(self) -> None:
        """Stops the engine's worker processes (tensor parallelism); the LLM cannot generate
        afterwards. Idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             use_tqdm: bool = False) -> RequestOutput:
        """One conversation (OpenAI's messages; an assistant's tool_calls and tool results
        included) through the model's chat template, with `tools` (OpenAI's function shape)
        and template arguments such as enable_thinking; its RequestOutput. The output is the
        model's text: the server's parsers read tool calls and reasoning out of it."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use generate()")
        prompt = self.tokenizer.apply_chat_template(
            template_messages(messages), tools=tools, tokenize=False,
            add_generation_prompt=True, **check_template_kwargs(chat_template_kwargs))
        return self.generate(prompt, sampling_params, use_tqdm)[0]

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs every prompt to completion with continuous batching; one output per prompt, in
        order. A prompt or SamplingParams that cannot run gives an output with `error` set and
        no completions; a completion whose step failed has finish_reason "error". Neither
        affects the others. Raises ValueError only when the arguments' shapes do not match (no
        request is queued then); the LLM stays usable either way."""
        prompts = _as_prompt_list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"one SamplingParams per prompt ({len(prompts)}), or a single "
                                 f"one for all; got {len(params)}")
        else:
            params = [params] * len(prompts)
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        owner: dict[int, int] = {}  # seq_id -> prompt index
        seqs: dict[int, list[Sequence]] = {}
        prefill = PrefillProgress(self.progress)
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                try:
                    group = self.engine.add_request(prompt, p)
                except ValueError as e:
                    outputs[i] = RequestOutput([], error=str(e))
                    continue
                seqs[i] = group
                owner.update((s.seq_id, i) for s in group)
            bar = tqdm(total=len(owner), desc="Generating", disable=not use_tqdm)
            left = {i: len(g) for i, g in seqs.items()}
            while self.engine.has_unfinished():
                finished = self.engine.step()
                if prefill.enabled:  # a prompt still waits for its prefill while any does
                    if self.engine.scheduler.waiting:
                        prefill.update(*prefill_counts(s for g in seqs.values() for s in g))
                    else:
                        prefill.finish()
                for seq in finished:
                    i = owner.get(seq.seq_id)
                    if i is None:
                        continue
                    bar.update(1)
                    left[i] -= 1
                    if left[i] == 0:
                        outputs[i] = self._output(seqs[i])
            bar.close()
        finally:  # an interrupt or a broken device: leave nothing queued behind
            prefill.close()
            for group in seqs.values():
                for seq in group:
                    if not seq.is_finished:
                        self.engine.abort(seq)
        return outputs

    def _output(self, group: list[Sequence]) -> RequestOutput:
        first = group[0]
        ttft = tpot = None
        starts = [s.first_token_time for s in group if s.first_token_time is not None]
        if starts:
            ttft = min(starts) - first.arrival_time
            tpots = [(s.finish_time - s.first_token_time) / (s.num_output_tokens - 1)
                     for s in group if s.first_token_time is not None and
                     s.num_output_tokens > 1]
            tpot = sum(tpots) / len(tpots) if tpots else None
        outs = [CompletionOutput(s.index, self.engine.decode_text(s), s.output_token_ids,
                                 s.finish_reason, s.logprobs, s.error) for s in group]
        return RequestOutput(first.token_ids[:first.num_prompt_tokens], outs,
                             num_cached_tokens=first.num_cached_tokens or 0, ttft_s=ttft,
                             tpot_s=tpot, prompt_logprobs=first.prompt_logprobs)


def _as_prompt_list(prompts) -> list:
    """One prompt (text or token ids) or a list of them; anything else in a list is one bad
    prompt each, refused by the engine with a clear message. A call of the wrong shape (bytes,
    no sequence, token ids mixed with other items) raises InvalidParameter naming `prompts`."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)):
        raise InvalidParameter("prompts", "prompts must be text or token ids, not bytes: "
                                          "decode them first")
    if not isinstance(prompts, SequenceABC) or isinstance(prompts, dict):
        raise InvalidParameter("prompts", f"prompts must be a string, a list of token ids or a "
                                          f"list of prompts; got {type(prompts).__name__}")
    ids = [isinstance(t, int) and not isinstance(t, bool) for t in prompts]
    if prompts and all(ids):
        return [list(prompts)]
    # ints beside anything but token-id lists are neither one prompt of token ids nor a batch;
    # beside a token-id list (never a token id) the list is a batch and an int one bad prompt
    if any(ids) and not any(isinstance(t, SequenceABC) and not isinstance(t, str)
                            for t in prompts):
        i = ids.index(False)
        raise InvalidParameter("prompts", f"prompts mixes token ids with a "
                                          f"{type(prompts[i]).__name__} (item {i}): one prompt "
                                          f"of token ids is a list of ints only; a batch is a "
                                          f"list of strings or of token-id lists")
    return list(prompts)

