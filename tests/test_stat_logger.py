"""The periodic log lines (`jaxllm.engine.stat_logger`), as vLLM's `LoggingStatLogger` writes
them: on a fake clock, and from the offline engine with `disable_log_stats=False`."""

from __future__ import annotations

import logging

from jaxllm import LLM, SamplingParams
from jaxllm.engine.core_outputs import SpecDecodingStats, Stats
from jaxllm.engine.stat_logger import LoggingStatLogger


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lines_over_each_interval():
    """Throughputs, state and rates over the interval only (counters since start are
    differenced), the speculative line where drafts were verified, nothing before an interval
    has passed, one line after the work stops and then silence."""
    clock = _Clock()
    log = LoggingStatLogger(engine_index=1, interval=10.0, clock=clock)
    start = Stats(prefix_cache_queries=100, prefix_cache_hits=50,
                  spec_decoding=SpecDecodingStats(4, 12, 6, [3, 2, 1]))  # fmt: skip
    log.record(start)
    log.record(
        Stats(
            num_running=3,
            num_waiting=2,
            kv_cache_usage=0.125,
            prefix_cache_queries=300,
            prefix_cache_hits=110,
            spec_decoding=SpecDecodingStats(14, 42, 26, [11, 9, 6]),
        ),  # fmt: skip
        prompt_tokens=1200,
        generation_tokens=340,
    )
    clock.now = 9.0
    assert log.maybe_log() == []
    clock.now = 10.0
    engine, spec = log.maybe_log()
    assert engine == (
        "Engine 001: Avg prompt throughput: 120.0 tokens/s, Avg generation throughput: 34.0 "
        "tokens/s, Running: 3 reqs, Waiting: 2 reqs, GPU KV cache usage: 12.5%, Prefix cache "
        "hit rate: 30.0%"
    )
    assert spec == (
        "SpecDecoding metrics: Mean acceptance length: 3.00, Accepted throughput: 2.00 "
        "tokens/s, Drafted throughput: 3.00 tokens/s, Accepted: 20 tokens, Drafted: 30 tokens, "
        "Per-position acceptance rate: 0.800, 0.700, 0.500, Avg Draft acceptance rate: 66.7%"
    )
    done = Stats(prefix_cache_queries=300, prefix_cache_hits=110,
                 spec_decoding=SpecDecodingStats(14, 42, 26, [11, 9, 6]))  # fmt: skip
    log.record(done, generation_tokens=5)
    clock.now = 20.0
    (line,) = log.maybe_log()  # the last work, nothing running: no speculative line
    assert "Avg generation throughput: 0.5 tokens/s, Running: 0 reqs" in line
    log.record(done)
    clock.now = 30.0
    assert len(log.maybe_log()) == 1  # the idle state, once
    log.record(done)
    clock.now = 40.0
    assert log.maybe_log() == []


def test_offline_only_when_asked(tiny_model_dir, caplog):
    """`LLM` logs no stats by default (vLLM's); with `disable_log_stats=False` it writes the
    lines from the steps it runs, counting each prompt once and every generated token."""
    engine = dict(max_model_len=128, num_pages=32, max_num_seqs=4, max_num_batched_tokens=32)
    assert LLM(tiny_model_dir, **engine)._stat_logger is None
    llm = LLM(tiny_model_dir, disable_log_stats=False, **engine)
    clock = _Clock()
    llm._stat_logger = LoggingStatLogger(interval=10.0, clock=clock)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 30, 12)]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    clock.now = 10.0
    with caplog.at_level(logging.INFO, logger="jaxllm.stats"):
        (line,) = llm._stat_logger.maybe_log()
    assert line.startswith(
        "Engine 000: Avg prompt throughput: 4.9 tokens/s, Avg generation throughput: 2.7 tokens/s"
    ), line
    assert [r.getMessage() for r in caplog.records if r.name == "jaxllm.stats"] == [line]
