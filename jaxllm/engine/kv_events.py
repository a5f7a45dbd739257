"""KV-cache events in vLLM's wire format (`--kv-events-config`), for prefix-aware routers such as
llm-d's inference scheduler, which keep an index of which engine holds which blocks.

What is published: after each engine step that changed the prefix cache, one `KVEventBatch`
`[ts, events, data_parallel_rank]` whose events are
- `BlockStored`: full blocks that became findable (keyed), with their hashes (in order), the
  hash of the block before the first (None for a prompt's first block), their token ids (all
  of them, concatenated), the block size, the LoRA adapter, and the medium: "GPU" for the
  accelerator's pool (vLLM's name, whatever the chip), "CPU" for the host tier;
- `BlockRemoved`: hashes that stopped being findable in a medium (evicted);
- `AllBlocksCleared`: the prefix cache was reset.
The hashes are vLLM's (`block_hashing.py`) as vLLM puts them in events by default: the digest's
last 8 bytes as an unsigned integer.

The encoding is msgpack through msgspec structs shaped as `vllm.distributed.kv_events`'s:
the batch an array, each event an array tagged by its class name, `[tag, block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
group_idx]` (vLLM up to 0.23, and the decoder in vLLM's example subscriber, which ignores the
trailing fields it does not know). vLLM since mid-2026 writes each event as a map instead
(`{"type": "BlockStored", ...}`); `"encoding": "map"` in the config selects that form.

The transport is vLLM's `ZmqEventPublisher`: a PUB socket sending three frames per batch (the
topic, an 8-byte big-endian sequence number from 0, the payload), bound when the endpoint
names a wildcard host (`tcp://*:5557`, the default) or an ipc/inproc path and connected
otherwise; and with `replay_endpoint` a ROUTER socket that answers a client's 8-byte start
sequence with every buffered batch from there (`buffer_steps` of them are kept), each as
`[seq, payload]`, then `[-1 as 8 bytes, b""]`. A thread owns the sockets; the engine only
queues batches.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec

from jaxllm.config.kv_events import KVEventsConfig

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # the accelerator's pool (vLLM's name for it)
MEDIUM_CPU = "CPU"  # the host tier


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """An event; its class name is its tag."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None:
    """A data-parallel rank's endpoint (vLLM's rule): tcp ports shifted by the rank, inproc
    names suffixed with it."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    raise ValueError(f"kv_events_config: cannot offset endpoint {endpoint!r} for rank {rank}")


class KVEventCollector:
    """The events of the step being built, from the KV cache manager's books."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []

    def stored(
        self,
        hashes: list[int],
        parent: int | None,
        token_ids: list[int],
        *,
        medium: str,
        group: int,
        lora_id: int | None = None,
        lora_name: str | None = None,
        extra_keys: list | None = None,
    ) -> None:
        if hashes:
            self._events.append(
                BlockStored(
                    hashes, parent, token_ids, self.block_size, lora_id, medium, lora_name,
                    extra_keys, group,
                )
            )  # fmt: skip

    def removed(self, hashes: list[int], *, medium: str, group: int) -> None:
        if hashes:
            self._events.append(BlockRemoved(hashes, medium, group))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch, encoding: str = "array") -> bytes:
    """A batch's payload: its events as tagged arrays, or as maps keyed by field with the tag
    under "type" (module doc)."""
    if encoding == "array":
        return _ENCODER.encode(batch)
    events = [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events]
    return _ENCODER.encode([batch.ts, events, batch.data_parallel_rank])


class ZmqEventPublisher:
    """Publishes batches on a thread of its own (module doc)."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        import zmq

        self.rank = data_parallel_rank
        self._encoding = config.encoding
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        if _binds(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        replay = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        if replay is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queues one step's events as a batch (nothing when there are none)."""
        if events and not self._closed:
            self._queue.put(KVEventBatch(time.time(), events, self.rank))

    def _run(self) -> None:
        while True:
            try:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    batch = self._queue.get(timeout=0.1)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                seq, payload = next(self._seq), encode_batch(batch, self._encoding)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:  # the engine goes on without events rather than stopping
                logger.exception("kv events: publishing failed")
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", self.END_SEQ, b""))

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join(timeout=5)


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host or a local transport binds; a named host is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
