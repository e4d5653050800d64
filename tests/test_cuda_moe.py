"""One token's MoE experts in CUDA (nanoserve/models/cuda_moe.py) on the CPU: which shapes the
kernels take (the rest goes to the Triton path). The kernels run in tests/test_gpu_models.py."""

from __future__ import annotations

import torch

from nanoserve.models import cuda_moe


def case(tokens=1, k=8, experts=16, hidden=2048, inter=768, dtype=torch.bfloat16):
    return dict(x=torch.zeros(tokens, hidden, dtype=dtype),
                weights=torch.zeros(tokens, k, dtype=dtype),
                ids=torch.zeros(tokens, k, dtype=torch.int64),
                gate_up=torch.zeros(experts, 2 * inter, hidden, dtype=dtype),
                down=torch.zeros(experts, hidden, inter, dtype=dtype))


def test_the_shapes_the_kernels_take():
    """One token, half precision, k dividing 16, hidden and intermediate sizes multiples of 64,
    contiguous stacks; on the CPU supports() is False whatever the shape."""
    for ok in (case(), case(k=1), case(k=16), case(k=4, hidden=64, inter=64),
               case(dtype=torch.float16)):
        assert cuda_moe.shape_ok(**ok)
    assert not cuda_moe.supports(**case())  # not on a GPU
    for bad in (case(tokens=2), case(k=6), case(hidden=2000), case(inter=96),
                case(dtype=torch.float32)):
        assert not cuda_moe.shape_ok(**bad)
    mixed = case()
    mixed["weights"] = mixed["weights"].float()  # routing weights in another dtype
    assert not cuda_moe.shape_ok(**mixed)
    strided = case()
    strided["down"] = torch.zeros(16, 768, 2048, dtype=torch.bfloat16).transpose(1, 2)
    assert not cuda_moe.shape_ok(**strided)


def fp8_case(experts=16, hidden=2048, inter=768, block=(128, 128)):
    c = case(experts=experts, hidden=hidden, inter=inter)
    c["gate_up"] = c["gate_up"].to(torch.float8_e4m3fn)
    c["down"] = c["down"].to(torch.float8_e4m3fn)
    rows, cols = block
    c["scales"] = (torch.ones(experts, -(-2 * inter // rows), -(-hidden // cols)),
                   torch.ones(experts, -(-hidden // rows), -(-inter // cols)))
    c["block"] = block
    return c


def test_the_fp8_shapes_the_kernels_take():
    """e4m3 stacks with their float32 block scales, [E, rows / block, columns / block] rounded
    up, a block's columns a multiple of 16 (a lane's 16 inputs within one block); e4m3 without
    scales, scales on 16-bit stacks, or scales of another shape, dtype or layout: not taken."""
    for ok in (fp8_case(), fp8_case(block=(64, 32)), fp8_case(block=(16, 16)),
               fp8_case(hidden=576, inter=64)):
        assert cuda_moe.shape_ok(**ok)
    assert not cuda_moe.supports(**fp8_case())  # not on a GPU
    for block in ((128, 8), (128, 24)):
        assert not cuda_moe.shape_ok(**fp8_case(block=block)), block
    zero_rows = fp8_case()
    zero_rows["block"] = (0, 128)
    assert not cuda_moe.shape_ok(**zero_rows)
    unscaled = fp8_case()
    del unscaled["scales"]
    assert not cuda_moe.shape_ok(**unscaled)
    half = case()
    half["scales"] = fp8_case()["scales"]
    assert not cuda_moe.shape_ok(**half)
    for bad in (lambda s: (s[0][:, :-1], s[1]), lambda s: (s[0], s[1].half()),
                lambda s: (s[0], s[1].transpose(1, 2).contiguous().transpose(1, 2)),
                lambda s: (s[1], s[0])):
        c = fp8_case()
        c["scales"] = bad(c["scales"])
        assert not cuda_moe.shape_ok(**c)


def test_the_engine_loads_the_one_row_kernels_its_model_takes_at_start(monkeypatch):
    """ModelRunner._load_one_row_kernels (run at start on a GPU, so an eager engine's first
    decode step builds nothing): the quantized kernels for AWQ and FP8 layers, the MoE kernels
    for a sparse MLP, nothing for GPTQ or dense layers."""
    from types import SimpleNamespace

    from torch import nn

    from nanoserve.engine.model_runner import ModelRunner
    from nanoserve.models.moe import SparseMoE
    from nanoserve.quant import QuantConfig, QuantizedLinear, cuda_gemv
    loaded = []
    monkeypatch.setattr(cuda_gemv, "load", lambda: loaded.append("quant"))
    monkeypatch.setattr(cuda_moe, "load", lambda: loaded.append("moe"))

    def quantized(method):
        return QuantizedLinear(64, [64], False, QuantConfig(method, group_size=32), torch.float16)

    for layers, want in (([nn.Linear(8, 8)], []), ([quantized("gptq")], []),
                         ([quantized("awq")], ["quant"]), ([quantized("fp8_channel")], ["quant"]),
                         ([nn.Linear(8, 8), SparseMoE(64, 4, 2, 64, True)], ["moe"])):
        loaded.clear()
        ModelRunner._load_one_row_kernels(SimpleNamespace(model=nn.Sequential(*layers)))
        assert loaded == want, layers
