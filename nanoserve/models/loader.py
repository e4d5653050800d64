"""Find a model (local dir, shipped config, embedded model, or hub id) and load its weights
straight into place: the module is built on the meta device, then materialized once."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from nanoserve.models.config import ModelConfig
from nanoserve.models.decoder import CausalLM
from nanoserve.models.layers import MergedLinear

PACKAGE_DIR = Path(__file__).resolve().parent.parent
SHIPPED_CONFIGS = PACKAGE_DIR / "model_configs"
EMBEDDED_MODEL = PACKAGE_DIR / "assets" / "tiny-qwen3"

# checkpoint name part -> (fused module name, shard index)
FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
HUB_CONFIG_PATTERNS = ["*.json", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def shipped_config_dir(name: str) -> Path | None:
    """Configs of real models shipped with nanoserve, for --dummy-weights with no download.
    Matches 'Qwen/Qwen3-8B' or 'qwen3-8b'."""
    key = name.rstrip("/").split("/")[-1].lower()
    for d in SHIPPED_CONFIGS.iterdir() if SHIPPED_CONFIGS.is_dir() else []:
        if d.name.lower() == key:
            return d
    return None


def resolve_model_dir(model: str | None, dummy_weights: bool = False) -> Path:
    """A local directory holding config.json (and the weights unless dummy_weights)."""
    if model in (None, "", "embedded", "tiny-qwen3"):
        return EMBEDDED_MODEL
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return path
    if dummy_weights and (shipped := shipped_config_dir(model)) is not None:
        return shipped
    if path.suffix or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(
            f"model {model!r} is neither a local directory nor a Hugging Face hub id "
            f"(owner/name); shipped configs for --dummy-weights: "
            f"{sorted(d.name for d in SHIPPED_CONFIGS.iterdir())}")
    from huggingface_hub import snapshot_download

    patterns = HUB_CONFIG_PATTERNS if dummy_weights else HUB_PATTERNS
    try:
        return Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as e:  # network, auth, missing repo: all surface as one clear error
        raise FileNotFoundError(f"could not fetch model {model!r} from the hub: {e}") from e


def build_model(cfg: ModelConfig, max_len: int, dtype: torch.dtype,
                device: torch.device) -> CausalLM:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = CausalLM(cfg, max_len)
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty unties parameters that share storage
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.build()
    return model.eval().requires_grad_(False)


@torch.no_grad()
def load_weights(model: CausalLM, model_dir: Path, progress: bool = True) -> None:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir} (use --dummy-weights "
                                "to run the model's shape with random weights)")
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    filled: set[str] = set()
    for file in tqdm(files, desc="Loading weights", unit="file", disable=not progress):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if "rotary_emb" in name:
                    continue
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue
                target, shard = _target(name)
                if target not in params:
                    raise KeyError(f"checkpoint tensor {name} has no place in the model")
                param = params[target]
                tensor = f.get_tensor(name)
                if shard is None:
                    param.copy_(tensor)
                else:
                    module = modules[target.rsplit(".", 1)[0]]
                    assert isinstance(module, MergedLinear)
                    param[module.shard_slice(shard)].copy_(tensor)
                filled.add(f"{target}#{shard}")
    expected = _expected_keys(model)
    missing = sorted(expected - filled)
    if missing:
        raise KeyError(
            f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _target(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in FUSED_SHARDS:
            fused, shard = FUSED_SHARDS[part]
            parts[i] = fused
            return ".".join(parts), shard
    return name, None


def _expected_keys(model: CausalLM) -> set[str]:
    keys = set()
    modules = dict(model.named_modules())
    for name, _ in model.named_parameters():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        module = modules[name.rsplit(".", 1)[0]]
        if isinstance(module, MergedLinear):
            keys.update(f"{name}#{s}" for s in range(len(module.shard_sizes)))
        else:
            keys.add(f"{name}#None")
    return keys


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights from the config alone, generated on the model's device."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)


def load_model(model_dir: Path, max_len: int, dtype: torch.dtype, device: torch.device,
               dummy_weights: bool = False, seed: int = 0, progress: bool = True) -> CausalLM:
    cfg = ModelConfig.from_dir(model_dir)
    model = build_model(cfg, max_len, dtype, device)
    if dummy_weights:
        init_dummy_weights(model, seed)
    else:
        load_weights(model, model_dir, progress)
    return model
