"""Offline generation: ``python -m sglang_tpu_backend.generate --prompt "..."``.

Loads a checkpoint (the embedded tiny default when ``--model-path`` is not given), runs the
prompt through the model as one prefill and then decodes token by token, and prints the text.
It drives the model directly with one request; serving many requests is the engine's job.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.config import DTYPES
from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
from sglang_tpu_backend.models.qwen3_5_moe import forward_jit, init_cache

log = logging.getLogger("sglang_tpu_backend.generate")


def sample_next(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """Greedy when temperature == 0, else a draw from softmax(logits / temperature)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = (logits - logits.max()) / temperature
    p = np.exp(z)
    return int(rng.choice(len(p), p=p / p.sum()))


def generate(
    model_path: str | None,
    prompt: str,
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
    chat: bool = True,
    dtype: str = "bfloat16",
    page_size: int = 16,
    impl: str = "auto",
) -> tuple[str, list[int]]:
    """Generate a continuation of ``prompt``; returns (text, output token ids)."""
    from sglang_tpu_backend.model_loader.loader import load_model
    from sglang_tpu_backend.tokenizer import load_tokenizer

    if model_path is None:
        from sglang_tpu_backend.model_loader.tiny_model import default_model_path

        model_path = str(default_model_path())
    cfg, params = load_model(model_path, dtype=DTYPES[dtype])
    tokenizer = load_tokenizer(model_path)
    if chat and tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    else:
        ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("prompt: encodes to zero tokens")
    total = len(ids) + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(f"prompt + max_new_tokens = {total} exceeds the context "
                         f"length {cfg.max_position_embeddings}")
    pages = list(range(-(-total // page_size)))
    cache = init_cache(cfg, num_pages=len(pages), page_size=page_size, num_state_slots=1,
                       kv_dtype=DTYPES[dtype], state_dtype=jnp.float32)
    rng = np.random.default_rng(seed)
    eos = set(cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)

    out: list[int] = []
    chunk = SeqChunk(ids, 0, pages, 0)
    for _ in range(max_new_tokens):
        batch, _ = build_forward_batch([chunk], page_size=page_size, pages_per_seq=len(pages))
        logits, cache = forward_jit(params, cache, batch, cfg, impl=impl)
        tok = sample_next(np.asarray(logits[0], np.float32), temperature, rng)
        out.append(tok)
        if tok in eos:
            break
        chunk = SeqChunk([tok], chunk.context_len + len(chunk.token_ids), pages, 0)
    return tokenizer.decode(out, skip_special_tokens=True), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="checkpoint directory (default: embedded tiny model)")
    ap.add_argument("--prompt", default="Tell me about the sea.")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--kernel-impl", default="auto", choices=["auto", "pallas", "interpret", "xla", "reference"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    t0 = time.perf_counter()
    try:
        text, ids = generate(
            args.model_path, args.prompt, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, seed=args.seed, chat=not args.no_chat,
            dtype=args.dtype, impl=args.kernel_impl,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log.info("generated %d tokens in %.1fs on %s", len(ids), time.perf_counter() - t0, jax.default_backend())
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
