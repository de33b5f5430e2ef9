"""The ``openai`` client against a live server: /v1/models, completions, chat completions,
streaming, usage counts, n, stop, logprobs, response_format, and OpenAI-style errors."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from sglang_tpu_backend.tokenizer import load_tokenizer

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(live_server):
    info = requests.get(live_server.url + "/get_model_info", timeout=30).json()
    return load_tokenizer(info["tokenizer_path"] or info["model_path"])


@pytest.fixture(scope="module")
def model(client):
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def templated_ids(tok, messages):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def test_models(client, model, live_server):
    info = requests.get(live_server.url + "/get_model_info", timeout=30).json()
    assert model in (info["model_path"], info.get("served_model_name"))


def test_completion_usage(client, model, tok):
    prompt = "Once upon a time"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode(prompt))
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert isinstance(r.choices[0].text, str)


def test_completion_matches_native_generate(client, model, live_server):
    prompt = "Compare me"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    native = requests.post(live_server.url + "/generate", timeout=120, json={
        "text": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).json()
    assert r.choices[0].text == native["text"]


def test_completion_token_prompt_n_and_logprobs(client, model):
    r = client.completions.create(model=model, prompt=[[5, 6, 7, 8]], max_tokens=4, n=2, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 8
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)


def test_chat_usage_counts_templated_prompt(client, model, tok):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert r.usage.prompt_tokens == len(templated_ids(tok, MESSAGES))
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_chat_completion_tokens_equal_generated_ids(client, model, live_server, tok):
    """completion_tokens is the number of generated ids (the native route exposes them)."""
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
    native = requests.post(live_server.url + "/generate", timeout=120, json={
        "input_ids": templated_ids(tok, MESSAGES), "sampling_params": {"max_new_tokens": 12, "temperature": 0}}).json()
    assert r.usage.completion_tokens == len(native["output_ids"]) == native["meta_info"]["completion_tokens"]
    assert r.choices[0].message.content == native["text"]


def test_chat_stream(client, model, tok):
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in content].count("length") == 1
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == len(templated_ids(tok, MESSAGES))
    text = "".join(c.choices[0].delta.content or "" for c in content)
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert text == full.choices[0].message.content


def test_completion_stream(client, model):
    stream = client.completions.create(model=model, prompt="Count:", max_tokens=5, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in chunks)
    full = client.completions.create(model=model, prompt="Count:", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert text == full.choices[0].text


def test_stop_string(client, model):
    base = client.completions.create(model=model, prompt="Stops", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    if len(base) < 4:
        pytest.skip("greedy output too short to pick a stop string from")
    stop = base[2:4]
    r = client.completions.create(model=model, prompt="Stops", max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[:base.index(stop)]


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)  # greedy = top-1


def test_response_format_json_schema(client, model):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "give json"}], max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    if r.choices[0].finish_reason == "length":
        pytest.skip("untrained model ran out of tokens inside the JSON value")
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"n"} and isinstance(obj["n"], int)


def test_openai_errors(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=5, temperature=-1)
    assert e.value.body["param"] == "temperature" or "temperature" in json.dumps(e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "x"}])
    assert "messages[0].role" in json.dumps(e.value.body)


def _native(live_server, body: dict) -> dict:
    r = requests.post(live_server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_matched_stop_for_stop_strings_and_token_ids(client, model, live_server):
    prompt, sp = "Stop here", {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    base = _native(live_server, {"text": prompt, "sampling_params": sp})
    ids = base["output_ids"]
    stop_id = ids[3]
    r = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["matched_stop"] == stop_id
    native = _native(live_server, {"text": prompt, "sampling_params": {**sp, "stop_token_ids": [stop_id]}})
    assert native["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    chat_text = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].message.content
    stop = next((chat_text[i:i + 2] for i in range(1, len(chat_text) - 1) if chat_text[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip("greedy output has no printable pair to stop on")
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0, stop=[stop],
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["matched_stop"] == stop
    assert r.choices[0].message.content == chat_text[:chat_text.index(stop)]
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0,
                                            stop=[stop], stream=True, extra_body={"ignore_eos": True})
    last = [c for c in stream if c.choices and c.choices[0].finish_reason][-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["matched_stop"] == stop


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_include_the_prompt_like_native_return_logprob(client, model, live_server, stream):
    prompt = "Echo the prompt back"
    native = _native(live_server, {
        "text": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True})
    meta = native["meta_info"]
    entries = meta["input_token_logprobs"] + meta["output_token_logprobs"]
    r = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2,
                                  stream=stream, extra_body={"ignore_eos": True})
    if stream:
        chunks = [c.choices[0] for c in r if c.choices]
        text = "".join(c.text for c in chunks)
        tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        lps = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
        tops = [t for c in chunks if c.logprobs for t in c.logprobs.top_logprobs]
        offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    else:
        lp = r.choices[0].logprobs
        text, tokens, lps, tops, offsets = r.choices[0].text, lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    P = meta["prompt_tokens"]
    assert text == prompt + native["text"]
    assert tokens == [e[2] for e in entries] and len(tokens) == P + 3
    assert lps[0] is None and tops[0] is None  # the first prompt token has no logprob
    assert lps[1:] == pytest.approx([e[0] for e in entries[1:]], abs=1e-4)
    assert [len(t) for t in tops[1:]] == [2] * (P + 2)
    assert offsets[:P] == [sum(len(t) for t in tokens[:i]) for i in range(P)]
    assert offsets[P] == len(prompt)


def test_logit_bias_over_http(client, model, live_server):
    prompt = "Bias me"
    target = 200
    native = _native(live_server, {"text": prompt, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "logit_bias": {str(target): 100}}})
    assert native["output_ids"] == [target] * 4
    r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                  logit_bias={str(target): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == native["text"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=prompt, max_tokens=2, logit_bias={"5": -100.5})
    assert e.value.body["param"] == "logit_bias"


def test_chat_template_kwargs_reach_the_template(client, model, tok):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<think>\n\n</think>\n\n")
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    assert r.usage.prompt_tokens > len(templated_ids(tok, MESSAGES))


def test_named_tool_choice_on_the_real_engine(client, model):
    """The named function's parameters schema constrains the real model's output; the answer
    is a tool call (no --tool-call-parser needed)."""
    tools = [{"type": "function", "function": {"name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["unit"], "additionalProperties": False}}}]
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=tools, max_tokens=48, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "set_unit"}})
    if r.choices[0].finish_reason == "length":
        pytest.skip("untrained model ran out of tokens inside the JSON")
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "set_unit"
    assert json.loads(call.function.arguments) in ({"unit": "c"}, {"unit": "f"})
