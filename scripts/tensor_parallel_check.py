"""Greedy outputs, compilations after warmup and per-device memory for several tensor-parallel
sizes of one model, on real devices or on fake CPU devices.

    .venv/bin/python scripts/tensor_parallel_check.py smollm2-135m --tp 1,3 --cpu-devices 8
    .venv/bin/python scripts/tensor_parallel_check.py ./ckpt --tp 1,2,4,8 --json out.json

For each size it builds the engine (warmup included), generates greedily for a fixed batch of
prompts, and reports: the tokens (and whether they equal those of the first size), how many
programs compiled after warmup (must be 0), and the bytes of parameters, of the
mixture-of-experts weights (if any) and of the KV cache on the busiest device next to the whole,
from the arrays' own shardings. `--cpu-devices N` fakes N CPU
devices (it must be set before JAX starts, so this script sets it itself).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes")
    parser.add_argument("--cpu-devices", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument(
        "--kv-offloading-size",
        type=float,
        default=0.0,
        help="GiB of host KV tier: a small pool, then the prompts again after others evicted them",
    )
    parser.add_argument(
        "--lora", default=None, help="a PEFT adapter directory: every other prompt runs with it"
    )
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.cpu_devices}"
        )
        os.environ["JAX_PLATFORMS"] = "cpu"

    from flax import nnx

    from jaxllm import LLM, LoRARequest, SamplingParams
    from jaxllm.sharding import per_device_bytes

    prompts = [{"prompt_token_ids": [5 + i, 17, 40 + 2 * i, 9] * (i + 3)} for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    # One request with a penalty and a logit bias: the sampler's other inputs under the mesh.
    penalized = SamplingParams(
        temperature=0,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        repetition_penalty=1.3,
        logit_bias={7: 2.0},
    )
    params = [greedy] * (len(prompts) - 1) + [penalized]
    from jaxllm.config import CacheConfig
    from jaxllm.loaders import load_config
    from jaxllm.model_files import resolve_model
    from jaxllm.worker.kv_groups import engine_kv_groups

    config = load_config(resolve_model(args.model))
    layers_per_slot = (
        config.num_layers // engine_kv_groups(config, CacheConfig(), draft=False).num_slots
    )
    rows = []
    for tp in (int(x) for x in args.tp.split(",")):
        start = time.perf_counter()
        llm = LLM(
            args.model,
            dtype=args.dtype,
            max_model_len=256,
            # With the host tier, a pool the prompts fill: the others below evict them. Pages
            # of every layer's bytes (a hybrid model's hold one layer group: kv_groups).
            num_pages=(24 if args.kv_offloading_size else 64) * layers_per_slot,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            tensor_parallel_size=tp,
            attention_backend=args.attention_backend,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_offloading_size=args.kv_offloading_size,
            enable_lora=args.lora is not None,
            max_lora_rank=64,
        )
        before = llm.runner.num_compilations
        lora = None if args.lora is None else LoRARequest("adapter", 1, args.lora)
        loras = [lora if i % 2 == 0 else None for i in range(len(prompts))]
        outs = [
            o.outputs[0].token_ids
            for o in llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        ]
        # Sleep mode puts every shard back where it was: the same tokens, nothing compiled.
        woke = []
        for level in (1, 2):
            llm.sleep(level)
            llm.wake_up()
            again = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            woke.append([o.outputs[0].token_ids for o in again] == outs)
        from_host = None
        if args.kv_offloading_size:  # evicted by others, then back from host memory
            others = [{"prompt_token_ids": [300 + i] * 40} for i in range(6)]
            llm.generate(others, greedy, use_tqdm=False)
            again = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            from_host = {
                "same_tokens": [o.outputs[0].token_ids for o in again] == outs,
                "hit_tokens": llm.engine.stats().prefix_cache_hits_host,
            }
        p_dev, p_all = per_device_bytes(llm.runner.state)
        k_dev, k_all = per_device_bytes(llm.runner.kv_cache)
        experts = [
            v.get_value()
            for path, v in nnx.to_flat_state(llm.runner.state)
            if path[-2:-1] == ("mlp",) and len(v.shape) == 3  # the stacked [E, ...] weights
        ]
        e_dev, e_all = per_device_bytes(experts)
        rows.append(
            {
                "tp": tp,
                "tokens": outs,
                "compiled_after_warmup": llm.runner.num_compilations - before,
                "same_tokens_after_sleep": woke,
                "host_tier": from_host,
                "param_bytes_per_device": p_dev,
                "param_bytes": p_all,
                "expert_bytes_per_device": e_dev,
                "expert_bytes": e_all,
                "kv_bytes_per_device": k_dev,
                "kv_bytes": k_all,
                "kv_head_replicas": llm.model_config.kv_head_replicas,
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
        del llm
    for row in rows:
        row["same_tokens_as_first"] = row["tokens"] == rows[0]["tokens"]
    print(f"{'tp':>3} {'same':>5} {'compiled':>8} {'params/dev':>12} {'share':>6} "
          f"{'experts/dev':>12} {'share':>6} {'kv/dev':>10} {'share':>6} {'kv x':>4}")  # fmt: skip
    for r in rows:
        expert_share = r["expert_bytes_per_device"] / max(rows[0]["expert_bytes"], 1)
        print(
            f"{r['tp']:>3} {str(r['same_tokens_as_first']):>5} {r['compiled_after_warmup']:>8} "
            f"{r['param_bytes_per_device']:>12} {r['param_bytes_per_device'] / rows[0]['param_bytes']:>6.3f} "
            f"{r['expert_bytes_per_device']:>12} {expert_share:>6.3f} "
            f"{r['kv_bytes_per_device']:>10} {r['kv_bytes_per_device'] / rows[0]['kv_bytes']:>6.3f} "
            f"{r['kv_head_replicas']:>4}"
        )  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["same_tokens_as_first"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
