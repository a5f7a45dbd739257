"""Online serving benchmark against any OpenAI-compatible server, in the spirit of
`vllm bench serve`.

    .venv/bin/python benchmarks/serve.py [--base-url http://127.0.0.1:8000] \
        [--endpoint /v1/completions | /v1/chat/completions] [--model ID] \
        [--num-prompts 64] [--request-rate inf] [--max-concurrency 8] \
        [--input-len 128] [--output-len 128] [--ignore-eos] [--json out.json]

Requests arrive as a Poisson process of --request-rate req/s (seeded; "inf" sends them all at
once), and at most --max-concurrency of them are in flight. Every request streams (SSE with
`stream_options.include_usage`) and every chunk is timestamped. Per request, as vLLM defines
them:

- TTFT: from sending the request to the first chunk carrying content.
- ITL: the gaps between consecutive content chunks (pooled over all requests).
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token.
- E2E: from sending the request to the end of the stream.
- Output tokens: `completion_tokens` of the final usage chunk, or, when the server sends no
  usage, the number of content chunks. Prompt tokens come from the same usage chunk.

Synthetic prompts are --input-len random words from a fixed list of common English words
(about one token each for common tokenizers; the exact count is the server's `prompt_tokens`),
so no dataset is downloaded; --prompt-file takes one prompt per line instead. --ignore-eos
sends the vLLM extension field `ignore_eos` so every request generates exactly --output-len
tokens. Failed requests (HTTP errors, `data: {"error": ...}` events, timeouts, broken
streams) are counted and their first messages reported; they never stop the run.

Prints a table and, with --json, writes the metrics, the arguments (API key redacted), the
server's `/version` when it answers, and per-request records.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx
import numpy as np

# Common short English words; most BPE vocabularies hold " word" as one token.
WORDS = (
    "the of and to in is was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time "
    "has look two more write go see number no way could people my than first water been call "
    "who oil its now find long down day did get come made may part over new sound take only "
    "little work know place year live me back give most very after thing our just name good "
    "sentence man think say great where help through much before line right too mean old any "
    "same tell boy follow came want show also around form three small set put end does another "
    "well large must big even such because turn here why ask went men read need land different "
    "home us move try kind hand picture again change off play spell air away animal house point "
    "page letter mother answer found study still learn should world high every near add food "
    "between own below country plant last school father keep tree never start city earth eye "
    "light thought head under story saw left few while along might close something seem next "
    "hard open example begin life always those both paper together got group often run important"
).split()

MAX_ERRORS_REPORTED = 5


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
    text_chars: int = 0
    start: float = 0.0  # offset from the benchmark start, seconds

    @property
    def tpot(self) -> float | None:
        if self.output_tokens > 1:
            return (self.e2e - self.ttft) / (self.output_tokens - 1)
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Serving benchmark (TTFT, TPOT, ITL, E2E, throughput) against an "
        "OpenAI-compatible server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"]
    )
    p.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help='mean arrival rate in req/s (Poisson); "inf" sends every request at once',
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most this many requests in flight (default: no cap)",
    )
    p.add_argument("--input-len", type=int, default=128, help="words per synthetic prompt")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    p.add_argument(
        "--prompt-file",
        default=None,
        help="one prompt per line (cycled to --num-prompts) instead of synthetic prompts",
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
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    p.add_argument(
        "--save-detailed", action="store_true", help="keep every request's ITLs in the JSON"
    )
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if args.api_key is None:
        args.api_key = os.environ.get("OPENAI_API_KEY")
    return args


def make_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
        lines = [line for line in lines if line.strip()]
        if not lines:
            raise SystemExit(f"{args.prompt_file}: no prompts")
        return [lines[i % len(lines)] for i in range(args.num_prompts)]
    rng = random.Random(args.seed)
    return [" ".join(rng.choices(WORDS, k=args.input_len)) for _ in range(args.num_prompts)]


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: the first at 0, then exponential gaps of mean
    1/rate (a Poisson process); all zero when rate is inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def build_payload(args: argparse.Namespace, model: str, prompt: str) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
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
                    text = _chunk_text(chunk)
                    if text:
                        if res.content_chunks == 0:
                            res.ttft = now - st
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.content_chunks += 1
                        res.text_chars += len(text)
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


def _stats(prefix: str, values_s: list[float]) -> dict:
    if not values_s:
        return {f"mean_{prefix}_ms": None, f"median_{prefix}_ms": None, f"p99_{prefix}_ms": None}
    a = np.asarray(values_s) * 1e3
    return {
        f"mean_{prefix}_ms": float(np.mean(a)),
        f"median_{prefix}_ms": float(np.median(a)),
        f"p99_{prefix}_ms": float(np.percentile(a, 99)),
    }


def summarize(results: list[RequestResult], prompts: list[str], duration: float) -> dict:
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_known = all(r.prompt_tokens is not None for r in ok)
    in_tokens = sum(
        r.prompt_tokens if r.prompt_tokens is not None else len(p.split())
        for r, p in zip(results, prompts, strict=True)
        if r.success
    )
    tpots = [t for r in ok if (t := r.tpot) is not None]
    metrics = {
        "completed": len(ok),
        "failed": len(failed),
        "errors": [r.error for r in failed[:MAX_ERRORS_REPORTED]],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "input_tokens_from_usage": in_known,
        "total_output_tokens": out_tokens,
        "output_tokens_from_usage": all(r.output_tokens_from_usage for r in ok),
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
    }
    metrics |= _stats("ttft", [r.ttft for r in ok])
    metrics |= _stats("tpot", tpots)
    metrics |= _stats("itl", [x for r in ok for x in r.itl])
    metrics |= _stats("e2el", [r.e2e for r in ok])
    return metrics


async def run_benchmark(args: argparse.Namespace) -> dict:
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    prompts = make_prompts(args)
    offsets = arrival_offsets(args.num_prompts, args.request_rate, args.seed)
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
            r = await send_request(
                client, url, headers, build_payload(args, model, prompts[0]), args.timeout
            )
            print(f"warmup {i + 1}/{args.num_warmups}: " + ("ok" if r.success else r.error))

        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        start = time.perf_counter()

        async def one(prompt: str, offset: float) -> RequestResult:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = build_payload(args, model, prompt)
            if sem is None:
                res = await send_request(client, url, headers, body, args.timeout)
            else:
                async with sem:
                    sent = time.perf_counter()
                    res = await send_request(client, url, headers, body, args.timeout)
                    res.start = sent - start
                    return res
            res.start = offset
            return res

        results = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets, strict=True)))
        duration = time.perf_counter() - start

    metrics = summarize(results, prompts, duration)
    cfg = {k: v for k, v in vars(args).items() if k != "api_key"}
    cfg["api_key"] = "<redacted>" if args.api_key else None
    if math.isinf(cfg["request_rate"]):
        cfg["request_rate"] = "inf"
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
        records.append(rec)
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "backend": "openai-chat" if args.endpoint == "/v1/chat/completions" else "openai",
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model": model,
        "server_version": version,
        "args": cfg,
        **metrics,
        "requests": records,
    }


def format_table(res: dict) -> str:
    def num(v, fmt="{:.2f}"):
        return "n/a" if v is None else fmt.format(v)

    rows: list[tuple[str, str] | str] = [
        " Serving Benchmark Result ",
        ("Model", str(res["model"])),
        ("Endpoint", res["base_url"] + res["endpoint"]),
        ("Request rate (req/s)", str(res["args"]["request_rate"])),
        ("Max concurrency", str(res["args"]["max_concurrency"] or "unlimited")),
        ("Successful requests", str(res["completed"])),
        ("Failed requests", str(res["failed"])),
        ("Benchmark duration (s)", num(res["duration_s"])),
        (
            "Total input tokens" + ("" if res["input_tokens_from_usage"] else " (words)"),
            str(res["total_input_tokens"]),
        ),
        (
            "Total generated tokens" + ("" if res["output_tokens_from_usage"] else " (chunks)"),
            str(res["total_output_tokens"]),
        ),
        ("Request throughput (req/s)", num(res["request_throughput"])),
        ("Output token throughput (tok/s)", num(res["output_throughput"])),
        ("Total token throughput (tok/s)", num(res["total_token_throughput"])),
    ]
    for key, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        rows.append(f" {title} ")
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            rows.append((f"{label} {key.upper()} (ms)", num(res[f"{stat}_{key}_ms"])))
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


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    res = asyncio.run(run_benchmark(args))
    print(format_table(res))
    if args.json:
        write_json(args.json, res)
    return res


def write_json(path: str, res: dict) -> None:
    """Writes a result as indented JSON to `path`, creating its directory (soak.py too)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=2)
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(0 if main()["completed"] > 0 else 1)
