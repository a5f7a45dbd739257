"""The proposer of draft heads that read the target's hidden states: EAGLE-3
(`{"method": "eagle3", "model": HEAD, "num_speculative_tokens": k}`, a one-layer head,
`jaxllm.models.eagle3`, reading three of the target's states) and a checkpoint's own
multi-token-prediction layer (`{"method": "mtp", ...}`, `jaxllm.models.mtp`, reading its final
state). Both are a layer with its own KV cache that takes a token and a state per position and
gives a draft and a state to draft from again.

The target's forward pass returns the states (`DecoderForCausalLM.aux_hidden_state_layers`
for EAGLE-3; its final hidden states for MTP) beside its usual outputs, and right after the
target's step, without a host round trip, one program (`_head_step`) runs on the device:

1. the head over the step's batch, position p reading the target's states at p and the token
   at p + 1 (the next row's input; at a request's last kept row, the token the step sampled;
   at the end of a prefill chunk that does not sample, the next prompt token). The head's KV
   cache then holds every scheduled position, on the target's pages (the page ids, block
   table and slot mapping of the target's first layer group; the pool is sized for both):
   rejected drafts' positions are written again next step, as the target's are. Its output
   at the request's last kept row gives the first draft.
2. per request that sampled, k - 1 more drafts, one token per request each, in an unrolled
   loop: draft j's input is draft j - 1 and the head's own state before its final norm (the
   training-time test), written at the next position, in the `num_lookahead_tokens` slots the
   scheduler reserved past the grant (past them, dropped; the scheduler cuts those drafts).

Drafts are the head's greedy tokens mapped to the target's vocabulary (EAGLE-3's `d2t`); the
target's verification makes the output the target's own, greedy or random (see the package
docstring).

A step that does not speculate (`jaxllm.engine.spec_policy`) runs step 1 alone, for the head's
KV (`eagle3_fill`, `mtp_fill`: no drafts; XLA drops what the KV does not need), so that
speculation resumes over a whole cache.

Programs: one per compiled shape of the target's (two where speculation may pause), all
compiled at warmup.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm import sharding
from jaxllm.models import ModelCache
from jaxllm.worker.packing import Layout
from jaxllm.worker.programs import merge, unpack_batch
from jaxllm.worker.spec_decode import (
    CachedProposer,
    DraftInputs,
    last_kept,
    one_token_metadata,
)

if TYPE_CHECKING:
    from jaxllm.worker.compiler import Compiler
    from jaxllm.worker.step_inputs import StepInputs


class HeadProposer(CachedProposer):
    """The heads' proposer (see `CachedProposer`): `config` is the head's (`Eagle3Config`,
    `MTPConfig`); `shared` returns what the head may take of the target's current parameters
    (EAGLE-3: the embedding table; MTP: the embedding table and output head)."""

    def __init__(
        self,
        head: nnx.Module,
        config: Any,
        inputs: StepInputs,
        compiler: Compiler,
        shared: Callable[[], Any],
        *,
        window: int | None = None,
        fills: bool = False,
    ):
        self.config = config
        # Its layer reads the target's first layer group's block table: full attention where
        # the target has any (`kv_groups`); a model of sliding layers only frees the blocks
        # behind its window, and the head then attends within that window too.
        head.attend_within(window)
        super().__init__(
            config.method, head, config.layer, 1, inputs, compiler, _head_step,
            shared=shared, aux_width=config.aux_width, fills=fills,
        )  # fmt: skip


def _head_step(
    graphdef,
    params_def,
    mesh,
    k: int,
    page_size: int,
    dropped_slot: int,
    params,
    shared: Any,  # what the head takes of the target's parameters
    cache: ModelCache,
    last_tokens: jax.Array,
    batch: jax.Array,  # the target's forward pass's buffer (`BatchInputs` as `layout` says)
    aux: jax.Array,  # [T, aux_width]: the target's states the head reads
    sampled: jax.Array,  # i32[L]  the target's token per logit row
    kept: jax.Array,  # bool[L]  the rows the step kept
    inputs: DraftInputs,
    block_tables: jax.Array,  # i32[R, P]
    *,
    layout: Layout,
    propose: bool = True,
):
    """The head over the batch, then k - 1 more drafts per request from its own states:
    (i32[R, k], the head's cache); not `propose`: (None, the head's cache)."""
    b = unpack_batch(layout, batch)
    head = merge(graphdef, params_def, params)
    ids = jnp.where(b.token_src >= 0, last_tokens[jnp.maximum(b.token_src, 0)], b.input_ids)
    num_tokens = ids.shape[0]
    num_reqs = inputs.first_rows.shape[0]
    # Each request's last kept logit row and its token row.
    _, last = last_kept(kept, inputs.first_rows, inputs.num_rows)
    chunk_end = b.attn.cu_q_lens[1:] - 1
    last_row = jnp.where(inputs.active, b.logits_indices[last], chunk_end)
    nxt = jnp.where(inputs.active, sampled[last], inputs.next_tokens)
    # Position p reads the token at p + 1: the next row's, and at the last row the new token.
    shifted = jnp.concatenate([ids[1:], ids[:1]])
    shifted = shifted.at[jnp.where(inputs.valid, last_row, num_tokens)].set(nxt, mode="drop")

    def draft(normed):
        logits = head.draft_logits(normed, shared)
        if mesh is not None:
            logits = jax.lax.with_sharding_constraint(logits, sharding.replicated(mesh))
        return head.to_target(jnp.argmax(logits, axis=-1).astype(jnp.int32))

    # The head's one layer (its cache's slot 0) on the first layer group's pages.
    attn = dataclasses.replace(
        b.attn,
        slot_mapping=b.attn.slot_mapping[:1],
        block_tables=b.attn.block_tables[:1],
        layer_slots=None,
    )
    normed, prenorm, cache = head(shifted, b.positions, head.combine(aux), cache, attn, shared)
    if not propose:
        return None, cache
    if mesh is not None:
        normed = jax.lax.with_sharding_constraint(normed, sharding.replicated(mesh))
        prenorm = jax.lax.with_sharding_constraint(prenorm, sharding.replicated(mesh))
    tokens = draft(normed[last_row])
    hidden = prenorm[last_row]
    base = jnp.where(inputs.active, b.positions[last_row], 0)
    drafts = jnp.zeros((num_reqs, k), jnp.int32).at[:, 0].set(tokens)
    # Unrolled: a GPU runs a `while` by asking the host at each trip.
    for j in range(1, k):
        positions = base + j  # rows that did not sample write nothing
        writes = inputs.active & (positions < inputs.num_slots)
        at, meta = one_token_metadata(positions, writes, block_tables, page_size, dropped_slot)
        normed, hidden, cache = head(tokens, at, hidden, cache, meta, shared)
        if mesh is not None:
            normed = jax.lax.with_sharding_constraint(normed, sharding.replicated(mesh))
            hidden = jax.lax.with_sharding_constraint(hidden, sharding.replicated(mesh))
        tokens = draft(normed)
        drafts = drafts.at[:, j].set(tokens)
    return drafts, cache
