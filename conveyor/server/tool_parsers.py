"""How a model writes tool calls, read back out of its text: `--tool-call-parser`, as vLLM names
its parsers. Each parser knows three things of its format:

- `scan(text, final)`: the content and the calls in an output so far, and how much of the text
  they account for. It is monotone: as the text grows, the content only extends and the calls
  only append, so a stream can send what is new each time (`ToolStream`) and end with what the
  whole output parses to. A tail that may still become a call is held back until `final`.
- `prompt(tools)`: the system prompt that shows the tools to a model whose chat template does
  not take `tools`, and asks for this format back.
- `write(calls)`: an assistant's earlier calls as the model would have written them, for the
  history of such a template.

Formats:
- `hermes` (Hermes 2/3, Qwen2.5, SmolLM2 asked to): `<tool_call>{"name", "arguments"}</tool_call>`
  blocks (an object or a list inside), text around them.
- `llama3_json` (Llama 3.1/3.3's JSON tool calling): the whole output is one or more
  `{"name", "parameters"}` objects separated by `;`, optionally after `<|python_tag|>`; an output
  that starts otherwise is content.
- `mistral`: content, then `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}`.
- `pythonic` (Llama 3.2 / 4's): the whole output is a Python list of calls with keyword
  arguments of literals, `[get_weather(city="Paris"), search(query="x")]`.

A block that does not parse as calls stays text. No model is needed: tests read each format's
own texts, and round-trip `write` through `scan`.
"""

from __future__ import annotations

import ast
import json
import uuid
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from conveyor.core.registry import Registry

Call = dict[str, Any]  # OpenAI's {"id", "type": "function", "function": {"name", "arguments"}}
Scan = tuple[str, list[Call], int]


def tool_call(name: str, arguments: str) -> Call:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def arguments_text(args: Any) -> str:
    if isinstance(args, str):
        return args
    return json.dumps(args if args is not None else {}, ensure_ascii=False)


def arguments_object(args: Any) -> Any:
    """A call's arguments as a JSON value (they travel as a string in OpenAI's shape)."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return {} if args is None else args


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _calls_of(value: Any, args_key: str) -> list[Call] | None:
    """`value` as calls: a `{"name", args_key}` object or a list of them (either key is taken);
    None if it is not that."""
    items = value if isinstance(value, list) else [value]
    out = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            return None
        args = it.get(args_key, it.get("arguments", it.get("parameters", {})))
        out.append(tool_call(it["name"], arguments_text(args)))
    return out or None


_JSON = json.JSONDecoder()


class ToolParser(ABC):
    name: ClassVar[str] = ""

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan: ...

    @abstractmethod
    def prompt(self, tools: list[dict[str, Any]]) -> str: ...

    @abstractmethod
    def write(self, calls: list[Call]) -> str: ...

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """A finished output as (content, calls); content is None when only calls remain."""
        content, calls, _ = self.scan(text, final=True)
        if calls:
            return content.strip() or None, calls
        return content, calls


_PARSERS: Registry[ToolParser] = Registry("tool call parser")


def tool_parser_names() -> list[str]:
    return _PARSERS.names()


def make_tool_parser(name: str) -> ToolParser:
    return _PARSERS[name]()


@_PARSERS.register("hermes")
class HermesParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        content: list[str] = []
        calls: list[Call] = []
        at = 0
        while True:
            start = text.find(self.OPEN, at)
            if start < 0:
                keep = 0 if final else partial_suffix(text[at:], self.OPEN)
                content.append(text[at : len(text) - keep])
                return "".join(content), calls, len(text) - keep
            end = text.find(self.CLOSE, start)
            if end < 0 and not final:
                content.append(text[at:start])
                return "".join(content), calls, start
            stop = end + len(self.CLOSE) if end >= 0 else len(text)
            try:
                found = _calls_of(json.loads(text[start + len(self.OPEN) : end if end >= 0 else len(text)]), "arguments")
            except ValueError:
                found = None
            if found is None:  # not a call: text
                content.append(text[at:stop])
            else:
                content.append(text[at:start])
                calls.extend(found)
            at = stop

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t) for t in tools)
        return (
            "You are a function calling AI model. You may call one or more functions to assist with "
            "the user query. Don't make assumptions about what values to plug into functions. The "
            f"functions available to you are listed within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n"
            "To call a function, reply with a JSON object with its name and arguments within "
            "<tool_call></tool_call> XML tags, for each call:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def write(self, calls: list[Call]) -> str:
        return "\n".join(
            f'{self.OPEN}\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
            f'{arguments_text(c["function"].get("arguments"))}}}\n{self.CLOSE}'
            for c in calls
        )


def _json_calls(text: str, at: int, final: bool, separators: str, args_key: str) -> tuple[list[Call], int, bool]:
    """JSON values from `at` on, separated by whitespace and `separators`, as calls: (calls, where
    they end, whether the rest is settled: False while a value may still be completing)."""
    calls: list[Call] = []
    pos = at
    while True:
        skip = pos
        while skip < len(text) and (text[skip].isspace() or (calls and text[skip] in separators)):
            skip += 1
        if skip == len(text):
            return calls, pos if not final else len(text), final
        try:
            value, end = _JSON.raw_decode(text, skip)
        except ValueError:
            return calls, pos, final  # incomplete (or not JSON): waits, or is content at the end
        found = _calls_of(value, args_key)
        if found is None:
            return calls, pos, True
        calls.extend(found)
        pos = end


@_PARSERS.register("llama3_json")
class Llama3JsonParser(ToolParser):
    TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        at = len(text) - len(body)
        if body.startswith(self.TAG):
            at += len(self.TAG)
        elif not final and self.TAG.startswith(body):  # nothing yet, or the tag's beginning
            return "", [], 0
        rest = text[at:].lstrip()
        if not rest:
            return ("", [], 0) if not final else (text, [], len(text))
        if not rest.startswith("{"):  # not a call: all of it is content
            return text, [], len(text)
        calls, end, settled = _json_calls(text, at, final, ";", "parameters")
        if not settled:
            return "", calls, end
        return (text[end:] if calls else text), calls, len(text)

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n\n".join(json.dumps(t, indent=2) for t in tools)
        return (
            "You can call these functions to answer the user:\n\n"
            f"{listed}\n\n"
            "To call one, reply with only a JSON object of the form "
            '{"name": <function name>, "parameters": <an object of argument names and values>}; '
            "for several calls, separate the objects with ';'. Use values, not variables. "
            "Otherwise answer in plain text."
        )

    def write(self, calls: list[Call]) -> str:
        return "; ".join(json.dumps({"name": c["function"]["name"],
                                     "parameters": arguments_object(c["function"].get("arguments"))},
                                    ensure_ascii=False) for c in calls)


@_PARSERS.register("mistral")
class MistralParser(ToolParser):
    TAG = "[TOOL_CALLS]"

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.TAG)
        if start < 0:
            keep = 0 if final else partial_suffix(text, self.TAG)
            return text[: len(text) - keep], [], len(text) - keep
        calls, end, settled = _json_calls(text, start + len(self.TAG), final, ",", "arguments")
        if not calls and settled:  # not calls after the tag: text
            return text, [], len(text)
        if not settled:
            return text[:start], calls, end
        return text[:start] + text[end:], calls, len(text)

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = json.dumps(tools, ensure_ascii=False)
        return (
            f"[AVAILABLE_TOOLS] {listed} [/AVAILABLE_TOOLS]\n"
            f"To call tools, reply with {self.TAG} followed by a JSON list of "
            '{"name": <function name>, "arguments": <an object of arguments>}, one item per call. '
            "Otherwise answer in plain text."
        )

    def write(self, calls: list[Call]) -> str:
        return self.TAG + json.dumps([{"name": c["function"]["name"],
                                       "arguments": arguments_object(c["function"].get("arguments"))}
                                      for c in calls], ensure_ascii=False)


@_PARSERS.register("pythonic")
class PythonicParser(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        body = text.strip()
        if not body.startswith("["):
            if not final and not body:
                return "", [], 0
            return text, [], len(text)
        if not final:
            return "", [], 0  # a list of calls is only read whole
        calls = self._calls(body)
        return ("", calls, len(text)) if calls else (text, [], len(text))

    @staticmethod
    def _calls(body: str) -> list[Call] | None:
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
                return None
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except ValueError:
                return None
            if len(args) != len(node.keywords):  # a **kwargs
                return None
            calls.append(tool_call(ast.unparse(node.func), json.dumps(args, ensure_ascii=False)))
        return calls

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t) for t in tools)
        return (
            "You can call these functions to answer the user:\n"
            f"{listed}\n"
            "To call them, reply with only a Python list of calls with keyword arguments, e.g. "
            '[func_name1(param1="value1", param2=2), func_name2(param=True)]. '
            "Otherwise answer in plain text."
        )

    def write(self, calls: list[Call]) -> str:
        def one(c: Call) -> str:
            args = arguments_object(c["function"].get("arguments"))
            kwargs = ", ".join(f"{k}={v!r}" for k, v in args.items()) if isinstance(args, dict) else ""
            return f"{c['function']['name']}({kwargs})"

        return "[" + ", ".join(one(c) for c in calls) + "]"
