"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, for
clients and agents that speak it (the official `anthropic` client, coding assistants).

A request is translated into a chat completion request (`server.protocol`'s, so every sampling
check, the chat template, tool choices, structured tool calls and the parsers are the ones
`/v1/chat/completions` runs) and its one generation is rendered in Anthropic's shapes:
- `system` (a string or text blocks) -> a system message; `messages` with text, `tool_use`
  (assistant) and `tool_result` (user) blocks -> messages with tool calls and tool messages
  (a tool result must answer a `tool_use` of the assistant message before it); `thinking`
  blocks of earlier turns are dropped, as Anthropic drops them; images are refused;
- `tools` ({name, description, input_schema}) -> function tools; `tool_choice` auto, any
  (a call required), tool (that one), none; `disable_parallel_tool_use`;
- `max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k`; `thinking` turns the chat
  template's `enable_thinking` on or off (its `budget_tokens` is not enforced);
- the answer: `thinking` blocks (with a `--reasoning-parser`), a `text` block, `tool_use`
  blocks; `stop_reason` end_turn, max_tokens, stop_sequence or tool_use; `usage` input and
  output tokens. Streamed as Anthropic's events (`message_start`, `content_block_start`,
  `content_block_delta` with text, thinking and input_json deltas, `content_block_stop`,
  `message_delta`, `message_stop`), from the same deltas as a chat stream, so they add up to
  the non-streamed message.

Errors on these paths leave in Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}` (`anthropic_error_body`); the key may come as `x-api-key` as well as a bearer
token (the app's guard takes both).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from server import protocol
from server.chat_errors import parse_chat_request
from server.generation import ChatCompletion, chat_generation, render_chat
from server.protocol import APIError, _Model
from server.serving import ServerState

logger = logging.getLogger("jaxllm.server")
router = APIRouter()
PATH_PREFIX = "/v1/messages"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "overloaded_error",
}


def anthropic_error_body(err: APIError) -> dict:
    """An error in Anthropic's shape (the status goes with the response)."""
    kind = _ERROR_TYPES.get(err.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


# ---- the request ------------------------------------------------------------------------


class MessagesRequest(_Model):
    model: str
    max_tokens: int | None = None  # required by /v1/messages, not by count_tokens
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def _text_of(blocks: Any, param: str) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError.bad_request(f"{param} must be a string or a list of text blocks", param)
    texts = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise APIError.bad_request(
                f"{param}.{i}: block type {protocol._short(kind)} is not supported here; only "
                "text is",
                f"{param}.{i}.type",
            )
        if not isinstance(block.get("text"), str):
            raise APIError.bad_request(f"{param}.{i}: a text block needs a string 'text'", param)
        texts.append(block["text"])
    return "\n".join(texts)


def _chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as chat completion messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    open_calls: set[str] = set()  # tool_use ids of the last assistant message
    for i, message in enumerate(req.messages):
        where = f"messages.{i}"
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise APIError.bad_request(
                f"{where}.role must be 'user' or 'assistant'", f"{where}.role"
            )
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise APIError.bad_request(
                f"{where}.content must be a string or a list of content blocks",
                f"{where}.content",
            )
        texts, calls, results = [], [], []
        for j, block in enumerate(content):
            at = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier turns' thinking is not sent back to the model
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise APIError.bad_request(f"{at}: a tool_use needs a string id and name", at)
                arguments = block.get("input", {})
                if not isinstance(arguments, dict):
                    raise APIError.bad_request(f"{at}.input must be an object", f"{at}.input")
                calls.append(
                    {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": block["name"], "arguments": json.dumps(arguments)},
                    }
                )
            elif kind == "tool_result" and role == "user":
                call_id = block.get("tool_use_id")
                if call_id not in open_calls:
                    raise APIError.bad_request(
                        f"{at}: tool_result for {protocol._short(call_id)}, which no tool_use "
                        "of the assistant message before it made",
                        f"{at}.tool_use_id",
                    )
                result = block.get("content", "")
                text = _text_of(result, f"{at}.content") if result else ""
                if block.get("is_error"):
                    text = f"Error: {text}"
                results.append({"role": "tool", "tool_call_id": call_id, "content": text})
            else:
                raise APIError.bad_request(
                    f"{at}: content block type {protocol._short(kind)} is not supported in a "
                    f"{role} message (text, tool_use in assistant messages, tool_result in "
                    "user messages)",
                    f"{at}.type",
                )
        if role == "assistant":
            message_out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                message_out["tool_calls"] = calls
            out.append(message_out)
            open_calls = {c["id"] for c in calls}
        else:
            out.extend(results)
            if texts or not results:
                out.append({"role": "user", "content": "\n".join(texts)})
            open_calls = set()
    return out


def _chat_tools(req: MessagesRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
                raise APIError.bad_request(
                    f"tools.{i}: only client tools (name, description, input_schema) are supported",
                    f"tools.{i}",
                )
            function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            tools.append({"type": "function", "function": function})
        fields["tools"] = tools
    choice = req.tool_choice
    if choice is not None:
        kind = choice.get("type")
        if kind == "auto":
            fields["tool_choice"] = "auto"
        elif kind == "any":
            fields["tool_choice"] = "required"
        elif kind == "none":
            fields["tool_choice"] = "none"
        elif kind == "tool":
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        else:
            raise APIError.bad_request(
                "tool_choice.type must be auto, any, tool or none", "tool_choice.type"
            )
        if choice.get("disable_parallel_tool_use"):
            fields["parallel_tool_calls"] = False
    return fields


# Chat request params -> the Messages API's names, for error messages.
_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}


def to_chat_request(req: MessagesRequest, *, generate: bool) -> protocol.ChatCompletionRequest:
    """The chat completion request `req` asks for (`generate`: max_tokens is required)."""
    if generate and req.max_tokens is None:
        raise APIError.bad_request("max_tokens is required", "max_tokens")
    body: dict[str, Any] = {"model": req.model, "messages": _chat_messages(req)}
    body |= _chat_tools(req)
    for name, value in (
        ("max_completion_tokens", req.max_tokens),
        ("stop", req.stop_sequences),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("top_k", req.top_k),
    ):
        if value is not None:
            body[name] = value
    body["stream"] = req.stream
    if req.thinking is not None:
        kind = req.thinking.get("type")
        if kind not in ("enabled", "disabled"):
            raise APIError.bad_request("thinking.type must be enabled or disabled", "thinking.type")
        body["chat_template_kwargs"] = {"enable_thinking": kind == "enabled"}
    return parse_chat_request(body, _PARAMS)


# ---- the response -----------------------------------------------------------------------


def _stop_reason(finish_reason: str | None, stop_reason: Any, req: MessagesRequest):
    """(Anthropic's stop_reason, stop_sequence) of a chat choice's finish."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str) and stop_reason in (req.stop_sequences or ()):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_of(resp: protocol.ChatCompletionResponse, req: MessagesRequest, msg_id: str) -> dict:
    """A chat completion response as Anthropic's message."""
    choice = resp.choices[0]
    m = choice.message
    content: list[dict[str, Any]] = []
    if m.reasoning_content:
        content.append({"type": "thinking", "thinking": m.reasoning_content, "signature": ""})
    if m.content:
        content.append({"type": "text", "text": m.content})
    for call in m.tool_calls or []:
        content.append(
            {
                "type": "tool_use",
                "id": call.id,
                "name": call.function.name,
                "input": _input(call.function.arguments),
            }
        )
    stop_reason, stop_sequence = _stop_reason(choice.finish_reason, choice.stop_reason, req)
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": resp.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": resp.usage.prompt_tokens,
            "output_tokens": resp.usage.completion_tokens,
        },
    }


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The content blocks of a streamed message, opened and closed as deltas come."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block's: thinking, text or tool_use

    def _open(self, kind: str, block: dict) -> list[str]:
        events = self.close()
        self.index += 1
        self.kind = kind
        events.append(_event("content_block_start", {"index": self.index, "content_block": block}))
        return events

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def events(self, d: protocol.DeltaMessage) -> list[str]:
        out: list[str] = []
        if d.reasoning_content:
            if self.kind != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning_content}))
        if d.content:
            if self.kind != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": d.content}))
        for call in d.tool_calls or []:
            function = call.function
            if call.id is not None:
                block = {"type": "tool_use", "id": call.id, "name": function.name, "input": {}}
                out += self._open("tool_use", block)
            if function is not None and function.arguments:
                out.append(
                    self._delta({"type": "input_json_delta", "partial_json": function.arguments})
                )
        return out


class AnthropicMessage(ChatCompletion):
    """A chat generation answered as an Anthropic message (`full`) or its events (`stream`),
    both made from the chat choice and deltas, so they add up to the same message."""

    def __init__(self, *args, messages_request: MessagesRequest, **kwargs):
        super().__init__(*args, **kwargs)
        self.messages_request = messages_request
        self.msg_id = f"msg_{uuid.uuid4().hex}"

    async def full(self) -> BaseModel:
        resp = await super().full()
        return _Message(**message_of(resp, self.messages_request, self.msg_id))

    async def stream(self) -> AsyncIterator[str]:
        start = {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(self.jobs[0][0]), "output_tokens": 0},
        }
        yield _event("message_start", {"message": start})
        blocks = _Blocks()
        sent = (0, 0)
        finish, stop_reason, tokens = None, None, 0
        try:
            async with contextlib.aclosing(self._events()) as events:
                async for choice, out in events:
                    delta = self._delta(choice, out, *sent)
                    sent = (len(out.text), len(out.token_ids))
                    tokens = len(out.token_ids)
                    if delta is None:
                        continue
                    for event in blocks.events(delta.delta):
                        yield event
                    if delta.finish_reason is not None:
                        finish, stop_reason = delta.finish_reason, delta.stop_reason
            for event in blocks.close():
                yield event
            reason, sequence = _stop_reason(finish, stop_reason, self.messages_request)
            yield _event(
                "message_delta",
                {
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": {"output_tokens": tokens},
                },
            )
            yield _event("message_stop", {})
        except Exception as e:
            if not isinstance(e, APIError):
                logger.warning("messages stream failed: %s", type(e).__name__)
                e = APIError.internal("the engine failed this request")
            yield f"event: error\ndata: {json.dumps(anthropic_error_body(e))}\n\n"


class _Message(BaseModel):
    """An Anthropic message, as built (`message_of`)."""

    model_config = ConfigDict(extra="allow")


# ---- the routes -------------------------------------------------------------------------


@router.post(PATH_PREFIX)
async def messages(request: Request):
    state: ServerState = request.app.state.server
    req = await state.parse(request, MessagesRequest)
    chat = to_chat_request(req, generate=True)
    chat.check_tool_choice(auto_tool_choice=state.tool_parser is not None)
    eng = state.ready_engine("generate", request.url.path)
    model = state.check_model(req.model)
    cls = functools.partial(AnthropicMessage, messages_request=req)

    async def make_gen():
        return await chat_generation(state, eng, chat, model, cls)

    return await state.respond(request, state.admit(1), make_gen)


@router.post(f"{PATH_PREFIX}/count_tokens")
async def count_tokens(request: Request):
    state: ServerState = request.app.state.server
    req = await state.parse(request, MessagesRequest)
    chat = to_chat_request(req, generate=False)
    eng = state.ready_engine("generate", request.url.path)
    state.check_model(req.model)
    ids = await state.tokenizing(render_chat, eng, chat, check_fits=False)
    return JSONResponse({"input_tokens": len(ids)})
