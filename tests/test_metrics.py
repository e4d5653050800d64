"""The KV metrics' tiers: the device tier is called `device`, with the device it is on, so a
CPU engine does not report its KV as GPU memory."""

from __future__ import annotations

import re

import pytest
from helpers import make_llm

from nanoserve import SamplingParams

pytest.importorskip("prometheus_client")
from nanoserve.serve.async_engine import AsyncEngine  # noqa: E402
from nanoserve.serve.metrics import Metrics  # noqa: E402


def kv_samples(text: str) -> dict[str, float]:
    """The nanoserve_kv_*_used samples as {name{labels but the model's}: value}."""
    out = {}
    for line in text.splitlines():
        if line.startswith("nanoserve_kv_") and "_used{" in line:
            key, value = line.rsplit(" ", 1)
            out[re.sub(r'model="[^"]*",', "", key)] = float(value)
    return out


def test_kv_tiers_are_device_and_host_with_the_memory_they_are_in():
    llm = make_llm(None, max_num_seqs=2, max_model_len=64, enable_offload=True,
                   resident_layers=1, host_kv_budget_gib=0.01)
    engine = llm.engine
    engine.add_request(list(range(1, 22)), SamplingParams(max_tokens=4))
    engine.step()  # the prompt's 21 tokens and the first output take 6 pages of 4 tokens
    kv = engine.kv
    assert kv.num_used == 6
    page = kv.spec.page_bytes(1) * kv.num_used  # one layer's KV of the used pages
    samples = kv_samples(Metrics(AsyncEngine(engine), "m").render().decode())
    assert samples == {
        'nanoserve_kv_pages_used{device="cpu",tier="device"}': 6.0,
        'nanoserve_kv_pages_used{device="cpu",tier="host"}': 6.0,
        'nanoserve_kv_bytes_used{device="cpu",tier="device"}': float(page),
        'nanoserve_kv_bytes_used{device="cpu",tier="host"}': float(3 * page),
    }
