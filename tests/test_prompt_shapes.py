"""LLM.generate's prompts argument: a list is one prompt of token ids or a batch of prompts,
never a mix that reads as both."""

from __future__ import annotations

import pytest
from helpers import make_llm

from nanoserve import InvalidParameter, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return make_llm(None, max_num_seqs=4, max_model_len=64)


@pytest.mark.parametrize("prompts, kind, item", [
    ([5, "a"], "str", 1), (["a", 5], "str", 0), ([5, 6, "seven"], "str", 2),
    ([5, 2.5], "float", 1), ([5, True], "bool", 1), ([5, None], "NoneType", 1)])
def test_token_ids_mixed_with_other_items_are_one_error_naming_prompts(llm, prompts, kind,
                                                                        item):
    with pytest.raises(InvalidParameter) as e:
        llm.generate(prompts, GREEDY)
    assert e.value.param == "prompts"
    assert str(e.value) == (f"prompts mixes token ids with a {kind} (item {item}): one prompt "
                            f"of token ids is a list of ints only; a batch is a list of "
                            f"strings or of token-id lists")
    eng = llm.engine
    assert not eng.has_unfinished() and eng.kv.num_free == eng.kv.capacity  # nothing queued


def test_token_ids_strings_and_token_id_lists_still_make_prompts_and_batches(llm):
    assert len(llm.generate([5, 6], GREEDY)) == 1  # one prompt of token ids
    outs = llm.generate(["a", "b"], GREEDY)
    assert len(outs) == 2 and all(o.error is None for o in outs)
    # beside a token-id list the list is a batch: the int is one bad prompt, refused alone
    outs = llm.generate([[5, 6], 7, "a"], GREEDY)
    assert [o.error is None for o in outs] == [True, False, True]
