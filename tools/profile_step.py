"""Where a step's GPU time goes: attention, GEMMs, copies and the rest, from a torch-profiler
trace of the engine's own steps (dummy weights, the shipped Qwen3-8B config by default).

    python tools/profile_step.py --prefill 32768 --decode 1x32768,64x512

Prefill: the whole prompt's steps (every chunk; BATCHxTOKENS: that many prompts at once, the
first ones decoding in mixed steps while the later ones prefill, as the bench's TTFT runs them).
Decode: 10 steps after warm-up, as the engine runs them (graphs unless --enforce-eager). Times
are kernel times summed per category and divided by the number of steps; "wall" is the host's
time per step. Prefill also lists where the GPU idles, and with --python the host's heaviest
Python functions (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from nanoserve import LLM, SamplingParams

CATEGORIES = (  # first match wins; names are lower-cased kernel names
    ("attention", ("flash", "fmha", "cudnn", "sdpa", "attention", "_decode_split", "_merge_split",
                   "attn")),
    ("fused", ("triton_",)),  # inductor's kernels (nanoserve/fused.py)
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "splitk", "cublas", "_skinny_linear")),
    ("copy", ("memcpy", "memset", "copy", "cat", "index", "gather", "scatter")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def kernel_split(prof) -> tuple[dict[str, float], dict[str, int], dict[str, float],
                                dict[str, int]]:
    ms, count = defaultdict(float), defaultdict(int)
    by_name, name_count = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = e.device_time / 1e3
        cat = category(e.name)
        ms[cat] += t
        count[cat] += 1
        by_name[f"{cat:<9} {e.name[:90]}"] += t
        name_count[f"{cat:<9} {e.name[:90]}"] += 1
    return ms, count, by_name, name_count


def report(title: str, prof, steps: int, wall_ms: float, top: int) -> None:
    ms, count, by_name, name_count = kernel_split(prof)
    total = sum(ms.values())
    print(f"\n## {title}: {steps} step(s), wall {wall_ms / steps:.2f} ms/step, "
          f"kernels {total / steps:.2f} ms/step")
    print(f"| {'category':<10} | {'ms/step':>9} | {'share':>6} | {'kernels/step':>12} |")
    print(f"| {'-' * 10} | {'-' * 9} | {'-' * 6} | {'-' * 12} |")
    for cat in ("attention", "gemm", "fused", "copy", "other"):
        print(f"| {cat:<10} | {ms[cat] / steps:>9.3f} | {ms[cat] / max(total, 1e-9):>6.1%} | "
              f"{count[cat] / steps:>12.0f} |")
    for name, t in sorted(by_name.items(), key=lambda x: -x[1])[:top]:
        print(f"    {t / steps:8.3f} ms {name_count[name] / steps:6.0f}x  {name}")


def copy_timeline(prof, steps: int) -> None:
    """Offload: how busy the host->device copies keep the link, and why it idles. A gap is the
    link's idle time between consecutive copies. From the trace's correlation of each copy with
    the runtime call that issued it, a gap's time splits into "host late" (the copy was issued
    after the link went idle: the host sets the pace) and "waiting" (issued earlier, held by a
    stream dependency: an event or the queue of its stream)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    issued = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    copies = sorted((e["ts"], e["ts"] + e["dur"], e["args"].get("bytes", 0),
                     issued.get(e["args"].get("correlation"))) for e in events
                    if e.get("cat") == "gpu_memcpy" and "htod" in e["name"].lower())
    if len(copies) < 2:
        return
    busy = sum(end - start for start, end, _, _ in copies)
    span = copies[-1][1] - copies[0][0]
    gaps = []  # (gap, host late part, copy before, copy after)
    for prev, cur in zip(copies[:-1], copies[1:], strict=True):
        if cur[0] > prev[1]:
            late = 0.0 if cur[3] is None else min(cur[0] - prev[1], max(0.0, cur[3] - prev[1]))
            gaps.append((cur[0] - prev[1], late, prev, cur))
    per_step = lambda us: f"{us / 1e3 / steps:.3f} ms/step"  # noqa: E731
    print(f"\n   host->device copies: {len(copies) / steps:.0f} per step, busy "
          f"{per_step(busy)} of {per_step(span)} ({busy / span:.1%}); idle "
          f"{per_step(sum(g[0] for g in gaps))} in {len(gaps) / steps:.0f} gaps a step: host "
          f"late {per_step(sum(g[1] for g in gaps))}, waiting on a dependency "
          f"{per_step(sum(g[0] - g[1] for g in gaps))}; gaps under 20 us "
          f"{per_step(sum(g[0] for g in gaps if g[0] < 20))}")
    for gap, late, prev, cur in sorted(gaps, reverse=True)[:8]:
        print(f"    gap {gap:7.1f} us ({late:6.1f} host late) between a {prev[2] / 2**20:6.2f} MiB"
              f" copy and a {cur[2] / 2**20:6.2f} MiB copy issued "
              f"{'?' if cur[3] is None else f'{cur[0] - cur[3]:8.1f}'} us before it ran")
    if gaps:  # from a layer's worth of copies (700 us) before the longest wait
        waiting = max(gaps, key=lambda g: g[0] - g[1])
        device_timeline(events, waiting[2][0] - 700, waiting[3][1] + 100, waiting[2][1])


def device_timeline(events: list[dict], start: float, end: float, origin: float) -> None:
    """Every kernel, copy and memset that overlaps [start, end] (trace us), by stream, times
    relative to `origin`: what each stream did around a gap of the link."""
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    window = sorted((e["ts"], e) for e in events if e.get("cat") in kinds and
                    e["ts"] < end and e["ts"] + e["dur"] > start)
    print("\n   the longest wait's neighbourhood (us from the link going idle; stream, "
          "start, duration):")
    for ts, e in window:
        print(f"    s{e['args'].get('stream', '?'):<3} {ts - origin:9.1f} {e['dur']:8.1f}  "
              f"{e['name'][:70]}")


def idle_gaps(prof, top: int) -> None:
    """Where the GPU waits: the gaps between consecutive kernels (and copies) over 20 us, their
    sum, and the longest ones with the kernels on either side (host-bound stretches show as
    many gaps; a synchronization as one long one)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    work = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    gaps, end = [], work[0][1]
    for (start, stop, name), (_, _, before) in zip(work[1:], work[:-1], strict=True):
        if start - end > 20:
            gaps.append((start - end, before, name))
        end = max(end, stop)
    span = work[-1][1] - work[0][0]
    print(f"\n   GPU idle in gaps over 20 us: {sum(g[0] for g in gaps) / 1e3:.1f} ms of "
          f"{span / 1e3:.1f} ms, {len(gaps)} gaps")
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"    {gap / 1e3:8.2f} ms after {before[:60]}  before {after[:60]}")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profiled_steps(engine, steps: int | None, host: bool = False,
                   python: cProfile.Profile | None = None):
    """Runs `steps` engine steps (None: until every sequence has its first token) under the
    profiler (`host`: the host's runtime calls too; `python`: under that Python profiler too);
    returns (profile, steps run, wall ms)."""
    sync()
    n, t0 = 0, time.perf_counter()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host else [])
    with profile(activities=activities) as prof:
        if python is not None:
            python.enable()
        while (engine.has_unfinished() and
               (n < steps if steps is not None else
                any(s.num_output_tokens == 0 for s in engine.scheduler.running +
                    list(engine.scheduler.waiting)))):
            engine.step()
            n += 1
        sync()
        if python is not None:
            python.disable()
    return prof, n, (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen3-8B")
    ap.add_argument("--prefill", default="32768",
                    help="prompt tokens, or BATCHxTOKENS (0: skip)")
    ap.add_argument("--decode", default="1x32768,64x512",
                    help="BATCHxCONTEXT,... decode workloads ('' to skip)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--top", type=int, default=12, help="heaviest kernels to list")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="decode's sampling temperature (0: greedy, as bench_offload.py)")
    ap.add_argument("--python", action="store_true",
                    help="prefill under cProfile too: the host's heaviest Python functions")
    ap.add_argument("--enable-offload", action="store_true",
                    help="every layer's KV streamed from host memory (copies under 'copy')")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_step.py profiles GPU kernels: it needs a CUDA device")
    g = torch.Generator().manual_seed(0)


    work = []
    if args.prefill != "0":
        b, n = (int(x) for x in ("1x" + args.prefill).split("x")[-2:])
        work.append(("prefill", b, n))
    for w in filter(None, args.decode.split(",")):
        b, n = (int(x) for x in w.split("x"))
        work.append(("decode", b, n))
    for kind, batch, ctx in work:
        llm = LLM(args.model, progress=False, dummy_weights=True, max_model_len=ctx + 64,
                  max_num_seqs=batch, enforce_eager=args.enforce_eager,
                  kv_cache_dtype=args.kv_cache_dtype, enable_offload=args.enable_offload,
                  resident_layers=0 if args.enable_offload else None)
        engine = llm.engine
        vocab = engine.runner.model.config.vocab_size

        def prompt(n: int, vocab: int = vocab) -> list[int]:
            return torch.randint(0, vocab, (n,), generator=g).tolist()

        if kind == "prefill":  # a short prompt first: warm-up of every kernel on this path
            engine.add_request(prompt(min(1024, ctx)), SamplingParams(max_tokens=1))
            while engine.has_unfinished():
                engine.step()
        params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=args.temperature)
        for _ in range(batch):
            engine.add_request(prompt(ctx), params)
        if kind == "prefill":
            python = cProfile.Profile() if args.python else None
            prof, n, wall = profiled_steps(engine, None, python=python)
            report(f"prefill, {batch} x {ctx} tokens", prof, 1, wall, args.top)
            print(f"    ({n} chunk steps)")
            idle_gaps(prof, args.top)
            if python is not None:
                stats = pstats.Stats(python)
                stats.sort_stats("tottime").print_stats(args.top * 2)
                stats.sort_stats("cumtime").print_stats("nanoserve", args.top * 2)
        else:
            profiled_steps(engine, None)  # prefill, unprofiled
            for _ in range(5):
                engine.step()
            prof, n, wall = profiled_steps(engine, 10, host=args.enable_offload)
            report(f"decode, batch {batch}, context {ctx}", prof, n, wall, args.top)
            if args.enable_offload:
                copy_timeline(prof, n)
        del llm, engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
