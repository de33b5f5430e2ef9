"""Chat features through the real HTTP layer, read back with the ``openai`` client:
reasoning_content, tool_calls (non-streamed, and streamed deltas reassembled), tool_choice,
chat_template_kwargs, separate_reasoning, and the 400s naming the field.

The engine is a SCRIPTED test double: it answers every request with a fixed text, streamed
in pieces of a few characters (so tags are cut across chunks), and records the prompt it
got. The real engine's side (stop strings, logit_bias, echo logprobs) is in test_openai.py.
"""

from __future__ import annotations

import json

import openai
import pytest
from starlette.testclient import TestClient

from sglang_tpu_backend.entrypoints.http_server import create_app
from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.sampling.sampling_params import SamplingParams
from sglang_tpu_backend.server_args import ServerArgs
from tests.server.fake_engine import FakeEngine

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CODER_SCRIPT = ("The user wants the weather.\n</think>\n\nI will look it up.\n<tool_call>\n"
                "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                "</parameter>\n</function>\n</tool_call>")


class ScriptedEngine(FakeEngine):
    """TEST DOUBLE: every request "generates" ``script``, streamed ``piece`` characters at a
    time, finishing with EOS (``matched`` 2); ``prompts`` records each request's prompt text."""

    script = ""
    piece = 3

    async def generate_request(self, req: GenerateReqInput):
        SamplingParams.from_dict(req.sampling_params).validate(self.model_config.vocab_size)
        ids = self._prompt_ids(req)
        self.requests_seen.append(req)
        text, cuts = self.script, list(range(self.piece, len(self.script), self.piece)) + [len(self.script)]
        for k, end in enumerate(cuts):
            meta = {"id": req.rid, "prompt_tokens": len(ids), "completion_tokens": k + 1, "cached_tokens": 0}
            if end == len(text):
                meta["finish_reason"] = {"type": "stop", "matched": 2}
            if req.stream or end == len(text):
                yield {"text": text[:end], "output_ids": [], "meta_info": meta}

    def last_prompt(self) -> str:
        return self.tokenizer.decode(self.requests_seen[-1].input_ids)


def make_client(**args) -> tuple[openai.OpenAI, ScriptedEngine]:
    engine = ScriptedEngine(ServerArgs(context_length=1024, **args))
    http = TestClient(create_app(engine), base_url="http://testserver")
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0), engine


@pytest.fixture(scope="module")
def coder():
    return make_client(reasoning_parser="qwen3", tool_call_parser="qwen3_coder")


def reassemble(stream) -> dict:
    """Streamed chat deltas -> {reasoning, content, tool_calls, finish_reason}; checks each
    call's id and name come once, in its first delta."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "matched": None}
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            out["reasoning"] += getattr(d, "reasoning_content", None) or ""
            out["content"] += d.content or ""
            for tc in d.tool_calls or []:
                if tc.index not in out["calls"]:
                    assert tc.id and tc.function.name, tc
                    out["calls"][tc.index] = {"id": tc.id, "name": tc.function.name,
                                              "arguments": tc.function.arguments or ""}
                else:
                    assert tc.id is None and not tc.function.name, tc
                    out["calls"][tc.index]["arguments"] += tc.function.arguments or ""
            if ch.finish_reason is not None:
                out["finish"] = ch.finish_reason
                out["matched"] = (ch.model_extra or {}).get("matched_stop")
    return out


@pytest.mark.parametrize("piece", [1, 4, 9])
def test_reasoning_and_qwen3_coder_tool_call(coder, piece):
    client, engine = coder
    engine.script, engine.piece = CODER_SCRIPT, piece
    r = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS)
    choice = r.choices[0]
    msg = choice.message
    assert msg.reasoning_content == "The user wants the weather."
    assert msg.content == "I will look it up."
    assert choice.finish_reason == "tool_calls"
    assert len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert (choice.model_extra or {}).get("matched_stop") == 2
    # the prompt opened <think> (Qwen3.5's default), and the tools were rendered into it
    prompt = engine.last_prompt()
    assert prompt.endswith("<|im_start|>assistant\n<think>\n") and '"name": "get_weather"' in prompt

    s = reassemble(client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, stream=True))
    assert s["reasoning"] == msg.reasoning_content and s["content"] == msg.content
    assert [(c["name"], c["arguments"]) for c in s["calls"].values()] == [
        (call.function.name, call.function.arguments)]
    assert s["finish"] == "tool_calls" and s["matched"] == 2


def test_qwen25_two_calls_streamed_and_not():
    client, engine = make_client(tool_call_parser="qwen25")
    engine.script = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>')
    msg = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}}
                                         ).choices[0].message
    assert msg.content == "Sure." and getattr(msg, "reasoning_content", None) is None
    args = [json.loads(c.function.arguments) for c in msg.tool_calls]
    assert args == [{"city": "Rome"}, {"city": "Oslo", "days": 2}]
    assert len({c.id for c in msg.tool_calls}) == 2
    s = reassemble(client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, stream=True))
    assert [json.loads(c["arguments"]) for c in s["calls"].values()] == args and s["content"] == "Sure."


def test_enable_thinking_false_changes_the_prompt_and_the_split(coder):
    client, engine = coder
    engine.script = "Just the answer."
    r = client.chat.completions.create(model="m", messages=MESSAGES)
    assert engine.last_prompt().endswith("assistant\n<think>\n")
    assert r.choices[0].message.reasoning_content == "Just the answer."  # output starts in thinking
    r = client.chat.completions.create(model="m", messages=MESSAGES,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert engine.last_prompt().endswith("assistant\n<think>\n\n</think>\n\n")
    assert engine.last_prompt().count("<think>") == 1
    assert r.choices[0].message.content == "Just the answer."
    assert r.choices[0].message.reasoning_content is None
    assert r.choices[0].finish_reason == "stop"


def test_separate_reasoning_false_and_tool_choice_none(coder):
    client, engine = coder
    engine.script = CODER_SCRIPT
    r = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                       extra_body={"separate_reasoning": False})
    msg = r.choices[0].message
    assert msg.content == CODER_SCRIPT and not msg.tool_calls and r.choices[0].finish_reason == "stop"
    assert getattr(msg, "reasoning_content", None) is None
    assert "# Tools" not in engine.last_prompt()  # tool_choice none: tools not rendered


def test_named_and_required_tool_choice_constrain_the_output(coder):
    client, engine = coder
    engine.script = '{"city": "Oslo"}'
    r = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(engine.requests_seen[-1].sampling_params["json_schema"]) == TOOLS[0]["function"]["parameters"]
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    engine.script = '[{"name": "get_weather", "parameters": {"city": "Lima"}}]'
    s = reassemble(client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                                  tool_choice="required", stream=True))
    assert json.loads(engine.requests_seen[-1].sampling_params["json_schema"])["type"] == "array"
    assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"].values()] == [("get_weather", {"city": "Lima"})]
    assert s["finish"] == "tool_calls"


def test_assistant_tool_calls_and_tool_results_render(coder):
    client, engine = coder
    engine.script = "It is sunny."
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    client.chat.completions.create(model="m", messages=history, tools=TOOLS)
    prompt = engine.last_prompt()
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>" in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>" in prompt


@pytest.mark.parametrize("extra, param", [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": TOOLS + TOOLS}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "yes"}, "chat_template_kwargs"),
    ({"logit_bias": {"5": 150}}, "logit_bias"),
    ({"logit_bias": {"123456": 1}}, "logit_bias"),
    ({"separate_reasoning": "no"}, "separate_reasoning"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_chat_fields_are_400_naming_the_field(coder, extra, param):
    client, engine = coder
    body = {"model": "m", "messages": MESSAGES, **extra}
    r = client._client.post("http://testserver/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
