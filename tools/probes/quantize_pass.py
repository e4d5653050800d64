"""FP8's activation quantization pass (quant/triton_gemm.quantize_activations) by the groups a
program takes: a whole row's (its values in registers, 254 a thread at 12,288 inputs, spills
with SiLU folded in; the default until session 38) against 2-32 groups a program (more
programs, fewer registers; 8 the default since). Qwen3-8B's widths (4,096: qkv's and
gate_up's x; 12,288: down's, with and without silu(gate) * up), at 64 rows (batch-64 decode)
and 8,192 (a prefill chunk), bf16, in CUDA graphs of 8 copies of the inputs (nothing served
from L2), each time's median of repeats; GB/s of the bytes read and written, beside a device
copy's rate measured here. Usage (GPU):
    python tools/probes/quantize_pass.py [--rows 64,8192] [--widths 4096,12288]
"""

from __future__ import annotations

import argparse

import torch
import triton

from nanoserve.cuda_timing import graph_median_ms, median_ms
from nanoserve.quant import triton_gemm as tg

COPIES = 8


def copy_gbs() -> float:
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    return 2 * big.numel() / median_ms(big.clone, reps=10) / 1e6


def time_us(xs: list[torch.Tensor], silu: bool, per_program: int) -> float:
    def run():
        for x in xs:
            tg.quantize_activations(x, tg.FP8_GROUP, silu=silu, groups_per_program=per_program)

    return graph_median_ms(run, reps=20) * 1e3 / len(xs)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,8192")
    ap.add_argument("--widths", default="4096,12288")
    ap.add_argument("--per-program", default="0,2,4,8,16,32",
                    help="groups a program takes (0: a whole row)")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}: a device copy {copy_gbs():.0f} GB/s")
    print(f"{'rows':>6}{'width':>7}{'silu':>6}{'groups':>8}{'us':>9}{'GB/s':>8}")
    for rows in (int(r) for r in args.rows.split(",")):
        for width in (int(w) for w in args.widths.split(",")):
            for silu in (False, True) if width > 4096 else (False,):
                xs = [torch.randn(rows, width * (2 if silu else 1), device="cuda").bfloat16()
                      for _ in range(COPIES)]
                moved = xs[0].numel() * 2 + rows * width * (1 + 4 / tg.FP8_GROUP)
                for per in (int(p) for p in args.per_program.split(",")):
                    us = time_us(xs, silu, per or triton.next_power_of_2(width // tg.FP8_GROUP))
                    print(f"{rows:>6}{width:>7}{silu!s:>6}{per or 'row':>8}{us:>9.1f}"
                          f"{moved / us / 1e3:>8.0f}")


if __name__ == "__main__":
    main()
