"""The batched device sampler against per-row references, transformers' logits processors and a
chi-square bound; seeded sampling under different batch compositions; numeric edges."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import random_prompts
from helpers import make_llm

from nanoserve import SamplingParams
from nanoserve.engine.sampler import (
    apply_penalties,
    build_sampling_tensors,
    candidates,
    derive_seed,
    sample,
    uniform_reference,
    uniforms,
)

VOCAB = 320


def rows(params: list[SamplingParams], token_ids=None, seeds=None):
    """Sequence-like rows for build_sampling_tensors."""
    out = []
    for i, p in enumerate(params):
        ids = token_ids[i] if token_ids else [1, 2, 3]
        out.append(SimpleNamespace(params=p, seed=(seeds or {}).get(i, 1000 + i), seq_id=i,
                                   token_ids=ids, num_tokens=len(ids), num_prompt_tokens=2))
    return out


def tensors(params, vocab=VOCAB, **kw):
    return build_sampling_tensors(rows(params, **kw), vocab, torch.device("cpu"))


def reference_filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, written plainly: temperature, top-k by rank (ties to the lower id), top-p over
    what top-k kept, min-p against the top token; the top token always stays."""
    x = logits.double() / p.temperature
    order = sorted(range(len(x)), key=lambda i: (-x[i].item(), i))
    keep = order[:p.top_k] if p.top_k > 0 else order
    z = torch.tensor([x[i].item() for i in keep], dtype=torch.float64).softmax(0)
    kept = []
    mass = 0.0
    for j, i in enumerate(keep):
        if j > 0 and mass >= p.top_p:
            break
        if j > 0 and z[j] < p.min_p * z[0]:
            break  # sorted: everything after is smaller too
        kept.append((i, z[j].item()))
        mass += z[j].item()
    out = torch.zeros(len(x), dtype=torch.float64)
    total = sum(v for _, v in kept)
    for i, v in kept:
        out[i] = v / total
    return out


def batched_filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    probs, order = candidates(logits, tensors(params, vocab=logits.shape[1]))
    out = torch.zeros(logits.shape, dtype=probs.dtype)
    return out.scatter_(1, order, probs)


def test_counter_based_uniforms_equal_their_integer_reference():
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 12345678901234567890, derive_seed(-5, 3), -7]
    positions = [0, 1, 7, 4095, 131071, 2**40]
    got = uniforms([x for x in seeds for _ in positions], [q for _ in seeds for q in positions])
    want = [uniform_reference(x, q) for x in seeds for q in positions]
    assert got.tolist() == want
    assert all(0.0 <= u < 1.0 for u in want) and len(set(want)) == len(want)


def test_top_k_top_p_min_p_masks_equal_the_per_row_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 50, generator=g) * 3
    logits[3, 10] = logits[3, 11] = logits[3].max() + 1  # a tie at the top
    params = [SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.3, top_p=0.6),
              SamplingParams(temperature=1.0, top_k=1 + 1, top_p=0.999),
              SamplingParams(temperature=0.5, min_p=0.2),
              SamplingParams(temperature=1.0, top_k=10, top_p=0.8, min_p=0.05),
              SamplingParams(temperature=2.0, top_p=1e-9),
              SamplingParams(temperature=0.9, top_k=49, min_p=1.0)]
    got = batched_filtered_probs(logits, params)
    for i, p in enumerate(params):
        ref = reference_filtered_probs(logits[i], p)
        assert torch.equal(got[i] > 0, ref > 0), i  # the kept set is exact
        assert torch.allclose(got[i].double(), ref, atol=1e-6), i
    assert (got[6] > 0).sum() == 1 and (got[7] > 0).sum() == 1  # tiny top_p / min_p=1: top only
    assert got[3, 10] > 0 and got[3, 11] > 0  # top_k=2 keeps both tied tokens


# Chi-square critical values at p = 0.001 by degrees of freedom (a standard table).
CHI2_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322,
             8: 26.124, 9: 27.877}


@pytest.mark.parametrize("p", [SamplingParams(temperature=1.0),
                               SamplingParams(temperature=0.8, top_p=0.9, top_k=8),
                               SamplingParams(temperature=1.0, min_p=0.02)])
def test_sampled_frequencies_match_the_distribution_chi_square(p):
    """20,000 rows, one seed each, over one fixed distribution of 10 tokens: the counts pass a
    chi-square test against the filtered distribution (df = kept - 1, p = 0.001)."""
    n = 20_000
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -2.5])
    ref = reference_filtered_probs(logits, p)
    t = build_sampling_tensors(rows([p] * n, seeds={i: derive_seed(7, i) for i in range(n)}),
                               10, torch.device("cpu"))
    counts = torch.bincount(torch.tensor(sample(logits.expand(n, 10), t).token_ids),
                            minlength=10).double()
    kept = ref > 0
    assert counts[~kept].sum() == 0  # nothing outside the filtered set, ever
    expected = ref[kept] * n
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum().item()
    df = int(kept.sum()) - 1
    assert df >= 3  # the filters leave a distribution worth testing
    assert chi2 < CHI2_P001[df], (chi2, counts.tolist(), expected.tolist())


def test_greedy_rows_and_edge_temperatures_give_the_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, VOCAB, generator=g) * 5
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-45),
              SamplingParams(temperature=9e-6), SamplingParams(temperature=1.0, top_p=1e-300),
              SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0,
                                                                        min_p=1.0)]
    out = sample(logits, tensors(params)).token_ids
    assert out == logits.argmax(-1).tolist()


def test_every_valid_extreme_gives_a_valid_token():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(7, VOCAB, generator=g) * 30
    logits[0] = 0.0  # a flat row
    params = [SamplingParams(temperature=2.0), SamplingParams(temperature=1.1e-5),
              SamplingParams(temperature=1.1e-5, top_p=1e-300, top_k=2**31),
              SamplingParams(temperature=2.0, top_k=10**9, min_p=0.0, top_p=1.0),
              SamplingParams(temperature=2.0, logit_bias={i: -100.0 for i in range(VOCAB)}),
              SamplingParams(temperature=1e-4, presence_penalty=2.0, frequency_penalty=-2.0,
                             repetition_penalty=10.0),
              SamplingParams(temperature=1.0, repetition_penalty=1e-3, logprobs=20)]
    out = sample(logits, tensors(params, token_ids=[list(range(300))] * 7))
    assert all(0 <= t < VOCAB for t in out.token_ids)
    lp = out.logprobs[6]
    assert math.isfinite(lp.logprob) and len(lp.top) == 20


def test_penalties_equal_transformers_and_openai_arithmetic():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, VOCAB, generator=g) * 4
    prompt = [[5, 6, 7, 5], [9, 9, 10], [1, 2]]
    output = [[7, 7, 8, 100], [11], []]
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.25),
              SamplingParams(repetition_penalty=0.7, frequency_penalty=-1.0),
              SamplingParams(presence_penalty=2.0)]
    seqs = rows(params, token_ids=[p + o for p, o in zip(prompt, output, strict=True)])
    for s, p in zip(seqs, prompt, strict=True):
        s.num_prompt_tokens = len(p)
    t = build_sampling_tensors(seqs, VOCAB, torch.device("cpu"))
    got = apply_penalties(logits, t.penalties)
    for i, p in enumerate(params):
        ids = torch.tensor([prompt[i] + output[i]])
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, logits[i:i + 1])[0]
        counts = torch.bincount(torch.tensor(output[i], dtype=torch.int64), minlength=VOCAB)
        want = want - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        assert torch.allclose(got[i], want, atol=1e-6), i


def test_logit_bias_forces_its_token_greedy_and_sampled():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.0, logit_bias={17: 100.0}),
              SamplingParams(temperature=1.0, logit_bias={42: 100.0, 17: -100.0})]
    assert sample(logits, tensors(params)).token_ids == [17, 42]


# --- through the engine, on a tiny model --------------------------------------------------------

def test_seeded_request_is_identical_alone_and_in_any_batch(qwen3_dir):
    llm = make_llm(qwen3_dir)
    prompt = random_prompts(1, [12], seed=5)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234,
                            ignore_eos=True)
    alone = llm.generate(prompt, seeded)[0].token_ids
    others = random_prompts(4, [5, 30, 9, 17], seed=6)
    mixes = [
        ([prompt] + others, [seeded] + [SamplingParams(temperature=1.0, max_tokens=7)] * 4),
        ([prompt] + others, [seeded] + [SamplingParams(temperature=0.6, min_p=0.1, top_k=4,
                                                       max_tokens=9)] * 4),
        (others[:2] + [prompt], [SamplingParams(temperature=0.0, max_tokens=30)] * 2 + [seeded]),
        (others + [prompt], [SamplingParams(temperature=1.5, top_k=3, seed=i, max_tokens=25)
                             for i in range(4)] + [seeded]),
    ]
    for prompts, params in mixes:
        outs = llm.generate(prompts, params)
        assert outs[prompts.index(prompt)].token_ids == alone
    assert llm.generate(prompt, seeded.replace(seed=1235))[0].token_ids != alone


def test_n_completions_have_distinct_indices_and_reproduce_with_a_seed(qwen3_dir):
    llm = make_llm(qwen3_dir)
    prompt = random_prompts(1, [10], seed=7)[0]
    p = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=9, ignore_eos=True)
    out = llm.generate(prompt, p)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert [c.token_ids for c in llm.generate(prompt, p)[0].outputs] == \
        [c.token_ids for c in out.outputs]
    greedy = llm.generate(prompt, p.replace(temperature=0.0))[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1


def test_logprobs_equal_log_softmax_of_transformers_logits(hf_model_dir):
    arch, hf_model, path = hf_model_dir
    llm = make_llm(path)
    prompt = random_prompts(1, [11], seed=8)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, logprobs=5,
                                              ignore_eos=True))[0].outputs[0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + out.token_ids])).logits[0].float()
    ref = logits.log_softmax(-1)[len(prompt) - 1:-1]
    assert len(out.logprobs) == 8
    for step, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert lp.token_id == tok
        assert abs(lp.logprob - ref[step, tok].item()) < 1e-4
        top_vals, top_ids = ref[step].topk(5)
        assert [i for i, _ in lp.top] == top_ids.tolist()
        assert max(abs(v - w) for (_, v), w in zip(lp.top, top_vals.tolist(),
                                                   strict=True)) < 1e-4


def test_logprobs_zero_reports_the_chosen_token_only(qwen3_dir):
    llm = make_llm(qwen3_dir)
    out = llm.generate([3, 4, 5], [SamplingParams(temperature=1.0, max_tokens=4, logprobs=0,
                                                  seed=1, ignore_eos=True)])[0].outputs[0]
    assert [lp.top for lp in out.logprobs] == [()] * 4
    assert all(lp.logprob <= 0 for lp in out.logprobs)


def test_penalties_change_tokens_exactly_as_transformers_processors(qwen3_dir):
    """Greedy with repetition penalty: the engine's tokens equal transformers' generate() with
    its own RepetitionPenaltyLogitsProcessor on the same weights."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32).eval()
    prompt = random_prompts(1, [9], seed=10)[0]
    llm = make_llm(qwen3_dir)
    got = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16,
                                              repetition_penalty=1.8, ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                          repetition_penalty=1.8, pad_token_id=0)[0, len(prompt):].tolist()
    assert got.token_ids == ref
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16,
                                                ignore_eos=True))[0]
    assert plain.token_ids != got.token_ids  # the penalty had an effect to check


def test_sorting_bf16_keys_draws_exactly_what_float32_keys_draw():
    """A bf16 model's logits are exact in bf16 (many ties included): sorting them there, as the
    engine does on the GPU, must not change a single draw."""
    g = torch.Generator().manual_seed(15)
    logits = (torch.randn(64, VOCAB, generator=g) * 2).to(torch.bfloat16).float()
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i) for i in range(32)] + \
             [SamplingParams(temperature=1.3, top_k=40, top_p=0.7, min_p=0.01, seed=i)
              for i in range(32)]
    t = tensors(params)
    assert sample(logits, t, torch.bfloat16).token_ids == sample(logits, t).token_ids


def test_plain_greedy_batches_upload_nothing():
    assert build_sampling_tensors(rows([SamplingParams(temperature=0.0)] * 3), VOCAB,
                                  torch.device("cpu")) is None
    assert tensors([SamplingParams(temperature=0.0, logprobs=0)]) is not None


def test_prefix_sums_search_equals_a_full_cumsum_across_chunks():
    """Integer-valued rows (sums exact in float32) spanning several chunks: every count and
    every prefix equals what searchsorted over a plain cumsum gives."""
    from nanoserve.engine.sampler import CHUNK, PrefixSums

    g = torch.Generator().manual_seed(16)
    probs = torch.randint(0, 4, (6, 5 * CHUNK), generator=g).float()
    probs[2, :3 * CHUNK] = 0  # empty chunks before the mass
    cdf = probs.cumsum(-1)
    sums = PrefixSums(probs)
    for q in range(40):
        x = torch.rand(6, generator=g) * cdf[:, -1] * 1.1
        if q % 2:
            x = cdf.gather(1, torch.randint(0, 5 * CHUNK, (6, 1), generator=g)).squeeze(1)
        for right in (False, True):
            want = torch.searchsorted(cdf, x[:, None], right=right).squeeze(1)
            assert torch.equal(sums.count(x, right=right), want), (q, right)
        i = torch.randint(0, 5 * CHUNK, (6,), generator=g)
        assert torch.equal(sums.through(i), cdf.gather(1, i[:, None]).squeeze(1))
    assert torch.equal(sums.total, cdf[:, -1])


def test_masks_are_exact_and_draws_stay_inside_them_at_a_wide_vocabulary():
    g = torch.Generator().manual_seed(17)
    vocab = 2500  # three chunks
    logits = torch.randn(4, vocab, generator=g) * 0.3  # flat: the nucleus spans chunks
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=1),
              SamplingParams(temperature=0.7, top_p=0.5, min_p=0.6, seed=2),
              SamplingParams(temperature=1.2, top_k=1500, top_p=0.99, seed=3),
              SamplingParams(temperature=1.0, min_p=0.9, seed=4)]
    got = batched_filtered_probs(logits, params)
    for i, p in enumerate(params):
        ref = reference_filtered_probs(logits[i], p)
        assert torch.equal(got[i] > 0, ref > 0), i
        assert 30 < int((ref > 0).sum()) < vocab or p.min_p > 0, i
    for seed in range(50):
        rows_ = rows(params, seeds={i: seed * 10 + i for i in range(4)})
        drawn = sample(logits, build_sampling_tensors(rows_, vocab, torch.device("cpu")))
        assert all(got[i, tok] > 0 for i, tok in enumerate(drawn.token_ids))


def test_token_stats_kept_up_to_date_equal_stats_built_afresh():
    """Rows updated step by step (new tokens only), across eviction and release, hold what a
    fresh build from the whole token lists holds."""
    from nanoserve.engine.token_stats import TokenStats

    cpu = torch.device("cpu")
    pen = SamplingParams(presence_penalty=0.5)
    g = torch.Generator().manual_seed(18)
    seqs = [SimpleNamespace(seq_id=i, params=pen if i != 2 else SamplingParams(),
                            token_ids=torch.randint(0, VOCAB, (5 + i,), generator=g).tolist(),
                            num_prompt_tokens=5 + i) for i in range(4)]
    live = TokenStats(VOCAB, capacity=2, device=cpu)  # 3 penalized sequences, 2 rows
    for step in range(12):
        batch = [seqs[step % 4], seqs[(step + 1) % 4]]
        rows = live.rows_for(batch)
        fresh = TokenStats(VOCAB, capacity=2, device=cpu)
        fresh_rows = fresh.rows_for(batch)
        assert torch.equal(live.counts[rows], fresh.counts[fresh_rows]), step
        assert torch.equal(live.seen[rows], fresh.seen[fresh_rows]), step
        for s in batch:  # each sequence gains a token, as after a decode step
            s.token_ids.append(int(torch.randint(0, VOCAB, (1,), generator=g)))
        if step == 6:
            live.release(seqs[0].seq_id)
    out = seqs[1].token_ids[seqs[1].num_prompt_tokens:]
    row = live.rows_for([seqs[1]])
    want = torch.bincount(torch.tensor(out), minlength=VOCAB).float()
    assert torch.equal(live.counts[row][0], want) and want.sum() > 0
    assert live.counts[0].sum() == 0 and not live.seen[0].any()  # row 0 stays zero


@pytest.mark.parametrize("own", [SamplingParams(temperature=1.0), SamplingParams(min_p=0.05),
                                 SamplingParams(temperature=0.7, top_p=0.8)])
def test_a_rows_draw_depends_on_its_own_parameters_only(own):
    """The same row, seed and position draw the same token beside rows of every kind of
    filter (top-k, top-p, min-p, none, greedy, penalties, logit bias) and alone."""
    g = torch.Generator().manual_seed(19)
    logits = torch.randn(1, VOCAB, generator=g) * 3
    neighbours = [SamplingParams(temperature=0.0), SamplingParams(top_k=3),
                  SamplingParams(top_p=0.5), SamplingParams(min_p=0.3),
                  SamplingParams(presence_penalty=1.0), SamplingParams(logit_bias={5: 3.0})]
    for seed in range(40):
        alone = sample(logits, tensors([own], seeds={0: seed})).token_ids[0]
        for other in neighbours:
            both = sample(logits.expand(2, VOCAB), tensors([own, other], seeds={0: seed}))
            assert both.token_ids[0] == alone, (seed, other)
