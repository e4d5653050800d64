"""The CPU's share of the streamed layers' decode attention: offloaded decode below the link's
floor, exactly.

In a decode step with streamed layers, sequence i may give the CPU its first `cpu_tokens[i]`
tokens (whole pages, all in the host store already). Those pages do not cross the link (the
step's load runs skip them); for every streamed layer, the CPU attends them straight from the
host store while the copy engine brings the rest of the layer into its ring slot and the GPU
attends that; the two partial results merge by their log-sum-exps. No token is skipped.

Per streamed layer (AttentionBackend.split_decode):
1. `send_q`: q goes to a pinned buffer (a device-to-host copy on the compute stream), then the
   step's number to the layer's q flag in pinned memory;
2. the GPU's share is enqueued (stage 1 of split-KV decode, over tokens [cpu_tokens, len));
3. `attend`: the CPU's output and LSE are read from pinned buffers (by a kernel, with the
   worker: a copy engine would queue them behind the layers' loads) and merged, after the GPU
   has waited for the layer's done flag (attention/host_flags.py).
The host's work runs on a thread of its own (ShareWorker, csrc/cpu_decode.cpp): it spins on
the q flag, runs the kernel over the layer's host KV, writes the done flag. Nothing in the
step waits on the thread that launches it, so a decode step is one CUDA graph as any other,
and the engine's thread prepares the next step while this one runs. The CPU's share of layer
j cannot start before its q, which needs layer j-1's output, which needs its CPU share: that
chain is the overhead per layer the split plans with (offload/cpu_split.py). Meanwhile the
copy stream keeps loading the next layers (offload/streamer.py).

Where the C++ kernel could not be built (torch's kernel serves), the engine's thread does the
host's work itself: `sync` meets the stream there (EagerSync records and waits on events;
while a decode graph is captured, the graph runner cuts the graph at the mark and at the
host's work instead). On a CPU device everything runs in order, inline.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from nanoserve.attention.cpu_decode import Kernel
from offload import PageLayout


class EagerSync:
    """The mark is an event on the compute stream; the host's work waits for it."""

    def __init__(self, device: torch.device) -> None:
        self.event = torch.cuda.Event() if device.type == "cuda" else None

    def mark(self) -> None:
        if self.event is not None:
            self.event.record()

    def after_mark(self, work: Callable[[], None], wait: Callable[[], bool]) -> None:
        """work, after the mark where wait() says it must wait (asked when the work runs)."""
        if self.event is not None and wait():
            self.event.synchronize()
        work()


class CpuShare:
    def __init__(self, host_kv: torch.Tensor, layout: PageLayout, kernel: Kernel,
                 max_rows: int, num_heads: int, head_dim: int, scale: float,
                 device: torch.device) -> None:
        """host_kv: the host store's rows of every streamed layer [layers, 2, pages, row]."""
        self.host_kv, self.layout, self.kernel, self.scale = host_kv, layout, kernel, scale
        self.device = device
        pin = device.type == "cuda"
        f32 = dict(dtype=torch.float32, pin_memory=pin)
        self.q = torch.zeros(max_rows, num_heads, head_dim, **f32)
        self.o = torch.zeros(max_rows, num_heads, head_dim, **f32)
        self.lse = torch.full((max_rows, num_heads), -torch.inf, **f32)
        # device: each row's first token attended on the GPU (fixed address: decode graphs)
        self.starts = torch.zeros(max_rows, dtype=torch.int32, device=device)
        # host: each row's CPU range [0, ends) and page table, for the current step
        self.zeros = torch.zeros(max_rows, dtype=torch.int32)
        self.ends = torch.zeros(max_rows, dtype=torch.int32)
        self.table = torch.zeros(max_rows, 1, dtype=torch.int32)
        self.tokens = 0
        self.active = False  # some row of the step has CPU tokens
        # a step's host time in the kernel and between kernels (the layer's cycle besides the
        # CPU's work: the GPU's work on the layer, the syncs, the graph launches), summed
        self.worked = self.between = 0.0
        self.layers = self.gaps = 0
        self.on_step: Callable[[float, float, int], None] | None = None  # (gap, work, tokens)
        # recent steps' (gap, work) per layer, tokens per layer, and the host's time from the
        # step's last kernel to the next step's first (what the bench reports)
        self.history: deque[tuple[float, float, int, float]] = deque(maxlen=1024)
        self._last_end: float | None = None
        self._step_end: float | None = None
        self._step_gap = float("nan")
        self.cleared = True  # o, lse hold zeros and -inf: what an inactive step uploads
        self.sync = EagerSync(device)
        self.probe: dict | None = None  # the start-up probe's figures (cpu_split_setup.py)
        self.worker = None  # the host's thread (start_worker); None: the engine's thread
        self.threads = torch.get_num_threads()

    def start_worker(self) -> bool:
        """Moves the host's work to a thread of its own, where the C++ kernel exists and
        the device is a GPU; False where it stays on the engine's thread."""
        if self.device.type != "cuda" or self.worker is not None:
            return self.worker is not None
        from nanoserve.attention import host_flags
        from nanoserve.attention.cpu_decode import share_worker

        layers = self.host_kv.shape[0]
        pinned = dict(dtype=torch.int32, pin_memory=True)
        self.q_flags = torch.zeros(layers, **pinned)
        self.done_flags = torch.zeros(layers, **pinned)
        self.error = torch.zeros(1, **pinned)
        self.worker = share_worker(self.q, self.o, self.lse, self.host_kv, self.q_flags,
                                   self.done_flags, self.layout, self.scale, self.threads)
        if self.worker is None:
            return False
        self._wait, self._read = host_flags.wait_for_host, host_flags.read_host
        self._o_view = host_flags.device_view(self.o, self.device)
        self._lse_view = host_flags.device_view(self.lse, self.device)
        self._done_view = host_flags.device_view(self.done_flags, self.device)
        self._error_view = host_flags.device_view(self.error, self.device)
        self.step = 0
        self.step_on_device = torch.zeros((), dtype=torch.int32, device=self.device)
        return True

    def close(self) -> None:
        """Stops the host's thread (idempotent); no step with a CPU share runs after it."""
        if self.worker is not None:
            self.worker.close()

    def begin_step(self, cpu_tokens: np.ndarray | None, table: np.ndarray | None,
                   gpu_starts: torch.Tensor | None, rows: int = 0) -> None:
        """A decode step of `rows` rows: each row's CPU token count and page table (host
        arrays), and its first GPU token (on the device); None: no CPU share in this step.
        Rows past them (graph padding) have none."""
        if self.worker is not None:
            self._begin_on_worker(cpu_tokens, table, gpu_starts, rows)
            return
        if self.gaps:  # the last step's figures, per layer
            gap, work = self.between / self.gaps, self.worked / self.layers
            self.history.append((gap, work, self.tokens, self._step_gap))
            if self.on_step is not None:
                self.on_step(gap, work, self.tokens)
        self.worked = self.between = 0.0
        self.layers = self.gaps = 0
        self._step_end, self._last_end = self._last_end, None
        self._step_gap = float("nan")
        n = 0 if cpu_tokens is None else len(cpu_tokens)
        self.ends.zero_()
        self.starts[n:].zero_()
        if n:
            self.ends[:n] = torch.from_numpy(cpu_tokens)
            self.table = torch.from_numpy(np.ascontiguousarray(table, dtype=np.int32))
            self.starts[:n].copy_(gpu_starts, non_blocking=True)
        self.tokens = int(self.ends.sum())  # the step's tokens on the CPU, per layer
        self.active = self.tokens > 0

    def _begin_on_worker(self, cpu_tokens, table, gpu_starts, rows: int) -> None:
        for gap, work, tokens, step_gap in self.worker.drain():  # the steps served since
            self.history.append((gap, work, tokens, step_gap))
            if self.on_step is not None:
                self.on_step(gap, work, tokens)
        self._raise_if_failed()
        n = 0 if cpu_tokens is None else len(cpu_tokens)
        ends = np.zeros(max(rows, n), dtype=np.int32)
        if n:
            ends[:n] = cpu_tokens
            self.starts[:n].copy_(gpu_starts, non_blocking=True)
        else:
            table = np.zeros((len(ends), 1), dtype=np.int32)
        self.starts[n:].zero_()
        self.tokens = int(ends.sum())
        self.active = self.tokens > 0
        self.step += 1
        self.step_on_device.fill_(self.step)
        self.worker.submit(self.step, torch.from_numpy(ends),
                           torch.from_numpy(np.ascontiguousarray(table, dtype=np.int32)))

    def _raise_if_failed(self) -> None:
        if int(self.error[0]):
            raise RuntimeError("CPU attention: the GPU gave up waiting for the host's share "
                               "of a layer (its thread stalled or stopped)")
        message = self.worker.error()
        if message:
            raise RuntimeError(f"CPU attention failed on the host: {message}")

    def send_q(self, q: torch.Tensor, host_layer: int) -> None:
        """A streamed layer's queries [rows, heads, d] to the host, then the mark (the
        layer's q flag, where the host's thread waits on it)."""
        self.q[:q.shape[0]].copy_(q, non_blocking=True)
        if self.worker is not None:
            self.q_flags[host_layer].copy_(self.step_on_device, non_blocking=True)
        else:
            self.sync.mark()

    def attend(self, host_layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU's share of host layer `host_layer` for the step's rows, on the device:
        output [rows, heads, d] and LSE [rows, heads], float32 (zeros and -inf for rows
        without CPU tokens)."""
        if self.worker is not None:
            self._wait(self._done_view[host_layer:host_layer + 1], self.step_on_device,
                       self._error_view)
        else:
            self.sync.after_mark(lambda: self._attend_on_host(host_layer, rows),
                                 self._must_wait)
        if self.device.type != "cuda":
            return self.o[:rows].clone(), self.lse[:rows].clone()
        if self.worker is not None:
            return self._read(self._o_view[:rows]), self._read(self._lse_view[:rows])
        return (self.o[:rows].to(self.device, non_blocking=True),
                self.lse[:rows].to(self.device, non_blocking=True))

    def _must_wait(self) -> bool:
        """The host waits for the mark before it reads q or rewrites the pinned outputs (an
        earlier upload of them may still be queued); an inactive step whose outputs are
        already cleared touches neither."""
        return self.active or not self.cleared

    def _attend_on_host(self, host_layer: int, rows: int) -> None:
        if self.active:
            t = time.perf_counter()
            if self._last_end is not None:
                self.between += t - self._last_end
                self.gaps += 1
            elif self._step_end is not None:
                self._step_gap = t - self._step_end
            self.kernel(self.q[:rows], self.host_kv[host_layer], self.layout, self.table,
                        self.zeros[:rows], self.ends[:rows], self.scale,
                        out=(self.o[:rows], self.lse[:rows]))
            self._last_end = time.perf_counter()
            self.worked += self._last_end - t
            self.layers += 1
            self.cleared = False
        elif not self.cleared:
            self.o.zero_()
            self.lse.fill_(-torch.inf)
            self.cleared = True
