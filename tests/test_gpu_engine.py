"""GPU: the engine in bf16 against transformers, and decode graphs against eager."""

from __future__ import annotations

import pytest
import torch
from conftest import GPU_SHAPE, make_hf_model, random_prompts
from helpers import engine_prefill_logits

from nanoserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SHAPE = GPU_SHAPE


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu-qwen3")
    hf = make_hf_model("qwen3", path, **SHAPE)
    return hf, path


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bf16_logits_as_close_to_fp32_as_transformers_bf16(gpu_model, backend):
    """Bound: our bf16 error against an fp32 reference is within 1.5x of transformers' own bf16
    error against it (both run the same weights), and the argmax agrees where the fp32 one is
    confident."""
    from transformers import AutoModelForCausalLM

    _, path = gpu_model
    ids = random_prompts(1, [700], vocab=2048)[0]
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():  # fresh loads: .to(bf16) on a loaded model also rounds RoPE buffers
        ref32, hf16 = (AutoModelForCausalLM.from_pretrained(path, dtype=dt).to("cuda")(x)
                       .logits[0].float().cpu() for dt in (torch.float32, torch.bfloat16))
    llm = LLM(str(path), progress=False, page_size=16, attention_backend=backend,
              enforce_eager=True)
    ours = engine_prefill_logits(llm, ids).float()

    def rel(a):
        return ((a - ref32).norm() / ref32.norm()).item()

    assert rel(ours) < 1.5 * rel(hf16) + 1e-3, (rel(ours), rel(hf16))
    top2 = ref32.topk(2, dim=-1).values
    confident = (top2[:, 0] - top2[:, 1]) > 0.1
    assert (ours.argmax(-1) == ref32.argmax(-1))[confident].all()


def test_graph_replay_equals_eager_for_every_captured_batch_size(gpu_model):
    _, path = gpu_model
    graphs = LLM(str(path), progress=False, page_size=16, max_graph_batch_size=16)
    eager = LLM(str(path), progress=False, page_size=16, enforce_eager=True)
    assert graphs.engine.runner.graphs.sizes == [1, 2, 4, 8, 16]
    for n in (1, 2, 3, 4, 7, 8, 13, 16):
        prompts = random_prompts(n, [5, 200, 33, 1000, 64], vocab=2048, seed=n)
        a = [o.token_ids for o in graphs.generate(prompts, GREEDY)]
        b = [o.token_ids for o in eager.generate(prompts, GREEDY)]
        assert a == b, f"batch {n}"


def test_graph_logits_equal_eager_logits(gpu_model):
    """Same batch, same KV: the captured graph and the eager path give the same logits."""
    from nanoserve.engine.scheduler import Batch

    _, path = gpu_model
    llm = LLM(str(path), progress=False, page_size=16, max_graph_batch_size=16)
    runner = llm.engine.runner
    for n in runner.graphs.sizes:
        prompts = random_prompts(n, [90, 17, 300], vocab=2048, seed=100 + n)
        seqs = [llm.engine.add_request(p, GREEDY)[0] for p in prompts]
        while any(s.num_output_tokens == 0 for s in seqs):
            llm.engine.step()
        batch = Batch(False, seqs, [1] * n)
        for s in seqs:  # room for the decode token
            assert llm.engine.kv.grow(s, s.num_tokens)
        graph_logits = runner.forward(runner.inputs.build(batch, n)).clone()
        saved, runner.graphs = runner.graphs, None
        eager_logits = runner.forward(runner.inputs.build(batch))
        runner.graphs = saved
        diff = (graph_logits - eager_logits).abs().max().item()
        assert diff < 2e-2 * eager_logits.abs().max().item(), (n, diff)
        assert (graph_logits.argmax(-1) == eager_logits.argmax(-1)).all()
        for s in seqs:
            llm.engine.abort(s)
    assert llm.engine.kv.num_free == llm.engine.kv.capacity


def test_batched_decode_through_tma_tiles_equals_pointer_loads(gpu_model, monkeypatch):
    """Above SMALL_BATCH, with pages a multiple of the tile, decode attention reads K/V through
    TMA descriptors (triton_decode.TILES["batched"]): the logits equal the pointer-load
    kernel's within the graph bound, with the same argmax; at page 16 no descriptor is made."""
    from nanoserve.attention import triton_decode as td
    from nanoserve.engine.scheduler import Batch

    _, path = gpu_model
    made = []
    real = td.TensorDescriptor
    monkeypatch.setattr(td, "TensorDescriptor", lambda *a: made.append(a) or real(*a))
    logits = {}
    for page, tma in ((64, True), (64, False), (16, True)):
        monkeypatch.setitem(td.TILES, "batched", td.TILES["batched"]._replace(tma=tma))
        with LLM(str(path), progress=False, page_size=page, enforce_eager=True,
                 max_num_seqs=16, gpu_kv_budget_gib=1) as llm:
            seqs = [llm.engine.add_request(p, GREEDY)[0]
                    for p in random_prompts(16, [90, 17, 300], vocab=2048, seed=5)]
            while any(s.num_output_tokens == 0 for s in seqs):
                llm.engine.step()
            for s in seqs:  # room for the decode token
                assert llm.engine.kv.grow(s, s.num_tokens)
            made.clear()
            runner = llm.engine.runner
            logits[page, tma] = runner.forward(
                runner.inputs.build(Batch(False, seqs, [1] * 16))).clone()
        assert len(made) == (2 * SHAPE["num_hidden_layers"] if (page, tma) == (64, True) else 0)
    for other in ((64, False), (16, True)):
        a, b = logits[64, True], logits[other]
        assert (a - b).abs().max().item() < 2e-2 * b.abs().max().item(), other
        assert torch.equal(a.argmax(-1), b.argmax(-1)), other


def test_temperature_zero_rows_equal_greedy_beside_sampled_rows(gpu_model):
    """Rows at temperature 0 (with top-k/top-p/min-p/seed set, batched with sampled rows)
    produce the tokens of an all-greedy batch of the same shape."""
    _, path = gpu_model
    llm = LLM(str(path), progress=False, page_size=16)
    prompts = random_prompts(4, [40, 300, 77, 129], vocab=2048, seed=21)
    ref = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    zero = SamplingParams(temperature=0.0, top_k=20, top_p=0.5, min_p=0.1, seed=3,
                          max_tokens=24, ignore_eos=True)
    hot = SamplingParams(temperature=1.0, top_p=0.95, seed=4, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, [zero, hot, zero, hot])
    assert [outs[0].token_ids, outs[2].token_ids] == [ref[0], ref[2]]
    assert outs[1].token_ids != ref[1] or outs[3].token_ids != ref[3]  # the others did sample


def test_seeded_sampling_is_identical_in_eager_and_graph_modes(gpu_model):
    _, path = gpu_model
    graphs = LLM(str(path), progress=False, page_size=16, max_graph_batch_size=16)
    eager = LLM(str(path), progress=False, page_size=16, enforce_eager=True)
    prompts = random_prompts(5, [33, 250, 64, 9, 500], vocab=2048, seed=22)
    params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=k, seed=100 + i, max_tokens=24,
                             ignore_eos=True) for i, k in enumerate((-1, 50, -1, 5, -1))]
    a = [o.token_ids for o in graphs.generate(prompts, params)]
    b = [o.token_ids for o in eager.generate(prompts, params)]
    assert a == b


def test_one_row_decode_through_the_one_row_kernels_matches_cublas(tmp_path, monkeypatch):
    """Batch-1 decode runs its wide linear layers (>= 4096 outputs) through the Triton skinny
    matmul, down with its SiLU-multiply in the same kernel, and the narrower qkv through the
    plain one-row CUDA GEMV (where it can be built), and so does the prefill's one-row head.
    The prefill's and the first decode step's logits are within 2e-2 of the largest of cuBLAS's
    (the same engine with both off; the first token must agree for the second step to see the
    same input); graphs equal eager token for token."""
    from nanoserve.models import layers, triton_linear
    from nanoserve.quant import cuda_gemv

    # 4096 wide: o, gate_up, down (with its SiLU-multiply) and lm_head run the skinny kernels;
    # qkv (768 outputs) the CUDA GEMV
    make_hf_model("qwen3", tmp_path, **dict(SHAPE, vocab_size=8192, hidden_size=4096,
                                            head_dim=64, intermediate_size=2048))
    calls = []
    for module, name in ((triton_linear, "skinny_linear"), (triton_linear, "skinny_silu_linear"),
                         (cuda_gemv, "half_gemv")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **kw:
                            calls.append(name) or real(*a, **kw))
    prompt = random_prompts(1, [300], vocab=8192, seed=5)

    def decode(**kw):
        llm = LLM(str(tmp_path), progress=False, page_size=16, max_graph_batch_size=4, **kw)
        runner, logits = llm.engine.runner, []
        forward = runner.forward
        runner.forward = lambda inputs: logits.append(forward(inputs).clone()) or logits[-1]
        calls.clear()  # what graph capture ran does not count
        tokens = llm.generate(prompt, GREEDY)[0].token_ids
        return tokens, logits[:2]  # the prefill's, the first decode step's

    tokens, skinny = decode(enforce_eager=True)
    assert calls.count("skinny_linear") >= 3 * len(tokens)  # o, gate_up, lm_head every step
    # qkv of every layer, every eager decode step
    n_layers = SHAPE["num_hidden_layers"]
    assert calls.count("half_gemv") >= (n_layers * (len(tokens) - 1) if cuda_gemv.load() else 0)
    assert calls.count("skinny_silu_linear") >= len(tokens) - 1  # down, every decode step
    assert decode()[0] == tokens  # graphs
    monkeypatch.setattr(layers, "SKINNY_MAX_ROWS", 0)
    monkeypatch.setattr(layers.Linear, "one_row_cuda", lambda self, x: False)
    cublas_tokens, cublas = decode(enforce_eager=True)
    assert not calls
    assert cublas_tokens[0] == tokens[0]
    for a, b in zip(skinny, cublas, strict=True):
        diff = (a - b).abs().max().item()
        assert diff < 2e-2 * b.abs().max().item(), diff
