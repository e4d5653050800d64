"""Trains the embedded default model: a tiny Qwen3 that finds a needle in a 32K-token haystack.

    python tools/train_needle_model.py --out nanoserve/assets/tiny-qwen3   # one H100/H200

Model: Qwen3 architecture (CONFIG: hidden 256, 4 layers, 8 query / 4 KV heads of dim 32),
byte-level tokenizer (256 bytes + 3 chat tokens), bf16 weights (~6 MB).
Data (seeded, generated on the fly): each example is a needle prompt from nanoserve.needle (the
builder the needle test uses: filler sentences, one needle "The secret number is N." at a
uniform random depth, the question, the chat template) followed by the answer
"The secret number is N.<|im_end|>". All examples of a step have one length, drawn
log-uniformly from [256, max_len]; max_len grows from 1K to --max-len over the first half of
training, so retrieval is learned short and then stretched to long contexts.
Copy rows (random printable bytes, then the same bytes again; 50% of rows at the start, 10% at
the end) grow the copying (induction) heads that retrieval needs far sooner than the sparse
needle answers alone: a run without them learned no retrieval in 300 small CPU steps.
Loss: cross-entropy on the answer tokens + on the copied halves + 0.1 x on the other tokens.
Eval: teacher-forced exact match of the whole answer at several lengths x 11 depths.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanoserve.needle import NeedleBuilder  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONFIG = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, head_dim=32,
              max_position_embeddings=65536, rope_theta=1_000_000.0, tie_word_embeddings=True)
EVAL_DEPTHS = [i / 10 for i in range(11)]


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


PROMPT, ANSWER, COPY = 0, 1, 2  # token roles in a training row


COPY_ALPHABETS = ["0123456789", "0123456789", "abcdefghijklmnopqrstuvwxyz",
                  "".join(map(chr, range(32, 127)))]


def copy_row(length: int, rng: random.Random,
             alphabets: list[list[int]]) -> tuple[list[int], list[int]]:
    """Random symbols, then the same symbols again: the second half is predictable only by
    copying from far back, which grows the copying (induction) heads retrieval needs. Small
    alphabets (digits, half of the rows) force matching on several preceding tokens, as finding
    a secret number among others' digits does."""
    half = length // 2
    alphabet = rng.choice(alphabets)
    text = [rng.choice(alphabet) for _ in range(length - half)]
    return text + text[:half], [PROMPT] * (length - half) + [COPY] * half


def make_batch(builder: NeedleBuilder, eos: int, length: int, batch: int, rng: random.Random,
               depths: list[float] | None = None, copy_frac: float = 0.0):
    """[batch, length] token ids (needle prompt + answer + eos, or a copy row) and token roles."""
    rows, roles = [], []
    alphabets = [builder.encode(a) for a in COPY_ALPHABETS]
    answer_len = len(builder.answer_ids("0" * builder.secret_digits)) + 1
    for i in range(batch):
        if depths is None and rng.random() < copy_frac:
            row, role = copy_row(length, rng, alphabets)
        else:
            depth = depths[i] if depths else rng.choice([0.0, 1.0, rng.random(), rng.random()])
            p = builder.build(length - answer_len, depth, rng)
            answer = builder.answer_ids(p.secret) + [eos]
            row, role = p.token_ids + answer, [PROMPT] * len(p.token_ids) + [ANSWER] * len(answer)
        rows.append(row)
        roles.append(role)
    return torch.tensor(rows), torch.tensor(roles, dtype=torch.int8)


def forward_loss(model, ids: torch.Tensor, roles: torch.Tensor, prompt_weight: float,
                 copy_weight: float = 1.0):
    """(loss, answer loss, exact match of the needle answer per row), next-token targets."""
    hidden = model.model(input_ids=ids[:, :-1], use_cache=False).last_hidden_state
    logits = model.lm_head(hidden).float()
    target, role = ids[:, 1:], roles[:, 1:]
    ce = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    zero = ce.sum() * 0

    def mean(sel):
        return ce[sel].mean() if sel.any() else zero

    answer_loss = mean(role == ANSWER)
    loss = answer_loss + copy_weight * mean(role == COPY) + prompt_weight * mean(role == PROMPT)
    correct = (logits.argmax(-1) == target) | (role != ANSWER)
    return loss, answer_loss.detach(), correct.all(dim=1)


@torch.no_grad()
def evaluate(model, builder, eos, lengths, rng, device) -> dict[int, float]:
    model.eval()
    out = {}
    for length in lengths:
        ids, mask = make_batch(builder, eos, length, len(EVAL_DEPTHS), rng, EVAL_DEPTHS)
        hits = []
        for j in range(len(EVAL_DEPTHS)):  # one row at a time keeps 64K-token logits small
            with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
                _, _, ok = forward_loss(model, ids[j:j + 1].to(device), mask[j:j + 1].to(device),
                                     0.0)
            hits.append(bool(ok.item()))
        out[length] = sum(hits) / len(hits)
    model.train()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="nanoserve/assets/tiny-qwen3")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--tokens-per-step", type=int, default=131072)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=40960)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--prompt-weight", type=float, default=0.1)
    ap.add_argument("--copy-frac", type=float, default=0.5,
                    help="Share of rows that are copy rows, at the start (linearly to 0.1).")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-lengths", default="1024,4096,16384,32768")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="Seconds of training: progress (learning-rate decay, length "
                         "curriculum) follows max(step / steps, elapsed / time-limit), so a "
                         "slower machine finishes the same schedule in fewer steps.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", default=None,
                    help="Start from this checkpoint (a model dir) instead of random weights.")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    t_start = time.time()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = byte_level_tokenizer()
    builder = NeedleBuilder(tokenizer)
    eos = tokenizer.eos_token_id
    cfg = Qwen3Config(vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=None,
                      pad_token_id=tokenizer.pad_token_id, **CONFIG)
    if args.init:
        model = Qwen3ForCausalLM.from_pretrained(args.init, dtype=torch.float32)
        model = model.to(device).train()
    else:
        model = Qwen3ForCausalLM(cfg).to(device).train()
    model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f}M parameters on {device}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.01, fused=device.type == "cuda")
    eval_lengths = [int(x) for x in args.eval_lengths.split(",")]
    log = {"command": " ".join(sys.argv), "args": vars(args), "config": CONFIG,
           "parameters": n_params, "device": torch.cuda.get_device_name() if
           device.type == "cuda" else "cpu", "loss": [], "evals": []}
    recent: list[tuple[float, float]] = []
    t_train = time.time()
    for step in range(1, args.steps + 1):
        frac = step / args.steps
        if args.time_limit:
            frac = min(1.0, max(frac, (time.time() - t_train) / args.time_limit))
        lr = args.lr * min(1.0, step / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(
            math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        top = args.min_len * (args.max_len / args.min_len) ** min(1.0, 2 * frac)
        top = max(top, min(1024, args.max_len))
        length = int(math.exp(rng.uniform(math.log(args.min_len), math.log(top))))
        batch = max(1, args.tokens_per_step // length)
        copy_frac = args.copy_frac + (min(args.copy_frac, 0.1) - args.copy_frac) * frac
        ids, mask = make_batch(builder, eos, length, batch, rng, copy_frac=copy_frac)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss, answer_loss, _ = forward_loss(model, ids.to(device), mask.to(device),
                                                args.prompt_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent.append((loss.item(), answer_loss.item()))
        if step % 25 == 0:
            avg = sum(r[0] for r in recent) / len(recent)
            ans = sum(r[1] for r in recent) / len(recent)
            recent.clear()
            log["loss"].append([step, round(avg, 4), round(ans, 4)])
            print(f"step {step:5d}  len {length:6d} x {batch:3d}  loss {avg:.4f}  answer "
                  f"{ans:.4f}  lr {lr:.2e}  "
                  f"{time.time() - t_start:.0f}s", flush=True)
        done = frac >= 1.0
        if step % args.eval_every == 0 or done:
            acc = evaluate(model, builder, eos, eval_lengths, random.Random(10_000 + step),
                           device)
            log["evals"].append({"step": step, **{str(k): v for k, v in acc.items()}})
            print(f"eval step {step}: " + "  ".join(f"{k}: {v:.2f}" for k, v in acc.items()),
                  flush=True)
        if done:
            break
    log["steps_done"] = step
    log["train_seconds"] = round(time.time() - t_start, 1)
    out = Path(args.out)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(f"wrote {out} in {log['train_seconds']} s", flush=True)


if __name__ == "__main__":
    main()
