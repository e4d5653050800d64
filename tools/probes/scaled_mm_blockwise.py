"""Whether torch's cuBLAS FP8 GEMM takes DeepSeek-style block scales on this GPU (x 1 x 128,
w 128 x 128), its error against float64 and its time against bf16 cuBLAS, Qwen3-8B's shapes at
4096 rows: the candidate for quantized FP8 prefill (nanoserve/quant/triton_gemm.py)."""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F

from nanoserve.quant import triton_gemm as tg


def timed_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def small_shapes() -> None:
    """cuBLAS's block-scaled path against the Triton kernel and float64 at small shapes."""
    for (n, k), rows in itertools.product(((1024, 256), (256, 512), (384, 256), (640, 512),
                                           (256, 256), (1024, 512), (512, 1024)), (16, 300)):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        ws = torch.rand(n // 128, k // 128, device="cuda") * 1e-3 + 1e-4
        row = (torch.arange(n, device="cuda") // 128).to(torch.int32)
        dense = w.double() * ws.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
        ref = tg.fp8_activations_reference(x, 128).double() @ dense.T
        errs = []
        for cublas in (True, False):
            y = tg.quant_gemm(x, tg.FP8, w, ws, n, scale_row=row, scale_cols=128,
                              cublas_blocks=cublas)
            errs.append(((y.double() - ref).abs().max() / ref.abs().max()).item())
        print(f"n {n} k {k} rows {rows}: cuBLAS err {errs[0]:.2e}, Triton err {errs[1]:.2e}",
              flush=True)


def main() -> None:
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
    if "--small" in sys.argv:
        small_shapes()
        return
    print("F.scaled_mm:", hasattr(F, "scaled_mm"), [n for n in dir(F) if "scal" in n.lower()])
    for n, k in ((6144, 4096), (4096, 12288), (24576, 4096)):
        shape(4096, n, k)


def shape(m: int, n: int, k: int) -> None:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.1).to(torch.float8_e4m3fn)
    ws = torch.rand(n // 128, k // 128, device="cuda") + 0.5
    xq, xs = tg.quantize_activations(x, 128)
    ref = (tg.fp8_activations_reference(x, 128).double()
           @ (w.double() * ws.double().repeat_interleave(128, 0).repeat_interleave(128, 1)).T)
    wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    bf16 = timed_us(lambda: F.linear(x, wb))
    ours = timed_us(lambda: tg.quant_gemm(x, tg.FP8, w, ws, n, scale_row=(
        torch.arange(n, device="cuda") // 128).to(torch.int32), scale_cols=128))
    print(f"n {n} k {k}: bf16 cuBLAS {bf16:.1f} us ({2 * m * n * k / bf16 / 1e6:.0f} TFLOP/s),"
          f" triton fp8 {ours:.1f} us", flush=True)
    tries = {
        "xs [m,k/128] outer-major, ws [n/128,k/128]": lambda: torch._scaled_mm(
            xq, w.t(), scale_a=xs.t().contiguous().t(), scale_b=ws, out_dtype=torch.bfloat16),
        "xs [m,k/128] outer-major, ws.t()": lambda: torch._scaled_mm(
            xq, w.t(), scale_a=xs.t().contiguous().t(), scale_b=ws.t(),
            out_dtype=torch.bfloat16),
        "xs contiguous, ws.t()": lambda: torch._scaled_mm(
            xq, w.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16),
    }
    if hasattr(F, "scaled_mm"):
        try:
            from torch.nn.functional import ScalingType, SwizzleType  # noqa: F401
            tries["F.scaled_mm BlockWise1x128 / 128x128"] = lambda: F.scaled_mm(
                xq, w.t(), xs.t().contiguous().t(), ScalingType.BlockWise1x128, ws.t(),
                ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
        except Exception as e:
            print("  F.scaled_mm import:", e)
    for name, fn in tries.items():
        try:
            y = fn()
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            print(f"  {name}: err {err:.2e}, {timed_us(fn):.1f} us", flush=True)
        except Exception as e:
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
