"""Zeroed int32 counters for kernels whose last program to finish completes the others' work
(decode's split K summed, split attention merged): one tensor a device and user, made at the
first such launch (the eager warm-up, before any graph capture) and kept zero by the kernels
themselves, each last program putting its counter back. Invariant: the kernels sharing a
tensor never run concurrently (they run on the model's one compute stream)."""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple[str, torch.device], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # graphs captured on them keep their addresses: never freed


def zeroed_counters(user: str, device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters for `user`'s kernels on `device`."""
    counters = _COUNTERS.get((user, device))
    if counters is None or counters.numel() < n:
        assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), \
            "counters made in a graph capture"
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = _COUNTERS[(user, device)] = torch.zeros(max(n, 1 << 14), dtype=torch.int32,
                                                           device=device)
    return counters
