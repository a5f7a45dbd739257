"""Prefill/decode disaggregation with vLLM's request protocol (`--kv-transfer-config`): one
engine prefills a prompt, another pulls its KV blocks and decodes, as llm-d and vLLM's proxies
drive them.

The protocol, as vLLM's NIXL connector speaks it to the proxy:
1. The proxy sends the request to the prefiller with `kv_transfer_params`
   `{"do_remote_decode": true}` and `max_tokens` 1.
2. The prefiller (a producer) computes the prompt, and when the request finishes keeps its
   blocks out of the pool ("held") instead of freeing them; the response carries the params a
   decoder needs: `{"do_remote_prefill": true, "remote_engine_id", "remote_request_id",
   "remote_host", "remote_port", "remote_block_ids", "tp_size"}`.
3. The proxy sends the original request to the decoder with those params. The decoder (a
   consumer) holds the request back while a thread pulls the prompt's full blocks from the
   prefiller's port, lands them in its host KV tier under its own prefix-cache keys, and then
   queues the request: its prefix-cache lookup finds the blocks there and copies them to the
   device (`kv_cache_manager`, `jaxllm.worker.kv_offload`), so it computes only the tokens of
   the last, partial block.

The transfer is host-staged over ZeroMQ (no device-to-device library runs on every platform
JAX serves). The prefiller gathers whole blocks (every device's shard), so the two engines
may differ in tensor-parallel degree; their blocks' shapes and dtypes must match. The pull
names the decoder's vLLM block hashes of the prompt (`block_hashing`), which commit to its
tokens, adapter, images and salt: the prefiller sends nothing unless they equal the held
request's, so a transfer is right or does not happen. Any failure (the prefiller gone or slow,
the blocks released, another model) leaves the decoder to compute the prompt itself
(`kv_load_failure_policy` "recompute", vLLM's default) or fails the request ("fail").

A prefiller releases a request's blocks once a decoder has pulled them, or after
`hold_timeout_s` (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT).

Every socket but the pulling threads' is served by the engine core's thread, between steps
(`poll`), so the books of the KV cache are never touched concurrently.
"""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple

import msgspec
import numpy as np
import zmq

from jaxllm.config.kv_transfer import KVTransferConfig
from jaxllm.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from jaxllm.engine.kv_cache_manager import KVCacheManager
    from jaxllm.worker import KVOffloader

logger = logging.getLogger(__name__)

_PULL_THREADS = 16


# ---- the wire ------------------------------------------------------------------------------


class Pull(msgspec.Struct, tag="pull"):
    """A decoder asks for a held request's blocks `[first_block, len(block_hashes))`; it holds
    the ones before. The prefiller releases the request after answering."""

    request_id: str  # the prefiller's (remote_request_id)
    engine_id: str  # the prefiller's, as its params named it
    first_block: int
    block_hashes: list[bytes]  # the decoder's vLLM hashes of the prompt's full blocks
    hash_algo: str
    layout: list[tuple[list[int], str]]  # per cache array: one block's shape and dtype


class Reply(msgspec.Struct, tag="reply"):
    """The answer; when `ok`, one frame follows per cache array: the blocks `blocks` names
    ((group, index) each), stacked in that order."""

    ok: bool
    error: str = ""
    blocks: list[tuple[int, int]] = []


_encoder = msgspec.msgpack.Encoder()
_pull_decoder = msgspec.msgpack.Decoder(Pull)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


class _Held(NamedTuple):
    hold: int  # the KV cache manager's hold id
    tables: list[list[int]]  # per group, the request's blocks
    chain: list[bytes]  # vLLM hashes of its full blocks
    deadline: float  # time.monotonic() after which it is released unread


class _Pulled(NamedTuple):
    request_id: str
    blocks: list[tuple[int, int]]
    arrays: list[np.ndarray]
    error: str  # "" when the pull succeeded
    seconds: float


class KVTransfer:
    """One engine core's part in P/D (see the module doc): `on_finish` holds a producer's
    finished request; `start_pull` takes a consumer's request until its blocks are in; `poll`
    serves pulls, expires holds and returns the requests whose pulls ended."""

    def __init__(
        self,
        config: KVTransferConfig,
        kv: KVCacheManager,
        offloader: KVOffloader,
        *,
        rank: int = 0,
        tp_size: int = 1,
    ):
        self.config = config
        self.kv = kv
        self.offloader = offloader
        self.engine_id = config.resolved_engine_id()
        self.tp_size = tp_size
        self.host, self.port = config.advertised_host(), config.port(rank)
        self.ctx = zmq.Context()
        self.router: zmq.Socket | None = None
        if config.is_producer:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            bind = "*" if config.kv_ip in ("0.0.0.0", "*") else config.kv_ip
            try:
                self.router.bind(f"tcp://{bind}:{self.port}")
            except zmq.ZMQError as e:
                self.router.close()
                raise ValueError(f"kv_transfer_config: cannot serve blocks on {bind}:{self.port}: {e}") from None  # fmt: skip
            logger.info(
                "KV transfer (%s): serving blocks on %s:%d", config.kv_role, bind, self.port
            )
        self.layout = [(list(h.shape[1:]), str(h.dtype)) for h in offloader.host]
        self._held: dict[str, _Held] = {}
        # Held blocks stop being taken past this share of the pool (a decoder that never
        # comes must not starve the prefiller): such a request's decoder computes the prompt.
        self._max_held_blocks = self.kv.num_pages // 2
        self._pulls: dict[str, Request] = {}  # consumer: requests waiting for their blocks
        self._done: queue.SimpleQueue[_Pulled] = queue.SimpleQueue()
        # The pulls under way at once (each a socket); more wait their turn.
        self._pool = ThreadPoolExecutor(_PULL_THREADS, thread_name_prefix="kv-pull")
        allowed = config.kv_connector_extra_config.get("allowed_prefillers")
        self._allowed = None if allowed is None else set(allowed)
        # Counters since start, for metrics.
        self.num_sent_blocks = 0  # producer: blocks decoders pulled
        self.num_received_blocks = 0  # consumer: blocks pulled and landed
        self.num_received_bytes = 0
        self.num_failed = 0  # consumer: pulls that failed (the prompt was recomputed)
        self.external_queries = 0  # consumer: prompt tokens of its remote-prefill requests
        self.external_hits = 0  # consumer: of which pulled
        self.pull_seconds = 0.0

    # ---- producer ------------------------------------------------------------------------

    def on_finish(self, request: Request, status: RequestStatus) -> bool:
        """A request is finishing: a producer keeps a `do_remote_decode` one's full blocks for
        its decoder (True: the caller must not free them) and leaves the params the decoder
        needs on the request (`kv_transfer_out`)."""
        params = request.kv_transfer_params
        if (
            self.router is None
            or not params
            or not params.get("do_remote_decode")
            or status not in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
        ):
            return False
        n = min(request.num_computed_tokens, request.num_prompt_tokens) // self.kv.page_size
        tables = self.kv.get_block_table(request.request_id)
        chain = self.kv.block_chain(request)[:n]
        held = n > 0 and len(chain) == n and request.request_id not in self._held
        if held and self._num_held_blocks() + n * len(tables) > self._max_held_blocks:
            logger.warning("request %s: half the KV pool is held for decoders already; its decoder will compute the prompt", request.request_id)  # fmt: skip
            held = False
        request.kv_transfer_out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [max(b, 0) for b in tables[0][:n]] if held else [],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_size": self.kv.page_size,
            "tp_size": self.tp_size,
        }
        if not held:
            return False
        hold = self.kv.hold(request)
        deadline = time.monotonic() + self.config.hold_timeout_s
        self._held[request.request_id] = _Held(hold, [t[:n] for t in tables], chain, deadline)
        return True

    def _num_held_blocks(self) -> int:
        return sum(b >= 0 for h in self._held.values() for t in h.tables for b in t)

    def _serve(self) -> None:
        """Answers the pulls waiting on the producer's socket."""
        while self.router.poll(0):
            frames = self.router.recv_multipart()
            identity, body = frames[0], frames[-1]
            try:
                pull = _pull_decoder.decode(body)
            except msgspec.DecodeError as e:
                self.router.send_multipart([identity, _encoder.encode(Reply(False, f"bad pull: {e}"))])  # fmt: skip
                continue
            try:
                reply, arrays = self._answer(pull)
            except Exception as e:  # (a device read that failed): the decoder recomputes
                logger.exception("serving a KV pull failed")
                reply, arrays = Reply(False, f"the prefiller failed: {type(e).__name__}"), []
            self.router.send_multipart([identity, _encoder.encode(reply), *arrays], copy=False)

    def _answer(self, pull: Pull) -> tuple[Reply, list[np.ndarray]]:
        held = self._held.get(pull.request_id)
        if pull.engine_id != self.engine_id:
            return Reply(False, f"engine {pull.engine_id!r} is not this one ({self.engine_id!r})"), []  # fmt: skip
        if held is None:
            return Reply(False, f"request {pull.request_id!r} holds no blocks here (released, expired or unknown)"), []  # fmt: skip
        if pull.hash_algo != self.kv.hasher.algo:
            return Reply(False, f"block hashes differ in algorithm: the decoder's {pull.hash_algo}, the prefiller's {self.kv.hasher.algo}"), []  # fmt: skip
        n = len(pull.block_hashes)
        if n > len(held.chain) or pull.block_hashes != held.chain[:n]:
            # Another prompt, adapter, salt or hash seed: nothing is sent, nothing released
            # (the right decoder may still come).
            return Reply(False, "the decoder's prompt blocks are not this request's (another prompt, adapter, salt or PYTHONHASHSEED)"), []  # fmt: skip
        if [tuple(x) for x in pull.layout] != [tuple(x) for x in self.layout]:
            return Reply(False, f"KV block layouts differ: the decoder's {pull.layout}, the prefiller's {self.layout}"), []  # fmt: skip
        blocks = [
            (g, i)
            for i in range(max(pull.first_block, 0), n)
            for g, table in enumerate(held.tables)
            if table[i] >= 0
        ]
        arrays = self.offloader.read([held.tables[g][i] for g, i in blocks])
        self._release(pull.request_id)  # read: the pool may have them back
        self.num_sent_blocks += len(blocks)
        return Reply(True, blocks=blocks), arrays

    def _release(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            self.kv.release_hold(held.hold)

    def release_all(self) -> None:
        """Releases every held request (the KV cache is about to be dropped: sleep, or a
        failed step took it); their decoders will compute the prompts themselves."""
        for request_id in list(self._held):
            self._release(request_id)

    # ---- consumer ------------------------------------------------------------------------

    def wants_pull(self, request: Request) -> bool:
        params = request.kv_transfer_params
        return self.config.is_consumer and bool(params) and bool(params.get("do_remote_prefill"))

    def start_pull(self, request: Request) -> bool:
        """Holds the request back while a thread pulls the prompt's full blocks that this
        engine does not cache already; `poll` returns it once they are in (or the pull
        failed). False, holding nothing back, when the prefiller holds no block of it (a
        prompt shorter than a block)."""
        params = request.kv_transfer_params
        page = self.kv.page_size
        self.external_queries += request.num_prompt_tokens
        chain = self.kv.block_chain(request)[: (request.num_tokens - 1) // page]
        chain = chain[: len(params.get("remote_block_ids") or [])]
        if not chain:
            return False
        host, port = params["remote_host"], params["remote_port"]
        if self._allowed is not None and host not in self._allowed and f"{host}:{port}" not in self._allowed:  # fmt: skip
            # A client named a prefiller this decoder does not trust with its prefix cache.
            logger.warning("request %s: prefiller %s:%d is not in allowed_prefillers; computing the prompt", request.request_id, host, port)  # fmt: skip
            self.num_failed += 1
            return False
        # Blocks cached here already are not pulled (but the pull still releases the
        # prefiller's hold).
        _, cached = self.kv.get_computed_blocks(request)
        first = min(cached // page, len(chain))
        pull = Pull(
            params["remote_request_id"],
            params["remote_engine_id"],
            first,
            chain,
            self.kv.hasher.algo,
            self.layout,
        )
        address = f"tcp://{_host(host)}:{port}"
        self._pool.submit(self._pull, request.request_id, address, pull)
        self._pulls[request.request_id] = request
        return True

    def _pull(self, request_id: str, address: str, pull: Pull) -> None:
        """A pulling thread: one round trip to the prefiller, its result queued for `poll`
        whatever happens."""
        start, sock = time.monotonic(), None
        result = _Pulled(request_id, [], [], "the pull was interrupted", 0.0)
        try:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            sock.send(_encoder.encode(pull))
            if not sock.poll(int(self.config.pull_timeout_s * 1000)):
                raise TimeoutError(f"no answer from {address} in {self.config.pull_timeout_s} s")
            frames = sock.recv_multipart()
            reply = _reply_decoder.decode(frames[0])
            if not reply.ok:
                raise ValueError(reply.error)
            if len(frames) != 1 + len(self.layout):
                raise ValueError(f"{len(frames) - 1} arrays for {len(self.layout)} cache arrays")
            groups, wanted = self.kv.num_groups, range(pull.first_block, len(pull.block_hashes))
            if any(not (0 <= g < groups and i in wanted) for g, i in reply.blocks):
                raise ValueError("blocks that were not asked for")
            arrays = [
                np.frombuffer(frame, _dtype(dtype)).reshape(len(reply.blocks), *shape)
                for frame, (shape, dtype) in zip(frames[1:], self.layout, strict=True)
            ]
            result = _Pulled(request_id, [tuple(b) for b in reply.blocks], arrays, "", 0.0)
        except Exception as e:  # any failure is a recompute (or a failed request)
            result = _Pulled(request_id, [], [], f"{type(e).__name__}: {e}", 0.0)
        finally:
            if sock is not None:
                sock.close()
            self._done.put(result._replace(seconds=time.monotonic() - start))

    def abort(self, request_ids: list[str]) -> None:
        """Drops requests still waiting for their blocks (their pulls end unused)."""
        for rid in request_ids:
            request = self._pulls.pop(rid, None)
            if request is not None:
                self.kv.forget(request)

    def pulling(self, request_id: str) -> bool:
        return request_id in self._pulls

    @property
    def num_pulling(self) -> int:
        return len(self._pulls)

    # ---- the engine thread ---------------------------------------------------------------

    def poll(self) -> tuple[list[Request], list[Request]]:
        """Serves pulls, releases expired holds, lands finished pulls: (requests now ready to
        schedule, requests failed by `kv_load_failure_policy` "fail")."""
        if self.router is not None:
            self._serve()
            now = time.monotonic()
            for rid in [r for r, h in self._held.items() if h.deadline < now]:
                logger.warning("request %s: no decoder pulled its blocks; released", rid)
                self._release(rid)
        ready, failed = [], []
        while True:
            try:
                pulled = self._done.get_nowait()
            except queue.Empty:
                break
            request = self._pulls.pop(pulled.request_id, None)
            if request is None:  # aborted meanwhile
                continue
            self.pull_seconds += pulled.seconds
            if pulled.error:
                self.num_failed += 1
                logger.warning("request %s: KV pull failed (%s); %s", request.request_id, pulled.error, "failing it" if self.config.kv_load_failure_policy == "fail" else "computing the prompt")  # fmt: skip
                if self.config.kv_load_failure_policy == "fail":
                    self.kv.forget(request)
                    failed.append(request)
                    continue
            elif pulled.blocks:
                try:
                    self._land(request, pulled)
                except Exception:  # never lost: it fails alone
                    logger.exception("request %s: landing its blocks failed", request.request_id)
                    self.kv.forget(request)
                    failed.append(request)
                    continue
            ready.append(request)
        return ready, failed

    def _land(self, request: Request, pulled: _Pulled) -> None:
        """Writes a pull's blocks into the host tier under the request's keys."""
        slots = self.kv.land_pulled(request, pulled.blocks)
        keep = [k for k, slot in enumerate(slots) if slot >= 0]
        # (The arrays' shapes were checked against this tier's when they arrived.)
        self.offloader.write([slots[k] for k in keep], [a[keep] for a in pulled.arrays])
        self.num_received_blocks += len(keep)
        self.num_received_bytes += sum(a.nbytes for a in pulled.arrays)
        self.external_hits += len({pulled.blocks[k][1] for k in keep}) * self.kv.page_size

    @property
    def sockets(self) -> list[zmq.Socket]:
        """The sockets whose messages `poll` serves (an idle core waits on them)."""
        return [] if self.router is None else [self.router]

    def stats(self) -> dict:
        return dict(
            kv_transfer_sent_blocks=self.num_sent_blocks,
            kv_transfer_received_blocks=self.num_received_blocks,
            kv_transfer_received_bytes=self.num_received_bytes,
            kv_transfer_failures=self.num_failed,
            kv_transfer_seconds=self.pull_seconds,
            external_prefix_cache_queries=self.external_queries,
            external_prefix_cache_hits=self.external_hits,
            kv_transfer_held=len(self._held),
        )

    def close(self) -> None:
        self.release_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.ctx.destroy(linger=0)


def _host(host: str) -> str:
    """A host for a tcp:// address (an IPv6 literal in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _dtype(name: str) -> np.dtype:
    import jax.numpy as jnp

    return np.dtype(jnp.dtype(name))
