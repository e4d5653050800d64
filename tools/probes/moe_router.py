"""Where a MoE layer's routing time goes at batch 1 (issue 35; docs/perf-notes.md sessions 30-31):
the engine's router (the plain one-row CUDA GEMV's logits, then fused_moe.pick: a warp a token,
one pass of k argmaxes) and its halves alone, against cuBLAS's logits and the candidates: the
pick in one pass of k argmaxes over 4 warps (session 30's), and one kernel for the whole router
(programs over 16 experts x a run of the hidden size, the last to finish sums the runs, rounds
to x's dtype and picks). In session 30 that one kernel, put in the engine, did not move
Qwen3-30B-A3B's batch-1 TPOT (3.38-3.40 ms against 3.34). Each part is timed in CUDA graphs over
router copies past L2; the candidates' picks are checked against the engine's on float32
logits. Usage (GPU):
    python tools/probes/moe_router.py [--tokens 1] [--experts 128] [--hidden 2048] [--top-k 8]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parents[1]))  # tools/: bench_quant's timing
from bench_quant import SPAN, graph_time_us  # noqa: E402

from nanoserve.models import fused_moe  # noqa: E402
from nanoserve.quant import cuda_gemv  # noqa: E402

COUNTER: list[torch.Tensor] = []


@triton.jit
def _pick(logits, rows, row_ok, Weights, Ids, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
          BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, NORMALIZE: tl.constexpr):
    """logits [BLOCK_T, BLOCK_E] in fp32 (-inf past the experts): each row's softmax, its top k
    in one pass of k argmaxes, stored as Weights' and Ids' rows `rows`."""
    offs = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_TOPK)
    exps = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    total = tl.sum(exps, axis=1)
    picked = tl.zeros([BLOCK_T, BLOCK_E], tl.int1)
    probs = tl.zeros([BLOCK_T, BLOCK_TOPK], tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_TOPK], tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(tl.where(picked, float("-inf"), logits), axis=1)
        hit = offs[None, :] == best[:, None]
        picked = picked | hit
        here = slots[None, :] == slot
        probs = tl.where(here, tl.sum(tl.where(hit, exps, 0.0), axis=1)[:, None], probs)
        ids = tl.where(here, best[:, None], ids)
    probs = probs / total[:, None]
    if NORMALIZE:
        probs = probs / tl.sum(probs, axis=1)[:, None]
    at = rows[:, None] * TOP_K + slots[None, :]
    keep = row_ok[:, None] & (slots < TOP_K)[None, :]
    tl.store(Weights + at, probs.to(Weights.dtype.element_ty), mask=keep)
    tl.store(Ids + at, ids.to(tl.int64), mask=keep)


@triton.jit(do_not_specialize=["T"])
def _pick_kernel(Logits, Weights, Ids, T, E, stride_l, TOP_K: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                 NORMALIZE: tl.constexpr):
    """BLOCK_T tokens' logits (cuBLAS's) picked from."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    offs = tl.arange(0, BLOCK_E)
    logits = tl.load(Logits + rows[:, None] * stride_l + offs[None, :],
                     mask=row_ok[:, None] & (offs < E)[None, :],
                     other=float("-inf")).to(tl.float32)
    _pick(logits, rows, row_ok, Weights, Ids, TOP_K, BLOCK_T, BLOCK_E, BLOCK_TOPK, NORMALIZE)


@triton.jit(do_not_specialize=["T"])
def _route_small_kernel(X, Router, Parts, Counter, Weights, Ids, T, E, H, stride_x,
                        RUNS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                        NORMALIZE: tl.constexpr, PRECISION: tl.constexpr):
    """Program (g, r): experts g BLOCK_G .. over run r of the hidden inputs, for up to 16
    tokens, its fp32 sums stored as Parts[r]; the last program to finish sums the runs in
    order, rounds them to x's dtype, picks, and puts the counter back to 0."""
    rows = tl.arange(0, 16)
    row_ok = rows < T
    experts = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    e_ok = experts < E
    chunks = H // BLOCK_K
    run = tl.program_id(1)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([16, BLOCK_G], tl.float32)
    for c in range(run * chunks // RUNS, (run + 1) * chunks // RUNS):
        k = c * BLOCK_K + ks
        x = tl.load(X + rows[:, None] * stride_x + k[None, :], mask=row_ok[:, None], other=0.0)
        w = tl.load(Router + experts[:, None] * H + k[None, :], mask=e_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    part = rows[:, None] * BLOCK_E + experts[None, :]
    tl.store(Parts + run * 16 * BLOCK_E + part, acc, mask=row_ok[:, None] & e_ok[None, :])
    tl.debug_barrier()  # every thread's sums stored before the count says so (release)
    if tl.atomic_add(Counter, 1, sem="acq_rel") == tl.num_programs(0) * RUNS - 1:
        offs = tl.arange(0, BLOCK_E)
        at = rows[:, None] * BLOCK_E + offs[None, :]
        live = row_ok[:, None] & (offs < E)[None, :]
        logits = tl.load(Parts + at, mask=live, other=0.0, cache_modifier=".cg")
        for r in tl.static_range(1, RUNS):
            logits += tl.load(Parts + r * 16 * BLOCK_E + at, mask=live, other=0.0,
                              cache_modifier=".cg")
        logits = tl.where(live, logits.to(X.dtype.element_ty).to(tl.float32), float("-inf"))
        _pick(logits, rows, row_ok, Weights, Ids, TOP_K, 16, BLOCK_E, BLOCK_TOPK, NORMALIZE)
        tl.atomic_xchg(Counter, 0, sem="relaxed")


def one_kernel(x: torch.Tensor, router: torch.Tensor, top_k: int, runs: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    t, h = x.shape
    e = router.shape[0]
    weights = torch.empty(t, top_k, dtype=x.dtype, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    block_e = triton.next_power_of_2(e)
    block_k = 256 if x.element_size() == 2 else 128
    parts = torch.empty(runs, 16, block_e, dtype=torch.float32, device=x.device)
    _route_small_kernel[(triton.cdiv(e, 16), runs)](
        x, router, parts, COUNTER[0], weights, ids, t, e, h, x.stride(0), RUNS=runs,
        TOP_K=top_k, BLOCK_G=16, BLOCK_K=block_k, BLOCK_E=block_e,
        BLOCK_TOPK=triton.next_power_of_2(top_k), NORMALIZE=True,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4, num_stages=3)
    return weights, ids


def one_pass_pick(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    block_e = triton.next_power_of_2(e)
    block_t = max(1, min(16, 2048 // block_e))
    _pick_kernel[(triton.cdiv(t, block_t),)](
        logits, weights, ids, t, e, logits.stride(0), TOP_K=top_k, BLOCK_T=block_t,
        BLOCK_E=block_e, BLOCK_TOPK=triton.next_power_of_2(top_k), NORMALIZE=True)
    return weights, ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    a = ap.parse_args()
    torch.manual_seed(0)
    COUNTER.append(torch.zeros(1, dtype=torch.int32, device="cuda"))
    t, e, h, k = a.tokens, a.experts, a.hidden, a.top_k
    # the picks on float32, where ties do not occur
    x32 = torch.randn(t, h, device="cuda")
    r32 = torch.randn(e, h, device="cuda") * 0.02
    _, ids_ref = fused_moe.route(x32, r32, k, True)
    for runs in (1, 4):
        assert torch.equal(one_kernel(x32, r32, k, runs)[1], ids_ref), runs
    assert torch.equal(one_pass_pick(torch.nn.functional.linear(x32, r32), k)[1], ids_ref)
    copies = max(1, SPAN // (e * h * 2))
    routers = [torch.randn(e, h, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(copies)]
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    logits = torch.nn.functional.linear(x, routers[0])
    # one token: the engine's logits through the one-row GEMV (it takes one row only)
    gemv = {"engine: one-row GEMV logits + pick (a warp, k argmaxes)":
            lambda r: fused_moe.pick(cuda_gemv.half_gemv(x, r), k, True),
            "one-row GEMV logits alone": lambda r: cuda_gemv.half_gemv(x, r)} if t == 1 else {}
    cases = {
        **gemv,
        "cuBLAS logits + the engine's pick": lambda r: fused_moe.route(x, r, k, True),
        "cuBLAS logits alone": lambda r: torch.nn.functional.linear(x, r),
        "engine pick alone (logits in L2)": lambda r: fused_moe.pick(logits, k, True),
        "one-pass pick alone (logits in L2)": lambda r: one_pass_pick(logits, k),
        "cuBLAS logits + one-pass pick":
            lambda r: one_pass_pick(torch.nn.functional.linear(x, r), k),
    }
    for runs in (1, 2, 4, 8):
        cases[f"one kernel, {runs} run(s) of the hidden size"] = \
            lambda r, runs=runs: one_kernel(x, r, k, runs)
    print(f"{torch.cuda.get_device_name()}: {t} token(s), {e} experts, hidden {h}, top {k}; "
          f"us a call in CUDA graphs over {copies} router copies")
    for label, call in cases.items():
        us = graph_time_us([lambda r=r, call=call: call(r) for r in routers])
        print(f"  {label:45s} {us:7.2f} us", flush=True)


if __name__ == "__main__":
    main()
