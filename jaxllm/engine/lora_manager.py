"""Which LoRA adapters the engine knows, which it keeps read in host memory, and which sit in
the device's slots (`jaxllm.worker.lora_slots`), for the scheduler.

An adapter is registered when a request first names it (its files are read then, so a bad
adapter fails that request and nothing else); at most `max_cpu_loras` stay read (least
recently used dropped, read again from their files when needed). A request admitted to the
batch pins its adapter's slot until it finishes or is preempted; an adapter not on the device
takes an unpinned slot (least recently used first), and a request whose adapter finds none
waits: a step never holds more than `max_loras` distinct adapters.
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
        self.registered: dict[str, LoRARequest] = {}
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recent first
        self.slots: list[str | None] = [None] * num_slots
        self._last_used: list[int] = [0] * num_slots
        self._clock = 0
        self.pins: Counter[str] = Counter()  # running requests per adapter

    def register(self, lora: LoRARequest) -> None:
        """Knows `lora` from now on (by name, for the server's `model` field), reading its
        files if they are not read; ValueError if they cannot be served, or if its name is
        taken by another path."""
        known = self.registered.get(lora.lora_name)
        if known is not None and known.lora_path != lora.lora_path:
            raise ValueError(
                f"lora_name {lora.lora_name!r} is already loaded from {known.lora_path}"
            )
        self._adapter(lora)
        self.registered[lora.lora_name] = lora

    def unregister(self, name: str) -> None:
        """Forgets an adapter's name (requests that named it before still run with it)."""
        self.registered.pop(name, None)
        self._host.pop(name, None)
        if name in self.slots and not self.pins[name]:
            self.slots[self.slots.index(name)] = None

    def _adapter(self, lora: LoRARequest) -> LoRAAdapter:
        adapter = self._host.get(lora.lora_name)
        if adapter is None:
            adapter = self._load(lora)
            self._host[lora.lora_name] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(lora.lora_name)
        return adapter

    def can_acquire(self, name: str) -> bool:
        """Whether a request with adapter `name` could be admitted now."""
        return (
            name in self.slots
            or any(not self.pins[n] for n in self.slots if n)
            or (None in self.slots)
        )

    def acquire(self, lora: LoRARequest) -> int:
        """The slot of adapter `lora`, placed there if it is not, pinned for one request."""
        self._clock += 1
        name = lora.lora_name
        if name in self.slots:
            slot = self.slots.index(name)
        else:
            free = [i for i, n in enumerate(self.slots) if n is None or not self.pins[n]]
            if not free:
                raise RuntimeError(f"no LoRA slot for {name!r}: every one is in use")
            slot = min(free, key=lambda i: (self.slots[i] is not None, self._last_used[i]))
            self._put(slot, self._adapter(lora))
            self.slots[slot] = name
        self.pins[name] += 1
        self._last_used[slot] = self._clock
        return slot

    def release(self, name: str) -> None:
        self.pins[name] -= 1
        if self.pins[name] <= 0:
            del self.pins[name]
            if name not in self.registered and name in self.slots:  # unloaded meanwhile
                self.slots[self.slots.index(name)] = None

    def running(self) -> list[str]:
        return sorted(self.pins)
