"""The embedded default model: shipped tokenizer/config, generated weights, cache reuse."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_backend.assets.build_tiny_tokenizer import build_tokenizer
from sglang_tpu_backend.config import load_model_config
from sglang_tpu_backend.model_loader import tiny_model
from sglang_tpu_backend.model_loader.loader import load_model
from sglang_tpu_backend.model_loader.tiny_model import (
    ASSET_DIR, default_model_path, tiny_config_dict)
from sglang_tpu_backend.models.qwen3_5_moe import layer_params
from sglang_tpu_backend.tokenizer import ids_decoder, load_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return default_model_path(tmp_path_factory.mktemp("cache"))


def test_generation_is_deterministic(model_dir, tmp_path):
    again = default_model_path(tmp_path)
    assert again != model_dir and again.name == model_dir.name
    assert (again / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (ASSET_DIR / name).read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    # Our writer's files read back identically through the safetensors library itself.
    from safetensors.numpy import load_file

    from sglang_tpu_backend.model_loader.checkpoint_io import read_checkpoint

    ours, theirs = read_checkpoint(model_dir), load_file(model_dir / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():
        assert t.dtype == theirs[name].dtype and np.array_equal(t.view(np.uint8), theirs[name].view(np.uint8))


def test_second_call_reuses_the_cache(model_dir, monkeypatch):
    stat = (model_dir / "model.safetensors").stat()

    def fail(*args, **kwargs):
        raise AssertionError("weights regenerated")

    monkeypatch.setattr(tiny_model, "random_checkpoint_tensors", fail)
    assert default_model_path(model_dir.parent) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stat.st_mtime_ns


def test_cache_dir_from_environment(model_dir, monkeypatch):
    monkeypatch.setenv("STB_CACHE_DIR", str(model_dir.parent))
    monkeypatch.setattr(tiny_model, "random_checkpoint_tensors", None)  # must not be needed
    assert default_model_path() == model_dir


def test_loads_through_load_model(model_dir):
    cfg, params = load_model(model_dir)
    tok = load_tokenizer(model_dir)
    assert cfg.model_type == "qwen3_5_moe" and cfg.num_hidden_layers == 8
    assert cfg.layer_types.count("full_attention") == 2 and cfg.layer_types[3] == "full_attention"
    assert cfg.vocab_size % 64 == 0 and len(tok) <= cfg.vocab_size < len(tok) + 64
    assert cfg.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)
    assert (cfg.hidden_size, cfg.head_dim, cfg.rotary_dim, cfg.rope_theta) == (128, 64, 16, 1e7)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (16, 4, 64)
    assert params["embed_tokens"].shape == (cfg.vocab_size, 128) and params["embed_tokens"].dtype == jnp.bfloat16
    assert layer_params(params, cfg, 0)["mlp"]["experts"]["gate_up"].shape == (16, 128, 128)
    gdn = layer_params(params, cfg, 0)["linear_attn"]
    a = np.exp(np.asarray(gdn["A_log"]))
    dt = np.log1p(np.exp(np.asarray(gdn["dt_bias"])))
    assert gdn["A_log"].dtype == jnp.float32 and np.all((a >= 1) & (a < 16))
    assert np.all((dt >= 1e-3) & (dt < 0.1))
    assert np.all(np.abs(np.asarray(params["norm"], np.float32)) < 0.5)  # zero-centred (1 + w)
    q = np.asarray(layer_params(params, cfg, 3)["self_attn"]["q_proj"], np.float32)
    assert 0.015 < q.std() < 0.025
    # Different tensors draw different values.
    assert not np.array_equal(np.asarray(layer_params(params, cfg, 0)["input_layernorm"]),
                              np.asarray(layer_params(params, cfg, 1)["input_layernorm"]))


def test_tokenizer_round_trips_text():
    tok = load_tokenizer(ASSET_DIR)
    for text in ["The quick brown fox jumps over the lazy dog.", "Numbers: 3.14, 42 and -7!",
                 "Ünïcödé café, naïve 東京 🙂", "  leading spaces\nand\ttabs  "]:
        ids = tok.encode(text)
        assert all(0 <= i < len(tok) for i in ids)
        assert tok.decode(ids) == text
    # Trained merges: common corpus words are single tokens.
    assert len(tok.encode(" the")) == 1 and len(tok.encode(" people")) == 1
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.encode("<|im_start|>user")[0] == im_start


def test_ids_decoder_equals_decode():
    """The detokeniser's fast decode gives what ``tok.decode`` gives, special tokens kept or
    skipped, partial UTF-8 included; with clean-up of tokenization spaces on it is tok.decode."""
    tok = load_tokenizer(ASSET_DIR)
    ids = tok.encode("<|im_start|>user\nÜnïcödé 東京 🙂 , ok .<|im_end|>")
    decode = ids_decoder(tok)
    for cut in range(len(ids) + 1):  # every prefix, so some end inside a multi-byte character
        for skip in (False, True):
            assert decode(ids[:cut], skip) == tok.decode(ids[:cut], skip_special_tokens=skip)
    assert "<|im_start|>" in decode(ids, False) and "<|im_start|>" not in decode(ids, True)
    tok.clean_up_tokenization_spaces = True
    calls = []
    tok.decode = lambda i, skip_special_tokens=False: calls.append(i) or "wrapped"
    assert ids_decoder(tok)(ids, False) == "wrapped" and calls == [ids]


def test_chat_template_renders_qwen35_chatml():
    tok = load_tokenizer(ASSET_DIR)
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                    "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye.<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n")  # Qwen3.5: the generation prompt opens <think>
    off = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off == text + "\n</think>\n\n"
    no_prompt = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nHi!<|im_end|>\n"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nab<|im_end|>\n"


def test_shipped_assets_match_their_generators():
    assert (ASSET_DIR / "tokenizer.json").read_text() == build_tokenizer().to_str()
    tok = load_tokenizer(ASSET_DIR)
    vocab = -(-len(tok) // 64) * 64
    want = tiny_config_dict(vocab, tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"))
    assert json.loads((ASSET_DIR / "config.json").read_text()) == want
    assert want["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert sum(p.stat().st_size for p in ASSET_DIR.parent.rglob("*") if p.is_file()) < 1_000_000
    assert 900 <= len(tok) <= 2048


def test_padding_ids_have_zero_embeddings_and_logit_rows(model_dir):
    cfg, params = load_model(model_dir, dtype=jnp.float32)
    n = len(load_tokenizer(model_dir))
    assert n < cfg.vocab_size
    embed, lm_head = np.asarray(params["embed_tokens"]), np.asarray(params["lm_head"])
    assert not embed[n:].any() and not lm_head[n:].any()
    assert np.all(np.abs(embed[:n]).max(axis=1) > 0) and np.all(np.abs(lm_head[:n]).max(axis=1) > 0)


def test_generated_checkpoint_fits_transformers_model_exactly(model_dir):
    """Every generated tensor but the MTP layer's has the name and shape of transformers' own
    (fused) state dict; transformers' loader ignores the ``mtp.*`` tensors."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from sglang_tpu_backend.model_loader.checkpoint_io import read_checkpoint

    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{k: v for k, v in text.items() if k != "model_type"}))
    tensors = read_checkpoint(model_dir)
    state = {name.replace("model.language_model.", "model."): torch.from_numpy(t.astype(np.float32))
             for name, t in tensors.items() if not name.startswith("mtp.")}
    assert len(state) < len(tensors)  # the MTP layer is there too
    model.load_state_dict(state, strict=True)  # raises on any missing/unexpected/mis-shaped tensor
    _, info = Qwen3_5MoeForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not any(info.values())  # nothing missing, unexpected (mtp.* ignored) or mis-shaped


def test_default_model_has_one_mtp_layer(model_dir):
    """The MTP params load beside the main ones (the embedding and head are shared)."""
    from sglang_tpu_backend.model_loader.loader import load_mtp_params
    from sglang_tpu_backend.models.param_shapes import mtp_param_shapes

    cfg = load_model_config(model_dir)
    assert cfg.mtp_num_hidden_layers == 1
    mtp = load_mtp_params(model_dir, cfg)
    want = mtp_param_shapes(cfg, jnp.bfloat16)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(mtp)] == \
        [(x.shape, x.dtype) for x in jax.tree.leaves(want)]
    fc = np.asarray(mtp["fc"], np.float32)
    assert fc.shape == (2 * cfg.hidden_size, cfg.hidden_size) and 0.015 < fc.std() < 0.025
