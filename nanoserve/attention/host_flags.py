"""The GPU's side of a flag the host sets (attention/cpu_share.py): a one-thread kernel that
spins on an int32 in pinned host memory until it holds the value a device scalar holds, so a
stream (and a CUDA graph) can wait for host work without the host launching anything after it.
It gives up after about `max_polls` reads of host memory (a read crosses the link: ~1 us) and
sets an error flag the host checks, rather than hang the device forever."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_POLLS = 20_000_000  # ~20-40 s


@triton.jit
def _wait_for_host(flag_ptr, want_ptr, error_ptr, max_polls):
    want = tl.load(want_ptr)
    seen = tl.load(flag_ptr, volatile=True)
    polls = 0
    if tl.load(error_ptr, volatile=True) != 0:  # an earlier wait gave up: do not wait again
        polls = max_polls
    while (seen != want) & (polls < max_polls):
        seen = tl.load(flag_ptr, volatile=True)
        polls += 1
    if seen != want:
        tl.store(error_ptr, 1)


class _Interface:
    """A pinned host tensor's memory as the device sees it (unified addressing: the same
    address), through the CUDA array interface, so that torch makes a CUDA tensor of it."""

    def __init__(self, t: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape), "typestr": "<i4", "data": (t.data_ptr(), False),
            "version": 3, "strides": None}


def device_view(pinned: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over a pinned int32 host tensor's memory (reads and writes cross the
    link)."""
    assert pinned.is_pinned() and pinned.dtype == torch.int32 and pinned.is_contiguous()
    return torch.as_tensor(_Interface(pinned), device=device)


def wait_for_host(flag: torch.Tensor, want: torch.Tensor, error: torch.Tensor) -> None:
    """Enqueues the wait: flag (a device view of pinned memory, one int32) == want (a device
    scalar); error (a device view too) is set to 1 if it gives up."""
    _wait_for_host[(1,)](flag, want, error, MAX_POLLS, num_warps=1)
