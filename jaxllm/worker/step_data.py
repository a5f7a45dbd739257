"""The data of one engine step: what the scheduler hands the runner, what the runner returns,
and what the engine core reports per request.

A leaf module, imported by the scheduler, the runner, the engine core and the multi-host
channel (each message is a msgspec struct, so it crosses a socket as msgpack); it imports
neither of them.

A request's full data crosses the scheduler/runner boundary once, as `NewRequestData`, when it
is scheduled for the first time or resumed after a preemption; the runner keeps it in its
persistent batch. Afterwards each step carries only what changed: a `ScheduledRequest` with
the request's progress, its token grant and the blocks added since the last step (vLLM V1's
`NewRequestData` / `CachedRequestData` split). Sampled tokens never travel back: the runner
appends the tokens it sampled to its own copy of each request.
"""

from __future__ import annotations

import enum

import msgspec

from jaxllm.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the end of the context
    ABORT = "abort"  # the client went away or cancelled
    ERROR = "error"  # the engine failed the step that held the request


class NewRequestData(msgspec.Struct):
    """A request entering the batch (new, or resumed after a preemption)."""

    request_id: str
    token_ids: list[int]  # the prompt, then the tokens generated so far (a resumed request)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int  # resolved: never None
    eos_token_ids: list[int]  # empty under ignore_eos
    block_ids: list[int]  # the whole block table, with the blocks granted this step


class ScheduledRequest(msgspec.Struct):
    """One request's share of a step, in batch order."""

    request_id: str
    num_computed_tokens: int  # tokens already in the KV cache: the position of the first one
    num_scheduled_tokens: int  # tokens to compute now (a prompt chunk, or 1 to decode)
    new_block_ids: list[int]  # blocks appended to its table since the previous step
    # prompt_logprobs: per scheduled token, the next prompt token to score it against, or -1;
    # None when the chunk scores nothing.
    prompt_logprob_targets: list[int] | None = None
    # Speculative decoding: draft tokens, the last of num_scheduled_tokens (which counts them),
    # to verify after the request's last token; the step's output keeps the accepted ones.
    spec_token_ids: list[int] = msgspec.field(default_factory=list)


class GrammarBitmask(msgspec.Struct):
    """Structured outputs: which tokens the constrained requests that sample this step may
    sample (see `jaxllm.structured_outputs`)."""

    request_ids: list[str]  # in batch order; each has 1 + len(spec_token_ids) rows
    data: bytes  # int32 [rows, ceil(V / 32)], row-major; bit i of word w allows token 32 w + i


class SchedulerOutput(msgspec.Struct):
    """One step's batch."""

    new_requests: list[NewRequestData]  # rows to (re)build before the step
    requests: list[ScheduledRequest]  # the batch, in order
    total_num_scheduled_tokens: int  # <= max_num_batched_tokens
    preempted_request_ids: list[str]  # preempted while this step was built: rows to drop
    finished_request_ids: list[str]  # finished since the previous step: rows to drop
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def is_empty(self) -> bool:
        return not self.requests


class TokenLogprobs(msgspec.Struct, array_like=True):
    """A sampled token's logprob and rank, and the top alternatives."""

    logprob: float
    rank: int  # 1 = the most likely token
    top_ids: list[int]
    top_logprobs: list[float]


class PromptTokenLogprobs(msgspec.Struct, array_like=True):
    """prompt_logprobs: the same for one prompt token, scored against what came before."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


class RunnerOutput(msgspec.Struct):
    """What one step computed, by request id."""

    # Requests whose chunk reached the end of their sequence: the token sampled after it, or
    # with speculative decoding the accepted draft tokens and the token sampled after them.
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]]  # those of them that asked: one per token
    prompt_logprobs: dict[str, list[PromptTokenLogprobs]]  # prompt tokens scored this step
    # Speculative decoding: draft tokens proposed for each sampling request's next step.
    draft_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)


class RequestUpdate(msgspec.Struct):
    """What one step produced for one request, as the engine core reports it."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    new_prompt_logprobs: list[PromptTokenLogprobs] | None = None


class StepEvents(msgspec.Struct):
    """What metrics need of one `EngineCore.step` beyond the counters in `Stats`."""

    # (request id, seconds it waited since it arrived, time.monotonic() when it first ran) of
    # the requests the step first admitted (a resumed request is not admitted again).
    scheduled: list[tuple[str, float, float]] = msgspec.field(default_factory=list)
    # Seconds the host worked on the step (scheduling, building the batch, dispatching, and
    # updating the requests from the outputs), without the time it waited for the device;
    # None when the call ran no step.
    host_seconds: float | None = None


class Stats(msgspec.Struct):
    """The engine core's state and counters, as of its last step (`EngineCore.stats`)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # share of pages held by requests
    prefix_cache_queries: int = 0  # counters, since start
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_compilations: int = 0
    num_steps: int = 0
    # Tokens the steps computed, and the token slots of the compiled shapes they ran (the
    # difference is padding), since start.
    num_scheduled_tokens: int = 0
    num_padded_tokens: int = 0
    # Structured outputs: seconds the host spent filling token bitmasks, and the steps that
    # filled one, since start.
    grammar_bitmask_seconds: float = 0.0
    grammar_bitmask_steps: int = 0
    # Speculative decoding, since start (vLLM's spec_decode counters): verifications (a
    # request with drafts in a step), draft tokens verified, accepted ones, and accepted ones
    # by their position among the drafts.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_per_pos: list[int] = msgspec.field(default_factory=list)
