"""Regex / JSON-schema constrained decoding through llguidance on the tiny model."""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pytest

from sglang_tpu_backend.constrained.grammar import GrammarBackend
from sglang_tpu_backend.managers.io_struct import GenerateReqInput, InvalidRequestError


def collect(engine, obj):
    async def go():
        return [o async for o in engine.generate_request(obj)]
    return asyncio.run(go())


@pytest.fixture(scope="module")
def backend():
    from sglang_tpu_backend.model_loader.tiny_model import ASSET_DIR
    from sglang_tpu_backend.tokenizer import load_tokenizer

    tok = load_tokenizer(ASSET_DIR)
    return tok, GrammarBackend(tok, 1024, [2])


def allowed(grammar, vocab=1024):
    words = np.zeros(grammar.num_words, np.int32)
    grammar.fill_bitmask(words)
    bits = (words.view(np.uint32)[np.arange(vocab) // 32] >> (np.arange(vocab) % 32)) & 1
    return np.nonzero(bits)[0].tolist()


def test_regex_mask_allows_exactly_matching_tokens(backend):
    tok, gb = backend
    g = gb.compile(regex=r"[0-9]+")
    ids = allowed(g)
    assert ids, "some digit token must be allowed"
    for t in ids:
        assert re.fullmatch(r"[0-9]+", tok.decode([t])), repr(tok.decode([t]))
    digit_tokens = [t for t in range(1024) if re.fullmatch(r"[0-9]+", tok.decode([t]) or "x")]
    assert set(digit_tokens) <= set(ids)
    g.accept(ids[0])
    assert 2 in allowed(g)  # after one digit the match may end: EOS allowed


@pytest.mark.parametrize("kwargs,field", [
    (dict(regex="(ab"), "sampling_params.regex"),
    (dict(json_schema='{"type": "nope"}'), "sampling_params.json_schema"),
    (dict(json_schema="[1, 2"), "sampling_params.json_schema"),
])
def test_invalid_grammar_names_field(backend, kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        backend[1].compile(**kwargs)
    assert e.value.field == field


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_output_matches(clean_engine, temperature):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    obj = GenerateReqInput(text="Code:", sampling_params={
        "max_new_tokens": 40, "regex": pattern, "temperature": temperature, "seed": 7})
    out = collect(clean_engine, obj)[-1]
    assert re.fullmatch(pattern, out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_parses_and_validates(clean_engine, temperature):
    obj = GenerateReqInput(text="Person:", sampling_params={
        "max_new_tokens": 80, "json_schema": json.dumps(SCHEMA), "temperature": temperature, "seed": 3})
    out = collect(clean_engine, obj)[-1]
    value = json.loads(out["text"])
    assert set(value) == {"name", "age", "ok"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
    assert isinstance(value["ok"], bool)


def test_a_grammar_request_alone_never_sleeps_the_loop(clean_engine, monkeypatch):
    """A constrained request's next step needs its previous step's token (the grammar's next
    mask), so while that step is in flight nothing can launch. The loop must then complete the
    step and launch again, not sleep: it slept ``MAX_IDLE_WAIT_S`` (1 s) per token."""
    loop = clean_engine.loop
    sleeps = []
    wait = loop._wait_for_room
    monkeypatch.setattr(loop, "_wait_for_room", lambda: (sleeps.append(1), wait())[1])
    obj = GenerateReqInput(text="Person:", sampling_params={
        "max_new_tokens": 40, "json_schema": json.dumps(SCHEMA), "temperature": 0})
    out = collect(clean_engine, obj)[-1]
    assert len(out["output_ids"]) > 10 and out["meta_info"]["finish_reason"]["type"] == "stop"
    assert sleeps == []


def test_marker_tokens_are_text_to_the_grammar(backend):
    """Qwen's non-special added tokens (``</think>``, ``<tool_call>``) are text to llguidance: a
    grammar needing that text accepts it, sampled as the marker token or spelled out."""
    tok, gb = backend
    marker = tok.convert_tokens_to_ids("</think>")
    g = gb.compile(regex=r"x\.\n</think>\nok")
    for t in tok.encode("x.\n"):
        g.accept(t)
    assert tok.encode("<")[0] in allowed(g)  # the text may be spelled out
    g.accept(marker)
    assert not g.matcher.is_error() and not g.is_terminated()
    for t in tok.encode("\nok"):
        g.accept(t)
    assert g.matcher.is_accepting()


def test_regex_output_may_hold_marker_text(clean_engine):
    """A forced output with Qwen3.5's reasoning and tool-call markers completes (the chat
    parsers' input on the real engine)."""
    text = "Plan.\n</think>\n\nOK.\n<tool_call>\n<function=f>\n</function>\n</tool_call>"
    obj = GenerateReqInput(text="<|im_start|>assistant\n<think>\n", sampling_params={
        "max_new_tokens": 60, "regex": re.escape(text), "temperature": 0})
    out = collect(clean_engine, obj)[-1]
    assert out["text"] == text and out["meta_info"]["finish_reason"]["type"] == "stop"
