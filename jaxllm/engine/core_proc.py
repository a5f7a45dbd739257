"""The engine core in its own process, driven over ZMQ by `EngineCoreClient`, and the
`CoreLoop` every driver of the core runs (this process and the offline `LLM`).

The process owns the accelerator: it builds the engine (`EngineCore.from_config`: loading
weights, compiling every bucket; on host 0 of a multi-host run, joining the other hosts), says
`Ready`, then loops: hand every message waiting on the input socket to the `CoreLoop`, run one
step if any request is unfinished, send that step's `StepOutputs` (updates and the engine's
stats). When idle it blocks on the input socket (with a timeout, to notice a dead parent).
It exits on `Shutdown`, or when its parent is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback

import msgspec
import zmq

from jaxllm.config import EngineConfig
from jaxllm.engine.core import EngineCore
from jaxllm.engine.core_outputs import FinishReason, RequestUpdate, StepEvents
from jaxllm.engine.encoder_core import EncoderEngineCore
from jaxllm.engine.messages import (
    Abort,
    AddPooling,
    AddRequest,
    Failed,
    Shutdown,
    Sleep,
    StepOutputs,
    WakeUp,
    encoder,
    input_decoder,
)
from jaxllm.engine.request import Request

logger = logging.getLogger("jaxllm.engine.core")

_IDLE_POLL_MS = 200
_PULL_POLL_MS = 2  # idle, but waiting for a pull's blocks (P/D)


def build_engine_core(config: EngineConfig) -> EngineCore | EncoderEngineCore:
    """The engine core the checkpoint asks for: the encoder's pooling core for an encoder
    (its config says it is one, as vLLM detects a pooling model), the decoder's core
    otherwise (which serves pooling too, under `--runner`: see `LoadConfig.runner`). Loads
    the weights and compiles every program."""
    from jaxllm.worker import serving_kind

    core = EncoderEngineCore if serving_kind(config) == "encoder" else EngineCore
    return core.from_config(config)


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    heartbeat_s: float | None = None,
) -> None:
    """Entry point of the core process (started with the "spawn" method), or of its thread
    in in-process mode. `heartbeat_s`: a core on another host than its front end (which sees
    no process of it) reports its stats at least this often, idle or not, to show it lives."""
    in_thread = threading.current_thread() is not threading.main_thread()
    if not in_thread:
        # A process of its own: the front end decides when to stop (a Ctrl-C or a SIGTERM to
        # the whole process group must not kill the core before the server has drained).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=os.environ.get("JAXLLM_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s core %(name)s: %(message)s",
    )
    parent = os.getppid()
    ctx = zmq.Context()  # its own, also on a thread: the sockets are ipc://, not inproc://
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(output_address)
    engine = None
    try:
        try:
            if not in_thread and len(config.parallel.local_ranks) > 1:
                claim_rank_devices(config.parallel)  # before JAX starts in this process
            engine = build_engine_core(config)
        except Exception as e:  # a bad model path or flag: tell the front end, then exit
            logger.exception("engine failed to start")
            outputs.send(encoder.encode(Failed(f"{type(e).__name__}: {e}")))
            return
        outputs.send(encoder.encode(engine.ready()))
        loop = CoreLoop(engine)
        # An idle core wakes for a message, or for a decoder's pull (P/D, `kv_transfer`).
        poller = zmq.Poller()
        for sock in [inputs, *loop.sockets]:
            poller.register(sock, zmq.POLLIN)
        sent = time.monotonic()
        while True:
            timeout = 0 if engine.has_unfinished_requests() else loop.idle_poll_ms
            received = False
            while inputs in dict(poller.poll(timeout)):
                received = True
                message = input_decoder.decode(inputs.recv())
                if isinstance(message, Shutdown):
                    return
                loop.handle(message)
                timeout = 0
            received |= loop.poll()
            if os.getppid() != parent:
                logger.warning("front end is gone; exiting")
                return
            # Idle after messages (e.g. the last requests were aborted): the idle stats.
            beat = heartbeat_s is not None and time.monotonic() - sent > heartbeat_s
            if received or beat or engine.has_unfinished_requests():
                outputs.send(encoder.encode(loop.step()))
                sent = time.monotonic()
    finally:
        if engine is not None:
            try:
                engine.shutdown()  # multi-host: releases the other hosts
            except Exception:
                logger.exception("engine shutdown failed")
        inputs.close(linger=0)
        outputs.close(linger=1000)
        ctx.term()


def claim_rank_devices(parallel) -> None:
    """Gives a data-parallel engine core its share of this host's devices, before JAX
    starts, by its place among the host's ranks (`ParallelConfig.local_ranks`): the i-th gets
    GPUs `[i * tp, (i + 1) * tp)` of the visible ones (CUDA_VISIBLE_DEVICES); on a TPU VM chip
    i (one chip an engine, as JAX runs several processes on one host); on the CPU its share of
    the cores (affinity), so ranks do not contend for them."""
    import glob

    local = parallel.local_ranks
    rank, size = parallel.data_parallel_rank - local.start, len(local)
    tp = parallel.tensor_parallel_size or 1
    gpus = sorted(glob.glob("/dev/nvidia[0-9]*"))
    if gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(len(gpus))]
        if len(ids) < size * tp:
            raise ValueError(
                f"data_parallel_size {size} x tensor_parallel_size {tp} needs {size * tp} "
                f"GPUs; {len(ids)} are visible"
            )
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[rank * tp : (rank + 1) * tp])
    elif glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
        if tp != 1:
            raise ValueError("data_parallel_size > 1 on a TPU VM takes one chip an engine: tensor_parallel_size 1")  # fmt: skip
        # JAX's recipe for several processes on one TPU VM (not run here: no TPU VM).
        port = str(8476 + rank)
        os.environ.update(
            TPU_VISIBLE_CHIPS=str(rank),
            TPU_VISIBLE_DEVICES=str(rank),
            TPU_CHIPS_PER_PROCESS_BOUNDS="1,1,1",
            TPU_PROCESS_BOUNDS="1,1,1",
            TPU_PROCESS_PORT=port,
            TPU_MESH_CONTROLLER_ADDRESS=f"localhost:{port}",
            TPU_MESH_CONTROLLER_PORT=port,
        )
    else:
        cores = sorted(os.sched_getaffinity(0))
        share = max(1, len(cores) // size)
        mine = cores[rank * share : (rank + 1) * share] or cores[rank % len(cores) :][:1]
        os.sched_setaffinity(0, mine)


class CoreLoop:
    """How the engine core is driven, whoever drives it: the core process runs it behind its
    sockets, `LLM` in its own thread (vLLM's in-process client). One way to take a request,
    one way to fail a step.

    `handle` queues a request or an abort. A request the core refuses (a bad value a front
    end let through) fails alone, reported by the next `step`. `step` runs one engine step
    if any request is unfinished and returns its `StepOutputs`; a step that raises fails
    the requests it held (finish reason "error"; the traceback is logged, never sent to
    clients), leaves the engine serving the waiting ones, and keeps the exception in
    `step_error` until the next step."""

    def __init__(self, engine: EngineCore | EncoderEngineCore):
        self.engine = engine
        self.step_error: BaseException | None = None
        self._refused: list[RequestUpdate] = []
        self.num_received = 0  # requests taken in (refused ones too), since start

    def handle(self, message: AddRequest | AddPooling | Abort | Sleep | WakeUp) -> None:
        if isinstance(message, Abort):
            self.engine.abort_requests(message.request_ids)
            return
        if isinstance(message, Sleep | WakeUp):
            # The next StepOutputs' stats say whether it slept (a busy engine refuses).
            try:
                if isinstance(message, Sleep):
                    self.engine.sleep(message.level)
                else:
                    self.engine.wake_up()
            except Exception as e:
                logger.warning("%s refused: %s", type(message).__name__, e)
            return
        self.num_received += 1
        try:
            if isinstance(message, AddPooling):
                self.engine.add_pooling_request(
                    message.request_id,
                    message.prompt_token_ids,
                    message.pooling_params,
                    message.token_type_ids,
                )
                return
            self.engine.add_request(
                Request(
                    message.request_id,
                    message.prompt_token_ids,
                    message.sampling_params,
                    eos_token_ids=tuple(message.eos_token_ids),
                    max_tokens=message.max_tokens,
                    seed=message.seed,
                    priority=message.priority,
                    prefix_parent=message.prefix_parent,
                    lora=message.lora_request,
                    mm_items=message.mm_items,
                    cache_salt=message.cache_salt,
                    kv_transfer_params=message.kv_transfer_params,
                )
            )
        except Exception as e:  # fails this request only
            logger.warning("request %s refused: %s", message.request_id, e)
            self._refused.append(
                RequestUpdate(message.request_id, [], finish_reason=FinishReason.ERROR)
            )

    @property
    def sockets(self) -> list[zmq.Socket]:
        """Sockets besides the input whose messages `poll` serves."""
        transfer = getattr(self.engine, "kv_transfer", None)
        return [] if transfer is None else transfer.sockets

    @property
    def idle_poll_ms(self) -> int:
        """How long an idle core may block on its sockets: not long while a request waits
        for its pulled blocks (they arrive on no socket of the core's)."""
        transfer = getattr(self.engine, "kv_transfer", None)
        return _PULL_POLL_MS if transfer is not None and transfer.num_pulling else _IDLE_POLL_MS

    def poll(self) -> bool:
        """Prefill/decode disaggregation's work between steps (`EngineCore.poll_transfers`);
        True if it changed what the next `step` reports or runs."""
        transfer = getattr(self.engine, "kv_transfer", None)
        if transfer is None:
            return False
        before = self.engine.has_unfinished_requests(), transfer.stats()
        try:
            failed = self.engine.poll_transfers()
        except Exception:
            logger.exception("KV transfer failed")
            return False
        self._refused += failed
        # (Pulls served or holds released change the stats metrics read.)
        after = self.engine.has_unfinished_requests(), transfer.stats()
        return bool(failed) or after != before

    def step(self) -> StepOutputs:
        engine = self.engine
        updates, self._refused = self._refused, []
        self.step_error = None
        step = StepEvents()
        if engine.has_unfinished_requests():
            try:
                updates += engine.step()
                step = engine.last_step
            except Exception as e:
                logger.error("engine step failed:\n%s", traceback.format_exc())
                self.step_error = e
                failed = engine.running_request_ids()  # the step's
                engine.abort_requests(failed)
                engine.forget_lost_cache()
                updates += [
                    RequestUpdate(rid, [], finish_reason=FinishReason.ERROR) for rid in failed
                ]
        config = getattr(engine, "config", None)
        rank = 0 if config is None else config.parallel.data_parallel_rank
        stats = msgspec.structs.replace(engine.stats(), num_received=self.num_received)
        return StepOutputs(updates, stats, step, rank)

    def settle(self, abort: list[str]) -> None:
        """Leaves the engine idle for its next user: aborts `abort` (requests nobody waits
        for any more), collects a step launched past the last stop and drops its updates,
        and forgets a prefix cache a failed step lost."""
        self.engine.abort_requests(abort)
        self.engine.drain()
        self.engine.forget_lost_cache()
