"""What the front end measures of each engine step and each request, for metrics: vLLM's
`IterationStats` and `FinishedRequestStats`, by its definitions.

`AsyncLLM` keeps a `RequestTimes` per request and hands an `IterationStats` to its `on_step`
hook after each step's outputs (and one per request that ends outside a step: an abort). The
server's Prometheus exporter (`server.metrics`) turns them into vLLM's histograms and counters.

Times are `time.monotonic()`: the engine core's timestamps (when a request first ran) come from
another process on the same host, which reads the same clock.
"""

from __future__ import annotations

import dataclasses
import time

from jaxllm.engine.core_outputs import FinishReason, StepEvents


@dataclasses.dataclass(slots=True)
class RequestTimes:
    """One request's timeline, as the front end sees it."""

    arrival: float  # when the request came (the server: when its HTTP request came)
    num_prompt_tokens: int
    max_tokens_param: int | None  # as the client asked (None: not given)
    n: int  # completions of its prompt (`SamplingParams.n`)
    group: str  # the id its prompt's completions share (the first completion's request id)
    queued_seconds: float = 0.0  # in the core's queue before it first ran
    scheduled: float | None = None  # when it first ran
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0
    engine: int = 0  # the data-parallel rank of the core that runs it


@dataclasses.dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float  # arrival to the end
    queued_time: float  # waiting in the core before it first ran
    prefill_time: float  # first ran to its first token
    decode_time: float  # first token to last token
    inference_time: float  # first ran to last token
    mean_time_per_output_token: float | None  # decode_time per token after the first
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None


@dataclasses.dataclass
class IterationStats:
    """What one step's outputs changed. A request's prompt tokens count once, when its first
    token comes; its inter-token latencies are the intervals between the steps that gave it
    tokens (several tokens in a step, with speculative decoding, make one interval)."""

    now: float = dataclasses.field(default_factory=time.monotonic)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = dataclasses.field(default_factory=list)
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)
    finished: list[FinishedRequestStats] = dataclasses.field(default_factory=list)
    # Per prompt whose n completions all ended: n, and the most tokens one of them generated.
    n_params: list[int] = dataclasses.field(default_factory=list)
    max_num_generation_tokens: list[int] = dataclasses.field(default_factory=list)
    step: StepEvents | None = None  # the engine core's part (None: no step, e.g. an abort)
    engine: int = 0  # the data-parallel rank of the core whose step this was

    def new_tokens(self, times: RequestTimes, count: int) -> None:
        if count == 0:
            return
        if times.first_token is None:
            times.first_token = self.now
            self.num_prompt_tokens += times.num_prompt_tokens
            self.time_to_first_tokens.append(self.now - times.arrival)
        else:
            self.inter_token_latencies.append(self.now - times.last_token)
        times.last_token = self.now
        times.num_generation_tokens += count
        self.num_generation_tokens += count

    def pooled(self, times: RequestTimes) -> None:
        """A pooling request's vector came: its prompt tokens count now (it has no tokens
        of its own, no TTFT)."""
        times.first_token = times.last_token = self.now
        self.num_prompt_tokens += times.num_prompt_tokens

    def finish(self, times: RequestTimes, reason: FinishReason | str) -> None:
        ran = times.scheduled if times.scheduled is not None else self.now
        first = times.first_token if times.first_token is not None else self.now
        last = times.last_token if times.last_token is not None else first
        decode = last - first
        tokens = times.num_generation_tokens
        self.finished.append(
            FinishedRequestStats(
                finish_reason=str(reason),
                e2e_latency=self.now - times.arrival,
                queued_time=times.queued_seconds,
                prefill_time=first - ran,
                decode_time=decode,
                inference_time=last - ran,
                mean_time_per_output_token=decode / (tokens - 1) if tokens > 1 else None,
                num_prompt_tokens=times.num_prompt_tokens,
                num_generation_tokens=tokens,
                max_tokens_param=times.max_tokens_param,
            )
        )


class PromptGroups:
    """Tells when all n completions of a prompt have ended (vLLM observes `n` and the most
    tokens one completion generated per prompt, not per completion). A prompt whose other
    completions never come (a library caller running one of n) stays open, among at most
    `max_open` such prompts: the oldest are forgotten past that."""

    def __init__(self, max_open: int = 4096):
        self.max_open = max_open
        self._open: dict[str, tuple[int, int]] = {}  # group -> (completions ended, most tokens)

    def finish(self, times: RequestTimes, stats: IterationStats) -> None:
        ended, most = self._open.pop(times.group, (0, 0))
        ended, most = ended + 1, max(most, times.num_generation_tokens)
        if ended < times.n:
            self._open[times.group] = (ended, most)
            if len(self._open) > self.max_open:
                del self._open[next(iter(self._open))]
        else:
            stats.n_params.append(times.n)
            stats.max_num_generation_tokens.append(most)
