"""The long-context families (issue 18): the registry, YaRN exactly as transformers computes
it (and a test that fails without it), Mistral's explicit head_dim and sliding-window refusal,
Qwen3-MoE's router and its three expert paths. Every family's logits and greedy tokens against
transformers are in test_models_vs_transformers.py (conftest's ARCHS)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import transformers
from conftest import HF_CLASSES, YARN, make_hf_model, random_prompts, tiny_hf_config
from helpers import engine_prefill_logits, make_llm
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from nanoserve import SamplingParams
from nanoserve.kv.fp8_format import FP8
from nanoserve.kv.spec import KVSpec
from nanoserve.models import moe, moe_tiles
from nanoserve.models.config import ModelConfig
from nanoserve.models.layers import RotaryEmbedding
from nanoserve.models.loader import resolve_model_dir
from nanoserve.models.registry import FAMILIES
from nanoserve.models.rope import inv_freq_and_attention_factor
from nanoserve.models.sizes import (
    expected_distinct_experts,
    num_active_params,
    num_model_params,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def variant(src, dst, **config_changes):
    """A copy of model directory `src` whose config.json has `config_changes` applied (None
    deletes a key): same weights, another reading of them."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.glob("*.safetensors"):
        shutil.copy(f, dst / f.name)
    raw = json.loads((src / "config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-yarn")
    return make_hf_model("qwen3_yarn", path), path


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-moe")
    return make_hf_model("qwen3_moe", path), path


# --- registry ------------------------------------------------------------------------------------
def test_every_registered_family_has_a_tiny_model_checked_against_transformers():
    assert set(HF_CLASSES.values()) == set(FAMILIES)


def test_an_unknown_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError) as e:
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"]})
    assert str(e.value) == (
        "unsupported architecture ['GPT2LMHeadModel']; nanoserve runs LlamaForCausalLM, "
        "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM")


def test_a_non_silu_activation_is_refused():
    raw = {**tiny_hf_config("mistral").to_dict(), "architectures": ["MistralForCausalLM"],
           "hidden_act": "gelu"}
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_dict(raw)


# --- YaRN ----------------------------------------------------------------------------------------
YARN_CASES = {
    "qwen3-8b-128k": dict(factor=4.0, original_max_position_embeddings=32768),
    "factor-from-lengths": dict(factor=None, original_max_position_embeddings=32768),
    "no-truncate-betas-mscale": dict(factor=8.0, original_max_position_embeddings=4096,
                                     truncate=False, beta_fast=16, beta_slow=2, mscale=0.707,
                                     mscale_all_dim=1.0),
    "explicit-attention-factor": dict(factor=4.0, original_max_position_embeddings=32768,
                                      attention_factor=1.3),
}


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_frequencies_and_cos_sin_equal_transformers_bitwise(case):
    hf_cfg = transformers.Qwen3Config(
        head_dim=128, hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, **YARN_CASES[case]})
    cfg = ModelConfig.from_dict({**hf_cfg.to_dict(), "architectures": ["Qwen3ForCausalLM"]})
    inv_freq, factor = inv_freq_and_attention_factor(128, cfg.rope_theta, cfg.rope_scaling)
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    assert torch.equal(inv_freq, ref_inv_freq) and factor == ref_factor

    ours = RotaryEmbedding(128, cfg.rope_theta, cfg.rope_scaling, 40000)
    ours.build()
    positions = torch.tensor([[0, 1, 4095, 4096, 32767, 32768, 39999]])
    cos, sin = Qwen3RotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float32), positions)
    table = ours.cos_sin[positions[0]]
    assert torch.equal(table[:, :64], cos[0, :, :64]) and torch.equal(table[:, 64:], sin[0, :, :64])


@pytest.mark.parametrize("name", ["Qwen3-8B", "Qwen3-30B-A3B"])
def test_the_shipped_yarn_configs_reach_131072_positions(name):
    """Qwen3-8B-YaRN and Qwen3-30B-A3B-YaRN (the MoE model at 128K, as its model card sets
    it): the plain model with YaRN factor 4 over 32,768 positions, the same parameters."""
    cfg = ModelConfig.from_dir(resolve_model_dir(f"{name}-YaRN", dummy_weights=True))
    assert cfg.max_position_embeddings == 131072
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32768}
    plain = ModelConfig.from_dir(resolve_model_dir(name, dummy_weights=True))
    assert num_model_params(cfg) == num_model_params(plain)
    assert dataclasses.replace(cfg, rope_scaling=None, max_position_embeddings=40960) == plain


def test_yarn_model_matches_transformers_past_its_original_context(yarn_model):
    hf, path = yarn_model
    ids = random_prompts(1, [120], seed=3)[0]  # 4x the original context of 32
    err = (engine_prefill_logits(make_llm(path), ids) - hf_logits(hf, ids)).abs().max().item()
    assert err < 2e-4


@pytest.mark.parametrize("dropped", ["scaling", "attention-factor"])
def test_dropping_yarn_fails_the_comparison_with_transformers(yarn_model, tmp_path, dropped):
    """The teeth of the YaRN test: the same weights read without YaRN (default RoPE), or with
    YaRN's frequencies but no attention factor, are far outside the 2e-4 bound."""
    hf, path = yarn_model
    rope = {"rope_type": "default", "rope_theta": 10000.0} if dropped == "scaling" else \
        {**YARN, "rope_theta": 10000.0, "attention_factor": 1.0}
    wrong = variant(path, tmp_path / "wrong", rope_parameters=rope, rope_scaling=None)
    ids = random_prompts(1, [120], seed=3)[0]
    err = (engine_prefill_logits(make_llm(wrong), ids) - hf_logits(hf, ids))[32:].abs().max()
    assert err.item() > 100 * 2e-4


# --- Mistral -------------------------------------------------------------------------------------
def test_mistral_keeps_its_explicit_head_dim(tmp_path):
    make_hf_model("mistral", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.architecture, cfg.head_dim, cfg.hidden_size, cfg.num_heads) == \
        ("mistral", 32, 64, 4)
    model = make_llm(tmp_path).engine.runner.model
    assert model.layers[0].self_attn.o_proj.weight.shape == (64, 128)


def test_mistral_with_a_sliding_window_is_refused_beyond_it_and_exact_within(tmp_path):
    hf = make_hf_model("mistral", tmp_path, sliding_window=64)
    with pytest.raises(ValueError) as e:
        make_llm(tmp_path)  # max_model_len: the model's 1024 positions
    assert str(e.value) == (
        "the mistral config sets sliding_window=64, and nanoserve has no sliding-window "
        "attention: it runs this model only with max_model_len <= 64 (where the window never "
        "applies), not 1024; pass --max-model-len 64 (max_model_len=64)")
    with pytest.raises(ValueError, match="sliding_window=64"):
        make_llm(tmp_path, max_model_len=65)
    ids = random_prompts(1, [64], seed=5)[0]  # transformers applies its window: no effect here
    ours = engine_prefill_logits(make_llm(tmp_path, max_model_len=64), ids)
    assert (ours - hf_logits(hf, ids)).abs().max().item() < 2e-4


def test_the_shipped_mistral_nemo_config_has_no_window():
    cfg = ModelConfig.from_dir(resolve_model_dir("Mistral-Nemo-12B", dummy_weights=True))
    assert (cfg.architecture, cfg.sliding_window, cfg.head_dim, cfg.hidden_size) == \
        ("mistral", None, 128, 5120)
    cfg.check_max_model_len(cfg.max_position_embeddings)


@pytest.mark.parametrize("switch, window", [(False, None), (True, 4096)])
def test_qwen_windows_count_only_when_use_sliding_window_is_on(switch, window):
    raw = {**tiny_hf_config("qwen2").to_dict(), "architectures": ["Qwen2ForCausalLM"],
           "sliding_window": 4096, "use_sliding_window": switch}
    assert ModelConfig.from_dict(raw).sliding_window == window


# --- Qwen3-MoE: config ---------------------------------------------------------------------------
@pytest.mark.parametrize("step, dense", [(1, []), (2, []), (1, [0, 2]), (2, [1])])
def test_sparse_layers_are_the_ones_transformers_builds(step, dense):
    hf_cfg = tiny_hf_config("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=step,
                            mlp_only_layers=dense)
    hf = transformers.Qwen3MoeForCausalLM(hf_cfg)
    cfg = ModelConfig.from_dict({**hf_cfg.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    assert cfg.moe_layers == tuple(i for i, layer in enumerate(hf.model.layers)
                                   if hasattr(layer.mlp, "experts"))


@pytest.mark.parametrize("change, message", [
    (dict(num_experts_per_tok=9), r"num_experts_per_tok 9 must be in 1\.\.num_experts \(8\)"),
    (dict(shared_expert_intermediate_size=64), "shared experts"),
])
def test_moe_configs_nanoserve_cannot_run_are_refused(change, message):
    raw = {**tiny_hf_config("qwen3_moe").to_dict(), "architectures": ["Qwen3MoeForCausalLM"],
           **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_qwen3_30b_a3b_sizes():
    cfg = ModelConfig.from_dir(resolve_model_dir("Qwen3-30B-A3B", dummy_weights=True))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_layers) == (128, 8, tuple(range(48)))
    assert num_model_params(cfg) == 30_532_122_624
    assert num_active_params(cfg) == 3_353_032_704
    assert expected_distinct_experts(cfg, 1) == 8
    assert 111 < expected_distinct_experts(cfg, 32) < 112 < 128


# --- Qwen3-MoE: the expert paths -----------------------------------------------------------------
def _block(hidden: int, experts: int, top_k: int, inter: int, norm: bool, seed: int = 0):
    torch.manual_seed(seed)
    block = moe.SparseMoE(hidden, experts, top_k, inter, norm)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return block.requires_grad_(False)


@pytest.mark.parametrize("tokens", [1, 3, 37])
@pytest.mark.parametrize("path", ["grouped", "gather"])
def test_capturable_expert_paths_equal_the_reference_loop_on_cpu(tokens, path):
    block = _block(64, 8, 3, 32, norm=True)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    block.backend = "loop"
    ref = block(x)
    block.backend = path
    assert (block(x) - ref).abs().max().item() < 1e-5 * ref.abs().max().item()


def _routing(tokens: int, experts: int, top_k: int, case: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    if case == "one expert":  # every token's first slot on expert 2, the rest spread
        rest = [3 + torch.randperm(experts - 3, generator=g)[:top_k - 1] for _ in range(tokens)]
        ids = torch.stack([torch.cat([torch.tensor([2]), r]) for r in rest])
    else:  # experts 0 and 1 never chosen: empty experts between used ones
        ids = torch.stack([2 + torch.randperm(experts - 2, generator=g)[:top_k]
                           for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g, dtype=torch.float64)
    return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize("case", ["empty experts", "one expert"])
def test_the_fused_paths_tile_layout_computes_the_loops_result_in_float64(tokens, block_m,
                                                                          case):
    """The layout the fused kernels run over (pairs sorted by expert into whole tiles of
    block_m rows, padding rows past each expert's pairs), computed tile by tile as the kernels
    do, equals the reference loop in float64."""
    experts, top_k, hidden, inter = 12, 4, 24, 16
    g = torch.Generator().manual_seed(tokens)
    weights, ids = _routing(tokens, experts, top_k, case, seed=tokens)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g, dtype=torch.float64)
    down = torch.randn(experts, hidden, inter, generator=g, dtype=torch.float64)
    ref = moe.experts_loop(x, weights, ids, gate_up, down)
    got = moe_tiles.experts_tiled_reference(x, weights, ids, gate_up, down, block_m)
    assert (got - ref).abs().max().item() < 1e-12 * ref.abs().max().item()
    sorted_pairs, tile_expert = moe_tiles.sort_pairs_reference(ids, experts, block_m)
    pairs = tokens * top_k
    flat = ids.flatten()
    assert sorted(p for p in sorted_pairs.tolist() if p < pairs) == list(range(pairs))
    for tile, expert in enumerate(tile_expert.tolist()):
        rows = [p for p in sorted_pairs[tile * block_m:(tile + 1) * block_m].tolist()
                if p < pairs]
        if expert == experts:  # past the used tiles: nothing but padding
            assert rows == []
            continue
        assert rows and rows == sorted(rows) and all(flat[p] == expert for p in rows)
    used = tile_expert[tile_expert < experts].tolist()
    assert used == sorted(used) and set(used) == set(flat.tolist())
    assert len(sorted_pairs) == moe_tiles.padded_sizes(pairs, experts, block_m)[0]


@pytest.mark.parametrize("norm", [True, False])
def test_sparse_moe_equals_transformers_block(norm):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_cfg = tiny_hf_config("qwen3_moe", norm_topk_prob=norm)
    hf_cfg._experts_implementation = "eager"
    hf = Qwen3MoeSparseMoeBlock(hf_cfg).eval().requires_grad_(False)
    ours = _block(64, 8, 2, 32, norm)
    hf.gate.weight.copy_(ours.gate.weight)
    hf.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
    hf.experts.down_proj.copy_(ours.experts.down_proj)
    x = torch.randn(1, 21, 64)
    with torch.no_grad():
        ref = hf(x)[0]
    assert (ours(x[0]) - ref).abs().max().item() < 1e-6


def test_the_cpu_runs_the_loop_unless_told():
    x = torch.zeros(2, 4)
    assert moe.choose_path("auto", x) == "loop"
    assert moe.choose_path("gather", x) == "gather"
    assert not moe.fast_grouped_mm(x.device, torch.bfloat16)


@pytest.mark.parametrize("backend", ["grouped", "gather"])
def test_moe_engine_on_a_capturable_path_matches_transformers(moe_model, backend):
    hf, path = moe_model
    llm = make_llm(path, moe_backend=backend)
    ids = random_prompts(1, [45])[0]
    assert (engine_prefill_logits(llm, ids) - hf_logits(hf, ids)).abs().max().item() < 2e-4
    prompt = random_prompts(1, [17], seed=2)[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert llm.generate(prompt, GREEDY)[0].token_ids == ref


def test_an_unknown_moe_backend_is_refused(moe_model):
    with pytest.raises(ValueError, match="moe_backend must be one of"):
        make_llm(moe_model[1], moe_backend="triton")


# --- Qwen3-MoE: loading --------------------------------------------------------------------------
def test_a_checkpoint_with_stacked_experts_loads_as_per_expert_tensors_do(moe_model, tmp_path):
    """transformers keeps experts stacked in memory (mlp.experts.gate_up_proj [E, 2I, H]); a
    checkpoint saved that way loads into the same places."""
    hf, path = moe_model
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    shutil.copy(path / "config.json", stacked / "config.json")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
              stacked / "model.safetensors")
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(stacked / "model.safetensors")
    ids = random_prompts(1, [30])[0]
    assert torch.equal(engine_prefill_logits(make_llm(stacked), ids),
                       engine_prefill_logits(make_llm(path), ids))


def test_a_checkpoint_missing_one_expert_is_refused(moe_model, tmp_path):
    _, path = moe_model
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    broken = variant(path, tmp_path / "broken")
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(KeyError, match="lacks 1 tensors.*layers.2.mlp.experts.gate_up_proj#5.1"):
        make_llm(broken)


def test_moe_offload_gives_the_same_tokens_as_resident(moe_model):
    _, path = moe_model
    prompts = random_prompts(3, [19, 6, 33], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=256)
    ref = [o.token_ids for o in make_llm(path, **kw).generate(prompts, params)]
    llm = make_llm(path, enable_offload=True, resident_layers=1, host_kv_budget_gib=0.01, **kw)
    assert llm.engine.kv.plan.streamed_layers == 2
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref


# --- one million tokens ---------------------------------------------------------------------------
def test_the_shipped_1m_llama3_config_parses_and_sizes():
    """Llama-3-8B-Instruct-Gradient-1048k's shape (issue 34): 1,048,576 positions through a
    larger RoPE base, no scaling; Llama 3 8B's weights; KV per token 128 KiB in bf16 and 66 KiB
    in FP8 (its scales included): 128 GiB and 66 GiB at 1M tokens."""
    cfg = ModelConfig.from_dir(resolve_model_dir("Llama-3-8B-1048k", dummy_weights=True))
    assert cfg.max_position_embeddings == 1_048_576
    assert cfg.rope_theta == 3580165449.0 and cfg.rope_scaling is None
    llama31 = ModelConfig.from_dir(resolve_model_dir("Llama-3.1-8B", dummy_weights=True))
    assert num_model_params(cfg) == num_model_params(llama31) == 8_030_261_248
    bf16, fp8 = (KVSpec.for_model(cfg, 256, dtype) for dtype in (torch.bfloat16, FP8))
    assert bf16.token_bytes() == 32 * 2 * 8 * 128 * 2 == 131_072
    assert fp8.token_bytes() == 32 * 2 * 8 * (128 + 4) == 67_584
    assert fp8.token_bytes() * 1_048_576 == 70_866_960_384  # 66.0 GiB


def test_1m_rope_equals_transformers_at_its_last_positions():
    """The cos/sin table over all 1,048,576 positions equals transformers' Llama RoPE with the
    same base, bitwise, up to the last position (float32 angles there are what transformers
    computes too)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    path = resolve_model_dir("Llama-3-8B-1048k", dummy_weights=True)
    cfg = ModelConfig.from_dir(path)
    hf_cfg = transformers.LlamaConfig.from_pretrained(path)
    ours = RotaryEmbedding(128, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    ours.build()
    positions = torch.tensor([[0, 1, 262_143, 524_288, 1_000_000, 1_048_575]])
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float32), positions)
    table = ours.cos_sin[positions[0]]
    assert torch.equal(table[:, :64], cos[0, :, :64]) and torch.equal(table[:, 64:], sin[0, :, :64])
