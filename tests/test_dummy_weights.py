"""`load_format="dummy"` (`--load-format dummy`): random weights in the model's shapes, from a
config.json alone, for measuring speed and memory without a checkpoint."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from flax import nnx

from jaxllm.config import LoadConfig
from jaxllm.loaders import load_model
from jaxllm.loaders.dummy import LOAD_FORMATS


@pytest.fixture(scope="module")
def config_only_dir(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("config-only")
    shutil.copy(tiny_model_dir / "config.json", path / "config.json")
    return path


def test_load_format_choices_agree():
    (field,) = [f for f in LoadConfig.__dataclass_fields__.values() if f.name == "load_format"]
    assert field.metadata["choices"] == LOAD_FORMATS


def test_dummy_weights_fill_every_parameter_in_its_shape(tiny_model_dir, config_only_dir):
    real = load_model(tiny_model_dir, load_tokenizer=False)
    dummy = load_model(config_only_dir, load_format="dummy")
    assert dummy.tokenizer is None  # the directory has none
    real_leaves = dict(nnx.to_flat_state(nnx.state(real.model)))
    dummy_leaves = dict(nnx.to_flat_state(nnx.state(dummy.model)))
    assert real_leaves.keys() == dummy_leaves.keys()
    for path, var in dummy_leaves.items():
        value = np.asarray(var.get_value())
        assert value.shape == real_leaves[path].get_value().shape, path
        assert value.dtype == real_leaves[path].get_value().dtype, path
        assert np.all(np.isfinite(value)), path
        if any("norm" in str(p) for p in path):
            assert np.all(value == 1), path
        else:
            assert 0.01 < value.std() < 0.03, path


def test_engine_generates_from_a_config_alone(config_only_dir):
    from jaxllm import LLM, SamplingParams

    llm = LLM(config_only_dir, load_format="dummy", max_model_len=64, num_pages=16, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": [3, 4, 5]}, params, use_tqdm=False)
    vocab = json.loads((config_only_dir / "config.json").read_text())["vocab_size"]
    assert len(out.outputs[0].token_ids) == 5
    assert all(0 <= t < vocab for t in out.outputs[0].token_ids)
    with pytest.raises(ValueError, match="prompt"):  # no tokenizer: text cannot be taken
        llm.generate("hello", params, use_tqdm=False)


def test_dummy_refuses_a_quantization_it_cannot_make(config_only_dir):
    with pytest.raises(ValueError, match="load_format dummy"):
        load_model(config_only_dir, load_format="dummy", quantization="int8")
    with pytest.raises(ValueError, match="load_format must be one of"):
        load_model(config_only_dir, load_format="pt")
