"""Tensor parallelism's model side (issue 15): two gloo ranks on the CPU each build their shard
of a tiny fp32 model, load it straight from the checkpoint (or generate it: dummy weights) and
prefill a batch of prompts; every rank's logits equal TP=1's of the same weights within fp32
rounding (the all-reduces sum in another order), and greedy tokens are equal. One spawn of the
two ranks runs every case (tests/tp_worker.py)."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import time
from contextlib import contextmanager

import pytest
import torch
from conftest import make_hf_model, random_prompts
from quant_checkpoints import quantize_checkpoint
from safetensors.torch import load_file, save_file
from tp_worker import prefill_logits, run_rank

from nanoserve.distributed import parallel_state
from nanoserve.models import loader
from nanoserve.models.config import ModelConfig
from nanoserve.models.loader import build_model, check_model_fits, model_bytes, resolve_model_dir
from nanoserve.models.sizes import num_model_params

TP = 2
# relative to the largest |logit| (O(1) here): the ranks' partial sums, added in another order,
# move the logits by a few ulps (measured: under 8e-7); the smallest top-2 gap of any row is
# over 1e-3, so greedy tokens cannot flip by rounding
REL_BOUND = 1e-5
PROMPTS = random_prompts(3, [5, 13, 9], seed=7)
SPAWN_TIMEOUT_S = 180

# case -> (tiny model family, config overrides, dummy weights, MoE backend)
CASES = {
    "qwen3": ("qwen3", {}, False, "auto"),
    "qwen2-qkv-bias": ("qwen2", {}, False, "auto"),
    "llama": ("llama", {}, False, "auto"),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True), False, "auto"),
    "qwen3-moe": ("qwen3_moe", {}, False, "auto"),  # the loop path on the CPU
    "qwen3-moe-gather": ("qwen3_moe", {}, False, "gather"),  # the capturable path
    "qwen3-moe-stacked-experts": ("qwen3_moe", {}, False, "auto"),  # [E, 2I, H] on disk
    "qwen3-dummy": ("qwen3", {}, True, "auto"),
    "qwen3-moe-dummy": ("qwen3_moe", {}, True, "auto"),
}
# quantized checkpoints (tests/quant_checkpoints.py) of the tiny qwen3: case -> (method, options);
# each rank splits their own tensors (q/k/v and gate/up by outputs, o and down by inputs)
QUANT_CASES = {
    "qwen3-fp8-block": ("fp8_block", {"block": (16, 32)}),
    "qwen3-fp8-channel": ("fp8_channel", {}),
    "qwen3-awq": ("awq", {"group": 16}),
    "qwen3-gptq": ("gptq", {"group": 16}),
    "qwen2-qkv-bias-awq": ("awq", {"group": 16}),  # a quantized fused layer's biases split too
}
EVERY_CASE = [*CASES, *QUANT_CASES]
ONE_KV_HEAD = "qwen3-one-kv-head"  # refused: 2 ranks cannot split 1 KV head
MISSING_K_PROJ = "qwen3-missing-k-proj"  # refused: a checkpoint without a tensor
# refused: act-order's g_idx under a config saying desc_act false (a rank's inputs reach groups
# another rank holds)
UNDECLARED_ACT_ORDER = "qwen3-gptq-undeclared-act-order"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """({case: {tp1: TP=1's result, ranks: [rank 0's, rank 1's], cfg}},
    {refused case: [rank 0's message, rank 1's]})."""
    root = tmp_path_factory.mktemp("tp")
    jobs, dirs = [], {}
    for name, (arch, overrides, dummy, moe_backend) in CASES.items():
        dirs[name] = root / name
        hf = make_hf_model(arch, dirs[name], **overrides)
        if "stacked" in name:  # transformers' in-memory layout, saved as it is
            save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
                      dirs[name] / "model.safetensors")
            assert "model.layers.0.mlp.experts.gate_up_proj" in \
                load_file(dirs[name] / "model.safetensors")
        jobs.append((name, dirs[name], PROMPTS, dummy, moe_backend))
    for name, (method, options) in QUANT_CASES.items():
        dirs[name] = root / name
        source = dirs["qwen2-qkv-bias" if name.startswith("qwen2") else "qwen3"]
        quantize_checkpoint(source, dirs[name], method, **options)
        jobs.append((name, dirs[name], PROMPTS, False, "auto"))
    make_hf_model("qwen3", root / ONE_KV_HEAD, num_key_value_heads=1)
    jobs.append((ONE_KV_HEAD, root / ONE_KV_HEAD, PROMPTS, False))
    missing = _without(dirs["qwen3"], root / MISSING_K_PROJ,
                       "model.layers.1.self_attn.k_proj.weight")
    jobs.append((MISSING_K_PROJ, missing, PROMPTS, False))
    quantize_checkpoint(dirs["qwen3"], root / UNDECLARED_ACT_ORDER, "gptq", group=16,
                        act_order=True)
    cfg_path = root / UNDECLARED_ACT_ORDER / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["quantization_config"]["desc_act"] = False
    cfg_path.write_text(json.dumps(raw))
    jobs.append((UNDECLARED_ACT_ORDER, root / UNDECLARED_ACT_ORDER, PROMPTS, False))

    out = root / "out"
    out.mkdir()
    ctx = multiprocessing.get_context("spawn")
    init_method = f"file://{root / 'rendezvous'}"
    ranks = [ctx.Process(target=run_rank, args=(r, TP, init_method, jobs, out))
             for r in range(TP)]
    for p in ranks:
        p.start()
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        for p in ranks:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in ranks:  # a rank still running (a hang) is killed: no process outlives the test
            if p.is_alive():
                p.kill()
                p.join()
    crashes = [f.read_text() for f in sorted(out.glob("*.crash"))]
    assert not crashes, crashes[0]
    assert [p.exitcode for p in ranks] == [0] * TP

    settings = {name: (dummy, backend) for name, (_, _, dummy, backend) in CASES.items()}
    settings.update({name: (False, "auto") for name in QUANT_CASES})
    results = {name: dict(tp1=prefill_logits(dirs[name], PROMPTS, dummy, moe_backend),
                          ranks=[torch.load(out / f"{name}.{r}.pt") for r in range(TP)],
                          cfg=ModelConfig.from_dir(dirs[name]))
               for name, (dummy, moe_backend) in settings.items()}
    refusals = {name: [(out / f"{name}.{r}.err").read_text() for r in range(TP)]
                for name in (ONE_KV_HEAD, MISSING_K_PROJ, UNDECLARED_ACT_ORDER)}
    return results, refusals


def _without(src, dst, tensor: str):
    """A copy of model directory `src` whose checkpoint lacks `tensor`."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    (file,) = src.glob("*.safetensors")
    tensors = load_file(file)
    del tensors[tensor]
    save_file(tensors, dst / file.name, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("case", EVERY_CASE)
def test_tp2_logits_equal_tp1_within_fp32_rounding_on_every_rank(runs, case):
    run = runs[0][case]
    ref, ranks = run["tp1"]["logits"], run["ranks"]
    assert ref.shape == (sum(map(len, PROMPTS)), 320) and ref.dtype == torch.float32
    for result in ranks:
        logits = result["logits"]
        assert logits.shape == ref.shape and logits.dtype == torch.float32
        err = (logits - ref).abs().max().item() / ref.abs().max().item()
        assert err < REL_BOUND, f"{case}: relative error {err:.2e}"


@pytest.mark.parametrize("case", EVERY_CASE)
def test_tp2_greedy_tokens_equal_tp1(runs, case):
    run = runs[0][case]
    for result in run["ranks"]:
        assert torch.equal(result["logits"].argmax(-1), run["tp1"]["logits"].argmax(-1))


@pytest.mark.parametrize("case", EVERY_CASE)
def test_every_rank_returns_the_same_full_logits(runs, case):
    rank0, rank1 = runs[0][case]["ranks"]
    assert torch.equal(rank0["logits"], rank1["logits"])


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_its_share_of_the_parameters(runs, case):
    run = runs[0][case]
    assert run["tp1"]["params"] == num_model_params(run["cfg"])
    assert [r["params"] for r in run["ranks"]] == [num_model_params(run["cfg"], TP)] * TP


@pytest.mark.parametrize("case", QUANT_CASES)
def test_each_rank_holds_about_half_of_a_quantized_checkpoints_tensors(runs, case):
    """The quantized layers' tensors split (weights, scales, zero points; the norms, per-tensor
    scales and the o / down layers' per-output scales stay whole): each rank holds between
    half of TP=1's elements and 60% of them."""
    run = runs[0][case]
    for result in run["ranks"]:
        assert 0.5 * run["tp1"]["params"] < result["params"] < 0.6 * run["tp1"]["params"]


def test_a_gptq_checkpoint_whose_g_idx_crosses_ranks_is_refused_on_every_rank(runs):
    for message in runs[1][UNDECLARED_ACT_ORDER]:
        assert message == ("model.layers.0.self_attn.o_proj: its g_idx reaches groups outside "
                           "this rank's inputs (an act-order checkpoint whose config says "
                           "desc_act false?); run it at tensor parallel size 1")


def test_tp2_wrong_weights_fail_the_comparison(runs):
    """The teeth: another checkpoint's TP=1 logits are far outside the bound."""
    ref = runs[0]["qwen3"]["tp1"]["logits"]
    other = runs[0]["llama"]["ranks"][0]["logits"]
    assert (other - ref).abs().max().item() / ref.abs().max().item() > 1000 * REL_BOUND


def test_a_tp_size_that_does_not_divide_the_kv_heads_is_refused(runs):
    assert runs[1][ONE_KV_HEAD] == [
        "tensor parallel size 2 does not divide the qwen3 config's num_key_value_heads 1: each "
        "rank holds an equal share of the attention heads, KV heads and MLP rows"] * TP


def test_a_missing_tensor_is_refused_under_tp(runs):
    for message in runs[1][MISSING_K_PROJ]:
        assert "lacks 1 tensors" in message and "model.layers.1.self_attn.qkv_proj" in message


# --- in-process: a rank's shapes and counts (no communication needed to build on meta) ---------
@contextmanager
def as_rank(rank: int, size: int):
    """This process sees itself as `rank` of `size` TP ranks (nothing is initialized)."""
    saved = parallel_state._rank, parallel_state._size
    parallel_state._rank, parallel_state._size = rank, size
    try:
        yield
    finally:
        parallel_state._rank, parallel_state._size = saved


# shipped configs and the TP sizes that split them (4 KV heads: not 8)
SHIPPED = [(name, tp) for name in ("Qwen3-8B", "Llama-3.1-8B", "Mistral-Nemo-12B")
           for tp in (2, 4, 8)] + \
    [(name, tp) for name in ("Qwen2.5-7B", "Qwen3-30B-A3B") for tp in (2, 4)]


@pytest.mark.parametrize("name, tp", SHIPPED)
def test_num_model_params_counts_one_ranks_share(name, tp):
    cfg = ModelConfig.from_dir(resolve_model_dir(name, dummy_weights=True))
    with as_rank(tp - 1, tp):
        model = build_model(cfg, 64, torch.bfloat16, torch.device("meta"))
        assert sum(p.numel() for p in model.parameters()) == num_model_params(cfg, tp)
        assert model_bytes(cfg, torch.bfloat16) == num_model_params(cfg, tp) * 2
        attn = model.attention_layers[0]
        assert (attn.num_heads, attn.num_kv_heads) == \
            (cfg.num_heads // tp, cfg.num_kv_heads // tp) == \
            (cfg.local_heads(), cfg.local_kv_heads())


def test_local_kv_heads_is_num_kv_heads_at_tp1():
    cfg = ModelConfig.from_dir(resolve_model_dir("Qwen3-8B", dummy_weights=True))
    assert (cfg.num_kv_heads, cfg.local_kv_heads(), cfg.local_kv_heads(4)) == (8, 8, 2)


def test_a_config_tp_cannot_split_is_refused_naming_every_dimension(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 321, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 6,
         "num_key_value_heads": 3}))
    cfg = ModelConfig.from_dir(tmp_path)
    with pytest.raises(ValueError) as e:
        cfg.check_tensor_parallel(4)
    assert str(e.value).startswith(
        "tensor parallel size 4 does not divide the qwen3 config's num_attention_heads 6, "
        "num_key_value_heads 3:")
    with as_rank(0, 4), pytest.raises(ValueError, match="does not divide"):
        build_model(cfg, 64, torch.float32, torch.device("meta"))


def test_qwen2_5_7b_at_tp8_is_refused_naming_its_heads():
    cfg = ModelConfig.from_dir(resolve_model_dir("Qwen2.5-7B", dummy_weights=True))
    with pytest.raises(ValueError) as e:
        cfg.check_tensor_parallel(8)
    assert str(e.value).startswith("tensor parallel size 8 does not divide the qwen2 config's "
                                   "num_attention_heads 28, num_key_value_heads 4:")


def test_a_rank_is_refused_when_its_share_does_not_fit(monkeypatch):
    cfg = ModelConfig.from_dir(resolve_model_dir("Qwen3-8B", dummy_weights=True))
    monkeypatch.setattr(loader, "available_memory", lambda device: 3 * 10**9)
    with as_rank(1, 4), pytest.raises(ValueError) as e:
        check_model_fits(cfg, torch.bfloat16, "cpu")
    assert str(e.value).startswith(
        "the model does not fit: this rank's share of its weights (tensor parallel size 4) "
        f"need {model_bytes(cfg, torch.bfloat16, tp=4) / 1e9:.1f} GB")
    with as_rank(1, 8):
        check_model_fits(cfg, torch.bfloat16, "cpu")
