"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request is translated into a chat completion request (`server.protocol`'s: every sampling
check, the chat template, tool choices, structured outputs and the parsers are the ones
`/v1/chat/completions` runs), and its one generation is rendered as a Responses object:
- `input`: a string, or items: messages (`role` user, system, developer or assistant; content
  a string or `input_text` / `output_text` parts), `function_call` (a call the model made)
  and `function_call_output` (its result, which must answer a call before it); `reasoning`
  items of earlier turns are dropped; `instructions` become the system message;
- `tools` (function tools), `tool_choice` (auto, none, required, or a function),
  `parallel_tool_calls`; `text.format` (text, json_object, or json_schema: the answer is
  constrained to the schema); `max_output_tokens`, `temperature`, `top_p`;
- the output items: `reasoning` (with a `--reasoning-parser`), a `message` with its
  `output_text`, `function_call`s; `status` completed, or incomplete with the reason
  max_output_tokens; `usage`. `stream` sends the Responses events (`response.created`,
  `response.output_item.added`, `response.output_text.delta`, `response.reasoning_text.delta`,
  `response.function_call_arguments.delta`, their `.done`s, `response.completed`), made from
  the same deltas as a chat stream, so they add up to the stored response.
- `store` (default true) keeps a response, with the conversation it continues, in a bounded
  in-memory store (`ResponseStore`: the newest `MAX_STORED`, each for `STORE_TTL_S`), for
  `previous_response_id` and `GET` / `DELETE /v1/responses/{id}`.

Not supported (a 400 naming the field): `background`, tools other than functions
(web search, file search, computer use, MCP), input images and files.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from server import protocol
from server.chat_errors import parse_chat_request
from server.generation import ChatCompletion, chat_generation
from server.protocol import APIError, _Model
from server.serving import ServerState

router = APIRouter()

MAX_STORED = 1024  # responses kept for previous_response_id
STORE_TTL_S = 3600.0  # seconds a stored response lives


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseStore:
    """Stored responses: id -> (when stored, the response, the conversation after it as chat
    messages). The oldest go first past `capacity`; each expires after `ttl` seconds."""

    def __init__(self, capacity: int = MAX_STORED, ttl: float = STORE_TTL_S):
        self.capacity, self.ttl = capacity, ttl
        self._items: collections.OrderedDict[str, tuple[float, dict, list[dict]]] = (
            collections.OrderedDict()
        )

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._items[response["id"]] = (time.monotonic(), response, conversation)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        item = self._items.get(response_id)
        if item is None:
            return None
        if time.monotonic() - item[0] > self.ttl:
            del self._items[response_id]
            return None
        return item[1], item[2]

    def delete(self, response_id: str) -> bool:
        return self.get(response_id) is not None and self._items.pop(response_id) is not None


def _store(state: ServerState) -> ResponseStore:
    """The server's store, made on first use."""
    if state.responses is None:
        state.responses = ResponseStore()
    return state.responses


class ResponsesRequest(_Model):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    background: bool | None = None
    metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None


def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError.bad_request(f"{param} must be a string or a list of content parts", param)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise APIError.bad_request(
                f"{param}.{i}: content part type {protocol._short(kind)} is not supported "
                "(input_text and output_text are)",
                f"{param}.{i}.type",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(items: str | list[Any], history: list[dict]) -> list[dict]:
    """The input items, after `history`, as chat messages (see the module docstring)."""
    if isinstance(items, str):
        return [*history, {"role": "user", "content": items}]
    out = list(history)
    calls = {c["id"] for m in history for c in m.get("tool_calls", [])}
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise APIError.bad_request(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError.bad_request(
                    f"{where}.role must be user, system, developer or assistant", f"{where}.role"
                )
            text = _content_text(item.get("content"), f"{where}.content")
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            arguments = item.get("arguments", "{}")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise APIError.bad_request(
                    f"{where}: a function_call needs string call_id, name and arguments", where
                )
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": arguments}}  # fmt: skip
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            calls.add(call_id)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if call_id not in calls:
                raise APIError.bad_request(
                    f"{where}: function_call_output for {protocol._short(call_id)}, which no "
                    "function_call before it made",
                    f"{where}.call_id",
                )
            text = output if isinstance(output, str) else json.dumps(output)
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue  # earlier turns' thinking is not sent back to the model
        else:
            raise APIError.bad_request(
                f"{where}: item type {protocol._short(kind)} is not supported (message, "
                "function_call, function_call_output, reasoning)",
                f"{where}.type",
            )
    return out


def _chat_fields(req: ResponsesRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if req.background:
        raise APIError.bad_request("background mode is not supported", "background")
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise APIError.bad_request(
                    f"tools.{i}: only function tools are supported", f"tools.{i}.type"
                )
            function = {"name": tool.get("name"), "parameters": tool.get("parameters")}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            tools.append({"type": "function", "function": function})
        fields["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        fields["tool_choice"] = choice
    if req.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": fmt.get("name", "schema"), "schema": fmt.get("schema")},
            }
        elif kind == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif kind != "text":
            raise APIError.bad_request(
                "text.format.type must be text, json_object or json_schema", "text.format.type"
            )
    effort = (req.reasoning or {}).get("effort") if isinstance(req.reasoning, dict) else None
    for name, value in (
        ("max_completion_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("reasoning_effort", effort),
    ):
        if value is not None:
            fields[name] = value
    return fields


# Chat request params -> the Responses API's names, for error messages.
_PARAMS = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


def to_chat_request(req: ResponsesRequest, history: list[dict]):
    """(the chat completion request `req` asks for, its messages)."""
    messages = _messages(req.input, history)
    if req.instructions is not None:  # this turn's, never stored with the conversation
        messages = [{"role": "system", "content": req.instructions}, *messages]
    if not messages:
        raise APIError.bad_request("input must not be empty", "input")
    body = {"messages": messages, "stream": req.stream, **_chat_fields(req)}
    # the input does not map one to one onto the messages: an error in any is the input's
    chat = parse_chat_request(body, _PARAMS, messages_param="input")
    offset = 1 if req.instructions is not None else 0
    return chat, messages[offset:]


# ---- the response -----------------------------------------------------------------------


class _Items:
    """The output items of a response as deltas build them: a reasoning item, a message,
    function calls; each opened when its first delta comes, closed when another kind comes."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.open: dict | None = None

    def _event(self, kind: str, **data) -> tuple[str, dict]:
        return kind, data

    def _start(self, item: dict) -> list[tuple[str, dict]]:
        events = self.close()
        self.items.append(item)
        self.open = item
        events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=_in_progress(item)))  # fmt: skip
        if item["type"] == "message":
            events.append(self._part("response.content_part.added", item))
        return events

    def _part(self, kind: str, item: dict) -> tuple[str, dict]:
        return self._event(kind, item_id=item["id"], output_index=len(self.items) - 1,
                           content_index=0, part=item["content"][0])  # fmt: skip

    def close(self) -> list[tuple[str, dict]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items) - 1
        events = []
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events.append(self._event("response.output_text.done", item_id=item["id"],
                                      output_index=index, content_index=0, text=text,
                                      logprobs=[]))  # fmt: skip
            events.append(self._part("response.content_part.done", item))
        elif item["type"] == "reasoning":
            events.append(self._event("response.reasoning_text.done", item_id=item["id"],
                                      output_index=index, content_index=0,
                                      text=item["content"][0]["text"]))  # fmt: skip
        else:
            events.append(self._event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=index,
                                      arguments=item["arguments"]))  # fmt: skip
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def add(self, d: protocol.DeltaMessage) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        if d.reasoning_content:
            if self.open is None or self.open["type"] != "reasoning":
                events += self._start(_reasoning_item(""))
            self.open["content"][0]["text"] += d.reasoning_content
            events.append(self._event("response.reasoning_text.delta", item_id=self.open["id"],
                                      output_index=len(self.items) - 1, content_index=0,
                                      delta=d.reasoning_content))  # fmt: skip
        if d.content:
            if self.open is None or self.open["type"] != "message":
                events += self._start(_message_item(""))
            self.open["content"][0]["text"] += d.content
            events.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                      output_index=len(self.items) - 1, content_index=0,
                                      delta=d.content, logprobs=[]))  # fmt: skip
        for call in d.tool_calls or []:
            arguments = call.function.arguments if call.function is not None else None
            if call.id is not None:
                events += self._start(_call_item(call.id, call.function.name, ""))
            if arguments:
                self.open["arguments"] += arguments
                events.append(self._event("response.function_call_arguments.delta",
                                          item_id=self.open["id"],
                                          output_index=len(self.items) - 1,
                                          delta=arguments))  # fmt: skip
        return events


def _in_progress(item: dict) -> dict:
    return {**item, "status": "in_progress"} if "status" in item else item


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def _message_item(text: str) -> dict:
    return {"type": "message", "id": _id("msg"), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}  # fmt: skip


def _call_item(call_id: str, name: str, arguments: str) -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}  # fmt: skip


def output_items(message: protocol.ChatResponseMessage) -> list[dict]:
    """A chat choice's message as output items."""
    items = []
    if message.reasoning_content:
        items.append(_reasoning_item(message.reasoning_content))
    if message.content:
        items.append(_message_item(message.content))
    for call in message.tool_calls or []:
        items.append(_call_item(call.id, call.function.name, call.function.arguments))
    return items


def conversation_after(messages: list[dict], items: list[dict]) -> list[dict]:
    """The conversation a response continues, with its output as the assistant's turn."""
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
    calls = [
        {"id": i["call_id"], "type": "function",
         "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in items
        if i["type"] == "function_call"
    ]  # fmt: skip
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        turn["tool_calls"] = calls
    return [*messages, turn]


class ResponsesGeneration(ChatCompletion):
    """A chat generation answered as a Responses object (`full`) or its events (`stream`),
    stored when asked."""

    def __init__(self, *args, responses_request, messages, state: ServerState, **kwargs):
        super().__init__(*args, **kwargs)
        self.responses_request = responses_request
        self.messages = messages  # the conversation, without this turn's instructions
        self.state = state
        self.response_id = _id("resp")

    def _response(self, items: list[dict], status: str, usage: dict | None) -> dict:
        req = self.responses_request
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "error": None,
            "model": self.model,
            "instructions": req.instructions,
            "output": items,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "text": req.text or {"format": {"type": "text"}},
            "temperature": req.temperature,
            "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "metadata": req.metadata or {},
            "usage": usage,
        }

    def _responses_usage(self, finals) -> dict:
        """The chat usage under the Responses API's names."""
        chat = self._usage(finals)
        return {
            "input_tokens": chat.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": chat.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat.total_tokens,
        }

    def _finish(self, items: list[dict], finish_reason: str | None, usage: dict) -> dict:
        status = "incomplete" if finish_reason == "length" else "completed"
        response = self._response(items, status, usage)
        if self.responses_request.store:
            _store(self.state).put(response, conversation_after(self.messages, items))
        return response

    async def full(self) -> BaseModel:
        finals = await self._finals()
        choice = self._choice(0, finals[0])
        response = self._finish(
            output_items(choice.message), choice.finish_reason, self._responses_usage(finals)
        )
        return _Object(**response)

    async def stream(self) -> AsyncIterator[str]:
        sequence = 0

        def event(kind: str, data: dict) -> str:
            nonlocal sequence
            body = {"type": kind, "sequence_number": sequence, **data}
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

        start = self._response([], "in_progress", None)
        yield event("response.created", {"response": start})
        yield event("response.in_progress", {"response": start})
        items = _Items()
        sent, finals, finish = (0, 0), {}, None
        try:
            async with contextlib.aclosing(self._events()) as events:
                async for choice, out in events:
                    delta = self._delta(choice, out, *sent)
                    sent = (len(out.text), len(out.token_ids))
                    if out.finish_reason is not None:
                        finals[choice] = out
                    if delta is None:
                        continue
                    for kind, data in items.add(delta.delta):
                        yield event(kind, data)
                    finish = delta.finish_reason or finish
            for kind, data in items.close():
                yield event(kind, data)
            response = self._finish(items.items, finish, self._responses_usage(finals))
            done = "incomplete" if response["status"] == "incomplete" else "completed"
            yield event(f"response.{done}", {"response": response})
        except Exception as e:
            err = e if isinstance(e, APIError) else APIError.internal("the engine failed")
            yield event("error", {"code": str(err.status), "message": err.message,
                                  "param": err.param})  # fmt: skip


class _Object(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- the routes -------------------------------------------------------------------------


@router.post("/v1/responses")
async def create(request: Request):
    state: ServerState = request.app.state.server
    req = await state.parse(request, ResponsesRequest)
    history: list[dict] = []
    if req.previous_response_id is not None:
        stored = _store(state).get(req.previous_response_id)
        if stored is None:
            raise APIError.not_found(
                f"previous response {protocol._short(req.previous_response_id)} does not exist "
                "or expired",
                "previous_response_id",
            )
        history = stored[1]
    chat, messages = to_chat_request(req, history)
    chat.check_tool_choice(auto_tool_choice=state.tool_parser is not None)
    eng = state.ready_engine("generate", request.url.path)
    model = state.check_model(req.model)
    cls = functools.partial(
        ResponsesGeneration, responses_request=req, messages=messages, state=state
    )

    async def make_gen():
        return await chat_generation(state, eng, chat, model, cls)

    return await state.respond(request, state.admit(1), make_gen)


@router.get("/v1/responses/{response_id}")
async def retrieve(request: Request, response_id: str):
    stored = _store(request.app.state.server).get(response_id)
    if stored is None:
        raise APIError.not_found(
            f"response {protocol._short(response_id)} does not exist or expired", "response_id"
        )
    return JSONResponse(stored[0])


@router.delete("/v1/responses/{response_id}")
async def delete(request: Request, response_id: str):
    if not _store(request.app.state.server).delete(response_id):
        raise APIError.not_found(
            f"response {protocol._short(response_id)} does not exist or expired", "response_id"
        )
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
