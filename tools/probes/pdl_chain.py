"""What programmatic dependent launch saves between Triton kernels in a CUDA graph, kernel by
kernel (issues 35-36: a batch-1 decode layer is 8-11 kernels of a few microseconds each, and
Qwen3-30B-A3B's step spends more outside its experts than its bytes; docs/perf-notes.md
session 31). Session 28 measured PDL on the CUDA GEMVs alone: 1.0-1.5 us a GEMV when the kernel
ahead signals early, nothing in a model, where the kernels ahead (Triton's, inductor's) do not.
This times chains of 32 kernels in one graph, each kernel's input the previous one's output:

- `tiny`: y = 1.0001 x + 1 over 2,048 elements (one program: a norm's or a router's size);
- `wide`: the same over 1M elements (512 programs);
- `gemv`: y = W x for W 2,048 x 2,048 bf16 (8 MB, the copies cycled past L2; Qwen3-30B-A3B's
  o is 16 MB), 128 programs of 16 rows;
- `mixed`: `gemv` and `tiny` alternating, `tiny` launched plainly (as inductor's kernels are).

Each chain runs three ways: plain launches; PDL with every kernel waiting first, then signalling
(`gdc_wait`, `gdc_launch_dependents`: what any kernel may do, since it neither reads nor writes
before the wait); and, for `gemv`, PDL with the weight's first chunk loaded before the wait (the
CUDA GEMVs' form: only what no kernel writes is read before it). Prints us a kernel and the
saving. Usage (GPU): python tools/probes/pdl_chain.py [--chain 32] [--reps 7]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).parents[1]))  # tools/: bench_quant's timing
from bench_quant import graph_time_us  # noqa: E402


@triton.jit
def _scale_shift(X, Y, N, PDL: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + offs, mask=mask).to(tl.float32)
    tl.store(Y + offs, (x * 1.0001 + 1.0).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gemv(W, X, Y, K: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[rows] = W[rows] . X for the program's BLOCK_N rows; EARLY: the first chunk of the
    weight loaded before the wait."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_at = W + rows[:, None].to(tl.int64) * K + cols[None, :]
    if PDL and not EARLY:
        gdc_wait()
        gdc_launch_dependents()
    w = tl.load(w_at)
    if PDL and EARLY:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + k0 + cols).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
        if k0 + BLOCK_K < K:
            w = tl.load(w_at + k0 + BLOCK_K)
    tl.store(Y + rows, acc.to(Y.dtype.element_ty))


def elementwise(x: torch.Tensor, y: torch.Tensor, pdl: bool):
    block = 2048
    grid = (triton.cdiv(x.numel(), block),)
    return lambda: _scale_shift[grid](x, y, x.numel(), PDL=pdl, BLOCK=block, launch_pdl=pdl,
                                      num_warps=4)


def gemv(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, pdl: bool, early: bool):
    n, k = w.shape
    return lambda: _gemv[(n // 16,)](w, x, y, K=k, PDL=pdl, EARLY=early, BLOCK_N=16,
                                     BLOCK_K=256, launch_pdl=pdl, num_warps=4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chain", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    n = 2048
    weights = [torch.randn(n, n, device=dev, dtype=torch.bfloat16) * n**-0.5 for _ in range(8)]
    small = [torch.randn(n, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    big = [torch.randn(1 << 20, device=dev, dtype=torch.bfloat16) for _ in range(2)]

    def chain(kind: str, mode: str) -> list:
        pdl, early = mode != "plain", mode == "early"
        calls = []
        for i in range(a.chain):
            src, dst = (small if kind != "wide" else big)[i % 2], \
                (small if kind != "wide" else big)[1 - i % 2]
            if kind in ("tiny", "wide") or (kind == "mixed" and i % 2):
                calls.append(elementwise(src, dst, pdl and kind != "mixed"))
            else:
                calls.append(gemv(weights[i % len(weights)], src, dst, pdl, early))
        return calls

    print(f"{torch.cuda.get_device_name()}: chains of {a.chain} kernels in one CUDA graph, "
          f"us a kernel (median of {a.reps} replays)")
    for kind, modes in (("tiny", ("plain", "pdl")), ("wide", ("plain", "pdl")),
                        ("gemv", ("plain", "pdl", "early")), ("mixed", ("plain", "pdl", "early"))):
        times = {m: graph_time_us(chain(kind, m), a.reps) for m in modes}
        # the chains' results agree: PDL changes when a kernel starts, never what it reads
        bufs = small if kind != "wide" else big
        start = [b.clone() for b in bufs]
        outs = {}
        for m in modes:
            for b, s in zip(bufs, start, strict=True):
                b.copy_(s)
            for c in chain(kind, m):
                c()
            torch.cuda.synchronize()
            outs[m] = bufs[a.chain % 2].clone()
        same = all(torch.equal(outs[m], outs["plain"]) for m in modes)
        line = "  ".join(f"{m} {t:6.2f}" for m, t in times.items())
        saved = "  ".join(f"{m} saves {times['plain'] - t:+.2f}" for m, t in times.items()
                          if m != "plain")
        print(f"  {kind:6s} {line} | {saved} | results equal: {same}", flush=True)


if __name__ == "__main__":
    main()
