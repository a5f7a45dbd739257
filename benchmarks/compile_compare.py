"""What `jaxllm compile` says of the runs of benchmarks/compile_targets.py, in this checkout and
another (the commit before a change, `git worktree add ../old <commit>`), compared field by
field: a restructuring must leave every plan and report as it was.

    .venv-compile/bin/python benchmarks/compile_compare.py --against ../old            # plans
    .venv-compile/bin/python benchmarks/compile_compare.py --against ../old \\
        --programs decode --only smollm2-v5e-1 8b-h100                                   # reports

`--programs none` (the default) builds each engine as `jaxllm compile` does but compiles no
program (warmup skipped): the pool's pages, max_model_len, page and weight bytes, budget,
shapes and program count, or the refusal. `--programs decode` compiles the decode programs and
compares whole reports (`jaxllm.aot.report.summary`, times left out). Each side runs in a
process of its own, with its checkout first on the path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_VOLATILE = ("seconds", "wall", "time")


def _clean(d):
    if isinstance(d, dict):
        return {k: _clean(v) for k, v in d.items() if not any(w in k for w in _VOLATILE)}
    if isinstance(d, list):
        return [_clean(x) for x in d]
    return d


def side(programs: str, names: list[str], out: Path) -> None:
    """Runs in the checkout on the path: each run's summary into `out` (JSON)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import compile_targets

    from jaxllm.aot import engine, report, targets
    from jaxllm.config import EngineConfig

    if programs == "none":
        from jaxllm.worker import ModelRunner

        ModelRunner.warmup = lambda self, **kw: 0.0
    results = {}
    for name in names:
        model, target, flags = compile_targets.RUNS[name]
        config = EngineConfig.create(compile_targets.CONFIGS / model, **flags)
        try:
            compiled = engine.compile_engine(
                config, targets.parse_target(target), progress=False, decode_only=True
            )
        except engine.DoesNotFit as e:
            results[name] = {"refused": str(e)}
            continue
        runner = compiled.runner
        if programs == "none":
            results[name] = {
                "num_pages": runner.num_pages,
                "max_model_len": compiled.config.scheduler.max_model_len,
                "page_bytes": compiled.page_bytes,
                "budget_bytes": compiled.budget_bytes,
                "kv_dtype": str(compiled.kv_dtype),
                "tensor_parallel_size": compiled.config.parallel.tensor_parallel_size,
                "weight_device_bytes": compiled.weight_device_bytes,
                "kv_cache_device_bytes": compiled.kv_cache_device_bytes,
                "num_programs": runner.num_programs,
                "shapes": [list(s) for s in runner.shapes],
                "kv_groups": str(runner.kv_groups),
            }
        else:
            results[name] = _clean(report.summary(compiled, context=1024))
        print(f"{name}: done", file=sys.stderr, flush=True)
    out.write_text(json.dumps(results, indent=1, sort_keys=True, default=str))


def _differences(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _differences(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        return out
    return [] if a == b else [f"{path}: {a!r} -> {b!r}"]


def main() -> None:
    import compile_targets

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", required=True, help="the other checkout (the commit before)")
    p.add_argument("--programs", choices=("none", "decode"), default="none")
    p.add_argument("--only", nargs="+", default=list(compile_targets.RUNS))
    p.add_argument("--side", help=argparse.SUPPRESS)  # internal: this process is one side
    args = p.parse_args()
    if args.side:
        side(args.programs, args.only, Path(args.side))
        return
    with tempfile.TemporaryDirectory() as tmp:
        found = {}
        for label, checkout in (("before", Path(args.against).resolve()), ("this", ROOT)):
            out = Path(tmp) / f"{label}.json"
            env = {**os.environ, "PYTHONPATH": str(checkout)}
            cmd = [sys.executable, __file__, "--against", args.against, "--programs"]
            cmd += [args.programs, "--only", *args.only, "--side", str(out)]
            subprocess.run(cmd, env=env, check=True)
            found[label] = json.loads(out.read_text())
    same = 0
    for name in args.only:
        diffs = _differences(found["before"].get(name), found["this"].get(name))
        same += not diffs
        print(f"{name}: {'same' if not diffs else 'DIFFERS'}")
        for d in diffs:
            print(f"  {d}")
    print(f"{same} of {len(args.only)} runs the same")
    sys.exit(0 if same == len(args.only) else 1)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    main()
