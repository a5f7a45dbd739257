"""The HTTP server's own settings: `jaxllm serve`'s flags beyond the engine's, declared once
(flag, keyword and help from each field, as `jaxllm.config.EngineConfig` does)."""

from __future__ import annotations

import dataclasses

from jaxllm.config import option
from server.reasoning_parsers import REASONING_PARSERS
from server.tool_parsers import TOOL_PARSERS


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """The address to listen on."""
    port: int = 8000
    """The port to listen on."""
    api_key: str | None = None
    """Require this bearer key on /v1, /tokenize and /detokenize (env JAXLLM_API_KEY)."""
    served_model_name: tuple[str, ...] | None = None
    """The names clients use for the model (default: MODEL as given)."""
    max_queued_requests: int = 1024
    """Unfinished requests beyond this get 503 with Retry-After; a request of more than this
    many completions (n, times its prompts) gets 400."""
    chat_template: str | None = None
    """A Jinja chat template, or a file holding one (default: the tokenizer's)."""
    generation_config: str = "auto"
    """Sampling defaults: auto (the model's generation_config.json), vllm (none), or a
    directory holding a generation_config.json."""
    shutdown_timeout: float = 30.0
    """Seconds to drain in-flight requests on SIGTERM."""
    headless: bool = False
    """Run this host's data-parallel engine cores (--data-parallel-start-rank and
    --data-parallel-size-local of --data-parallel-size) for the API server on another host
    (--data-parallel-address, --data-parallel-rpc-port), and no API server (vLLM's flag)."""
    enable_auto_tool_choice: bool = False
    """Allow tool_choice "auto": the model decides whether to call tools, and
    --tool-call-parser reads its calls out of the text."""
    tool_call_parser: str | None = option(None, choices=tuple(TOOL_PARSERS))
    """The format of the model's own tool calls, for tool_choice auto: hermes, llama3_json,
    mistral, pythonic, qwen3_coder or openai (gpt-oss's harmony), vLLM's names."""
    enable_sleep_mode: bool = False
    """Serve vLLM's sleep mode endpoints: POST /sleep?level=1|2 frees the weights' (level 1:
    kept in host memory; 2: dropped, reloaded on waking) and the KV cache's device memory
    while idle, POST /wake_up brings them back (nothing compiles), GET /is_sleeping."""
    reasoning_parser: str | None = option(None, choices=tuple(REASONING_PARSERS))
    """Split a reasoning model's thinking off its answer, into message.reasoning_content:
    qwen3 or deepseek_r1 (<think>...</think>), openai_gptoss (gpt-oss's harmony analysis
    channel; the default for gpt-oss), vLLM's names."""
    lora_modules: tuple[str, ...] | None = None
    """LoRA adapters to serve (with --enable-lora), each name=path (a PEFT directory) or
    vLLM's JSON {"name": ..., "path": ..., "base_model_name": ...}; a request's `model` field
    picks one by name."""
    allow_runtime_lora_updating: bool = False
    """Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's environment
    switch VLLM_ALLOW_RUNTIME_LORA_UPDATING, as a flag); needs --enable-lora."""

    def __post_init__(self) -> None:
        if self.max_queued_requests < 1:
            raise ValueError(
                f"--max-queued-requests must be at least 1 (got {self.max_queued_requests})"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535] (got {self.port})")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 (got {self.shutdown_timeout})")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"--tool-call-parser: unknown parser {self.tool_call_parser!r}; the parsers "
                f"are {', '.join(TOOL_PARSERS)}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser: unknown parser {self.reasoning_parser!r}; the parsers "
                f"are {', '.join(REASONING_PARSERS)}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("--served-model-name: give at least one name")
