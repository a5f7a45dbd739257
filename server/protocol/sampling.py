"""The OpenAI-compatible schema of `jaxllm serve`: request models and their validation, the
response models the handlers fill, OpenAI's error shape, and logprob formatting.

Data flow of one request through this module (the FastAPI app and the engine client own the
rest):

    body (a JSON dict)
      -> parse_request(CompletionRequest | ChatCompletionRequest | TokenizeRequest
                       | DetokenizeRequest, body)              every check of one field, or
                                                               of fields among themselves
      -> [server] model name (APIError.model_not_found), chat template
         (req.conversation(), req.template_kwargs()), tokenization (req.prompts()), and the
         engine's input checks (InputProcessor: prompt length and ids, the room left)
      -> req.to_sampling_params(default_max_tokens=max_model_len - prompt_len,
                                generation_defaults=...)       checks that need the room the
                                                               prompt leaves
      -> the engine's input checks of the SamplingParams (ids against the vocabulary)
      -> (request_id, prompt_token_ids, SamplingParams) to the engine
      -> CompletionResponse / ChatCompletionResponse, or their *StreamResponse chunks,
         with completion_logprobs / chat_logprobs formatting jaxllm's logprobs.

Contract with the app:

- Every failure is an `APIError` carrying the HTTP status; the app answers
  `JSONResponse(err.body(), status_code=err.status)` (in a stream: one
  `data: {json of err.body()}` event). `parse_request` turns pydantic's `ValidationError` into
  a 400 via `from_validation_error`; `to_sampling_params` raises `APIError` itself. Any other
  exception is a bug: log it and answer `APIError.internal()`, which never shows internals.
  Errors of the chat template (jinja2 `TemplateError`, `ValueError`) are the client's
  messages: answer `APIError.bad_request(..., param="messages")`.
- Unknown body fields are accepted and ignored (as in vLLM); `req.ignored_fields()` lists them
  for a log line.
- `error.type` follows vLLM: the name of the openai-python exception for the status
  ("BadRequestError", "AuthenticationError", "NotFoundError", "InternalServerError"; and
  "RequestTooLargeError", "ServiceUnavailableError", which openai-python has no class for);
  `error.code` is the status code.
- Sampling fields a request leaves unset (or sets to null) come from the model's
  `generation_defaults` (keys read: temperature, top_p, top_k, min_p, repetition_penalty,
  max_new_tokens), then from vLLM's neutral values. max_tokens (chat: max_completion_tokens,
  which wins over max_tokens):
    explicit number      -> that number; 400 if above default_max_tokens (vLLM's rule)
    explicit null        -> default_max_tokens (up to the end of the context)
    unset, completions   -> min(16, max_new_tokens, default_max_tokens) (OpenAI's default is
                            16; vLLM's min)
    unset, chat          -> min(max_new_tokens, default_max_tokens)
- Not supported, each a 400 naming the field: suffix, the legacy functions / function_call
  (other than empty or "none"), best_of != n, content parts other than text.
- Structured outputs (`StructuredOutputsParams`, in SamplingParams.structured_outputs), from
  at most one of: `response_format` ({"type": "json_object"}, or {"type": "json_schema",
  "json_schema": {"schema": ...}}; {"type": "text"} is none), vLLM's `structured_outputs` (a
  dict of StructuredOutputsParams fields), its older `guided_json`, `guided_regex`,
  `guided_choice`, `guided_grammar`, and, in chat, a `tool_choice` that forces a call.
  `guided_whitespace_pattern` applies to whichever is given; `guided_decoding_backend` is
  ignored (llguidance decodes all). Two of them, an unknown structured_outputs key, or a
  schema, regex or grammar that does not compile: a 400 naming the field the client used.
- Tools (chat): `tools` are checked (non-empty unique names, parameters a schema that
  compiles; a 400 names "tools", the message says where) and reach the chat template (as
  `tools=`, OpenAI's dicts) unless tool_choice is "none"; assistant messages may carry
  `tool_calls` (their JSON `arguments` reach the template parsed, as dicts), tool messages a
  `tool_call_id`. `tool_choice` is as in vLLM: unset with tools means "auto"; other than
  "none" it needs `tools` (an empty list makes "auto" and "required" "none"); a named
  function must be one of them. A named function constrains the output to its parameters
  schema; "required" to `tool_parsers.required_tool_calls_schema` (one call at most with
  `parallel_tool_calls: false`); "auto" leaves it free for the server's `--tool-call-parser`,
  and `check_tool_choice` is a 400 when the server has none. `server.tool_parsers` turns the
  output into `tool_calls` (ChatResponseMessage, DeltaMessage).
- Completions `prompt_logprobs: k` scores the prompt tokens; `echo` with `logprobs: k` asks
  the engine for prompt logprobs too, so the echoed prompt carries logprobs as in vLLM.
- chat_template_kwargs: only the keys of CHAT_TEMPLATE_KWARGS reach the template, each with
  its type. Arbitrary keys could shadow the template's own variables (messages, tools,
  bos_token, ...) or switch templates into paths nobody tested; add keys here when a
  supported model needs one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import pydantic
from annotated_types import Ge, Gt, Le
from pydantic import (
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from jaxllm.outputs import Logprob
from jaxllm.sampling_params import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from jaxllm.structured_outputs import StructuredOutputsParams
from server.tool_parsers import required_tool_calls_schema

MAX_PROMPTS = 1024  # prompts in one completions request (a list of strings or of token lists)
MAX_STOP = 32  # stop strings per request
MAX_STOP_CHARS = 1024  # characters in one stop string
MAX_TOP_LOGPROBS = 20  # chat top_logprobs (OpenAI's limit)
MAX_ECHOED_CHARS = 100  # longest value an error message repeats back
LOGPROB_FLOOR = -9999.0  # what -inf logprobs become (JSON has no -inf), as in vLLM

# Keys of chat_template_kwargs the template may receive, with the type of their value:
# Qwen3's `enable_thinking`, DeepSeek-V3.1's `thinking`, gpt-oss's `reasoning_effort`.
CHAT_TEMPLATE_KWARGS: dict[str, type] = {
    "enable_thinking": bool,
    "thinking": bool,
    "reasoning_effort": str,
}
# Keys of generation_defaults (the model's generation_config.json) that fill unset fields.
GENERATION_DEFAULT_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
)
# What an unset sampling field is when the model has no default either: SamplingParams' own
# defaults (vLLM's values).
_NEUTRAL = {
    f.name: f.default
    for f in dataclasses.fields(SamplingParams)
    if f.name in GENERATION_DEFAULT_KEYS
}
_ANY_OBJECT = {"type": "object"}  # the arguments of a function that declares no parameters
_COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
_SAMPLING_PARAMS_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_STRUCTURED_OUTPUTS_KEYS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams))
# vLLM's older request fields for a constraint, and the StructuredOutputsParams field of each.
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


# ----------------------------------------------------------------------------------- errors


class APIError(Exception):
    """A request failure in OpenAI's error shape, with the HTTP status to answer."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        param: str | None = None,
        code: int | str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = status if code is None else code

    def body(self) -> dict:
        """`{"error": {"message", "type", "param", "code"}}`, ready for a JSON response."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r})"

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> APIError:
        return cls(400, message, "BadRequestError", param)

    @classmethod
    def unauthorized(cls, message: str = "Invalid or missing API key.") -> APIError:
        return cls(401, message, "AuthenticationError")

    @classmethod
    def not_found(cls, message: str, param: str | None = None) -> APIError:
        return cls(404, message, "NotFoundError", param)

    @classmethod
    def model_not_found(cls, model: str | None) -> APIError:
        name = str(model)
        if len(name) > MAX_ECHOED_CHARS:
            name = name[: MAX_ECHOED_CHARS - 3] + "..."
        return cls.not_found(f"The model `{name}` does not exist.", param="model")

    @classmethod
    def too_large(cls, max_bytes: int | None = None) -> APIError:
        limit = "" if max_bytes is None else f" (the limit is {max_bytes} bytes)"
        return cls(413, f"The request body is too large{limit}.", "RequestTooLargeError")

    @classmethod
    def unavailable(cls, message: str = "The engine is not available.") -> APIError:
        return cls(503, message, "ServiceUnavailableError")

    @classmethod
    def internal(cls, message: str = "Internal server error.") -> APIError:
        """A 500. The message must stay generic: log the cause on the server, never send it
        (no exception text, paths or tracebacks)."""
        return cls(500, message, "InternalServerError")


class _ParamError(ValueError):
    """A validator's error that names its param: relative to the validator's location (the
    field or nested model it validates; the request itself for a model validator)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def _short(value: Any) -> str:
    """`value` as an error message may repeat it: at most MAX_ECHOED_CHARS characters."""
    if isinstance(value, str):
        text = repr(value[: MAX_ECHOED_CHARS + 1])
    elif value is None or isinstance(value, bool | int | float):
        text = repr(value)
    else:
        return f"a {type(value).__name__}"  # never render a container: it may be huge
    return text if len(text) <= MAX_ECHOED_CHARS else text[: MAX_ECHOED_CHARS - 3] + "..."


# Union members pydantic names in an error's location; they are not part of the param.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _param_of(loc: Sequence[int | str]) -> str | None:
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int) or p.isdigit() or (p.isidentifier() and p not in _TYPE_TAGS)
    ]
    return ".".join(parts) or None


def from_validation_error(exc: pydantic.ValidationError) -> APIError:
    """A 400 for the first error of a validation: its dotted location is the param
    ("temperature", "messages.0.role") and the message never repeats a long input.

    Also takes FastAPI's RequestValidationError (anything with `.errors()`; a leading "body"
    location is dropped)."""
    errors = exc.errors()
    if not errors:
        return APIError.bad_request("Invalid request.")
    err = errors[0]
    loc = list(err.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ValueError):  # one of ours: the message names its field
        if isinstance(cause, _ParamError) and cause.param:
            loc = [*loc, *cause.param.split(".")]
        param = _param_of(loc)
        message = str(cause)
        if param and "." in param and not message.startswith(param):
            message = f"{param}: {message}"  # nested: say where
        return APIError.bad_request(message, param)
    param = _param_of(loc)
    if err.get("type") == "model_type":
        if param is None:
            return APIError.bad_request("The request body must be a JSON object.")
        return APIError.bad_request(f"{param} must be a JSON object", param)
    subject = param or "request body"
    if err.get("type") == "missing":
        return APIError.bad_request(f"{subject} is required", param)
    message = f"{subject}: {err.get('msg', 'invalid value')}"
    if "input" in err and not isinstance(err["input"], dict | list):
        message += f" (got {_short(err['input'])})"
    return APIError.bad_request(message, param)


_M = TypeVar("_M", bound=BaseModel)


def parse_request(model: type[_M], body: Any) -> _M:
    """Validates a decoded JSON body into `model`; any failure is an APIError (400)."""
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None


# ------------------------------------------------------------------------- field types


def _not_bool(value: Any) -> Any:
    # pydantic's lax mode reads true as 1; SamplingParams (and OpenAI) refuse it.
    if isinstance(value, bool):
        raise PydanticCustomError("bool_number", "Input should be a number, not a boolean")
    return value


def _number(*bounds: Any) -> Any:
    return Annotated[float, BeforeValidator(_not_bool), AllowInfNan(False), *bounds]


def _integer(*bounds: Any) -> Any:
    return Annotated[int, BeforeValidator(_not_bool), *bounds]


Temperature = _number(Ge(0.0), Le(2.0))
TopP = _number(Gt(0.0), Le(1.0))
MinP = _number(Ge(0.0), Le(1.0))
Penalty = _number(Ge(-2.0), Le(2.0))
RepetitionPenalty = _number(Gt(0.0), Le(2.0))
Seed = _integer(Ge(-(2**63)), Le(2**64 - 1))
Logprobs = _integer(Ge(0), Le(MAX_LOGPROBS))
MaxTokens = _integer(Ge(1))
TopK = _integer(Ge(-1))  # -1 or 0: off
MinTokens = _integer(Ge(0))
N = _integer(Ge(1), Le(MAX_N))
BestOf = _integer(Ge(1))
TopLogprobs = _integer(Ge(0), Le(MAX_TOP_LOGPROBS))


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
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            **(self.chat_template_kwargs or {}),
        }


# ------------------------------------------------------------------------ generation requests


def _response_format_constraint(value: Any) -> dict[str, Any] | None:
    """The StructuredOutputsParams fields of a response_format; None for {"type": "text"}."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise _ParamError(
                "response_format", "response_format: json_schema.schema (a JSON schema) is required"
            )
        return {"json": spec["schema"]}
    raise _ParamError(
        "response_format",
        "response_format must be {'type': 'text'}, {'type': 'json_object'} or "
        f"{{'type': 'json_schema', 'json_schema': {{...}}}}; got type {_short(kind)}",
    )


_CONSTRAINT_PREFIX = re.compile(r"^structured_outputs(\.\w+)?:? ?")


def _constraint_error(param: str, exc: ValueError) -> str:
    """StructuredOutputsParams' message ("structured_outputs.json: why") in the words of the
    field the client used ("guided_json: why"), at most 4 * MAX_ECHOED_CHARS characters."""
    message = str(exc)
    if param != "structured_outputs":
        message = f"{param}: {_CONSTRAINT_PREFIX.sub('', message)}"
    return message[: 4 * MAX_ECHOED_CHARS]


class _SamplingRequest(_Model):
    """The fields completions and chat share, and their conversion to SamplingParams."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: dict[str, float] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: MinTokens = 0
    n: N = 1
    best_of: BestOf | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    response_format: Any = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: llguidance decodes all

    # The constraint of the fields above (and of chat's tool_choice), built and checked when
    # the request is parsed.
    _structured_outputs: StructuredOutputsParams | None = PrivateAttr(None)

    _PROMPT_PARAM: ClassVar[str]  # what the prompt is called in this request
    _UNSET_MAX_TOKENS: ClassVar[int | None] = None  # max_tokens when the request omits it

    @field_validator("n", mode="before")
    @classmethod
    def _null_n(cls, value: Any) -> Any:
        return 1 if value is None else value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_logit_bias(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("logit_bias must be an object mapping token ids to biases")
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
        for key, bias in value.items():
            if not (type(key) is int and key >= 0) and not (
                isinstance(key, str) and re.fullmatch(r"[0-9]{1,12}", key)
            ):
                raise ValueError(f"logit_bias: key {_short(key)} is not a token id")
            if (
                isinstance(bias, bool)
                or not isinstance(bias, int | float)
                or not math.isfinite(bias)
                or abs(bias) > LOGIT_BIAS_LIMIT
            ):
                raise ValueError(
                    f"logit_bias: the bias of token {_short(key)} must be a number in "
                    f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {_short(bias)}"
                )
        return {str(k): float(b) for k, b in value.items()}

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop: at most {MAX_STOP} strings, got {len(stops)}")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings must have 1 to {MAX_STOP_CHARS} characters")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _check_stop_token_ids(cls, value: Any) -> Any:
        if value is None:
            return None
        _token_list(value, "stop_token_ids")
        if len(value) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(value)}")
        return value

    @model_validator(mode="after")
    def _check_sampling_fields(self):
        if self.stream_options is not None and not self.stream:
            raise _ParamError(
                "stream_options", "stream_options is only allowed when stream is true"
            )
        if self.best_of is not None and self.best_of != self.n:
            raise _ParamError("best_of", "best_of is only supported when equal to n")
        max_param, max_tokens = self._requested_max_tokens()
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise _ParamError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must be <= {max_param} ({max_tokens})",
            )
        return self

    @model_validator(mode="after")
    def _check_structured_outputs(self):
        sources = self._constraints()
        if len(sources) > 1:
            raise _ParamError(
                sources[1][0],
                f"{' and '.join(p for p, _ in sources)} each constrain the output; give one",
            )
        if sources:
            param, fields = sources[0]
            if self.guided_whitespace_pattern is not None:
                fields.setdefault("whitespace_pattern", self.guided_whitespace_pattern)
            try:
                self._structured_outputs = StructuredOutputsParams(**fields)
            except ValueError as e:
                raise _ParamError(param, _constraint_error(param, e)) from None
        return self

    def _constraints(self) -> list[tuple[str, dict[str, Any]]]:
        """(param, StructuredOutputsParams fields) of each field that constrains the output."""
        out = []
        if self.response_format is not None:
            fields = _response_format_constraint(self.response_format)
            if fields is not None:
                out.append(("response_format", fields))
        if self.structured_outputs is not None:
            unknown = sorted(set(self.structured_outputs) - set(_STRUCTURED_OUTPUTS_KEYS))
            if unknown:
                raise _ParamError(
                    "structured_outputs",
                    f"structured_outputs: unknown key {_short(unknown[0])}; the keys are "
                    f"{', '.join(_STRUCTURED_OUTPUTS_KEYS)}",
                )
            out.append(("structured_outputs", dict(self.structured_outputs)))
        for name, key in _GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                out.append((name, {key: getattr(self, name)}))
        return out

    def _requested_max_tokens(self) -> tuple[str, int | None]:
        """The field that bounds the output and its value (None: unset or null)."""
        return "max_tokens", self.max_tokens

    def _num_logprobs(self) -> int | None:
        raise NotImplementedError

    def _num_prompt_logprobs(self) -> int | None:
        return None  # chat has no prompt logprobs

    def _resolve_max_tokens(self, default_max_tokens: int, max_new_tokens: int | None) -> int:
        param, requested = self._requested_max_tokens()
        if requested is not None:
            if requested > default_max_tokens:
                raise APIError.bad_request(
                    f"{param} is too large: {requested}. The prompt leaves room for at most "
                    f"{default_max_tokens} generated tokens in the model's context.",
                    param,
                )
            return requested
        if param in self.model_fields_set:  # explicit null: up to the end of the context
            return default_max_tokens
        bounds = (default_max_tokens, max_new_tokens, self._UNSET_MAX_TOKENS)
        return min(b for b in bounds if b is not None)

    def to_sampling_params(
        self,
        *,
        default_max_tokens: int,
        generation_defaults: dict[str, Any],
    ) -> SamplingParams:
        """The engine's SamplingParams for this request.

        default_max_tokens: the room the prompt leaves, max_model_len - prompt_len
            (`InputProcessor.check_prompt`). generation_defaults: the model's defaults for
            fields the request left unset (keys: GENERATION_DEFAULT_KEYS; others are
            ignored). Token ids are checked against the vocabulary by the engine's
            `InputProcessor.check_params`, not here."""
        if default_max_tokens < 1:
            raise APIError.bad_request(
                "The prompt fills the model's context; no room is left to generate.",
                self._PROMPT_PARAM,
            )
        defaults = {k: v for k, v in generation_defaults.items() if k in GENERATION_DEFAULT_KEYS}
        kwargs: dict[str, Any] = {}
        for name, neutral in _NEUTRAL.items():
            value = getattr(self, name) if name in self.model_fields_set else None
            kwargs[name] = value if value is not None else defaults.get(name, neutral)
        kwargs["max_tokens"] = self._resolve_max_tokens(
            default_max_tokens, defaults.get("max_new_tokens")
        )
        if self.min_tokens > kwargs["max_tokens"]:
            raise APIError.bad_request(
                f"min_tokens ({self.min_tokens}) is more than the {kwargs['max_tokens']} tokens "
                "this request may generate",
                "min_tokens",
            )
        logit_bias = None
        if self.logit_bias:
            logit_bias = {int(k): b for k, b in self.logit_bias.items()}
        kwargs.update(
            n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=logit_bias,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=self._num_logprobs(),
            prompt_logprobs=self._num_prompt_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self._structured_outputs,
        )
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:  # second line: SamplingParams' own checks name the field
            message = str(exc)
            word = re.match(r"[a-z_]+", message)
            param = word.group() if word and word.group() in _SAMPLING_PARAMS_FIELDS else None
            if param == "max_tokens":
                param = self._requested_max_tokens()[0]
            raise APIError.bad_request(message[: 4 * MAX_ECHOED_CHARS], param) from None


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    _PROMPT_PARAM: ClassVar[str] = "prompt"
    _UNSET_MAX_TOKENS: ClassVar[int | None] = _COMPLETIONS_MAX_TOKENS

    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: Any = None
    logprobs: Logprobs | None = None
    echo: bool | None = False
    prompt_logprobs: Logprobs | None = None
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


class ChatCompletionRequest(_ChatTemplateFields, _SamplingRequest):
    """POST /v1/chat/completions."""

    _PROMPT_PARAM: ClassVar[str] = "messages"

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None
    echo: bool | None = False
    tools: list[dict[str, Any]] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}} once
    # validated (validated when unset too: with tools, it is then "auto").
    tool_choice: Any = Field(None, validate_default=True)
    parallel_tool_calls: bool | None = True
    functions: Any = None
    function_call: Any = None
    # vLLM's: with a --reasoning-parser, False leaves the thinking out of the response.
    include_reasoning: bool = True

    @field_validator("tools", mode="before")
    @classmethod
    def _check_tools(cls, value: Any) -> Any:
        """Each tool as {"type": "function", "function": {"name", "description",
        "parameters"}} (the keys vLLM hands the chat template; others are dropped)."""
        if value is None:
            return None
        if not isinstance(value, list):
            raise ValueError("tools must be a list of {'type': 'function', 'function': {...}}")
        out, names = [], set()
        for i, tool in enumerate(value):
            where = f"tools.{i}"
            if not isinstance(tool, dict):
                raise ValueError(f"{where} must be {{'type': 'function', 'function': {{...}}}}")
            function = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(function, dict):
                raise ValueError(f"{where} must be {{'type': 'function', 'function': {{...}}}}")
            name = function.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError(f"{where}.function.name must be a non-empty string")
            if name in names:
                raise ValueError(f"{where}.function.name: two tools are named {_short(name)}")
            names.add(name)
            description = function.get("description")
            if description is not None and not isinstance(description, str):
                raise ValueError(f"{where}.function.description must be a string")
            parameters = function.get("parameters")
            if parameters is not None:
                if not isinstance(parameters, dict):
                    raise ValueError(f"{where}.function.parameters must be a JSON schema object")
                try:  # compiles as the constraint of a call to it would
                    StructuredOutputsParams(json=parameters)
                except ValueError as e:
                    raise ValueError(_constraint_error(f"{where}.function.parameters", e)) from None
            out.append(
                {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": description,
                        "parameters": parameters,
                    },
                }
            )
        return out

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, value: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools")
        if value is None:
            value = "auto" if tools else "none"
        if value == "none":
            return value
        name = None
        if isinstance(value, dict) and value.get("type") == "function":
            function = value.get("function")
            name = function.get("name") if isinstance(function, dict) else None
        if value not in ("auto", "required") and not (isinstance(name, str) and name):
            raise ValueError(
                "tool_choice must be 'none', 'auto', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}"
            )
        if tools is None:
            raise ValueError("tool_choice needs tools")
        if name is None:
            return value if tools else "none"  # no tools to call (vLLM, for "required")
        if all(t["function"]["name"] != name for t in tools):
            raise ValueError(f"tool_choice: no tool is named {_short(name)}")
        return {"type": "function", "function": {"name": name}}

    @field_validator("parallel_tool_calls", mode="before")
    @classmethod
    def _null_parallel_tool_calls(cls, value: Any) -> Any:
        return True if value is None else value

    @field_validator("functions", "function_call")
    @classmethod
    def _check_functions(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, [], "none"):
            raise ValueError(f"{info.field_name} is not supported; use tools and tool_choice")
        return value

    @model_validator(mode="after")
    def _check_chat_fields(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise _ParamError("top_logprobs", "top_logprobs is only allowed when logprobs is true")
        return self

    def _requested_max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        if "max_completion_tokens" in self.model_fields_set and "max_tokens" not in (
            self.model_fields_set
        ):
            return "max_completion_tokens", None
        return "max_tokens", self.max_tokens

    def _num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def named_tool(self) -> str | None:
        """The function tool_choice names, if it names one."""
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return None

    def check_tool_choice(self, *, auto_tool_choice: bool) -> None:
        """400 for tool_choice "auto" on a server without a tool call parser (vLLM's words)."""
        if self.tool_choice == "auto" and not auto_tool_choice:
            raise APIError.bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                "tool_choice",
            )

    def _constraints(self) -> list[tuple[str, dict[str, Any]]]:
        out = super()._constraints()
        if self.named_tool is not None:
            tool = next(t for t in self.tools if t["function"]["name"] == self.named_tool)
            out.append(("tool_choice", {"json": tool["function"]["parameters"] or _ANY_OBJECT}))
        elif self.tool_choice == "required":
            try:
                schema = required_tool_calls_schema(self.tools, parallel=self.parallel_tool_calls)
            except ValueError as e:
                raise _ParamError("tools", str(e)) from None
            out.append(("tool_choice", {"json": schema}))
        return out

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = super().template_kwargs()
        if self.tools and self.tool_choice != "none":
            kwargs["tools"] = self.tools
        return kwargs


# --------------------------------------------------------------------- tokenizer endpoints


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


# -------------------------------------------------------------------------------- responses


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


# -------------------------------------------------------------------------------- logprobs


def _json_logprob(logprob: float) -> float:
    """-inf (and NaN) has no JSON form: it becomes LOGPROB_FLOOR."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _token_text(token_id: int, entry: Logprob | None, decode: Callable[[int], str] | None) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return decode(token_id) if decode is not None else f"token_id:{token_id}"


def _top(step: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The step's `num` most likely tokens, most likely first."""
    return sorted(
        ((t, lp) for t, lp in step.items() if lp.rank <= num), key=lambda item: item[1].rank
    )


def _check_lengths(token_ids: Sequence[int], logprobs: Sequence[Any]) -> None:
    if len(token_ids) != len(logprobs):
        raise ValueError(f"{len(token_ids)} token ids but {len(logprobs)} logprob entries")


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob] | None],
    num: int,
    tokenizer_decode: Callable[[int], str],
    initial_text_offset: int = 0,
) -> dict[str, list]:
    """OpenAI's completions logprobs for `token_ids`: per token its text, its logprob, a dict
    of the `num` most likely tokens' texts to logprobs plus the sampled one (up to num + 1
    entries, as OpenAI documents), and its character offset in the text, starting at
    `initial_text_offset` (the length of the text before these tokens: echoed prompt, earlier
    stream chunks). A None entry (a token without logprobs) gives None logprobs."""
    _check_lengths(token_ids, logprobs)
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    offset = initial_text_offset
    for token_id, step in zip(token_ids, logprobs, strict=True):
        entry = None if step is None else step.get(token_id)
        token = _token_text(token_id, entry, tokenizer_decode)
        out["tokens"].append(token)
        out["text_offset"].append(offset)
        offset += len(token)
        if step is None or entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_json_logprob(entry.logprob))
        top = _top(step, num)
        if all(t != token_id for t, _ in top):
            top.append((token_id, entry))
        out["top_logprobs"].append(
            {_token_text(t, lp, tokenizer_decode): _json_logprob(lp.logprob) for t, lp in top}
        )
    return out


def prompt_logprobs_json(
    token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob] | None], num: int
) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a completion choice: per prompt token its own entry and
    the `num` most likely, each {"logprob", "rank", "decoded_token"}; None for the first."""
    _check_lengths(token_ids, logprobs)
    out: list[dict[int, dict[str, Any]] | None] = []
    for token_id, step in zip(token_ids, logprobs, strict=True):
        if step is None:
            out.append(None)
            continue
        entries = dict(_top(step, num))
        if token_id in step:
            entries[token_id] = step[token_id]
        out.append(
            {
                t: {
                    "logprob": _json_logprob(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token,
                }  # fmt: skip
                for t, lp in entries.items()
            }
        )
    return out


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob] | None],
    num: int,
    tokenizer_decode: Callable[[int], str] | None = None,
) -> dict[str, list]:
    """OpenAI's chat logprobs for `token_ids`: {"content": [{"token", "logprob", "bytes",
    "top_logprobs": the `num` most likely, each {"token", "logprob", "bytes"}}]}. Token texts
    come from the Logprob's decoded_token, else `tokenizer_decode`, else "token_id:<id>"."""
    _check_lengths(token_ids, logprobs)
    content = []
    for token_id, step in zip(token_ids, logprobs, strict=True):
        entry = None if step is None else step.get(token_id)
        token = _token_text(token_id, entry, tokenizer_decode)
        item: dict[str, Any] = {
            "token": token,
            "logprob": LOGPROB_FLOOR if entry is None else _json_logprob(entry.logprob),
            "bytes": _utf8(token),
            "top_logprobs": [],
        }
        if step is not None:
            for t, lp in _top(step, num):
                text = _token_text(t, lp, tokenizer_decode)
                item["top_logprobs"].append(
                    {"token": text, "logprob": _json_logprob(lp.logprob), "bytes": _utf8(text)}
                )
        content.append(item)
    return {"content": content}
