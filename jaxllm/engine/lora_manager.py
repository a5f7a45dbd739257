"""Which LoRA adapters the engine keeps read in host memory and which sit in the device's
slots (`jaxllm.worker.lora_slots`), for the scheduler. An adapter is known by its
`lora_int_id` (vLLM's identity: a server gives each adapter it loads a new one).

A request's adapter is read when the request arrives (so a bad adapter fails that request and
nothing else); at most `max_cpu_loras` stay read (least recently used dropped, read again
from their files when needed). A request admitted to the batch pins its adapter's slot until
it finishes or is preempted; an adapter not on the device takes an unpinned slot (least
recently used first), and a request whose adapter finds none waits: a step never holds more
than `max_loras` distinct adapters.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable

from jaxllm.lora import LoRAAdapter, LoRARequest


class LoRAManager:
    def __init__(
        self,
        num_slots: int,
        max_cpu_loras: int,
        load: Callable[[LoRARequest], LoRAAdapter],
        put: Callable[[int, LoRAAdapter], None],
    ):
        """`load` reads an adapter's files (ValueError when it cannot be served); `put` places
        an adapter in a device slot."""
        self.num_slots = num_slots
        self.max_cpu_loras = max_cpu_loras
        self._load, self._put = load, put
        self._host: OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = OrderedDict()
        self.slots: list[LoRARequest | None] = [None] * num_slots
        self._last_used: list[int] = [0] * num_slots
        self._clock = 0
        self.pins: Counter[int] = Counter()  # running requests per adapter id

    def prepare(self, lora: LoRARequest) -> None:
        """Reads `lora`'s files if they are not read; ValueError if they cannot be served, or
        if its id is another adapter's."""
        self._adapter(lora)

    def _adapter(self, lora: LoRARequest) -> LoRAAdapter:
        known = self._host.get(lora.lora_int_id)
        if known is None:
            for held in self.slots:
                if held is not None and held.lora_int_id == lora.lora_int_id:
                    known = (held, None)
        if known is not None and known[0] != lora:
            raise ValueError(
                f"lora_int_id {lora.lora_int_id} is adapter {known[0].lora_name!r} "
                f"({known[0].lora_path}); give {lora.lora_name!r} another id"
            )
        entry = self._host.get(lora.lora_int_id)
        if entry is None:
            entry = self._host[lora.lora_int_id] = (lora, self._load(lora))
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(lora.lora_int_id)
        return entry[1]

    def _slot_of(self, lora_id: int) -> int | None:
        for i, held in enumerate(self.slots):
            if held is not None and held.lora_int_id == lora_id:
                return i
        return None

    def can_acquire(self, lora: LoRARequest) -> bool:
        """Whether a request with adapter `lora` could be admitted now."""
        if self._slot_of(lora.lora_int_id) is not None:
            return True
        return any(held is None or not self.pins[held.lora_int_id] for held in self.slots)

    def acquire(self, lora: LoRARequest) -> int:
        """The slot of adapter `lora`, placed there if it is not, pinned for one request."""
        self._clock += 1
        slot = self._slot_of(lora.lora_int_id)
        if slot is None:
            free = [
                i
                for i, held in enumerate(self.slots)
                if held is None or not self.pins[held.lora_int_id]
            ]
            if not free:
                raise RuntimeError(f"no LoRA slot for {lora.lora_name!r}: every one is in use")
            slot = min(free, key=lambda i: (self.slots[i] is not None, self._last_used[i]))
            self._put(slot, self._adapter(lora))
            self.slots[slot] = lora
        self.pins[lora.lora_int_id] += 1
        self._last_used[slot] = self._clock
        return slot

    def release(self, lora: LoRARequest) -> None:
        self.pins[lora.lora_int_id] -= 1
        if self.pins[lora.lora_int_id] <= 0:
            del self.pins[lora.lora_int_id]

    def running(self) -> list[str]:
        """The names of the adapters running requests use."""
        return sorted(held.lora_name for held in self.slots if held and self.pins[held.lora_int_id])
