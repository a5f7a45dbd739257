"""POST /tokenize and POST /detokenize."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from server.protocol.errors import _ParamError
from server.protocol.fields import ChatMessage, _ChatTemplateFields, _Model, _token_list


class TokenizeRequest(_ChatTemplateFields):
    """POST /tokenize: either {prompt, add_special_tokens} or {messages, add_generation_prompt,
    ...}. add_special_tokens defaults to True for a prompt and False for messages (the chat
    template already holds the BOS token)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise _ParamError(
                "prompt" if self.prompt is not None else None,
                "give either prompt or messages, not both"
                if self.prompt is not None
                else "prompt or messages is required",
            )
        if self.messages is not None and "add_special_tokens" not in self.model_fields_set:
            self.add_special_tokens = False
        return self


class DetokenizeRequest(_Model):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]

    @field_validator("tokens", mode="before")
    @classmethod
    def _check_tokens(cls, value: Any) -> Any:
        return _token_list(value, "tokens")
