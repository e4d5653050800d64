"""Qwen3's reasoning parser: the (reasoning, content) split of whole outputs, and that streaming
gives the same split for any cutting of the output into deltas."""

from __future__ import annotations

import pytest
from helpers import cuttings

from nanoserve.serve.reasoning import REASONING_PARSERS, Qwen3ReasoningParser

# starts_in -> {case: (text, parse()'s reasoning, parse()'s content)}
CASES = {
    "auto": {
        "think then answer": ("<think>\nThe user wants 2+2.\nThat is 4.\n</think>\n\nIt is 4.",
                              "The user wants 2+2.\nThat is 4.", "It is 4."),
        "no tags is all content, verbatim": ("Just an answer.\n", None, "Just an answer.\n"),
        "cut off while thinking is all reasoning": ("<think>\nLet me think about",
                                                    "Let me think about", None),
        "a close without an open": ("Thinking begun in the prompt.\n</think>\n\nAnswer.",
                                    "Thinking begun in the prompt.", "Answer."),
        "empty thinking": ("<think>\n\n</think>\n\nHi!", None, "Hi!"),
        "only reasoning": ("<think>x</think>", "x", None),
        "the content keeps its trailing whitespace": ("<think>a</think>  b \n", "a", "b \n"),
        "whitespace before the open": ("\n <think>a</think>b", "a", "b"),
        "an open after text is reasoning text": ("Hello <think>a</think>b", "Hello <think>a", "b"),
        "a second close is content": ("<think>a</think>b</think>c", "a", "b</think>c"),
        "a second open is reasoning": ("<think><think>a</think>b", "<think>a", "b"),
        "a start of the open tag is content": ("<thi", None, "<thi"),
        "a start of the close tag is reasoning": ("<think>a</thi", "a</thi", None),
        "tag look-alikes": ("<thinking>a</thinker>", None, "<thinking>a</thinker>"),
        "unicode": ("<think>考虑一下 🤔</think>答案是四。", "考虑一下 🤔", "答案是四。"),
        "empty": ("", None, None),
        "only the open tag": ("<think>\n", None, None),
    },
    "reasoning": {
        "reasoning then answer": ("Let me see.\n</think>\n\nFour.", "Let me see.", "Four."),
        "unclosed is all reasoning": ("Still thinking ", "Still thinking", None),
        "an open tag is dropped": ("<think>a</think>b", "a", "b"),
        "a start of the open tag is reasoning": ("<thi", "<thi", None),
        "empty": ("", None, None),
    },
    "content": {
        "tags are content": ("<think>a</think>b", None, "<think>a</think>b"),
        "verbatim": ("  Four.\n", None, "  Four.\n"),
        "empty": ("", None, None),
    },
}

ALL = [(starts_in, text, reasoning, content)
       for starts_in, cases in CASES.items() for text, reasoning, content in cases.values()]
ALL_IDS = [f"{starts_in}: {name}" for starts_in, cases in CASES.items() for name in cases]


def stream(parser: Qwen3ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    outs = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return "".join(r for r, _ in outs), "".join(c for _, c in outs)


@pytest.mark.parametrize("starts_in, text, reasoning, content", ALL, ids=ALL_IDS)
def test_parse_splits_reasoning_from_content(starts_in, text, reasoning, content):
    assert Qwen3ReasoningParser(starts_in).parse(text) == (reasoning, content)


@pytest.mark.parametrize("starts_in, text, reasoning, content", ALL, ids=ALL_IDS)
def test_streaming_any_cutting_gives_what_parse_gives(starts_in, text, reasoning, content):
    """Streamed pieces concatenate exactly to parse()'s parts, None as ""."""
    want = tuple(part or "" for part in Qwen3ReasoningParser(starts_in).parse(text))
    for pieces in cuttings(text):
        assert stream(Qwen3ReasoningParser(starts_in), pieces) == want, pieces


def test_reasoning_streams_before_the_close_tag():
    parser = Qwen3ReasoningParser()
    assert parser.feed("<think>\nStep one") == ("Step one", "")
    assert parser.feed(", step two.\n") == (", step two.", "")


def test_a_possible_close_tag_is_held_back_until_it_completes():
    parser = Qwen3ReasoningParser()
    assert parser.feed("<think>abc</th") == ("abc", "")
    assert parser.feed("ink>\n\nHi") == ("", "Hi")


def test_a_possible_close_tag_that_is_not_one_goes_on_as_reasoning():
    parser = Qwen3ReasoningParser()
    assert parser.feed("<think>a </th") == ("a", "")
    assert parser.feed("ere") == (" </there", "")


def test_auto_holds_an_output_without_an_open_tag_until_its_end():
    parser = Qwen3ReasoningParser()
    assert parser.feed("Hello") == ("", "")
    assert parser.feed(" there") == ("", "")
    assert parser.finish() == ("", "Hello there")


def test_auto_releases_held_text_as_reasoning_when_a_close_tag_comes():
    parser = Qwen3ReasoningParser()
    assert parser.feed("Hmm") == ("", "")
    assert parser.feed(".</think>Yes") == ("Hmm.", "Yes")


def test_reasoning_start_streams_at_once():
    parser = Qwen3ReasoningParser("reasoning")
    assert parser.feed("Step one") == ("Step one", "")


def test_content_start_streams_verbatim():
    parser = Qwen3ReasoningParser("content")
    assert parser.feed(" Hi") == ("", " Hi")
    assert parser.feed(" </think>") == ("", " </think>")


def test_an_unknown_start_is_refused():
    with pytest.raises(ValueError, match="starts_in must be one of auto, reasoning, content"):
        Qwen3ReasoningParser("thinking")


def test_the_registry_names_qwen3():
    assert REASONING_PARSERS == {"qwen3": Qwen3ReasoningParser}
