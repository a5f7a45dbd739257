"""Converted orbax checkpoints (`jaxllm convert`): the round trip from a Hugging Face directory
and from a GGUF file gives identical logits, and a tensor-parallel load restores each
parameter straight into its shard (kv heads repeated where TP > kv heads)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.cli import main
from jaxllm.loaders import load_model
from jaxllm.loaders.convert import convert
from jaxllm.loaders.orbax import MARKER, is_orbax_checkpoint

from helpers import prefill_logits

PROMPT = "The quick brown fox jumps over the lazy dog. Paris is"


@pytest.fixture(scope="module")
def converted(tiny_model_dir, tmp_path_factory) -> Path:
    return convert(tiny_model_dir, tmp_path_factory.mktemp("orbax") / "tiny")


def _params(loaded) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(loaded.model))}


def _placements(loaded) -> set:
    # Committed arrays (orbax's own placement on one device) would not hit the programs the
    # runner compiles at warmup: every loader must place parameters alike.
    return {
        (str(v.get_value().sharding), v.get_value()._committed)
        for _, v in nnx.to_flat_state(nnx.state(loaded.model))
    }


def _assert_same_model(a, b, *, logits: bool = True) -> None:
    assert a.config == b.config
    assert _placements(a) == _placements(b)
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for p in pa:
        assert pa[p].dtype == pb[p].dtype, p
        np.testing.assert_array_equal(pa[p], pb[p], err_msg=str(p))
    ids = a.tokenizer.encode(PROMPT)
    assert b.tokenizer.encode(PROMPT) == ids
    assert b.tokenizer.chat_template == a.tokenizer.chat_template
    if logits:  # identical parameters give identical logits; this checks the wiring too
        np.testing.assert_array_equal(
            prefill_logits(a.model, a.config, ids), prefill_logits(b.model, b.config, ids)
        )


def test_hf_round_trip_gives_identical_logits(tiny_model_dir, converted):
    assert is_orbax_checkpoint(converted)
    marker = json.loads((converted / MARKER).read_text())
    assert marker["format"] == "jaxllm-orbax" and marker["dtype"] == "float32"
    assert marker["source"] == str(tiny_model_dir.resolve())
    assert json.loads((converted / "config.json").read_text()) == json.loads(
        (tiny_model_dir / "config.json").read_text()
    )
    _assert_same_model(load_model(tiny_model_dir), load_model(converted))


def test_gguf_round_trip_gives_identical_logits(tiny_model_dir, tmp_path):
    try:
        from test_gguf import Q, write_gguf
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"the GGUF writer of tests/test_gguf.py is not importable: {e}")
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(tiny_model_dir, gguf_path, Q.Q4_1)
    dst = convert(gguf_path, tmp_path / "from-gguf")
    config = json.loads((dst / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert not (dst / "generation_config.json").exists()
    # The checkpoint holds the GGUF's dequantized weights: the GGUF loaded the same way.
    _assert_same_model(load_model(gguf_path, quantization="float"), load_model(dst))


def test_bfloat16_checkpoint_and_dtype_cast_on_restore(tiny_model_dir, converted, tmp_path):
    dst = convert(tiny_model_dir, tmp_path / "bf16", dtype=jnp.bfloat16)
    assert json.loads((dst / MARKER).read_text())["dtype"] == "bfloat16"
    hf_bf16 = load_model(tiny_model_dir, dtype=jnp.bfloat16)
    _assert_same_model(hf_bf16, load_model(dst, dtype=jnp.bfloat16), logits=False)
    # An f32 checkpoint restored as bf16 is cast while reading: the same rounding.
    cast = load_model(converted, dtype=jnp.bfloat16, load_tokenizer=False)
    for p, v in _params(hf_bf16).items():
        np.testing.assert_array_equal(_params(cast)[p], v, err_msg=str(p))


# Runs with 8 fake CPU devices (set before JAX starts, hence a subprocess).
_TP_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from flax import nnx
    sys.path.insert(0, sys.argv[3])
    from helpers import prefill_logits
    from jaxllm.loaders import load_model
    from jaxllm.sharding import make_mesh, param_shardings

    hf, ckpt = sys.argv[1], sys.argv[2]
    base = load_model(ckpt, load_tokenizer=False)
    ids = [5, 17, 40, 9, 250, 3, 77, 128, 64, 300, 12, 8, 199, 41, 42, 7, 100, 6]
    want = prefill_logits(base.model, base.config, ids)
    report = []
    for tp in (2, 4):
        mesh = make_mesh(tp)
        got = load_model(ckpt, mesh=mesh, load_tokenizer=False)
        ref = load_model(hf, mesh=mesh, load_tokenizer=False)  # the HF path, same mesh
        expected = param_shardings(nnx.split(got.model)[1], mesh)
        ref_params = dict(nnx.to_flat_state(nnx.state(ref.model)))
        wrong, differ = [], []
        for path, var in nnx.to_flat_state(nnx.state(got.model)):
            a = var.get_value()
            if not a.sharding.is_equivalent_to(expected[path], a.ndim):
                wrong.append([".".join(map(str, path)), str(a.sharding.spec), str(expected[path].spec)])
            b = ref_params[path].get_value()
            if b.sharding.spec != a.sharding.spec or not np.array_equal(a, b):
                differ.append(".".join(map(str, path)))
        logits = prefill_logits(got.model, got.config, ids)
        report.append({
            "tp": tp,
            "kv_head_replicas": got.config.kv_head_replicas,
            "wrongly_sharded": wrong,
            "differ_from_hf_load": differ,
            "k_proj_spec": str(got.model.layers[0].self_attn.k_proj.get_value().sharding.spec),
            "k_proj_shard": list(
                got.model.layers[0].self_attn.k_proj.get_value().addressable_shards[0].data.shape
            ),
            "max_abs_diff": float(np.abs(logits - want).max()),
            "scale": float(np.abs(want).max()),
            "same_argmax": bool((logits.argmax(-1) == want.argmax(-1)).all()),
        })
    # Saving the TP 4 model (sharded arrays, kv heads repeated) stores one copy of each head.
    from jaxllm.loaders.orbax import save
    out = sys.argv[4] + "/resaved"
    save(got, json.load(open(ckpt + "/config.json")), None, {}, out)
    again = dict(nnx.to_flat_state(nnx.state(load_model(out, load_tokenizer=False).model)))
    resaved_differ = [
        ".".join(map(str, path)) for path, var in nnx.to_flat_state(nnx.state(base.model))
        if not np.array_equal(var.get_value(), again[path].get_value())
    ]
    print(json.dumps({"rows": report, "resaved_differ": resaved_differ}))
    """
)


@pytest.mark.slow  # 4-5 minutes: TP 1, 2, 4, 8 restores in a subprocess
def test_tensor_parallel_restore_on_8_fake_devices(tiny_model_dir, converted, tmp_path):
    """4 query / 2 kv heads: TP 2 splits the kv heads, TP 4 repeats each twice."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _TP_CHILD,
            str(tiny_model_dir),
            str(converted),
            str(Path(__file__).parent),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = result["rows"]
    print(result)
    assert result["resaved_differ"] == []
    assert [r["tp"] for r in rows] == [2, 4]
    assert [r["kv_head_replicas"] for r in rows] == [1, 2]
    for r in rows:
        assert r["wrongly_sharded"] == [], r
        assert r["differ_from_hf_load"] == [], r
        assert r["k_proj_spec"] == "P(None, 'model')", r
        assert r["k_proj_shard"] == [64, 16], r  # one whole kv head per device
        # Sharded matmuls may sum in another order: 1e-5 of the logits' scale (~15 here).
        assert r["max_abs_diff"] <= 1e-5 * max(1.0, r["scale"]), r
        assert r["same_argmax"], r


def test_convert_cli_end_to_end(tiny_model_dir, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir, src)
    generation_config = {"eos_token_id": [2, 0], "temperature": 0.6, "top_p": 0.9}
    (src / "generation_config.json").write_text(json.dumps(generation_config))
    dst = tmp_path / "cli-out"
    assert main(["convert", str(src), str(dst), "--dtype", "float32"]) == 0
    assert str(dst) in capsys.readouterr().out
    names = {p.name for p in dst.iterdir()}
    assert {"config.json", "generation_config.json", MARKER, "state", "tokenizer.json"} <= names
    a = load_model(src)
    b = load_model(dst)
    assert b.generation_config == generation_config
    ids = a.tokenizer.encode(PROMPT)
    np.testing.assert_array_equal(
        prefill_logits(a.model, a.config, ids), prefill_logits(b.model, b.config, ids)
    )
    # A second conversion onto it is refused, and leaves it intact.
    assert main(["convert", str(src), str(dst)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert is_orbax_checkpoint(dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli-out", "src"]  # no leftovers
