"""The response bodies the handlers fill: completions and chat (whole and streamed), the model
list, and the tokenizer endpoints'."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_serializer

from server.protocol.logprobs import LOGPROB_FLOOR


def _now() -> int:
    return int(time.time())


def _id(prefix: str) -> Callable[[], str]:
    return lambda: f"{prefix}-{uuid.uuid4().hex}"


class _Response(BaseModel):
    """A response body; fields in _OMIT_IF_NONE are left out of the JSON while None (as
    OpenAI leaves `usage` out of stream chunks and unset fields out of a delta)."""

    _OMIT_IF_NONE: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler):
        data = handler(self)
        for name in self._OMIT_IF_NONE:
            if data.get(name, 0) is None:
                del data[name]
        return data


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogProbs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(_Response):
    _OMIT_IF_NONE: ClassVar[frozenset[str]] = frozenset({"prompt_logprobs"})

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended the text
    # vLLM's extension: per prompt token {token id: {logprob, rank, decoded_token}}, the
    # first None; present only when the request asked for prompt_logprobs.
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None


class CompletionResponse(_Response):
    id: str = Field(default_factory=_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefiller's answer (vLLM's)


class CompletionStreamResponse(_Response):
    _OMIT_IF_NONE = frozenset({"usage"})

    id: str = Field(default_factory=_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]  # [] in the final usage-only chunk
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ChatCompletionLogProb(_Response):
    token: str
    logprob: float = LOGPROB_FLOOR
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(_Response):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text


tool_call_id = _id("chatcmpl-tool")  # vLLM's form of a tool call's id


class ToolCall(_Response):
    id: str = Field(default_factory=tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    # The thinking of a server with --reasoning-parser, under vLLM's two names.
    _OMIT_IF_NONE = frozenset({"tool_calls", "reasoning_content", "reasoning"})

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionResponseChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str = Field(default_factory=_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefiller's answer (vLLM's)


class DeltaFunctionCall(_Response):
    _OMIT_IF_NONE = frozenset({"name", "arguments"})

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    """What a stream chunk adds to the tool call at `index`: its id, type and name first
    (with the arguments known then), then fragments of its arguments."""

    _OMIT_IF_NONE = frozenset({"id", "type", "function"})

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_Response):
    """What a stream chunk adds to a message: the role in the first, then content and tool
    calls."""

    _OMIT_IF_NONE = frozenset({"role", "content", "reasoning_content", "reasoning", "tool_calls"})

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Response):
    _OMIT_IF_NONE = frozenset({"usage"})

    id: str = Field(default_factory=_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]  # [] in the final usage-only chunk
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "jaxllm"
    max_model_len: int | None = None
    # What the model serves (vLLM's task names): ["generate"], or a pooling model's
    # ["encode", "embed", "score"]; None while the engine starts.
    supported_tasks: list[str] | None = None
    # vLLM's: a LoRA adapter's directory and the model it adapts (None for the base model).
    root: str | None = None
    parent: str | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str
