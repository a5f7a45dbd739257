"""A step's padded inputs, gathered from the persistent batch's rows: the forward pass's
(`BatchInputs`), the sampler's (`SamplingInputsBuilder`) and the verification's.

Every batch is padded to a compiled shape (`buckets`). Padding tokens write to an out-of-range
slot (dropped) and padding requests have no tokens and length 0, so they never touch real data.
The forward pass's inputs are written into one buffer per step and the sampler's and the
verification's into another (`packing`): a step sends both in one transfer, beside what few
steps need (the sampler's idle inputs, kept on the device).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from jaxllm.models import AttentionMetadata, StepExtras
from jaxllm.models.linear_attention import StateSlots
from jaxllm.worker.buckets import logit_rows, pick_shape
from jaxllm.worker.input_batch import InputBatch
from jaxllm.worker.packing import Layout, Template
from jaxllm.worker.programs import BatchInputs
from jaxllm.worker.sampler import SamplerVariant
from jaxllm.worker.sampling_inputs import SamplingInputsBuilder
from jaxllm.worker.spec_decode.verification import VerifyInputs, padding_verify
from jaxllm.worker.step_data import SchedulerOutput


@dataclasses.dataclass
class PreparedStep:
    """A step's inputs, as `StepInputs.prepare` builds them."""

    batch: BatchInputs  # views of `buffers[0]`
    sampling: dict[str, np.ndarray]  # the sampler's host inputs per logit row: views of the 2nd
    verify: VerifyInputs  # per logit row: views of `buffers[1]`
    # The forward pass's and the sampler's buffers, and their layouts (see `packing`)
    buffers: tuple[np.ndarray, np.ndarray]
    layouts: tuple[Layout, Layout]
    idle: dict  # the sampler's other inputs (`SamplingInputsBuilder.idle_inputs`)
    needs: SamplerVariant  # the sampler's parts the batch needs
    samples: np.ndarray  # bool[R]: the request's chunk reaches the end of its sequence
    first_row: np.ndarray  # i32[R + 1]: each request's first logit row, then their number
    num_drafts: np.ndarray  # i32[R]


@dataclasses.dataclass
class StepInputs:
    input_batch: InputBatch
    sampling: SamplingInputsBuilder
    shapes: list[tuple[int, int]]  # the compiled (token bucket, request bucket) pairs
    num_pages: int
    page_size: int
    pages_per_seq: int  # the block table's width
    num_speculative_tokens: int
    lora: bool = False  # each token's LoRA slot is an input (LoRA served)
    # Per model layer, (its group, its cache slot) per part (`KVCacheGroups.layer_slots`); None: one
    # group, slot i is layer i.
    layer_slots: tuple[tuple[tuple[int, int], ...], ...] | None = None
    # A hybrid model: each request's recurrent-state slots are inputs (`StateSlots`), its
    # batch row and, after the rows, this many snapshot slots of saved states.
    state: bool = False
    num_state_snapshots: int = 0
    mm: bool = False  # image placeholders read the encoder cache (an image-text model)
    mm_block: int = 1  # the encoder cache's rows per block
    # An image's tokens attend to each other (Gemma 3): `AttentionMetadata.attend_to`.
    mm_attend: bool = False
    # The buffers' neutral contents by shape (forward) and by logit rows (sampler), made once.
    _templates: dict = dataclasses.field(default_factory=dict, repr=False)

    def batch_template(self, t_pad: int, r_pad: int) -> Template:
        """The forward pass's buffer of a padded shape, holding no request."""
        key = ("batch", t_pad, r_pad)
        if key not in self._templates:
            self._templates[key] = Template.of(self.padding_batch(t_pad, r_pad))
        return self._templates[key]

    def head_template(self, n: int) -> Template:
        """The sampler's and the verification's buffer of `n` logit rows, sampling nothing."""
        key = ("head", n)
        if key not in self._templates:
            self._templates[key] = Template.of(
                (self.sampling.host_padding(n), self.padding_verify(n))
            )
        return self._templates[key]

    def padding_batch(self, t_pad: int, r_pad: int) -> BatchInputs:
        """Fresh arrays of the given padded shape holding no request: such a batch writes
        nothing. `prepare` fills requests in."""
        num_logits = logit_rows((t_pad, r_pad), self.num_speculative_tokens)
        groups = self.input_batch.block_table.shape[0]
        return BatchInputs(
            input_ids=_ints(t_pad),
            token_src=_ints(t_pad, fill=-1),
            positions=_ints(3, t_pad) if self.input_batch.mrope else _ints(t_pad),
            logits_indices=_ints(num_logits),
            attn=AttentionMetadata(
                slot_mapping=_ints(groups, t_pad, fill=self.num_pages * self.page_size),  # dropped
                seq_lens=_ints(r_pad),
                block_tables=_ints(groups, r_pad, self.pages_per_seq),
                cu_q_lens=_ints(r_pad + 1),
                num_seqs=_ints(1),
                layer_slots=self.layer_slots,
                attend_to=_ints(t_pad, fill=-1) if self.mm_attend else None,
            ),
            extras=StepExtras(
                lora_slots=_ints(t_pad, fill=-1) if self.lora else None,
                mm_rows=_ints(t_pad, fill=-1) if self.mm else None,
                state_slots=self._padding_state_slots(r_pad) if self.state else None,
            ),
        )

    def _padding_state_slots(self, r_pad: int) -> StateSlots:
        dropped = len(self.input_batch.token_ids) + self.num_state_snapshots
        return StateSlots(_ints(r_pad), _ints(r_pad, fill=dropped))

    def padding_verify(self, n: int) -> VerifyInputs:
        return padding_verify(n, dropped_row=len(self.input_batch.token_ids))

    def prepare(self, out: SchedulerOutput, rows: np.ndarray) -> PreparedStep:
        """The step's padded inputs, gathered from the batch rows, and which requests sample
        (their chunk reaches the end of their sequence, not counting draft tokens).

        Sampling happens per logit row: one per request, after its last scheduled token, and
        with draft tokens one more per draft (row j samples the token after j drafts, with the
        request's parameters, counter and history as they would be at that token)."""
        ib = self.input_batch
        num_reqs = len(out.requests)
        # Each request's computed and scheduled tokens, drafts, and whether it pools, read once.
        computed, lens, num_drafts, pool = (
            np.fromiter(
                itertools.chain.from_iterable(
                    (s.num_computed_tokens, s.num_scheduled_tokens, len(s.spec_token_ids), s.pool)
                    for s in out.requests
                ),
                np.int32,
                4 * num_reqs,
            )
            .reshape(num_reqs, 4)
            .T
        )
        num_tokens = int(lens.sum())
        t_pad, r_pad = pick_shape(num_tokens, num_reqs, self.shapes)
        batch_template = self.batch_template(t_pad, r_pad)
        batch_buffer, batch = batch_template.new()
        attn = batch.attn

        starts = np.zeros(num_reqs + 1, np.int32)
        np.cumsum(lens, out=starts[1:])
        owner = np.repeat(np.arange(num_reqs), lens)  # the request of each token
        pos = computed[owner] + np.arange(num_tokens, dtype=np.int32) - starts[owner]
        token_rows = rows[owner]
        ids = ib.token_ids[token_rows, pos]
        # A placeholder (-1): the token the previous step samples, not back on the host yet.
        batch.input_ids[:num_tokens] = np.maximum(ids, 0)
        batch.token_src[:num_tokens] = np.where(ids < 0, token_rows, -1)
        if self.input_batch.mrope:
            batch.positions[:, :num_tokens] = ib.positions(token_rows, pos)
        else:
            batch.positions[:num_tokens] = pos
        extras = batch.extras
        if extras.lora_slots is not None:
            extras.lora_slots[:num_tokens] = ib.lora_slot[token_rows]
        if extras.state_slots is not None:
            self._fill_state_slots(extras.state_slots, out, rows)
        if extras.mm_rows is not None:
            bt = self.mm_block
            for i, s in enumerate(out.requests):
                for first, length, blocks in s.mm_spans:
                    span = slice(starts[i], starts[i + 1])
                    inside = (pos[span] >= first) & (pos[span] < first + length)
                    k = pos[span][inside] - first
                    extras.mm_rows[span][inside] = np.asarray(blocks)[k // bt] * bt + k % bt
                    if attn.attend_to is not None:  # the whole image is in this chunk
                        attn.attend_to[span][inside] = first + length - 1
        attn.slot_mapping[:, :num_tokens] = (
            ib.block_table[:, token_rows, pos // self.page_size] * self.page_size
            + pos % self.page_size
        )
        attn.num_seqs[0] = num_reqs
        attn.cu_q_lens[:num_reqs] = starts[:num_reqs]
        attn.cu_q_lens[num_reqs:] = num_tokens  # padding requests: empty, after the last token
        attn.seq_lens[:num_reqs] = computed + lens
        # Only the columns some request uses (the rest stay 0): a long max_model_len makes the
        # tables wide, and a hybrid model has one per layer group.
        width = int(ib.num_blocks[rows].max(initial=0))
        attn.block_tables[:, :num_reqs, :width] = ib.block_table[:, rows, :width]

        # Logit rows: request i has 1 + num_drafts[i], from first_row[i]; its row j samples
        # the token after its last token and its first j drafts.
        first_row = np.zeros(num_reqs + 1, np.int32)
        np.cumsum(1 + num_drafts, out=first_row[1:])
        num_logits = int(first_row[-1])
        req = np.repeat(np.arange(num_reqs), 1 + num_drafts)  # the request of each logit row
        j = np.arange(num_logits, dtype=np.int32) - first_row[req]
        batch.logits_indices[:num_logits] = starts[req + 1] - 1 - num_drafts[req] + j

        samples = (computed + lens - num_drafts == ib.num_tokens[rows]) & (pool == 0)
        lrows = rows[req]
        seq_len = ib.num_tokens[lrows] + j  # each row's sequence, its drafts included
        head_template = self.head_template(len(batch.logits_indices))
        head_buffer, (sampling, verify) = head_template.new()
        idle, needs = self.sampling.build(sampling, lrows, seq_len, samples[req], out, first_row)
        # Verification: row j is kept if rows 0..j-1 of its request sampled their drafts.
        if num_logits > num_reqs:  # some request has drafts
            has_draft = j < num_drafts[req]
            draft_pos = np.minimum(seq_len, ib.token_ids.shape[1] - 1)
            verify.drafts[:num_logits] = np.where(has_draft, ib.token_ids[lrows, draft_pos], -1)
        verify.first_rows[:num_logits] = first_row[req]
        # A decode without drafts leaves its token on the device for the next step to read
        # (async scheduling; an engine with speculative decoding steps synchronously).
        single = samples & (num_drafts == 0)
        verify.sample_rows[first_row[:-1][single]] = rows[single]
        return PreparedStep(
            batch,
            sampling,
            verify,
            (batch_buffer, head_buffer),
            (batch_template.layout, head_template.layout),
            idle,
            needs,
            samples,
            first_row,
            num_drafts,
        )

    def _fill_state_slots(self, slots: StateSlots, out: SchedulerOutput, rows: np.ndarray) -> None:
        """A request's state lives at its batch row; it is read from a saved state (a
        snapshot slot, after the rows) when its chunk starts from one, and written to one
        instead of the row when the scheduler saves it."""
        n, base = len(out.requests), len(self.input_batch.token_ids)
        read, save = (
            np.fromiter(
                itertools.chain.from_iterable((s.state_from, s.state_save) for s in out.requests),
                np.int32,
                2 * n,
            )
            .reshape(n, 2)
            .T
        )
        slots.read[:n] = np.where(read >= 0, base + read, rows)
        slots.write[:n] = np.where(save >= 0, base + save, rows)


def _ints(*shape: int, fill: int = 0) -> np.ndarray:
    return np.full(shape, fill, np.int32)
