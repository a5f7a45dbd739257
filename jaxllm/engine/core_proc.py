"""The engine core in its own process, driven over ZMQ by `EngineCoreClient`.

The process owns the accelerator: it builds the engine (loading weights, compiling every
bucket), says `Ready`, then loops: take every message waiting on the input socket, run one
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

from jaxllm.engine.messages import (
    Abort,
    AddRequest,
    Failed,
    Ready,
    Shutdown,
    Stats,
    StepOutputs,
    encoder,
    input_decoder,
)
from jaxllm.engine.step_data import FinishReason, RequestUpdate

logger = logging.getLogger("jaxllm.engine.core")

_IDLE_POLL_MS = 200


def _stats(llm) -> Stats:
    scheduler, kv = llm.engine.scheduler, llm.kv_cache_manager
    return Stats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        kv_cache_usage=1.0 - kv.num_free_blocks / kv.num_pages,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions,
        num_compilations=llm.runner.num_compilations,
        num_steps=llm.engine.num_steps,
    )


def run_engine_core(
    model: str, engine_kwargs: dict, input_address: str, output_address: str
) -> None:
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
    try:
        from jaxllm.engine.request import Request
        from jaxllm.llm import LLM

        try:
            llm = LLM(model, **engine_kwargs)
        except Exception as e:  # a bad model path or flag: tell the front end, then exit
            logger.exception("engine failed to start")
            outputs.send(encoder.encode(Failed(f"{type(e).__name__}: {e}")))
            return
        outputs.send(
            encoder.encode(
                Ready(
                    max_model_len=llm.max_model_len,
                    vocab_size=llm.model_config.vocab_size,
                    num_pages=llm.kv_cache_manager.num_pages,
                    page_size=llm.kv_cache_manager.page_size,
                    num_programs=llm.runner.num_programs,
                    stats=_stats(llm),
                )
            )
        )
        engine = llm.engine
        eos = llm.eos_token_ids
        while True:
            busy = engine.has_unfinished_requests()
            timeout = 0 if busy else _IDLE_POLL_MS
            received = False
            while inputs.poll(timeout):
                received = True
                message = input_decoder.decode(inputs.recv())
                if isinstance(message, AddRequest):
                    engine.add_request(
                        Request(
                            message.request_id,
                            message.prompt_token_ids,
                            message.sampling_params,
                            eos_token_ids=eos,
                            max_tokens=message.max_tokens,
                            seed=message.seed,
                            priority=message.priority,
                            prefix_parent=message.prefix_parent,
                        )
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
                    outputs.send(encoder.encode(StepOutputs([], _stats(llm))))
                continue
            try:
                updates = engine.step()
            except Exception:
                logger.error("engine step failed:\n%s", traceback.format_exc())
                scheduler = engine.scheduler
                failed = [r.request_id for r in scheduler.running]  # the step's requests
                engine.abort_requests(failed)
                engine.forget_lost_cache()
                updates = [
                    RequestUpdate(rid, [], finish_reason=FinishReason.ERROR) for rid in failed
                ]
            queue_times, engine.scheduler.queue_times = engine.scheduler.queue_times, []
            outputs.send(encoder.encode(StepOutputs(updates, _stats(llm), queue_times)))
    finally:
        inputs.close(linger=0)
        outputs.close(linger=1000)
        ctx.term()
