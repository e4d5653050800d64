"""Constrained decoding through llguidance: a constrained sequence's grammar state, advanced by
each token it samples, and a step's allowed-token masks. The masks are computed on the host in
one parallel call (llguidance's executor) while the device runs the step's forward, and applied
on the device inside the batched sampler (sampler.apply_allowed); rows without a grammar take no
part in either."""

from __future__ import annotations

from functools import cache, lru_cache

import torch

from nanoserve.errors import InvalidParameter
from nanoserve.structured_outputs import FIELD, StructuredOutputs


@cache
def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as e:  # a dependency of the project: a broken install
        raise InvalidParameter(FIELD, f"structured outputs need llguidance ({e}); pip install "
                                      f"llguidance") from e
    return llguidance


@cache
def _executor():
    return _llguidance().LLExecutor()


class SequenceGrammar:
    """One sequence's place in its grammar."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> str | None:
        """Advances by the sampled token; why the grammar cannot go on, or None."""
        self.matcher.consume_token(token)
        if self.matcher.is_error():
            return self.matcher.get_error() or "the token is not allowed"
        return None

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but the end may follow."""
        return self.matcher.is_stopped()


class Grammars:
    """The engine's grammar compiler: its tokenizer's view for llguidance (built at the first
    constrained request) and each distinct spec's starting matcher (cached)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 ll_tokenizer=None) -> None:
        """`ll_tokenizer`: llguidance's view of the vocabulary, given (byte_vocabulary's, for
        a model without a tokenizer) instead of built from `tokenizer`."""
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, eos_token_ids
        if ll_tokenizer is not None:
            self._tok = ll_tokenizer

    @property
    def _ll_tokenizer(self):
        if not hasattr(self, "_tok"):
            if self.tokenizer is None:
                raise InvalidParameter(FIELD, "structured outputs need the model's tokenizer; "
                                              "this model has none")
            lg = _llguidance()
            try:
                self._tok = lg.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                 eos_token=list(self.eos) or None)
            except (ValueError, TypeError, AssertionError) as e:  # a slow or larger tokenizer
                raise InvalidParameter(FIELD, f"structured outputs cannot use this model's "
                                              f"tokenizer: {e}") from e
        return self._tok

    def compile(self, spec: StructuredOutputs) -> str:
        """The spec's grammar; InvalidParameter (a 400) when it does not compile."""
        lg = _llguidance()
        fmt, text = spec.llguidance_grammar()
        try:
            grammar = lg.grammar_from(fmt, text)
        except ValueError as e:
            raise InvalidParameter(FIELD, f"{FIELD}: {e}") from e
        error = lg.LLMatcher.validate_grammar(grammar, self._ll_tokenizer)
        if error:
            raise InvalidParameter(FIELD, f"{FIELD}: the grammar does not compile: {error}")
        return grammar

    @lru_cache(maxsize=256)  # noqa: B019 (one engine's compiler lives as long as the engine)
    def prototype(self, spec: StructuredOutputs):
        """The spec's matcher at its start, built once (a large schema takes a good part of a
        second); sequences start from copies of it. The server calls this (and so compile)
        on its request-parsing thread, so the engine's thread finds both built."""
        matcher = _llguidance().LLMatcher(self._ll_tokenizer, self.compile(spec))
        if matcher.is_error():
            raise InvalidParameter(FIELD, f"{FIELD}: {matcher.get_error()}")
        return matcher

    def start(self, spec: StructuredOutputs) -> SequenceGrammar:
        return SequenceGrammar(self.prototype(spec).deep_copy())


class MaskBuffers:
    """Host buffers for steps' masks (pinned where CUDA is), reused: allocating pinned memory
    each step costs more than filling it. Two take turns, so a step's masks are never written
    while the step before's upload may still read them (a step's masks are filled after the
    step before was read back, which its upload precedes)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self._buffers, self._turn = vocab_size, [None, None], 0

    def take(self, rows: int) -> torch.Tensor:
        self._turn ^= 1
        buf = self._buffers[self._turn]
        if buf is None or buf.shape[0] < rows:
            buf = self._buffers[self._turn] = \
                _llguidance().torch.allocate_token_bitmask(rows, self.vocab_size)
        return buf[:rows]


def allowed_token_masks(grammars: list[SequenceGrammar], vocab_size: int,
                        buffers: MaskBuffers | None = None) -> torch.Tensor:
    """Each grammar's allowed next tokens as bits, int32 [len(grammars), ceil(V / 32)] on the
    host (pinned where CUDA is), in one call that runs them in parallel; in one of `buffers`'
    when given."""
    lg = _llguidance()
    masks = buffers.take(len(grammars)) if buffers is not None else \
        lg.torch.allocate_token_bitmask(len(grammars), vocab_size)
    lg.torch.fill_next_token_bitmask_par(_executor(), [(g.matcher, i) for i, g in
                                                       enumerate(grammars)], masks)
    return masks


class _ByteVocabulary:
    """llguidance's tokenizer interface over byte_vocabulary's tokens."""

    def __init__(self, tokens: list[bytes], eos: int) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self.special_token_ids = [eos]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)  # one token a byte


def byte_vocabulary(vocab_size: int, eos: int):
    """llguidance's view of a made-up vocabulary of `vocab_size` tokens: the 256 bytes, then
    two-byte pieces of JSON's usual characters, then special tokens, `eos` the end. For a
    model without a tokenizer (dummy weights of a shipped shape): its constrained decoding
    runs as a real vocabulary's would, token ids standing for those bytes."""
    lg = _llguidance()
    common = b'abcdefghijklmnopqrstuvwxyz0123456789 "{}[]:,.'
    tokens = [bytes([b]) for b in range(256)]
    tokens += [bytes([a, b]) for a in common for b in common][:max(0, vocab_size - 256)]
    tokens += [b"<|special_%d|>" % i for i in range(vocab_size - len(tokens))]
    return lg.LLTokenizer(lg.TokenizerWrapper(_ByteVocabulary(tokens[:vocab_size], eos)))
