"""KV offload: pinned host KV store, GPU ring slots, and the copy-stream streamer.

Knows tensors, streams, events and layouts only; imports nothing from nanoserve. The engine owns
the layer loop and calls the streamer before and after each streamed layer.
"""

from offload.cpu_split import CpuSplit
from offload.host_store import HostKVStore, coalesce_runs
from offload.layout import PageLayout
from offload.plan import ResidencyPlan, plan_residency
from offload.streamer import LayerStreamer, StepPlan

__all__ = ["CpuSplit", "HostKVStore", "LayerStreamer", "PageLayout", "ResidencyPlan", "StepPlan",
           "coalesce_runs", "plan_residency"]
