"""The attention backend registry: which backend `auto` picks on each device, what selecting one
by name checks, and the import layering it exists for (no cycle through attention or kv)."""

from __future__ import annotations

import dataclasses
import logging
import sys
import types
from pathlib import Path

import pytest
import torch

from nanoserve.attention import backend_names, registry, resolve_backend, select_backend
from nanoserve.attention.torch_backend import TorchBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import import_cycles  # noqa: E402

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # resolving reads only the device type


def test_every_backend_is_registered():
    assert set(backend_names()) == {"torch", "triton", "flash"}


@pytest.mark.parametrize("kv_in_model_dtype", [True, False])
def test_auto_is_torch_on_cpu(kv_in_model_dtype):
    assert resolve_backend("auto", CPU, kv_in_model_dtype).name == "torch"
    assert isinstance(select_backend("auto", CPU, kv_in_model_dtype), TorchBackend)


@pytest.mark.parametrize("kv_in_model_dtype", [True, False])
def test_auto_is_triton_on_cuda_even_with_flash_attn_installed(monkeypatch, kv_in_model_dtype):
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    assert resolve_backend("auto", CUDA, kv_in_model_dtype).name == "triton"


def test_flash_is_selectable_by_name_on_cuda_and_marked_untested():
    entry = resolve_backend("flash", CUDA)
    assert entry.name == "flash" and entry.auto_priority is None
    assert "auto` never picks it" in entry.untested


def test_selecting_an_untested_backend_logs_why(monkeypatch, caplog):
    entry = registry._BACKENDS["flash"]
    monkeypatch.setitem(registry._BACKENDS, "flash",
                        dataclasses.replace(entry, create=TorchBackend))
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        select_backend("flash", CUDA)
    assert caplog.records[-1].getMessage() == f"attention backend 'flash': {entry.untested}"


def test_tested_backends_select_without_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        select_backend("torch", CPU)
    assert caplog.records == []


def test_flash_refuses_a_quantized_kv_cache():
    with pytest.raises(ValueError, match="'flash' reads KV only in the model's dtype: use "
                                         "attention backend auto \\(or torch or triton\\)"):
        resolve_backend("flash", CUDA, kv_in_model_dtype=False)


@pytest.mark.parametrize("name", ["triton", "flash"])
def test_cuda_backends_refuse_the_cpu(name):
    with pytest.raises(ValueError, match=f"attention backend '{name}' needs a CUDA device"):
        resolve_backend(name, CPU)


def test_unknown_names_are_refused_with_the_registered_ones():
    with pytest.raises(ValueError, match="unknown attention backend 'sdpa': auto or one of "
                                         "torch, triton, flash"):
        resolve_backend("sdpa", CUDA)


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="'torch' is already registered"):
        registry.register_backend("torch", needs_cuda=False)(TorchBackend)


def test_no_import_cycle_runs_through_attention_or_kv():
    modules = import_cycles.module_names(import_cycles.PACKAGES)
    cycles = import_cycles.cycles(import_cycles.import_edges(modules))
    assert [c for c in cycles
            if any(m.startswith(("nanoserve.attention", "nanoserve.kv")) for m in c)] == []


def test_kv_imports_nothing_of_attention():
    edges = import_cycles.import_edges(import_cycles.module_names(import_cycles.PACKAGES))
    assert [(m, t) for m, targets in edges.items() if m.startswith("nanoserve.kv")
            for t in targets if t.startswith("nanoserve.attention")] == []
