"""KV-cache events in vLLM's format and vLLM's block hashes (`--kv-events-config`,
`--prefix-caching-hash-algo`).

The subscriber here is written from vLLM's published format, not from our module: msgspec
structs shaped as vLLM's example subscriber (`examples/online_serving/kv_events_subscriber.py`)
declares them, a SUB socket for the three-frame messages and a REQ socket for replay. Block
hashes are recomputed from the token ids by this file's own sha256_cbor (cbor2 + hashlib, the
seed as vLLM takes it), never by the engine's code.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import socket
import time
from typing import Any

import cbor2
import msgspec
import pytest
import zmq

from jaxllm import LLM, SamplingParams
from jaxllm.config.kv_events import KVEventsConfig
from jaxllm.engine.block_hashing import BlockHasher
from jaxllm.engine.host_blocks import HostBlockPool
from jaxllm.engine.kv_cache_manager import KVCacheManager
from tests.helpers import admit, book_request


# --- vLLM's format, as its example subscriber declares it ------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# vLLM's newer form (since mid-2026): events as maps tagged under "type".
class MapStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[MapStored]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def vllm_hashes(
    token_ids: list[int], block_size: int, algo: str = "sha256_cbor", extra: tuple | None = None
) -> list[int]:
    """Each full block's hash as vLLM's events carry it: sha256 over (parent, tokens, extra
    keys), chained from sha256 of the seed, the last 8 bytes as an unsigned integer."""
    if algo == "sha256_cbor":
        digest = lambda x: hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()  # noqa: E731
    else:
        digest = lambda x: hashlib.sha256(pickle.dumps(x, protocol=5)).digest()  # noqa: E731
    parent = digest(os.environ.get("PYTHONHASHSEED", "vllm-none-hash"))
    out = []
    for i in range(len(token_ids) // block_size):
        parent = digest((parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), extra))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _roundtrip(events) -> list:
    """The events through the wire format and vLLM's decoder."""
    from jaxllm.engine.kv_events import KVEventBatch as Ours

    payload = msgspec.msgpack.encode(Ours(1.0, events, 0))
    return DECODER.decode(payload).events


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
def test_block_hashes_are_vllms(algo):
    """The engine's block hashes equal vLLM's recomputed from the token ids, for both of
    vLLM's sha256 algorithms (prompt and decode blocks alike)."""
    tokens = list(range(100, 137))
    kv = KVCacheManager(num_pages=16, page_size=8, hasher=BlockHasher(algo), events=True)
    admit(kv, book_request("a", tokens))
    (stored,) = _roundtrip(kv.take_events())
    assert stored.block_hashes == vllm_hashes(tokens, 8, algo)


def test_an_adapters_blocks_carry_its_name():
    """A LoRA request's blocks: vLLM's extra key (the adapter's name) in every block's hash,
    and the adapter in the event (its id and, in vLLM's newer fields, its name and the extra
    keys)."""
    from jaxllm.engine.kv_events import KVEventBatch as Ours
    from jaxllm.lora import LoRARequest

    kv = KVCacheManager(num_pages=8, page_size=4, hasher=BlockHasher("sha256_cbor"), events=True)
    req = book_request("a", list(range(12)))
    req.lora = LoRARequest("sql", 3, "/adapters/sql")
    admit(kv, req)
    events = kv.take_events()
    (stored,) = _roundtrip(events)
    assert stored.block_hashes == vllm_hashes(list(range(12)), 4, extra=("sql",))
    assert stored.lora_id == 3
    full = msgspec.msgpack.decode(msgspec.msgpack.encode(Ours(1.0, events)))[1][0]
    assert full[7:10] == ["sql", [["sql"]] * 3, 0]  # lora_name, extra_keys, group_idx


def test_an_adapter_reloaded_under_its_name_does_not_hit_the_old_ones_blocks():
    """vLLM's hash names an adapter by its name; the cache keys by the loaded adapter, so a
    name loaded again from another checkpoint (a new adapter id) recomputes its prefixes,
    while its events carry the same vLLM hashes."""
    from jaxllm.lora import LoRARequest

    kv = KVCacheManager(num_pages=8, page_size=4, hasher=BlockHasher("sha256_cbor"), events=True)
    old = book_request("a", list(range(12)))
    old.lora = LoRARequest("sql", 1, "/adapters/sql-v1")
    admit(kv, old)
    new = book_request("b", list(range(12)))
    new.lora = LoRARequest("sql", 2, "/adapters/sql-v2")
    assert kv.get_computed_blocks(new) == (None, 0)
    same = book_request("c", list(range(12)))
    same.lora = LoRARequest("sql", 1, "/adapters/sql-v1")
    assert kv.get_computed_blocks(same)[1] == 8
    admit(kv, new)
    first, second = _roundtrip(kv.take_events())
    assert first.block_hashes == second.block_hashes


def test_a_cache_salt_keys_the_first_block():
    """vLLM's cache_salt: an extra key of a prompt's first block (so of the whole chain);
    requests share cached prefixes only under the same salt."""
    kv = KVCacheManager(num_pages=16, page_size=4, hasher=BlockHasher("sha256_cbor"), events=True)
    tokens = list(range(12))
    a = book_request("a", tokens, cache_salt="t1")
    admit(kv, a)
    (stored,) = _roundtrip(kv.take_events())
    digest = lambda x: hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()  # noqa: E731
    parent = digest(os.environ.get("PYTHONHASHSEED", "vllm-none-hash"))
    first = digest((parent, tuple(tokens[:4]), ("t1",)))
    second = digest((first, tuple(tokens[4:8]), None))
    assert stored.block_hashes[:2] == [int.from_bytes(h[-8:], "big") for h in (first, second)]
    for rid, salt, hit in (("b", "t2", 0), ("c", None, 0), ("d", "t1", 8)):
        req = book_request(rid, tokens, cache_salt=salt)
        assert kv.get_computed_blocks(req)[1] == hit, salt


def test_events_tell_the_prefix_caches_changes():
    """Admitted prompts: BlockStored with parent links and token ids (a shared prefix is not
    stored twice); freed blocks evicted for new ones: BlockRemoved, exactly the stored
    hashes; a reset: AllBlocksCleared."""
    kv = KVCacheManager(num_pages=6, page_size=4, hasher=BlockHasher("sha256_cbor"), events=True)
    a = [*range(10)]
    admit(kv, book_request("a", a))
    b = [*range(8), 50, 51, 52, 53, 54]
    admit(kv, book_request("b", b))
    first, second = _roundtrip(kv.take_events())
    ha, hb = vllm_hashes(a, 4), vllm_hashes(b, 4)
    assert isinstance(first, BlockStored) and first.medium == "GPU"
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == (ha, None, a[:8])
    assert first.block_size == 4 and first.lora_id is None
    # b's first two blocks were hits: only its third is new, under its second block.
    assert (second.block_hashes, second.parent_block_hash, second.token_ids) == (
        hb[2:],
        hb[1],
        b[8:12],
    )
    for rid in ("a", "b"):
        kv.free(book_request(rid, []))
    admit(kv, book_request("c", list(range(1000, 1024))))  # 6 blocks: every cached one evicted
    events = _roundtrip(kv.take_events())
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(ha + hb[2:])
    assert all(e.medium == "GPU" for e in events)
    kv.free(book_request("c", []))
    assert kv.reset_prefix_cache()
    assert [type(e) for e in _roundtrip(kv.take_events())] == [AllBlocksCleared]


def test_the_host_tier_is_a_medium_of_its_own():
    """A block evicted to the host tier: BlockStored in "CPU" (same hash, parent, tokens) with
    its BlockRemoved in "GPU"; evicted from the host too: BlockRemoved in "CPU"."""
    kv = KVCacheManager(
        num_pages=2, page_size=4, host=HostBlockPool(1), hasher=BlockHasher("sha256_cbor"),
        events=True,
    )  # fmt: skip
    a = list(range(8))
    admit(kv, book_request("a", a))  # two full blocks
    kv.free(book_request("a", []))
    kv.take_events()
    h = vllm_hashes(a, 4)
    admit(kv, book_request("c", list(range(50, 58))))  # both a's blocks evicted, one host slot
    events = _roundtrip(kv.take_events())
    cpu = [(type(e).__name__, e.block_hashes) for e in events if e.medium == "CPU"]
    gpu_removed = [x for e in events if e.medium == "GPU" and isinstance(e, BlockRemoved)
                   for x in e.block_hashes]  # fmt: skip
    assert sorted(gpu_removed) == sorted(h)
    assert cpu == [
        ("BlockStored", [h[1]]),  # the last freed first (the tail), into the one slot
        ("BlockRemoved", [h[1]]),  # then pushed out by the head
        ("BlockStored", [h[0]]),
    ]
    head = next(e for e in events if e.medium == "CPU" and e.block_hashes == [h[0]])
    assert (head.parent_block_hash, head.token_ids) == (None, a[:4])


def test_the_map_encoding_is_vllms_newer_form():
    """`"encoding": "map"`: each event a map with its tag under "type", as vLLM writes them
    since mid-2026 (structs without array_like decode it), the batch still an array."""
    from jaxllm.engine.kv_events import BlockStored as OurStored
    from jaxllm.engine.kv_events import KVEventBatch as Ours
    from jaxllm.engine.kv_events import encode_batch

    event = OurStored([7], None, [1, 2], 2, None, "GPU", None, None, 0)
    batch = msgspec.msgpack.decode(encode_batch(Ours(1.5, [event], 0), "map"), type=MapBatch)
    assert batch.events == [MapStored([7], None, [1, 2], 2, None, "GPU", None, 0)]
    assert batch.data_parallel_rank == 0


def test_config_errors_name_the_field():
    for bad, field in [
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
        ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps"),
        ('{"enable_kv_cache_events": true, "endpoint": "5557"}', "endpoint"),
        ('{"enable_kv_cache_events": true, "bogus": 1}', "bogus"),
        ("not json", "JSON"),
    ]:
        with pytest.raises(ValueError, match=field):
            KVEventsConfig.parse(bad)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_engine_publishes_to_a_vllm_subscriber(tiny_model_dir):
    """A served engine's events over ZeroMQ, read by a subscriber of vLLM's format: the
    prompt's blocks stored with their vLLM hashes and tokens, chained by parents; a reset
    cleared; and a replay from sequence 0 returns every batch, then the end marker."""
    pub, rep = _free_port(), _free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{rep}",
        "topic": "kv@pod-0@tiny",
    }
    llm = LLM(tiny_model_dir, max_model_len=128, num_pages=64, max_num_seqs=4, page_size=16,
              kv_events_config=config, prefix_caching_hash_algo="sha256_cbor",
              skip_warmup=True)  # fmt: skip
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv@")
    time.sleep(0.5)  # a late subscriber misses what came before (replay covers that)
    try:
        prompt = [5 + i % 200 for i in range(40)]
        out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
        tokens = prompt + list(out[0].outputs[0].token_ids)
        assert llm.reset_prefix_cache()
        batches = []
        while sub.poll(2000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@pod-0@tiny"
            batches.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
            if isinstance(batches[-1][1].events[-1], AllBlocksCleared):
                break
        seqs = [s for s, _ in batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        events = [e for _, b in batches for e in b.events]
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert all(e.medium == "GPU" and e.block_size == 16 for e in stored)
        hashes = [h for e in stored for h in e.block_hashes]
        assert hashes == vllm_hashes(tokens, 16)[: len(hashes)] and len(hashes) >= 2
        assert [t for e in stored for t in e.token_ids] == tokens[: 16 * len(hashes)]
        first = 0
        for e in stored:  # each event's parent: the block before its first
            assert e.parent_block_hash == (hashes[first - 1] if first else None)
            first += len(e.block_hashes)
        assert isinstance(events[-1], AllBlocksCleared)

        # Replay from sequence 0 (a DEALER: the ROUTER answers with one message per batch).
        replay = ctx.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{rep}")
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while replay.poll(2000):
            empty, seq, payload = replay.recv_multipart()
            assert empty == b""
            if not payload:
                assert seq == (-1).to_bytes(8, "big", signed=True)
                break
            replayed.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        else:
            raise AssertionError("no end-of-replay marker")
        assert [s for s, _ in replayed] == list(range(seqs[-1] + 1))
        assert [b.events for _, b in replayed][-len(batches) :] == [b.events for _, b in batches]
        replay.close(linger=0)
    finally:
        sub.close(linger=0)
        ctx.term()
        llm.engine.shutdown()
