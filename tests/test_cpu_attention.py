"""CPU decode attention over paged host KV (nanoserve/attention/cpu_decode.py): both kernels
against a float64 reference, for bf16, fp16, fp32 and FP8 (e4m3 with its scales) pages, GQA,
a batch whose sequences attend token ranges that start and end mid-page (and an empty one),
and the split of a context's tokens between two calls merging to the whole, exactly."""

from __future__ import annotations

import math
import time

import pytest
import torch
from helpers import random_layer_rows

from nanoserve.attention.cpu_decode import (
    KINDS,
    _extension,
    cpu_decode_kernel,
    decode_cpp,
    decode_torch,
    share_worker,
)
from nanoserve.attention.prefill import merge_partials
from nanoserve.kv.fp8_format import FP8
from nanoserve.kv.spec import KVSpec

PAGE, KV_HEADS, Q_HEADS, D, PAGES = 16, 2, 8, 64, 24
SCALE = 1 / math.sqrt(D)
RANGES = [(0, 100), (5, 77), (30, 30), (17, 160)]  # [start, end) per sequence; one empty


def make_layer(dtype: torch.dtype, seed: int = 0) -> tuple[KVSpec, torch.Tensor]:
    """One layer's host rows [2, pages, row], filled with random K and V (FP8: quantized,
    a scale per token and kv head)."""
    spec = KVSpec(1, PAGE, KV_HEADS, D, dtype)
    return spec, random_layer_rows(spec, PAGES, torch.Generator().manual_seed(seed), std=2.0)


def inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(RANGES), Q_HEADS, D, generator=g)
    width = -(-max(e for _, e in RANGES) // PAGE)
    table = torch.stack([torch.randperm(PAGES, generator=g)[:width] for _ in RANGES]).int()
    starts = torch.tensor([s for s, _ in RANGES], dtype=torch.int32)
    ends = torch.tensor([e for _, e in RANGES], dtype=torch.int32)
    return q, table, starts, ends


def reference(spec: KVSpec, rows, q, table, starts, ends):
    """float64, from the dequantized values, one sequence and query head at a time."""
    k, v, k_scale, v_scale = spec.views(rows)
    k, v = k.double(), v.double()
    if k_scale is not None:
        k, v = k * k_scale[..., None].double(), v * v_scale[..., None].double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64)
    for b, (lo, hi) in enumerate(RANGES):
        if hi <= lo:
            continue
        t = torch.arange(lo, hi)
        pages, r = table[b].long()[t // PAGE], t % PAGE
        for h in range(Q_HEADS):
            kv_head = h // (Q_HEADS // KV_HEADS)
            s = (k[pages, r, kv_head] @ q[b, h].double()) * SCALE
            lse[b, h] = s.logsumexp(0)
            out[b, h] = s.softmax(0) @ v[pages, r, kv_head]
    return out, lse


def kernels() -> list[str]:
    return ["torch", "cpp"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, FP8])
@pytest.mark.parametrize("name", kernels())
def test_kernels_match_float64(name, dtype):
    if name == "cpp" and _extension() is None:
        pytest.skip("no C++ compiler here: the torch kernel serves (tested above)")
    spec, rows = make_layer(dtype)
    q, table, starts, ends = inputs()
    _, kernel = cpu_decode_kernel(name)
    out, lse = kernel(q, rows, spec.layout, table, starts, ends, SCALE)
    ref_out, ref_lse = reference(spec, rows, q, table, starts, ends)
    empty = [i for i, (s, e) in enumerate(RANGES) if e <= s]
    assert torch.isinf(lse[empty]).all() and (out[empty] == 0).all()
    full = [i for i, (s, e) in enumerate(RANGES) if e > s]
    assert (out[full].double() - ref_out[full]).abs().max().item() < 1e-4
    assert (lse[full].double() - ref_lse[full]).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", kernels())
def test_a_split_context_merges_to_the_whole(name):
    """The CPU's share [start, m) and the rest [m, end) merge by log-sum-exp to [start, end):
    no token is lost or counted twice."""
    if name == "cpp" and _extension() is None:
        pytest.skip("no C++ compiler here: the torch kernel serves")
    spec, rows = make_layer(FP8, seed=3)
    q, table, starts, ends = inputs(seed=4)
    _, kernel = cpu_decode_kernel(name)
    whole, whole_lse = kernel(q, rows, spec.layout, table, starts, ends, SCALE)
    mid = torch.div(starts + ends, 2, rounding_mode="floor").int()
    a, a_lse = kernel(q, rows, spec.layout, table, starts, mid, SCALE)
    b, b_lse = kernel(q, rows, spec.layout, table, mid, ends, SCALE)
    full = [i for i, (s, e) in enumerate(RANGES) if e - s >= 2]
    merged = merge_partials(a[full], a_lse[full], b[full], b_lse[full])
    assert (merged - whole[full]).abs().max().item() < 1e-5
    assert (torch.logaddexp(a_lse, b_lse)[full] - whole_lse[full]).abs().max().item() < 1e-5


def test_the_reference_kernel_is_the_fallback_and_names_are_checked():
    name, kernel = cpu_decode_kernel("auto")
    assert name == ("cpp" if _extension() is not None else "torch")
    assert cpu_decode_kernel("torch")[1] is decode_torch
    with pytest.raises(ValueError, match="unknown CPU attention kernel 'avx'"):
        cpu_decode_kernel("avx")


@pytest.mark.parametrize("kv_heads, q_heads, d", [
    (2, 16, 128),  # group 8: the compiled-in layout
    (3, 9, 64),  # group 3: the runtime-group loops
    (2, 4, 256),  # group 2, head_dim 256
    (1, 12, 32),  # group 12, head_dim 32: the plain-loop fallback
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, FP8])
def test_cpp_kernel_across_group_sizes_and_head_dims(kv_heads, q_heads, d, dtype):
    """Each of the C++ kernel's code paths against float64: jobs of every sequence in the
    batch, ranges that start and end mid-block and mid-page, every (token, q head) dot."""
    if _extension() is None:
        pytest.skip("no C++ compiler here: the torch kernel serves")
    page, pages = 16, 20
    spec = KVSpec(1, page, kv_heads, d, dtype)
    g = torch.Generator().manual_seed(kv_heads * 1000 + q_heads + d)
    rows = random_layer_rows(spec, pages, g)
    k, v, k_scale, v_scale = spec.views(rows)
    ranges = [(3, 291), (0, 1), (40, 77)]
    q = torch.randn(len(ranges), q_heads, d, generator=g)
    table = torch.stack([torch.randperm(pages, generator=g) for _ in ranges]).int()
    starts = torch.tensor([a for a, _ in ranges], dtype=torch.int32)
    ends = torch.tensor([b for _, b in ranges], dtype=torch.int32)
    out, lse = cpu_decode_kernel("cpp")[1](q, rows, spec.layout, table, starts, ends,
                                           d**-0.5)
    kd, vd = k.double(), v.double()
    if k_scale is not None:
        kd, vd = kd * k_scale[..., None].double(), vd * v_scale[..., None].double()
    for b, (lo, hi) in enumerate(ranges):
        t = torch.arange(lo, hi)
        p, r = table[b].long()[t // page], t % page
        for h in range(q_heads):
            kv = h // (q_heads // kv_heads)
            s = (kd[p, r, kv] @ q[b, h].double()) * d**-0.5
            assert abs(lse[b, h].item() - s.logsumexp(0).item()) < 1e-4
            ref = s.softmax(0) @ vd[p, r, kv]
            assert (out[b, h].double() - ref).abs().max().item() < 1e-4


def test_cpp_kernel_refuses_a_range_past_the_page_table():
    if _extension() is None:
        pytest.skip("no C++ compiler here")
    spec, rows = make_layer(torch.bfloat16)
    q, table, starts, ends = inputs()
    ends[0] = table.shape[1] * PAGE + 1  # one token past the row's last page
    with pytest.raises(RuntimeError, match="row 0 attends tokens past its page table"):
        cpu_decode_kernel("cpp")[1](q, rows, spec.layout, table, starts, ends, SCALE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, FP8])
def test_the_build_for_cpus_without_avx512_matches_float64(dtype):
    """A CPU without AVX-512 (AVX2 servers) compiles the kernel's portable loops only: built
    here with -mno-avx512f, they match float64 too (the file once failed to compile so)."""
    if _extension() is None:
        pytest.skip("no C++ compiler here")
    ext = _extension(without_avx512=True)
    assert ext is not None, "the kernel builds for this CPU but not without AVX-512"
    spec, rows = make_layer(dtype)
    q, table, starts, ends = inputs()
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:2])
    assert ext.decode(q, rows, table, starts, ends, KINDS[dtype], PAGE, KV_HEADS,
                      spec.layout.scales_start, SCALE, out, lse) == ""
    ref_out, ref_lse = reference(spec, rows, q, table, starts, ends)
    full = [i for i, (s, e) in enumerate(RANGES) if e > s]
    assert (out[full].double() - ref_out[full]).abs().max().item() < 1e-4
    assert (lse[full].double() - ref_lse[full]).abs().max().item() < 1e-4
    empty = [i for i, (s, e) in enumerate(RANGES) if e <= s]
    assert torch.isinf(lse[empty]).all() and (out[empty] == 0).all()


def _await(flag: torch.Tensor, value: int, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while int(flag) != value:
        assert time.monotonic() < end, f"the worker never set the flag to {value}"
        time.sleep(1e-4)


@pytest.mark.parametrize("warm", [True, False])
def test_the_share_worker_serves_each_flagged_layer_in_order(warm):
    """The host's thread (csrc/cpu_decode.cpp ShareWorker), with this test as the GPU: it
    serves the submitted step whose number reaches layer 0's q flag (a step submitted but
    never run is dropped), runs a layer only once its q flag says so, writes the kernel's
    output, then the done flag; each served step's figures come back once; a failing kernel
    still releases the GPU; a step left mid-way does not hold the worker. With and without
    warming the next layer's share while it waits."""
    if _extension() is None:
        pytest.skip("no C++ compiler here")
    spec = KVSpec(1, PAGE, KV_HEADS, D, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    host_kv = torch.stack([random_layer_rows(spec, PAGES, g) for _ in range(3)])
    q, table, _, _ = inputs()
    q, table = q[:2].contiguous(), table[:2].contiguous()
    ends = torch.tensor([100, 0], dtype=torch.int32)
    o, lse = torch.zeros_like(q), torch.zeros(q.shape[:2])
    q_flags, done = torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    worker = share_worker(q, o, lse, host_kv, q_flags, done, spec.layout, SCALE, 1, warm)
    try:
        worker.submit(4, ends, table)  # never reaches the GPU
        worker.submit(5, ends, table)
        for layer in range(3):
            q_flags[layer] = 5
            _await(done[layer], 5)
            want_o, want_lse = decode_cpp(q, host_kv[layer], spec.layout, table,
                                          torch.zeros(2, dtype=torch.int32), ends, SCALE)
            assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
            assert lse[1].eq(-math.inf).all() and o[1].eq(0).all()  # no CPU tokens
            if layer < 2:  # the next layer waits for its q
                time.sleep(0.05)
                assert int(done[layer + 1]) == 0
        stats = worker.drain()
        assert len(stats) == 1 and stats[0][2] == 100 and stats[0][1] > 0
        assert worker.drain() == [] and worker.error() == ""
        # a row past its page table: zeros, the done flags all the same, the error kept
        worker.submit(6, torch.tensor([PAGE * table.shape[1] + 1, 0], dtype=torch.int32),
                      table)
        for layer in range(3):
            q_flags[layer] = 6
            _await(done[layer], 6)
        assert o.eq(0).all() and lse.eq(-math.inf).all()
        assert "past its page table" in worker.error()
        # a step left after its first layer (the engine raised mid-step): the next step's
        # first flag releases the worker, which serves that step whole
        worker.submit(7, ends, table)
        q_flags[0] = 7
        _await(done[0], 7)
        worker.submit(8, ends, table)
        for layer in range(3):
            q_flags[layer] = 8
            _await(done[layer], 8)
        assert torch.equal(lse[1], torch.full((Q_HEADS,), -math.inf))
    finally:
        worker.close()
