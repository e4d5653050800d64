"""Shared fixtures: tiny random Hugging Face models of each supported architecture, on disk."""

from __future__ import annotations

import pytest
import torch

try:  # lets tests/test_needle.py and friends run as scripts on machines without pytest plugins
    import transformers
except ImportError:  # pragma: no cover
    transformers = None

ARCHS = ("qwen3", "qwen2", "llama", "qwen3_yarn", "mistral", "qwen3_moe")
HF_CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
              "qwen3_yarn": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
              "qwen3_moe": "Qwen3MoeForCausalLM"}
# YaRN's original context is short, so that short prompts reach past it
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


# the GPU tests' model shape: 4 query heads per KV head, vocabulary and width for real kernels
GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=2048,
                 max_position_embeddings=4096, initializer_range=0.05)


def tiny_hf_config(arch: str, **overrides):
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.1, eos_token_id=None, bos_token_id=None)
    common.update(overrides)
    if arch == "qwen3":
        return transformers.Qwen3Config(**{"head_dim": 16, **common})
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "llama":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return transformers.LlamaConfig(rope_scaling=scaling, rope_theta=500000.0, **common)
    if arch == "qwen3_yarn":
        common.setdefault("rope_scaling", YARN)
        common["max_position_embeddings"] = min(common["max_position_embeddings"],
                                                4 * common["rope_scaling"][
                                                    "original_max_position_embeddings"])
        return transformers.Qwen3Config(**{"head_dim": 16, **common})
    if arch == "mistral":  # an explicit head_dim: q and o projections of 4 * 32 != 64 features
        common.setdefault("head_dim", 2 * common["hidden_size"] // common["num_attention_heads"])
        return transformers.MistralConfig(**{"sliding_window": None, **common})
    if arch == "qwen3_moe":
        # layer 1 keeps a dense MLP: both kinds of layer in one model
        moe = dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                   moe_intermediate_size=common["intermediate_size"] // 4, head_dim=16,
                   mlp_only_layers=[1])
        return transformers.Qwen3MoeConfig(**{**moe, **common})
    raise ValueError(arch)


def make_hf_model(arch: str, path, seed: int = 0, **overrides):
    cfg = tiny_hf_config(arch, **overrides)
    cls = getattr(transformers, HF_CLASSES[arch])
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    if arch == "qwen2":  # random qkv biases, so the bias path is really checked
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session", params=ARCHS)
def hf_model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = make_hf_model(request.param, path)
    return request.param, model, path


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-main")
    make_hf_model("qwen3", path)
    return path


@pytest.fixture(scope="session")
def six_layer_dir(tmp_path_factory):
    """A six-layer tiny Qwen3: room for resident and streamed layers in the offload tests."""
    path = tmp_path_factory.mktemp("qwen3-6l")
    make_hf_model("qwen3", path, num_hidden_layers=6)
    return path


def random_prompts(n: int, lengths, vocab: int = 320, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
            for i in range(n)]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
