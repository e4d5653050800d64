"""Finding a model (local directory, hub id, local Hugging Face cache) and refusing one that
cannot fit the machine before anything is allocated."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from conftest import ARCHS, HF_CLASSES, make_hf_model, tiny_hf_config

from nanoserve.models import loader
from nanoserve.models.config import ModelConfig
from nanoserve.models.loader import (
    HUB_CONFIG_PATTERNS,
    HUB_PATTERNS,
    build_model,
    check_model_fits,
    model_bytes,
    num_model_params,
    resolve_model_dir,
)

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30
SHIPPED = ("Qwen3-8B", "Qwen3-4B", "Llama-3.1-8B", "Llama-3-8B-1048k", "Qwen2.5-7B",
           "Qwen3-8B-YaRN", "Qwen3-30B-A3B", "Qwen3-30B-A3B-YaRN", "Mistral-Nemo-12B")


# --- hub ids -----------------------------------------------------------------------------------
@pytest.mark.parametrize("repo_id", ["Qwen/Qwen3-0.6B", "Qwen/Qwen2.5-7B-Instruct",
                                     "meta-llama/Llama-3.1-8B-Instruct", "owner/name.v1"])
@pytest.mark.parametrize("dummy", [False, True])
def test_dotted_hub_ids_go_to_the_hub(monkeypatch, tmp_path, repo_id, dummy):
    calls = []

    def fake_snapshot_download(repo, allow_patterns=None, **kw):
        calls.append((repo, allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model_dir(repo_id, dummy_weights=dummy) == tmp_path
    assert calls == [(repo_id, HUB_CONFIG_PATTERNS if dummy else HUB_PATTERNS)]
    assert HUB_PATTERNS == ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt",
                            "*.jinja"]


def _fake_hf_cache(root: Path, repo_id: str, commit: str = "0123456789abcdef" * 2 + "01234567"):
    """The layout huggingface_hub writes: models--owner--name/{refs/main, snapshots/<commit>/}."""
    repo_dir = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    make_hf_model("qwen3", snapshot)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


def test_a_model_in_the_local_hf_cache_loads_offline(tmp_path):
    snapshot = _fake_hf_cache(tmp_path / "home" / "hub", "owner/name.v1")
    assert (snapshot / "config.json").is_file() and (snapshot / "model.safetensors").is_file()
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"),
           "HF_HUB_CACHE": str(tmp_path / "home" / "hub"), "HF_HUB_OFFLINE": "1"}
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    # any network connection fails the run: the model must come from the cache alone
    code = (
        "import socket\n"
        "def refuse(*a, **k):\n"
        "    raise RuntimeError('network used')\n"
        "socket.socket.connect = refuse\n"
        "socket.create_connection = refuse\n"
        "from nanoserve import LLM, SamplingParams\n"
        "from nanoserve.models.loader import resolve_model_dir\n"
        "print(resolve_model_dir('owner/name.v1'))\n"
        "llm = LLM('owner/name.v1', progress=False, device='cpu', max_model_len=32)\n"
        "out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))\n"
        "print(llm.engine.model_dir, len(out[0].token_ids))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [str(snapshot), f"{snapshot} 4"]


def test_offline_and_not_cached_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_dir("owner/missing.v1")
    assert str(e.value) == (
        f"model 'owner/missing.v1' is not in the local Hugging Face cache ({tmp_path}) and "
        f"HF_HUB_OFFLINE is set, so it cannot be downloaded: unset HF_HUB_OFFLINE to download "
        f"it, or pass a local directory")


def test_local_dir_without_config_json(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_dir(str(tmp_path))
    assert str(e.value) == (f"model directory {tmp_path} has no config.json (a model directory "
                            f"holds a Hugging Face config.json and weights)")


SHIPPED_NOTE = ("shipped configs for --dummy-weights: ['Llama-3-8B-1048k', 'Llama-3.1-8B', "
                "'Mistral-Nemo-12B', 'Qwen2.5-7B', 'Qwen3-30B-A3B', 'Qwen3-30B-A3B-FP8', "
                "'Qwen3-30B-A3B-YaRN', "
                "'Qwen3-4B', 'Qwen3-8B', 'Qwen3-8B-AWQ', 'Qwen3-8B-FP8', 'Qwen3-8B-YaRN']")


@pytest.mark.parametrize("model, error, message", [
    ("a/b/c", ValueError, "model 'a/b/c' is neither a local directory nor a Hugging Face hub "
     f"id (owner/name): a hub id is owner/name, with exactly one '/'; {SHIPPED_NOTE}"),
    ("owner/bad--name", ValueError, "model 'owner/bad--name' is neither a local directory nor "
     "a Hugging Face hub id (owner/name): Cannot have -- or .. in repo_id: 'owner/bad--name'; "
     f"{SHIPPED_NOTE}"),
    ("Qwen3-8B", ValueError, "model 'Qwen3-8B' is neither a local directory nor a Hugging "
     "Face hub id (owner/name): a hub id is owner/name, with exactly one '/'; 'Qwen3-8B' is a "
     "shipped config: add --dummy-weights to run its shape with random weights"),
    # a relative path that climbs out of the checkout, and that no machine has
    ("../nanoserve-no-such-model", FileNotFoundError, "model directory "
     "'../nanoserve-no-such-model' does not exist (and a path is not a Hugging Face hub id, "
     f"owner/name); {SHIPPED_NOTE}"),
])
def test_nonsense_ids_are_clear_errors(monkeypatch, model, error, message):
    def no_hub(*a, **k):
        raise AssertionError("the hub must not be asked")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    with pytest.raises(error) as e:
        resolve_model_dir(model)
    assert str(e.value) == message


# --- does the model fit? ---------------------------------------------------------------------
def _tiny_config(arch: str, tied: bool) -> ModelConfig:
    raw = tiny_hf_config(arch, tie_word_embeddings=tied).to_dict()
    raw["architectures"] = [HF_CLASSES[arch]]
    return ModelConfig.from_dict(raw)


def _built_params(cfg: ModelConfig) -> int:
    model = build_model(cfg, 64, torch.bfloat16, torch.device("meta"))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", SHIPPED)
def test_num_model_params_matches_the_built_model_shipped(name):
    cfg = ModelConfig.from_dir(resolve_model_dir(name, dummy_weights=True))
    assert num_model_params(cfg) == _built_params(cfg)


def test_num_model_params_of_qwen3_8b():
    cfg = ModelConfig.from_dir(resolve_model_dir("Qwen3-8B", dummy_weights=True))
    assert num_model_params(cfg) == 8_190_735_360
    assert model_bytes(cfg, torch.float32) == 32_762_941_440
    assert model_bytes(cfg, torch.bfloat16, max_len=1000) == 16_381_470_720 + 1000 * 128 * 4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tied", [False, True])
def test_num_model_params_matches_the_built_model_tiny(arch, tied):
    cfg = _tiny_config(arch, tied)
    assert num_model_params(cfg) == _built_params(cfg)


def test_qwen3_8b_fp32_is_refused_at_24_gib_and_bf16_accepted(monkeypatch):
    monkeypatch.setattr(loader, "available_memory", lambda device: 24 * GiB)
    cfg = ModelConfig.from_dir(resolve_model_dir("Qwen3-8B", dummy_weights=True))
    with pytest.raises(ValueError) as e:
        check_model_fits(cfg, torch.float32, torch.device("cpu"))
    assert str(e.value) == (
        "the model does not fit: its weights need 32.8 GB (30.5 GiB) in float32 but only "
        "25.8 GB (24.0 GiB) of RAM is available (MemAvailable); use --dtype bfloat16 "
        "(dtype='bfloat16'), which needs 16.4 GB (15.3 GiB)")
    assert check_model_fits(cfg, torch.bfloat16, torch.device("cpu")) is None


def test_a_model_too_large_in_any_dtype_gets_no_dtype_advice(monkeypatch):
    monkeypatch.setattr(loader, "available_memory", lambda device: 10 * GiB)
    cfg = ModelConfig.from_dir(resolve_model_dir("Qwen3-8B", dummy_weights=True))
    with pytest.raises(ValueError) as e:
        check_model_fits(cfg, torch.bfloat16, torch.device("cuda:0"))
    assert str(e.value) == (
        "the model does not fit: its weights need 16.4 GB (15.3 GiB) in bfloat16 but only "
        "10.7 GB (10.0 GiB) is free on cuda:0; use a smaller model or a machine with more "
        "memory")


def test_available_memory_reads_meminfo():
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    got = loader.available_memory(torch.device("cpu"))
    assert got % 1024 == 0 and abs(got - kib * 1024) < 2 * GiB
    assert loader.available_memory(torch.device("meta")) is None


def test_load_model_refuses_before_building_anything(monkeypatch):
    from nanoserve import LLM

    monkeypatch.setattr(loader, "available_memory", lambda device: 1 << 20)

    def no_build(*a, **k):
        raise AssertionError("weights were built")

    monkeypatch.setattr(loader, "build_model", no_build)
    with pytest.raises(ValueError, match=r"^the model does not fit: its weights need "):
        LLM(None, progress=False, device="cpu", dtype="float32", max_model_len=64)
