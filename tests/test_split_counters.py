"""split_counters: the zeroed int32 counters that split-K GEMMs and split decode attention
count their finished programs on (CPU: the buffer logic; the kernels' own use is GPU-tested)."""

from __future__ import annotations

import torch
from helpers import counters_all_zero

from nanoserve import split_counters
from nanoserve.split_counters import zeroed_counters


def test_counters_are_zeroed_per_user_grown_not_freed_and_checked(monkeypatch):
    monkeypatch.setattr(split_counters, "_COUNTERS", {})
    monkeypatch.setattr(split_counters, "_OUTGROWN", [])
    cpu = torch.device("cpu")
    gemm = zeroed_counters("split-k", cpu, 10)
    decode = zeroed_counters("decode", cpu, 10)
    assert gemm.dtype == torch.int32 and gemm.numel() == 1 << 14 and not gemm.any()
    assert gemm.data_ptr() != decode.data_ptr()  # users never share counters
    assert zeroed_counters("split-k", cpu, 1 << 14) is gemm  # big enough: the same tensor
    decode[3] = 1  # a kernel that left its counter set
    assert not counters_all_zero(cpu)
    decode[3] = 0
    assert counters_all_zero(cpu)
    grown = zeroed_counters("split-k", cpu, (1 << 14) + 1)
    assert grown.numel() == (1 << 14) + 1 and not grown.any()
    assert split_counters._OUTGROWN == [gemm]  # graphs captured on the old one keep it alive
    assert zeroed_counters("split-k", cpu, 5) is grown
