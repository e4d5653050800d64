"""The engine on a background thread, fed by asyncio request handlers.

The thread owns the LLMEngine: only it adds, aborts and steps. Handlers send it commands through
a queue and read per-request outputs from asyncio queues, so requests that arrive while others
decode join the running batch at the next step, and tokenization and detokenization happen on the
event loop, off the engine's critical path.

A prompt is its `n` sequences (one per completion); its stream carries the deltas of all of
them, each tagged with its completion's index, and ends after every completion's last delta. A
request of several prompts is submitted at once, all or none: its prompts' streams share one
queue, and prompt i's completion j is tagged i * n + j (OpenAI's choice index).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from nanoserve.engine.engine import LLMEngine
from nanoserve.engine.sequence import Sequence
from nanoserve.outputs import TokenLogprobs
from nanoserve.sampling_params import SamplingParams

log = logging.getLogger("nanoserve.serve")

SHUTDOWN_MESSAGE = "request aborted: the server is shutting down"


class ServerOverloaded(RuntimeError):
    """More sequences in flight than the server takes; the client should retry later."""


class PromptRefused(ValueError):
    """The engine refused prompt `index` of a request (`cause`, an InvalidParameter); none of
    the request's prompts runs."""

    def __init__(self, index: int, cause: Exception) -> None:
        super().__init__(str(cause))
        self.index, self.cause = index, cause


@dataclass
class Delta:
    index: int  # which of the request's completions
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per token, when asked for
    finish_reason: str | None = None  # stop | length | abort | error, on the last delta
    stop_text: str | None = None  # the output text cut before a stop string
    error: str | None = None  # why: finish_reason error, or abort at shutdown
    # SamplingParams.prompt_logprobs: the prompt's, complete, on the first delta with tokens
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class RequestStream:
    """One prompt's outputs, in order; the engine thread writes, a handler reads."""

    loop: asyncio.AbstractEventLoop
    n: int = 1
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_index: int = 0  # its deltas' index: first_index + completion index
    seqs: list[Sequence] = field(default_factory=list)
    num_sent: list[int] = field(default_factory=list)  # per completion: tokens sent
    last_time: list[float] = field(default_factory=list)  # per completion: last token sent
    num_open: int = 0  # completions not finished yet
    num_prompt_tokens: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_seen: bool = False

    def put(self, delta: Delta) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache served (set when the request was admitted)."""
        return (self.seqs[0].num_cached_tokens or 0) if self.seqs else 0


@dataclass
class BatchStream:
    """A request's prompts, one RequestStream each, all writing to one queue: choice i * n + j
    is prompt i's completion j."""

    streams: list[RequestStream]

    @property
    def queue(self) -> asyncio.Queue:
        return self.streams[0].queue

    @property
    def n(self) -> int:
        """Completions of all prompts together."""
        return sum(s.n for s in self.streams)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(s.num_prompt_tokens for s in self.streams)

    @property
    def num_cached_tokens(self) -> int:
        return sum(s.num_cached_tokens for s in self.streams)


@dataclass
class EngineStats:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # completions, by reason
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # (time, new tokens)

    def tokens_per_second(self, window_s: float = 10.0) -> float:
        now = time.perf_counter()
        items = [(t, n) for t, n in list(self.recent) if now - t <= window_s]
        if not items:
            return 0.0
        span = max(now - items[0][0], 1e-3)
        return sum(n for _, n in items) / span


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.stats = EngineStats()
        self.error: str | None = None  # set if the engine loop died
        self.observer = None  # latency histograms (serve.metrics.Metrics), set by the app
        self.draining = False  # shutting down: no new requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._in_flight = 0  # sequences submitted and not finished
        self._streams: dict[int, tuple[RequestStream, Sequence]] = {}  # by seq_id
        self._thread = threading.Thread(target=self._loop, name="nanoserve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def begin_shutdown(self) -> None:
        """Refuses new requests and aborts those in flight: their streams end at once with an
        abort (an error event for the client), so nothing is left for a graceful shutdown to
        wait for."""
        self.draining = True
        self._inbox.put(("abort_all",))
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Aborts every request and stops the loop."""
        self.draining = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """False once the loop died or a tensor-parallel rank is gone (the loop may then be
        blocked in a step that cannot finish: requests are refused without waiting for it)."""
        failure = self.engine.failure
        if failure is not None and self.error is None:
            self.error = failure
        return self._thread.is_alive() and self.error is None

    async def submit(self, token_ids: list[int], params: SamplingParams,
                     max_in_flight: int | None = None) -> RequestStream:
        """Queues a request. Raises ValueError (InvalidParameter, from the engine) when it
        cannot run, ServerOverloaded when more than `max_in_flight` sequences would be in
        flight, RuntimeError when the engine is not running."""
        try:
            batch = await self.submit_batch([token_ids], params, max_in_flight)
        except PromptRefused as e:
            raise e.cause from None
        return batch.streams[0]

    async def submit_batch(self, prompts: list[list[int]], params: SamplingParams,
                           max_in_flight: int | None = None) -> BatchStream:
        """Queues a request of several prompts, each with `params` (its n completions), all or
        none. Raises PromptRefused naming the first prompt the engine refused (ValueError),
        RuntimeError (TensorParallelFailure) when the engine cannot take it, ServerOverloaded
        when more than `max_in_flight` sequences would be in flight, RuntimeError when the
        engine is not running."""
        if not self.alive or self.draining:
            raise RuntimeError("the engine is not running: " + (
                self.error or ("the server is shutting down" if self.draining else "stopped")))
        count = params.n * len(prompts)
        with self._lock:
            if max_in_flight is not None and self._in_flight + count > max_in_flight:
                raise ServerOverloaded(f"the server is overloaded: {self._in_flight} sequences "
                                       f"in flight, at most {max_in_flight}; retry later")
            self._in_flight += count
        loop = asyncio.get_running_loop()
        shared: asyncio.Queue = asyncio.Queue()
        batch = BatchStream([RequestStream(loop, params.n, shared, i * params.n)
                             for i in range(len(prompts))])
        admitted = loop.create_future()
        self._inbox.put(("add", prompts, params, batch, admitted))
        self._wake.set()
        try:
            await admitted
        except asyncio.CancelledError:  # the client left before admission: do not run it
            self.abort(batch)
            raise
        return batch

    def abort(self, stream: RequestStream | BatchStream) -> None:
        for s in stream.streams if isinstance(stream, BatchStream) else [stream]:
            self._inbox.put(("abort", s))
        self._wake.set()

    def _done(self, count: int) -> None:
        with self._lock:
            self._in_flight -= count

    # --- engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self.engine.prepare_thread()  # requests that arrive meanwhile wait in the inbox
            while not self._stop.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                finished = self.engine.step()
                self._publish(finished)
        except Exception as e:  # a broken device: fail every request, report unhealthy
            log.exception("engine loop failed")
            self.error = f"{type(e).__name__}: {e}"
            for stream, seq in self._streams.values():
                stream.put(Delta(seq.index, [], finish_reason="error", error=self.error))
            self._streams.clear()
            self._fail_inbox()
            return
        self._drain_inbox()  # requests queued in the meantime are admitted, then aborted
        self._abort_all(SHUTDOWN_MESSAGE)
        self._fail_inbox()

    def _queued(self):
        """The commands queued so far, taken one by one."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _fail_inbox(self) -> None:
        """After the loop: requests still queued are refused (their submit raises)."""
        for cmd in self._queued():
            if cmd[0] == "add":
                batch, admitted = cmd[3], cmd[4]
                batch.streams[0].loop.call_soon_threadsafe(
                    _set_exception, admitted, RuntimeError(self.error or "engine stopped"))

    def _drain_inbox(self) -> None:
        for cmd in self._queued():
            if cmd[0] == "add":
                self._add(*cmd[1:])
            elif cmd[0] == "abort":
                self._abort(cmd[1], None)
            else:
                self._abort_all(SHUTDOWN_MESSAGE)

    def _add(self, prompts: list[list[int]], params: SamplingParams, batch: BatchStream,
             admitted: asyncio.Future) -> None:
        added: list[list[Sequence]] = []
        for i, token_ids in enumerate(prompts):
            try:
                added.append(self.engine.add_request(token_ids, params))
            except Exception as e:  # InvalidParameter: the request is refused alone
                for seqs in added:  # no step has run since they were queued: nothing ran
                    for seq in seqs:
                        self.engine.abort(seq)
                self._done(params.n * len(prompts))
                refusal = PromptRefused(i, e) if isinstance(e, ValueError) else e
                batch.streams[0].loop.call_soon_threadsafe(_set_exception, admitted, refusal)
                return
        for stream, seqs in zip(batch.streams, added, strict=True):
            stream.seqs = seqs
            stream.num_sent = [0] * len(seqs)
            stream.last_time = [0.0] * len(seqs)
            stream.num_open = len(seqs)
            stream.num_prompt_tokens = seqs[0].num_prompt_tokens
            for seq in seqs:
                self._streams[seq.seq_id] = (stream, seq)
            self.stats.prompt_tokens_total += stream.num_prompt_tokens
        batch.streams[0].loop.call_soon_threadsafe(_set_result, admitted)

    def _abort(self, stream: RequestStream, error: str | None) -> None:
        for seq in stream.seqs:
            if self._streams.pop(seq.seq_id, None) is not None:
                self.engine.abort(seq)
                self._emit(stream, seq, "abort", error)

    def _abort_all(self, error: str) -> None:
        for stream in {id(s): s for s, _ in self._streams.values()}.values():
            self._abort(stream, error)

    def _publish(self, finished: list[Sequence]) -> None:
        done = {s.seq_id for s in finished}
        new_tokens = 0
        for seq_id, (stream, seq) in list(self._streams.items()):
            n = seq.num_output_tokens
            new_tokens += n - stream.num_sent[seq.index]
            if seq_id in done:
                del self._streams[seq_id]
                self._emit(stream, seq, seq.finish_reason, seq.error)
            elif n > stream.num_sent[seq.index]:
                self._emit(stream, seq, None)
        self.stats.generation_tokens_total += new_tokens
        self.stats.recent.append((time.perf_counter(), new_tokens))

    def _emit(self, stream: RequestStream, seq: Sequence, finish_reason: str | None,
              error: str | None = None) -> None:
        i = seq.index
        start = stream.num_sent[i]
        ids = seq.output_token_ids[start:]
        logprobs = None if seq.logprobs is None else seq.logprobs[start:start + len(ids)]
        # completion 0 scores the prompt for the request (LLMEngine.add_request)
        prompt_logprobs = stream.seqs[0].prompt_logprobs if start == 0 and ids else None
        stream.num_sent[i] += len(ids)
        stop_text = seq.output_text if finish_reason is not None else None
        stream.put(Delta(stream.first_index + i, ids, logprobs, finish_reason, stop_text, error,
                         prompt_logprobs))
        self._observe(stream, seq, len(ids), finish_reason)
        if finish_reason is not None:
            counts = self.stats.requests_finished
            counts[finish_reason] = counts.get(finish_reason, 0) + 1
            stream.num_open -= 1
            self._done(1)

    def _observe(self, stream: RequestStream, seq: Sequence, num_new: int,
                 finish_reason: str | None) -> None:
        obs = self.observer
        if obs is None:
            return
        now = time.perf_counter()
        i = seq.index
        if num_new:
            if not stream.first_token_seen and seq.first_token_time is not None:
                stream.first_token_seen = True
                obs.first_token(seq.first_token_time - stream.arrival_time)
                if seq.first_scheduled_time is not None:
                    obs.queued(seq.first_scheduled_time - stream.arrival_time)
            elif stream.last_time[i]:
                # tokens arriving together in one delta share the interval
                obs.inter_token((now - stream.last_time[i]) / num_new, num_new)
            stream.last_time[i] = now
        if finish_reason is not None and stream.num_open == 1:  # the request's last one
            obs.finished(now - stream.arrival_time)


def _set_result(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future, exc: Exception) -> None:
    if not fut.done():
        fut.set_exception(exc)
