"""Offload benchmark: every engine mode on the same model and weights, against this machine's
measured ceilings (PCIe host->device, device memory, bf16 matmul), in one run.

    python bench_offload.py --input-len 16384 --bench-all
    python bench_offload.py --model Qwen3-8B --input-len 4096,16384,32768 --batch-size 1,4
    python bench_offload.py --input-len 16384 --batch-size 1,16 --sampled   # greedy vs sampled
    python bench_offload.py --input-len 32768,131072 --bench-all --kv-cache-dtype fp8
    python bench_offload.py --input-len 32768 --tensor-parallel-size 1,2,4 --resident-graph

Reports per mode: TTFT, prefill tok/s, TPOT median/p90 (decode steps only), decode tok/s,
output tok/s (all output tokens over the whole run), peak GPU memory, host->device bytes per
decode step, layers resident/streamed, and the ratio of each figure to its floor. Runs decode
greedily unless --temperature / --top-p / --top-k say otherwise; --sampled runs every
configuration twice, greedy and sampled, and reports sampled / greedy ratios of TPOT and output
tok/s. With --tensor-parallel-size N (N > 1) the PCIe floor is the bytes every rank streams
over the host->device bandwidth of N GPUs copying at once (measured in the same run), the HBM
floor one rank's bytes over one GPU's bandwidth, the FLOP floor over N GPUs' matmul rate.
Writes bench.json and bench.png into --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from nanoserve import LLM, SamplingParams, StructuredOutputs
from nanoserve.config import KV_CACHE_DTYPES, EngineConfig, config_default
from nanoserve.cuda_timing import held_rate, median_ms
from nanoserve.engine.grammar import Grammars, byte_vocabulary
from nanoserve.engine.prefill_progress import PrefillProgress, prefill_counts
from nanoserve.kv.pages import pages_needed
from nanoserve.kv.spec import KVSpec
from nanoserve.kv.synthetic import fill_random
from nanoserve.models.config import ModelConfig
from nanoserve.models.loader import model_bytes, resolve_model_dir
from nanoserve.models.sizes import (
    expert_params,
    num_active_params,
    num_model_params,
    unread_expert_params,
)
from nanoserve.text import plural

MODES = {
    "resident-eager": dict(enforce_eager=True),
    "resident-graph": dict(),
    "offload-eager": dict(enable_offload=True, enforce_eager=True),
    "offload-graph": dict(enable_offload=True),
}


# --- ceilings -------------------------------------------------------------------------------
def measure_ceilings() -> dict:
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    h2d = n / median_ms(lambda: dev.copy_(host, non_blocking=True)) / 1e6
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    big2 = torch.empty_like(big)
    hbm = 2 * big.numel() / median_ms(lambda: big2.copy_(big)) / 1e6
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    tflops = 2 * 8192**3 / median_ms(lambda: a @ b) / 1e9
    fp8, host = fp8_tflops(), host_read_gbps()
    # last: 3 s of matmuls leave the clock where the power limit set it
    held = 2 * 8192**3 * held_rate(lambda: a @ b) / 1e12
    return {"h2d_GBps": h2d, "hbm_GBps": hbm, "bf16_TFLOPs": tflops, "bf16_held_TFLOPs": held,
            "fp8_TFLOPs": fp8, "host_read_GBps": host}


def fp8_tflops() -> float | None:
    """cuBLAS's FP8 matmul rate (8192^3, one scale a tensor), or None where the GPU has none:
    the rate an FP8-weight model's linear layers are held to (prefill_floor_s)."""
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    try:
        return 2 * 8192**3 / median_ms(lambda: torch._scaled_mm(
            a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)) / 1e9
    except RuntimeError:
        return None


def host_read_gbps(nbytes: int = 1 << 30, repeat: int = 5) -> float:
    """The host's memory read rate with torch's threads: the best of a few sums of 1 GiB of
    float32 (what CPU attention's kernel is measured against)."""
    x = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def _copy_on_rank(rank: int, nbytes: int, reps: int, rounds: int, barrier, seconds) -> None:
    torch.cuda.set_device(rank)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    for i in range(rounds):
        barrier.wait()
        t0 = time.perf_counter()
        for _ in range(reps):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        seconds[i * barrier.parties + rank] = time.perf_counter() - t0


def best_aggregate_gbps(seconds: list[list[float]], nbytes: int) -> float:
    """seconds[round][rank], each rank copying `nbytes` per round: the best round's bytes over
    its slowest rank's time. A ceiling is the best the links were seen to do together; one
    round alone can be slowed by a rank that starts late (0.86x of the next call's figure on an
    H200 x4, which put a TP=4 step below its floor)."""
    return max(len(r) * nbytes / max(r) / 1e9 for r in seconds)


def measure_h2d_aggregate(num_gpus: int, nbytes: int = 256 << 20, reps: int = 20,
                          rounds: int = 5) -> float:
    """GB/s host->device of `num_gpus` GPUs copying pinned memory at once (one process each,
    as tensor-parallel ranks stream), the best of `rounds` (best_aggregate_gbps)."""
    ctx = mp.get_context("spawn")
    barrier, seconds = ctx.Barrier(num_gpus), ctx.Array("d", num_gpus * rounds)
    procs = [ctx.Process(target=_copy_on_rank,
                         args=(r, nbytes, reps, rounds, barrier, seconds))
             for r in range(num_gpus)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    table = [list(seconds[i * num_gpus:(i + 1) * num_gpus]) for i in range(rounds)]
    return best_aggregate_gbps(table, nbytes * reps)


# --- floors ---------------------------------------------------------------------------------
def prefill_flops(cfg: ModelConfig, tokens: int, batch: int) -> float:
    """A token multiplies with its active parameters: with MoE, k experts of a sparse layer."""
    emb = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    linear = 2 * (num_active_params(cfg) - emb) * tokens
    attn = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * tokens  # causal QK+PV
    return batch * (linear + attn)


def held_share(ceil: dict) -> float:
    """The matmul rate the GPU holds over the burst rate the FLOP floor counts (nan where not
    measured): a prompt that prefills for seconds runs at the clock the power limit sets, so
    its TTFT over the floor times this is its ratio to what the tensor cores can hold. An FP8
    model's floor, mostly at the FP8 rate, is scaled by bf16's share too (the clock is the
    same; its FP8 rate held is not measured)."""
    return ceil.get("bf16_held_TFLOPs", float("nan")) / ceil["bf16_TFLOPs"]


def prefill_floor_s(cfg: ModelConfig, tokens: int, batch: int, ceil: dict, tp: int = 1
                    ) -> float:
    """prefill_flops at the bf16 matmul rate; an FP8-weight model's linear layers at the FP8
    rate, except attention and FP8 experts (the fused MoE kernels widen them to bf16)."""
    total = prefill_flops(cfg, tokens, batch)
    q = cfg.quantization
    if q is None or not q.method.startswith("fp8") or not ceil.get("fp8_TFLOPs"):
        return total / tp / ceil["bf16_TFLOPs"] / 1e12
    bf16 = batch * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * tokens + \
        batch * 2 * tokens * len(cfg.moe_layers) * cfg.num_experts_per_tok * expert_params(cfg)
    return ((total - bf16) / ceil["fp8_TFLOPs"] + bf16 / ceil["bf16_TFLOPs"]) / tp / 1e12


def weight_bytes(cfg: ModelConfig, dtype_bytes: int, batch: int = 1) -> float:
    """Weight bytes one decode step of `batch` sequences reads: every weight except the input
    embedding (gathered, not read whole) and, with MoE, the experts no token of the step picks:
    a sparse layer reads E (1 - (1 - k/E)^batch) experts, the expectation under uniform
    routing (k at batch 1; Qwen3-30B-A3B: 8, 51.6, 111.8 of 128 at batch 1, 8, 32)."""
    emb = cfg.vocab_size * cfg.hidden_size
    if cfg.quantization is not None:  # the quantized layers' own bytes, FP8 experts' 1 a weight
        dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}[dtype_bytes]
        bn, bk = cfg.quantization.block
        return model_bytes(cfg, dtype, tp=1) - (0 if cfg.tie_word_embeddings else
                                                emb * dtype_bytes) \
            - unread_expert_params(cfg, batch) * (1 + 4 / (bn * bk))
    read = num_model_params(cfg) - emb - unread_expert_params(cfg, batch)
    return read * dtype_bytes + (emb if cfg.tie_word_embeddings else 0)


# --- sampling --------------------------------------------------------------------------------
SHARED_QUESTION_LEN = 16  # --shared-prefix: each request's own tokens after the document
# --json-schema: every other request's output is held to this (constrained decoding); a
# dummy model's text rarely closes the string, so its rows run to --output-len as the others.
# A shape without a tokenizer gets a made-up byte vocabulary (engine/grammar.byte_vocabulary)
JSON_SUFFIX = " json"
BENCH_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}},
                "required": ["text"], "additionalProperties": False}
SAMPLED_DEFAULTS = dict(temperature=0.8, top_p=0.95, top_k=-1)


def sampling_runs(args) -> list[tuple[str, dict]]:
    """(label, sampling parameters) of each run of a configuration: greedy, or the given
    sampling, or with --sampled both (the sampled run defaulting to temperature 0.8, top_p 0.95).
    """
    given = {k: getattr(args, k) for k in SAMPLED_DEFAULTS}
    greedy = dict(temperature=0.0, top_p=1.0, top_k=-1)
    def label(params: dict) -> str:
        return "greedy" if SamplingParams(**params).greedy else "sampled"

    if args.sampled:
        sampled = {k: SAMPLED_DEFAULTS[k] if v is None else v for k, v in given.items()}
        runs = [("greedy", greedy), (label(sampled), sampled)]
    else:
        params = {k: greedy[k] if v is None else v for k, v in given.items()}
        runs = [(label(params), params)]
    if getattr(args, "json_schema", False):  # each again, half its requests constrained
        runs += [(name + JSON_SUFFIX, params) for name, params in runs]
    return runs


def sampling_label(params: dict) -> str:
    """'greedy' or e.g. 't0.8 p0.95' for a row or a sampling dict."""
    params = {k: params[k] for k in SAMPLED_DEFAULTS}
    if SamplingParams(**params).greedy:
        return "greedy"
    text = f"t{params['temperature']:g} p{params['top_p']:g}"
    return text + (f" k{params['top_k']}" if params["top_k"] > 0 else "")


def add_json_ratios(rows: list[dict]) -> None:
    """Rows with half their requests under a JSON schema get their output tok/s and TPOT over
    the same configuration's plain row."""
    def key(r: dict, sampling: str) -> tuple:
        return r["mode"], r["input_len"], r["batch"], r.get("cpu_attention"), sampling

    plain = {key(r, r["sampling"]): r for r in rows
             if not r.get("skipped") and not r["sampling"].endswith(JSON_SUFFIX)}
    for r in rows:
        if r.get("skipped") or not r["sampling"].endswith(JSON_SUFFIX):
            continue
        base = plain.get(key(r, r["sampling"][:-len(JSON_SUFFIX)]))
        if base is not None:
            r["output_tok_s_vs_plain"] = r["output_tok_s"] / base["output_tok_s"]
            r["tpot_vs_plain"] = r["tpot_ms_median"] / base["tpot_ms_median"]


def add_sampling_ratios(rows: list[dict]) -> None:
    """Sampled rows get their TPOT and output tok/s over the greedy row of the same mode,
    context and batch."""
    greedy = {(r["mode"], r["input_len"], r["batch"], r.get("cpu_attention")): r for r in rows
              if r.get("sampling") == "greedy" and not r.get("skipped")}
    for r in rows:
        g = greedy.get((r["mode"], r["input_len"], r["batch"], r.get("cpu_attention")))
        if r.get("sampling") == "sampled" and not r.get("skipped") and g is not None:
            r["tpot_vs_greedy"] = r["tpot_ms_median"] / g["tpot_ms_median"]
            r["output_tok_s_vs_greedy"] = r["output_tok_s"] / g["output_tok_s"]


# --- one run ---------------------------------------------------------------------------------
def run_mode(args, mode: str, input_len: int, batch: int, cfg: ModelConfig, ceil: dict,
             sampling: tuple[str, dict] | None = None, tp: int = 1,
             cpu_attention: str = "off") -> dict:
    kw = dict(MODES[mode], tensor_parallel_size=tp)
    if kw.get("enable_offload"):
        kw["cpu_attention"] = cpu_attention
        kw["resident_layers"] = args.resident_layers
        kw["num_kv_buffers"] = args.num_kv_buffers
        if args.gpu_kv_budget is not None:
            kw["gpu_kv_budget_gib"] = args.gpu_kv_budget
        if args.host_kv_budget is not None:
            kw["host_kv_budget_gib"] = args.host_kv_budget
    elif args.gpu_kv_budget is not None and args.force_budget_resident:
        kw["gpu_kv_budget_gib"] = args.gpu_kv_budget
    if args.sync_scheduling:
        kw["async_scheduling"] = False
    kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    llm = LLM(args.model, progress=False, dummy_weights=args.dummy_weights,
              max_model_len=input_len + args.output_len, max_num_seqs=batch,
              kv_cache_dtype=args.kv_cache_dtype, **kw)
    engine, runner = llm.engine, llm.engine.runner
    kv = engine.kv
    need = kv_pages_needed(args, input_len, batch, kv.spec.page_size)
    if need > kv.capacity:
        raise ValueError(f"does not fit: {plural(need, 'KV page')} needed, "
                         f"{kv.describe_budgets()} holds {kv.capacity}")
    g = torch.Generator().manual_seed(0)
    label, sampling_params = sampling or ("greedy", dict(temperature=0.0, top_p=1.0, top_k=-1))
    if label.endswith(JSON_SUFFIX) and engine.tokenizer is None:  # dummy weights of a shape
        eos = cfg.vocab_size - 1
        engine.grammars = Grammars(None, cfg.vocab_size, (eos,),
                                   byte_vocabulary(cfg.vocab_size, eos))
    params = SamplingParams(**sampling_params, max_tokens=args.output_len, ignore_eos=True)
    constrained = params.replace(structured_outputs=StructuredOutputs(json=BENCH_SCHEMA)) \
        if label.endswith(JSON_SUFFIX) else params
    def tokens(n: int) -> list[int]:
        return torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()

    if tp > 1:
        # the workers are fresh processes: their first prefill would build its attention plans
        # and compile inside the timed request (TP=1's were built by main's warm-up, in this
        # process), so one request of the same length runs first, untimed
        warm = torch.randint(0, cfg.vocab_size, (input_len,), generator=torch.Generator())
        llm.generate([warm.tolist()], SamplingParams(max_tokens=2, ignore_eos=True))
    doc = tokens(shared_prefix_len(args, input_len))
    seqs = [seq for i in range(batch) for seq in  # add_request: one sequence per completion
            engine.add_request(doc + tokens(input_len - len(doc)),
                               constrained if i % 2 else params)]
    if args.synthetic_prefill:
        for i, seq in enumerate(seqs):
            fill_random(kv, seq, seed=i)
    t0 = time.perf_counter()
    prefill = PrefillProgress()
    try:
        while any(s.num_output_tokens == 0 for s in seqs):
            engine.step()
            prefill.update(*prefill_counts(seqs))
    finally:
        prefill.close()
    ttft = time.perf_counter() - t0
    steps, streamed, waits, on_cpu = [], [], [], []
    collect = runner.collect  # async scheduling: where a step's host waits for the GPU

    def timed_collect(launched):
        a = time.perf_counter()
        out = collect(launched)
        waits[-1] += time.perf_counter() - a
        return out

    runner.collect = timed_collect
    try:
        while engine.has_unfinished():
            a = time.perf_counter()
            waits.append(0.0)
            engine.step()
            steps.append(time.perf_counter() - a)
            if kv.streamer is not None:
                streamed.append(kv.streamer.bytes_loaded)
                share = runner.cpu_share
                on_cpu.append(0 if share is None else share.tokens // kv.spec.page_size *
                              kv.spec.page_bytes(kv.plan.streamed_layers))
    finally:
        del runner.collect
    plan = kv.plan
    ctx = input_len + args.output_len // 2
    kv_read = batch * ctx * kv.spec.token_bytes(plan.resident_layers)
    resident_bytes = weight_bytes(cfg, runner.dtype.itemsize, batch) / tp + kv_read  # a rank's
    # rank 0 streams its share of the heads; every rank streams as much, each over its link.
    # The floor counts every host byte of the step, the CPU's share (cpu_attention) included:
    # the split is measured against streaming it all
    bytes_step = tp * statistics.median(streamed) if streamed else 0
    cpu_bytes = tp * statistics.median(on_cpu) if on_cpu else 0
    h2d = ceil["h2d_GBps"] if tp == 1 else ceil["h2d_GBps_tp"][str(tp)]
    tpot = statistics.median(steps)
    row = {
        "mode": mode, "input_len": input_len, "batch": batch, "tp": tp, "sampling": label,
        "async_scheduling": not args.sync_scheduling,
        "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
        **sampling_params, "kv_cache_dtype": args.kv_cache_dtype,
        "resident_layers": plan.resident_layers, "streamed_layers": plan.streamed_layers,
        "num_kv_buffers": kv.streamer.num_slots if kv.streamer is not None else 0,
        "ttft_s": ttft, "prefill_tok_s": batch * input_len / ttft,
        "tpot_ms_median": tpot * 1e3,
        "tpot_ms_p90": statistics.quantiles(steps, n=10)[-1] * 1e3 if len(steps) > 1 else
        tpot * 1e3,
        "decode_tok_s": batch / tpot,
        # the host's own time in a decode step: the step's wall less its wait for the GPU
        # (async scheduling; a synchronous step waits inside its sampling: not separable)
        "host_ms_median": statistics.median(s - w for s, w in zip(steps, waits, strict=True))
        * 1e3 if not args.sync_scheduling else float("nan"),
        "output_tok_s": sum(s.num_output_tokens for s in seqs) / (ttft + sum(steps)),
        "peak_gpu_GiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "h2d_bytes_per_step": bytes_step,
        "cpu_attention": cpu_attention if kv.streamer is not None else "off",
        "cpu_fraction": cpu_bytes / (cpu_bytes + bytes_step) if cpu_bytes else 0.0,
        # the start-up probe's figures, and the CPU kernel's rate as the last steps saw it
        **cpu_split_figures(runner),
        "pcie_floor_ms": (bytes_step + cpu_bytes) / h2d / 1e6,
        "hbm_floor_ms": resident_bytes / ceil["hbm_GBps"] / 1e6,
        "prefill_floor_s": prefill_floor_s(cfg, input_len, batch, ceil, tp),
    }
    floor = max(row["pcie_floor_ms"], row["hbm_floor_ms"])
    row["tpot_over_floor"] = row["tpot_ms_median"] / floor
    row["ttft_over_floor"] = ttft / row["prefill_floor_s"]
    row["ttft_over_held_floor"] = row["ttft_over_floor"] * held_share(ceil)
    if args.synthetic_prefill:  # the prefill computed less than a page per prompt
        row.update(synthetic_prefill=True, ttft_s=float("nan"), prefill_tok_s=float("nan"),
                   ttft_over_floor=float("nan"), ttft_over_held_floor=float("nan"))
    del llm, engine, runner
    gc.collect()
    return row


def cpu_split_figures(runner) -> dict:
    share, split = runner.cpu_share, runner.inputs.cpu_split
    if share is None:
        return {}
    out = {f"cpu_probe_{k}": v for k, v in (share.probe or {}).items()}
    if split is not None and split.fixed is None:
        out["cpu_kernel_GBps_in_run"] = split.cpu_rate / 1e9
        out["cpu_overhead_us_in_run"] = split.overhead * 1e6
        out["link_GBps_in_run"] = split.link_now / 1e9
    if share.history:  # the decode steps' medians, per layer: kernel, host time between them
        gap, work, tokens, _ = (statistics.median(x) for x in zip(*share.history, strict=True))
        step_gaps = [h[3] for h in share.history if h[3] == h[3]]  # not the first step's nan
        step_gap = statistics.median(step_gaps) if step_gaps else float("nan")
        page_bytes = runner.kv.spec.page_bytes(1)
        out["cpu_kernel_GBps_median"] = tokens / runner.cfg.page_size * page_bytes / work / 1e9
        out["cpu_work_us_median"] = work * 1e6
        out["cpu_gap_us_median"] = gap * 1e6
        out["cpu_step_gap_ms_median"] = step_gap * 1e3
    return out


# --- a running stream while a long prompt arrives -----------------------------------------------
def run_stall(args, mode: str, input_len: int, cfg: ModelConfig) -> dict:
    """A stream decodes; an input_len-token prompt arrives. The stream's largest gap between
    tokens until the prompt's first token, against one step with a full prefill chunk."""
    kw = dict(MODES[mode])
    if kw.get("enable_offload"):
        kw["resident_layers"] = args.resident_layers
        kw["num_kv_buffers"] = args.num_kv_buffers
    llm = LLM(args.model, progress=False, dummy_weights=args.dummy_weights,
              max_model_len=input_len + 256, max_num_seqs=2, **kw)
    engine = llm.engine
    g = torch.Generator().manual_seed(1)
    # 128 tokens of output outlast a 1M-token prompt's chunk steps
    stream_params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    [stream] = engine.add_request(torch.randint(0, cfg.vocab_size, (128,), generator=g).tolist(),
                                  stream_params)
    for _ in range(4):
        engine.step()
    [prompt] = engine.add_request(torch.randint(0, cfg.vocab_size, (input_len,),
                                                generator=g).tolist(),
                                  SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    chunk = min(engine.scheduler.max_num_batched_tokens, input_len)  # a full chunk's tokens
    cuda = torch.cuda.is_available()
    last, gaps, chunk_steps, step_s = time.perf_counter(), [], [], []
    t0 = last
    while prompt.num_output_tokens == 0:
        a, cached, out = time.perf_counter(), prompt.num_cached, stream.num_output_tokens
        engine.step()
        if cuda:  # a step that samples nothing returns before its kernels finish
            torch.cuda.synchronize()
        now = time.perf_counter()
        step_s.append(now - a)
        if prompt.num_cached - cached == chunk:
            chunk_steps.append(now - a)
        if stream.num_output_tokens > out:
            gaps.append(now - last)
            last = now
    ttft = time.perf_counter() - t0
    gaps.append(time.perf_counter() - last)  # a stream that got nothing waited the whole prefill
    for s in (stream, prompt):
        engine.abort(s)
    step = statistics.median(chunk_steps) if chunk_steps else float("nan")
    del llm, engine
    gc.collect()
    return {"mode": f"stall-{mode}", "input_len": input_len, "chunk": chunk, "ttft_s": ttft,
            "max_gap_s": max(gaps), "chunk_step_s": step, "gap_over_chunk_step": max(gaps) / step,
            "step_s": step_s}


def print_stall(rows: list[dict]) -> None:
    print("\na running stream while a long prompt is prefilled (largest gap between its tokens "
          "vs one step with a full chunk):")
    for r in rows:
        print(f"  {r['mode']:<22} ctx {r['input_len']:>6}: largest gap {r['max_gap_s']:.3f} s, "
              f"chunk step {r['chunk_step_s']:.3f} s ({plural(r['chunk'], 'token')}), "
              f"{r['gap_over_chunk_step']:.2f}x; prompt TTFT {r['ttft_s']:.2f} s")


# --- transformers, same weights ----------------------------------------------------------------
def hf_model_with_our_weights(model_dir: Path, dummy: bool, max_len: int,
                              device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """transformers' model for `model_dir`, holding exactly the weights nanoserve runs (dummy
    weights are generated by nanoserve's initializer with the same seed and copied over)."""
    import transformers

    from nanoserve.models.checkpoint import checkpoint_target, destination
    from nanoserve.models.loader import load_model

    hf_cfg = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device(device):  # random init on the device is fast; overwritten below
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype,
                                                           attn_implementation="sdpa").eval()
    ours = load_model(model_dir, max_len, dtype, torch.device(device), dummy, 0, False)
    params = dict(ours.named_parameters(remove_duplicate=False))
    modules = dict(ours.named_modules())
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(destination(params, modules, checkpoint_target(name)))
    return hf


def run_hf(args, hf, cache: str, input_len: int, batch: int, cfg: ModelConfig,
           ceil: dict) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randint(0, cfg.vocab_size, (input_len,), generator=g)
                       for _ in range(batch)]).to(hf.device)
    cuda = hf.device.type == "cuda"
    kw = dict(do_sample=False, min_new_tokens=1, pad_token_id=0)
    if cache == "offloaded":
        kw["cache_implementation"] = "offloaded"

    def timed(n: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, **{**kw, "min_new_tokens": n})
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    timed(1)  # warm-up: kernels, allocator
    ttft = timed(1)
    total = timed(args.output_len)
    tpot = (total - ttft) / (args.output_len - 1)
    return {"mode": f"hf-{cache}", "input_len": input_len, "batch": batch, "sampling": "greedy",
            "temperature": 0.0, "top_p": 1.0, "top_k": -1,
            "resident_layers": cfg.num_layers if cache == "default" else 0,
            "streamed_layers": 0 if cache == "default" else cfg.num_layers,
            "ttft_s": ttft, "prefill_tok_s": batch * input_len / ttft,
            "tpot_ms_median": tpot * 1e3, "tpot_ms_p90": float("nan"),
            "decode_tok_s": batch / tpot, "output_tok_s": batch * args.output_len / total,
            "peak_gpu_GiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
            "h2d_bytes_per_step": 0.0, "pcie_floor_ms": 0.0, "hbm_floor_ms": 0.0,
            "prefill_floor_s": prefill_floor_s(cfg, input_len, batch, ceil),
            "tpot_over_floor": float("nan"),
            "ttft_over_floor": ttft / prefill_floor_s(cfg, input_len, batch, ceil),
            "ttft_over_held_floor": ttft / prefill_floor_s(cfg, input_len, batch, ceil)
            * held_share(ceil)}


def compare_hf(args, model_dir: Path, cfg: ModelConfig, ceil: dict, rows: list[dict],
               combos: list[tuple[int, int]]) -> None:
    """Adds transformers rows (default and offloaded cache) and nanoserve/transformers ratios."""
    hf = hf_model_with_our_weights(model_dir, args.dummy_weights,
                                   max(n for n, _ in combos) + args.output_len)
    for n, b in tqdm(combos, desc="transformers"):
        for cache in ("default", "offloaded"):
            try:
                row = run_hf(args, hf, cache, n, b, cfg, ceil)
            except torch.cuda.OutOfMemoryError as e:
                row = {"mode": f"hf-{cache}", "input_len": n, "batch": b,
                       "skipped": f"out of memory: {str(e)[:60]}"}
            torch.cuda.empty_cache()
            rows.append(row)
            ours = next((r for r in rows if r["input_len"] == n and r["batch"] == b and not
                         r.get("skipped") and r.get("sampling") == "greedy" and r["mode"] ==
                         ("resident-graph" if cache == "default" else "offload-graph")), None)
            if ours is not None and not row.get("skipped"):
                ours[f"tpot_vs_hf_{cache}"] = ours["tpot_ms_median"] / row["tpot_ms_median"]
                ours[f"ttft_vs_hf_{cache}"] = ours["ttft_s"] / row["ttft_s"]
    del hf
    gc.collect()
    torch.cuda.empty_cache()


def shared_prefix_len(args: argparse.Namespace, input_len: int) -> int:
    """--shared-prefix: the tokens of the one document every request starts with (each then
    asks its own 16-token question); 0 without."""
    return max(input_len - SHARED_QUESTION_LEN, 0) if args.shared_prefix else 0


def kv_pages_needed(args: argparse.Namespace, input_len: int, batch: int, page_size: int) -> int:
    """KV pages a batch takes at its full length. With --shared-prefix and prefix caching the
    document's full pages are computed once and held by every request together; each request's
    question, output and partly filled document page take pages of its own."""
    own = pages_needed(input_len + args.output_len, page_size)
    shared = shared_prefix_len(args, input_len) // page_size \
        if config_default("enable_prefix_caching") else 0
    return shared + batch * (own - shared)


def fits(args, cfg: ModelConfig, input_len: int, batch: int, tp: int = 1) -> bool:
    """Whether the weights and KV of one rank fit its GPU, in the memory free once the previous
    row's engine is collected and its blocks leave torch's cache (a row run again right after
    itself was refused: the last engine's KV pool still counted as used)."""
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    kv_dtype = KV_CACHE_DTYPES.get(args.kv_cache_dtype, torch.bfloat16)  # auto: bf16 on CUDA
    spec = KVSpec.for_model(cfg, EngineConfig().page_size, kv_dtype)
    kv = kv_pages_needed(args, input_len, batch, spec.page_size) * spec.page_bytes()
    weights = model_bytes(cfg, torch.bfloat16, tp=1)
    return (weights + kv) / tp < 0.9 * free


def _print_ratios(rows: list[dict], key: str, title: str, line) -> None:
    """The rows that carry ratio `key` (against another run of the same configuration), under
    their title, a line each."""
    picked = [r for r in rows if key in r]
    if picked:
        print(title)
        for r in picked:
            print(line(r))


def print_table(rows: list[dict], ceil: dict) -> None:
    nan = float("nan")
    print(f"\nceilings: host->device {ceil['h2d_GBps']:.1f} GB/s, device memory "
          f"{ceil['hbm_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_TFLOPs']:.0f} TFLOP/s "
          f"({ceil.get('bf16_held_TFLOPs', nan):.0f} held), FP8 "
          f"{ceil.get('fp8_TFLOPs') or 0:.0f}, host "
          f"memory reads {ceil.get('host_read_GBps', nan):.0f} GB/s")
    tp_ceils = ", ".join(f"{n} GPUs {gbs:.1f}" for n, gbs in ceil.get("h2d_GBps_tp", {}).items())
    if tp_ceils:
        print(f"host->device, GPUs copying at once: {tp_ceils} GB/s together")
    head = (f"{'mode':<24}{'sampling':<12}{'ctx':>7}{'bs':>4}{'tp':>3}{'res/str':>9}{'TTFT s':>8}"
            f"{'xFLOP':>7}{'xheld':>7}{'prefill t/s':>12}{'TPOT ms':>9}{'p90':>8}{'floor':>8}"
            f"{'xfloor':>7}"
            f"{'dec t/s':>9}{'out t/s':>9}{'H2D GB':>8}{'cpu':>5}{'peak GiB':>9}{'host ms':>8}")
    print(head)
    print("-" * len(head))
    rows = sorted(rows, key=lambda r: (r["input_len"], r["batch"]))
    for r in rows:
        cpu = r.get("cpu_attention", "off")
        mode = r["mode"] + ("" if cpu == "off" else f" cpu={cpu}")
        label = sampling_label(r) if "temperature" in r else ""
        if r.get("sampling", "").endswith(JSON_SUFFIX):
            label += JSON_SUFFIX
        start = (f"{mode:<24}{label:<12}"
                 f"{r['input_len']:>7}{r['batch']:>4}{r.get('tp', 1):>3}")
        if r.get("skipped"):
            print(f"{start}  {r['skipped']}")
            continue
        if r["mode"].startswith("hf-"):
            print(f"{start}{'':>9}{r['ttft_s']:>8.2f}"
                  f"{r['ttft_over_floor']:>7.2f}{r.get('ttft_over_held_floor', nan):>7.2f}"
                  f"{r['prefill_tok_s']:>12,.0f}"
                  f"{r['tpot_ms_median']:>9.2f}{'':>8}{'':>8}{'':>7}{r['decode_tok_s']:>9.1f}"
                  f"{r['output_tok_s']:>9.1f}{'':>8}{r['peak_gpu_GiB']:>9.1f}")
            continue
        floor = max(r["pcie_floor_ms"], r["hbm_floor_ms"])
        print(f"{start}{r['resident_layers']:>5}/{r['streamed_layers']:<3}{r['ttft_s']:>8.2f}"
              f"{r['ttft_over_floor']:>7.2f}{r.get('ttft_over_held_floor', nan):>7.2f}"
              f"{r['prefill_tok_s']:>12,.0f}"
              f"{r['tpot_ms_median']:>9.2f}{r['tpot_ms_p90']:>8.2f}{floor:>8.2f}"
              f"{r['tpot_over_floor']:>7.2f}{r['decode_tok_s']:>9.1f}{r['output_tok_s']:>9.1f}"
              f"{r['h2d_bytes_per_step'] / 1e9:>8.2f}{r.get('cpu_fraction', 0.0):>5.2f}"
              f"{r['peak_gpu_GiB']:>9.1f}"
              f"{r.get('host_ms_median', float('nan')):>8.2f}")
    split_rows = [r for r in rows if "cpu_probe_cpu_alone_GBps" in r]
    if split_rows:
        print("\nCPU attention (GB/s of host KV; the host's reads "
              f"{ceil.get('host_read_GBps', float('nan')):.0f} GB/s):")
        for r in split_rows:
            run = (f", in the run CPU {r['cpu_kernel_GBps_in_run']:.1f} GB/s, link "
                   f"{r['link_GBps_in_run']:.1f}, {r['cpu_overhead_us_in_run']:.0f} us per "
                   "layer besides"
                   if "cpu_kernel_GBps_in_run" in r else "")
            print(f"  ctx {r['input_len']:>6} bs {r['batch']:>2} cpu={r['cpu_attention']}: probe "
                  f"CPU {r['cpu_probe_cpu_alone_GBps']:.1f} alone / "
                  f"{r['cpu_probe_cpu_both_GBps']:.1f} with the link, link "
                  f"{r['cpu_probe_link_alone_GBps']:.1f} / {r['cpu_probe_link_both_GBps']:.1f} "
                  f"({r['cpu_probe_threads']} threads){run}")
            if "cpu_work_us_median" in r:
                print(f"    per layer (medians): kernel {r['cpu_work_us_median']:.0f} us "
                      f"({r['cpu_kernel_GBps_median']:.1f} GB/s), host between kernels "
                      f"{r['cpu_gap_us_median']:.0f} us; between steps "
                      f"{r['cpu_step_gap_ms_median']:.2f} ms")
    _print_ratios(rows, "tpot_vs_tp1", "\ntensor parallel / one GPU, same mode, context and "
                  "batch (lower is better):", lambda r: (
                      f"  {r['mode']:<15} ctx {r['input_len']:>6} bs {r['batch']:>2} "
                      f"TP={r['tp']}: TPOT {r['tpot_vs_tp1']:.3f}x, TTFT "
                      f"{r['ttft_vs_tp1']:.3f}x"))
    _print_ratios(rows, "tpot_vs_greedy", "\nsampled / greedy, same mode, context and batch "
                  "(TPOT: lower is better; output tok/s: higher is better):", lambda r: (
                      f"  {r['mode']:<15} {sampling_label(r):<11} ctx {r['input_len']:>6} bs "
                      f"{r['batch']:>2}: TPOT {r['tpot_vs_greedy']:.3f}x, output tok/s "
                      f"{r['output_tok_s_vs_greedy']:.3f}x"))
    _print_ratios(rows, "output_tok_s_vs_plain", "\nhalf the requests under a JSON schema / "
                  "none, same mode, context and batch (output tok/s: higher is better):",
                  lambda r: (
                      f"  {r['mode']:<15} {r['sampling']:<16} ctx {r['input_len']:>6} bs "
                      f"{r['batch']:>2}: output tok/s {r['output_tok_s_vs_plain']:.3f}x, TPOT "
                      f"{r['tpot_vs_plain']:.3f}x"))
    vs = [r for r in rows if any(k.startswith("tpot_vs_hf") for k in r)]
    if vs:
        print("\nnanoserve / transformers (lower is better; resident-graph vs default cache, "
              "offload-graph vs offloaded cache):")
        for r in vs:
            cache = "default" if r["mode"].startswith("resident") else "offloaded"
            print(f"  {r['mode']:<15} ctx {r['input_len']:>6} bs {r['batch']:>2}: TPOT "
                  f"{r[f'tpot_vs_hf_{cache}']:.3f}x, TTFT {r[f'ttft_vs_hf_{cache}']:.3f}x")


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    ok = [r for r in rows if not r.get("skipped") and r["batch"] == rows[0]["batch"]]
    if any(r.get("sampling") == "greedy" for r in ok):  # one curve per mode: the greedy runs
        ok = [r for r in ok if r.get("sampling") == "greedy"]
    for mode in [*MODES, "hf-default", "hf-offloaded"]:
        pts = sorted((r["input_len"], r["tpot_ms_median"]) for r in ok if r["mode"] == mode)
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o" if mode in MODES else "x",
                    linestyle="-" if mode in MODES else "-.", label=mode)
    for key, style, label in (("pcie_floor_ms", "k--", "PCIe floor (offload)"),
                              ("hbm_floor_ms", "k:", "HBM floor (resident)")):
        mode = "offload-graph" if key == "pcie_floor_ms" else "resident-graph"
        pts = sorted((r["input_len"], r[key]) for r in ok if r["mode"] == mode)
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("TPOT (ms)")
    ax.set_title(f"TPOT vs context, batch {ok[0]['batch'] if ok else '?'}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def add_tp_ratios(rows: list[dict]) -> None:
    """Each TP > 1 row's TPOT and TTFT over those of its TP=1 row (same mode, context, batch,
    sampling), where the run has one."""
    def key(r: dict) -> tuple:
        return r["mode"], r["input_len"], r["batch"], r.get("sampling"), r.get("cpu_attention")

    one = {key(r): r for r in rows if r.get("tp", 1) == 1 and not r.get("skipped")}
    for r in rows:
        base = one.get(key(r))
        if r.get("tp", 1) > 1 and base is not None and not r.get("skipped"):
            r["tpot_vs_tp1"] = r["tpot_ms_median"] / base["tpot_ms_median"]
            r["ttft_vs_tp1"] = r["ttft_s"] / base["ttft_s"]


def int_list(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16], every item a positive integer."""
    try:
        items = [int(x) for x in text.split(",")]
    except ValueError:
        items = []
    if not items or min(items) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got "
                                         f"{text!r}")
    return items


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_offload.py", description=__doc__.split("\n\n")[0])
    # engine settings: the config's defaults, except the model (a real one's shape) and
    # --resident-layers (0: every layer streams; -1: the config's default, the split follows
    # the budget)
    ap.add_argument("--model", default="Qwen3-8B",
                    help="model dir, hub id or shipped config (default: Qwen3-8B, dummy weights)")
    ap.add_argument("--dummy-weights", action="store_true", default=config_default("dummy_weights"),
                    help="random weights (implied for shipped configs)")
    ap.add_argument("--input-len", type=int_list, default=[16384],
                    help="comma-separated context lengths")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens (at least 2)")
    ap.add_argument("--batch-size", type=int_list, default=[1],
                    help="comma-separated batch sizes")
    ap.add_argument("--tensor-parallel-size", type=int_list, default=[1],
                    help="comma-separated TP sizes, each run in turn (1,2,4: the TP rows "
                         "report their ratio to the TP=1 row)")
    ap.add_argument("--bench-all", action="store_true", help="run every mode")
    for mode in MODES:
        ap.add_argument(f"--{mode}", action="store_true", help=f"run the {mode} mode")
    ap.add_argument("--kv-cache-dtype", default=config_default("kv_cache_dtype"),
                    choices=["auto", *KV_CACHE_DTYPES],
                    help="KV cache dtype of every nanoserve mode (fp8: e4m3 with per-token "
                         "scales; the floors count its bytes); transformers keeps bf16")
    ap.add_argument("--cpu-attention", type=lambda t: t.split(","),
                    default=[config_default("cpu_attention")],
                    help="offload modes: the CPU attends a share of each streamed layer's host "
                    "KV (auto, off or a fraction; a comma list runs each); the table's cpu "
                    "column is the share of host KV bytes on the CPU, and the PCIe floor "
                    "counts every host byte, the CPU's too")
    ap.add_argument("--resident-layers", type=int, default=0,
                    help="offload modes: layers kept resident (default 0: every layer streams)")
    ap.add_argument("--num-kv-buffers", type=int, default=config_default("num_kv_buffers"),
                    help="offload modes: GPU ring slots for streamed layers")
    ap.add_argument("--gpu-kv-budget", type=float, default=config_default("gpu_kv_budget_gib"),
                    help="offload modes: GPU KV budget in GiB (with --resident-layers unset "
                         "by -1, the split follows the budget)")
    ap.add_argument("--host-kv-budget", type=float, default=config_default("host_kv_budget_gib"),
                    help="offload modes: host KV budget in GiB (default: half the available RAM)")
    ap.add_argument("--force-budget-resident", action="store_true",
                    help="apply --gpu-kv-budget to resident modes too")
    ap.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature, 0 to 2 (default: 0, greedy; with --sampled: "
                         f"{SAMPLED_DEFAULTS['temperature']})")
    ap.add_argument("--top-p", type=float, default=None,
                    help=f"top-p (default: 1; with --sampled: {SAMPLED_DEFAULTS['top_p']})")
    ap.add_argument("--top-k", type=int, default=-1, help="top-k (default: -1, off)")
    ap.add_argument("--shared-prefix", action="store_true",
                    help="every request of a batch shares one document (all but its last 16 "
                         "tokens): with prefix caching its KV is computed and streamed once")
    ap.add_argument("--synthetic-prefill", action="store_true",
                    help="decode only: each prompt's full pages get random KV instead of a "
                    "prefill (kv/synthetic.py; TTFT not measured): TPOT and memory at contexts "
                    "whose prefill takes longer than a run can wait")
    ap.add_argument("--sampled", action="store_true",
                    help="run every configuration twice, greedy and sampled (--temperature, "
                         "--top-p, --top-k), and report the sampled / greedy ratios of TPOT "
                         "and output tok/s")
    ap.add_argument("--json-schema", action="store_true",
                    help="run every configuration again with every other request's output held "
                         "to a JSON schema (structured outputs), and report the output tok/s "
                         "ratio")
    ap.add_argument("--compare-hf", action="store_true",
                    help="also run transformers generate() (default and offloaded cache) on "
                         "the same weights and prompts (greedy)")
    ap.add_argument("--hf-max-len", type=int, default=32768,
                    help="with --compare-hf: longest context given to transformers")
    ap.add_argument("--sync-scheduling", action="store_true",
                    help="turn async scheduling off (the host waits for each step's tokens "
                         "before it schedules the next)")
    ap.add_argument("--max-num-batched-tokens", type=int,
                    default=config_default("max_num_batched_tokens"),
                    help="prefill tokens per step (the chunk size; default: the engine's, "
                         "%(default)s)")
    ap.add_argument("--stall", action="store_true",
                    help="also measure a decoding stream's largest gap between tokens while a "
                         "prompt of each --input-len arrives (per graph mode)")
    ap.add_argument("--out", default="docs/bench", help="folder for bench.json and bench.png")
    args = ap.parse_args(argv)
    if args.output_len < 2:
        ap.error("--output-len must be >= 2 (TPOT needs a decode step)")
    if args.synthetic_prefill and (args.shared_prefix or args.compare_hf or
                                   max(args.tensor_parallel_size) > 1):
        ap.error("--synthetic-prefill writes this process's KV: not with --shared-prefix, "
                 "--compare-hf or tensor parallelism")
    try:
        runs = sampling_runs(args)
    except ValueError as e:
        ap.error(str(e))
    if args.sampled and runs[1][0] != "sampled":
        ap.error("--sampled needs sampling parameters that sample (--temperature > 0, "
                 "--top-k other than 1)")
    if args.resident_layers < 0:
        args.resident_layers = config_default("resident_layers")
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"bench_offload.py: needs a CUDA GPU, and torch {torch.__version__} sees none")
    try:
        model_dir = resolve_model_dir(args.model, dummy_weights=True)
        cfg = ModelConfig.from_dir(model_dir)
    except (ValueError, OSError) as e:
        sys.exit(f"bench_offload.py: {e}")
    if "model_configs" in str(model_dir):
        args.dummy_weights = True
    modes = [m for m in MODES if args.bench_all or getattr(args, m.replace("-", "_"))]
    modes = modes or ["resident-graph", "offload-graph"]
    lens, batches = args.input_len, args.batch_size
    runs = sampling_runs(args)
    ceil = measure_ceilings()
    tps = args.tensor_parallel_size
    if max(tps) > torch.cuda.device_count():
        sys.exit(f"bench_offload.py: --tensor-parallel-size {max(tps)} needs that many GPUs; "
                 f"{torch.cuda.device_count()} visible")
    ceil["h2d_GBps_tp"] = {str(n): measure_h2d_aggregate(n) for n in tps if n > 1}
    for run in runs:  # warm-up (kernel compilation, the sampler's first use), not reported
        try:
            run_mode(args, modes[0], min(lens), 1, cfg, ceil, run)
        except (ValueError, torch.cuda.OutOfMemoryError):
            pass
        gc.collect()
    torch.cuda.empty_cache()
    rows = []
    combos = [(m, n, b, run, tp, c) for n in lens for b in batches for m in modes
              for run in runs for tp in tps
              for c in (args.cpu_attention if m.startswith("offload") else ["off"])]
    for mode, n, b, (label, params), tp, cpu in tqdm(combos, desc="bench"):
        head = {"mode": mode, "input_len": n, "batch": b, "tp": tp, "sampling": label,
                "cpu_attention": cpu, **params}
        if mode.startswith("resident") and not fits(args, cfg, n, b, tp):
            rows.append({**head, "skipped": "KV does not fit the GPU: resident cannot run"})
            continue
        try:
            rows.append(run_mode(args, mode, n, b, cfg, ceil, (label, params), tp, cpu))
        except (ValueError, torch.cuda.OutOfMemoryError) as e:
            rows.append({**head, "skipped": str(e)[:80]})
            gc.collect()
            torch.cuda.empty_cache()
    add_sampling_ratios(rows)
    add_json_ratios(rows)
    add_tp_ratios(rows)
    # each twice: the first pays the mixed step's first compiles and cuDNN plans
    stall = [[run_stall(args, m, n, cfg) for _ in range(2)][-1] for n in lens for m in modes
             if args.stall and m.endswith("graph")]
    if args.compare_hf:
        compare_hf(args, model_dir, cfg, ceil, rows,
                   [(n, b) for n in lens for b in batches if n <= args.hf_max_len])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from nanoserve.extensions import one_row_cuda_wanted, pdl_wanted
    machine = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
               # the launch switches a figure depends on (NANOSERVE_PDL, NANOSERVE_ONE_ROW_CUDA)
               "pdl": pdl_wanted(torch.cuda.get_device_capability()),
               "one_row_cuda": one_row_cuda_wanted()}
    (out / "bench.json").write_text(json.dumps(
        {"machine": machine, "model": args.model, "kv_cache_dtype": args.kv_cache_dtype,
         "ceilings": ceil, "stall": stall,
         "sampling": [dict(label=label, **params) for label, params in runs], "rows": rows},
        indent=1))
    plot(rows, out / "bench.png")
    print(f"\n{machine['gpu']}, {args.model} ({plural(cfg.num_layers, 'layer')}), KV cache "
          f"{args.kv_cache_dtype}, output {args.output_len} tokens, {machine['date']}; "
          f"PDL {'on' if machine['pdl'] else 'off'}, one-row CUDA kernels "
          f"{'on' if machine['one_row_cuda'] else 'off'}")
    print_table(rows, ceil)
    if stall:
        print_stall(stall)


if __name__ == "__main__":
    main()
