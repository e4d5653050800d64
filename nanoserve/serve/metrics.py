"""Prometheus text exposition of the engine's state."""

from __future__ import annotations

from nanoserve.serve.async_engine import AsyncEngine


def render_metrics(ae: AsyncEngine, model: str) -> str:
    engine = ae.engine
    sched, alloc, plan = engine.scheduler, engine.allocator, engine.runner.plan
    used = alloc.capacity - alloc.num_free
    label = f'model="{model}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP nanoserve_{name} {help_}")
        lines.append(f"# TYPE nanoserve_{name} {kind}")
        for labels, value in samples:
            extra = f",{labels}" if labels else ""
            lines.append(f"nanoserve_{name}{{{label}{extra}}} {value}")

    metric("requests_running", "gauge", "Requests decoding.", [("", len(sched.running))])
    metric("requests_waiting", "gauge", "Requests queued or prefilling.",
           [("", len(sched.waiting))])
    # one page id holds a token range for every layer: resident layers' KV on the GPU,
    # streamed layers' KV in host memory
    gpu_used = used if plan.resident_layers else 0
    host_used = used if plan.streamed_layers else 0
    metric("kv_pages_used", "gauge", "KV pages in use, by tier.",
           [('tier="gpu"', gpu_used), ('tier="host"', host_used)])
    metric("kv_pages_total", "gauge", "KV pages the budgets hold.", [("", alloc.capacity)])
    metric("kv_bytes_used", "gauge", "KV bytes in use, by tier.",
           [('tier="gpu"', used * plan.resident_layers * plan.layer_page_bytes),
            ('tier="host"', used * plan.streamed_layers * plan.layer_page_bytes)])
    metric("prompt_tokens_total", "counter", "Prompt tokens admitted.",
           [("", ae.stats.prompt_tokens_total)])
    metric("generation_tokens_total", "counter", "Tokens generated.",
           [("", ae.stats.generation_tokens_total)])
    metric("generation_tokens_per_second", "gauge", "Tokens generated per second, last 10 s.",
           [("", round(ae.stats.tokens_per_second(), 3))])
    metric("requests_finished_total", "counter", "Finished requests by reason.",
           [(f'reason="{k}"', v) for k, v in sorted(ae.stats.requests_finished.items())])
    metric("preemptions_total", "counter", "Sequences preempted for KV pages.",
           [("", sched.num_preemptions)])
    return "\n".join(lines) + "\n"
