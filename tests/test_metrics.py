"""/metrics under vLLM's names: every metric vLLM documents is exported with its type, labels
and buckets, or named here as a concept this engine lacks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxllm.config import CacheConfig
from jaxllm.engine.core_outputs import SpecDecodingStats, Stats, StepEvents
from jaxllm.engine.iteration_stats import IterationStats, RequestTimes
from server.metrics import Metrics, build_1_2_5_buckets

# vLLM V1's metrics (docs.vllm.ai, "Production Metrics", and the PrometheusStatLogger it is
# generated from, v0.11-0.12): name -> type. Every one carries the labels model_name and engine.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",  # deprecated in 0.11, still read
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:spec_decode_num_drafts": "counter",
    "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "counter",
    "vllm:external_prefix_cache_queries": "counter",
    "vllm:external_prefix_cache_hits": "counter",
}
# vLLM's metrics for concepts this engine does not have.
VLLM_NOT_APPLICABLE = {
    "vllm:lora_requests_info": "no LoRA adapters",
    "vllm:engine_sleep_state": "no sleep mode",
    "vllm:mm_cache_queries": "no multi-modal inputs",
    "vllm:mm_cache_hits": "no multi-modal inputs",
    "vllm:corrupted_requests": "vLLM's only with VLLM_COMPUTE_NANS_IN_LOGITS",
    "vllm:kv_block_lifetime_seconds": "vLLM's only with --kv-cache-metrics",
    "vllm:kv_block_idle_before_evict_seconds": "vLLM's only with --kv-cache-metrics",
    "vllm:kv_block_reuse_gap_seconds": "vLLM's only with --kv-cache-metrics",
}
# vLLM's buckets, for the histograms whose buckets do not depend on max_model_len.
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                                         0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                                         160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                                         0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                                         20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                                         960.0, 1920.0, 7680.0],
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                    16384],
    "vllm:request_params_n": [1, 2, 5, 10, 20],
}  # fmt: skip
JAXLLM_METRICS = {
    "jaxllm:num_compilations": "counter",
    "jaxllm:num_steps": "counter",
    "jaxllm:scheduled_tokens": "counter",
    "jaxllm:padded_tokens": "counter",
    "jaxllm:grammar_bitmask_seconds": "counter",
    "jaxllm:step_host_time_seconds": "histogram",
    "jaxllm:prefix_cache_hits_host": "counter",
    "jaxllm:kv_offload_stored_blocks": "counter",
    "jaxllm:kv_offload_loaded_blocks": "counter",
    "jaxllm:kv_offload_usage_perc": "gauge",
    "jaxllm:encoder_cache_usage_perc": "gauge",
    "jaxllm:encoder_cache_queries": "counter",
    "jaxllm:encoder_cache_hits": "counter",
    "jaxllm:kv_transfer_sent_blocks": "counter",
    "jaxllm:kv_transfer_received_blocks": "counter",
    "jaxllm:kv_transfer_received_bytes": "counter",
    "jaxllm:kv_transfer_failures": "counter",
    "jaxllm:kv_transfer_seconds": "counter",
    "jaxllm:kv_transfer_held_requests": "gauge",
}
MAX_MODEL_LEN = 2048


def fake_engine(stats: Stats | None = None) -> SimpleNamespace:
    """What `Metrics` reads of an `AsyncLLM`."""
    stats = stats or Stats()
    return SimpleNamespace(
        stats=stats,
        engine_stats=[stats],
        max_model_len=MAX_MODEL_LEN,
        config=SimpleNamespace(cache=CacheConfig()),
        ready=SimpleNamespace(page_size=16, num_pages=100),
    )


def one_request(metrics: Metrics) -> None:
    """Feeds `metrics` a request of 7 prompt tokens that generates 3 over three steps."""
    times = RequestTimes(arrival=0.0, num_prompt_tokens=7, max_tokens_param=3, n=1, group="r",
                         queued_seconds=0.1, scheduled=0.1)  # fmt: skip
    first = IterationStats(now=0.5, step=StepEvents([("r", 0.1, 0.1)], host_seconds=0.002))
    first.new_tokens(times, 1)
    metrics.observe(first)
    for now in (0.7, 1.0):
        step = IterationStats(now=now, step=StepEvents(host_seconds=0.001))
        step.new_tokens(times, 1)
        if now == 1.0:
            step.finish(times, "length")
            step.n_params.append(1)
            step.max_num_generation_tokens.append(3)
        metrics.observe(step)


def rendered(stats: Stats | None = None) -> dict[str, object]:
    """The metric families /metrics shows after one request, by name."""
    metrics = Metrics(fake_engine(stats), "m")
    one_request(metrics)
    families = text_string_to_metric_families(metrics.render().decode())
    # prometheus_client's *_created series (when each counter and histogram began), as vLLM's.
    return {f.name: f for f in families if not f.name.endswith("_created")}


def sample_names() -> set[str]:
    """Every sample name /metrics shows after one request (counters end in _total, histograms
    in _bucket, _sum and _count)."""
    stats = Stats(
        spec_decoding=SpecDecodingStats(num_accepted_per_pos=[0])
    )  # a sample per draft position
    return {s.name for family in rendered(stats).values() for s in family.samples}


def test_every_vllm_metric_is_exported_with_its_type_and_labels():
    families = rendered()
    for name, kind in {**VLLM_METRICS, **JAXLLM_METRICS}.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
        for sample in families[name].samples:
            assert sample.labels["engine"] == "0", name
            # vLLM's cache_config_info carries the cache's settings instead of the model.
            if name != "vllm:cache_config_info":
                assert sample.labels["model_name"] == "m", name
    exported = {n for n in families if n.startswith("vllm:")}
    assert exported == set(VLLM_METRICS)
    assert not exported & set(VLLM_NOT_APPLICABLE)
    assert {n for n in families if not n.startswith("vllm:")} == set(JAXLLM_METRICS)


def test_histograms_have_vllms_buckets():
    families = rendered()

    def buckets(name):
        return [float(s.labels["le"]) for s in families[name].samples
                if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]  # fmt: skip

    for name, expected in VLLM_BUCKETS.items():
        assert buckets(name) == expected, name
    for name in (
        "vllm:time_per_output_token_seconds",
        "vllm:request_time_per_output_token_seconds",
    ):
        assert buckets(name) == VLLM_BUCKETS["vllm:inter_token_latency_seconds"]
    for phase in ("queue", "inference", "prefill", "decode"):
        name = f"vllm:request_{phase}_time_seconds"
        assert buckets(name) == VLLM_BUCKETS["vllm:e2e_request_latency_seconds"]
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    for name in ("prompt_tokens", "generation_tokens", "params_max_tokens",
                 "max_num_generation_tokens"):  # fmt: skip
        assert buckets(f"vllm:request_{name}") == build_1_2_5_buckets(MAX_MODEL_LEN), name


def test_values_follow_one_request():
    stats = Stats(num_running=2, num_waiting=1, kv_cache_usage=0.25, prefix_cache_queries=30,
                  prefix_cache_hits=16, num_preemptions=1, num_compilations=20, num_steps=3,
                  num_scheduled_tokens=9, num_padded_tokens=48, prefix_cache_hits_host=5,
                  kv_offload_stored=6, kv_offload_loaded=4, kv_offload_blocks=3,
                  kv_offload_capacity=12,
                  spec_decoding=SpecDecodingStats(4, 12, 7, [4, 2, 1]))  # fmt: skip
    families = rendered(stats)

    def value(name, suffix="", **labels):
        (v,) = [s.value for s in families[name].samples if s.name == name + suffix
                and labels.items() <= s.labels.items()]  # fmt: skip
        return v

    assert value("vllm:num_requests_running") == 2
    assert value("vllm:kv_cache_usage_perc") == 0.25
    assert value("vllm:prefix_cache_hits", "_total") == 16
    assert value("vllm:num_preemptions", "_total") == 1
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos", "_total", position="2") == 1
    assert value("jaxllm:padded_tokens", "_total") == 48
    assert value("jaxllm:prefix_cache_hits_host", "_total") == 5
    assert value("jaxllm:kv_offload_stored_blocks", "_total") == 6
    assert value("jaxllm:kv_offload_loaded_blocks", "_total") == 4
    assert value("jaxllm:kv_offload_usage_perc") == 0.25
    assert value("vllm:prompt_tokens", "_total") == 7
    assert value("vllm:generation_tokens", "_total") == 3
    assert value("vllm:request_success", "_total", finished_reason="length") == 1
    assert value("vllm:request_success", "_total", finished_reason="abort") == 0
    assert value("vllm:time_to_first_token_seconds", "_sum") == pytest.approx(0.5)
    assert value("vllm:inter_token_latency_seconds", "_count") == 2
    assert value("vllm:inter_token_latency_seconds", "_sum") == pytest.approx(0.5)
    assert value("vllm:request_time_per_output_token_seconds", "_sum") == pytest.approx(0.25)
    assert value("vllm:e2e_request_latency_seconds", "_sum") == pytest.approx(1.0)
    assert value("vllm:request_queue_time_seconds", "_sum") == pytest.approx(0.1)
    assert value("vllm:request_prefill_time_seconds", "_sum") == pytest.approx(0.4)
    assert value("vllm:request_decode_time_seconds", "_sum") == pytest.approx(0.5)
    assert value("vllm:request_inference_time_seconds", "_sum") == pytest.approx(0.9)
    # vLLM's iteration tokens: prompt tokens (once, with the first token) and generated ones.
    assert value("vllm:iteration_tokens_total", "_sum") == 7 + 3
    assert value("vllm:iteration_tokens_total", "_count") == 3
    assert value("vllm:request_params_max_tokens", "_sum") == 3
    assert value("jaxllm:step_host_time_seconds", "_sum") == pytest.approx(0.004)
    info = families["vllm:cache_config_info"].samples[0]
    assert info.value == 1
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "100"
