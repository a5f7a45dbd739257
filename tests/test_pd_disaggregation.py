"""Prefill/decode disaggregation (`--kv-transfer-config`, `jaxllm.engine.kv_transfer`): a
producer engine prefills and holds a request's blocks, a consumer engine pulls them over
ZeroMQ and decodes. Two engine cores in this process, driven step by step; the servers and the
proxy over HTTP are `test_pd_servers.py`'s."""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest

from jaxllm.config import EngineConfig
from jaxllm.config.kv_transfer import KVTransferConfig, check_kv_transfer_params
from jaxllm.engine.core import EngineCore
from jaxllm.engine.core_outputs import FinishReason
from jaxllm.engine.request import Request
from tests.helpers import book_request

ENGINE = dict(max_model_len=256, num_pages=64, max_num_seqs=8, max_num_batched_tokens=64)
PAGE = 16
# Lengths: blocks and a tail, shorter than a block, exactly four blocks, a long one.
PROMPTS = [[(7 * i + 3 * j) % 200 + 5 for j in range(n)] for i, n in enumerate((70, 10, 64, 150, 33))]  # fmt: skip
MAX_TOKENS = 10


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(model, role: str, **extra) -> EngineCore:
    transfer = {"kv_connector": "JaxTransferConnector", "kv_role": role, "kv_port": _port(),
                "kv_connector_extra_config": {"pull_timeout_s": 5}}  # fmt: skip
    config = EngineConfig.create(str(model), kv_transfer_config=transfer, **ENGINE, **extra)
    return EngineCore.from_config(config)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    producer, consumer = _engine(tiny_model_dir, "kv_producer"), _engine(tiny_model_dir, "kv_consumer")  # fmt: skip
    yield producer, consumer
    producer.shutdown()
    consumer.shutdown()


def _request(rid: str, prompt: list[int], max_tokens: int, params: dict | None) -> Request:
    return book_request(rid, prompt, max_tokens, kv_transfer_params=params)


def _run(engine: EngineCore, *serving: EngineCore, ids: set[str]) -> dict[str, list]:
    """Steps `engine` (and lets the `serving` engines answer pulls) until requests `ids` are
    finished; each one's updates."""
    out: dict[str, list] = {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for other in serving:
            other.poll_transfers()
        updates = engine.poll_transfers()
        if engine.has_unfinished_requests():
            updates += engine.step()
        else:
            time.sleep(0.002)  # a pull under way
        for u in updates:
            out.setdefault(u.request_id, []).append(u)
        if all(out.get(r) and out[r][-1].finish_reason for r in ids):
            engine.drain()
            return out
    raise AssertionError(f"requests {ids - set(out)} did not finish")


def _tokens(updates) -> list[int]:
    return [t for u in updates for t in u.new_token_ids]


def _prefill(producer: EngineCore, prompts: dict[str, list[int]]) -> dict[str, dict]:
    """The producer's answers for `prompts` sent with do_remote_decode: the params each
    decoder is sent with."""
    for rid, prompt in prompts.items():
        producer.add_request(_request(rid, prompt, 1, {"do_remote_decode": True}))
    out = _run(producer, ids=set(prompts))
    return {rid: out[rid][-1].kv_transfer_params for rid in prompts}


def _reference(consumer: EngineCore) -> list[list[int]]:
    """The prompts decoded by the consumer alone (its cache reset after)."""
    for i, p in enumerate(PROMPTS):
        consumer.add_request(_request(f"ref{i}", p, MAX_TOKENS, None))
    out = _run(consumer, ids={f"ref{i}" for i in range(len(PROMPTS))})
    assert consumer.reset_prefix_cache()
    return [_tokens(out[f"ref{i}"]) for i in range(len(PROMPTS))]


def test_the_decoder_pulls_every_full_block_and_decodes_the_same(engines):
    producer, consumer = engines
    expected = _reference(consumer)
    compiled = producer.stats().num_compilations, consumer.stats().num_compilations
    params = _prefill(producer, {f"p{i}": p for i, p in enumerate(PROMPTS)})
    p = params["p0"]
    assert p["do_remote_prefill"] is True and p["do_remote_decode"] is False
    assert (p["remote_host"], p["remote_port"]) == ("127.0.0.1", producer.kv_transfer.port)
    assert p["remote_engine_id"] == producer.kv_transfer.engine_id
    assert [len(params[f"p{i}"]["remote_block_ids"]) for i in range(len(PROMPTS))] == [len(q) // PAGE for q in PROMPTS]  # fmt: skip
    # Held until pulled: every prompt with a full block.
    assert producer.stats().kv_transfer_held == sum(len(q) >= PAGE for q in PROMPTS)
    producer.scheduler.kv.check_invariants()

    before = consumer.stats()
    for i, prompt in enumerate(PROMPTS):
        consumer.add_request(_request(f"d{i}", prompt, MAX_TOKENS, params[f"p{i}"]))
    out = _run(consumer, producer, ids={f"d{i}" for i in range(len(PROMPTS))})
    assert [_tokens(out[f"d{i}"]) for i in range(len(PROMPTS))] == expected
    after = consumer.stats()

    # The decoder computed none of a prompt's full blocks but the one a prompt of whole
    # blocks must recompute for its last token's logits: only the tails, and the decodes.
    pulled = sum((len(q) - 1) // PAGE * PAGE for q in PROMPTS)
    assert after.external_prefix_cache_hits - before.external_prefix_cache_hits == pulled
    assert after.prefix_cache_hits - before.prefix_cache_hits == pulled
    computed = after.num_scheduled_tokens - before.num_scheduled_tokens
    assert computed == sum(len(q) for q in PROMPTS) - pulled + len(PROMPTS) * (MAX_TOKENS - 1)
    assert after.kv_transfer_received_blocks - before.kv_transfer_received_blocks == pulled // PAGE  # fmt: skip
    assert after.kv_transfer_failures == before.kv_transfer_failures
    # Released once pulled; nothing compiled on either side.
    assert producer.stats().kv_transfer_held == 0
    assert producer.scheduler.kv.num_free_blocks == producer.scheduler.kv.num_pages
    assert (producer.stats().num_compilations, consumer.stats().num_compilations) == compiled
    producer.scheduler.kv.check_invariants()
    consumer.scheduler.kv.check_invariants()
    assert consumer.reset_prefix_cache() and producer.reset_prefix_cache()


def test_a_failed_pull_is_a_recompute(engines):
    """The prefiller gone, the blocks released already, or the blocks of another prompt: the
    decoder computes the prompt itself, with the same tokens. A decoder with another prompt
    does not take the right one's blocks."""
    producer, consumer = engines
    expected = _reference(consumer)
    params = _prefill(producer, {"q0": PROMPTS[0], "q3": PROMPTS[3]})

    def decode(rid, i, p):
        failures = consumer.stats().kv_transfer_failures
        consumer.add_request(_request(rid, PROMPTS[i], MAX_TOKENS, p))
        out = _run(consumer, producer, ids={rid})
        assert _tokens(out[rid]) == expected[i], rid
        assert consumer.reset_prefix_cache()
        return consumer.stats().kv_transfer_failures - failures

    # Another prompt with q0's params: refused by the prefiller, which keeps q0's blocks.
    assert decode("other", 3, params["q0"]) == 1
    assert producer.stats().kv_transfer_held == 2
    assert decode("right", 0, params["q0"]) == 0
    assert decode("again", 0, params["q0"]) == 1  # released once pulled
    transfer = consumer.kv_transfer
    transfer.config = dataclasses.replace(transfer.config, kv_connector_extra_config={"pull_timeout_s": 0.3})  # fmt: skip
    try:
        gone = dict(params["q3"], remote_port=_port())  # nobody there
        assert decode("gone", 3, gone) == 1
        # vLLM's "fail" policy: the request fails instead.
        transfer.config = dataclasses.replace(transfer.config, kv_load_failure_policy="fail")
        consumer.add_request(_request("failed", PROMPTS[3], MAX_TOKENS, gone))
        out = _run(consumer, ids={"failed"})
        assert out["failed"][-1].finish_reason == FinishReason.ERROR
    finally:
        transfer.config = dataclasses.replace(transfer.config, kv_load_failure_policy="recompute", kv_connector_extra_config={"pull_timeout_s": 5})  # fmt: skip
    assert decode("q3", 3, params["q3"]) == 0
    assert producer.stats().kv_transfer_held == 0
    consumer.scheduler.kv.check_invariants()
    assert producer.reset_prefix_cache()


def test_limits_on_both_sides(engines):
    """A decoder pulls only from its allowed prefillers (when it lists them); a prefiller holds
    at most its share of the pool for decoders. Past either, the decoder computes the prompt."""
    producer, consumer = engines
    expected = _reference(consumer)
    params = _prefill(producer, {"l3": PROMPTS[3]})
    transfer = consumer.kv_transfer
    transfer._allowed = {"10.0.0.9"}  # kv_connector_extra_config.allowed_prefillers
    try:
        failures = consumer.stats().kv_transfer_failures
        consumer.add_request(_request("l3", PROMPTS[3], MAX_TOKENS, params["l3"]))
        assert not transfer.num_pulling  # not even tried
        out = _run(consumer, producer, ids={"l3"})
        assert _tokens(out["l3"]) == expected[3]
        assert consumer.stats().kv_transfer_failures == failures + 1
    finally:
        transfer._allowed = None
    assert consumer.reset_prefix_cache()
    # Release the hold (a pull of what it has), then hold no more than 8 blocks.
    consumer.add_request(_request("l3b", PROMPTS[3], MAX_TOKENS, params["l3"]))
    _run(consumer, producer, ids={"l3b"})
    assert producer.stats().kv_transfer_held == 0
    producer.kv_transfer._max_held_blocks = 8
    try:
        capped = _prefill(producer, {"c0": PROMPTS[0], "c3": PROMPTS[3]})
    finally:
        producer.kv_transfer._max_held_blocks = producer.scheduler.kv.num_pages // 2
    assert len(capped["c0"]["remote_block_ids"]) == 4  # held
    assert capped["c3"]["remote_block_ids"] == []  # 9 more would pass 8: not held
    assert producer.stats().kv_transfer_held == 1
    producer.kv_transfer.release_all()
    assert consumer.reset_prefix_cache() and producer.reset_prefix_cache()


def test_unpulled_blocks_are_released_after_the_hold_timeout(engines):
    producer, _ = engines
    transfer = producer.kv_transfer
    config = transfer.config
    transfer.config = dataclasses.replace(config, kv_connector_extra_config={"hold_timeout_s": 0.05})  # fmt: skip
    try:
        _prefill(producer, {"late": PROMPTS[3]})
        assert producer.stats().kv_transfer_held == 1
        assert producer.scheduler.kv.num_free_blocks < producer.scheduler.kv.num_pages
        time.sleep(0.1)
        producer.poll_transfers()
    finally:
        transfer.config = config
    assert producer.stats().kv_transfer_held == 0
    assert producer.scheduler.kv.num_free_blocks == producer.scheduler.kv.num_pages
    producer.scheduler.kv.check_invariants()


def test_an_aborted_decode_waits_for_nothing(engines):
    """A request aborted while its blocks are pulled is dropped when they come."""
    producer, consumer = engines
    params = _prefill(producer, {"ab": PROMPTS[3]})
    consumer.add_request(_request("ab", PROMPTS[3], MAX_TOKENS, params["ab"]))
    assert consumer.stats().num_waiting == 1  # waiting for its blocks
    consumer.abort_requests(["ab"])
    deadline = time.monotonic() + 10
    while producer.stats().kv_transfer_held and time.monotonic() < deadline:
        producer.poll_transfers()
        time.sleep(0.005)
    time.sleep(0.05)
    consumer.poll_transfers()
    assert consumer.stats().num_waiting == 0 and not consumer.has_unfinished_requests()
    assert consumer.reset_prefix_cache() and producer.reset_prefix_cache()


def test_config_and_params_errors_name_the_field(tiny_model_dir):
    def config(**transfer):
        return EngineConfig.create("m", kv_transfer_config={"kv_connector": "JaxTransferConnector", "kv_role": "kv_both", **transfer})  # fmt: skip

    with pytest.raises(ValueError, match="kv_role must be one of"):
        config(kv_role="prefill")
    with pytest.raises(ValueError, match="kv_connector must be one of"):
        config(kv_connector="LMCacheConnectorV1")
    with pytest.raises(ValueError, match=r"unknown fields \['kv_rol'\]"):
        config(kv_rol="kv_both")
    with pytest.raises(ValueError, match="kv_port must be a port number"):
        config(kv_port=70000)
    with pytest.raises(ValueError, match="pull_timeout_s must be a positive number"):
        config(kv_connector_extra_config={"pull_timeout_s": 0})
    with pytest.raises(ValueError, match="kv_transfer_config needs prefix caching"):
        EngineConfig.create("m", enable_prefix_caching=False, kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})  # fmt: skip
    # vLLM's NIXL name is served by this transfer; a role gets a host tier by default.
    nixl = config(kv_connector="NixlConnector")
    assert KVTransferConfig.parse(nixl.cache.kv_transfer_config).is_consumer
    assert nixl.cache.host_tier_gib > 0

    assert check_kv_transfer_params({"do_remote_decode": True}) is None
    good = {"do_remote_prefill": True, "remote_host": "10.0.0.2", "remote_port": 14579,
            "remote_request_id": "r", "remote_engine_id": "e", "remote_block_ids": [1, 2]}  # fmt: skip
    assert check_kv_transfer_params(good) is None
    for bad, field in (
        ([1], "kv_transfer_params must be"),
        ({"do_remote_decode": "yes"}, "do_remote_decode must be a boolean"),
        (dict(good, remote_port="80"), "remote_port must be a port number"),
        (dict(good, remote_host=""), "remote_host must be"),
        (dict(good, remote_block_ids=3), "remote_block_ids must be a list"),
    ):
        assert field in check_kv_transfer_params(bad), bad

    from jaxllm import LLM

    with pytest.raises(ValueError, match="kv_transfer_config .* is served by `jaxllm serve`"):
        LLM(tiny_model_dir, kv_transfer_config={"kv_connector": "JaxTransferConnector", "kv_role": "kv_both"}, skip_warmup=True, **ENGINE)  # fmt: skip
