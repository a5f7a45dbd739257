"""Multi-host lockstep (`jaxllm.engine.multihost`), as far as one machine allows.

- The protocol: a `SchedulerOutput` survives msgpack; host 0's `LockstepEngineCore` drives two
  workers (threads, each with a fake runner) over the real ZMQ channel, and every host executes
  the same batches in the same order, then stops; a worker refuses an engine unlike host 0's,
  and a gap in the stream.
- The real thing on CPU: two processes joined by `jax.distributed.initialize` over loopback
  (JAX's CPU collectives are Gloo over TCP), two fake CPU devices each, one tensor-parallel mesh
  of 4 over both; host 0 generates, host 1 follows, and host 0's tokens equal a one-process,
  one-device run.

Not testable here: TPU pod slices (ICI/DCN collectives, `jax.distributed.initialize()` with no
arguments discovering the slice), separate machines, and the server (`jaxllm serve`) in
multi-host mode.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from jaxllm.config import SchedulerConfig
from jaxllm.engine import multihost
from jaxllm.engine.core import EngineCore
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.request import Request
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.step_data import (
    NewRequestData,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from jaxllm.sampling_params import SamplingParams

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
        block_ids=[3, 9],
    )


def _scheduled(request_id: str = "r0", **overrides) -> ScheduledRequest:
    fields = dict(
        request_id=request_id,
        num_computed_tokens=3,
        num_scheduled_tokens=3,
        new_block_ids=[4],
        prompt_logprob_targets=[6, 7, -1],
    )
    return ScheduledRequest(**{**fields, **overrides})


def test_scheduler_output_round_trip():
    out = SchedulerOutput(
        new_requests=[_new()],
        requests=[_scheduled(), _scheduled("r1", new_block_ids=[], prompt_logprob_targets=None)],
        total_num_scheduled_tokens=6,
        preempted_request_ids=["r7"],
        finished_request_ids=["r2", "r3"],
    )
    back = multihost.decode_scheduler_output(multihost.encode_scheduler_output(out))
    assert back == out
    # int keys stay ints
    assert back.new_requests[0].sampling_params.logit_bias == {11: -100.0, 12: 2.5}


class FakeRunner:
    """Records each batch it executes (a decoded copy, as a worker sees it); keeps each
    request's tokens as the real runner's persistent batch does, and samples (its last token
    + 1) so requests advance and finish."""

    def __init__(self):
        self.executed: list[SchedulerOutput] = []
        self.kv_cache = np.zeros((2, 8, 4, 4, 8), np.float32)
        self.page_size = 4
        self.pages_per_seq = 8
        self.token_buckets = [16, 32]
        self.request_buckets = [4]
        self.max_model_len = 32
        self.kv_cache_lost = False
        self.tokens: dict[str, list[int]] = {}

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        out = multihost.decode_scheduler_output(multihost.encode_scheduler_output(out))
        self.executed.append(out)
        for rid in [*out.finished_request_ids, *out.preempted_request_ids]:
            self.tokens.pop(rid, None)
        for new in out.new_requests:
            self.tokens[new.request_id] = list(new.token_ids)
        sampled = {}
        for s in out.requests:
            tokens = self.tokens[s.request_id]
            if s.num_computed_tokens + s.num_scheduled_tokens == len(tokens):
                tokens.append((tokens[-1] + 1) % 50)
                sampled[s.request_id] = tokens[-1]
        return RunnerOutput(sampled, {}, {})


class FakeLLM:
    def __init__(self):
        self.runner = FakeRunner()


def _worker_thread(address: str, llm, results: dict, key) -> threading.Thread:
    def run():
        try:
            results[key] = multihost.run_worker(llm, address=address)
        except Exception as e:
            results[key] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_workers_execute_host0_batches_in_order():
    address = f"tcp://127.0.0.1:{_free_port()}"
    workers = [FakeLLM(), FakeLLM()]
    results: dict = {}
    threads = [_worker_thread(address, w, results, i) for i, w in enumerate(workers)]

    host0 = FakeLLM()
    kv = KVCacheManager(num_pages=8, page_size=4)
    config = SchedulerConfig(max_model_len=32, max_num_seqs=4, max_num_batched_tokens=16)
    host0.engine = EngineCore(Scheduler(config, kv), host0.runner)
    publisher = multihost.LockstepPublisher(
        address, 2, multihost.engine_fingerprint(host0.runner), timeout_s=30
    )
    engine = multihost.LockstepEngineCore(host0.engine.scheduler, host0.runner, publisher)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # Prompts of 5..17 tokens under a 16-token budget: chunked prefill, decodes, and (8 pages
    # of 4 for 4 requests of up to 23 tokens) preemptions.
    for i in range(4):
        prompt = list(range(1, 6 + 4 * i))
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

    n = len(host0.runner.executed)
    assert n == engine.num_steps > 4
    assert results == {0: n, 1: n}
    for w in workers:
        assert w.runner.executed == host0.runner.executed


def test_worker_refuses_a_different_engine():
    address = f"tcp://127.0.0.1:{_free_port()}"
    worker = FakeLLM()
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
    worker = FakeLLM()
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
# (tensor_parallel_size 1); "multi" joins jax.distributed (JAXLLM_* env) with 2 CPU devices.
CHILD = r"""
import hashlib, json, os, sys
mode, model, out_path = sys.argv[1:4]
import jax
from jaxllm.engine import multihost
from jaxllm.engine.core import EngineCore
if mode == "multi":
    jax.config.update("jax_num_cpu_devices", 2)
    multihost.initialize_distributed()
from jaxllm import LLM, SamplingParams
from jaxllm.engine.multihost import decode_scheduler_output, encode_scheduler_output
# The lockstep engine steps synchronously: so does the one-process reference, whose schedule
# must match step for step.
llm = LLM(model, max_model_len=128, num_pages=32, max_num_seqs=4, max_num_batched_tokens=16,
          tensor_parallel_size=jax.device_count(), compilation_cache_dir=None,
          async_scheduling=False)
digests = []  # what this host's runner executed, in order
execute = llm.runner.execute
def recording_execute(out):
    canonical = encode_scheduler_output(decode_scheduler_output(encode_scheduler_output(out)))
    digests.append(hashlib.sha256(canonical).hexdigest()[:16])  # ints read back as floats
    return execute(out)
llm.runner.execute = recording_execute
report = {"process_index": jax.process_index(), "devices": jax.device_count(),
          "local_devices": jax.local_device_count(),
          "mesh": dict(llm.mesh.shape) if llm.mesh is not None else None}
if jax.process_index() != 0:
    report["steps"] = multihost.run_worker(llm)
else:
    engine = multihost.enable_lockstep(llm) if mode == "multi" else llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 17, 40 + 2 * i, 9] * (i + 2)} for i in range(5)]
    before = llm.runner.num_compilations
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    report["tokens"] = [o.outputs[0].token_ids for o in outs]
    report["compiled_after_warmup"] = llm.runner.num_compilations - before
    # prompt_logprobs (a second program, the scorer) and a penalty (host arrays of history).
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
    if mode == "multi":
        engine.shutdown()
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
