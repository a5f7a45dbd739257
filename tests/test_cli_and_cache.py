"""The `jaxllm` command line and model resolution (no network: the demo model is not fetched
here)."""

from __future__ import annotations

import os

import pytest

from jaxllm.cli import build_parser, main
from jaxllm.model_files import DEMO_MODELS, fetch_demo_model, resolve_model


def test_generate_prints_the_completion(tiny_model_dir, capsys):
    rc = main(
        [
            "generate",
            str(tiny_model_dir),
            "--prompt",
            "The quick",
            "--prompt",
            "Paris",
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--max-model-len",
            "64",
            "--num-pages",
            "16",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "32",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("### prompt:") == 2 and out.count("5 tokens, finish_reason=length") == 2


def test_generate_reports_bad_input(tiny_model_dir, capsys):
    rc = main(
        ["generate", str(tiny_model_dir), "--prompt", "x", "--max-tokens", "0", "--num-pages", "16"]
    )
    assert rc == 2
    assert "max_tokens" in capsys.readouterr().err


def test_unknown_model_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "neither an existing path nor a known short name" in capsys.readouterr().err


def test_demo_names_resolve_offline_only_when_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXLLM_CACHE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="jaxllm fetch smollm2-135m"):
        resolve_model("smollm2-135m", download=False)
    cached = tmp_path / "models" / DEMO_MODELS["smollm2-135m"].filename
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")
    assert resolve_model("smollm2-135m", download=False) == cached
    assert fetch_demo_model("smollm2-135m") == cached  # cached: no download
    with pytest.raises(ValueError, match="unknown demo model"):
        fetch_demo_model("gpt-5")


def test_help_lists_commands():
    text = build_parser().format_help()
    assert "generate" in text and "fetch" in text


def test_attention_backend_choices_match_the_kernels():
    import pallas_kernels

    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    (action,) = [a for a in generate._actions if a.dest == "attention_backend"]
    assert set(action.choices) == set(pallas_kernels.ATTENTION_BACKENDS)


def test_every_engine_field_has_a_flag_a_docstring_and_a_keyword():
    """Each field of `EngineConfig` is declared once: with a docstring (the flag's help), a
    flag on `generate` and `serve` whose default is the field's, and an `LLM(...)` keyword."""
    import dataclasses
    import inspect
    import typing

    import pallas_kernels
    from jaxllm import LLM
    from jaxllm.config import ATTENTION_BACKENDS, EngineConfig, field_docs

    fields = EngineConfig.fields()
    assert len(fields) > 15
    sections = typing.get_type_hints(EngineConfig)
    for name, (section, _) in fields.items():
        assert field_docs(sections[section]).get(name), f"{name} has no docstring"
    assert [s.name for s in dataclasses.fields(EngineConfig)] == list(sections)

    commands = build_parser()._subparsers._group_actions[0].choices
    for command in ("generate", "serve"):
        dests = {a.dest for a in commands[command]._actions}
        assert set(fields) <= dests, f"{command} lacks flags for {sorted(set(fields) - dests)}"
        extra = ["--prompt", "x"] if command == "generate" else []
        args = build_parser().parse_args([command, "m", *extra])
        assert EngineConfig.from_cli(args) == EngineConfig.create("m")  # same defaults

    params = inspect.signature(LLM).parameters
    assert set(params) - {"self"} == set(fields) | {"config"}
    for name, (_, f) in fields.items():
        if name != "model":
            assert params[name].default == f.default, name

    # vLLM's spellings.
    args = build_parser().parse_args(
        ["serve", "m", "--gpu-memory-utilization", "0.5", "--block-size", "32",
         "--num-gpu-blocks-override", "64", "--no-enable-prefix-caching"]
    )  # fmt: skip
    config = EngineConfig.from_cli(args)
    assert config.cache == dataclasses.replace(
        config.cache, memory_utilization=0.5, page_size=32, num_pages=64
    )
    assert config.cache.enable_prefix_caching is False
    assert ATTENTION_BACKENDS == pallas_kernels.ATTENTION_BACKENDS
    args = build_parser().parse_args(["serve", "m", "-q", "int8"])
    assert EngineConfig.from_cli(args).load.quantization == "int8"
    from jaxllm import config as config_module

    assert config_module.QUANTIZED_KV_CACHE_DTYPES == tuple(pallas_kernels.QUANTIZED_KV_DTYPES)
    args = build_parser().parse_args(["serve", "m", "--kv-cache-dtype", "fp8_e4m3"])
    assert EngineConfig.from_cli(args).cache.kv_cache_dtype == "fp8_e4m3"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_num_seqs": "8"}, "max_num_seqs must be int"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching must be bool"),
        ({"page_size": 24}, "page_size must be a power of two"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype must be one of"),
        ({"memory_utilization": 1.5}, "memory_utilization must be in"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy must be fcfs or priority"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        ({"attention_backend": "flash"}, "attention_backend must be one of"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "max_num_batched_tokens"),
        ({"dtype": "int8"}, "dtype must be one of"),
    ],
)
def test_engine_config_names_the_bad_parameter(kwargs, message):
    from jaxllm.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig.create("m", **kwargs)
    with pytest.raises(TypeError, match=r"unknown engine argument.*max_num_seq\b"):
        EngineConfig.create("m", max_num_seq=8)


def test_engine_config_takes_vllms_keyword_names():
    """vLLM's keyword arguments where ours are named otherwise (the flags' aliases)."""
    from jaxllm.config import EngineConfig

    c = EngineConfig.create("m", gpu_memory_utilization=0.8, block_size=32,
                            num_gpu_blocks_override=64, disable_log_stats=True)  # fmt: skip
    assert (c.cache.memory_utilization, c.cache.page_size, c.cache.num_pages) == (0.8, 32, 64)
    assert c.observability.disable_log_stats
    with pytest.raises(TypeError, match="page_size and block_size"):
        EngineConfig.create("m", page_size=16, block_size=32)


def test_cli_rejects_a_bad_flag_value(capsys):
    assert main(["generate", "m", "--prompt", "x", "--page-size", "24"]) == 2
    assert "page_size must be a power of two" in capsys.readouterr().err


def test_bench_help_lists_the_subcommands(capsys):
    from jaxllm.config import EngineConfig

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("serve", "throughput", "latency"))
    for command in ("throughput", "latency"):  # the engine's flags, the model as --model
        args = build_parser().parse_args(["bench", command, "--model", "m"])
        assert EngineConfig.from_cli(args) == EngineConfig.create("m")


# A tiny engine: little to compile on a 2-core CPU.
BENCH_ENGINE = ["--num-pages", "16", "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]


def test_bench_throughput_prints_vllms_line_and_writes_json(tiny_model_dir, tmp_path, capsys):
    import json
    import re

    path = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", str(tiny_model_dir), "--num-prompts", "4"]
    argv += ["--input-len", "8", "--output-len", "4", "--output-json", str(path)]
    assert main([*argv, *BENCH_ENGINE, "--disable-tqdm"]) == 0
    out = capsys.readouterr().out
    number = r"\d+\.\d\d"
    assert re.search(
        rf"^Throughput: {number} requests/s, {number} total tokens/s, {number} output tokens/s$",
        out,
        re.M,
    )
    assert "Total num prompt tokens:  32" in out and "Total num output tokens:  16" in out
    res = json.loads(path.read_text())
    assert res["num_requests"] == 4 and res["total_num_tokens"] == 48
    assert res["total_output_tokens"] == 16 and res["elapsed_time"] > 0
    assert res["requests_per_second"] == pytest.approx(4 / res["elapsed_time"])
    assert res["tokens_per_second"] == pytest.approx(48 / res["elapsed_time"])
    assert res["engine_args"]["max_model_len"] == 12  # input + output when not given
    assert res["compilations_during_run"] == 0  # warmup compiled every program


def test_bench_latency_prints_percentiles_and_writes_json(tiny_model_dir, tmp_path, capsys):
    import json
    import re

    path = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", str(tiny_model_dir), "--batch-size", "2"]
    argv += ["--input-len", "8", "--output-len", "4", "--num-iters-warmup", "1"]
    argv += ["--num-iters", "3", "--output-json", str(path)]
    assert main([*argv, *BENCH_ENGINE]) == 0  # with the progress bars (on stderr)
    out = capsys.readouterr().out
    assert re.search(r"^Avg latency: \S+ seconds$", out, re.M)
    for p in (10, 25, 50, 75, 90, 99):
        assert re.search(rf"^{p}% percentile latency: \S+ seconds$", out, re.M)
    res = json.loads(path.read_text())
    assert len(res["latencies"]) == 3 and res["batch_size"] == 2
    assert res["avg_latency"] == pytest.approx(sum(res["latencies"]) / 3)
    assert list(res["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert min(res["latencies"]) <= res["percentiles"]["50"] <= max(res["latencies"])


def test_bench_reports_speculative_decoding(tiny_model_dir, tmp_path, capsys):
    """With --speculative-config, `vllm bench serve`'s section: acceptance rate and length,
    the counts and the acceptance per position, over the measured run."""
    import json

    path = tmp_path / "throughput.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
    spec += '"adaptive": false}'
    argv = ["bench", "throughput", "--model", str(tiny_model_dir), "--num-prompts", "4"]
    argv += ["--input-len", "8", "--output-len", "48", "--output-json", str(path)]
    argv += ["--speculative-config", spec, "--max-num-seqs", "4", "--disable-tqdm"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    res = json.loads(path.read_text())["spec_decode"]
    assert res["drafts"] > 0 and res["draft_tokens"] >= res["drafts"]
    assert res["acceptance_length"] == pytest.approx(1 + res["accepted_tokens"] / res["drafts"])
    assert len(res["per_position_acceptance_rate"]) == 3
    assert "-- Speculative Decoding --" in out and "Acceptance length:" in out
    assert "  Position 2:" in out


def test_malloc_settings_for_the_core_process(monkeypatch):
    """The core process starts with glibc malloc settings that keep XLA's CPU temporaries
    resident, unless an accelerator may run JAX or the operator set malloc tunables."""
    from jaxllm import host_memory

    if not host_memory.glibc():
        pytest.skip("glibc only")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.rtld.optional_static_tls=4096")
    assert host_memory.set_for_children()
    assert os.environ["GLIBC_TUNABLES"] == (
        "glibc.rtld.optional_static_tls=4096:" + host_memory.TUNABLES
    )
    assert not host_memory.set_for_children(), "set twice"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")
    assert not host_memory.set_for_children(), "the operator's malloc settings win"
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert not host_memory.set_for_children()
    assert "GLIBC_TUNABLES" not in os.environ
