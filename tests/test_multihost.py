"""Multi-host lockstep (`jaxllm.engine.multihost`), as far as one machine allows.

- The protocol: a `SchedulerOutput` survives msgpack; host 0's `EngineCore`, with the lockstep
  publisher as its step hook, drives two workers (threads, each with a fake runner) over the
  real ZMQ channel, synchronously and with async scheduling, and every host launches the same
  batches and collects them in the same order, then stops; a worker refuses an engine unlike
  host 0's, and a gap in the stream.
- The real thing on CPU: two processes joined by `jax.distributed.initialize` over loopback
  (JAX's CPU collectives are Gloo over TCP), two fake CPU devices each, one tensor-parallel mesh
  of 4 over both; host 0 generates, host 1 follows, and host 0's tokens equal a one-process,
  one-device run.
- `jaxllm serve` on two processes: host 0 serves HTTP, host 1 follows, the answers equal a
  one-process server's, and stopping host 0 releases host 1.

Not testable here: TPU pod slices (ICI/DCN collectives, `jax.distributed.initialize()` with no
arguments discovering the slice) and separate machines.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jaxllm.config import SchedulerConfig
from jaxllm.engine import multihost
from jaxllm.engine.core import EngineCore
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.request import Request
from jaxllm.engine.scheduler import Scheduler
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker import (
    NewRequestData,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)

from conftest import write_tiny_checkpoint

ROOT = Path(__file__).parent.parent


def _new(request_id: str = "r0") -> NewRequestData:
    params = SamplingParams(
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        logprobs=3,
        logit_bias={11: -100.0, 12: 2.5},
        presence_penalty=0.5,
        min_tokens=2,
        stop_token_ids=[2],
        prompt_logprobs=2,
    )
    return NewRequestData(
        request_id=request_id,
        token_ids=[1, 2, 3, 5, 6, 7],
        num_prompt_tokens=3,
        sampling_params=params,
        seed=2**63 + 5,
        eos_token_ids=[0],
        block_ids=[[3, 9]],
    )


def _scheduled(request_id: str = "r0", **overrides) -> ScheduledRequest:
    fields = dict(
        request_id=request_id,
        num_computed_tokens=3,
        num_scheduled_tokens=3,
        new_block_ids=[[4]],
        prompt_logprob_targets=[6, 7, -1],
    )
    return ScheduledRequest(**{**fields, **overrides})


def test_scheduler_output_round_trip():
    out = SchedulerOutput(
        new_requests=[_new()],
        requests=[_scheduled(), _scheduled("r1", new_block_ids=[[]], prompt_logprob_targets=None)],
        total_num_scheduled_tokens=6,
        preempted_request_ids=["r7"],
        finished_request_ids=["r2", "r3"],
    )
    back = multihost.decode_scheduler_output(multihost.encode_scheduler_output(out))
    assert back == out
    # int keys stay ints
    assert back.new_requests[0].sampling_params.logit_bias == {11: -100.0, 12: 2.5}


class FakeRunner:
    """Records each batch it launches (a decoded copy, as a worker sees it) and every launch
    and collection in order; keeps each request's tokens as the real runner's persistent batch
    does, and samples (its last token + 1) so requests advance and finish."""

    def __init__(self):
        self.executed: list[SchedulerOutput] = []
        self.calls: list[tuple[str, int]] = []  # ("launch" | "fetch", step number)
        self.kv_cache = np.zeros((2, 8, 4, 4, 8), np.float32)
        self.page_size = 4
        self.pages_per_seq = 8
        self.token_buckets = [16, 32]
        self.request_buckets = [4]
        self.max_model_len = 32
        self.kv_cache_lost = False
        self.num_speculative_tokens = 0
        self.device_wait_seconds = 0.0  # what EngineCore reads of a runner for its metrics
        self.tokens: dict[str, list[int]] = {}

    def launch(self, out: SchedulerOutput) -> tuple[int, RunnerOutput]:
        out = multihost.decode_scheduler_output(multihost.encode_scheduler_output(out))
        self.executed.append(out)
        self.calls.append(("launch", len(self.executed)))
        for rid in [*out.finished_request_ids, *out.preempted_request_ids]:
            self.tokens.pop(rid, None)
        for new in out.new_requests:
            self.tokens[new.request_id] = list(new.token_ids)
        sampled = {}
        for s in out.requests:
            tokens = self.tokens[s.request_id]
            if s.num_computed_tokens + s.num_scheduled_tokens == len(tokens):
                tokens.append((tokens[-1] + 1) % 50)
                sampled[s.request_id] = [tokens[-1]]
        return len(self.executed), RunnerOutput(sampled, {}, {})

    def fetch(self, step: tuple[int, RunnerOutput]) -> RunnerOutput:
        self.calls.append(("fetch", step[0]))
        return step[1]

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.fetch(self.launch(out))


class FakeEngine:
    def __init__(self):
        self.runner = FakeRunner()
        self.config = None


def _worker_thread(address: str, engine, results: dict, key) -> threading.Thread:
    def run():
        try:
            subscriber = multihost.LockstepSubscriber(address)
            try:
                results[key] = multihost.run_worker(engine.runner, subscriber=subscriber)
            finally:
                subscriber.close()
        except Exception as e:
            results[key] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_workers_replay_host0_steps_in_order(async_scheduling):
    """Host 0's engine core, with the publisher as its step hook, drives two workers: each
    launches the same batches and collects them in the same order as host 0 (with async
    scheduling, a step is collected after the next one launched; with a penalty, at once)."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    workers = [FakeEngine(), FakeEngine()]
    results: dict = {}
    threads = [_worker_thread(address, w, results, i) for i, w in enumerate(workers)]

    runner = FakeRunner()
    kv = KVCacheManager(num_pages=8, page_size=4)
    config = SchedulerConfig(max_model_len=32, max_num_seqs=4, max_num_batched_tokens=16)
    publisher = multihost.LockstepPublisher(
        address, 2, multihost.engine_fingerprint(runner), timeout_s=30
    )
    engine = EngineCore(
        Scheduler(config, kv), runner, async_scheduling=async_scheduling, hook=publisher
    )
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    penalty = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, presence_penalty=0.5)
    # Prompts of 5..17 tokens under a 16-token budget: chunked prefill, decodes, and (8 pages
    # of 4 for 4 requests of up to 23 tokens) preemptions; the last request has a penalty,
    # which makes the steps it runs in synchronous.
    for i in range(4):
        prompt = list(range(1, 6 + 4 * i))
        params = penalty if i == 3 else greedy
        engine.add_request(Request(str(i), prompt, params, eos_token_ids=(), max_tokens=6, seed=i))
    finished = set()
    for _ in range(200):
        for u in engine.step():
            if u.finish_reason:
                finished.add(u.request_id)
        if not engine.has_unfinished_requests():
            break
    assert finished == {"0", "1", "2", "3"}
    assert engine.scheduler.num_preemptions > 0
    engine.step()  # nothing scheduled: nothing sent
    engine.shutdown()
    for t in threads:
        t.join(timeout=30)

    n = len(runner.executed)
    assert n == engine.num_steps > 4
    assert results == {0: n, 1: n}
    calls = runner.calls
    if async_scheduling:  # some step was collected only after the next one launched
        assert any(a == b == "launch" for (a, _), (b, _) in itertools.pairwise(calls))
    for w in workers:
        assert w.runner.executed == runner.executed
        assert w.runner.calls == calls


def test_worker_refuses_a_different_engine():
    address = f"tcp://127.0.0.1:{_free_port()}"
    worker = FakeEngine()
    worker.runner.kv_cache = np.zeros((2, 16, 4, 4, 8), np.float32)  # num_pages differs
    results: dict = {}
    thread = _worker_thread(address, worker, results, 0)
    host0 = FakeRunner()
    publisher = multihost.LockstepPublisher(
        address, 1, multihost.engine_fingerprint(host0), timeout_s=30
    )
    thread.join(timeout=30)
    publisher.close()
    assert isinstance(results[0], RuntimeError)
    assert "kv_cache_shape" in str(results[0]) and "[2, 8, 4, 4, 8]" in str(results[0])


def test_worker_stops_on_a_gap_in_the_stream():
    address = f"tcp://127.0.0.1:{_free_port()}"
    worker = FakeEngine()
    results: dict = {}
    thread = _worker_thread(address, worker, results, 0)
    publisher = multihost.LockstepPublisher(
        address, 1, multihost.engine_fingerprint(worker.runner), timeout_s=30
    )
    empty = SchedulerOutput([_new()], [_scheduled()], 3, [], [])
    publisher.publish(empty)
    publisher.seq += 1  # as if a message were lost
    publisher.publish(empty)
    thread.join(timeout=30)
    publisher.close()
    assert isinstance(results[0], RuntimeError) and "missed steps" in str(results[0])
    assert len(worker.runner.executed) == 1


def test_publisher_times_out_naming_the_missing_workers():
    with pytest.raises(TimeoutError, match="0 of 1 workers"):
        multihost.LockstepPublisher(f"tcp://127.0.0.1:{_free_port()}", 1, {}, timeout_s=0.3)


def test_distributed_args():
    assert multihost.distributed_args(environ={}) == {}  # JAX discovers them (TPU VMs)
    env = {
        "JAXLLM_COORDINATOR_ADDRESS": "10.0.0.2:8476",
        "JAXLLM_NUM_PROCESSES": "4",
        "JAXLLM_PROCESS_ID": "3",
    }
    assert multihost.distributed_args(environ=env) == {
        "coordinator_address": "10.0.0.2:8476",
        "num_processes": 4,
        "process_id": 3,
    }
    assert multihost.distributed_args(process_id=0, environ=env)["process_id"] == 0
    with pytest.raises(ValueError, match="num_processes, process_id not set"):
        multihost.distributed_args("10.0.0.2:8476", environ={})
    with pytest.raises(ValueError, match="outside"):
        multihost.distributed_args("h:1", 2, 2, environ={})


def test_lockstep_address(monkeypatch):
    monkeypatch.delenv(multihost.ENV_LOCKSTEP_ADDRESS, raising=False)
    assert multihost.lockstep_address(coordinator_address="10.0.0.2:8476") == "tcp://10.0.0.2:8477"
    assert multihost.lockstep_address("tcp://h:9") == "tcp://h:9"
    monkeypatch.setenv(multihost.ENV_LOCKSTEP_ADDRESS, "tcp://h:10")
    assert multihost.lockstep_address(coordinator_address="10.0.0.2:8476") == "tcp://h:10"


# ---- two processes, one mesh ----------------------------------------------------------

# Run as `python -c CHILD MODE MODEL OUT`: MODE "single" is one process on one device
# (tensor_parallel_size 1); "multi" joins jax.distributed (JAXLLM_* env) with 2 CPU devices,
# and the engine's mesh spans every device of both processes.
CHILD = r"""
import hashlib, json, os, sys
mode, model, out_path = sys.argv[1:4]
import jax
from jaxllm.engine import multihost
if mode == "multi":
    jax.config.update("jax_num_cpu_devices", 2)
    multihost.initialize_distributed()
from jaxllm import LLM, SamplingParams
from jaxllm.engine.multihost import decode_scheduler_output, encode_scheduler_output
llm = LLM(model, max_model_len=128, num_pages=32, max_num_seqs=4, max_num_batched_tokens=16,
          compilation_cache_dir=None)
digests = []  # what this host's runner launched, in order
launch = llm.runner.launch
def recording_launch(out):
    canonical = encode_scheduler_output(decode_scheduler_output(encode_scheduler_output(out)))
    digests.append(hashlib.sha256(canonical).hexdigest()[:16])  # ints read back as floats
    return launch(out)
llm.runner.launch = recording_launch
report = {"process_index": jax.process_index(), "devices": jax.device_count(),
          "local_devices": jax.local_device_count(),
          "mesh": dict(llm.mesh.shape) if llm.mesh is not None else None}
if llm.engine.is_worker:
    report["steps"] = multihost.run_worker(llm.engine.runner, llm.engine.config.parallel)
else:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 17, 40 + 2 * i, 9] * (i + 2)} for i in range(5)]
    before = llm.runner.num_compilations
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    report["tokens"] = [o.outputs[0].token_ids for o in outs]
    report["compiled_after_warmup"] = llm.runner.num_compilations - before
    # prompt_logprobs (a second program, the scorer) and a penalty (host arrays of history,
    # synchronous steps).
    extra = llm.generate(
        [{"prompt_token_ids": [7, 8, 9, 10, 11, 12] * 3}] * 2,
        [SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2, ignore_eos=True),
         SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.5, ignore_eos=True)],
        use_tqdm=False)
    report["extra_tokens"] = [o.outputs[0].token_ids for o in extra]
    report["prompt_logprobs"] = [
        None if d is None else {str(k): v.logprob for k, v in d.items()}
        for d in extra[0].prompt_logprobs]
    report["steps"] = llm.engine.num_steps
    llm.engine.shutdown()  # releases the workers
report["digests"] = digests
with open(out_path, "w") as f:
    json.dump(report, f)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXLLM_")}
    env.pop("XLA_FLAGS", None)
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **extra)
    return env


def _run_child(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_two_processes_one_mesh_match_one_process(tmp_path, tokenizer_dir):
    """Two processes x 2 CPU devices, tensor_parallel_size 4 over both (8 q heads, 2 kv heads
    repeated 2x); host 0's tokens equal a single-process run on one device, and both hosts
    executed the same batches (by digest) in the same order."""
    model = write_tiny_checkpoint(
        tmp_path / "model", tokenizer_dir, num_heads=8, num_kv_heads=2, vocab_size=512
    )
    port = _free_port()
    lockstep_port = _free_port()
    procs = []
    for pid in (0, 1):
        env = _env(
            JAXLLM_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAXLLM_NUM_PROCESSES="2",
            JAXLLM_PROCESS_ID=str(pid),
            JAXLLM_LOCKSTEP_ADDRESS=f"tcp://127.0.0.1:{lockstep_port}",
        )
        procs.append(_run_child(["multi", str(model), str(tmp_path / f"host{pid}.json")], env))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for pid, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"host {pid}:\n{log[-4000:]}"
    host0, host1 = (json.loads((tmp_path / f"host{i}.json").read_text()) for i in (0, 1))

    single = _run_child(["single", str(model), str(tmp_path / "single.json")], _env())
    log = single.communicate(timeout=600)[0]
    assert single.returncode == 0, log[-4000:]
    ref = json.loads((tmp_path / "single.json").read_text())

    assert (host0["devices"], host0["local_devices"], host0["mesh"]) == (
        4,
        2,
        {"data": 1, "model": 4},
    )
    assert host1["process_index"] == 1 and host1["local_devices"] == 2
    assert host0["tokens"] == ref["tokens"]
    assert host0["extra_tokens"] == ref["extra_tokens"]
    for got, want in zip(host0["prompt_logprobs"][1:], ref["prompt_logprobs"][1:], strict=True):
        assert got.keys() == want.keys()
        assert [got[k] for k in got] == pytest.approx([want[k] for k in want], abs=1e-4)
    # The greedy batches compiled nothing after warmup. (The penalty batch does compile once
    # under any mesh, one process or two: its host arrays are not placed like the padding that
    # warmup compiled against. A runner matter, not a multi-host one.)
    assert host0["compiled_after_warmup"] == 0
    # Lockstep: the worker executed exactly host 0's batches, in order.
    assert host1["steps"] == host0["steps"] == len(host0["digests"])
    assert host1["digests"] == host0["digests"]
    assert host0["digests"] == ref["digests"]  # and the same schedule as one process


# ---- jaxllm serve on two hosts ----------------------------------------------------------


def _serve(model: Path, port: int, *extra: str, env: dict[str, str]) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "jaxllm.cli", "serve", str(model), "--port", str(port),
        "--served-model-name", "tiny", "--max-model-len", "128", "--num-pages", "32",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
        "--compilation-cache-dir", "none", *extra,
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 400) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.stdout.read()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("server did not become healthy in time")


def _ask(url: str) -> dict:
    """Greedy completions (3 prompts x n=2, batched and chunked), and a stream with a penalty
    (synchronous steps), as texts."""
    import httpx

    prompts = [[5 + i, 17, 40 + 2 * i, 9] * (i + 2) for i in range(3)]
    body = {"model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    body = {"model": "tiny", "prompt": [7, 8, 9, 10, 11, 12] * 3, "max_tokens": 8,
            "temperature": 0, "frequency_penalty": 0.5, "ignore_eos": True, "stream": True}  # fmt: skip
    streamed = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed.append(json.loads(line[6:])["choices"][0]["text"])
    return {"texts": texts, "streamed": "".join(streamed)}


@pytest.mark.slow  # 4 minutes: three servers (two hosts, one alone)
def test_two_hosts_serve_http_like_one_process(tmp_path, tokenizer_dir):
    """`jaxllm serve` on two processes (one CPU device each; a tensor-parallel mesh of 2 over
    both): host 0 serves HTTP, host 1 follows, and the answers equal one process's. Stopping
    host 0 releases host 1, which exits cleanly."""
    model = write_tiny_checkpoint(
        tmp_path / "model", tokenizer_dir, num_heads=8, num_kv_heads=2, vocab_size=512
    )
    coordinator = f"127.0.0.1:{_free_port()}"
    lockstep = f"tcp://127.0.0.1:{_free_port()}"
    ports = [_free_port(), _free_port()]
    hosts = [
        _serve(
            model, ports[0] if pid == 0 else _free_port(),
            "--coordinator-address", coordinator, "--num-processes", "2",
            "--process-id", str(pid), "--lockstep-address", lockstep, env=_env(),
        )
        for pid in (0, 1)
    ]  # fmt: skip
    single = _serve(model, ports[1], env=_env())
    procs = [*hosts, single]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        _wait_healthy(hosts[0], urls[0])
        _wait_healthy(single, urls[1])
        multi, one = _ask(urls[0]), _ask(urls[1])
        assert multi == one
        assert len(set(one["texts"])) == 3 and one["streamed"]  # not all alike, not empty
        for p in (hosts[0], single):
            p.send_signal(signal.SIGTERM)
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    # uvicorn re-raises the signal it stopped on, so a clean exit reads -SIGTERM.
    for name, p, log in zip(("host 0", "host 1", "single"), procs, logs, strict=True):
        assert p.returncode in (0, -signal.SIGTERM), f"{name}:\n{log[-4000:]}"
        assert "Traceback" not in log, f"{name}:\n{log[-4000:]}"
    assert hosts[1].returncode == 0  # released by host 0, not signalled
    assert "host 1 follows host 0" in logs[1]
    assert "Uvicorn running" not in logs[1]  # no HTTP on host 1
