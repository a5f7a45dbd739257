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
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm import sharding
from jaxllm.models import ModelCache
from jaxllm.worker.features import Feature, Warmup
from jaxllm.worker.packing import Layout
from jaxllm.worker.programs import merge, unpack_batch
from jaxllm.worker.spec_decode import last_kept, one_token_metadata
from pallas_kernels import get_kv_cache_shape

if TYPE_CHECKING:
    from jaxllm.worker.compiler import Compiler
    from jaxllm.worker.step_inputs import PreparedStep, StepInputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadInputs:
    """Per request row of the step (padded to its request bucket)."""

    first_rows: jax.Array  # i32[R]  its first logit row
    num_rows: jax.Array  # i32[R]  its logit rows (1 + its drafts)
    num_slots: jax.Array  # i32[R]  slots its block table holds (past them: dropped)
    active: jax.Array  # bool[R]  it sampled this step (padding and prefill chunks do not)
    valid: jax.Array  # bool[R]  a real request (not padding)
    next_tokens: jax.Array  # i32[R]  a chunk that does not sample: the prompt token after it


class HeadProposer(Feature):
    """The head's proposer (see `jaxllm.worker.spec_decode.Proposer`), beside the runner: it
    reads the runner's step inputs and the target's states, compiles with its compiler, and
    its cache lives on the runner's devices. `config`: the head's (`Eagle3Config`,
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
        """`fills`: compile the KV-only programs too (speculation may pause)."""
        self.config = config
        self.fills = fills
        self.inputs = inputs
        self.compiler = compiler
        self.shared = shared
        self.device = device = compiler.device
        self.k = inputs.num_speculative_tokens
        # Its layer reads the target's first layer group's block table: full attention where
        # the target has any (`kv_groups`); a model of sliding layers only frees the blocks
        # behind its window, and the head then attends within that window too.
        head.attend_within(window)
        self.graphdef, state = nnx.split(head)
        self._params, self._params_def = jax.tree.flatten(state)
        layer = config.layer
        shape = get_kv_cache_shape(
            1, inputs.num_pages, inputs.page_size, layer.cache_kv_heads, layer.cache_head_dim,
            device.platform, latent=layer.latent_attention is not None,
        )  # fmt: skip
        self.cache = device.zeros_model_cache(shape, device.kv_cache.dtype)
        self._step = jax.jit(
            functools.partial(
                _head_step,
                self.graphdef,
                self._params_def,
                device.mesh,
                self.k,
                inputs.page_size,
                inputs.num_pages * inputs.page_size,
            ),
            donate_argnums=(2,),
            static_argnames=("layout", "propose"),
        )

    @property
    def num_programs(self) -> int:
        return len(self.inputs.shapes) * (2 if self.fills else 1)

    def warmup_jobs(self, warm: Warmup) -> list:
        """One compile job per program: one per compiled shape of the target's (and its
        KV-only twin where speculation may pause)."""
        device = self.device

        def compile_step(shape, propose):
            template = self.inputs.batch_template(*shape)
            n = len(template.new()[1].logits_indices)
            sampled = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=device.replicated)
            kept = jax.ShapeDtypeStruct((n,), jnp.bool_, sharding=device.replicated)
            rows = warm.rows(shape[0])
            aux = jax.ShapeDtypeStruct(
                (shape[0], self.config.aux_width), rows.dtype, sharding=device.replicated
            )
            inputs, tables = self._padding_inputs(shape[1])
            batch = template.layout.abstract(device.replicated)
            self.compiler.compile(
                f"{self.config.method}_{'step' if propose else 'fill'}", shape, self._step, self._params,
                self.shared(), self.cache, device.last_tokens, batch, aux, sampled, kept,
                inputs, tables, updates_cache=True, cache=self.cache,
                static={"layout": template.layout, "propose": propose},
            )  # fmt: skip

        kinds = (True, False) if self.fills else (True,)
        return [
            functools.partial(compile_step, shape, propose)
            for shape in self.inputs.shapes
            for propose in kinds
        ]

    def _padding_inputs(self, r: int) -> tuple[HeadInputs, np.ndarray]:
        inputs = HeadInputs(
            first_rows=np.zeros(r, np.int32),
            num_rows=np.ones(r, np.int32),
            num_slots=np.zeros(r, np.int32),
            active=np.zeros(r, np.bool_),
            valid=np.zeros(r, np.bool_),
            next_tokens=np.zeros(r, np.int32),
        )
        return inputs, np.zeros((r, self.inputs.pages_per_seq), np.int32)

    def launch(
        self,
        step: PreparedStep,
        batch: jax.Array,
        last_tokens: jax.Array,
        rows: np.ndarray,
        sampled: jax.Array,
        kept: jax.Array,
        aux: jax.Array | None = None,
        propose: bool = True,
    ) -> jax.Array | None:
        """Dispatches the head's step: its cache gets the batch's positions, and every request
        that sampled gets k drafts, i32[R, k] on the device (junk in the other rows); with
        `propose` False (and `fills`) the cache only, None. `batch`: the forward pass's buffer
        on the device, `last_tokens` what its placeholders read, `aux` its target states;
        `sampled`, `kept`: the verification's output."""
        ib = self.input_batch
        r_pad = len(step.batch.attn.seq_lens)
        num_reqs = len(rows)
        inputs, tables = self._padding_inputs(r_pad)
        inputs.first_rows[:num_reqs] = step.first_row[:-1]
        inputs.num_rows[:num_reqs] = 1 + step.num_drafts
        inputs.num_slots[:num_reqs] = ib.num_blocks[rows] * self.inputs.page_size
        inputs.active[:num_reqs] = step.samples
        inputs.valid[:num_reqs] = True
        # A chunk that ends inside the prompt: the prompt's next token (past the sequence's
        # tokens the batch holds an id past the vocabulary: taken as 0, never read).
        ends = np.minimum(step.batch.attn.seq_lens[:num_reqs], ib.token_ids.shape[1] - 1)
        nxt = ib.token_ids[rows, ends]
        inputs.next_tokens[:num_reqs] = np.where((nxt >= 0) & (nxt < ib.vocab_size), nxt, 0)
        tables[:num_reqs] = ib.block_table[0, rows]  # the first layer group's (see above)
        drafts, self.cache = self._step(
            self._params,
            self.shared(),
            self.cache,
            last_tokens,
            batch,
            aux,
            sampled,
            kept,
            inputs,
            tables,
            layout=step.layouts[0],
            propose=propose or not self.fills,
        )
        return drafts if propose else None

    @property
    def input_batch(self):
        return self.inputs.input_batch

    def propose(
        self, launched: jax.Array, held: list[tuple[str, int, int]]
    ) -> dict[str, list[int]]:
        drafts = np.asarray(launched)
        return {rid: drafts[i].tolist() for rid, i, _ in held}


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
    inputs: HeadInputs,
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
