"""Data parallelism (`--data-parallel-size N`): N engine cores behind one front end.

Each core is the usual engine core process (`EngineCoreClient`), started with its rank
(`ParallelConfig.data_parallel_rank`), which claims its share of the host's devices before
JAX starts (`core_proc.claim_rank_devices`) and keeps a KV cache of its own. This client has
the single client's interface, so `AsyncLLM` drives N cores as it drives one:
- a new request goes to the live core with the least load, as vLLM's DP coordinator balances
  them: waiting requests weigh four times running ones (a waiting request will need a whole
  prefill), counted from each core's last stats, plus the requests sent that it had not taken
  in yet when it made them; ties go round the ranks. A request that shares its prompt with an earlier one (`prefix_parent`: the n
  completions of one prompt) goes where that one went, to share its cached prompt;
- an abort goes to the core that has the request; sleep mode messages go to every core;
- outputs come from whichever core has some (in turn, so a busy core does not starve the
  others), tagged with its rank (`StepOutputs.engine`), for per-rank metrics;
- a core that dies delivers what it sent before dying, then fails its own requests (finish
  reason "error"), once, as if its step had failed them; the others keep serving, and its
  gauges read zero. The front end counts as dead only when every core is.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time

import msgspec
import zmq
import zmq.asyncio

from jaxllm.config import EngineConfig
from jaxllm.config.kv_events import KVEventsConfig
from jaxllm.engine.core_client import CoreMessages, EngineCoreClient
from jaxllm.engine.core_outputs import FinishReason, RequestUpdate
from jaxllm.engine.kv_events import offset_endpoint_port
from jaxllm.engine.messages import (
    AddPooling,
    AddRequest,
    Failed,
    Ready,
    Shutdown,
    StepOutputs,
    encoder,
    output_decoder,
)
from jaxllm.errors import EngineDeadError

logger = logging.getLogger(__name__)

_WAITING_WEIGHT = 4
_LIVENESS_S = 0.1  # how often a quiet wait looks for dead cores
# Another host's core reports at least every _HEARTBEAT_S; silent for _REMOTE_TIMEOUT_S once
# ready, it counts as dead.
_HEARTBEAT_S = 1.0
_REMOTE_TIMEOUT_S = 30.0


class DPEngineCoreClient:
    def __init__(self, config: EngineConfig, *, in_process: bool = False):
        if in_process:
            raise ValueError("data_parallel_size > 1 runs its engine cores as processes")
        parallel = config.parallel
        size = parallel.data_parallel_size
        if parallel.data_parallel_start_rank != 0:
            raise ValueError("the API server runs data-parallel rank 0 (data_parallel_start_rank 0); other hosts run theirs with --headless")  # fmt: skip
        _check_event_endpoints(config, size)
        local = parallel.local_ranks
        self.clients = [
            EngineCoreClient(config.replace(data_parallel_rank=r))
            if r in local
            else RemoteEngineCoreClient(config.replace(data_parallel_rank=r))
            for r in range(size)
        ]
        self.ready: list[Ready | None] = [None] * size
        self.stats: list = [None] * size  # each core's last Stats
        self._owner: dict[str, int] = {}  # request id -> rank, until it finishes or is aborted
        self._sent = [0] * size  # requests sent to each rank, since start
        self._received = [0] * size  # of those, taken in by its last stats
        self._load = [0] * size  # its last stats' weighted load
        self._dead = [False] * size
        self._next = 0  # the rank whose outputs are read first
        self._turn = 0  # the rank a tie goes to
        self._poller = zmq.asyncio.Poller()
        for client in self.clients:
            self._poller.register(client.output_socket, zmq.POLLIN)

    async def wait_ready(self) -> Ready:
        """Waits for every core; they must agree on what they serve (the same config)."""
        results = await asyncio.gather(
            *(c.wait_ready() for c in self.clients), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        self.ready = list(results)
        self.stats = [ready.stats for ready in self.ready]
        first = self.ready[0]
        for rank, ready in enumerate(self.ready):
            if ready.max_model_len != first.max_model_len:
                raise RuntimeError(
                    f"engine core {rank} serves max_model_len {ready.max_model_len}, core 0 "
                    f"{first.max_model_len}: data-parallel cores need the same devices"
                )
        return first

    def is_alive(self) -> bool:
        """Whether any core serves."""
        return any(c.is_alive() for c in self.clients)

    @property
    def exit_status(self) -> str:
        return "; ".join(f"core {r}: {c.exit_status}" for r, c in enumerate(self.clients))

    def add_request(self, request: AddRequest | AddPooling) -> None:
        size = len(self.clients)
        live = [r for r in range(size) if not self._dead[r]]
        parent = self._owner.get(getattr(request, "prefix_parent", None) or "")
        # Ties go round the ranks, so sequential requests spread too.
        live.sort(key=lambda r: (r != parent, self._load_of(r), (r - self._turn) % size))
        for rank in live:
            try:
                self.clients[rank].add_request(request)
            except EngineDeadError:  # died since it was last seen: the next one
                continue
            self._owner[request.request_id] = rank
            self._sent[rank] += 1
            self._turn = (rank + 1) % size
            return
        raise EngineDeadError("no engine core is running")

    def _load_of(self, rank: int) -> int:
        return self._load[rank] + self._sent[rank] - self._received[rank]

    def owner(self, request_id: str) -> int:
        """The rank a request was sent to (0 once it is done)."""
        return self._owner.get(request_id, 0)

    def send(self, message) -> None:
        for rank, client in enumerate(self.clients):
            if not self._dead[rank] and client.is_alive():
                client.send(message)

    def abort(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self._owner.pop(rid, None)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        for rank, rids in by_rank.items():
            self.clients[rank].abort(rids)

    async def get_output(self, timeout: float = 0.5) -> StepOutputs | None:
        """The next outputs of any core, or a dead core's failures; None after `timeout`
        seconds without either."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        size = len(self.clients)
        while True:
            for i in range(size):
                rank = (self._next + i) % size
                if self._dead[rank]:
                    continue
                out = await self.clients[rank].get_output(timeout=0)
                if out is not None:
                    self._next = (rank + 1) % size
                    return self._seen(rank, out)
            died = self._newly_dead()
            if died is not None:
                return died
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            await self._poller.poll(int(1000 * min(remaining, _LIVENESS_S)) + 1)

    def _seen(self, rank: int, out: StepOutputs) -> StepOutputs:
        s = self.stats[rank] = out.stats
        self._load[rank] = _WAITING_WEIGHT * s.num_waiting + s.num_running
        self._received[rank] = s.num_received
        for u in out.updates:
            if u.finish_reason is not None:
                self._owner.pop(u.request_id, None)
        return out if out.engine == rank else msgspec.structs.replace(out, engine=rank)

    def _newly_dead(self) -> StepOutputs | None:
        """A core found dead, its outputs all read (the caller read every socket just before):
        its requests' failures, as one step's, and its gauges zeroed."""
        for rank, client in enumerate(self.clients):
            if self._dead[rank] or client.is_alive():
                continue
            if client.output_socket.get(zmq.EVENTS) & zmq.POLLIN:
                continue  # still some it sent before dying: read them first
            self._dead[rank] = True
            logger.error("engine core %d died (%s); the others go on", rank, client.exit_status)
            lost = [rid for rid, r in self._owner.items() if r == rank]
            for rid in lost:
                del self._owner[rid]
            self.stats[rank] = msgspec.structs.replace(
                self.stats[rank], num_running=0, num_waiting=0, kv_cache_usage=0.0
            )
            failures = [RequestUpdate(rid, [], finish_reason=FinishReason.ERROR) for rid in lost]
            return StepOutputs(failures, self.stats[rank], engine=rank)
        return None

    async def shutdown(self, timeout: float = 10.0) -> None:
        await asyncio.gather(*(c.shutdown(timeout) for c in self.clients))


class RemoteEngineCoreClient(CoreMessages):
    """The front end's handle on an engine core that another host runs (`run_headless`): the
    same interface as `EngineCoreClient`, over TCP. The front end binds the rank's two ports
    (`ParallelConfig.rank_ports`) on `data_parallel_address` (`_bind_host`) and the core
    connects to them; with no process to watch, the core counts as alive while it reports
    (its heartbeat)."""

    def __init__(self, config: EngineConfig):
        parallel = config.parallel
        self.rank = parallel.data_parallel_rank
        # Sends on a plain socket: one that cannot go out raises here (an asyncio socket's
        # would only fail a future nobody awaits).
        self._send_ctx, self._ctx = zmq.Context(), zmq.asyncio.Context()
        self._inputs = self._send_ctx.socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._outputs = self._ctx.socket(zmq.PULL)
        ports = parallel.rank_ports(self.rank)
        host = _bind_host(parallel.data_parallel_address)
        try:
            self._inputs.bind(f"tcp://{host}:{ports[0]}")
            self._outputs.bind(f"tcp://{host}:{ports[1]}")
        except zmq.ZMQError as e:
            self._send_ctx.destroy(linger=0)
            self._ctx.destroy(linger=0)
            raise ValueError(f"data_parallel_rpc_port: rank {self.rank}'s ports {ports} on {host}: {e}") from None  # fmt: skip
        self._last = None  # time.monotonic() of its last message, once ready
        self._gone = False  # shut down, or silent too long

    async def wait_ready(self) -> Ready:
        """Waits, for as long as it takes another host to start, for the core's `Ready`."""
        waited = 0
        while True:
            if await self._outputs.poll(500):
                message = output_decoder.decode(await self._outputs.recv())
                if isinstance(message, Ready):
                    self._last = time.monotonic()
                    return message
                if isinstance(message, Failed):
                    raise RuntimeError(f"engine core {self.rank} failed to start: {message.message}")  # fmt: skip
            waited += 1
            if waited % 60 == 0:
                logger.info("waiting for data-parallel rank %d (another host's --headless)", self.rank)  # fmt: skip

    def is_alive(self) -> bool:
        if self._gone:
            return False
        if self._outputs.get(zmq.EVENTS) & zmq.POLLIN:  # it spoke; not read yet
            self._last = time.monotonic()
        elif self._last is not None and time.monotonic() - self._last > _REMOTE_TIMEOUT_S:
            self._gone = True  # late outputs are not believed any more
        return not self._gone

    @property
    def output_socket(self) -> zmq.asyncio.Socket:
        return self._outputs

    @property
    def exit_status(self) -> str:
        return f"no word from it for {_REMOTE_TIMEOUT_S:.0f} s" if self._gone else "running"

    def _send(self, message) -> None:
        if not self.is_alive():
            raise EngineDeadError(f"engine core {self.rank} is not running")
        try:
            self._inputs.send(encoder.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:  # its host went away and took the connection with it
            self._gone = True
            raise EngineDeadError(f"engine core {self.rank} is not connected") from None

    async def get_output(self, timeout: float = 0.5) -> StepOutputs | None:
        if self._gone or not await self._outputs.poll(int(timeout * 1000)):
            return None
        message = output_decoder.decode(await self._outputs.recv())
        self._last = time.monotonic()
        if isinstance(message, Ready):  # a new core: the one that had its requests is gone
            logger.error("data-parallel rank %d started again; its requests are lost", self.rank)
            self._gone = True
            return None
        return message if isinstance(message, StepOutputs) else None

    async def shutdown(self, timeout: float = 10.0) -> None:
        if not self._gone:
            try:
                self._inputs.send(encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
                await asyncio.sleep(0.1)  # (sent before the socket closes)
            except zmq.ZMQError:
                pass
        self._gone = True
        self._inputs.close(linger=1000)
        self._outputs.close(linger=0)
        self._send_ctx.term()
        self._ctx.term()


def _bind_host(address: str) -> str:
    """Where the API server listens for other hosts' cores: `address` if it is an IP of this
    host's (ZeroMQ binds interfaces, not names), else every interface."""
    import ipaddress
    import socket

    try:
        ipaddress.ip_address(address)
    except ValueError:
        return "*"
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
            s.bind((address, 0))
    except OSError:
        return "*"  # not this host's (e.g. a NAT'd or load-balanced address)
    return f"[{address}]" if ":" in address else address


def run_headless(config: EngineConfig) -> int:
    """`jaxllm serve --headless`: this host's data-parallel ranks (`local_ranks`), each an
    engine core process that connects to the API server on another host
    (`data_parallel_address`, its rank's ports) and serves no HTTP. Returns when they have all
    exited (the API server shut them down, or they failed)."""
    from jaxllm import host_memory
    from jaxllm.engine.core_proc import run_engine_core

    parallel = config.parallel
    if 0 in parallel.local_ranks:
        raise ValueError("--headless runs ranks other than 0 (the API server's): set --data-parallel-start-rank")  # fmt: skip
    host_memory.set_for_children()
    processes = []
    for rank in parallel.local_ranks:
        ports = parallel.rank_ports(rank)
        address = parallel.data_parallel_address
        args = (config.replace(data_parallel_rank=rank), f"tcp://{address}:{ports[0]}", f"tcp://{address}:{ports[1]}", _HEARTBEAT_S)  # fmt: skip
        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=args, name=f"jaxllm-engine-core-{rank}"
        )
        process.start()
        processes.append(process)
    logger.info("headless: ranks %s serve the API server at %s", list(parallel.local_ranks), parallel.data_parallel_address)  # fmt: skip
    try:
        for process in processes:
            process.join()
    except KeyboardInterrupt:
        pass
    finally:
        for process in processes:  # (the cores ignore SIGINT and SIGTERM)
            if process.is_alive():
                process.kill()
    return max((p.exitcode or 0) for p in processes)


def _check_event_endpoints(config: EngineConfig, size: int) -> None:
    """Every rank publishes KV events on its own ports (shifted by its rank, as vLLM shifts
    them): refuse a config whose ranks' ports would collide, before any core starts."""
    events = KVEventsConfig.parse(config.cache.kv_events_config)
    if events is None or not events.enabled:
        return
    seen: dict[str, str] = {}
    for rank in range(size):
        for name in ("endpoint", "replay_endpoint"):
            endpoint = offset_endpoint_port(getattr(events, name), rank)
            if endpoint is None:
                continue
            if endpoint in seen:
                raise ValueError(
                    f"kv_events_config: with data_parallel_size {size}, rank {rank}'s {name} "
                    f"{endpoint} is also {seen[endpoint]} (ports are shifted by the rank): leave "
                    f"{size} ports between endpoint and replay_endpoint"
                )
            seen[endpoint] = f"rank {rank}'s {name}"
