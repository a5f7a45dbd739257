"""`jaxllm bench serve` (`jaxllm/bench/serve.py`, and benchmarks/serve.py on it) against a fake
OpenAI-compatible streaming server (FastAPI + uvicorn on a free loopback port in a background
thread) whose chunks come with known delays."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jaxllm.bench import serve as bench
from jaxllm.cli import main as cli_main

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

FIRST_DELAY = 0.15  # seconds before the first content chunk
TOKEN_DELAY = 0.03  # seconds between content chunks
EOS_AFTER = 3  # tokens generated when the request does not set ignore_eos


def _fake_app(state: dict):
    app = fastapi.FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/version")
    async def version():
        return {"version": "fake-1.0"}

    async def generate(request: fastapi.Request, chat: bool):
        body = await request.json()
        state["bodies"].append(body)
        state["auth"].append(request.headers.get("authorization"))
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if "FAIL_HTTP" in prompt:
            return JSONResponse({"error": {"message": "bad prompt"}}, status_code=400)
        n = body["max_tokens"] if body.get("ignore_eos") else min(EOS_AFTER, body["max_tokens"])
        usage = body.get("stream_options", {}).get("include_usage") and body["model"] != "no-usage"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(text, finish=None):
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            return f"data: {json.dumps({'object': obj, 'choices': [choice]})}\n\n"

        async def stream():
            state["inflight"] += 1
            state["max_inflight"] = max(state["max_inflight"], state["inflight"])
            try:
                if chat:
                    role = {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}
                    yield f"data: {json.dumps({'object': obj, 'choices': [role]})}\n\n"
                await asyncio.sleep(FIRST_DELAY)
                if "HANG" in prompt:
                    await asyncio.sleep(30)
                for i in range(n):
                    if i:
                        await asyncio.sleep(TOKEN_DELAY)
                    if "FAIL_EVENT" in prompt and i == 1:
                        yield f"data: {json.dumps({'error': {'message': 'engine died'}})}\n\n"
                        return
                    yield event(f" w{i}", "length" if i == n - 1 else None)
                if usage:
                    u = {"prompt_tokens": len(prompt.split()), "completion_tokens": n}
                    yield f"data: {json.dumps({'object': obj, 'choices': [], 'usage': u})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["inflight"] -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request):
        return await generate(request, chat=True)

    return app


@pytest.fixture(scope="module")
def server():
    state = {"bodies": [], "auth": [], "inflight": 0, "max_inflight": 0}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        _fake_app(state), log_level="warning", lifespan="off", timeout_graceful_shutdown=1
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    srv.should_exit = True
    thread.join(timeout=5)
    sock.close()


def _reset(state):
    state["bodies"].clear()
    state["auth"].clear()
    state["max_inflight"] = 0


def test_completions_counts_and_latencies(server, tmp_path, monkeypatch):
    url, state = server
    _reset(state)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    out_len, n = 6, 6
    path = tmp_path / "res.json"
    res = bench.main(
        [
            *("--base-url", url, "--num-prompts", str(n), "--max-concurrency", "2"),
            *("--random-input-len", "16", "--random-output-len", str(out_len), "--ignore-eos"),
            *("--save-result", "--result-filename", str(path)),
        ]
    )
    assert res["completed"] == n and res["failed"] == 0 and res["errors"] == []
    assert res["model"] == "fake-model"  # the first id of /v1/models
    assert res["server_version"] == {"version": "fake-1.0"}
    assert res["total_output_tokens"] == n * out_len and res["output_tokens_from_usage"]
    assert res["total_input_tokens"] == n * 16 and res["input_tokens_from_usage"]
    assert state["max_inflight"] <= 2

    body = state["bodies"][0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["max_tokens"] == out_len and len(body["prompt"].split()) == 16
    assert state["auth"][0] == "Bearer sk-test"
    assert len({b["prompt"] for b in state["bodies"]}) == n  # distinct synthetic prompts

    # Known delays: TTFT >= FIRST_DELAY, ITL ~ TOKEN_DELAY, E2E >= FIRST + (n-1) * TOKEN.
    slack = 1.0  # generous: shared, noisy machines
    ms = 1e3
    assert 0.9 * FIRST_DELAY * ms <= res["median_ttft_ms"] <= (FIRST_DELAY + slack) * ms
    assert 0.8 * TOKEN_DELAY * ms <= res["mean_itl_ms"] <= (TOKEN_DELAY + slack) * ms
    assert 0.5 * TOKEN_DELAY * ms <= res["median_itl_ms"] <= (TOKEN_DELAY + slack) * ms
    assert 0.8 * TOKEN_DELAY * ms <= res["mean_tpot_ms"] <= (TOKEN_DELAY + slack) * ms
    e2e_min = FIRST_DELAY + (out_len - 1) * TOKEN_DELAY
    assert 0.9 * e2e_min * ms <= res["median_e2el_ms"] <= (e2e_min + slack) * ms
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert res[f"mean_{key}_ms"] <= res[f"p99_{key}_ms"] + 1e-9
    # Six requests, two at a time: three waves.
    assert res["duration_s"] >= 0.9 * 3 * e2e_min
    assert res["output_throughput"] == pytest.approx(n * out_len / res["duration_s"])

    saved = json.loads(path.read_text())
    assert saved["completed"] == n and saved["args"]["api_key"] == "<redacted>"
    assert saved["args"]["request_rate"] == "inf" and len(saved["requests"]) == n
    assert all(r["output_tokens"] == out_len for r in saved["requests"])


def test_chat_poisson_without_usage(server):
    url, state = server
    _reset(state)
    n, rate, seed = 5, 20.0, 3
    res = bench.main(
        [
            *("--base-url", url, "--endpoint", "/v1/chat/completions", "--model", "no-usage"),
            *("--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(seed)),
            *("--input-len", "8", "--output-len", "4"),  # no --ignore-eos: stops at EOS_AFTER
            "--disable-tqdm",  # the older spellings of benchmarks/serve.py above
        ]
    )
    assert res["completed"] == n and res["failed"] == 0
    assert res["model"] == "no-usage" and "ignore_eos" not in state["bodies"][0]
    assert state["bodies"][0]["messages"][0]["role"] == "user"
    # No usage chunk: output tokens are counted from content chunks (the role chunk is not one).
    assert not res["output_tokens_from_usage"] and res["total_output_tokens"] == n * EOS_AFTER
    assert not res["input_tokens_from_usage"] and res["total_input_tokens"] == n * 8
    assert res["median_ttft_ms"] >= 0.9 * FIRST_DELAY * 1e3

    offsets = bench.arrival_offsets(n, rate, seed)
    assert offsets == bench.arrival_offsets(n, rate, seed) and offsets[0] == 0.0
    assert offsets != bench.arrival_offsets(n, rate, seed + 1)
    starts = [r["start_s"] for r in res["requests"]]
    assert starts == pytest.approx(offsets)


def test_failures_are_counted_not_fatal(server, tmp_path):
    url, state = server
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nFAIL_HTTP please\nFAIL_EVENT now\nHANG forever\n")
    res = bench.main(
        [
            *("--base-url", url, "--prompt-file", str(prompts), "--num-prompts", "4"),
            *("--output-len", "3", "--ignore-eos", "--timeout", "0.8"),
        ]
    )
    assert res["completed"] == 1 and res["failed"] == 3
    errors = " | ".join(res["errors"])
    assert "HTTP 400: bad prompt" in errors
    assert "error event: engine died" in errors
    assert "timeout after 0.8 s" in errors
    assert res["total_output_tokens"] == 3
    assert [r["success"] for r in res["requests"]] == [True, False, False, False]


def test_unreachable_server_reports_failures():
    # Nothing listens on this port (bound, never listening): every request fails, no crash.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        res = bench.main(
            ["--base-url", url, "--model", "m", "--num-prompts", "2", "--input-len", "4"]
        )
    assert res["completed"] == 0 and res["failed"] == 2
    assert all("ConnectError" in e for e in res["errors"])
    assert res["server_version"] is None and res["mean_ttft_ms"] is None


# The fields benchmarks/serve.py printed (its table), under vLLM's names where they differ.
TABLE_FIELDS = [
    "Serving Benchmark Result",
    "Model",
    "Endpoint",
    "Request rate (req/s)",
    "Max concurrency",
    "Successful requests",
    "Failed requests",
    "Benchmark duration (s)",
    "Total input tokens",
    "Total generated tokens",
    "Request throughput (req/s)",
    "Output token throughput (tok/s)",
    "Total Token throughput (tok/s)",
    "Time to First Token",
    "Time per Output Token (excl. 1st token)",
    "Inter-token Latency",
    "End-to-end Latency",
    *(f"{s} {m} (ms)" for m in ("TTFT", "TPOT", "ITL", "E2EL") for s in ("Mean", "Median", "P99")),
]


def _printed_fields(out: str) -> set[str]:
    """The labels of a printed table: the rows' left column and the section titles."""
    fields = set()
    for line in out.splitlines():
        if line.startswith(("=", "-")):
            fields.add(line.strip("=-").strip())
        elif m := re.match(r"(\S.*?)\s{2,}\S+$", line):
            fields.add(m.group(1))
    return fields


def test_cli_bench_serve_prints_the_fields_and_saves_vllm_json(server, tmp_path, capsys):
    url, state = server
    _reset(state)
    host, port = url.removeprefix("http://").split(":")
    rc = cli_main(
        [
            *("bench", "serve", "--host", host, "--port", port, "--backend", "openai-chat"),
            *("--num-prompts", "4", "--max-concurrency", "2", "--ignore-eos"),
            *("--random-input-len", "8", "--random-output-len", "4"),
            *("--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90"),
            *("--save-result", "--result-dir", str(tmp_path), "--disable-tqdm"),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    printed = _printed_fields(out)
    assert set(TABLE_FIELDS) <= printed, set(TABLE_FIELDS) - printed
    assert {"P50 TTFT (ms)", "P90 TTFT (ms)", "P50 E2EL (ms)", "P90 E2EL (ms)"} <= printed
    assert "P90 TPOT (ms)" not in printed  # tpot is not in --percentile-metrics
    assert re.search(r"^Successful requests +4$", out, re.M)
    assert re.search(r"^Total generated tokens +16$", out, re.M)
    assert state["bodies"][0]["messages"][0]["content"]  # openai-chat: chat completions

    (path,) = tmp_path.glob("openai-chat-infqps-concurrency2-fake-model-*.json")  # vLLM's name
    saved = json.loads(path.read_text())
    assert saved["completed"] == 4 and saved["total_output_tokens"] == 16
    assert saved["backend"] == "openai-chat" and saved["model_id"] == "fake-model"
    assert saved["endpoint"] == "/v1/chat/completions" and saved["max_concurrency"] == 2
    for key in ("duration", "total_input_tokens", "request_throughput", "output_throughput"):
        assert saved[key] > 0, key
    assert saved["total_token_throughput"] > saved["output_throughput"]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert saved[f"{stat}_{metric}_ms"] is not None, (stat, metric)
    assert saved["p50_ttft_ms"] <= saved["p90_ttft_ms"] <= saved["p99_ttft_ms"]
    assert "p90_e2el_ms" in saved and "p90_tpot_ms" not in saved


def test_benchmarks_serve_script_runs_the_package(server, tmp_path):
    url, _ = server
    path = tmp_path / "res.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "serve.py"
    proc = subprocess.run(
        [
            *(sys.executable, str(script), "--base-url", url, "--num-prompts", "2"),
            *("--input-len", "4", "--output-len", "2", "--json", str(path)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert set(TABLE_FIELDS) <= _printed_fields(proc.stdout)
    assert json.loads(path.read_text())["completed"] == 2


def _args(argv: list[str]):
    import argparse

    p = argparse.ArgumentParser()
    bench.add_cli_args(p)
    args = p.parse_args(argv)
    bench.check_args(args)
    return args


def test_burstiness_and_random_range_ratio():
    rate, n = 10.0, 4000
    assert bench.arrival_offsets(n, rate, 0) == bench.arrival_offsets(n, rate, 0, 1.0)
    for burstiness in (0.5, 1.0, 4.0):
        gaps = np.diff(bench.arrival_offsets(n, rate, 0, burstiness))
        assert np.mean(gaps) == pytest.approx(1 / rate, rel=0.1)
        # Gamma gaps of shape k: squared coefficient of variation 1 / k.
        assert np.var(gaps) / np.mean(gaps) ** 2 == pytest.approx(1 / burstiness, rel=0.2)

    args = _args(["--num-prompts", "200", "--input-len", "10", "--output-len", "20"])
    reqs = bench.make_requests(args)
    assert {len(r.prompt.split()) for r in reqs} == {10} and {r.output_len for r in reqs} == {20}
    args = _args([*("--num-prompts", "200", "--input-len", "10", "--output-len", "20"),
                  *("--random-range-ratio", "0.5")])  # fmt: skip
    reqs = bench.make_requests(args)
    in_lens, out_lens = [len(r.prompt.split()) for r in reqs], [r.output_len for r in reqs]
    assert in_lens == [r.prompt_len for r in reqs]
    assert min(in_lens) >= 5 and max(in_lens) <= 15 and len(set(in_lens)) > 5
    assert min(out_lens) >= 10 and max(out_lens) <= 30 and len(set(out_lens)) > 5
    assert [r.prompt for r in bench.make_requests(args)] == [r.prompt for r in reqs]  # seeded


def test_tokenizer_makes_token_prompts_and_counts_tokens(server, tokenizer_dir, capsys):
    url, state = server
    _reset(state)
    res = bench.main(
        [
            *("--base-url", url, "--model", "no-usage", "--tokenizer", str(tokenizer_dir)),
            *("--num-prompts", "3", "--random-input-len", "12", "--random-output-len", "4"),
            "--disable-tqdm",
        ]
    )
    tok = bench.load_tokenizer(str(tokenizer_dir))
    lens = [len(tok.encode(b["prompt"], add_special_tokens=False)) for b in state["bodies"]]
    # Random ids, cut to at most 12 tokens of their text's encoding (a tiny byte-level
    # vocabulary has many ids of partial characters, which decode to 3-byte U+FFFD).
    assert all(6 <= n <= 12 for n in lens) and sum(lens) >= 3 * 9
    # No usage from the server: the tokenizer counts the prompts and the generated text.
    assert res["total_input_tokens"] == sum(lens)
    gen = len(tok.encode(" w0 w1 w2", add_special_tokens=False))
    assert res["total_output_tokens"] == 3 * gen
    assert "Total generated tokens (tokenizer)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--backend", "openai", "--endpoint", "/v1/chat/completions"], "does not speak"),
        (["--percentile-metrics", "ttft,ttfx"], "unknown ['ttfx']"),
        (["--metric-percentiles", "0"], "must be in (0, 100]"),
        (["--dataset-name", "custom"], "--dataset-path goes with"),
        (["--random-range-ratio", "1"], "--random-range-ratio"),
    ],
)
def test_cli_bench_serve_rejects_bad_flags(flags, message, capsys):
    assert cli_main(["bench", "serve", *flags]) == 2
    assert message in capsys.readouterr().err
