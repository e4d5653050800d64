"""The GPU's side of a flag the host sets (attention/cpu_share.py): a one-thread kernel that
spins on an int32 in pinned host memory until it holds the value a device scalar holds, so a
stream (and a CUDA graph) can wait for host work without the host launching anything after it.
It gives up after about `max_polls` reads of host memory (a read crosses the link: ~1 us) and
sets an error flag the host checks, rather than hang the device forever. Then the host's
results are read by a kernel straight from pinned memory: a copy engine would queue them
behind the streamed layers' host-to-device copies."""

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


@triton.jit
def _read_host(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    # volatile: the same host addresses were read for the previous layer; no cached copy
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=live, volatile=True), mask=live)


_TYPESTR = {torch.int32: "<i4", torch.float32: "<f4"}


class _Interface:
    """A pinned host tensor's memory as the device sees it (unified addressing: the same
    address), through the CUDA array interface, so that torch makes a CUDA tensor of it."""

    def __init__(self, t: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape), "typestr": _TYPESTR[t.dtype],
            "data": (t.data_ptr(), False), "version": 3, "strides": None}


def device_view(pinned: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over a pinned int32 or float32 host tensor's memory (reads and writes
    cross the link)."""
    assert pinned.is_pinned() and pinned.dtype in _TYPESTR and pinned.is_contiguous()
    return torch.as_tensor(_Interface(pinned), device=device)


def read_host(view: torch.Tensor) -> torch.Tensor:
    """A device copy of `view` (a contiguous slice of a device view), read by a kernel."""
    assert view.is_contiguous()
    out = torch.empty(view.shape, dtype=view.dtype, device=view.device)
    n, block = view.numel(), 1024
    _read_host[(triton.cdiv(n, block),)](view, out, n, BLOCK=block, num_warps=4)
    return out


def wait_for_host(flag: torch.Tensor, want: torch.Tensor, error: torch.Tensor) -> None:
    """Enqueues the wait: flag (a device view of pinned memory, one int32) == want (a device
    scalar); error (a device view too) is set to 1 if it gives up."""
    _wait_for_host[(1,)](flag, want, error, MAX_POLLS, num_warps=1)
