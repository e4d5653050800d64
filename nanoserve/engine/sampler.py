"""Sampling for a whole batch in one device pass.

Per row: penalties and logit bias, then greedy or temperature / top-k / top-p / min-p sampling,
plus the chosen token's logprob and the top alternatives. Everything per row lives in tensors;
the host reads the batch's results once per step.

Random numbers are counter-based: a row's draw is a hash of (its sequence's seed, the position
it samples at), not a stream shared by the batch. A seeded request therefore draws the same
tokens alone or in any batch, and again when it is recomputed after preemption. One uniform per
row drives an inverse-CDF draw over the filtered distribution, so no noise is generated over
the vocabulary; the batch's uniforms are hashed at once on the host and travel to the device
in the same upload as the other per-row parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.engine.grammar import MaskBuffers, allowed_token_masks
from nanoserve.engine.token_stats import TokenStats
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


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """_splitmix64 over a uint64 array (uint64 arithmetic wraps as the hash wants)."""
    x = x + np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_MIX1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_MIX2)
    return x ^ (x >> np.uint64(31))


def uniforms(seeds: list[int], positions: list[int]) -> np.ndarray:
    """One float32 in [0, 1) per row from its (seed, position), for the whole batch at once."""
    x = _splitmix64_array(np.array([s & _MASK64 for s in seeds], dtype=np.uint64))
    x = _splitmix64_array(x ^ np.array(positions, dtype=np.uint64))
    return (x >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / (1 << 24))


def uniform_reference(seed: int, position: int) -> float:
    """uniforms() in plain Python integers, one row: what the vectorized version must equal."""
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
    uniform: torch.Tensor  # f32 [B] in [0, 1): this step's draw, from (seed, position)
    # host-side facts about the batch that choose the kernels (no device sync needed)
    all_greedy: bool
    use_top_k: bool  # some sampled row has a top_k below the vocabulary size
    use_top_p: bool
    use_min_p: bool
    penalties: Penalties | None
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None  # ids [B, M] (pad: vocab), values
    num_logprobs: int  # most alternatives any row asked for; -1: no row wants logprobs
    logprobs: list[int | None]  # per row: alternatives it asked for, None: no logprobs
    # rows under a grammar (int64 [R]) and their allowed tokens as bits (int32 [R, V / 32])
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class Penalties:
    presence: torch.Tensor  # f32 [B]
    frequency: torch.Tensor  # f32 [B]
    repetition: torch.Tensor  # f32 [B]
    output_counts: torch.Tensor  # f32 [B, V]: occurrences of each token in the output
    seen: torch.Tensor  # bool [B, V]: the token occurs in the prompt or the output


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64)


def build_sampling_tensors(seqs, vocab: int, device: torch.device, pin: bool = False,
                           stats: TokenStats | None = None,
                           positions: list[int] | None = None,
                           mask_buffers: MaskBuffers | None = None) -> SamplingTensors | None:
    """`seqs`: objects with `params` (SamplingParams), `seed`, `seq_id`, `token_ids`,
    `num_prompt_tokens`; each samples the token at its `positions` entry (default:
    len(token_ids)). `stats`: the engine's per-sequence token statistics (penalties); without
    them, built for this call. `mask_buffers`: the engine's, for grammars' masks. None when
    every row is plain greedy (nothing to upload)."""
    params: list[SamplingParams] = [s.params for s in seqs]
    # a row whose sequence stopped a step ago (async scheduling) samples a discarded token
    constrained = [i for i, s in enumerate(seqs) if getattr(s, "grammar", None) is not None
                   and not getattr(s, "is_finished", False)]
    if not constrained and all(p.greedy and not p.has_penalties and not p.logit_bias and
                               p.logprobs is None for p in params):
        return None

    def put(data, dtype) -> torch.Tensor:
        t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
        return (t.pin_memory() if pin and not t.is_pinned() else t).to(device,
                                                                        non_blocking=True)

    allowed = None
    if constrained:  # host work while the device runs the forward queued before this
        masks = allowed_token_masks([seqs[i].grammar for i in constrained], vocab,
                                    mask_buffers)
        allowed = (put(constrained, torch.int64), put(masks, torch.int32))

    greedy = [p.greedy for p in params]
    sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    # every per-row value in one upload (top_k < 2**24 is exact in float32)
    rows = np.empty((len(seqs), 6), dtype=np.float32)
    rows[:, 0] = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
    rows[:, 1] = [p.top_p for p in params]
    rows[:, 2] = [p.min_p for p in params]
    rows[:, 3] = top_ks
    rows[:, 4] = greedy
    rows[:, 5] = uniforms([s.seed for s in seqs],
                          [len(s.token_ids) for s in seqs] if positions is None else positions)
    packed = put(torch.from_numpy(rows), torch.float32)
    penalties = None
    if any(p.has_penalties for p in params):
        pen = put([[p.presence_penalty, p.frequency_penalty, p.repetition_penalty]
                   for p in params], torch.float32)
        stats = stats or TokenStats(vocab, len(seqs), device)
        rows = stats.rows_for(seqs, pin)
        penalties = Penalties(pen[:, 0], pen[:, 1], pen[:, 2], stats.counts[rows],
                              stats.seen[rows])
    logit_bias = None
    if any(p.logit_bias for p in params):
        items = [list((p.logit_bias or {}).items()) for p in params]
        ids = _padded([[t for t, _ in row] for row in items], vocab)
        width = ids.shape[1]
        values = torch.tensor([[v for _, v in row] + [0.0] * (width - len(row))
                               for row in items], dtype=torch.float32)
        logit_bias = (put(ids, torch.int64), put(values, torch.float32))
    return SamplingTensors(
        greedy=packed[:, 4] > 0.5, temperature=packed[:, 0], top_k=packed[:, 3].long(),
        top_p=packed[:, 1], min_p=packed[:, 2], uniform=packed[:, 5],
        all_greedy=not sampled,
        use_top_k=any(k < vocab for k, g in zip(top_ks, greedy, strict=True) if not g),
        use_top_p=any(p.top_p < 1.0 for p in sampled),
        use_min_p=any(p.min_p > 0.0 for p in sampled), penalties=penalties,
        logit_bias=logit_bias,
        num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        logprobs=[p.logprobs for p in params], allowed=allowed)


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """Repetition penalty as transformers' RepetitionPenaltyLogitsProcessor (over prompt and
    output), then OpenAI's presence and frequency penalties (over the output)."""
    r = pen.repetition[:, None]
    penalized = torch.where(logits < 0, logits * r, logits / r)
    logits = torch.where(pen.seen, penalized, logits)
    counts = pen.output_counts
    return (logits - pen.frequency[:, None] * counts
            - pen.presence[:, None] * (counts > 0).to(torch.float32))


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor]
                     ) -> torch.Tensor:
    ids, values = bias
    b, vocab = logits.shape
    full = torch.zeros(b, vocab + 1, dtype=logits.dtype, device=logits.device)
    full.scatter_add_(1, ids, values)
    return logits + full[:, :vocab]


def apply_allowed(logits: torch.Tensor, allowed: tuple[torch.Tensor, torch.Tensor]
                  ) -> torch.Tensor:
    """-inf for every token a row's grammar does not allow; other rows unchanged."""
    rows, masks = allowed
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=masks.device)
    bits = ((masks[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
    constrained = logits.index_select(0, rows).masked_fill(~bits, float("-inf"))
    return logits.index_copy(0, rows, constrained)


CHUNK = 1024  # columns per chunk of PrefixSums


def _scaled_padded(values: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """values / temperature in float32, padded with -inf to whole chunks (probability 0)."""
    b, width = values.shape
    out = torch.empty(b, -(-width // CHUNK) * CHUNK, dtype=torch.float32, device=values.device)
    out[:, width:] = float("-inf")
    torch.div(values, temperature[:, None], out=out[:, :width])
    return out


class PrefixSums:
    """Searches in the prefix sums of nonnegative rows without a scan across the whole row
    (a 152K-wide scan runs one block per row: 4x the rest of the sampler on an H200): one
    reduction per chunk of CHUNK columns, then a scan of only the chunk a search lands in."""

    def __init__(self, probs: torch.Tensor) -> None:  # [B, n * CHUNK]
        b, width = probs.shape
        self.chunks = probs.view(b, width // CHUNK, CHUNK)
        self.chunk_mass = self.chunks.sum(-1)
        self.ends = self.chunk_mass.cumsum(-1)  # [B, n]: mass through each chunk's end

    @property
    def total(self) -> torch.Tensor:
        return self.ends[:, -1]

    def _chunk(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mass before chunk c[b] of row b, and that chunk's columns: ([B, 1], [B, CHUNK])."""
        before = self.ends.gather(1, c) - self.chunk_mass.gather(1, c)
        cols = self.chunks.gather(1, c[:, :, None].expand(-1, -1, CHUNK)).squeeze(1)
        return before, cols

    def count(self, x: torch.Tensor, right: bool = False) -> torch.Tensor:
        """Per row, how many prefix sums are < x[b] (right: <= x[b]), i.e. the index of the
        first one that reaches (right: exceeds) it."""
        x = x[:, None].contiguous()
        last = self.ends.shape[1] - 1
        c = torch.searchsorted(self.ends, x, right=right).clamp_(max=last)
        before, cols = self._chunk(c)
        inside = torch.searchsorted(before + cols.cumsum(-1), x, right=right)
        return (c * CHUNK + inside).squeeze(1)

    def through(self, i: torch.Tensor) -> torch.Tensor:
        """Per row, the prefix sum through column i[b] (inclusive)."""
        c = (i // CHUNK)[:, None]
        before, cols = self._chunk(c)
        upto = torch.arange(CHUNK, device=i.device)[None, :] <= (i % CHUNK)[:, None]
        return before.squeeze(1) + (cols * upto).sum(-1)


def filter_candidates(logits: torch.Tensor, t: SamplingTensors,
                      key_dtype: torch.dtype | None = None
                      ) -> tuple[PrefixSums, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The vocabulary of each row, most likely first: (its probabilities as PrefixSums, the
    probabilities [B, V'] (V' >= V, zero-padded), token ids [B, V], how many are kept [B]).
    top-k keeps the k most likely tokens, top-p the shortest prefix whose mass reaches top_p of
    what top-k kept, min-p the tokens of at least min_p x the top token's probability. Each
    filter keeps a prefix of the sorted tokens, so one count per row describes them all; the
    top token always stays.

    The sort is stable (equal logits: the lower id first), so the kept set never depends on
    the batch; torch.topk makes no such promise, and bf16 logits tie often. The order does not
    depend on temperature, so the raw logits are sorted, in `key_dtype` when they are exactly
    representable in it (bf16 logits of a bf16 model: half the radix passes of float32)."""
    keys = logits if key_dtype is None else logits.to(key_dtype)
    values, order = torch.sort(keys, dim=-1, descending=True, stable=True)
    scaled = _scaled_padded(values, t.temperature)
    if t.use_top_k:
        ranks = torch.arange(scaled.shape[-1], device=logits.device)
        scaled.masked_fill_(ranks >= t.top_k[:, None], float("-inf"))
    probs = scaled.softmax(-1)
    sums = PrefixSums(probs)
    kept = t.top_k
    if t.use_top_p:  # candidate j stays while the mass before it is below top_p
        by_top_p = torch.where(t.top_p < 1.0, sums.count(t.top_p) + 1, kept)
        kept = torch.minimum(kept, by_top_p)  # top_p 1 keeps all though the sums round up
    if t.use_min_p:  # probs descend, so -probs ascend
        floor = -(t.min_p * probs[:, 0])[:, None]
        kept = torch.minimum(kept, torch.searchsorted(-probs, floor, right=True).squeeze(1))
    return sums, probs, order, kept.clamp(min=1)  # min 1: top_p may underflow float32 to 0


def candidates(logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The filtered, renormalized distribution over each row's candidates (zeros past the kept
    prefix) and their token ids: what draw() samples from, spelled out for tests."""
    _, probs, order, kept = filter_candidates(logits, t)
    probs = probs[:, :order.shape[1]]
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    probs = probs.masked_fill(ranks >= kept[:, None], 0.0)
    return probs / probs.sum(-1, keepdim=True), order


def draw(sums: PrefixSums, order: torch.Tensor, kept: torch.Tensor,
         u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw within the kept prefix: the first candidate whose cumulative
    probability exceeds u x the prefix's mass."""
    pick = sums.count(u * sums.through(kept - 1), right=True)
    return order.gather(1, torch.minimum(pick, kept - 1)[:, None]).squeeze(1)


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # per row, when some row asked for them


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies to the host behind one synchronization."""
    if not tensors or tensors[0].device.type == "cpu":
        return list(tensors)
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for dst, src in zip(out, tensors, strict=True):
        dst.copy_(src, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return out


def _draw_tokens(logits: torch.Tensor, t: SamplingTensors,
                 key_dtype: torch.dtype | None) -> torch.Tensor:
    if t.penalties is not None:
        logits = apply_penalties(logits, t.penalties)
        key_dtype = None
    if t.logit_bias is not None:
        logits = apply_logit_bias(logits, t.logit_bias)
        key_dtype = None
    if t.allowed is not None:
        logits = apply_allowed(logits, t.allowed)
    if t.all_greedy:
        return logits.argmax(-1)
    # Every sampled row draws in the same (sorted) order whatever its batch holds: a row's
    # token depends on its own logits, parameters and uniform only.
    sums, _, order, kept = filter_candidates(logits, t, key_dtype)
    # a stable sort puts the argmax (the lowest id among equals, as argmax) first
    return torch.where(t.greedy, order[:, 0], draw(sums, order, kept, t.uniform))


def sample_on_device(logits: torch.Tensor, t: SamplingTensors | None,
                     key_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The sampled token ids (int64 [B], on the logits' device), no logprobs, nothing read
    back: the next step can take them as inputs before the host sees them."""
    return logits.argmax(-1) if t is None else _draw_tokens(logits, t, key_dtype)


def sample(logits: torch.Tensor, t: SamplingTensors | None,
           key_dtype: torch.dtype | None = None) -> SampleOutput:
    """logits: [B, V] float32 of the rows that sample this step, on any device. t=None: every
    row is plain greedy. key_dtype: a dtype that holds the logits exactly (the model's)."""
    if t is None:
        (tokens,) = to_host(logits.argmax(-1))
        return SampleOutput(tokens.tolist(), None)
    tokens = _draw_tokens(logits, t, key_dtype)
    if t.num_logprobs < 0:
        (tokens,) = to_host(tokens)
        return SampleOutput(tokens.tolist(), None)
    logprobs = logits.log_softmax(-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    top_values, top_ids = logprobs.topk(max(t.num_logprobs, 1), dim=-1)
    tokens, chosen, top_values, top_ids = to_host(tokens, chosen, top_values, top_ids)
    token_list = tokens.tolist()
    rows = zip(token_list, chosen.tolist(), top_values.tolist(), top_ids.tolist(), t.logprobs,
               strict=True)
    per_row = [None if k is None else
               TokenLogprobs(tok, lp, tuple(zip(ids[:k], vals[:k], strict=True)))
               for tok, lp, vals, ids, k in rows]
    return SampleOutput(token_list, per_row)
