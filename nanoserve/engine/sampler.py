"""Sampling for a whole batch in one device pass.

Per row: penalties and logit bias, then greedy or temperature / top-k / top-p / min-p sampling,
plus the chosen token's logprob and the top alternatives. Everything per row lives in tensors;
the host reads the batch's results once per step.

Random numbers are counter-based: a row's draw is a hash of (its sequence's seed, the position
it samples at), not a stream shared by the batch. A seeded request therefore draws the same
tokens alone or in any batch, and again when it is recomputed after preemption. One uniform per
row drives an inverse-CDF draw over the filtered distribution, so no noise is generated over
the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.outputs import TokenLogprobs
from nanoserve.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def derive_seed(base: int, index: int) -> int:
    """The seed of completion `index` of a request seeded with `base` (any 64-bit integer)."""
    return _splitmix64(_splitmix64(base & _MASK64) ^ index)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix_tensor(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 on int64 tensors; the multiplications wrap modulo 2**64 as uint64 would."""
    x = x + _signed(_GOLDEN)
    x = (x ^ _shr(x, 30)) * _signed(_MIX1)
    x = (x ^ _shr(x, 27)) * _signed(_MIX2)
    return x ^ _shr(x, 31)


def uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One float32 in [0, 1) per row from (seed, position) int64 tensors, on their device."""
    h = _mix_tensor(_mix_tensor(seeds) ^ positions)
    return _shr(h, 40).to(torch.float32) * (1.0 / (1 << 24))


def uniform_reference(seed: int, position: int) -> float:
    """uniform() in plain Python integers: what the tensor version must equal."""
    h = _splitmix64(_splitmix64(seed & _MASK64) ^ position)
    return (h >> 40) / (1 << 24)


@dataclass
class SamplingTensors:
    """Per-row parameters of one step's sampled rows, on the device."""

    greedy: torch.Tensor  # bool [B]
    temperature: torch.Tensor  # f32 [B]; 1 where greedy
    top_k: torch.Tensor  # int64 [B]; the vocabulary size where off
    top_p: torch.Tensor  # f32 [B]
    min_p: torch.Tensor  # f32 [B]
    seeds: torch.Tensor  # int64 [B]
    positions: torch.Tensor  # int64 [B]: where the sampled token goes
    # host-side facts about the batch that choose the kernels (no device sync needed)
    all_greedy: bool
    max_top_k: int  # candidates to keep: the vocabulary size unless every sampled row has top_k
    use_top_k: bool  # some sampled row keeps fewer than max_top_k
    use_top_p: bool
    use_min_p: bool
    penalties: Penalties | None
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None  # ids [B, M] (pad: vocab), values
    num_logprobs: int  # most alternatives any row asked for; -1: no row wants logprobs
    logprobs: list[int | None]  # per row: alternatives it asked for, None: no logprobs


@dataclass
class Penalties:
    presence: torch.Tensor  # f32 [B]
    frequency: torch.Tensor  # f32 [B]
    repetition: torch.Tensor  # f32 [B]
    output_ids: torch.Tensor  # int64 [B, L] (pad: vocab)
    context_ids: torch.Tensor  # int64 [B, L'] prompt and output (pad: vocab)


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64)


def build_sampling_tensors(seqs, vocab: int, device: torch.device,
                           pin: bool = False) -> SamplingTensors | None:
    """`seqs`: objects with `params` (SamplingParams), `seed`, `token_ids`,
    `num_prompt_tokens`; each samples the token at position len(token_ids). None when every
    row is plain greedy (nothing to upload)."""
    params: list[SamplingParams] = [s.params for s in seqs]
    if all(p.greedy and not p.has_penalties and not p.logit_bias and p.logprobs is None
           for p in params):
        return None

    def put(data, dtype) -> torch.Tensor:
        t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
        return (t.pin_memory() if pin else t).to(device, non_blocking=True)

    greedy = [p.greedy for p in params]
    sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    max_top_k = max((k for k, g in zip(top_ks, greedy, strict=True) if not g), default=vocab)
    floats = put([[1.0 if g else p.temperature, p.top_p, p.min_p]
                  for p, g in zip(params, greedy, strict=True)], torch.float32)
    ints = put([[k, s.seed if s.seed < 1 << 63 else s.seed - (1 << 64), s.num_tokens]
                for k, s in zip(top_ks, seqs, strict=True)], torch.int64)
    penalties = None
    if any(p.has_penalties for p in params):
        pen = put([[p.presence_penalty, p.frequency_penalty, p.repetition_penalty]
                   for p in params], torch.float32)
        out_ids = [s.token_ids[s.num_prompt_tokens:] if s.params.has_penalties else []
                   for s in seqs]
        ctx_ids = [s.token_ids if s.params.repetition_penalty != 1.0 else [] for s in seqs]
        penalties = Penalties(pen[:, 0], pen[:, 1], pen[:, 2],
                              put(_padded(out_ids, vocab), torch.int64),
                              put(_padded(ctx_ids, vocab), torch.int64))
    logit_bias = None
    if any(p.logit_bias for p in params):
        items = [list((p.logit_bias or {}).items()) for p in params]
        ids = _padded([[t for t, _ in row] for row in items], vocab)
        width = ids.shape[1]
        values = torch.tensor([[v for _, v in row] + [0.0] * (width - len(row))
                               for row in items], dtype=torch.float32)
        logit_bias = (put(ids, torch.int64), put(values, torch.float32))
    return SamplingTensors(
        greedy=put(greedy, torch.bool), temperature=floats[:, 0], top_k=ints[:, 0],
        top_p=floats[:, 1], min_p=floats[:, 2], seeds=ints[:, 1], positions=ints[:, 2],
        all_greedy=not sampled, max_top_k=max_top_k,
        use_top_k=any(k < max_top_k for k, g in zip(top_ks, greedy, strict=True) if not g),
        use_top_p=any(p.top_p < 1.0 for p in sampled),
        use_min_p=any(p.min_p > 0.0 for p in sampled), penalties=penalties,
        logit_bias=logit_bias,
        num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        logprobs=[p.logprobs for p in params])


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """Repetition penalty as transformers' RepetitionPenaltyLogitsProcessor (over prompt and
    output), then OpenAI's presence and frequency penalties (over the output)."""
    b, vocab = logits.shape
    seen = torch.zeros(b, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, pen.context_ids, True)
    r = pen.repetition[:, None]
    penalized = torch.where(logits < 0, logits * r, logits / r)
    logits = torch.where(seen[:, :vocab], penalized, logits)
    counts = torch.zeros(b, vocab + 1, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(1, pen.output_ids, torch.ones_like(pen.output_ids, dtype=torch.float32))
    counts = counts[:, :vocab]
    return (logits - pen.frequency[:, None] * counts
            - pen.presence[:, None] * (counts > 0).to(torch.float32))


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor]
                     ) -> torch.Tensor:
    ids, values = bias
    b, vocab = logits.shape
    full = torch.zeros(b, vocab + 1, dtype=logits.dtype, device=logits.device)
    full.scatter_add_(1, ids, values)
    return logits + full[:, :vocab]


def filter_candidates(logits: torch.Tensor, t: SamplingTensors,
                      key_dtype: torch.dtype | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's candidates, most likely first: (cumulative probabilities [B, K], token ids
    [B, K], how many candidates are kept [B]). K is the vocabulary, or the largest top_k when
    every sampled row has one. top-k keeps the k most likely tokens (ties: the lower id first),
    top-p the shortest prefix whose mass reaches top_p of what top-k kept, min-p the tokens of
    at least min_p x the top token's probability. Each filter keeps a prefix of the sorted
    candidates, so one count per row describes them all; the top token always stays.

    The order does not depend on temperature, so the raw logits are sorted, in `key_dtype`
    when they are exactly representable in it (bf16 logits of a bf16 model: half the radix
    passes of float32)."""
    keys = logits if key_dtype is None else logits.to(key_dtype)
    k = t.max_top_k
    if k < logits.shape[-1]:
        values, order = torch.topk(keys, k, dim=-1)
    else:
        values, order = torch.sort(keys, dim=-1, descending=True, stable=True)
    values = values.float() / t.temperature[:, None]
    width = values.shape[-1]
    if t.use_top_k:
        ranks = torch.arange(width, device=logits.device)
        values = values.masked_fill(ranks >= t.top_k[:, None], float("-inf"))
    probs = values.softmax(-1)
    cdf = probs.cumsum(-1)
    kept = t.top_k.clamp(max=width)
    if t.use_top_p:  # candidate j stays while the mass before it is below top_p
        before = torch.searchsorted(cdf, t.top_p[:, None]).squeeze(1)
        kept = torch.minimum(kept, before + 1)
    if t.use_min_p:  # probs descend, so -probs ascend
        floor = -(t.min_p * probs[:, 0])[:, None]
        kept = torch.minimum(kept, torch.searchsorted(-probs, floor, right=True).squeeze(1))
    return cdf, order, kept.clamp(min=1)  # min 1: top_p may underflow float32 to 0


def candidates(logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The filtered, renormalized distribution over each row's candidates (zeros past the kept
    prefix) and their token ids: what draw() samples from, spelled out for tests."""
    cdf, order, kept = filter_candidates(logits, t)
    probs = torch.diff(cdf, dim=-1, prepend=torch.zeros_like(cdf[:, :1]))
    ranks = torch.arange(cdf.shape[-1], device=cdf.device)
    probs = probs.masked_fill(ranks >= kept[:, None], 0.0)
    return probs / probs.sum(-1, keepdim=True), order


def draw(cdf: torch.Tensor, order: torch.Tensor, kept: torch.Tensor,
         u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw within the kept prefix: the first candidate whose cumulative
    probability exceeds u x the prefix's mass."""
    last = (kept - 1)[:, None]
    target = u[:, None] * cdf.gather(1, last)
    pick = torch.searchsorted(cdf, target, right=True)
    return order.gather(1, torch.minimum(pick, last)).squeeze(1)


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # per row, when some row asked for them


def _to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies to the host behind one synchronization."""
    if not tensors or tensors[0].device.type == "cpu":
        return list(tensors)
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for dst, src in zip(out, tensors, strict=True):
        dst.copy_(src, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return out


def sample(logits: torch.Tensor, t: SamplingTensors | None,
           key_dtype: torch.dtype | None = None) -> SampleOutput:
    """logits: [B, V] float32 of the rows that sample this step, on any device. t=None: every
    row is plain greedy. key_dtype: a dtype that holds the logits exactly (the model's)."""
    if t is None:
        (tokens,) = _to_host(logits.argmax(-1))
        return SampleOutput(tokens.tolist(), None)
    raw = logits
    if t.penalties is not None:
        logits = apply_penalties(logits, t.penalties)
        key_dtype = None
    if t.logit_bias is not None:
        logits = apply_logit_bias(logits, t.logit_bias)
        key_dtype = None
    tokens = logits.argmax(-1)
    if not t.all_greedy:
        u = uniform(t.seeds, t.positions)
        if t.max_top_k < logits.shape[-1] or t.use_top_p:
            cdf, order, kept = filter_candidates(logits, t, key_dtype)
            drawn = draw(cdf, order, kept, u)
        else:  # no ordered filter: draw in vocabulary order, no sort
            drawn = draw_unsorted(logits, t, u, tokens)
        tokens = torch.where(t.greedy, tokens, drawn)
    if t.num_logprobs < 0:
        (tokens,) = _to_host(tokens)
        return SampleOutput(tokens.tolist(), None)
    logprobs = raw.log_softmax(-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    top_values, top_ids = logprobs.topk(max(t.num_logprobs, 1), dim=-1)
    tokens, chosen, top_values, top_ids = _to_host(tokens, chosen, top_values, top_ids)
    token_list = tokens.tolist()
    rows = zip(token_list, chosen.tolist(), top_values.tolist(), top_ids.tolist(), t.logprobs,
               strict=True)
    per_row = [None if k is None else
               TokenLogprobs(tok, lp, tuple(zip(ids[:k], vals[:k], strict=True)))
               for tok, lp, vals, ids, k in rows]
    return SampleOutput(token_list, per_row)


def draw_unsorted(logits: torch.Tensor, t: SamplingTensors, u: torch.Tensor,
                  argmax: torch.Tensor) -> torch.Tensor:
    """Temperature (and min-p) alone: inverse CDF over the vocabulary in id order."""
    probs = (logits / t.temperature[:, None]).softmax(-1)
    if t.use_min_p:
        probs = probs.masked_fill(probs < t.min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    cdf = probs.cumsum(-1)
    pick = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(1)
    # u x total rounded up to the total (odds ~2**-24): the argmax, always a candidate
    return torch.where(pick < logits.shape[-1], pick, argmax)
