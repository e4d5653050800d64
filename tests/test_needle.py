"""Needle in a haystack: a secret number hidden at each depth of an exact-length prompt, found by
greedy generation. A script and a pytest module.

    python tests/test_needle.py --input-len 32768 --enable-offload --use-cuda-graph \
        --depths 0,0.1,...,1
    python tests/test_needle.py --input-len 32768 --enable-offload --kv-cache-dtype fp8
    python -m pytest tests/test_needle.py

The script takes every engine option of `nanoserve generate` (default model: the embedded one,
trained for this test). With --enable-offload and no --resident-layers / --gpu-kv-budget, half
of the layers stream, so both paths run even when the KV would fit the GPU.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.cli import build_config, engine_options
from nanoserve.config import EngineConfig
from nanoserve.needle import NeedleBuilder, NeedlePrompt, parse_depths

sys.path.insert(0, str(Path(__file__).parent))  # run as a script too: the test helpers
from helpers import corrupt_host_kv  # noqa: E402

ALL_DEPTHS = parse_depths("0,0.1,...,1")


@dataclass
class NeedleResult:
    depth: float
    trial: int
    secret: str
    answer: str
    token_ids: list[int]
    ttft_s: float
    tpot_s: float

    @property
    def passed(self) -> bool:
        return self.secret in self.answer


def needle_prompts(llm: LLM, input_len: int, depths: list[float], trials: int,
                   seed: int) -> list[NeedlePrompt]:
    builder = NeedleBuilder(llm.tokenizer)
    rng = random.Random(seed)
    return [builder.build(input_len, d, rng) for _ in range(trials) for d in depths]


def ask(llm: LLM, prompt: NeedlePrompt, max_tokens: int = 32, after_prefill=None):
    """Greedy answer to one needle prompt: (token ids, text, TTFT, TPOT). `after_prefill(seq)`
    runs once, after the step that produced the first token."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    (seq,) = engine.add_request(prompt.token_ids, params)
    t0 = time.perf_counter()
    ttft = None
    while not seq.is_finished:
        engine.step()
        if ttft is None and seq.num_output_tokens > 0:
            ttft = time.perf_counter() - t0
            t1 = time.perf_counter()
            if after_prefill is not None:
                after_prefill(seq)
            t0 += time.perf_counter() - t1  # the hook's time is not the engine's
    total = time.perf_counter() - t0
    n = seq.num_output_tokens
    tpot = (total - ttft) / (n - 1) if n > 1 else float("nan")
    return seq.output_token_ids, engine.decode_text(seq), ttft, tpot


def run_needle(llm: LLM, input_len: int, depths: list[float], trials: int = 1, seed: int = 0,
               after_prefill=None, max_tokens: int = 32) -> list[NeedleResult]:
    prompts = needle_prompts(llm, input_len, depths, trials, seed)
    results = []
    for i, p in enumerate(prompts):
        ids, text, ttft, tpot = ask(llm, p, max_tokens,
                                    None if after_prefill is None else
                                    lambda seq, p=p: after_prefill(seq, p))
        results.append(NeedleResult(p.depth, i // len(depths), p.secret, text, ids, ttft, tpot))
    return results


def format_table(results: list[NeedleResult]) -> str:
    lines = [f"{'depth':>5} {'trial':>5}  {'result':6} {'secret':>8}  {'TTFT ms':>8} "
             f"{'TPOT ms':>7}  answer"]
    for r in results:
        lines.append(f"{r.depth:5.2f} {r.trial:5d}  {'PASS' if r.passed else 'FAIL':6} "
                     f"{r.secret:>8}  {r.ttft_s * 1e3:8.1f} {r.tpot_s * 1e3:7.2f}  "
                     f"{r.answer.strip()[:60]!r}")
    n_pass = sum(r.passed for r in results)
    lines.append(f"{n_pass}/{len(results)} passed")
    return "\n".join(lines)


# --- the script ---------------------------------------------------------------------------

@click.command()
@engine_options
@click.option("--input-len", type=int, default=2048, show_default=True,
              help="Prompt length in tokens, exactly.")
@click.option("--depths", default="0,0.1,...,1", show_default=True,
              help="Needle depths in [0, 1]: '0,0.5,1' or '0,0.1,...,1'.")
@click.option("--trials", type=int, default=1, show_default=True,
              help="Secrets per depth.")
@click.option("--max-tokens", type=int, default=32, show_default=True)
@click.option("--use-cuda-graph", is_flag=True,
              help="Decode with CUDA graphs (the default on a GPU; --enforce-eager turns off).")
def main(input_len, depths, trials, max_tokens, use_cuda_graph, **kw) -> None:
    """Needle-in-a-haystack test: exits non-zero if any depth fails."""
    if use_cuda_graph and kw["enforce_eager"]:
        raise click.UsageError("--use-cuda-graph and --enforce-eager exclude each other")
    try:
        depth_list = parse_depths(depths)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    if trials < 1:
        raise click.UsageError("--trials must be >= 1")
    kw["max_model_len"] = kw["max_model_len"] or input_len + max_tokens
    kw["max_num_seqs"] = kw["max_num_seqs"] or 1
    cfg = build_config(kw)
    llm = LLM.from_config(half_streamed(cfg))
    engine = llm.engine
    if llm.tokenizer is None:
        raise click.UsageError(f"model {engine.model_dir} has no tokenizer")
    if use_cuda_graph and not engine.runner.graphs:
        click.echo("warning: CUDA graphs are off (no GPU); running eager", err=True)
    click.echo(f"model {engine.model_dir}, {input_len} tokens, device {cfg.torch_device}, "
               f"attention {engine.runner.backend.name}, "
               f"graphs {'on' if engine.runner.graphs else 'off'}")
    click.echo(engine.describe_memory())
    try:
        results = run_needle(llm, input_len, depth_list, trials, kw["seed"],
                             max_tokens=max_tokens)
    except ValueError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(format_table(results))
    sys.exit(0 if all(r.passed for r in results) else 1)


def half_streamed(cfg: EngineConfig) -> EngineConfig:
    """With offload on and no split asked for, stream half of the layers."""
    if not cfg.enable_offload or cfg.resident_layers is not None or \
            cfg.gpu_kv_budget_gib is not None:
        return cfg
    from dataclasses import replace

    from nanoserve.models.config import ModelConfig
    from nanoserve.models.loader import resolve_model_dir

    layers = ModelConfig.from_dir(resolve_model_dir(cfg.model, cfg.dummy_weights)).num_layers
    return replace(cfg, resident_layers=layers // 2)


# --- pytest -------------------------------------------------------------------------------

CPU_LEN = 2048


def cpu_llm(**kw) -> LLM:
    return LLM(progress=False, device="cpu", dtype="float32", page_size=16,
               max_model_len=CPU_LEN + 32, max_num_seqs=2, **kw)


@pytest.fixture(scope="module")
def resident_llm():
    return cpu_llm()


@pytest.fixture(scope="module")
def offload_llm():
    llm = cpu_llm(enable_offload=True, resident_layers=2)
    assert llm.engine.kv.plan.streamed_layers == 2
    return llm


@pytest.fixture(scope="module")
def cpu_split_llm():
    """Offload with CPU attention beside the link: 60% of each row's host pages on the CPU."""
    llm = cpu_llm(enable_offload=True, resident_layers=2, cpu_attention="0.6")
    assert llm.engine.runner.cpu_share is not None
    return llm


@pytest.mark.parametrize("offload", [False, True, "cpu-split"],
                         ids=["resident", "offload", "offload-cpu-split"])
def test_needle_found_at_every_depth(resident_llm, offload_llm, cpu_split_llm, offload):
    llm = {False: resident_llm, True: offload_llm, "cpu-split": cpu_split_llm}[offload]
    results = run_needle(llm, CPU_LEN, ALL_DEPTHS, seed=1)
    assert all(r.passed for r in results), format_table(results)
    if offload:  # and the streamed path gives the resident tokens exactly
        ref = run_needle(resident_llm, CPU_LEN, ALL_DEPTHS, seed=1)
        assert [r.token_ids for r in results] == [r.token_ids for r in ref]


def zero_host_pages(llm: LLM, seq, first_token: int, last_token: int) -> None:
    """Zeroes the KV of tokens [first, last) of every streamed layer in the host store."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the copy stream may still be writing the host store
    ps = llm.engine.kv.spec.page_size
    pages = seq.pages[first_token // ps:(last_token - 1) // ps + 1]
    for layer in range(llm.engine.kv.plan.streamed_layers):
        corrupt_host_kv(llm.engine, layer, pages, value=0.0)


def test_needle_fails_when_the_streamed_needle_kv_is_zeroed(offload_llm):
    """Teeth: the answer must come from the needle's KV, read back from the host store."""
    def corrupt(seq, p):
        zero_host_pages(offload_llm, seq, p.needle_start, p.needle_start + p.needle_len)

    broken = run_needle(offload_llm, CPU_LEN, [0.1, 0.5, 0.9], seed=2, after_prefill=corrupt)
    assert not any(r.passed for r in broken), format_table(broken)

    def corrupt_elsewhere(seq, p):  # the same number of pages, away from the needle
        far = p.needle_start + (700 if p.needle_start < CPU_LEN // 2 else -700)
        zero_host_pages(offload_llm, seq, far, far + p.needle_len)

    intact = run_needle(offload_llm, CPU_LEN, [0.1, 0.5, 0.9], seed=2,
                        after_prefill=corrupt_elsewhere)
    assert all(r.passed for r in intact), format_table(intact)


def shared_haystack_prompts(llm: LLM, input_len: int, secrets: list[str]) -> list:
    """One haystack, a different secret per request: the needle sits at the end (depth 1), so
    every request shares all of the haystack before it."""
    builder = NeedleBuilder(llm.tokenizer)
    return [builder.build(input_len, 1.0, random.Random(7), secret) for secret in secrets]


def check_shared_haystack(llm: LLM, ref: LLM, input_len: int) -> None:
    secrets = ["314159", "271828", "161803", "141421"]
    prompts = shared_haystack_prompts(llm, input_len, secrets)
    assert len({tuple(p.token_ids[:p.needle_start]) for p in prompts}) == 1
    params = SamplingParams(temperature=0.0, max_tokens=32)
    first = llm.generate(prompts[0].token_ids, params)[0]
    rest = llm.generate([p.token_ids for p in prompts[1:]], params)
    outs = [first, *rest]
    page = llm.engine.kv.spec.page_size
    assert all(o.num_cached_tokens >= prompts[0].needle_start // page * page - page
               for o in rest)
    assert [s in o.text for s, o in zip(secrets, outs, strict=True)] == [True] * 4
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref.generate(
        [p.token_ids for p in prompts], params)]


def test_shared_haystack_requests_each_find_their_own_secret():
    """Prefix caching: requests sharing a haystack reuse its KV, each still answers with its
    own secret, and the tokens equal caching off."""
    check_shared_haystack(cpu_llm(), cpu_llm(enable_prefix_caching=False), CPU_LEN)


def hf_greedy(model, prompt_ids: list[int], max_tokens: int, eos: int) -> list[int]:
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                         pad_token_id=eos)
    return out[0, len(prompt_ids):].tolist()


def test_needle_answers_equal_transformers(resident_llm):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        resident_llm.engine.model_dir, dtype=torch.float32).eval()
    eos = resident_llm.tokenizer.eos_token_id
    results = run_needle(resident_llm, CPU_LEN, [0.0, 0.5, 1.0], seed=3)
    prompts = needle_prompts(resident_llm, CPU_LEN, [0.0, 0.5, 1.0], 1, seed=3)
    for r, p in zip(results, prompts, strict=True):
        assert r.token_ids == hf_greedy(model, p.token_ids, 32, eos), r.answer
        assert r.passed


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("mode", ["offload-graph", "offload-eager", "resident-graph"])
def test_needle_32k_gpu(mode, kv_cache_dtype):
    llm = LLM(progress=False, max_model_len=32768 + 32, max_num_seqs=1,
              enforce_eager=mode.endswith("eager"), enable_offload=mode.startswith("offload"),
              resident_layers=2 if mode.startswith("offload") else None,
              kv_cache_dtype=kv_cache_dtype)
    results = run_needle(llm, 32768, ALL_DEPTHS, seed=4)
    print(format_table(results))
    assert all(r.passed for r in results), format_table(results)


@pytest.mark.gpu
def test_shared_haystack_32k_gpu():
    common = dict(progress=False, max_model_len=32768 + 32, max_num_seqs=4,
                  enable_offload=True, resident_layers=2, cpu_attention="off")
    check_shared_haystack(LLM(**common), LLM(enable_prefix_caching=False, **common), 32768)


@pytest.mark.gpu
def test_needle_32k_equals_transformers_gpu():
    transformers = pytest.importorskip("transformers")
    llm = LLM(progress=False, max_model_len=32768 + 32, max_num_seqs=1, enable_offload=True,
              resident_layers=2, cpu_attention="off")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        llm.engine.model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    eos = llm.tokenizer.eos_token_id
    depths = [0.0, 0.5, 1.0]
    results = run_needle(llm, 32768, depths, seed=5)
    for r, p in zip(results, needle_prompts(llm, 32768, depths, 1, seed=5), strict=True):
        assert r.token_ids == hf_greedy(model, p.token_ids, 32, eos), r.answer
        assert r.passed


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
