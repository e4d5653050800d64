"""PDL's policy (nanoserve/pdl.py): which launches use it, and the switch to inductor."""

from __future__ import annotations

import importlib

import pytest
import torch

from nanoserve import pdl

HOPPER = torch.device("cuda", 0)


@pytest.fixture
def reloaded(monkeypatch):
    """pdl reloaded under the environment the test sets, with device 0 a Hopper or not."""
    def load(env: str | None, hopper: bool):
        if env is None:
            monkeypatch.delenv("NANOSERVE_PDL", raising=False)
        else:
            monkeypatch.setenv("NANOSERVE_PDL", env)
        module = importlib.reload(pdl)
        monkeypatch.setattr(module, "_hopper_or_later", lambda index: hopper)
        return module
    yield load
    monkeypatch.delenv("NANOSERVE_PDL", raising=False)
    importlib.reload(pdl)


@pytest.mark.parametrize("env, hopper, expected", [(None, True, True), ("1", True, True),
                                                   ("0", True, False), (None, False, False)])
def test_pdl_on_cuda_needs_hopper_and_no_opt_out(reloaded, env, hopper, expected):
    assert reloaded(env, hopper).enabled(HOPPER) is expected


def test_pdl_is_never_on_for_the_cpu(reloaded):
    module = reloaded(None, True)
    assert not module.enabled(torch.device("cpu"))
    assert module.inductor_options(torch.device("cpu")) in ({}, {"triton.enable_pdl": False})


def test_forcing_pdl_overrides_the_device_and_is_undone():
    try:
        pdl.force(True)
        assert pdl.enabled(torch.device("cpu"))
        pdl.force(False)
        assert not pdl.enabled(HOPPER)
    finally:
        pdl.force(None)
    assert not pdl.enabled(torch.device("cpu"))
