"""Regenerate the tiny model's byte-level BPE tokenizer from ``corpus.txt`` (deterministic).

    python sglang_tpu_backend/assets/build_tiny_tokenizer.py [out_dir]

Writes ``tokenizer.json`` into ``out_dir`` (default: ``tiny-qwen3.5-moe/`` beside this file).
``tokenizer_config.json`` and ``config.json`` there are hand-written; rerun
``python -m sglang_tpu_backend.model_loader.tiny_model --write-config`` after changing the
vocabulary size.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3.5's reasoning and tool-call markers: added after training (ids 1172..1177, inside the
# model's vocab_size of 1216), not special, so decoding keeps them in the text as Qwen's do.
MARKER_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VOCAB_SIZE = 1280  # upper bound: training stops once no pair occurs twice (1172 tokens)


def build_tokenizer(corpus: Path = HERE / "corpus.txt", vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train a GPT-2/Qwen-style byte-level BPE on ``corpus`` (one document per line)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = corpus.read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(lines, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    return tok


def main(argv: list[str]) -> None:
    out = Path(argv[1]) if len(argv) > 1 else HERE / "tiny-qwen3.5-moe"
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"), pretty=False)
    print(f"wrote {out / 'tokenizer.json'} ({tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main(sys.argv)
