"""Prometheus metrics under vLLM's names with a `jaxllm:` prefix (speculative decoding's
under vLLM's `vllm:` ones).

Engine-side figures (running/waiting requests, KV usage, prefix cache, preemptions,
compilations) are read from the core's latest `Stats` at scrape time; request-side ones
(tokens, finish reasons, latencies) are recorded by the server as requests run.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class _EngineCollector:
    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        stats = self.engine().stats if self.engine() is not None else None
        if stats is None:
            return
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"jaxllm:{name}", doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"jaxllm:{name}", doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to run.", stats.num_waiting)
        yield gauge("kv_cache_usage_perc", "Share of KV pages in use (0-1).", stats.kv_cache_usage)
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )  # fmt: skip
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits
        )
        yield counter("num_preemptions", "Requests preempted.", stats.num_preemptions)
        yield counter(
            "num_compilations", "XLA programs compiled or loaded from the cache.",
            stats.num_compilations,
        )  # fmt: skip
        # Speculative decoding, under vLLM's own names (dashboards read these as they are).
        for name, doc, value in (
            ("num_drafts", "Verifications of draft tokens (a request's drafts in a step).",
             stats.spec_num_drafts),
            ("num_draft_tokens", "Draft tokens verified.", stats.spec_num_draft_tokens),
            ("num_accepted_tokens", "Draft tokens accepted.", stats.spec_num_accepted_tokens),
        ):  # fmt: skip
            c = CounterMetricFamily(f"vllm:spec_decode_{name}", doc, labels=labels)
            c.add_metric(values, value)
            yield c
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position among a request's drafts.",
            labels=[*labels, "position"],
        )
        for position, value in enumerate(stats.spec_num_accepted_per_pos):
            per_pos.add_metric([*values, str(position)], value)
        yield per_pos


class Metrics:
    def __init__(self, engine_getter, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine_getter, model_name))
        labels = ["model_name"]
        self.model_name = model_name

        def counter(name, doc, extra=()):
            return Counter(f"jaxllm:{name}", doc, [*labels, *extra], registry=self.registry)

        def histogram(name, doc):
            return Histogram(
                f"jaxllm:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=self.registry
            )

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time requests waited before they first ran."
        )

    def observe_step(self, out) -> None:
        """AsyncLLM's per-step hook: the queue times of the requests the step admitted."""
        for seconds in out.queue_times:
            self.queue_time.labels(self.model_name).observe(seconds)

    def record_request(
        self,
        *,
        prompt_tokens: int,
        output_tokens: int,
        finish_reason: str | None,
        arrival: float,
        token_times: list[float],
        end: float,
    ) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(output_tokens)
        if finish_reason is not None:
            self.request_success.labels(m, finish_reason).inc()
        if token_times:
            self.ttft.labels(m).observe(token_times[0] - arrival)
            for a, b in zip(token_times, token_times[1:], strict=False):
                self.itl.labels(m).observe(b - a)
        self.e2e.labels(m).observe(end - arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
