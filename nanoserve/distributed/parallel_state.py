"""Tensor parallelism's per-process state: this process's rank, the group's size, and the two
collectives the model needs: an all-reduce of partial sums (row-parallel layers, the
vocabulary-parallel embedding) and an all-gather of the vocabulary-parallel logits.

At TP=1 (the default) torch.distributed is never touched: both collectives return their input.
Under TP every rank runs the same layers on its shard of the weights and of the KV heads;
column-parallel projections need no communication, row-parallel ones sum their partial
outputs with `all_reduce`, inside the decode graphs too (NCCL calls capture into CUDA graphs).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist

log = logging.getLogger("nanoserve")

_rank, _size = 0, 1
_device = torch.device("cpu")  # where this rank's collectives run (NCCL: its GPU)


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


@contextlib.contextmanager
def sized_as(size: int) -> Iterator[None]:
    """Layers built inside size themselves as rank 0 of `size` ranks would (a model built on
    the meta device to count its bytes). Process-wide, not per thread: no forward or collective
    may run meanwhile (it is used while the engine is built or before)."""
    global _rank, _size
    saved = _rank, _size
    _rank, _size = 0, size
    try:
        yield
    finally:
        _rank, _size = saved


def init_tp(rank: int, size: int, init_method: str, device: torch.device) -> None:
    """Joins this process to the tensor-parallel group: NCCL on CUDA, gloo on the CPU."""
    global _rank, _size, _device
    if size > 1:
        if dist.is_initialized():
            raise RuntimeError(
                "the tensor-parallel group of an earlier engine in this process is still up (it "
                "could not be torn down: a rank had died, or its teardown timed out); start a "
                "new process to run another tensor-parallel engine")
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                **kwargs)
    _rank, _size, _device = rank, size, device


def destroy_tp(peers_alive: bool = True, timeout: float = 20.0) -> None:
    """Leaves the group. NCCL frees a node's communicators together: every rank destroys (or
    aborts) at the same time, or the calls wait for each other forever (NVIDIA/nccl#863;
    measured on an H200 x4 with rank 0 alone). So a stopped worker destroys its group while
    rank 0 destroys its own. With a rank gone (`peers_alive` False), or a teardown that
    outlasts `timeout`, the group is left to the process's exit instead; init_tp then refuses
    a new one in this process."""
    global _rank, _size
    if _size > 1 and dist.is_initialized():
        if dist.get_backend() != "nccl":
            dist.destroy_process_group()
        elif not peers_alive:
            log.warning("tensor parallelism: a rank is gone, so the NCCL group is left to this "
                        "process's exit")
        else:
            teardown = threading.Thread(target=dist.destroy_process_group, daemon=True,
                                        name="nanoserve-tp-destroy")
            teardown.start()
            teardown.join(timeout)
            if teardown.is_alive():
                log.warning("tensor parallelism: the NCCL group's teardown did not finish in "
                            "%.0f s; it is left to this process's exit", timeout)
    _rank, _size = 0, 1


def abort_tp() -> None:
    """Aborts the group's communicators (another rank died): a collective blocked on the dead
    rank raises instead of waiting forever. Best effort; the group is unusable afterwards."""
    if _size > 1 and dist.is_initialized():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - nothing better to do on the way down
            pass


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks, in place; `x` itself at TP=1."""
    if _size > 1:
        dist.all_reduce(x)
    return x


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank, in place (stream-ordered: no host sync)."""
    if _size > 1:
        dist.broadcast(x, src=0)
    return x


def agree_min(value: int) -> int:
    """The smallest of every rank's `value`: one figure (a memory budget) all ranks share."""
    if _size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` [rows, n] side by side, in rank order: [rows, size * n]; `x` itself at
    TP=1. One all-gather into a tensor (capturable in CUDA graphs), then a transposing copy."""
    if _size == 1:
        return x
    rows, n = x.shape
    gathered = torch.empty(_size * rows, n, dtype=x.dtype, device=x.device)
    _all_gather_into(gathered, x.contiguous())
    return gathered.view(_size, rows, n).permute(1, 0, 2).reshape(rows, _size * n)


# torch >= 2.12 names it all_gather_single (all_gather_into_tensor warns, deprecated)
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shard_padded(n: int) -> tuple[int, int]:
    """(start, length) of this rank's share of `n` rows padded to a multiple of the TP size
    (the vocabulary): every rank holds ceil(n / size) rows, the last ones past `n` unused."""
    length = -(-n // _size)
    return _rank * length, length


def shard(n: int, what: str = "size") -> tuple[int, int]:
    """(start, length) of this rank's equal share of `n` (a head count, a row count);
    ValueError when `n` does not divide by the TP size."""
    if n % _size:
        raise ValueError(f"tensor parallel size {_size} does not divide {what} {n}")
    length = n // _size
    return _rank * length, length
