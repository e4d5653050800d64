"""Prefill attention (nanoserve/attention/prefill.py) against a float64 reference: a chunk over
its cached prefix and itself, split in two and merged by log-sum-exp; paged, several sequences
per step; the FA2 varlen path; chunked prefill against unchunked in the engine."""

from __future__ import annotations

import pytest
import torch
from conftest import GPU_SHAPE, make_hf_model, random_prompts
from helpers import engine_prefill_logits, make_gpu_llm, make_llm

from nanoserve.attention.prefill import (
    causal_plan_lengths,
    chunk_attention,
    merge_partials,
    pad_queries,
    padded_rows,
    paged_prefill,
    use_varlen,
    varlen_prefill,
)
from nanoserve.context import ForwardContext

gpu = pytest.mark.gpu


def reference(q, k, v, prefix_len, scale):
    """float64: T queries over prefix_len + T keys, causal from the bottom-right corner."""
    t = q.shape[0]
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = torch.einsum("thd,shd->hts", q.double(), k) * scale
    visible = torch.ones(t, prefix_len + t, dtype=torch.bool, device=q.device).tril(prefix_len)
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v)


def random_qkv(t, p, heads, kv_heads, d, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(t, heads, d, dtype=dtype, device=device, generator=g)
    k = torch.randn(p + t, kv_heads, d, dtype=dtype, device=device, generator=g)
    v = torch.randn(p + t, kv_heads, d, dtype=dtype, device=device, generator=g)
    return q, k, v


CASES = [(t, p, h, hkv) for t, p in ((1, 0), (5, 0), (64, 0), (1, 1), (5, 7), (64, 100),
                                      (33, 3))
         for h, hkv in ((8, 8), (8, 2), (8, 1))]


@pytest.fixture(params=["one-kernel", "split", "pieces", "pieces-split"])
def route(request, monkeypatch):
    """Every route of a chunk with a prefix: one SDPA call (small work), or split and merged;
    the prefix read in pieces of 5 tokens (most cases' prefixes take several, the last one
    short, starting mid-page in the paged cases), small work through the planless kernel or
    all through the split route's."""
    if request.param.endswith("split"):
        monkeypatch.setattr("nanoserve.attention.prefill.SPLIT_MIN_WORK", 0)
    if request.param.startswith("pieces"):
        monkeypatch.setattr("nanoserve.attention.prefill.PREFIX_PIECE", 5)
    return request.param


@pytest.mark.parametrize("t,p,heads,kv_heads", CASES)
def test_chunk_attention_cpu_matches_float64(t, p, heads, kv_heads, route):
    q, k, v = random_qkv(t, p, heads, kv_heads, 16, torch.float32, "cpu", t * 100 + p)
    out = chunk_attention(q, k[p:], v[p:], k[:p], v[:p], 0.25)
    err = (out.double() - reference(q, k, v, p, 0.25)).abs().max().item()
    assert err < 1e-5, err


def test_padded_rows_bounds_the_plan_shapes():
    """cuDNN plans are built per shape: every length maps to a padded length at most a quarter
    (or 32 rows) longer, padded lengths map to themselves, and 1..8192 tokens take 28 shapes."""
    assert [padded_rows(t) for t in (1, 32, 33, 100, 129, 1000, 3000, 5000, 8191, 8192)] == \
        [32, 32, 64, 128, 160, 1024, 3072, 5120, 8192, 8192]
    for t in range(1, 20000):
        p = padded_rows(t)
        assert t <= p < t + max(32, t / 4) and padded_rows(p) == p, t
    assert len({padded_rows(t) for t in range(1, 8193)}) == 28


@pytest.mark.parametrize("max_tokens", [1, 31, 33, 1000, 8192, 10000])
def test_the_plans_built_at_start_cover_every_chunk_length(max_tokens):
    assert causal_plan_lengths(max_tokens) == \
        sorted({padded_rows(t) for t in range(1, max_tokens + 1)})


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("t", [1, 33, 100, 129, 300])
def test_padded_queries_leave_the_real_rows_exact(causal, t):
    """The real queries' attention over the padded inputs equals theirs over the real ones
    (float64): padding rows come after them, and causal from the top left hides the padded keys
    from every real query."""
    s = t if causal else 50  # keys: the chunk's own (causal) or a prefix's
    g = torch.Generator().manual_seed(t)
    q = torch.randn(t, 4, 8, dtype=torch.float64, generator=g)
    k, v = torch.randn(2, s, 2, 8, dtype=torch.float64, generator=g)

    def attend(q, k, v):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("thd,shd->hts", q, k)
        if causal:
            visible = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
            scores = scores.masked_fill(~visible, float("-inf"))
        return torch.einsum("hts,shd->thd", scores.softmax(-1), v)

    qp, kp, vp = pad_queries(q, k, v, causal)
    assert qp.shape[0] == padded_rows(t) and kp.shape[0] == (padded_rows(t) if causal else s)
    assert torch.equal(qp[:t], q) and torch.equal(kp[:s], k) and torch.equal(vp[:s], v)
    assert (attend(qp, kp, vp)[:t] - attend(q, k, v)).abs().max() < 1e-12


@pytest.mark.parametrize("t", [64, 100])  # already a padded length, and padded
def test_padded_queries_come_back_contiguous(t):
    """cuDNN's plans are keyed by strides too: q, k, v reach it contiguous, as they do when the
    plans are built at start, even when v is a view into a wider projection."""
    qkv = torch.randn(t, 12 * 8)
    q, k, v = qkv[:, :64].view(t, 8, 8), qkv[:, 64:80].view(t, 2, 8), qkv[:, 80:].view(t, 2, 8)
    assert not v.is_contiguous()
    for x in pad_queries(q, k, v, True):
        assert x.is_contiguous() and x.shape[0] == padded_rows(t)


def test_prefill_plans_cover_chunks_up_to_the_step_or_the_model_length(monkeypatch):
    """The engine builds plans for chunks as long as a step can hold: max_num_batched_tokens,
    or max_model_len when shorter; with the layer's (this rank's) head counts."""
    llm = make_llm(None, max_model_len=300)
    runner = llm.engine.runner
    seen = []
    monkeypatch.setattr(runner.backend, "build_prefill_plans", lambda *a: seen.append(a))
    runner.build_prefill_plans()
    attn = runner.model.attention_layers[0]
    assert seen == [(attn.num_heads, attn.num_kv_heads, runner.mcfg.head_dim, torch.float32,
                     torch.device("cpu"), 300, False)]


def test_merge_of_two_halves_is_order_free_and_exact():
    """Merging attention over keys [0, a) and [a, n) gives attention over [0, n), for every
    split point, in either order."""
    from nanoserve.attention.prefill import attention_with_lse

    q, k, v = random_qkv(6, 20, 4, 2, 8, torch.float64, "cpu", 3)
    q = q.float()
    k, v = k.float(), v.float()
    whole, _ = attention_with_lse(q, k, v, False, 0.3)
    for a in (1, 7, 19, 25):
        o1, l1 = attention_with_lse(q, k[:a], v[:a], False, 0.3)
        o2, l2 = attention_with_lse(q, k[a:], v[a:], False, 0.3)
        l1, l2 = l1.t(), l2.t()
        assert (merge_partials(o1, l1, o2, l2) - whole).abs().max() < 1e-6
        assert (merge_partials(o2, l2, o1, l1) - whole).abs().max() < 1e-6


class _Layer:
    def __init__(self, k_cache, v_cache, scale):
        self.k_cache, self.v_cache, self.scale = k_cache, v_cache, scale
        self.k_scale = self.v_scale = None


def paged_case(query_lens, prefix_lens, heads, kv_heads, d, page_size, dtype, device, seed):
    """Sequences whose prefix + chunk KV sit in scattered pages; returns the step's q, k, v,
    the layer, its context and each sequence's full (q, k, v) for the reference."""
    g = torch.Generator(device=device).manual_seed(seed)
    need = [-(-(p + t) // page_size) for t, p in zip(query_lens, prefix_lens, strict=True)]
    num_pages = sum(need) + 1
    k_cache = torch.zeros(num_pages, page_size, kv_heads, d, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    perm = (torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)) + 1)
    table = torch.zeros(len(need), max(need), dtype=torch.int32)
    qs, ks, vs, full, slots, start = [], [], [], [], [], 0
    for i, (t, p) in enumerate(zip(query_lens, prefix_lens, strict=True)):
        pages = perm[start:start + need[i]]
        start += need[i]
        table[i, :len(pages)] = pages.int()
        q = torch.randn(t, heads, d, dtype=dtype, device=device, generator=g)
        k = torch.randn(p + t, kv_heads, d, dtype=dtype, device=device, generator=g)
        v = torch.randn(p + t, kv_heads, d, dtype=dtype, device=device, generator=g)
        flat = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:p + t]
        k_cache.view(-1, kv_heads, d)[flat.to(device)] = k
        v_cache.view(-1, kv_heads, d)[flat.to(device)] = v
        qs.append(q)
        ks.append(k[p:])
        vs.append(v[p:])
        full.append((q, k, v, p))
        slots.append(flat[p:])
    ctx = ForwardContext(True, torch.cat(slots).to(device), table.to(device),
                         query_lens=list(query_lens), prefix_lens=list(prefix_lens))
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), _Layer(k_cache, v_cache, d**-0.5), ctx, \
        full


def test_paged_prefill_cpu_several_sequences_unaligned_prefixes(route):
    q, k, v, layer, ctx, full = paged_case([5, 1, 9, 4], [0, 13, 6, 30], 8, 2, 16, 4,
                                           torch.float32, "cpu", 0)
    out = paged_prefill(q, k, v, layer, ctx)
    ref = torch.cat([reference(*f[:3], f[3], layer.scale) for f in full])
    assert (out.double() - ref).abs().max() < 1e-5


def test_paged_prefill_writes_into_out_and_returns_one_sequence_uncopied(route, monkeypatch):
    """Into the given rows of `out` (a mixed step's rows after its decode rows), the others
    untouched, with the values of a fresh output; one sequence, no `out`: the same values."""
    q, k, v, layer, ctx, _ = paged_case([5, 1, 9], [0, 13, 6], 8, 2, 16, 4, torch.float32,
                                        "cpu", 3)
    fresh = paged_prefill(q, k, v, layer, ctx)
    buffer = torch.full((2 + q.shape[0], *q.shape[1:]), 7.0)
    assert paged_prefill(q, k, v, layer, ctx, buffer[2:]).data_ptr() == buffer[2:].data_ptr()
    assert torch.equal(buffer[2:], fresh) and (buffer[:2] == 7.0).all()
    one = ForwardContext(True, ctx.slot_mapping[5:6], ctx.page_tables[1:2], query_lens=[1],
                         prefix_lens=[13])
    assert torch.equal(paged_prefill(q[5:6], k[5:6], v[5:6], layer, one), fresh[5:6])
    import nanoserve.attention.prefill as prefill
    computed = []
    real = prefill._sequence_prefill
    monkeypatch.setattr(prefill, "_sequence_prefill",
                        lambda *a: computed.append(real(*a)) or computed[-1])
    assert paged_prefill(q[5:6], k[5:6], v[5:6], layer, one) is computed[0]  # not copied


def test_torch_mixed_step_hands_each_part_its_rows_of_one_output():
    """The CPU's backend takes the same mixed step: decode rows and chunks written into their
    rows of one output, equal to the parts computed apart and concatenated."""
    from nanoserve.attention.torch_backend import TorchBackend

    lens, prefixes = [1, 1, 9, 4], [13, 6, 30, 0]
    q, k, v, layer, ctx, _ = paged_case(lens, prefixes, 8, 2, 16, 4, torch.float32, "cpu", 5)
    decode = ForwardContext(False, ctx.slot_mapping[:2], ctx.page_tables[:2],
                            context_lens=torch.tensor([14, 7], dtype=torch.int32))
    prefill = ForwardContext(True, ctx.slot_mapping[2:], ctx.page_tables[2:],
                             query_lens=lens[2:], prefix_lens=prefixes[2:])
    assert_mixed_writes_one_output(TorchBackend(), q, k, v, layer, decode, prefill, 2)


def assert_mixed_writes_one_output(backend, q, k, v, layer, decode, prefill, rows: int) -> None:
    """backend.mixed equals its decode rows' and chunks' outputs concatenated, bit for bit, and
    hands decode and prefill their own slices of the one output it returns (`out`)."""
    parts = torch.cat([backend.decode(q[:rows], layer, decode),
                       backend.prefill(q[rows:], k[rows:], v[rows:], layer, prefill)])
    outs = {}
    for name in ("decode", "prefill"):
        method = getattr(backend, name)
        setattr(backend, name, lambda *a, out, method=method, name=name:
                outs.setdefault(name, out) is None or method(*a, out=out))
    mixed = backend.mixed(q, k, v, layer, decode, prefill)
    assert torch.equal(mixed, parts)
    assert outs["decode"].data_ptr() == mixed.data_ptr()
    assert outs["prefill"].data_ptr() == mixed[rows:].data_ptr()


def test_small_chunks_with_a_prefix_take_one_kernel_large_ones_split(monkeypatch):
    """The route follows SPLIT_MIN_WORK: the split route calls the LSE kernel twice."""
    import nanoserve.attention.prefill as prefill

    calls = []
    real = prefill.attention_with_lse
    monkeypatch.setattr(prefill, "attention_with_lse",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    q, k, v = random_qkv(16, 48, 4, 2, 8, torch.float32, "cpu", 0)
    chunk_attention(q, k[48:], v[48:], k[:48], v[:48], 0.3)
    assert calls == []  # 16 * 64 < SPLIT_MIN_WORK: one SDPA call
    monkeypatch.setattr(prefill, "SPLIT_MIN_WORK", 16 * 64)
    chunk_attention(q, k[48:], v[48:], k[:48], v[:48], 0.3)
    assert calls == [16, 16]


def test_a_long_prefix_is_read_in_pieces_of_prefix_piece_tokens(monkeypatch):
    """The prefix reader is asked for [0, 5), [5, 10), ... [20, 23): never more than a piece
    (the memory bound), every token once, in order; the result is float64's."""
    import nanoserve.attention.prefill as prefill

    monkeypatch.setattr(prefill, "PREFIX_PIECE", 5)
    q, k, v = random_qkv(7, 23, 4, 2, 8, torch.float32, "cpu", 3)
    asked = []

    def read(lo, hi):
        asked.append((lo, hi))
        return k[lo:hi], v[lo:hi]

    out = prefill.attend_after_prefix(q, k[23:], v[23:], 23, read, 0.3)
    assert asked == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 23)]
    assert (out.double() - reference(q, k, v, 23, 0.3)).abs().max() < 1e-5


def test_a_short_last_piece_with_little_work_is_attended_planless(monkeypatch):
    """Pieces of 5 over a prefix of 6: a full piece through the plan kernel, the last piece of
    one key, less work than a plan build (6 x 1 < 7), planless; merged to float64's result."""
    import nanoserve.attention.prefill as prefill

    monkeypatch.setattr(prefill, "PREFIX_PIECE", 5)
    monkeypatch.setattr(prefill, "SPLIT_MIN_WORK", 7)
    calls = []
    real = prefill.attention_with_lse
    monkeypatch.setattr(prefill, "attention_with_lse", lambda *a, **kw: calls.append(
        (a[0].shape[0], a[1].shape[0], a[3], kw.get("planless", False))) or real(*a, **kw))
    q, k, v = random_qkv(6, 6, 4, 2, 8, torch.float32, "cpu", 5)
    out = chunk_attention(q, k[6:], v[6:], k[:6], v[:6], 0.3)
    assert calls == [(6, 6, True, False), (6, 5, False, False), (6, 1, False, True)]
    assert (out.double() - reference(q, k, v, 6, 0.3)).abs().max() < 1e-5


def test_varlen_only_for_many_short_fresh_prompts():
    def ctx(qs, ps):
        return ForwardContext(True, torch.zeros(0), torch.zeros(0), query_lens=qs,
                              prefix_lens=ps)
    assert use_varlen(ctx([512] * 16, [0] * 16))
    assert not use_varlen(ctx([512], [0]))  # one prompt: cuDNN
    assert not use_varlen(ctx([512, 4096], [0, 0]))  # a long one: cuDNN per prompt
    assert not use_varlen(ctx([512, 512], [0, 256]))  # a prefix: the split path


# --- GPU: the cuDNN and FA2 kernels ---------------------------------------------------------
def sdpa_error(q, k, v, p, scale):
    """Max error of torch's own one-kernel bf16 attention (bottom-right causal mask, expanded
    heads) against float64: the bound's unit. Our kernels may be at most twice as far off."""
    from torch.nn.attention.bias import causal_lower_right

    t, rep = q.shape[0], q.shape[1] // k.shape[1]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.repeat_interleave(rep, 1).transpose(0, 1)[None],
        v.repeat_interleave(rep, 1).transpose(0, 1)[None],
        attn_mask=causal_lower_right(t, p + t), scale=scale)[0].transpose(0, 1)
    return (o.double() - reference(q, k, v, p, scale)).abs().max().item()



@gpu
@pytest.mark.parametrize("t,p", [(1, 0), (257, 0), (300, 700), (1000, 1), (64, 4096),
                                 (2048, 2048)])
@pytest.mark.parametrize("heads,kv_heads,d", [(32, 8, 128), (8, 2, 32), (16, 16, 64)])
def test_chunk_attention_cuda_bf16_matches_float64(t, p, heads, kv_heads, d, route):
    q, k, v = random_qkv(t, p, heads, kv_heads, d, torch.bfloat16, "cuda", t + p)
    out = chunk_attention(q, k[p:], v[p:], k[:p], v[:p], d**-0.5)
    err = (out.double() - reference(q, k, v, p, d**-0.5)).abs().max().item()
    assert err <= 2 * sdpa_error(q, k, v, p, d**-0.5) + 1e-3, err


@gpu
def test_paged_prefill_cuda_bf16_several_sequences(route):
    q, k, v, layer, ctx, full = paged_case([300, 1, 77, 512], [0, 555, 256, 1000], 32, 8, 128,
                                           256, torch.bfloat16, "cuda", 1)
    out = paged_prefill(q, k, v, layer, ctx)
    start = 0
    for fq, fk, fv, p in full:
        err = (out[start:start + len(fq)].double() - reference(fq, fk, fv, p, layer.scale))
        assert err.abs().max().item() <= 2 * sdpa_error(fq, fk, fv, p, layer.scale) + 1e-3
        start += len(fq)


@gpu
@pytest.mark.parametrize("rows", [2, 70], ids=["2-decode-rows-merged", "70-rows-one-split"])
@pytest.mark.parametrize("varlen", [False, True])
def test_triton_mixed_step_equals_its_parts_concatenated(varlen, rows):
    """The default backend's mixed step writes its decode rows and its chunks into their rows
    of one output (each part handed its slice: no concatenation after): bit-equal to the two
    parts computed apart and concatenated, with decode's splits merged (2 rows) and written
    directly (70 rows: one split), paged and varlen chunks."""
    from nanoserve.attention.triton_backend import TritonBackend

    g = torch.Generator().manual_seed(rows)
    prefixes = torch.randint(20, 600, (rows,), generator=g).tolist() + \
        ([0, 0] if varlen else [256, 700])
    lens = [1] * rows + [300, 77]
    q, k, v, layer, ctx, _ = paged_case(lens, prefixes, 32, 8, 128, 256, torch.bfloat16,
                                        "cuda", 4)
    lengths = torch.tensor([p + 1 for p in prefixes[:rows]], dtype=torch.int32, device="cuda")
    decode = ForwardContext(False, ctx.slot_mapping[:rows], ctx.page_tables[:rows],
                            context_lens=lengths)
    prefill = ForwardContext(True, ctx.slot_mapping[rows:], ctx.page_tables[rows:],
                             query_lens=lens[rows:], prefix_lens=prefixes[rows:])
    backend = TritonBackend()
    backend.configure(8, 4096)
    for part in (decode, prefill):
        backend.prepare(part)
    assert_mixed_writes_one_output(backend, q, k, v, layer, decode, prefill, rows)


@gpu
@pytest.mark.parametrize("lens", [[512] * 16, [1, 7, 1024, 300]])
def test_varlen_prefill_matches_float64(lens):
    q, k, v = (torch.cat(x) for x in zip(*(random_qkv(n, 0, 32, 8, 128, torch.bfloat16,
                                                       "cuda", i)
                                            for i, n in enumerate(lens)), strict=True))
    cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).int().cuda()
    out = varlen_prefill(q, k, v, cu, max(lens), 128**-0.5)
    for i, n in enumerate(lens):
        s, e = cu[i].item(), cu[i + 1].item()
        err = (out[s:e].double() - reference(q[s:e], k[s:e], v[s:e], 0, 128**-0.5)).abs().max()
        assert err <= 2 * sdpa_error(q[s:e], k[s:e], v[s:e], 0, 128**-0.5) + 1e-3, n


@gpu
def test_fused_merge_equals_eager_merge():
    q, k, v = random_qkv(4096, 3000, 32, 8, 128, torch.bfloat16, "cuda", 5)
    from nanoserve.attention.prefill import attention_with_lse

    o1, l1 = attention_with_lse(q, k[:3000], v[:3000], False, 0.1)
    o2, l2 = attention_with_lse(q, k[3000:], v[3000:], True, 0.1)
    l1, l2 = l1.t(), l2.t()
    fused, eager = merge_partials(o1, l1, o2, l2), merge_partials.eager(o1, l1, o2, l2)
    # the same float32 math; rounding to bf16 may differ by one step where exp differs by ulps
    assert ((fused.float() - eager.float()).abs() <= 2 * eager.float().abs() * 2**-8 + 1e-6).all()


@gpu
@pytest.mark.parametrize("chunk", [64, 100, 333, 1000])
def test_chunked_prefill_equals_unchunked_on_gpu(tmp_path, chunk, route):
    """bf16, 16-token pages: each chunk boundary falls inside a page for 100 and 333. Bound:
    chunking moves the logits less than bf16 itself does (whole bf16 vs whole fp32), and the
    argmax agrees with fp32 wherever fp32 is confident."""
    make_hf_model("qwen3", tmp_path, **GPU_SHAPE)
    ids = random_prompts(1, [1500], vocab=2048, seed=chunk)[0]
    llm32 = make_llm(tmp_path, device="cuda", dtype="float32", page_size=16, enforce_eager=True)
    whole32 = engine_prefill_logits(llm32, ids)
    del llm32
    llm = make_llm(tmp_path, device="cuda", dtype="bfloat16", page_size=16, enforce_eager=True)
    whole = engine_prefill_logits(llm, ids).float()
    chunked = engine_prefill_logits(llm, ids, chunk=chunk).float()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(chunked, whole) < rel(whole, whole32), (rel(chunked, whole), rel(whole, whole32))
    top2 = whole32.topk(2, dim=-1).values
    confident = (top2[:, 0] - top2[:, 1]) > 0.1
    assert (chunked.argmax(-1) == whole32.argmax(-1))[confident].all()


@gpu
def test_a_prompt_over_a_prefix_compiles_no_merge_in_the_request(tmp_path, monkeypatch):
    """The prefill merges are compiled at start (ModelRunner._compile_prefill_kernels, under
    inference mode as requests run, with distinct tensors: one passed twice compiled a graph
    guarded on their being the same), and an eager engine's one-token graphs in its warm-up: a
    2,000-token prompt in chunks of 512, its prefixes read in pieces of 512 (one piece, the
    merge of two bf16 parts, the float32 accumulation of three), then a decode step, makes no
    new dynamo graph."""
    from torch._dynamo.utils import counters

    import nanoserve.attention.prefill as prefill
    from nanoserve import SamplingParams
    monkeypatch.setattr(prefill, "SPLIT_MIN_WORK", 0)
    monkeypatch.setattr(prefill, "PREFIX_PIECE", 512)
    make_hf_model("qwen3", tmp_path, **GPU_SHAPE)
    llm = make_gpu_llm(tmp_path, enforce_eager=True)
    before = counters["stats"]["unique_graphs"]
    prompt = random_prompts(1, [2000], vocab=2048, seed=3)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.parametrize("chunk", [7, 13, 64])
def test_chunked_prefill_equals_unchunked_cpu(tmp_path, chunk, route):
    make_hf_model("qwen3", tmp_path)
    llm = make_llm(tmp_path)  # float32, 4-token pages: chunk ends inside pages for 7 and 13
    ids = random_prompts(1, [150], seed=chunk)[0]
    diff = (engine_prefill_logits(llm, ids, chunk=chunk) - engine_prefill_logits(llm, ids))
    assert diff.abs().max() < 1e-4
