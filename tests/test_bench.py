"""The benchmark's transformers comparison runs transformers on exactly nanoserve's weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import make_hf_model
from helpers import engine_prefill_logits

from nanoserve import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_offload import hf_model_with_our_weights  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_hf_model_gets_nanoserves_dummy_weights(tmp_path, arch):
    make_hf_model(arch, tmp_path)
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM(str(tmp_path), progress=False, device="cpu", dtype="float32", dummy_weights=True,
              max_model_len=64)
    ours = engine_prefill_logits(llm, ids)
    hf = hf_model_with_our_weights(tmp_path, dummy=True, max_len=64, device="cpu",
                                   dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max() < 1e-4
    # and they are not transformers' own random init (which the checkpoint holds)
    saved = LLM(str(tmp_path), progress=False, device="cpu", dtype="float32", max_model_len=64)
    assert (engine_prefill_logits(saved, ids) - theirs).abs().max() > 1e-2
