"""The field types of the request bodies: numbers that refuse booleans, token id lists, the
base model that keeps unknown fields aside, chat messages with their content parts and tool
calls, and the fields that render a conversation with the chat template.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from server.protocol.errors import MAX_ECHOED_CHARS, _ParamError, _short

# Keys of chat_template_kwargs the template may receive, with the type of their value:
# Qwen3's `enable_thinking`, DeepSeek-V3.1's `thinking`, gpt-oss's `reasoning_effort`.
CHAT_TEMPLATE_KWARGS: dict[str, type] = {
    "enable_thinking": bool,
    "thinking": bool,
    "reasoning_effort": str,
}


def _not_bool(value: Any) -> Any:
    # pydantic's lax mode reads true as 1; SamplingParams (and OpenAI) refuse it.
    if isinstance(value, bool):
        raise PydanticCustomError("bool_number", "Input should be a number, not a boolean")
    return value


def _number(*bounds: Any) -> Any:
    return Annotated[float, BeforeValidator(_not_bool), AllowInfNan(False), *bounds]


def _integer(*bounds: Any) -> Any:
    return Annotated[int, BeforeValidator(_not_bool), *bounds]


def _token_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        raise ValueError(f"{name} must be a list of non-negative integer token ids")
    return value


class _Model(BaseModel):
    # OpenAI's API takes fields it does not know; like vLLM, they are kept aside and ignored.
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        """Body fields this server does not know (for a log line)."""
        return sorted(self.model_extra or {})


class StreamOptions(_Model):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class TextContentPart(_Model):
    type: Literal["text"]
    text: str


class ImageURL(_Model):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; images are read whole


class ImageContentPart(_Model):
    """An image (an image-text model's): a data: URL with base64 image bytes, or a file
    under the server's --allowed-local-media-path."""

    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCallParam(_Model):
    """The function an earlier assistant message called."""

    name: str
    arguments: Any = None

    @field_validator("arguments")
    @classmethod
    def _parse_arguments(cls, value: Any) -> Any:
        # OpenAI sends the arguments as JSON text; chat templates take them parsed (a dict),
        # as transformers documents and vLLM does. Null or "" is no arguments.
        if value is None or value == "":
            return {}
        if isinstance(value, str):
            try:
                return json.loads(value)
            except (json.JSONDecodeError, RecursionError):
                raise ValueError("arguments must be JSON text") from None
        return value


class ToolCallParam(_Model):
    """One tool call of an earlier assistant message."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam

    def template_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {} if self.id is None else {"id": self.id}
        out.update(
            type="function",
            function={"name": self.function.name, "arguments": self.function.arguments},
        )
        return out


class ChatMessage(_Model):
    """One message of a conversation; content is a string, text parts, or null. An assistant
    message may hold the tool calls it made, a tool message the id of the call it answers."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextContentPart | ImageContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string, a list of content parts, or null")
        for i, part in enumerate(value):
            if not isinstance(part, dict):
                raise _ParamError(str(i), "a content part must be an object")
            if part.get("type") == "image_url":
                image = part.get("image_url")
                if not isinstance(image, dict) or not isinstance(image.get("url"), str):
                    raise _ParamError(
                        f"{i}.image_url", "an image_url content part needs an object with a 'url'"
                    )
                continue
            if part.get("type") == "image_embeds":
                raise _ParamError(
                    f"{i}.type",
                    "image_embeds content parts are not supported: vLLM sends them as "
                    "torch-pickled tensors, which this server does not unpickle; send the "
                    "image (image_url), or its embeddings offline (LLM with enable_mm_embeds)",
                )
            if part.get("type") != "text":
                raise _ParamError(
                    f"{i}.type",
                    f"content part type {_short(part.get('type'))} is not supported; only "
                    "'text' and 'image_url' are",
                )
            if not isinstance(part.get("text"), str):
                raise _ParamError(f"{i}.text", "a text content part needs a string 'text'")
        return value

    def text(self) -> str | None:
        """The content as one string: text parts joined by newlines (as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content if isinstance(p, TextContentPart))
        return self.content

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(
            isinstance(p, ImageContentPart) for p in self.content
        )


class _ChatTemplateFields(_Model):
    """What renders a conversation: the messages and the chat template's switches."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: how hard a reasoning model thinks; the template's `reasoning_effort` (gpt-oss's
    # harmony system message) unless chat_template_kwargs sets it.
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, v in (value or {}).items():
            if key not in CHAT_TEMPLATE_KWARGS:
                raise ValueError(
                    f"chat_template_kwargs: key {_short(key)} is not allowed; allowed keys: "
                    f"{', '.join(CHAT_TEMPLATE_KWARGS)}"
                )
            if not isinstance(v, CHAT_TEMPLATE_KWARGS[key]) or (
                isinstance(v, str) and len(v) > MAX_ECHOED_CHARS
            ):
                raise ValueError(
                    f"chat_template_kwargs: {key} must be a {CHAT_TEMPLATE_KWARGS[key].__name__}"
                )
        return value

    @model_validator(mode="after")
    def _check_template_switches(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise _ParamError(
                "continue_final_message",
                "continue_final_message and add_generation_prompt cannot both be true",
            )
        return self

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the tokenizer's apply_chat_template takes them: content a string
        (null becomes "", which every template can concatenate); an assistant's tool calls
        and a tool message's tool_call_id as transformers' chat templates read them."""
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text() or ""}
            if m.has_images:  # parts, for `jaxllm.multimodal.chat.split_images`
                d["content"] = [p.model_dump(exclude_none=True) for p in m.content]
            if m.name is not None:
                d["name"] = m.name
            if m.role == "assistant" and m.tool_calls:
                d["tool_calls"] = [c.template_dict() for c in m.tool_calls]
            if m.role == "tool" and m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for apply_chat_template beside the messages."""
        effort = (
            {} if self.reasoning_effort is None else {"reasoning_effort": self.reasoning_effort}
        )
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            **effort,
            **(self.chat_template_kwargs or {}),
        }
