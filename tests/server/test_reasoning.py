"""Reasoning outputs (`--reasoning-parser`): the split of a `<think>` block from the answer,
whole and streamed in random pieces, for every parser; gpt-oss's harmony messages split into
reasoning, content and calls the same two ways; and over HTTP, a SmolLM2 server with the
parser against the session's server without it."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.server.reasoning import keeps_special_tokens, reasoning_stream, split_reasoning
from tests.server.conftest import ServerProcess


@pytest.mark.parametrize(("parser", "text", "want"), [
    ("deepseek_r1", "I should add.</think>\n\n4", ("I should add.", "4")),
    ("deepseek_r1", "<think>\nhmm</think>4", ("\nhmm", "4")),
    ("deepseek_r1", "still thinking when cut off", ("still thinking when cut off", None)),
    ("deepseek_r1", "</think>just the answer", (None, "just the answer")),
    ("qwen3", "<think>a</think>\nb", ("a", "b")),
    ("qwen3", "  <think>a</think>b", ("a", "b")),
    ("qwen3", "no thinking here</think>", (None, "no thinking here</think>")),
    ("qwen3", "<think>cut off", ("cut off", None)),
    ("glm45", "<think>a</think>\nb", ("a", "b")),
    ("glm45", "no thinking here", (None, "no thinking here")),
    ("mistral", "[THINK]Add them.[/THINK]\n\n4", ("Add them.", "4")),
    ("mistral", "4", (None, "4")),
    ("mistral", "<think>not Magistral's tag</think>", (None, "<think>not Magistral's tag</think>")),
    ("seed_oss", "<seed:think>Add.</seed:think>4", ("Add.", "4")),
    ("seed_oss", "Add.</seed:think>\n4", ("Add.", "4")),
    ("step3", "Add them.</think>\n4", ("Add them.", "4")),
    ("step3", "cut off", ("cut off", None)),
    ("ernie45", "abc\n</think>\n\n<response>\ndef\n</response>\n", ("abc\n", "\ndef\n")),
    ("ernie45", "abc\n</think>\ndef", ("abc\n", "def")),
    ("ernie45", "a</think><response>x</response> and after", ("a", "x</response> and after")),
    ("ernie45", "a</think>x <response> y", ("a", "x <response> y")),
    ("hunyuan_a13b", "<think>\nAdd.\n</think>\n<answer>\n4\n</answer>", ("Add.", "4")),
    ("hunyuan_a13b", "<think>\n\n</think>\n<answer>\n4\n</answer>", (None, "4")),
    ("hunyuan_a13b", "no tags", (None, "no tags")),
    ("minimax_m2", "Add them.</think>\n\n4", ("Add them.", "4")),
    ("minimax_m2_append_think", "Add them.</think>\n\n4", (None, "<think>Add them.</think>\n\n4")),
    ("minimax_m2_append_think", "", (None, "<think>")),
    ("granite", "Here is my thought process:\nAdd.\nHere is my response:\n4", ("\nAdd.\n", "4")),
    ("granite", "Here's my thought process: Add. Here's my response: 4", (" Add. ", " 4")),
    ("granite", "Here is my thought process: Add. Here's my response: 4", (" Add. ", " 4")),
    ("granite", "Here is my thought process: cut off", (" cut off", None)),
    ("granite", "4. Here is my response: 4", (None, "4. Here is my response: 4")),
])
def test_split(parser, text, want):
    assert split_reasoning(text, parser) == want


PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<thi", "</th", "\n", " ", "a", "b<", "nk>", "x",
                                   "[THINK]", "[/THINK]", "[TH", "[/T", "<seed:think>", "</seed:think>",
                                   "<response>", "</response>", "<resp", "</res", "ponse>", "<answer>\n",
                                   "\n</answer>", "<ans", "Here is my thought process:", "Here's my response:",
                                   "Here is my response:", "Here", " is my ", "'s my", "thought process:",
                                   "response:"]), max_size=12)


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(["deepseek_r1", "glm45", "mistral", "qwen3", "seed_oss", "step3", "ernie45", "hunyuan_a13b",
                        "minimax_m2", "minimax_m2_append_think", "granite"]),
       PIECES, st.data())
def test_a_stream_cut_anywhere_splits_as_the_whole(parser, pieces, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = reasoning_stream(parser)
    reasoning = content = ""
    for i, chunk in enumerate(chunks):
        r, c = stream.feed(chunk, final=i == len(chunks) - 1)
        reasoning, content = reasoning + r, content + c
    want_reasoning, want_content = split_reasoning(text, parser)
    assert (reasoning, content) == (want_reasoning or "", want_content or "")


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory, smol_server: ServerProcess) -> Iterator[ServerProcess]:
    server = ServerProcess(
        ["--kv-cache-memory", str(128 << 20), "--max-model-len", "1024", "--served-model-name", "smollm2",
         "--reasoning-parser", "deepseek_r1", "--no-engine-process", "--shutdown-timeout", "2"],
        tmp_path_factory.mktemp("thinking") / "server.log",
    )
    server.wait_ready()
    yield server
    server.stop()


def test_a_served_output_comes_back_as_reasoning(client: openai.OpenAI, thinking_server: ServerProcess) -> None:
    """SmolLM2 writes no </think>: under deepseek_r1 (the output starts inside the block) its
    whole answer is reasoning. A grammar holds only what follows the block, so a constrained
    request thinks as freely, but may not end before its answer: it runs to its token limit."""
    thinking = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0)
    ask = {"model": "smollm2", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 16,
           "temperature": 0}
    plain = client.chat.completions.create(**ask).choices[0].message.content
    msg = thinking.chat.completions.create(**ask).choices[0].message
    assert msg.content is None and msg.model_extra["reasoning_content"] == plain
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                       for c in thinking.chat.completions.create(**ask, stream=True) if c.choices)
    assert streamed == plain
    constrained = thinking.chat.completions.create(**ask, response_format={"type": "json_object"}).choices[0]
    assert constrained.message.content is None and constrained.finish_reason == "length"
    assert constrained.message.model_extra["reasoning_content"].startswith(plain)


def test_an_unknown_parser_is_refused():
    from conveyor.config import ConfigError
    from conveyor.server.config import ServerConfig

    with pytest.raises(ConfigError, match="use one of deepseek_r1, ernie45, glm45, granite, hunyuan_a13b, minimax_m2, minimax_m2_append_think, "
                       "mistral, openai_gptoss, qwen3, seed_oss, step3"):
        ServerConfig(reasoning_parser="o1")


# -- gpt-oss's harmony format -----------------------------------------------------------------
ANALYSIS = "<|channel|>analysis<|message|>The user asks for the weather.<|end|>"
CALL = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}"
CANONICAL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'


@pytest.mark.parametrize(("text", "want"), [
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.", ("The user asks for the weather.", "It is sunny.")),
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
     ("The user asks for the weather.", "It is sunny.")),
    (ANALYSIS + CALL, ("The user asks for the weather.", CANONICAL)),  # the stop token <|call|> not in the text
    (ANALYSIS + CALL + "<|call|>", ("The user asks for the weather.", CANONICAL)),
    ("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}",
     (None, CANONICAL)),  # the recipient before the channel
    ("<|channel|>commentary<|message|>Looking it up.<|end|>", (None, "Looking it up.")),  # a preamble: content
    ("<|channel|>analysis<|message|>cut off while think", ("cut off while think", None)),
    ("Just text, no harmony.", (None, "Just text, no harmony.")),
    ("<|channel|>analysis<|mess", (None, None)),  # a header cut off says nothing
])
def test_harmony_split(text, want):
    assert split_reasoning(text, "openai_gptoss") == want
    assert keeps_special_tokens("openai_gptoss") and not keeps_special_tokens("qwen3")


def test_harmony_calls_reach_the_openai_tool_parser():
    from conveyor.server.tool_parsers import make_tool_parser

    _, content = split_reasoning(ANALYSIS + CALL, "openai_gptoss")
    text, calls = make_tool_parser("openai").parse(content)
    assert text is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Paris"}')]


HARMONY_PIECES = st.lists(st.sampled_from([
    "<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.f", " to=user",
    " <|constrain|>json", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|", "ch", "a", " ", "\n", "{}",
    '{"x": 1}', "<|mess", "age|>"]), max_size=14)


@settings(max_examples=400, deadline=None)
@given(HARMONY_PIECES, st.data())
def test_a_harmony_stream_cut_anywhere_splits_as_the_whole(pieces, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = reasoning_stream("openai_gptoss")
    reasoning = content = ""
    for i, chunk in enumerate(chunks):
        r, c = stream.feed(chunk, final=i == len(chunks) - 1)
        reasoning, content = reasoning + r, content + c
    want_reasoning, want_content = split_reasoning(text, "openai_gptoss")
    assert (reasoning, content) == (want_reasoning or "", want_content or "")
