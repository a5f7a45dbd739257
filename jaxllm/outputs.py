"""What `LLM.generate` and `LLM.embed` return, shaped like vLLM's outputs."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int  # 1 is the most likely token
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per generated token: its own and top logprobs
    finish_reason: str | None = None  # "stop" or "length"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # With SamplingParams.prompt_logprobs: per prompt token, its logprob and the top ones
    # (None for the first token, which has no context).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # A prefiller's finished request (prefill/decode disaggregation): the params its decoder
    # is sent with (vLLM's).
    kv_transfer_params: dict | None = None


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (`LLM.embed`), as vLLM's `EmbeddingRequestOutput`."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None


@dataclasses.dataclass
class ClassificationOutput:
    probs: list[float]  # one per label (a sigmoid for one label, a softmax for more)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ClassificationRequestOutput:
    """One prompt's class probabilities (`LLM.classify`), as vLLM's."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """One pair's score (`LLM.score`), as vLLM's: a cross-encoder's relevance, or the cosine
    similarity of an embedding model's two vectors."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # a cross-encoder's pair; the second text's for embeddings
    finished: bool = True


@dataclasses.dataclass
class PoolingOutput:
    data: list[float]  # the model's pooled output as it comes


@dataclasses.dataclass
class PoolingRequestOutput:
    """One prompt's pooled output (`LLM.encode`), as vLLM's."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
