"""Tensor parallelism on 8 fake CPU devices: the same greedy tokens for every size, no
compilation after warmup, and each device holding its share of the weights and the KV cache.

Each case runs `scripts/tensor_parallel_check.py` in a subprocess: the fake device count must
be set before JAX starts, and the rest of the suite runs on one device.
"""

from __future__ import annotations

import pytest

from conftest import write_tiny_checkpoint
from helpers import tensor_parallel_report


def test_tiny_model_8_q_heads_2_kv_heads(tmp_path, tokenizer_dir):
    """TP 1, 2, 4, 8 on 8 query heads and 2 kv heads: at 4 and 8 each kv head is repeated so
    every device holds whole heads. The vocabulary is padded to 512 so it splits evenly."""
    model = write_tiny_checkpoint(
        tmp_path / "tp8x2", tokenizer_dir, num_heads=8, num_kv_heads=2, vocab_size=512
    )
    rows = tensor_parallel_report(model, "1,2,4,8", tmp_path)
    assert [r["same_tokens_as_first"] for r in rows] == [True] * 4
    assert [r["compiled_after_warmup"] for r in rows] == [0] * 4  # sleep and wake included
    assert [r["same_tokens_after_sleep"] for r in rows] == [[True, True]] * 4
    assert [r["kv_head_replicas"] for r in rows] == [1, 1, 2, 4]
    whole_params, whole_kv = rows[0]["param_bytes"], rows[0]["kv_bytes"]
    kv_proj = 2 * 2 * 64 * 2 * 16 * 4  # k and v projections: layers x D x K x H x f32
    norms = (2 * 2 + 1) * 64 * 4  # replicated on every device
    for r in rows:
        tp, copies = r["tp"], r["kv_head_replicas"]
        # 1/TP of everything, counting the repeated kv projections once per copy.
        expected = (whole_params - norms + (copies - 1) * kv_proj) / tp + norms
        assert r["param_bytes_per_device"] == pytest.approx(expected, rel=1e-6), r
        # KV: 1/TP of the unreplicated cache while TP <= K, else one kv head per device.
        assert r["kv_bytes_per_device"] == whole_kv // min(tp, 2), r


@pytest.mark.slow  # 2.5 minutes: the TPU kernel in interpret mode under TP
def test_pallas_kernel_under_shard_map(tmp_path, tiny_model_dir):
    """The TPU kernel (interpreted) per device on its own heads: TP 4 (kv heads repeated, the
    case that covers TP 2's split too) gives TP 1's tokens. (TP 2 as well took 35 s more of
    the default suite's budget.)"""
    rows = tensor_parallel_report(tiny_model_dir, "1,4", tmp_path, "--attention-backend", "pallas")
    assert [r["same_tokens_as_first"] for r in rows] == [True] * 2
    assert [r["compiled_after_warmup"] for r in rows] == [0] * 2


@pytest.mark.demo_model
@pytest.mark.slow  # 2 minutes: the demo model twice
def test_demo_model_tp3_matches_tp1(tmp_path):
    """SmolLM2: 9 query heads and 3 kv heads split evenly over 3 devices."""
    rows = tensor_parallel_report("smollm2-135m", "1,3", tmp_path)
    assert [r["same_tokens_as_first"] for r in rows] == [True, True]
    assert [r["compiled_after_warmup"] for r in rows] == [0, 0]
    assert rows[1]["param_bytes_per_device"] <= rows[0]["param_bytes"] / 3 * 1.01
    assert rows[1]["kv_bytes_per_device"] == rows[0]["kv_bytes"] // 3


def test_uneven_splits_are_clear_errors(tmp_path, tokenizer_dir):
    from jaxllm.config import ModelConfig
    from jaxllm.sharding import make_mesh, shard_config

    def config(n, k):
        return ModelConfig("LlamaForCausalLM", 64, 64, 128, 2, n, k, 16, 128)

    with pytest.raises(ValueError, match="does not divide the model's 9 query heads"):
        shard_config(config(9, 3), 2)  # the demo model at TP 2: refused, not padded
    with pytest.raises(ValueError, match="kv heads do not divide"):
        shard_config(config(12, 3), 4)
    assert shard_config(config(8, 2), 8).num_kv_heads == 8
    with pytest.raises(ValueError, match="needs 64 devices"):
        make_mesh(64)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        make_mesh(0)
