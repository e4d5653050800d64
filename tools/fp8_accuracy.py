"""FP8 KV accuracy on a real model's K/V: attention output error per layer and logit agreement,
against float32 KV, for bf16 KV, FP8 with a scale per token and kv head (the engine's) and FP8
with a scale per page and kv head (the alternative). Runs on the CPU (or a GPU with --device).

    python tools/fp8_accuracy.py                       # the embedded model, 2,048-token needles
    python tools/fp8_accuracy.py --input-len 8192 --queries 1024

Attention error: each layer's queries (the last --queries of a needle prompt) over all its keys,
causal, in float64, with K/V as each format stores them; relative Frobenius error of the output
against float32 K/V. Logits: every position of the prompts through the engine (prefill) with
--kv-cache-dtype auto (float32 on the CPU), bfloat16 and fp8; relative error, and how often the
top-1 token agrees with bf16 KV's.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import engine_prefill_logits  # noqa: E402

from nanoserve import LLM  # noqa: E402
from nanoserve.kv.fp8 import dequantize, quantize  # noqa: E402
from nanoserve.kv.fp8_format import FP8, FP8_MAX, MIN_SCALE  # noqa: E402
from nanoserve.needle import NeedleBuilder  # noqa: E402


def per_token(x: torch.Tensor) -> torch.Tensor:
    """K or V [tokens, kv_heads, d] as the engine's FP8 cache stores and reads it."""
    values, scales = quantize(x)
    return dequantize(values, scales, torch.float32)


def per_page(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """The alternative: one scale per page and kv head (a full page's amax)."""
    t, h, d = x.shape
    pad = -t % page_size
    xp = torch.cat([x, x.new_zeros(pad, h, d)]).view(-1, page_size, h, d)
    scale = (xp.abs().amax(dim=(1, 3), keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    deq = (xp / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale
    return deq.view(-1, h, d)[:t]


FORMATS = {
    "bf16": lambda x: x.to(torch.bfloat16).float(),
    "fp8 per token": per_token,
    "fp8 per page of 16": lambda x: per_page(x, 16),
    "fp8 per page of 256": lambda x: per_page(x, 256),
}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The last q.shape[0] queries of a causal sequence over its keys, float64."""
    t, s = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    logits = torch.einsum("thd,shd->hts", q.double(), k) * scale
    visible = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.einsum("hts,shd->thd", logits.softmax(-1), v)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm()).item()


def capture_qkv(llm: LLM, token_ids: list[int]) -> dict[int, tuple]:
    """Each layer's q, k (rotated), v of a one-chunk prefill of `token_ids`."""
    got = {}
    layers = llm.engine.runner.model.attention_layers
    for attn in layers:
        def record(positions, q, k, v, attn=attn, f=attn.forward):
            qr, kr = attn.rotate(positions, q, k)
            got[attn.layer_id] = (qr.float().clone(), kr.float().clone(), v.float().clone())
            return f(positions, q, k, v)
        attn.forward = record
    try:
        engine_prefill_logits(llm, token_ids)
    finally:
        for attn in layers:
            del attn.forward
    return got


def attention_errors(qkv: dict[int, tuple], queries: int, scale: float
                     ) -> dict[str, list[float]]:
    """Per format, per layer: relative error of the attention output against float32 K/V."""
    errors: dict[str, list[float]] = {name: [] for name in FORMATS}
    for layer in sorted(qkv):
        q, k, v = qkv[layer]
        q = q[-queries:]
        ref = attention(q, k, v, scale)
        for name, fmt in FORMATS.items():
            errors[name].append(rel(attention(q, fmt(k), fmt(v), scale), ref))
    return errors


def logit_agreement(model: str | None, device: str, prompts: list[list[int]]) -> dict:
    """Prefill logits of every position with float32 (auto on CPU), bf16 and fp8 KV."""
    logits = {}
    for kv in ("auto", "bfloat16", "fp8"):
        llm = LLM(model, progress=False, device=device, dtype="float32", kv_cache_dtype=kv,
                  max_model_len=max(map(len, prompts)) + 1, max_num_seqs=1)
        logits[kv] = torch.cat([engine_prefill_logits(llm, p) for p in prompts]).double()
    ref, bf16, fp8 = logits["auto"], logits["bfloat16"], logits["fp8"]
    return {"rel_fp8": rel(fp8, ref), "rel_bf16": rel(bf16, ref),
            "top1_fp8_vs_bf16": (fp8.argmax(-1) == bf16.argmax(-1)).double().mean().item(),
            "top1_bf16_vs_fp32": (bf16.argmax(-1) == ref.argmax(-1)).double().mean().item(),
            "top1_fp8_vs_fp32": (fp8.argmax(-1) == ref.argmax(-1)).double().mean().item(),
            "positions": ref.shape[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=512)
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    args = ap.parse_args()
    llm = LLM(args.model, progress=False, device=args.device, dtype="float32",
              max_model_len=args.input_len + 1, max_num_seqs=1)
    builder = NeedleBuilder(llm.tokenizer)
    depths = [float(d) for d in args.depths.split(",")]
    prompts = [builder.build(args.input_len, d, random.Random(i)).token_ids
               for i, d in enumerate(depths)]
    scale = llm.engine.runner.model.attention_layers[0].scale
    print(f"model {llm.engine.model_dir.name}, {args.input_len}-token needle prompts at depths "
          f"{depths}, last {args.queries} queries, attention error vs float32 K/V "
          f"(relative Frobenius, per layer; mean over prompts)")
    per_prompt = [attention_errors(capture_qkv(llm, p), args.queries, scale) for p in prompts]
    for name in FORMATS:
        layers = zip(*(e[name] for e in per_prompt), strict=True)
        means = [sum(x) / len(x) for x in layers]
        print(f"  {name:<20} " + " ".join(f"{m:.2e}" for m in means) +
              f"   max {max(means):.2e}")
    del llm
    agree = logit_agreement(args.model, args.device, prompts)
    print(f"logits over {agree['positions']} positions (prefill, every position): relative "
          f"error vs float32 KV: fp8 {agree['rel_fp8']:.2e}, bf16 {agree['rel_bf16']:.2e}; "
          f"top-1 agreement: fp8 vs bf16 KV {agree['top1_fp8_vs_bf16']:.4f}, fp8 vs float32 "
          f"{agree['top1_fp8_vs_fp32']:.4f}, bf16 vs float32 {agree['top1_bf16_vs_fp32']:.4f}")


if __name__ == "__main__":
    main()
