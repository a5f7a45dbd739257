"""Speculative decoding: a proposer drafts k tokens per request, and the next step verifies
them (`verification`, on the device inside the head-and-sampler program).

A request that decodes with drafts d_1..d_k is granted 1 + k tokens: its last token and the
drafts, computed in one forward pass, whose logits give the target's distributions p_0..p_k
(p_j: the next token after d_j). The sampler draws a token y_j from every p_j with exactly the
randomness it would use for that token without speculation (the request's seed and the token's
index), and the step accepts the longest prefix of drafts with d_{j+1} == y_j; the request's new
tokens are the accepted drafts and one more, y_a at the first mismatch (or y_k, the bonus
token). So the output is token for token the output without speculation, greedy or random.

This is rejection sampling (Leviathan et al., Chen et al.) for a proposer that puts all its
probability on its draft (vLLM treats n-gram and its greedy draft models that way): it accepts
d with probability p(d), and after a rejection the token is distributed as p without d,
renormalised, which is the residual max(p - q, 0) for q one-hot on d. Drawing y ~ p and
comparing couples the two events with one draw.

The KV of rejected drafts is written and then overwritten: the scheduler rolls
`num_computed_tokens` back to the accepted tokens, so the next step writes those positions again.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.models import AttentionMetadata
from jaxllm.worker.features import Feature, Warmup
from pallas_kernels import get_kv_cache_shape

if TYPE_CHECKING:
    from jaxllm.worker.compiler import Compiler
    from jaxllm.worker.step_inputs import PreparedStep, StepInputs

# The proposers live in `ngram`, `draft_model` and `heads` (EAGLE-3, MTP), the verification in
# `verification`; this package's own module holds only what they share (the protocol, the
# base of those with a model and cache of their own, device helpers), so importing one
# imports no other.


class Proposer(Protocol):
    """How the runner asks for drafts. `launch` runs when a step is dispatched, with its
    inputs (the prepared step, its forward pass's buffer on the device and the earlier
    sampled tokens its placeholders read, as the forward pass read them), its sampled
    tokens and (for a head) the target's states it reads, still on the device (a
    draft model dispatches its own program there); `propose` runs when the step's output is
    back, for the requests that sampled and still hold their batch rows: `held` is (request
    id, index in the step's requests, batch row) each, and the result the drafts for each
    request's next step. A step that does not speculate (`SchedulerOutput.propose_drafts`,
    see `jaxllm.engine.spec_policy`) launches with `propose` False: a proposer with a cache
    then only writes the step's KV into it (its `fill` program, compiled where `fills`), and
    `propose` is not called. A proposer is also one of the runner's features
    (`jaxllm.worker.features.Feature`), for its programs."""

    def launch(
        self,
        step: Any,
        batch: Any,
        last_tokens: Any,
        rows: np.ndarray,
        sampled: Any,
        kept: Any,
        aux: Any = None,
        propose: bool = True,
    ) -> Any: ...

    def propose(self, launched: Any, held: list[tuple[str, int, int]]) -> dict[str, list[int]]: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftInputs:
    """Per request row of the step (padded to its request bucket), as a proposer's program
    reads them."""

    first_rows: jax.Array  # i32[R]  its first logit row
    num_rows: jax.Array  # i32[R]  its logit rows (1 + its drafts)
    positions: jax.Array  # i32[R]  its token count before the step: its first new token's position
    num_slots: jax.Array  # i32[R]  slots its block table holds (past them: dropped)
    active: jax.Array  # bool[R]  it sampled this step (padding and prefill chunks do not)
    valid: jax.Array  # bool[R]  a real request (not padding)
    next_tokens: jax.Array  # i32[R]  a chunk that does not sample: the prompt token after it


class CachedProposer(Feature):
    """A proposer that runs a model of its own (the draft model, an EAGLE-3 head, an MTP
    layer) with a paged KV cache of `num_layers` layers on the target's pages (the same page
    ids and the first layer group's block tables; the pool is sized for both): one program
    right after each target step, without a host round trip, per compiled shape of the
    target's, named `{kind}_step` (and its KV-only twin `{kind}_fill` where speculation may
    pause, `fills`), all compiled at warmup. It reads the runner's step inputs, compiles with
    its compiler, and its cache lives on the runner's devices.

    `step_fn(graphdef, params_def, mesh, k, page_size, dropped_slot, params, shared, cache,
    last_tokens, batch, aux, sampled, kept, inputs, block_tables, *, layout, propose)` is the
    program: (drafts i32[R, k] or None without `propose`, the cache). `shared` returns what it
    takes of the target's current parameters (or None), `aux_width` the width of the target's
    states it reads per token (None: none)."""

    def __init__(
        self,
        kind: str,
        module: nnx.Module,
        cache_config: ModelConfig,
        num_layers: int,
        inputs: StepInputs,
        compiler: Compiler,
        step_fn: Callable,
        *,
        shared: Callable[[], Any] = lambda: None,
        aux_width: int | None = None,
        fills: bool = False,
    ):
        self.kind = kind
        self.fills = fills
        self.inputs = inputs
        self.compiler = compiler
        self.shared = shared
        self.aux_width = aux_width
        self.device = device = compiler.device
        self.k = inputs.num_speculative_tokens
        self.graphdef, state = nnx.split(module)
        self._params, self._params_def = jax.tree.flatten(state)
        c = cache_config
        shape = get_kv_cache_shape(
            num_layers, inputs.num_pages, inputs.page_size, c.cache_kv_heads, c.cache_head_dim,
            device.platform, latent=c.latent_attention is not None,
        )  # fmt: skip
        self.cache = device.zeros_model_cache(shape, device.kv_cache.dtype)
        dropped_slot = inputs.num_pages * inputs.page_size
        self._step = jax.jit(
            functools.partial(
                step_fn,
                self.graphdef,
                self._params_def,
                device.mesh,
                self.k,
                inputs.page_size,
                dropped_slot,
            ),  # fmt: skip
            donate_argnums=(2,),
            static_argnames=("layout", "propose"),
        )

    @property
    def num_programs(self) -> int:
        return len(self.inputs.shapes) * (2 if self.fills else 1)

    def warmup_jobs(self, warm: Warmup) -> list:
        """One compile job per program."""
        kinds = (True, False) if self.fills else (True,)
        return [
            functools.partial(self._compile, warm, shape, propose)
            for shape in self.inputs.shapes
            for propose in kinds
        ]

    def _compile(self, warm: Warmup, shape: tuple[int, int], propose: bool) -> None:
        device = self.device
        template = self.inputs.batch_template(*shape)
        n = len(template.new()[1].logits_indices)
        sampled = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=device.replicated)
        kept = jax.ShapeDtypeStruct((n,), jnp.bool_, sharding=device.replicated)
        aux = None
        if self.aux_width is not None:
            dtype = warm.rows(shape[0]).dtype
            aux = jax.ShapeDtypeStruct(
                (shape[0], self.aux_width), dtype, sharding=device.replicated
            )
        inputs, tables = self._padding_inputs(shape[1])
        batch = template.layout.abstract(device.replicated)
        self.compiler.compile(
            f"{self.kind}_{'step' if propose else 'fill'}", shape, self._step, self._params,
            self.shared(), self.cache, device.last_tokens, batch, aux, sampled, kept, inputs,
            tables, updates_cache=True, cache=self.cache,
            static={"layout": template.layout, "propose": propose},
        )  # fmt: skip

    def _padding_inputs(self, r: int) -> tuple[DraftInputs, np.ndarray]:
        inputs = DraftInputs(
            first_rows=np.zeros(r, np.int32),
            num_rows=np.ones(r, np.int32),
            positions=np.zeros(r, np.int32),
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
        """Dispatches the program: its cache gets the batch's positions, and every request
        that sampled gets k drafts, i32[R, k] on the device (junk in the other rows); with
        `propose` False (and `fills`) the cache only, None. `batch`: the forward pass's buffer
        on the device, `last_tokens` what its placeholders read, `aux` the target's states;
        `sampled`, `kept`: the verification's output."""
        ib = self.inputs.input_batch
        num_reqs = len(rows)
        inputs, tables = self._padding_inputs(len(step.batch.attn.seq_lens))
        inputs.first_rows[:num_reqs] = step.first_row[:-1]
        inputs.num_rows[:num_reqs] = 1 + step.num_drafts
        inputs.positions[:num_reqs] = ib.num_tokens[rows]
        inputs.num_slots[:num_reqs] = ib.num_blocks[rows] * self.inputs.page_size
        inputs.active[:num_reqs] = step.samples
        inputs.valid[:num_reqs] = True
        # A chunk that ends inside the prompt: the prompt's next token (past the sequence's
        # tokens the batch holds an id past the vocabulary: taken as 0, never read).
        ends = np.minimum(step.batch.attn.seq_lens[:num_reqs], ib.token_ids.shape[1] - 1)
        nxt = ib.token_ids[rows, ends]
        inputs.next_tokens[:num_reqs] = np.where((nxt >= 0) & (nxt < ib.vocab_size), nxt, 0)
        tables[:num_reqs] = ib.block_table[0, rows]  # the first layer group's
        aux = None if self.aux_width is None else aux  # (as compiled)
        drafts, self.cache = self._step(
            self._params, self.shared(), self.cache, last_tokens, batch, aux, sampled, kept,
            inputs, tables, layout=step.layouts[0], propose=propose or not self.fills,
        )  # fmt: skip
        return drafts if propose else None

    def propose(
        self, launched: jax.Array, held: list[tuple[str, int, int]]
    ) -> dict[str, list[int]]:
        drafts = np.asarray(launched)
        return {rid: drafts[i].tolist() for rid, i, _ in held}


# ---- on the device, inside a proposer's program ------------------------------------------------


def last_kept(kept: jax.Array, first_rows: jax.Array, num_rows: jax.Array) -> tuple:
    """Per request (its first logit row, its rows): (the rows the verification kept, its last
    kept logit row), from the step's bool[L] `kept`."""
    counts = jnp.cumsum(kept.astype(jnp.int32))
    before = counts[first_rows] - kept[first_rows].astype(jnp.int32)
    num_kept = counts[first_rows + num_rows - 1] - before
    return num_kept, jnp.maximum(first_rows + num_kept - 1, 0)


def one_token_metadata(
    positions: jax.Array,  # i32[R]: each request's drafting position
    writes: jax.Array,  # bool[R]: the rows that write their KV (that sampled, within slots)
    block_tables: jax.Array,  # i32[R, P]
    page_size: int,
    dropped_slot: int,
) -> tuple[jax.Array, AttentionMetadata]:
    """(the positions as read, the attention metadata) of a drafting step of one token per
    request. Past the block table's reach (drafts past max_model_len, cut by the scheduler) a
    row reads as if at its last position, writing nothing."""
    num_reqs = positions.shape[0]
    at = jnp.minimum(positions, block_tables.shape[1] * page_size - 1)
    page = block_tables[
        jnp.arange(num_reqs), jnp.minimum(at // page_size, block_tables.shape[1] - 1)
    ]
    slots = jnp.where(writes, page * page_size + at % page_size, dropped_slot)
    meta = AttentionMetadata(
        slot_mapping=slots[None],
        seq_lens=at + 1,
        block_tables=block_tables[None],
        cu_q_lens=jnp.arange(num_reqs + 1, dtype=jnp.int32),
        num_seqs=jnp.full((1,), num_reqs, jnp.int32),
    )
    return at, meta
