"""Progress of long prefills (engine/prefill_progress.py): the bar appears only after a prefill
has run for a while (a fake clock), counts the batch's prompt tokens (joining prompts,
preemption), finishes at their length; LLM.generate shows it over a chunked prefill; /metrics
exposes the prefills in flight."""

from __future__ import annotations

import pytest
from helpers import make_llm

from nanoserve import SamplingParams
from nanoserve.engine import prefill_progress
from nanoserve.engine.prefill_progress import PrefillProgress, prefill_counts
from nanoserve.engine.sequence import Sequence, Status


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class RecordingBar:
    """What the progress asks of tqdm: its total, its count, whether closed."""

    made: list[RecordingBar] = []

    def __init__(self, total: int, initial: int, **kw) -> None:
        self.total, self.n, self.kw, self.closed = total, initial, kw, False
        RecordingBar.made.append(self)

    def update(self, k: int) -> None:
        self.n += k

    def close(self) -> None:
        self.closed = True


def test_the_bar_shows_after_the_delay_and_completes_at_the_prompts_length():
    RecordingBar.made.clear()
    clock = FakeClock()
    p = PrefillProgress(show_after=2.0, clock=clock, make_bar=RecordingBar)
    p.update(0, 1000)
    clock.now += 1.0
    p.update(300, 1000)
    assert RecordingBar.made == []  # a prefill shorter than the delay shows nothing
    clock.now += 1.5
    p.update(600, 1000)
    [bar] = RecordingBar.made
    assert (bar.total, bar.n, bar.kw["unit"], bar.kw["desc"]) == (1000, 600, "tok", "Prefill")
    clock.now += 1.0
    p.update(900, 1000)
    assert bar.n == 900 and not bar.closed
    p.update(1000, 1000)  # done: the bar completes and closes
    assert bar.n == 1000 and bar.closed and p.bar is None


def test_the_bar_follows_joining_prompts_and_preemption_and_off_shows_nothing():
    RecordingBar.made.clear()
    clock = FakeClock()
    p = PrefillProgress(show_after=0.0, clock=clock, make_bar=RecordingBar)
    p.update(10, 100)
    p.update(500, 1000)  # more prompts joined the batch: the same bar, a larger total
    p.update(200, 1000)  # one was preempted: its computed tokens count again from 0
    [bar] = RecordingBar.made
    assert (bar.total, bar.n, bar.closed) == (1000, 200, False)
    p.finish()
    assert (bar.n, bar.closed) == (1000, True)
    off = PrefillProgress(enabled=False, show_after=0.0, clock=clock, make_bar=RecordingBar)
    off.update(1, 10)
    assert len(RecordingBar.made) == 1 and off.bar is None


def test_prefill_counts_count_computed_prompt_tokens():
    params = SamplingParams(max_tokens=4)
    partial, decoding, finished, preempted = (Sequence(list(range(n)), params)
                                              for n in (100, 40, 60, 30))
    partial.num_cached, decoding.num_cached = 30, 45
    decoding.status = Status.RUNNING
    finished.status = Status.FINISHED  # its pages are released: num_cached 0
    assert prefill_counts([partial, decoding, finished, preempted]) == (30 + 40 + 60, 230)
    assert prefill_counts([]) == (0, 0)


def test_generate_shows_the_bar_over_a_chunked_prefill(capsys, monkeypatch):
    """Two prompts (200 and 100 tokens) in 32-token chunks: one bar over both, which ends at
    300/300; with progress off, nothing."""
    monkeypatch.setattr(prefill_progress, "SHOW_AFTER_S", 0.0)
    llm = make_llm(None, max_num_batched_tokens=32, max_model_len=256)
    llm.progress = True
    prompts = [list(range(1, 201)), list(range(7, 107))]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    err = capsys.readouterr().err
    assert err.count("Prefill") >= 1 and "300/300" in err
    llm.progress = False
    llm.generate(prompts, params)
    assert "Prefill" not in capsys.readouterr().err


def test_metrics_expose_the_prefill_in_flight():
    pytest.importorskip("prometheus_client")
    from nanoserve.serve.async_engine import AsyncEngine
    from nanoserve.serve.metrics import Metrics

    llm = make_llm(None, max_num_batched_tokens=32, max_model_len=256)
    engine = llm.engine
    engine.add_request(list(range(1, 101)), SamplingParams(max_tokens=2))
    engine.step()  # the first 32-token chunk

    def samples() -> dict[str, float]:
        text = Metrics(AsyncEngine(engine), "m").render().decode()
        return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("nanoserve_prefill_")}

    assert samples() == {"nanoserve_prefill_prompt_tokens": 100.0,
                         "nanoserve_prefill_computed_tokens": 32.0}
    while engine.has_unfinished():
        engine.step()
    assert samples() == {"nanoserve_prefill_prompt_tokens": 0.0,
                         "nanoserve_prefill_computed_tokens": 0.0}
