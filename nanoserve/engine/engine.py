"""The engine loop: admit requests, schedule a step, run it, advance the sequences."""

from __future__ import annotations

import gc
import logging
import random
from dataclasses import replace
from pathlib import Path

import torch

from nanoserve.config import EngineConfig
from nanoserve.distributed.parallel_state import destroy_tp, init_tp
from nanoserve.distributed.workers import TensorParallelFailure, TPWorkers, rank_device
from nanoserve.engine.grammar import Grammars
from nanoserve.engine.model_runner import LaunchedStep, ModelRunner, build_worker_runner
from nanoserve.engine.sampler import derive_seed
from nanoserve.engine.scheduler import Batch, Scheduler
from nanoserve.engine.sequence import Sequence
from nanoserve.kv.manager import default_host_budget_gib
from nanoserve.models.config import ModelConfig
from nanoserve.models.loader import load_model, resolve_model_dir
from nanoserve.sampling_params import InvalidParameter, SamplingParams

log = logging.getLogger("nanoserve")


def is_device_failure(e: BaseException) -> bool:
    """Errors that leave the device (or the tensor-parallel group) unusable for every request,
    not just the step's own."""
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return isinstance(e, (accelerator_error, TensorParallelFailure)) or "CUDA error" in str(e)


def load_tokenizer(model_dir: Path):
    """The model's tokenizer, or None when the directory has none (token-id prompts only)."""
    if not any(model_dir.glob("tokenizer*")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class LLMEngine:
    def __init__(self, cfg: EngineConfig, progress: bool = True) -> None:
        self.cfg = cfg
        self.model_dir = resolve_model_dir(cfg.model, cfg.dummy_weights)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        max_pos = self.model_config.max_position_embeddings
        if cfg.max_model_len is not None and cfg.max_model_len > max_pos:
            if not cfg.dummy_weights:
                raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's "
                                 f"max_position_embeddings {max_pos}")
            log.warning("max_model_len %d > max_position_embeddings %d: allowed with dummy "
                        "weights, for benchmarking the shape", cfg.max_model_len, max_pos)
        self.max_model_len = cfg.max_model_len or max_pos
        self.model_config.check_max_model_len(self.max_model_len)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.workers: TPWorkers | None = None
        try:
            self.runner = self._start_runner(progress)
        except BaseException:
            self.shutdown()
            raise
        self.kv = self.runner.kv
        if (short := self.kv.shortfall(self.max_model_len)) is not None:
            log.warning(short)
        eos = self.model_config.eos_token_ids
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        detok = None
        if self.tokenizer is not None:
            def detok(ids):
                return self.tokenizer.decode(ids, skip_special_tokens=True)
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   self.max_model_len, eos, detok,
                                   mixed_steps=self.kv.streamer is None)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, eos)
        self.sequences: dict[int, Sequence] = {}
        self._seeds = random.Random(cfg.seed)  # seeds of requests that bring none
        self._launched: LaunchedStep | None = None  # async scheduling: the step in flight

    def _start_runner(self, progress: bool) -> ModelRunner:
        """This process's model runner; under tensor parallelism, first the workers (ranks
        1..N-1, building theirs at the same time) and this process's place in the group."""
        cfg = self.cfg
        if cfg.tensor_parallel_size > 1:
            self.model_config.check_tensor_parallel(cfg.tensor_parallel_size)
            if cfg.enable_offload and cfg.host_kv_budget_gib is None:  # one figure for all
                cfg = self.cfg = replace(cfg, host_kv_budget_gib=default_host_budget_gib())
            self.workers = TPWorkers(cfg, self.model_dir, self.max_model_len,
                                     build_worker_runner)
            init_tp(0, cfg.tensor_parallel_size, self.workers.init_method,
                    rank_device(cfg.torch_device, 0))
        model = load_model(self.model_dir, self.max_model_len, cfg.torch_dtype,
                           cfg.torch_device, cfg.dummy_weights, cfg.seed, progress)
        runner = ModelRunner(cfg, model, self.max_model_len, progress, self.workers)
        if self.workers is not None:
            self.workers.wait_ready()
        if runner.device.type == "cuda":  # the CPU compiles nothing (fused kernels are CUDA's)
            runner.warm_up_prompts()
        return runner

    @property
    def failure(self) -> str | None:
        """Why the engine cannot run steps any more (a tensor-parallel rank died), or None."""
        return self.workers.failure if self.workers is not None else None

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any, and leaves the group with them (every
        rank at once: see parallel_state.destroy_tp), and the CPU attention thread, once the
        device has run what was launched (it may wait on that thread). Idempotent; no step
        runs after it."""
        share = getattr(getattr(self, "runner", None), "cpu_share", None)
        if share is not None and share.worker is not None:
            if share.device.type == "cuda":
                torch.cuda.synchronize(share.device)
            share.close()
        workers, self.workers = self.workers, None
        if workers is None:
            return
        alive = workers.failure is None
        runner = getattr(self, "runner", None)
        if runner is not None:  # decode graphs hold captured collectives: released first
            runner.graphs = None
            gc.collect()
            if alive and runner.device.type == "cuda":  # (with a rank gone it may never end)
                torch.cuda.synchronize(runner.device)
        workers.stop()
        destroy_tp(peers_alive=alive)
        workers.join()

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text or token-id prompt; InvalidParameter("prompt") otherwise."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameter("prompt", f"model {self.model_dir} has no tokenizer: "
                                                 "pass token ids")
            if not prompt:
                raise InvalidParameter("prompt", "empty prompt")
            try:
                return self.tokenizer.encode(prompt, add_special_tokens=False)
            except UnicodeEncodeError as e:  # a lone surrogate
                raise InvalidParameter("prompt", f"prompt is not valid Unicode: {e.reason} "
                                                 f"at position {e.start}") from e
        vocab = self.model_config.vocab_size
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                for t in prompt):
            raise InvalidParameter("prompt", f"a prompt is a string or a list of token ids "
                                             f"(integers in [0, {vocab})), got "
                                             f"{type(prompt).__name__}")
        return list(prompt)

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against this model's vocabulary."""
        if not isinstance(params, SamplingParams):
            raise InvalidParameter("sampling_params", f"expected SamplingParams, got "
                                                      f"{type(params).__name__}")
        vocab = self.model_config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidParameter(name, f"{name}: token id {bad[0]} is not in the "
                                             f"vocabulary [0, {vocab})")
        if params.structured_outputs is not None:
            self.grammars.prototype(params.structured_outputs)

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> list[Sequence]:
        """Queues the request's `params.n` sequences (one per completion, index 0..n-1).
        Raises ValueError (InvalidParameter naming the field) for a request that cannot run;
        nothing is queued then and nothing else is affected. Raises TensorParallelFailure once a
        tensor-parallel rank is gone."""
        if self.workers is not None:
            self.workers.check()
        self.check_params(params)
        ids = self.tokenize(prompt)
        self.scheduler.check_admissible(len(ids))
        base = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        # the prompt is scored once, by completion 0 (admitted first: the others queue behind
        # it), whose logprobs serve the whole request
        unscored = params if params.prompt_logprobs is None else \
            params.replace(prompt_logprobs=None)
        seqs = [Sequence(ids, params if i == 0 else unscored, i, derive_seed(base, i))
                for i in range(params.n)]
        if params.structured_outputs is not None:
            for seq in seqs:
                seq.grammar = self.grammars.start(params.structured_outputs)
        for seq in seqs:
            self.scheduler.add(seq)
            self.sequences[seq.seq_id] = seq
        return seqs

    def step(self) -> list[Sequence]:
        """One scheduled step; returns the sequences that finished in it. A failure inside the
        step fails the sequences it belongs to (finish_reason "error") and nothing else; only a
        device failure, which no later step would survive either, is raised.

        Async scheduling: a plain decode step is launched before the previous one's tokens are
        read; the host reads those while the device runs the new step. A sequence that stopped
        in the previous step has then already been given a row in the new one: that row's token
        is discarded when it is read (Scheduler.postprocess skips finished sequences), and the
        KV it writes lands in pages just freed, which the stream's order keeps from any later
        owner until it is done. With streamed layers the copy stream's order does the same for
        tails, ring slots and host pages: every ordering there is queued, none waits on the
        host (offload/streamer.py)."""
        if self.workers is not None:
            self.workers.check()
        ahead = self._can_launch_ahead()
        finished = [] if ahead else self._collect_launched()
        batch, dropped = self.scheduler.schedule()
        finished += dropped
        if batch is None:
            finished += self._collect_launched()
        elif ahead:
            finished += self._launch(batch)
        else:
            finished += self._run(batch)
        for seq in finished:
            self.sequences.pop(seq.seq_id, None)
            self.runner.release(seq.seq_id)
        return finished

    def _run(self, batch: Batch) -> list[Sequence]:
        try:
            tokens = self.runner.run(batch)
        except Exception as e:
            if is_device_failure(e):
                raise
            return self._run_one_by_one(batch, e)
        return self._postprocess(batch, tokens)

    def _can_launch_ahead(self) -> bool:
        """Whether the next step may launch before the step in flight is read: a plain decode
        step (no prefill, no preemption) whose sampling reads nothing the host has not seen
        (no penalties, no logprobs). A grammar's mask needs the token in flight: such a step
        is launched unsampled and sampled once that token is read (_launch). Under
        tensor parallelism rank 0 sends each launched step's ids to the workers on the device
        (ModelRunner.launch). With streamed layers the next
        step's loads then queue on the copy stream behind this step's, so the link never waits
        for the host between steps; the streamer's ordering is all on the device
        (offload/streamer.py), and a step's plan counts the tokens still in flight."""
        return (self.cfg.async_scheduling
                and self.scheduler.next_step_is_plain_decode()
                and all(not s.params.has_penalties and s.params.logprobs is None
                        for s in self.scheduler.running))

    def _launch(self, batch: Batch) -> list[Sequence]:
        """Launches `batch` behind the step in flight, then reads that one's tokens while the
        new step runs. Under a grammar the new step's sampling is queued after that read: the
        tokens advance the grammars, whose masks the sampling applies, while the new step's
        forward runs."""
        previous = self._launched
        constrained = any(s.grammar is not None for s in batch.seqs)
        try:
            launched = self.runner.launch(batch, previous.tokens if previous else None,
                                          sample=not constrained)
        except Exception as e:
            if is_device_failure(e):
                raise
            return self._collect_launched() + self._rerun_live(batch, e)
        for seq in batch.seqs:
            seq.num_pending += 1
        self._launched = launched
        finished = self._collect(previous)
        if constrained:
            try:
                self.runner.sample_launched(launched)
            except Exception as e:
                if is_device_failure(e):
                    raise
                self._launched = None
                for seq in batch.seqs:
                    seq.num_pending -= 1
                return finished + self._rerun_live(batch, e)
        return finished

    def _rerun_live(self, batch: Batch, error: Exception) -> list[Sequence]:
        """A failed decode step's sequences still running, rerun one by one (nothing of the
        failed step was read: their state is where it was before it)."""
        live = [s for s in batch.seqs if not s.is_finished]
        return self._run_one_by_one(Batch(False, live, [1] * len(live)), error)

    def _collect_launched(self) -> list[Sequence]:
        """Reads the step in flight (if any) and advances its sequences."""
        step, self._launched = self._launched, None
        return self._collect(step)

    def _collect(self, step: LaunchedStep | None) -> list[Sequence]:
        if step is None:
            return []
        tokens = self.runner.collect(step)
        for seq in step.batch.seqs:
            seq.num_pending -= 1
        return self._postprocess(step.batch, tokens)

    def _run_one_by_one(self, batch: Batch, error: Exception) -> list[Sequence]:
        """Reruns a failed step's sequences alone, so the failure lands on its owner. Rerunning
        is safe: a sequence's state advances only in postprocess, which runs only after its
        step succeeded."""
        if len(batch.seqs) == 1:
            self._fail(batch.seqs[0], error)
            return batch.seqs
        finished = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            alone = Batch(batch.is_prefill, [seq], [n])  # a decode row alone: a 1-token chunk
            try:
                tokens = self.runner.run(alone)
            except Exception as e:
                if is_device_failure(e):
                    raise
                self._fail(seq, e)
                finished.append(seq)
            else:
                finished += self._postprocess(alone, tokens)
        return finished

    def _postprocess(self, batch: Batch, tokens: list[int | None]) -> list[Sequence]:
        """The step's tokens into its sequences. Should that raise (a stop-string check's
        detokenizer, say), the step's sequences fail: their state may be half advanced."""
        live = [s for s in batch.seqs if not s.is_finished]  # async: some stopped a step ago
        try:
            return self.scheduler.postprocess(batch, tokens)
        except Exception as e:
            for seq in live:
                if not seq.is_finished:
                    self._fail(seq, e)
            return live

    def _fail(self, seq: Sequence, error: Exception) -> None:
        log.error("request %d failed in a step: %s: %s", seq.seq_id, type(error).__name__, error,
                  exc_info=error)
        self.scheduler.finish(seq, "error")
        seq.error = f"{type(error).__name__}: {error}"

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)
        self.sequences.pop(seq.seq_id, None)
        self.runner.release(seq.seq_id)
        if self._launched is not None and all(s.is_finished for s in self._launched.batch.seqs):
            self._launched = None  # nothing left to read from it

    def prepare_thread(self) -> None:
        """For a thread other than the one that built the engine, before it runs steps: builds
        what is cached per thread (cuDNN's prefill attention plans, ModelRunner), so its first
        requests do not pay for it."""
        self.runner.build_prefill_plans()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._launched is not None

    def describe_memory(self) -> str:
        split = self.runner.cpu_split
        return self.kv.describe() + ("" if split is None else "\n  " + split.describe())

    def decode_text(self, seq: Sequence) -> str:
        if seq.output_text is not None or self.tokenizer is None:
            return seq.output_text or ""
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
