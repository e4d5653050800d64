"""One row (batch-1 decode) times a weight in CUDA (csrc/): AWQ's 4-bit GEMM layout
(awq_gemv.cu), and plain weights, one value an element (plain_gemv.cu): e4m3 with block, channel
or tensor scales, or 16-bit floats (models/layers.py's one-row products that the skinny matmul
leaves to cuBLAS). Built at first use through torch's cpp_extension (nvcc); where it
cannot be built, or for shapes they do not take, Triton's kernels run (quant/triton_gemm.py;
`one_row` and `half_gemv_ok` say so).

Both read the weight in whole contiguous 128-byte row segments, 16 bytes a lane, several loads
in flight (AWQ: a quarter warp a row; plain: a warp 512 bytes of one row, x loaded once a chunk
for the warp's 8 rows). AWQ's products run in packed fp16 (two nibbles become two fp16 1024 + q
in one LOP3, the zero point comes off in one HSUB2, one HFMA2 adds x (q - z) for both; x enters
fp16 scaled by a power of two per thread and group, a group's sums are widened and scaled in
float32); e4m3 becomes two floats in one `cvt`, 16-bit weights are widened as x is, one FMA an
element. K is split over CTAs and the parts summed in a fixed order by the last CTA of each
slice of outputs (gemv_split.cuh). Triton's GEMVs ran at 2.4-4.0x the weights' floor (AWQ) and
about 2.0 TB/s (FP8) per layer on an H100 (sessions 21-22).

On an H100 (session 27, Qwen3-8B's layers): AWQ 1.35-2.62x the weights' floor against Triton's
2.39-3.77x (TPOT 5.08 against 6.66 ms; 5.07-5.10 with session 28's split cap). FP8 on an H200
(session 29, us, this kernel against the quarter-warp form that loaded x for each row): qkv
11.1 / 14.1, o 10.5 / 12.0, gate_up 26.6 / 37.6, down 16.6 / 20.3; Qwen3-8B-FP8 batch-1 TPOT at
32K 4.39 against 5.06 ms. AWQ's fp16 products on an H200 (session 30, against float32 ones):
qkv 10.6 / 11.6 us, o 8.7 / 9.6, gate_up 21.9 / 26.0, down 14.5 / 16.6; Qwen3-8B-AWQ TPOT
3.97-3.99 against 4.28-4.30 ms.
NANOSERVE_ONE_ROW_CUDA=0 (nanoserve/extensions.py) leaves Triton's (and cuBLAS's)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from nanoserve.extensions import device_capability, one_row_module, pdl_wanted

CSRC = Path(__file__).parent / "csrc"
AWQ_OUTS, PLAIN_OUTS = 256, 32  # outputs a CTA owns (the kernels')
AWQ_GROUPS = (32, 64, 128)  # group sizes the AWQ kernel is built for
PLAIN_STEP = 128  # the plain kernel's split unit; FP8's scale blocks must not cross one
# the fewest steps an FP8 CTA takes (8 x 128 inputs x 32 outputs, AWQ's one group's weights).
# Qwen3-8B-FP8's o (4,096 x 4,096) at 4 / 6 splits: 8.8 / 10.6 us on an H200, 10.3 / 11.9 on an
# H100 (session 30); qkv's and down's choices (4, 6) were already the fastest
FP8_MIN_STEPS = 8
# CTAs an SM that a K split aims at (all resident at once): 128 threads a CTA, the plain
# kernel's at 72-80 registers a thread (6 an SM), AWQ's at 168 (3 an SM)
AWQ_CTAS_PER_SM, PLAIN_CTAS_PER_SM = 3, 6
# 16-bit weights: the fewest steps a CTA takes (64 KB of weights), unless its outputs are too few
# to fill the SMs (num_splits' `fill`). Us at 1 / 2 / 4 / 8 / 16 splits, one H100 (session 31):
# Qwen3-30B-A3B's qkv 6.6 / 7.0 / 7.4 / 8.8 / 10.4, o 7.4 / 6.5 / 6.2 / 6.7 / 8.3, router 4.0 /
# 4.2 / 3.7 / 3.4 / 3.7; Qwen3-8B's qkv 20.5 / 19.5 / 18.4 / 17.8 / 18.5, o 12.0 / 9.3 / 8.8 /
# 11.9 / 12.8, gate_up 66.1 / 66.1 / 64.1 / 66.9 / 75.9, lm_head 400.7 at 1 (the skinny matmul:
# 6.5, 8.6, 4.9, 20.0, 8.8, 68.7, 401.2; cuBLAS 6.8, 7.7, 4.8, 20.5, 10.8, 72.2, 437.1)
HALF_MIN_STEPS = 8
MAX_SPLITS = 32  # the most a split may be asked for (tools/bench_quant.py --splits)
# num_splits' cap. Measured on an H100 (session 28, Qwen3-8B-AWQ's layers, us at 8 / 16 / 24 /
# 32 splits): qkv 13.5 / 11.8 / 16.3 / 15.7, o 11.9 / 9.8 / 11.6 / 11.4, down 26.7 / 18.6 / 18.3 /
# 18.4; gate_up 28.3 at 4 (3 an SM) against 29.9 at 5 (4 an SM). Batch-1 TPOT 5.09-5.10 ms
# against 5.24-5.26 (16 and 3 an SM against 32 and 4)
SPLITS_CAP = 16
HALF = (torch.bfloat16, torch.float16)


@cache
def _extension():
    """The compiled module, or None where it cannot be built or run (or is switched off)."""
    return one_row_module(
        "nanoserve_quant_gemv",
        [CSRC / "gemv_binding.cpp", CSRC / "awq_gemv.cu", CSRC / "plain_gemv.cu"],
        "the quantized one-row CUDA kernels", CSRC)


def load() -> bool:
    """Builds (first use on a machine) or loads the kernels now; whether they run here."""
    return _extension() is not None


@cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _together(x: torch.Tensor, *tensors: torch.Tensor) -> bool:
    return all(t.device == x.device for t in tensors)


def awq_shape_ok(x: torch.Tensor, w: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                 group: int, x_order: torch.Tensor | None = None) -> bool:
    """Whether the AWQ kernel takes one row x [1, K] against qweight w [K, N / 8], qzeros
    [K / group, N / 8] and scales [K / group, N]: half-precision x and scales, a group it is
    built for, N a multiple of 32, contiguous 16-byte aligned tensors (it reads 16 bytes a
    lane); x_order, where given, contiguous int32 [K] (input k is x[x_order[k]]). Checks no
    device."""
    k, n = w.shape[0], scales.shape[-1]
    if x_order is not None and not (x_order.dtype == torch.int32 and x_order.shape == (k,) and
                                    x_order.is_contiguous() and _together(x, x_order)):
        return False
    return (k > 0 and n > 0 and _together(x, w, zeros, scales) and
            x.dim() == 2 and x.shape == (1, k) and x.dtype in HALF and scales.dtype in HALF and
            w.dtype == zeros.dtype == torch.int32 and group in AWQ_GROUPS and k % group == 0 and
            n % 32 == 0 and w.shape[1] * 8 == n and zeros.shape == (k // group, n // 8) and
            scales.shape == (k // group, n) and
            all(t.is_contiguous() for t in (x, w, zeros, scales)) and _aligned(w, zeros, scales))


def fp8_shape_ok(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                 scale_row: torch.Tensor, scale_cols: int) -> bool:
    """Whether the FP8 kernel takes one row x [1, K] against e4m3 w [N, K] with float32 scales
    [rows, ceil(K / scale_cols)] and scale_row int32 [N]: half-precision x, K a multiple of
    128, scale blocks of whole 128-input steps (or one scale a row), rows and x 16-byte
    aligned. Checks no device."""
    n, k = w.shape
    return (k > 0 and n > 0 and _together(x, w, scales, scale_row) and
            x.dim() == 2 and x.shape == (1, k) and x.dtype in HALF and x.is_contiguous() and
            w.dtype == torch.float8_e4m3fn and w.stride(1) == 1 and w.stride(0) % 16 == 0 and
            k % PLAIN_STEP == 0 and scale_cols > 0 and
            (scale_cols >= k or scale_cols % PLAIN_STEP == 0) and
            scales.dtype == torch.float32 and scales.dim() == 2 and scales.stride(1) == 1 and
            scale_row.dtype == torch.int32 and scale_row.shape == (n,) and
            scale_row.is_contiguous() and _aligned(x, w))


def half_shape_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the plain kernel takes one row x [1, K] against w [N, K] of x's dtype: half
    precision, K a multiple of 128, rows and x 16-byte aligned. Checks no device."""
    n, k = w.shape
    return (k > 0 and n > 0 and _together(x, w) and x.dim() == 2 and x.shape == (1, k) and
            x.dtype in HALF and w.dtype == x.dtype and x.is_contiguous() and w.stride(1) == 1 and
            (w.stride(0) * w.element_size()) % 16 == 0 and k % PLAIN_STEP == 0 and _aligned(x, w))


def half_gemv_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether half_gemv runs x @ w.T here: a CUDA x, the kernels built, a shape they take."""
    return x.is_cuda and half_shape_ok(x, w) and _extension() is not None


def num_splits(slices: int, units: int, resident: int, min_units: int = 1, fill: int = 0
               ) -> int:
    """CTAs a slice of outputs' K is split over, each a run of whole units (AWQ's groups, the
    plain kernel's 128-input steps; runs differ by at most one unit): as many as keep every CTA
    of the launch resident at once (`resident` CTAs), at most SPLITS_CAP and one a `min_units`
    units, at least one; with `fill` (SMs), at least enough for a CTA on each, each of at least
    2 units. Qwen3-8B in AWQ on 132 SMs (396 resident): o (16 slices, 32 groups) 16; qkv (24,
    32) 16; gate_up (96, 32) 4; down (16, 96) 16. In FP8 (792 resident, 32 outputs a slice, 8
    steps a CTA): qkv 4, o 4, gate_up 1, down 6. 16-bit Qwen3-30B-A3B (8 steps a CTA, fill
    132): qkv 2, o 4, router (4 slices, 16 steps) 8."""
    split = min(units // min_units, SPLITS_CAP, resident // slices)
    if fill:
        split = max(split, min(-(-fill // slices), units // 2, SPLITS_CAP))
    return max(1, split)


def one_row(x: torch.Tensor, args: dict, splits: int | None = None,
            x_order: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [1, K] times a quantized weight given as quant/triton_gemm.quant_gemm's arguments
    (QuantizedLinear._kernel_args), through the CUDA kernels: y [1, N] in x's dtype; None where
    they do not take it (no GPU, no build, another format or shape). `splits`: the K split's
    CTAs a slice instead of num_splits' (tools/bench_quant.py --splits times them). x_order
    (AWQ only): the weight's input k is x[x_order[k]]."""
    # the cached build first: switched off (NANOSERVE_ONE_ROW_CUDA=0), an eager decode step's
    # every layer returns here, before any shape check
    if not x.is_cuda or _extension() is None:
        return None
    from nanoserve.quant.triton_gemm import AWQ, FP8  # the format ids (GPU installs: Triton)
    if args["fmt"] == AWQ:
        awq = dict(w=args["w"], zeros=args["zeros"], scales=args["scales"], group=args["group"])
        if awq_shape_ok(x, **awq, x_order=x_order):
            return awq_gemv(x, **awq, splits=splits, x_order=x_order)
    elif x_order is not None:
        return None
    elif args["fmt"] == FP8:
        fp8 = dict(w=args["w"], scales=args["scales"], scale_row=args["scale_row"],
                   scale_cols=args["scale_cols"])
        if device_capability(x.device.index or 0) >= (8, 9) and fp8_shape_ok(x, **fp8):
            return fp8_gemv(x, **fp8, splits=splits)
    return None


def awq_gemv(x: torch.Tensor, w: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
             group: int, splits: int | None = None, x_order: torch.Tensor | None = None
             ) -> torch.Tensor:
    """x [1, K] times the AWQ weight (qweight w [K, N / 8], qzeros, scales): y [1, N] in x's
    dtype; with x_order, x[:, x_order] times it, gathered in the kernel. See awq_shape_ok;
    `splits` as one_row's."""
    k, n = w.shape[0], scales.shape[-1]
    slices = -(-n // AWQ_OUTS)
    split = _split(splits, slices, k // group, AWQ_CTAS_PER_SM, 1, x)
    order = x if x_order is None else x_order  # unread unless ordered
    return _launch("awq_gemv", x, n, slices, split, order, w, zeros, scales, group=group,
                   ordered=int(x_order is not None))


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, scale_row: torch.Tensor,
             scale_cols: int, splits: int | None = None) -> torch.Tensor:
    """x [1, K] times e4m3 w [N, K], output n's scale for inputs k scales[scale_row[n], k //
    scale_cols]: y [1, N] in x's dtype. See fp8_shape_ok; `splits` as one_row's."""
    n, k = w.shape
    slices = -(-n // PLAIN_OUTS)
    split = _split(splits, slices, k // PLAIN_STEP, PLAIN_CTAS_PER_SM, FP8_MIN_STEPS, x)
    return _launch("fp8_gemv", x, n, slices, split, w, scales, scale_row,
                   scale_cols=min(scale_cols, 1 << 30))


def half_gemv(x: torch.Tensor, w: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """x [1, K] @ w.T for w [N, K] of x's dtype: y [1, N], float32 sums rounded once. See
    half_shape_ok; `splits` as one_row's."""
    n, k = w.shape
    slices = -(-n // PLAIN_OUTS)
    split = _split(splits, slices, k // PLAIN_STEP, PLAIN_CTAS_PER_SM, HALF_MIN_STEPS, x,
                   fill=True)
    return _launch("half_gemv", x, n, slices, split, w)


def _split(splits: int | None, slices: int, units: int, ctas_per_sm: int, min_units: int,
           x: torch.Tensor, fill: bool = False) -> int:
    """num_splits' choice (`fill`: the device's SMs), or `splits` held to 1..min(units,
    MAX_SPLITS) (each CTA needs a unit)."""
    if splits is None:
        sms = _num_sms(x.device.index or 0)
        return num_splits(slices, units, ctas_per_sm * sms, min_units, sms if fill else 0)
    return max(1, min(splits, units, MAX_SPLITS))


def _launch(kernel: str, x: torch.Tensor, n: int, slices: int, split: int,
            *tensors: torch.Tensor, **ints: int) -> torch.Tensor:
    from nanoserve.quant.triton_gemm import split_buffers  # the split-K parts and counters

    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    partials, counters = split_buffers(y, split, (slices, 1, split))
    pdl = pdl_wanted(device_capability(x.device.index or 0))
    with torch.cuda.device(x.device):
        stream = torch.cuda.current_stream().cuda_stream  # a graph's, while capturing
        refused = getattr(_extension(), kernel)(x, *tensors, y, partials, counters,
                                                *ints.values(), split, int(pdl), stream)
    if refused:
        raise RuntimeError(refused)
    return y
