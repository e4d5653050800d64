"""Quantized checkpoints (nanoserve/quant/): a tiny random Qwen3 written in each published format
by the tests' own quantizer (tests/quant_checkpoints.py), read by nanoserve, gives the logits and
greedy tokens of transformers' model holding the dequantized weights; the weights stay
quantized in memory; a method nanoserve does not run is refused before loading."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import make_hf_model, random_prompts
from helpers import engine_prefill_logits, make_llm
from quant_checkpoints import quantize_checkpoint

from nanoserve import SamplingParams
from nanoserve.models.config import ModelConfig
from nanoserve.models.loader import model_bytes
from nanoserve.quant import QuantConfig, QuantizedLinear, UnsupportedQuantization

FORMATS = {
    "fp8 block 128x128 (partial blocks: k, v have 32 rows)": ("fp8_block", {}),
    "fp8 block 16x32": ("fp8_block", {"block": (16, 32)}),
    "fp8 per channel (compressed-tensors)": ("fp8_channel", {}),
    "fp8 per tensor (compressed-tensors)": ("fp8_tensor", {}),
    "awq group 32": ("awq", {"group": 32}),
    "gptq group 32": ("gptq", {"group": 32}),
    "gptq group 32, act-order": ("gptq", {"group": 32, "act_order": True}),
    "gptq_v2 group 16, act-order": ("gptq", {"group": 16, "act_order": True, "v2": True}),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-to-quantize")
    make_hf_model("qwen3", path, seed=3)
    return path


@pytest.fixture(scope="module", params=list(FORMATS))
def quantized(request, source, tmp_path_factory):
    method, options = FORMATS[request.param]
    path = tmp_path_factory.mktemp("quantized")
    dequantized = quantize_checkpoint(source, path, method, **options)
    twin = transformers.Qwen3ForCausalLM(transformers.AutoConfig.from_pretrained(source)).eval()
    twin.load_state_dict({k: v.float() for k, v in dequantized.items()})
    return request.param, path, twin


def test_logits_and_greedy_tokens_equal_the_dequantized_twins(quantized):
    name, path, twin = quantized
    llm = make_llm(path, page_size=8)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * 3  # qkv, o, gate_up, down of each of the 3 layers
    ids = random_prompts(1, [37], seed=5)[0]
    with torch.no_grad():
        ref = twin(torch.tensor([ids])).logits[0].float()
    err = (engine_prefill_logits(llm, ids) - ref).abs().max().item()
    assert err < 2e-4, f"{name}: max |logit diff| {err}"
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with torch.no_grad():
        want = twin.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert llm.generate(ids, params)[0].token_ids == want, name


@pytest.mark.parametrize("block", [(128, 128), (16, 32)])
def test_transformers_own_reading_of_an_fp8_checkpoint_gives_the_same_logits(source, tmp_path,
                                                                             block):
    """transformers itself (on the CPU it dequantizes fine-grained FP8 checkpoints) reads the
    tests' FP8 checkpoint: its logits are nanoserve's, so the tests' format is the published
    one."""
    quantize_checkpoint(source, tmp_path, "fp8_block", block=block)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = random_prompts(1, [29], seed=6)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = engine_prefill_logits(make_llm(tmp_path, page_size=8), ids)
    assert (ours - ref).abs().max().item() < 2e-4


def test_the_decoders_norms_are_handed_the_projection_they_feed(source, tmp_path, monkeypatch):
    """Each decoder layer hands its input norm qkv_proj and its post-attention norm gate_up_proj
    (RMSNorm's `into`; on a GPU, QuantizedLinear.norm_input quantizes the norm in its own pass),
    and what norm_input hands back reaches that projection. With norm_input standing in for
    the GPU's pass on the CPU (the eager norm, tagged as QuantizedRows) and the projection
    taking those rows back through its dequantized weight, an FP8 model's prefill logits equal
    the plain run's bit for bit, and every layer asked exactly its two projections: with x +
    delta from the second layer on, without it in the first layer's input norm."""
    import torch.nn.functional as F

    from nanoserve.models.layers import add_rms_norm, rms_norm
    from nanoserve.quant.linear import QuantizedRows
    quantize_checkpoint(source, tmp_path, "fp8_block")
    llm = make_llm(tmp_path, page_size=8)
    ids = random_prompts(1, [29], seed=7)[0]
    plain = engine_prefill_logits(llm, ids)
    asked = []

    def norm_input(self, x, delta, weight, eps):
        asked.append((self, delta is not None))
        total, h = (None, rms_norm.eager(x, weight, eps)) if delta is None else \
            add_rms_norm.eager(x, delta, weight, eps)
        return total, QuantizedRows(h, torch.empty(0), x.shape[0], x.dtype)

    monkeypatch.setattr(QuantizedLinear, "norm_input", norm_input)
    monkeypatch.setattr(QuantizedLinear, "_quantized_rows_forward", lambda self, rows: F.linear(
        rows.values, self.dequantized(rows.dtype), self.bias))
    handed = engine_prefill_logits(llm, ids)
    assert torch.equal(handed, plain)
    layers = llm.engine.runner.model.model.layers
    assert asked == [pair for i, layer in enumerate(layers) for pair in (
        (layer.self_attn.qkv_proj, i > 0), (layer.mlp.gate_up_proj, True))]


def test_the_weights_stay_quantized_in_memory(quantized):
    """The linear layers hold their checkpoint's tensors (fp8 or packed int32, a quarter or a
    half of float32's bytes with the scales; GPTQ in groups of 32 repacked as AWQ's, act-order
    too, GPTQ in groups of 16 as it is), and the model's memory counts them so."""
    name, path, _ = quantized
    model = make_llm(path, page_size=8).engine.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear)
    dtypes = {p.dtype for p in qkv.parameters()}
    assert torch.float8_e4m3fn in dtypes or torch.int32 in dtypes
    held = sum(p.numel() * p.element_size() for p in qkv.parameters())
    dense = qkv.out_features * qkv.in_features * 4
    assert held < dense * (0.3 if "fp8" in name else 0.2), held / dense
    cfg = ModelConfig.from_dir(path)
    want = sum(p.numel() * p.element_size() for p in model.parameters())
    # GPTQ runs as AWQ (formats.gptq_as_awq): its g_idx, counted by the plan, is gone
    repacked = [m for m in model.modules() if isinstance(m, QuantizedLinear) and
                cfg.quantization.method == "gptq" and m.quant.method == "awq"]
    assert bool(repacked) == name.startswith("gptq group 32"), name
    assert all((m.input_order is not None) == ("act-order" in name) for m in repacked), name
    want += sum(len(m.shard_sizes) * m.in_features * 4 for m in repacked)
    assert model_bytes(cfg, torch.float32, 0, tp=1) == want


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("group", [32, 128])
def test_gptq_repacks_as_awq_with_equal_weights(v2, group, act_order, monkeypatch):
    """formats.gptq_as_awq: GPTQ tensors (v1 zero points stored less one, v2 as they are) as
    AWQ's dequantize to the same values exactly, repacked in chunks too (of a few rows in
    order, of a few columns by act-order, whose AWQ input i is GPTQ's input order[i]); a v1 zero
    point stored as 15 (read as 16) and a group size AWQ's GPU kernels are not tested at (16)
    are left as GPTQ."""
    from nanoserve.quant import formats
    k, n = 512, 96
    gen = torch.Generator().manual_seed(group + v2)
    gptq = QuantConfig("gptq", group_size=group, zeros_less_one=not v2)
    t = dict(qweight=torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32,
                                   generator=gen),
             qzeros=torch.randint(0, 15 if not v2 else 16, (k // group, n), generator=gen),
             scales=torch.rand(k // group, n, generator=gen).half(),
             g_idx=(torch.arange(k) // group).int())
    order = None
    if act_order:  # the groups over a random order of the inputs; the inputs sorted by group
        t["g_idx"] = t["g_idx"][torch.randperm(k, generator=gen)]
        order = torch.argsort(t["g_idx"], stable=True)
        assert torch.equal(t["g_idx"][order], (torch.arange(k) // group).int())
    t["qzeros"] = formats._pack(t["qzeros"], 1)
    want = formats.dequantize(gptq, t, n, k, torch.float64)
    if act_order:
        want = want[:, order]
    awq = QuantConfig("awq", group_size=group)
    # one chunk; 3 words of rows each (in order), 40 columns each, the last 16 (act-order)
    for chunk in (formats.GPTQ_REPACK_BYTES, 32 * (k // 8) * 40 if act_order else 32 * n * 3):
        monkeypatch.setattr(formats, "GPTQ_REPACK_BYTES", chunk)
        qweight, qzeros = formats.gptq_as_awq(gptq, t["qweight"], t["qzeros"], order)
        assert qweight.shape == (k, n // 8) and qzeros.shape == (k // group, n // 8)
        got = formats.dequantize(awq, dict(qweight=qweight, qzeros=qzeros, scales=t["scales"]),
                                 n, k, torch.float64)
        assert torch.equal(got, want), chunk
    ints = torch.randint(0, 16, (16, 24), generator=gen)
    assert torch.equal(formats._unpack(formats._pack(ints, 1, formats.AWQ_ORDER), 1,
                                       formats.AWQ_ORDER), ints)
    if not v2:
        fifteen = formats._unpack(t["qzeros"], 1)
        fifteen[0, 5] = 15
        assert formats.gptq_as_awq(gptq, t["qweight"], formats._pack(fifteen, 1)) is None
    sixteen = QuantConfig("gptq", group_size=16, zeros_less_one=not v2)
    assert formats.gptq_as_awq(sixteen, t["qweight"], t["qzeros"]) is None


def test_gptq_layers_run_as_awq_where_awqs_layout_holds_them():
    """QuantizedLinear.finish_loading makes GPTQ over whole groups AWQ, g_idx gone: in order,
    and by act-order (its inputs sorted by group, input_order keeping the order); the same
    weights in the checkpoint's input order, and AWQ's rows are the inputs in input_order, as
    the kernels read x (y equal within float64 rounding). It leaves as GPTQ, with the same
    weights: inputs that are not whole groups (48 inputs, groups of 32), one shard's g_idx
    unlike another's, groups of unequal sizes."""
    from nanoserve.quant.formats import dequantize
    gen = torch.Generator().manual_seed(0)
    cases = {"whole groups": (64, None), "act-order": (64, "permuted"), "48 inputs": (48, None),
             "shards differ": (64, "one shard permuted"), "uneven groups": (64, "uneven")}
    for label, (k, g_idx) in cases.items():
        layer = QuantizedLinear(k, [16, 8], False, QuantConfig("gptq", group_size=32),
                                torch.float16)
        layer.fill_dummy(gen)
        if g_idx is not None:
            layer.g_idx[-1] = layer.g_idx[-1][torch.randperm(k, generator=gen)]
            if g_idx == "permuted":
                layer.g_idx[0] = layer.g_idx[-1]
            if g_idx == "uneven":  # 33 inputs in group 0, 31 in group 1
                layer.g_idx[:, layer.g_idx[0].tolist().index(1)] = 0
        want = layer.dequantized(torch.float64)
        layer.finish_loading(label)
        as_awq = label in ("whole groups", "act-order")
        assert layer.quant.method == ("awq" if as_awq else "gptq"), label
        assert hasattr(layer, "g_idx") != as_awq, label
        assert (layer.input_order is not None) == (label == "act-order"), label
        assert torch.equal(layer.dequantized(torch.float64), want), label
        if as_awq:  # AWQ's own rows, as the kernels read them: x in input_order
            rows = torch.cat([dequantize(layer.quant, layer.shard_tensors(i), n, k,
                                         torch.float64)
                              for i, n in enumerate(layer.shard_sizes)])
            x = torch.randn(3, k, dtype=torch.float64, generator=gen)
            read = x if layer.input_order is None else x.index_select(1, layer.input_order)
            assert torch.allclose(read @ rows.T, x @ want.T, rtol=1e-12, atol=1e-12), label


def test_dummy_weights_of_a_quantized_shape_run_quantized(tmp_path, source):
    """--dummy-weights with a quantized config: random quantized tensors of about the dense
    dummy weights' spread, and a model that runs."""
    for method, options in (("fp8_block", {}), ("awq", {"group": 32}), ("gptq", {"group": 32}),
                            ("gptq", {"group": 32, "act_order": True})):
        path = tmp_path / f"{method}{len(options)}"
        quantize_checkpoint(source, path, method, **options)
        for f in path.glob("*.safetensors"):
            f.unlink()
        llm = make_llm(path, dummy_weights=True, page_size=8)
        qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
        # dummy GPTQ runs as AWQ; act-order's g_idx permuted, as such a checkpoint's, its
        # inputs then read in their groups' order
        act_order = options.get("act_order", False)
        assert qkv.quant.method == ("awq" if method == "gptq" else method)
        assert (qkv.input_order is not None) == act_order
        w = qkv.dequantized(torch.float32)
        assert 0.01 < w.std().item() < 0.04, (method, w.std().item())
        out = llm.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].token_ids) == 4


@pytest.mark.parametrize("raw, message", [
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "awq with 8 bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     "awq version 'gemv'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group_size -1"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq with 3 bits"),
    ({"quant_method": "fp8", "fmt": "e4m3"}, "without weight_block_size"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group"}}}}, "type 'int', 4 bits"),
])
def test_unsupported_methods_are_refused_naming_them_and_the_supported_ones(raw, message):
    with pytest.raises(UnsupportedQuantization, match=message) as e:
        QuantConfig.from_dict(raw)
    assert "nanoserve runs these quantized checkpoints: fp8 (block-wise)" in str(e.value)


def test_a_refused_method_stops_the_engine_before_any_weight_is_read(tmp_path, source):
    quantize_checkpoint(source, tmp_path, "awq", group=32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "hqq", "nbits": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"not read")  # reading it would fail otherwise
    with pytest.raises(UnsupportedQuantization, match="'hqq' is not supported"):
        make_llm(tmp_path)


@pytest.mark.parametrize("method, options, reason", [
    ("fp8_block", {}, "2 ranks would split q_proj's 64 outputs, k_proj's 32 outputs, gate_proj's "
     "128 outputs, o_proj's 64 inputs, down_proj's 128 inputs inside a fp8_block block (128 "
     "outputs x 128 inputs)"),
    ("awq", {"group": 64}, "2 ranks would split o_proj's 64 inputs inside a awq block (8 "
     "outputs x 64 inputs)"),
    ("gptq", {"group": 16, "act_order": True},
     "GPTQ with act-order (desc_act) mixes every group into every rank's inputs")])
def test_quantized_checkpoints_tp_cannot_split_are_refused_naming_why(source, tmp_path, method,
                                                                       options, reason):
    """Tensor parallelism splits a quantized layer's own tensors: a rank's share must hold
    whole blocks and groups, and act-order's groups cross ranks (tests/test_tp_model.py runs
    the ones that split)."""
    quantize_checkpoint(source, tmp_path, method, **options)
    cfg = ModelConfig.from_dir(tmp_path)
    with pytest.raises(ValueError) as e:
        cfg.check_tensor_parallel(2)
    assert str(e.value) == (f"a quantized checkpoint ({cfg.quantization.method}) cannot run at "
                            f"tensor parallel size 2: {reason}")


def test_skipped_modules_stay_dense(source, tmp_path):
    """modules_to_not_convert names layers the checkpoint keeps in full precision: those are
    dense layers here, the rest quantized; a fused layer's shards must agree."""
    dequantized = quantize_checkpoint(source, tmp_path, "awq", group=32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["model.layers.1.mlp.down_proj"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file, save_file
    tensors = load_file(tmp_path / "model.safetensors")
    for t in ("qweight", "qzeros", "scales"):
        del tensors[f"model.layers.1.mlp.down_proj.{t}"]
    tensors["model.layers.1.mlp.down_proj.weight"] = \
        dequantized["model.layers.1.mlp.down_proj.weight"].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    model = make_llm(tmp_path).engine.runner.model
    assert not isinstance(model.model.layers[1].mlp.down_proj, QuantizedLinear)
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantizedLinear)
    cfg["quantization_config"]["modules_to_not_convert"] = ["model.layers.0.self_attn.k_proj"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantizes some of .*q_proj.*k_proj.* and not"):
        make_llm(tmp_path)


def test_zero_biases_of_bias_free_layers_are_passed_over_and_others_refused(source, tmp_path):
    """GPTQ checkpoints often hold all-zero biases for layers that have none: they load; a
    bias that is not zero has no place in such a model and is an error."""
    from safetensors.torch import load_file, save_file
    quantize_checkpoint(source, tmp_path, "gptq", group=32)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, tmp_path / "model.safetensors")
    assert make_llm(tmp_path).generate([1, 2], SamplingParams(max_tokens=2))[0].token_ids
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.full((64,), 0.5)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="o_proj.bias has no place"):
        make_llm(tmp_path)


@pytest.mark.parametrize("name", ["Qwen3-8B-FP8", "Qwen3-8B-AWQ"])
def test_the_shipped_quantized_shapes_count_their_quantized_bytes(name):
    """Qwen3-8B's shapes in FP8 block-wise and AWQ (for --dummy-weights runs): the model's bytes
    are the quantized layers' tensors (weights, scales, zero points) plus the dense rest in
    bf16, counted here from the formats' layouts."""
    from nanoserve.models.loader import SHIPPED_CONFIGS
    cfg = ModelConfig.from_dir(SHIPPED_CONFIGS / name)
    h, q, kv, inter, layers, vocab = 4096, 4096, 1024, 12288, 36, 151936
    shards = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]  # (n, k)

    def cdiv(a, b):
        return -(-a // b)

    if name.endswith("FP8"):
        per_layer = sum(n * k + cdiv(n, 128) * cdiv(k, 128) * 4 for n, k in shards)
    else:
        per_layer = sum(n * k // 2 + (k // 128) * (n // 8) * 4 + (k // 128) * n * 2
                        for n, k in shards)
    dense = 2 * (2 * vocab * h + layers * (2 * h + 2 * 128) + h)
    assert model_bytes(cfg, torch.bfloat16, 0, tp=1) == layers * per_layer + dense


def test_a_quantized_models_bytes_are_counted_at_the_tp_size_asked_not_the_processs():
    """model_bytes(tp=...) of a quantized model (counted from a meta build) is one rank's bytes
    at that TP size, whatever this process's TP size is: at TP=2 the quantized layers and the
    vocabulary-parallel embedding and lm_head are halved, the norms whole; and TP=1's count
    taken inside a TP=2 process (the bench's rank 0, whose floors divide by TP afterwards)
    equals it taken outside."""
    from nanoserve.distributed.parallel_state import sized_as, tp_size
    from nanoserve.models.loader import SHIPPED_CONFIGS
    cfg = ModelConfig.from_dir(SHIPPED_CONFIGS / "Qwen3-8B-FP8")
    h, vocab, layers = 4096, 151936, 36
    whole = model_bytes(cfg, torch.bfloat16, 0, tp=1)
    norms = 2 * (layers * (2 * h + 2 * 128) + h)
    embeddings = 2 * 2 * vocab * h
    assert model_bytes(cfg, torch.bfloat16, 0, tp=2) == \
        (whole - norms - embeddings) // 2 + embeddings // 2 + norms
    with sized_as(2):
        assert tp_size() == 2
        assert model_bytes(cfg, torch.bfloat16, 0, tp=1) == whole
    assert tp_size() == 1


@pytest.mark.parametrize("method, options", [("fp8_block", {}), ("awq", {"group": 128}),
                                             ("gptq", {"group": 64, "act_order": True})])
def test_the_embedded_model_quantized_still_finds_the_needle(tmp_path, method, options):
    """The embedded model (trained to retrieve) quantized to FP8 block-wise, AWQ and GPTQ
    act-order answers the 2K-token needle at every depth, as in bf16."""
    from test_needle import ALL_DEPTHS, CPU_LEN, cpu_llm, format_table, run_needle

    from nanoserve.models.loader import EMBEDDED_MODEL
    quantize_checkpoint(EMBEDDED_MODEL, tmp_path, method, **options)
    llm = cpu_llm(model=str(tmp_path))
    assert isinstance(llm.engine.runner.model.model.layers[0].mlp.down_proj, QuantizedLinear)
    results = run_needle(llm, CPU_LEN, ALL_DEPTHS, seed=1)
    assert all(r.passed for r in results), format_table(results)


@pytest.mark.parametrize("method", ["fp8_channel", "fp8_tensor"])
def test_compressed_tensors_scales_in_the_models_dtype_and_shape_load(tmp_path, method):
    """compressed-tensors writes its scales in the model's dtype, a per-tensor one with shape
    [1], and a static input_scale beside it: from a bf16 model, the logits are the dequantized
    twin's."""
    src = tmp_path / "bf16"
    make_hf_model("qwen3", src, seed=4).to(torch.bfloat16).save_pretrained(src)
    dequantized = quantize_checkpoint(src, tmp_path / method, method)
    from safetensors.torch import load_file
    scale = load_file(tmp_path / method / "model.safetensors")[
        "model.layers.0.self_attn.q_proj.weight_scale"]
    assert scale.dtype == torch.bfloat16 and scale.shape == ((1,) if method == "fp8_tensor"
                                                              else (64, 1))
    twin = transformers.Qwen3ForCausalLM(transformers.AutoConfig.from_pretrained(src)).eval()
    twin.load_state_dict({k: v.float() for k, v in dequantized.items()})
    ids = random_prompts(1, [21], seed=7)[0]
    with torch.no_grad():
        ref = twin.float()(torch.tensor([ids])).logits[0].float()
    ours = engine_prefill_logits(make_llm(tmp_path / method, page_size=8), ids)
    assert (ours - ref).abs().max().item() < 2e-4


def test_compressed_tensors_regex_ignore_keeps_its_layers_dense(source, tmp_path):
    """`re:` entries of compressed-tensors' ignore list match as regular expressions."""
    from safetensors.torch import load_file, save_file
    dequantized = quantize_checkpoint(source, tmp_path, "fp8_channel")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head", r"re:.*layers\.1\.mlp\.down_proj$"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(tmp_path / "model.safetensors")
    for t in ("weight", "weight_scale"):
        del tensors[f"model.layers.1.mlp.down_proj.{t}"]
    tensors["model.layers.1.mlp.down_proj.weight"] = \
        dequantized["model.layers.1.mlp.down_proj.weight"].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    layers = make_llm(tmp_path).engine.runner.model.model.layers
    assert not isinstance(layers[1].mlp.down_proj, QuantizedLinear)
    assert isinstance(layers[0].mlp.down_proj, QuantizedLinear)
    assert isinstance(layers[1].mlp.gate_up_proj, QuantizedLinear)


@pytest.mark.parametrize("block", [(16, 32), (32, 32)])
def test_an_fp8_moe_checkpoint_gives_its_dequantized_twins_logits_and_tokens(tmp_path, block):
    """Qwen3-MoE in FP8 block-wise as Qwen3-30B-A3B-FP8 ships it (each expert's projections
    with their own weight_scale_inv, the router dense): the experts stay e4m3 in memory, beside
    their scales, and the logits (within 2e-4) and 16 greedy tokens are those of transformers'
    Qwen3MoeForCausalLM holding the dequantized weights."""
    from safetensors.torch import save_file

    from nanoserve.models.moe import Experts
    src, dst, twin_dir = tmp_path / "src", tmp_path / "fp8", tmp_path / "twin"
    make_hf_model("qwen3_moe", src, seed=4)
    dequantized = quantize_checkpoint(src, dst, "fp8_block", block=block)
    twin_dir.mkdir()
    (twin_dir / "config.json").write_text((src / "config.json").read_text())
    save_file({k: v.float().contiguous() for k, v in dequantized.items()},
              twin_dir / "model.safetensors")
    twin = transformers.AutoModelForCausalLM.from_pretrained(twin_dir,
                                                              dtype=torch.float32).eval()
    llm = make_llm(dst, page_size=8)
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, Experts)]
    assert experts and all(e.gate_up_proj.dtype == torch.float8_e4m3fn and
                           e.down_proj.dtype == torch.float8_e4m3fn for e in experts)
    assert experts[0].gate_up_proj_scale_inv.shape == (8, 2 * 32 // block[0], 64 // block[1])
    assert experts[0].gate_up_proj_scale_inv.dtype == torch.float32  # as the checkpoint's
    ids = random_prompts(1, [33], seed=7)[0]
    with torch.no_grad():
        ref = twin(torch.tensor([ids])).logits[0].float()
        want = twin.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert (engine_prefill_logits(llm, ids) - ref).abs().max().item() < 2e-4
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert llm.generate(ids, params)[0].token_ids == want


def test_quantized_moe_checkpoints_other_than_fp8_block_wise_are_refused(tmp_path):
    make_hf_model("qwen3_moe", tmp_path / "src", seed=4)
    quantize_checkpoint(tmp_path / "src", tmp_path / "awq", "awq", group=32)
    with pytest.raises(UnsupportedQuantization, match="other than FP8 block-wise \\(awq\\)"):
        ModelConfig.from_dir(tmp_path / "awq")


def test_the_shipped_fp8_moe_shape_holds_its_experts_in_one_byte_a_weight():
    """Qwen3-30B-A3B-FP8 for --dummy-weights: every linear weight, experts included, one byte
    plus a float32 scale per 128 x 128 block; the router, norms and embeddings in bf16."""
    from nanoserve.models.loader import SHIPPED_CONFIGS
    from nanoserve.models.sizes import num_model_params
    fp8 = ModelConfig.from_dir(SHIPPED_CONFIGS / "Qwen3-30B-A3B-FP8")
    dense = ModelConfig.from_dir(SHIPPED_CONFIGS / "Qwen3-30B-A3B")
    h, layers, experts, inter, vocab = 2048, 48, 128, 768, 151936
    q, kv = 32 * 128, 4 * 128
    shards = [(q, h), (kv, h), (kv, h), (h, q)] + [(inter, h), (inter, h), (h, inter)] * experts
    per_layer = sum(n * k + -(-n // 128) * -(-k // 128) * 4 for n, k in shards)
    bf16 = 2 * (2 * vocab * h + layers * (2 * h + 2 * 128 + experts * h) + h)
    assert model_bytes(fp8, torch.bfloat16, 0, tp=1) == layers * per_layer + bf16
    assert num_model_params(fp8) == num_model_params(dense)
    # the bench's decode floor reads the 8 routed experts of 128 in one byte a weight
    from bench_offload import weight_bytes
    assert 0.5 < weight_bytes(fp8, 2, 1) / weight_bytes(dense, 2, 1) < 0.56


def test_a_non_fused_moe_backend_over_fp8_experts_warns_that_it_dequantizes_them(tmp_path,
                                                                                 caplog):
    """Only the fused path reads FP8 experts as they are; choosing another backend says what it
    costs (every expert dequantized every step), and the model still runs."""
    make_hf_model("qwen3_moe", tmp_path / "src", seed=4)
    quantize_checkpoint(tmp_path / "src", tmp_path / "fp8", "fp8_block", block=(16, 32))
    model = make_llm(tmp_path / "fp8").engine.runner.model
    with caplog.at_level("WARNING", logger="nanoserve"):
        model.set_moe_backend("fused")
        assert not caplog.records
        model.set_moe_backend("loop")
    assert [r.getMessage() for r in caplog.records] == [
        "MoE backend 'loop': FP8 experts are dequantized every step (all of them, in the "
        "model's dtype); the fused backend reads them as they are"]
