"""What the engine core reports to its front ends, per request and per step: a leaf of the
engine (the data between the scheduler and the worker is `jaxllm.worker.step_data`).
"""

from __future__ import annotations

import enum

import msgspec
import msgspec.structs

from jaxllm.worker import PromptTokenLogprobs, TokenLogprobs


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the end of the context
    ABORT = "abort"  # the client went away or cancelled
    ERROR = "error"  # the engine failed the step that held the request


class RequestUpdate(msgspec.Struct):
    """What one step produced for one request, as the engine core reports it."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    new_prompt_logprobs: list[PromptTokenLogprobs] | None = None
    pooled: list[float] | None = None  # a pooling request's vector (it finishes with it)
    # A prefiller's finished request (`kv_transfer`): what its decoder needs to pull its KV.
    kv_transfer_params: dict | None = None


class StepEvents(msgspec.Struct):
    """What metrics need of one `EngineCore.step` beyond the counters in `Stats`."""

    # (request id, seconds it waited since it arrived, time.monotonic() when it first ran) of
    # the requests the step first admitted (a resumed request is not admitted again).
    scheduled: list[tuple[str, float, float]] = msgspec.field(default_factory=list)
    # Seconds the host worked on the step (scheduling, building the batch, dispatching, and
    # updating the requests from the outputs), without the time it waited for the device;
    # None when the call ran no step.
    host_seconds: float | None = None


class SpecDecodingStats(msgspec.Struct):
    """Speculative decoding's counters since start (vLLM's spec_decode metrics): verifications
    (a request with drafts in a step), draft tokens verified, accepted ones, and accepted ones
    by their position among the drafts. The scheduler owns one and `observe`s each
    verification; metrics read a copy in `Stats`."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_per_pos: list[int] = msgspec.field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_per_pos
        per_pos += [0] * (num_accepted - len(per_pos))
        for j in range(num_accepted):
            per_pos[j] += 1

    def copy(self) -> SpecDecodingStats:
        return msgspec.structs.replace(self, num_accepted_per_pos=list(self.num_accepted_per_pos))


class Stats(msgspec.Struct):
    """The engine core's state and counters, as of its last step (`EngineCore.stats`)."""

    num_running: int = 0
    num_waiting: int = 0
    num_received: int = 0  # requests the core has taken in, since start
    kv_cache_usage: float = 0.0  # share of pages held by requests
    prefix_cache_queries: int = 0  # counters, since start
    prefix_cache_hits: int = 0
    # The prefix cache's host tier (kv_offloading_size): hits it served, in tokens (of
    # `prefix_cache_hits`), blocks copied out and back since start, and blocks it holds.
    prefix_cache_hits_host: int = 0
    kv_offload_stored: int = 0
    kv_offload_loaded: int = 0
    kv_offload_blocks: int = 0
    kv_offload_capacity: int = 0
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
    spec_decoding: SpecDecodingStats = msgspec.field(default_factory=SpecDecodingStats)
    sleep_level: int = 0  # sleep mode: 0 awake, 1 weights on the host, 2 weights dropped
    # LoRA (enable_lora): the adapters of the running and the waiting requests, by name, and
    # how many the device holds at once (0: LoRA off), for vllm:lora_requests_info.
    running_loras: list[str] = msgspec.field(default_factory=list)
    waiting_loras: list[str] = msgspec.field(default_factory=list)
    max_loras: int = 0
    # An image-text model's encoder cache: images looked up and found (the rest encoded)
    # since start, and the share of its slots that requests hold now.
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_usage: float = 0.0
    # Prefill/decode disaggregation (kv_transfer_config), since start: blocks decoders pulled
    # from this engine; blocks it pulled and landed, their bytes, failed pulls (prompts
    # recomputed) and seconds spent pulling; prompt tokens of its remote-prefill requests
    # and how many of them it pulled (vLLM's external prefix cache); requests held now.
    kv_transfer_sent_blocks: int = 0
    kv_transfer_received_blocks: int = 0
    kv_transfer_received_bytes: int = 0
    kv_transfer_failures: int = 0
    kv_transfer_seconds: float = 0.0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_transfer_held: int = 0
