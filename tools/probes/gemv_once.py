"""Each of Qwen3-8B's one-row CUDA GEMVs (AWQ and FP8: qkv, o, gate_up, down) launched a few
times at the engine's K split, for Nsight Compute to read (issue 36: what holds a small GEMV at
2-3x its bytes' time on an H200, where the bytes of the larger ones stream near the device's
rate). Usage (GPU; `gpu_check.sh gemvncu` gives the sections):
    ncu --clock-control none -k regex:gemv_kernel python3 tools/probes/gemv_once.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tools/: bench_quant's shapes and weights
from bench_quant import SHAPES, weights  # noqa: E402

from nanoserve.quant import cuda_gemv  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="awq,fp8")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--calls", type=int, default=2, help="launches of each GEMV")
    args = ap.parse_args()
    torch.manual_seed(0)
    if not cuda_gemv.load():
        sys.exit("the one-row CUDA kernels did not build here")
    for fmt in args.formats.split(","):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            kernel_args, nbytes = weights(fmt, n, k)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(args.calls):
                if cuda_gemv.one_row(x, kernel_args) is None:
                    sys.exit(f"{fmt} {name}: not taken by the CUDA kernels")
            torch.cuda.synchronize()
            print(f"{fmt} {name}: N {n} x K {k}, {nbytes / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    main()
