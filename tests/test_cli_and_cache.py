"""The `jaxllm` command line and model resolution (no network: the demo model is not fetched
here)."""

from __future__ import annotations

import pytest

from jaxllm.cli import build_parser, main
from jaxllm.model_cache import DEMO_MODELS, fetch_demo_model, resolve_model


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


def test_every_engine_argument_has_a_flag():
    """Each keyword argument of `LLM(...)` can be set from `generate` and `serve`."""
    import inspect

    from jaxllm import LLM

    wanted = set(inspect.signature(LLM).parameters) - {"model"}
    commands = build_parser()._subparsers._group_actions[0].choices
    for name in ("generate", "serve"):
        dests = {a.dest for a in commands[name]._actions}
        assert wanted <= dests, f"{name} lacks flags for {sorted(wanted - dests)}"
    args = build_parser().parse_args(["serve", "m", "--gpu-memory-utilization", "0.5"])
    assert args.memory_utilization == 0.5
