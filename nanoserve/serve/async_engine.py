"""The engine on a background thread, fed by asyncio request handlers.

The thread owns the LLMEngine: only it adds, aborts and steps. Handlers send it commands through
a queue and read per-request outputs from asyncio queues, so requests that arrive while others
decode join the running batch at the next step, and tokenization and detokenization happen on the
event loop, off the engine's critical path.
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
from nanoserve.sampling_params import SamplingParams

log = logging.getLogger("nanoserve.serve")


@dataclass
class Delta:
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error, on the last delta
    stop_text: str | None = None  # the output text cut before a stop string
    error: str | None = None


@dataclass
class RequestStream:
    """One request's outputs, in order; the engine thread writes, a handler reads."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None
    num_sent: int = 0
    num_prompt_tokens: int = 0

    def put(self, delta: Delta) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)


@dataclass
class EngineStats:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)
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
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[int, RequestStream] = {}
        self._thread = threading.Thread(target=self._loop, name="nanoserve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Aborts every request and stops the loop."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def submit(self, token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queues a request; raises ValueError (from the engine) when it cannot run."""
        if not self.alive:
            raise RuntimeError(f"engine is not running: {self.error or 'stopped'}")
        loop = asyncio.get_running_loop()
        stream = RequestStream(loop)
        admitted = loop.create_future()
        self._inbox.put(("add", token_ids, params, stream, admitted))
        self._wake.set()
        try:
            await admitted
        except asyncio.CancelledError:  # the client left before admission: do not run it
            self.abort(stream)
            raise
        return stream

    def abort(self, stream: RequestStream) -> None:
        self._inbox.put(("abort", stream))
        self._wake.set()

    # --- engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        try:
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
            for stream in self._streams.values():
                stream.put(Delta([], "error", error=self.error))
            self._streams.clear()
            return
        for stream in list(self._streams.values()):  # shutdown
            self.engine.abort(stream.seq)
            self._emit(stream, "abort")
        self._streams.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, token_ids, params, stream, admitted = cmd
                try:
                    seq = self.engine.add_request(token_ids, params)
                except ValueError as e:
                    stream.loop.call_soon_threadsafe(_set_exception, admitted, e)
                    continue
                stream.seq, stream.num_prompt_tokens = seq, seq.num_prompt_tokens
                self._streams[seq.seq_id] = stream
                self.stats.prompt_tokens_total += seq.num_prompt_tokens
                stream.loop.call_soon_threadsafe(_set_result, admitted)
            else:
                stream = cmd[1]
                if stream.seq is not None and self._streams.pop(stream.seq.seq_id, None):
                    self.engine.abort(stream.seq)
                    self._emit(stream, "abort")

    def _publish(self, finished: list[Sequence]) -> None:
        done = {s.seq_id for s in finished}
        new_tokens = 0
        for seq_id, stream in list(self._streams.items()):
            n = stream.seq.num_output_tokens
            new_tokens += n - stream.num_sent
            if seq_id in done:
                self._emit(stream, stream.seq.finish_reason)
                del self._streams[seq_id]
            elif n > stream.num_sent:
                self._emit(stream, None)
        self.stats.generation_tokens_total += new_tokens
        self.stats.recent.append((time.perf_counter(), new_tokens))

    def _emit(self, stream: RequestStream, finish_reason: str | None) -> None:
        seq = stream.seq
        ids = seq.output_token_ids[stream.num_sent:]
        stream.num_sent += len(ids)
        stop_text = seq.output_text if finish_reason is not None else None
        stream.put(Delta(ids, finish_reason, stop_text))
        if finish_reason is not None:
            counts = self.stats.requests_finished
            counts[finish_reason] = counts.get(finish_reason, 0) + 1


def _set_result(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future, exc: Exception) -> None:
    if not fut.done():
        fut.set_exception(exc)
