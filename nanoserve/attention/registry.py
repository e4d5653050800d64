"""The attention backends by name, and `select_backend`, which picks one of them.

A backend registers a factory with `register_backend` (nanoserve/attention/__init__.py holds the
registrations); `select_backend` reads only this table, so the interface (backend.py) names
none of its implementations. New backends: register here, never add a branch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoserve.attention.backend import AttentionBackend

log = logging.getLogger("nanoserve")

BackendFactory = Callable[[], AttentionBackend]


@dataclass(frozen=True)
class BackendEntry:
    name: str
    create: BackendFactory
    needs_cuda: bool
    reads_quantized_kv: bool  # reads a cache stored in a dtype other than the model's (FP8)
    auto_priority: int | None  # `auto` takes the highest that fits; None: only by name
    untested: str | None  # why its output is not yet trusted: logged when it is selected


_BACKENDS: dict[str, BackendEntry] = {}


def register_backend(name: str, *, needs_cuda: bool, reads_quantized_kv: bool = True,
                     auto_priority: int | None = None, untested: str | None = None
                     ) -> Callable[[BackendFactory], BackendFactory]:
    """Decorator: registers `create` (which should import its backend's module itself, so that
    an optional kernel package is needed only by whoever selects that backend)."""
    def register(create: BackendFactory) -> BackendFactory:
        if name in _BACKENDS or name == "auto":
            raise ValueError(f"attention backend {name!r} is already registered")
        _BACKENDS[name] = BackendEntry(name, create, needs_cuda, reads_quantized_kv,
                                       auto_priority, untested)
        return create
    return register


def backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def _fits(entry: BackendEntry, device: torch.device, kv_in_model_dtype: bool) -> bool:
    return ((device.type == "cuda" or not entry.needs_cuda)
            and (kv_in_model_dtype or entry.reads_quantized_kv))


def _auto(device: torch.device, kv_in_model_dtype: bool) -> str:
    candidates = [e for e in _BACKENDS.values()
                  if e.auto_priority is not None and _fits(e, device, kv_in_model_dtype)]
    if not candidates:
        raise ValueError(f"no attention backend registered for `auto` on {device.type}")
    return max(candidates, key=lambda e: e.auto_priority).name


def resolve_backend(name: str, device: torch.device, kv_in_model_dtype: bool = True
                    ) -> BackendEntry:
    """The entry of backend `name` (or, for "auto", of the registered one of highest auto
    priority that runs on `device`), checked against the device and the KV dtype.
    kv_in_model_dtype: False when the KV cache is stored in another dtype (FP8), which some
    backends cannot read."""
    if name == "auto":
        name = _auto(device, kv_in_model_dtype)
    entry = _BACKENDS.get(name)
    if entry is None:
        raise ValueError(f"unknown attention backend {name!r}: auto or one of "
                         f"{', '.join(_BACKENDS)}")
    if not kv_in_model_dtype and not entry.reads_quantized_kv:
        readers = [e.name for e in _BACKENDS.values() if e.reads_quantized_kv]
        raise ValueError(f"attention backend {name!r} reads KV only in the model's dtype: use "
                         f"attention backend auto (or {' or '.join(readers)}) with this kv "
                         "cache dtype")
    if entry.needs_cuda and device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device")
    return entry


def select_backend(name: str, device: torch.device, kv_in_model_dtype: bool = True
                   ) -> AttentionBackend:
    """The backend resolve_backend names, constructed; an untested one logs why."""
    entry = resolve_backend(name, device, kv_in_model_dtype)
    if entry.untested is not None:
        log.warning("attention backend %r: %s", entry.name, entry.untested)
    return entry.create()
