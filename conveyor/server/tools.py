"""Tool calling on the chat API: OpenAI's `tools` and `tool_choice`, as vLLM serves them.

- `tool_choice="none"`: the tools are not shown to the model; plain text comes back.
- `"auto"` (the default with tools): the model is shown the tools and answers freely; calls it
  writes in the Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (a
  JSON object or a list of them inside the tags), are parsed out of the text into
  `message.tool_calls`, the rest stays `content`.
- `"required"`: the output is held by structured outputs to a JSON list of one or more
  `{"name": <a tool's name>, "parameters": <that tool's parameters>}` (one only with
  `parallel_tool_calls=false`), as vLLM does, and every element becomes a call.
- `{"type": "function", "function": {"name": ...}}`: the output is held to that function's
  `parameters` schema and becomes its arguments.

A chat template that renders tools itself (it names `tools`) gets them as `tools=`; for one
that does not (SmolLM2's), a system prompt lists them in the Hermes format and asks for that
format back, and an assistant message's earlier `tool_calls` are written into its content the
same way, so a conversation's history reads as the model was asked to write.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conveyor.sampling_params import InvalidRequestError, StructuredOutputParams
from conveyor.server.tool_parsers import (
    HermesParser,
    ToolParser,
    partial_suffix,
    tool_call,
    tool_schemas,
)

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
HERMES = HermesParser()

__all__ = ["ToolStream", "Tools", "history_for_template", "parse_hermes", "partial_suffix", "tool_call"]


@dataclass(frozen=True)
class Tools:
    """A request's tools (each `{"type": "function", "function": {...}}`), checked, and what
    its `tool_choice` asks: "none", "auto", "required", or a function's name."""

    functions: tuple[dict[str, Any], ...]
    choice: str
    named: str | None = None
    parallel: bool = True
    parser: ToolParser = HERMES  # how calls are written under "auto" (--tool-call-parser)

    @classmethod
    def parse(cls, tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
              parser: ToolParser = HERMES) -> Tools | None:
        """None when the request has no tools; raises InvalidRequestError naming the field."""
        if not tools:
            if tool_choice not in (None, "none"):
                raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
            return None
        functions: list[dict[str, Any]] = []
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
                raise InvalidRequestError(
                    f"tools[{i}]: must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools"
                )
            name = fn.get("name")
            if not isinstance(name, str) or not NAME.fullmatch(name):
                raise InvalidRequestError(
                    f"tools[{i}].function.name {name!r}: 1-64 letters, digits, '_', '.' or '-'", param="tools"
                )
            params = fn.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(params, dict):
                raise InvalidRequestError(f"tools[{i}].function.parameters: must be a JSON Schema object", param="tools")
            try:
                StructuredOutputParams(json=params)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"tools[{i}].function.parameters: {e}", param="tools") from None
            functions.append({**fn, "parameters": params})
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tools: two functions share a name", param="tools")
        choice, named = tool_choice if tool_choice is not None else "auto", None
        if isinstance(choice, dict):
            fn = choice.get("function") if choice.get("type") == "function" else None
            named = fn.get("name") if isinstance(fn, dict) else None
            if named not in names:
                raise InvalidRequestError(
                    f"tool_choice names {named!r}, which is not among the tools", param="tool_choice"
                )
            choice = "named"
        elif choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"tool_choice {choice!r}: none, auto, required or {{\"type\": \"function\", ...}}", param="tool_choice"
            )
        return cls(tuple(functions), choice, named, parallel is not False, parser)

    # -- the prompt ----------------------------------------------------------------------------
    @property
    def shown(self) -> bool:
        return self.choice != "none"

    def template_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": f} for f in self.functions]

    def system_prompt(self) -> str:
        return self.parser.prompt(self.template_tools())

    # -- the output ----------------------------------------------------------------------------
    def constraint(self, writable: Callable[[str], bool] | None = None) -> StructuredOutputParams | None:
        """What the output is held to: a call list ("required"), one function's arguments
        (named), with "auto" and a strict function, the parser's structural tag (its format's
        free text, and calls held to their functions' schemas; `hermes` as vLLM's), or nothing:
        also where `writable` (the served tokenizer's) says one of the tag's markers is a special
        token that the tag writes as text (a grammar admits a special token only as a `token`
        format, as the tags of `TOKEN_TAG` parsers write every marker)."""
        if self.choice == "auto" and any(f.get("strict") is True for f in self.functions):
            tag = self.parser.strict_tag(list(self.functions), self.parallel)
            if tag is not None and (writable is None or self.parser.TOKEN_TAG
                                    or all(writable(m) for m in self.parser.MARKERS)):
                return StructuredOutputParams(structural_tag=tag)
        if self.choice == "named":
            fn = next(f for f in self.functions if f["name"] == self.named)
            return StructuredOutputParams(json=fn["parameters"])
        if self.choice == "required":
            call = {"anyOf": [
                {"type": "object", "properties": {"name": {"const": f["name"]}, "parameters": f["parameters"]},
                 "required": ["name", "parameters"]}
                for f in self.functions
            ]}
            schema = {"type": "array", "items": call, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}
            return StructuredOutputParams(json=schema)
        return None

    def keeps_special_tokens(self, is_special: Callable[[str], bool] | None) -> bool:
        """Whether the output's text must keep special tokens for the parser to read its calls:
        where calls may come ("auto") and the served tokenizer holds one of the format's markers
        as a special token (`is_special`; vLLM's tool parsers' `adjust_request`)."""
        return self.choice == "auto" and is_special is not None and any(is_special(m) for m in self.parser.MARKERS)

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A finished output as (content, tool calls)."""
        if self.choice == "named":
            assert self.named is not None
            return None, [tool_call(self.named, text)]
        if self.choice == "required":
            try:
                items = json.loads(text)
                return None, [tool_call(it["name"], json.dumps(it["parameters"], ensure_ascii=False)) for it in items]
            except (ValueError, TypeError, KeyError):  # cut short by max_tokens: the text as it is
                return text, []
        if self.choice == "auto":
            with tool_schemas(self.functions):
                return self.parser.parse(text)
        return text, []


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Calls written as `<tool_call>{...}</tool_call>` (an object or a list of them), and the
    text around them. A block that is not a call (bad JSON, no name) stays in the text; an
    unclosed one at the end is read to the end."""
    return HERMES.parse(text)


@dataclass
class ToolStream:
    """One streamed choice's text, split as it grows into content deltas and tool calls.

    With `tool_choice="auto"`, the parser's scan of the text so far says what is content and
    what calls (a tail that could begin a call is held back); what is new since the last piece
    is sent, a call whole once it is complete. Named: each piece of text is the function's
    arguments, the call's id and name first. Required: the calls are sent when the output ends
    (its JSON is only whole then)."""

    tools: Tools
    text: str = ""
    sent: int = 0  # characters of content passed on
    calls: int = 0  # tool calls sent so far
    named_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def feed(self, piece: str, final: bool) -> dict[str, Any]:
        """The delta for a new piece of text: {"content": ...} and/or {"tool_calls": [...]}."""
        self.text += piece
        t = self.tools
        if t.choice == "named":
            delta: list[dict[str, Any]] = []
            if self.calls == 0:
                self.calls = 1
                delta.append({"index": 0, "id": self.named_id, "type": "function",
                              "function": {"name": t.named, "arguments": piece}})
            elif piece:
                delta.append({"index": 0, "function": {"arguments": piece}})
            return {"tool_calls": delta} if delta else {}
        if t.choice == "required":
            if not final:
                return {}
            return self._out(*t.calls(self.text))
        if t.choice != "auto":
            return {"content": piece} if piece else {}
        with tool_schemas(t.functions):
            content, calls, _ = t.parser.scan(self.text, final)  # monotone: only what is new goes out
        new_content, self.sent = content[self.sent :], len(content)
        return self._out(new_content, calls[self.calls :])

    def _out(self, content: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [{"index": self.calls + i, **c} for i, c in enumerate(calls)]
            self.calls += len(calls)
        return delta


def history_for_template(messages: list[dict[str, Any]], tools: Tools | None, template: str) -> list[dict[str, Any]]:
    """Messages for a chat template. A template that names `tool_calls` gets them with their
    arguments as objects (as HF templates expect); for one that does not, an assistant's calls
    are written into its content in the parser's format (Hermes without tools). Tools shown to
    a template that does not name `tools` come as a system prompt (merged into the first system
    message)."""
    knows_calls = "tool_calls" in template
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            if knows_calls:
                m["tool_calls"] = [_with_object_arguments(c) for c in calls]
            else:
                written = (tools.parser if tools is not None else HERMES).write(calls)
                m["content"] = "\n".join(filter(None, [m.get("content") or "", written]))
                del m["tool_calls"]
        out.append(m)
    if tools is not None and tools.shown and "tools" not in template:
        prompt = tools.system_prompt()
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):
            fn["arguments"] = json.loads(args)
    return {**call, "function": fn}
