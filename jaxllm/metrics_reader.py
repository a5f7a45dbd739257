"""The offline engine's metrics as vLLM's `LLM.get_metrics()` returns them (the types of
`vllm.v1.metrics.reader`): counters, gauges and vectors under the names the server's `/metrics`
uses, read from the engine core's counters.

    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts": drafts = m.value
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos": per_pos = m.values
"""

from __future__ import annotations

import dataclasses

from jaxllm.engine.core_outputs import Stats


@dataclasses.dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclasses.dataclass
class Counter(Metric):
    value: int


@dataclasses.dataclass
class Gauge(Metric):
    value: float


@dataclasses.dataclass
class Vector(Metric):
    """A counter per position (vLLM's `vllm:spec_decode_num_accepted_tokens_per_pos`)."""

    values: list[int]


def metrics_of(stats: Stats, model_name: str, num_speculative_tokens: int) -> list[Metric]:
    """The metrics of one engine core's `stats`."""
    labels = {"model_name": model_name, "engine": "0"}
    spec = stats.spec_decoding
    per_pos = list(spec.num_accepted_per_pos)
    per_pos += [0] * (num_speculative_tokens - len(per_pos))
    out: list[Metric] = [
        Gauge("vllm:num_requests_running", dict(labels), stats.num_running),
        Gauge("vllm:num_requests_waiting", dict(labels), stats.num_waiting),
        Gauge("vllm:kv_cache_usage_perc", dict(labels), stats.kv_cache_usage),
        Counter("vllm:prefix_cache_queries", dict(labels), stats.prefix_cache_queries),
        Counter("vllm:prefix_cache_hits", dict(labels), stats.prefix_cache_hits),
        Counter("vllm:num_preemptions", dict(labels), stats.num_preemptions),
    ]
    if num_speculative_tokens:  # as vLLM: only with speculative decoding
        out += [
            Counter("vllm:spec_decode_num_drafts", dict(labels), spec.num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", dict(labels), spec.num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", dict(labels), spec.num_accepted_tokens),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels), per_pos),
        ]
    out.append(Counter("jaxllm:num_compilations", dict(labels), stats.num_compilations))
    return out
