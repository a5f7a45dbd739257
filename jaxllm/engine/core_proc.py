"""The engine core in its own process, driven over ZMQ by `EngineCoreClient`.

The process owns the accelerator: it builds the engine (`EngineCore.from_config`: loading
weights, compiling every bucket; on host 0 of a multi-host run, joining the other hosts), says
`Ready`, then loops: take every message waiting on the input socket, run one
engine step if any request is unfinished, send that step's updates with the engine's stats.
When idle it blocks on the input socket (with a timeout, to notice a dead parent).

A step that raises fails the running requests, the ones the step held (finish reason "error";
the message is logged here, never sent to clients), and the engine goes on serving the
waiting ones. The process exits
on `Shutdown`, or when its parent is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import traceback

import zmq

from jaxllm.config import EngineConfig
from jaxllm.engine.core import EngineCore
from jaxllm.engine.messages import (
    Abort,
    AddRequest,
    Failed,
    Ready,
    Shutdown,
    StepOutputs,
    encoder,
    input_decoder,
)
from jaxllm.engine.request import Request
from jaxllm.engine.step_data import FinishReason, RequestUpdate, StepEvents

logger = logging.getLogger("jaxllm.engine.core")

_IDLE_POLL_MS = 200


def run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
    """Entry point of the core process (started with the "spawn" method), or of its thread
    in in-process mode."""
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
            engine = EngineCore.from_config(config)
        except Exception as e:  # a bad model path or flag: tell the front end, then exit
            logger.exception("engine failed to start")
            outputs.send(encoder.encode(Failed(f"{type(e).__name__}: {e}")))
            return
        outputs.send(
            encoder.encode(
                Ready(
                    max_model_len=engine.max_model_len,
                    vocab_size=engine.model_config.vocab_size,
                    eos_token_ids=list(engine.model_config.eos_token_ids),
                    num_pages=engine.scheduler.kv.num_pages,
                    page_size=engine.scheduler.kv.page_size,
                    num_programs=engine.runner.num_programs,
                    stats=engine.stats(),
                )
            )
        )
        while True:
            busy = engine.has_unfinished_requests()
            timeout = 0 if busy else _IDLE_POLL_MS
            received = False
            refused: list[RequestUpdate] = []
            while inputs.poll(timeout):
                received = True
                message = input_decoder.decode(inputs.recv())
                if isinstance(message, AddRequest):
                    try:
                        engine.add_request(
                            Request(
                                message.request_id,
                                message.prompt_token_ids,
                                message.sampling_params,
                                eos_token_ids=tuple(message.eos_token_ids),
                                max_tokens=message.max_tokens,
                                seed=message.seed,
                                priority=message.priority,
                                prefix_parent=message.prefix_parent,
                            )
                        )
                    except Exception as e:  # fails this request only
                        logger.warning("request %s refused: %s", message.request_id, e)
                        refused.append(
                            RequestUpdate(message.request_id, [], finish_reason=FinishReason.ERROR)
                        )
                elif isinstance(message, Abort):
                    engine.abort_requests(message.request_ids)
                elif isinstance(message, Shutdown):
                    return
                timeout = 0
            if os.getppid() != parent:
                logger.warning("front end is gone; exiting")
                return
            if not engine.has_unfinished_requests():
                if received:  # e.g. the last requests were aborted: publish the idle stats
                    outputs.send(encoder.encode(StepOutputs(refused, engine.stats())))
                continue
            try:
                updates = engine.step()
                step = engine.last_step
            except Exception:
                logger.error("engine step failed:\n%s", traceback.format_exc())
                scheduler = engine.scheduler
                failed = [r.request_id for r in scheduler.running]  # the step's requests
                engine.abort_requests(failed)
                engine.forget_lost_cache()
                updates = [
                    RequestUpdate(rid, [], finish_reason=FinishReason.ERROR) for rid in failed
                ]
                step = StepEvents()
            outputs.send(encoder.encode(StepOutputs(refused + updates, engine.stats(), step)))
    finally:
        if engine is not None:
            try:
                engine.shutdown()  # multi-host: releases the other hosts
            except Exception:
                logger.exception("engine shutdown failed")
        inputs.close(linger=0)
        outputs.close(linger=1000)
        ctx.term()
