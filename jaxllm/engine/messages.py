"""What the front end and the engine core process say to each other, as msgpack (msgspec).

Front end -> core: `AddRequest` (`AddPooling` for a pooling model), `Abort`, `Sleep` and
`WakeUp` (sleep mode), `Shutdown`.
Core -> front end: `Ready` once warmup is done (or `Failed` if the engine could not start),
then one `StepOutputs` per engine step. No pickle crosses the socket: every message is a typed
struct.
"""

from __future__ import annotations

import msgspec

from jaxllm.engine.core_outputs import RequestUpdate, Stats, StepEvents
from jaxllm.lora import LoRARequest
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker import MultiModalItem


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against max_model_len by the front end
    seed: int  # resolved: a request without a seed gets one from the front end
    eos_token_ids: list[int]  # resolved by the front end (model, generation config, tokenizer)
    priority: int = 0
    prefix_parent: str | None = None  # see Request.prefix_parent
    lora_request: LoRARequest | None = None  # its LoRA adapter
    mm_items: list[MultiModalItem] = []  # its images (an image-text model)
    cache_salt: str | None = None  # see Request.cache_salt
    kv_transfer_params: dict | None = None  # prefill/decode disaggregation (`kv_transfer`)


class AddPooling(msgspec.Struct, tag="pool"):
    """A pooling request (an embedding, a classification): its checked, truncated token ids,
    and for a text pair its segment ids (an encoder's token types)."""

    request_id: str
    prompt_token_ids: list[int]
    pooling_params: PoolingParams
    token_type_ids: list[int] | None = None


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Sleep(msgspec.Struct, tag="sleep"):
    """Sleep mode: free the weights' and the KV cache's device memory (see
    `EngineCore.sleep`); the next `StepOutputs`' stats say the level reached."""

    level: int = 1


class WakeUp(msgspec.Struct, tag="wake_up"):
    pass


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Ready(msgspec.Struct, tag="ready"):
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]  # the model config's; the front end adds its tokenizer's
    num_pages: int  # 0 for a pooling model: it keeps no KV cache
    page_size: int
    num_programs: int
    stats: Stats
    # A pooling model: it takes `AddPooling` requests only; its embeddings have
    # `hidden_size` values, a classifier's outputs one per label of `labels`.
    pooling: bool = False
    hidden_size: int = 0
    labels: list[str] = msgspec.field(default_factory=list)
    supported_tasks: list[str] = msgspec.field(default_factory=lambda: ["generate"])
    # An image-text model: the most images a prompt may carry (0: it takes none; the front
    # end reads the rest of the vision side from the checkpoint).
    image_limit: int = 0


class Failed(msgspec.Struct, tag="failed"):
    message: str


class StepOutputs(msgspec.Struct, tag="outputs"):
    updates: list[RequestUpdate]  # FinishReason.ERROR: the step failed the request
    stats: Stats
    step: StepEvents = msgspec.field(default_factory=StepEvents)
    engine: int = 0  # the core's data-parallel rank


Input = AddRequest | AddPooling | Abort | Sleep | WakeUp | Shutdown
Output = Ready | Failed | StepOutputs

encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(Input)
output_decoder = msgspec.msgpack.Decoder(Output)
