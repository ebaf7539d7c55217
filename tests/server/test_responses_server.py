"""OpenAI's Responses API (`POST /v1/responses`) on the session's SmolLM2 server, through the
official `openai` client: the output text is the chat completion's for the same conversation
(greedy), whole and streamed (the deltas join to it, the events in order); `instructions`,
`previous_response_id` (a stored conversation goes on) and `GET /v1/responses/{id}`; a forced
function call as a `function_call` item; `text.format` JSON; bad requests a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import openai

from tests.server.conftest import ServerProcess, assert_openai_error


def chat_text(client: openai.OpenAI, messages: list[dict[str, str]], max_tokens: int) -> str:
    r = client.chat.completions.create(model="smollm2", messages=messages, max_completion_tokens=max_tokens,
                                       temperature=0)
    return r.choices[0].message.content or ""


def test_output_is_the_chat_completions(client: openai.OpenAI) -> None:
    r = client.responses.create(model="smollm2", input="Name three colors.", max_output_tokens=24, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output_text == chat_text(client, [{"role": "user", "content": "Name three colors."}], 24)
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage is not None and r.usage.output_tokens > 0 and r.usage.total_tokens == (
        r.usage.input_tokens + r.usage.output_tokens)

    told = client.responses.create(model="smollm2", instructions="Answer in French.", input="Say hello.",
                                   max_output_tokens=16, temperature=0)
    assert told.output_text == chat_text(client, [{"role": "system", "content": "Answer in French."},
                                                  {"role": "user", "content": "Say hello."}], 16)


def test_streamed_events_join_to_the_response(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="smollm2", input="Write a haiku about trains.", max_output_tokens=32,
                                    temperature=0)
    events = list(client.responses.create(model="smollm2", input="Write a haiku about trains.",
                                          max_output_tokens=32, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == deltas
    assert events[-1].response.output_text == deltas


def test_previous_response_id_goes_on_from_a_stored_conversation(client: openai.OpenAI,
                                                                 smol_server: ServerProcess) -> None:
    first = client.responses.create(model="smollm2", input="My name is Ada.", max_output_tokens=16,
                                    temperature=0, instructions="Be brief.")
    second = client.responses.create(model="smollm2", input="What is my name?", max_output_tokens=16,
                                     temperature=0, previous_response_id=first.id)
    # The stored conversation carries the messages and the answer, not the first instructions.
    assert second.output_text == chat_text(client, [
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}], 16)
    assert second.previous_response_id == first.id
    got = httpx.get(f"{smol_server.url}/v1/responses/{first.id}").json()
    assert got["id"] == first.id and got["output"][0]["content"][0]["text"] == first.output_text
    assert_openai_error(httpx.get(f"{smol_server.url}/v1/responses/resp_nope"), 404, "response_id")


def test_a_forced_function_call_and_json_output(client: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    r = client.responses.create(model="smollm2", input="What is the weather in Paris?", tools=[tool],  # type: ignore[list-item]
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=48,
                                temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)

    events = list(client.responses.create(
        model="smollm2", input="What is the weather in Paris?", tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=48, temperature=0, stream=True))
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [a.arguments for a in args] == [calls[0].arguments]
    delta = next(e for e in events if e.type == "response.function_call_arguments.delta")
    assert delta.delta == calls[0].arguments
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(d.name, d.arguments) for d in done] == [("get_weather", calls[0].arguments)]

    schema = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}
    j = client.responses.create(model="smollm2", input="Name a color as JSON.", max_output_tokens=32, temperature=0,
                                text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    assert isinstance(json.loads(j.output_text)["color"], str)


def test_bad_responses_requests_get_a_400(smol_server: ServerProcess) -> None:
    url = smol_server.url + "/v1/responses"
    assert_openai_error(httpx.post(url, json={"input": "hi", "previous_response_id": "resp_nope"}), 400,
                        "previous_response_id")
    assert_openai_error(httpx.post(url, json={"input": "hi", "tools": [{"type": "web_search"}]}), 400, "tools")
    assert_openai_error(httpx.post(url, json={"input": [{"role": "robot", "content": "x"}]}), 400, "input")
    assert_openai_error(httpx.post(url, json={"input": [{"type": "image_generation_call"}]}), 400, "input")
    assert_openai_error(httpx.post(url, json={"input": "hi", "text": {"format": {"type": "xml"}}}), 400, "text")
    assert_openai_error(httpx.post(url, json={"model": "nope", "input": "hi"}), 404, "model")
