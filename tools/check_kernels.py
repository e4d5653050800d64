"""Compiles every hand-written Triton kernel of nanoserve for Hopper (sm_90; --capability 89
for Ada, 80 / 86 for Ampere) without a GPU, and checks each within the target's shared memory:
each kernel goes through its real launch wrapper, on CPU tensors of the Qwen3-8B shape, with
the launch itself skipped. A compile error (a Python global the JIT cannot read, a loop
variable that changes type) then costs no device time. Needs triton beside CPU torch, in its
own environment (the project's test environment has none):

    python -m venv /tmp/tv && . /tmp/tv/bin/activate
    pip install torch==2.13.0 triton==3.6.0 && pip install -e .
    python tools/check_kernels.py [--pdl] [--ptxas]

--ptxas (needs the CUDA toolkit's ptxas) also prints each kernel's registers, spills and
cp.async copies narrower than 16 bytes: a tile whose alignment the compiler cannot prove is
copied in 4-byte pieces, at more registers (FP8's K split until session 38: 245 registers and 96
narrow copies against 165 and none). --pdl compiles the kernels as sm_90 launches them, with
programmatic dependent launch, and says where each lets the next kernel start: first thing, or
after its last loop (what a kernel that streams should do; nanoserve/pdl.py).
"""

from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver, jit

# the most shared memory a block may use, by compute capability (CUDA's programming guide):
# a kernel over it compiles but is refused at launch
SHARED_LIMIT = {80: 163 << 10, 86: 99 << 10, 89: 99 << 10, 90: 227 << 10}


class _CompileOnlyDriver:
    """Enough of triton's driver for a compile: device 0, an sm_`capability` target, no
    launches."""

    capability = 90

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.capability, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def compile_only(capability: int = 90, compiled: list | None = None) -> None:
    """From here on, launching a Triton kernel compiles it for sm_`capability` and returns;
    each compiled kernel's (name, compiled kernel) is appended to `compiled`."""
    _CompileOnlyDriver.capability = capability
    driver.set_active(_CompileOnlyDriver())
    run = jit.JITFunction.run

    def warmup_run(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        if compiled is not None:
            compiled.append((self.fn.__name__, kernel))
        return kernel

    jit.JITFunction.run = warmup_run


def cases():
    """(name, launch) for every kernel and its variants (dtypes, flags)."""
    from nanoserve.attention.triton_decode import Tiles, paged_decode_attention
    from nanoserve.attention.triton_kv_store import store_fp8
    from nanoserve.attention.triton_rope_store import rope_and_store
    from nanoserve.kv.fp8_format import FP8
    from nanoserve.kv.spec import KVSpec
    from nanoserve.models.triton_linear import (
        skinny_linear,
        skinny_silu_linear,
    )

    bf16, pages, page, heads, kv_heads, d = torch.bfloat16, 8, 256, 32, 8, 128
    q = torch.zeros(4, heads, d, dtype=bf16)
    k = v = torch.zeros(4, kv_heads, d, dtype=bf16)
    table = torch.zeros(4, pages, dtype=torch.int32)
    lens = torch.ones(4, dtype=torch.int32)
    slots = torch.zeros(4, dtype=torch.int64)
    caches = {dt: torch.zeros(2, pages, page, kv_heads, d, dtype=dt) for dt in (bf16, FP8)}
    scales = torch.ones(2, pages, page, kv_heads)
    cos_sin = torch.zeros(64, d)
    positions = torch.zeros(4, dtype=torch.int64)
    norm = (torch.ones(d, dtype=bf16), torch.ones(d, dtype=bf16), 1e-6)

    def decode(dt, splits=8, tiles=None, q=q, kvh=kv_heads):
        kw = {"k_scale": scales[0, ..., :kvh], "v_scale": scales[1, ..., :kvh]} \
            if dt == FP8 else {}
        return lambda: paged_decode_attention(q, caches[dt][0, ..., :kvh, :],
                                              caches[dt][1, ..., :kvh, :], table, lens,
                                              d**-0.5, splits, tiles=tiles, **kw)

    yield "decode attention, bf16 KV", decode(bf16)
    yield "decode attention, FP8 KV", decode(FP8)
    yield "decode attention, bf16 KV, one split (no merge)", decode(bf16, 1)
    for dt, tiles in ((bf16, Tiles(64, 4, 2, tma=True)), (FP8, Tiles(128, 4, 3, tma=True))):
        for transposed in (False, True):
            yield f"decode attention, {dt}, TMA, transposed {transposed}", \
                decode(dt, tiles=tiles._replace(transposed=transposed))
    # the dots both ways (Tiles.transposed), one split and several, float32 queries
    for dt, tiles in ((bf16, Tiles(64, 4, 2)), (FP8, Tiles(128, 4, 2, f16_dot=True))):
        for transposed, splits, q_dtype in itertools.product((False, True), (1, 8),
                                                             (bf16, torch.float32)):
            yield f"decode attention, {dt}, q {q_dtype}, transposed {transposed}, " \
                f"{splits} split(s)", decode(dt, splits, tiles._replace(transposed=transposed),
                                             q.to(q_dtype))
    for group_heads, kvh in ((28, 4), (8, 8), (64, 8)):  # groups of 7, 1 and 8
        yield f"decode attention, FP8 KV, {group_heads} heads / {kvh}, transposed", decode(
            FP8, tiles=Tiles(128, 4, 2, f16_dot=True, transposed=True),
            q=torch.zeros(4, group_heads, d, dtype=bf16), kvh=kvh)
    for q_dtype in (bf16, torch.float32):  # a GQA group of 8 (Qwen3-30B-A3B)
        yield f"decode attention, bf16 KV, 32 heads / 4 (default tiles), q {q_dtype}", decode(
            bf16, q=torch.zeros(4, 32, d, dtype=q_dtype), kvh=4)
    for qk_norm in (norm, None):
        yield f"rope + store, q/k norm {qk_norm is not None}", lambda qk_norm=qk_norm: \
            rope_and_store(q, k, v, cos_sin, positions, qk_norm, caches[bf16][0],
                           caches[bf16][1], slots)
    rows = KVSpec(1, page, kv_heads, d, FP8).empty(1, pages, q.device)[0]
    fp8_views = KVSpec(1, page, kv_heads, d, FP8).views(rows)  # the engine's strided views
    for qk_norm in (norm, None):
        yield f"rope + FP8 store, q/k norm {qk_norm is not None}", lambda qk_norm=qk_norm: \
            rope_and_store(q, k, v, cos_sin, positions, qk_norm, *fp8_views[:2], slots,
                           *fp8_views[2:])
    yield "FP8 KV store", lambda: store_fp8(k, v, caches[FP8][0], caches[FP8][1], scales[0],
                                            scales[1], slots)
    for n, kk in ((6144, 4096), (151936, 4096)):
        yield f"skinny matmul {n} x {kk}", lambda n=n, kk=kk: skinny_linear(
            torch.zeros(1, kk, dtype=bf16), torch.zeros(n, kk, dtype=bf16))
    yield "SiLU-multiply + skinny matmul", lambda: skinny_silu_linear(
        torch.zeros(1, 2 * 12288, dtype=bf16), torch.zeros(4096, 12288, dtype=bf16))
    yield from moe_cases()
    yield from quant_cases()


def quant_cases():
    """The quantized-weight kernels at a 4096 x 4096 weight: FP8 with the weight widened (one
    row), x quantized (16, 64 and 128 rows; from [gate | up] too; by the residual add and RMSNorm,
    at 4,096 and 8,192 inputs: 4 and 8 warps) and float32 x, K split and not; the 4-bit
    formats' GEMV (one row) and GEMM (16 rows; GPTQ with act-order too)."""
    from nanoserve.quant.triton_gemm import (
        AWQ,
        FP8,
        GPTQ,
        GPTQ_ACT_ORDER,
        QuantTiles,
        _fp8_gemm,
        norm_quantize_activations,
        quant_gemm,
        quantize_activations,
    )

    n = k = 4096
    fp8 = dict(fmt=FP8, w=torch.zeros(n, k, dtype=torch.float8_e4m3fn),
               scales=torch.ones(n // 128, k // 128), scale_row=torch.zeros(n, dtype=torch.int32),
               scale_cols=128, n=n)
    for rows, dtype in ((1, torch.bfloat16), (16, torch.bfloat16), (64, torch.bfloat16),
                        (128, torch.bfloat16), (16, torch.float32)):
        yield f"quantized GEMM, FP8 block-wise, {rows} rows {dtype}", lambda r=rows, d=dtype: \
            quant_gemm(torch.zeros(r, k, dtype=d), **fp8)
    yield "quantized GEMM, FP8 block-wise, silu(gate) * up quantized, 16 rows", lambda: \
        quant_gemm(torch.zeros(16, 2 * k, dtype=torch.bfloat16), **fp8, silu=True)
    yield "FP8 activation quantization, a whole row a program, silu", lambda: \
        quantize_activations(torch.zeros(16, 2 * k, dtype=torch.bfloat16), 128, silu=True,
                             groups_per_program=k // 128)
    for width, add in ((k, True), (k, False), (2 * k, True)):
        yield f"FP8 activation quantization of RMSNorm, {width} inputs, residual add {add}", \
            lambda w=width, a=add: norm_quantize_activations(
                torch.zeros(16, w, dtype=torch.bfloat16),
                torch.zeros(16, w, dtype=torch.bfloat16) if a else None,
                torch.ones(w, dtype=torch.bfloat16), 1e-6, 128, 16)
    int4 = dict(zeros=torch.zeros(k // 128, n // 8, dtype=torch.int32),
                scales=torch.ones(k // 128, n, dtype=torch.float16), n=n)
    formats = {"AWQ": dict(fmt=AWQ, w=torch.zeros(k, n // 8, dtype=torch.int32)),
               "GPTQ": dict(fmt=GPTQ, w=torch.zeros(k // 8, n, dtype=torch.int32),
                            zero_offset=1),
               "GPTQ act-order": dict(fmt=GPTQ_ACT_ORDER, g_idx=torch.zeros(k, dtype=torch.int32),
                                      w=torch.zeros(k // 8, n, dtype=torch.int32))}
    for (name, args), rows in itertools.product(formats.items(), (1, 16)):
        yield f"quantized GEMM, {name}, {rows} rows", lambda a=args, r=rows: quant_gemm(
            torch.zeros(r, k, dtype=torch.bfloat16), **a, **int4)
    yield "quantized GEMM, AWQ, 16 rows, fp16", lambda: quant_gemm(
        torch.zeros(16, k, dtype=torch.float16), **formats["AWQ"], **int4)
    for split in (1, 4):
        yield f"FP8 block-wise, weight widened, bf16, split {split}", lambda s=split: _fp8_gemm(
            torch.zeros(16, k, dtype=torch.bfloat16), fp8["w"], fp8["scales"],
            fp8["scale_row"], 128, n, False, QuantTiles(16, 64, 128, 4, 4, s), False)


def moe_cases():
    """The fused MoE kernels at Qwen3-30B-A3B's widths: the one-program and blocked sorts, the
    grouped GEMMs (on the CPU the sort runs as torch ops) in bf16 and in float32's full
    precision, their weights through TMA too, and the intermediate in sorted order."""
    from nanoserve.models import fused_moe
    from nanoserve.models.moe_tiles import MoETiles, padded_sizes

    experts, k, hidden, inter = 128, 8, 2048, 768
    ids = torch.arange(4 * k, dtype=torch.int64).view(4, k)
    rows, tiles = padded_sizes(ids.numel(), experts, 16)
    yield "fused MoE: the one-program sort", lambda: fused_moe._sort_pairs_kernel[(1,)](
        ids, torch.zeros(34, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32),
        torch.zeros(tiles, dtype=torch.int32), ids.numel(), experts, rows, tiles, BLOCK_P=32,
        BLOCK_ROWS=triton.next_power_of_2(rows), BLOCK_TILES=triton.next_power_of_2(tiles),
        BLOCK_M=16)
    for dtype, tokens in itertools.product((torch.bfloat16, torch.float32), (4, 64)):
        yield f"fused MoE router, {dtype}, {tokens} tokens", \
            lambda dtype=dtype, tokens=tokens: fused_moe.pick(
                torch.zeros(tokens, experts, dtype=dtype), k, True)
    many = torch.zeros(4096, k, dtype=torch.int64)
    yield "fused MoE: the blocked sort", lambda: fused_moe._sort_pairs_blocked(many, experts, 128)
    for dtype, tiles in itertools.product((torch.bfloat16, torch.float32),
                                          (MoETiles(16, 32, 128, 4, 4),
                                           MoETiles(128, 128, 64, 8, 3),
                                           MoETiles(128, 128, 64, 8, 3, True),
                                           MoETiles(128, 128, 64, 8, 3, True, True))):
        yield f"fused MoE experts, {dtype}, {tuple(tiles)}", \
            lambda dtype=dtype, tiles=tiles: fused_moe.experts_fused(
                torch.zeros(4, hidden, dtype=dtype), torch.ones(4, k, dtype=dtype), ids,
                torch.zeros(experts, 2 * inter, hidden, dtype=dtype),
                torch.zeros(experts, hidden, inter, dtype=dtype), tiles)
    fp8 = torch.float8_e4m3fn
    yield "fused MoE experts, FP8 block-wise weights", lambda: fused_moe.experts_fused(
        torch.zeros(4, hidden, dtype=torch.bfloat16), torch.ones(4, k, dtype=torch.bfloat16),
        ids, torch.zeros(experts, 2 * inter, hidden, dtype=fp8),
        torch.zeros(experts, hidden, inter, dtype=fp8), MoETiles(16, 32, 128, 4, 4),
        scales=(torch.ones(experts, 2 * inter // 128, hidden // 128),
                torch.ones(experts, hidden // 128, inter // 128)))


def ptxas_report(kernel, capability: int) -> str:
    """ptxas's registers and spill stores for a compiled kernel's PTX, and its cp.async copies
    under 16 bytes (`.ca`: 4 or 8 bytes; a 16-byte copy is `.cg`)."""
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "kernel.ptx")
        path.write_text(ptx)
        arch = f"sm_{capability}{'a' if capability == 90 else ''}"
        out = subprocess.run(["ptxas", f"-arch={arch}", "-v", str(path), "-o",
                              str(Path(d, "kernel.o"))], capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spilled = re.search(r"(\d+) bytes spill stores", out)
    return (f"{regs.group(1) if regs else '?'} registers, "
            f"{spilled.group(1) if spilled else '?'} bytes spilled, "
            f"{ptx.count('cp.async.ca.')} copies under 16 bytes")


def pdl_report(kernel) -> str:
    """Where a kernel compiled with PDL lets the next kernel start, against its loops (the PTX's
    backward branches): first thing (a short kernel, pdl.start) or after its last loop (a kernel
    that streams, pdl.let_next_start: let go first thing, the next kernel's programs wait
    beside its running ones; session 41)."""
    lines = kernel.asm["ptx"].splitlines()
    if not any("griddepcontrol.wait" in line for line in lines):
        return "no PDL wait"
    trigger = next((i for i, line in enumerate(lines)
                    if "griddepcontrol.launch_dependents" in line), None)
    if trigger is None:
        return "PDL: waits; the next kernel starts when it ends"
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"\s*(\$L__\w+):", line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)  # (top, backward branch)
             if (m := re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line))
             and labels.get(m.group(1), i) < i]
    if not loops:
        return "PDL: waits; lets the next start (no loop)"
    where = "after its last loop" if trigger > max(end for _, end in loops) else \
        "first thing" if trigger < min(top for top, _ in loops) else "inside a loop"
    return f"PDL: waits; lets the next start {where}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capability", type=int, default=90, choices=sorted(SHARED_LIMIT),
                    help="compute capability to compile for (89: an L4 / L40 / RTX 4090)")
    ap.add_argument("--pdl", action="store_true",
                    help="compile the kernels with PDL, as sm_90 and later launch them, and say "
                         "where each lets the next kernel start")
    ap.add_argument("--ptxas", action="store_true",
                    help="also each kernel's registers, spills and narrow copies (ptxas)")
    args = ap.parse_args()
    capability = args.capability
    compiled: list[tuple[str, object]] = []
    compile_only(capability, compiled)
    if args.pdl:
        from nanoserve import pdl
        pdl.wanted = lambda t: True
    failed = 0
    for name, launch in cases():
        compiled.clear()
        if capability < 89 and ("FP8" in name or "float8" in name):
            print(f"skip    {name}: no e4m3 before sm_89 (the engine refuses FP8 KV there and "
                  f"runs FP8 weights dequantized)")
            continue
        try:
            launch()
            over = [(k, c.metadata.shared) for k, c in compiled
                    if c.metadata.shared > SHARED_LIMIT[capability]]
            if over:
                raise RuntimeError(f"shared memory over the sm_{capability} limit of "
                                   f"{SHARED_LIMIT[capability]} bytes: {over}")
            print(f"ok      {name}")
            for kernel_name, kernel in compiled if args.ptxas or args.pdl else ():
                report = [ptxas_report(kernel, capability)] if args.ptxas else []
                report += [pdl_report(kernel)] if args.pdl else []
                print(f"          {kernel_name}: {'; '.join(report)}")
        except Exception as e:  # noqa: BLE001 - every compile error is reported, then the next
            failed += 1
            print(f"FAILED  {name}: {type(e).__name__}: {str(e)[:2000]}")
    print(f"{failed} of the kernels failed to compile for sm_{capability} within its shared "
          f"memory (triton {triton.__version__})")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
