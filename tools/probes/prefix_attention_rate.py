"""What a long prompt's prefill attention runs at, by chunk length and prefix piece (issue 34).

A chunk of T queries attends to each PREFIX_PIECE of its prefix without a mask and to itself
causally, through cuDNN (nanoserve/attention/prefill.py). This times those calls for the 1M
Llama shape (32 query heads, 8 kv heads, d=128, bf16) at several T and piece lengths S, with
the layouts and options cuDNN could take, and the per-piece work around them (the FP8 gather
and the log-sum-exp merge), then adds them up for a whole prompt at each chunk length.
Usage (GPU): python tools/probes/prefix_attention_rate.py [--chunks 4096,8192,16384,32768]
"""

from __future__ import annotations

import argparse

import torch

from nanoserve.attention import prefill
from nanoserve.cuda_timing import median_ms

H, HKV, D = 32, 8, 128
SCALE = D**-0.5
PAGE = 256
aten = torch.ops.aten


def bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)


def cudnn(q, k, v, causal, lse=True):
    return aten._scaled_dot_product_cudnn_attention(q, k, v, None, lse, 0.0, causal, False,
                                                    scale=SCALE)


def variants(q, k, v, causal, engine_only=False):
    """name -> call, for q [T, H, d] and k, v [S, Hkv, d]."""
    qb, kb, vb = (bhsd(x) for x in (q, k, v))
    rep = H // HKV
    groups = [(bhsd(q[:, g * rep:(g + 1) * rep]), bhsd(k[:, g:g + 1]), bhsd(v[:, g:g + 1]))
              for g in range(HKV)]
    by_group = {"cudnn, a call per kv head": lambda: [cudnn(*x, causal) for x in groups]}
    if engine_only:
        return {"cudnn, token-major views (engine)": lambda: cudnn(qb, kb, vb, causal)} | by_group
    qc, kc, vc = (x.contiguous() for x in (qb, kb, vb))  # [1, h, S, d] laid out head-major
    return {
        "cudnn, token-major views (engine)": lambda: cudnn(qb, kb, vb, causal),
        "cudnn, head-major contiguous": lambda: cudnn(qc, kc, vc, causal),
        "cudnn, no log-sum-exp": lambda: cudnn(qb, kb, vb, causal, lse=False),
    } | by_group


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", default="4096,8192,16384,32768")
    ap.add_argument("--pieces", default="65536,131072,262144")
    ap.add_argument("--prompt", type=int, default=1 << 20)
    ap.add_argument("--engine-only", action="store_true", help="only the engine's own call")
    args = ap.parse_args()
    chunks = [int(x) for x in args.chunks.split(",")]
    pieces = [int(x) for x in args.pieces.split(",")]
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "cudnn",
          torch.backends.cudnn.version())
    dev, bf = "cuda", torch.bfloat16
    s_max = max(pieces)
    k = torch.randn(s_max, HKV, D, device=dev, dtype=bf)
    v = torch.randn(s_max, HKV, D, device=dev, dtype=bf)
    rate = {}  # (T, S or "causal") -> engine call's ms
    for t in chunks:
        q = torch.randn(t, H, D, device=dev, dtype=bf)
        for s in pieces + [t]:
            causal = s == t
            flops = 4 * H * D * t * s / (2 if causal else 1)
            for name, fn in variants(q, k[:s], v[:s], causal, args.engine_only).items():
                ms = median_ms(fn, reps=5)
                if "engine" in name:
                    rate[(t, "causal" if causal else s)] = ms
                print(f"T={t:<6} S={s:<7} {'causal' if causal else 'prefix':<6} {name:<36} "
                      f"{ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
        o = torch.randn(t, H, D, device=dev, dtype=torch.float32)
        lse = torch.randn(t, H, device=dev, dtype=torch.float32)
        ms = median_ms(lambda o=o, lse=lse: prefill.merge_with_lse(o, lse, o.to(bf), lse), reps=5)
        rate[(t, "merge")] = ms
        print(f"T={t:<6} merge_with_lse {ms:.3f} ms")
        del q, o, lse
    # a piece's FP8 gather, dequantized to bf16 (k and v alike: one timed)
    for s in pieces:
        pages = torch.randperm(s // PAGE, device=dev)
        cache = torch.randn(s // PAGE, PAGE, HKV, D, device=dev).to(torch.float8_e4m3fn)
        scales = torch.rand(s // PAGE, PAGE, HKV, device=dev) + 0.5
        ms = median_ms(lambda pages=pages, cache=cache, scales=scales, s=s: prefill.gather_kv(
            cache, pages, s, scales, bf), reps=5)
        rate[("gather", s)] = ms
        print(f"gather S={s} FP8 -> bf16 (one of k, v): {ms:.3f} ms "
              f"({s * HKV * D * 3 / ms / 1e6:.0f} GB/s of bytes read + written)")
        del cache, scales
    n = args.prompt
    print(f"\none layer's attention over a {n}-token prompt, by chunk and keys a call, each "
          f"call's gather and merge counted (seconds):")
    for t in chunks:
        for s in pieces:
            total = 0.0
            for start in range(0, n, t):
                total += rate[(t, "causal")]
                full, rest = divmod(start, s)
                parts = full + (rest > 0)
                if parts:
                    total += full * (rate[(t, s)] + 2 * rate[("gather", s)])
                    total += rest / s * (rate[(t, s)] + 2 * rate[("gather", s)])
                    total += parts * rate[(t, "merge")]
            flops = 4 * H * D * n * n / 2
            print(f"  T={t:<6} S={s:<7} {total / 1e3:7.3f} s  {flops / total / 1e9:5.0f} "
                  f"TFLOP/s (the short last piece counted at the full piece's rate)")


if __name__ == "__main__":
    main()
