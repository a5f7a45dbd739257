"""What a step's forward pass carries into the model besides its tokens and positions: the
model's cache (`ModelCache`, donated and returned updated as one value) and the optional
inputs of the features the engine serves (`StepExtras`).

Both are pytrees whose fields are None where unused, so a step program's signature does not
change with them: a new kind of cache state (a linear-attention layer's recurrent state per
request, beside the paged KV cache) is a field of `ModelCache`, its bytes an entry of the
engine plan's memory (`jaxllm.worker.plan`); a new step input is a field of `StepExtras`,
filled by the step builder and read where the model uses it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxllm.models.linear_attention import LinearState, StateSlots
from jaxllm.models.lora import LayerLoRA, layer_loras
from pallas_kernels import KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCache:
    """The state a model keeps on the devices between steps. Step programs take it donated
    and return it updated in place: warmup checks that each step program's output aliases
    all of its bytes, and that no instruction copies the KV cache's arrays (see
    `jaxllm.worker.compiler`; copies of the recurrent state are searched for and reported by
    `jaxllm compile`).

    `kv`: the paged KV cache of every attention layer slot, [slots, num_pages, K, page_size,
    2H] (a `KVCache`: an 8-bit cache with its scales; a plain float array is taken as one)."""

    kv: KVCache | jax.Array
    linear: LinearState | None = None
    """A hybrid model's linear layers' recurrent state per request slot
    (`jaxllm.models.linear_attention`); None for a model without such layers."""

    def arrays(self) -> list:
        """Every array of the cache (what a failed step may have deleted, what sleep frees)."""
        return jax.tree.leaves(self)

    @property
    def nbytes(self) -> int:
        """Logical bytes of the whole cache (every device's shards)."""
        return sum(a.size * a.dtype.itemsize for a in self.arrays())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepExtras:
    """A step's optional inputs, each None unless the engine serves its feature. The per-step
    ones (`lora_slots`, `mm_rows`) come packed with the step's inputs; the resident ones
    (`lora`, `mm_pool`) are arrays the runner keeps on the devices (`merged` joins the two)."""

    lora: Any = None
    """The adapter slots' weights by target (`jaxllm.worker.lora_slots`), with LoRA served."""
    lora_slots: jax.Array | None = None
    """i32[T]: each token's LoRA slot (-1: none)."""
    mm_pool: jax.Array | None = None
    """The encoder cache's rows [N, D] (an image-text model, `jaxllm.worker.mm_encoder`)."""
    mm_rows: jax.Array | None = None
    """i32[T]: each image placeholder's row of `mm_pool` (-1: a text token)."""
    state_slots: StateSlots | None = None
    """Each request's slots of the model cache's `linear` state (a hybrid model): where its
    state is read and where it is written (its row, or a saved-state slot)."""

    def merged(self, other: StepExtras) -> StepExtras:
        """These extras with `other`'s fields that are set."""
        set_ = {
            f.name: v
            for f in dataclasses.fields(other)
            if (v := getattr(other, f.name)) is not None
        }
        return dataclasses.replace(self, **set_)

    def layer_loras(self) -> list[LayerLoRA] | None:
        """Per layer, each token's adapter (None without LoRA)."""
        return None if self.lora is None else layer_loras(self.lora, self.lora_slots)

    def image_embeds(self) -> tuple[jax.Array, jax.Array] | None:
        """(the encoder cache's rows, each token's row) for an image-text model."""
        return None if self.mm_pool is None else (self.mm_pool, self.mm_rows)
