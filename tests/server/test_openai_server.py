"""`conveyor serve` on the default model (SmolLM2), driven by the official `openai` package.

One server process serves the whole session (see conftest); every test talks to it over
loopback HTTP, exactly as a user's client would.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import openai
import pytest
import regex

from conveyor import LLM, SamplingParams
from tests.server.conftest import ServerProcess, sample, scrape

TOPICS = [
    "trains", "the sea", "coffee", "mountains", "winter", "a cat", "the moon", "bread",
    "music", "rain", "a library", "the desert", "bees", "a river", "clocks", "autumn",
    "a lighthouse", "bicycles", "snow", "a garden", "the city", "books", "stars", "tea",
    "a forest", "the wind", "a bridge", "fire", "an island", "the sun", "a market", "birds",
]
PROMPTS = [f"Write one sentence about {t}:" for t in TOPICS]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def offline_reference(smollm2: str, smol_server_process: ServerProcess) -> list[tuple[str, str]]:
    """(text, finish_reason) of each prompt from offline `LLM.generate`, greedy.

    Runs while the server process loads (it asks for the started, not the ready, server).
    """
    import torch

    torch.set_num_threads(1)
    llm = LLM(smollm2, kv_cache_memory=256 << 20, max_model_len=2048)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].finish_reason or "") for o in outs]


# Must stay the first test of the module (and this module the first to use the server, hence
# test_server_errors.py sorts after it): its reference is computed while the server loads.
def test_32_concurrent_streaming_clients_match_offline_generate(
    offline_reference: list[tuple[str, str]], smol_server: ServerProcess
) -> None:
    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str, int]:
        stream = await client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, completion_tokens = [], "", -1
        async for chunk in stream:
            for choice in chunk.choices:
                text.append(choice.text)
                finish = choice.finish_reason or finish
            if chunk.usage is not None:
                completion_tokens = chunk.usage.completion_tokens
        return "".join(text), finish, completion_tokens

    async def all_clients() -> list[tuple[str, str, int]]:
        client = openai.AsyncOpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    results = asyncio.run(all_clients())
    assert [(t, f) for t, f, _ in results] == offline_reference
    assert all(0 < n <= MAX_TOKENS for _, _, n in results)
    assert any(f == "length" for _, f in offline_reference)
    # They really shared steps: some step ran many sequences at once.
    buckets = scrape(smol_server.url)
    assert sample(buckets, "conveyor:iteration_tokens_total_count") > 0


@pytest.mark.parametrize("seed", [None, 7])
def test_chat_streamed_text_equals_non_streamed(client: openai.OpenAI, seed: int | None) -> None:
    messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
    kwargs = {"temperature": 0} if seed is None else {"temperature": 0.9, "seed": seed}
    full = client.chat.completions.create(
        model="smollm2", messages=messages, max_completion_tokens=40, **kwargs  # type: ignore[arg-type]
    )
    choice = full.choices[0]
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert full.usage is not None and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    stream = client.chat.completions.create(
        model="smollm2", messages=messages, max_completion_tokens=40, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, **kwargs,
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.message.content
    assert finishes == [choice.finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    # The same counts; the second request may find the first one's prompt in the prefix cache.
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)


def test_completions_streamed_text_equals_non_streamed(client: openai.OpenAI) -> None:
    prompt = "The days of the week are Monday,"
    full = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=30, temperature=0, stop=["Friday"]
    )
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert full.model == "smollm2"  # the first served name is the one reported
    text = full.choices[0].text
    assert "Wednesday" in text and "Fri" not in text and full.choices[0].finish_reason == "stop"
    assert full.usage is not None and full.usage.completion_tokens > 0

    streamed = client.completions.create(
        prompt=prompt, model="smollm2", max_tokens=30, temperature=0, stop=["Friday"], stream=True
    )
    pieces = [c.choices[0].text for c in streamed if c.choices]
    assert "".join(pieces) == text
    assert not any("Fri" in p for p in pieces)  # the stop string's prefix was held back


def test_n_choices_seeded_are_reproducible_and_indexed(client: openai.OpenAI) -> None:
    kwargs = dict(model="smollm2", prompt="Once upon a time", max_tokens=12, n=3, temperature=1.0, seed=5)
    a = client.completions.create(**kwargs)  # type: ignore[call-overload]
    b = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # seed, seed+1, seed+2 differ
    assert a.usage is not None and a.usage.prompt_tokens == b.usage.prompt_tokens  # counted once
    streamed: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for chunk in client.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        for c in chunk.choices:
            streamed[c.index].append(c.text)
    assert ["".join(streamed[i]) for i in range(3)] == [c.text for c in a.choices]


def test_logprobs_and_vllm_extensions(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        logprobs=True, top_logprobs=3, temperature=0,
        extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True, "priority": 1},
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == 5 and out.choices[0].finish_reason == "length"
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    comp = client.completions.create(model="smollm2", prompt="1, 2, 3,", max_tokens=4, logprobs=2, temperature=0)
    lp = comp.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 4 and len(lp.top_logprobs[0]) == 2


def test_logit_bias_and_allowed_token_ids(client: openai.OpenAI) -> None:
    """A +100 bias forces its token as surely as allowing only that token, in both APIs, and
    min_tokens holds the end back: the answers are the same token three times, not the
    model's greedy text. A bad word's token is never drawn."""
    kwargs: dict[str, Any] = dict(model="smollm2", max_tokens=3, temperature=0)
    prompt = "The capital of France is"
    plain = client.completions.create(prompt=prompt, **kwargs).choices[0].text
    biased = client.completions.create(prompt=prompt, logit_bias={"330": 100}, **kwargs)
    only = client.completions.create(prompt=prompt, extra_body={"allowed_token_ids": [330]}, **kwargs)
    assert biased.choices[0].text == only.choices[0].text != plain
    assert biased.usage is not None and biased.usage.completion_tokens == 3
    messages = [{"role": "user", "content": "Say hi."}]
    chat = client.chat.completions.create(messages=messages, logit_bias={"330": 100}, **kwargs)
    assert chat.choices[0].message.content == only.choices[0].text
    ended = client.chat.completions.create(
        messages=messages, model="smollm2", max_tokens=6, temperature=0,
        logit_bias={"2": 100}, extra_body={"min_tokens": 4},  # 2 is SmolLM2's <|im_end|>
    )
    assert ended.choices[0].finish_reason == "stop" and ended.usage is not None
    assert ended.usage.completion_tokens == 5  # four held back, then the end
    free = client.completions.create(prompt=prompt, logprobs=0, **kwargs).choices[0].logprobs
    assert free is not None
    first = free.tokens[0]  # the model's first word, a token of its own
    banned = client.completions.create(prompt=prompt, logprobs=0, extra_body={"bad_words": [first.strip()]}, **kwargs)
    assert banned.choices[0].logprobs is not None and first not in banned.choices[0].logprobs.tokens


def test_prompt_logprobs_echoed_and_as_vllm_gives_them(client: openai.OpenAI) -> None:
    """echo with logprobs (OpenAI's legacy API) puts the prompt's tokens first, the first
    with null logprobs; vLLM's prompt_logprobs gives the same values per token id with their
    ranks; a stream's chunks add up to the response."""
    kwargs: dict[str, Any] = dict(model="smollm2", prompt="One, two, three,", max_tokens=3, temperature=0, logprobs=2)
    echoed = client.completions.create(echo=True, **kwargs)
    lp = echoed.choices[0].logprobs
    assert echoed.usage is not None and lp is not None
    n_prompt = echoed.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3 and "".join(lp.tokens) == echoed.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:]) and lp.text_offset[n_prompt] == len("One, two, three,")
    plain = client.completions.create(extra_body={"prompt_logprobs": 0}, **kwargs).model_dump()["choices"][0]
    field = plain["prompt_logprobs"]
    assert len(field) == n_prompt and field[0] is None
    values = [next(iter(e.values())) for e in field[1:]]  # the prompt token's own (its key first)
    assert [v["logprob"] for v in values] == pytest.approx(lp.token_logprobs[1:n_prompt], abs=1e-4)
    assert all(v["rank"] >= 1 for v in values) and plain["text"] == echoed.choices[0].text[len("One, two, three,"):]
    tokens: list[str] = []
    streamed: list[float | None] = []
    for chunk in client.completions.create(echo=True, stream=True, **kwargs):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                streamed += c.logprobs.token_logprobs
    assert tokens == lp.tokens and streamed == pytest.approx(lp.token_logprobs)
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={"prompt_logprobs": 1},
    ).model_dump()
    field = chat["choices"][0]["prompt_logprobs"]
    assert len(field) == chat["usage"]["prompt_tokens"] and field[0] is None
    assert all(1 <= len(e) <= 2 and any(v["rank"] == 1 for v in e.values()) for e in field[1:])


def test_streamed_logprobs_and_usage_match_the_response(client: openai.OpenAI) -> None:
    """A stream's chunks carry only what is new (output_kind "delta" inside): together they
    are the response's tokens, logprobs and text offsets, and its usage."""
    kwargs = dict(model="smollm2", prompt="The days of the week are Monday,", max_tokens=12, logprobs=2,
                  temperature=0, echo=False)
    whole = client.completions.create(**kwargs)  # type: ignore[call-overload]
    want = whole.choices[0].logprobs
    tokens: list[str] = []
    values: list[float] = []
    offsets: list[int] = []
    text = ""
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                           **kwargs):  # type: ignore[call-overload]
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.choices[0].text
    assert tokens == want.tokens and offsets == want.text_offset and len(offsets) == 12
    assert values == pytest.approx(want.token_logprobs)
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens == 12


def test_structured_outputs_over_the_api(client: openai.OpenAI) -> None:
    """OpenAI's response_format (json_schema, json_object) and vLLM's guided_choice, streamed or not."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"]}
    messages = [{"role": "user", "content": "Name a large city and its population, as JSON."}]
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=60, temperature=0, stream=True,
        response_format={"type": "json_object"},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)
    r2 = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Is the sea salty? Answer:", max_tokens=5, temperature=0.9, n=4,
        seed=3, extra_body={"guided_choice": [" yes", " no"]},
    )
    assert {c.text for c in r2.choices} <= {" yes", " no"}
    # A context-free grammar (GBNF), as vLLM's structured_outputs.grammar and SGLang's ebnf
    nested = 'root ::= "[" list "]"\nlist ::= item ("," item)*\nitem ::= [0-9]{1,3} | "[" list "]"'
    pattern = r"\[(?&l)\](?(DEFINE)(?P<l>(?&i)(?:,(?&i))*)(?P<i>[0-9]{1,3}|\[(?&l)\]))"
    lark = 'start: "[" list "]"\nlist: item ("," item)*\nitem: /[0-9]{1,3}/ | "[" list "]"'  # the same, in Lark's syntax
    for extra in ({"structured_outputs": {"grammar": nested}}, {"ebnf": nested}, {"guided_grammar": lark}):
        r3 = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="Nested lists of numbers: [[1,2],[3,[4]]] and", max_tokens=24,
            temperature=0, extra_body=extra,
        )
        text = r3.choices[0].text
        assert regex.fullmatch(pattern, text, partial=r3.choices[0].finish_reason != "stop"), text


def test_a_structural_tag_over_the_api(client: openai.OpenAI) -> None:
    """vLLM's structural_tag response format, and the same in structured_outputs: SmolLM2
    answers in its own words, but where it writes the trigger the answer goes on as the
    structure (a JSON string of the enum between `begin` and `end`), then freely again."""
    tag = {"structures": [{"begin": " is ", "schema": {"enum": ["Paris", "Lyon"]}, "end": "."}], "triggers": [" is"]}
    ask = {"model": "SmolLM2-135M-Instruct", "max_tokens": 24, "temperature": 0,
           "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    plain = client.chat.completions.create(**ask).choices[0].message.content or ""
    assert " is" in plain and '"Paris"' not in plain
    tree = {"type": "triggered_tags", "triggers": [" is"], "tags": [  # the same, as xgrammar's format tree
        {"type": "tag", "begin": " is ", "content": {"type": "json_schema", "json_schema": {"enum": ["Paris", "Lyon"]}},
         "end": "."}]}
    for extra in ({"response_format": {"type": "structural_tag", **tag}},
                  {"extra_body": {"structured_outputs": {"structural_tag": json.dumps(tag)}}},
                  {"response_format": {"type": "structural_tag", "format": tree}}):
        text = client.chat.completions.create(**ask, **extra).choices[0].message.content or ""
        head, _, tail = text.partition(" is")
        assert head == plain.partition(" is")[0], text  # free text until the trigger: the same tokens
        assert regex.match(r' ("Paris"|"Lyon")\.', tail), text
    with pytest.raises(openai.BadRequestError, match="does not start with a trigger"):
        client.chat.completions.create(**ask, response_format={"type": "structural_tag", **tag, "triggers": ["<x>"]})
    answer = {"type": "sequence", "elements": [{"type": "const_string", "value": "Answer: "},
                                               {"type": "json_schema", "json_schema": {"enum": ["Paris", "Lyon"]}}]}
    text = client.chat.completions.create(**ask, response_format={"type": "structural_tag", "format": answer})
    assert text.choices[0].message.content in ('Answer: "Paris"', 'Answer: "Lyon"')
    with pytest.raises(openai.BadRequestError, match=r"structural_tag.format.elements\[1\]: 'exclude_token'"):
        bad = {"type": "sequence", "elements": [answer, {"type": "exclude_token", "exclude_tokens": ["<|im_end|>"]}]}
        client.chat.completions.create(**ask, response_format={"type": "structural_tag", "format": bad})
    # SmolLM2's special tokens around the answer (`<filename>` by its text, `<gh_stars>` by its id, 7)
    tokens = {"type": "tag", "begin": {"type": "token", "token": "<filename>"}, "end": {"type": "token", "token": 7},
              "content": {"type": "json_schema", "json_schema": {"enum": ["Paris", "Lyon"]}}}
    for skip, form in ((True, '{}'), (False, '<filename>{}<gh_stars>')):
        text = client.chat.completions.create(**ask, response_format={"type": "structural_tag", "format": tokens},
                                              extra_body={"skip_special_tokens": skip}).choices[0].message.content
        assert text in (form.format('"Paris"'), form.format('"Lyon"')), text


def test_models_version_health(smol_server: ServerProcess, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2", "SmolLM2-135M-Instruct"]
    assert httpx.get(smol_server.url + "/health").status_code == 200
    assert httpx.get(smol_server.url + "/version").json()["version"]


def test_metrics_parse_and_counters_move(smol_server: ServerProcess, client: openai.OpenAI) -> None:
    before = scrape(smol_server.url)
    for name in (
        "conveyor:time_to_first_token_seconds_count",
        "conveyor:inter_token_latency_seconds_count",
        "conveyor:e2e_request_latency_seconds_count",
        "conveyor:request_queue_time_seconds_count",
        "conveyor:num_requests_running",
        "conveyor:num_requests_waiting",
        "conveyor:num_requests_swapped",
        "conveyor:kv_cache_usage_perc",
        "conveyor:num_preemptions_total",
        "conveyor:prompt_tokens_total",
        "conveyor:generation_tokens_total",
        "conveyor:iteration_tokens_total_count",
    ):
        assert (name, ()) in before, name
    out = client.completions.create(model="smollm2", prompt="Hello there", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    after = scrape(smol_server.url)
    usage = out.usage
    assert usage is not None

    def moved(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert moved("conveyor:request_success_total", finished_reason="length") == 1
    assert moved("conveyor:prompt_tokens_total") == usage.prompt_tokens
    assert moved("conveyor:generation_tokens_total") == usage.completion_tokens == 6
    assert moved("conveyor:time_to_first_token_seconds_count") == 1
    assert moved("conveyor:e2e_request_latency_seconds_count") == 1
    assert moved("conveyor:inter_token_latency_seconds_count") == 5
    assert moved("conveyor:iteration_tokens_total_count") >= 6
    assert moved("conveyor:iteration_tokens_total_sum") >= usage.prompt_tokens + 5


def test_a_repeated_prompt_reports_its_cached_tokens(smol_server: ServerProcess, client: openai.OpenAI) -> None:
    prompt = "You are a terse assistant who answers in one short sentence. " * 4 + "What is the tallest mountain?"
    kwargs: dict[str, Any] = dict(model="smollm2", prompt=prompt, max_tokens=4, temperature=0)
    first = client.completions.create(**kwargs)
    before = scrape(smol_server.url)
    second = client.completions.create(**kwargs)
    after = scrape(smol_server.url)
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    # Every full 16-token block of the prompt but the one holding its last token.
    assert details.cached_tokens == (second.usage.prompt_tokens - 1) // 16 * 16 > 0
    assert second.choices[0].text == first.choices[0].text
    hits = sample(after, "conveyor:prefix_cache_hits_total") - sample(before, "conveyor:prefix_cache_hits_total")
    queries = sample(after, "conveyor:prefix_cache_queries_total") - sample(before, "conveyor:prefix_cache_queries_total")
    assert (hits, queries) == (details.cached_tokens, second.usage.prompt_tokens)
    # The streamed usage says the same.
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == details.cached_tokens


def test_a_cache_salt_keeps_a_repeated_prompt_out_of_another_salts_cache(client: openai.OpenAI) -> None:
    """vLLM's cache_salt: the prompt another salt computed is not a hit; the same salt's is."""
    prompt = "You are a careful assistant who answers in one word. " * 4 + "Which planet is red?"
    kwargs: dict[str, Any] = dict(model="smollm2", prompt=prompt, max_tokens=2, temperature=0)

    def cached(salt: str) -> int:
        out = client.completions.create(**kwargs, extra_body={"cache_salt": salt})
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        return out.usage.prompt_tokens_details.cached_tokens or 0

    assert cached("a-long-random-secret-of-tenant-one") == 0
    assert cached("a-long-random-secret-of-tenant-two") == 0
    assert cached("a-long-random-secret-of-tenant-one") > 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(**kwargs, extra_body={"cache_salt": ""})


def test_logprobs_can_name_tokens_by_id(smol_server: ServerProcess, client: openai.OpenAI) -> None:
    """vLLM's return_tokens_as_token_ids: logprobs name tokens `token_id:N`, the ids whose text
    the same request's plain logprobs give; offsets still count the text."""
    kwargs: dict[str, Any] = dict(model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=2)
    plain = client.completions.create(**kwargs).choices[0]
    ids = client.completions.create(**kwargs, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert ids.text == plain.text and ids.logprobs is not None and plain.logprobs is not None
    assert ids.logprobs.text_offset == plain.logprobs.text_offset
    assert ids.logprobs.token_logprobs == plain.logprobs.token_logprobs
    tokens = ids.logprobs.tokens or []
    assert all(re.fullmatch(r"token_id:\d+", t) for t in tokens)
    for t, text in zip(tokens, plain.logprobs.tokens or [], strict=True):
        back = httpx.post(smol_server.url + "/detokenize", json={"tokens": [int(t.split(":")[1])]}).json()
        assert back["prompt"] == text
    assert all(re.fullmatch(r"token_id:\d+", k) for top in ids.logprobs.top_logprobs or [] for k in top)
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say yes."}], max_tokens=2, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content and all(re.fullmatch(r"token_id:\d+", c.token) for c in content)


def test_return_token_ids_gives_the_prompts_and_the_answers_ids(smol_server: ServerProcess) -> None:
    """vLLM's return_token_ids: a completion's choice holds the prompt's ids (those /tokenize
    gives) and the answer's (detokenized, its text; as many as the usage counts); streamed, the
    prompt's come in the first chunk and the chunks' ids add up to the answer's. A chat response
    holds the prompt's at its top (the chat template's), its choices their own."""
    url = smol_server.url

    def events(route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        with httpx.stream("POST", url + route, json={**body, "stream": True}, timeout=60) as r:
            return [json.loads(line[5:]) for line in r.iter_lines()
                    if line.startswith("data:") and line != "data: [DONE]"]

    body: dict[str, Any] = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8,
                            "temperature": 0, "return_token_ids": True}
    full = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    choice = full["choices"][0]
    assert choice["prompt_token_ids"] == httpx.post(url + "/tokenize", json={"prompt": body["prompt"]}).json()["tokens"]
    assert len(choice["token_ids"]) == full["usage"]["completion_tokens"] == 8
    assert httpx.post(url + "/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"] == choice["text"]
    chunks = [c["choices"][0] for c in events("/v1/completions", body) if c["choices"]]
    assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    assert "token_ids" not in httpx.post(url + "/v1/completions", json={**body, "return_token_ids": False},
                                         timeout=60).json()["choices"][0]

    chat_body: dict[str, Any] = {"model": "smollm2", "messages": [{"role": "user", "content": "Name a color."}],
                                 "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    chat = httpx.post(url + "/v1/chat/completions", json=chat_body, timeout=60).json()
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    streamed = events("/v1/chat/completions", chat_body)
    assert [c["prompt_token_ids"] for c in streamed if "prompt_token_ids" in c] == [chat["prompt_token_ids"]]
    assert [t for c in streamed for ch in c["choices"] for t in ch.get("token_ids", [])] == chat["choices"][0]["token_ids"]


def test_a_request_named_by_its_id_is_aborted_by_it(smol_server: ServerProcess) -> None:
    """vLLM's `request_id` (and the X-Request-Id header) names a request: its response id is
    "cmpl-<id>"; SGLang's /abort_request {"rid"} ends it mid-stream with finish_reason "abort"
    while it streams on; an id in flight is refused again, an unknown one is a 404, and
    `abort_all` ends every request in flight."""
    import threading

    url = smol_server.url
    body = {"prompt": "Tell me a very long story.", "max_tokens": 1500, "ignore_eos": True, "stream": True,
            "request_id": "rollout-7"}
    with httpx.Client(timeout=60.0) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
        assert first["id"] == "cmpl-rollout-7"
        again = http.post(url + "/v1/completions", json={**body, "stream": False})
        assert again.status_code == 400 and again.json()["error"]["param"] == "request_id"
        assert http.post(url + "/abort_request", json={"rid": "rollout-7"}).status_code == 200
        events = [json.loads(line[5:]) for line in lines if line.startswith("data:") and line != "data: [DONE]"]
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
        assert finish == ["abort"] and sum(len(c["text"]) > 0 for e in events for c in e["choices"]) < 1400
    assert httpx.post(url + "/abort_request", json={"rid": "rollout-7"}).status_code == 404  # (done)
    named = httpx.post(url + "/v1/completions", headers={"X-Request-Id": "by-header"},
                       json={"prompt": "Hi", "max_tokens": 2}, timeout=60).json()
    assert named["id"] == "cmpl-by-header"

    results: list[dict[str, Any]] = []
    long = {"prompt": "Tell me a very long story.", "max_tokens": 1500, "ignore_eos": True}
    threads = [threading.Thread(target=lambda k=k: results.append(httpx.post(
        url + "/v1/completions", json={**long, "request_id": f"all-{k}"}, timeout=120).json())) for k in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sample(scrape(url), "conveyor:num_requests_running") < 2:
        assert time.monotonic() < deadline, "the two requests never ran"
        time.sleep(0.05)
    assert httpx.post(url + "/abort_request", json={"abort_all": True}).status_code == 200
    for t in threads:
        t.join(60)
    assert sorted(r["choices"][0]["finish_reason"] for r in results) == ["abort", "abort"]
    assert httpx.post(url + "/abort_request", json={}).status_code == 400


def test_reset_prefix_cache_route_forgets_the_served_prefixes(smol_server: ServerProcess, client: openai.OpenAI) -> None:
    """vLLM's POST /reset_prefix_cache, through the engine process: a repeated prompt hits before
    it and not after it."""
    prompt = "You are a patient assistant who answers briefly. " * 4 + "What is two plus two?"
    kwargs: dict[str, Any] = dict(model="smollm2", prompt=prompt, max_tokens=2, temperature=0)

    def cached() -> int:
        usage = client.completions.create(**kwargs).usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return usage.prompt_tokens_details.cached_tokens or 0

    cached()
    assert cached() > 0
    assert httpx.post(smol_server.url + "/reset_prefix_cache").status_code == 200
    assert cached() == 0
    assert httpx.post(smol_server.url + "/reset_mm_cache").status_code == 200


def _wait_for_abort(url: str, aborted_before: float, timeout: float = 15.0) -> dict:
    """Poll /metrics until one more request is counted aborted and no KV block is in use."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        aborted = sample(m, "conveyor:request_success_total", finished_reason="abort")
        if aborted > aborted_before and sample(m, "conveyor:kv_cache_usage_perc") == 0:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"no abort seen within {timeout} s: aborted={aborted}, metrics={m}")
        time.sleep(0.05)


def test_streaming_client_disconnect_aborts_and_frees_blocks(smol_server: ServerProcess) -> None:
    url = smol_server.url
    before = sample(scrape(url), "conveyor:request_success_total", finished_reason="abort")
    body = {"prompt": "Tell me a very long story.", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30.0) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = 0
        lines = r.iter_lines()  # kept referenced: an abandoned iterator closes the connection
        for line in lines:
            events += line.startswith("data:")
            if events == 4:
                break
        during = scrape(url)
        assert sample(during, "conveyor:request_success_total", finished_reason="abort") == before
        assert sample(during, "conveyor:num_requests_running") == 1
        assert sample(during, "conveyor:kv_cache_usage_perc") > 0
    # The connection is closed here, mid-stream.
    after = _wait_for_abort(url, before)
    assert sample(after, "conveyor:num_requests_running") == 0
    assert sample(after, "conveyor:num_requests_waiting") == 0


def test_non_streaming_client_disconnect_aborts(smol_server: ServerProcess) -> None:
    url = smol_server.url
    before = sample(scrape(url), "conveyor:request_success_total", finished_reason="abort")
    body = {"prompt": "Tell me a very long story.", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=1.5)
    _wait_for_abort(url, before)
    # The server is still fine afterwards.
    ok = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30.0)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_sagemakers_routes_and_the_load(smol_server: ServerProcess) -> None:
    """/ping answers as /health; /invocations serves a chat completion, a completion and an
    embedding as their own routes do, and names what it takes otherwise; /load counts requests."""
    url = smol_server.url
    assert httpx.get(url + "/ping").status_code == 200 and httpx.post(url + "/ping").status_code == 200
    chat = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8, "temperature": 0.0}
    completion = {"prompt": "The sky is", "max_tokens": 8, "temperature": 0.0}
    embedding = {"input": "The sky is blue."}
    for body, route, field in ((chat, "/v1/chat/completions", "choices"), (completion, "/v1/completions", "choices"),
                               (embedding, "/v1/embeddings", "data")):
        direct = httpx.post(url + route, json=body, timeout=60.0)
        via = httpx.post(url + "/invocations", json=body, timeout=60.0)
        assert direct.status_code == via.status_code == 200, via.text
        if field == "choices":
            key = "message" if route.endswith("chat/completions") else "text"
            assert [c[key] for c in via.json()["choices"]] == [c[key] for c in direct.json()["choices"]]
        else:
            assert via.json()["data"][0]["embedding"] == pytest.approx(direct.json()["data"][0]["embedding"])
    other = httpx.post(url + "/invocations", json={"query": "?"})
    assert other.status_code == 400 and "messages" in other.json()["error"]["message"]
    bad = httpx.post(url + "/invocations", json={"messages": "not a list"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert isinstance(httpx.get(url + "/load").json()["server_load"], int)
