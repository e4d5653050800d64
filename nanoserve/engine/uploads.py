"""A step's small host->device uploads (inputs, sampling parameters), and the stream they ride.

With streamed layers they go on the layer copy stream, ahead of the next step's layer loads in
its queue, and the compute stream waits for them by event. Queued on the compute stream
instead, an upload holds the next step's loads behind it until the compute stream reaches it:
the copy engines serve host->device copies in the order they were issued, so the link idled
from the last layer's load until the step's head and sampling had run (tools/profile_step.py
--enable-offload: ~0.7 ms of an 11.8 ms step at 4K, Qwen3-8B shape, every layer streamed).
"""

from __future__ import annotations

import torch


def host_to_device(host: torch.Tensor, device: torch.device,
                   stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """A non-blocking copy of (pinned) host memory; with `stream`, made there, the current
    stream waiting for it."""
    if stream is None:
        return host.to(device, non_blocking=True)
    compute = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        dev = host.to(device, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    compute.wait_event(done)
    dev.record_stream(compute)  # once freed, reused only after the compute stream's uses
    return dev
