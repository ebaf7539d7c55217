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
- `mistral`: content, then `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}` (v3
  tokenizers), or `[TOOL_CALLS]name[ARGS]{...}` once a call (v11 tokenizers: Mistral Small 3.2,
  Magistral, Devstral); both are read, the list is written.
- `pythonic` (Llama 3.2 / 4's): the whole output is a Python list of calls with keyword
  arguments of literals, `[get_weather(city="Paris"), search(query="x")]`.
- `qwen3_coder` (Qwen3-Coder's XML): `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
  ...</function></tool_call>`, one call a block, each on lines of their own.
- `glm45` (GLM-4.5 / 4.6): `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...
  </tool_call>`.
- `deepseek_v3` (DeepSeek-V3 / R1 and V3.1): `<｜tool▁calls▁begin｜>` then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and a fenced JSON block (V3), or
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}` (V3.1), each ending `<｜tool▁call▁end｜>`;
  also named `deepseek_v31` (vLLM's name for V3.1's). `llama4_json` is `llama3_json` under
  vLLM's other name.
- `kimi_k2`: `<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{...}<|tool_call_end|>`.
- `deepseek_v32` (DeepSeek-V3.2's DSML): a `<｜DSML｜function_calls>` block of
  `<｜DSML｜invoke name="NAME">` calls, each parameter `string="true"` (text) or `"false"` (JSON).
- `apertus`: `<|tools_prefix|>[{"NAME": {...}}, ...]<|tools_suffix|>`, text around it.
- `granite-20b-fc`: content, then `<function_call> {"name", "arguments"}` a call.
- `gigachat3`: content, then `<|message_sep|>` and `function call<|role_sep|>` with one
  `{"name", "arguments"}` object (3.1: `<|function_call|>` and the object).
- `openai` (gpt-oss's harmony format): a message to a function, `<|channel|>commentary
  to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`, the form the `openai_gptoss`
  reasoning parser passes each of the model's calls on in (use the two together, as vLLM's).

The XML formats' values are text, typed by the request's tool schemas where they say
(`tool_schemas`, set around a parse by `Tools`): a `string` parameter keeps its text (`42`
stays `"42"`), an `integer` or `number` one reads as a number, a `boolean` as true or false,
an `object` or `array` as JSON (or a Python literal, as models also write them), and `null` as
null where the schema allows it; text that does not read as its type stays text. A parameter
the schemas do not type: the JSON its text reads as (a number, a list...), else the text.
`write` quotes a string that would read as JSON, so what it writes reads back.

A block that does not parse as calls stays text. No model is needed: tests read each format's
own texts, and round-trip `write` through `scan`.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
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
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


class ToolParser(ABC):
    name: ClassVar[str] = ""

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan: ...

    @abstractmethod
    def prompt(self, tools: list[dict[str, Any]]) -> str: ...

    @abstractmethod
    def write(self, calls: list[Call]) -> str: ...

    # The marker texts this format is written with that a tokenizer may hold as special tokens.
    # Where the served tokenizer holds one as such, the output's text keeps special tokens (the
    # parser reads them; `Tools.keeps_special_tokens`, vLLM's `adjust_request`), and a strict tag
    # that writes them as text (not `TOKEN_TAG`) holds no calls: a grammar admits a special token
    # only where a `token` format names it.
    MARKERS: ClassVar[tuple[str, ...]] = ()
    TOKEN_TAG: ClassVar[bool] = False  # the strict tag writes every marker as a `token` format
    # The strict tag holds the whole output as the format's messages (harmony's), which the
    # reasoning parser still splits; other tags hold text that the parser reads as it comes.
    HOLDS_MESSAGES: ClassVar[bool] = False

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """The structural tag that holds this format's calls to their functions' parameters
        under `tool_choice="auto"` with a strict function (`held_parameters`), one call at most
        where `parallel` is false; None where the format has none (its calls are then free)."""
        return None

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """A finished output as (content, calls); content is None when only calls remain."""
        content, calls, _ = self.scan(text, final=True)
        if calls:
            return content.strip() or None, calls
        return content, calls


_PARSERS: Registry[ToolParser] = Registry("tool call parser")


def call_items(calls: list[Call], args_key: str = "arguments") -> list[dict[str, Any]]:
    """Calls as the `{"name": ..., args_key: {...}}` objects the JSON formats write."""
    return [{"name": c["function"]["name"], args_key: arguments_object(c["function"].get("arguments"))} for c in calls]


def json_calls_tag(functions: list[dict[str, Any]], parallel: bool, separator: str, args_key: str = "arguments",
                   begin: str = "", end: str = "") -> dict[str, Any]:
    """A `tags_with_separator` format of `{"name": ..., args_key: ...}` calls, one per function
    whose arguments hold to `held_parameters`, the first opened by `begin` and the last closed
    by `end`; one call where `parallel` is false."""
    return {"type": "tag", "begin": begin, "end": end, "content": {
        "type": "tags_with_separator", "separator": separator, "at_least_one": True, "stop_after_first": not parallel,
        "tags": [{"type": "tag", "begin": f'{{"name": {json.dumps(f["name"])}, "{args_key}": ', "end": "}",
                  "content": {"type": "json_schema", "json_schema": held_parameters(f)}} for f in functions]}}


def held_parameters(function: dict[str, Any]) -> Any:
    """What a strict tag holds a function's arguments to: its parameters, or any JSON object for
    a function marked `"strict": false`."""
    return function["parameters"] if function.get("strict") is not False else {"type": "object"}


def token(text: str) -> dict[str, Any]:
    """A structural tag's `token` format: the special token of that text, or the text itself
    where the served tokenizer holds it as text."""
    return {"type": "token", "token": text}


def const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def triggered_section(begin: str, end: str, calls: dict[str, Any]) -> dict[str, Any]:
    """Free text, then at most one section that the token `begin` opens and `end` closes, the
    `calls` inside, and nothing after it."""
    section = {"type": "tag", "begin": token(begin), "content": calls, "end": token(end)}
    return {"type": "structural_tag", "format": {"type": "token_triggered_tags", "trigger_tokens": [begin],
                                                  "tags": [section], "stop_after_first": True}}


def one_or_more(call: dict[str, Any], parallel: bool, between: str = "") -> dict[str, Any]:
    """`call`, and where `parallel` more of it, each after `between` (a regular expression)."""
    if not parallel:
        return call
    more = {"type": "sequence", "elements": [{"type": "regex", "pattern": between}, call]} if between else call
    return {"type": "sequence", "elements": [call, {"type": "star", "content": more}]}


def tool_parser_names() -> list[str]:
    return _PARSERS.names()


def make_tool_parser(name: str) -> ToolParser:
    return _PARSERS[name]()


def _blocks(text: str, final: bool, open_tag: str, close_tag: str, read: Any) -> Scan:
    """Calls in `open_tag ... close_tag` blocks with text around them: `read(inner)` gives a
    block's calls, or None when it is not calls (it stays text). A block not closed yet is held
    back, and so is a tail that may be the start of `open_tag`."""
    content: list[str] = []
    calls: list[Call] = []
    at = 0
    while True:
        start = text.find(open_tag, at)
        if start < 0:
            keep = 0 if final else partial_suffix(text[at:], open_tag)
            content.append(text[at : len(text) - keep])
            return "".join(content), calls, len(text) - keep
        end = text.find(close_tag, start + len(open_tag))
        if end < 0 and not final:
            content.append(text[at:start])
            return "".join(content), calls, start
        stop = end + len(close_tag) if end >= 0 else len(text)
        found = read(text[start + len(open_tag) : end if end >= 0 else len(text)])
        if found is None:  # not a call: text
            content.append(text[at:stop])
        else:
            content.append(text[at:start])
            calls.extend(found)
        at = stop


def _json_or_text(value: str) -> Any:
    """An XML format's value: the JSON it reads as, else the text itself."""
    try:
        return json.loads(value)
    except ValueError:
        return value


# The request's functions' parameter schemas by name, while its output is parsed (a context
# variable: one parser serves every request, each parse in its own request's context).
_SCHEMAS: ContextVar[dict[str, Any] | None] = ContextVar("tool_schemas", default=None)


@contextmanager
def tool_schemas(functions: Any) -> Iterator[None]:
    """Type the XML formats' values by these functions' `parameters` within the block."""
    token = _SCHEMAS.set({f["name"]: f.get("parameters") for f in functions})
    try:
        yield
    finally:
        _SCHEMAS.reset(token)


def _types(function: str, key: str) -> set[str]:
    schemas = _SCHEMAS.get()
    params = (schemas or {}).get(function)
    props = params.get("properties") if isinstance(params, dict) else None
    prop = props.get(key) if isinstance(props, dict) else None
    kind = prop.get("type") if isinstance(prop, dict) else None
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()


def _typed_value(function: str, key: str, text: str) -> Any:
    """An XML format's value `text` for `function`'s parameter `key`, as its schema types it."""
    kinds = _types(function, key)
    if not kinds:
        return _json_or_text(text)
    bare = text.strip()
    if "null" in kinds and bare == "null":
        return None
    if "integer" in kinds and re.fullmatch(r"[+-]?\d+", bare):
        return int(bare)
    if "number" in kinds:
        try:
            number = float(bare)
        except ValueError:
            number = None
        if number is not None and number == number and abs(number) != float("inf"):
            return int(number) if re.fullmatch(r"[+-]?\d+", bare) else number
    if "boolean" in kinds and bare.lower() in ("true", "false"):
        return bare.lower() == "true"
    if kinds & {"object", "array"}:
        for read in (json.loads, ast.literal_eval):
            try:
                value = read(bare)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
            if (isinstance(value, dict) and "object" in kinds) or (isinstance(value, list) and "array" in kinds):
                return value
    return text


def _text_of(value: Any) -> str:
    """A value as an XML format writes it (`_json_or_text` reads it back the same)."""
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, ensure_ascii=False)


def _object_args(call: Call) -> dict[str, Any] | None:
    args = arguments_object(call["function"].get("arguments"))
    return args if isinstance(args, dict) else None


@_PARSERS.register("hermes")
class HermesParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    MARKERS = (OPEN, CLOSE)

    def scan(self, text: str, final: bool) -> Scan:
        return _blocks(text, final, self.OPEN, self.CLOSE, self._read)

    @staticmethod
    def _read(inner: str) -> list[Call] | None:
        try:
            return _calls_of(json.loads(inner), "arguments")
        except ValueError:
            return None

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t) for t in tools)
        return (
            "You are a function calling AI model. You may call one or more functions to assist with "
            "the user query. Don't make assumptions about what values to plug into functions. The "
            f"functions available to you are listed within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n"
            "To call a function, reply with a JSON object with its name and arguments within "
            f"{self.OPEN}{self.CLOSE} XML tags, for each call:\n{self.OPEN}\n"
            f'{{"name": <function-name>, "arguments": <args-json-object>}}\n{self.CLOSE}'
        )

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Free text, and from each `<tool_call>` one call, `{"name": ..., "arguments": ...}`,
        on lines of its own or not (vLLM's rule for `hermes`)."""
        structures = [
            {"begin": f'{open_}{{"name": {json.dumps(f["name"])}, "arguments": ', "schema": held_parameters(f),
             "end": "}" + close}
            for f in functions
            for open_, close in ((self.OPEN + "\n", "\n" + self.CLOSE), (self.OPEN, self.CLOSE))
        ]
        return {"structures": structures, "triggers": [self.OPEN], "stop_after_first": not parallel}

    def write(self, calls: list[Call]) -> str:
        return "\n".join(
            f'{self.OPEN}\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
            f'{arguments_text(c["function"].get("arguments"))}}}\n{self.CLOSE}'
            for c in calls
        )


@_PARSERS.register("ernie45")
class Ernie45Parser(HermesParser):
    """Baidu ERNIE 4.5: Hermes's `<tool_call>` blocks of `{"name": ..., "arguments": ...}`.
    (vLLM's reader keeps only the text before the first call as content; here the text around
    the calls is content. The thinking model's `<response>` wrapper is the `ernie45` reasoning
    parser's to drop.)"""


@_PARSERS.register("longcat")
class LongcatParser(HermesParser):
    """Meituan LongCat-Flash: Hermes's calls in `<longcat_tool_call>` blocks."""

    OPEN, CLOSE = "<longcat_tool_call>", "</longcat_tool_call>"
    MARKERS = (OPEN, CLOSE)


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


class _TaggedJsonParser(ToolParser):
    """Calls as JSON (`{"name", "arguments"}` objects, or a list of them; several separated by
    whitespace) in `OPEN ... CLOSE` blocks, with text around them."""

    OPEN: ClassVar[str]
    CLOSE: ClassVar[str]
    ARGS: ClassVar[str] = "arguments"

    def scan(self, text: str, final: bool) -> Scan:
        return _blocks(text, final, self.OPEN, self.CLOSE, self._read)

    def _read(self, inner: str) -> list[Call] | None:
        calls, end, _ = _json_calls(inner, 0, True, "", self.ARGS)
        return calls if calls and not inner[end:].strip() else None

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Text, and blocks of calls held to their schemas (one block of one call where
        `parallel` is false), as `write` writes them."""
        block = json_calls_tag(functions, parallel, *self.list_form())
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [self.OPEN], "tags": [block],
                                                      "stop_after_first": not parallel}}

    def list_form(self) -> tuple[str, str, str, str]:
        """(separator, the arguments' key, a block's start, its end) of `strict_tag`."""
        return ", ", self.ARGS, self.OPEN + "[", "]" + self.CLOSE

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            f"You can call these functions to answer the user:\n{_tools_listing(tools)}\n"
            f"To call them, reply with {self.OPEN}{self.example()}{self.CLOSE}, "
            "one item per call. Otherwise answer in plain text."
        )

    def example(self) -> str:
        return f'[{{"name": <function name>, "{self.ARGS}": <an object of arguments>}}]'

    def write(self, calls: list[Call]) -> str:
        return f"{self.OPEN}{json.dumps(call_items(calls, self.ARGS), ensure_ascii=False)}{self.CLOSE}"


@_PARSERS.register("jamba")
class JambaParser(_TaggedJsonParser):
    """AI21's Jamba: `<tool_calls>[{"name": ..., "arguments": ...}]</tool_calls>`."""

    OPEN, CLOSE = "<tool_calls>", "</tool_calls>"
    MARKERS = (OPEN, CLOSE)


@_PARSERS.register("hunyuan_a13b")
class HunyuanA13BParser(JambaParser):
    """Tencent Hunyuan-A13B: `<tool_calls>[{"name": ..., "arguments": ...}]</tool_calls>`, as Jamba."""


@_PARSERS.register("xlam")
class XLamParser(ToolParser):
    """Salesforce xLAM: a JSON list of `{"name", "arguments"}` calls, the whole output, or in a
    ```` ```json ```` fence with text around it; read when the output ends, or the fence closes."""

    FENCE, CLOSE = "```json", "```"

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Only a JSON list of `{"name": ..., "arguments": ...}` calls held to their schemas,
        separated by `, ` (one where `parallel` is false), whitespace around it; or text that
        does not open with `[` in which every ```` ```json ```` fence holds such a list (the
        first is the one `scan` reads)."""
        calls = json_calls_tag(functions, parallel, ", ", "arguments", "[", "]")
        fenced = {"type": "triggered_tags", "triggers": [self.FENCE], "tags": [
            {"type": "tag", "begin": self.FENCE + "\n", "content": calls, "end": "\n" + self.CLOSE}]}
        space = {"type": "regex", "pattern": r"\s*"}
        return {"type": "structural_tag", "format": {"type": "or", "elements": [
            {"type": "sequence", "elements": [space, calls, space]},
            {"type": "sequence", "elements": [{"type": "regex", "pattern": r"\s*[^\[`\s]"}, fenced]},
            {"type": "sequence", "elements": [space, {**fenced, "at_least_one": True}]},
            space,
        ]}}

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.FENCE)
        if start >= 0:
            end = text.find(self.CLOSE, start + len(self.FENCE))
            if end < 0:
                return (text, [], len(text)) if final else (text[:start], [], start)
            calls = self._list(text[start + len(self.FENCE) : end])
            if calls is None:
                return text, [], len(text)
            return text[:start] + text[end + len(self.CLOSE) :], calls, len(text)
        body = text.strip()
        if body.startswith("["):
            if not final:
                return "", [], 0  # a list is read whole
            calls = self._list(body)
            return ("", calls, len(text)) if calls else (text, [], len(text))
        if not final and not body:
            return "", [], 0
        keep = 0 if final else partial_suffix(text, self.FENCE)
        return text[: len(text) - keep], [], len(text) - keep

    @staticmethod
    def _list(text: str) -> list[Call] | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        return _calls_of(value, "arguments") if isinstance(value, list) else None

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            f"You can call these functions to answer the user:\n{_tools_listing(tools)}\n"
            'To call them, reply with only a JSON list of {"name": <function name>, "arguments": <an object of '
            "arguments>}, one item per call. Otherwise answer in plain text."
        )

    def write(self, calls: list[Call]) -> str:
        return json.dumps(call_items(calls), ensure_ascii=False)


@_PARSERS.register("apertus")
class ApertusParser(_TaggedJsonParser):
    """Swiss AI's Apertus: `<|tools_prefix|>[{"NAME": {...arguments}}, ...]<|tools_suffix|>`, a
    one-key object a call (the function's name, its arguments), text around the block."""

    OPEN, CLOSE = "<|tools_prefix|>", "<|tools_suffix|>"
    MARKERS = (OPEN, CLOSE)
    TOKEN_TAG = True

    def _read(self, inner: str) -> list[Call] | None:
        try:
            value = json.loads(inner)
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            if not isinstance(item, dict) or len(item) != 1:
                return None
            (name, args), = item.items()
            if _NAME.fullmatch(name) is None or not isinstance(args, dict):
                return None
            calls.append(tool_call(name, json.dumps(args, ensure_ascii=False)))
        return calls or None

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Text, and blocks (their markers `token` formats) of a JSON list of one-key calls held
        to their schemas, separated by `, ` (one block of one call where `parallel` is false)."""
        calls = {"type": "tags_with_separator", "separator": ", ", "at_least_one": True, "stop_after_first": not parallel,
                 "tags": [{"type": "tag", "begin": f"{{{json.dumps(f['name'])}: ", "end": "}",
                           "content": {"type": "json_schema", "json_schema": held_parameters(f)}} for f in functions]}
        block = {"type": "tag", "begin": token(self.OPEN), "end": token(self.CLOSE),
                 "content": {"type": "sequence", "elements": [const("["), calls, const("]")]}}
        return {"type": "structural_tag", "format": {"type": "token_triggered_tags", "trigger_tokens": [self.OPEN],
                                                      "tags": [block], "stop_after_first": not parallel}}

    def example(self) -> str:
        return '[{<function name>: <an object of arguments>}]'

    def write(self, calls: list[Call]) -> str:
        items = [{c["function"]["name"]: _object_args(c) or {}} for c in calls]
        return f"{self.OPEN}{json.dumps(items, ensure_ascii=False)}{self.CLOSE}"


@_PARSERS.register("minimax")
class MiniMaxParser(_TaggedJsonParser):
    """MiniMax-M1: `<tool_calls>` and one `{"name": ..., "arguments": ...}` object a line,
    `</tool_calls>`."""

    OPEN, CLOSE = "<tool_calls>\n", "\n</tool_calls>"
    MARKERS = ("<tool_calls>", "</tool_calls>")

    def list_form(self) -> tuple[str, str, str, str]:
        return "\n", self.ARGS, self.OPEN, self.CLOSE

    def example(self) -> str:
        return '{"name": <function name>, "arguments": <an object of arguments>}\n... (one object a line)'

    def write(self, calls: list[Call]) -> str:
        return self.OPEN + "\n".join(json.dumps(item, ensure_ascii=False) for item in call_items(calls)) + self.CLOSE


@_PARSERS.register("internlm")
class InternLMParser(_TaggedJsonParser):
    """InternLM2 / 2.5: `<|action_start|><|plugin|>` and `{"name": ..., "parameters": ...}`,
    `<|action_end|>`, a block a call."""

    OPEN, CLOSE, ARGS = "<|action_start|><|plugin|>\n", "<|action_end|>", "parameters"
    MARKERS = ("<|action_start|>", "<|plugin|>", "<|action_end|>")

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Text, and blocks of one call each held to its schema (one block where `parallel` is
        false)."""
        call = json_calls_tag(functions, False, "", self.ARGS, self.OPEN, self.CLOSE)
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [self.OPEN], "tags": [call],
                                                      "stop_after_first": not parallel}}

    def example(self) -> str:
        return '{"name": <function name>, "parameters": <an object of arguments>}'

    def write(self, calls: list[Call]) -> str:
        return "".join(f"{self.OPEN}{json.dumps(item, ensure_ascii=False)}{self.CLOSE}" for item in call_items(calls, self.ARGS))


@_PARSERS.register("granite")
class GraniteParser(ToolParser):
    """IBM Granite 3.x: the output opens with `<|tool_call|>` (3.0) or `<tool_call>` (3.1 on)
    and a JSON list of `{"name", "arguments"}` calls (what follows the list is text); an output
    that does not open so is text."""

    TAGS = ("<|tool_call|>", "<tool_call>")
    MARKERS = TAGS[:1]

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Text that does not open with `<` past any whitespace (so with neither tag: content, as
        `scan` reads it), or `<|tool_call|>` and a JSON list of `{"name": ..., "arguments": ...}`
        calls held to their schemas, separated by `, ` (one where `parallel` is false), then any
        text (what `scan` reads after the list)."""
        calls = json_calls_tag(functions, parallel, ", ", "arguments", self.TAGS[0] + "[", "]")
        return {"type": "structural_tag", "format": {"type": "or", "elements": [
            {"type": "regex", "pattern": r"\s*([^<\s][\s\S]*)?"},
            {"type": "sequence", "elements": [{"type": "regex", "pattern": r"\s*"}, calls,
                                              {"type": "regex", "pattern": r"[\s\S]*"}]},
        ]}}

    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        tag = next((t for t in self.TAGS if body.startswith(t)), None)
        if tag is None:
            if not final and any(t.startswith(body) for t in self.TAGS):  # nothing yet, or a tag's beginning
                return "", [], 0
            return text, [], len(text)
        at = len(text) - len(body) + len(tag)
        rest = text[at:].lstrip()
        if not rest:
            return ("", [], 0) if not final else (text, [], len(text))
        if not rest.startswith("["):
            return text, [], len(text)
        calls, end, settled = _json_calls(text, at, final, "", "arguments")
        if not settled:
            return "", calls, end
        return (text[end:] if calls else text), calls, len(text)

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            f"You can call these functions to answer the user:\n{_tools_listing(tools)}\n"
            f"To call them, reply with only {self.TAGS[0]} followed by a JSON list of "
            '{"name": <function name>, "arguments": <an object of arguments>}, one item per call. '
            "Otherwise answer in plain text."
        )

    def write(self, calls: list[Call]) -> str:
        return self.TAGS[0] + json.dumps(call_items(calls), ensure_ascii=False)


class _OpenedCallsParser(ToolParser):
    """Content, then calls each written as an opener and one `{"name": ..., "arguments": {...}}`
    object, whitespace between them; text after the last call is content. An opener is a
    sequence of parts with any whitespace between and after them (`OPENERS`, the first one the
    form `write` writes). A marker of `ENDS` that no call follows ends the message: the rest is
    not content. A tail that may still open or complete a call is held back."""

    OPENERS: ClassVar[tuple[tuple[str, ...], ...]]
    ENDS: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._opener = re.compile("|".join(r"\s*".join(map(re.escape, parts)) + r"\s*" for parts in self.OPENERS))
        self._starts = tuple(dict.fromkeys([parts[0] for parts in self.OPENERS] + list(self.ENDS)))

    def scan(self, text: str, final: bool) -> Scan:
        found = [i for i in (text.find(s) for s in self._starts) if i >= 0]
        if not found:
            keep = 0 if final else max(partial_suffix(text, s) for s in self._starts)
            return text[: len(text) - keep], [], len(text) - keep
        content, pos = text[: min(found)], min(found)
        calls: list[Call] = []
        while True:
            rest = text[pos:]
            opened = self._opener.match(text, pos)
            if opened is None:
                if not final and self._may_open(rest):
                    return content, calls, pos
                if rest.startswith(self.ENDS):  # the message ends here
                    return content, calls, len(text)
                return content + rest, calls, len(text)
            try:
                value, end = _JSON.raw_decode(text, opened.end())
            except ValueError:  # a call still being written, or not JSON
                return (content, calls, pos) if not final else (content + rest, calls, len(text))
            if not (isinstance(value, dict) and isinstance(value.get("name"), str)
                    and isinstance(value.get("arguments"), dict)):
                return content + rest, calls, len(text)
            calls.append(tool_call(value["name"], arguments_text(value["arguments"])))
            pos = end
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if pos == len(text):
                return content, calls, len(text) if final else end

    def _may_open(self, rest: str) -> bool:
        """Whether more text may make `rest` an opener."""
        for parts in self.OPENERS:
            tail = rest
            for k, part in enumerate(parts):
                tail = tail.lstrip() if k else tail
                if tail.startswith(part):
                    tail = tail[len(part):]
                    continue
                if part.startswith(tail):
                    return True
                break
            else:
                return True
        return False

    def opener(self) -> str:
        """The opener as `write` writes it."""
        raise NotImplementedError

    def write(self, calls: list[Call]) -> str:
        return "\n".join(f"{self.opener()}{json.dumps(item, ensure_ascii=False)}" for item in call_items(calls))

    def _call_forms(self, functions: list[dict[str, Any]]) -> dict[str, Any]:
        """A call's object held to its function's schema, one form a function."""
        return {"type": "or", "elements": [
            {"type": "tag", "begin": f'{{"name": {json.dumps(f["name"])}, "arguments": ', "end": "}",
             "content": {"type": "json_schema", "json_schema": held_parameters(f)}} for f in functions]}


@_PARSERS.register("granite-20b-fc")
class Granite20bFCParser(_OpenedCallsParser):
    """IBM granite-20b-functioncalling: content, then `<function_call> {"name": ..., "arguments":
    {...}}` for each call, a line each."""

    OPENERS = (("<function_call>",),)
    MARKERS = ("<function_call>",)
    TOKEN_TAG = True

    def opener(self) -> str:
        return "<function_call> "

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Free text, then calls held to their schemas, each `<function_call>` (a `token`
        format) and its object, a newline between them (one call where `parallel` is false);
        nothing after the last."""
        call = {"type": "sequence", "elements": [const(" "), self._call_forms(functions)]}
        more = {"type": "sequence", "elements": [const("\n"), token(self.MARKERS[0]), call]}
        content = {"type": "sequence", "elements": [call, {"type": "star", "content": more}]} if parallel else call
        section = {"type": "tag", "begin": token(self.MARKERS[0]), "content": content, "end": ""}
        return {"type": "structural_tag", "format": {"type": "token_triggered_tags", "trigger_tokens": [self.MARKERS[0]],
                                                      "tags": [section], "stop_after_first": True}}

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            f"You can call these functions to answer the user:\n{_tools_listing(tools)}\n"
            'To call one, write <function_call> {"name": <function name>, "arguments": <an object of arguments>}, '
            "a line a call. Otherwise answer in plain text."
        )


@_PARSERS.register("gigachat3")
class GigaChat3Parser(_OpenedCallsParser):
    """GigaChat 3: content, then `<|message_sep|>` and, in a message of its own, `function
    call<|role_sep|>` and one `{"name": ..., "arguments": {...}}` object (GigaChat 3.1:
    `<|function_call|>` and the object; a bare `function call<|role_sep|>` is read too). A
    `<|message_sep|>` that opens no call ends the answer. Several calls are several such
    messages."""

    SEP, ROLE, CALL = "<|message_sep|>", "<|role_sep|>", "<|function_call|>"
    OPENERS = ((SEP, "function call" + ROLE), ("function call" + ROLE,), (CALL,))
    ENDS = (SEP,)
    MARKERS = (SEP, ROLE, CALL)
    TOKEN_TAG = True

    def opener(self) -> str:
        return f"{self.SEP}\n\nfunction call{self.ROLE}\n"

    def write(self, calls: list[Call]) -> str:
        return "".join(f"{self.opener()}{json.dumps(item, ensure_ascii=False)}" for item in call_items(calls))

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Free text, then calls held to their schemas, each `<|message_sep|>`, `\\n\\nfunction
        call`, `<|role_sep|>`, a newline and the object (the markers `token` formats); one call
        where `parallel` is false, nothing after the last."""
        call = {"type": "sequence", "elements": [const("\n\nfunction call"), token(self.ROLE), const("\n"),
                                                 self._call_forms(functions)]}
        more = {"type": "sequence", "elements": [token(self.SEP), call]}
        content = {"type": "sequence", "elements": [call, {"type": "star", "content": more}]} if parallel else call
        section = {"type": "tag", "begin": token(self.SEP), "content": content, "end": ""}
        return {"type": "structural_tag", "format": {"type": "token_triggered_tags", "trigger_tokens": [self.SEP],
                                                      "tags": [section], "stop_after_first": True}}

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            f"You can call these functions to answer the user:\n{_tools_listing(tools)}\n"
            f"To call one, end your text with {self.opener()}"
            '{"name": <function name>, "arguments": <an object of arguments>}. Otherwise answer in plain text.'
        )


@_PARSERS.register("phi4_mini_json")
class Phi4MiniJsonParser(ToolParser):
    """Phi-4-mini: `functools[{"name": ..., "arguments": ...}, ...]`, text around it."""

    TAG = "functools"
    MARKERS = (TAG,)

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.TAG + "[")
        if start < 0:
            keep = 0 if final else partial_suffix(text, self.TAG + "[")
            return text[: len(text) - keep], [], len(text) - keep
        try:
            value, end = _JSON.raw_decode(text, start + len(self.TAG))
        except ValueError:  # a list still being written, or not JSON
            return (text, [], len(text)) if final else (text[:start], [], start)
        calls = _calls_of(value, "arguments") if isinstance(value, list) else None
        if calls is None:
            return text, [], len(text)
        return text[:start] + text[end:], calls, len(text)

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            f"You can call these functions to answer the user:\n{_tools_listing(tools)}\n"
            f"To call them, reply with {self.TAG}" + '[{"name": <function name>, "arguments": <an object of arguments>}], '
            "one item per call. Otherwise answer in plain text."
        )

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Text, and at most one `functools[...]` (the one `scan` reads), its calls
        `{"name": ..., "arguments": ...}` with the arguments in their schema, separated by `, `
        (one where `parallel` is false); the output ends with the list."""
        start = self.TAG + "["
        calls = json_calls_tag(functions, parallel, ", ", "arguments", start, "]")
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [start], "stop_after_first": True,
                                                      "tags": [calls]}}

    def write(self, calls: list[Call]) -> str:
        return self.TAG + json.dumps(call_items(calls), ensure_ascii=False)


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

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Text whose first character past any whitespace is not `{` (content, as `scan` reads
        it), or only calls: `{"name": ..., "parameters": ...}` objects separated by `; ` (one
        where `parallel` is false), whitespace around them."""
        calls = json_calls_tag(functions, parallel, "; ", "parameters")
        space = {"type": "regex", "pattern": r"\s*"}
        return {"type": "structural_tag", "format": {"type": "or", "elements": [
            {"type": "regex", "pattern": r"\s*([^{\s][\s\S]*)?"},
            {"type": "sequence", "elements": [space, calls, space]},
        ]}}

    def write(self, calls: list[Call]) -> str:
        return "; ".join(json.dumps(item, ensure_ascii=False) for item in call_items(calls, "parameters"))


@_PARSERS.register("mistral")
class MistralParser(ToolParser):
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    MARKERS = (TAG, ARGS)
    TOKEN_TAG = True

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Text, then `[TOOL_CALLS]` (a `token` format: Mistral's tokenizers hold it as a
        special token) and calls held to their schemas, in either form the parser reads: the
        v3 form's JSON list of calls (as `write` writes it), or the v11 form's
        `NAME[ARGS]{...}`, each further call after `[TOOL_CALLS]` again (`[ARGS]` a token too);
        one call where `parallel` is false, and nothing after the calls."""
        v3 = json_calls_tag(functions, parallel, ", ", "arguments", "[", "]")
        named = {"type": "or", "elements": [{"type": "sequence", "elements": [
            const(f["name"]), token(self.ARGS), {"type": "json_schema", "json_schema": held_parameters(f)}]}
            for f in functions]}
        v11 = {"type": "sequence", "elements": [named, {"type": "star", "content": {
            "type": "sequence", "elements": [token(self.TAG), named]}}]} if parallel else named
        tag = {"type": "tag", "begin": token(self.TAG), "content": {"type": "or", "elements": [v3, v11]}, "end": ""}
        return {"type": "structural_tag", "format": {"type": "token_triggered_tags", "trigger_tokens": [self.TAG],
                                                      "tags": [tag], "stop_after_first": True}}

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.TAG)
        if start < 0:
            keep = 0 if final else partial_suffix(text, self.TAG)
            return text[: len(text) - keep], [], len(text) - keep
        after = text[start + len(self.TAG) :].lstrip()
        if after and after[0] != "[":  # v11: name[ARGS]{...}, the tag before each call
            calls, end, settled = self._named_calls(text, start + len(self.TAG), final)
        else:
            calls, end, settled = _json_calls(text, start + len(self.TAG), final, ",", "arguments")
        if not calls and settled:  # not calls after the tag: text
            return text, [], len(text)
        if not settled:
            return text[:start], calls, end
        return text[:start] + text[end:], calls, len(text)

    def _named_calls(self, text: str, at: int, final: bool) -> tuple[list[Call], int, bool]:
        """`NAME[ARGS]{...}` calls from `at` on, each after the first led by the tag: (calls,
        where they end, whether the rest is settled)."""
        calls: list[Call] = []
        pos = at
        while True:
            mark = text.find(self.ARGS, pos)
            if mark < 0:  # a name still being written (and perhaps the start of the marker)?
                tail = text[pos:]
                head = tail[: len(tail) - partial_suffix(tail, self.ARGS)].strip()
                return calls, pos, final or (head != "" and _NAME.fullmatch(head) is None)
            name = text[pos:mark].strip()
            if _NAME.fullmatch(name) is None:
                return calls, pos, True
            skip = mark + len(self.ARGS)
            while skip < len(text) and text[skip].isspace():
                skip += 1
            try:
                args, end = _JSON.raw_decode(text, skip)
            except ValueError:  # an object still being written, or not one
                return calls, pos, final or (skip < len(text) and text[skip] != "{")
            if not isinstance(args, dict):
                return calls, pos, True
            calls.append(tool_call(name, arguments_text(args)))
            rest = text[end:].lstrip()
            if rest.startswith(self.TAG):
                pos = len(text) - len(rest) + len(self.TAG)
            elif not final and self.TAG.startswith(rest):  # perhaps another call's tag
                return calls, end, rest == ""
            else:
                return calls, end, True

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = json.dumps(tools, ensure_ascii=False)
        return (
            f"[AVAILABLE_TOOLS] {listed} [/AVAILABLE_TOOLS]\n"
            f"To call tools, reply with {self.TAG} followed by a JSON list of "
            '{"name": <function name>, "arguments": <an object of arguments>}, one item per call. '
            "Otherwise answer in plain text."
        )

    def write(self, calls: list[Call]) -> str:
        return self.TAG + json.dumps(call_items(calls), ensure_ascii=False)


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
        calls = [_python_call(node) for node in tree.elts]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t) for t in tools)
        return (
            "You can call these functions to answer the user:\n"
            f"{listed}\n"
            "To call them, reply with only a Python list of calls with keyword arguments, e.g. "
            '[func_name1(param1="value1", param2=2), func_name2(param=True)]. '
            "Otherwise answer in plain text."
        )

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Text that does not open with `[` (content, as `scan` reads it), or only a list of
        calls with keyword arguments, each value a Python literal of its parameter's schema
        (conveyor/structured/python_calls.py)."""
        from conveyor.structured.python_calls import python_calls_grammar

        grammar = python_calls_grammar([(f["name"], held_parameters(f)) for f in functions], parallel)
        return {"type": "structural_tag", "format": {"type": "grammar", "grammar": grammar}}

    def write(self, calls: list[Call]) -> str:
        def one(c: Call) -> str:
            args = arguments_object(c["function"].get("arguments"))
            kwargs = ", ".join(f"{k}={v!r}" for k, v in args.items()) if isinstance(args, dict) else ""
            return f"{c['function']['name']}({kwargs})"

        return "[" + ", ".join(one(c) for c in calls) + "]"


@_PARSERS.register("llama4_pythonic")
class Llama4PythonicParser(PythonicParser):
    """Llama 4: `pythonic`'s list of calls, which Llama 4 may open with `<|python_start|>` (and
    close with `<|python_end|>`, dropped wherever it is), as vLLM's reader takes them."""

    START, END = "<|python_start|>", "<|python_end|>"
    MARKERS = (START, END)
    TOKEN_TAG = True

    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        if body.startswith(self.START):
            if not final:
                return "", [], 0  # the list is read whole
            inner = body[len(self.START) :].replace(self.END, "")
            calls = self._calls(inner.strip())
            return ("", calls, len(text)) if calls else (inner, [], len(text))
        if not final and body and self.START.startswith(body):  # `<|pyth`: wait
            return "", [], 0
        return super().scan(text, final)

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Text that does not open with `[` or `<` past any whitespace (content, as `scan` reads
        it), or only a list of held calls (`pythonic`'s), after `<|python_start|>` or not and
        before `<|python_end|>` or not (`token` formats)."""
        from conveyor.structured.python_calls import python_calls_grammar

        grammar = python_calls_grammar([(f["name"], held_parameters(f)) for f in functions], parallel, text=False)
        return {"type": "structural_tag", "format": {"type": "or", "elements": [
            {"type": "regex", "pattern": r"\s*([^\[<\s][\s\S]*)?"},
            {"type": "sequence", "elements": [
                {"type": "regex", "pattern": r"\s*"}, {"type": "optional", "content": token(self.START)},
                {"type": "grammar", "grammar": grammar}, {"type": "optional", "content": token(self.END)}]},
        ]}}


class _JsonNames(ast.NodeTransformer):
    """`null`, `true` and `false` as the constants they are in JSON (OLMo 3 writes them so)."""

    VALUES: ClassVar[dict[str, Any]] = {"null": None, "true": True, "false": False}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Constant(self.VALUES[node.id]) if node.id in self.VALUES else node


def _python_call(node: ast.AST, json_names: bool = False) -> Call | None:
    """A Python call with keyword arguments, each a literal (with `json_names`, also `null`,
    `true`, `false`), as a tool call; None for anything else."""
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
        return None
    try:
        args = {kw.arg: ast.literal_eval(_JsonNames().visit(kw.value) if json_names else kw.value)
                for kw in node.keywords if kw.arg is not None}
    except ValueError:
        return None
    if len(args) != len(node.keywords):  # a **kwargs
        return None
    return tool_call(ast.unparse(node.func), json.dumps(args, ensure_ascii=False))


@_PARSERS.register("olmo3")
class Olmo3Parser(ToolParser):
    """Ai2's OLMo 3: a `<function_calls>` block that opens the output, holding one Python call
    with keyword arguments a line (values Python or JSON literals: `True` or `true`); the text
    after the block is content. An output that does not open with the block is text, as vLLM's
    streaming reader has it."""

    OPEN, CLOSE = "<function_calls>", "</function_calls>"
    MARKERS = (OPEN, CLOSE)
    TOKEN_TAG = True

    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        if not body.startswith(self.OPEN):
            if not final and self.OPEN.startswith(body):  # nothing yet, or the block's beginning
                return "", [], 0
            return text, [], len(text)
        at = len(text) - len(body) + len(self.OPEN)
        end = text.find(self.CLOSE, at)
        if end < 0 and not final:
            return "", [], 0  # the block is read whole
        calls = self._calls(text[at : end if end >= 0 else len(text)])
        if calls is None:
            return text, [], len(text)
        return text[end + len(self.CLOSE) :] if end >= 0 else "", calls, len(text)

    @staticmethod
    def _calls(inner: str) -> list[Call] | None:
        lines = [line.strip() for line in inner.splitlines() if line.strip()]
        calls = []
        for line in lines:
            try:
                node = ast.parse(line, mode="eval").body
            except SyntaxError:
                return None
            call = _python_call(node, json_names=True)
            if call is None:
                return None
            calls.append(call)
        return calls or None

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            f"You can call these functions to answer the user:\n{_tools_listing(tools)}\n"
            f"To call them, reply with only {self.OPEN}, then one Python call with keyword arguments a line, "
            f'e.g. get_weather(city="Paris"), then {self.CLOSE}. Otherwise answer in plain text.'
        )

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Text whose first character past any whitespace is not `<` (content, as `scan` reads
        it), or the `<function_calls>` block (`token` formats) of calls held to their schemas, one
        a line (one call where `parallel` is false), each value a Python literal of its schema
        (conveyor/structured/python_calls.py), then any text."""
        from conveyor.structured.python_calls import python_call_lines_grammar

        lines = python_call_lines_grammar([(f["name"], held_parameters(f)) for f in functions], parallel)
        block = {"type": "tag", "begin": token(self.OPEN), "content": {"type": "grammar", "grammar": lines},
                 "end": token(self.CLOSE)}
        return {"type": "structural_tag", "format": {"type": "or", "elements": [
            {"type": "regex", "pattern": r"\s*([^<\s][\s\S]*)?"},
            {"type": "sequence", "elements": [{"type": "regex", "pattern": r"\s*"}, block,
                                              {"type": "regex", "pattern": r"[\s\S]*"}]},
        ]}}

    def write(self, calls: list[Call]) -> str:
        def one(c: Call) -> str:
            args = arguments_object(c["function"].get("arguments"))
            kwargs = ", ".join(f"{k}={v!r}" for k, v in args.items()) if isinstance(args, dict) else ""
            return f"{c['function']['name']}({kwargs})"

        return self.OPEN + "\n".join(one(c) for c in calls) + self.CLOSE


def _tools_listing(tools: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


def _only_space_between(text: str, spans: list[tuple[int, int]]) -> bool:
    """Whether `text` holds nothing but whitespace outside `spans` (sorted, disjoint)."""
    at = 0
    for a, b in spans:
        if text[at:a].strip():
            return False
        at = b
    return not text[at:].strip()


@_PARSERS.register("qwen3_coder")
class Qwen3CoderParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    MARKERS = (OPEN, CLOSE, "<function=", "</function>", "<parameter=", "</parameter>")
    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)

    def scan(self, text: str, final: bool) -> Scan:
        return _blocks(text, final, self.OPEN, self.CLOSE, self._read)

    def _read(self, inner: str) -> list[Call] | None:
        m = self._FUNCTION.fullmatch(inner)
        if m is None or _NAME.fullmatch(m.group(1).strip()) is None:
            return None
        body = m.group(2)
        params = list(self._PARAMETER.finditer(body))
        if not _only_space_between(body, [p.span() for p in params]):
            return None
        args = {}
        for p in params:
            value = p.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[p.group(1).strip()] = _typed_value(m.group(1).strip(), p.group(1).strip(), value)
        return [tool_call(m.group(1).strip(), json.dumps(args, ensure_ascii=False))]

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            "# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
            f"{_tools_listing(tools)}\n</tools>\n\n"
            f"If you choose to call a function, reply in the following format:\n\n{self.OPEN}\n"
            "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
            f"</function>\n{self.CLOSE}\n\nOtherwise answer in plain text."
        )

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Free text, and from each `<tool_call>` one call, `<function=NAME>` and its parameters
        as XML, each value held to its schema (the `qwen_xml` style of a structural tag)."""
        tags = [{"type": "tag", "begin": f"{self.OPEN}\n<function={f['name']}>\n", "end": f"</function>\n{self.CLOSE}",
                 "content": {"type": "json_schema", "json_schema": held_parameters(f), "style": "qwen_xml"}}
                for f in functions]
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [self.OPEN], "tags": tags,
                                                      "stop_after_first": not parallel}}

    def write(self, calls: list[Call]) -> str:
        def one(c: Call) -> str:
            params = "".join(f"<parameter={k}>\n{_text_of(v)}\n</parameter>\n"
                             for k, v in (_object_args(c) or {}).items())
            return f"{self.OPEN}\n<function={c['function']['name']}>\n{params}</function>\n{self.CLOSE}"

        return "\n".join(one(c) for c in calls)


@_PARSERS.register("qwen3_xml")
class Qwen3XmlParser(Qwen3CoderParser):
    """vLLM's other name for Qwen3-Coder's format (its streaming XML reader): the same calls."""


@_PARSERS.register("seed_oss")
class SeedOssParser(Qwen3CoderParser):
    """ByteDance Seed-OSS: Qwen3-Coder's XML calls in `<seed:tool_call>` blocks."""

    OPEN, CLOSE = "<seed:tool_call>", "</seed:tool_call>"
    # (Qwen3-Coder's strict tag with these blocks; none where Seed-OSS's tokenizer holds one as a
    # special token)
    MARKERS = (OPEN, CLOSE, "<function=", "</function>", "<parameter=", "</parameter>")


@_PARSERS.register("glm45")
class Glm45Parser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    KEY, VALUE = ("<arg_key>", "</arg_key>"), ("<arg_value>", "</arg_value>")
    MARKERS = (OPEN, CLOSE, *KEY, *VALUE)
    TOKEN_TAG = True
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def scan(self, text: str, final: bool) -> Scan:
        return _blocks(text, final, self.OPEN, self.CLOSE, self._read)

    def _read(self, inner: str) -> list[Call] | None:
        cut = inner.find("<arg_key>")
        name = (inner if cut < 0 else inner[:cut]).strip()
        if _NAME.fullmatch(name) is None:
            return None
        rest = "" if cut < 0 else inner[cut:]
        pairs = list(self._PAIR.finditer(rest))
        if not _only_space_between(rest, [p.span() for p in pairs]):
            return None
        args = {p.group(1).strip(): _typed_value(name, p.group(1).strip(), p.group(2)) for p in pairs}
        return [tool_call(name, json.dumps(args, ensure_ascii=False))]

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{_tools_listing(tools)}\n</tools>\n\nFor each function call, reply with:\n"
            "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
            "...\n</tool_call>"
        )

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Free text, and from each `<tool_call>` one call: the function's name on a line,
        then its arguments as `<arg_key>` / `<arg_value>` pairs held to its parameters (in the
        schema's order, the required ones always: `glm_arguments`), one block where `parallel`
        is false. Every marker is a `token` format: GLM-4.5's tokenizer holds them as tokens."""
        tags = [{"type": "tag", "begin": token(self.OPEN), "end": token(self.CLOSE), "content": {
                    "type": "sequence", "elements": [const(f"{f['name']}\n"), *self.arguments(held_parameters(f))]}}
                for f in functions]
        return {"type": "structural_tag", "format": {"type": "token_triggered_tags", "trigger_tokens": [self.OPEN],
                                                      "tags": tags, "stop_after_first": not parallel}}

    def arguments(self, schema: Any) -> list[dict[str, Any]]:
        """Formats of an object's properties as `<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n`
        pairs, as the parser reads them: each property in the schema's order, the required ones
        always; a value is raw text for a string (or a property of no type), one of the literals
        for an enum or const of strings, else the JSON of its schema. An object with no
        properties takes any pairs. A string's length, pattern and format are not held."""
        def pair(key: dict[str, Any], value: dict[str, Any]) -> dict[str, Any]:
            return {"type": "sequence", "elements": [
                {"type": "tag", "begin": token(self.KEY[0]), "content": key, "end": token(self.KEY[1])}, const("\n"),
                {"type": "tag", "begin": token(self.VALUE[0]), "content": value, "end": token(self.VALUE[1])}, const("\n")]}

        text = {"type": "any_text", "excludes": [self.VALUE[1], self.CLOSE]}
        props = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(props, dict) or not props:
            return [{"type": "star", "content": pair({"type": "any_text", "excludes": [self.KEY[1]]}, text)}]
        required = set(schema.get("required", []))
        out = []
        for key, sub in props.items():
            one = pair(const(key), _glm_value(sub, text))
            out.append(one if key in required else {"type": "optional", "content": one})
        return out

    def write(self, calls: list[Call]) -> str:
        def one(c: Call) -> str:
            pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_text_of(v)}</arg_value>\n"
                            for k, v in (_object_args(c) or {}).items())
            return f"{self.OPEN}{c['function']['name']}\n{pairs}{self.CLOSE}"

        return "\n".join(one(c) for c in calls)


def _glm_value(sub: Any, text: dict[str, Any]) -> dict[str, Any]:
    """The format of one `<arg_value>`: `text` for a string, the literals of an enum or const of
    strings, the JSON of any other schema."""
    if not isinstance(sub, dict):
        return text
    literals = sub["enum"] if isinstance(sub.get("enum"), list) else [sub["const"]] if "const" in sub else None
    if literals is not None and all(isinstance(v, str) for v in literals):
        return {"type": "or", "elements": [const(v) for v in literals]} if literals else text
    kind = sub.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    if literals is None and (not kinds or "string" in kinds):
        return text
    return {"type": "json_schema", "json_schema": sub}


class _SectionParser(ToolParser):
    """Calls inside one section's begin and end tokens, each call between its own."""

    SECTION: ClassVar[tuple[str, str]]
    CALL: ClassVar[tuple[str, str]]

    def scan(self, text: str, final: bool) -> Scan:
        return _blocks(text, final, *self.SECTION, self._read)

    def _read(self, inner: str) -> list[Call] | None:
        begin, end = self.CALL
        spans: list[tuple[int, int]] = []
        calls: list[Call] = []
        at = 0
        while (start := inner.find(begin, at)) >= 0:
            stop = inner.find(end, start)
            if stop < 0:
                return None
            call = self._call(inner[start + len(begin) : stop])
            if call is None:
                return None
            calls.append(call)
            spans.append((start, stop + len(end)))
            at = stop + len(end)
        return calls if calls and _only_space_between(inner, spans) else None

    @abstractmethod
    def _call(self, body: str) -> Call | None: ...


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@_PARSERS.register("deepseek_v3")
class DeepSeekV3Parser(_SectionParser):
    SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    CALL = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
    SEP = "<｜tool▁sep｜>"
    MARKERS = (*SECTION, *CALL, SEP)
    TOKEN_TAG = True
    _FENCED = re.compile(r"\s*([^\n]+?)\s*\n```(?:json)?\s*\n(.*?)\n?```\s*", re.S)

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Free text, then one section of calls held to their schemas (one where `parallel` is
        false, else any, a newline or none between), each in either form the parser reads: V3's
        and R1's `function<sep>NAME` and a fenced JSON block, or V3.1's `NAME<sep>` and the JSON;
        markers as `token` formats."""
        def forms(f: dict[str, Any]) -> dict[str, Any]:
            args = {"type": "json_schema", "json_schema": held_parameters(f)}
            return {"type": "or", "elements": [
                {"type": "sequence", "elements": [const("function"), token(self.SEP),
                                                  const(f"{f['name']}\n```json\n"), args, const("\n```")]},
                {"type": "sequence", "elements": [const(f["name"]), token(self.SEP), args]}]}

        call = {"type": "or", "elements": [{"type": "tag", "begin": token(self.CALL[0]), "content": forms(f),
                                            "end": token(self.CALL[1])} for f in functions]}
        return triggered_section(*self.SECTION, one_or_more(call, parallel, "\n?"))

    def _call(self, body: str) -> Call | None:
        kind, sep, rest = body.partition(self.SEP)
        if not sep:
            return None
        if kind.strip() == "function":  # V3 / R1: the name, then a fenced JSON block
            m = self._FENCED.fullmatch(rest)
            name, args = (m.group(1), _json_object(m.group(2))) if m else ("", None)
        else:  # V3.1: the name before the separator, the JSON after it
            name, args = kind.strip(), _json_object(rest)
        if args is None or _NAME.fullmatch(name) is None:
            return None
        return tool_call(name, json.dumps(args, ensure_ascii=False))

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            "## Tools\nYou have access to the following tools:\n\n"
            f"{_tools_listing(tools)}\n\n"
            "To call tools, reply with:\n"
            f"{self.SECTION[0]}{self.CALL[0]}tool_call_name{self.SEP}tool_call_arguments{self.CALL[1]}"
            f"...{self.SECTION[1]}\nwhere tool_call_arguments is a JSON object. Otherwise answer in plain text."
        )

    def write(self, calls: list[Call]) -> str:
        body = "".join(f"{self.CALL[0]}{c['function']['name']}{self.SEP}"
                       f"{json.dumps(_object_args(c) or {}, ensure_ascii=False)}{self.CALL[1]}" for c in calls)
        return f"{self.SECTION[0]}{body}{self.SECTION[1]}"


@_PARSERS.register("kimi_k2")
class KimiK2Parser(_SectionParser):
    SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    CALL = ("<|tool_call_begin|>", "<|tool_call_end|>")
    ARGS = "<|tool_call_argument_begin|>"
    MARKERS = (*SECTION, *CALL, ARGS)
    TOKEN_TAG = True

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Free text, then one section of calls held to their schemas (one where `parallel` is
        false), each `functions.NAME:INDEX`, the argument token and the JSON; markers as
        `token` formats (Kimi-K2's tokenizer holds them as special tokens)."""
        call = {"type": "or", "elements": [{"type": "tag", "begin": token(self.CALL[0]), "end": token(self.CALL[1]),
                                            "content": {"type": "sequence", "elements": [
                                                const(f"functions.{f['name']}:"), {"type": "regex", "pattern": "[0-9]+"},
                                                token(self.ARGS),
                                                {"type": "json_schema", "json_schema": held_parameters(f)}]}}
                                           for f in functions]}
        return triggered_section(*self.SECTION, one_or_more(call, parallel))

    def _call(self, body: str) -> Call | None:
        ident, sep, rest = body.partition(self.ARGS)
        name = ident.strip().removeprefix("functions.").rsplit(":", 1)[0]
        args = _json_object(rest) if sep else None
        if args is None or _NAME.fullmatch(name) is None:
            return None
        return tool_call(name, json.dumps(args, ensure_ascii=False))

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            f"You can call these tools:\n{_tools_listing(tools)}\n\nTo call tools, reply with:\n"
            f"{self.SECTION[0]}{self.CALL[0]}functions.NAME:0{self.ARGS}"
            '{"argument": "value"}'
            f"{self.CALL[1]}{self.SECTION[1]}\nnumbering the calls from 0. Otherwise answer in plain text."
        )

    def write(self, calls: list[Call]) -> str:
        body = "".join(f"{self.CALL[0]}functions.{c['function']['name']}:{i}{self.ARGS}"
                       f"{json.dumps(_object_args(c) or {}, ensure_ascii=False)}{self.CALL[1]}"
                       for i, c in enumerate(calls))
        return f"{self.SECTION[0]}{body}{self.SECTION[1]}"


class _Invokes:
    """Calls as XML invocations: `<{ns}invoke name="NAME">` holding
    `<{ns}parameter name="KEY">VALUE</{ns}parameter>` elements, `</{ns}invoke>` (Step-3's with
    `ns="steptml:"`, MiniMax-M2's with none). A value is typed by the request's schema, stripped of
    the whitespace around it; `value_text` is what a strict tag holds a string's value to. With
    `typed` (DeepSeek-V3.2's DSML), each parameter says `string="true"` (its text is the string,
    whole) or `string="false"` (its text is JSON)."""

    def __init__(self, ns: str, value_text: dict[str, Any], typed: bool = False) -> None:
        self.ns, self.value_text, self.typed = ns, value_text, typed
        self._invoke = re.compile(rf'\s*<{ns}invoke name=["\']?([^"\'>]+)["\']?>(.*?)</{ns}invoke>\s*', re.S)
        self._parameter = re.compile(
            rf'<{ns}parameter name=["\']?([^"\'>]+?)["\']?(?:\s+string=["\']?(true|false)["\']?)?>(.*?)</{ns}parameter>',
            re.S)

    def read(self, text: str) -> list[Call] | None:
        """One or more invocations with only whitespace around them, as calls (None: not so)."""
        calls: list[Call] = []
        spans = []
        for m in self._invoke.finditer(text):
            name, body = m.group(1).strip(), m.group(2)
            params = list(self._parameter.finditer(body))
            if _NAME.fullmatch(name) is None or not _only_space_between(body, [p.span() for p in params]):
                return None
            args = {p.group(1).strip(): self._value(name, p.group(1).strip(), p.group(2), p.group(3)) for p in params}
            calls.append(tool_call(name, json.dumps(args, ensure_ascii=False)))
            spans.append(m.span())
        return calls if calls and _only_space_between(text, spans) else None

    def _value(self, function: str, key: str, kind: str | None, text: str) -> Any:
        if kind == "true":  # (DSML: the string, whole)
            return text
        if kind == "false":
            try:
                return json.loads(text)
            except ValueError:
                pass
        return _typed_value(function, key, text.strip())

    def write(self, name: str, args: dict[str, Any]) -> str:
        def text(v: Any) -> str:  # (a value is read stripped: a string with spaces around it as JSON)
            written = _text_of(v)
            return json.dumps(v, ensure_ascii=False) if isinstance(v, str) and written.strip() != written else written

        def param(k: str, v: Any) -> str:
            if not self.typed:
                return f'<{ns}parameter name="{k}">{text(v)}</{ns}parameter>'
            if isinstance(v, str):
                return f'<{ns}parameter name="{k}" string="true">{v}</{ns}parameter>'
            return f'<{ns}parameter name="{k}" string="false">{json.dumps(v, ensure_ascii=False)}</{ns}parameter>'

        ns = self.ns
        params = "".join(param(k, v) for k, v in args.items())
        return f'<{ns}invoke name="{name}">{params}</{ns}invoke>'

    def held(self, f: dict[str, Any], space: str = "") -> dict[str, Any]:
        """The format of one call of `f` held to its schema: its parameters in the schema's
        order, the required ones always, `space` (a regular expression) around each element; a
        string's value `value_text`, an enum's its literal, other types their JSON (a string's
        length, pattern and format not held)."""
        ns = self.ns
        gap = [{"type": "regex", "pattern": space}] if space else []

        def parameter(key: dict[str, Any], value: dict[str, Any], any_kind: bool = False) -> dict[str, Any]:
            close = const('">')
            if self.typed and any_kind:  # (a free object's parameter: text either way)
                close = {"type": "regex", "pattern": '" string="(true|false)">'}
            elif self.typed:  # (a string's text, an enum's literal: string="true"; JSON: "false")
                close = const('" string="false">' if value.get("type") == "json_schema" else '" string="true">')
            return {"type": "sequence", "elements": [*gap, const(f'<{ns}parameter name="'), key, close, value,
                                                     const(f"</{ns}parameter>")]}

        schema = held_parameters(f)
        props = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(props, dict) or not props:
            params = [{"type": "star", "content": parameter({"type": "regex", "pattern": '[^"<>]+'}, self.value_text,
                                                            any_kind=True)}]
        else:
            required = set(schema.get("required", []))
            params = []
            for key, sub in props.items():
                one = parameter(const(key), _glm_value(sub, self.value_text))
                params.append(one if key in required else {"type": "optional", "content": one})
        return {"type": "sequence", "elements": [const(f'<{ns}invoke name="{f["name"]}">'), *params, *gap,
                                                 const(f"</{ns}invoke>")]}


@_PARSERS.register("step3")
class Step3Parser(_SectionParser):
    """StepFun Step-3: a section of calls, each `function<｜tool_sep｜>` and a
    `<steptml:invoke name="NAME">` holding `<steptml:parameter name="KEY">VALUE</steptml:parameter>`
    elements; a value is typed by the request's schema (stripped of surrounding whitespace)."""

    SECTION = ("<｜tool_calls_begin｜>", "<｜tool_calls_end｜>")
    CALL = ("<｜tool_call_begin｜>", "<｜tool_call_end｜>")
    SEP = "<｜tool_sep｜>"
    MARKERS = (*SECTION, *CALL, SEP)
    TOKEN_TAG = True
    INVOKES = _Invokes("steptml:", {"type": "regex", "pattern": "[^<]*"})  # (vLLM's reading: no `<`)

    def _call(self, body: str) -> Call | None:
        kind, sep, rest = body.partition(self.SEP)
        calls = self.INVOKES.read(rest) if sep and kind.strip() == "function" else None
        return calls[0] if calls is not None and len(calls) == 1 else None

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        example = self.INVOKES.write("NAME", {"KEY": "VALUE"})
        return (
            f"You can call these tools:\n{_tools_listing(tools)}\n\nTo call tools, reply with:\n"
            f"{self.SECTION[0]}{self.CALL[0]}function{self.SEP}{example}{self.CALL[1]}...{self.SECTION[1]}\n"
            "one parameter element for each argument. Otherwise answer in plain text."
        )

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Free text, then one section of calls (one where `parallel` is false), each held to its
        function's schema (`_Invokes.held`: a string's value text without `<`); markers as
        `token` formats."""
        call = {"type": "or", "elements": [{"type": "tag", "begin": token(self.CALL[0]), "end": token(self.CALL[1]),
                                            "content": {"type": "sequence", "elements": [
                                                const("function"), token(self.SEP), self.INVOKES.held(f)]}}
                                           for f in functions]}
        return triggered_section(*self.SECTION, one_or_more(call, parallel, "\n?"))

    def write(self, calls: list[Call]) -> str:
        body = "".join(f"{self.CALL[0]}function{self.SEP}"
                       f"{self.INVOKES.write(c['function']['name'], _object_args(c) or {})}{self.CALL[1]}" for c in calls)
        return f"{self.SECTION[0]}{body}{self.SECTION[1]}"


@_PARSERS.register("minimax_m2")
class MinimaxM2Parser(ToolParser):
    """MiniMax-M2: `<minimax:tool_call>` blocks of `<invoke name="NAME">` calls, each holding
    `<parameter name="KEY">VALUE</parameter>` elements, text around the blocks; a value is typed
    by the request's schema (stripped of surrounding whitespace)."""

    OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
    MARKERS: ClassVar[tuple[str, ...]] = (OPEN, CLOSE)
    TOKEN_TAG = True
    INVOKES = _Invokes("", {"type": "any_text", "excludes": ["</parameter>"]})

    def scan(self, text: str, final: bool) -> Scan:
        return _blocks(text, final, self.OPEN, self.CLOSE, self.INVOKES.read)

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        example = self.INVOKES.write("NAME", {"KEY": "VALUE"})
        return (
            f"You can call these tools:\n{_tools_listing(tools)}\n\nTo call tools, reply with:\n"
            f"{self.OPEN}\n{example}\n...\n{self.CLOSE}\n"
            "one invoke element a call, one parameter element for each argument. Otherwise answer in plain text."
        )

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Free text, then one `<minimax:tool_call>` block (its markers `token` formats) of calls
        held to their schemas (`_Invokes.held`), whitespace between the elements, one call where
        `parallel` is false; nothing after the block."""
        call = {"type": "or", "elements": [self.INVOKES.held(f, r"\s*") for f in functions]}
        calls = one_or_more(call, parallel, r"\s*")
        space = {"type": "regex", "pattern": r"\s*"}
        return self._section({"type": "sequence", "elements": [space, calls, space]})

    def _section(self, body: dict[str, Any]) -> dict[str, Any]:
        """The one block of calls after free text, its markers `token` formats."""
        return triggered_section(self.OPEN, self.CLOSE, body)

    def write(self, calls: list[Call]) -> str:
        body = "\n".join(self.INVOKES.write(c["function"]["name"], _object_args(c) or {}) for c in calls)
        return f"{self.OPEN}\n{body}\n{self.CLOSE}"


@_PARSERS.register("deepseek_v32")
class DeepSeekV32Parser(MinimaxM2Parser):
    """DeepSeek-V3.2's DSML: a `<｜DSML｜function_calls>` block of `<｜DSML｜invoke name="NAME">`
    calls, each holding `<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>`
    elements (a string's text whole, or JSON), text before the block."""

    OPEN, CLOSE = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>"
    MARKERS = ("｜DSML｜",)
    TOKEN_TAG = False
    INVOKES = _Invokes("｜DSML｜", {"type": "any_text", "excludes": ["</｜DSML｜parameter>"]}, typed=True)

    def _section(self, body: dict[str, Any]) -> dict[str, Any]:
        """MiniMax-M2's strict tag with the block's markers as text (a string's value any text
        up to its closing tag): where the tokenizer holds `｜DSML｜` as a special token, the calls
        stay free."""
        block = {"type": "tag", "begin": self.OPEN, "content": body, "end": self.CLOSE}
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [self.OPEN],
                                                      "tags": [block], "stop_after_first": True}}


# The harmony format's markers (each one special token of gpt-oss's vocabulary; the
# `openai_gptoss` reasoning parser reads them too).
START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN = (
    "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")


def harmony_call(recipient: str, arguments: str) -> str:
    """A harmony tool call as the `openai_gptoss` reasoning parser passes it on in the content."""
    return f"{CHANNEL}commentary to={recipient} {CONSTRAIN}json{MESSAGE}{arguments}{CALL}"


@_PARSERS.register("openai")
class HarmonyParser(ToolParser):
    OPEN, CLOSE = f"{CHANNEL}commentary to=", CALL
    MARKERS = (START, CHANNEL, MESSAGE, END, CONSTRAIN)
    TOKEN_TAG = True
    HOLDS_MESSAGES = True

    def strict_tag(self, functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """The whole output as harmony messages: any number of `analysis` and `commentary`
        messages (each `<|channel|>NAME<|message|>`, its text, `<|end|>`, then
        `<|start|>assistant` before the next), and last a `final` message (its text to the end)
        or a call: `<|channel|>commentary to=functions.NAME [<|constrain|>json]<|message|>` (or,
        after `<|start|>assistant`, ` to=functions.NAME<|channel|>commentary ...`) and the
        arguments held to the function's schema, where the output ends (its `<|call|>`). One
        call a turn, as gpt-oss makes them; every marker a `token` format."""
        def text_message(channel: str) -> dict[str, Any]:
            return {"type": "sequence", "elements": [token(CHANNEL), const(channel), {
                "type": "tag", "begin": token(MESSAGE), "content": {"type": "any_text"}, "end": token(END)}]}

        json_header = {"type": "optional", "content": {"type": "sequence", "elements": [
            const(" "), token(CONSTRAIN), const("json")]}}

        def arguments(f: dict[str, Any]) -> list[dict[str, Any]]:
            return [json_header, token(MESSAGE), {"type": "json_schema", "json_schema": held_parameters(f)}]

        call = {"type": "or", "elements": [{"type": "sequence", "elements": [
            token(CHANNEL), const(f"commentary to=functions.{f['name']}"), *arguments(f)]} for f in functions]}
        addressed = {"type": "or", "elements": [{"type": "sequence", "elements": [
            const(f" to=functions.{f['name']}"), token(CHANNEL), const("commentary"), *arguments(f)]}
            for f in functions]}
        final = {"type": "sequence", "elements": [token(CHANNEL), const("final"), token(MESSAGE), {"type": "any_text"}]}
        message = {"type": "or", "elements": [text_message("analysis"), text_message("commentary")]}
        start = {"type": "sequence", "elements": [token(START), const("assistant")]}
        last = {"type": "optional", "content": {"type": "sequence", "elements": [
            start, {"type": "or", "elements": [final, call, addressed]}]}}
        return {"type": "structural_tag", "format": {"type": "or", "elements": [
            final, call,
            {"type": "sequence", "elements": [
                message, {"type": "star", "content": {"type": "sequence", "elements": [start, message]}}, last]},
        ]}}

    def scan(self, text: str, final: bool) -> Scan:
        return _blocks(text, final, self.OPEN, self.CLOSE, self._read)

    @staticmethod
    def _read(inner: str) -> list[Call] | None:
        header, sep, body = inner.partition(MESSAGE)
        recipient = header.split(maxsplit=1)[0] if header.strip() else ""
        name = recipient.removeprefix("functions.")
        args = _json_object(body) if sep else None
        if not recipient.startswith("functions.") or args is None or _NAME.fullmatch(name) is None:
            return None
        return [tool_call(name, json.dumps(args, ensure_ascii=False))]

    def prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            f"You can call these tools:\n{_tools_listing(tools)}\n\nTo call a tool, send a message on the "
            f"commentary channel to it: {self.OPEN}functions.NAME {CONSTRAIN}json{MESSAGE}"
            '{"argument": "value"}'
            f"{self.CLOSE}\nOtherwise answer in plain text."
        )

    def write(self, calls: list[Call]) -> str:
        return "".join(harmony_call(f"functions.{c['function']['name']}",
                                    json.dumps(_object_args(c) or {}, ensure_ascii=False)) for c in calls)


# vLLM's other names for the same formats: DeepSeek-V3.1's calls (read by `deepseek_v3`), and
# Llama 4's JSON calls (Llama 3's form).
_PARSERS.alias("deepseek_v31", DeepSeekV3Parser)
_PARSERS.alias("llama4_json", Llama3JsonParser)
