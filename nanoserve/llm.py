"""The Python API: LLM(model, ...).generate(prompts, SamplingParams)."""

from __future__ import annotations

from dataclasses import dataclass

from tqdm import tqdm

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import LLMEngine
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # stop | length | abort | error
    error: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None  # mean time per output token after the first


class LLM:
    def __init__(self, model: str | None = None, progress: bool = True, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model or "", **kwargs), progress)

    @classmethod
    def from_config(cls, cfg: EngineConfig, progress: bool = True) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(cfg, progress)
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs every prompt to completion with continuous batching. A prompt that cannot run
        gets an output with `error` set; the others are unaffected."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        seqs: dict[int, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            try:
                seqs[self.engine.add_request(prompt, p).seq_id] = i
            except ValueError as e:
                outputs[i] = RequestOutput([], [], "", "error", error=str(e))
        bar = tqdm(total=len(seqs), desc="Generating", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for seq in self.engine.step():
                if seq.seq_id in seqs:
                    outputs[seqs[seq.seq_id]] = self._output(seq)
                    bar.update(1)
        bar.close()
        return outputs

    def _output(self, seq: Sequence) -> RequestOutput:
        ttft = tpot = None
        if seq.first_token_time is not None:
            ttft = seq.first_token_time - seq.arrival_time
            if seq.num_output_tokens > 1:
                tpot = (seq.finish_time - seq.first_token_time) / (seq.num_output_tokens - 1)
        return RequestOutput(seq.token_ids[:seq.num_prompt_tokens], seq.output_token_ids,
                             self.engine.decode_text(seq), seq.finish_reason, ttft_s=ttft,
                             tpot_s=tpot)
