"""Offloaded decode's link and compute timelines from CUDA events, without a profiler: where the
host->device link idles in a step, and what the compute stream is doing meanwhile.

    python tools/link_timeline.py --input-len 4096 --num-kv-buffers 2,3,4

Each streamed layer's load is bracketed by timing events on the copy stream, and the compute
stream marks the start of the step (launch), the executor's run (inputs uploaded), each layer's
start (its load waited for) and end, and the logits. Steps run as the bench runs them (graphs,
async scheduling). The same steps also run uninstrumented and with other event placements
(--variants), to show what the events cost.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import defaultdict

import torch

from nanoserve import LLM, SamplingParams


class Marks:
    """Timing events per step, by name (and layer for the per-layer ones)."""

    COPY = ("load_start", "load_end")  # on the copy stream; the rest on the compute stream

    def __init__(self) -> None:
        # per run of the "all" variant, its steps: events by (name, layer), and ("bytes", -1)
        self.runs: list[list[dict]] = []
        self.on = False
        self.where, self.timing = ("copy", "compute"), True  # which marks; timing events?
        self.current: dict[tuple[str, int], torch.cuda.Event] | None = None  # in a launch
        self.loads = -1  # loads queued so far in the current launch

    def mark(self, name: str, j: int = -1) -> None:
        stream = "copy" if name in self.COPY else "compute"
        if self.current is not None and (name in self.where or stream in self.where):
            ev = torch.cuda.Event(enable_timing=self.timing)
            ev.record()
            self.current[(name, j)] = ev


def instrument(llm: LLM, marks: Marks) -> None:
    runner = llm.engine.runner
    s = runner.kv.streamer

    host_load, wait_loaded, finish_layer = s.host.load, s.wait_loaded, s.finish_layer
    begin_step, end_step, launch = s.begin_step, s.end_step, runner.launch
    def timed_load(j, runs, slot):  # on the copy stream, after its wait for the slot
        marks.loads += 1  # loads run in order
        k = marks.loads
        marks.mark("load_start", k)
        host_load(j, runs, slot)
        marks.mark("load_end", k)

    def timed_wait(j):
        wait_loaded(j)
        marks.mark("layer_start", j)

    def timed_finish(j):
        marks.mark("layer_end", j)
        finish_layer(j)

    def timed_begin(plan):
        marks.mark("run")
        begin_step(plan)

    def timed_end():
        marks.mark("logits")
        end_step()

    def timed_launch(batch, in_flight):  # a decode step's work is all queued in here
        marks.current = {} if marks.on else None
        marks.loads = -1
        marks.mark("launch")
        out = launch(batch, in_flight)
        marks.mark("sampled")
        if marks.current is not None and marks.timing and marks.where == ("copy", "compute"):
            marks.current[("bytes", -1)] = s.bytes_loaded  # this step's, set by begin_step
            marks.runs[-1].append(marks.current)
        marks.current = None
        return out

    s.host.load, s.wait_loaded, s.finish_layer = timed_load, timed_wait, timed_finish
    s.begin_step, s.end_step, runner.launch = timed_begin, timed_end, timed_launch


def report(marks: Marks, layers: int) -> None:
    torch.cuda.synchronize()
    t, pairs = [], []  # steps as ms since their run's first launch; consecutive steps of a run
    for run in marks.runs:
        steps = [m for m in run if ("sampled", -1) in m and ("load_end", layers - 1) in m]
        run_t = [{k: steps[0][("launch", -1)].elapsed_time(v) if k[0] != "bytes" else v
                  for k, v in m.items()} for m in steps]
        t += run_t
        pairs += zip(run_t, run_t[1:], strict=False)
    step_ms = [b[("launch", -1)] - a[("launch", -1)] for a, b in pairs]
    busy = [sum(m[("load_end", k)] - m[("load_start", k)] for k in range(layers)) for m in t]
    rate = [m[("bytes", -1)] / b / 1e6 for m, b in zip(t, busy, strict=True)]
    gap = defaultdict(list)  # link idle before load k (k = 0: since the last step's last load)
    for a, b in pairs:
        gap[0].append(b[("load_start", 0)] - a[("load_end", layers - 1)])
        for k in range(1, layers):
            gap[k].append(b[("load_start", k)] - b[("load_end", k - 1)])
    med = statistics.median
    print(f"  step {med(step_ms):.3f} ms (launch to launch); link busy {med(busy):.3f} ms "
          f"({med(rate):.1f} GB/s), idle {med(step_ms) - med(busy):.3f} ms a step")
    worst = sorted(gap, key=lambda k: -med(gap[k]))[:6]
    print("  link idle before load k (median ms): " +
          ", ".join(f"k={k}: {med(gap[k]):.3f}" for k in sorted(worst)))
    rows = []
    for a, b in pairs:  # the boundary on the compute stream, from a's last layer
        last = a[("layer_end", layers - 1)]
        rows.append((a[("logits", -1)] - last, a[("sampled", -1)] - a[("logits", -1)],
                     b[("run", -1)] - b[("launch", -1)],
                     b[("layer_start", 0)] - b[("run", -1)],
                     b[("layer_start", 0)] - b[("load_end", 0)],
                     b[("layer_end", 0)] - b[("layer_start", 0)],
                     med(b[("layer_end", k)] - b[("layer_start", k)] for k in range(layers))))
    names = ("logits", "sampling", "inputs", "head+wait", "layer0 late on load",
             "layer0", "layer median")
    print("  compute boundary (median ms): " + ", ".join(
        f"{n} {med(r[i] for r in rows):.3f}" for i, n in enumerate(names)))
    print("  loads: " + ", ".join(
        f"k={k} {med(m[('load_end', k)] - m[('load_start', k)] for m in t) * 1e3:.0f} us"
        for k in (0, 1, 2, layers - 1)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Qwen3-8B")
    ap.add_argument("--input-len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--num-kv-buffers", default="2,3,4")
    ap.add_argument("--variants", default="none,all",
                    help="runs per engine, in turn: none (no marks), all, copy or compute (the "
                         "marks on that stream only) or mark names joined by '+', with "
                         "'-untimed': events without timing; 'untimed-sync': no marks, the "
                         "streamer's own events created without timing (as before session 12; "
                         "every other variant keeps them as shipped)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the variants")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("link_timeline.py measures a GPU: it needs CUDA")
    for slots in map(int, args.num_kv_buffers.split(",")):
        llm = LLM(args.model, dummy_weights=True, progress=False, enable_offload=True,
                  resident_layers=0, num_kv_buffers=slots,
                  max_model_len=args.input_len + args.output_len)
        engine = llm.engine
        s = engine.runner.kv.streamer
        marks = Marks()
        instrument(llm, marks)
        shipped = s.load_done, s.compute_done
        ids = torch.randint(0, llm.engine.model_config.vocab_size, (args.input_len,),
                            generator=torch.Generator().manual_seed(0)).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        walls = defaultdict(list)
        for _ in range(args.repeat):
            for variant in args.variants.split(","):
                engine.add_request(ids, params)
                while not any(q.num_output_tokens for q in engine.scheduler.running):
                    engine.step()
                where = variant.removesuffix("-untimed")
                marks.on = where not in ("none", "untimed-sync")
                marks.where = ("copy", "compute") if where == "all" else tuple(where.split("+"))
                marks.timing = not variant.endswith("-untimed")
                if marks.on and marks.timing and where == "all":
                    marks.runs.append([])
                # between requests (the prefill before this ran synchronously): nothing that
                # the events order is in flight
                s.load_done, s.compute_done = shipped
                if where == "untimed-sync":
                    s.load_done = [torch.cuda.Event() for _ in s.load_done]
                    s.compute_done = [torch.cuda.Event() for _ in s.compute_done]
                steps = []
                while engine.has_unfinished():
                    a = time.perf_counter()
                    engine.step()
                    steps.append(time.perf_counter() - a)
                marks.on = False
                walls[variant].append(statistics.median(steps) * 1e3)
        for variant, ms in walls.items():
            print(f"slots {slots}, marks {variant}: step wall (median per run) " +
                  " ".join(f"{t:.3f}" for t in ms) + " ms")
        if marks.runs:
            report(marks, s.num_streamed)
        del llm, engine, s, marks, shipped
        gc.collect()  # the patched methods hold the engine in reference cycles
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
