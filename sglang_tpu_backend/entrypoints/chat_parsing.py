"""Chat output parsing: ``<think>`` reasoning (``--reasoning-parser``) and tool calls
(``--tool-call-parser``) split out of the generated text.

Every parser here is a pure function of the cumulative text and ``final`` (the request has
finished). A non-final parse keeps back what later text may still change (a partial tag,
trailing whitespace, an unfinished tool call), so each non-final result is a prefix of every
later one: streaming sends the growth between two parses, and the reassembled stream equals
the non-streamed message by construction.

Formats (SGLang's parser names):

* ``qwen3`` reasoning: ``<think>reasoning</think>content``. When the prompt already opened
  ``<think>`` (Qwen3.5's template does unless ``enable_thinking`` is false), the output starts
  inside the reasoning. Reasoning is stripped of surrounding whitespace, content of leading.
* ``qwen3_coder`` tool calls (Qwen3.5, Qwen3-Coder)::

      <tool_call>
      <function=NAME>
      <parameter=ARG>
      VALUE
      </parameter>
      </function>
      </tool_call>

  VALUE is taken verbatim when the tool's schema says ``string`` (or names no such
  parameter), else as JSON when it parses. Arguments stream one finished parameter at a time.
* ``qwen25`` tool calls (Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  each call sent whole once its closing tag arrives.

A block that does not parse (no function, bad JSON, a function not in ``tools``) stays in the
content verbatim. Content outside tool calls is stripped of surrounding whitespace.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: ``arguments`` is JSON text (a prefix of it while ``complete`` is False)."""

    name: str
    arguments: str
    complete: bool


@dataclasses.dataclass(frozen=True)
class ParsedMessage:
    reasoning: str | None  # None: no reasoning parser, or no reasoning in the output
    content: str
    tool_calls: list[ToolCall]


def _held_tag_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def split_reasoning(text: str, in_reasoning: bool, final: bool, memo: dict | None = None
                    ) -> tuple[str | None, str]:
    """``(reasoning, content)`` of ``text``; ``in_reasoning``: the prompt opened ``<think>``.
    ``memo`` (streaming, one per choice, the text only growing): where to resume looking for
    ``</think>``, so a long reasoning is not searched again at every chunk."""
    head = text.lstrip()
    if head.startswith(THINK_START):  # opened by the output (again, when the prompt did)
        text, in_reasoning = head[len(THINK_START):], True
    elif not final and THINK_START.startswith(head):  # nothing yet, or the start of a <think> tag
        return ("" if in_reasoning else None), ""
    elif not in_reasoning:
        return None, text
    start = memo.get("think_end_from", 0) if memo is not None else 0
    end = text.find(THINK_END, start)
    if end < 0 and memo is not None:
        memo["think_end_from"] = max(start, len(text) - len(THINK_END) + 1)
    if end < 0:
        held = 0 if final else _held_tag_prefix(text, THINK_END)
        return text[:len(text) - held].strip(), ""  # trailing whitespace held back too
    return text[:end].strip(), text[end + len(THINK_END):].lstrip()


def _param_value(raw: str, schema_type: Any) -> Any:
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    if schema_type in (None, "string") or (isinstance(schema_type, list) and "string" in schema_type):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _args_text(params: list[tuple[str, Any]], closed: bool) -> str:
    """JSON object text of ``params`` (``json.dumps`` layout); open until ``closed``."""
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                     for k, v in params)
    return "{" + body + ("}" if closed else "")


def _parse_coder_block(block: str, tools: dict[str, dict], closed: bool) -> ToolCall | None:
    """A ``qwen3_coder`` block (between the tags); ``closed``: its end tag (or the end of the
    output) came. None when it names no known function (yet)."""
    m = _FUNCTION.search(block)
    if m is None or m.group(1).strip() not in tools:
        return None
    name = m.group(1).strip()
    props = (tools[name].get("parameters") or {}).get("properties") or {}
    params = [(p.group(1).strip(), _param_value(p.group(2), (props.get(p.group(1).strip()) or {}).get("type")))
              for p in _PARAMETER.finditer(m.group(2))]
    done = closed or block[m.end(2):].startswith("</function>")
    return ToolCall(name, _args_text(params, done), done)


def _parse_json_block(block: str, tools: dict[str, dict]) -> ToolCall | None:
    """A complete ``qwen25`` block; None when it is not a call of a known function."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in tools:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), True)


def parse_tool_calls(text: str, parser: str, tools: dict[str, dict], final: bool,
                     memo: dict | None = None) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` of ``text``; ``tools`` maps function name -> its OpenAI function
    object. Content is stripped (non-final: trailing whitespace and a partial ``<tool_call>``
    held back); the last call may be incomplete while not ``final`` (qwen3_coder). ``memo``:
    as for :func:`split_reasoning`, where to resume looking for the first ``<tool_call>``."""
    content, calls, pos = [], [], 0
    first_from = memo.get("call_from", 0) if memo is not None else 0
    while True:
        start = text.find(CALL_START, first_from if pos == 0 else pos)
        if start < 0 and pos == 0 and memo is not None:
            memo["call_from"] = max(first_from, len(text) - len(CALL_START) + 1)
        if start < 0:
            tail = text[pos:]
            content.append(tail if final else tail[:len(tail) - _held_tag_prefix(tail, CALL_START)])
            break
        content.append(text[pos:start])
        body_at = start + len(CALL_START)
        end = text.find(CALL_END, body_at)
        closed = end >= 0 or final
        block = text[body_at:end if end >= 0 else len(text)]
        if parser == "qwen3_coder":
            call = _parse_coder_block(block, tools, closed)
        else:
            call = _parse_json_block(block.strip(), tools) if closed else None
        if call is not None:
            calls.append(call)
        elif closed:
            content.append(text[start:end + len(CALL_END) if end >= 0 else len(text)])
        if end < 0:
            break
        pos = end + len(CALL_END)
    joined = "".join(content)
    return (joined.strip() if final else joined.lstrip().rstrip()), calls


class ChatParser:
    """Parses one choice's cumulative output text into a :class:`ParsedMessage`.

    ``forced``: the output is constrained to a tool call of ``tool_choice`` (a named function:
    its arguments object; ``required``: a JSON array of ``{"name", "parameters"}``), parsed
    only once final.
    """

    def __init__(self, reasoning_parser: str | None = None, tool_parser: str | None = None,
                 tools: list[dict] | None = None, in_reasoning: bool = False,
                 forced: str | None = None):
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.tools = {t["function"]["name"]: t["function"] for t in tools or []}
        self.in_reasoning = in_reasoning
        self.forced = forced  # None | "required" | a function name

    def parse(self, text: str, final: bool, memo: dict | None = None) -> ParsedMessage:
        """``memo``: a dict kept per streamed choice while its text grows (ignored when final:
        the final text is parsed afresh)."""
        if self.forced is not None:
            return self._parse_forced(text, final)
        memo = None if final else memo
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning, text = split_reasoning(text, self.in_reasoning, final, memo)
        calls: list[ToolCall] = []
        if self.tool_parser is not None and self.tools:
            text, calls = parse_tool_calls(text, self.tool_parser, self.tools, final, memo)
        return ParsedMessage(reasoning, text, calls)

    def _parse_forced(self, text: str, final: bool) -> ParsedMessage:
        if not final:
            return ParsedMessage(None, "", [])
        try:
            obj = json.loads(text)
        except ValueError:
            return ParsedMessage(None, text, [])
        if self.forced != "required":
            return ParsedMessage(None, "", [ToolCall(self.forced, json.dumps(obj, ensure_ascii=False), True)])
        if not isinstance(obj, list) or not all(isinstance(c, dict) and c.get("name") in self.tools for c in obj):
            return ParsedMessage(None, text, [])
        return ParsedMessage(None, "", [ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False),
                                                 True) for c in obj])


def forced_call_schema(tool_choice: Any, tools: list[dict]) -> tuple[str, dict] | None:
    """``(forced, json_schema)`` constraining the output to the tool call ``tool_choice``
    demands (``required`` or a named function), or None for ``auto`` / ``none``."""
    if tool_choice == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                   "parameters": t["function"].get("parameters") or {"type": "object"}},
                  "required": ["name", "parameters"]} for t in tools]
        return "required", {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        fn = next(t["function"] for t in tools if t["function"]["name"] == name)
        return name, fn.get("parameters") or {"type": "object"}
    return None
