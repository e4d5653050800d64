"""The benchmark's transformers comparison runs transformers on exactly nanoserve's weights."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_hf_model
from helpers import engine_prefill_logits

from nanoserve import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_offload import hf_model_with_our_weights  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "qwen3_moe"])
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


# --- sampling: greedy and sampled throughput from one run (issue 11 item 4) --------------------
import bench_offload  # noqa: E402
from bench_offload import (  # noqa: E402
    add_sampling_ratios,
    parse_args,
    print_table,
    run_mode,
    run_stall,
    sampling_runs,
)
from nanoserve.config import config_default  # noqa: E402
from nanoserve.models.config import ModelConfig  # noqa: E402
from nanoserve.models.loader import EMBEDDED_MODEL  # noqa: E402

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}
CEIL = {"h2d_GBps": 1.0, "hbm_GBps": 1.0, "bf16_TFLOPs": 1.0}


def test_sampling_runs_from_the_options():
    assert sampling_runs(parse_args([])) == [("greedy", GREEDY)]
    assert sampling_runs(parse_args(["--sampled"])) == [
        ("greedy", GREEDY), ("sampled", {"temperature": 0.8, "top_p": 0.95, "top_k": -1})]
    assert sampling_runs(parse_args(["--sampled", "--temperature", "1.2", "--top-k", "50"])) == [
        ("greedy", GREEDY), ("sampled", {"temperature": 1.2, "top_p": 0.95, "top_k": 50})]
    assert sampling_runs(parse_args(["--temperature", "0.7", "--top-p", "0.9"])) == [
        ("sampled", {"temperature": 0.7, "top_p": 0.9, "top_k": -1})]


@pytest.mark.parametrize("argv, message", [
    (["--sampled", "--temperature", "0"], "--sampled needs sampling parameters that sample "
                                          "(--temperature > 0, --top-k other than 1)"),
    (["--temperature", "3"], "temperature must be a number in [0.0, 2.0], got 3.0"),
    (["--input-len", "0"], "argument --input-len: expected positive integers separated by "
                           "commas, got '0'"),
    (["--output-len", "1"], "--output-len must be >= 2 (TPOT needs a decode step)"),
    (["--synthetic-prefill", "--shared-prefix"], "--synthetic-prefill writes this process's "
     "KV: not with --shared-prefix, --compare-hf or tensor parallelism"),
])
def test_bench_refuses_bad_options(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"bench_offload.py: error: {message}"


def test_sampled_mode_runs_greedy_and_sampled_and_reports_ratios(monkeypatch, capsys):
    made = []

    class SpyParams(bench_offload.SamplingParams):
        def __init__(self, **kw):
            if "max_tokens" in kw:
                made.append(kw)
            super().__init__(**kw)

    monkeypatch.setattr(bench_offload, "SamplingParams", SpyParams)
    args = parse_args(["--model", "tiny-qwen3", "--input-len", "48", "--output-len", "6",
                       "--sampled"])
    cfg = ModelConfig.from_dir(EMBEDDED_MODEL)
    rows = [run_mode(args, "resident-eager", 48, 2, cfg, CEIL, run)
            for run in sampling_runs(args)]
    add_sampling_ratios(rows)
    assert made == [{**GREEDY, "max_tokens": 6, "ignore_eos": True},
                    {"temperature": 0.8, "top_p": 0.95, "top_k": -1, "max_tokens": 6,
                     "ignore_eos": True}]
    greedy, sampled = rows
    assert (greedy["sampling"], greedy["temperature"]) == ("greedy", 0.0)
    assert (sampled["sampling"], sampled["temperature"], sampled["top_p"]) == ("sampled", 0.8,
                                                                               0.95)
    assert "tpot_vs_greedy" not in greedy
    assert sampled["tpot_vs_greedy"] == sampled["tpot_ms_median"] / greedy["tpot_ms_median"]
    assert sampled["output_tok_s_vs_greedy"] == sampled["output_tok_s"] / greedy["output_tok_s"]
    assert greedy["output_tok_s"] > 0 and sampled["output_tok_s"] > 0
    print_table(rows, CEIL)
    out = capsys.readouterr().out
    assert (f"  resident-eager  t0.8 p0.95  ctx     48 bs  2: TPOT "
            f"{sampled['tpot_vs_greedy']:.3f}x, output tok/s "
            f"{sampled['output_tok_s_vs_greedy']:.3f}x") in out


def test_json_schema_runs_each_configuration_again_with_half_its_requests_constrained(
        monkeypatch, capsys):
    """--json-schema: a second run of the configuration where every other request's output is
    held to BENCH_SCHEMA; its row reports output tok/s and TPOT over the plain row's."""
    from nanoserve.engine.engine import LLMEngine

    args = parse_args(["--model", "tiny-qwen3", "--input-len", "48", "--output-len", "6",
                       "--json-schema"])
    assert sampling_runs(args) == [("greedy", GREEDY), ("greedy json", GREEDY)]
    seen, real = [], LLMEngine.add_request

    def spy(self, prompt, params):
        seen.append(params.structured_outputs)
        return real(self, prompt, params)

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    cfg = ModelConfig.from_dir(EMBEDDED_MODEL)
    rows = [run_mode(args, "resident-eager", 48, 4, cfg, CEIL, run)
            for run in sampling_runs(args)]
    schema = bench_offload.StructuredOutputs(json=bench_offload.BENCH_SCHEMA)
    assert seen == [None] * 4 + [None, schema, None, schema]
    bench_offload.add_json_ratios(rows)
    plain, half = rows
    assert "output_tok_s_vs_plain" not in plain
    assert half["output_tok_s_vs_plain"] == half["output_tok_s"] / plain["output_tok_s"]
    print_table(rows, CEIL)
    out = capsys.readouterr().out
    assert (f"  resident-eager  greedy json      ctx     48 bs  4: output tok/s "
            f"{half['output_tok_s_vs_plain']:.3f}x") in out


@pytest.mark.parametrize("tp", [1, 2])
def test_a_tp_engine_prefills_once_untimed_before_the_timed_request(monkeypatch, tp):
    """Under TP the workers are fresh processes (their first prefill builds attention plans):
    one untimed request of the same length runs first; at TP=1 main's warm-up did that."""
    warm_ups = []
    original = LLM.generate

    def spy(self, prompts, params=None, **kw):
        warm_ups.append((len(prompts[0]), params.max_tokens))
        return original(self, prompts, params, **kw)

    monkeypatch.setattr(LLM, "generate", spy)
    args = parse_args(["--model", "tiny-qwen3", "--input-len", "48", "--output-len", "3"])
    row = run_mode(args, "resident-eager", 48, 1, ModelConfig.from_dir(EMBEDDED_MODEL),
                   {**CEIL, "h2d_GBps_tp": {"2": 1.0}}, tp=tp)
    assert warm_ups == ([(48, 2)] if tp > 1 else [])
    assert (row["tp"], row["input_len"]) == (tp, 48) and row["ttft_s"] > 0


def test_the_prefill_chunk_asked_for_reaches_the_engine_and_the_row(monkeypatch):
    """--max-num-batched-tokens: the engine prefills a 48-token prompt in chunks of 16 (three
    prefill steps before its first token) and the row records the chunk; the default is the
    engine's."""
    assert parse_args([]).max_num_batched_tokens == config_default("max_num_batched_tokens")
    chunks = []
    real = bench_offload.LLM

    def spy(*args, **kw):
        llm = real(*args, **kw)
        schedule = llm.engine.scheduler.schedule

        def recorded():
            batch, dropped = schedule()
            if batch is not None and batch.is_prefill:
                chunks.append(sum(batch.num_new_tokens))
            return batch, dropped

        llm.engine.scheduler.schedule = recorded
        return llm

    monkeypatch.setattr(bench_offload, "LLM", spy)
    args = parse_args(["--model", "tiny-qwen3", "--input-len", "48", "--output-len", "3",
                       "--max-num-batched-tokens", "16"])
    row = run_mode(args, "resident-eager", 48, 1, ModelConfig.from_dir(EMBEDDED_MODEL), CEIL)
    assert row["max_num_batched_tokens"] == 16
    assert chunks[-3:] == [16, 16, 16]


@pytest.mark.parametrize("buffers", [2, 3])
def test_offload_modes_run_with_the_ring_slots_asked_for(buffers):
    args = parse_args(["--model", "tiny-qwen3", "--input-len", "48", "--output-len", "3",
                       "--num-kv-buffers", str(buffers)])
    cfg = ModelConfig.from_dir(EMBEDDED_MODEL)
    row = run_mode(args, "offload-eager", 48, 1, cfg, CEIL)
    assert row["streamed_layers"] == cfg.num_layers >= 3
    assert row["num_kv_buffers"] == buffers
    assert run_mode(args, "resident-eager", 48, 1, cfg, CEIL)["num_kv_buffers"] == 0


def test_synthetic_prefill_fills_each_prompt_and_reports_no_ttft(monkeypatch):
    """--synthetic-prefill: each prompt's full pages get random KV (kv/synthetic.py) before
    the first step, so the prefill computes the rest only; decode runs and is timed; the row
    carries no TTFT."""
    filled = []
    real = bench_offload.fill_random

    def spy(kv, seq, seed=0):
        filled.append((seed, real(kv, seq, seed)))
        return filled[-1][1]

    monkeypatch.setattr(bench_offload, "fill_random", spy)
    args = parse_args(["--model", "tiny-qwen3", "--input-len", "600", "--output-len", "4",
                       "--synthetic-prefill"])
    cfg = ModelConfig.from_dir(EMBEDDED_MODEL)
    row = run_mode(args, "offload-eager", 600, 2, cfg, CEIL)
    page = config_default("page_size")
    assert filled == [(0, 599 // page * page), (1, 599 // page * page)]
    assert row["synthetic_prefill"] and math.isnan(row["ttft_s"])
    assert row["tpot_ms_median"] > 0 and row["streamed_layers"] == cfg.num_layers


def test_stall_mode_times_the_streams_gaps_against_a_chunk_step():
    args = parse_args(["--model", "tiny-qwen3", "--input-len", "300", "--output-len", "4",
                       "--stall"])
    row = run_stall(args, "resident-graph", 300, ModelConfig.from_dir(EMBEDDED_MODEL))
    assert (row["mode"], row["input_len"], row["chunk"]) == ("stall-resident-graph", 300, 300)
    # one step prefills the whole prompt and carries the stream's token: the gap is that step
    assert 0 < row["chunk_step_s"] <= row["max_gap_s"] <= row["ttft_s"]
    assert row["gap_over_chunk_step"] < 1.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_without_cuda_is_one_clear_line():
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "bench_offload.py", "--input-len", "64"], cwd=repo,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (f"bench_offload.py: needs a CUDA GPU, and torch {torch.__version__} "
                        f"sees none\n")


# --- floors of a mixture-of-experts model (issue 18) -------------------------------------------
def test_moe_floors_count_the_weights_a_step_reads():
    from bench_offload import prefill_flops, weight_bytes
    from nanoserve.models.loader import resolve_model_dir
    from nanoserve.models.sizes import expert_params, num_active_params, num_model_params

    cfg = ModelConfig.from_dir(resolve_model_dir("Qwen3-30B-A3B", dummy_weights=True))
    emb = cfg.vocab_size * cfg.hidden_size
    # batch 1: the active parameters (k experts a layer, the whole router), less the embedding
    assert weight_bytes(cfg, 2, 1) == 2 * (num_active_params(cfg) - emb)
    # batch 32: 111.8 of 128 experts a layer (expected under uniform routing)
    idle = 128 * (120 / 128) ** 32
    assert weight_bytes(cfg, 2, 32) == pytest.approx(
        2 * (num_model_params(cfg) - emb - 48 * idle * expert_params(cfg)))
    assert prefill_flops(cfg, 1, 1) == 2 * (num_active_params(cfg) - 2 * emb) + \
        2 * 48 * 32 * 128
    dense = ModelConfig.from_dir(resolve_model_dir("Qwen3-8B", dummy_weights=True))
    assert weight_bytes(dense, 2, 1) == weight_bytes(dense, 2, 64)


def test_an_fp8_models_prefill_floor_runs_its_linear_layers_at_the_fp8_rate():
    """FP8 weights: the linear layers' FLOPs over the FP8 matmul rate, attention's over bf16's;
    bf16 weights, or no FP8 rate measured: everything over bf16's."""
    from bench_offload import prefill_floor_s, prefill_flops
    from nanoserve.models.loader import resolve_model_dir
    fp8 = ModelConfig.from_dir(resolve_model_dir("Qwen3-8B-FP8", dummy_weights=True))
    bf16 = ModelConfig.from_dir(resolve_model_dir("Qwen3-8B", dummy_weights=True))
    ceil = {"bf16_TFLOPs": 1.0, "fp8_TFLOPs": 2.0}
    total = prefill_flops(fp8, 1000, 2)
    attn = 2 * 2 * 36 * 32 * 128 * 1000 * 1000
    assert prefill_floor_s(fp8, 1000, 2, ceil) == pytest.approx(
        ((total - attn) / 2.0 + attn) / 1e12)
    assert prefill_floor_s(bf16, 1000, 2, ceil) == pytest.approx(total / 1e12)
    assert prefill_floor_s(fp8, 1000, 2, {"bf16_TFLOPs": 1.0, "fp8_TFLOPs": None}) == \
        pytest.approx(total / 1e12)
    # FP8 experts run bf16 dots: the 8 routed experts of each of the 48 layers at bf16's rate
    from nanoserve.models.sizes import expert_params
    moe = ModelConfig.from_dir(resolve_model_dir("Qwen3-30B-A3B-FP8", dummy_weights=True))
    total = prefill_flops(moe, 1000, 1)
    slow = 2 * 48 * 32 * 128 * 1000 * 1000 + 2 * 1000 * 48 * 8 * expert_params(moe)
    assert prefill_floor_s(moe, 1000, 1, ceil) == pytest.approx(
        ((total - slow) / 2.0 + slow) / 1e12)


def test_tp_rows_count_every_ranks_bytes_against_the_gpus_bandwidth_together(capsys):
    """TP=2 offloaded: each rank streams half the heads, the floor counts both halves over the
    two GPUs' bandwidth together; the row reports its TPOT over the TP=1 row's."""
    from bench_offload import add_tp_ratios

    args = parse_args(["--model", "tiny-qwen3", "--input-len", "600", "--output-len", "6",
                       "--tensor-parallel-size", "1,2"])
    assert args.tensor_parallel_size == [1, 2]
    cfg = ModelConfig.from_dir(EMBEDDED_MODEL)
    ceil = {**CEIL, "h2d_GBps_tp": {"2": 4.0}}
    # 600 tokens: two full 256-token pages per sequence stream each step (the rest is its tail)
    rows = [run_mode(args, "offload-eager", 600, 2, cfg, ceil, None, tp) for tp in (1, 2)]
    add_tp_ratios(rows)
    one, two = rows
    assert (one["tp"], two["tp"]) == (1, 2)
    assert one["h2d_bytes_per_step"] > 0
    assert two["h2d_bytes_per_step"] == one["h2d_bytes_per_step"]  # 2 ranks x half the heads
    assert two["pcie_floor_ms"] == pytest.approx(one["pcie_floor_ms"] / 4.0)
    assert two["prefill_floor_s"] == pytest.approx(one["prefill_floor_s"] / 2)
    assert "tpot_vs_tp1" not in one
    assert two["tpot_vs_tp1"] == two["tpot_ms_median"] / one["tpot_ms_median"]
    print_table(rows, ceil)
    out = capsys.readouterr().out
    assert "host->device, GPUs copying at once: 2 GPUs 4.0 GB/s together" in out
    assert (f"  offload-eager   ctx    600 bs  2 TP=2: TPOT {two['tpot_vs_tp1']:.3f}x, TTFT "
            f"{two['ttft_vs_tp1']:.3f}x") in out


def test_the_aggregate_link_ceiling_is_the_best_round_over_its_slowest_rank():
    """A round with a late rank (1.25 s) is not the ceiling; the best round's slowest rank
    (1.0 s for 2 ranks x 10 GB) is: 20 GB/s."""
    from bench_offload import best_aggregate_gbps

    rounds = [[1.25, 0.5], [0.9, 1.0], [1.1, 1.1]]
    assert best_aggregate_gbps(rounds, 10 * 10**9) == pytest.approx(20.0)


# --- a shared prefix's pages count once ----------------------------------------------------------
def test_the_page_count_counts_a_shared_prefixs_full_pages_once():
    from bench_offload import kv_pages_needed

    argv = ["--input-len", "32768", "--batch-size", "16"]
    # 32,768 + 64 tokens: 129 pages of 256 each
    assert kv_pages_needed(parse_args(argv), 32768, 16, 256) == 16 * 129 == 2064
    # the document's 32,752 tokens fill 127 pages, held once; each request's question, its
    # output and the document's last, partly filled page take 129 - 127 pages of its own
    shared = parse_args([*argv, "--shared-prefix"])
    assert kv_pages_needed(shared, 32768, 16, 256) == 127 + 16 * 2 == 159
    assert kv_pages_needed(shared, 32768, 1, 256) == 129


def test_a_shared_prefix_batch_that_fits_only_shared_is_not_refused():
    """600-token prompts, 6 output tokens, 4 requests, 256-token pages: 12 pages unshared, 6
    shared (the document's 2 full pages once, 1 page each). The device budget holds the
    streamed layers' tails (5 rows of 256 KiB each for 4 layers) and 2 ring slots of 9 pages:
    8 usable pages, which refused the batch before."""
    cfg = ModelConfig.from_dir(EMBEDDED_MODEL)
    lpb = 256 * 1024  # the embedded model's float32 KV: 1 KiB per token per layer
    budget = (4 * 5 * lpb + 2 * 9 * lpb) / 2**30
    argv = ["--model", "tiny-qwen3", "--input-len", "600", "--output-len", "6",
            "--gpu-kv-budget", str(budget)]
    with pytest.raises(ValueError, match=r"does not fit: 12 KV pages needed, the GPU KV budget "
                       r"\(0.009277 GiB\) with the host KV budget \(.* GiB, --host-kv-budget\) "
                       r"holds 8"):
        run_mode(parse_args(argv), "offload-eager", 600, 4, cfg, CEIL)
    # --host-kv-budget reaches the engine: 6 pages of 4 streamed layers, one the dummy page
    with pytest.raises(ValueError, match=r"host KV budget \(0.005859 GiB, --host-kv-budget\) "
                       r"holds 5"):
        run_mode(parse_args([*argv, "--host-kv-budget", str(6 * 4 * lpb / 2**30)]),
                 "offload-eager", 600, 4, cfg, CEIL)
    row = run_mode(parse_args([*argv, "--shared-prefix"]), "offload-eager", 600, 4, cfg, CEIL)
    assert (row["batch"], row["streamed_layers"]) == (4, 4)
    # a decode step loads the document's 2 pages once for all 4 requests (each one's own page
    # is its tail), for each of the 4 streamed layers
    assert row["h2d_bytes_per_step"] == 4 * 2 * lpb


def test_quantized_floors_count_the_quantized_bytes():
    """A quantized shape's decode floor reads its quantized layers' tensors and the dense rest,
    less the input embedding: FP8 about half of bf16's bytes, AWQ about a third."""
    from bench_offload import weight_bytes
    from nanoserve.models.loader import model_bytes, resolve_model_dir

    dense = ModelConfig.from_dir(resolve_model_dir("Qwen3-8B", dummy_weights=True))
    emb = 2 * dense.vocab_size * dense.hidden_size
    for name, share in (("Qwen3-8B-FP8", (0.53, 0.55)), ("Qwen3-8B-AWQ", (0.31, 0.33))):
        cfg = ModelConfig.from_dir(resolve_model_dir(name, dummy_weights=True))
        got = weight_bytes(cfg, 2, 1)
        assert got == model_bytes(cfg, torch.bfloat16, tp=1) - emb
        assert share[0] < got / weight_bytes(dense, 2, 1) < share[1], name


def test_the_fit_check_counts_memory_the_previous_rows_engine_held(monkeypatch):
    """The free memory a resident row is checked against is read after the last engine is
    collected and torch's cache is emptied: read before, a row run right after itself saw the
    previous engine's KV pool as used and was skipped."""
    from bench_offload import fits

    released = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(True))
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda *a: ((80 if released else 0) * gib, 80 * gib))
    cfg = ModelConfig.from_dir(EMBEDDED_MODEL)
    assert fits(parse_args(["--model", "tiny-qwen3"]), cfg, 4096, 32)
    assert released


def test_ttft_is_also_held_to_the_matmul_rate_the_gpu_holds(capsys):
    """A row's TTFT over the FLOP floor, and over the floor at the rate the tensor cores hold
    once the power limit sets the clock (held 0.8 of the burst: 0.8 of the ratio); the table
    prints both and the ceilings line the held rate; no held rate measured: nan."""
    from bench_offload import held_share

    args = parse_args(["--model", "tiny-qwen3", "--input-len", "48", "--output-len", "3"])
    cfg = ModelConfig.from_dir(EMBEDDED_MODEL)
    ceil = {**CEIL, "bf16_held_TFLOPs": 0.8}
    assert held_share(ceil) == pytest.approx(0.8)
    assert math.isnan(held_share(CEIL))
    row = run_mode(args, "resident-eager", 48, 1, cfg, ceil, None)
    assert row["ttft_over_held_floor"] == pytest.approx(0.8 * row["ttft_over_floor"])
    assert row["ttft_over_floor"] == pytest.approx(row["ttft_s"] / row["prefill_floor_s"])
    print_table([row], ceil)
    out = capsys.readouterr().out
    assert "bf16 matmul 1 TFLOP/s (1 held)" in out
    assert f"{row['ttft_over_floor']:>7.2f}{row['ttft_over_held_floor']:>7.2f}" in out
    assert " xFLOP  xheld" in out
