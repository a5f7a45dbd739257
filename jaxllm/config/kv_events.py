"""vLLM's `KVEventsConfig` (`--kv-events-config`): what `jaxllm.engine.kv_events` publishes
and where. In the config package so that the engine config can check it without importing the
engine."""

from __future__ import annotations

import dataclasses

from jaxllm.config.flags import json_section


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig` (the `--kv-events-config` JSON), plus `encoding`."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; default "zmq" when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: str = "array"  # "array" (vLLM <= 0.23 and its example subscriber) or "map"

    @classmethod
    def parse(cls, value: str | dict | KVEventsConfig | None) -> KVEventsConfig | None:
        """From the flag's JSON (or a dict); a clear error names a bad field."""
        return json_section(cls, value, "kv_events_config")

    def check(self) -> None:
        if self.publisher not in (None, "zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got {self.publisher!r}")  # fmt: skip
        if self.encoding not in ("array", "map"):
            raise ValueError(f"kv_events_config.encoding must be 'array' or 'map', got {self.encoding!r}")  # fmt: skip
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be a positive integer")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"kv_events_config.endpoint must be a ZeroMQ endpoint, got {self.endpoint!r}")  # fmt: skip

    @property
    def enabled(self) -> bool:
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and publisher == "zmq"
