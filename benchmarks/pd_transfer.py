"""Prefill/decode disaggregation on one machine: the decode engine's time to first token when it
pulls a prompt's KV blocks from a prefill engine (`--kv-transfer-config`), against computing
the prompt itself, in one process and one run; and that both give the same tokens.

    .venv/bin/python benchmarks/pd_transfer.py [--model smollm2-135m] [--lengths 512 2048] \
        [--repeats 3] [--json PATH]

Two engine cores (a kv_producer and a kv_consumer) are driven step by step in this process, as
`tests/test_pd_disaggregation.py` drives them. For each prompt length, each repeat takes fresh
random token ids: the decoder computes them alone (its cache reset), then the prefiller
prefills them (`max_tokens` 1, `do_remote_decode`) and the decoder, given the prefiller's
params, pulls the full blocks and decodes. Timed on the decoder, from handing it the request to
its first token: alone, the whole prefill; disaggregated, the pull (a ZeroMQ round trip over
the loopback, the prefiller's device read included), landing in the host tier, the copy to the
device and the tail's prefill. The prefiller's own prefill is reported beside them.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

import numpy as np

from jaxllm.config import EngineConfig
from jaxllm.engine.core import EngineCore
from jaxllm.engine.request import Request
from jaxllm.sampling_params import SamplingParams


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(args, role: str) -> EngineCore:
    transfer = {"kv_connector": "JaxTransferConnector", "kv_role": role, "kv_port": _port()}
    config = EngineConfig.create(
        args.model,
        max_model_len=max(args.lengths) + 64,
        max_num_seqs=4,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_transfer_config=transfer,
    )
    return EngineCore.from_config(config)


def _request(rid: str, prompt: list[int], max_tokens: int, params: dict | None) -> Request:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, sp, eos_token_ids=(), max_tokens=max_tokens, seed=0,
                   kv_transfer_params=params)  # fmt: skip


def _run(engine: EngineCore, rid: str, *serving: EngineCore) -> tuple[list[int], float, dict]:
    """Steps `engine` until `rid` finishes: (its tokens, seconds to its first token, its last
    update's kv_transfer_params)."""
    start, first, tokens = time.perf_counter(), None, []
    while True:
        for other in serving:
            other.poll_transfers()
        updates = engine.poll_transfers()
        if engine.has_unfinished_requests():
            updates += engine.step()
        for u in updates:
            if u.request_id != rid:
                continue
            if u.new_token_ids and first is None:
                first = time.perf_counter() - start
            tokens += u.new_token_ids
            if u.finish_reason is not None:
                engine.drain()
                return tokens, first, u.kv_transfer_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    producer, consumer = _engine(args, "kv_producer"), _engine(args, "kv_consumer")
    compiled = producer.stats().num_compilations, consumer.stats().num_compilations
    vocab = consumer.model_config.vocab_size
    rng = np.random.default_rng(0)
    rows = []
    for length in args.lengths:
        alone, pulled, prefill, same = [], [], [], True
        for r in range(args.repeats + 1):  # the first round warms the paths up, untimed
            prompt = rng.integers(10, vocab - 10, length).tolist()
            assert consumer.reset_prefix_cache() and producer.reset_prefix_cache()
            consumer.add_request(_request(f"a{length}-{r}", prompt, args.max_tokens, None))
            ref, t_alone, _ = _run(consumer, f"a{length}-{r}")
            assert consumer.reset_prefix_cache()
            producer.add_request(_request(f"p{length}-{r}", prompt, 1, {"do_remote_decode": True}))  # fmt: skip
            _, t_prefill, params = _run(producer, f"p{length}-{r}")
            before = consumer.stats()
            consumer.add_request(_request(f"d{length}-{r}", prompt, args.max_tokens, params))
            got, t_pulled, _ = _run(consumer, f"d{length}-{r}", producer)
            after = consumer.stats()
            same &= got == ref
            if r:
                alone.append(t_alone)
                pulled.append(t_pulled)
                prefill.append(t_prefill)
        row = {
            "prompt_tokens": length,
            "ttft_alone_s": statistics.median(alone),
            "ttft_pulled_s": statistics.median(pulled),
            "speedup": statistics.median(alone) / statistics.median(pulled),
            "prefiller_prefill_s": statistics.median(prefill),
            "pulled_tokens": after.external_prefix_cache_hits - before.external_prefix_cache_hits,
            "pulled_mib": (after.kv_transfer_received_bytes - before.kv_transfer_received_bytes)
            / 2**20,  # fmt: skip
            "same_tokens": same,
        }
        rows.append(row)
        print(json.dumps(row))
    result = {
        "model": args.model,
        "repeats": args.repeats,
        "rows": rows,
        "compiled_after_warmup": [
            producer.stats().num_compilations - compiled[0],
            consumer.stats().num_compilations - compiled[1],
        ],
    }
    producer.shutdown()
    consumer.shutdown()
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
