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

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm import sharding
from jaxllm.config import ModelConfig
from jaxllm.models import ModelCache, StepExtras
from jaxllm.worker.features import Feature, Warmup
from jaxllm.worker.packing import Layout
from jaxllm.worker.programs import forward, merge
from jaxllm.worker.sampler import argmax
from jaxllm.worker.spec_decode import last_kept, one_token_metadata
from pallas_kernels import get_kv_cache_shape

if TYPE_CHECKING:
    from jaxllm.worker.compiler import Compiler
    from jaxllm.worker.step_inputs import PreparedStep, StepInputs


def check_draft_config(target: ModelConfig, draft: ModelConfig) -> None:
    """A draft model must share the target's vocabulary: its ids are the target's ids."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({draft.vocab_size} ids) differs "
            f"from the target's ({target.vocab_size}); a draft model must share it"
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProposeInputs:
    """Per request row of the step (padded to its request bucket)."""

    first_rows: jax.Array  # i32[R]  its first logit row
    num_rows: jax.Array  # i32[R]  its logit rows (1 + its drafts)
    positions: jax.Array  # i32[R]  its token count before the step: its first new token's position
    num_slots: jax.Array  # i32[R]  slots its block table holds (past them: dropped)
    active: jax.Array  # bool[R]  it sampled this step (padding and prefill chunks do not)


class DraftModelProposer(Feature):
    """The draft model's proposer (see `jaxllm.worker.spec_decode.Proposer`), beside the
    runner: it reads the runner's step inputs and compiles with its compiler, and its cache
    lives on the runner's devices."""

    def __init__(
        self,
        model: nnx.Module,
        config: ModelConfig,
        inputs: StepInputs,
        compiler: Compiler,
        *,
        fills: bool = False,
    ):
        """`fills`: compile the KV-only programs too (speculation may pause)."""
        self.config = config
        self.fills = fills
        self.inputs = inputs
        self.compiler = compiler
        self.device = device = compiler.device
        self.k = inputs.num_speculative_tokens
        self.graphdef, state = nnx.split(model)
        self._params, self._params_def = jax.tree.flatten(state)
        shape = get_kv_cache_shape(
            config.num_layers,
            inputs.num_pages,
            inputs.page_size,
            config.cache_kv_heads,
            config.cache_head_dim,
            device.platform,
            latent=config.latent_attention is not None,
        )
        self.cache = device.zeros_model_cache(shape, device.kv_cache.dtype)
        self._step = jax.jit(
            functools.partial(
                _draft_step,
                self.graphdef,
                self._params_def,
                device.mesh,
                self.k,
                inputs.page_size,
                inputs.num_pages * inputs.page_size,
            ),
            donate_argnums=(1,),
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
            inputs, tables = self._padding_inputs(shape[1])
            batch = template.layout.abstract(device.replicated)
            self.compiler.compile(
                "draft_step" if propose else "draft_fill", shape, self._step, self._params,
                self.cache, device.last_tokens, batch, sampled, kept, inputs, tables,
                updates_cache=True, cache=self.cache,
                static={"layout": template.layout, "propose": propose},
            )  # fmt: skip

        kinds = (True, False) if self.fills else (True,)
        return [
            functools.partial(compile_step, shape, propose)
            for shape in self.inputs.shapes
            for propose in kinds
        ]

    def _padding_inputs(self, r: int) -> tuple[ProposeInputs, np.ndarray]:
        inputs = ProposeInputs(
            first_rows=np.zeros(r, np.int32),
            num_rows=np.ones(r, np.int32),
            positions=np.zeros(r, np.int32),
            num_slots=np.zeros(r, np.int32),
            active=np.zeros(r, np.bool_),
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
        """Dispatches the draft's step: its cache gets the batch's tokens, and every request
        that sampled gets k drafts, i32[R, k] on the device (junk in the other rows). `step`:
        the runner's step, launched, `batch` its forward pass's buffer on the device,
        `last_tokens` what its placeholders read;
        `sampled`, `kept`: its verification output. With `propose` False (and `fills`): the
        cache only, None."""
        ib = self.inputs.input_batch
        r_pad = len(step.batch.attn.seq_lens)
        num_reqs = len(rows)
        inputs, tables = self._padding_inputs(r_pad)
        inputs.first_rows[:num_reqs] = step.first_row[:-1]
        inputs.num_rows[:num_reqs] = 1 + step.num_drafts
        inputs.positions[:num_reqs] = ib.num_tokens[rows]
        inputs.num_slots[:num_reqs] = ib.num_blocks[rows] * self.inputs.page_size
        inputs.active[:num_reqs] = step.samples
        tables[:num_reqs] = ib.block_table[0, rows]  # one layer group: see `kv_cache_groups`
        drafts, self.cache = self._step(
            self._params,
            self.cache,
            last_tokens,
            batch,
            sampled,
            kept,
            inputs,
            tables,
            layout=step.layouts[0],
            propose=propose or not self.fills,
        )
        return drafts if propose else None

    def propose(
        self, launched: jax.Array, held: list[tuple[str, int, int]]
    ) -> dict[str, list[int]]:
        drafts = np.asarray(launched)
        return {rid: drafts[i].tolist() for rid, i, _ in held}


def _draft_step(
    graphdef,
    params_def,
    mesh,
    k: int,
    page_size: int,
    dropped_slot: int,
    params,
    cache: ModelCache,
    last_tokens: jax.Array,
    batch: jax.Array,  # the target's forward pass's buffer (`BatchInputs` as `layout` says)
    sampled: jax.Array,  # i32[L]  the target's token per logit row
    kept: jax.Array,  # bool[L]  the rows the step kept
    inputs: ProposeInputs,
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
