"""Tensor parallelism end to end on the CPU (gloo): a TP=2 engine (rank 0 here, rank 1 a
spawned worker) gives TP=1's greedy tokens, resident and offloaded; its worker never outlives
it; a worker that dies is a clear error, also for the server's health check."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import make_hf_model, random_prompts
from helpers import make_llm

from nanoserve import SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.distributed.workers import TensorParallelFailure
from nanoserve.structured_outputs import StructuredOutputs

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = random_prompts(3, [37, 5, 90], seed=11)
OFFLOAD = {"resident": {},  # async scheduling: rank 0 sends each launched step's ids
           "resident-sync": dict(async_scheduling=False),
           # one layer resident, two streamed through two ring slots
           "split": dict(enable_offload=True, resident_layers=1, host_kv_budget_gib=0.05),
           # every layer streamed, more streamed layers than slots
           "streamed": dict(enable_offload=True, resident_layers=0, host_kv_budget_gib=0.05),
           # and half of each row's host pages attended on the CPU, by each rank for its heads
           "streamed-cpu": dict(enable_offload=True, resident_layers=0, host_kv_budget_gib=0.05,
                                cpu_attention="0.5")}


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tp-{request.param}")
    make_hf_model(request.param, path)
    return path


def token_ids(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def gone(procs, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while any(p.is_alive() for p in procs) and time.time() < deadline:
        time.sleep(0.05)
    return not any(p.is_alive() for p in procs)


@pytest.mark.parametrize("mode", OFFLOAD)
def test_tp2_greedy_tokens_equal_tp1(model_dir, mode):
    ref = token_ids(make_llm(model_dir, **OFFLOAD[mode]))
    with make_llm(model_dir, tensor_parallel_size=2, **OFFLOAD[mode]) as llm:
        engine = llm.engine
        assert (engine.kv.streamer is not None) == mode.startswith(("split", "streamed"))
        assert engine.kv.spec.num_kv_heads == 1  # this rank's share of the 2 kv heads
        procs = engine.workers.procs
        launched = []
        launch = engine.runner.launch
        engine.runner.launch = lambda *a, **kw: launched.append(1) or launch(*a, **kw)
        assert token_ids(llm) == ref
        # decode steps launch ahead (async scheduling), offloaded or not, unless turned off
        assert bool(launched) == (mode != "resident-sync")
    assert gone(procs)


def test_the_embedded_model_runs_at_tp2_with_its_padded_vocabulary():
    # 259 tokens: the ranks hold 130 rows each, the last one unused
    prompts = random_prompts(3, [37, 5, 90], vocab=259, seed=11)
    # and a grammar's rows, whose launched steps sample after the step before is read: the
    # workers wait in the tokens' broadcast meanwhile
    json_params = SamplingParams(temperature=0.8, seed=3, max_tokens=40, n=2,
                                 structured_outputs=StructuredOutputs(json_object=True))
    one = make_llm(None)
    ref, ref_json = one.generate(prompts, GREEDY), one.generate(["as json:"], json_params)
    llm = make_llm(None, tensor_parallel_size=2)
    procs = llm.engine.workers.procs
    llm.engine.runner.warm_up_prompts()  # CUDA engines' start-up steps reach the workers too
    assert llm.engine.kv.num_free == llm.engine.kv.capacity
    out = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    got_json = llm.generate(["as json:"], json_params)[0].outputs
    assert [o.token_ids for o in got_json] == [o.token_ids for o in ref_json[0].outputs]
    assert all(isinstance(json.loads(o.text), dict) for o in got_json
               if o.finish_reason == "stop")
    del llm, out, got_json
    gc.collect()  # the LLM's finalizer stops its worker
    assert gone(procs)


def test_a_tp_size_that_does_not_divide_the_heads_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide the qwen3 "
                                         "config's num_attention_heads 8, num_key_value_heads 4"):
        make_llm(None, tensor_parallel_size=3)
    assert multiprocessing.active_children() == []


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 exceeds the 2 visible CUDA"):
        EngineConfig(device="cuda", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="pick the GPUs with CUDA_VISIBLE_DEVICES"):
        EngineConfig(device="cuda:1", tensor_parallel_size=2)


def test_a_dead_worker_is_a_clear_error_and_the_server_reports_unhealthy():
    pytest.importorskip("fastapi")
    from nanoserve.serve.async_engine import AsyncEngine

    llm = make_llm(None, tensor_parallel_size=2)
    ae = AsyncEngine(llm.engine)
    ae.start()
    assert ae.alive
    worker = llm.engine.workers.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    deadline = time.time() + 10
    while llm.engine.failure is None and time.time() < deadline:
        time.sleep(0.05)
    assert llm.engine.failure.startswith("tensor-parallel rank 1 was killed by signal 9")
    assert not ae.alive and ae.error == llm.engine.failure  # /health answers 503 with it
    ae.shutdown()
    with pytest.raises(TensorParallelFailure, match="rank 1 was killed by signal 9"):
        llm.generate([[1, 2, 3]], GREEDY)
    llm.shutdown()


SCRIPT = """
import signal, sys, time
from nanoserve import LLM
if __name__ == "__main__":
    # Ctrl-C as a terminal delivers it, even where the suite runs with SIGINT ignored (a
    # background job of a non-interactive shell passes that on to every process it starts)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    llm = LLM(device="cpu", dtype="float32", page_size=16, progress=False,
              tensor_parallel_size=2)
    print(" ".join(str(p.pid) for p in llm.engine.workers.procs), flush=True)
    time.sleep(600)
"""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_the_worker_dies_with_rank_0_however_rank_0_ends(tmp_path, sig):
    script = tmp_path / "tp_main.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 1 and pid_alive(pids[0])
        proc.send_signal(sig)
        proc.wait(30)
        deadline = time.time() + 10
        while pid_alive(pids[0]) and time.time() < deadline:
            time.sleep(0.05)
        assert not pid_alive(pids[0])
    finally:
        proc.kill()


def test_the_cli_runs_tensor_parallel():
    """`python -m nanoserve` imports its main module in the spawned worker too: the command
    must run once, not once per rank, and exit clean."""
    r = subprocess.run([sys.executable, "-m", "nanoserve", "generate", "--device", "cpu",
                        "--tensor-parallel-size", "2", "--input-len", "64", "--output-len",
                        "4"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("requests 1  prompt tokens 64  output tokens 4") == 1, r.stdout
    # a worker leaves nothing behind: no semaphore for the resource tracker to report
    assert "leaked" not in r.stderr, r.stderr[-2000:]


def test_tp2_prompt_logprobs_equal_tp1(qwen3_dir):
    """Scoring runs the head over the scored rows on every rank (its all-gather pairs up)."""
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    ref = make_llm(qwen3_dir, max_num_batched_tokens=16).generate(PROMPTS[:2], params)
    with make_llm(qwen3_dir, tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        outs = llm.generate(PROMPTS[:2], params)
    for out, want in zip(outs, ref, strict=True):
        assert len(out.prompt_logprobs) == len(want.prompt_logprobs)
        for got, exp in zip(out.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert got.token_id == exp.token_id and [i for i, _ in got.top] == \
                [i for i, _ in exp.top]
            assert abs(got.logprob - exp.logprob) < 1e-4


def test_a_requests_failing_grammar_mask_at_tp2_fails_that_request_alone(monkeypatch):
    """A constrained step's masks are built on rank 0 while the workers wait in the tokens'
    broadcast: when one request's mask fails there, the workers take placeholders, the step is
    dropped and rerun one sequence at a time, so that request fails, the others finish with
    TP=1's tokens and the engine keeps serving."""
    from nanoserve.engine import sampler

    spec = StructuredOutputs(json_object=True)
    params = [SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=spec),
              SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=spec),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    prompts = ["as json:", "more json:", "free text"]
    ref = make_llm(None).generate(prompts, params)
    llm = make_llm(None, tensor_parallel_size=2)
    engine = llm.engine
    masks = sampler.allowed_token_masks

    def failing(grammars, vocab, buffers=None):
        if any(getattr(g, "poisoned", False) for g in grammars):
            raise RuntimeError("mask failed")
        return masks(grammars, vocab, buffers)

    monkeypatch.setattr(sampler, "allowed_token_masks", failing)
    seqs = [s for p, q in zip(prompts, params, strict=True) for s in engine.add_request(p, q)]
    for _ in range(3):  # past the prefill: decode steps launch ahead
        engine.step()
    seqs[1].grammar.poisoned = True
    while engine.has_unfinished():
        engine.step()
    assert seqs[1].finish_reason == "error" and "mask failed" in seqs[1].error
    for seq, want in zip((seqs[0], seqs[2]), (ref[0], ref[2]), strict=True):
        assert seq.finish_reason != "error"
        assert seq.output_token_ids == want.outputs[0].token_ids
    again = llm.generate(prompts[2:], params[2:])  # still serving, the workers in step
    assert again[0].outputs[0].token_ids == ref[2].outputs[0].token_ids
    procs = engine.workers.procs
    del llm, engine, seqs, again
    gc.collect()
    assert gone(procs)
