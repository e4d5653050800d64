"""CPU attention beside the link, on the CPU engine (both tiers in CPU memory, copies
synchronous; the torch backend attends the GPU's share): the split of each decode row's host KV
between the CPU kernel and the streamed ring slot gives exactly the tokens of offload off, at
any fraction, for fp32 and FP8 KV, batches, preemption; the pages the CPU takes are
not loaded; and they are really read by the CPU."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import random_prompts
from helpers import corrupt_host_kv, make_llm

from nanoserve import SamplingParams
from nanoserve.attention.cpu_decode import _extension
from nanoserve.cli import describe_streamed
from nanoserve.config import EngineConfig
from nanoserve.engine.step_inputs import StepInputBuilder
from nanoserve.kv.spec import KVSpec
from offload import CpuSplit
from offload.cpu_split import DECAY, DRIFT, GAPS_KEPT

GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
# one 4-token page of the 4 streamed layers (resident_layers=2 of 6), fp32
STREAMED_PAGE_BYTES = KVSpec(6, 4, 2, 16, torch.float32).page_bytes(num_layers=4)



def llm_for(path, **kw):
    return make_llm(path, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=256, **kw)


def offload(path, cpu_attention="off", **kw):
    return llm_for(path, enable_offload=True, resident_layers=2, host_kv_budget_gib=0.01,
                   cpu_attention=cpu_attention, **kw)


def run(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("fraction", ["0", "0.5", "1"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("batch", [1, 4])
def test_split_gives_the_tokens_of_offload_off(six_layer_dir, fraction, kv_cache_dtype, batch):
    prompts = random_prompts(batch, [37, 6, 61, 20], seed=batch)
    ref = run(llm_for(six_layer_dir, kv_cache_dtype=kv_cache_dtype), prompts)
    llm = offload(six_layer_dir, fraction, kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runner.cpu_split == CpuSplit(fixed=float(fraction))
    assert run(llm, prompts) == ref
    kv = llm.engine.kv
    assert kv.num_free == kv.capacity and kv.tail_rows_in_use == 0


def test_the_cpu_reads_its_pages_and_they_are_not_loaded(six_layer_dir):
    """With every host page on the CPU, corrupting one streamed layer's host KV changes the
    tokens (the CPU read it), and the steps load nothing over the link but tails."""
    prompt = random_prompts(1, [40], seed=9)[0]
    ref = run(offload(six_layer_dir, "1"), [prompt])[0]
    llm = offload(six_layer_dir, "1")
    engine = llm.engine
    (seq,) = engine.add_request(prompt, GREEDY)
    while seq.num_output_tokens == 0:
        engine.step()
    engine.step()
    assert engine.kv.streamer.bytes_loaded == 0  # the CPU took every full page
    corrupt_host_kv(engine, 1, seq.pages[:seq.num_cached // 4])
    while not seq.is_finished:
        engine.step()
    assert seq.output_token_ids[:2] == ref[:2]  # sampled before the corruption
    assert seq.output_token_ids != ref


def test_preemption_with_the_split(six_layer_dir):
    prompts = random_prompts(4, [20, 25, 30, 18], seed=4)
    ref = run(llm_for(six_layer_dir), prompts)
    # 40 pages of 4 tokens for 4 sequences of ~50 tokens: decode must preempt
    llm = llm_for(six_layer_dir, enable_offload=True, resident_layers=2, cpu_attention="0.6",
                  host_kv_budget_gib=41 * STREAMED_PAGE_BYTES / 2**30)
    assert llm.engine.kv.capacity == 40
    assert run(llm, prompts) == ref
    assert llm.engine.scheduler.num_preemptions > 0


def test_shared_prefix_rows_with_the_split(six_layer_dir):
    """Rows on one cached document (prefix caching: the same host pages in every page table)
    give the tokens of offload off with the split."""
    doc = random_prompts(1, [48], seed=5)[0]
    prompts = [doc + q for q in random_prompts(4, [3, 9, 5, 14], seed=6)]
    ref = run(llm_for(six_layer_dir), prompts)
    llm = offload(six_layer_dir, "0.5")
    assert run(llm, prompts[:1]) == ref[:1]  # the document's pages are cached now
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert all(o.num_cached_tokens >= 44 for o in outs[1:])


def test_cpu_pages_per_row():
    """floor(fraction x full pages) per row; the tail (the page the step writes) never."""
    split = CpuSplit(fixed=0.5)
    assert [split.pages(0.5, n) for n in (0, 1, 3, 10)] == [0, 0, 1, 5]
    measured = CpuSplit(cpu_rate=80e9, link_rate=40e9, overhead=0.0)
    assert measured.fraction(10**8) == pytest.approx(2 / 3)
    assert measured.limit == pytest.approx(2 / 3)
    # a fixed cost per layer moves work to the link, the more the shorter the context
    slow = CpuSplit(cpu_rate=80e9, link_rate=40e9, overhead=100e-6)
    assert slow.fraction(10**8) == pytest.approx((2.5e-3 - 1e-4) / (2.5e-3 + 1.25e-3))
    assert slow.fraction(10**6) == 0.0
    # 16 rows on one document: the link moves its pages once, the CPU reads them 16 times
    assert measured.fraction(10**8, 16 * 10**8) == pytest.approx(1 / 9)
    with pytest.raises(ValueError):
        CpuSplit(fixed=1.5)


def test_calibration_from_what_the_host_saw():
    """A measured split takes the CPU rate just seen (averaged with the last). Where the CPU
    clearly set a layer's pace (its cycle, work plus gap, over 1.05x what the link needs),
    the overhead is the lower median of the last such gaps (a hiccup only lengthens one);
    where the cycle is under 0.9x, the gap was waiting for the link and the overhead
    decays; between, it drifts down slowly. A fixed split ignores all of it."""
    probe = CpuSplit(cpu_rate=80e9, link_rate=40e9, overhead=50e-6)
    one = probe.calibrated(gap=400e-6, work=1e-3, cpu_bytes=60 * 10**6)
    assert (one.cpu_rate, one.overhead, one.calibrated_steps) == (60e9, 400e-6, 1)
    two = one.calibrated(gap=600e-6, work=1e-3, cpu_bytes=40 * 10**6)
    assert two.cpu_rate == pytest.approx(50e9)
    assert two.overhead == pytest.approx(400e-6)  # the lower median of 400 and 600 us
    # CPU-paced: 40 MB cross the link in 1 ms, the cycle is 1.9 ms: the gap is overhead
    three = one.calibrated(gap=900e-6, work=1e-3, cpu_bytes=60 * 10**6, link_bytes=40 * 10**6)
    assert three.overhead == pytest.approx(400e-6)
    assert three.cpu_paced_gaps == (400e-6, 900e-6)
    # near the balance: 60 MB need 1.5 ms, the cycle is 1.45 ms: a slow drift down
    four = one.calibrated(gap=450e-6, work=1e-3, cpu_bytes=60 * 10**6, link_bytes=60 * 10**6)
    assert four.overhead == pytest.approx(DRIFT * 400e-6)
    assert four.cpu_paced_gaps == one.cpu_paced_gaps
    # link-paced: a 1.2 ms cycle where the link needs 1.5 ms: the overhead decays, more
    # goes to the CPU
    five = one.calibrated(gap=200e-6, work=1e-3, cpu_bytes=60 * 10**6, link_bytes=60 * 10**6)
    assert five.overhead == pytest.approx(DECAY * 400e-6)
    assert five.link_now == pytest.approx(50e9)  # and the link's rate is learned
    assert five.fraction(134 * 10**6) > replace(one, link_seen=five.link_seen).fraction(
        134 * 10**6)
    # a hiccup among steady gaps: the estimate holds
    steady = one
    for _ in range(4):
        steady = steady.calibrated(gap=400e-6, work=1e-3, cpu_bytes=60 * 10**6)
    assert steady.calibrated(gap=20e-3, work=1e-3, cpu_bytes=60 * 10**6).overhead == \
        pytest.approx(400e-6)
    # nor does one short gap (their least made the CPU's share too large)
    assert steady.calibrated(gap=100e-6, work=1e-3, cpu_bytes=60 * 10**6).overhead == \
        pytest.approx(400e-6)
    # a slower CPU and a larger overhead than the probe saw: less on the CPU
    assert two.fraction(134 * 10**6) < probe.fraction(134 * 10**6)
    fixed = CpuSplit(fixed=0.4)
    assert fixed.calibrated(1e-3, 1e-3, 10**6) is fixed
    assert probe.calibrated(1e-3, 0.0, 0) is probe  # nothing attended: nothing learned


def test_the_link_rate_a_step_reached():
    """The plan prices the link at the most of the probe's rates (alone and beside the CPU)
    and of the last steps' link bytes over their cycle, a rate the link reached whoever set
    the pace: a step that saw the link faster puts less on the CPU; a slow step lowers
    nothing; the window forgets. Pacing is still told at the rate beside the CPU."""
    probe = CpuSplit(cpu_rate=30e9, link_rate=45e9, link_alone=49e9, overhead=170e-6)
    assert probe.link_now == 49e9
    # 48 MB in a 0.9 ms cycle: 53.3 GB/s
    fast = probe.calibrated(gap=300e-6, work=600e-6, cpu_bytes=18 * 10**6,
                            link_bytes=48 * 10**6)
    assert fast.link_now == pytest.approx(48e6 / 0.9e-3)
    assert fast.fraction(69 * 10**6) < probe.fraction(69 * 10**6)
    assert fast.limit < probe.limit
    slow = fast.calibrated(gap=200e-6, work=1.3e-3, cpu_bytes=18 * 10**6,
                           link_bytes=48 * 10**6)
    assert slow.link_now == fast.link_now
    # that 1.5 ms cycle is over 1.05x the 1.07 ms 48 MB need at 45 GB/s: CPU-paced
    assert slow.cpu_paced_gaps == (200e-6,)
    for _ in range(GAPS_KEPT):
        fast = fast.calibrated(gap=200e-6, work=1.3e-3, cpu_bytes=18 * 10**6,
                               link_bytes=40 * 10**6)
    assert fast.link_now == probe.link_alone


def test_step_plan_skips_the_cpu_pages():
    class Seq:
        def __init__(self, n, pages):
            self.num_tokens, self.num_pending, self.pages = n, 0, pages
            self.token_ids = [1] * n
            self.seq_id = n

    from nanoserve.engine.scheduler import Batch

    seqs = [Seq(4 * 10 + 2, list(range(100, 111))), Seq(4 * 3, list(range(200, 203)))]
    builder = StepInputBuilder(4, torch.device("cpu"), tail_row=lambda s: 0,
                               cpu_split=CpuSplit(fixed=0.5), layer_page_bytes=1)
    step = builder.plan(Batch(False, seqs, [1, 1]))
    # row 0: writes token 41 (page 10), 10 full pages, 5 on the CPU; row 1: writes token 11
    # (page 2), 2 full pages, 1 on the CPU
    assert step.cpu_tokens.tolist() == [20, 4]
    assert step.arrays["gpu_starts"].tolist() == [20, 4]
    assert step.load_runs == [(105, 110), (201, 202)]
    assert np.array_equal(step.arrays["table"][1, :3], [200, 201, 202])


def test_cpu_attention_setting():
    assert EngineConfig(cpu_attention="0.25").cpu_attention_fraction == 0.25
    assert EngineConfig(cpu_attention="auto").cpu_attention_fraction is None
    for bad in ("1.5", "-0.1", "nan", "half"):
        with pytest.raises(ValueError, match="cpu_attention"):
            EngineConfig(cpu_attention=bad)
    # the flash backend merges no CPU share: a fraction is refused, auto (the default) is off
    assert EngineConfig(attention_backend="flash").cpu_attention == "auto"
    with pytest.raises(ValueError, match="cannot merge a CPU share"):
        EngineConfig(attention_backend="flash", cpu_attention="0.3")


def test_auto_is_the_default_and_off_on_a_cpu_device(six_layer_dir):
    """auto, the default, measures a split on a GPU; on a CPU device there is no link for
    the CPU to work beside, so it is off there (a fraction still splits, for tests)."""
    assert EngineConfig().cpu_attention == "auto"
    auto = offload(six_layer_dir, "auto")
    assert auto.engine.runner.cpu_share is None and auto.engine.runner.cpu_split is None
    assert "CPU attention" not in auto.engine.describe_memory()
    del auto
    llm = offload(six_layer_dir, "0.5")
    assert llm.engine.runner.cpu_split.fixed == 0.5
    assert "CPU attention: 50% of each row's host KV (fixed)" in llm.engine.describe_memory()
    kv = llm.engine.kv
    line = describe_streamed(kv, 3 * kv.plan.streamed_layers * kv.plan.layer_page_bytes, 1,
                             cpu_tokens=5 * 4)
    assert line.endswith("(3 pages of each streamed layer); the CPU attended 5 pages of each "
                         "streamed layer from host memory")
    assert llm.engine.runner.cpu_share.kernel.__name__ == \
        ("decode_cpp" if _extension() is not None else "decode_torch")


class _FakeEvent:
    """torch.cuda.Event's timing on the host clock: the CPU stand-in for the link's copies,
    which run synchronously there."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self, stream=None) -> None:
        import time

        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end) -> float:
        return max(end.t - self.t, 1e-9) * 1e3


def test_the_start_up_probe_measures_rates(six_layer_dir, monkeypatch):
    """measure_split, the `auto` probe of a CUDA engine, run on the CPU engine's store with the
    CUDA events standing in: positive rates both ways, the thread count it kept, its figures
    recorded for the bench."""
    from nanoserve.engine.cpu_split_setup import measure_split

    llm = offload(six_layer_dir, "0.5")
    runner = llm.engine.runner
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    threads = torch.get_num_threads()
    try:
        split = measure_split(runner.cpu_share, llm.engine.kv)
    finally:
        torch.set_num_threads(threads)
    assert split.fixed is None and split.cpu_rate > 0 and split.link_rate > 0
    assert 0.0 <= split.limit <= 1.0 and split.overhead > 0
    probe = runner.cpu_share.probe
    assert probe["threads"] in probe["threads_tried_GBps"]
    assert probe["cpu_alone_GBps"] > 0 and probe["link_both_GBps"] > 0
    # the probe's kernel calls left nothing behind: an inactive step uploads zeros, LSE -inf
    share = runner.cpu_share
    assert share.cleared and not share.o.any() and torch.isinf(share.lse).all()
