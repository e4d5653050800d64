"""The CPU's share of the streamed layers' decode attention: offloaded decode below the link's
floor, exactly.

In a decode step with streamed layers, sequence i may give the CPU its first `cpu_tokens[i]`
tokens (whole pages, all in the host store already). Those pages do not cross the link (the
step's load runs skip them); for every streamed layer, the CPU attends them straight from the
host store while the copy engine brings the rest of the layer into its ring slot and the GPU
attends that; the two partial results merge by their log-sum-exps. No token is skipped.

Per streamed layer (AttentionBackend.split_decode):
1. `send_q`: q goes to a pinned buffer (a device-to-host copy on the compute stream), then a
   mark (an event);
2. the GPU's share is enqueued (stage 1 of split-KV decode, over tokens [cpu_tokens, len));
3. `attend`: the host waits for the mark, not for the GPU's share, and runs the CPU kernel into
   pinned output and LSE buffers, whose upload is then enqueued, and the merge after it.
The host thread thus waits once per layer, for that layer's q: the CPU's share cannot start
before q exists, and q of layer j needs layer j-1's output, which needs its CPU share.
Meanwhile the copy stream keeps loading the next layers (offload/streamer.py).

`sync` is how the host meets the stream: `EagerSync` records and waits on events; while a
decode graph is captured, the graph runner swaps in a sync that cuts the graph at the mark and
at the host's work instead, so a streamed layer replays as graph, mark, graph, host work, graph.
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

    def begin_step(self, cpu_tokens: np.ndarray | None, table: np.ndarray | None,
                   gpu_starts: torch.Tensor | None) -> None:
        """A decode step: each row's CPU token count and page table (host arrays), and its
        first GPU token (on the device); None: no CPU share in this step. Rows past them
        (graph padding) have none."""
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

    def send_q(self, q: torch.Tensor) -> None:
        """A streamed layer's queries [rows, heads, d] to the host, then the mark."""
        self.q[:q.shape[0]].copy_(q, non_blocking=True)
        self.sync.mark()

    def attend(self, host_layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU's share of host layer `host_layer` for the step's rows, on the device:
        output [rows, heads, d] and LSE [rows, heads], float32 (zeros and -inf for rows
        without CPU tokens)."""
        self.sync.after_mark(lambda: self._attend_on_host(host_layer, rows), self._must_wait)
        if self.device.type != "cuda":
            return self.o[:rows].clone(), self.lse[:rows].clone()
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
