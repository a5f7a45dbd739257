"""Host time per engine step and decode throughput where the host is the bottleneck: a tiny
random model (2 layers, width 64, a real vocabulary) decoding many requests at once, as a small
or medium model is on an accelerator.

    .venv/bin/python benchmarks/host_step.py [--requests 1 64 256] [--output-len 64] \
        [--vocab 49152] [--against ../old-checkout] [--json PATH]

The vocabulary is a real model's (49,152 as SmolLM2's by default; 151,936 as Qwen's): the
output head and the sampler over [requests, vocab] are then what a step's device time is
mostly made of, as in a real model's decode at high batch; a vocabulary of a few hundred
would measure the host alone.

For each request count, `--requests` prompts of 16 random tokens decode `--output-len` tokens
each (greedy, ignore_eos) through `LLM.generate`, after a warm-up run of the same batch.
Reported per request count:

    host_ms     schedule + prepare + update per step (the scheduler, the runner's host-side
                batch building, and the scheduler's update from the step's output), median
    step_ms     the whole step, median
    tok_per_s   output tokens per second of the timed `generate`
    steps_per_s engine steps per second
    idle_ms     the device's idle time between two steps, median per step (see below)
    idle_share  the device's idle time over the run: the gaps' sum over the time from the
                first step's launch to the last step's output

The idle figures come from a second run of the same batch, since the watcher thread that
measures them (below) competes for the GIL and would slow the run that gives the others.

This checkout runs with async scheduling on and off. `--against DIR` runs the same
measurement on the jaxllm checked out in DIR (e.g. the commit before a change, `git worktree
add ../old <commit>`), taking turns with this one in fresh processes, and prints the ratios:
every side from one run, on the same machine. With async scheduling, `host_ms` overlaps the
device's work; `step_ms` is the time between two steps' returns. The table goes to stdout as
it fills; the full results as JSON to `--json`, or to stdout after the table.

Device idle time. Each step that `runner.launch` dispatches gets t_launch, the time launch
returned (the step's programs are enqueued), and t_done, the time its sampled tokens were
ready, seen by a watcher thread that waits on the launched steps in order. The device runs
steps in order, so step k+1 starts at max(t_launch[k+1], t_done[k]) and the device idles
max(0, t_launch[k+1] - t_done[k]) before it: the host work between two steps that async
scheduling failed to hide. Limits:
- The device may start a step's first program (the forward pass) before launch returns, while
  the host still dispatches the sampler: the gaps are upper bounds by up to that dispatch time
  (0.2-0.9 ms per step measured on a 2-core CPU, 64 requests).
- t_done is read when the watcher thread gets the GIL back; the measuring process lowers the
  interpreter's switch interval from 5 ms to 0.1 ms (on every side, for like conditions) so
  that it gets it promptly.
- On the CPU the "device" is XLA's CPU thread pool, on the same cores as the host thread: the
  two slow each other down, and a busy device delays launch's return. On an accelerator the
  gaps are the accelerator's idle time.
- Only steps that go through `runner.launch` are timed: an older checkout (`--against`) whose
  runner has only `execute` reports None.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()


def write_tiny_model(path: Path, vocab_size: int) -> Path:
    """The random model measured: Llama, 2 layers, width 64 (MLP 128), 4 query heads and 2
    kv heads of 16, a vocabulary of `vocab_size` (a real model's: the output head and the
    sampler over [requests, vocab] are most of a step's device work at this width), with
    `jaxllm.testing`'s tiny tokenizer (ids past its 445 decode to nothing)."""
    from jaxllm.testing import write_tiny_checkpoint, write_tiny_tokenizer

    tokenizer = write_tiny_tokenizer(path.parent / f"{path.name}-tokenizer")
    return write_tiny_checkpoint(
        path,
        tokenizer,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=vocab_size,
    )


def _wrap(times: dict[str, list[float]], obj, name: str) -> None:
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        times[name].append(time.perf_counter() - start)
        return out

    setattr(obj, name, timed)


class DeviceTimeline:
    """When each step launched through `runner.launch` was enqueued (`t_launch`: launch
    returned) and when its sampled tokens were ready (`t_done`, seen by one watcher thread that
    waits on the launched steps in order)."""

    def __init__(self, runner):
        self.t_launch: list[float] = []
        self.t_done: list[float] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()
        launch = runner.launch  # `execute` (sync steps) calls it too

        def timed_launch(*args, **kwargs):
            step = launch(*args, **kwargs)
            result, _kept = step.result  # (the sampler's output, the rows the step keeps)
            self._queue.put((time.perf_counter(), result.sampled))
            return step

        runner.launch = timed_launch

    def _watch(self) -> None:
        while (item := self._queue.get()) is not None:
            t_launch, sampled = item
            try:
                sampled.block_until_ready()
                t_done = time.perf_counter()
            except Exception:  # a failed step: no time for it
                t_done = float("nan")
            self.t_launch.append(t_launch)
            self.t_done.append(t_done)

    def close(self) -> dict:
        """Waits for the steps launched so far; idle_ms: the median gap per step between one
        step's output being ready and the next step's launch, where that launch came later;
        idle_share: the gaps' sum over the time from the first launch to the last output."""
        self._queue.put(None)
        self._watcher.join()
        launch, done = np.array(self.t_launch), np.array(self.t_done)
        if len(launch) < 2 or np.isnan(done).any():
            return {"idle_ms": None, "idle_share": None}
        gaps = np.maximum(0.0, launch[1:] - done[:-1])
        return {
            "idle_ms": 1e3 * float(np.median(gaps)),
            "idle_share": float(gaps.sum() / (done[-1] - launch[0])),
        }


def measure(model: str, num_requests: int, output_len: int, async_scheduling: str) -> dict:
    """One request count, in this process, with whatever `jaxllm` imports."""
    from jaxllm import LLM, SamplingParams

    extra = {} if async_scheduling == "default" else {"async_scheduling": async_scheduling == "on"}
    llm = LLM(
        model,
        max_model_len=16 + output_len + 16,
        max_num_seqs=num_requests,
        max_num_batched_tokens=max(512, num_requests),
        compilation_cache_dir=None,
        **extra,
    )
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 500, 16).tolist()} for _ in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm

    times: dict[str, list[float]] = defaultdict(list)
    runner, scheduler, engine = llm.runner, llm.engine.scheduler, llm.engine
    for obj, name in (
        (scheduler, "schedule"),
        (scheduler, "update_from_output"),
        (runner, "prepare"),
        (runner, "update_batch"),  # the persistent batch's diffs (absent in older code)
        (engine, "step"),
    ):
        if hasattr(obj, name):
            _wrap(times, obj, name)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = len(times["step"])
    host = [
        sum(times[name][i] for name in times if name != "step" and i < len(times[name]))
        for i in range(steps)
    ]
    step_ms = 1e3 * float(np.median(times["step"]))
    # The idle time comes from a second run: its watcher thread competes for the GIL (more
    # so with the short switch interval below) and would slow the run it measures.
    idle = {"idle_ms": None, "idle_share": None}
    if hasattr(runner, "launch"):
        # the watcher reads a step's t_done once it holds the GIL: let it take the GIL from
        # the thread running the engine within 0.1 ms instead of the default 5 ms
        sys.setswitchinterval(1e-4)
        timeline = DeviceTimeline(runner)
        llm.generate(prompts, params, use_tqdm=False)
        idle = timeline.close()
    return {
        "requests": num_requests,
        "host_ms": 1e3 * float(np.median(host)),
        "step_ms": step_ms,
        "tok_per_s": tokens / elapsed,
        "steps_per_s": steps / elapsed,
        "steps": steps,
        **idle,
        "jaxllm": str(Path(__import__("jaxllm").__file__).parent.parent),
    }


def _run_child(checkout: Path, model: str, n: int, output_len: int, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run(
        [sys.executable, str(HERE), "--child", model, str(n), str(output_len), mode],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"{checkout}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


_HEADER = (
    f"{'requests':>8}  {'side':<7} {'host_ms':>7} {'step_ms':>7} {'idle_ms':>7} "
    f"{'idle_share':>10} {'tok/s':>9} {'steps':>5}"
)


def _table_row(side: str, r: dict) -> str:
    idle_ms = "-" if r["idle_ms"] is None else f"{r['idle_ms']:.3f}"
    idle_share = "-" if r["idle_share"] is None else f"{r['idle_share']:.1%}"
    return (
        f"{r['requests']:>8}  {side:<7} {r['host_ms']:>7.3f} {r['step_ms']:>7.3f} {idle_ms:>7} "
        f"{idle_share:>10} {r['tok_per_s']:>9,.0f} {r['steps']:>5}"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model, n, output_len, mode = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        print(json.dumps(measure(model, n, output_len, mode)))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--vocab",
        type=int,
        default=49152,
        help="the model's vocabulary (SmolLM2 49152, Qwen 151936)",
    )
    p.add_argument("--against", type=Path, help="another jaxllm checkout to compare with")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    # (checkout, async scheduling): this code with it on and off, the other as it comes
    sides = {"async": (HERE.parent.parent, "on"), "sync": (HERE.parent.parent, "off")}
    if args.against:
        sides["against"] = (args.against.resolve(), "default")
    results: dict = {
        "output_len": args.output_len,
        "vocab_size": args.vocab,
        "sides": {k: [str(c), mode] for k, (c, mode) in sides.items()},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_model(Path(tmp) / "tiny-llama", args.vocab))
        print(_HEADER, flush=True)
        for n in args.requests:
            row = {}
            for side, (checkout, mode) in sides.items():  # in turns, each in a fresh process
                row[side] = _run_child(checkout, model, n, args.output_len, mode)
                print(_table_row(side, row[side]), flush=True)
            row["async_over_sync_tok_per_s"] = row["async"]["tok_per_s"] / row["sync"]["tok_per_s"]
            if "against" in row:
                for side in ("async", "sync"):
                    row[f"{side}_over_against_tok_per_s"] = (
                        row[side]["tok_per_s"] / row["against"]["tok_per_s"]
                    )
                    row[f"{side}_over_against_host_ms"] = (
                        row[side]["host_ms"] / row["against"]["host_ms"]
                    )
            ratios = [f"async/sync tok/s {row['async_over_sync_tok_per_s']:.2f}x"]
            ratios += [
                f"{side}/against tok/s {row[f'{side}_over_against_tok_per_s']:.2f}x, "
                f"host_ms {row[f'{side}_over_against_host_ms']:.2f}x"
                for side in ("async", "sync")
                if "against" in row
            ]
            print(f"{'':>8}  " + "; ".join(ratios), flush=True)
            results[str(n)] = row
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    else:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
