"""Tool calling on the chat API (`conveyor/server/tools.py`): the Hermes parser against
random texts and random chunkings of their streams, the history written for templates with
and without tool support, and over HTTP on SmolLM2 each `tool_choice`, streamed and whole."""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import InvalidRequestError
from conveyor.server.tool_parsers import make_tool_parser, tool_schemas
from conveyor.server.tools import Tools, ToolStream, history_for_template, parse_hermes

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 60}},
                   "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]


def test_hermes_calls_and_the_text_around_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>[{"name": "search", "arguments": {"query": "x"}}, {"name": "f", "parameters": {}}]</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("search", {"query": "x"}), ("f", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 3
    # not a call: bad JSON or no name stays text; an unclosed block at the end is read to the end
    assert parse_hermes("a <tool_call>{oops}</tool_call> b") == ("a <tool_call>{oops}</tool_call> b", [])
    assert parse_hermes('<tool_call>{"args": 1}</tool_call>')[1] == []
    content, calls = parse_hermes('Sure <tool_call>{"name": "search", "arguments": {"query": "q"}}')
    assert content == "Sure" and calls[0]["function"]["name"] == "search"
    assert parse_hermes("no calls at all") == ("no calls at all", [])


CALL = st.builds(
    lambda name, args: f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>',
    st.sampled_from(["get_weather", "search"]),
    st.dictionaries(st.sampled_from(["city", "query"]), st.text(max_size=6), max_size=2),
)
PIECE = st.one_of(CALL, st.text(alphabet="ab <>/_tolc\n", max_size=12), st.just("<tool_c"), st.just("<tool_call>{bad}</tool_call>"))


def check_stream_cut(tools: Tools, text: str, data: st.DataObject) -> None:
    """`text` streamed in random pieces gives the calls and the content of the whole."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = ToolStream(tools)
    content, calls = "", []
    for i, chunk in enumerate(chunks):
        delta = stream.feed(chunk, final=i == len(chunks) - 1)
        content += delta.get("content", "")
        for c in delta.get("tool_calls", []):
            assert c["index"] == len(calls)
            calls.append((c["function"]["name"], c["function"]["arguments"]))
    want_content, want_calls = tools.calls(text)
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]
    assert (content.strip() if calls else content) == (want_content or "")


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECE, max_size=6), st.data())
def test_a_stream_cut_anywhere_gives_the_calls_and_text_of_the_whole(pieces, data):
    check_stream_cut(Tools.parse(TOOLS, "auto", None), "".join(pieces), data)


def test_a_named_stream_sends_the_id_and_name_first_then_arguments():
    stream = ToolStream(Tools.parse(TOOLS, {"type": "function", "function": {"name": "search"}}, None))
    first = stream.feed('{"query"', final=False)["tool_calls"][0]
    assert first["function"] == {"name": "search", "arguments": '{"query"'} and first["id"].startswith("call_")
    assert stream.feed(': "x"}', final=True) == {"tool_calls": [{"index": 0, "function": {"arguments": ': "x"}'}}]}


@pytest.mark.parametrize(("tools", "choice", "why"), [
    ([], "required", "tool_choice needs tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}], None, "if"),
    ([{"type": "function", "function": {"name": ""}}], None, "1-64 letters"),
    ([{"type": "function", "function": {"name": "f"}}], {"type": "function", "function": {"name": "g"}}, "'g'"),
    ([{"type": "function", "function": {"name": "f"}}], "sometimes", "none, auto, required"),
])
def test_bad_tools_are_refused_naming_what(tools, choice, why):
    with pytest.raises(InvalidRequestError, match=why) as e:
        Tools.parse(tools, choice, None)
    assert e.value.param in ("tools", "tool_choice")


def test_the_required_schema_takes_calls_of_the_tools_only():
    tools = Tools.parse(TOOLS, "required", False)
    schema = json.loads(tools.constraint().json)
    jsonschema.validate([{"name": "search", "parameters": {"query": "x"}}], schema)
    for bad in ([], [{"name": "search", "parameters": {"city": 1}}], [{"name": "other", "parameters": {}}],
                [{"name": "search", "parameters": {"query": "x"}}] * 2):  # parallel_tool_calls=false: one
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    content, calls = tools.calls('[{"name": "search", "parameters": {"query": "x"}}]')
    assert content is None and calls[0]["function"] == {"name": "search", "arguments": '{"query": "x"}'}
    assert tools.calls('[{"name": "sea')[0] == '[{"name": "sea'  # cut short: the text as it is


def test_history_for_templates_with_and_without_tool_support():
    messages = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
    ]
    tools = Tools.parse(TOOLS, "auto", None)
    plain = history_for_template(messages, tools, "{{ message['content'] }}")
    assert plain[0]["content"].startswith("Be brief.\n\nYou are a function calling AI model")
    assert '"name": "get_weather"' in plain[0]["content"] and "<tools>" in plain[0]["content"]
    assert plain[2] == {"role": "assistant", "content":
                        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    aware = history_for_template(messages, tools, "{% if tools %}{{ tools }}{% endif %}{{ m.tool_calls }}")
    assert aware[0] == messages[0]  # the template shows the tools itself
    assert aware[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert history_for_template(messages, Tools.parse(TOOLS, "none", None), "")[0] == messages[0]


# -- over HTTP -------------------------------------------------------------------------------
MODEL = "SmolLM2-135M-Instruct"


def collect(stream: Any) -> tuple[str, dict[int, dict[str, str]], str | None]:
    content, calls, reason = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            entry = calls.setdefault(t.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] = t.id or entry["id"]
            entry["name"] = (t.function.name if t.function else None) or entry["name"]
            entry["arguments"] += (t.function.arguments if t.function else None) or ""
        reason = chunk.choices[0].finish_reason or reason
    return content, calls, reason


def test_a_named_function_is_called_with_arguments_in_its_schema(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                       max_tokens=60, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    content, calls, reason = collect(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0, stream=True))
    assert content == "" and reason == "stop" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments


def test_required_calls_one_or_more_tools_and_a_conversation_goes_on(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=80, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    for call in msg.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    content, calls, reason = collect(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0, stream=True))
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in msg.tool_calls]
    # The calls and the tool's answer go back in; the model answers in text.
    history = [*ASK, msg.model_dump(exclude_none=True),
               *({"role": "tool", "tool_call_id": c.id, "content": '{"temperature": 21, "sky": "clear"}'}
                 for c in msg.tool_calls)]
    r2 = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=20, temperature=0)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls


def strict(tool: dict[str, Any], value: bool = True) -> dict[str, Any]:
    """The tool marked strict (OpenAI's), its parameters closed to other properties, as a strict
    schema is (conveyor's grammar takes no property a schema does not list)."""
    fn = tool["function"]
    return {**tool, "function": {**fn, "strict": value, "parameters": {**fn["parameters"], "additionalProperties": False}}}


@functools.cache
def strict_automaton(parser: str, parallel: bool) -> Any:
    """The automaton of "auto" with a strict get_weather and a non-strict search under `parser`."""
    from conveyor.structured import compile_automaton

    tools = Tools.parse([strict(WEATHER), strict(SEARCH, False)], "auto", parallel, make_tool_parser(parser))
    assert tools is not None
    return compile_automaton(tools.constraint())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(CALL, st.text(alphabet="ab <>/_tolc\n", max_size=12), st.just("<tool_c")), max_size=4),
       st.booleans())
def test_auto_with_a_strict_function_holds_hermes_calls_to_their_schemas(pieces, newlines):
    """`tool_choice="auto"` with a strict function (vLLM's rule): free text, and every
    `<tool_call>` one call of a listed function whose arguments match its parameters, on lines
    of its own or not; the calls are the ones the Hermes parser then reads."""
    automaton = strict_automaton("hermes", True)
    if newlines:
        pieces = [p.replace("<tool_call>", "<tool_call>\n").replace("</tool_call>", "\n</tool_call>") for p in pieces]
    text = "".join(pieces)
    _, calls = parse_hermes(text)
    blocks = text.count("<tool_call>")
    weather = strict(WEATHER)["function"]["parameters"]
    valid = len(calls) == blocks and all(
        c["function"]["name"] == "search" or jsonschema.Draft202012Validator(weather).is_valid(
            json.loads(c["function"]["arguments"])) for c in calls)
    canonical = all(json.dumps({"name": n, "arguments": a}) in text for n, a in
                    ((c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls))
    if automaton.matches(text):
        assert valid, text
    elif valid and canonical and "<tool_c" not in text.replace("<tool_call>", ""):
        raise AssertionError(f"a text of valid calls refused: {text!r}")


def test_strict_auto_tags_only_where_asked():
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    from conveyor.structured import compile_automaton

    assert Tools.parse(TOOLS, "auto", None).constraint() is None  # no strict function
    one = Tools.parse([strict(WEATHER)], "auto", False).constraint()
    assert one is not None and compile_automaton(one).matches(call) and not compile_automaton(one).matches(call + call)
    many = compile_automaton(Tools.parse([strict(WEATHER)], "auto", True).constraint())
    assert many.matches(f"First {call}, then {call}.") and not many.matches(call.replace("Paris", "x" * 31))
    assert Tools.parse([strict(WEATHER)], "auto", None, make_tool_parser("pythonic")).constraint() is not None


LLAMA_CALL = st.builds(  # the arguments in the schemas' order (the grammar's JSON keeps it)
    lambda name, args: json.dumps({"name": name, "parameters": {k: args[k] for k in sorted(args, key=["city", "unit",
                                                                                                     "query"].index)}}),
    st.sampled_from(["get_weather", "search", "other"]),
    st.dictionaries(st.sampled_from(["city", "query", "unit"]), st.sampled_from(["Paris", "", "celsius", "x" * 31]),
                    max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(LLAMA_CALL, st.sampled_from(["; ", ";", " ", "\n", "ok", "{", "}", "Sure: "])), max_size=5),
       st.booleans())
def test_auto_with_a_strict_function_holds_llama3_json_calls_to_their_schemas(pieces, parallel):
    """Under `llama3_json`: what the automaton allows is text the parser reads as content, or
    calls it reads in full, each of a listed function with arguments its parameters allow (one
    where `parallel_tool_calls` is false); and calls written as the prompt asks are allowed."""
    parser = make_tool_parser("llama3_json")
    automaton = strict_automaton("llama3_json", parallel)
    text = "".join(pieces)
    content, calls = parser.parse(text)
    weather = strict(WEATHER)["function"]["parameters"]
    if automaton.matches(text):
        if text.strip().startswith("{"):
            assert calls and not (content or "").strip() and (parallel or len(calls) == 1), text
        for c in calls:
            args = json.loads(c["function"]["arguments"])
            assert c["function"]["name"] == "search" or jsonschema.Draft202012Validator(weather).is_valid(args), text
    written = [p for p in pieces if p.startswith('{"name": ')][: None if parallel else 1]
    if written and all(jsonschema.Draft202012Validator(SCHEMAS["get_weather"] if '"get_weather"' in p else
                                                       {"type": "object"}).is_valid(json.loads(p)["parameters"])
                       and '"other"' not in p and ('"get_weather"' not in p or '"query"' not in p) for p in written):
        assert automaton.matches("; ".join(written)), written
    assert automaton.matches("The weather is fine.") and automaton.matches("")


XML_ARGS = st.fixed_dictionaries({}, optional={"city": st.sampled_from(["Paris", "", "New\nYork", "a</function>"]),
                                              "unit": st.sampled_from(["celsius", "kelvin"]),
                                              "query": st.sampled_from(["x", "1"])})
XML_CALL = st.builds(lambda name, args: make_tool_parser("qwen3_coder").write(  # arguments in the schemas' order
    [{"type": "function", "function": {"name": name, "arguments": json.dumps(
        {k: args[k] for k in sorted(args, key=["city", "unit", "query"].index)})}}]),
    st.sampled_from(["get_weather", "search", "other"]), XML_ARGS)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(XML_CALL, st.sampled_from(["ok ", "\n", "<tool_call>", "<function=get_weather>", "</tool_call>"])),
                max_size=4), st.booleans())
def test_auto_with_a_strict_function_holds_qwen3_coder_calls_to_their_schemas(pieces, parallel):
    """Under `qwen3_coder`: what the automaton allows, the parser reads as text and calls, every
    `<tool_call>` block one call of a listed function, its arguments (typed by the parser from
    their text) in its parameters (one call where `parallel_tool_calls` is false); and calls
    written as the parser writes them, with text between, are allowed."""
    parser = make_tool_parser("qwen3_coder")
    automaton = strict_automaton("qwen3_coder", parallel)
    text = "".join(pieces)
    weather = strict(WEATHER)["function"]["parameters"]
    if automaton.matches(text):
        with tool_schemas([strict(WEATHER)["function"], strict(SEARCH, False)["function"]]):
            _, calls = parser.parse(text)
        assert len(calls) == text.count("<tool_call>") and (parallel or len(calls) <= 1), text
        for c in calls:
            args = json.loads(c["function"]["arguments"])
            assert c["function"]["name"] == "search" or jsonschema.Draft202012Validator(weather).is_valid(args), text
    written = [p for p in pieces if p.startswith("<tool_call>\n<function=")][: None if parallel else 1]
    valid = all("=other>" not in p and ("=get_weather>" not in p or (
        "<parameter=city>" in p and "kelvin" not in p and "=query>" not in p and "a</function>" not in p))
        and ("=search>" not in p or "a</function>" not in p) for p in written)
    if valid:
        assert automaton.matches(" and ".join(["Let me look.", *written])), written


PY_ARGS = st.fixed_dictionaries({}, optional={"city": st.sampled_from(["Paris", "", "it's \"x\"\n", 3]),
                                             "unit": st.sampled_from(["celsius", "kelvin", None]),
                                             "query": st.sampled_from(["x", 1.5, True])})
PY_CALLS = st.lists(st.tuples(st.sampled_from(["get_weather", "search", "other"]), PY_ARGS), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(PY_CALLS, st.sampled_from(["", "  ", "Sure: ", "[", "]"]), st.booleans())
def test_auto_with_a_strict_function_holds_pythonic_calls_to_their_schemas(calls, around, parallel):
    """Under `pythonic`: what the automaton allows is text the parser reads as content, or a
    call list it reads whole, each a listed function with arguments its parameters allow (one
    call where `parallel_tool_calls` is false); and a valid list, written as the parser writes
    it (arguments in the schema's order), is allowed."""
    parser = make_tool_parser("pythonic")
    automaton = strict_automaton("pythonic", parallel)
    order = ["city", "unit", "query"]
    written = parser.write([{"type": "function", "function": {
        "name": n, "arguments": json.dumps({k: a[k] for k in sorted(a, key=order.index)})}} for n, a in calls])
    weather = strict(WEATHER)["function"]["parameters"]
    for text in (written, around + written, written + around):
        content, got = parser.parse(text)
        if automaton.matches(text):
            if text.strip().startswith("["):
                assert got and not content and (parallel or len(got) == 1), text
            for c in got:
                args = json.loads(c["function"]["arguments"])
                assert c["function"]["name"] == "search" or jsonschema.Draft202012Validator(weather).is_valid(args), text
    valid = all(n == "search" or (n == "get_weather" and jsonschema.Draft202012Validator(weather).is_valid(a))
                for n, a in calls)
    if valid and (parallel or len(calls) == 1):
        assert automaton.matches(written), written


def valid_item(item: str) -> bool:
    """A written `{"name", "arguments"}` call of search, or of get_weather in its strict schema."""
    call = json.loads(item)
    return call["name"] == "search" or (call["name"] == "get_weather" and jsonschema.Draft202012Validator(
        strict(WEATHER)["function"]["parameters"]).is_valid(call["arguments"]))


PHI_LIST = st.lists(LLAMA_CALL.map(lambda c: c.replace('"parameters"', '"arguments"')), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["", "Let me check. ", "functools"]), st.lists(PHI_LIST, min_size=1, max_size=2),
       st.sampled_from(["", " ok", "]"]), st.booleans())
def test_auto_with_a_strict_function_holds_phi4_mini_calls_to_their_schemas(before, lists, after, parallel):
    """Under `phi4_mini_json`: what the automaton allows, the parser reads as text and one call
    list, each call of a listed function with arguments its parameters allow (one where
    `parallel_tool_calls` is false), and nothing after the list; a valid list after text is
    allowed."""
    parser = make_tool_parser("phi4_mini_json")
    automaton = strict_automaton("phi4_mini_json", parallel)
    written = ["functools[" + ", ".join(items) + "]" for items in lists]
    text = before + " and ".join(written) + after
    _, calls = parser.parse(text)

    if automaton.matches(text):
        assert len(lists) == 1 and not after and len(calls) == len(lists[0]) and (parallel or len(calls) == 1), text
        assert all(valid_item(item) for item in lists[0]), text
    elif len(lists) == 1 and not after and all(valid_item(item) for item in lists[0]) and (parallel or len(lists[0]) == 1):
        raise AssertionError(f"a valid list refused: {text!r}")


BLOCK_PARSERS = ["mistral", "jamba", "hunyuan_a13b", "minimax", "internlm"]
JSON_ARGS = st.fixed_dictionaries({}, optional={"city": st.sampled_from(["Paris", "", "x" * 31, 3]),
                                               "unit": st.sampled_from(["celsius", "kelvin"]),
                                               "query": st.sampled_from(["x", 1])})
JSON_CALLS = st.lists(st.tuples(st.sampled_from(["get_weather", "search", "other"]), JSON_ARGS), min_size=1, max_size=3)


@pytest.mark.parametrize("parser_name", BLOCK_PARSERS)
@settings(max_examples=120, deadline=None)
@given(blocks=st.lists(JSON_CALLS, min_size=1, max_size=2), before=st.sampled_from(["", "Let me look. "]),
       after=st.sampled_from(["", " Done."]), parallel=st.booleans())
def test_auto_with_a_strict_function_holds_json_block_calls_to_their_schemas(parser_name, blocks, before, after,
                                                                           parallel):
    """Under the parsers whose calls are JSON in marked blocks: what the automaton allows, the
    parser reads as calls of listed functions with arguments their parameters allow (one call
    where `parallel_tool_calls` is false); and text then a valid block as the parser writes it
    is allowed."""
    parser = make_tool_parser(parser_name)
    automaton = strict_automaton(parser_name, parallel)
    order = ["city", "unit", "query"]
    written = [parser.write([{"type": "function", "function": {
        "name": n, "arguments": json.dumps({k: a[k] for k in sorted(a, key=order.index)})}} for n, a in calls])
        for calls in blocks]
    text = before + " ".join(written) + after
    weather = strict(WEATHER)["function"]["parameters"]

    def valid(name: str, args: dict) -> bool:
        return name == "search" or (name == "get_weather" and jsonschema.Draft202012Validator(weather).is_valid(args))

    if automaton.matches(text):
        _, got = parser.parse(text)
        assert got and (parallel or len(got) == 1), text
        assert all(valid(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got), text
    first = blocks[0]
    if all(valid(n, a) for n, a in first) and (parallel or len(first) == 1):
        assert automaton.matches(before + written[0]), written[0]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["", " ", "\n", "Sure ", "<"]), st.lists(PHI_LIST, min_size=0, max_size=2),
       st.sampled_from(["", " Done.", "]"]), st.booleans())
def test_auto_with_a_strict_function_holds_granite_calls_to_their_schemas(before, lists, after, parallel):
    """Under `granite`: what the automaton allows, the parser reads as text (opening with no
    tag) or as the opening list's calls, each of a listed function with arguments its parameters
    allow (one where `parallel_tool_calls` is false); a valid list after whitespace, with any
    text after it, is allowed, and so is plain text."""
    parser = make_tool_parser("granite")
    automaton = strict_automaton("granite", parallel)
    written = ["<|tool_call|>[" + ", ".join(items) + "]" for items in lists]
    text = before + " then ".join(written) + after
    _, calls = parser.parse(text)

    if automaton.matches(text):
        if text.lstrip().startswith("<"):
            assert len(calls) == len(lists[0]) and (parallel or len(calls) == 1), text
            assert all(valid_item(item) for item in lists[0]), text
        else:
            assert not calls, text
    elif lists and before.strip() == "" and all(valid_item(i) for i in lists[0]) and (parallel or len(lists[0]) == 1):
        raise AssertionError(f"a valid list refused: {text!r}")
    assert automaton.matches("The weather is fine.") and automaton.matches("") and not automaton.matches("<b>hi</b>")


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["", " ", "Sure. ", "[", "`"]), st.lists(PHI_LIST, min_size=0, max_size=2), st.booleans(),
       st.sampled_from(["", " Done."]), st.booleans())
def test_auto_with_a_strict_function_holds_xlam_calls_to_their_schemas(before, lists, fenced, after, parallel):
    """Under `xlam`: what the automaton allows, the parser reads as calls of listed functions
    with arguments their parameters allow (one where `parallel_tool_calls` is false), from a
    bare list or the first fenced one; a valid bare list, and text with valid fenced lists, are
    allowed, and so is plain text."""
    parser = make_tool_parser("xlam")
    automaton = strict_automaton("xlam", parallel)
    lists_text = ["[" + ", ".join(items) + "]" for items in lists]
    written = [f"```json\n{t}\n```" for t in lists_text] if fenced else lists_text
    text = before + " then ".join(written) + after
    _, calls = parser.parse(text)
    weather = strict(WEATHER)["function"]["parameters"]

    if automaton.matches(text):
        for c in calls:
            args = json.loads(c["function"]["arguments"])
            assert c["function"]["name"] == "search" or jsonschema.Draft202012Validator(weather).is_valid(args), text
        assert parallel or len(calls) <= 1, text
        if lists and (fenced or text.strip().startswith("[")):  # (a list inside text is text)
            assert calls, text
    ok = all(valid_item(i) for items in lists for i in items) and (parallel or all(len(items) == 1 for items in lists))
    allowed_form = (fenced and before in ("", " ", "Sure. ")) or (
        not fenced and before.strip() == "" and not after and len(lists) == 1)
    if lists and ok and allowed_form:
        assert automaton.matches(text), text
    assert automaton.matches("The weather is fine.") and automaton.matches("") and not automaton.matches("[1]")


def test_auto_with_a_strict_function_holds_seed_oss_calls_as_qwen3_coders():
    """Under `seed_oss`: Qwen3-Coder's held calls in `<seed:tool_call>` blocks, with text around
    them; a value outside its schema, an unlisted function or a second call where
    `parallel_tool_calls` is false are refused; Qwen3-Coder's own blocks are text there."""
    parser = make_tool_parser("seed_oss")

    def written(name: str, args: dict) -> str:
        return parser.write([{"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}])

    good, other = written("get_weather", {"city": "Paris", "unit": "celsius"}), written("search", {"query": "x"})
    many, one = strict_automaton("seed_oss", True), strict_automaton("seed_oss", False)
    assert many.matches(f"Let me check. {good}\n{other}") and one.matches(f"Let me check. {good}")
    assert parser.parse(f"Let me check. {good}")[1][0]["function"]["name"] == "get_weather"
    assert not one.matches(f"{good}\n{other}")
    assert not many.matches(written("get_weather", {"city": "Paris", "unit": "kelvin"}))
    assert not many.matches(written("other", {}))
    assert many.matches(make_tool_parser("qwen3_coder").write(
        [{"type": "function", "function": {"name": "other", "arguments": "{}"}}]))  # (not seed's blocks: text)


def test_no_strict_tag_where_the_tokenizer_holds_a_marker_as_a_special_token(tmp_path):
    """A grammar admits a special token only as a `token` format: where the served tokenizer
    holds one of a tag's markers as one and the tag writes it as text, the calls stay free (as
    without a strict function); a tag of `token` formats holds them either way. Where a marker
    is a special token, the output's text keeps special tokens for the parser to read."""
    from transformers import AutoTokenizer

    from conveyor.tokenizer import Tokenizer
    from tests.conftest import save_word_tokenizer

    save_word_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    hf.add_tokens(["<tool_call>", "</tool_call>"])  # added, but ordinary text
    tok = Tokenizer(hf)
    assert not tok.writes_as_text("[TOOL_CALLS]") and not tok.writes_as_text("w4 [TOOL_CALLS] w5")
    assert tok.writes_as_text("<tool_call>") and tok.writes_as_text("w4 w5")  # (its words are w4, w5, ...)
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "<|action_start|>"]})
    tok = Tokenizer(hf)
    for name, held, keeps in (("mistral", True, True), ("internlm", False, True), ("hermes", True, False),
                              ("llama3_json", True, False)):
        tools = Tools.parse([strict(WEATHER)], "auto", None, make_tool_parser(name))
        assert tools is not None and tools.constraint() is not None  # no tokenizer said: the tag
        assert (tools.constraint(tok.writes_as_text) is not None) == held, name
        assert tools.keeps_special_tokens(tok.is_special) == keeps, name
        named = Tools.parse([strict(WEATHER)], {"type": "function", "function": {"name": "get_weather"}}, None,
                            make_tool_parser(name))
        assert named is not None and not named.keeps_special_tokens(tok.is_special)  # (no markers there)


def written(parser: Any, *calls: tuple[str, dict]) -> str:
    return parser.write([{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for n, a in calls])


@functools.cache
def held(name: str, parallel: bool, special: bool) -> Any:
    """The automaton of "auto" with a strict get_weather and a non-strict search under `name`,
    compiled for a tokenizer that holds the parser's markers as special tokens, or as text."""
    from conveyor.structured import compile_automaton

    parser = make_tool_parser(name)
    tools = Tools.parse([strict(WEATHER), strict(SEARCH, False)], "auto", parallel, parser)
    assert tools is not None
    return compile_automaton(tools.constraint(), frozenset(parser.MARKERS) if special else frozenset())


def spelling(markers: tuple[str, ...], special: bool) -> Any:
    """What a grammar reads for a text: its markers as special tokens' spellings, or as text."""
    import re

    from conveyor.structured.regex import special_token

    pattern = re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))

    def spelled(text: str) -> bytes:
        if not special:
            return text.encode()
        out, at = b"", 0
        for m in pattern.finditer(text):
            out += text[at:m.start()].encode() + special_token(m.group())
            at = m.end()
        return out + text[at:].encode()

    return spelled


@pytest.mark.parametrize("special", [True, False], ids=["special markers", "markers as text"])
@pytest.mark.parametrize("name", ["kimi_k2", "deepseek_v3", "glm45", "mistral", "step3", "minimax_m2", "granite-20b-fc",
                                  "gigachat3", "apertus"])
def test_strict_tags_of_token_markers_hold_calls_to_their_schemas(name, special):
    """Under a parser whose strict tag writes its markers as `token` formats: the calls its
    `write` writes are allowed (markers as the served tokenizer's special tokens, or as text
    where it holds them so), text before them too, and the parser reads them back; a value
    outside its schema, an unlisted function and a second call where `parallel_tool_calls` is
    false are refused; where the markers are special, their text in free text is only text."""
    from conveyor.structured.regex import special_token

    parser = make_tool_parser(name)
    assert parser.TOKEN_TAG and parser.MARKERS
    spelled = spelling(parser.MARKERS, special)
    many, one = held(name, True, special), held(name, False, special)
    good = written(parser, ("get_weather", {"city": "Paris", "unit": "celsius"}))
    two = written(parser, ("get_weather", {"city": "Oslo"}), ("search", {"query": "rain"}))
    with tool_schemas([strict(WEATHER)["function"], strict(SEARCH, False)["function"]]):
        content, calls = parser.parse(f"Let me check. {good}")
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert many.reads(spelled(f"Let me check. {good}")) and one.reads(spelled(good)) and many.reads(b"plain")
    assert many.reads(spelled(two)) and not one.reads(spelled(two))
    assert not many.reads(spelled(written(parser, ("get_weather", {"city": "Paris", "unit": "kelvin"}))))
    assert not many.reads(spelled(written(parser, ("get_weather", {"unit": "celsius"}))))  # city is required
    assert not many.reads(spelled(written(parser, ("other", {}))))
    # The trigger's text in free text: the parser would read it as the marker, so a call follows
    # it where it is the marker's text, and it is not written in ordinary tokens where the
    # marker is a special token (the free text holds no special token's text).
    trigger = parser.MARKERS[0]
    assert not many.reads(f"Markers look like {trigger}.".encode())
    as_text = spelled(f"Look: {good}").replace(special_token(trigger), trigger.encode())
    assert many.reads(spelled(f"Look: {good}")) and many.reads(as_text) == (not special)


def test_deepseek_v32_strict_tag_holds_dsml_calls():
    """DSML's markers are text: its tag holds what `write` writes, a string's value any text up
    to its closing tag (`string="true"`), other values their JSON (`string="false"`), one call
    where `parallel_tool_calls` is false; a value outside its schema or an unlisted function is
    refused, and the parser reads the held calls back."""
    parser = make_tool_parser("deepseek_v32")
    many, one = held("deepseek_v32", True, False), held("deepseek_v32", False, False)
    good = written(parser, ("get_weather", {"city": "São Paulo <3", "unit": "celsius"}))
    two = written(parser, ("get_weather", {"city": "Oslo"}), ("search", {"query": "rain", "n": [1, 2]}))
    assert 'string="true">São Paulo <3<' in good
    with tool_schemas([strict(WEATHER)["function"], strict(SEARCH, False)["function"]]):
        content, calls = parser.parse(f"Let me check. {good}")
    assert content == "Let me check." and json.loads(calls[0]["function"]["arguments"])["city"] == "São Paulo <3"
    assert many.reads(f"Let me check. {good}".encode()) and one.reads(good.encode()) and many.reads(b"plain")
    assert many.reads(two.encode()) and not one.reads(two.encode())
    assert not many.reads(written(parser, ("get_weather", {"city": "Paris", "unit": "kelvin"})).encode())
    assert not many.reads(written(parser, ("get_weather", {"unit": "celsius"})).encode())
    assert not many.reads(written(parser, ("other", {})).encode())
    assert not many.reads(f"{good} and more".encode())  # (nothing after the block)


def test_deepseek_v3_calls_are_held_in_either_form():
    """V3's and R1's `function<sep>NAME` and a fenced JSON block, V3.1's `NAME<sep>` and the
    JSON: both held to the schema, a newline or none between calls."""
    from conveyor.structured import compile_automaton

    parser = make_tool_parser("deepseek_v3")
    (begin, end), (call, close), sep = parser.SECTION, parser.CALL, parser.SEP
    tools = Tools.parse([strict(WEATHER), strict(SEARCH)], "auto", True, parser)
    assert tools is not None
    automaton = compile_automaton(tools.constraint(), frozenset())
    v3 = f'{call}function{sep}get_weather\n```json\n{{"city": "Paris"}}\n```{close}'
    v31 = f'{call}search{sep}{{"query": "x"}}{close}'
    for text in (f"{begin}{v3}{end}", f"{begin}{v3}\n{v31}{end}", f"{begin}{v31}{v3}{end}"):
        assert automaton.reads(text.encode()), text
        assert len(parser.parse(text)[1]) == text.count(call)
    assert not automaton.reads(f'{begin}{v3.replace("Paris", "x" * 31)}{end}'.encode())
    assert not automaton.reads(f"{begin}{end}".encode())  # a section holds a call


def test_auto_and_none_answer_in_text_or_calls(client: openai.OpenAI) -> None:
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=24, temperature=0)
        msg = r.choices[0].message
        assert msg.content or msg.tool_calls
        assert choice == "auto" or not msg.tool_calls
        for call in msg.tool_calls or []:
            assert call.function.name in SCHEMAS
        content, calls, _ = collect(client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=24, temperature=0, stream=True))
        assert (content.strip(), len(calls)) == ((msg.content or "").strip(), len(msg.tool_calls or []))


def test_strict_tools_under_auto_over_http(client: openai.OpenAI) -> None:
    """A strict function under "auto": SmolLM2 answers as it likes, and any call it makes holds
    to the function's schema; another output constraint beside it is refused."""
    tools = [strict(WEATHER), SEARCH]
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="auto",
                                       max_tokens=60, temperature=0)
    msg = r.choices[0].message
    assert msg.content or msg.tool_calls
    for call in msg.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    with pytest.raises(openai.BadRequestError, match="strict function"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, max_tokens=8,
                                       response_format={"type": "json_object"})


def test_the_text_keeps_special_tokens_where_the_parser_reads_them_as_markers(tmp_path):
    """A chat request with tools, served under a parser whose marker the served tokenizer holds
    as a special token (vLLM's tool parsers' `adjust_request`): its text keeps special tokens,
    and its strict function's calls are held by a tag of `token` formats; under another parser,
    or without tools, special tokens are skipped as asked."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from conveyor.server.config import ServerConfig
    from conveyor.server.metrics import ServerMetrics
    from conveyor.server.protocol import ChatCompletionRequest
    from conveyor.server.serving import ChatCompletionHandler, ServerState
    from conveyor.tokenizer import Tokenizer
    from tests.conftest import save_word_tokenizer

    save_word_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    hf.add_tokens(["<tool_call>", "</tool_call>"])  # added, but ordinary text
    engine = SimpleNamespace(tokenizer=Tokenizer(hf))

    def params(parser: str, **body: Any):
        state = ServerState(engine, ServerConfig(tool_call_parser=parser), ("m",), ServerMetrics("m"))  # type: ignore[arg-type]
        request = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **body})
        return ChatCompletionHandler(state, request).sampling_params(16, 0)

    tools = {"tools": [strict(WEATHER)], "tool_choice": "auto"}
    kept = params("mistral", **tools)
    assert not kept.skip_special_tokens and kept.structured_outputs is not None
    assert "token_triggered_tags" in json.dumps(kept.structured_outputs.structural_tag)
    held = params("hermes", **tools)
    assert held.skip_special_tokens and held.structured_outputs is not None
    assert params("mistral").skip_special_tokens
    assert params("mistral", **tools, skip_special_tokens=False).skip_special_tokens is False


def test_harmony_strict_tag_holds_the_messages_and_the_call():
    """Under `openai` (gpt-oss's harmony): analysis and commentary messages, then a final
    message or one call whose arguments hold to the schema, where the output ends (its
    `<|call|>` is an end token, not text); the reasoning parser splits what the grammar allows,
    and the tool parser reads the call it passes on."""
    from conveyor.server.reasoning import split_reasoning
    from conveyor.server.tool_parsers import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, START

    parser = make_tool_parser("openai")
    assert parser.MARKERS == (START, CHANNEL, MESSAGE, END, CONSTRAIN)
    automaton, spelled = held("openai", True, True), spelling(parser.MARKERS, True)
    think = f"{CHANNEL}analysis{MESSAGE}The user wants the weather.{END}{START}assistant"
    call = f'{CHANNEL}commentary to=functions.get_weather {CONSTRAIN}json{MESSAGE}{{"city": "Paris"}}'
    addressed = f'{START}assistant to=functions.search{CHANNEL}commentary{MESSAGE}{{"anything": 1}}'
    final = f"{CHANNEL}final{MESSAGE}It is sunny."
    for text in (think + call, call, think + final, final, think[: -len(f"{START}assistant")] + addressed,
                 f"{CHANNEL}commentary{MESSAGE}Checking.{END}{START}assistant" + call):
        assert automaton.reads(spelled(text)), text
    for text in (think + call.replace("Paris", "x" * 31), think + call.replace("get_weather", "other"),
                 call + " more", f"{CHANNEL}analysis{MESSAGE}a {CONSTRAIN} b{END}",  # no special token in text
                 think.replace(f"{START}assistant", "") + call, "plain text", addressed):
        assert not automaton.reads(spelled(text)), text
    # What the server then does with `think + call` and the end token <|call|>:
    reasoning, content = split_reasoning(think + call + CALL, "openai_gptoss")
    assert reasoning == "The user wants the weather."
    assert content is not None
    assert [c["function"]["name"] for c in parser.parse(content)[1]] == ["get_weather"]


def test_a_harmony_strict_tag_keeps_the_reasoning_parser(tmp_path):
    """Under `--reasoning-parser openai_gptoss` the output is split as ever: the harmony strict
    tag holds the harmony messages itself; any other grammar holds the final message's text,
    after messages as free as a thinking block (analysis, with its special tokens)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from conveyor.server.config import ServerConfig
    from conveyor.server.metrics import ServerMetrics
    from conveyor.server.protocol import ChatCompletionRequest
    from conveyor.server.serving import ChatCompletionHandler, ServerState
    from conveyor.server.tool_parsers import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, START
    from conveyor.tokenizer import Tokenizer
    from tests.conftest import save_word_tokenizer

    save_word_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    hf.add_special_tokens({"additional_special_tokens": [START, CHANNEL, MESSAGE, END, CONSTRAIN, CALL]})
    engine = SimpleNamespace(tokenizer=Tokenizer(hf))
    config = ServerConfig(tool_call_parser="openai", reasoning_parser="openai_gptoss")

    def handler(**body: Any) -> ChatCompletionHandler:
        state = ServerState(engine, config, ("m",), ServerMetrics("m"))  # type: ignore[arg-type]
        return ChatCompletionHandler(state, ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **body}))

    held = handler(tools=[strict(WEATHER)], tool_choice="auto")
    assert held.structured_outputs is not None and held.reasoning_parser == "openai_gptoss"
    assert held.structured_outputs.reasoning is None
    assert not held.sampling_params(16, 0).skip_special_tokens
    final = f"{CHANNEL}final{MESSAGE}"
    for body in ({"response_format": {"type": "json_object"}}, {"tools": [strict(WEATHER)], "tool_choice": "required"}):
        other = handler(**body)
        assert other.structured_outputs is not None and other.reasoning_parser == "openai_gptoss"
        assert other.structured_outputs.reasoning == ("", final)
    from conveyor.sampling_params import StructuredOutputParams
    from conveyor.server.reasoning import split_reasoning
    from conveyor.structured import compile_automaton
    from conveyor.structured.regex import special_token

    markers = (START, CHANNEL, MESSAGE, END, CONSTRAIN, CALL)
    automaton = compile_automaton(StructuredOutputParams(json={"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}, reasoning=("", final)), frozenset(markers))
    spelled = spelling(markers, True)
    analysis = f"{CHANNEL}analysis{MESSAGE}The user wants JSON.{END}{START}assistant"
    answer = '{"city": "Paris"}'
    assert automaton.reads(spelled(f"{analysis}{final}{answer}"))
    assert split_reasoning(f"{analysis}{final}{answer}", "openai_gptoss") == ("The user wants JSON.", answer)
    assert automaton.reads(spelled(f"{final}{answer}"))  # (no analysis at all)
    for wrong in (f"{analysis}{final}{{\"town\": 1}}", f"{analysis}{answer}", f"{analysis}{final}plain"):
        assert not automaton.reads(spelled(wrong)), wrong
    assert not automaton.reads(f"{analysis}{final}{answer}".encode())  # the markers as text are not them
    assert special_token(CHANNEL) in spelled(final)


@pytest.mark.parametrize("special", [True, False], ids=["special markers", "markers as text"])
def test_mistral_v11_calls_are_held_too(special):
    """Mistral's v11 form, `[TOOL_CALLS]NAME[ARGS]{...}` and `[TOOL_CALLS]` before each further
    call: held to the schemas beside the v3 list, one call where `parallel_tool_calls` is false."""
    parser = make_tool_parser("mistral")
    tag, args = parser.TAG, parser.ARGS
    spelled = spelling(parser.MARKERS, special)
    many, one = held("mistral", True, special), held("mistral", False, special)
    first, second = f'{tag}get_weather{args}{{"city": "Paris"}}', f'{tag}search{args}{{"q": 1}}'
    for text in (f"Sure. {first}", first + second):
        assert many.reads(spelled(text)), text
        with tool_schemas([strict(WEATHER)["function"], strict(SEARCH, False)["function"]]):
            assert len(parser.parse(text)[1]) == text.count(tag)
    assert one.reads(spelled(first)) and not one.reads(spelled(first + second))
    assert not many.reads(spelled(first.replace("Paris", "x" * 31))) and not many.reads(spelled(f"{tag}other{args}{{}}"))
    assert not many.reads(spelled(first + " and text"))  # nothing after the calls


@pytest.mark.parametrize("special", [True, False], ids=["special markers", "markers as text"])
def test_olmo3_strict_tag_holds_the_block_that_opens_the_output(special):
    """Under `olmo3`: text that does not open with `<`, or the `<function_calls>` block of held
    calls one a line (one where `parallel_tool_calls` is false), then any text."""
    parser = make_tool_parser("olmo3")
    spelled = spelling(parser.MARKERS, special)
    many, one = held("olmo3", True, special), held("olmo3", False, special)
    good = written(parser, ("get_weather", {"city": "Paris", "unit": "celsius"}))
    two = written(parser, ("get_weather", {"city": "Oslo"}), ("search", {"query": "rain", "n": 3}))
    for text in (good, f"  {good} Done.", two):
        assert many.reads(spelled(text)), text
    mention = "Plain text <function_calls> mentioned."  # (text: the parser reads a block at the start only)
    assert many.reads(mention.encode()) and many.reads(spelled(mention)) == (not special)
    with tool_schemas([strict(WEATHER)["function"], strict(SEARCH, False)["function"]]):
        assert [c["function"]["name"] for c in parser.parse(two)[1]] == ["get_weather", "search"]
    assert one.reads(spelled(good)) and not one.reads(spelled(two))
    assert not many.reads(spelled(written(parser, ("get_weather", {"city": "Paris", "unit": "kelvin"}))))
    assert not many.reads(spelled(written(parser, ("other", {}))))
    assert not many.reads(b"<b>html</b>")  # (a `<` first: the block, or nothing)


def test_longcat_and_ernie45_hold_hermes_calls_in_their_blocks():
    from conveyor.structured import compile_automaton

    for name in ("longcat", "ernie45"):
        parser = make_tool_parser(name)
        tools = Tools.parse([strict(WEATHER)], "auto", True, parser)
        assert tools is not None
        automaton = compile_automaton(tools.constraint())
        good = written(parser, ("get_weather", {"city": "Paris"}))
        assert automaton.matches(f"Looking. {good}") and parser.parse(good)[1], name
        assert not automaton.matches(written(parser, ("get_weather", {"city": "x" * 31}))), name
    assert compile_automaton(Tools.parse([strict(WEATHER)], "auto", True, make_tool_parser("longcat")).constraint()
                             ).matches('<tool_call>{"name": "other"}</tool_call>')  # (hermes's block: text there)


@pytest.mark.parametrize("special", [True, False], ids=["special markers", "markers as text"])
def test_llama4_pythonic_strict_tag_takes_python_start(special):
    parser = make_tool_parser("llama4_pythonic")
    spelled = spelling(parser.MARKERS, special)
    many, one = held("llama4_pythonic", True, special), held("llama4_pythonic", False, special)
    good = "[get_weather(city='Paris', unit='celsius')]"
    for text in (good, f"{parser.START}{good}", f"{parser.START}{good}{parser.END}", "Plain text."):
        assert many.reads(spelled(text)) and one.reads(spelled(text)), text
    two = "[get_weather(city='Oslo'), search(query='x')]"
    assert many.reads(spelled(f"{parser.START}{two}")) and not one.reads(spelled(f"{parser.START}{two}"))
    assert not many.reads(spelled(f"{parser.START}[get_weather(city='Paris', unit='kelvin')]"))
    assert not many.reads(spelled(f"{parser.START}[other()]"))
    assert not many.reads(b"<b>an answer opening with a tag</b>")  # (a `<` first: the list's start, or nothing)
