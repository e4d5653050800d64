"""Offload on the CPU (CPU memory stands in for both tiers; copies are synchronous):
streamed layers give exactly the tokens of resident ones."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from helpers import corrupt_host_kv, make_llm

from nanoserve import SamplingParams
from nanoserve.kv.spec import KVSpec
from offload import coalesce_runs, plan_residency

GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
# one 4-token page of the 4 streamed layers (resident_layers=2 of 6), fp32
STREAMED_PAGE_BYTES = KVSpec(6, 4, 2, 16, torch.float32).page_bytes(num_layers=4)



def offload_llm(path, **kw):
    return make_llm(path, max_num_batched_tokens=7, max_num_seqs=8, max_model_len=256, **kw)


def run(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("resident, slots", [(0, 2), (2, 2), (5, 2), (1, 3)])
@pytest.mark.parametrize("batch", [1, 4])
def test_offload_gives_the_same_tokens_as_resident(six_layer_dir, resident, slots, batch):
    # prompts end mid-page and mid-chunk; 30 new tokens cross several page boundaries
    prompts = random_prompts(batch, [19, 6, 33, 12], seed=batch)
    ref = run(offload_llm(six_layer_dir), prompts)
    llm = offload_llm(six_layer_dir, enable_offload=True, resident_layers=resident,
                   num_kv_buffers=slots, host_kv_budget_gib=0.01)
    kv = llm.engine.kv
    assert kv.plan.resident_layers == resident
    assert kv.streamer.num_slots == min(slots, 6 - resident)
    assert run(llm, prompts) == ref
    assert kv.num_free == kv.capacity  # every host (and GPU) page returned
    assert kv.tail_rows_in_use == 0  # every tail row returned


def test_offload_with_preemption_gives_the_same_tokens(six_layer_dir):
    prompts = random_prompts(4, [20, 25, 30, 18], seed=4)
    ref = run(offload_llm(six_layer_dir), prompts)
    # 40 pages of 4 tokens for 4 sequences of ~50 tokens: decode must preempt
    llm = offload_llm(six_layer_dir, enable_offload=True, resident_layers=2, num_kv_buffers=2,
                   host_kv_budget_gib=41 * STREAMED_PAGE_BYTES / 2**30)
    assert llm.engine.kv.capacity == 40
    assert run(llm, prompts) == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.num_free == 40


def test_streamed_kv_is_what_attention_reads(six_layer_dir):
    """Corrupting one streamed layer's host KV after prefill changes the tokens: the equality
    tests above really compare data that went through the host store."""
    prompt = random_prompts(1, [30], seed=9)[0]
    clean = offload_llm(six_layer_dir, enable_offload=True, resident_layers=3)
    ref = run(clean, [prompt])[0]
    llm = offload_llm(six_layer_dir, enable_offload=True, resident_layers=3)
    engine = llm.engine
    (seq,) = engine.add_request(prompt, GREEDY)
    while seq.num_output_tokens == 0:
        engine.step()
    corrupt_host_kv(engine, 1, seq.pages[:seq.num_cached // 4])
    while not seq.is_finished:
        engine.step()
    assert seq.output_token_ids[0] == ref[0]  # sampled before the corruption
    assert seq.output_token_ids != ref


def test_offload_with_room_for_everything_streams_nothing(six_layer_dir):
    llm = offload_llm(six_layer_dir, enable_offload=True, host_kv_budget_gib=0.01)
    assert llm.engine.kv.plan.resident_layers == 6
    assert llm.engine.kv.streamer is None


def test_request_larger_than_both_budgets_is_refused_naming_them(six_layer_dir):
    llm = offload_llm(six_layer_dir, enable_offload=True, resident_layers=2,
                   host_kv_budget_gib=11 * STREAMED_PAGE_BYTES / 2**30)
    outs = llm.generate(random_prompts(2, [60, 10]), GREEDY)
    assert "GPU KV budget" in outs[0].error and "host KV budget" in outs[0].error
    assert outs[1].error is None and outs[1].token_ids == run(offload_llm(six_layer_dir),
                                                             [random_prompts(2, [60, 10])[1]])[0]


def test_coalesce_runs_merges_consecutive_pages():
    assert coalesce_runs([3, 4, 5, 9, 10, 2]) == [(3, 6), (9, 11), (2, 3)]
    assert coalesce_runs([]) == []


def test_plan_keeps_as_many_layers_resident_as_fit():
    mib = 1 << 20
    # 36 layers, 1 MiB per page per layer, 129 pages wanted, 1 GiB GPU, big host
    plan = plan_residency(36, mib, 129, 1024 * mib, 64 * 1024 * mib, 2, 2 * mib)
    assert (plan.resident_layers + 2) * 129 * mib + plan.streamed_layers * 2 * mib <= 1024 * mib
    assert (plan.resident_layers + 3) * 129 * mib + (plan.streamed_layers - 1) * 2 * mib > \
        1024 * mib
    assert plan.num_pages == 129 and plan.resident_layers == 5
    everything = plan_residency(36, mib, 129, 36 * 129 * mib, 0, 2, 2 * mib)
    assert everything.resident_layers == 36 and not everything.offloading
    with pytest.raises(ValueError, match="KV budgets too small"):
        plan_residency(36, mib, 129, 2 * mib, 64 * 1024 * mib, 2, 2 * mib)


def test_a_small_device_budget_streams_layers_on_the_cpu_with_the_same_tokens(six_layer_dir):
    """The device KV budget applies on the CPU too: one that holds 2 layers' pages beside the
    ring slots (2) and the streamed layers' tails streams the other 4, and greedy tokens equal
    offload off. 513 pages wanted (8 sequences x 64 + the dummy page), 9 tail rows a layer."""
    lpb = KVSpec(6, 4, 2, 16, torch.float32).page_bytes(num_layers=1)  # 1,024 bytes
    fits_2, fits_3 = ((r + 2) * 513 * lpb + (6 - r) * 9 * lpb for r in (2, 3))
    prompts = random_prompts(4, [19, 6, 33, 12], seed=5)
    ref = run(offload_llm(six_layer_dir), prompts)
    for budget, resident in ((fits_2, 2), (fits_3 - 1, 2), (fits_2 - 1, 1)):
        llm = offload_llm(six_layer_dir, enable_offload=True, gpu_kv_budget_gib=budget / 2**30)
        kv = llm.engine.kv
        assert (kv.plan.resident_layers, kv.plan.streamed_layers) == (resident, 6 - resident)
        assert run(llm, prompts) == ref
    split = llm.engine.describe_memory().splitlines()[0]
    assert split.endswith("; 1 of 6 layers resident, 5 streamed, 2.62 MB per decode step at "
                          "full capacity (512 pages)")  # 5 layers x 512 pages x 1,024 bytes
