"""POST /v1/completions: the prompt forms (text, token ids, lists of either), echo and
logprobs."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import field_validator

from server.protocol.fields import _token_list
from server.protocol.sampling import Logprobs, PromptLogprobs, _SamplingRequest

MAX_PROMPTS = 1024  # prompts in one completions request (a list of strings or of token lists)
_COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    _PROMPT_PARAM: ClassVar[str] = "prompt"
    _UNSET_MAX_TOKENS: ClassVar[int | None] = _COMPLETIONS_MAX_TOKENS

    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: Any = None
    logprobs: Logprobs | None = None
    echo: bool | None = False
    prompt_logprobs: PromptLogprobs | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, str):
            if not value:
                raise ValueError("prompt must not be empty")
            return value
        if not isinstance(value, list) or not value:
            raise ValueError(
                "prompt must be a non-empty string, a list of strings, a list of token ids, "
                "or a list of token id lists"
            )
        if all(type(t) is int for t in value):
            return _token_list(value, "prompt")
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts, got {len(value)}")
        if all(isinstance(p, str) for p in value):
            if not all(value):
                raise ValueError("prompt: a prompt must not be empty")
            return value
        if all(isinstance(p, list) for p in value):
            for p in value:
                if not p:
                    raise ValueError("prompt: a token id list must not be empty")
                _token_list(p, "prompt")
            return value
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids, or a list of "
            "token id lists (not a mix)"
        )

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("suffix is not supported")
        return value

    def _num_prompt_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:  # the echoed prompt carries logprobs
            return max(self.prompt_logprobs or 0, self.logprobs)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one entry each: a string or a list of token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def _num_logprobs(self) -> int | None:
        return self.logprobs
