"""Past one host: one engine over the devices of several hosts (a TPU pod slice), in lockstep.

JAX runs a multi-host mesh as a multi-controller program: one Python process per host, each
owning its local devices, all of them launching the same jitted programs, with the same global
shapes, in the same order; the collectives inside those programs then meet across hosts. A host
that launches a different program, or skips one, hangs the others.

So the scheduler's decisions are made once and replayed everywhere:

    host 0: schedule() -> publish the step -> runner.launch/fetch -> update, emit outputs
    host k:               receive the step  -> runner.launch/fetch

Host 0 (process_index 0) runs the scheduler, the KV cache manager and the front end (the HTTP
server of `jaxllm serve`, or `LLM.generate`). Its `EngineCore` has a `LockstepPublisher` as
its step hook (`EngineCore.from_config` attaches it), which publishes each step's
`SchedulerOutput` (msgpack, numbered) before the runner launches it, with how host 0 collects
it (at once, or after launching the next step: async scheduling). Every other host runs
`run_worker`, which makes the same runner calls in the same order. Only host 0 updates the
scheduler and emits tokens: the sampled tokens are replicated over the mesh, so every host
holds them, but the workers have nothing to do with them.

    every host:  jaxllm serve MODEL --coordinator-address HOST0:PORT --num-processes N \
                     --process-id I      (or nothing but --distributed on a Cloud TPU VM)

`jaxllm serve` on host 0 serves HTTP (its engine core process joins the run); on the others it
builds the same engine in its own process and follows host 0 until host 0 stops.

Why the hosts stay in lockstep:
- The runner's calls are a function of the `SchedulerOutput`s, of the order of launches and
  collections, and of the runner's own state (which buckets' padding already sits on the
  device, whether the cache was rebuilt): the bucket, the sampler variant, whether prompt
  logprobs are scored, every host array, all follow from them. Hosts that start from the same
  engine (the `Hello` fingerprint checks it) and replay the same calls in the same order
  therefore launch the same programs in the same order, with identical host inputs.
- The channel is one TCP stream per worker (ZMQ), reliable and in order; each message carries a
  sequence number and a worker raises on a gap instead of running a different program.
- Steps with nothing scheduled launch nothing and are not sent. A step that raises on host 0
  raises on every host (same input, same code): host 0 fails the step's requests, workers log
  and go on, and if the donated KV cache was lost each runner rebuilds its own.
- Startup is not part of the stream: every host builds the same engine from the same config,
  which loads, sizes its KV cache and compiles in the same order.

The channel: ZMQ PUB/SUB from host 0 to the workers over the hosts' network, not
`jax.experimental.multihost_utils.broadcast_one_to_all`. The broadcast would ride the device
collectives, but it costs a device program per step (host -> device -> all-reduce -> host
before the step itself can start), needs a fixed buffer size while a batch ranges from a few
bytes to megabytes (penalties send each request's history), compiles a program per buffer size
after warmup, and leaves idle workers blocked inside a collective for as long as the server has
no requests. ZMQ (already the engine core's transport) costs no device time, carries any size,
and lets an idle worker wait on a socket. Its costs: a port on host 0 reachable from the other
hosts, and the publisher's "slow joiner" problem, solved by an XPUB socket that waits until
every worker has subscribed before the first message.

Addresses: `jax.distributed.initialize` runs its coordinator in process 0, so host 0 is the
coordinator host; the lockstep channel defaults to that host, one port above the coordinator's
(`JAXLLM_LOCKSTEP_ADDRESS` or `address=` overrides it).

Threads: none of its own. Host 0 publishes from whatever thread calls `step()`; a worker's
main thread blocks in `run_worker` on its socket (polling, so it notices signals).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from jaxllm.worker import SchedulerOutput

if TYPE_CHECKING:
    from jaxllm.config import ParallelConfig

logger = logging.getLogger(__name__)

ENV_COORDINATOR = "JAXLLM_COORDINATOR_ADDRESS"  # host:port of process 0
ENV_NUM_PROCESSES = "JAXLLM_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXLLM_PROCESS_ID"
ENV_LOCKSTEP_ADDRESS = "JAXLLM_LOCKSTEP_ADDRESS"  # tcp://host0:port of the step channel

_POLL_MS = 500


# ---- the messages ----------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello"):
    """First message: what host 0's engine looks like; a worker whose engine differs would
    launch differently shaped programs and hang the mesh, so it refuses to start."""

    seq: int
    num_workers: int
    fingerprint: dict[str, Any]


class Step(msgspec.Struct, tag="step"):
    """A step host 0 launches, and how it collects it (see `run_worker`)."""

    seq: int
    scheduler_output: SchedulerOutput
    overlap: bool = False  # the previous step was still in flight: collected after this launch
    wait: bool = True  # collected at once (a synchronous step)


class Stop(msgspec.Struct, tag="stop"):
    seq: int


Message = Hello | Step | Stop

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_scheduler_output(out: SchedulerOutput) -> bytes:
    return _encoder.encode(out)


def decode_scheduler_output(data: bytes) -> SchedulerOutput:
    return msgspec.msgpack.decode(data, type=SchedulerOutput)


def engine_fingerprint(runner) -> dict[str, Any]:
    """What must be equal on every host for the same batch to launch the same programs."""
    cache = runner.kv_cache
    return {
        "kv_cache_shape": list(cache.shape),
        "kv_cache_dtype": str(cache.dtype),
        "page_size": runner.page_size,
        "pages_per_seq": runner.pages_per_seq,
        "token_buckets": list(runner.token_buckets),
        "request_buckets": list(runner.request_buckets),
        "max_model_len": runner.max_model_len,
        "num_speculative_tokens": runner.num_speculative_tokens,
    }


# ---- distributed runtime ---------------------------------------------------------------


def distributed_args(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    environ: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The arguments for `jax.distributed.initialize`: each from the call, else from
    `JAXLLM_COORDINATOR_ADDRESS` / `JAXLLM_NUM_PROCESSES` / `JAXLLM_PROCESS_ID`, else left to
    JAX, which discovers all three on Cloud TPU VMs (and under SLURM, Open MPI, ...)."""
    env = os.environ if environ is None else environ
    coordinator_address = coordinator_address or env.get(ENV_COORDINATOR) or None
    if num_processes is None and env.get(ENV_NUM_PROCESSES):
        num_processes = int(env[ENV_NUM_PROCESSES])
    if process_id is None and env.get(ENV_PROCESS_ID):
        process_id = int(env[ENV_PROCESS_ID])
    given = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    if any(v is not None for v in given.values()) and any(v is None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        raise ValueError(
            f"multi-host: {', '.join(missing)} not set; give all of coordinator_address, "
            f"num_processes and process_id ({ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, "
            f"{ENV_PROCESS_ID}), or none of them on a TPU VM where JAX discovers them"
        )
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} is outside [0, {num_processes})")
    return {k: v for k, v in given.items() if v is not None}


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """`jax.distributed.initialize` with `distributed_args`; call it once per process, before
    anything else touches JAX. Afterwards `jax.devices()` lists the devices of every host, and
    `LLM(..., tensor_parallel_size=len(jax.devices()))` builds a mesh over all of them."""
    import jax

    args = distributed_args(coordinator_address, num_processes, process_id)
    if jax.distributed.is_initialized():
        return
    jax.distributed.initialize(**args)
    logger.info(
        "multi-host: process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def lockstep_address(address: str | None = None, coordinator_address: str | None = None) -> str:
    """The step channel's address, `tcp://host:port`: `address`, else
    `JAXLLM_LOCKSTEP_ADDRESS`, else the coordinator's host one port above the coordinator's."""
    address = address or os.environ.get(ENV_LOCKSTEP_ADDRESS)
    if address:
        return address
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    if coordinator_address is None:
        from jax._src import distributed  # the address JAX discovered (TPU VMs)

        coordinator_address = distributed.global_state.coordinator_address
    if not coordinator_address:
        raise ValueError(
            f"multi-host: no lockstep address; set {ENV_LOCKSTEP_ADDRESS}=tcp://HOST0:PORT"
        )
    host, port = coordinator_address.rsplit(":", 1)
    return f"tcp://{host}:{int(port) + 1}"


# ---- the channel -----------------------------------------------------------------------


class LockstepPublisher:
    """Host 0's end: an XPUB socket that every worker subscribes to."""

    def __init__(
        self,
        address: str,
        num_workers: int,
        fingerprint: dict[str, Any],
        *,
        timeout_s: float = 600.0,
    ):
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # see every subscription, not just the first
        self.socket.setsockopt(zmq.SNDHWM, 0)  # a slow worker lags; it is never skipped
        self.socket.setsockopt(zmq.LINGER, 10_000)
        self.socket.bind(_bind_address(address))
        self.seq = 0
        self._wait_for_subscribers(num_workers, timeout_s)
        self._send(Hello(self.seq, num_workers, fingerprint))

    def _wait_for_subscribers(self, num_workers: int, timeout_s: float) -> None:
        """ZMQ drops what a PUB socket sends before a subscriber's subscription arrived, so
        nothing is sent until all of them have (each SUB sends b"\\x01" on connecting)."""
        deadline = time.monotonic() + timeout_s
        joined = 0
        while joined < num_workers:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.socket.poll(left_ms):
                raise TimeoutError(
                    f"multi-host: {joined} of {num_workers} workers subscribed to the lockstep "
                    f"channel in {timeout_s:.0f} s; is the port open between hosts?"
                )
            if self.socket.recv().startswith(b"\x01"):
                joined += 1
        logger.info("multi-host: %d workers joined the lockstep channel", joined)

    def _send(self, message: Message) -> None:
        self.socket.send(_encoder.encode(message))
        self.seq += 1

    def publish(self, out: SchedulerOutput, *, overlap: bool = False, wait: bool = True) -> None:
        self._send(Step(self.seq, out, overlap, wait))

    on_launch = publish  # the `EngineCore` step hook

    def close(self) -> None:
        """Tells the workers to stop, then closes (waiting a while for the message to go)."""
        if self.socket.closed:
            return
        self._send(Stop(self.seq))
        self.socket.close()
        self.ctx.term()


class LockstepSubscriber:
    """A worker's end."""

    def __init__(self, address: str):
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(address)
        self.seq = 0

    def recv(self) -> Message:
        while not self.socket.poll(_POLL_MS):
            pass  # an idle server sends nothing; polling keeps Ctrl-C working
        message = _decoder.decode(self.socket.recv())
        if message.seq != self.seq:
            raise RuntimeError(
                f"multi-host: lockstep message {message.seq} arrived, {self.seq} expected; "
                "this host missed steps and can no longer follow host 0"
            )
        self.seq += 1
        return message

    def close(self) -> None:
        self.socket.close(linger=0)
        self.ctx.term()


def _bind_address(address: str) -> str:
    """Host 0 listens on every interface, on the address's port."""
    if address.startswith("tcp://"):
        return "tcp://*:" + address.rsplit(":", 1)[1]
    return address  # ipc:// and the like: as given


# ---- the workers -----------------------------------------------------------------------


def process_index(parallel: ParallelConfig) -> int:
    """This host's index in the multi-host run `parallel` asks for, known before
    `jax.distributed` starts (the server decides with it whether this host serves HTTP or
    follows host 0): `process_id`, else `JAXLLM_PROCESS_ID`, else what JAX's cluster
    detection finds (the TPU VM's worker number)."""
    args = distributed_args(
        parallel.coordinator_address, parallel.num_processes, parallel.process_id
    )
    if "process_id" in args:
        return args["process_id"]
    # JAX's own discovery, as `jax.distributed.initialize()` runs it (a private API: the
    # public one starts the runtime, which belongs to the engine's process).
    from jax._src.clusters import ClusterEnv

    _, _, pid, _ = ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, None, None, None
    )
    if pid is None:
        raise ValueError(
            "multi-host: this host's process id is unknown; pass --process-id (or set "
            f"{ENV_PROCESS_ID}) with --coordinator-address and --num-processes"
        )
    return pid


def run_worker(
    runner, parallel: ParallelConfig | None = None, *, subscriber: LockstepSubscriber | None = None
) -> int:
    """On a host other than 0: replays every step host 0 publishes, in order, until host 0
    shuts down; returns the number of steps. `runner` is the model runner of this host's
    engine, built from the same config as host 0's (its scheduler stays unused); `parallel`:
    its parallel config, which names the lockstep address (or the subscriber is given).

    The runner calls are host 0's, in host 0's order: a synchronous step is launched and
    collected at once; an async one is launched, and the step before it collected after the
    launch if host 0 had it still in flight (`overlap`), before it otherwise. The order matters
    beyond the programs launched: a row whose previous token is not collected yet reads it on
    the device, and the hosts' inputs must be the same."""
    own = subscriber is None
    if own:
        subscriber = LockstepSubscriber(
            lockstep_address(parallel.lockstep_address if parallel else None)
        )
    num_steps = 0
    pending = None  # the step launched and not collected yet
    try:
        hello = subscriber.recv()
        if not isinstance(hello, Hello):
            raise RuntimeError(f"multi-host: expected Hello first, got {type(hello).__name__}")
        mine = engine_fingerprint(runner)
        if hello.fingerprint != mine:
            diff = {k: (hello.fingerprint.get(k), mine.get(k)) for k in mine}
            diff = {k: v for k, v in diff.items() if v[0] != v[1]}
            raise RuntimeError(
                "multi-host: this host's engine differs from host 0's (host 0, here): "
                f"{diff}; start every host with the same model and flags"
            )
        while True:
            message = subscriber.recv()
            if isinstance(message, Stop):
                if pending is not None:
                    runner.fetch(pending)
                return num_steps
            try:
                if pending is not None and not message.overlap:
                    previous, pending = pending, None
                    runner.fetch(previous)
                if message.wait:
                    runner.execute(message.scheduler_output)
                else:
                    previous, pending = pending, runner.launch(message.scheduler_output)
                    if previous is not None:
                        runner.fetch(previous)
            except Exception:
                # Host 0 ran the same batch through the same code and failed it too; it fails
                # the step's requests, drops what was in flight, and goes on; so does this host.
                logger.exception("multi-host worker: step %d failed", message.seq)
                pending = None
                runner.kv_cache_lost = False  # a rebuilt cache: nothing to forget here
            num_steps += 1
    finally:
        if own:
            subscriber.close()
