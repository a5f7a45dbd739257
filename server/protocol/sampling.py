"""The fields completions and chat share (`_SamplingRequest`): the sampling parameters with
SamplingParams' own ranges (`jaxllm.sampling_params.RANGES`), the stop conditions, the
structured-output fields, and the conversion to the engine's `SamplingParams` with the model's
generation defaults.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, ClassVar

from annotated_types import Ge, Gt, Le
from pydantic import PrivateAttr, field_validator, model_validator

from jaxllm.sampling_params import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    RANGES,
    SamplingParams,
)
from jaxllm.structured_outputs import StructuredOutputsParams
from server.protocol.errors import MAX_ECHOED_CHARS, APIError, _ParamError, _short
from server.protocol.fields import StreamOptions, _integer, _Model, _number, _token_list

MAX_STOP = 32  # stop strings per request
MAX_STOP_CHARS = 1024  # characters in one stop string

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
_SAMPLING_PARAMS_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_STRUCTURED_OUTPUTS_KEYS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams))
# vLLM's older request fields for a constraint, and the StructuredOutputsParams field of each.
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _ranged(name: str) -> Any:
    """SamplingParams' field `name` as a request field: its kind and range (RANGES)."""
    r = RANGES[name]
    bounds = [Gt(r.lo) if r.lo_open else Ge(r.lo), *([] if r.hi is None else [Le(r.hi)])]
    return (_integer if r.kind is int else _number)(*bounds)


# The sampling fields' types, with SamplingParams' ranges: a value out of range is a 400
# naming the field, whether the request or SamplingParams finds it.
Temperature = _ranged("temperature")
TopP = _ranged("top_p")
MinP = _ranged("min_p")
PresencePenalty = _ranged("presence_penalty")
FrequencyPenalty = _ranged("frequency_penalty")
RepetitionPenalty = _ranged("repetition_penalty")
Seed = _ranged("seed")
Logprobs = _ranged("logprobs")
PromptLogprobs = _ranged("prompt_logprobs")
MaxTokens = _ranged("max_tokens")
TopK = _ranged("top_k")  # -1 or 0: off
MinTokens = _ranged("min_tokens")
N = _ranged("n")
BestOf = _integer(Ge(1))


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
    presence_penalty: PresencePenalty | None = None
    frequency_penalty: FrequencyPenalty | None = None
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
    # vLLM's: only requests of the same salt share cached prompt prefixes (tenant isolation).
    cache_salt: str | None = None
    # vLLM's prefill/decode disaggregation (`jaxllm.engine.kv_transfer`): {"do_remote_decode":
    # true} to a prefiller; the params its response carries, to a decoder.
    kv_transfer_params: dict[str, Any] | None = None

    # The constraint of the fields above (and of chat's tool_choice), built and checked when
    # the request is parsed.
    _structured_outputs: StructuredOutputsParams | None = PrivateAttr(None)

    _PROMPT_PARAM: ClassVar[str]  # what the prompt is called in this request
    _UNSET_MAX_TOKENS: ClassVar[int | None] = None  # max_tokens when the request omits it

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("cache_salt must be a non-empty string")
        return value

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
