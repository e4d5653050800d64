"""The hand-written kernels' builds (nanoserve/extensions.py): a line before a first build,
none when the build is cached; torch's loader gets the sources and options as given."""

from __future__ import annotations

import logging
from pathlib import Path

from torch.utils import cpp_extension

from nanoserve.extensions import load_extension


def test_a_first_build_is_announced_a_cached_one_is_not(tmp_path, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: tmp_path)
    monkeypatch.setattr(cpp_extension, "load",
                        lambda name, sources, **kw: calls.append((name, sources, kw)) or "mod")
    with caplog.at_level(logging.INFO, logger="nanoserve"):
        assert load_extension("ns_x", [Path("a.cpp")], "X's kernel", extra_cflags=["-O3"]) \
            == "mod"
    assert calls == [("ns_x", ["a.cpp"], {"verbose": False, "extra_cflags": ["-O3"]})]
    assert "X's kernel: compiling it (first use on this machine" in caplog.text
    caplog.clear()
    (tmp_path / "ns_x.so").write_bytes(b"")
    with caplog.at_level(logging.INFO, logger="nanoserve"):
        load_extension("ns_x", [Path("a.cpp")], "X's kernel")
    assert "compiling" not in caplog.text and len(calls) == 2


def test_the_one_row_cuda_kernels_switch(monkeypatch):
    """The one-row CUDA kernels are on unless NANOSERVE_ONE_ROW_CUDA=0 (Triton's)."""
    from nanoserve.extensions import ONE_ROW_SWITCH, one_row_cuda_wanted
    monkeypatch.delenv(ONE_ROW_SWITCH, raising=False)
    assert one_row_cuda_wanted()
    monkeypatch.setenv(ONE_ROW_SWITCH, "1")
    assert one_row_cuda_wanted()
    monkeypatch.setenv(ONE_ROW_SWITCH, "0")
    assert not one_row_cuda_wanted()


def test_a_cuda_module_needs_its_gpu_and_falls_back_when_its_build_fails(tmp_path, monkeypatch,
                                                                        caplog):
    """cuda_module: None without a GPU of the capability asked (nothing built); with one, the
    build gets the common headers' folder on its include path; a failed build is None and one
    warning naming what runs instead."""
    import torch

    from nanoserve import extensions
    calls = []

    def load(name, sources, **kw):
        calls.append(kw)
        if name == "ns_broken":
            raise RuntimeError("nvcc: not found")
        return "mod"

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: tmp_path)
    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert extensions.cuda_module("ns_y", [Path("a.cu")], "Y", (8, 9), "Z's") is None
    assert calls == []
    assert extensions.cuda_module("ns_y", [Path("a.cu")], "Y", (8, 0), "Z's",
                                  extra_include_paths=["inc"]) == "mod"
    assert calls[-1]["extra_include_paths"] == ["inc", str(extensions.COMMON_CSRC)]
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        assert extensions.cuda_module("ns_broken", [Path("a.cu")], "Y", (8, 0), "Z's") is None
    assert "Y could not be built (RuntimeError: nvcc: not found); using Z's" in caplog.text


def test_the_one_row_modules_build_unless_switched_off(tmp_path, monkeypatch):
    """one_row_module: nothing built with NANOSERVE_ONE_ROW_CUDA=0; by default built for
    sm_80 and later with its folder and the common headers on the include path."""
    import torch

    from nanoserve import extensions
    calls = []
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: tmp_path)
    monkeypatch.setattr(cpp_extension, "load",
                        lambda name, sources, **kw: calls.append(kw) or "mod")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setenv(extensions.ONE_ROW_SWITCH, "0")
    assert extensions.one_row_module("ns_z", [Path("a.cu")], "Z", Path("inc")) is None
    assert calls == []
    monkeypatch.delenv(extensions.ONE_ROW_SWITCH)
    assert extensions.one_row_module("ns_z", [Path("a.cu")], "Z", Path("inc")) == "mod"
    assert calls[0]["extra_include_paths"] == ["inc", str(extensions.COMMON_CSRC)]


def test_programmatic_dependent_launch_on_sm90_unless_switched_off(monkeypatch):
    """Kernels launch with programmatic dependent launch on compute capability 9.0 and later
    (unset or "1"), never below it, and nowhere with NANOSERVE_PDL=0."""
    from nanoserve.extensions import PDL_SWITCH, pdl_wanted
    monkeypatch.delenv(PDL_SWITCH, raising=False)
    assert pdl_wanted((9, 0)) and pdl_wanted((10, 0))
    assert not pdl_wanted((8, 9)) and not pdl_wanted((8, 0))
    monkeypatch.setenv(PDL_SWITCH, "0")
    assert not pdl_wanted((9, 0)) and not pdl_wanted((10, 0))
    monkeypatch.setenv(PDL_SWITCH, "1")
    assert pdl_wanted((9, 0)) and pdl_wanted((10, 0))
    assert not pdl_wanted((8, 9)) and not pdl_wanted((8, 0))


def test_pdl_is_asked_of_inductor_on_hopper_unless_switched_off(monkeypatch):
    """fused._pdl_options: inductor's `triton.enable_pdl` where the device is sm_90 or later and
    NANOSERVE_PDL is not 0 (and this torch has the option), nothing otherwise; pdl_wanted
    likewise."""
    import torch

    from nanoserve import fused
    from nanoserve.extensions import PDL_SWITCH, pdl_wanted
    dev = torch.device("cuda", 0)
    for switch, capability, want in (("1", (9, 0), True), ("1", (10, 0), True),
                                     ("1", (8, 9), False), ("0", (9, 0), False),
                                     (None, (9, 0), True), (None, (8, 0), False)):
        if switch is None:
            monkeypatch.delenv(PDL_SWITCH, raising=False)
        else:
            monkeypatch.setenv(PDL_SWITCH, switch)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: c)
        assert pdl_wanted(capability) == want
        has = hasattr(torch._inductor.config.triton, "enable_pdl")
        assert fused._pdl_options(dev) == ({"triton.enable_pdl": True} if want and has else {})
