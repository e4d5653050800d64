"""The MoE layer at prefill sizes (issue 35's TTFT rows): the fused path's tiles, with and without
TMA for the experts' weights and with the intermediate in sorted order or not (down's own tiles
beside gate_up's too), against torch's grouped GEMM (CUTLASS), at Qwen3-30B-A3B's widths,
in TFLOP/s of the experts' matmuls against the bf16 matmul rate measured in the same run. The
sort and the sum over k are timed alone too. Eager, median of repeats, three layers' weights in
turn. Usage (GPU):
    python tools/probes/moe_prefill.py [--tokens 2048,8192]
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch.profiler import ProfilerActivity, profile

from nanoserve.cuda_timing import median_ms
from nanoserve.models import fused_moe, moe, moe_tiles

H, E, K, INTER = 2048, 128, 8, 768
LAYERS = 3


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / median_ms(lambda: a @ a, reps=10) / 1e9


def candidates(base: moe_tiles.MoETiles) -> dict[str, functools.partial]:
    """The fused path's tile candidates, both GEMMs on one set; then down's own tiles beside
    gate_up's base, the intermediate in sorted order (its rows through TMA)."""
    tiles = moe_tiles.MoETiles
    both = [base, base._replace(tma=False, sorted_mid=False),
            base._replace(tma=True, sorted_mid=False), base._replace(tma=True, sorted_mid=True),
            tiles(128, 128, 64, 8, 4, True), tiles(64, 128, 64, 4, 4, True),
            tiles(64, 128, 64, 4, 4, True, True), tiles(128, 64, 64, 8, 4, True)]
    rows = {f"fused {tuple(c)}": functools.partial(fused_moe.experts_fused, tiles=c)
            for c in both}
    gate_up = base._replace(tma=True, sorted_mid=True)
    m = gate_up.block_m
    for down in (tiles(m, 128, 128, 8, 3, True, True), tiles(m, 256, 64, 8, 3, True, True),
                 tiles(m, 128, 64, 8, 4, True, True), tiles(m, 128, 64, 4, 3, True, True),
                 tiles(m, 64, 128, 4, 3, True, True), tiles(m, 256, 64, 8, 2, True, True)):
        rows[f"down {tuple(down)}"] = functools.partial(fused_moe.experts_fused, tiles=gate_up,
                                                        down_tiles=down)
    return rows


def probe(t: int, ws: list[tuple[torch.Tensor, ...]], rate: float) -> None:
    xs = [torch.randn(t, H, device="cuda").bfloat16() for _ in range(LAYERS)]
    routed = [moe.route(x, r, K, True) for x, (r, _, _) in zip(xs, ws, strict=True)]
    flops = 6 * t * K * H * INTER
    base = moe_tiles.tiles_for(t * K, E, H, INTER, xs[0].device)

    def timed(fn) -> float:
        calls = iter(range(1 << 30))

        def once():
            j = next(calls) % LAYERS
            fn(xs[j], *routed[j], *ws[j][1:])
        return median_ms(once, reps=20, warmup=2)

    split = {}  # the last candidate's gate_up and down kernels, us a call

    def kernels_ms(fn) -> float:
        """Device time of fn's kernels a call (eager timing counts the host's launches too);
        `split`: the fused path's gate_up and down GEMMs (they alternate) apart."""
        fn(xs[0], *routed[0], *ws[0][1:])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for j in range(2 * LAYERS):
                fn(xs[j % LAYERS], *routed[j % LAYERS], *ws[j % LAYERS][1:])
            torch.cuda.synchronize()
        kernels = sorted((e.time_range.start, e.name, e.device_time) for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA)
        gemms = [us for _, name, us in kernels if name == "_moe_gemm_kernel"]
        split.update(gate_up=sum(gemms[0::2]) / (2 * LAYERS), down=sum(gemms[1::2]) / (2 * LAYERS))
        return sum(us for _, _, us in kernels) / 1e3 / (2 * LAYERS)

    rows = candidates(base)
    if moe.fast_grouped_mm(xs[0].device, torch.bfloat16):
        rows["grouped (torch._grouped_mm)"] = moe.experts_grouped
    print(f"\n{t} tokens ({t * K} pairs), {flops / 1e9:.1f} GFLOP a layer")
    for name, fn in rows.items():
        try:
            ms, dev = timed(fn), kernels_ms(fn)
        except Exception as e:  # a candidate over the shared memory: say so, go on
            print(f"  {name:<48} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        tf = flops / dev / 1e9
        parts = ""
        if split["gate_up"]:  # the fused path: gate_up has 2/3 of the FLOPs, down 1/3
            gu, dn = split["gate_up"], split["down"]
            parts = f"; gate_up {gu:.0f} us ({flops * 2 / 3 / gu / 1e6 / rate:.0%}), down " \
                    f"{dn:.0f} us ({flops / 3 / dn / 1e6 / rate:.0%})"
        print(f"  {name:<44} {ms * 1e3:7.1f} us eager, kernels {dev * 1e3:7.1f} us "
              f"{tf:4.0f} TFLOP/s ({tf / rate:.0%}){parts}")
    sort = lambda x, w, ids, gu, d: fused_moe.sort_pairs(ids, E, base.block_m)  # noqa: E731
    out = torch.empty(t * K, H, device="cuda", dtype=torch.bfloat16)
    sum_ms = median_ms(lambda: out.view(t, K, H).sum(dim=1), reps=20)
    print(f"  of which: sort {timed(sort) * 1e3:.1f} us eager, kernels "
          f"{kernels_ms(sort) * 1e3:.1f} us; sum over k {sum_ms * 1e3:.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="2048,8192")
    args = ap.parse_args()
    torch.manual_seed(0)
    ws = [(torch.randn(E, H, device="cuda").mul_(0.02).bfloat16(),
           torch.randn(E, 2 * INTER, H, device="cuda").mul_(0.02).bfloat16(),
           torch.randn(E, H, INTER, device="cuda").mul_(0.02).bfloat16()) for _ in range(LAYERS)]
    rate = matmul_tflops()
    print(f"bf16 matmul (8192^3): {rate:.0f} TFLOP/s")
    for t in (int(x) for x in args.tokens.split(",")):
        probe(t, ws, rate)


if __name__ == "__main__":
    main()
