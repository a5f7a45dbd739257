"""Which encoded images the device holds, for the scheduler (vLLM V1's encoder cache manager
and encoder budget): slots of the encoder cache by image hash, and per step which images the
vision encoder computes.

An image is encoded whole in the step whose chunk first reaches one of its placeholder tokens,
into a free slot, unless a slot already holds the same image (by content hash: two requests
with the same image encode it once). A request holds each of its images from that step until
its chunks have passed the image's last placeholder; an image no request holds stays cached,
least recently released evicted first, so a repeated image is found again. A step encodes at
most `budget` image tokens, and a chunk that would reach an image that cannot be encoded this
step (budget or slots spent) stops before it.

Slots are never reused within the step that read or wrote them: the step's encoding runs
before its forward pass, which reads the slots.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxllm.engine.request import Request
from jaxllm.worker import EncoderInput, MultiModalItem


class EncoderCache:
    def __init__(self, num_slots: int, tokens_per_slot: int, budget: int, *, whole: bool = False):
        """`whole`: an image's placeholders are computed in one chunk (a model whose image
        tokens attend to each other); a chunk that would end inside one stops before it."""
        if num_slots < 1 or budget < tokens_per_slot:
            raise ValueError(
                f"the encoder cache needs a slot and a budget of at least one image "
                f"({tokens_per_slot} tokens); got {num_slots} slot(s), budget {budget}"
            )
        self.num_slots = num_slots
        self.tokens_per_slot = tokens_per_slot
        self.budget = budget
        self.whole = whole
        self.slot_of: dict[str, int] = {}  # image hash -> its slot
        self.holders: dict[str, set[str]] = {}  # image hash -> requests holding it
        self.released: OrderedDict[str, None] = OrderedDict()  # cached, unheld: evictable
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.held: dict[str, set[str]] = {}  # request id -> the image hashes it holds
        self.hits = self.misses = 0
        self._begin()

    def _begin(self) -> None:
        self.step_budget = self.budget
        self.step_inputs: list[EncoderInput] = []
        self.step_used: set[str] = set()  # hashes read or written this step: not evictable

    @classmethod
    def for_model(cls, vision, config) -> EncoderCache:
        """The encoder cache an engine of `config` (an `EngineConfig`) keeps for the model's
        vision side (`VisionConfig`), as `serve` and `jaxllm compile` size it. A model whose
        image tokens attend to each other needs a step to hold an image's tokens."""
        tokens, batched = vision.tokens_per_image, config.scheduler.max_num_batched_tokens
        if vision.bidirectional and batched < tokens:
            raise ValueError(
                f"max_num_batched_tokens ({batched}) must be >= {tokens}: this model computes "
                f"an image's {tokens} tokens in one step"
            )
        slots, budget = config.multimodal.encoder_plan(tokens, batched)
        return cls(slots, tokens, budget, whole=vision.bidirectional)

    @property
    def max_items_per_step(self) -> int:
        return min(self.num_slots, self.budget // self.tokens_per_slot)

    def cut(self, request: Request, start: int, n: int) -> int:
        """The grant of `n` tokens from `start` shortened to stop before the first image it
        reaches that cannot be encoded this step: the budget is spent, or no slot is free or
        holds an image nobody needs now. Nothing changes: this walks the images as `take`
        will (the same slots, the same evictions)."""
        budget, free = self.step_budget, len(self.free_slots)
        cached, used = set(self.slot_of), set(self.step_used)
        released = list(self.released)
        for item in request.mm_items:
            if item.offset >= start + n:
                break
            if item.offset + item.length <= start:
                continue
            if self.whole and item.offset + item.length > start + n:
                return max(0, item.offset - start)  # the image in a later chunk, whole
            h = item.hash
            if h not in cached:
                victim = None if free else next((v for v in released if v not in used), None)
                if budget < item.length or (not free and victim is None):
                    return max(0, item.offset - start)
                if free:
                    free -= 1
                else:
                    released.remove(victim)
                    cached.discard(victim)
                cached.add(h)
                budget -= item.length
            used.add(h)
        return n

    def take(self, request: Request, start: int, n: int) -> list[tuple[int, int, int]]:
        """Records a grant (`cut` first): the images it reaches are held for the request,
        those not cached queued to encode. Returns the chunk's spans (first placeholder,
        placeholders, first row), as `ScheduledRequest.mm_spans`."""
        spans = []
        held = self.held.setdefault(request.request_id, set())
        for item in request.mm_items:
            if item.offset >= start + n:
                break
            if item.offset + item.length <= start:
                continue
            h = item.hash
            if h not in held:
                self._hold(request.request_id, item)
                held.add(h)
            self.step_used.add(h)
            spans.append((item.offset, item.length, self.slot_of[h] * self.tokens_per_slot))
            if item.offset + item.length <= start + n:  # its last placeholder computed now
                self._release(request.request_id, h)
                held.discard(h)
        return spans

    def _hold(self, rid: str, item: MultiModalItem) -> None:
        h = item.hash
        if h in self.slot_of:
            self.hits += 1
            self.released.pop(h, None)
        else:
            self.misses += 1
            if self.free_slots:
                slot = self.free_slots.pop()
            else:
                victim = next(v for v in self.released if v not in self.step_used)
                del self.released[victim]
                slot = self.slot_of.pop(victim)
            self.slot_of[h] = slot
            self.step_inputs.append(EncoderInput(slot, item.pixels))
            self.step_budget -= item.length
        self.holders.setdefault(h, set()).add(rid)

    def _release(self, rid: str, h: str) -> None:
        holders = self.holders.get(h)
        if holders is None:
            return
        holders.discard(rid)
        if not holders:
            del self.holders[h]
            self.released[h] = None  # the most recently released: evicted last

    def free(self, request: Request) -> None:
        """A request finished or was preempted: it holds no image any more."""
        for h in self.held.pop(request.request_id, ()):
            self._release(request.request_id, h)

    def reset(self) -> None:
        """Forgets every cached image (the device's cache was dropped: sleep mode); no request
        may hold one."""
        if self.holders:
            raise ValueError("the encoder cache is in use: reset it when the engine is idle")
        self.slot_of.clear()
        self.released.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self._begin()

    def take_step(self) -> list[EncoderInput]:
        """The step's images to encode; the next step starts afresh."""
        inputs = self.step_inputs
        self._begin()
        return inputs

    @property
    def num_held(self) -> int:
        """Slots held by requests (0 when idle: nothing leaks)."""
        return len(self.holders)

    def check_invariants(self) -> None:
        slots = sorted([*self.slot_of.values(), *self.free_slots])
        assert slots == list(range(self.num_slots)), slots
        assert set(self.released) | set(self.holders) == set(self.slot_of)
        assert not set(self.released) & set(self.holders)
