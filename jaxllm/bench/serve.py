"""`jaxllm bench serve`: an online serving benchmark against any OpenAI-compatible server
(`jaxllm serve`, vLLM, ...), with `vllm bench serve`'s flags and summary.

    jaxllm bench serve [--base-url http://127.0.0.1:8000 | --host H --port P] \
        [--backend openai | openai-chat] [--model ID] [--num-prompts 64] \
        [--request-rate inf] [--burstiness 1] [--max-concurrency 8] \
        [--random-input-len 128] [--random-output-len 128] [--ignore-eos] \
        [--save-result [--result-dir DIR] [--result-filename NAME]]

Data flow: the dataset makes `SampleRequest`s (prompt, its length, max_tokens); each gets an
arrival offset (both `serve_workload`'s); one asyncio task per request sleeps until its offset,
waits for a slot of --max-concurrency, streams its request and records a `RequestResult`;
`summarize` pools them into the metrics, printed as a table and saved as JSON. Everything runs
on one event loop in the calling thread; the tasks wait only on the clock, the semaphore and
their HTTP stream.

Requests arrive as a gamma process of --request-rate req/s (shape --burstiness; 1 is a Poisson
process; seeded; "inf" sends them all at once), and at most --max-concurrency of them are in
flight. Every request streams (SSE with `stream_options.include_usage`) and every chunk is
timestamped. Per request, as vLLM defines them:

- TTFT: from sending the request to the first chunk carrying content.
- ITL: the gaps between consecutive content chunks (pooled over all requests).
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token.
- E2E: from sending the request to the end of the stream.
- Output tokens: `completion_tokens` of the final usage chunk, or, when the server sends no
  usage, the generated text's tokens with --tokenizer, else the number of content chunks.
  Prompt tokens come from the same usage chunk (else the tokenizer's or the word count).

Datasets (`random`, `custom`): `jaxllm/bench/serve_workload.py`. --ignore-eos sends the vLLM
extension field `ignore_eos` so every request generates exactly its max_tokens. Failed requests
(HTTP errors, `data: {"error": ...}` events, timeouts, broken streams) are counted and their
first messages reported; they never stop the run.

Mean, median and P99 of TTFT, TPOT, ITL and E2EL are always reported; --percentile-metrics
and --metric-percentiles add percentiles of the metrics named. The JSON holds the metrics
under vLLM's names, the arguments (API key redacted), the server's `/version` when it answers,
and per-request records.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx
import numpy as np
from tqdm.auto import tqdm

from jaxllm.bench import write_json
from jaxllm.bench.serve_workload import (
    SampleRequest,
    arrival_offsets,
    count_tokens,
    load_tokenizer,
    make_requests,
)

MAX_ERRORS_REPORTED = 5
METRICS = ("ttft", "tpot", "itl", "e2el")
BACKENDS = ("openai", "openai-chat")


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds; 0 until the first content chunk
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None  # from the usage chunk
    output_tokens: int = 0
    output_tokens_from_usage: bool = False
    content_chunks: int = 0
    generated_text: str = ""
    start: float = 0.0  # offset from the benchmark start, seconds

    @property
    def tpot(self) -> float | None:
        if self.output_tokens > 1:
            return (self.e2e - self.ttft) / (self.output_tokens - 1)
        return None


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """`vllm bench serve`'s flags (with the older spellings of benchmarks/serve.py as
    aliases: --input-len, --output-len, --prompt-file, --json)."""
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="the API: openai (completions) or openai-chat (chat completions); default "
        "openai-chat for an --endpoint ending in chat/completions, else openai",
    )
    p.add_argument("--base-url", default=None, help="the server's URL (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--endpoint",
        default=None,
        help="default: /v1/chat/completions for openai-chat, else /v1/completions",
    )
    p.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="a model or tokenizer (directory, .gguf, demo name): random prompts of exact "
        "token lengths, and token counts when the server sends no usage (default: none; "
        "prompts are words)",
    )
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    p.add_argument(
        "--dataset-name",
        choices=("random", "custom"),
        default=None,
        help="default: custom with --dataset-path, else random",
    )
    p.add_argument(
        "--dataset-path",
        "--prompt-file",
        default=None,
        help='custom dataset: a .jsonl file of {"prompt": ...}, or one prompt per line',
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help='mean arrival rate in req/s; "inf" sends every request at once',
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma-distributed gaps between arrivals: 1 is a Poisson process, "
        "lower is burstier, higher more uniform",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most this many requests in flight (default: no cap)",
    )
    p.add_argument(
        "--random-input-len",
        "--input-len",
        type=int,
        default=128,
        help="prompt length, in words (tokens with --tokenizer)",
    )
    p.add_argument(
        "--random-output-len",
        "--output-len",
        type=int,
        default=128,
        help="max_tokens of every request",
    )
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="each request's input and output lengths are drawn uniformly from "
        "[len * (1 - ratio), len * (1 + ratio)]",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension field)"
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrivals")
    p.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="requests sent one at a time before the timed run, not counted",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help="comma-separated metrics (of ttft, tpot, itl, e2el) to report "
        "--metric-percentiles of, beside the mean, median and P99 all four always have",
    )
    p.add_argument(
        "--metric-percentiles", default="99", help='comma-separated percentiles, e.g. "25,50,99"'
    )
    p.add_argument("--save-result", action="store_true", help="write the result as JSON")
    p.add_argument(
        "--save-detailed", action="store_true", help="keep every request's ITLs in the JSON"
    )
    p.add_argument("--result-dir", default=None, help="where --save-result writes")
    p.add_argument(
        "--result-filename",
        default=None,
        help="default: BACKEND-RATEqps[-concurrencyN]-MODEL-YYYYMMDD-HHMMSS.json",
    )
    p.add_argument(
        "--json", default=None, metavar="PATH", help="write the result to PATH (--save-result)"
    )
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def check_args(args: argparse.Namespace) -> None:
    """Validates and completes a parsed command line (ValueError on a bad flag)."""
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0")
    if not args.burstiness > 0:
        raise ValueError("--burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.random_input_len < 1 or args.random_output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    if args.dataset_name is None:
        args.dataset_name = "custom" if args.dataset_path else "random"
    if (args.dataset_name == "custom") != bool(args.dataset_path):
        raise ValueError("--dataset-path goes with --dataset-name custom, and only with it")
    if args.endpoint is None:
        chat = args.backend == "openai-chat"
        args.endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    if args.backend is None:
        chat = args.endpoint.rstrip("/").endswith("chat/completions")
        args.backend = "openai-chat" if chat else "openai"
    if (args.backend == "openai-chat") != args.endpoint.rstrip("/").endswith("chat/completions"):
        raise ValueError(
            f"--backend {args.backend} does not speak --endpoint {args.endpoint}: openai-chat "
            "is for chat/completions, openai for completions"
        )
    percentiles(args)  # raises on a bad list
    if args.api_key is None:
        args.api_key = os.environ.get("OPENAI_API_KEY")


def percentiles(args: argparse.Namespace) -> dict[str, list[float]]:
    """The percentiles each metric reports: P99 always, and --metric-percentiles for the
    metrics of --percentile-metrics."""
    chosen = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if unknown := sorted(set(chosen) - set(METRICS)):
        raise ValueError(f"--percentile-metrics: unknown {unknown}; choose from {METRICS}")
    try:
        ps = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        msg = f"--metric-percentiles: not numbers: {args.metric_percentiles!r}"
        raise ValueError(msg) from None
    if not all(0 < p <= 100 for p in ps):
        raise ValueError("--metric-percentiles must be in (0, 100]")
    return {m: sorted({99.0, *(ps if m in chosen else ())}) for m in METRICS}


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)  # vLLM's key: p99, p99.9


def build_payload(args: argparse.Namespace, model: str, request: SampleRequest) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def _error_message(obj) -> str:
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(obj)


async def send_request(
    client: httpx.AsyncClient, url: str, headers: dict, body: dict, timeout: float
) -> RequestResult:
    res = RequestResult()
    st = time.perf_counter()
    last = st
    finished = False
    text: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    raw = (await resp.aread()).decode("utf-8", "replace")
                    try:
                        msg = _error_message(json.loads(raw))
                    except ValueError:
                        msg = raw.strip()[:200]
                    res.error = f"HTTP {resp.status_code}: {msg}"
                    return res
                async for line in resp.aiter_lines():
                    now = time.perf_counter()
                    line = line.strip()
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, event: lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        finished = True
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        res.error = f"unparseable event: {data[:200]}"
                        return res
                    if not isinstance(chunk, dict):
                        continue
                    if "error" in chunk:
                        res.error = f"error event: {_error_message(chunk)}"
                        return res
                    if piece := _chunk_text(chunk):
                        if res.content_chunks == 0:
                            res.ttft = now - st
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.content_chunks += 1
                        text.append(piece)
                    for choice in chunk.get("choices") or []:
                        if choice.get("finish_reason"):
                            finished = True
                    usage = chunk.get("usage")
                    if usage:
                        if usage.get("completion_tokens") is not None:
                            res.output_tokens = int(usage["completion_tokens"])
                            res.output_tokens_from_usage = True
                        if usage.get("prompt_tokens") is not None:
                            res.prompt_tokens = int(usage["prompt_tokens"])
        res.e2e = time.perf_counter() - st
    except TimeoutError:
        res.error = f"timeout after {timeout:g} s"
        return res
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.generated_text = "".join(text)
    if not finished:
        res.error = "stream ended without [DONE] or a finish_reason"
        return res
    if not res.output_tokens_from_usage:
        res.output_tokens = res.content_chunks
    if res.content_chunks == 0:
        res.error = "no content in the stream"
        return res
    res.success = True
    return res


async def get_model(client: httpx.AsyncClient, base_url: str, headers: dict) -> str:
    try:
        resp = await client.get(f"{base_url}/v1/models", headers=headers, timeout=30)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise SystemExit(f"cannot list models at {base_url}/v1/models ({e}); pass --model") from e


async def get_version(client: httpx.AsyncClient, base_url: str, headers: dict):
    try:
        resp = await client.get(f"{base_url}/version", headers=headers, timeout=10)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return resp.json()
    except ValueError:
        return resp.text.strip()[:200] or None


def _stats(prefix: str, values_s: list[float], ps: list[float]) -> dict:
    keys = [f"{s}_{prefix}_ms" for s in ("mean", "median", "std")]
    keys += [f"p{_p_word(p)}_{prefix}_ms" for p in ps]
    if not values_s:
        return dict.fromkeys(keys)
    a = np.asarray(values_s) * 1e3
    values = [np.mean(a), np.median(a), np.std(a), *np.percentile(a, ps)]
    return {k: float(v) for k, v in zip(keys, values, strict=True)}


def summarize(
    results: list[RequestResult],
    requests: list[SampleRequest],
    duration: float,
    metric_percentiles: dict[str, list[float]],
    tokenizer=None,
) -> dict:
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    if tokenizer is not None:  # the tokenizer counts what the server did not
        for r in ok:
            if not r.output_tokens_from_usage:
                r.output_tokens = count_tokens(r.generated_text, tokenizer)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(
        r.prompt_tokens if r.prompt_tokens is not None else req.prompt_len
        for r, req in zip(results, requests, strict=True)
        if r.success
    )
    tpots = [t for r in ok if (t := r.tpot) is not None]
    per_s = 1 / duration if duration > 0 else 0.0
    metrics = {
        "completed": len(ok),
        "failed": len(failed),
        "errors": [r.error for r in failed[:MAX_ERRORS_REPORTED]],
        "duration": duration,
        "duration_s": duration,  # benchmarks/serve.py's name
        "total_input_tokens": in_tokens,
        "input_tokens_from_usage": all(r.prompt_tokens is not None for r in ok),
        "total_output_tokens": out_tokens,
        "output_tokens_from_usage": all(r.output_tokens_from_usage for r in ok),
        "request_throughput": len(ok) * per_s,
        "output_throughput": out_tokens * per_s,
        "total_token_throughput": (in_tokens + out_tokens) * per_s,
    }
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": tpots,
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.e2e for r in ok],
    }
    for key in METRICS:
        metrics |= _stats(key, values[key], metric_percentiles[key])
    return metrics


async def run_benchmark(args: argparse.Namespace, tokenizer=None) -> dict:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    requests = make_requests(args, tokenizer)
    offsets = arrival_offsets(args.num_prompts, args.request_rate, args.seed, args.burstiness)
    # No pool limit or pool timeout: the semaphore (or the arrival process) is the only cap.
    # trust_env=False keeps proxies from the environment out of the measured path.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(None), limits=limits, trust_env=False
    ) as client:
        model = args.model or await get_model(client, base_url, headers)
        version = await get_version(client, base_url, headers)
        url = base_url + args.endpoint

        for i in range(args.num_warmups):
            body = build_payload(args, model, requests[0])
            r = await send_request(client, url, headers, body, args.timeout)
            print(f"warmup {i + 1}/{args.num_warmups}: " + ("ok" if r.success else r.error))

        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(requests), disable=args.disable_tqdm, unit="req")
        start = time.perf_counter()

        async def one(request: SampleRequest, offset: float) -> RequestResult:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = build_payload(args, model, request)
            if sem is None:
                res = await send_request(client, url, headers, body, args.timeout)
                res.start = offset
            else:
                async with sem:
                    sent = time.perf_counter()
                    res = await send_request(client, url, headers, body, args.timeout)
                    res.start = sent - start
            bar.update(1)
            return res

        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
        duration = time.perf_counter() - start
        bar.close()

    metrics = summarize(results, requests, duration, percentiles(args), tokenizer)
    cfg = {k: v for k, v in vars(args).items() if k not in ("api_key", "func")}
    cfg["api_key"] = "<redacted>" if args.api_key else None
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    cfg["request_rate"] = rate
    records = []
    for r in results:
        rec = {
            "success": r.success,
            "error": r.error or None,
            "start_s": r.start,
            "ttft_ms": r.ttft * 1e3 if r.success else None,
            "tpot_ms": r.tpot * 1e3 if r.success and r.tpot is not None else None,
            "e2el_ms": r.e2e * 1e3 if r.success else None,
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens if r.success else None,
            "content_chunks": r.content_chunks,
        }
        if args.save_detailed:
            rec["itl_ms"] = [x * 1e3 for x in r.itl]
            rec["generated_text"] = r.generated_text
        records.append(rec)
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "backend": args.backend,
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model": model,
        "model_id": model,
        "tokenizer_id": args.tokenizer,
        "server_version": version,
        "num_prompts": args.num_prompts,
        "request_rate": rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "args": cfg,
        **metrics,
        "requests": records,
    }


def format_table(res: dict, metric_percentiles: dict[str, list[float]]) -> str:
    def num(v, fmt="{:.2f}"):
        return "n/a" if v is None else fmt.format(v)

    def counted(from_usage: bool, fallback: str) -> str:
        if from_usage:
            return ""
        return " (tokenizer)" if res["tokenizer_id"] else f" ({fallback})"

    rows: list[tuple[str, str] | str] = [
        " Serving Benchmark Result ",
        ("Model", str(res["model"])),
        ("Endpoint", res["base_url"] + res["endpoint"]),
        ("Request rate (req/s)", str(res["request_rate"])),
        ("Burstiness", f"{res['burstiness']:g}"),
        ("Max concurrency", str(res["max_concurrency"] or "unlimited")),
        ("Successful requests", str(res["completed"])),
        ("Failed requests", str(res["failed"])),
        ("Benchmark duration (s)", num(res["duration"])),
        (
            "Total input tokens" + counted(res["input_tokens_from_usage"], "words"),
            str(res["total_input_tokens"]),
        ),
        (
            "Total generated tokens" + counted(res["output_tokens_from_usage"], "chunks"),
            str(res["total_output_tokens"]),
        ),
        ("Request throughput (req/s)", num(res["request_throughput"])),
        ("Output token throughput (tok/s)", num(res["output_throughput"])),
        ("Total Token throughput (tok/s)", num(res["total_token_throughput"])),
    ]
    for key, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        rows.append(f" {title} ")
        rows.append((f"Mean {key.upper()} (ms)", num(res[f"mean_{key}_ms"])))
        rows.append((f"Median {key.upper()} (ms)", num(res[f"median_{key}_ms"])))
        for p in metric_percentiles[key]:
            word = _p_word(p)
            rows.append((f"P{word} {key.upper()} (ms)", num(res[f"p{word}_{key}_ms"])))
    width = 60
    lines = []
    for row in rows:
        if isinstance(row, str):
            lines.append(row.center(width, "=" if not lines else "-"))
        else:
            lines.append(f"{row[0]:<41} {row[1]:>18}")
    lines.append("=" * width)
    if res["errors"]:
        lines.append(f"First {len(res['errors'])} error(s):")
        lines += [f"  {e}" for e in res["errors"]]
    return "\n".join(lines)


def result_path(args: argparse.Namespace, res: dict) -> str | None:
    """Where the result goes: --json, or with --save-result --result-dir/--result-filename,
    by default named as vLLM names it."""
    if args.json:
        return args.json
    if not args.save_result:
        return None
    name = args.result_filename
    if name is None:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model = str(res["model"]).rstrip("/").split("/")[-1]
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"{res['backend']}-{res['request_rate']}qps{concurrency}-{model}-{stamp}.json"
    return os.path.join(args.result_dir, name) if args.result_dir else name


def run(args: argparse.Namespace) -> dict:
    """Runs the benchmark of a command line `check_args` passed, prints the table, saves the
    JSON."""
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    res = asyncio.run(run_benchmark(args, tokenizer))
    print(format_table(res, percentiles(args)))
    if path := result_path(args, res):
        write_json(path, res)
    return res


def main(argv: list[str] | None = None) -> dict:
    """benchmarks/serve.py's entry: parses `argv` (errors exit as argparse's do) and runs."""
    p = argparse.ArgumentParser(
        description="Serving benchmark (TTFT, TPOT, ITL, E2E, throughput) against an "
        "OpenAI-compatible server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_cli_args(p)
    args = p.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        p.error(str(e))
    return run(args)
