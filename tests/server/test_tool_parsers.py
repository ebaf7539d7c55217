"""The tool-call parsers (`--tool-call-parser`): each format's texts read as calls and content,
a stream cut at random points giving what the whole output gives (hypothesis), each parser's
`write` read back by its own `scan` (hypothesis), and the history and system prompt of a
template without tool support written in the chosen format."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.config import ConfigError
from conveyor.server.config import ServerConfig
from conveyor.server.tool_parsers import make_tool_parser, tool_call, tool_parser_names
from conveyor.server.tools import Tools, history_for_template
from tests.server.test_tools import ASK, TOOLS, check_stream_cut


def named(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


PARSERS = ["apertus", "deepseek_v3", "deepseek_v31", "deepseek_v32", "ernie45", "gigachat3", "glm45", "granite", "granite-20b-fc", "hermes", "hunyuan_a13b", "internlm", "jamba", "kimi_k2",
           "llama3_json", "llama4_json", "llama4_pythonic", "longcat", "minimax", "minimax_m2", "mistral", "olmo3", "openai", "phi4_mini_json", "pythonic",
           "qwen3_coder", "qwen3_xml", "seed_oss", "step3", "xlam"]


def test_the_parsers_are_vllms():
    assert tool_parser_names() == PARSERS
    with pytest.raises(ConfigError, match="use apertus, deepseek_v3, deepseek_v31, deepseek_v32, ernie45, gigachat3, glm45, granite, granite-20b-fc"):
        ServerConfig(tool_call_parser="tng")


def test_vllms_other_names_read_their_formats():
    """`deepseek_v31` reads DeepSeek-V3.1's calls, `llama4_json` Llama 4's JSON calls."""
    v31 = make_tool_parser("deepseek_v31")
    _, calls = v31.parse("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                         '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    assert named(calls) == [("get_weather", {"city": "Paris"})]
    _, calls = make_tool_parser("llama4_json").parse('{"name": "search", "parameters": {"query": "x"}}')
    assert named(calls) == [("search", {"query": "x"})]


def test_mistral_v11_calls_after_each_tag():
    """Mistral Small 3.2 / Magistral / Devstral: `[TOOL_CALLS]name[ARGS]{...}` once a call."""
    p = make_tool_parser("mistral")
    content, calls = p.parse('Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'
                             '[TOOL_CALLS]search[ARGS]{"query": "x"}')
    assert content == "Let me check."
    assert named(calls) == [("get_weather", {"city": "Paris", "days": 2}), ("search", {"query": "x"})]
    for text in ("[TOOL_CALLS]not a name[ARGS]{}", "[TOOL_CALLS]f[ARGS][1]", "[TOOL_CALLS]f[ARGS]{oops"):
        assert p.parse(text) == (text, []), text


def test_qwen3_coder_xml_calls():
    p = make_tool_parser("qwen3_coder")
    content, calls = p.parse(
        "I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=search>\n<parameter=query>\nmulti\nline\n</parameter>\n</function>\n</tool_call>")
    assert content == "I will look."
    assert named(calls) == [("get_weather", {"city": "San Francisco, CA", "days": 3, "hourly": True}),
                            ("search", {"query": "multi\nline"})]
    for text in ("<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>",
                 "<tool_call>{\"name\": \"f\"}</tool_call>"):
        assert p.parse(text) == (text, []), text


RECORD = {"type": "function", "function": {"name": "record", "parameters": {"type": "object", "properties": {
    "code": {"type": "string"}, "count": {"type": "integer"}, "ratio": {"type": "number"},
    "ok": {"type": "boolean"}, "meta": {"type": "object"}, "tags": {"type": "array"},
    "note": {"type": ["string", "null"]}, "level": {"type": "integer"}}}}}
TYPED = {"code": "42", "count": 3, "ratio": 0.5, "ok": False, "meta": {"a": 1}, "tags": ["x", "y"], "note": None,
         "level": "high"}


def _qwen3_coder_text(values: dict[str, str]) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function=record>\n{params}</function>\n</tool_call>"


RAW = {"code": "42", "count": "3", "ratio": "0.5", "ok": "False", "meta": '{"a": 1}', "tags": "['x', 'y']",
       "note": "null", "level": "high"}


@pytest.mark.parametrize("fmt", ["qwen3_coder", "glm45"])
def test_xml_values_are_typed_by_the_tools_schema(fmt):
    """Typed by the request's schema (vLLM's reading): a string keeps its text ("42"), numbers
    and booleans read as such (Python's `False` too), an object or array as JSON or a Python
    literal, `null` where the type allows it; text that is not its type stays text ("high" for
    an integer). Without the tools, the untyped reading: "42" is a number, the list text."""
    if fmt == "qwen3_coder":
        text = _qwen3_coder_text(RAW)
    else:
        text = "<tool_call>record\n" + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>"
                                               for k, v in RAW.items()) + "</tool_call>"
    tools = Tools.parse([RECORD], "auto", None, make_tool_parser(fmt))
    assert named(tools.calls(text)[1]) == [("record", TYPED)]
    untyped = named(make_tool_parser(fmt).parse(text)[1])[0][1]
    assert untyped["code"] == 42 and untyped["tags"] == "['x', 'y']" and untyped["note"] is None


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_typed_xml_values_stream_as_the_whole(data):
    check_stream_cut(Tools.parse([RECORD], "auto", None, make_tool_parser("qwen3_coder")),
                     "Recording.\n" + _qwen3_coder_text(RAW), data)


def test_glm45_calls():
    p = make_tool_parser("glm45")
    content, calls = p.parse("Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
                             "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
                             "<tool_call>now\n</tool_call>")
    assert content == "Checking."
    assert named(calls) == [("get_weather", {"city": "Beijing", "days": 2}), ("now", {})]
    text = "<tool_call>get weather\n</tool_call>"
    assert p.parse(text) == (text, [])


def test_deepseek_v3_and_v31_calls():
    p = make_tool_parser("deepseek_v3")
    v3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
          '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n'
          '{"query": "x"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    content, calls = p.parse("Sure." + v3)
    assert content == "Sure."
    assert named(calls) == [("get_weather", {"city": "Paris"}), ("search", {"query": "x"})]
    v31 = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    assert named(p.parse(v31)[1]) == [("get_weather", {"city": "Paris"})]
    broken = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{oops<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    assert p.parse(broken) == (broken, [])


def test_kimi_k2_calls():
    p = make_tool_parser("kimi_k2")
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>'
            '{"query": "x"}<|tool_call_end|><|tool_calls_section_end|>')
    content, calls = p.parse(text)
    assert content is None
    assert named(calls) == [("get_weather", {"city": "Paris"}), ("search", {"query": "x"})]


def test_llama3_json_calls_and_content():
    p = make_tool_parser("llama3_json")
    content, calls = p.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert content is None and named(calls) == [("get_weather", {"city": "Paris"})]
    content, calls = p.parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}')
    assert content is None and named(calls) == [("a", {}), ("b", {"x": 1})]
    assert p.parse("The weather is fine.") == ("The weather is fine.", [])
    assert p.parse('{"city": "Paris"}') == ('{"city": "Paris"}', [])  # JSON, but not a call
    assert p.parse('{"name": "a", "parame') == ('{"name": "a", "parame', [])  # cut short: text
    content, calls = p.parse('{"name": "a", "parameters": {}} and then some words')
    assert content == "and then some words" and named(calls) == [("a", {})]


def test_granite_jamba_hunyuan_minimax_internlm_seed_oss_xlam_and_phi4_mini_calls():
    """Each family's own form, the text around it, and what is not a call."""
    granite = make_tool_parser("granite")
    for tag in ("<|tool_call|>", "<tool_call>"):
        content, calls = granite.parse(f' {tag}[{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}]')
        assert content is None and named(calls) == [("get_weather", {"city": "Paris"})]
    assert granite.parse("Sure <|tool_call|>[]") == ("Sure <|tool_call|>[]", [])  # not at the start: text
    assert granite.parse('<|tool_call|>{"x": 1}') == ('<|tool_call|>{"x": 1}', [])
    jamba = make_tool_parser("jamba")
    content, calls = jamba.parse('Let me see.<tool_calls>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": '
                                 '{"x": 1}}]</tool_calls>')
    assert content == "Let me see." and named(calls) == [("a", {}), ("b", {"x": 1})]
    assert jamba.parse("<tool_calls>[oops]</tool_calls>") == ("<tool_calls>[oops]</tool_calls>", [])
    minimax = make_tool_parser("minimax")
    content, calls = minimax.parse('Hm.\n<tool_calls>\n{"name": "a", "arguments": {"q": "x"}}\n'
                                   '{"name": "b", "arguments": {}}\n</tool_calls>')
    assert content == "Hm." and named(calls) == [("a", {"q": "x"}), ("b", {})]
    internlm = make_tool_parser("internlm")
    content, calls = internlm.parse('I will search.<|action_start|><|plugin|>\n{"name": "search", "parameters": '
                                    '{"query": "x"}}<|action_end|>')
    assert content == "I will search." and named(calls) == [("search", {"query": "x"})]
    hunyuan = make_tool_parser("hunyuan_a13b")
    assert named(hunyuan.parse('<tool_calls>[{"name": "a", "arguments": {"x": 1}}]</tool_calls>')[1]) == [("a", {"x": 1})]
    seed = make_tool_parser("seed_oss")
    content, calls = seed.parse("Checking.<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                                "</parameter>\n</function>\n</seed:tool_call>")
    assert content == "Checking." and named(calls) == [("get_weather", {"city": "Paris"})]
    xlam = make_tool_parser("xlam")
    assert named(xlam.parse('[{"name": "a", "arguments": {"q": "x"}}]')[1]) == [("a", {"q": "x"})]
    content, calls = xlam.parse('Here:\n```json\n[{"name": "b", "arguments": {}}]\n``` done')
    assert content == "Here:\n done" and named(calls) == [("b", {})]
    assert xlam.parse("[1, 2]") == ("[1, 2]", []) and xlam.parse("plain") == ("plain", [])
    phi = make_tool_parser("phi4_mini_json")
    content, calls = phi.parse('functools[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert content is None and named(calls) == [("get_weather", {"city": "Oslo"})]
    assert phi.parse("functools[1, 2]") == ("functools[1, 2]", []) and phi.parse("no call") == ("no call", [])


def test_granite_20b_fc_calls_each_after_its_tag():
    """granite-20b-functioncalling: content, then `<function_call>` and an object a call; what
    follows the last call is content; a tag that opens no call object is text."""
    p = make_tool_parser("granite-20b-fc")
    content, calls = p.parse('I will look.\n<function_call> {"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                             '<function_call>{"name": "search", "arguments": {}}')
    assert content == "I will look." and named(calls) == [("get_weather", {"city": "Oslo"}), ("search", {})]
    content, calls = p.parse('<function_call> {"name": "a", "arguments": {}} and that is all')
    assert content == "and that is all" and named(calls) == [("a", {})]
    for text in ("<function_call> not JSON", '<function_call> {"name": "a"}', '<function_call> [1]',
                 '<function_call> {"name": "a", "arguments": "x"}', "no call"):
        assert p.parse(text) == (text, []), text
    content, calls = p.parse('x <function_call> {"name": "a", "arguments": {}} <function_call> oops')
    assert content == "x <function_call> oops" and named(calls) == [("a", {})]  # (a broken call stays text)


def test_apertus_one_key_calls_in_a_block():
    p = make_tool_parser("apertus")
    content, calls = p.parse('Checking.<|tools_prefix|>[{"get_weather": {"city": "Oslo"}}, {"search": {}}]'
                             '<|tools_suffix|> Done.')
    assert content == "Checking. Done." and named(calls) == [("get_weather", {"city": "Oslo"}), ("search", {})]
    assert named(p.parse('<|tools_prefix|>{"a": {"x": 1}}<|tools_suffix|>')[1]) == [("a", {"x": 1})]
    for bad in ('<|tools_prefix|>[{"a": {}, "b": {}}]<|tools_suffix|>', '<|tools_prefix|>[{"a": 1}]<|tools_suffix|>',
                "<|tools_prefix|>oops<|tools_suffix|>"):
        assert p.parse(bad) == (bad, []), bad


def test_deepseek_v32_dsml_calls():
    """DeepSeek-V3.2's DSML: invokes in a `<｜DSML｜function_calls>` block; `string="true"` keeps
    the text whole, `string="false"` reads JSON; a block that is not calls stays text."""
    p = make_tool_parser("deepseek_v32")
    text = ('I will look.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true"> Paris </｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="tags" string="false">["a", null]</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n<｜DSML｜invoke name="search">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    content, calls = p.parse(text)
    assert content == "I will look."
    assert named(calls) == [("get_weather", {"city": " Paris ", "days": 3, "tags": ["a", None]}), ("search", {})]
    for bad in ("<｜DSML｜function_calls>oops</｜DSML｜function_calls>", "plain",
                '<｜DSML｜function_calls><｜DSML｜invoke name="a b"></｜DSML｜invoke></｜DSML｜function_calls>'):
        assert p.parse(bad) == (bad, []), bad


def test_gigachat3_calls_in_a_message_of_their_own():
    """GigaChat 3: `<|message_sep|>`, then `function call<|role_sep|>` and the object; 3.1's
    `<|function_call|>` and the object; a message separator that opens no call ends the answer."""
    p = make_tool_parser("gigachat3")
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for text in (f"Checking.<|message_sep|>\n\nfunction call<|role_sep|>\n{call}",
                 f"Checking. function call<|role_sep|>\n{call}", f"Checking.<|function_call|>{call}"):
        content, calls = p.parse(text)
        assert content == "Checking." and named(calls) == [("get_weather", {"city": "Paris"})], text
    assert p.parse("Hello!<|message_sep|>\n\nuser<|role_sep|>\nmore") == ("Hello!", [])
    assert p.parse("Hello!<|message_sep|>") == ("Hello!", [])
    assert p.parse("function call<|role_sep|>\nnot JSON") == ("function call<|role_sep|>\nnot JSON", [])
    assert p.parse("a plain answer about a function call") == ("a plain answer about a function call", [])


def test_olmo3_calls_in_a_block_that_opens_the_output():
    """OLMo 3: one Python call a line in `<function_calls>`, JSON's literals too; the text after
    the block is content; a block not at the start, or not of calls, is text."""
    p = make_tool_parser("olmo3")
    content, calls = p.parse('<function_calls>\nget_weather(city="Paris", days=2, metric=true)\n'
                             "search(query='x', tags=[\"a\", null])\n</function_calls> Done.")
    assert content == "Done."
    assert named(calls) == [("get_weather", {"city": "Paris", "days": 2, "metric": True}),
                            ("search", {"query": "x", "tags": ["a", None]})]
    for text in ("Sure. <function_calls>f(x=1)</function_calls>", "<function_calls>f(1)</function_calls>",
                 "<function_calls>not a call</function_calls>", "<function_calls></function_calls>", "plain"):
        assert p.parse(text) == (text, []), text


def test_step3_calls_in_a_section():
    """Step-3: `function<｜tool_sep｜>` and a `steptml:invoke` of parameters, typed by the
    request's schema (stripped); the text around the section is content."""
    from conveyor.server.tool_parsers import tool_schemas

    p = make_tool_parser("step3")
    (begin, end), (call, close), sep = p.SECTION, p.CALL, p.SEP
    text = (f'Checking. {begin}{call}function{sep}<steptml:invoke name="get_weather">'
            f'<steptml:parameter name="city"> Paris </steptml:parameter><steptml:parameter name="days">3'
            f'</steptml:parameter></steptml:invoke>{close}{end} Done.')
    schema = {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}
    with tool_schemas([schema]):
        content, calls = p.parse(text)
    assert content == "Checking.  Done." and named(calls) == [("get_weather", {"city": "Paris", "days": 3})]
    bad = f'{begin}{call}python{sep}<steptml:invoke name="f"></steptml:invoke>{close}{end}'
    assert p.parse(bad) == (bad, [])


def test_llama4_pythonic_lists_after_python_start_or_not():
    p = make_tool_parser("llama4_pythonic")
    want = [("get_weather", {"city": "Paris"})]
    for text in ('[get_weather(city="Paris")]', '<|python_start|>[get_weather(city="Paris")]<|python_end|>',
                 '<|python_start|>[get_weather(city="Paris")]'):
        content, calls = p.parse(text)
        assert content is None and named(calls) == want, text
    assert p.parse("<|python_start|>not calls") == ("not calls", [])
    assert p.parse("Hello [world]") == ("Hello [world]", [])


def test_minimax_m2_invokes_in_blocks():
    """MiniMax-M2: `<invoke name=...>` calls in `<minimax:tool_call>` blocks, names quoted or
    not, values typed by the schema and stripped; text around the blocks."""
    from conveyor.server.tool_parsers import tool_schemas

    p = make_tool_parser("minimax_m2")
    text = ('Let me look.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
            '</parameter>\n<parameter name="days">\n3\n</parameter>\n</invoke>\n<invoke name=search>'
            '<parameter name="query">a < b</parameter></invoke>\n</minimax:tool_call>')
    schema = {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}
    with tool_schemas([schema]):
        content, calls = p.parse(text)
    assert content == "Let me look." and named(calls) == [("get_weather", {"city": "Paris", "days": 3}),
                                                         ("search", {"query": "a < b"})]
    bad = "<minimax:tool_call>stray <invoke name=\"f\"></invoke></minimax:tool_call>"
    assert p.parse(bad) == (bad, [])


def test_ernie45_and_longcat_are_hermes_blocks():
    call = '{"name": "search", "arguments": {"query": "x"}}'
    for name, (open_, close) in (("ernie45", ("<tool_call>", "</tool_call>")),
                                 ("longcat", ("<longcat_tool_call>", "</longcat_tool_call>"))):
        content, calls = make_tool_parser(name).parse(f"Looking.\n{open_}\n{call}\n{close}")
        assert content == "Looking." and named(calls) == [("search", {"query": "x"})], name
    assert make_tool_parser("longcat").parse(f"<tool_call>{call}</tool_call>")[1] == []


def test_mistral_calls_and_content():
    p = make_tool_parser("mistral")
    content, calls = p.parse('Let me look.[TOOL_CALLS][{"name": "search", "arguments": {"query": "x"}}, '
                             '{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert content == "Let me look." and named(calls) == [("search", {"query": "x"}), ("get_weather", {"city": "Oslo"})]
    assert p.parse("[TOOL_CALLS] not json") == ("[TOOL_CALLS] not json", [])
    assert p.parse("plain [TOOL_ text") == ("plain [TOOL_ text", [])


def test_pythonic_calls_and_content():
    p = make_tool_parser("pythonic")
    content, calls = p.parse('[get_weather(city="Paris", days=2, metric=True), search(query=\'x\', tags=["a", None])]')
    assert content is None
    assert named(calls) == [("get_weather", {"city": "Paris", "days": 2, "metric": True}),
                            ("search", {"query": "x", "tags": ["a", None]})]
    for text in ("[1, 2, 3]", "[f(x=y)]", "[f(1)]", "Hello [world]", "[f(**k)]", "[]"):
        assert p.parse(text) == (text, []), text


# -- streams ---------------------------------------------------------------------------------
ARGS = st.dictionaries(st.sampled_from(["city", "query", "n"]),
                       st.one_of(st.text(alphabet="ab ;,[]{}\"'", max_size=5), st.integers(-3, 3), st.booleans()),
                       max_size=2)
NAMES = st.sampled_from(["get_weather", "search"])
CALLS = st.lists(st.builds(lambda n, a: tool_call(n, json.dumps(a)), NAMES, ARGS), min_size=1, max_size=3)
NOISE = st.text(alphabet="ab {}[];<>|_TOLCS\n\"", max_size=10)


@st.composite
def outputs(draw, parser: str) -> str:
    """Texts a model might write in the format: its calls (as `write` puts them) with text
    around where the format allows it, near-misses, or just text."""
    p = make_tool_parser(parser)
    kind = draw(st.sampled_from(["calls", "text", "mixed"]))
    if kind == "text":
        return draw(NOISE)
    calls = p.write(draw(CALLS))
    if kind == "calls":
        return calls
    before, after = draw(NOISE), draw(NOISE)
    cut = draw(st.integers(0, len(calls)))
    return draw(st.sampled_from([before + calls + after, calls[:cut], before + calls, calls + after]))


@pytest.mark.parametrize("parser", PARSERS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_stream_cut_anywhere_gives_what_the_whole_gives(parser, data):
    check_stream_cut(Tools.parse(TOOLS, "auto", None, make_tool_parser(parser)), data.draw(outputs(parser)), data)


@pytest.mark.parametrize("parser", PARSERS)
@settings(max_examples=100, deadline=None)
@given(calls=CALLS)
def test_what_a_parser_writes_it_reads_back(parser, calls):
    p = make_tool_parser(parser)
    content, got = p.parse(p.write(calls))
    assert content is None and named(got) == named(calls)


def test_a_template_without_tools_is_asked_for_the_parsers_format_and_shown_its_history():
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}]
    written = {
        "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "pythonic": "[get_weather(city='Paris')]",
    }
    for parser, text in written.items():
        tools = Tools.parse(TOOLS, "auto", None, make_tool_parser(parser))
        out = history_for_template(messages, tools, "{{ message['content'] }}")
        assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
        assert out[2] == {"role": "assistant", "content": text}, parser
    assert "[TOOL_CALLS]" in Tools.parse(TOOLS, "auto", None, make_tool_parser("mistral")).system_prompt()


def mistral_v11(calls) -> str:
    return "".join(f"[TOOL_CALLS]{c['function']['name']}[ARGS]{c['function']['arguments']}" for c in calls)


@settings(max_examples=150, deadline=None)
@given(calls=CALLS, before=NOISE, after=NOISE, data=st.data())
def test_a_mistral_v11_stream_cut_anywhere_gives_what_the_whole_gives(calls, before, after, data):
    text = data.draw(st.sampled_from([mistral_v11(calls), before + mistral_v11(calls), before + mistral_v11(calls) + after]))
    check_stream_cut(Tools.parse(TOOLS, "auto", None, make_tool_parser("mistral")), text, data)
    content, got = make_tool_parser("mistral").parse(before + mistral_v11(calls))
    assert named(got) == named(calls) and (content or "") == before.strip()
