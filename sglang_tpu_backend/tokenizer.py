"""Tokenizer from a checkpoint directory's local files; never touches the network.

Needs ``tokenizer.json``; reads special tokens and the chat template from
``tokenizer_config.json`` (``chat_template``) or ``chat_template.jinja``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from sglang_tpu_backend.model_loader.checkpoint_io import CheckpointError

# tokenizer_config.json keys passed through to the tokenizer's constructor.
_PASSTHROUGH = (
    "bos_token", "eos_token", "pad_token", "unk_token", "additional_special_tokens",
    "extra_special_tokens", "model_max_length", "clean_up_tokenization_spaces", "padding_side",
    "truncation_side", "split_special_tokens", "add_bos_token", "add_eos_token",
)


def _token_text(value: Any) -> Any:
    """``{"content": "<|im_end|>", ...}`` (AddedToken dict) -> ``"<|im_end|>"``."""
    if isinstance(value, dict) and "content" in value:
        return value["content"]
    if isinstance(value, list):
        return [_token_text(v) for v in value]
    return value


def load_tokenizer(path: str | Path):
    """A ``PreTrainedTokenizerFast`` built from ``path``'s files only.

    Raises:
      CheckpointError: ``path`` lacks tokenizer.json, or a file there is unreadable.
    """
    from transformers import PreTrainedTokenizerFast

    d = Path(path)
    tok_file = d / "tokenizer.json"
    if not tok_file.is_file():
        raise CheckpointError(f"tokenizer directory {d} lacks tokenizer.json (only fast tokenizers are supported)")
    config: dict[str, Any] = {}
    cfg_file = d / "tokenizer_config.json"
    if cfg_file.is_file():
        try:
            config = json.loads(cfg_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_file}: invalid JSON ({e})") from None
    kwargs = {k: _token_text(config[k]) for k in _PASSTHROUGH if k in config and config[k] is not None}
    template = config.get("chat_template")
    jinja = d / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    try:
        tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_file), **kwargs)
    except Exception as e:  # tokenizers raises bare Exception subclasses on corrupt files
        raise CheckpointError(f"{tok_file}: cannot build tokenizer ({type(e).__name__}: {e})") from None
    if template is not None:
        tok.chat_template = template
    tok.name_or_path = str(d)
    return tok


def ids_decoder(tok) -> Callable[[list[int], bool], str]:
    """``decode(ids, skip_special_tokens)`` equal to ``tok.decode``, minus transformers' per-call
    wrapper where it adds nothing (no clean-up of tokenization spaces): the detokeniser calls it
    twice per request per step, and the wrapper costs ~5x the Rust decode it wraps."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or getattr(tok, "clean_up_tokenization_spaces", False):
        return lambda ids, skip: tok.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
