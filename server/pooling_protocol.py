"""The schema of the pooling endpoints of `jaxllm serve`, as vLLM's (and OpenAI's, Jina's and
Cohere's) clients send and read them: `/v1/embeddings`, `/pooling`, `/score`, `/rerank`
(`/v1/rerank`, `/v2/rerank`) and `/classify`. The routes are in `server.pooling_api`.

Requests are validated as `server.protocol`'s are: a bad field is a 400 naming it, unknown
fields are accepted and ignored. Inputs are texts or token ids:
- `/v1/embeddings`, `/pooling`, `/classify`: `input` is a string, a list of strings, a list
  of token ids or a list of token id lists (OpenAI's forms), at most `MAX_INPUTS` items;
- `/score`: `text_1` and `text_2`, each a string or a list of strings; one `text_1` is scored
  against every `text_2`, otherwise they pair up one to one;
- `/rerank`: a `query` and its `documents` (strings, or Jina's `{"text": ...}` objects),
  `top_n` (0 or unset: all), `return_documents` (Jina's; default true).

`truncate_prompt_tokens` (vLLM's) cuts each text to that many tokens (-1: the model's
max_model_len) as the tokenizer truncates; without it a longer input is a 400.
"""

from __future__ import annotations

import base64
from typing import Any, ClassVar, Literal

import numpy as np
from annotated_types import Ge
from pydantic import Field, field_validator, model_validator

from jaxllm.pooling_params import PoolingParams
from server.protocol import (
    UsageInfo,
    _id,
    _integer,
    _Model,
    _now,
    _ParamError,
    _Response,
    _token_list,
)

MAX_INPUTS = 2048  # items in one request (OpenAI's limit for embeddings)

Input = str | list[int]  # one item: a text or its token ids


def _inputs(value: Any, name: str) -> Any:
    """A string, a list of strings, a list of token ids, or a list of token id lists."""
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{name} must not be empty")
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"{name} must be a non-empty string, a list of strings, a list of token ids, or "
            "a list of token id lists"
        )
    if len(value) > MAX_INPUTS:
        raise ValueError(f"{name}: at most {MAX_INPUTS} items, got {len(value)}")
    if all(type(t) is int for t in value):
        return _token_list(value, name)
    if all(isinstance(p, str) for p in value):
        if not all(value):
            raise ValueError(f"{name}: an item must not be an empty string")
        return value
    if all(isinstance(p, list) for p in value):
        for p in value:
            if not p:
                raise ValueError(f"{name}: a token id list must not be empty")
            _token_list(p, name)
        return value
    raise ValueError(
        f"{name} must be a string, a list of strings, a list of token ids, or a list of token "
        "id lists (not a mix)"
    )


def _items(value: str | list) -> list[Input]:
    """The items of a checked input, one entry each: a string or a list of token ids."""
    if isinstance(value, str) or isinstance(value[0], int):
        return [value]
    return list(value)


TruncatePromptTokens = _integer(Ge(-1))


class _PoolingRequest(_Model):
    model: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    add_special_tokens: bool = True
    user: str | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1, got 0")
        return value

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens)


class _VectorRequest(_PoolingRequest):
    """A request whose answer is one vector per input item."""

    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: _integer(Ge(1)) | None = None
    normalize: bool | None = None  # vLLM's: None, as the checkpoint says

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        return _inputs(value, "input")

    def items(self) -> list[Input]:
        return _items(self.input)

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(
            normalize=self.normalize,
            dimensions=self.dimensions,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )


class EmbeddingRequest(_VectorRequest):
    """POST /v1/embeddings (OpenAI's)."""


class PoolingRequest(_VectorRequest):
    """POST /pooling (vLLM's): the model's pooled output, as it comes (for an embedding
    model, its embedding)."""


class ClassificationRequest(_PoolingRequest):
    """POST /classify (vLLM's)."""

    input: str | list[str] | list[int] | list[list[int]]
    activation: bool | None = None  # vLLM's: False gives the logits instead of probabilities
    use_activation: bool | None = None  # its newer name for the same

    @model_validator(mode="after")
    def _one_activation(self):
        if self.activation is None:
            self.activation = self.use_activation
        return self

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        return _inputs(value, "input")

    def items(self) -> list[Input]:
        return _items(self.input)

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(
            truncate_prompt_tokens=self.truncate_prompt_tokens, activation=self.activation
        )


def _texts(value: Any, name: str) -> Any:
    """A string or a non-empty list of strings."""
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{name} must not be empty")
        return value
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
        raise ValueError(f"{name} must be a non-empty string or a non-empty list of strings")
    if len(value) > MAX_INPUTS:
        raise ValueError(f"{name}: at most {MAX_INPUTS} items, got {len(value)}")
    if not all(value):
        raise ValueError(f"{name}: an item must not be an empty string")
    return value


class ScoreRequest(_PoolingRequest):
    """POST /score (vLLM's)."""

    text_1: str | list[str]
    text_2: str | list[str]

    @model_validator(mode="before")
    @classmethod
    def _other_names(cls, data: Any) -> Any:
        """vLLM's other spellings of the two sides: `queries` / `documents` (its newer
        form) and `data_1` / `data_2` (its offline names)."""
        if isinstance(data, dict):
            for name, others in (
                ("text_1", ("queries", "data_1")),
                ("text_2", ("documents", "data_2")),
            ):
                given = [o for o in others if o in data]
                if name not in data and given:
                    data = {**data, name: data[given[0]]}
        return data

    @field_validator("text_1", "text_2", mode="before")
    @classmethod
    def _check_texts(cls, value: Any, info) -> Any:
        return _texts(value, info.field_name)

    @model_validator(mode="after")
    def _check_pairs(self):
        ones, twos = self.firsts(), self.seconds()
        if len(ones) != 1 and len(ones) != len(twos):
            raise _ParamError(
                "text_2",
                f"text_2 has {len(twos)} items for text_1's {len(ones)}: give one text_1, or "
                "as many as text_2",
            )
        return self

    def firsts(self) -> list[str]:
        return [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)

    def seconds(self) -> list[str]:
        return [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)

    def pairs(self) -> list[tuple[str, str]]:
        ones, twos = self.firsts(), self.seconds()
        if len(ones) == 1:
            ones = ones * len(twos)
        return list(zip(ones, twos, strict=True))


class RerankRequest(_PoolingRequest):
    """POST /rerank, /v1/rerank (Jina's shape), /v2/rerank (Cohere's)."""

    query: str
    documents: list[str]
    top_n: _integer(Ge(0)) | None = None  # 0 or unset: every document
    return_documents: bool = True

    @field_validator("query", mode="before")
    @classmethod
    def _check_query(cls, value: Any) -> Any:
        if not isinstance(value, str) or not value:
            raise ValueError("query must be a non-empty string")
        return value

    @field_validator("documents", mode="before")
    @classmethod
    def _check_documents(cls, value: Any) -> Any:
        if isinstance(value, list):  # Jina's and Cohere v1's {"text": ...} objects
            value = [d["text"] if isinstance(d, dict) and "text" in d else d for d in value]
        return _texts(value, "documents") if not isinstance(value, str) else [value]


# -------------------------------------------------------------------------------- responses


class PoolingUsage(_Response):
    """OpenAI's embeddings usage: prompt tokens only."""

    prompt_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int) -> PoolingUsage:
        return cls(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as the client asked: floats, or base64 of its float32 little-endian bytes
    (OpenAI's form, which its client decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


class EmbeddingData(_Response):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(_Response):
    id: str = Field(default_factory=_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingData(_Response):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(_Response):
    id: str = Field(default_factory=_id("pool"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[PoolingData]
    usage: UsageInfo


class ScoreData(_Response):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_Response):
    id: str = Field(default_factory=_id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class ClassificationData(_Response):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(_Response):
    id: str = Field(default_factory=_id("classify"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class RerankDocument(_Response):
    text: str


class RerankResult(_Response):
    _OMIT_IF_NONE: ClassVar[frozenset[str]] = frozenset({"document"})

    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(_Response):
    total_tokens: int = 0


class RerankResponse(_Response):
    id: str = Field(default_factory=_id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]
