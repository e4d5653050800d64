"""Which layers keep their KV on the GPU and which stream from host memory.

All tiers share one page-id space: page p of a resident layer lives in the GPU pool at p, page p
of a streamed layer lives in the host store at p, and each GPU ring slot mirrors the whole page
range, so one page table serves every layer and every kernel. GPU bytes for KV are then
(resident_layers + num_slots) * pages * layer_page_bytes + streamed_layers * tail_bytes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ResidencyPlan:
    num_layers: int
    resident_layers: int  # layers [0, resident_layers) resident; the rest streamed
    num_pages: int
    layer_page_bytes: int  # K+V of one page of one layer

    @property
    def streamed_layers(self) -> int:
        return self.num_layers - self.resident_layers

    @property
    def offloading(self) -> bool:
        return self.streamed_layers > 0

    def streamed_bytes(self, num_pages: int) -> int:
        """Host-to-device bytes of one step whose batch holds `num_pages` pages on the host."""
        return self.streamed_layers * num_pages * self.layer_page_bytes


def plan_residency(num_layers: int, layer_page_bytes: int, wanted_pages: int,
                   gpu_budget_bytes: int, host_budget_bytes: int, num_slots: int,
                   tail_bytes_per_layer: int, resident_layers: int | None = None) -> ResidencyPlan:
    """The most resident layers for which `wanted_pages` fit both budgets; fewer pages if even
    an all-streamed split cannot hold them. `resident_layers` forces the split."""
    lpb = layer_page_bytes

    def gpu_bytes(r: int, p: int) -> int:
        if r == num_layers:
            return r * p * lpb
        return (r + num_slots) * p * lpb + (num_layers - r) * tail_bytes_per_layer

    def host_pages(r: int) -> int:
        return wanted_pages if r == num_layers else host_budget_bytes // ((num_layers - r) * lpb)

    candidates = [resident_layers] if resident_layers is not None else \
        range(num_layers, -1, -1)
    for r in candidates:
        p = min(wanted_pages, host_pages(r))
        if gpu_bytes(r, p) <= gpu_budget_bytes and p >= 2:
            return ResidencyPlan(num_layers, r, p, lpb)
    r = 0 if resident_layers is None else resident_layers
    spare = gpu_budget_bytes - (num_layers - r) * tail_bytes_per_layer
    p = min(host_pages(r), spare // ((r + num_slots) * lpb)) if spare > 0 else 0
    if p < 2:
        raise ValueError(
            f"KV budgets too small: GPU {gpu_budget_bytes / 2**30:.4g} GiB, host "
            f"{host_budget_bytes / 2**30:.4g} GiB cannot hold {num_slots} ring slots of 2 pages "
            f"({layer_page_bytes} bytes per page per layer) with resident_layers={r}")
    return ResidencyPlan(num_layers, r, p, lpb)
