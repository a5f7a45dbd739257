"""SamplingParams: how one request is decoded, with vLLM's names, defaults and checks.

Every field is validated on construction; a bad value raises a `ValueError` that names the
parameter, before anything reaches the engine.
"""

from __future__ import annotations

import dataclasses
import math

from jaxllm.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20  # most top logprobs a request may ask for (vLLM's default max_logprobs)
MAX_N = 128
MAX_STOP_TOKEN_IDS = 32  # stop_token_ids per request (they travel to the sampler as an array)
MAX_LOGIT_BIAS = 300  # logit_bias entries per request (they travel to the sampler as an array)
LOGIT_BIAS_LIMIT = 100.0  # logit_bias values are in [-100, 100] (as in OpenAI's API)
# Temperatures below this are greedy (as in vLLM): dividing logits by less would overflow.
SAMPLING_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric parameter takes: `kind` numbers from lo to hi (no upper bound when
    hi is None), lo itself left out when lo_open."""

    kind: type  # int or float (a float parameter takes ints too, never booleans)
    lo: float
    hi: float | None = None
    lo_open: bool = False

    def __str__(self) -> str:
        """As an error message says it: "in [0.0, 1.0]", "in (0.0, 1.0]", ">= 1"."""
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        return f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}]"

    def check(self, name: str, value) -> None:
        """A ValueError that names `name` unless `value` is a `kind` number in the range."""
        number = int if self.kind is int else int | float
        if isinstance(value, bool) or not isinstance(value, number):
            a = "an integer" if self.kind is int else "a number"
            raise ValueError(f"{name} must be {a}, got {value!r}")
        if self.kind is float and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
        if (
            value < self.lo
            or (self.lo_open and value == self.lo)
            or (self.hi is not None and value > self.hi)
        ):
            raise ValueError(f"{name} must be {self}, got {value}")


# The range of each numeric field of SamplingParams, written once: __post_init__ checks them,
# and the server's request fields take them as their constraints (server/protocol/sampling.py),
# so an API request accepts what SamplingParams accepts, as in vLLM. temperature: vLLM sets no
# upper bound; 1e4 only refuses absurd values (sampling is all but uniform long before).
RANGES: dict[str, Range] = {
    "n": Range(int, 1, MAX_N),
    "max_tokens": Range(int, 1),
    "temperature": Range(float, 0.0, 1e4),
    "top_p": Range(float, 0.0, 1.0, lo_open=True),
    "top_k": Range(int, -1),  # -1 or 0: off
    "min_p": Range(float, 0.0, 1.0),
    "seed": Range(int, -(2**63), 2**64 - 1),
    "min_tokens": Range(int, 0),
    "logprobs": Range(int, 0, MAX_LOGPROBS),
    "prompt_logprobs": Range(int, 0, MAX_LOGPROBS),
    "presence_penalty": Range(float, -2.0, 2.0),
    "frequency_penalty": Range(float, -2.0, 2.0),
    "repetition_penalty": Range(float, 0.0, 2.0, lo_open=True),
}
# The fields of RANGES that may also be None: no limit, no seed, no logprobs.
_OPTIONAL = frozenset({"max_tokens", "seed", "logprobs", "prompt_logprobs"})
TOKEN_ID = Range(int, 0)
LOGIT_BIAS = Range(float, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    """Number of completions to return for the prompt."""
    max_tokens: int | None = 16
    """Most tokens to generate; None generates up to the model's context."""
    temperature: float = 1.0
    """0 (or anything below 1e-5) is greedy; higher is more random."""
    top_p: float = 1.0
    """Sample only from the smallest set of tokens whose probability adds up to top_p."""
    top_k: int = 0
    """Sample only from the top_k most likely tokens; 0 (or -1) considers all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same output whatever else is in the batch."""
    stop: str | list[str] | None = None
    """Strings that end the output; they are not included unless include_stop_str_in_output."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the output (beside EOS)."""
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    """Keep generating after EOS (for benchmarks and parity tests)."""
    min_tokens: int = 0
    """Generate at least this many tokens before EOS or stop_token_ids may end the output."""
    logprobs: int | None = None
    """Return the log-probability of each generated token and of this many top alternatives."""
    prompt_logprobs: int | None = None
    """Return the log-probability of each prompt token (the first has none) and of this many
    top alternatives. Such requests skip the prefix cache: every prompt position must be
    computed to be scored."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output text."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token that already occurs in the output."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per occurrence of that token in the output."""
    repetition_penalty: float = 1.0
    """Tokens seen in the prompt or the output: positive logits are divided by it, others
    multiplied; 1 is off, above 1 discourages repetition."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to that token's logit before sampling."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, a regex, a choice or a grammar (a dict of
    `StructuredOutputsParams` fields is taken too)."""
    reasoning_end_token_id: int | None = None
    """A reasoning model's end-of-thinking token (`</think>`): structured outputs constrain
    only the tokens after it, the thinking before it is free (a server with a reasoning
    parser sets it). Short for `reasoning_end_token_ids=[id]`."""
    reasoning_end_token_ids: list[int] | None = None
    """The token sequence that ends a reasoning model's thinking where one token does not
    (gpt-oss: `<|channel|>final<|message|>`): structured outputs constrain what follows its
    first appearance in the output."""

    def __post_init__(self) -> None:
        for name, bounds in RANGES.items():
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL:
                bounds.check(name, value)
        if self.top_k == -1:
            self.top_k = 0
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} allowed, got "
                f"{len(self.stop_token_ids)}"
            )
        for t in self.stop_token_ids:
            TOKEN_ID.check("stop_token_ids", t)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(
                    f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}"
                )
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias: at most {MAX_LOGIT_BIAS} entries allowed, got "
                    f"{len(self.logit_bias)}"
                )
            for t, b in self.logit_bias.items():
                TOKEN_ID.check("logit_bias token id", t)
                LOGIT_BIAS.check("logit_bias value", b)
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()} or None
        if self.reasoning_end_token_id is not None:
            TOKEN_ID.check("reasoning_end_token_id", self.reasoning_end_token_id)
            if self.reasoning_end_token_ids is None:
                self.reasoning_end_token_ids = [self.reasoning_end_token_id]
        if self.reasoning_end_token_ids is not None:
            ids = self.reasoning_end_token_ids
            if not isinstance(ids, list | tuple) or not ids:
                raise ValueError(
                    f"reasoning_end_token_ids must be a non-empty list of token ids, got {ids!r}"
                )
            for t in ids:
                TOKEN_ID.check("reasoning_end_token_ids", t)
            self.reasoning_end_token_ids = [int(t) for t in ids]
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:  # an unknown key
                raise ValueError(f"structured_outputs: {e}") from None
        elif self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict")

    @property
    def uses_penalties(self) -> bool:
        """Whether any of presence, frequency or repetition penalty is on."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        """Temperature-greedy: argmax, but of the logits after penalties and logit_bias."""
        return self.temperature < SAMPLING_EPS
