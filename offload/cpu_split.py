"""How much of each streamed layer's host KV the CPU attends while the rest crosses the link.

Per streamed layer of a decode step with B bytes of host KV, the CPU takes a fraction f and the
link the rest; the two run at once, so the layer takes about
    max((1 - f) * B / link_rate,  f * B / cpu_rate + overhead)
where the rates are each one's while the other runs (they share the host's memory) and the
overhead is what the CPU's share waits on besides its own work, once per layer (the sync on the
layer's queries, the layer's own GPU work before them). The best f makes the two equal:
    f = (B / link_rate - overhead) / (B / link_rate + B / cpu_rate)
which for large B tends to cpu_rate / (cpu_rate + link_rate). A fixed fraction skips the
rates. Each row gives the CPU floor(f * its full host pages).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CpuSplit:
    fixed: float | None = None  # a fraction chosen by the user; else from the rates
    cpu_rate: float = 0.0  # bytes/s of host KV the CPU attends, with the link busy
    link_rate: float = 0.0  # bytes/s the link moves, with the CPU attending
    overhead: float = 0.0  # seconds per layer the CPU's share waits besides its work

    def __post_init__(self) -> None:
        if self.fixed is not None and not 0.0 <= self.fixed <= 1.0:
            raise ValueError(f"a CPU attention fraction is in [0, 1], got {self.fixed}")
        if self.fixed is None and (self.cpu_rate <= 0 or self.link_rate <= 0):
            raise ValueError("a measured CPU split needs both rates > 0")

    def fraction(self, layer_bytes: int) -> float:
        """The CPU's share of a step whose rows hold `layer_bytes` of host KV per layer."""
        if self.fixed is not None:
            return self.fixed
        link, cpu = layer_bytes / self.link_rate, layer_bytes / self.cpu_rate
        if link + cpu <= 0:
            return 0.0
        return min(1.0, max(0.0, (link - self.overhead) / (link + cpu)))

    @staticmethod
    def pages(fraction: float, full_pages: int) -> int:
        return int(fraction * full_pages)

    @property
    def limit(self) -> float:
        """The fraction long contexts tend to."""
        if self.fixed is not None:
            return self.fixed
        return self.cpu_rate / (self.cpu_rate + self.link_rate)

    def describe(self) -> str:
        if self.fixed is not None:
            return f"CPU attention: {self.fixed:.0%} of each row's host KV (fixed)"
        return (f"CPU attention: {self.limit:.0%} of each row's host KV at long contexts, less "
                f"at short ones (CPU {self.cpu_rate / 1e9:.1f} GB/s and link "
                f"{self.link_rate / 1e9:.1f} GB/s while both run, "
                f"{self.overhead * 1e6:.0f} us per layer besides)")
