"""Writes the embedded default model: a tiny Qwen3 with random weights and a byte-level tokenizer.

    python tools/make_tiny_model.py [--out nanoserve/assets/tiny-qwen3] [--seed 0]

Random weights: it runs every code path offline but knows nothing (the needle issue trains it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="nanoserve/assets/tiny-qwen3")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tokenizer = byte_level_tokenizer()
    cfg = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=131072,
        rope_theta=1_000_000.0, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(cfg).eval()
    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main()
