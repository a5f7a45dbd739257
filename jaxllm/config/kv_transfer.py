"""vLLM's `KVTransferConfig` (`--kv-transfer-config`): the engine's part in prefill/decode
disaggregation (`jaxllm.engine.kv_transfer`). In the config package so that the engine config
can check it without importing the engine."""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

from jaxllm.config.flags import json_section

CONNECTOR = "JaxTransferConnector"
# vLLM's connector names that deployments made for vLLM carry (llm-d's manifests name NIXL):
# they get this engine's transfer, which speaks the same request protocol.
ALIASES = ("NixlConnector",)
ROLES = ("kv_producer", "kv_consumer", "kv_both")

DEFAULT_PORT = 14579  # vLLM's kv_port
# A role's host KV tier when kv_offloading_size sets none: pulled blocks land there.
DEFAULT_HOST_TIER_GIB = 2.0


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's `KVTransferConfig` (the `--kv-transfer-config` JSON). Fields of vLLM's that other
    connectors read (buffer sizes, ranks, module paths) are accepted and unused.

    Ours, in `kv_connector_extra_config`: "pull_timeout_s" (how long a decoder waits for a
    prefiller's blocks before computing the prompt itself; default 30), "hold_timeout_s"
    (how long a prefiller keeps a finished request's blocks for a decoder that does not come;
    default 480, vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT) and "allowed_prefillers" (the hosts,
    or host:port, a decoder pulls from; default any: a client that can reach the decoder
    directly can name a prefiller of its own, whose blocks enter the shared prefix cache)."""

    kv_connector: str | None = None
    kv_role: str | None = None
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int | None = None
    kv_connector_extra_config: dict = dataclasses.field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"
    # vLLM's, unused here.
    kv_buffer_device: str | None = None
    kv_buffer_size: float | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_connector_module_path: str | None = None
    enable_permute_local_kv: bool = False

    @classmethod
    def parse(cls, value: str | dict | KVTransferConfig | None) -> KVTransferConfig | None:
        """From the flag's JSON (or a dict); a clear error names a bad field."""
        return json_section(cls, value, "kv_transfer_config")

    def check(self) -> None:
        known = (CONNECTOR, *ALIASES)
        if self.kv_connector not in known:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {list(known)}, got {self.kv_connector!r}")  # fmt: skip
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {list(ROLES)}, got {self.kv_role!r}")  # fmt: skip
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"kv_transfer_config.kv_load_failure_policy must be 'recompute' or 'fail', got {self.kv_load_failure_policy!r}")  # fmt: skip
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_transfer_config.kv_ip must be a host address, got {self.kv_ip!r}")  # fmt: skip
        port = self.kv_port
        if port is not None and (type(port) is not int or not 0 < port < 65536):
            raise ValueError(f"kv_transfer_config.kv_port must be a port number, got {port!r}")
        if self.engine_id is not None and (not isinstance(self.engine_id, str) or not self.engine_id):  # fmt: skip
            raise ValueError("kv_transfer_config.engine_id must be a non-empty string")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON object")
        allowed = extra.get("allowed_prefillers")
        if allowed is not None and (not isinstance(allowed, list) or not all(isinstance(a, str) and a for a in allowed)):  # fmt: skip
            raise ValueError("kv_transfer_config.kv_connector_extra_config.allowed_prefillers must be a list of hosts or host:port")  # fmt: skip
        for name in ("pull_timeout_s", "hold_timeout_s"):
            value = extra.get(name, 1)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{name} must be a positive number of seconds, got {value!r}")  # fmt: skip

    @property
    def is_producer(self) -> bool:
        """It prefills for other engines: it keeps a `do_remote_decode` request's blocks for
        the decoder and serves them."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """It decodes for other engines: it pulls a `do_remote_prefill` request's blocks."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def pull_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("pull_timeout_s", 30.0))

    @property
    def hold_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("hold_timeout_s", 480.0))

    def port(self, rank: int = 0) -> int:
        """The port this engine core serves its blocks on: kv_port (default vLLM's
        VLLM_NIXL_SIDE_CHANNEL_PORT when set, else 14579), plus the data-parallel rank, as
        vLLM offsets its side channel."""
        base = self.kv_port
        if base is None:
            base = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", DEFAULT_PORT))
        return base + rank

    def advertised_host(self) -> str:
        """The host a decoder reaches this engine at: kv_ip, or with kv_ip "0.0.0.0" (every
        interface) VLLM_NIXL_SIDE_CHANNEL_HOST (llm-d sets it to the pod's IP), else this
        machine's name."""
        if self.kv_ip not in ("0.0.0.0", "*", "::"):
            return self.kv_ip
        import socket

        return os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or socket.gethostname()

    def resolved_engine_id(self) -> str:
        return self.engine_id or str(uuid.uuid4())


def check_kv_transfer_params(params: Any) -> str | None:
    """What is wrong with a request's `kv_transfer_params` (the field named), or None. A
    client's value: a decoder connects where it says, so its address must be well formed."""
    if params is None:
        return None
    if not isinstance(params, dict):
        return "kv_transfer_params must be a JSON object"
    for name in ("do_remote_decode", "do_remote_prefill"):
        if params.get(name) is not None and not isinstance(params[name], bool):
            return f"kv_transfer_params.{name} must be a boolean"
    if not params.get("do_remote_prefill"):
        return None
    for name in ("remote_host", "remote_request_id", "remote_engine_id"):
        value = params.get(name)
        if not isinstance(value, str) or not value:
            return f"kv_transfer_params.{name} must be a non-empty string"
    port = params.get("remote_port")
    if type(port) is not int or not 0 < port < 65536:
        return "kv_transfer_params.remote_port must be a port number"
    blocks = params.get("remote_block_ids")
    if blocks is not None and not isinstance(blocks, list):
        return "kv_transfer_params.remote_block_ids must be a list"
    return None
