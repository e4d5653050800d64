"""How much of each streamed layer's host KV the CPU attends while the rest crosses the link.

Per streamed layer of a decode step with B bytes of host KV, the CPU takes a fraction f and the
link the rest; the two run at once, so the layer takes about
    max((1 - f) * B / link_rate,  f * B / cpu_rate + overhead)
where the rates are each one's while the other runs (they share the host's memory) and the
overhead is what the CPU's share waits on besides its own work, once per layer (the sync on the
layer's queries, the layer's own GPU work before them). The best f makes the two equal:
    f = (B / link_rate - overhead) / (B / link_rate + B / cpu_rate)
which for large B tends to cpu_rate / (cpu_rate + link_rate). Rows that share prefix pages
(one document, many questions) count them once on the link's side and once per row on the
CPU's, which reads them for each row: the more rows share, the less goes to the CPU.

The start-up probe measures the rates; each decode step with a CPU share then refines the
rates and the overhead from what the host saw (`calibrated`): the probe cannot see the layer's
own GPU work, which with Qwen3-8B at batch 1 made the overhead 0.2-0.4 ms a layer against the
probe's sync alone, and its CPU reads all the time where a step's reads for part of each
layer, so steps see the link faster than the probe beside the CPU does (`link_now`). A fixed
fraction skips all that. Each row gives the CPU floor(f * its full host pages).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

# a layer's cycle against the time the link needs for its share at its rate beside the CPU:
# above, the CPU set the pace; below, the link did, faster than thought; between, the host
# cannot tell
PACED_BY_CPU, PACED_BY_LINK = 1.05, 0.9
GAPS_KEPT = 9  # the overhead is the lower median of the last gaps of layers the CPU paced
DECAY, DRIFT = 0.9, 0.98  # the overhead's estimate per step the link paced, clearly or not


@dataclass(frozen=True)
class CpuSplit:
    fixed: float | None = None  # a fraction chosen by the user; else from the rates
    cpu_rate: float = 0.0  # bytes/s of host KV the CPU attends, with the link busy
    link_rate: float = 0.0  # bytes/s the link moves, with the CPU attending (the probe's)
    link_alone: float = 0.0  # the probe's rate of the link alone
    link_seen: tuple[float, ...] = ()  # the last steps' link bytes per layer over their cycle
    overhead: float = 0.0  # seconds per layer the CPU's share waits besides its work
    calibrated_steps: int = 0  # decode steps whose figures refined the rates (calibrated)
    cpu_paced_gaps: tuple[float, ...] = ()  # the last gaps of layers the CPU paced

    def __post_init__(self) -> None:
        if self.fixed is not None and not 0.0 <= self.fixed <= 1.0:
            raise ValueError(f"a CPU attention fraction is in [0, 1], got {self.fixed}")
        if self.fixed is None and (self.cpu_rate <= 0 or self.link_rate <= 0):
            raise ValueError("a measured CPU split needs both rates > 0")

    def fraction(self, layer_bytes: int, row_bytes: int | None = None) -> float:
        """The CPU's share of a step whose rows hold `layer_bytes` of distinct host KV per
        layer, `row_bytes` counted row by row (more where rows share prefix pages: the link
        moves a shared page once, the CPU reads it for each row that attends it there)."""
        if self.fixed is not None:
            return self.fixed
        row_bytes = layer_bytes if row_bytes is None else row_bytes
        link, cpu = layer_bytes / self.link_now, row_bytes / self.cpu_rate
        if link + cpu <= 0:
            return 0.0
        return min(1.0, max(0.0, (link - self.overhead) / (link + cpu)))

    def calibrated(self, gap: float, work: float, cpu_bytes: int,
                   link_bytes: int = 0) -> CpuSplit:
        """The split after a decode step whose host spent `work` seconds per layer in the CPU
        kernel on `cpu_bytes` of KV and `gap` seconds between one layer's kernel and the next,
        while the link moved `link_bytes` per layer (measured split only).

        The CPU's rate is the one just seen (averaged with the last). A layer's cycle, work
        plus gap, is paced by the CPU or by the link, which runs layers ahead of the CPU.
        Where the cycle is clearly longer than the link needs for its share at its rate beside
        the CPU (PACED_BY_CPU), the CPU set the pace and the gap is all overhead: the estimate
        is the lower median of the last such gaps (hiccups only lengthen a gap; their least,
        133 us where the median was 204, gave FP8 at 32K 0.33 where 0.30 was best). Otherwise
        the gap may be waiting for the link: the estimate decays, fast where the cycle is
        clearly shorter than the link's time (PACED_BY_LINK), slowly near the balance, where
        the host cannot tell the two apart; so more goes to the CPU until it sets the pace and
        is measured again. (An estimate that fell to nothing near the balance drifted FP8 at
        32K to 0.37 where 0.30 was best; one that stayed there, inflated, held bf16 at 0.34
        where 0.45 was; pacing told at the probe's alone rate, 53 GB/s, where bf16's steps
        beside the CPU ran slower, took link-paced layers for CPU-paced ones and their waits
        for overhead, 413 us, holding bf16 at 0.28.) The fraction itself prices the link at
        the rate steps reached (`link_now`)."""
        if self.fixed is not None or work <= 0 or cpu_bytes <= 0:
            return self
        rate, cycle = cpu_bytes / work, work + gap
        seen = (*self.link_seen, link_bytes / cycle)[-GAPS_KEPT:] if link_bytes else self.link_seen
        link_time = link_bytes / self.link_rate if link_bytes else 0.0
        overhead, gaps = self.overhead, self.cpu_paced_gaps
        if not link_bytes or cycle > PACED_BY_CPU * link_time:
            gaps = (*gaps, gap)[-GAPS_KEPT:]
            overhead = statistics.median_low(gaps)
        else:
            overhead *= DECAY if cycle < PACED_BY_LINK * link_time else DRIFT
        return replace(self, cpu_rate=rate if not self.calibrated_steps else
                       0.5 * (self.cpu_rate + rate), overhead=overhead, cpu_paced_gaps=gaps,
                       link_seen=seen, calibrated_steps=self.calibrated_steps + 1)

    @property
    def link_now(self) -> float:
        """The link's rate the plan uses: the most of the probe's and of the last steps'.
        The link moves its share of a layer within the layer's cycle, so its bytes over the
        cycle are a rate it reached, whoever set the pace (FP8 steps at 32K saw 53 GB/s where
        the probe saw 49-51 alone and 45 beside the CPU, whose reads it shares all the time
        where a step's CPU reads for part of each layer)."""
        return max((self.link_rate, self.link_alone, *self.link_seen))

    @staticmethod
    def pages(fraction: float, full_pages: int) -> int:
        return int(fraction * full_pages)

    @property
    def limit(self) -> float:
        """The fraction long contexts tend to."""
        if self.fixed is not None:
            return self.fixed
        return self.cpu_rate / (self.cpu_rate + self.link_now)

    def describe(self) -> str:
        if self.fixed is not None:
            return f"CPU attention: {self.fixed:.0%} of each row's host KV (fixed)"
        return (f"CPU attention: {self.limit:.0%} of each row's host KV at long contexts, less "
                f"at short ones (CPU {self.cpu_rate / 1e9:.1f} GB/s and link "
                f"{self.link_now / 1e9:.1f} GB/s while both run, "
                f"{self.overhead * 1e6:.0f} us per layer besides)")
