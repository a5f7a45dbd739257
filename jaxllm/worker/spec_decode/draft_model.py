"""The draft model of speculative decoding (`{"model": PATH, "num_speculative_tokens": k}`).

The draft model keeps its own paged KV cache, with the target's pages: the same page ids, block
tables and slot mapping (the pool's page count is sized for both, see `plan_kv_cache`), so it
needs no block management of its own. Each step it runs one program, `_draft_step`, on the
device right after the target's, without a host round trip in between:

1. the draft model over the step's batch, exactly the target's inputs: its cache then holds
   every scheduled token, as the target's does (rejected drafts included: the next step writes
   their positions again, as it does the target's). A prefix-cache hit is therefore a hit for
   both caches.
2. per request that sampled: from the last token the step kept (the target's verification
   output stays on the device), k greedy steps of the draft model, one token per request each,
   in one `fori_loop`. Step j writes its input's KV at position `n + j`, in the
   `num_lookahead_tokens` slots the scheduler reserved past the grant; positions past them (the
   request's end) are dropped, and the drafts from there are cut by the scheduler.

A step that does not speculate (`jaxllm.engine.spec_policy`) runs step 1 alone (`draft_fill`),
so that the draft's cache stays whole for when speculation resumes.

Programs: one per compiled shape of the target's (two where speculation may pause), all
compiled at warmup.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm import sharding
from jaxllm.config import ModelConfig
from jaxllm.models import ModelCache, StepExtras
from jaxllm.worker.packing import Layout
from jaxllm.worker.programs import forward, merge
from jaxllm.worker.sampler import argmax
from jaxllm.worker.spec_decode import (
    CachedProposer,
    DraftInputs,
    last_kept,
    one_token_metadata,
)

if TYPE_CHECKING:
    from jaxllm.worker.compiler import Compiler
    from jaxllm.worker.step_inputs import StepInputs


def check_draft_config(target: ModelConfig, draft: ModelConfig) -> None:
    """A draft model must share the target's vocabulary: its ids are the target's ids."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({draft.vocab_size} ids) differs "
            f"from the target's ({target.vocab_size}); a draft model must share it"
        )


class DraftModelProposer(CachedProposer):
    """The draft model's proposer (see `CachedProposer`): its cache has all its layers."""

    def __init__(
        self,
        model: nnx.Module,
        config: ModelConfig,
        inputs: StepInputs,
        compiler: Compiler,
        *,
        fills: bool = False,
    ):
        self.config = config
        super().__init__(
            "draft", model, config, config.num_layers, inputs, compiler, _draft_step, fills=fills
        )


def _draft_step(
    graphdef,
    params_def,
    mesh,
    k: int,
    page_size: int,
    dropped_slot: int,
    params,
    shared: None,  # (it takes nothing of the target's)
    cache: ModelCache,
    last_tokens: jax.Array,
    batch: jax.Array,  # the target's forward pass's buffer (`BatchInputs` as `layout` says)
    aux: None,  # (nor its states)
    sampled: jax.Array,  # i32[L]  the target's token per logit row
    kept: jax.Array,  # bool[L]  the rows the step kept
    inputs: DraftInputs,
    block_tables: jax.Array,  # i32[R, P]
    *,
    layout: Layout,
    propose: bool = True,
):
    """The draft model over the batch, then k greedy draft tokens per request from the last
    token the step kept: (i32[R, k], the draft's cache); not `propose`: (None, the cache)."""
    _, _, cache, _ = forward(
        graphdef, params_def, mesh, params, cache, last_tokens, batch, StepExtras(), layout=layout
    )
    if not propose:
        return None, cache
    model = merge(graphdef, params_def, params)
    num_reqs = inputs.first_rows.shape[0]
    num_kept, last = last_kept(kept, inputs.first_rows, inputs.num_rows)
    tokens = jnp.where(inputs.active, sampled[last], 0)
    # The last kept token sits after the step's accepted tokens; rows that did not sample run
    # at position 0 and write nothing.
    positions = jnp.where(inputs.active, inputs.positions + num_kept - 1, 0)

    def step(j, carry):
        tokens, positions, cache, drafts = carry
        writes = inputs.active & (positions < inputs.num_slots)
        at, meta = one_token_metadata(positions, writes, block_tables, page_size, dropped_slot)
        hidden, cache = model(tokens, at, cache, meta)
        logits = model.compute_logits(hidden)
        if mesh is not None:
            logits = jax.lax.with_sharding_constraint(logits, sharding.replicated(mesh))
        nxt = argmax(logits).astype(jnp.int32)
        return nxt, positions + 1, cache, drafts.at[:, j].set(nxt)

    drafts = jnp.zeros((num_reqs, k), jnp.int32)
    # Unrolled: a GPU runs a `while` by asking the host at each trip.
    carry = (tokens, positions, cache, drafts)
    _, _, cache, drafts = jax.lax.fori_loop(0, k, step, carry, unroll=True)
    return drafts, cache
