"""Online serving benchmark against any OpenAI-compatible server: `jaxllm bench serve`
(`jaxllm/bench/serve.py`, which documents the metrics), kept here as a script.

    .venv/bin/python benchmarks/serve.py [--base-url http://127.0.0.1:8000] \
        [--backend openai | openai-chat] [--model ID] [--num-prompts 64] \
        [--request-rate inf] [--max-concurrency 8] [--input-len 128] [--output-len 128] \
        [--ignore-eos] [--json out.json]

Exits 1 when no request succeeded.
"""

from __future__ import annotations

import sys

from jaxllm.bench.serve import main

if __name__ == "__main__":
    sys.exit(0 if main()["completed"] > 0 else 1)
