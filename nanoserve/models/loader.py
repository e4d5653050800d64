"""Find a model (local dir, shipped config, embedded model, or hub id) and load its weights
straight into place: the module is built on the meta device, then materialized once. Under
tensor parallelism each rank builds and fills only its part (models/parallel.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from nanoserve.distributed.parallel_state import sized_as, tp_size
from nanoserve.models.checkpoint import checkpoint_target, covered, destination, pieces
from nanoserve.models.config import ModelConfig
from nanoserve.models.decoder import CausalLM
from nanoserve.models.moe import Experts
from nanoserve.models.parallel import copy_rank_part, full_shape, read_rank_part
from nanoserve.models.sizes import num_model_params
from nanoserve.quant.linear import QuantizedLinear

PACKAGE_DIR = Path(__file__).resolve().parent.parent
SHIPPED_CONFIGS = PACKAGE_DIR / "model_configs"
EMBEDDED_MODEL = PACKAGE_DIR / "assets" / "tiny-qwen3"

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


def hub_id_problem(model: str) -> str | None:
    """Why `model` is not a Hugging Face hub id of the form owner/name (None when it is one).
    The characters and shapes refused are huggingface_hub's own: letters, digits, '-', '_' and
    '.', no '--' or '..', no leading or trailing '-' or '.', at most 96 characters a part."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if model.count("/") != 1:
        return "a hub id is owner/name, with exactly one '/'"
    try:
        validate_repo_id(model)
    except HFValidationError as e:
        return str(e)
    return None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def resolve_model_dir(model: str | None, dummy_weights: bool = False) -> Path:
    """A local directory holding config.json (and the weights unless dummy_weights): the
    embedded model, a local directory, a shipped config (dummy_weights), or a Hugging Face hub
    id (owner/name), downloaded or found in the local Hugging Face cache (with HF_HUB_OFFLINE=1,
    the cache only)."""
    if model in (None, "", "embedded", "tiny-qwen3"):
        return EMBEDDED_MODEL
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json (a model "
                                    f"directory holds a Hugging Face config.json and weights)")
        return path
    if dummy_weights and (shipped := shipped_config_dir(model)) is not None:
        return shipped
    if path.exists():
        raise FileNotFoundError(f"model {model!r} is a file, not a model directory (a "
                                f"directory holding config.json)")
    problem = hub_id_problem(model)
    if problem is not None:
        names = sorted(d.name for d in SHIPPED_CONFIGS.iterdir())
        hint = (f"; {model!r} is a shipped config: add --dummy-weights to run its shape with "
                f"random weights" if shipped_config_dir(model) is not None else
                f"; shipped configs for --dummy-weights: {names}")
        if model.startswith((".", "/", "~")):  # meant as a path
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist (and a path "
                                    f"is not a Hugging Face hub id, owner/name){hint}")
        raise ValueError(f"model {model!r} is neither a local directory nor a Hugging Face hub "
                         f"id (owner/name): {problem.rstrip('.')}{hint}")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    offline = constants.HF_HUB_OFFLINE or \
        os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    patterns = HUB_CONFIG_PATTERNS if dummy_weights else HUB_PATTERNS
    try:
        return Path(snapshot_download(model, allow_patterns=patterns, local_files_only=offline))
    except LocalEntryNotFoundError as e:
        if offline:
            raise FileNotFoundError(
                f"model {model!r} is not in the local Hugging Face cache "
                f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set, so it cannot be "
                f"downloaded: unset HF_HUB_OFFLINE to download it, or pass a local "
                f"directory") from e
        raise FileNotFoundError(f"could not fetch model {model!r} from the Hugging Face hub "
                                f"and it is not in the local cache: {_one_line(e)}") from e
    except Exception as e:  # network, auth, missing repo: all surface as one clear error
        raise FileNotFoundError(f"could not fetch model {model!r} from the Hugging Face hub: "
                                f"{_one_line(e)}") from e


def model_bytes(cfg: ModelConfig, dtype: torch.dtype, max_len: int = 0,
                tp: int | None = None) -> int:
    """Bytes of the model one rank builds under tensor parallelism of `tp` ranks (default:
    this process's TP size): its weights in `dtype` plus the fp32 RoPE table of `max_len`."""
    tp = tp_size() if tp is None else tp
    rope = max_len * cfg.head_dim * 4
    if cfg.quantization is not None:  # the quantized tensors' own bytes, as a rank builds them
        with sized_as(tp):
            model = build_model(cfg, 0, dtype, torch.device("meta"))
        return sum(p.numel() * p.element_size() for p in model.parameters()) + rope
    return num_model_params(cfg, tp) * dtype.itemsize + rope


def available_memory(device: torch.device) -> int | None:
    """Bytes free for the model on `device` now: MemAvailable from /proc/meminfo on the CPU,
    free device memory on CUDA; None where it cannot be told."""
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                return next(int(line.split()[1]) * 1024 for line in f
                            if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError, IndexError):
            return None
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.mem_get_info(device)[0]
    return None


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB ({n / 2**30:.1f} GiB)"


def check_model_fits(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                     max_len: int = 0) -> None:
    """Raises ValueError, before anything is allocated, when the model cannot fit the memory
    available on `device`, naming the bytes needed and available (and --dtype bfloat16 when
    the model is in float32 and would fit in bfloat16)."""
    device = torch.device(device)
    avail = available_memory(device)
    need = model_bytes(cfg, dtype, max_len)
    if avail is None or need <= avail:
        return
    where = "of RAM is available (MemAvailable)" if device.type == "cpu" else \
        f"is free on {device}"
    share = f"this rank's share of its weights (tensor parallel size {tp_size()})" \
        if tp_size() > 1 else "its weights"
    text = (f"the model does not fit: {share} need {_gb(need)} in "
            f"{str(dtype).removeprefix('torch.')} but only {_gb(avail)} {where}")
    half = model_bytes(cfg, torch.bfloat16, max_len)
    if dtype == torch.float32 and half <= avail:
        text += f"; use --dtype bfloat16 (dtype='bfloat16'), which needs {_gb(half)}"
    else:
        text += "; use a smaller model or a machine with more memory"
    raise ValueError(text)


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
                # static activation scales (activations run unquantized here) and a
                # checkpoint's KV-cache scales (the engine keeps its own, --kv-cache-dtype)
                if name.endswith((".input_scale", ".k_scale", ".v_scale")):
                    continue
                target = checkpoint_target(name)
                if target.param not in params:
                    # GPTQ checkpoints hold zero biases of bias-free layers, older
                    # compressed-tensors ones zero points of symmetric FP8: nothing to hold
                    if name.endswith((".bias", "_zero_point")) and not f.get_tensor(name).any():
                        continue
                    raise KeyError(f"checkpoint tensor {name} has no place in the model")
                owner = _owner(modules, target.param)
                src = f.get_slice(name)  # reads only this rank's part from disk
                copy_rank_part(destination(params, modules, target), read_rank_part(
                    src, len(src.get_shape()), target.param, owner, target.shard), target.param)
                filled |= covered(target, owner)
    missing = sorted(_expected_keys(model) - filled)
    if missing:
        raise KeyError(
            f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for name, module in modules.items():
        if isinstance(module, QuantizedLinear):
            module.finish_loading(name)


def _owner(modules: dict, param: str):
    return modules[param.rsplit(".", 1)[0]]


def _expected_keys(model: CausalLM) -> set[str]:
    modules = dict(model.named_modules())
    return {p.key for name, _ in model.named_parameters()
            if not (name == "lm_head.weight" and model.config.tie_word_embeddings)
            for p in pieces(name, _owner(modules, name))}


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights from the config alone, generated on the model's device. Under tensor
    parallelism each rank generates every full (TP=1) parameter in turn and keeps its part:
    the ranks together hold exactly the TP=1 model of the same seed (quantized layers excepted:
    each rank fills its own part)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    modules = dict(model.named_modules())
    quantized = {name for name, m in modules.items() if isinstance(m, QuantizedLinear)
                 or (isinstance(m, Experts) and m.quant is not None)}
    for name in sorted(quantized):
        modules[name].fill_dummy(gen)
        if isinstance(modules[name], QuantizedLinear):
            modules[name].finish_loading(name)
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[0] in quantized:
            continue
        if name.endswith("norm.weight") or "layernorm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        elif tp_size() == 1:
            p.normal_(0.0, 0.02, generator=gen)
        else:
            full = torch.empty(full_shape(name, p.shape), dtype=p.dtype, device=p.device)
            full.normal_(0.0, 0.02, generator=gen)
            copy_rank_part(p, read_rank_part(full, full.ndim, name, _owner(modules, name)), name)


def load_model(model_dir: Path, max_len: int, dtype: torch.dtype, device: torch.device,
               dummy_weights: bool = False, seed: int = 0, progress: bool = True) -> CausalLM:
    cfg = ModelConfig.from_dir(model_dir)
    check_model_fits(cfg, dtype, device, max_len)  # refuse before allocating anything
    model = build_model(cfg, max_len, dtype, device)
    if dummy_weights:
        init_dummy_weights(model, seed)
    else:
        load_weights(model, model_dir, progress)
    return model
