"""Progress of long prefills (engine/prefill_progress.py): the bar appears only after a prefill
has run for a while, counts prompt tokens with the rate and time left of a fake clock, finishes
at the prompt's length; LLM.generate shows it over a chunked prefill; /metrics exposes it."""

from __future__ import annotations

import pytest
from helpers import make_llm

from nanoserve import SamplingParams
from nanoserve.engine import prefill_progress
from nanoserve.engine.prefill_progress import PrefillProgress, prefill_counts
from nanoserve.engine.sequence import Sequence


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


def test_the_bar_shows_after_the_delay_with_the_rate_and_time_left():
    RecordingBar.made.clear()
    clock = FakeClock()
    p = PrefillProgress(show_after=2.0, clock=clock, make_bar=RecordingBar)
    p.update(0, 1000)
    clock.now += 1.0
    p.update(300, 1000)
    assert RecordingBar.made == []  # a prefill shorter than the delay shows nothing
    assert p.rate == pytest.approx(300.0) and p.eta == pytest.approx(700 / 300)
    clock.now += 1.5
    p.update(600, 1000)
    [bar] = RecordingBar.made
    assert (bar.total, bar.n, bar.kw["unit"]) == (1000, 600, "tok")
    assert p.rate == pytest.approx(240.0) and p.eta == pytest.approx(400 / 240)
    clock.now += 1.0
    p.update(900, 1000)
    assert bar.n == 900 and not bar.closed
    p.update(1000, 1000)  # done: the bar completes and closes
    assert bar.n == 1000 and bar.closed and p.bar is None and p.rate is None


def test_new_prefills_start_the_count_over_and_a_disabled_progress_shows_nothing():
    RecordingBar.made.clear()
    clock = FakeClock()
    p = PrefillProgress(show_after=0.0, clock=clock, make_bar=RecordingBar)
    p.update(10, 100)
    clock.now += 1
    p.update(50, 300)  # a second prompt joined: a new bar over both
    first, second = RecordingBar.made
    assert first.closed and (second.total, second.n) == (300, 50) and not second.closed
    assert p.rate is None  # no time has passed for the new count
    off = PrefillProgress(enabled=False, show_after=0.0, clock=clock, make_bar=RecordingBar)
    off.update(1, 10)
    assert len(RecordingBar.made) == 2 and off.bar is None


def test_prefill_counts_only_prompts_still_being_computed():
    params = SamplingParams(max_tokens=4)
    partial, whole, cached = (Sequence(list(range(n)), params) for n in (100, 40, 60))
    partial.num_cached, whole.num_cached, cached.num_cached = 30, 40, 20
    assert prefill_counts([partial, whole, cached]) == (50, 160)
    assert prefill_counts([whole]) == (0, 0)


def test_generate_shows_the_bar_over_a_chunked_prefill(capsys, monkeypatch):
    monkeypatch.setattr(prefill_progress, "SHOW_AFTER_S", 0.0)
    llm = make_llm(None, max_num_batched_tokens=32, max_model_len=256)
    llm.progress = True
    [out] = llm.generate([list(range(1, 201))], SamplingParams(max_tokens=2, ignore_eos=True))
    assert out.error is None and len(out.outputs[0].token_ids) == 2
    err = capsys.readouterr().err
    assert "Prefill" in err and "200/200" in err
    llm.progress = False  # and without progress, not a character
    llm.generate([list(range(1, 201))], SamplingParams(max_tokens=2, ignore_eos=True))
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
