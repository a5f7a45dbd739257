"""The data of one step between the scheduler and the worker: the batch the scheduler hands
the model runner (`SchedulerOutput`), and what the runner computed (`RunnerOutput`). What the
engine core reports to its front ends is `jaxllm.engine.core_outputs`.

A leaf module, imported by the scheduler, the worker, the engine core and the multi-host
channel (each message is a msgspec struct, so it crosses a socket as msgpack); it imports
none of them.

A request's full data crosses the scheduler/runner boundary once, as `NewRequestData`, when it
is scheduled for the first time or resumed after a preemption; the runner keeps it in its
persistent batch. Afterwards each step carries only what changed: a `ScheduledRequest` with
the request's progress, its token grant and the blocks added since the last step (vLLM V1's
`NewRequestData` / `CachedRequestData` split). Sampled tokens never travel back: the runner
appends the tokens it sampled to its own copy of each request.
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np

from jaxllm.sampling_params import SamplingParams


class FloatArray(msgspec.Struct, array_like=True):
    """A float32 array (C-order) as raw bytes, so it crosses the sockets without pickle: an
    image's pixels as its model's image processor made them, or a prompt's image
    embeddings."""

    data: bytes
    shape: list[int]

    @classmethod
    def of(cls, array: np.ndarray) -> FloatArray:
        array = np.ascontiguousarray(array, np.float32)
        return cls(array.tobytes(), list(array.shape))

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, np.float32).reshape(self.shape)


class MultiModalItem(msgspec.Struct, array_like=True):
    """An image of a prompt: its values, the pixels (or, `embeds`, its embeddings: the
    encoder's rows themselves), their hash (which keys the encoder's cache and the prefix cache's blocks over
    its placeholders), and the placeholder tokens it fills."""

    hash: str  # hex SHA-256 of the values and their shape
    offset: int  # the prompt position of its first placeholder token
    length: int  # its placeholder tokens: the rows the encoder makes of it
    values: FloatArray  # the pixels, or with `embeds` the embeddings
    embeds: bool = False  # `values` are the rows [..., decoder width], not encoded

    @classmethod
    def of(
        cls, values: np.ndarray, offset: int, length: int, *, embeds: bool = False
    ) -> MultiModalItem:
        array = FloatArray.of(values)
        digest = hashlib.sha256(repr((array.shape, embeds)).encode())
        digest.update(array.data)
        return cls(digest.hexdigest(), offset, length, array, embeds)

    @property
    def grid(self) -> tuple[int, int, int] | None:
        """The image's tokens as a (frames, rows, columns) grid, for a model whose pixel
        arrays are laid out so ([t, h, w, patch data], Qwen2.5-VL); None for others."""
        shape = self.values.shape
        return (shape[0], shape[1], shape[2]) if len(shape) == 4 else None


class EncoderInput(msgspec.Struct, array_like=True):
    """An image the step encodes first, into its blocks of the encoder cache on the device."""

    blocks: list[int]
    values: FloatArray  # its pixels, or with `embeds` its embeddings
    embeds: bool = False  # the rows themselves: written, not encoded


class NewRequestData(msgspec.Struct):
    """A request entering the batch (new, or resumed after a preemption)."""

    request_id: str
    token_ids: list[int]  # the prompt, then the tokens generated so far (a resumed request)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int  # resolved: never None
    eos_token_ids: list[int]  # empty under ignore_eos
    block_ids: list[list[int]]  # per layer group, the whole block table, with this step's
    lora_slot: int = -1  # the device slot of its LoRA adapter; -1: none
    # Its images' token grids (first placeholder, frames, rows, columns), for M-RoPE positions
    # (Qwen2.5-VL); empty for other models.
    mm_grids: list[tuple[int, int, int, int]] = msgspec.field(default_factory=list)


class ScheduledRequest(msgspec.Struct):
    """One request's share of a step, in batch order."""

    request_id: str
    num_computed_tokens: int  # tokens already in the KV cache: the position of the first one
    num_scheduled_tokens: int  # tokens to compute now (a prompt chunk, or 1 to decode)
    new_block_ids: list[list[int]]  # per layer group, blocks appended since the last step
    # prompt_logprobs: per scheduled token, the next prompt token to score it against, or -1;
    # None when the chunk scores nothing.
    prompt_logprob_targets: list[int] | None = None
    # Speculative decoding: draft tokens, the last of num_scheduled_tokens (which counts them),
    # to verify after the request's last token; the step's output keeps the accepted ones.
    spec_token_ids: list[int] = msgspec.field(default_factory=list)
    pool: bool = False  # a pooling request's chunk: pooled, never sampled after
    # Images whose placeholders the chunk computes: (first placeholder position, placeholders,
    # the image's blocks of the encoder cache), read in place of those tokens' embeddings.
    mm_spans: list[tuple[int, int, list[int]]] = msgspec.field(default_factory=list)
    # A hybrid model's saved states (`jaxllm.engine.state_snapshots`): the snapshot slot whose
    # state the chunk starts from (a prefix-cache hit, or the request's own last save), and
    # the one its state after the chunk goes to instead of its row (the chunk ends at a page
    # boundary); -1: none.
    state_from: int = -1
    state_save: int = -1


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
    # The host KV tier's copies, run before the step's programs (`jaxllm.worker.kv_offload`):
    # evicted cached blocks to host slots, then host slots to fresh device blocks.
    kv_stores: list[tuple[int, int]] = []  # (device block, host slot)
    kv_loads: list[tuple[int, int]] = []  # (host slot, device block)
    # Images to encode before the step's programs, into the encoder cache (vision models).
    encoder_inputs: list[EncoderInput] = []
    # Speculative decoding: the most drafts a request verifies in this step (-1: no limit), as
    # the scheduler's `spec_policy` chose; 0: none, and the proposer drafts nothing after this
    # step (it only keeps its KV).
    max_drafts: int = -1

    @property
    def propose_drafts(self) -> bool:
        return self.max_drafts != 0

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


class PooledChunk(msgspec.Struct, array_like=True):
    """A pooling request's chunk computed this step: the sum of its tokens' final hidden
    states, its last token's, and how many tokens it had (float32 values)."""

    total: list[float]
    last: list[float]
    num_tokens: int


class RunnerOutput(msgspec.Struct):
    """What one step computed, by request id."""

    # Requests whose chunk reached the end of their sequence: the token sampled after it, or
    # with speculative decoding the accepted draft tokens and the token sampled after them.
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]]  # those of them that asked: one per token
    prompt_logprobs: dict[str, list[PromptTokenLogprobs]]  # prompt tokens scored this step
    # Speculative decoding: draft tokens proposed for each sampling request's next step.
    draft_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    pooled: dict[str, PooledChunk] = msgspec.field(default_factory=dict)  # pooling requests
