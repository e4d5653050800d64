"""Needle-in-a-haystack prompts of an exact token length.

A haystack of filler sentences (no digits) hides one needle sentence carrying a random secret
number at a chosen depth; the question after it asks for the number. Prompts are built as token
ids (template prefix + haystack + question + template suffix), so their length is exact for any
tokenizer. The needle test and the embedded model's training data both come from here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FILLER = [
    "The grass is green and the sky is blue.",
    "A river runs slowly through the old valley.",
    "Children walk to school along the quiet road.",
    "The baker opens his shop before the sun comes up.",
    "Clouds gather over the hills in the late afternoon.",
    "An old man feeds the birds in the park.",
    "The train leaves the station on time every morning.",
    "Fresh bread smells warm in the small kitchen.",
    "The library is full of students reading in silence.",
    "Leaves fall from the trees when autumn arrives.",
    "A cat sleeps on the window sill in the sun.",
    "The market is busy with people buying fruit.",
    "Snow covers the mountains far to the north.",
    "The fisherman mends his nets by the harbor.",
    "Music drifts from an open window down the street.",
    "The teacher writes a long sentence on the board.",
    "Rain taps softly against the roof all night.",
    "A dog chases a ball across the wide field.",
    "The painter mixes colors for a new picture.",
    "Wind moves the tall grass like waves on the sea.",
    "The shop on the corner sells maps and old books.",
    "Lights come on in the town as evening falls.",
    "A farmer drives his cart to the village.",
    "The lake is calm and reflects the pale moon.",
    "Travelers rest at the inn after a long journey.",
    "Bees move from flower to flower in the garden.",
    "The bridge over the river was built long ago.",
    "Her garden is full of roses and tall sunflowers.",
    "The clock in the square rings at noon.",
    "Sailors watch the stars to find their way home.",
]
NEEDLE = "The secret number is: {secret}."
QUESTION = "What is the secret number in the text above?"
ANSWER = "The secret number is: {secret}."
_MARK = "\x00HAYSTACK\x00"


@dataclass
class NeedlePrompt:
    token_ids: list[int]
    secret: str
    depth: float
    needle_start: int  # index of the needle's first token in token_ids
    needle_len: int


class NeedleBuilder:
    """Builds needle prompts for one tokenizer (anything with `encode`, optionally
    `apply_chat_template`)."""

    def __init__(self, tokenizer, use_chat_template: bool | None = None,
                 secret_digits: int = 6) -> None:
        self.tokenizer = tokenizer
        self.secret_digits = secret_digits
        if use_chat_template is None:
            use_chat_template = bool(getattr(tokenizer, "chat_template", None))
        if use_chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{_MARK}\n\n{QUESTION}"}], tokenize=False,
                add_generation_prompt=True, enable_thinking=False)
            before, after = text.split(_MARK)
        else:
            before, after = "", f"\n\nQuestion: {QUESTION}\nAnswer:"
        self.prefix = self.encode(before)
        self.suffix = self.encode(after)
        self.sentences = [self.encode(" " + s) for s in FILLER]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def min_len(self) -> int:
        return len(self.prefix) + len(self.suffix) + len(self.encode(" " + self.needle("9" * 9)))

    def needle(self, secret: str) -> str:
        return NEEDLE.format(secret=secret)

    def answer_ids(self, secret: str) -> list[int]:
        return self.encode(ANSWER.format(secret=secret))

    def random_secret(self, rng: random.Random) -> str:
        return str(rng.randrange(10 ** (self.secret_digits - 1), 10 ** self.secret_digits))

    def build(self, input_len: int, depth: float, rng: random.Random,
              secret: str | None = None) -> NeedlePrompt:
        """A prompt of exactly `input_len` tokens with the needle at `depth` (0 = first
        sentence, 1 = last, before the question), snapped to a sentence boundary."""
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        secret = secret or self.random_secret(rng)
        needle = self.encode(" " + self.needle(secret))
        budget = input_len - len(self.prefix) - len(self.suffix) - len(needle)
        if budget < 0:
            raise ValueError(f"input_len {input_len} is too short for a needle prompt "
                             f"(at least {input_len - budget} tokens)")
        filler: list[int] = []
        bounds = [0]  # token offsets where a sentence starts
        while len(filler) < budget:
            filler.extend(rng.choice(self.sentences))
            bounds.append(len(filler))
        del filler[budget:]
        target = round(depth * budget)
        cut = max(b for b in bounds if b <= target) if target < budget else budget
        start = len(self.prefix) + cut
        ids = self.prefix + filler[:cut] + needle + filler[cut:] + self.suffix
        assert len(ids) == input_len
        return NeedlePrompt(ids, secret, depth, start, len(needle))


def parse_depths(text: str) -> list[float]:
    """'0,0.5,1' -> [0.0, 0.5, 1.0]; '0,0.1,...,1' -> 0 to 1 in steps of 0.1."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    try:
        if "..." in items:
            if len(items) != 4 or items[2] != "...":
                raise ValueError
            a, b, last = float(items[0]), float(items[1]), float(items[3])
            n = round((last - a) / (b - a)) + 1
            depths = [round(a + (b - a) * i, 6) for i in range(n)]
        else:
            depths = [float(x) for x in items]
    except (ValueError, ZeroDivisionError):
        depths = []
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must be numbers in [0, 1] ('0,0.5,1' or '0,0.1,...,1'), "
                         f"got {text!r}")
    return depths
