"""Which encoded images the device holds, for the scheduler (vLLM V1's encoder cache manager
and encoder budget): blocks of the encoder cache by image hash, and per step which images the
vision encoder computes.

An image is encoded whole in the step whose chunk first reaches one of its placeholder tokens,
into free blocks of rows (one block for a model whose images are all one size; ceil(tokens /
block) for Qwen2.5-VL's images of any size), unless blocks already hold the same image (by
content hash: two requests with the same image encode it once). A request holds each of its
images from that step until its chunks have passed the image's last placeholder; an image no
request holds stays cached, least recently released evicted first, so a repeated image is
found again. A step encodes at most `budget` image tokens, and a chunk that would reach an
image that cannot be encoded this step (budget or blocks spent) stops before it.

Blocks are never reused within the step that read or wrote them: the step's encoding runs
before its forward pass, which reads the blocks.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxllm.engine.request import Request
from jaxllm.worker import EncoderInput, MultiModalItem


class EncoderCache:
    def __init__(
        self,
        num_blocks: int,
        block_tokens: int,
        budget: int,
        *,
        max_item_tokens: int | None = None,
        whole: bool = False,
    ):
        """`num_blocks` of `block_tokens` rows each: an image of n tokens takes ceil(n /
        block_tokens) of them, anywhere (a model whose images are all one size has blocks of
        an image). `budget`: image tokens a step encodes; both must hold the largest image,
        `max_item_tokens`. `whole`: an image's placeholders are computed in one chunk (a model
        whose image tokens attend to each other); a chunk that would end inside one stops
        before it."""
        largest = max_item_tokens or block_tokens
        if num_blocks * block_tokens < largest or budget < largest:
            raise ValueError(
                f"the encoder cache and a step's encoder budget must hold the largest image "
                f"({largest} tokens); got {num_blocks * block_tokens} rows, budget {budget}"
            )
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.budget = budget
        self.whole = whole
        self.holders: dict[str, set[str]] = {}  # image hash -> requests holding it
        self.held: dict[str, set[str]] = {}  # request id -> the image hashes it holds
        self.hits = self.misses = 0
        self._empty()

    def _empty(self) -> None:
        """No image cached: every block free."""
        self.blocks_of: dict[str, list[int]] = {}  # image hash -> its blocks
        self.released: OrderedDict[str, None] = OrderedDict()  # cached, unheld: evictable
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self._begin()

    def _begin(self) -> None:
        self.step_budget = self.budget
        self.step_inputs: list[EncoderInput] = []
        self.step_used: set[str] = set()  # hashes read or written this step: not evictable

    @classmethod
    def for_model(cls, vision, config) -> EncoderCache:
        """The encoder cache an engine of `config` (an `EngineConfig`) keeps for the model's
        vision side (`VisionConfig` or `QwenVisionConfig`), as `serve` and `jaxllm compile`
        size it. A model whose image tokens attend to each other needs a step to hold an
        image's tokens."""
        from jaxllm.worker import encoder_plan

        blocks, budget = encoder_plan(vision, config)
        return cls(
            blocks,
            vision.block_tokens,
            budget,
            max_item_tokens=vision.max_tokens_per_image,
            whole=vision.bidirectional,
        )

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def cut(self, request: Request, start: int, n: int) -> int:
        """The grant of `n` tokens from `start` shortened to stop before the first image it
        reaches that cannot be encoded this step: the budget is spent, or too few blocks are
        free or hold images nobody needs now. Nothing changes: this walks the images as
        `take` will (the same blocks, the same evictions)."""
        budget, free = self.step_budget, len(self.free_blocks)
        cached, used = set(self.blocks_of), set(self.step_used)
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
                need = self.blocks_for(item.length)
                if budget < item.length:
                    return max(0, item.offset - start)
                while free < need:
                    victim = next((v for v in released if v not in used), None)
                    if victim is None:
                        return max(0, item.offset - start)
                    released.remove(victim)
                    cached.discard(victim)
                    free += len(self.blocks_of[victim])
                free -= need
                cached.add(h)
                budget -= item.length
            used.add(h)
        return n

    def take(self, request: Request, start: int, n: int) -> list[tuple[int, int, list[int]]]:
        """Records a grant (`cut` first): the images it reaches are held for the request,
        those not cached queued to encode. Returns the chunk's spans (first placeholder,
        placeholders, the image's blocks), as `ScheduledRequest.mm_spans`."""
        spans: list[tuple[int, int, list[int]]] = []
        if n <= 0:
            return spans
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
            spans.append((item.offset, item.length, self.blocks_of[h]))
            if item.offset + item.length <= start + n:  # its last placeholder computed now
                self._release(request.request_id, h)
                held.discard(h)
        return spans

    def _hold(self, rid: str, item: MultiModalItem) -> None:
        h = item.hash
        if h in self.blocks_of:
            self.hits += 1
            self.released.pop(h, None)
        else:
            self.misses += 1
            need = self.blocks_for(item.length)
            while len(self.free_blocks) < need:
                victim = next(v for v in self.released if v not in self.step_used)
                del self.released[victim]
                self.free_blocks.extend(reversed(self.blocks_of.pop(victim)))
            blocks = [self.free_blocks.pop() for _ in range(need)]
            self.blocks_of[h] = blocks
            self.step_inputs.append(EncoderInput(blocks, item.values, item.embeds))
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
        self._empty()

    def take_step(self) -> list[EncoderInput]:
        """The step's images to encode; the next step starts afresh."""
        inputs = self.step_inputs
        self._begin()
        return inputs

    @property
    def num_held(self) -> int:
        """Images held by requests (0 when idle: nothing leaks)."""
        return len(self.holders)

    @property
    def num_held_blocks(self) -> int:
        """Blocks of the images requests hold."""
        return sum(len(self.blocks_of[h]) for h in self.holders)

    def check_invariants(self) -> None:
        blocks = sorted([*(b for bs in self.blocks_of.values() for b in bs), *self.free_blocks])
        assert blocks == list(range(self.num_blocks)), blocks
        assert set(self.released) | set(self.holders) == set(self.blocks_of)
        assert not set(self.released) & set(self.holders)
