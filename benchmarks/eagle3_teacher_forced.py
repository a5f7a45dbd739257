"""A trained EAGLE-3 head's teacher-forced accuracy (the training forward, `ttt_loss`) on
held-out answers, and on the answers it was trained on, beside the acceptance the engine
measured when serving it (its `train_report.json`): tells over-fitting (the training answers'
accuracy far above the held-out one) from a difference between training and serving (the
served per-position rates, conditioned on the position before, far from the held-out
accuracy). Minutes on the CPU where serving evaluation takes longer.

    .venv/bin/python benchmarks/eagle3_teacher_forced.py --head DIR --prompts held.jsonl

DIR is `jaxllm train-draft`'s output (its `answers.npz` gives the training answers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm import LLM
from jaxllm.loaders.eagle3 import load_eagle3_head
from jaxllm.training.eagle3 import (
    TargetStates,
    _load_data,
    _pack,
    answer,
    float_embeddings,
    read_prompts,
    train_aux_layers,
    ttt_loss,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", required=True, help="jaxllm train-draft's --out")
    p.add_argument("--prompts", required=True, help="held-out prompts (train-draft's format)")
    p.add_argument("--model", default="smollm2-135m", help="the head's target")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--train-samples", type=int, default=32, help="training answers to score")
    args = p.parse_args()

    head_dir = Path(args.head)
    llm = LLM(args.model, max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=1024)
    target = llm.runner.config
    target_model = nnx.merge(llm.runner.graphdef, llm.runner.state)
    aux_layers = train_aux_layers(target.num_layers)
    samples = answer(llm, read_prompts(args.prompts), args.max_tokens, False)
    states = TargetStates(llm.runner, aux_layers, budget=2048)(samples)
    head, _ = load_eagle3_head(head_dir, target)
    k = 3
    embed = float_embeddings(target_model)
    d2t = np.asarray(head.d2t.get_value())
    t2d = np.full(target.vocab_size, -1, np.int32)
    t2d[np.arange(len(d2t)) + d2t] = np.arange(len(d2t))

    def accuracy(samples, states, n: int) -> list[float]:
        """Each drafting step's accuracy, the mean over batches of 4 answers."""
        out = []
        for i in range(0, n, 4):
            idx = list(range(i, min(i + 4, n)))
            width = -(-max(len(samples[j].tokens) for j in idx) // 64) * 64
            packed = _pack(samples, states, idx, width, 4, states[0].shape[-1])
            tokens, aux, lengths, prompt_lens = (jnp.asarray(a) for a in packed)
            _, a = ttt_loss(head, embed, jnp.asarray(t2d), aux, tokens, lengths, prompt_lens, k)
            out.append(np.asarray(a))
        return [round(float(x), 4) for x in np.mean(out, 0)]

    report = {"held_out_teacher_forced": accuracy(samples, states, len(samples))}
    if (head_dir / "answers.npz").is_file():
        train, train_states = _load_data(head_dir / "answers.npz")
        train_states = [s.astype(np.float32) for s in train_states]
        n = min(args.train_samples, len(train))
        report["train_teacher_forced"] = accuracy(train, train_states, n)
    if (head_dir / "train_report.json").is_file():
        served = json.loads((head_dir / "train_report.json").read_text()).get("held_out", {})
        rates = served.get("acceptance_per_position")
        if rates:  # each position's rate given the one before was accepted
            report["served_held_out"] = rates
            report["served_conditional"] = [
                round(r / (rates[i - 1] if i else 1.0), 4) for i, r in enumerate(rates)
            ]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
