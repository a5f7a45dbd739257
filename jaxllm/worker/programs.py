"""The programs a step runs, as pure functions of the model's flat parameter list (the runner
jits them with the model's graph bound): the layers (`forward`), the output head with the
sampler (`head_and_sample`), the prompt scorer (`score_prompt`, prompt_logprobs), and the
pooler of a decoder served for pooling (`pool_hidden`).

Two programs per step: the forward pass per (token, request) shape, and the output head with
the sampler per logit bucket only (the sampler compiles about as long as the 30 layers of the
demo model; compiled into every shape it doubled startup), in each of the sampler's variants
for the platform (`SamplerVariant.for_platform`: one off GPUs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm import sharding
from jaxllm.models import AttentionMetadata, ModelCache, StepExtras
from jaxllm.worker.packing import Layout
from jaxllm.worker.sampler import SamplerVariant, SamplingInputs, sample, token_logprobs
from jaxllm.worker.spec_decode.verification import kept_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BatchInputs:
    input_ids: jax.Array  # i32[T]  flattened tokens of all scheduled requests (drafts included)
    # i32[T]  -1, or the batch row whose token sampled by the previous step (still on the
    # device, see `DeviceState.last_tokens`) is this input: async scheduling's decode inputs
    token_src: jax.Array
    positions: jax.Array  # i32[T]; M-RoPE (Qwen2.5-VL): i32[3, T]
    # i32[L]  the tokens to sample after: each request's last token (with speculative decoding,
    # also its draft tokens: L = `logit_rows`)
    logits_indices: jax.Array
    attn: AttentionMetadata
    # The served features' per-step inputs (each token's LoRA slot, image rows, ...): the
    # fields of `StepExtras` that come with the step, None where not served
    extras: StepExtras = StepExtras()


def unpack_batch(layout: Layout, packed: jax.Array) -> BatchInputs:
    """The forward pass's inputs from the step's buffer (see `jaxllm.worker.packing`)."""
    return layout.unpack(packed)


def merge(graphdef, params_def, params: list[jax.Array]) -> nnx.Module:
    """The model from its graph and its flat list of parameters (see `ModelRunner`)."""
    return nnx.merge(graphdef, jax.tree.unflatten(params_def, params))


def forward(
    graphdef,
    params_def,
    mesh,
    params,
    cache: ModelCache,
    last_tokens,
    batch: BatchInputs | jax.Array,
    resident: StepExtras,
    *,
    layout: Layout | None = None,
):
    """The layers: (hidden states of the rows to sample from [R, D], all hidden states [T, D],
    the updated cache, the states an EAGLE-3 head reads [T, 3D] or None). `batch`: the step's
    inputs, or with `layout` (static) the buffer that holds them. `resident`: the served
    features' arrays kept on the devices (adapter slots, the encoder cache's rows; see
    `StepExtras`), joined to the step's own extras."""
    if layout is not None:
        batch = unpack_batch(layout, batch)
    model = merge(graphdef, params_def, params)
    src = batch.token_src
    input_ids = jnp.where(src >= 0, last_tokens[jnp.maximum(src, 0)], batch.input_ids)
    extras = batch.extras.merged(resident)
    hidden, cache, *aux = model(input_ids, batch.positions, cache, batch.attn, extras)
    aux = aux[0] if aux else None
    if mesh is not None:
        hidden = jax.lax.with_sharding_constraint(hidden, sharding.replicated(mesh))
        if aux is not None:
            aux = jax.lax.with_sharding_constraint(aux, sharding.replicated(mesh))
    return hidden[batch.logits_indices], hidden, cache, aux


def head_and_sample(
    graphdef,
    params_def,
    mesh,
    variant: SamplerVariant,
    params,
    last: jax.Array,  # [L, D]
    packed: jax.Array,  # i32[layout.size]: the sampler's host inputs and the verification's
    idle: dict,  # the sampler's other inputs
    last_tokens: jax.Array,  # i32[max_num_seqs]
    *,
    layout: Layout,
):
    """((the sampler's output, bool[L]: the rows whose tokens the step keeps), `last_tokens`
    with each decode's token at its batch row), with the sampler's parts `variant` holds.
    `packed` holds (the `SamplingInputs` fields sent every step, `VerifyInputs`) as `layout`
    (static) lays them out (see `jaxllm.worker.packing`).

    A row is kept when every earlier row of its request sampled the draft it verifies (see
    `jaxllm.worker.spec_decode`): the accepted drafts' rows and the one after them."""
    host, verify = layout.unpack(packed)
    sampling = SamplingInputs(**host, **idle)
    model = merge(graphdef, params_def, params)
    logits = model.compute_logits(last)
    if mesh is not None:  # split on the vocabulary by the head: gather it for the sampler
        logits = jax.lax.with_sharding_constraint(logits, sharding.replicated(mesh))
    result = sample(logits, sampling, variant)
    kept = kept_rows(result.sampled, verify)
    last_tokens = last_tokens.at[verify.sample_rows].set(result.sampled, mode="drop")
    return (result, kept), last_tokens


def score_prompt(graphdef, params_def, params, hidden: jax.Array, targets: jax.Array):
    """prompt_logprobs: for each token row, the logprob and rank of `targets` (the next prompt
    token; -1 rows are ignored) and the top MAX_LOGPROBS, from the raw logits."""
    model = merge(graphdef, params_def, params)
    return token_logprobs(model.compute_logits(hidden), jnp.maximum(targets, 0))


def pool_hidden(hidden: jax.Array, segments: jax.Array, last_rows: jax.Array):
    """A decoder's pooling: per batch request (`last_rows` has one entry each), the float32
    sum of the hidden states of its tokens (`segments[t]`: the request of token t; out of
    range for tokens not pooled) and its last token's hidden state."""
    h = hidden.astype(jnp.float32)
    n = last_rows.shape[0]
    totals = jax.ops.segment_sum(h, segments, num_segments=n + 1)[:n]
    return totals, h[last_rows]
