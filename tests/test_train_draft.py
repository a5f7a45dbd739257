"""`jaxllm train-draft`: an EAGLE-3 head trained here on the target's own answers, written in
the layout vLLM loads, served by this engine with the target's output unchanged.

The tiny target's answers are its greedy continuations; the head learns them (the training
loss falls, the held-out acceptance is measured), `--resume` continues from the orbax
checkpoint, and the written tensors map onto vLLM's `Eagle3LlamaForCausalLM` parameters by its
loader's rules (transcribed below from vllm/model_executor/models/llama_eagle3.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open

from jaxllm import LLM, SamplingParams
from jaxllm.cli import main

ENGINE = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256)
TOPICS = ["the sea", "a cat", "bread", "chess", "the moon", "trains", "music", "rain",
          "a garden", "coffee", "bees", "snow", "maps", "clocks", "kites", "owls"]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    """A head trained for 3 epochs on 48 prompts' answers (8 more held out), then resumed
    for a 4th."""
    root = tmp_path_factory.mktemp("train-draft")
    prompts = root / "prompts.jsonl"
    lines = [json.dumps({"prompt": f"Tell me about {t}, please {i}."}) for i in range(4)
             for t in TOPICS]  # fmt: skip
    lines[1] = json.dumps({"messages": [{"role": "user", "content": "Hello there"}]})
    prompts.write_text("\n".join(lines) + "\nplain text prompt\n")
    out = root / "head"
    args = ["train-draft", str(tiny_model_dir), "--prompts", str(prompts), "--out", str(out),
            "--max-tokens", "40", "--draft-vocab-size", "300", "--held-out", "8",
            "--tokens-per-batch", "512", "--learning-rate", "3e-3", "--quiet",
            "--max-model-len", "256", "--max-num-seqs", "16", "--max-num-batched-tokens", "256"]  # fmt: skip
    assert main([*args, "--epochs", "3"]) == 0
    first = json.loads((out / "train_report.json").read_text())
    assert main([*args, "--epochs", "4", "--resume"]) == 0
    return out, first, json.loads((out / "train_report.json").read_text())


def test_the_head_learns_and_resumes(trained):
    out, first, resumed = trained
    losses = [e["loss"] for e in first["epochs"]]
    assert len(losses) == 3 and losses[-1] < 0.7 * losses[0], losses
    # Resumed: only the 4th epoch ran, from the checkpoint (its loss below the 3rd's).
    assert [e["epoch"] for e in resumed["epochs"]] == [3]
    assert resumed["epochs"][0]["loss"] < losses[0]
    held = resumed["held_out"]
    assert held["prompts"] == 8 and held["num_speculative_tokens"] == 3
    # The tiny target's greedy answers repeat: a head that learned them is accepted often (a
    # random head's drafts, 1 in 300 ids, are next to never).
    assert held["mean_acceptance_length"] > 1.25 and held["acceptance_per_position"][0] > 0.2
    assert held["acceptance_per_position"][0] >= held["acceptance_per_position"][-1]


def test_served_output_is_the_targets(trained, tiny_model_dir):
    out, _, _ = trained
    spec = {"method": "eagle3", "model": str(out), "num_speculative_tokens": 3}
    llm = LLM(tiny_model_dir, speculative_config=spec, **ENGINE)
    plain = LLM(tiny_model_dir, **ENGINE)
    convs = [[{"role": "user", "content": f"What about {t}?"}] for t in TOPICS[:6]]
    params = SamplingParams(temperature=0, max_tokens=40)
    want = [o.outputs[0].token_ids for o in plain.chat(convs, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.chat(convs, params, use_tqdm=False)] == want
    s = llm.engine.stats().spec_decoding
    assert s.num_accepted_tokens > 0.1 * s.num_draft_tokens  # (a random head: about none)


# vLLM's EAGLE-3 loader (Eagle3LlamaForCausalLM.load_weights, then LlamaModel.load_weights):
# t2d is skipped; d2t becomes draft_id_to_target_id; every other name but lm_head's gets
# "model."; "midlayer." becomes "layers.0."; q/k/v_proj load into qkv_proj and gate/up_proj
# into gate_up_proj (stacked on the output rows). Its parameters, by shape (n heads, k kv heads
# of h, hidden d, the layer's input 2d, intermediate f, target hidden t, draft vocabulary v):
def _vllm_parameters(c: dict) -> dict[str, tuple[int, ...]]:
    d, f, h = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    n, k = c["num_attention_heads"], c["num_key_value_heads"]
    layer = "model.layers.0."
    return {
        layer + "self_attn.qkv_proj.weight": ((n + 2 * k) * h, 2 * d),
        layer + "self_attn.o_proj.weight": (d, n * h),
        layer + "mlp.gate_up_proj.weight": (2 * f, d),
        layer + "mlp.down_proj.weight": (d, f),
        layer + "input_layernorm.weight": (d,),
        layer + "post_attention_layernorm.weight": (d,),
        layer + "hidden_norm.weight": (d,),
        "model.fc.weight": (d, 3 * c["target_hidden_size"]),
        "model.norm.weight": (d,),
        "lm_head.weight": (c["draft_vocab_size"], d),
        "draft_id_to_target_id": (c["draft_vocab_size"],),
    }


_STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj",
            ".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}  # fmt: skip


def test_written_head_is_what_vllms_loader_reads(trained, tiny_model_dir):
    out, _, _ = trained
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["eagle_config"]["use_aux_hidden_state"]
    target = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["vocab_size"] == target["vocab_size"]
    assert config["target_hidden_size"] == target["hidden_size"]
    loaded: dict[str, list[tuple[int, ...]]] = {}
    with safe_open(out / "model.safetensors", framework="numpy") as st:
        tensors = {name: st.get_tensor(name) for name in st.keys()}  # noqa: SIM118
    for name, t in tensors.items():
        if "t2d" in name:
            continue
        name = name.replace("d2t", "draft_id_to_target_id")
        if "lm_head" not in name and "draft_id" not in name:
            name = "model." + name.replace("midlayer.", "layers.0.")
        for shard, stacked in _STACKED.items():
            name = name.replace(shard, stacked)
        loaded.setdefault(name, []).append(t.shape)
    want = _vllm_parameters(config)
    assert set(loaded) == set(want)
    for name, shapes in loaded.items():  # stacked shards: rows add up, the rest equal
        rows = sum(s[0] for s in shapes)
        assert (rows, *shapes[0][1:]) == want[name], (name, shapes)
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_ and len(t2d) == config["vocab_size"]
    ids = np.arange(len(d2t)) + d2t  # vLLM: target id = draft id + d2t[draft id]
    assert (np.diff(ids) > 0).all() and t2d[ids].all() and t2d.sum() == len(ids)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--epochs", "0", "--epochs must be an integer >= 1"),
     ("--num-speculative-tokens", "17", "at most 16"),
     ("--learning-rate", "-1", "--learning-rate must be > 0"),
     ("--tokens-per-batch", "8", "--tokens-per-batch must be an integer >= 64")],
)  # fmt: skip
def test_bad_settings_are_named(tmp_path, tiny_model_dir, capsys, flag, value, message):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    args = ["train-draft", str(tiny_model_dir), "--prompts", str(prompts), "--out",
            str(tmp_path / "o"), flag, value]  # fmt: skip
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_prompt_files(tmp_path):
    from jaxllm.training.eagle3 import read_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n"b"\nc d\n{"messages": [{"role": "user", "content": "e"}]}\n')
    assert [c[-1]["content"] for c in read_prompts(f)] == ["a", "b", "c d", "e"]
    f.write_text('{"other": 1}\n')
    with pytest.raises(ValueError, match="line 1: neither messages, prompt nor text"):
        read_prompts(f)
    f.write_text("\n")
    with pytest.raises(ValueError, match="has no prompts"):
        read_prompts(f)
