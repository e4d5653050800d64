"""FP8 KV cache (e4m3, a float32 scale per token and kv head) on the CPU: the quantizer's
round-trip bound, where scales live, the byte arithmetic, accuracy against bf16 KV on the
embedded model, offload on == off, and the needle with teeth in the scales."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import random_prompts
from helpers import corrupt_host_scales, engine_prefill_logits, make_llm
from test_needle import ALL_DEPTHS, CPU_LEN, format_table, run_needle

from nanoserve import LLM, SamplingParams
from nanoserve.attention.prefill import gather_kv
from nanoserve.kv import fp8
from nanoserve.kv.fp8 import dequantize, quantize
from nanoserve.kv.fp8_format import FP8, FP8_MAX, MIN_SCALE
from nanoserve.kv.spec import KVSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import fp8_accuracy  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
E4M3_HALF_STEP = 2.0**-4  # relative rounding error of a normal e4m3 value (3 mantissa bits)
E4M3_HALF_SUBNORMAL = 2.0**-10  # absolute, below e4m3's smallest normal 2^-6 (steps of 2^-9)
# e4m3 rounds 16x coarser than bf16 (3 mantissa bits against 7): an error bound in bf16 units
BF16_RATIO_BOUND = 20


# --- the quantizer -------------------------------------------------------------------------------

def test_round_trip_is_within_half_an_e4m3_step_of_every_value():
    g = torch.Generator().manual_seed(0)
    magnitude = 10.0 ** torch.randint(-6, 5, (64, 8, 1), generator=g).float()
    x = torch.randn(64, 8, 128, generator=g) * magnitude
    x[3, 2] = 0.0  # an all-zero (token, head)
    x[5, 1, 7] = 1e4 * x[5, 1].abs().max()  # an outlier sets its row's scale
    values, scales = quantize(x)
    assert values.dtype == FP8 and scales.dtype == torch.float32
    assert scales.shape == (64, 8) and torch.isfinite(values.float()).all()
    assert values.float().abs().max() <= FP8_MAX
    err = (dequantize(values, scales, torch.float32) - x).abs()
    bound = E4M3_HALF_STEP * x.abs() + E4M3_HALF_SUBNORMAL * scales[..., None] + 2**-22 * x.abs()
    assert (err <= bound).all(), (err - bound).max()
    assert scales[3, 2] == MIN_SCALE and (values[3, 2].float() == 0).all()
    # each row's largest value is e4m3's largest: the whole range is used
    assert (values.float().abs().amax(-1)[scales > MIN_SCALE] == FP8_MAX).all()


def test_each_token_and_head_has_its_own_scale():
    x = torch.randn(6, 4, 32, generator=torch.Generator().manual_seed(1))
    y = x.clone()
    y[2, 1] *= 1000.0
    (vx, sx), (vy, sy) = quantize(x), quantize(y)
    others = torch.ones(6, 4, dtype=torch.bool)
    others[2, 1] = False
    assert torch.equal(vx.view(torch.uint8)[others], vy.view(torch.uint8)[others])
    assert torch.equal(sx[others], sy[others])
    assert torch.equal(vx[2, 1].view(torch.uint8), vy[2, 1].view(torch.uint8))
    assert torch.isclose(sy[2, 1], sx[2, 1] * 1000.0, rtol=1e-6)


# --- layout and bytes ----------------------------------------------------------------------------

def test_scales_live_in_the_page_row_of_their_values():
    """One copy of a page row moves a page's values and scales: the host store, ring slots,
    tails and run copies need no second path."""
    spec = KVSpec(2, 4, 2, 16, FP8)
    kv = spec.empty(2, 5, torch.device("cpu"))
    assert kv.dtype == torch.uint8 and kv.shape == (2, 2, 5, spec.layout.row_bytes)
    k, v, k_scale, v_scale = spec.views(kv[1])
    g = torch.Generator().manual_seed(2)
    new_k, new_v = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    slots = torch.tensor([13, 6, 7])  # page 3 offset 1, page 1 offsets 2 and 3
    fp8.store(new_k, new_v, k, v, k_scale, v_scale, slots)
    want_values, want_scales = quantize(new_k)
    assert torch.equal(k[3, 1].view(torch.uint8), want_values[0].view(torch.uint8))
    assert torch.equal(k_scale[1, 2:4], want_scales[1:])
    copy = torch.zeros_like(kv)
    copy[1, :, 1] = kv[1, :, 1]  # page 1's rows, nothing else
    ck, _, ck_scale, _ = spec.views(copy[1])
    assert torch.equal(ck_scale[1], k_scale[1]) and torch.equal(ck[1].view(torch.uint8),
                                                                 k[1].view(torch.uint8))
    pages = torch.tensor([1, 3])
    got = gather_kv(k, pages, 6, k_scale, torch.float32)  # page 1's 4 tokens, page 3's first 2
    assert torch.equal(got[2:4], dequantize(want_values[1:], want_scales[1:], torch.float32))
    assert torch.equal(got[5], dequantize(want_values[0], want_scales[0], torch.float32))
    for start in (0, 3, 4, 5):  # a piece of the prefix: from mid-page, from a page's start
        assert torch.equal(gather_kv(k, pages, 6, k_scale, torch.float32, start), got[start:])


def test_byte_arithmetic_counts_fp8_values_and_their_scales():
    bf16 = KVSpec(36, 256, 8, 128, torch.bfloat16)  # the Qwen3-8B shape
    fp8_spec = KVSpec(36, 256, 8, 128, FP8)
    assert bf16.layer_token_bytes == 2 * 8 * 128 * 2
    assert fp8_spec.layer_token_bytes == 2 * 8 * (128 + 4)
    assert fp8_spec.page_bytes(1) == 2 * fp8_spec.layout.row_bytes == 256 * 2112
    # a 1M-token context: 151 GB in bf16, 78 GB in FP8 with scales
    assert round(bf16.token_bytes() * 2**20 / 1e9) == 155
    assert round(fp8_spec.token_bytes() * 2**20 / 1e9) == 80
    assert fp8_spec.token_bytes() / bf16.token_bytes() == pytest.approx(132 / 256)


def test_the_same_budgets_hold_more_fp8_pages_and_the_split_says_so(six_layer_dir):
    common = dict(max_num_seqs=8, max_model_len=256, enable_offload=True, resident_layers=2,
                  host_kv_budget_gib=100 * KVSpec(6, 4, 2, 16, torch.float32).page_bytes(4)
                  / 2**30)
    fp32 = make_llm(six_layer_dir, **common).engine.kv
    low = make_llm(six_layer_dir, kv_cache_dtype="fp8", **common).engine.kv
    assert fp32.capacity == 99  # page 0 is the dummy page
    # fp32 4-token pages of 2 kv heads x 16: 512 bytes per row; fp8: 128 + 32 scale bytes
    assert low.spec.layout.row_bytes == 160
    assert low.capacity == 100 * 512 // 160 - 1
    assert low.streamer.host.nbytes == low.plan.num_pages * low.spec.page_bytes(4)
    assert "fp8 e4m3" in low.describe() and f"{low.capacity} pages" in low.describe()


def test_settings_are_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, bfloat16 or fp8"):
        LLM(progress=False, device="cpu", kv_cache_dtype="fp9")
    with pytest.raises(ValueError, match="flash attention backend reads no FP8 KV"):
        LLM(progress=False, device="cpu", kv_cache_dtype="fp8", attention_backend="flash")


# --- accuracy against bf16 KV, the embedded model ------------------------------------------------

@pytest.fixture(scope="module")
def needle_prompts():
    llm = LLM(progress=False, device="cpu", dtype="float32", max_model_len=CPU_LEN + 1,
              max_num_seqs=1)
    from test_needle import needle_prompts as build

    return llm, [p.token_ids for p in build(llm, CPU_LEN, [0.1, 0.9], 1, seed=11)]


def test_attention_error_per_layer_is_bounded_by_bf16s(needle_prompts):
    """Each layer's attention output (the last 256 queries over 2,048 real keys) with FP8 K/V
    against float32 K/V: within 20x bf16 K/V's error and below 10% (measured: 2.9-6.7%, 14x
    bf16's), and never worse than one scale per page of 256 tokens."""
    llm, prompts = needle_prompts
    scale = llm.engine.runner.model.attention_layers[0].scale
    errors = fp8_accuracy.attention_errors(fp8_accuracy.capture_qkv(llm, prompts[0]), 256,
                                           scale)
    for layer, (e8, e16) in enumerate(zip(errors["fp8 per token"], errors["bf16"],
                                          strict=True)):
        assert e8 < 0.10 and e8 < BF16_RATIO_BOUND * e16, (layer, e8, e16)
    assert max(errors["fp8 per token"]) < max(errors["fp8 per page of 256"])


def test_logits_and_top1_agree_with_bf16_kv(needle_prompts):
    """Every prefill position of two needle prompts (4,096 logit rows): FP8 KV's logits within
    20x bf16 KV's error against float32 KV and below 8% (measured 4.3%), top-1 equal to bf16
    KV's on >= 99% of positions (measured 99.6%)."""
    _, prompts = needle_prompts
    agree = fp8_accuracy.logit_agreement(None, "cpu", prompts)
    assert agree["positions"] == 2 * CPU_LEN
    assert agree["rel_fp8"] < 0.08 and agree["rel_fp8"] < BF16_RATIO_BOUND * agree["rel_bf16"]
    assert agree["top1_fp8_vs_bf16"] >= 0.99


def test_chunked_prefill_agrees_with_unchunked_in_fp8():
    """A chunk attends to its own K/V as stored, as decode does, so chunking moves the logits
    only by float32 noise (measured 1.5e-5 relative: the noise flips an e4m3 rounding here and
    there). Letting a chunk see its own K/V unquantized, as vLLM does, moves them by 0.9%."""
    llm = LLM(progress=False, device="cpu", dtype="float32", kv_cache_dtype="fp8",
              max_model_len=600, max_num_seqs=1)
    ids = random_prompts(1, [512], vocab=256, seed=5)[0]
    whole = engine_prefill_logits(llm, ids)
    chunked = engine_prefill_logits(llm, ids, chunk=96)
    assert ((whole - chunked).norm() / whole.norm()).item() < 1e-4
    assert torch.equal(whole.argmax(-1), chunked.argmax(-1))


# --- offload on == off, and the needle -----------------------------------------------------------


def fp8_llm(path, **kw):
    return make_llm(path, kv_cache_dtype="fp8", max_num_batched_tokens=7, max_num_seqs=8,
                    max_model_len=256, **kw)


@pytest.mark.parametrize("resident, slots", [(0, 2), (2, 2), (1, 3)],
                         ids=["all-streamed", "split", "split-3-slots"])
def test_fp8_offload_gives_the_same_tokens_as_resident(six_layer_dir, resident, slots):
    """Layers split, and more streamed layers than slots; prompts end mid-page and mid-chunk,
    decode crosses pages (tails fill and go home with their scales)."""
    prompts = random_prompts(4, [19, 6, 33, 12], seed=21)
    ref = [o.token_ids for o in fp8_llm(six_layer_dir).generate(prompts, GREEDY)]
    llm = fp8_llm(six_layer_dir, enable_offload=True, resident_layers=resident,
                  num_kv_buffers=slots, host_kv_budget_gib=0.01)
    kv = llm.engine.kv
    assert kv.plan.streamed_layers == 6 - resident and kv.streamer.host.data.dtype == torch.uint8
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    assert kv.num_free == kv.capacity and kv.tail_rows_in_use == 0


def fp8_needle_llm(**kw) -> LLM:
    return LLM(progress=False, device="cpu", dtype="float32", page_size=16, kv_cache_dtype="fp8",
               max_model_len=CPU_LEN + 32, max_num_seqs=2, **kw)


@pytest.fixture(scope="module")
def fp8_offload_llm():
    llm = fp8_needle_llm(enable_offload=True, resident_layers=2)
    assert llm.engine.kv.plan.streamed_layers == 2
    return llm


def test_needle_found_at_every_depth_in_fp8_with_offload(fp8_offload_llm):
    results = run_needle(fp8_offload_llm, CPU_LEN, ALL_DEPTHS, seed=1)
    assert all(r.passed for r in results), format_table(results)
    ref = run_needle(fp8_needle_llm(), CPU_LEN, ALL_DEPTHS, seed=1)
    assert [r.token_ids for r in results] == [r.token_ids for r in ref]


def zero_needle_scales(llm: LLM, seq, first_token: int, last_token: int) -> None:
    ps = llm.engine.kv.spec.page_size
    pages = seq.pages[first_token // ps:(last_token - 1) // ps + 1]
    for layer in range(llm.engine.kv.plan.streamed_layers):
        corrupt_host_scales(llm.engine, layer, pages, 0.0)


def test_zeroing_the_needle_pages_scales_in_the_host_store_fails_those_depths(fp8_offload_llm):
    """Teeth: attention reads the scales that came through the host store with the values
    (values untouched here); the same corruption away from the needle changes nothing."""
    def at_needle(seq, p):
        zero_needle_scales(fp8_offload_llm, seq, p.needle_start, p.needle_start + p.needle_len)

    broken = run_needle(fp8_offload_llm, CPU_LEN, [0.1, 0.5, 0.9], seed=2,
                        after_prefill=at_needle)
    assert not any(r.passed for r in broken), format_table(broken)

    def elsewhere(seq, p):
        far = p.needle_start + (700 if p.needle_start < CPU_LEN // 2 else -700)
        zero_needle_scales(fp8_offload_llm, seq, far, far + p.needle_len)

    intact = run_needle(fp8_offload_llm, CPU_LEN, [0.1, 0.5, 0.9], seed=2,
                        after_prefill=elsewhere)
    assert all(r.passed for r in intact), format_table(intact)


@pytest.mark.parametrize("capability, name, refused", [((8, 0), "NVIDIA A100-SXM4-80GB", True),
                                                      ((8, 6), "NVIDIA GeForce RTX 3090", True),
                                                      ((8, 9), "NVIDIA L40S", False),
                                                      ((9, 0), "NVIDIA H100 80GB HBM3", False)])
def test_fp8_kv_on_a_gpu_whose_kernels_cannot_read_e4m3_is_refused_by_name(
        monkeypatch, capability, name, refused):
    """Before compute capability 8.9 Triton has no e4m3 (the KV store and decode kernels fail
    to compile with "type fp8e4nv not supported"): the engine refuses FP8 KV at start, naming
    the GPU, its capability and what to use; from 8.9 on, and on the CPU, it proceeds."""
    from nanoserve.kv.fp8_format import check_device_reads_fp8
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    check_device_reads_fp8(torch.device("cpu"))
    if not refused:
        check_device_reads_fp8(torch.device("cuda", 0))
        return
    with pytest.raises(ValueError) as e:
        check_device_reads_fp8(torch.device("cuda", 0))
    assert str(e.value) == (
        f"kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper, "
        f"Blackwell), whose kernels read e4m3; {name} is {capability[0]}.{capability[1]}: use "
        f"kv_cache_dtype auto (the model's dtype)")


@pytest.mark.parametrize("kv_cache_dtype, asked", [("fp8", True), ("auto", False)])
def test_the_engine_asks_whether_its_device_reads_fp8_before_building_fp8_kv(
        monkeypatch, kv_cache_dtype, asked):
    """The refusal above is wired in: an engine with FP8 KV asks for its device at start (a
    refusal there stops the engine with that ValueError), one with the model's dtype does
    not ask."""
    from nanoserve.engine import model_runner
    seen = []

    def refuse(device):
        seen.append(device)
        raise ValueError("refused for the test")

    monkeypatch.setattr(model_runner, "check_device_reads_fp8", refuse)
    if asked:
        with pytest.raises(ValueError, match="refused for the test"):
            make_llm(None, kv_cache_dtype=kv_cache_dtype)
        assert seen == [torch.device("cpu")]
    else:
        make_llm(None, kv_cache_dtype=kv_cache_dtype)
        assert seen == []


@pytest.mark.parametrize("sms", [78, 108, 114, 132, 142])
def test_cuda_fp8_decode_launches_at_most_one_block_an_sm(sms):
    """A quarter of num_splits_for's 4 waves, rounded down: one wave of one block an SM, never a
    few blocks past it (those SMs take two and the step waits for them); at least 2 splits."""
    from nanoserve.attention.cuda_fp8_decode import num_splits

    for batch in range(1, 9):
        for kv_heads in (1, 2, 4, 8):
            four_waves = 4 * sms // (batch * kv_heads)  # num_splits_for's count, uncapped
            splits = num_splits(four_waves, 0.25)
            assert splits >= 2
            assert batch * kv_heads * splits <= sms or splits == 2, (batch, kv_heads, splits)
    assert (num_splits(66, 0.25), num_splits(66, 0.5), num_splits(3, 0.25)) == (16, 33, 2)
