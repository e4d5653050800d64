"""One token's MoE experts (batch-1 decode) in CUDA (csrc/moe_gemv.cu): the k experts the
router chose, read by their ids on the device, in two kernels (gate_up with SiLU-multiply; down
weighted and summed over the k), where the Triton path (models/fused_moe.py) runs the sort, two
grouped GEMMs and a sum. A warp reads 4 weight rows together, 512 contiguous bytes of one row a
load, its inputs loaded once for the 4 (csrc/moe_gemv.cu). Experts in x's dtype, or e4m3 with
block scales (FP8 block-wise checkpoints: Qwen3-30B-A3B-FP8). Built at first use through torch's
cpp_extension (nvcc); where it cannot be built, or for other shapes, the Triton path runs
(`supports` says which).

Session 23's profile of Qwen3-30B-A3B at batch 1 (H200) put the expert kernels at 25.8 us a
layer, about 1.4x their bytes' floor, and the sort and the sum over k at 6 us more.

On an H100 (session 27) the layer takes 40.9 us against the Triton path's 47.9 (1.59x and
1.84x the bytes' floor), Qwen3-30B-A3B's batch-1 TPOT 4.00 against 4.36 ms. On an H200 (session
29, `tools/bench_moe.py --batch 1`) the layer takes 32.7 us (1.80x) against 34.7 (1.91x) for the
form before, a quarter warp a row with its inputs loaded for each row; TPOT 3.35 against 3.41 ms.
NANOSERVE_ONE_ROW_CUDA=0 (nanoserve/extensions.py) leaves the Triton path."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from nanoserve.extensions import device_capability, one_row_module, pdl_wanted

CSRC = Path(__file__).parent / "csrc"
MAX_SLOTS = 16  # top k must divide it (the down kernel keeps 16 slots' dots a CTA)
STEP = 64  # hidden and intermediate sizes are multiples of it (the kernels' launch check)
HALF = (torch.bfloat16, torch.float16)


@cache
def _extension():
    """The compiled module, or None where it cannot be built or run (or is switched off)."""
    return one_row_module(
        "nanoserve_moe_gemv", [CSRC / "moe_gemv_binding.cpp", CSRC / "moe_gemv.cu"],
        "the one-token MoE CUDA kernels", CSRC)


def load() -> bool:
    """Builds (first use on a machine) or loads the kernels now; whether they run here."""
    return _extension() is not None


def shape_ok(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
             block: tuple[int, int] = (128, 128)) -> bool:
    """Whether the kernels take x [1, H] routed to ids [1, k] with weights [1, k], over gate_up
    [E, 2I, H] and down [E, H, I]: one token, x and the routing weights in half precision, k
    dividing 16, H and I multiples of 64, contiguous 16-byte aligned stacks on x's device, in
    x's dtype or (with `scales`, gate_up's and down's) e4m3 with one float32 scale per `block`
    (rows, columns; columns a multiple of 16), scales [E, ceil(rows / block[0]), ceil(columns /
    block[1])] with unit last stride. Checks no GPU."""
    if gate_up.dim() != 3 or down.dim() != 3 or ids.dim() != 2:
        return False
    (t, k), (e, inter2, hidden) = ids.shape, gate_up.shape
    inter = inter2 // 2
    stacks = (torch.float8_e4m3fn,) if scales is not None else (x.dtype,)
    return (t == 1 and k >= 1 and MAX_SLOTS % k == 0 and x.shape == (1, hidden) and
            x.dtype in HALF and gate_up.dtype in stacks and down.dtype == gate_up.dtype and
            weights.dtype == x.dtype and
            ids.dtype == torch.int64 and weights.shape == ids.shape and
            hidden % STEP == 0 and inter > 0 and inter % STEP == 0 and inter2 == 2 * inter and
            down.shape == (e, hidden, inter) and
            all(a.is_contiguous() and a.device == x.device
                for a in (x, weights, ids, gate_up, down)) and
            all(a.data_ptr() % 16 == 0 for a in (x, gate_up, down)) and
            (scales is None or _scales_ok(scales, block, x.device, e, inter2, hidden, inter)))


def _scales_ok(scales: tuple[torch.Tensor, torch.Tensor], block: tuple[int, int],
               device: torch.device, e: int, inter2: int, hidden: int, inter: int) -> bool:
    rows, cols = block
    if rows < 1 or cols < 16 or cols % 16:
        return False
    want = ((e, -(-inter2 // rows), -(-hidden // cols)), (e, -(-hidden // rows), -(-inter // cols)))
    return all(s.dtype == torch.float32 and s.device == device and tuple(s.shape) == shape and
               s.stride(2) == 1 for s, shape in zip(scales, want, strict=True))


def supports(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
             block: tuple[int, int] = (128, 128)) -> bool:
    """shape_ok, on a GPU where the kernels build (checked first: it is cached, and switched
    off it ends every batch-1 layer's check at once)."""
    return x.is_cuda and _extension() is not None and \
        shape_ok(x, weights, ids, gate_up, down, scales, block)


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
            block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The experts' weighted sum for the one token x [1, H]: y [1, H] in x's dtype, as
    fused_moe.experts_fused computes it (its roundings; the dots' order aside). See
    `supports`."""
    k, (_, hidden, inter) = ids.shape[1], down.shape
    act = torch.empty(k, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    gate_up_scales, down_scales = scales if scales is not None else (gate_up, down)  # unread
    pdl = pdl_wanted(device_capability(x.device.index or 0))
    with torch.cuda.device(x.device):
        stream = torch.cuda.current_stream().cuda_stream  # a graph's, while capturing
        refused = _extension().experts(x, gate_up, down, ids, weights, act, y, gate_up_scales,
                                       down_scales, block[0], block[1], int(pdl), stream)
    if refused:
        raise RuntimeError(refused)
    return y
