"""The reasoning and tool-call parsers (entrypoints/chat_parsing.py) on hand-written outputs:
final results, and the streaming rule that every partial parse is a prefix of the final one
whatever the split (tags cut anywhere)."""

from __future__ import annotations

import json

import pytest

from sglang_tpu_backend.entrypoints.chat_parsing import ChatParser, forced_call_schema, split_reasoning

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "units": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "noop"}},
]
CODER_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def assert_prefix_stable(parser: ChatParser, text: str):
    """Each prefix's non-final parse is a prefix of the final parse (what streaming relies on)."""
    final = parser.parse(text, final=True)
    memo: dict = {}  # as a stream keeps one: each parse resumes the searches of the last
    for i in range(len(text) + 1):
        part = parser.parse(text[:i], final=False, memo=memo)
        assert part == parser.parse(text[:i], final=False), i  # the memo changes nothing
        assert (final.reasoning or "").startswith(part.reasoning or ""), (i, part)
        assert final.content.startswith(part.content), (i, part)
        assert len(part.tool_calls) <= len(final.tool_calls), (i, part)
        for p, f in zip(part.tool_calls, final.tool_calls):
            assert p.name == f.name and f.arguments.startswith(p.arguments), (i, part)
    return final


def test_reasoning_opened_by_the_prompt():
    p = ChatParser("qwen3", in_reasoning=True)
    m = assert_prefix_stable(p, "\nThe user greets.\n</think>\n\nHello there!")
    assert (m.reasoning, m.content, m.tool_calls) == ("The user greets.", "Hello there!", [])
    # the output opening <think> again is not part of the reasoning
    assert assert_prefix_stable(p, "<think>\nidea</think>ok").reasoning == "idea"
    # not finished thinking (length): everything is reasoning
    assert p.parse("still thinking </thi", final=True).reasoning == "still thinking </thi"
    assert p.parse("still thinking </thi", final=False).reasoning == "still thinking"


def test_reasoning_opened_by_the_output_or_absent():
    p = ChatParser("qwen3")
    m = assert_prefix_stable(p, "<think>plan</think>answer")
    assert (m.reasoning, m.content) == ("plan", "answer")
    m = assert_prefix_stable(p, "plain answer, <think> later is content")
    assert (m.reasoning, m.content) == (None, "plain answer, <think> later is content")
    assert split_reasoning("<thi", False, final=False) == (None, "")  # may be a <think> tag
    assert split_reasoning("<thi", False, final=True) == (None, "<thi")


def test_qwen3_coder_call_after_reasoning_and_text():
    p = ChatParser("qwen3", "qwen3_coder", TOOLS, in_reasoning=True)
    m = assert_prefix_stable(p, "Need weather.</think>\n\nLet me check.\n" + CODER_CALL)
    assert m.reasoning == "Need weather." and m.content == "Let me check."
    assert len(m.tool_calls) == 1 and m.tool_calls[0].name == "get_weather"
    assert json.loads(m.tool_calls[0].arguments) == {"city": "New York", "days": 3}


def test_qwen3_coder_two_calls_typed_values_and_multiline_string():
    p = ChatParser(None, "qwen3_coder", TOOLS)
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\nline two\n</parameter>\n"
            "<parameter=units>\n{\"t\": \"C\"}\n</parameter>\n<parameter=extra>\n42\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=noop>\n</function>\n</tool_call>")
    m = assert_prefix_stable(p, text)
    assert [c.name for c in m.tool_calls] == ["get_weather", "noop"] and m.content == ""
    # string in the schema: verbatim; object: JSON; not in the schema: verbatim text
    assert json.loads(m.tool_calls[0].arguments) == {"city": "line one\nline two", "units": {"t": "C"},
                                                     "extra": "42"}
    assert m.tool_calls[1].arguments == "{}"


def test_qwen3_coder_partial_call_streams_finished_parameters_only():
    p = ChatParser(None, "qwen3_coder", TOOLS)
    part = p.parse(CODER_CALL[:CODER_CALL.index("<parameter=days>") + 12], final=False)
    assert part.tool_calls[0].arguments == '{"city": "New York"'
    assert not part.tool_calls[0].complete


def test_malformed_and_unknown_calls_stay_content():
    p = ChatParser(None, "qwen3_coder", TOOLS)
    bad = "Hi <tool_call>\nno function here\n</tool_call>"
    m = assert_prefix_stable(p, bad)
    assert m.content == bad and m.tool_calls == []
    unknown = "<tool_call>\n<function=launch>\n</function>\n</tool_call>"
    assert p.parse(unknown, final=True).content == unknown
    j = ChatParser(None, "qwen25", TOOLS)
    m = assert_prefix_stable(j, 'A <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
                                ' <tool_call>{not json}</tool_call>')
    assert [c.name for c in m.tool_calls] == ["get_weather"]
    assert m.content == "A  <tool_call>{not json}</tool_call>"


def test_qwen25_two_calls_and_text_before():
    p = ChatParser("qwen3", "qwen25", TOOLS, in_reasoning=True)
    text = ('hmm</think>Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
    m = assert_prefix_stable(p, text)
    assert (m.reasoning, m.content) == ("hmm", "Sure.")
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Rome", "days": 2}), ("noop", {})]
    # a call is only sent once whole
    assert p.parse(text[:text.index("</tool_call>")], final=False).tool_calls == []


@pytest.mark.parametrize("choice, text, want", [
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Oslo"}',
     [("get_weather", {"city": "Oslo"})]),
    ("required", '[{"name": "noop", "parameters": {}}, {"name": "get_weather", "parameters": {"days": 1}}]',
     [("noop", {}), ("get_weather", {"days": 1})]),
])
def test_forced_tool_choice(choice, text, want):
    forced, schema = forced_call_schema(choice, TOOLS)
    assert schema["type"] in ("object", "array")
    p = ChatParser(tools=TOOLS, forced=forced)
    assert p.parse(text[:5], final=False).tool_calls == []
    m = p.parse(text, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == want and m.content == ""
