"""The AWQ one-row GEMV (nanoserve/quant/csrc/awq_gemv.cu) built in other shapes and timed
beside the engine's, per Qwen3-8B layer (issue 36; docs/perf-notes.md session 30). A variant
WxC is AWQ_WARPS W warps a CTA (each quarter warp a row slot: 4 W rows a step, a group in
128 / (4 W) steps, so 8 warps halve a thread's sums a group) with registers bounded for C CTAs
an SM (AWQ_CTAS_PER_SM); its K split is num_splits' for C CTAs an SM, or each of --splits. nvcc
13 for sm_90 gives 4x3 (the engine's) 168 registers, 8x2 128, both without spills; 4x4 and
8x3 spill. Each variant's product is checked against float64's with formats.dequantize's
weight (within 2^-8 of the largest output) before it is timed in CUDA graphs over copies of the
weight past L2. A variant WxC:FILE is built from another copy of awq_gemv.cu (an untracked file
at the repo root, say `git show REV:nanoserve/quant/csrc/awq_gemv.cu > ab_awq_old.cu`): its
products must equal those of the variant WxC named before it bit for bit, the A/B of a change
that keeps the arithmetic. Usage (GPU):
    python tools/probes/awq_variants.py [--variants 4x3,8x2,4x3:ab_awq_old.cu] [--splits 8,16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tools/: bench_quant's shapes and timing
from bench_quant import SHAPES, SPAN, graph_time_us, weights  # noqa: E402

from nanoserve.extensions import COMMON_CSRC, load_extension  # noqa: E402
from nanoserve.quant import QuantConfig, cuda_gemv  # noqa: E402
from nanoserve.quant.formats import dequantize  # noqa: E402
from nanoserve.quant.triton_gemm import split_buffers  # noqa: E402


def build(warps: int, per_sm: int, source: str = ""):
    """The engine's quantized one-row module built with this variant's macros (and `source`
    for awq_gemv.cu, where given)."""
    csrc = cuda_gemv.CSRC
    flags = ["-O3", f"-DAWQ_WARPS={warps}", f"-DAWQ_CTAS_PER_SM={per_sm}"]
    awq = Path(source).resolve() if source else csrc / "awq_gemv.cu"
    tag = f"_{awq.stem}" if source else ""
    return load_extension(f"nanoserve_probe_awq_{warps}x{per_sm}{tag}",
                          [csrc / "gemv_binding.cpp", awq, csrc / "plain_gemv.cu"],
                          f"the AWQ GEMV as {warps}x{per_sm}{tag}", extra_cflags=["-O3"],
                          extra_cuda_cflags=flags,
                          extra_include_paths=[str(csrc), str(COMMON_CSRC)])


def gemv(ext, x: torch.Tensor, a: dict, split: int) -> torch.Tensor:
    """cuda_gemv._launch's call of the variant's kernel."""
    n = a["scales"].shape[-1]
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    partials, counters = split_buffers(y, split, (-(-n // cuda_gemv.AWQ_OUTS), 1, split))
    refused = ext.awq_gemv(x, x, a["w"], a["zeros"], a["scales"], y, partials, counters, 128,
                           0, split, 0, torch.cuda.current_stream().cuda_stream)
    if refused:
        raise RuntimeError(refused)
    return y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="4x3,8x2,8x3,4x4")
    ap.add_argument("--splits", default="", help="K splits to time beside num_splits' choice")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = []
    for spec in args.variants.split(","):
        shape, _, source = spec.partition(":")
        variants.append((*(int(v) for v in shape.split("x")), source))
    exts = {v: build(*v) for v in variants}
    extra = [int(s) for s in args.splits.split(",") if s]
    print(f"{torch.cuda.get_device_name()}: AWQ group 128, x bf16; us a call in CUDA graphs "
          "(K split in brackets); the first of each line at num_splits' choice")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        one, nbytes = weights("awq", n, k)
        copies = [one] + [weights("awq", n, k)[0] for _ in range(max(0, SPAN // nbytes - 1))]
        dense = dequantize(QuantConfig("awq", group_size=128),
                           dict(qweight=one["w"], qzeros=one["zeros"], scales=one["scales"]),
                           n, k, torch.float64)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ dense.T
        slices = -(-n // cuda_gemv.AWQ_OUTS)
        cells, plain = [], {}  # (warps, per_sm, split) -> the tree's kernel's product
        for (warps, per_sm, source), ext in exts.items():
            chosen = cuda_gemv.num_splits(slices, k // 128, per_sm * sms)
            times = []
            for split in [chosen] + [s for s in extra if s != chosen and s <= k // 128]:
                err = ((gemv(ext, x, one, split).double() - ref).abs().max() /
                       ref.abs().max()).item()
                assert err < 2**-8, (name, warps, per_sm, split, err)
                key = (warps, per_sm, split)
                if not source:
                    plain[key] = gemv(ext, x, one, split)
                elif key in plain:  # another copy of the kernel: the same bits
                    assert torch.equal(gemv(ext, x, one, split), plain[key]), (name, source)
                us = graph_time_us([lambda a=a, e=ext, s=split, x=x: gemv(e, x, a, s)
                                    for a in copies])
                times.append(f"{us:5.1f} ({split})")
            cells.append(f"{warps}x{per_sm}{':' + source if source else ''}: " +
                         " ".join(times))
        print(f"{name:8s} {nbytes / 1e6:5.1f} MB | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
