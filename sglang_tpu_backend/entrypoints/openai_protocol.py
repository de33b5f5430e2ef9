"""OpenAI ``/v1/completions`` and ``/v1/chat/completions``: request -> engine requests, and
engine outputs -> response objects and stream chunks.

Choice ``index = i * n + j`` for sample j of prompt i (the order the engine requests are
built in). ``usage.prompt_tokens`` counts each prompt once, ``completion_tokens`` sums all
choices. Chat prompts are rendered with the tokenizer's chat template and sent as token ids,
so ``prompt_tokens`` equals the tokenizer's count of the templated prompt.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import time
import uuid
from typing import Any

from sglang_tpu_backend.entrypoints.chat_parsing import ChatParser, ParsedMessage, forced_call_schema
from sglang_tpu_backend.entrypoints.native_protocol import new_rid
from sglang_tpu_backend.entrypoints.request_fields import APIError, check_fanout, is_int_list, opt_field
from sglang_tpu_backend.managers.io_struct import GenerateReqInput, InvalidRequestError
from sglang_tpu_backend.sampling.sampling_params import check_stop_limits

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# apply_chat_template arguments a request's chat_template_kwargs may not override.
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tools", "tokenize", "add_generation_prompt",
                            "return_dict", "continue_final_message")
# Engine error fields (InvalidRequestError.field, "sampling_params." stripped) -> OpenAI names.
ENGINE_FIELD_TO_OPENAI = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}

# OpenAI field -> (SGLang sampling param, kind). Extra SGLang fields are accepted as in SGLang.
_SAMPLING_FIELDS = {
    "temperature": ("temperature", "number"),
    "top_p": ("top_p", "number"),
    "top_k": ("top_k", "int"),
    "min_p": ("min_p", "number"),
    "presence_penalty": ("presence_penalty", "number"),
    "frequency_penalty": ("frequency_penalty", "number"),
    "repetition_penalty": ("repetition_penalty", "number"),
    "min_tokens": ("min_new_tokens", "int"),
    "seed": ("seed", "int"),
    "ignore_eos": ("ignore_eos", "bool"),
    "skip_special_tokens": ("skip_special_tokens", "bool"),
    "no_stop_trim": ("no_stop_trim", "bool"),
    "regex": ("regex", "str"),
    "stop_token_ids": ("stop_token_ids", "list"),
    "logit_bias": ("logit_bias", "dict"),  # token-id string -> bias; the engine checks the values
}


@dataclasses.dataclass(frozen=True)
class OpenAIRequest:
    """A parsed completions/chat request. ``reqs[i * n + j]`` is choice ``i * n + j``."""

    kind: str  # "completion" | "chat"
    model: str
    reqs: list[GenerateReqInput]
    n: int
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs requested
    echo_texts: list[str] | None  # completions with echo=true: each prompt's text
    chat: ChatParser | None = None  # chat: splits reasoning / tool calls out of the output


def openai_field(engine_field: str) -> str:
    name = engine_field.removeprefix("sampling_params.")
    return ENGINE_FIELD_TO_OPENAI.get(name, name)


# Requests --------------------------------------------------------------------------------
def _sampling_params(body: dict, max_tokens_default: int | None) -> dict[str, Any]:
    sp: dict[str, Any] = {}
    max_tokens = opt_field(body, "max_completion_tokens", "int", None)
    if max_tokens is None:
        max_tokens = opt_field(body, "max_tokens", "int", max_tokens_default)
    sp["max_new_tokens"] = max_tokens
    for name, (sgl_name, kind) in _SAMPLING_FIELDS.items():
        value = opt_field(body, name, kind)
        if value is not None:
            sp[sgl_name] = value
    stop = body.get("stop")
    if stop is not None:
        if not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
            raise APIError("'stop' must be a string or a list of strings", "stop")
        sp["stop"] = [stop] if isinstance(stop, str) else stop
        try:
            check_stop_limits(sp["stop"], "stop")
        except InvalidRequestError as e:
            raise APIError(e.message, "stop") from e
    json_schema = body.get("json_schema")
    if json_schema is not None:
        sp["json_schema"] = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    fmt = opt_field(body, "response_format", "dict")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise APIError("'response_format.json_schema' must be an object with a 'schema' object",
                               "response_format.json_schema")
            sp["json_schema"] = json.dumps(spec.get("schema", {}))
        elif kind == "json_object":
            sp["json_schema"] = json.dumps({"type": "object"})
        elif kind == "regex":  # SGLang's extension
            sp["regex"] = opt_field(fmt, "regex", "str", param="response_format.regex")
        elif kind != "text":
            raise APIError(f"'response_format.type' must be one of text, json_object, json_schema; "
                           f"got {kind!r}", "response_format.type")
    return sp


def _common(body: dict, kind: str, model_name: str, sp: dict, prompts: list[dict],
            top_logprobs: int | None, echo_texts: list[str] | None, seed_rng: random.Random,
            chat: ChatParser | None = None) -> OpenAIRequest:
    """``echo_texts`` with logprobs also asks for the prompt's logprobs (``logprob_start_len=0``)."""
    n = opt_field(body, "n", "int", 1, minimum=1)
    check_fanout(len(prompts), n, "prompt", "n")
    stream = opt_field(body, "stream", "bool", False)
    options = opt_field(body, "stream_options", "dict", {})
    include_usage = opt_field(options, "include_usage", "bool", False, param="stream_options.include_usage")
    model = opt_field(body, "model", "str", model_name)
    base_seed = sp.get("seed")
    if n > 1 and base_seed is None:
        base_seed = seed_rng.randrange(2**62)
    reqs = []
    for prompt in prompts:
        for j in range(n):
            sp_j = dict(sp)
            if n > 1:
                sp_j["seed"] = base_seed + j
            reqs.append(GenerateReqInput(
                **prompt, sampling_params=sp_j, stream=stream, rid=new_rid(),
                return_logprob=top_logprobs is not None, top_logprobs_num=top_logprobs or 0,
                return_text_in_logprobs=top_logprobs is not None,
                logprob_start_len=0 if echo_texts is not None and top_logprobs is not None else -1,
            ))
    return OpenAIRequest(kind=kind, model=model, reqs=reqs, n=n, stream=stream,
                         include_usage=include_usage, top_logprobs=top_logprobs, echo_texts=echo_texts,
                         chat=chat)


def parse_completion_request(body: dict, model_name: str, tokenizer, seed_rng: random.Random) -> OpenAIRequest:
    """``/v1/completions``: ``prompt`` is a string, a list of strings, token ids, or a list of them."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [{"text": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [{"text": p} for p in prompt]
    elif isinstance(prompt, list) and prompt and is_int_list(prompt):
        prompts = [{"input_ids": list(prompt)}]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and is_int_list(p) for p in prompt):
        prompts = [{"input_ids": list(p)} for p in prompt]
    else:
        raise APIError("'prompt' is required: a string, a list of strings, a list of token ids, "
                       "or a list of token-id lists", "prompt")
    logprobs = opt_field(body, "logprobs", "int", None, minimum=0)
    echo = opt_field(body, "echo", "bool", False)
    echo_texts = None
    if echo:
        echo_texts = [p["text"] if "text" in p else tokenizer.decode(p["input_ids"]) for p in prompts]
    sp = _sampling_params(body, max_tokens_default=16)
    return _common(body, "completion", model_name, sp, prompts, logprobs, echo_texts, seed_rng)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty array of message objects", "messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(f"'{param}' must be an object", param)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise APIError(f"'{param}.role' must be one of {CHAT_ROLES}, got {role!r}", f"{param}.role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for k, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise APIError(f"'{param}.content[{k}]' must be a text part "
                                   "{\"type\": \"text\", \"text\": ...}", f"{param}.content[{k}]")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            raise APIError(f"'{param}.content' must be a string or an array of text parts", f"{param}.content")
        msg = {**m, "content": content if content is not None else ""}
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _history_tool_calls(m["tool_calls"], f"{param}.tool_calls")
        out.append(msg)
    return out


def _history_tool_calls(calls: Any, param: str) -> list[dict]:
    """An assistant message's ``tool_calls`` with each ``function.arguments`` JSON string
    decoded into an object, as chat templates render them."""
    if not isinstance(calls, list):
        raise APIError(f"'{param}' must be an array", param)
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(f"'{param}[{k}].function' must be an object with a 'name'", f"{param}[{k}].function")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise APIError(f"'{param}[{k}].function.arguments' is not valid JSON: {e}",
                               f"{param}[{k}].function.arguments") from e
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def _tools(body: dict) -> list[dict] | None:
    """``tools``: function tools ``{"type": "function", "function": {"name", "description"?,
    "parameters"?}}`` with distinct names."""
    tools = opt_field(body, "tools", "list")
    if tools is None:
        return None
    names = set()
    for i, t in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise APIError(f"'{param}' must be an object with type 'function'", f"{param}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise APIError(f"'{param}.function' must be an object", f"{param}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise APIError(f"'{param}.function.name' must be 1-64 letters, digits, '_', '.' or '-'",
                           f"{param}.function.name")
        if name in names:
            raise APIError(f"'{param}.function.name' repeats the function {name!r}", f"{param}.function.name")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise APIError(f"'{param}.function.description' must be a string", f"{param}.function.description")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise APIError(f"'{param}.function.parameters' must be a JSON schema object",
                           f"{param}.function.parameters")
    return tools


def _tool_choice(body: dict, tools: list[dict] | None) -> Any:
    """``tool_choice``: none | auto | required | {"type": "function", "function": {"name"}}
    (default: auto with tools, none without)."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise APIError("'tool_choice' 'required' needs 'tools'", "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise APIError("'tool_choice' must be 'none', 'auto', 'required' or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if not any(t["function"]["name"] == name for t in tools or []):
        raise APIError(f"'tool_choice' names the function {name!r}, which is not in 'tools'", "tool_choice")
    return choice


def render_chat_prompt(body: dict, tokenizer) -> tuple[str, list[dict] | None, Any]:
    """The templated prompt text of a chat request, its ``tools`` and ``tool_choice``.

    ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``) go to the template as
    extra variables; tools are rendered unless ``tool_choice`` is ``none``."""
    messages = _messages(body)
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    kwargs = opt_field(body, "chat_template_kwargs", "dict", {})
    clash = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
    if clash:
        raise APIError(f"'chat_template_kwargs' may not set {clash}", "chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools if choice != "none" else None,
                                             tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as e:  # a template that rejects this conversation (jinja raise_exception)
        raise APIError(f"chat template rejected the messages: {e}", "messages") from e
    return text, tools, choice


def parse_chat_request(body: dict, model_name: str, tokenizer, seed_rng: random.Random, *,
                       reasoning_parser: str | None = None, tool_call_parser: str | None = None
                       ) -> OpenAIRequest:
    """``/v1/chat/completions``: messages rendered with the tokenizer's chat template.

    ``reasoning_parser`` / ``tool_call_parser`` (the server's flags) split the output into
    ``reasoning_content`` (unless the request sets ``separate_reasoning: false``) and
    ``tool_calls``. ``tool_choice`` ``required`` or a named function constrains the output
    to that call (a JSON schema) whatever the parser."""
    text, tools, choice = render_chat_prompt(body, tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    logprobs = opt_field(body, "logprobs", "bool", False)
    top = opt_field(body, "top_logprobs", "int", 0, minimum=0)
    sp = _sampling_params(body, max_tokens_default=None)
    separate = opt_field(body, "separate_reasoning", "bool", True)
    forced = forced_call_schema(choice, tools or [])
    if forced is not None:
        if sp.get("json_schema") is not None or sp.get("regex") is not None:
            raise APIError("'tool_choice' 'required' or a named function cannot be combined with "
                           "response_format, json_schema or regex", "tool_choice")
        sp["json_schema"] = json.dumps(forced[1])
    parser = None
    reasoning = reasoning_parser if separate and forced is None else None
    tool_parser = tool_call_parser if choice == "auto" and tools else None
    if reasoning or tool_parser or forced:
        parser = ChatParser(reasoning, tool_parser, tools, forced=forced[0] if forced else None,
                            in_reasoning=text.rstrip().endswith("<think>"))
    return _common(body, "chat", model_name, sp, [{"input_ids": ids}], top if logprobs else None, None,
                   seed_rng, chat=parser)


# Responses -------------------------------------------------------------------------------
def finish_reason(meta: dict) -> str | None:
    """SGLang's ``{"type": "stop" | "length" | "abort", ...}`` -> OpenAI's string."""
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    return fr.get("type") if isinstance(fr, dict) else str(fr)


def usage(outputs: list[dict], n: int) -> dict:
    """OpenAI usage; ``prompt_tokens_details.cached_tokens`` sums the prompt tokens every
    sample reused from the prefix cache (the n samples of a prompt may each reuse it)."""
    prompt = sum(o["meta_info"].get("prompt_tokens", 0) for o in outputs[::n])
    completion = sum(o["meta_info"].get("completion_tokens", 0) for o in outputs)
    cached = sum(o["meta_info"].get("cached_tokens", 0) or 0 for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token_text(entry: list) -> str:
    return entry[2] if len(entry) > 2 and entry[2] is not None else ""


def completion_logprobs(meta: dict, text_offset: int = 0, echo: bool = False) -> dict:
    """``output_token_logprobs`` / ``output_top_logprobs`` -> completions' ``logprobs`` object.

    ``echo``: the prompt's entries (``input_token_logprobs`` / ``input_top_logprobs``, from
    offset 0; the first token's logprob and top_logprobs are None) come first, as OpenAI and
    vLLM answer ``echo`` with ``logprobs``; ``text_offset`` then applies to the output only.
    """
    entries = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [None] * len(entries)
    tokens, offsets, lps, top_out = [], [], [], []

    def add(es: list, ts: list, pos: int, first_none: bool) -> None:
        for k, (e, top) in enumerate(zip(es, ts)):
            tokens.append(_token_text(e))
            offsets.append(pos)
            pos += len(tokens[-1])
            lps.append(e[0])
            top_out.append(None if first_none and k == 0 else {_token_text(t): t[0] for t in (top or [])})

    if echo:
        ins = meta.get("input_token_logprobs") or []
        add(ins, meta.get("input_top_logprobs") or [None] * len(ins), 0, True)
    add(entries, tops, text_offset, False)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_out, "text_offset": offsets}


def matched_stop(meta: dict) -> int | str | None:
    """What stopped the request (SGLang's ``matched_stop``): the stop string or the stop / EOS
    token id; None unless it finished with ``type: stop``."""
    fr = meta.get("finish_reason")
    return fr.get("matched") if isinstance(fr, dict) and fr.get("type") == "stop" else None


def chat_logprobs(meta: dict) -> dict:
    """``output_token_logprobs`` / ``output_top_logprobs`` -> chat's ``logprobs.content``."""
    entries = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [None] * len(entries)

    def item(e: list) -> dict:
        text = _token_text(e)
        return {"token": text, "logprob": e[0], "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e), "top_logprobs": [item(t) for t in (top or [])]}
                        for e, top in zip(entries, tops)]}


def completion_response(req: OpenAIRequest, rid: str, outputs: list[dict]) -> dict:
    choices = []
    for idx, out in enumerate(outputs):
        meta = out["meta_info"]
        prefix = req.echo_texts[idx // req.n] if req.echo_texts else ""
        choices.append({
            "index": idx,
            "text": prefix + out["text"],
            "logprobs": (completion_logprobs(meta, len(prefix), echo=req.echo_texts is not None)
                         if req.top_logprobs is not None else None),
            "finish_reason": finish_reason(meta),
            "matched_stop": matched_stop(meta),
        })
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.model,
            "choices": choices, "usage": usage(outputs, req.n)}


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _chat_finish_reason(meta: dict, parsed: ParsedMessage | None) -> str | None:
    """OpenAI's finish_reason; ``tool_calls`` when the output stopped after tool calls."""
    reason = finish_reason(meta)
    return "tool_calls" if reason == "stop" and parsed is not None and parsed.tool_calls else reason


def chat_message(req: OpenAIRequest, text: str) -> tuple[dict, ParsedMessage | None]:
    """The assistant message of a finished choice (content, reasoning_content, tool_calls)."""
    if req.chat is None:
        return {"role": "assistant", "content": text}, None
    parsed = req.chat.parse(text, final=True)
    content = parsed.content if parsed.content or not parsed.tool_calls else None  # OpenAI: null with calls
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if req.chat.reasoning_parser is not None:
        msg["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        msg["tool_calls"] = [{"id": _call_id(), "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in parsed.tool_calls]
    return msg, parsed


def chat_response(req: OpenAIRequest, rid: str, outputs: list[dict]) -> dict:
    choices = []
    for idx, out in enumerate(outputs):
        msg, parsed = chat_message(req, out["text"])
        choices.append({
            "index": idx,
            "message": msg,
            "logprobs": chat_logprobs(out["meta_info"]) if req.top_logprobs is not None else None,
            "finish_reason": _chat_finish_reason(out["meta_info"], parsed),
            "matched_stop": matched_stop(out["meta_info"]),
        })
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": req.model,
            "choices": choices, "usage": usage(outputs, req.n)}


class ChunkBuilder:
    """Turns one request's per-choice cumulative engine outputs into OpenAI stream chunks."""

    def __init__(self, req: OpenAIRequest, rid: str):
        self.req = req
        self.rid = rid
        self.created = int(time.time())
        self.sent_text: dict[int, int] = {}  # choice index -> characters already sent
        self.sent_lps: dict[int, int] = {}  # choice index -> logprob entries already sent
        self.sent_parts: dict[int, dict] = {}  # choice index -> parsed characters already sent
        self.finals: dict[int, dict] = {}

    def _chunk(self, choice: dict) -> dict:
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.req.model,
                "choices": [choice]}

    def chunk(self, idx: int, out: dict) -> dict | None:
        """The chunk for choice ``idx``'s new output, or None when it adds nothing."""
        meta = out["meta_info"]
        first = idx not in self.sent_text
        start = self.sent_text.get(idx, 0)
        delta = out["text"][start:]
        if first and self.req.echo_texts:
            delta = self.req.echo_texts[idx // self.req.n] + delta
        self.sent_text[idx] = len(out["text"])
        reason = finish_reason(meta)
        if reason is not None:
            self.finals[idx] = out
        logprobs = None
        if self.req.top_logprobs is not None:
            total = meta.get("completion_tokens", 0)
            done = self.sent_lps.get(idx, 0)
            new = {k: (meta.get(k) or [])[done:total] for k in ("output_token_logprobs", "output_top_logprobs")}
            self.sent_lps[idx] = total
            if self.req.kind == "chat":
                logprobs = chat_logprobs(new)
            else:
                echo = first and self.req.echo_texts is not None
                if echo:
                    new.update({k: meta.get(k) for k in ("input_token_logprobs", "input_top_logprobs")})
                logprobs = completion_logprobs(new, len(delta) - len(out["text"][start:]) if echo else 0,
                                               echo=echo)
        if self.req.kind == "chat" and self.req.chat is not None:
            return self._parsed_chunk(idx, out, first, reason, logprobs)
        if not delta and not first and reason is None:
            return None
        tail = {"finish_reason": reason, "matched_stop": matched_stop(meta)} if reason else {"finish_reason": None}
        if self.req.kind == "chat":
            d = {"role": "assistant", "content": delta} if first else ({"content": delta} if delta else {})
            return self._chunk({"index": idx, "delta": d, "logprobs": logprobs, **tail})
        return self._chunk({"index": idx, "text": delta, "logprobs": logprobs, **tail})

    def _parsed_chunk(self, idx: int, out: dict, first: bool, reason: str | None,
                      logprobs: dict | None) -> dict | None:
        """A chat chunk through the request's ChatParser: the growth of reasoning_content,
        content and tool calls since the last parse (each call: id + name + arguments so far
        when it first appears, then argument fragments)."""
        final = reason is not None
        sent = self.sent_parts.setdefault(idx, {"reasoning": 0, "content": 0, "calls": [], "memo": {}})
        parsed = self.req.chat.parse(out["text"], final, sent["memo"])
        d: dict[str, Any] = {"role": "assistant"} if first else {}
        for key, value in (("reasoning_content", parsed.reasoning), ("content", parsed.content)):
            part = key.removesuffix("_content")
            if value and len(value) > sent[part]:
                d[key] = value[sent[part]:]
                sent[part] = len(value)
        calls = []
        for k, call in enumerate(parsed.tool_calls):
            if k == len(sent["calls"]):
                sent["calls"].append(len(call.arguments))
                calls.append({"index": k, "id": _call_id(), "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > sent["calls"][k]:
                calls.append({"index": k, "function": {"arguments": call.arguments[sent["calls"][k]:]}})
                sent["calls"][k] = len(call.arguments)
        if calls:
            d["tool_calls"] = calls
        if not d and not final and not (logprobs and logprobs.get("content")):
            return None
        reason = _chat_finish_reason(out["meta_info"], parsed) if final else None
        tail = {"matched_stop": matched_stop(out["meta_info"])} if final else {}
        return self._chunk({"index": idx, "delta": d, "logprobs": logprobs, "finish_reason": reason, **tail})

    def usage_chunk(self) -> dict | None:
        """The final ``choices: []`` chunk with usage, when ``stream_options.include_usage``."""
        if not self.req.include_usage:
            return None
        outputs = [self.finals[i] for i in sorted(self.finals)]
        if len(outputs) != len(self.req.reqs):
            return None
        return {**self._chunk({}), "choices": [], "usage": usage(outputs, self.req.n)}
