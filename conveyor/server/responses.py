"""/v1/responses: OpenAI's Responses API over the chat completions machinery.

A Responses request becomes a chat completion request (its `input` items as messages, its
function tools and `text.format` as the chat's), run by `ChatCompletionHandler` (templates,
tool parsing, reasoning, structured outputs, streaming, disconnects: all as for chat); only the
rendering differs: a response object with `output` items, and, streamed, the Responses events
(`response.created` ... `response.output_text.delta` ... `response.completed`). Responses are
kept in memory (the last `MAX_STORED`, as `store` asks) so that `previous_response_id` goes on
from one and `GET /v1/responses/{id}` gives it back.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import OrderedDict
from typing import Any

from pydantic import ValidationError

from conveyor.sampling_params import InvalidRequestError
from conveyor.server.protocol import ChatCompletionRequest, ResponsesRequest
from conveyor.server.serving import ChatCompletionHandler, ServerState, _Choice

MAX_STORED = 1024


class ResponseStore:
    """Stored responses (id -> the response object and the conversation it ends), the oldest
    forgotten past `MAX_STORED`."""

    def __init__(self, capacity: int = MAX_STORED) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._items[response["id"]] = (response, conversation)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        return self._items.get(response_id)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # input_text / output_text parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _content(content: Any) -> Any:
    """A message's content: its text, or with `input_image` parts (an image URL: data or
    http(s)) the chat API's parts, text and `image_url`, in their order."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text(content)
    parts: list[dict[str, Any]] = []
    for p in content:
        if not isinstance(p, dict):
            continue
        if p.get("type") == "input_image":
            url = p.get("image_url")
            if not isinstance(url, str):
                raise InvalidRequestError("input: an input_image needs its image_url (a data or http(s) URL; "
                                          "file ids are not served)", param="input")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": str(p.get("text", ""))})
    return parts


def to_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: messages (developer as system), function calls
    (an assistant message's tool_calls) and their outputs (tool messages)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequestError(f"input: a message's role {role!r} is not user, system, developer "
                                          "or assistant", param="input")
            out.append({"role": "system" if role == "developer" else role, "content": _content(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(item.get("output"))})
        elif kind == "reasoning":
            continue  # the model's earlier thinking: not shown to it again
        else:
            raise InvalidRequestError(f"input: items of type {kind!r} are not supported", param="input")
    return out


def to_chat(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
    messages += to_messages(body.input)
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "stream": body.stream, "user": body.user, "priority": body.priority,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "parallel_tool_calls", "mm_processor_kwargs"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    if body.tools:
        tools = []
        for t in body.tools:
            if t.get("type") != "function":
                raise InvalidRequestError(f"tools: only function tools are served (got {t.get('type')!r})",
                                          param="tools")
            tools.append({"type": "function", "function": {
                k: t[k] for k in ("name", "description", "parameters") if k in t}})
        chat["tools"] = tools
    choice = body.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = (body.text or {}).get("format")
    if fmt:
        kind = fmt.get("type")
        if kind == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
        elif kind in ("json_object", "text"):
            chat["response_format"] = {"type": kind}
        else:
            raise InvalidRequestError(f"text.format type {kind!r}: must be text, json_object or json_schema",
                                      param="text")
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        raise InvalidRequestError(f"input: {e.errors()[0].get('msg', e)}", param="input") from None


class ResponsesHandler(ChatCompletionHandler):
    id_prefix = "resp"
    named_by_client = False  # (its ids are `resp_<hex>`, what previous_response_id names)

    def __init__(self, state: ServerState, body: ResponsesRequest, store: ResponseStore) -> None:
        history: list[dict[str, Any]] = []
        self.previous: str | None = body.previous_response_id
        if self.previous is not None:
            found = store.get(self.previous)
            if found is None:
                raise InvalidRequestError(f"previous_response_id {self.previous!r}: no stored response has it",
                                          param="previous_response_id")
            history = list(found[1])
        super().__init__(state, to_chat(body, history))
        self.request_id = f"resp_{uuid.uuid4().hex}"
        self.responses_body = body
        self.store = store
        self.seq = 0
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.streamed: list[str] = []  # a stream's text and tokens so far
        self.streamed_ids: list[int] = []

    # -- rendering ---------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _response(self, status: str, output: list[dict[str, Any]], choice: _Choice | None) -> dict[str, Any]:
        b = self.responses_body
        reason = None if choice is None or choice.final is None else choice.final.outputs[0].finish_reason
        usage = self.usage()
        return {
            "id": self.request_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
            "error": None,
            "model": self.model_name,
            "instructions": b.instructions,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "tool_choice": b.tool_choice or "auto",
            "tools": b.tools or [],
            "temperature": b.temperature,
            "top_p": b.top_p,
            "max_output_tokens": b.max_output_tokens,
            "previous_response_id": self.previous,
            "store": b.store,
            "text": b.text or {"format": {"type": "text"}},
            "metadata": b.metadata or {},
            "user": b.user,
            "usage": {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            },
        }

    def _output_items(self, choice: _Choice) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The response's output items, and the assistant message they make (for the store)."""
        message = super().final_choice(choice)["message"]
        items: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                          "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            items.append({"type": "message", "id": self.message_id, "status": "completed", "role": "assistant",
                          "content": [{"type": "output_text", "text": message.get("content") or "",
                                       "annotations": [], "logprobs": []}]})
        for call in calls:
            items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                          "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                          "status": "completed"})
        said: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if calls:
            said["tool_calls"] = calls
        return items, said

    def full_response(self) -> dict[str, Any]:
        choice = self.choices[0]
        items, said = self._output_items(choice)
        reason = choice.final.outputs[0].finish_reason if choice.final is not None else "abort"
        response = self._response("incomplete" if reason == "length" else "completed", items, choice)
        if self.responses_body.store:  # the conversation, without this request's instructions
            messages = self.body.message_dicts()[1 if self.responses_body.instructions else 0 :]
            self.store.put(response, [*messages, said])
        return response

    def opening_chunks(self) -> list[dict[str, Any]]:
        super().opening_chunks()  # (the choices' tool and reasoning streams)
        created = self._response("in_progress", [], None)
        item = {"type": "message", "id": self.message_id, "status": "in_progress", "role": "assistant",
                "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.created", response=created),
            self._event("response.in_progress", response=created),
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                        part=part),
        ]

    def delta_chunk(self, choice: _Choice, out: Any) -> dict[str, Any] | None:
        self.streamed.append(out.outputs[0].delta_text)  # (a streamed output holds what is new)
        self.streamed_ids += out.outputs[0].delta_token_ids
        chunk = super().delta_chunk(choice, out)
        text = None if chunk is None else chunk["choices"][0]["delta"].get("content")
        if not text:
            return None
        return self._event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                           delta=text, logprobs=[])

    def closing_chunks(self) -> list[dict[str, Any]]:
        choice = self.choices[0]
        if choice.final is None:  # the engine failed: the error event went out already
            return []
        whole = dataclasses.replace(choice.final.outputs[0], text="".join(self.streamed),
                                    token_ids=list(self.streamed_ids))
        choice.final = dataclasses.replace(choice.final, outputs=[whole])
        response = self.full_response()
        items = response["output"]
        message = next((i for i in items if i["type"] == "message"), None)
        text = message["content"][0]["text"] if message is not None else ""
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        done_item = message or {"type": "message", "id": self.message_id, "status": "completed",
                                "role": "assistant", "content": [part]}
        events = [
            self._event("response.output_text.done", item_id=self.message_id, output_index=0, content_index=0,
                        text=text, logprobs=[]),
            self._event("response.content_part.done", item_id=self.message_id, output_index=0, content_index=0,
                        part=part),
            self._event("response.output_item.done", output_index=0, item=done_item),
        ]
        for index, item in enumerate((i for i in items if i["type"] != "message"), start=1):
            if item["type"] != "function_call":
                events.append(self._event("response.output_item.added", output_index=index, item=item))
                events.append(self._event("response.output_item.done", output_index=index, item=item))
                continue
            # A call's arguments come whole, once the call is parsed: one delta, then done.
            args = item["arguments"]
            events += [
                self._event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=args),
                self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=args),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        events.append(self._event(kind, response=response))
        return events
