"""moe_tiles' choice of tiles: a GPU's tuned config file by batch band, else the defaults with
one warning naming the shape and the tuner; the shape the tuner takes from a model's config."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from nanoserve.models import moe_tiles
from nanoserve.models.config import ModelConfig
from nanoserve.models.loader import shipped_config_dir

QWEN3_30B = dict(num_experts=128, hidden=2048, inter=768)


@pytest.fixture
def device_named(monkeypatch):
    def name(device_name: str) -> torch.device:
        monkeypatch.setattr(moe_tiles, "_device_name", lambda index: device_name)
        moe_tiles._warn_untuned.cache_clear()
        return torch.device("cpu")
    yield name
    moe_tiles._warn_untuned.cache_clear()


def untuned_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "no tuned tiles" in r.getMessage()]


def test_a_gpu_without_a_config_warns_once_and_runs_the_default_tiles(device_named, caplog):
    device = device_named("Fake GPU 80GB")
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        for pairs in (8, 64, 8, 65536):
            assert moe_tiles.tiles_for(pairs, **QWEN3_30B, device=device) == \
                moe_tiles.default_tiles(pairs)
        assert moe_tiles.tiles_for(8, 64, 1024, 512, device) == moe_tiles.default_tiles(8)
    warned = untuned_warnings(caplog)
    assert len(warned) == 2, warned  # once a (GPU, shape)
    assert "E=128,H=2048,I=768" in warned[0] and "Fake GPU 80GB" in warned[0]
    assert "tools/tune_moe.py --model MODEL" in warned[0]
    assert "E=64,H=1024,I=512" in warned[1]


def test_a_tuned_gpu_runs_its_bands_without_a_warning(device_named, caplog):
    device = device_named("NVIDIA H200")
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        # the smallest band holding the pairs: 64 pairs (8 tokens x top 8) in band 128
        assert moe_tiles.tiles_for(64, **QWEN3_30B, device=device) == \
            moe_tiles.MoETiles(16, 64, 128, 4, 3)
        assert moe_tiles.tiles_for(8, **QWEN3_30B, device=device) == \
            moe_tiles.MoETiles(16, 32, 64, 4, 4)
        assert moe_tiles.tiles_for(10_000, **QWEN3_30B, device=device) == \
            moe_tiles.MoETiles(128, 128, 64, 8, 3, tma=True, sorted_mid=True)
        # past the largest band: the defaults, no warning (the shape is tuned)
        assert moe_tiles.tiles_for(1 << 20, **QWEN3_30B, device=device) == \
            moe_tiles.default_tiles(1 << 20)
    assert untuned_warnings(caplog) == []


def test_the_tuners_shape_comes_from_the_models_config_per_gpu():
    cfg = ModelConfig.from_dir(shipped_config_dir("Qwen3-30B-A3B"))
    assert moe_tiles.model_shape(cfg) == dict(experts=128, top_k=8, hidden=2048, inter=768)
    # tensor parallelism splits each expert's intermediate rows: the key the ranks look up
    assert moe_tiles.model_shape(cfg, 2) == dict(experts=128, top_k=8, hidden=2048, inter=384)
    with pytest.raises(ValueError, match="moe_intermediate_size 768"):
        moe_tiles.model_shape(cfg, 5)
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        moe_tiles.model_shape(ModelConfig.from_dir(shipped_config_dir("Qwen3-8B")))


# each shipped file and the name torch.cuda.get_device_name() gives its GPU
SHIPPED = {"NVIDIA_H200.json": "NVIDIA H200", "NVIDIA_H100_80GB_HBM3.json": "NVIDIA H100 80GB HBM3"}


def test_every_shipped_config_is_named_for_a_gpu():
    assert sorted(p.name for p in moe_tiles.CONFIG_DIR.glob("*.json")) == sorted(SHIPPED)
    assert all(moe_tiles.config_file(name) == file for file, name in SHIPPED.items())


@pytest.mark.parametrize("file", sorted(SHIPPED))
def test_every_shipped_config_is_read_for_its_gpu_and_runs_its_bands(file, device_named, caplog):
    """Each shipped file is the one its GPU (by the name torch gives it) reads: every band of
    every shape comes back as that band's tiles, with no warning, each tile's K step dividing
    the shape's hidden and intermediate sizes and the sorted intermediate only with TMA; pairs
    past the largest band take the defaults."""
    device = device_named(SHIPPED[file])
    tuned = json.loads((moe_tiles.CONFIG_DIR / file).read_text())
    assert tuned
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        for key, bands in tuned.items():
            e, h, i = (int(part.split("=")[1]) for part in key.split(","))
            assert moe_tiles.config_key(e, h, i) == key
            for band, tiles in bands.items():
                got = moe_tiles.tiles_for(int(band), e, h, i, device)
                assert got == moe_tiles.MoETiles(**tiles)
                assert h % got.block_k == 0 and i % got.block_k == 0
                assert got.tma or not got.sorted_mid
            largest = max(int(b) for b in bands)
            assert moe_tiles.tiles_for(largest + 1, e, h, i, device) == \
                moe_tiles.default_tiles(largest + 1)
    assert untuned_warnings(caplog) == []
