"""Cold and warm startup of `LLM(model)` with default settings, printed as JSON.

    .venv/bin/python benchmarks/startup.py [--model smollm2-135m]

Each start runs in a fresh process against the same new, empty persistent compilation cache:
the first compiles every bucket program (cold), the second loads them from the cache (warm).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
t = time.perf_counter()
from jaxllm import LLM
llm = LLM(sys.argv[1], compilation_cache_dir=sys.argv[2])
print(json.dumps({"startup_s": round(time.perf_counter() - t, 2),
                  "warmup_s": round(llm.warmup_seconds, 2),
                  "programs": llm.runner.num_programs,
                  "max_model_len": llm.max_model_len,
                  "num_pages": llm.kv_cache_manager.num_pages}))
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        for kind in ("cold", "warm"):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, args.model, cache],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            results[kind] = json.loads(out.strip().splitlines()[-1])
    results["warm_over_cold"] = round(
        results["warm"]["startup_s"] / results["cold"]["startup_s"], 3
    )
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
