"""The front end's handle on the engine core process (asyncio, ZMQ over private unix sockets).

The client binds two sockets in a fresh directory only this user can enter (mode 0700), starts
the core with the "spawn" method (JAX must not be forked) and waits for `Ready`. Requests and
aborts go out on one socket, step outputs come back on the other.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile
import threading
from pathlib import Path

import zmq
import zmq.asyncio

from jaxllm import host_memory
from jaxllm.config import EngineConfig
from jaxllm.engine.core_proc import run_engine_core
from jaxllm.engine.messages import (
    Abort,
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


class CoreMessages:
    """What a handle on an engine core sends, over its `_send` (which raises
    `EngineDeadError` when the core is gone) and `is_alive`."""

    def add_request(self, request: AddRequest | AddPooling) -> None:
        self._send(request)

    def send(self, message) -> None:
        """A control message (`Sleep`, `WakeUp`)."""
        self._send(message)

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.is_alive():
            self._send(Abort(request_ids))


class EngineCoreClient(CoreMessages):
    """`in_process=True` runs the same core loop on a thread of this process instead of a
    child process (for tests and notebooks: one process, same code path, same sockets)."""

    def __init__(self, config: EngineConfig, *, in_process: bool = False):
        self._dir = Path(tempfile.mkdtemp(prefix="jaxllm-"))  # 0700
        self._ctx = zmq.asyncio.Context()
        self._inputs = self._ctx.socket(zmq.PUSH)
        # No send limit: an abort must never be dropped (the server's queue limit already
        # bounds what can be waiting).
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._outputs = self._ctx.socket(zmq.PULL)
        input_address = f"ipc://{self._dir / 'input'}"
        output_address = f"ipc://{self._dir / 'output'}"
        self._inputs.bind(input_address)
        self._outputs.bind(output_address)
        args = (config, input_address, output_address)
        if in_process:
            self.process = threading.Thread(
                target=run_engine_core, args=args, name="jaxllm-engine-core", daemon=True
            )
        else:
            host_memory.set_for_children()  # the core's XLA temporaries stay resident
            self.process = multiprocessing.get_context("spawn").Process(
                target=run_engine_core, args=args, name="jaxllm-engine-core", daemon=True
            )
        self.process.start()

    async def wait_ready(self) -> Ready:
        """Waits for the core to load the model and compile; raises if it cannot start."""
        while True:
            if await self._outputs.poll(500):
                message = output_decoder.decode(await self._outputs.recv())
                if isinstance(message, Ready):
                    return message
                if isinstance(message, Failed):
                    raise RuntimeError(f"engine failed to start: {message.message}")
            elif not self.process.is_alive():
                raise EngineDeadError(f"engine core exited during startup ({self.exit_status})")

    def is_alive(self) -> bool:
        return self.process.is_alive()

    @property
    def output_socket(self) -> zmq.asyncio.Socket:
        """The socket the core's outputs arrive on (to wait on several cores at once)."""
        return self._outputs

    @property
    def exit_status(self) -> str:
        code = getattr(self.process, "exitcode", None)
        return "thread ended" if code is None else f"exit code {code}"

    def _send(self, message) -> None:
        if not self.is_alive():
            raise EngineDeadError("engine core is not running")
        # PUSH over ipc never blocks here in practice; NOBLOCK turns a wedged core into an
        # error rather than a hung event loop.
        self._inputs.send(encoder.encode(message), flags=zmq.NOBLOCK)

    async def get_output(self, timeout: float = 0.5) -> StepOutputs | None:
        """The next step's outputs, or None after `timeout` seconds without one."""
        if not await self._outputs.poll(int(timeout * 1000)):
            return None
        message = output_decoder.decode(await self._outputs.recv())
        return message if isinstance(message, StepOutputs) else None

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self.process.is_alive():
            try:
                self._inputs.send(encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            await asyncio.to_thread(self.process.join, timeout)
        if isinstance(self.process, multiprocessing.process.BaseProcess):
            if self.process.is_alive():  # the core ignores SIGTERM: kill it
                self.process.kill()
                await asyncio.to_thread(self.process.join, 5)
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
