"""Prefill attention candidates on the GPU: TFLOP/s and error against a float64 reference.

A prefill chunk of T new tokens attends to a cached prefix of P tokens (no mask) and to itself
(causal). Each candidate computes that for the Qwen3-8B shape (32 query heads, 8 kv heads,
d=128, bf16); batches of short prompts are timed too. Usage (GPU):
    python tools/probes/bench_attention.py [--chunk 8192] [--prefix 0,8192,24576,122880]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from nanoserve.cuda_timing import median_ms

H, HKV, D = 32, 8, 128
SCALE = D**-0.5
aten = torch.ops.aten


def merge(o1, lse1, o2, lse2):
    """Two partial attentions over disjoint keys, [T, H, d] with LSE [H, T], merged."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).t().unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).t().unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype)


def bhsd(x):  # [S, h, d] -> [1, h, S, d] (a view)
    return x.transpose(0, 1).unsqueeze(0)


def lse_ht(lse, h, t):
    return lse.reshape(h, t) if lse.dim() == 2 else lse.reshape(-1, h, t)[0]


def rep(x):
    return x.repeat_interleave(H // HKV, dim=1)


def sdpa_mem_efficient(q, k, v, p):
    t = q.shape[0]
    if p == 0:
        return bhsd_out(F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), is_causal=True,
                                                       scale=SCALE, enable_gqa=True))
    o = F.scaled_dot_product_attention(bhsd(q), bhsd(rep(k)), bhsd(rep(v)),
                                       attn_mask=causal_lower_right(t, p + t), scale=SCALE)
    return bhsd_out(o)


def bhsd_out(o):
    return o[0].transpose(0, 1)


def fa2_varlen(q, k, v, p):
    t = q.shape[0]
    cu_q = torch.tensor([0, t], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, p + t], dtype=torch.int32, device=q.device)
    return aten._flash_attention_forward(q, k, v, cu_q, cu_k, t, p + t, 0.0, True, False,
                                         scale=SCALE)[0]


def _split(attn_fn, q, k, v, p):
    t = q.shape[0]
    oc, lc = attn_fn(q, k[p:], v[p:], True)
    if p == 0:
        return oc
    op, lp = attn_fn(q, k[:p], v[:p], False)
    return merge(op, lse_ht(lp, H, t), oc, lse_ht(lc, H, t))


def _cudnn(q, k, v, causal, expand):
    if expand:
        k, v = rep(k), rep(v)
    r = aten._scaled_dot_product_cudnn_attention(bhsd(q), bhsd(k), bhsd(v), None, True, 0.0,
                                                 causal, False, scale=SCALE)
    return bhsd_out(r[0]), r[1]


def _flash(q, k, v, causal):
    r = aten._scaled_dot_product_flash_attention(bhsd(q), bhsd(k), bhsd(v), 0.0, causal, False,
                                                 scale=SCALE)
    return bhsd_out(r[0]), r[1]


CANDIDATES = {
    "sdpa-mem-efficient (today)": sdpa_mem_efficient,
    "fa2-varlen bottom-right": fa2_varlen,
    "cudnn split+lse, gqa": lambda q, k, v, p: _split(lambda *a: _cudnn(*a, False), q, k, v, p),
    "cudnn split+lse, expanded": lambda q, k, v, p: _split(lambda *a: _cudnn(*a, True), q, k, v,
                                                           p),
    "flash split+lse, gqa": lambda q, k, v, p: _split(_flash, q, k, v, p),
}


def reference(q, k, v, p):
    t = q.shape[0]
    qd, kd, vd = (bhsd(x.double()) for x in (q, rep(k), rep(v)))
    s = qd @ kd.transpose(-1, -2) * SCALE
    mask = torch.ones(t, p + t, dtype=torch.bool, device=q.device).tril(p)
    s = s.masked_fill(~mask, float("-inf"))
    return bhsd_out(s.softmax(-1) @ vd)


def data(t, p, dev="cuda"):
    g = torch.Generator(device=dev).manual_seed(t * 7 + p)
    q = torch.randn(t, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(p + t, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(p + t, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    return q, k, v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--prefix", default="0,8192,24576,122880")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "cudnn",
          torch.backends.cudnn.version())
    print("errors vs float64 (T=300, P=700, and T=257, P=0):")
    for name, fn in CANDIDATES.items():
        errs = []
        for t, p in ((300, 700), (257, 0)):
            q, k, v = data(t, p)
            try:
                errs.append(f"{(fn(q, k, v, p).double() - reference(q, k, v, p)).abs().max():.2e}")
            except Exception as e:  # noqa: BLE001 - a candidate this torch lacks is reported
                errs.append(f"ERR {type(e).__name__}: {str(e)[:80]}")
        print(f"  {name:<30} {'  '.join(errs)}")
    t = args.chunk
    for p in (int(x) for x in args.prefix.split(",")):
        q, k, v = data(t, p)
        flops = 4 * H * D * (t * p + t * t / 2)
        for name, fn in CANDIDATES.items():
            try:
                ms = median_ms(lambda fn=fn, q=q, k=k, v=v, p=p: fn(q, k, v, p), reps=5)
                print(f"T={t} P={p:<7} {name:<30} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s")
            except Exception as e:  # noqa: BLE001
                print(f"T={t} P={p:<7} {name:<30} ERR {type(e).__name__}: {str(e)[:80]}")
        del q, k, v
        torch.cuda.empty_cache()
    # a batch of short prompts: one call over all of them vs one call per prompt
    n, t = 16, 512
    q, k, v = data(n * t, 0)
    k, v = k[: n * t], v[: n * t]
    cu = torch.arange(0, (n + 1) * t, t, dtype=torch.int32, device="cuda")
    flops = n * 4 * H * D * t * t / 2
    loops = {
        "per-prompt sdpa": lambda: [F.scaled_dot_product_attention(
            bhsd(q[i * t:(i + 1) * t]), bhsd(k[i * t:(i + 1) * t]), bhsd(v[i * t:(i + 1) * t]),
            is_causal=True, scale=SCALE, enable_gqa=True) for i in range(n)],
        "fa2 varlen, one call": lambda: aten._flash_attention_forward(
            q, k, v, cu, cu, t, t, 0.0, True, False, scale=SCALE),
        "cudnn varlen, one call": lambda: aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, t, t, False, 0.0, True, False, scale=SCALE),
    }
    for name, fn in loops.items():
        try:
            ms = median_ms(fn, reps=5)
            print(f"{n}x{t} {name:<28} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s")
        except Exception as e:  # noqa: BLE001
            print(f"{n}x{t} {name:<28} ERR {type(e).__name__}: {str(e)[:80]}")


if __name__ == "__main__":
    main()
