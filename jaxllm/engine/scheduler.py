"""The scheduler: which requests run this step, and how many tokens each.

There is no prefill phase and no decode phase. Each request carries `num_computed_tokens` (its
tokens already in the KV cache) and `num_tokens` (prompt plus output so far); each step the
scheduler grants tokens so that the first catches up with the second, under a budget of
`max_num_batched_tokens` per step and `max_num_seqs` requests. A decode is a grant of one
token; a prompt longer than the budget is prefilled in chunks over several steps while other
requests keep decoding in the same batch (chunked prefill). Running requests are served
first, then waiting ones in arrival order.

With speculative decoding, a decoding request that has draft tokens (proposed by the runner
after its previous step) is granted 1 + drafts tokens, as the budget and its length allow; a
draft model also gets `num_lookahead_tokens` more slots, where it writes the KV of the drafts it
proposes. After the step, `num_computed_tokens` is rolled back to the tokens accepted, so the
next step rewrites the rejected positions; the prefix cache keys only accepted tokens. A step
verifies at most the drafts `spec_policy` measured to pay best at that batch size; one allowed
none verifies none and has none proposed (`SchedulerOutput.max_drafts`).

A new request first looks up its longest cached prefix (see `KVCacheManager`): a hit simply
starts it with `num_computed_tokens > 0`. A hybrid model's hit also needs the linear layers'
state saved after the prefix (`jaxllm.engine.state_snapshots`): its prompts' chunks are cut
to end at page boundaries, where the state is saved.

When the KV pool has no block for a running request, the newest running request is preempted:
its blocks are freed, and it goes back to the front of the waiting queue to be recomputed from
its prompt and the tokens it already produced, so its output does not change. Under the
"priority" policy the victim is the lowest-priority, newest running request, and a waiting
request may also preempt running requests of strictly lower priority to get a seat or blocks.

The scheduler's only output is a `SchedulerOutput` (see `step_data`): the full data of the
requests entering the batch, and for every scheduled request only its progress and new blocks.
After the model ran, `update_from_output` appends the sampled tokens and finishes requests that
hit EOS, a stop token or their length.

Structured outputs (see `jaxllm.structured_outputs`): a constrained request waits until its
grammar has compiled; each step that samples for it carries its rows of the token bitmask
(`SchedulerOutput.grammar_bitmask`), its draft tokens are cut where the grammar refuses them,
and its matcher consumes the tokens the step kept. The bitmask reflects every token sampled so
far, so the engine core runs such steps synchronously.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from jaxllm.config import SchedulerConfig
from jaxllm.engine.core_outputs import FinishReason, RequestUpdate, SpecDecodingStats
from jaxllm.engine.kv_cache_manager import CacheHit, KVCacheManager
from jaxllm.engine.request import Request, RequestStatus
from jaxllm.worker import (
    GrammarBitmask,
    NewRequestData,
    PooledChunk,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from jaxllm.engine.encoder_cache import EncoderCache
    from jaxllm.engine.kv_transfer import KVTransfer
    from jaxllm.engine.lora_manager import LoRAManager
    from jaxllm.engine.spec_policy import SpeculationPolicy
    from jaxllm.structured_outputs import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        *,
        num_lookahead_tokens: int = 0,
        structured_outputs: StructuredOutputManager | None = None,
        loras: LoRAManager | None = None,
        encoder_cache: EncoderCache | None = None,
        speculation: SpeculationPolicy | None = None,
    ):
        """`speculation`: with speculative decoding, how many drafts each step verifies
        (`spec_policy`; None: all, every step). `loras`: the LoRA adapters' slots, when LoRA
        is served: a request with an adapter is admitted only when its adapter has (or can
        take) a slot. `encoder_cache`: an image-text model's encoded images on the device: a
        chunk reaching an image is granted only when the image is cached or can be encoded in
        its step."""
        if config.max_model_len is None:
            raise ValueError("the scheduler needs a resolved max_model_len")
        self.config = config
        self.kv = kv_cache_manager
        self.num_lookahead_tokens = num_lookahead_tokens
        self.structured_outputs = structured_outputs
        self.loras = loras
        self.encoder_cache = encoder_cache
        # Prefill/decode disaggregation: a producer keeps some finished requests' blocks
        # (`kv_transfer.KVTransfer.on_finish`); set by the engine core.
        self.kv_transfer: KVTransfer | None = None
        self.grammar_bitmask_seconds = 0.0  # host time filling bitmasks, since start
        self.grammar_bitmask_steps = 0
        # Requests failed outside a step (a grammar that did not compile): the engine core
        # reports them with its next step's updates.
        self.failed: list[RequestUpdate] = []
        self.spec_decoding = SpecDecodingStats()
        self.speculation = speculation
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []  # finished since the last step that ran
        self._preempted_ids: list[str] = []  # preempted in steps that ran nothing
        self.num_preemptions = 0
        # (request id, seconds it waited, time.monotonic() when it ran) of the requests first
        # admitted since the engine core last took them (`EngineCore.step`), for metrics.
        self.first_scheduled: list[tuple[str, float, float]] = []

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine")
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            if self.structured_outputs is None:
                raise ValueError("structured_outputs: this engine has no grammar support")
            request.grammar = self.structured_outputs.grammar(constraint)
        # The sequence length it may reach, read at every step it runs.
        request.max_len = min(
            request.num_prompt_tokens + request.max_tokens, self.config.max_model_len
        )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_ABORTED)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self._release_lora(request)
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        held = self.kv_transfer is not None and self.kv_transfer.on_finish(request, status)
        if not held:
            self.kv.free(request)
        self.kv.forget(request)
        if self.encoder_cache is not None:
            self.encoder_cache.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def _preempt(self, request: Request, granted: dict[Request, int], preempted: list[str]) -> int:
        """Frees a running request's blocks and sends it back to the front of the queue, to be
        recomputed; records it in `preempted` and returns the tokens it had been granted this
        step (now free again)."""
        self.running.remove(request)
        self.kv.free(request)
        if self.encoder_cache is not None:
            self.encoder_cache.free(request)
        self._release_lora(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # A token an in-flight step samples for it is dropped: it is sampled again, the same
        # (same seed and counter), once the request is recomputed.
        request.num_inflight_tokens = request.num_pending_tokens = 0
        request.spec_token_ids = []
        if request.pooled is not None:
            request.pooled.reset()  # its prompt is pooled again from the start
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        preempted.append(request.request_id)
        return granted.pop(request, 0)

    def max_drafts(self) -> int:
        """The most drafts a request verifies in the next step (speculative decoding's policy;
        -1: no limit, 0: the step neither verifies drafts nor has any proposed). A step that
        speculates runs synchronously."""
        return -1 if self.speculation is None else self.speculation.speculate(len(self.running))

    def schedule(self) -> SchedulerOutput:
        self._fail_broken_grammars()
        budget = self.config.max_num_batched_tokens
        max_drafts = self.max_drafts()
        granted: dict[Request, int] = {}  # in batch order
        drafts: dict[Request, list[int]] = {}  # the draft tokens among a request's grant
        admitted: list[Request] = []  # entering the batch: the runner gets their full data
        preempted: list[str] = []
        spans: dict[Request, list[tuple[int, int, int]]] = {}  # images the grants reach
        state_from: dict[Request, int] = {}  # admitted from a saved state: its snapshot slot

        # Running requests first, oldest first. When blocks run out, a victim is preempted:
        # the newest running request not yet granted this step ("fcfs"), or the lowest-priority,
        # newest running request, granted or not ("priority", as vLLM V1 does it).
        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._finishes_by_length(request):
                continue  # its in-flight step samples its last token
            n = request.num_tokens + request.num_pending_tokens - request.num_computed_tokens
            if n == 0:
                continue  # a pooling request whose last chunk is in flight
            n = self._chunk(request, request.num_computed_tokens, min(n, budget))
            if n == 0:
                continue  # its chunk starts at an image this step cannot encode
            spec = self._drafts(request, n, budget, max_drafts)
            n += len(spec)
            while not self._allocate(request, n):
                victim = self._pick_victim(granted)
                budget += self._preempt(victim, granted, preempted)
                if victim is request:
                    break
            if request.status == RequestStatus.RUNNING:
                granted[request] = n
                budget -= n
                if spec:
                    drafts[request] = spec
                self._take_images(request, n, spans)

        # Then waiting requests in arrival (or priority) order, while budget, seats and blocks
        # last. Nothing new is admitted in a step that had to preempt (memory is short), except
        # under "priority" a request that displaces running requests of lower priority.
        while self.waiting and budget > 0:
            request = self._next_waiting()
            if request is None or (preempted and self._displaceable(request) is None):
                break
            if len(self.running) >= self.config.max_num_seqs:
                victim = self._displaceable(request)
                if victim is None:
                    break
                budget += self._preempt(victim, granted, preempted)
            # A new or preempted request starts from its longest cached prefix, unless its
            # prompt positions must be scored (prompt_logprobs) or pooled.
            hit, num_cached = (
                (None, 0)
                if request.owes_prompt_logprobs or request.pooled is not None
                else self.kv.get_computed_blocks(request)
            )
            n = self._chunk(request, num_cached, min(request.num_tokens - num_cached, budget))
            request.num_computed_tokens = num_cached
            allocated = n > 0 and self._allocate(request, n, hit)
            while not allocated and n and (victim := self._displaceable(request)) is not None:
                budget += self._preempt(victim, granted, preempted)
                n = self._chunk(request, num_cached, min(request.num_tokens - num_cached, budget))
                allocated = n > 0 and self._allocate(request, n, hit)
            if not allocated:
                request.num_computed_tokens = 0
                break
            self.kv.record_lookup(request.num_tokens, num_cached)
            self.waiting.remove(request)
            if request.status == RequestStatus.WAITING:  # first admission, not a resumption
                now = time.monotonic()
                self.first_scheduled.append((request.request_id, now - request.arrival_time, now))
            request.status = RequestStatus.RUNNING
            if request.lora is not None:
                request.lora_slot = self.loras.acquire(request.lora)
            self.running.append(request)
            admitted.append(request)
            granted[request] = n
            budget -= n
            self._take_images(request, n, spans)
            if hit is not None and hit.state is not None:
                state_from[request] = hit.state

        # Ids the runner must drop wait for a step that runs (an empty one is not sent).
        self._preempted_ids += preempted
        finished, preempted = self._finished_ids, self._preempted_ids
        if granted:
            self._finished_ids, self._preempted_ids = [], []
        else:
            finished, preempted = [], []
        # Data for the new rows first: it records the blocks they have as sent.
        new_requests = [self._new_request_data(r) for r in admitted if r in granted]
        # The requests whose grant reaches the end of their sequence (drafts aside): this
        # step samples their next token (a pooling request's ends instead).
        sampling = [
            r
            for r, n in granted.items()
            if r.num_computed_tokens + n - len(drafts.get(r, ()))
            == r.num_tokens + r.num_pending_tokens
            and r.pooled is None
        ]
        bitmask = self._grammar_bitmask(sampling, drafts)
        # The host tier's copies wait, like the ids above, for a step that runs.
        stores, loads = self.kv.take_transfers() if granted else ([], [])
        encodes = self.encoder_cache.take_step() if self.encoder_cache is not None else []
        out = SchedulerOutput(
            new_requests=new_requests,
            requests=[
                self._scheduled(
                    request,
                    n,
                    drafts.get(request, []),
                    spans.get(request, []),
                    state_from.get(request, -1),
                )
                for request, n in granted.items()
            ],
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            preempted_request_ids=preempted,
            finished_request_ids=finished,
            grammar_bitmask=bitmask,
            kv_stores=stores,
            kv_loads=loads,
            encoder_inputs=encodes,
            max_drafts=max_drafts,
        )
        # The grants count as computed from now on, so the next step can be scheduled before
        # this one's output is back; `update_from_output` confirms them.
        for request, n in granted.items():
            request.num_computed_tokens += n
            request.num_inflight_tokens += n
        for request in sampling:
            request.num_pending_tokens += 1  # the token this step samples
        return out

    def _chunk(self, request: Request, start: int, n: int) -> int:
        """The grant of at most `n` tokens from `start`: cut before an image the step cannot
        encode, and for a hybrid model's saved states, at a page boundary."""
        return self._align_for_state(request, start, self._cut_for_images(request, start, n))

    def _align_for_state(self, request: Request, start: int, n: int) -> int:
        """With saved states (a hybrid model), a chunk of a prompt (or of a recomputed
        sequence) ends at a page boundary unless it ends the sequence, and never runs past
        the sequence's last boundary before its end, where the state is saved (vLLM's
        block-aligned split). That boundary is where a hit on the same prompt ends (a hit
        leaves a token to compute): a prompt of whole pages is saved a page before its end
        too. A chunk shorter than a page is left as it is."""
        if self.kv.snapshots is None or request.pooled is not None or n <= 1:
            return n
        page, end, total = self.kv.page_size, start + n, request.num_tokens
        last = (total - 1) // page * page
        if start < last < end:
            return last - start
        if end < total and end // page * page > start:
            return end // page * page - start
        return n

    def _cut_for_images(self, request: Request, start: int, n: int) -> int:
        """A grant of `n` tokens from `start`, stopped before an image it reaches that this
        step cannot encode (see `EncoderCache`)."""
        if self.encoder_cache is None or not request.mm_items:
            return n
        return self.encoder_cache.cut(request, start, n)

    def _take_images(self, request: Request, n: int, spans: dict) -> None:
        """Records the images a grant reaches: held, queued to encode if not cached."""
        if self.encoder_cache is not None and request.mm_items:
            spans[request] = self.encoder_cache.take(request, request.num_computed_tokens, n)

    def _drafts(self, request: Request, n: int, budget: int, max_drafts: int) -> list[int]:
        """The draft tokens to verify with a decode grant of `n`: the request's proposals, as
        many as the budget holds, as could still be accepted before its end, and at most
        `max_drafts` (-1: all)."""
        if not request.spec_token_ids or n != 1 or request.num_pending_tokens or not max_drafts:
            return []
        room = request.max_len - request.num_tokens - 1  # the last token is sampled
        if max_drafts > 0:
            room = min(room, max_drafts)
        spec = request.spec_token_ids[: max(0, min(room, budget - 1))]
        if request.grammar is not None and spec:
            if not request.grammar_live:
                return []  # still thinking: what follows its end must be constrained
            spec = spec[: request.grammar.valid_prefix(spec)]
        return spec

    def _grammar_bitmask(
        self, sampling: list[Request], drafts: dict[Request, list[int]]
    ) -> GrammarBitmask | None:
        """The bitmask rows of the constrained requests among those that sample this step."""
        rows = [
            (r, drafts.get(r, [])) for r in sampling if r.grammar is not None and r.grammar_live
        ]
        if not rows:
            return None
        start = time.perf_counter()
        bitmask = self.structured_outputs.fill_bitmask([(r.grammar, d) for r, d in rows])
        self.grammar_bitmask_seconds += time.perf_counter() - start
        self.grammar_bitmask_steps += 1
        return GrammarBitmask([r.request_id for r, _ in rows], bitmask.tobytes())

    def _fail_broken_grammars(self) -> None:
        """Fails the waiting requests whose grammar did not compile (or not in time)."""
        for request in list(self.waiting):
            grammar = request.grammar
            if grammar is not None and grammar.ready() and grammar.error is not None:
                logger.warning("request %s failed: %s", request.request_id, grammar.error)
                self._finish(request, RequestStatus.FINISHED_ERROR)
                self.failed.append(
                    RequestUpdate(request.request_id, [], finish_reason=FinishReason.ERROR)
                )

    def wait_for_grammars(self, timeout: float) -> None:
        """Blocks (at most `timeout` s) until a waiting request's grammar is compiled, if
        some waiting request is held back only by its grammar."""
        for request in self.waiting:
            if request.grammar is not None and not request.grammar.ready():
                request.grammar.wait(timeout)
                return

    def _allocate(self, request: Request, n: int, hit: CacheHit | None = None) -> bool:
        """Slots for a grant of `n` tokens (a new request's from its prefix-cache `hit`) and,
        past them, the `num_lookahead_tokens` where a draft model writes its drafts' KV (none
        past the request's end)."""
        end = request.max_len - request.num_computed_tokens - n
        lookahead = max(0, min(self.num_lookahead_tokens, end))
        return self.kv.allocate_slots(request, n, hit, num_lookahead_tokens=lookahead)

    def _finishes_by_length(self, request: Request) -> bool:
        """Whether the token an in-flight step samples for the request is its last."""
        if request.pooled is not None:
            return False  # it samples nothing; it ends with its prompt
        return request.num_tokens + request.num_pending_tokens >= request.max_len

    def _release_lora(self, request: Request) -> None:
        """Unpins a running request's adapter slot (finished or preempted)."""
        if request.lora_slot >= 0:
            self.loras.release(request.lora)
            request.lora_slot = -1

    def _next_waiting(self) -> Request | None:
        """The next request to admit: the first in arrival order (preempted requests went back
        to the front) or by (priority, arrival), among those not waiting for a sibling."""
        ready = (
            r
            for r in self.waiting
            if not self._waits_for_parent(r)
            and (r.grammar is None or r.grammar.compiled)
            and (r.lora is None or self.loras.can_acquire(r.lora))
        )
        if self.config.scheduling_policy == "priority":
            return min(ready, key=lambda r: (r.priority, r.arrival_time), default=None)
        return next(ready, None)

    def _waits_for_parent(self, request: Request) -> bool:
        """Fan-out of n completions: the siblings of the first one wait until it has computed
        the shared prompt, so they start from its cached blocks instead of recomputing them."""
        if request.prefix_parent is None or not self.kv.enable_prefix_caching:
            return False
        parent = self.requests.get(request.prefix_parent)
        if parent is None:  # finished or aborted: nothing to wait for
            return False
        return (
            parent.status != RequestStatus.RUNNING
            or parent.num_confirmed_tokens < parent.num_prompt_tokens
        )

    def _pick_victim(self, granted: dict[Request, int]) -> Request:
        """The running request to preempt when a running one needs blocks (the request being
        scheduled is itself a candidate, so there always is one)."""
        if self.config.scheduling_policy == "priority":
            return self._lowest_priority_running()
        return [r for r in self.running if r not in granted][-1]

    def _displaceable(self, request: Request) -> Request | None:
        """Under "priority", the running request a waiting `request` may preempt: the
        lowest-priority, newest one, if its priority is strictly lower than the request's."""
        if self.config.scheduling_policy != "priority" or not self.running:
            return None
        victim = self._lowest_priority_running()
        return victim if victim.priority > request.priority else None

    def _lowest_priority_running(self) -> Request:
        """The lowest-priority running request (the largest value), the newest among equals."""
        return max(self.running, key=lambda r: (r.priority, r.arrival_time))

    def _new_request_data(self, request: Request) -> NewRequestData:
        block_ids = _sent(self.kv.get_block_table(request.request_id), 0)
        request.num_blocks_sent = len(block_ids[0])
        return NewRequestData(
            request_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            seed=request.seed,
            eos_token_ids=list(request.eos_token_ids),
            block_ids=block_ids,
            lora_slot=request.lora_slot,
            mm_grids=[(i.offset, *i.grid) for i in request.mm_items if i.grid is not None],
        )

    def _scheduled(
        self,
        request: Request,
        n: int,
        drafts: list[int],
        spans: list[tuple[int, int, list[int]]],
        state_from: int,
    ) -> ScheduledRequest:
        tables = self.kv.get_block_table(request.request_id)
        if len(tables[0]) == request.num_blocks_sent:  # most decodes: no new block
            new_block_ids = [[] for _ in tables]
        else:
            new_block_ids = _sent(tables, request.num_blocks_sent)
            request.num_blocks_sent = len(tables[0])
        start = request.num_computed_tokens
        targets = None
        if request.sampling_params.prompt_logprobs is not None:
            targets = self._prompt_logprob_targets(request, start, n)
        return ScheduledRequest(
            request_id=request.request_id,
            num_computed_tokens=start,
            num_scheduled_tokens=n,
            new_block_ids=new_block_ids,
            prompt_logprob_targets=targets,
            spec_token_ids=drafts,
            pool=request.pooled is not None,
            mm_spans=spans,
            state_from=state_from if state_from >= 0 else self.kv.state_source(request),
            state_save=self.kv.save_state(request, start + n),
        )

    @staticmethod
    def _prompt_logprob_targets(request: Request, start: int, n: int) -> list[int] | None:
        """Position p of the chunk scores prompt token p + 1, if that one is still owed."""
        if not request.owes_prompt_logprobs:
            return None
        first, end = request.next_prompt_logprob, request.num_prompt_tokens
        ids = request.all_token_ids
        targets = [ids[p + 1] if first <= p + 1 < end else -1 for p in range(start, start + n)]
        return targets if any(t >= 0 for t in targets) else None

    def update_from_output(
        self, scheduled: SchedulerOutput, output: RunnerOutput
    ) -> list[RequestUpdate]:
        """Advances each scheduled request by its grant; appends the token sampled for each
        request whose chunk reached the end of its sequence, and finishes it if it stops."""
        updates = []
        num_tokens = 0
        for s in scheduled.requests:
            rid = s.request_id
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished, aborted or preempted while the step ran
            request.num_inflight_tokens -= s.num_scheduled_tokens
            if s.state_save >= 0:  # the state it saved is there now
                self.kv.commit_state(request, s.state_save)
            if request.pooled is not None:
                update = self._pooled_chunk(request, output.pooled.get(rid))
                if update is not None:
                    updates.append(update)
                continue
            tokens = output.sampled.get(rid, [])
            if s.spec_token_ids:  # roll back to the accepted drafts
                accepted = len(tokens) - 1
                request.num_computed_tokens -= len(s.spec_token_ids) - accepted
                self.spec_decoding.observe(len(s.spec_token_ids), accepted)
            scored = output.prompt_logprobs.get(rid)
            if scored:
                request.next_prompt_logprob += len(scored)
            if not tokens:
                self.kv.cache_full_blocks(request)
                if scored:  # a prefill chunk: only its prompt logprobs to report
                    updates.append(RequestUpdate(rid, [], new_prompt_logprobs=scored))
                continue
            logprobs = output.logprobs.get(rid)
            num_tokens += len(tokens)
            request.num_pending_tokens -= 1
            status = None
            for i, token in enumerate(tokens):
                request.append_output_token(token)
                status = self._check_stop(request, token)
                if status is not None:  # the tokens after a stop are dropped
                    tokens, logprobs = tokens[: i + 1], logprobs and logprobs[: i + 1]
                    break
            self.kv.cache_full_blocks(request)  # accepted drafts are keyed once appended
            if request.grammar is not None and not self._advance_grammar(request, tokens):
                status = status or RequestStatus.FINISHED_ERROR
            if status is not None:
                self._finish(request, status)
            else:
                request.spec_token_ids = output.draft_token_ids.get(rid, [])
            updates.append(
                RequestUpdate(
                    request_id=rid,
                    new_token_ids=tokens,
                    new_logprobs=logprobs,
                    finish_reason=status.finish_reason if status else None,
                    stop_reason=request.stop_reason,
                    new_prompt_logprobs=scored,
                    kv_transfer_params=request.kv_transfer_out if status else None,
                )
            )
        if self.speculation is not None:
            decodes = not scheduled.new_requests and all(
                s.num_scheduled_tokens == 1 + len(s.spec_token_ids) and not s.pool
                for s in scheduled.requests
            )
            self.speculation.observe(
                len(scheduled.requests) if decodes else None, scheduled.max_drafts, num_tokens
            )
        return updates

    @staticmethod
    def _advance_grammar(request: Request, tokens: list[int]) -> bool:
        """Feeds a constrained request's new tokens (already appended to its output) to its
        grammar (False: it refused them). Until its reasoning end sequence has appeared the
        thinking is free: the grammar takes what follows the sequence's first appearance."""
        if not request.grammar_live:
            end = request.sampling_params.reasoning_end_token_ids
            out, n = request.output_token_ids, len(end)
            first = len(out) - len(tokens)  # where the new tokens start in the output
            ends = (
                i
                for i in range(len(tokens))
                if out[max(first + i + 1 - n, 0) : first + i + 1] == end
            )
            last = next(ends, None)  # the new token that completes the sequence first
            if last is None:
                return True
            request.grammar_live = True
            tokens = tokens[last + 1 :]
        return not tokens or request.grammar.accept(tokens)

    def _pooled_chunk(self, request: Request, chunk: PooledChunk | None) -> RequestUpdate | None:
        """Adds a pooling request's computed chunk to its pool; once its whole prompt is in,
        it finishes with its vector."""
        if chunk is not None:
            request.pooled.add(np.asarray(chunk.total), np.asarray(chunk.last), chunk.num_tokens)
        if request.num_confirmed_tokens < request.num_tokens:
            return None
        vector = request.pooled.finish(request.pooling_params)
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        return RequestUpdate(
            request.request_id, [], finish_reason=FinishReason.STOP, pooled=vector.tolist()
        )

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        # The sampler cannot pick EOS or a stop id among the first min_tokens tokens; this
        # check repeats the rule so the two can never disagree.
        if request.num_output_tokens > request.sampling_params.min_tokens:
            if token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in request.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_tokens >= request.max_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _sent(tables: list[list[int]], start: int) -> list[list[int]]:
    """Each group's table from `start`, as the runner gets it: a null entry (a sliding
    group's block behind the window) as page 0, which no kernel reads there."""
    return [[max(b, 0) for b in table[start:]] for table in tables]
