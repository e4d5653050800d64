"""Prometheus metrics of one app, in a registry of its own (several apps can share a process).

Gauges and counters are read from the engine's state when scraped (a custom collector); the
latency histograms are observed by the engine thread as requests progress, with vLLM's names
and buckets under the `nanoserve_` prefix:

- nanoserve_time_to_first_token_seconds: request arrival (after tokenization) to its first token
- nanoserve_time_per_output_token_seconds: inter-token latency, one observation per token after
  a completion's first
- nanoserve_e2e_request_latency_seconds: arrival to the request's last token (any finish reason)
- nanoserve_request_queue_time_seconds: arrival to its first scheduled step
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from nanoserve.engine.prefill_progress import prefill_counts
from nanoserve.serve.async_engine import AsyncEngine

CONTENT_TYPE = CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineCollector:
    """Gauges and counters read from the engine at scrape time."""

    def __init__(self, ae: AsyncEngine, model: str) -> None:
        self.ae, self.model = ae, model

    def collect(self):
        ae, model = self.ae, self.model
        engine = ae.engine
        sched, kv = engine.scheduler, engine.kv
        used, plan = kv.num_used, kv.plan

        def gauge(name: str, help_: str, value: float, **labels: str) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"nanoserve_{name}", help_, labels=["model", *labels])
            g.add_metric([model, *labels.values()], value)
            return g

        def counter(name: str, help_: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"nanoserve_{name}", help_, labels=["model"])
            c.add_metric([model], value)
            return c

        yield gauge("requests_running", "Sequences decoding.", len(sched.running))
        yield gauge("requests_waiting", "Sequences queued, prefilling or preempted.",
                    len(sched.waiting))
        prefilling = [s for s in tuple(sched.waiting) if s.num_cached < s.num_prompt_tokens]
        done, total = prefill_counts(prefilling)  # (running: prompts computed)
        yield gauge("prefill_prompt_tokens", "Prompt tokens of the sequences whose prompt is "
                    "not all computed yet (per sequence: n completions count n times).", total)
        yield gauge("prefill_computed_tokens", "Of those, the tokens computed so far (or served "
                    "by the prefix cache): a long prefill's progress.", done)
        # one page id holds a token range for every layer: resident layers' KV on the device
        # (a GPU, or the CPU the engine runs on), streamed layers' KV in host memory; `device`
        # names the memory each tier is in
        where = {"device": kv.device.type, "host": "cpu"}
        pages = GaugeMetricFamily("nanoserve_kv_pages_used", "KV pages in use, by tier.",
                                  labels=["model", "tier", "device"])
        pages.add_metric([model, "device", where["device"]], used if plan.resident_layers else 0)
        pages.add_metric([model, "host", where["host"]], used if plan.streamed_layers else 0)
        yield pages
        yield gauge("kv_pages_total", "KV pages the budgets hold.", kv.capacity)
        if kv.cache is not None:
            yield gauge("prefix_cache_pages", "KV pages in the prefix cache (in use or not).",
                        len(kv.cache))
            yield gauge("prefix_cache_evictable_pages", "Cached KV pages no request holds.",
                        kv.pages.num_evictable)
            yield counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix "
                          "cache.", kv.cache.queried_tokens)
            yield counter("prefix_cache_hits_total", "Prompt tokens served from the prefix "
                          "cache.", kv.cache.hit_tokens)
            hit_rate = kv.cache.hit_tokens / max(1, kv.cache.queried_tokens)
            yield gauge("prefix_cache_hit_rate", "Share of prompt tokens served from the "
                        "prefix cache, since start.", hit_rate)
        nbytes = GaugeMetricFamily("nanoserve_kv_bytes_used", "KV bytes in use, by tier.",
                                   labels=["model", "tier", "device"])
        for tier, value in kv.used_bytes().items():
            nbytes.add_metric([model, tier, where[tier]], value)
        yield nbytes
        yield counter("prompt_tokens_total", "Prompt tokens admitted.",
                      ae.stats.prompt_tokens_total)
        yield counter("generation_tokens_total", "Tokens generated.",
                      ae.stats.generation_tokens_total)
        yield gauge("generation_tokens_per_second", "Tokens generated per second, last 10 s.",
                    round(ae.stats.tokens_per_second(), 3))
        finished = CounterMetricFamily("nanoserve_requests_finished_total",
                                       "Finished completions by reason.",
                                       labels=["model", "reason"])
        for reason, count in sorted(ae.stats.requests_finished.items()):
            finished.add_metric([model, reason], count)
        yield finished
        yield counter("preemptions_total", "Sequences preempted for KV pages.",
                      sched.num_preemptions)


class Metrics:
    """The app's registry; the engine thread reports latencies through it."""

    def __init__(self, ae: AsyncEngine, model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(ae, model))

        def histogram(name: str, help_: str, buckets) -> Histogram:
            return Histogram(f"nanoserve_{name}", help_, ["model"], buckets=buckets,
                             registry=self.registry).labels(model=model)

        self._ttft = histogram("time_to_first_token_seconds",
                               "Time to first token: arrival to the first generated token.",
                               TTFT_BUCKETS)
        self._tpot = histogram("time_per_output_token_seconds",
                               "Inter-token latency: time per output token after the first.",
                               TPOT_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds",
                              "End-to-end request latency: arrival to the last token.",
                              REQUEST_BUCKETS)
        self._queue = histogram("request_queue_time_seconds",
                                "Queue time: arrival to the request's first scheduled step.",
                                REQUEST_BUCKETS)
        ae.observer = self

    # called on the engine thread
    def first_token(self, seconds: float) -> None:
        self._ttft.observe(max(seconds, 0.0))

    def queued(self, seconds: float) -> None:
        self._queue.observe(max(seconds, 0.0))

    def inter_token(self, seconds: float, count: int = 1) -> None:
        for _ in range(count):
            self._tpot.observe(max(seconds, 0.0))

    def finished(self, seconds: float) -> None:
        self._e2e.observe(max(seconds, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
