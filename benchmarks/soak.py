"""Soak run for `jaxllm serve` (issue "Hardening"): minutes of mixed random traffic, then
checks that nothing leaked and that the server still stops cleanly.

    .venv/bin/python benchmarks/soak.py --duration 600 --json benchmarks/results/soak-cpu-2core.json
    .venv/bin/python benchmarks/soak.py --duration 30                  # a smoke run
    .venv/bin/python benchmarks/soak.py --base-url URL --api-key KEY [--server-pid PID]

It writes a tiny random model into a temporary directory (jaxllm.testing, no network), starts
`python -m jaxllm.cli serve` on it (context 256, 128 KV pages, 16 sequences, an API key) and
waits for /health; with --base-url it uses that server instead and neither starts nor stops
one. --concurrency client tasks then send requests back to back for --duration seconds, drawn
from seeded generators: completions or chat, streamed or not, n 1-4, max_tokens 1-64, and at
random temperature/top_p/top_k/min_p, seed, logprobs, stop strings and token ids, the three
penalties, logit_bias, min_tokens, ignore_eos. A share (--invalid-share) is invalid on purpose
and must get a 4xx in OpenAI's error shape. Valid ones are sent as one of four clients: normal
(reads it all), abort (closes a stream after 1-5 events), disconnect (gives up after 1-200 ms,
mostly before any answer) and slow reader (0.2-1 s between events, closes after 2-10 s).

Outcomes: ok (a complete, well-formed answer), expected_4xx, unexpected_4xx (a valid request
refused, or a 4xx error event in its stream), 5xx (status or error event), transport_error (a
connection error or timeout the client did not cause), bad_response (cut short, malformed, or
an invalid request accepted), aborted (the client left on purpose). Latencies are those of
normal requests that completed: p50/p99 of non-streamed ones, and of streams end to end.

Memory: the VmRSS of the server and all its descendants (the engine core is a child process),
every 10 s; the baseline is the sample at minute 1 (at half time for runs under 2 minutes, to
leave warm-up compilations out), the end figure is taken after the load. At the end the engine
must become idle (vllm:num_requests_running and _waiting 0) with vllm:kv_cache_usage_perc 0
(no KV page leaked) and /health 200; then SIGTERM, and the server must exit with 0 or -SIGTERM
within 60 s, log "Application shutdown complete" and leave no child behind.

Prints a table (--json PATH: every figure) and exits 1 on any 5xx, unexpected_4xx,
transport_error or bad_response, a leaked KV page, RSS growth >= --max-rss-growth-mib (100), a
dead or unhealthy server, or an unclean shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np

from jaxllm.bench import write_json

REPO = Path(__file__).resolve().parent.parent
NUM_PAGES = 128
SERVER_FLAGS = ["--served-model-name", "tiny", "--max-model-len", "256",
                "--num-pages", str(NUM_PAGES), "--max-num-seqs", "16",
                "--max-num-batched-tokens", "128"]  # fmt: skip
WORDS = ("the quick brown fox jumps over lazy dog Paris is capital of France Berlin Germany "
         "once upon a time there was small model that ran on CPU def add return hello world "
         "numbers symbols café naïve 日本語 🙂").split()  # fmt: skip
STOPS = ["\n", ".", "the", " a", "e", "ab", "zz", "🙂"]
FAILING = ("unexpected_4xx", "5xx", "transport_error", "bad_response")
OUTCOMES = ("ok", "expected_4xx", *FAILING, "aborted")
BEHAVIOURS = {"normal": 0.55, "abort": 0.15, "disconnect": 0.15, "slow": 0.15}
MAX_ERRORS_KEPT = 5  # per outcome


@dataclass
class Req:
    path: str
    body: dict | bytes
    valid: bool = True
    label: str = ""  # what makes an invalid request invalid
    headers: dict | None = None  # replaces the auth header
    n: int = 1


@dataclass
class Tally:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    by_behaviour: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    errors: dict = field(default_factory=lambda: collections.defaultdict(list))
    latency: dict = field(default_factory=lambda: {"non_stream": [], "stream": []})

    def add(self, behaviour: str, outcome: str, error: str = "") -> None:
        self.outcomes[outcome] += 1
        self.by_behaviour[behaviour][outcome] += 1
        if error and outcome != "aborted" and len(self.errors[outcome]) < MAX_ERRORS_KEPT:
            self.errors[outcome].append(f"[{behaviour}] {error}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Soak run: mixed random traffic against `jaxllm serve`, then leak, memory "
        "and shutdown checks.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=32, help="client tasks")
    p.add_argument("--seed", type=int, default=0, help="seeds every client's generator")
    p.add_argument("--invalid-share", type=float, default=0.1, help="requests invalid on purpose")
    p.add_argument("--base-url", default=None, help="target this server instead of starting one")
    p.add_argument("--api-key", default=None, help="with --base-url; else $OPENAI_API_KEY")
    p.add_argument("--model", default=None, help="with --base-url; else GET /v1/models")
    p.add_argument("--server-pid", type=int, default=None, help="with --base-url: sample its RSS")
    p.add_argument("--num-pages", type=int, default=NUM_PAGES, help="to report leaked pages")
    p.add_argument(
        "--max-rss-growth-mib", type=float, default=100.0, help="the limit, minute 1 to end"
    )
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to /health 200")
    p.add_argument("--server-log", default=None, help="keep the server's log here")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    args = p.parse_args(argv)
    if args.duration <= 0 or args.concurrency < 1 or not 0 <= args.invalid_share <= 1:
        p.error("--duration must be > 0, --concurrency >= 1, --invalid-share in [0, 1]")
    if args.base_url and args.api_key is None:
        args.api_key = os.environ.get("OPENAI_API_KEY")
    return args


# ---- requests ------------------------------------------------------------------------------


def valid_request(rng: random.Random, model: str) -> Req:
    chat = rng.random() < 0.5
    n, max_tokens = rng.randint(1, 4), rng.randint(1, 64)
    text = " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))  # short: the context is 256
    body: dict = {"model": model, "n": n}
    body["max_completion_tokens" if chat and rng.random() < 0.5 else "max_tokens"] = max_tokens
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.3:
            body["messages"].insert(0, {"role": "system", "content": rng.choice(WORDS)})
    else:
        ids = [rng.randint(3, 300) for _ in range(rng.randint(1, 24))]
        body["prompt"] = text if rng.random() < 0.8 else ids
    maybe = {
        "temperature": lambda: rng.choice([0.0, round(rng.uniform(0, 2), 3)]),
        "top_p": lambda: round(rng.uniform(0.05, 1), 3),
        "top_k": lambda: rng.choice([-1, 0, 1, 5, 50]),
        "min_p": lambda: round(rng.uniform(0, 0.5), 3),
        "seed": lambda: rng.randint(0, 2**32),
        "stop": lambda: rng.sample(STOPS, rng.randint(1, 3)),
        "stop_token_ids": lambda: rng.sample(range(3, 300), rng.randint(1, 3)),
        "presence_penalty": lambda: round(rng.uniform(-2, 2), 3),
        "frequency_penalty": lambda: round(rng.uniform(-2, 2), 3),
        "repetition_penalty": lambda: round(rng.uniform(0.5, 2), 3),
        "logit_bias": lambda: {
            str(rng.randint(3, 300)): round(rng.uniform(-100, 100), 2)
            for _ in range(rng.randint(1, 5))
        },  # fmt: skip
        "min_tokens": lambda: rng.randint(0, max_tokens),
        "ignore_eos": lambda: rng.random() < 0.5,
    }
    for name, value in maybe.items():
        if rng.random() < 0.3:
            body[name] = value()
    if rng.random() < 0.3:
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 5)
        else:
            body["logprobs"] = rng.randint(0, 5)
    if not chat and rng.random() < 0.1:
        body["echo"] = True
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Req(path, body, n=n)


def invalid_request(rng: random.Random, model: str, api_key: str | None) -> Req:
    comp = {"model": model, "prompt": "a", "max_tokens": 4, "stream": rng.random() < 0.5}
    chat = {**comp, "messages": [{"role": "user", "content": "a"}]}
    del chat["prompt"]
    c, ch = "/v1/completions", "/v1/chat/completions"
    cases: list[tuple[str, str, dict | bytes]] = [
        ("temperature -1", c, {**comp, "temperature": -1}),
        ("top_p 0", c, {**comp, "top_p": 0}),
        ("max_tokens 0", c, {**comp, "max_tokens": 0}),
        ("n 100000", c, {**comp, "n": 100_000}),
        ("unknown model", c, {**comp, "model": "no-such-model"}),
        ("no prompt", c, {"model": model, "max_tokens": 4}),
        ("logprobs 500", c, {**comp, "logprobs": 500}),
        ("past the context", c, {**comp, "max_tokens": 100_000}),
        ("min_tokens > max_tokens", c, {**comp, "min_tokens": 9}),
        ("stop token id out of range", c, {**comp, "stop_token_ids": [2**31]}),
        ("logit_bias key", c, {**comp, "logit_bias": {"x": 1}}),
        ("stream_options, no stream", c, {**comp, "stream": False, "stream_options": {}}),
        ("no messages", ch, {**chat, "messages": []}),
        ("top_logprobs, no logprobs", ch, {**chat, "top_logprobs": 2}),
        ("tools", ch, {**chat, "tools": [{"type": "function"}]}),
        ("not JSON", c, b"{not json"),
    ]
    if api_key:
        cases.append(("wrong API key", c, comp))
    label, path, body = rng.choice(cases)
    headers = {"Authorization": "Bearer wrong"} if label == "wrong API key" else None
    return Req(path, body, valid=False, label=label, headers=headers)


def _refusal(req: Req, resp: httpx.Response) -> tuple[str, str]:
    """The outcome of an answer other than 200, or of an invalid request's answer."""
    text = resp.text[:300]
    if resp.status_code >= 500:
        return "5xx", f"HTTP {resp.status_code}: {text}"
    if resp.status_code < 400:
        what = "a valid request" if req.valid else f"an invalid request ({req.label})"
        return "bad_response", f"{what} got HTTP {resp.status_code}"
    if req.valid:
        return "unexpected_4xx", f"HTTP {resp.status_code}: {text}"
    try:
        err = resp.json()["error"]
        shaped = set(err) == {"message", "type", "param", "code"}
        shaped = shaped and err["code"] == resp.status_code
    except (ValueError, KeyError, TypeError):
        shaped = False
    if not shaped:
        return "bad_response", f"({req.label}) error not in OpenAI's shape: {text}"
    return "expected_4xx", ""


def _check_full(req: Req, resp: httpx.Response) -> tuple[str, str]:
    try:
        choices = resp.json()["choices"]
        if len(choices) == req.n and all(c.get("finish_reason") for c in choices):
            return "ok", ""
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return "bad_response", f"incomplete answer: {resp.text[:300]}"


async def _read_stream(
    req: Req, resp: httpx.Response, behaviour: str, rng: random.Random
) -> tuple[str, str]:
    leave_after = rng.randint(1, 5) if behaviour == "abort" else None
    slow_until = time.monotonic() + rng.uniform(2, 10) if behaviour == "slow" else None
    finished, done, events = set(), False, 0
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        try:
            event = json.loads(data)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            return "bad_response", f"not an event: {data[:200]}"
        if "error" in event:
            code = event["error"].get("code") if isinstance(event["error"], dict) else None
            kind = "5xx" if not isinstance(code, int) or code >= 500 else "unexpected_4xx"
            return kind, f"error event: {data[:300]}"
        finished |= {c.get("index") for c in event.get("choices") or [] if c.get("finish_reason")}
        events += 1
        if leave_after is not None and events >= leave_after:
            return "aborted", ""  # leaving the `async with` closes the connection
        if slow_until is not None:
            if time.monotonic() > slow_until:
                return "aborted", ""
            await asyncio.sleep(rng.uniform(0.2, 1.0))
    if not done or len(finished) < req.n:
        return "bad_response", f"stream cut short: [DONE] {done}, {len(finished)}/{req.n} finished"
    return "ok", ""


async def send(
    client: httpx.AsyncClient, url: str, auth: dict, req: Req, behaviour: str,
    rng: random.Random, timeout: float,
) -> tuple[str, str, float | None]:  # fmt: skip
    """Sends `req` as `behaviour` has it: (outcome, error, seconds taken if it completed)."""
    headers = req.headers if req.headers is not None else auth
    kw: dict = {"headers": headers}
    if isinstance(req.body, bytes):
        kw = {"headers": {**headers, "content-type": "application/json"}, "content": req.body}
    else:
        kw["json"] = req.body
    stream = isinstance(req.body, dict) and bool(req.body.get("stream")) and req.valid
    start = time.perf_counter()
    try:
        async with asyncio.timeout(
            rng.uniform(0.001, 0.2) if behaviour == "disconnect" else timeout
        ):
            if not stream:
                resp = await client.post(url + req.path, **kw)
                if resp.status_code != 200 or not req.valid:
                    outcome, error = _refusal(req, resp)
                else:
                    outcome, error = _check_full(req, resp)
            else:
                async with client.stream("POST", url + req.path, **kw) as resp:
                    if resp.status_code != 200:
                        await resp.aread()
                        outcome, error = _refusal(req, resp)
                    else:
                        outcome, error = await _read_stream(req, resp, behaviour, rng)
    except TimeoutError:
        if behaviour == "disconnect":
            outcome, error = "aborted", ""
        else:
            outcome, error = "transport_error", f"no answer in {timeout:g} s"
    except httpx.HTTPError as e:
        outcome, error = "transport_error", f"{type(e).__name__}: {e}"
    except Exception as e:  # a surprise in the answer must not end a 10-minute run
        outcome, error = "bad_response", f"client-side {type(e).__name__}: {e}"
    return outcome, error, time.perf_counter() - start if outcome == "ok" else None


async def client_task(
    i: int, args: argparse.Namespace, client: httpx.AsyncClient, url: str, model: str,
    stop: asyncio.Event, tally: Tally,
) -> None:  # fmt: skip
    """Sends one request after another until `stop`."""
    rng = random.Random(args.seed * 100_003 + i)
    auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    names, weights = zip(*BEHAVIOURS.items(), strict=True)
    while not stop.is_set():
        if rng.random() < args.invalid_share:
            req, behaviour = invalid_request(rng, model, args.api_key), "invalid"
        else:
            req, behaviour = valid_request(rng, model), rng.choices(names, weights)[0]
            req.body["stream"] = behaviour in ("abort", "slow") or rng.random() < 0.5
            if req.body["stream"] and rng.random() < 0.5:
                req.body["stream_options"] = {"include_usage": rng.random() < 0.5}
        outcome, error, seconds = await send(
            client, url, auth, req, behaviour, rng, args.request_timeout
        )
        tally.add(behaviour, outcome, error)
        if seconds is not None and behaviour == "normal":
            tally.latency["stream" if req.body.get("stream") else "non_stream"].append(seconds)


# ---- the server process ----------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: state, ppid, ..."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    children = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            children[int(stat[1])].append(int(entry))
    tree = [pid]
    for p in tree:
        tree += children.get(p, [])
    return tree


def rss_mib(pid: int) -> float:
    kib = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                kib += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            pass
    return kib / 1024


def start_server(
    tmp: Path, api_key: str, log_path: Path, timeout: float
) -> tuple[subprocess.Popen, str]:
    """Writes the tiny model, starts `jaxllm serve` on it and waits for /health 200."""
    from jaxllm.testing import write_tiny_checkpoint, write_tiny_tokenizer

    model = write_tiny_checkpoint(tmp / "tiny", write_tiny_tokenizer(tmp / "tokenizer"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "jaxllm.cli", "serve", str(model), "--port", str(port),
           *SERVER_FLAGS, "--api-key", api_key]  # fmt: skip
    with open(log_path, "w") as log:  # a file, not a pipe: nobody would drain a pipe
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    kill_tree(proc)
    raise SystemExit(f"the server did not become healthy:\n{_tail(log_path)}")


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL to the server and its descendants (after a failure: leave nothing behind)."""
    for pid in reversed(process_tree(proc.pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def stop_server(proc: subprocess.Popen, log_path: Path, timeout: float = 60) -> dict:
    """SIGTERM, as an operator would, then the checks of tests/test_server_e2e._wait_stopped."""
    children = {p: _cmdline(p) for p in process_tree(proc.pid)[1:]}
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
        exited = True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        exited = False
    seconds = time.monotonic() - start
    survivors = []
    for pid, cmdline in children.items():
        # multiprocessing's resource tracker leaves once it reads EOF from the dead server.
        deadline = time.monotonic() + (5 if b"resource_tracker" in cmdline else 0)
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            survivors.append(cmdline.replace(b"\0", b" ").decode(errors="replace")[:200])
            with contextlib.suppress(ProcessLookupError):  # ours: leave nothing behind
                os.kill(pid, signal.SIGKILL)
    log = log_path.read_text(errors="replace")
    said_done = "Application shutdown complete" in log
    clean = exited and proc.returncode in (0, -signal.SIGTERM) and not survivors and said_done
    return {"clean": clean, "returncode": proc.returncode, "seconds": round(seconds, 2),
            "exited_in_time": exited, "shutdown_logged": said_done, "survivors": survivors,
            "log_tracebacks": log.count("Traceback (most recent call last)")}  # fmt: skip


def metric(text: str, name: str) -> float | None:
    """The value of `vllm:<name>` in a Prometheus text page, summed over its labels."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith((f"vllm:{name}{{", f"vllm:{name} "))]  # fmt: skip
    return sum(values) if values else None


async def wait_idle(client: httpx.AsyncClient, url: str, timeout: float = 60) -> dict:
    """Waits for no running or waiting request, then gives the KV usage 5 s to reach 0 (the
    gauges come from the core's latest step)."""
    deadline, grace = time.monotonic() + timeout, None
    while True:
        try:
            text = (await client.get(f"{url}/metrics", timeout=10)).text
        except httpx.HTTPError:
            text = ""
        running, waiting = (
            metric(text, "num_requests_running"),
            metric(text, "num_requests_waiting"),
        )
        usage = metric(text, "kv_cache_usage_perc")
        idle = running == 0 and waiting == 0
        if idle and grace is None:
            grace = time.monotonic() + 5
        now = time.monotonic()
        if (idle and (usage == 0 or now > grace)) or now > deadline:
            return {"idle": idle, "running": running, "waiting": waiting, "kv_usage": usage}
        await asyncio.sleep(0.5)


# ---- the run -------------------------------------------------------------------------------


async def soak(
    args: argparse.Namespace, url: str, pid: int | None, proc: subprocess.Popen | None
) -> dict:
    """The load, the memory samples and the checks after it; everything but the shutdown."""
    tally, samples, stop = Tally(), [], asyncio.Event()
    # Idle connections expire before uvicorn's 5 s keep-alive ends: reusing one the server is
    # closing fails with a transport error that is no fault of the server.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=1)
    async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=False) as client:
        model = args.model
        if model is None:
            auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            model = (await client.get(f"{url}/v1/models", headers=auth)).json()["data"][0]["id"]
        t0 = time.monotonic()

        async def sampler() -> None:
            while not stop.is_set():
                if pid is not None:
                    samples.append((round(time.monotonic() - t0, 1), round(rss_mib(pid), 1)))
                if len(samples) % 6 == 1 or pid is None:
                    rss = f", RSS {samples[-1][1]:.0f} MiB" if samples else ""
                    print(f"[{time.monotonic() - t0:5.0f} s] {dict(tally.outcomes)}{rss}",
                          flush=True)  # fmt: skip
                if (proc is not None and proc.poll() is not None) or (pid and not _alive(pid)):
                    print("the server died", flush=True)
                    stop.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 60 if pid is None else 10)

        tasks = [asyncio.create_task(sampler())]
        tasks += [asyncio.create_task(client_task(i, args, client, url, model, stop, tally))
                  for i in range(args.concurrency)]  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), args.duration)
        stop.set()
        await asyncio.gather(*tasks)
        load_s = time.monotonic() - t0
        alive = (proc is None or proc.poll() is None) and (pid is None or _alive(pid))
        idle = await wait_idle(client, url) if alive else {}
        rss_end = round(rss_mib(pid), 1) if pid is not None and alive else None
        try:
            health = (await client.get(f"{url}/health", timeout=10)).status_code
        except httpx.HTTPError:
            health = None
    base_t = min(60.0, args.duration / 2)
    rss_1 = next((mib for t, mib in samples if t >= base_t), None)
    lat = {k: [x * 1e3 for x in v] for k, v in tally.latency.items()}
    usage = idle.get("kv_usage")
    return {
        "load_s": round(load_s, 1), "model": model, "server_alive": alive,
        "requests": sum(tally.outcomes.values()),
        "outcomes": {o: tally.outcomes[o] for o in OUTCOMES},
        "by_behaviour": {b: dict(c) for b, c in tally.by_behaviour.items()},
        "errors": dict(tally.errors),
        **{f"{q}_{k}_ms": round(float(np.percentile(v, p)), 1) if v else None
           for k, v in lat.items() for q, p in (("p50", 50), ("p99", 99))},
        "rss_baseline_at_s": base_t, "rss_minute1_mib": rss_1, "rss_end_mib": rss_end,
        "rss_growth_mib": None if None in (rss_1, rss_end) else round(rss_end - rss_1, 1),
        "rss_samples": samples, **{f"final_{k}": v for k, v in idle.items()},
        "leaked_kv_pages": None if usage is None else round(usage * args.num_pages, 1),
        "health_after": health,
    }  # fmt: skip


def failures(res: dict, args: argparse.Namespace) -> list[str]:
    """Why the run fails, if it does."""
    out = [f"{res['outcomes'][o]} {o}" for o in FAILING if res["outcomes"][o]]
    if not res["server_alive"]:
        out.append("the server died")
    if res.get("final_idle") is False:
        out.append("the engine did not become idle")
    if res["server_alive"] and res.get("final_kv_usage") != 0:
        out.append(f"KV usage after the run: {res.get('final_kv_usage')}")
    if res["health_after"] != 200:
        out.append(f"/health after the run: {res['health_after']}")
    growth = res["rss_growth_mib"]
    if growth is not None and growth >= args.max_rss_growth_mib:
        out.append(f"RSS grew {growth} MiB")
    if res.get("shutdown") and not res["shutdown"]["clean"]:
        out.append(f"unclean shutdown: {res['shutdown']}")
    return out


def format_table(res: dict) -> str:
    def num(v) -> str:
        return "n/a" if v is None else str(v)

    def p50_p99(key: str) -> str:
        return f"{num(res[f'p50_{key}_ms'])} / {num(res[f'p99_{key}_ms'])}"

    shutdown = res.get("shutdown")
    clean = "not ours" if shutdown is None else "yes" if shutdown["clean"] else "NO"
    rows = [("Load duration (s)", res["load_s"]), ("Requests sent", res["requests"])]
    rows += [(f"  {o}", n) for o, n in res["outcomes"].items()]
    rows += [
        ("p50 / p99 non-stream (ms)", p50_p99("non_stream")),
        ("p50 / p99 stream end to end (ms)", p50_p99("stream")),
        ("RSS minute 1 (MiB)", num(res["rss_minute1_mib"])),
        ("RSS end (MiB)", num(res["rss_end_mib"])),
        ("RSS growth (MiB)", num(res["rss_growth_mib"])),
        ("KV usage after idle", num(res.get("final_kv_usage"))),
        ("Leaked KV pages", num(res["leaked_kv_pages"])),
        ("/health after the run", num(res["health_after"])),
        ("Clean shutdown", clean),
        ("Tracebacks in the server log", num(shutdown and shutdown["log_tracebacks"])),
    ]
    lines = [" Soak Result ".center(60, "=")]
    lines += [f"{k:<34} {v!s:>25}" for k, v in rows] + ["=" * 60]
    for outcome, errors in res["errors"].items():
        lines += [f"{outcome}:"] + [f"  {e}" for e in errors]
    lines += [f"FAIL: {f}" for f in res["failures"]] or ["PASS"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="jaxllm-soak-") as tmp:
        proc, pid, url = None, args.server_pid, args.base_url
        log_path = Path(args.server_log or Path(tmp) / "server.log")
        if url is None:
            args.api_key = args.api_key or "soak-key"
            proc, url = start_server(Path(tmp), args.api_key, log_path, args.startup_timeout)
            pid = proc.pid
            args.model = "tiny"
        try:
            res = asyncio.run(soak(args, url.rstrip("/"), pid, proc))
            res["shutdown"] = stop_server(proc, log_path) if proc is not None else None
        finally:
            if proc is not None and proc.poll() is None:  # a crash or ^C
                kill_tree(proc)
        res["failures"] = failures(res, args)
        if proc is not None and res["failures"]:
            print(f"server log, last lines:\n{_tail(log_path)}")
    cfg = {**vars(args), "api_key": "<redacted>" if args.api_key else None}
    res = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "base_url": url,
           "args": cfg, "passed": not res["failures"], **res}  # fmt: skip
    print(format_table(res))
    if args.json:
        write_json(args.json, res)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
