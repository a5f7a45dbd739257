"""A request as the engine core sees it: token ids, progress, and status."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxllm.engine.core_outputs import FinishReason
from jaxllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxllm.lora import LoRARequest
    from jaxllm.pooling import PooledState
    from jaxllm.pooling_params import PoolingParams
    from jaxllm.structured_outputs import Grammar
    from jaxllm.worker import MultiModalItem


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # blocks taken back; waits to be recomputed from scratch
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # e.g. its grammar failed to compile

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...],
        max_tokens: int,
        seed: int,
        priority: int = 0,
        prefix_parent: str | None = None,
        lora: LoRARequest | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = () if sampling_params.ignore_eos else eos_token_ids
        self.stop_token_ids = set(sampling_params.stop_token_ids)
        self.max_tokens = max_tokens  # resolved: never runs past max_model_len
        # The sequence length it may reach: prompt + max_tokens within max_model_len (the
        # scheduler sets it when the request is added).
        self.max_len = len(prompt_token_ids) + max_tokens
        self.seed = seed  # resolved: a request without a seed gets one from the engine
        self.priority = priority  # lower runs earlier under the "priority" policy
        # A sibling with the same prompt (the first of n completions): this request waits
        # until the sibling has computed the prompt, then starts from its cached blocks.
        self.prefix_parent = prefix_parent
        # Its LoRA adapter, and the device slot that holds it while the request runs (-1: not
        # running, or none).
        self.lora = lora
        self.lora_slot = -1
        # Its images, in prompt order: each fills `length` placeholder tokens from `offset`.
        self.mm_items = sorted(mm_items, key=lambda item: item.offset)
        # vLLM's cache salt: only requests of the same salt share cached prefixes.
        self.cache_salt = cache_salt
        # Prefill/decode disaggregation (`kv_transfer`): the client's params, and the ones
        # a prefiller answers with once it finishes.
        self.kv_transfer_params = kv_transfer_params
        self.kv_transfer_out: dict | None = None
        # The next prompt position whose logprob is owed (prompt_logprobs): position 0 has
        # none; positions scored before a preemption are not scored again.
        self.next_prompt_logprob = 1
        self.arrival_time = time.monotonic()
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        # Tokens whose K/V are in the cache. It catches up with num_tokens one scheduled chunk
        # at a time; when it equals num_tokens the next step samples a new token.
        self.num_computed_tokens = 0
        # Blocks of its table the runner has been sent (see `SchedulerOutput`).
        self.num_blocks_sent = 0
        # Scheduled steps whose output has not come back yet (async scheduling runs one step
        # ahead): num_computed_tokens counts their tokens already; `num_inflight_tokens` of them
        # are not confirmed written, and `num_pending_tokens` is the token such a step samples
        # (0 or 1), not yet appended.
        self.num_inflight_tokens = 0
        self.num_pending_tokens = 0
        # Speculative decoding: draft tokens proposed to follow the sequence, verified in its
        # next decode step (never part of all_token_ids unless accepted).
        self.spec_token_ids: list[int] = []
        # Structured outputs: the matcher its tokens must follow (set by the scheduler), live
        # from the start, or once the thinking ended (`reasoning_end_token_ids`).
        self.grammar: Grammar | None = None
        self.grammar_live = sampling_params.reasoning_end_token_ids is None
        # A pooling request (a decoder served for pooling): its prompt is computed, pooled
        # chunk by chunk, and the request finishes with its vector; it samples nothing.
        self.pooling_params: PoolingParams | None = None
        self.pooled: PooledState | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_confirmed_tokens(self) -> int:
        """Tokens whose K/V a finished step has written (the prefix cache may key them)."""
        return self.num_computed_tokens - self.num_inflight_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def owes_prompt_logprobs(self) -> bool:
        return (
            self.sampling_params.prompt_logprobs is not None
            and self.next_prompt_logprob < self.num_prompt_tokens
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}"
            f"/{self.num_tokens})"
        )
