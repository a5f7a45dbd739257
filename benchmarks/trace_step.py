"""One decode step on the device, from a `jax.profiler` trace, reduced to a table: the top
kernels and their share of the step, kernels launched per step, the device's idle gaps inside a
step, and the host's waits on the device (device-to-host copies and synchronizations).

    python benchmarks/trace_step.py [--model smollm2-135m] [--load-format auto] \
        [--batch 1,64] [--context 1024] [--output-len 128] [--steps 16] [--dtype auto] \
        [--top 15] \
        [--trace-dir DIR] [--json PATH] [ENGINE FLAGS as --flag=value ...]
    python benchmarks/trace_step.py --reduce DIR/plugins/profile/RUN --steps 16   # a trace

One engine serves every batch size. For each, `--batch` prompts of `--context` random tokens:
first the decode step untimed by the profiler, greedy and then sampled (temperature 0.7, top-p
0.9): a run of `--output-len` tokens that compiles what the shapes need, then the best of two
runs of 1 and of `--output-len` tokens, whose difference gives decode ms per step (as
`e2e_vs_transformers.py` measures), with the programs compiled after the first run counted.
Then `--steps` greedy decode steps run under `jax.profiler.trace` (each `EngineCore.step`
inside a `TraceAnnotation` named "engine_step", so the steps' windows are known). The trace's
Chrome JSON (`*.trace.json.gz`) is reduced:

    device events  on a GPU, the kernels on the "/device:GPU:N" rows (CUPTI); on the CPU, the
                   work items of XLA's CPU client threads (its thunks and fusions)
    kernels/step   device events inside the decode steps' windows, per step; the table groups
                   them by kind (the name without XLA's instance numbers)
    launches       host API calls inside a step that launch kernels or graphs (on a GPU)
    busy, idle     per step: the union of device events' time, and the window minus it
    gaps           device idle stretches inside a step longer than 20 us, per step
    host syncs     host events that wait for the device (memcpy device-to-host, stream or
                   event synchronization, a buffer's await), per step

The trace itself is not kept unless `--trace-dir` names where (a decode step of an 8B model
is thousands of events). Engine flags after the known ones go to `LLM` (`--max-num-seqs=64`).
On the CPU the "device" is XLA's thread pool on the host's own cores: its idle gaps are the
host's work between steps that async scheduling did not hide.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import tempfile
from pathlib import Path

import numpy as np

# Host events that wait for the device.
_SYNC = re.compile(
    r"memcpy.*(dtoh|d2h|devicetohost)|synchroniz|blockhostuntil|await|cuStreamWait|"
    r"cuEventSynchronize|TransferToHost|CopyToHost",
    re.IGNORECASE,
)
# Bookkeeping events of XLA's CPU client threads: not work.
_CPU_NOISE = re.compile(r"^(ThreadpoolListener|ThunkExecutor|end: )")
# Host API calls that launch work: kernels one by one, or a captured graph (command buffer).
_LAUNCH = re.compile(r"(cu|cuda)LaunchKernel|(cu|cuda)GraphLaunch|LaunchKernel", re.IGNORECASE)
_GRAPH = re.compile(r"GraphLaunch", re.IGNORECASE)
# A kernel's kind: its name without XLA's instance numbers ("loop_fusion_12" -> "loop_fusion").
_INSTANCE = re.compile(r"([._]\d+)+$")
_STEP = "engine_step"
_GAP_US = 20.0


def _load(trace_dir: Path) -> dict:
    files = sorted(trace_dir.rglob("*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
    with gzip.open(files[-1]) as f:
        return json.load(f)


def reduce_trace(trace: dict, *, top: int = 15) -> dict:
    """The table's figures from a Chrome trace (see the module's docstring)."""
    events = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"
    }
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = {pid for pid, name in procs.items() if "/device:GPU" in name or "/device:gpu" in name}
    if gpu:
        device = [e for e in spans if e["pid"] in gpu]
        source = "gpu"
    else:  # XLA's CPU client threads
        cpu_threads = {k for k, name in threads.items() if re.search(r"XLA|Eigen|PjRtCpu", name)}
        device = [
            e
            for e in spans
            if (e["pid"], e["tid"]) in cpu_threads and not _CPU_NOISE.match(e["name"])
        ]
        source = "cpu threads"
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == _STEP)
    if not steps:
        raise ValueError(f"no {_STEP!r} annotations in the trace")
    host_thread_ids = {k for k, name in threads.items() if name == "python"}
    host = [e for e in spans if (e["pid"], e["tid"]) in host_thread_ids]
    launches = [e for e in spans if e["pid"] not in gpu and _LAUNCH.search(e["name"])]

    def inside(e, window) -> bool:
        return window[0] <= e["ts"] < window[1]

    per_step = []
    kernels = collections.defaultdict(lambda: [0, 0.0])  # kind -> [count, us]
    for window in steps:
        mine = sorted((e for e in device if inside(e, window)), key=lambda e: e["ts"])
        busy, gaps, cursor = 0.0, [], window[0]
        for e in mine:
            start, end = e["ts"], e["ts"] + e["dur"]
            if start > cursor:
                if start - cursor > _GAP_US and cursor > window[0]:
                    gaps.append(start - cursor)
            busy += max(0.0, end - max(start, cursor))
            cursor = max(cursor, end)
            kind = _INSTANCE.sub("", e["name"]) or e["name"]
            kernels[kind][0] += 1
            kernels[kind][1] += e["dur"]
        syncs = [e["name"] for e in host if inside(e, window) and _SYNC.search(e["name"])]
        mine_launches = [e["name"] for e in launches if inside(e, window)]
        per_step.append(
            {
                "step_us": window[1] - window[0],
                "kernels": len(mine),
                "busy_us": busy,
                "idle_us": (window[1] - window[0]) - busy,
                "gaps": len(gaps),
                "gap_us": sum(gaps),
                "host_syncs": len(syncs),
                "launches": len(mine_launches),
                "graph_launches": sum(1 for n in mine_launches if _GRAPH.search(n)),
                "sync_names": sorted(set(syncs)),
            }
        )
    n = len(per_step)
    total = sum(us for _, us in kernels.values()) or 1.0
    table = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    med = {k: float(np.median([s[k] for s in per_step])) for k in per_step[0] if k != "sync_names"}
    return {
        "source": source,
        "steps": n,
        "median": med,
        "sync_names": sorted({s for p in per_step for s in p["sync_names"]}),
        "top_kernels": [
            {"name": name, "per_step": c / n, "us_per_step": us / n, "share": us / total}
            for name, (c, us) in table[:top]
        ],
        "per_step": per_step,
    }


def render(r: dict, title: str) -> str:
    m = r["median"]
    lines = [
        f"{title}: {r['steps']} decode steps, device events from {r['source']}",
        f"  step {m['step_us'] / 1e3:.2f} ms (median): device busy {m['busy_us'] / 1e3:.2f} ms, "
        f"idle {m['idle_us'] / 1e3:.2f} ms; {m['kernels']:.0f} kernels; {m['gaps']:.0f} gaps "
        f"> {_GAP_US:.0f} us ({m['gap_us'] / 1e3:.2f} ms); host launches {m['launches']:.0f} "
        f"({m['graph_launches']:.0f} graphs); host syncs {m['host_syncs']:.0f}"
        + (f" ({', '.join(r['sync_names'][:4])})" if r["sync_names"] else ""),
        f"  {'kernel (kind)':<60} {'/step':>6} {'us/step':>9} {'share':>6}",
    ]
    for k in r["top_kernels"]:
        lines.append(
            f"  {k['name'][:60]:<60} {k['per_step']:>6.1f} {k['us_per_step']:>9.1f} "
            f"{k['share']:>6.1%}"
        )
    return "\n".join(lines)


def run(args, engine_args: dict, on_batch=None) -> dict:
    import dataclasses

    import jax

    from jaxllm import LLM, SamplingParams
    from jaxllm.bench.throughput import measure, random_token_prompts

    # One engine for every batch size, programs compiled as the shapes first occur (as
    # e2e_vs_transformers.py does): a warmed 8B engine would compile every bucket first.
    llm = LLM(
        args.model,
        dtype=args.dtype,
        load_format=args.load_format,
        max_num_seqs=max(args.batch),
        max_model_len=args.context + max(args.output_len, args.steps + 2) + 16,
        **{"skip_warmup": True, **engine_args},
    )
    vocab = llm.model_config.vocab_size
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    sampled = SamplingParams(temperature=0.7, top_p=0.9, seed=0, ignore_eos=True)
    results = {}
    for batch in args.batch:
        tokens = random_token_prompts(batch, args.context, vocab, seed=batch)
        prompts = [{"prompt_token_ids": p} for p in tokens]
        row: dict = {"batch": batch, "context": args.context, "output_len": args.output_len}
        # Decode ms per step, untraced: an --output-len run against a 1-token run (best of two
        # each, after one that compiles what the shapes need), greedy, then sampled.
        kinds = [("greedy", greedy)] + ([("sampled", sampled)] if batch in args.sampled else [])
        for name, params in kinds:

            def gen(n, params=params, tokens=tokens):
                r = measure(llm, tokens, n, use_tqdm=False, params=params)
                return r["elapsed_time"], r["compilations_during_run"]

            first_s, compiled = gen(args.output_len)
            one = min(gen(1)[0] for _ in range(2))
            runs = [gen(args.output_len) for _ in range(2)]
            full = min(t for t, _ in runs)
            step = (full - one) / (args.output_len - 1)
            row[name] = {
                "first_run_s": round(first_s, 2),
                "compiled_in_first_run": compiled,
                "compiled_after": sum(c for _, c in runs),
                "decode_ms_per_step": round(1e3 * step, 3),
                "decode_tok_s": round(batch / step, 1),
                "output_tok_s": round(batch * args.output_len / full, 1),
            }
            print(f"batch {batch} {name}: " + json.dumps(row[name]), flush=True)
        # The traced decode steps.
        engine = llm.engine
        step_fn = engine.step
        traced: list = []

        def annotated_step(step_fn=step_fn, traced=traced):
            # Only decode steps: the first call prefills the prompts.
            if not traced:
                traced.append(0)
                return step_fn()
            with jax.profiler.TraceAnnotation(_STEP):
                return step_fn()

        # The prompts' blocks are in the prefix cache from the timed runs: their prefill is one
        # short step (the first, not traced), so the traced steps are decode steps.
        engine.step = annotated_step
        trace_dir = Path(args.trace_dir or tempfile.mkdtemp()) / f"batch-{batch}"
        try:
            with jax.profiler.trace(str(trace_dir)):
                llm.generate(
                    prompts,
                    dataclasses.replace(greedy, max_tokens=args.steps + 2),
                    use_tqdm=False,
                )
        finally:
            del engine.step
        r = reduce_trace(_load(trace_dir), top=args.top)
        row.update(r)
        print(render(r, f"batch {batch}, context {args.context}"), flush=True)
        results[str(batch)] = row
        if on_batch is not None:
            on_batch(results)  # what was measured survives a stage's time limit
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--load-format", default="auto", help="dummy: random weights (a config)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=16, help="decode steps traced")
    p.add_argument("--output-len", type=int, default=128, help="tokens of the timed runs")
    p.add_argument(
        "--sampled",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[1],
        help="batch sizes also timed with temperature 0.7, top-p 0.9",
    )
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--trace-dir", help="keep the traces here")
    p.add_argument("--reduce", type=Path, help="only reduce this trace directory")
    p.add_argument("--json")
    args, extra = p.parse_known_args()
    engine_args = {}
    for flag in extra:
        key, _, value = flag.lstrip("-").partition("=")
        if value.lower() in ("true", "false"):
            engine_args[key.replace("-", "_")] = value.lower() == "true"
        else:
            engine_args[key.replace("-", "_")] = int(value) if value.isdigit() else value

    def save(results: dict) -> None:
        if not args.json:
            return
        import jax

        from jaxllm.bench import cpu_name, write_json

        device = jax.devices()[0]
        write_json(
            args.json,
            {
                "device": device.device_kind if device.platform != "cpu" else cpu_name(),
                "command": "benchmarks/trace_step.py "
                + " ".join(f"{k}={v}" for k, v in vars(args).items()),
                "engine_args": engine_args,
                "results": results,
            },
        )

    if args.reduce:
        r = reduce_trace(_load(args.reduce), top=args.top)
        print(render(r, str(args.reduce)))
        save({"trace": r})
    else:
        run(args, engine_args, on_batch=save)


if __name__ == "__main__":
    main()
