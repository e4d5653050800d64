"""The forward context: scoped to one forward pass and one thread, never nested."""

from __future__ import annotations

import threading

import pytest
import torch

from nanoserve.context import ForwardContext, forward_context, get_context


def ctx() -> ForwardContext:
    return ForwardContext(False, torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1))


def test_a_context_is_active_only_inside_its_block_and_refuses_nesting():
    c = ctx()
    with forward_context(c):
        assert get_context() is c
        with pytest.raises(RuntimeError, match="already active"), forward_context(ctx()):
            pass
        assert get_context() is c
    with pytest.raises(AssertionError, match="no forward context"):
        get_context()


def test_an_exception_inside_clears_the_context():
    with pytest.raises(ValueError), forward_context(ctx()):
        raise ValueError("inside a forward pass")
    with forward_context(ctx()):  # not left set by the failed pass
        pass


def test_contexts_of_two_threads_do_not_meet():
    mine, seen = ctx(), []
    entered, release = threading.Event(), threading.Event()

    def other_engine():
        with forward_context(ctx()) as theirs:
            entered.set()
            release.wait(5)
            seen.append(get_context() is theirs)

    t = threading.Thread(target=other_engine)
    t.start()
    entered.wait(5)
    with forward_context(mine):
        assert get_context() is mine
        release.set()
        t.join(5)
    assert seen == [True]
