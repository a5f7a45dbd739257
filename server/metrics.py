"""Prometheus metrics under vLLM's names, types, labels and buckets (vLLM V1's
`PrometheusStatLogger`), so that dashboards, alert rules, autoscalers and inference gateways
made for vLLM read them as they are; what vLLM has no concept of (compilations, steps, padding,
host time per step, grammar bitmasks) under `jaxllm:`.

Every metric carries vLLM's labels `model_name` and `engine` (one engine core: "0").
- The engine core's state and counters (requests running and waiting, KV cache usage, prefix
  cache, preemptions, speculative decoding, compilations, padding) are read from its latest
  `Stats` at scrape time.
- What the front end measures (tokens, finish reasons, latencies, request sizes) is recorded
  from the `IterationStats` `AsyncLLM` reports after each step (`Metrics.observe`), by vLLM's
  definitions (see `jaxllm.engine.iteration_stats`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxllm.engine.core_outputs import FinishReason

if TYPE_CHECKING:
    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.engine.iteration_stats import IterationStats

LABELS = ("model_name", "engine")

# vLLM's buckets.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                            40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
# Ours: host time per step, from 50 us (a small batch on an accelerator host) to seconds.
_HOST_STEP_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                      0.05, 0.1, 0.25, 0.5, 1.0)  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value`."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class _EngineCollector:
    """The engine core's gauges and counters, from its latest `Stats` at scrape time."""

    def __init__(self, engine: AsyncLLM, values: list[str]):
        self.engine, self.values = engine, values

    def collect(self):
        # One sample per engine core (data-parallel rank), labelled engine="<rank>" as vLLM's.
        model, ranks = self.values[0], list(enumerate(self.engine.engine_stats))
        yield from self._families(model, ranks)

    def _families(self, model: str, ranks: list):
        def family(cls, name, doc, value):
            metric = cls(name, doc, labels=LABELS)
            for rank, stats in ranks:
                metric.add_metric([model, str(rank)], value(stats))
            return metric

        yield family(GaugeMetricFamily, "vllm:num_requests_running",
                     "Number of requests in model execution batches.", lambda s: s.num_running)  # fmt: skip
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting",
                     "Number of requests waiting to be processed.", lambda s: s.num_waiting)  # fmt: skip
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc",
                     "KV-cache usage. 1 means 100 percent usage.", lambda s: s.kv_cache_usage)  # fmt: skip
        yield family(GaugeMetricFamily, "jaxllm:kv_offload_usage_perc",
                     "Host KV tier (kv_offloading_size) usage, in blocks held. 1 means 100 "
                     "percent usage; 0 without the tier.",
                     lambda s: s.kv_offload_blocks / max(s.kv_offload_capacity, 1))  # fmt: skip
        yield family(GaugeMetricFamily, "jaxllm:kv_transfer_held_requests",
                     "Finished requests whose KV blocks this prefiller keeps until their "
                     "decoder pulls them.", lambda s: s.kv_transfer_held)  # fmt: skip
        yield family(GaugeMetricFamily, "jaxllm:encoder_cache_usage_perc",
                     "Encoder cache usage (an image-text model's encoded images on the device), "
                     "in slots held by requests. 1 means 100 percent usage; 0 without images.",
                     lambda s: s.encoder_cache_usage)  # fmt: skip
        for name, doc, value in (
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.",
             "prefix_cache_queries"),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             "prefix_cache_hits"),
            ("vllm:external_prefix_cache_queries",
             "External prefix cache queries from KV connector cross-instance cache sharing, "
             "in terms of number of queried tokens (here: the prompt tokens of requests a "
             "decoder was sent with a prefiller's kv_transfer_params).",
             "external_prefix_cache_queries"),
            ("vllm:external_prefix_cache_hits",
             "External prefix cache hits from KV connector cross-instance cache sharing, in "
             "terms of number of cached tokens (here: the prompt tokens whose KV a decoder "
             "pulled from its prefiller; they count as vllm:prefix_cache_hits too, found in "
             "the host tier they landed in).", "external_prefix_cache_hits"),
            ("jaxllm:kv_transfer_sent_blocks",
             "KV blocks decoders pulled from this engine (a prefiller, kv_transfer_config).",
             "kv_transfer_sent_blocks"),
            ("jaxllm:kv_transfer_received_blocks",
             "KV blocks this engine (a decoder) pulled from prefillers and landed.",
             "kv_transfer_received_blocks"),
            ("jaxllm:kv_transfer_received_bytes", "Bytes of the KV blocks pulled.",
             "kv_transfer_received_bytes"),
            ("jaxllm:kv_transfer_failures",
             "Pulls that failed (the prefiller gone, slow or holding other blocks): the "
             "prompt was computed here instead, or the request failed "
             "(kv_load_failure_policy fail).", "kv_transfer_failures"),
            ("jaxllm:kv_transfer_seconds", "Seconds spent waiting for pulls, summed.",
             "kv_transfer_seconds"),
            ("jaxllm:prefix_cache_hits_host",
             "Prefix cache hits served from the host KV tier (kv_offloading_size), in tokens; "
             "included in vllm:prefix_cache_hits.", "prefix_cache_hits_host"),
            ("jaxllm:kv_offload_stored_blocks",
             "KV blocks evicted from the device and copied to the host tier.",
             "kv_offload_stored"),
            ("jaxllm:encoder_cache_queries",
             "Images looked up in the encoder cache (an image-text model's).",
             "encoder_cache_queries"),
            ("jaxllm:encoder_cache_hits",
             "Images found in the encoder cache: not encoded again.", "encoder_cache_hits"),
            ("jaxllm:kv_offload_loaded_blocks",
             "KV blocks copied back from the host tier on a prefix-cache hit.",
             "kv_offload_loaded"),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             "num_preemptions"),
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_decoding.num_drafts"),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
             "spec_decoding.num_draft_tokens"),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
             "spec_decoding.num_accepted_tokens"),
            ("jaxllm:num_compilations",
             "XLA programs compiled or loaded from the cache; flat after startup.",
             "num_compilations"),
            ("jaxllm:num_steps", "Engine steps run.", "num_steps"),
            ("jaxllm:scheduled_tokens", "Tokens the engine steps computed.",
             "num_scheduled_tokens"),
            ("jaxllm:padded_tokens",
             "Token slots of the compiled shapes the steps ran: the scheduled tokens and their "
             "padding.", "num_padded_tokens"),
            ("jaxllm:grammar_bitmask_seconds",
             "Host seconds spent filling structured-output token bitmasks.",
             "grammar_bitmask_seconds"),
        ):  # fmt: skip
            yield family(CounterMetricFamily, name, doc, _field(value))
        s = ranks[0][1]
        if s.max_loras:  # vLLM's, only when LoRA is served: the value is when it was read
            info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"],
            )
            info.add_metric(
                [
                    ",".join(sorted({a for _, x in ranks for a in x.running_loras})),
                    str(s.max_loras),
                    ",".join(sorted({a for _, x in ranks for a in x.waiting_loras})),
                ],
                time.time(),
            )
            yield info
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*LABELS, "position"],
        )
        for rank, stats in ranks:
            for position, value in enumerate(stats.spec_decoding.num_accepted_per_pos):
                per_pos.add_metric([model, str(rank), str(position)], value)
        yield per_pos


def _field(path: str):
    """A Stats field's getter, by its dotted path."""

    def get(stats):
        for name in path.split("."):
            stats = getattr(stats, name)
        return stats

    return get


class Metrics:
    def __init__(self, engine: AsyncLLM, model_name: str):
        self.registry = registry = CollectorRegistry()
        self.model_name = model_name
        registry.register(_EngineCollector(engine, [model_name]))

        # Labelled per observation by the engine core's rank (`_at`).
        def counter(name, doc):
            return Counter(name, doc, LABELS, registry=registry)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry)

        token_buckets = build_1_2_5_buckets(engine.max_model_len)
        cache = engine.config.cache
        info = {
            "block_size": engine.ready.page_size,
            "cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "gpu_memory_utilization": cache.memory_utilization,
            "num_gpu_blocks": engine.ready.num_pages,
            "engine": "0",
        }
        cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(info),
            registry=registry,
        )
        for rank in range(len(engine.engine_stats)):
            cache_info.labels(*map(str, {**info, "engine": rank}.values())).set(1)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=registry,
        )
        self.request_success = success
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            token_buckets,
        )  # fmt: skip
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            _ITERATION_TOKEN_BUCKETS,
        )  # fmt: skip
        self.max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.n_param = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS
        )
        self.max_tokens_param = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )  # fmt: skip
        # vLLM's name for the same observations until 0.11, which dashboards still read.
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds."
            "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
            _ITL_BUCKETS,
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            _REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        phases = (("queue", "WAITING"), ("inference", "RUNNING"), ("prefill", "PREFILL"),
                  ("decode", "DECODE"))  # fmt: skip
        self.phase = {
            phase: histogram(
                f"vllm:request_{phase}_time_seconds",
                f"Histogram of time spent in {state} phase for request.",
                _REQUEST_LATENCY_BUCKETS,
            )
            for phase, state in phases
        }
        self.host_step = histogram(
            "jaxllm:step_host_time_seconds",
            "Host time per engine step (scheduling, building the batch, dispatching, updating "
            "from the outputs), without waiting for the device.",
            _HOST_STEP_BUCKETS,
        )

        # Every series of every core from the start, at zero, as vLLM's.
        ranks = [str(rank) for rank in range(len(engine.engine_stats))]
        labelled = [m for m in vars(self).values() if isinstance(m, Counter | Histogram)]
        labelled += list(self.phase.values())
        for rank in ranks:
            for metric in labelled:
                if metric is not success:
                    metric.labels(model_name, rank)
            for reason in FinishReason:
                success.labels(model_name, rank, str(reason))

    def observe(self, stats: IterationStats) -> None:
        """AsyncLLM's `on_step` hook: each metric under the engine core's rank."""
        labels = (self.model_name, str(stats.engine))

        def at(metric):
            return metric.labels(*labels)

        at(self.prompt_tokens).inc(stats.num_prompt_tokens)
        at(self.generation_tokens).inc(stats.num_generation_tokens)
        if stats.step is not None:  # one engine step's outputs (not an abort)
            at(self.iteration_tokens).observe(stats.num_prompt_tokens + stats.num_generation_tokens)
            if stats.step.host_seconds is not None:
                at(self.host_step).observe(stats.step.host_seconds)
        for seconds in stats.time_to_first_tokens:
            at(self.ttft).observe(seconds)
        for seconds in stats.inter_token_latencies:
            at(self.itl).observe(seconds)
            at(self.tpot).observe(seconds)
        for n in stats.n_params:
            at(self.n_param).observe(n)
        for tokens in stats.max_num_generation_tokens:
            at(self.max_num_generation_tokens).observe(tokens)
        for r in stats.finished:
            self.request_success.labels(*labels, str(r.finish_reason)).inc()
            at(self.e2e).observe(r.e2e_latency)
            at(self.phase["queue"]).observe(r.queued_time)
            at(self.phase["prefill"]).observe(r.prefill_time)
            at(self.phase["inference"]).observe(r.inference_time)
            at(self.phase["decode"]).observe(r.decode_time)
            if r.mean_time_per_output_token is not None:
                at(self.request_tpot).observe(r.mean_time_per_output_token)
            at(self.request_prompt_tokens).observe(r.num_prompt_tokens)
            at(self.request_generation_tokens).observe(r.num_generation_tokens)
            if r.max_tokens_param:
                at(self.max_tokens_param).observe(r.max_tokens_param)

    def render(self) -> bytes:
        return generate_latest(self.registry)
