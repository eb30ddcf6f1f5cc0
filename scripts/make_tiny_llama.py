#!/usr/bin/env python3
"""Write a tiny randomly initialised Llama checkpoint that vLLM CPU loads and serves in seconds.

    python scripts/make_tiny_llama.py OUT_DIR [--layers N] [--hidden H]

Defaults (2 layers, hidden 128: 459,392 parameters) are the model CI serves. benchmarks/soak_accuracy.py
--vllm asks for a larger one (more layers, wider) so that one decode step costs the server several ms and the
gaps between tokens measure the server, not how the client reads its socket.
Runs inside the vLLM CPU venv (torch, transformers and tokenizers come with vLLM); downloads nothing.
The tokenizer is a small byte-level BPE fitted here on deterministic pseudo-text, so every prompt
(including `vllm bench serve`'s random token ids) maps to valid ids. The output is noise on purpose:
the model exists to exercise the serving path (scheduler, KV cache, streaming), not to say anything.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

VOCAB_SIZE = 512
MAX_LEN = 512
BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "[{{ message['role'] }}] {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def pseudo_text(lines: int) -> list[str]:
    """Deterministic text with a little vocabulary, digits and punctuation (a linear congruential walk)."""
    words = (
        "kv page block pool engine core worker server stream token prompt reply queue lock thread "
        "alloc free map unmap reserve null cache hit miss load idle busy wait wake step run stop "
        "alpha beta gamma delta one two three four five six seven eight nine zero and or the of to"
    ).split()
    state = 12345
    out = []
    for _ in range(lines):
        state = (state * 1103515245 + 12345) % (1 << 31)
        n = 4 + state % 11
        picked = []
        for _ in range(n):
            state = (state * 1103515245 + 12345) % (1 << 31)
            picked.append(words[state % len(words)])
        line = " ".join(picked)
        if state % 5 == 0:
            line = line.title() + f", {state % 997}."
        out.append(line)
    return out


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Write a tiny random Llama checkpoint for vLLM CPU.")
    ap.add_argument("out", help="output directory")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    ap.add_argument("--hidden", type=int, default=128,
                    help="hidden size, a multiple of 64 (default 128; MLP width 2x, one head per 64)")
    args = ap.parse_args(argv[1:])
    if args.layers < 1 or args.hidden < 64 or args.hidden % 64:
        ap.error("--layers must be >= 1 and --hidden a positive multiple of 64")
    out = Path(args.out)
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=UNK))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        itertools.chain(pseudo_text(3000)),
        trainer=trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE,
            special_tokens=[UNK, BOS, EOS, PAD],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        model_max_length=MAX_LEN,
    )
    tokenizer.chat_template = TEMPLATE
    if len(tokenizer) > VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {len(tokenizer)} entries, more than the model's {VOCAB_SIZE}")

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        head_dim=64,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).float()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"tiny llama: {out} ({params:,} parameters, vocab {len(tokenizer)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
